"""The vLLM fleet's pure parts: the trace slice handed to it, its per-mode figures, output
identity, daemon tier deltas, SSE parsing, and the front door's instruments. No processes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from bench.vllm_serving import fleet_requests
from kvstore.cluster.vllm_fleet import (
    MODE_SERVERS,
    Arrivals,
    FleetRequest,
    FleetSpec,
    Mode,
    ModeResult,
    RequestRecord,
    ServerPlan,
    Slo,
    assemble,
    conversations,
    drive,
    format_tables,
    goodput,
    identical_outputs,
    kv_cache_tokens,
    max_in_flight,
    parse_sse,
    percentile,
    pool_rounds,
    routing_latency,
    servers_for,
    summarize,
    tier_deltas,
    working_set_blocks,
)
from kvstore.frontdoor.instrument import TimedRouter
from kvstore.frontdoor.router import Backend, BackendPool, Rejection, RoundRobinRouter, RouteRequest
from planner.trace import default_trace_path


def rec(label: str, ids: list[int], *, backend: str = "v0", ttft: float = 0.1,
        tpot: float | None = 0.01, prompt: int = 64) -> RequestRecord:
    return RequestRecord(label, backend, prompt, None, ttft, tpot, ids)


def result(mode: Mode, records: list[RequestRecord], **kw: object) -> ModeResult:
    return ModeResult(mode.value, records=records, **kw)  # type: ignore[arg-type]


def test_the_trace_slice_is_the_benchmarks_conversations_as_token_ids() -> None:
    trace = default_trace_path()
    if trace is None:
        pytest.skip("conversation_trace.jsonl not found")
    requests = fleet_requests(Path(trace), 3, 1024)
    assert len(requests) == 8  # 3 conversations with >= 2 requests each, all their requests
    assert len({r.label for r in requests}) == len(requests)
    assert all(3 <= t < 1024 for r in requests for t in r.token_ids)
    # Follow-up turns of a conversation share their leading blocks token for token.
    by_block = {}
    for r in requests:
        by_block.setdefault(r.token_ids[32:64], []).append(r)
    assert any(len(group) >= 2 for group in by_block.values())
    assert max(len(r.token_ids) for r in requests) <= 32 * 32
    # Tagged with their conversations (the chat arrivals send each one's turns in order).
    assert [len(c) for c in conversations(requests)] == [2, 4, 2]


def test_summary_figures_are_exact() -> None:
    r = result(Mode.CONDUCTOR, [rec("a", [1, 2], ttft=0.1, backend="v0"),
                                rec("b", [3, 4], ttft=0.3, tpot=None, backend="v1"),
                                rec("c", [5, 6], ttft=0.2, tpot=0.03, backend="v1")],
               server_deltas={"local_queries": 200.0, "local_hits": 50.0,
                              "external_hits": 100.0, "kvtier_loaded_bytes": 3.0 * (1 << 20)},
               decision_s=[0.001, 0.002, 0.003], wall_s=1.5)
    s = summarize(r)
    assert s["ttft_mean_s"] == pytest.approx(0.2) and s["ttft_p50_s"] == pytest.approx(0.2)
    assert s["tpot_mean_s"] == pytest.approx(0.02)
    assert (s["engine_hit_ratio"], s["kvtier_hit_ratio"]) == (0.25, 0.5)
    assert s["decision_p50_s"] == pytest.approx(0.002)
    assert s["backends"] == {"v0": 1, "v1": 2} and s["prompt_tokens"] == 192
    assert summarize(ModeResult("pd+kvtier", status="not run: why")) == {
        "mode": "pd+kvtier", "status": "not run: why"}


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0


def test_outputs_are_compared_with_the_first_mode_that_ran() -> None:
    alone = result(Mode.VLLM_ALONE, [rec("a", [1, 2]), rec("b", [3, 4])])
    same = result(Mode.ROUND_ROBIN, [rec("b", [3, 4]), rec("a", [1, 2])])
    other = result(Mode.CONDUCTOR, [rec("a", [1, 2]), rec("b", [3, 9])])
    missing = result(Mode.PD, [rec("a", [1, 2])])
    skipped = ModeResult("x", status="not run: no")
    assert identical_outputs([skipped, alone, same, other, missing]) == {
        "x": None, Mode.VLLM_ALONE.value: 0, Mode.ROUND_ROBIN.value: 0,
        Mode.CONDUCTOR.value: 1, Mode.PD.value: 1}


def _node(node: str, **tiers: dict[str, int]) -> dict[str, object]:
    base = dict.fromkeys(("puts", "hits", "bytes_written", "bytes_read", "demotions",
                          "promotions", "evictions", "used_bytes"), 0)
    return {"node_id": node, "tiers": [{"tier": t, **base, **v} for t, v in tiers.items()]}


def test_tier_deltas_are_per_node_and_tier_increases() -> None:
    before = [_node("node-a", dram={"puts": 5, "bytes_written": 100}, nvme={"hits": 1})]
    after = [_node("node-a", dram={"puts": 7, "bytes_written": 300, "used_bytes": 9},
                   nvme={"hits": 4, "demotions": 0}),
             _node("node-b", dram={"puts": 2})]
    rows = tier_deltas(before, after)
    assert [(r["node"], r["tier"], r["puts"], r["hits"], r["bytes_written"], r["used_bytes"])
            for r in rows] == [("node-a", "dram", 2, 0, 200, 9), ("node-a", "nvme", 0, 3, 0, 0),
                               ("node-b", "dram", 2, 0, 0, 0)]


def test_sse_lines_are_parsed_and_done_is_skipped() -> None:
    lines = [b'data: {"choices": [{"token_ids": [5]}]}', b"", b": keepalive",
             b'data: {"usage": {"prompt_tokens": 3}}', b"data: [DONE]"]
    assert parse_sse(lines) == [{"choices": [{"token_ids": [5]}]},
                                {"usage": {"prompt_tokens": 3}}]


def test_the_document_and_tables_carry_every_mode() -> None:
    spec = FleetSpec(work_dir=Path("/nonexistent"), requests=(FleetRequest("a", (1, 2)),),
                     modes=(Mode.VLLM_ALONE, Mode.CONDUCTOR, Mode.PD))
    results = [result(Mode.VLLM_ALONE, [rec("a", [1, 2], ttft=0.4)]),
               result(Mode.CONDUCTOR, [rec("a", [1, 2], ttft=0.1)], decision_s=[0.0005],
                      tiers=[{"node": "node-a", "tier": "dram", "puts": 1, "hits": 0,
                              "bytes_written": 1 << 20, "bytes_read": 0, "demotions": 0,
                              "evictions": 0, "used_bytes": 1 << 20}]),
               ModeResult(Mode.PD.value, status="not run: the front door has no P/D mode yet")]
    doc = assemble(results, spec, 12.5)
    # vllm-alone is the round robin without kvtier (b); no round-robin+kvtier ran.
    assert doc["ttft_speedup_vs_round_robin"] == pytest.approx(4.0)
    assert doc["ttft_speedup_vs_round_robin_kvtier"] is None
    assert doc["ttft_speedup_vs_events_only"] is None
    assert doc["outputs_identical"] is True
    assert json.loads(json.dumps(doc))["modes"][2]["status"].startswith("not run")
    modes, tiers = format_tables(doc)
    assert modes.row_count == 3 and tiers.row_count == 1
    assert doc["config"]["cache_blocks"] == spec.cache_blocks
    assert doc["config"]["slo"] == {"ttft_s": 1.0, "tpot_s": 0.1}


def test_every_speedup_is_a_baseline_over_the_routed_mode() -> None:
    spec = FleetSpec(work_dir=Path("/nonexistent"), requests=(FleetRequest("a", (1, 2)),))
    ttft = {Mode.VLLM_SINGLE: 0.9, Mode.VLLM_ALONE: 0.6, Mode.ROUND_ROBIN: 0.45,
            Mode.CONDUCTOR: 0.3, Mode.EVENTS_ONLY: 0.75}
    doc = assemble([result(m, [rec("a", [1, 2], ttft=t)]) for m, t in ttft.items()], spec, 1.0)
    assert doc["ttft_speedup_vs_round_robin"] == pytest.approx(2.0)
    assert doc["ttft_speedup_vs_round_robin_kvtier"] == pytest.approx(1.5)
    assert doc["ttft_speedup_vs_events_only"] == pytest.approx(2.5)
    assert doc["ttft_speedup_vs_vllm_single"] == pytest.approx(3.0)


def test_only_the_servers_the_modes_need_are_started() -> None:
    assert servers_for([Mode.VLLM_SINGLE]) == [ServerPlan("alone-0", False, False)]
    assert servers_for([Mode.VLLM_SINGLE, Mode.VLLM_ALONE]) == [
        ServerPlan("alone-0", False, False), ServerPlan("alone-1", False, False)]
    # events-only: the same servers without a connector, now publishing KV events.
    assert servers_for([Mode.VLLM_ALONE, Mode.EVENTS_ONLY]) == [
        ServerPlan("alone-0", False, True), ServerPlan("alone-1", False, True)]
    assert servers_for([Mode.PD]) == [ServerPlan("v0", True, True), ServerPlan("v1", True, True)]
    assert [p.name for p in servers_for(tuple(Mode))] == ["v0", "v1", "alone-0", "alone-1"]
    assert set(MODE_SERVERS) == set(Mode)


def test_goodput_counts_requests_meeting_both_objectives_per_second() -> None:
    records = [rec("a", [1], ttft=0.5, tpot=0.05), rec("b", [1], ttft=1.0, tpot=0.1),
               rec("c", [1], ttft=1.2, tpot=0.05), rec("d", [1], ttft=0.2, tpot=0.3),
               rec("e", [1], ttft=0.3, tpot=None)]
    g = goodput(records, 2.0, Slo(ttft_s=1.0, tpot_s=0.1))
    # a, b (on the limits) and e (one token: no TPOT to miss) meet both; c misses TTFT, d TPOT.
    assert (g["slo_met"], g["slo_fraction"], g["goodput_per_s"]) == (3, 0.6, 1.5)
    assert goodput([], 1.0, Slo())["slo_fraction"] is None
    assert goodput(records, 0.0, Slo())["goodput_per_s"] is None
    with pytest.raises(ValueError):
        Slo(ttft_s=0)
    s = summarize(result(Mode.VLLM_SINGLE, records, wall_s=2.0), Slo(2.0, 1.0))
    assert (s["slo_met"], s["goodput_per_s"]) == (5, 2.5)


def test_routing_latency_percentiles() -> None:
    r = routing_latency([0.004, 0.001, 0.002, 0.003])
    assert r["count"] == 4 and r["max_s"] == 0.004
    assert r["p50_s"] == pytest.approx(0.0025) and r["p99_s"] == pytest.approx(0.00397)
    assert routing_latency([]) == {"count": 0, "p50_s": None, "p99_s": None, "max_s": None}


def test_the_working_set_counts_distinct_full_prefix_blocks() -> None:
    a, b = tuple(range(4)), tuple(range(10, 14))
    requests = [FleetRequest("1", a + b + (7,)),      # blocks a, a+b (the 7 is no full block)
                FleetRequest("2", a + b + a),          # a+b+a is new
                FleetRequest("3", b + a)]              # b and b+a: a prefix differs
    assert working_set_blocks(requests, 4) == 5
    with pytest.raises(ValueError):
        working_set_blocks(requests, 0)


def test_the_spec_refuses_what_cannot_run() -> None:
    with pytest.raises(ValueError):
        FleetSpec(work_dir=Path("/x"), requests=())
    with pytest.raises(ValueError):
        FleetSpec(work_dir=Path("/x"), requests=(FleetRequest("a", tuple(range(2000))),))
    with pytest.raises(ValueError):
        FleetSpec(work_dir=Path("/x"), requests=(FleetRequest("a", (1,)),),
                  modes=(Mode.PD, Mode.PD))
    with pytest.raises(ValueError):
        FleetRequest("empty", ())


class _Fixed:
    def __init__(self, answers: Sequence[Backend | Rejection]) -> None:
        self.answers = list(answers)

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | Rejection:
        return self.answers.pop(0)


def test_the_timed_router_passes_decisions_through_and_counts_them() -> None:
    b0, b1 = Backend("v0", "http://127.0.0.1:1"), Backend("v1", "http://127.0.0.1:2")
    no = Rejection(503, "none")
    timed = TimedRouter(_Fixed([b0, b1, no, b1]))
    req = RouteRequest("r", "/v1/completions", "m", 8, False)

    async def go() -> list[object]:
        return [await timed.route([1, 2], req) for _ in range(4)]

    assert asyncio.run(go()) == [b0, b1, no, b1]
    assert len(timed.decision_s) == 4 and all(s >= 0 for s in timed.decision_s)
    assert dict(timed.backends) == {"v0": 1, "v1": 2} and timed.rejections == 1
    timed.reset()
    assert (timed.decision_s, dict(timed.backends), timed.rejections) == ([], {}, 0)


def test_the_kv_cache_size_is_read_from_vllms_start_log() -> None:
    log = (b"INFO 12-03 08:00:01 [kv_cache_utils.py:1234] CPU KV cache size: 4,096 tokens, "
           b"Maximum concurrency for 1,280 tokens per request: 3.20x\n")
    assert kv_cache_tokens(b"noise\n" + log) == 4096
    assert kv_cache_tokens(b"INFO starting\n") is None


# -- arrivals ----------------------------------------------------------------------------------

def _chats() -> list[FleetRequest]:
    """Three conversations interleaved in trace order (x: 3 turns, y: 2, z: 1) and one request
    of no conversation."""
    turns = [("x1", "x"), ("y1", "y"), ("x2", "x"), ("z1", "z"), ("y2", "y"), ("lone", ""),
             ("x3", "x")]
    return [FleetRequest(label, (i + 3,), conv) for i, (label, conv) in enumerate(turns)]


class _Engine:
    """A stand-in for the fleet's ``send`` (the driver is pure logic): each request takes
    ``steps[label]`` event-loop turns; records what was in flight when each was sent."""

    def __init__(self, steps: dict[str, int] | None = None) -> None:
        self.steps = steps or {}
        self.in_flight: set[str] = set()
        self.sent: list[tuple[str, frozenset[str]]] = []
        self.answered: list[str] = []

    async def send(self, r: FleetRequest) -> RequestRecord:
        self.sent.append((r.label, frozenset(self.in_flight)))
        self.in_flight.add(r.label)
        for _ in range(self.steps.get(r.label, 3)):
            await asyncio.sleep(0)
        self.in_flight.discard(r.label)
        self.answered.append(r.label)
        return rec(r.label, [r.token_ids[0]])


def test_conversations_group_turns_in_trace_order() -> None:
    groups = conversations(_chats())
    assert [[r.label for r in g] for g in groups] == [["x1", "x2", "x3"], ["y1", "y2"],
                                                      ["z1"], ["lone"]]


def test_chat_arrivals_keep_conversations_in_flight_each_turn_after_its_answer() -> None:
    requests = _chats()
    engine = _Engine()
    records = asyncio.run(drive(requests, Arrivals.CHAT, 2, engine.send))
    assert [r.label for r in records] == [r.label for r in requests]  # trace order
    # Two requests were in flight at once (the closed loop never has more than one).
    assert max(len(busy) for _, busy in engine.sent) == 1
    assert engine.sent[:2] == [("x1", frozenset()), ("y1", frozenset({"x1"}))]
    # A turn is sent only after the previous turn of its conversation answered.
    order = [label for label, _ in engine.sent]
    for a, b in (("x1", "x2"), ("x2", "x3"), ("y1", "y2")):
        assert engine.answered.index(a) < order.index(b)
    # Never a second turn of one conversation in flight beside another of it.
    assert all(label[0] not in {x[0] for x in busy} for label, busy in engine.sent
               if label != "lone")


def test_chat_arrivals_start_conversations_in_trace_order_whatever_the_timings() -> None:
    """The same arrivals in every mode: whichever mode answers faster, each conversation's
    turns go in order and conversations start in trace order; only the interleaving moves."""
    starts = []
    for steps in ({}, {"x1": 50, "x2": 50, "x3": 50}, {"y1": 40, "z1": 1, "lone": 80}):
        engine = _Engine(steps)
        records = asyncio.run(drive(_chats(), Arrivals.CHAT, 2, engine.send))
        assert sorted(r.label for r in records) == sorted(r.label for r in _chats())
        order = [label for label, _ in engine.sent]
        firsts = [label for label in order if label in ("x1", "y1", "z1", "lone")]
        starts.append(firsts)
        for conv in ("x", "y"):
            mine = [label for label in order if label.startswith(conv)]
            assert mine == sorted(mine)
    assert starts == [["x1", "y1", "z1", "lone"]] * 3


def test_closed_arrivals_send_one_request_at_a_time_in_trace_order() -> None:
    engine = _Engine()
    records = asyncio.run(drive(_chats(), Arrivals.CLOSED, 4, engine.send))
    assert [label for label, _ in engine.sent] == [r.label for r in _chats()]
    assert all(not busy for _, busy in engine.sent)
    assert [r.label for r in records] == [r.label for r in _chats()]


def test_a_failed_request_stops_the_replay_with_its_own_error() -> None:
    async def send(r: FleetRequest) -> RequestRecord:
        await asyncio.sleep(0)
        if r.label == "y1":
            raise ValueError("backend answered 503")
        return rec(r.label, [1])

    with pytest.raises(ValueError, match="503"):
        asyncio.run(drive(_chats(), Arrivals.CHAT, 2, send))
    with pytest.raises(ValueError):
        asyncio.run(drive(_chats(), Arrivals.CHAT, 0, send))
    with pytest.raises(ValueError):
        FleetSpec(work_dir=Path("/x"), requests=(FleetRequest("a", (1,)),), in_flight=0)


def test_max_in_flight_counts_overlapping_requests() -> None:
    def timed(label: str, sent: float, done: float) -> RequestRecord:
        r = rec(label, [1])
        r.sent_s, r.done_s = sent, done
        return r

    assert max_in_flight([timed("a", 0, 2), timed("b", 1, 3), timed("c", 2.5, 4)]) == 2
    assert max_in_flight([timed("a", 0, 1), timed("b", 1, 2)]) == 1  # end, then start
    assert max_in_flight([]) == 0
    s = summarize(result(Mode.CONDUCTOR, [timed("a", 0, 2), timed("b", 1, 3)],
                         decision_s=[0.001, 0.002], floor_s=[1e-5, 3e-5],
                         decision_cpu_s=[4e-4, 6e-4]))
    assert s["max_in_flight"] == 2
    assert s["decision_floor_p50_s"] == pytest.approx(2e-5)
    assert s["decision_cpu_p50_s"] == pytest.approx(5e-4)
    assert format_tables({"modes": [s], "config": {}})[0].row_count == 1


def test_the_timed_router_times_its_floor_beside_each_decision() -> None:
    b0, b1 = Backend("v0", "http://127.0.0.1:1"), Backend("v1", "http://127.0.0.1:2")
    timed = TimedRouter(_Fixed([b1, b1, b1]), floor=RoundRobinRouter(BackendPool([b0, b1])))
    req = RouteRequest("r", "/v1/completions", "m", 8, False)

    async def go() -> list[object]:
        return [await timed.route([1, 2], req) for _ in range(3)]

    assert asyncio.run(go()) == [b1, b1, b1]  # the floor's picks are not answered
    assert len(timed.floor_s) == len(timed.decision_s) == len(timed.cpu_s) == 3
    assert dict(timed.backends) == {"v1": 3}
    timed.reset()
    assert timed.floor_s == [] and timed.cpu_s == []


def test_a_niced_server_runs_under_nice_and_the_spec_passes_it_on(tmp_path: Path) -> None:
    from kvstore.cluster.vllm_server import VllmServer

    plain = VllmServer(tmp_path, tmp_path, "s0").command()
    niced = VllmServer(tmp_path, tmp_path, "s1", nice=10).command()
    assert niced[:3] == ["nice", "-n", "10"] and niced[3:] == plain
    with pytest.raises(ValueError):
        VllmServer(tmp_path, tmp_path, "s2", nice=20)
    spec = FleetSpec(work_dir=tmp_path, requests=(FleetRequest("a", (1, 2)),), engine_nice=5)
    doc = assemble([result(Mode.CONDUCTOR, [rec("a", [1, 2])])], spec, 1.0)
    assert doc["config"]["engine_nice"] == 5 and doc["config"]["arrivals"] == "chat"


def test_first_turns_and_follow_ups_are_told_apart() -> None:
    requests = (FleetRequest("x1", (1, 2), "x"), FleetRequest("y1", (3, 4), "y"),
                FleetRequest("x2", (1, 2, 5), "x"), FleetRequest("lone", (6,)))
    spec = FleetSpec(work_dir=Path("/nonexistent"), requests=requests)
    ttfts = {Mode.CONDUCTOR: {"x1": 1.0, "y1": 3.0, "x2": 0.2, "lone": 2.0},
             Mode.EVENTS_ONLY: {"x1": 1.0, "y1": 1.0, "x2": 0.6, "lone": 1.0}}
    doc = assemble([result(m, [rec(label, [1], ttft=t) for label, t in by.items()])
                    for m, by in ttfts.items()], spec, 1.0)
    c = {s["mode"]: s for s in doc["modes"]}[Mode.CONDUCTOR.value]
    assert c["first_turn_ttft_mean_s"] == pytest.approx(2.0)  # x1, y1, lone
    assert c["followup_ttft_mean_s"] == pytest.approx(0.2)    # x2
    assert doc["followup_ttft_speedup_vs_events_only"] == pytest.approx(3.0)
    assert doc["followup_ttft_speedup_vs_round_robin"] is None
    assert doc["ttft_speedup_vs_events_only"] == pytest.approx(0.9 / 1.55)


def test_rounds_pool_into_one_result_per_mode() -> None:
    tier = {"node": "node-a", "tier": "dram", "puts": 2, "hits": 1, "bytes_written": 10,
            "bytes_read": 5, "demotions": 0, "promotions": 0, "evictions": 0, "used_bytes": 7}
    one = [result(Mode.VLLM_ALONE, [rec("a", [1], ttft=0.4)], decision_s=[1e-5], wall_s=2.0,
                  server_deltas={"local_hits": 3.0}, tiers=[dict(tier)]),
           result(Mode.CONDUCTOR, [rec("a", [1], ttft=0.2)], decision_s=[4e-4])]
    two = [result(Mode.VLLM_ALONE, [rec("a", [1], ttft=0.8)], decision_s=[2e-5], wall_s=1.0,
                  server_deltas={"local_hits": 1.0}, tiers=[{**tier, "used_bytes": 9}]),
           ModeResult(Mode.CONDUCTOR.value, status="failed: PeerUnavailable: 503")]
    alone, routed = pool_rounds([one, two])
    assert [r.ttft_s for r in alone.records] == [0.4, 0.8] and alone.decision_s == [1e-5, 2e-5]
    assert (alone.wall_s, alone.server_deltas) == (3.0, {"local_hits": 4.0})
    assert [(t["puts"], t["bytes_read"], t["used_bytes"]) for t in alone.tiers] == [(4, 10, 9)]
    assert routed.status.startswith("failed")  # a mode that failed in any round
    assert summarize(alone)["ttft_mean_s"] == pytest.approx(0.6)
    # The second round's times follow the first's wall time: never two rounds in flight.
    assert [(r.sent_s, r.done_s) for r in alone.records] == [(0.0, 0.0), (2.0, 2.0)]
    with pytest.raises(ValueError):
        pool_rounds([one, list(reversed(one))])
    assert pool_rounds([]) == []


def test_a_servers_kv_event_sockets_live_in_a_private_directory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's KV event publisher authenticates nobody: the launcher puts its ipc:// sockets in
    a directory only this user may enter (docs/security.md), however loose it was made."""
    from kvstore.cluster.vllm_server import VllmServer
    from kvstore.membership.vllm_registration import check_kv_events_endpoint

    events = tmp_path / "events"
    events.mkdir(mode=0o777)
    events.chmod(0o777)
    server = VllmServer(tmp_path, tmp_path, "s0", kv_events=True, events_dir=events)
    assert (events.stat().st_mode & 0o777) == 0o700
    spec = server.kv_events_spec
    assert spec is not None and spec.endpoint.startswith(f"ipc://{events.resolve()}/")
    with caplog.at_level("WARNING"):
        check_kv_events_endpoint(spec.endpoint)
    assert "other users may reach" not in caplog.text  # the registration's check is content

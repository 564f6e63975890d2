"""Colocated engines (one instance runs prefill and decode: a vLLM serving end to end): the
scheduler names one instance for both phases, and the conductor pairs a server's prefill and
decode records into one. Exact figures with the linear latency model of test_scheduler.py."""

from __future__ import annotations

import pytest

from conductor.index import GlobalPrefixIndex
from conductor.instances import InstanceKind, PlannedInstance, plan_instances
from conductor.scheduler import (
    DecodeInstance,
    Policy,
    PrefillInstance,
    RejectReason,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
)
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from kvstore.membership.engines import EngineRecord, EngineRole
from tests.control.test_scheduler import BLOCK_BYTES, BLOCK_TOKENS, MODEL, LinearLatency, keys

DRAM = TierKind.DRAM


def colocated(*, nodes: tuple[str, ...] = ("n0", "n1"), kv_capacity: int = 1_000_000,
              policy: Policy = Policy.GLOBAL_CACHE, held: dict[str, list[bytes]] | None = None,
              **config: object) -> Scheduler:
    index = GlobalPrefixIndex()
    for node in nodes:
        assert index.apply_snapshot(node, 1, 0, [(key, DRAM) for key in (held or {}).get(node, [])])
    cfg = SchedulerConfig(policy=policy, block_size_tokens=BLOCK_TOKENS,
                          block_size_bytes=BLOCK_BYTES, remote_link_bytes_per_s=1e6,
                          dram_read_bytes_per_s=1e6, **config)  # type: ignore[arg-type]
    sched = Scheduler(index, LinearLatency(), cfg)
    for i, node in enumerate(nodes):
        sched.add_colocated_instance(PrefillInstance(f"v{i}", node, MODEL), kv_capacity)
    return sched


def req(rid: str, n_keys: int, tokens: int, out: int | None = None) -> ScheduleRequest:
    return ScheduleRequest(rid, MODEL, keys(n_keys), tokens, expected_output_tokens=out)


def test_a_colocated_instance_decodes_what_it_prefills() -> None:
    sched = colocated()
    for i in range(4):  # whichever it picks, both phases run there
        dec = sched.schedule(req(f"r{i}", 10, 100), 0.0)
        assert dec.accepted and dec.prefill_instance is not None
        assert dec.decode_instance == dec.prefill_instance
        assert dec.fetch is None
    assert sched.is_colocated("v0") and sched.is_colocated("v1")


def test_the_engine_holding_the_prefix_runs_both_phases() -> None:
    sched = colocated()
    sched.schedule(req("a", 0, 10), 0.0, {"v0": 10_000})  # lands on v0 (own cache)
    busy = sched.schedule(req("b", 0, 10), 0.0, {"v1": 10_000})
    assert busy.prefill_instance == "v1"
    dec = sched.schedule(req("c", 10, 100), 0.0, {"v0": 90})
    assert (dec.prefill_instance, dec.decode_instance) == ("v0", "v0")
    assert dec.engine_cached_tokens == 90


def test_a_colocated_tpot_is_its_own_decode_batch() -> None:
    sched = colocated(nodes=("n0",))
    first = sched.schedule(req("a", 0, 10, out=1000), 0.0)
    second = sched.schedule(req("b", 0, 10, out=1000), 0.0)
    # decode_coeffs(batch) = 10 ms + 1 ms x batch: one request decoding, then two.
    assert first.tpot_s == pytest.approx(0.011)
    assert second.tpot_s == pytest.approx(0.012)


def test_a_colocated_instance_without_kv_room_is_not_a_prefill_candidate() -> None:
    # Both idle; v0 wins ties. Fill v0's room: the next request goes to v1 although v0's node
    # holds its whole prefix (with plain decode pinning it would have been rejected or sent
    # where it cannot decode).
    sched = colocated(kv_capacity=300, held={"n0": list(keys(10))})
    a = sched.schedule(req("a", 10, 100, out=100), 0.0)
    assert (a.prefill_instance, a.decode_instance) == ("v0", "v0") and a.local_blocks == 10
    b = sched.schedule(req("b", 10, 100, out=100), 10.0)  # v0 now has 100 tokens of room left
    assert (b.prefill_instance, b.decode_instance) == ("v1", "v1")
    assert b.fetch is not None and b.fetch.src_node == "n0"  # it still reuses v0's node's KV
    c = sched.schedule(req("c", 10, 100, out=100), 20.0)
    assert not c.accepted and c.reason is RejectReason.DECODE_KV_FULL
    assert c.ttft is not None  # the estimate is still reported
    # Releasing a reservation makes room again.
    sched.decode_done(a.ticket, 30.0, output_tokens=100)
    d = sched.schedule(req("d", 10, 100, out=100), 30.0)
    assert (d.prefill_instance, d.decode_instance) == ("v0", "v0")


def test_tpot_slo_rejects_on_the_colocated_instance_itself() -> None:
    sched = colocated(nodes=("n0",), tpot_slo_s=0.0115)
    assert sched.schedule(req("a", 0, 10, out=1000), 0.0).accepted  # 11 ms
    second = sched.schedule(req("b", 0, 10, out=1000), 0.0)  # 12 ms on the same engine
    assert not second.accepted and second.reason is RejectReason.TPOT_SLO
    assert "v0" in second.message


def test_prefill_only_instances_hand_over_to_decode_only_ones() -> None:
    index = GlobalPrefixIndex()
    for node in ("n0", "n1", "dn"):
        assert index.apply_snapshot(node, 1, 0, [])
    sched = Scheduler(index, LinearLatency(), SchedulerConfig(
        policy=Policy.LOAD, block_size_tokens=BLOCK_TOKENS, block_size_bytes=BLOCK_BYTES))
    sched.add_colocated_instance(PrefillInstance("v0", "n0", MODEL), 1_000_000)
    sched.add_prefill_instance(PrefillInstance("p", "n1", MODEL))
    sched.add_decode_instance(DecodeInstance("d", "dn", MODEL, 1_000_000))
    first = sched.schedule(req("a", 0, 100), 0.0)
    assert (first.prefill_instance, first.decode_instance) == ("p", "d")  # tie: "p" < "v0"
    second = sched.schedule(req("b", 0, 100), 0.0)  # p is busy now: LOAD picks v0
    assert (second.prefill_instance, second.decode_instance) == ("v0", "v0")


def test_load_reports_and_removal_cover_both_roles() -> None:
    sched = colocated()
    assert sched.report_load("v0", 1.0, queued_prefill_tokens=500, running_decode_batch=8,
                             kv_used_tokens=1000)
    assert sched.queue_s("v0", 1.0) == pytest.approx(0.5)
    dec = sched.schedule(req("a", 0, 10, out=10), 1.0)
    assert dec.prefill_instance == "v1"  # v0 has 0.5 s queued
    # v0's decode report counts as well: 8 running beyond ours -> 10 ms + 1 ms x 9.
    pinned = sched.schedule(req("b", 0, 1000, out=10), 1.0, {"v0": 10_000})
    assert pinned.decode_instance == "v0" and pinned.tpot_s == pytest.approx(0.019)
    assert sched.remove_instance("v0")
    assert not sched.is_colocated("v0")
    with pytest.raises(InvalidArgument):
        sched.queue_s("v0", 1.0)
    assert sched.outstanding() == 1  # v0's ticket went with it
    for i in range(3):
        assert sched.schedule(req(f"c{i}", 0, 10), 2.0).decode_instance == "v1"


def test_a_colocated_id_cannot_be_registered_twice() -> None:
    sched = colocated(nodes=("n0",))
    with pytest.raises(InvalidArgument):
        sched.add_colocated_instance(PrefillInstance("v0", "n0", MODEL), 100)
    with pytest.raises(InvalidArgument):
        sched.add_decode_instance(DecodeInstance("v0", "n0", MODEL, 100))
    with pytest.raises(InvalidArgument):
        sched.add_colocated_instance(PrefillInstance("v9", "n0", MODEL), 0)
    assert not sched.is_colocated("v9")
    with pytest.raises(InvalidArgument):
        sched.queue_s("v9", 0.0)


# -- pairing engine records ------------------------------------------------------------------

def rec(instance_id: str, role: EngineRole, *, url: str | None = "http://127.0.0.1:8000",
        node: str = "n0", model: str = MODEL, cap: int = 0) -> EngineRecord:
    return EngineRecord(instance_id=instance_id, role=role, model=model, node_id=node,
                        kv_capacity_tokens=cap or (4096 if role is EngineRole.DECODE else 0),
                        http_url=url)


P, D = EngineRole.PREFILL, EngineRole.DECODE


def test_a_servers_prefill_and_decode_records_pair_into_one_colocated_instance() -> None:
    records = {"v0": rec("v0", P), "v0.decode": rec("v0.decode", D, cap=8192),
               "v1": rec("v1", P, url="http://127.0.0.1:8001", node="n1"),
               "v1.decode": rec("v1.decode", D, url="http://127.0.0.1:8001", node="n1")}
    planned = plan_instances(records, {"n0", "n1"})
    assert planned == {
        "v0": PlannedInstance("v0", InstanceKind.COLOCATED, "n0", MODEL, 8192, ("v0", "v0.decode")),
        "v1": PlannedInstance("v1", InstanceKind.COLOCATED, "n1", MODEL, 4096, ("v1", "v1.decode")),
    }
    # A dead node takes its pair out; the other stays.
    assert list(plan_instances(records, {"n1"})) == ["v1"]


def test_records_without_a_shared_server_stay_separate() -> None:
    records = {"p": rec("p", P, url=None), "d": rec("d", D, url=None),
               "solo": rec("solo", P, url="http://h:1"),
               # same URL but another model / two prefill records: not one engine
               "x": rec("x", P, url="http://h:2"), "x.d": rec("x.d", D, url="http://h:2",
                                                              model="other"),
               "y1": rec("y1", P, url="http://h:3"), "y2": rec("y2", P, url="http://h:3")}
    planned = plan_instances(records, {"n0"})
    assert {i: p.kind for i, p in planned.items()} == {
        "p": InstanceKind.PREFILL, "d": InstanceKind.DECODE, "solo": InstanceKind.PREFILL,
        "x": InstanceKind.PREFILL, "x.d": InstanceKind.DECODE, "y1": InstanceKind.PREFILL,
        "y2": InstanceKind.PREFILL}
    assert planned["d"].kv_capacity_tokens == 4096 and planned["p"].kv_capacity_tokens == 0
    assert all(p.records == (i,) for i, p in planned.items())


def test_a_decode_completion_without_a_prefill_report_ends_both() -> None:
    # A front door sees only whole requests finish: one DecodeDone must free the queue too.
    sched = colocated(nodes=("n0",))
    dec = sched.schedule(req("a", 0, 100, out=10), 0.0)
    assert sched.queue_s("v0", 0.0) == pytest.approx(0.100)
    sched.decode_done(dec.ticket, 0.05, output_tokens=10)
    assert sched.queue_s("v0", 0.05) == 0.0
    assert sched.outstanding() == 0
    # and the queue re-anchors on it: the next request starts at once
    nxt = sched.schedule(req("b", 0, 100, out=10), 0.05)
    assert nxt.ttft is not None and nxt.ttft.queue_s == 0.0

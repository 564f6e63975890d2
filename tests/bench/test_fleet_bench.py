"""bench/fleet.py without processes: the JSON assembled from mode results (speedups, goals,
the planner beside the measured figures) and the planner's prediction on a small slice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.fleet import (
    MODE_PLAN,
    PLANNED,
    SLO,
    bench_doc,
    block_ids,
    build_spec,
    format_planner,
    goal_lines,
    goals,
    kvtier_load_bandwidth,
    planner_prediction,
    sent_times,
)
from kvstore.cluster.vllm_fleet import FleetRequest, Mode, ModeResult, RequestRecord, assemble

A = tuple(range(3, 3 + 64))  # two 32-token blocks every prompt shares


def _requests() -> list[FleetRequest]:
    return [FleetRequest("r1", A + tuple(range(100, 140))),
            FleetRequest("r2", A + tuple(range(100, 140)) + tuple(range(200, 230))),
            FleetRequest("r3", A + tuple(range(300, 310)))]


def _mode(mode: Mode, ttft: float, *, decision_s: float = 2e-5, tokens: list[int] | None = None,
          loaded: float = 0.0, load_s: float = 0.0) -> ModeResult:
    records = [RequestRecord(r.label, "v0", len(r.token_ids), None, ttft, 0.02,
                             tokens or [1, 2]) for r in _requests()]
    return ModeResult(mode.value, records=records, decision_s=[decision_s] * 3,
                      server_deltas={"kvtier_loaded_bytes": loaded,
                                     "kvtier_load_seconds": load_s}, wall_s=3.0)


def _doc(ttfts: dict[Mode, float], *, routed_decision_s: float = 5e-4,
         differ: bool = False) -> dict:
    spec = build_spec(True, _requests(), Path("/nonexistent"))
    results = [_mode(m, t, decision_s=routed_decision_s if m in (Mode.CONDUCTOR,
                                                                   Mode.EVENTS_ONLY) else 2e-5,
                     tokens=[9, 9] if differ and m is Mode.PD else None,
                     loaded=4e6 if m is Mode.CONDUCTOR else 0.0,
                     load_s=0.002 if m is Mode.CONDUCTOR else 0.0)
               for m, t in ttfts.items()]
    return assemble(results, spec, 100.0)


TTFTS = {Mode.VLLM_SINGLE: 0.8, Mode.VLLM_ALONE: 0.9, Mode.ROUND_ROBIN: 0.5,
         Mode.CONDUCTOR: 0.3, Mode.EVENTS_ONLY: 0.6, Mode.PD: 0.7}


def test_speedups_and_goals_come_from_the_mode_results() -> None:
    fleet = _doc(TTFTS)
    assert fleet["ttft_speedup_vs_round_robin"] == pytest.approx(3.0)  # (b) 0.9 / (c) 0.3
    assert fleet["ttft_speedup_vs_events_only"] == pytest.approx(2.0)  # (e) 0.6 / (c) 0.3
    doc = bench_doc(fleet, header={"bench": "fleet", "git_sha": "abc"},
                    cache_tokens={"v0": 2048, "alone-0": None}, profile=None, planner=None)
    assert doc["git_sha"] == "abc" and doc["vllm_cache_blocks"] == {"v0": 64, "alone-0": None}
    met = {g["name"]: g["met"] for g in doc["goals"]}
    assert met == {"ttft_speedup_vs_round_robin": True, "ttft_speedup_vs_events_only": True,
                   "outputs_identical": True, "routing_p99_s": True}
    json.dumps(doc)  # the document is JSON as it stands


def test_missed_goals_say_so() -> None:
    slow = {**TTFTS, Mode.EVENTS_ONLY: 0.4}  # 1.33x: below 1.5x
    g = {x["name"]: x for x in goals(_doc(slow, routed_decision_s=2.1e-3, differ=True))}
    assert g["ttft_speedup_vs_events_only"]["met"] is False
    assert g["ttft_speedup_vs_round_robin"]["met"] is True
    assert g["outputs_identical"]["met"] is False
    assert g["routing_p99_s"]["met"] is False and g["routing_p99_s"]["value"] == pytest.approx(
        2.1e-3)
    lines = goal_lines(list(g.values()))
    assert any("events-only" in line and "1.33x" in line and line.endswith("MISSED")
               for line in lines)
    assert any("2.10 ms" in line and line.endswith("MISSED") for line in lines)


def test_a_mode_that_did_not_run_leaves_its_goal_unmeasured() -> None:
    fleet = _doc({m: t for m, t in TTFTS.items() if m is not Mode.EVENTS_ONLY})
    g = {x["name"]: x for x in goals(fleet)}
    assert g["ttft_speedup_vs_events_only"]["met"] is None
    assert g["routing_p99_s"]["met"] is None
    assert any(line.endswith("not measured") for line in goal_lines(list(g.values())))


def test_load_bandwidth_is_loaded_bytes_over_load_seconds() -> None:
    assert kvtier_load_bandwidth(_doc(TTFTS)) == pytest.approx(4e6 / 0.002)
    assert kvtier_load_bandwidth(_doc({Mode.VLLM_ALONE: 0.5})) is None


def test_block_ids_are_chained_over_full_blocks() -> None:
    ids = block_ids(_requests(), 32)
    # r1: 104 tokens = 3 full blocks; r2 shares r1's 3 and adds one; r3 shares the first 2.
    assert ids == [(0, 1, 2), (0, 1, 2, 3), (0, 1)]


PROFILE = {"schema": "kvtier.latency-profile/1", "model": "tiny", "gpu": "cpu", "tp": 1,
           "prefill": [{"tokens": 32, "time_ms": 40.0}, {"tokens": 128, "time_ms": 120.0}],
           "decode": [{"batch_size": 1, "time_ms": 20.0}]}


def test_the_planner_predicts_each_deployment_from_the_measured_profile() -> None:
    spec = build_spec(True, _requests(), Path("/nonexistent"))
    planner = planner_prediction(spec, PROFILE, 2e9)
    d = planner["deployments"]
    assert set(d) == set(PLANNED) and set(MODE_PLAN.values()) == set(PLANNED)
    # No reuse: every prompt computed whole, as the profile says (interpolated: 104 tokens
    # -> 100 ms, 134 -> 120 ms (clamped at the last point's slope), 74 -> 75 ms).
    assert d["no-reuse"]["hit_ratio"] == 0.0
    assert d["no-reuse"]["ttft_mean_s"] == pytest.approx((0.1 + 0.125 + 0.075) / 3, rel=0.05)
    # The pool: r2 finds r1's 3 blocks, r3 its first 2; cheaper than no reuse.
    assert d["kvtier-pool"]["hit_ratio"] > 0
    assert d["kvtier-pool"]["cache_to_gpu_bytes"] > 0
    assert d["kvtier-pool"]["ttft_mean_s"] < d["no-reuse"]["ttft_mean_s"]
    assert planner["ttft_speedup_vs_round_robin"] > 1.0
    assert planner["fed"]["load_bandwidth_source"] == "measured"
    assert planner["fed"]["own_cache_tokens"] == spec.cache_blocks * 32
    assert 0.0 <= d["pd-kvtier-pool"]["slo_fraction"] <= 1.0
    assert d["own-cache"]["tpot_p50_s"] == pytest.approx(0.02, rel=0.05)

    fleet = _doc(TTFTS)
    doc = bench_doc(fleet, header={}, cache_tokens={}, profile=PROFILE, planner=planner)
    rows = {r["mode"]: r for r in doc["planner_vs_measured"]}
    assert rows[Mode.CONDUCTOR.value]["planner_deployment"] == "kvtier-pool"
    assert rows[Mode.VLLM_ALONE.value]["predicted_ttft_mean_s"] == d["no-reuse"]["ttft_mean_s"]
    assert format_planner(doc).row_count == len(TTFTS)
    assert doc["config"]["slo"] == {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s}


def test_the_planner_replays_the_arrivals_measured_in_the_run() -> None:
    """Chat arrivals: the planner gets the times (c) sent each request, not a closed loop's
    spacing; all at once, the three prompts queue (two instances), so TTFT grows."""
    spec = build_spec(True, _requests(), Path("/nonexistent"))
    closed = planner_prediction(spec, PROFILE, 2e9)
    together = planner_prediction(spec, PROFILE, 2e9, [5.0, 5.0, 5.0])
    assert closed["fed"]["arrival_gap_s"] == 60.0
    assert together["fed"]["arrival_gap_s"] is None and together["fed"]["arrival_span_s"] == 0
    assert together["deployments"]["no-reuse"]["ttft_mean_s"] > \
        closed["deployments"]["no-reuse"]["ttft_mean_s"]
    # Out of trace order (r3 first) is taken in arrival order, each with its own blocks.
    late = planner_prediction(spec, PROFILE, 2e9, [120.0, 180.0, 0.0])
    assert late["deployments"]["no-reuse"]["ttft_mean_s"] == pytest.approx(
        closed["deployments"]["no-reuse"]["ttft_mean_s"], rel=1e-6)
    with pytest.raises(ValueError):
        planner_prediction(spec, PROFILE, 2e9, [0.0])

    results = [_mode(Mode.CONDUCTOR, 0.3), _mode(Mode.VLLM_ALONE, 0.9)]
    for i, r in enumerate(results[0].records):
        r.sent_s = 10.0 - i
    assert sent_times(results, spec) == [10.0, 9.0, 8.0]
    assert sent_times(results[1:], spec) is None  # (c) did not run

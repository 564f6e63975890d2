"""Trace replay through the real index and scheduler onto simulated engines and daemons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conductor.index import GlobalPrefixIndex
from conductor.perf.data import DEFAULT_DATA_DIR
from conductor.perf.engine_model import default_engine_model
from conductor.scheduler import Policy
from kvstore.cli.main import app
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from planner.replay import ClusterSpec, SimNode, _Clock, replay, scale_to_load
from planner.workload import Workload, load_trace

TRACES = DEFAULT_DATA_DIR / "traces"
needs_traces = pytest.mark.skipif(not (TRACES / "conversation_trace.jsonl").is_file(),
                                  reason="../shared/data/traces is not here")
SMALL = ClusterSpec(prefill_instances=4, decode_instances=4, node_capacity_blocks=3000, seed=1)


def _mooncake(count: int, load: float) -> Workload:
    wl = load_trace("mooncake", count=count)
    return scale_to_load(wl, default_engine_model().latency, SMALL.prefill_instances, load)


@needs_traces
def test_policy_ordering_on_a_trace_slice() -> None:
    """The Mooncake paper's ordering of average TTFT: random >> load < local < global cache."""
    wl = _mooncake(1000, 1.0)
    res = {p: replay(wl, p, cluster=SMALL) for p in Policy}
    ttft = {p: r.ttft_s["mean"] for p, r in res.items()}
    assert all(v is not None for v in ttft.values())
    rnd, load = ttft[Policy.RANDOM], ttft[Policy.LOAD]
    local, glob = ttft[Policy.LOCAL_CACHE], ttft[Policy.GLOBAL_CACHE]
    assert rnd is not None and load is not None and local is not None and glob is not None
    assert rnd > 2 * load > 2 * local  # random is far worse
    assert load > local > glob
    # Cache awareness is where the gain comes from, and only the global policy fetches.
    hits = {p: r.hit_ratio for p, r in res.items()}
    assert hits[Policy.GLOBAL_CACHE] > hits[Policy.LOCAL_CACHE] > hits[Policy.LOAD]
    assert res[Policy.GLOBAL_CACHE].fetched_blocks > 0
    assert res[Policy.LOCAL_CACHE].fetched_blocks == 0
    # The calibrated estimates track the simulated TTFT.
    err = res[Policy.GLOBAL_CACHE].ttft_estimate_error
    assert err is not None and err < 0.15
    for r in res.values():
        assert r.accepted == r.requests == 1000
        assert r.events_dropped == 0  # every daemon event arrived in order


def test_node_events_keep_the_global_index_equal_to_the_node() -> None:
    index = GlobalPrefixIndex()
    node = SimNode("n", capacity_blocks=50, index=index, clock=_Clock())
    node.join()
    chains = [[b"c%d-%d" % (c, i) for i in range(1 + c % 7)] for c in range(40)]
    for step in range(200):
        shared = [b"root"] + chains[(step * 7) % 40]
        node.store(shared)
    held = node.held
    assert 0 < len(held) <= 50 and len(node.cache) == len(held)
    assert all(key in node.cache for key in held)
    assert set(index.stats().blocks_by_node) == {"n"}
    assert index.node_blocks("n") == len(held) == len(index)
    for key in held:
        assert index.holders(key) == {"n": TierKind.DRAM}
    assert index.stats().events_dropped == 0 and index.needs_resync("n") is None


@needs_traces
def test_replay_counts_early_rejections() -> None:
    wl = _mooncake(400, 1.2)
    r = replay(wl, Policy.GLOBAL_CACHE, cluster=SMALL, ttft_slo_s=2.0)
    rejected = sum(r.rejected.values())
    assert r.rejected["ttft_slo"] == rejected > 0
    assert r.accepted + rejected == r.requests == 400
    # Nothing that was let in misses the target by much: the estimates hold.
    assert r.ttft_s["p99"] is not None and r.ttft_s["p99"] < 2.0 * 1.5


@needs_traces
def test_azure_trace_has_no_prefixes_to_reuse() -> None:
    wl = load_trace("azure-code", count=600)
    wl = scale_to_load(wl, default_engine_model().latency, SMALL.prefill_instances, 0.8)
    res = {p: replay(wl, p, cluster=SMALL) for p in (Policy.RANDOM, Policy.LOAD,
                                                      Policy.GLOBAL_CACHE)}
    for r in res.values():
        assert r.hit_ratio == 0.0 and r.fetched_blocks == 0 and r.index_keys == 0
    rnd, load = res[Policy.RANDOM].ttft_s["mean"], res[Policy.LOAD].ttft_s["mean"]
    assert rnd is not None and load is not None and rnd > load


@needs_traces
def test_preloaded_blocks_change_lookup_size_not_decisions() -> None:
    wl = _mooncake(300, 1.0)
    plain = replay(wl, Policy.GLOBAL_CACHE, cluster=SMALL)
    loaded = replay(wl, Policy.GLOBAL_CACHE, cluster=SMALL, preload_blocks=20_000)
    assert loaded.index_keys == plain.index_keys + 20_000
    assert (loaded.hit_ratio, loaded.fetched_blocks, loaded.ttft_s) == (
        plain.hit_ratio, plain.fetched_blocks, plain.ttft_s)


def test_a_slice_without_duration_cannot_be_rescaled() -> None:
    import numpy as np

    wl = Workload("flat", np.zeros(3), np.full(3, 100), np.full(3, 10))
    with pytest.raises(InvalidArgument, match="all arrive at once"):
        scale_to_load(wl, default_engine_model().latency, 4, 0.5)


@needs_traces
def test_cli_bench_schedule_smoke(tmp_path: Path) -> None:
    out = tmp_path / "schedule.json"
    result = CliRunner().invoke(app, [
        "bench", "schedule", "--trace", "mooncake", "--limit", "200", "--index-blocks", "640",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "global-cache" in result.output and "Scheduling latency" in result.output
    doc = json.loads(out.read_text())
    assert doc["index_scale"][0]["blocks"] == 640
    assert {row["policy"] for row in doc["policies"][0]["rows"]} == {p.value for p in Policy}
    bad = CliRunner().invoke(app, ["bench", "schedule", "--trace", "no-such-trace"])
    assert bad.exit_code == 2 and "unknown trace" in bad.output

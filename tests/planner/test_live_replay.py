"""A trace slice through a REAL conductor, REAL daemons and etcd (separate processes).

The daemons hold every block the engines write (4 KiB each, LRU at a capacity the slice
overflows, so evictions happen); the conductor learns them only from the daemons' event
streams. Every decision is checked against the daemons at the moment it is made.
"""

from __future__ import annotations

from conductor.perf.engine_model import default_engine_model
from conductor.scheduler import Policy
from planner.live_replay import run_live_replay
from planner.replay import ClusterSpec, scale_to_load
from planner.workload import load_trace
from tests.planner.test_schedule_replay import needs_traces
from tests.support.etcd import require_etcd

CLUSTER = ClusterSpec(prefill_instances=4, decode_instances=4, node_capacity_blocks=300, seed=1)


@needs_traces
def test_decisions_match_what_the_real_daemons_hold() -> None:
    require_etcd()
    wl = scale_to_load(load_trace("mooncake", count=150), default_engine_model().latency,
                       CLUSTER.prefill_instances, 0.85)
    result = run_live_replay(wl, Policy.GLOBAL_CACHE, cluster=CLUSTER)
    c = result.consistency
    assert result.accepted == result.requests == 150
    assert c["checked"] == 150
    # Each decision's local prefix is really held by the prefill node it names, and (the
    # index being caught up before every decision) is exactly what that daemon holds.
    assert c["violations"] == 0, result.violations
    assert c["local_exact"] == c["checked"]
    assert c["fetch_held"] == c["fetches"]
    # The slice overflows the daemons (4 x 300 blocks): evictions happened, and the
    # conductor's index ends equal to the daemons' contents, learned from their events.
    assert result.stored_blocks > 4 * 300
    assert result.indexed_blocks == result.daemon_blocks > 0
    assert result.sync_timeouts == 0
    # Engines reused prefixes the daemons held, and reported load and completions.
    assert result.hit_ratio > 0.0
    assert result.load_reports > 0
    assert result.ttft_estimate_error is not None and result.ttft_estimate_error < 0.5
    assert result.schedule_latency_us["p50"] is not None

"""``Scheduler.first_token``: a front door reports only when a request's first token came out.
It ends the request's prefill in its instance's queue estimate and, for a request that had its
instance's prefill queue to itself, calibrates the instance's speed from decision to first
token. Exact figures with the linear latency model of test_scheduler.py (1 ms per token)."""

from __future__ import annotations

import math

import pytest

from conductor.index import GlobalPrefixIndex
from conductor.scheduler import (
    Policy,
    PrefillInstance,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
)
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from tests.control.test_scheduler import BLOCK_BYTES, BLOCK_TOKENS, MODEL, LinearLatency, keys

ALPHA = 0.2  # SpeedCalibration's default weight of a sample


def shared_store(held_blocks: int = 0, engines: tuple[str, ...] = ("v0", "v1"),
                 cache_affinity_margin: float = 0.25) -> Scheduler:
    """Colocated engines on one node (the fleet: both connectors on node-a's daemon), which
    holds the first ``held_blocks`` blocks of ``keys()``."""
    index = GlobalPrefixIndex()
    assert index.apply_snapshot("n0", 1, 0, [(key, TierKind.DRAM) for key in keys(held_blocks)])
    cfg = SchedulerConfig(policy=Policy.GLOBAL_CACHE, block_size_tokens=BLOCK_TOKENS,
                          block_size_bytes=BLOCK_BYTES, dram_read_bytes_per_s=1e6,
                          cache_affinity_margin=cache_affinity_margin)
    sched = Scheduler(index, LinearLatency(), cfg)
    for name in engines:
        sched.add_colocated_instance(PrefillInstance(name, "n0", MODEL), 1_000_000)
    return sched


def req(rid: str, tokens: int, n_keys: int = 0) -> ScheduleRequest:
    return ScheduleRequest(rid, MODEL, keys(n_keys), tokens, expected_output_tokens=8)


def test_a_request_alone_on_its_instance_calibrates_it_from_decision_to_first_token() -> None:
    sched = shared_store()
    d = sched.schedule(req("a", 101), 1.0, {"v0": 1})  # ties go to v0's own cache
    assert d.prefill_instance == "v0" and d.ttft is not None
    assert d.ttft.prefill_s == pytest.approx(0.1)
    sched.first_token(d.ticket, 1.5)  # 0.5 s measured against 0.1 s modelled
    assert sched.prefill_speed.factor("v0") == pytest.approx(5 ** ALPHA)
    assert sched.prefill_speed.factor("v1") == 1.0
    assert sched.queue_s("v0", 1.5) == 0.0
    assert sched.prefill_estimate_s("v0", 100, 1) == pytest.approx(0.1 * 5 ** ALPHA)
    later = sched.schedule(req("b", 101), 2.0, {"v0": 1})  # v0 is slower than modelled now
    assert later.prefill_instance == "v1" and later.ttft is not None
    assert later.ttft.prefill_s == pytest.approx(0.101)


def test_a_request_decided_behind_another_only_ends_its_prefill() -> None:
    sched = shared_store(engines=("v0",))
    a = sched.schedule(req("a", 101), 0.0)
    b = sched.schedule(req("b", 100), 0.0)  # behind a
    assert a.prefill_instance == b.prefill_instance == "v0"
    sched.first_token(a.ticket, 0.3)
    factor = (0.3 / 0.101) ** ALPHA
    assert sched.prefill_speed.factor("v0") == pytest.approx(factor)
    # What is left of the queue starts now: b's estimate (made with factor 1).
    assert sched.queue_s("v0", 0.3) == pytest.approx(b.ttft.prefill_s if b.ttft else math.nan)
    sched.first_token(b.ticket, 0.9)  # 0.9 s includes a's prefill: not a sample
    assert sched.prefill_speed.factor("v0") == pytest.approx(factor)
    assert sched.queue_s("v0", 0.9) == 0.0
    # Ended once: its decode completion still releases it, a second first token is refused.
    with pytest.raises(InvalidArgument, match="already reported its prefill"):
        sched.first_token(b.ticket, 1.0)
    sched.decode_done(b.ticket, 2.0, output_tokens=8)
    with pytest.raises(InvalidArgument, match="unknown ticket"):
        sched.first_token(b.ticket, 2.0)


def _calibrate(sched: Scheduler, slowdown: float, now_s: float) -> float:
    """Ten requests alone on each engine, each taking ``slowdown`` times the model's time."""
    for i in range(10):
        for name in ("v0", "v1"):
            d = sched.schedule(req(f"w{name}{i}", 101), now_s, {name: 1})
            assert d.prefill_instance == name
            now_s += 0.1 * slowdown
            sched.first_token(d.ticket, now_s)
            sched.decode_done(d.ticket, now_s, output_tokens=8)
    return now_s


@pytest.mark.parametrize("first_tokens", [True, False])
def test_a_slow_engine_learned_from_first_tokens_sends_a_store_hit_to_the_idle_instance(
        first_tokens: bool) -> None:
    """The fleet's case (bench/RESULTS.md, issue 14, session 13): engines 20x slower than
    the latency model, both reading one store. A follow-up whose prefix v0 holds in its own
    cache (one block more than the store holds) finds v0 still prefilling a long prompt
    decided 0.5 s ago. Calibrated from first tokens, the scheduler knows that prompt is far
    from done and sends the follow-up to idle v1 (it loads the prefix from the store); never
    told of a first token, it believes the prompt done after its modelled 0.3 s, sees both
    queues empty and keeps the follow-up on v0 for its one block, behind the prompt."""
    sched = shared_store(held_blocks=10)
    now_s = _calibrate(sched, 20.0, 0.0) if first_tokens else 10.0
    busy = sched.schedule(req("busy", 301), now_s, {"v0": 1})
    assert busy.prefill_instance == "v0"
    follow_up = sched.schedule(req("follow-up", 120, n_keys=12), now_s + 0.5, {"v0": 110})
    assert follow_up.ttft is not None
    if first_tokens:
        assert sched.prefill_speed.factor("v0") > 10
        assert follow_up.prefill_instance == "v1" and follow_up.prefix_blocks == 10
        assert follow_up.ttft.queue_s == 0.0
    else:
        assert follow_up.prefill_instance == "v0" and follow_up.ttft.queue_s == 0.0


def test_ties_go_to_the_instance_with_fewer_requests_waiting_for_a_first_token() -> None:
    """Both engines read the prompt's prefix from one store, and the one that holds it in its
    own cache too has a request still prefilling, predicted done (the engine is slower than
    the model says): the estimates tie, and the follow-up goes to the idle engine instead of
    queueing behind (the fleet's conductor sent 73 of 108 requests to v0 so: ties went to
    the lower instance id, or to the one holding the prefix)."""
    sched = shared_store(held_blocks=10)
    busy = sched.schedule(req("busy", 301), 0.0, {"v0": 1})
    assert busy.prefill_instance == "v0"
    tie = sched.schedule(req("follow-up", 120, n_keys=12), 5.0, {"v0": 100})
    assert sched.queue_s("v0", 5.0) == 0.0  # predicted done long ago, no first token yet
    assert tie.prefill_instance == "v1" and tie.ttft is not None and tie.ttft.queue_s == 0.0


def test_the_queue_is_never_less_than_the_work_behind_its_oldest_request() -> None:
    """Three requests on the only engine, none with its first token after their predicted
    end: the second and third have not started (FIFO), so a fourth waits at least their
    estimates, not nothing; once the oldest's first token comes the queue re-anchors."""
    sched = shared_store(engines=("v0",))
    a = sched.schedule(req("a", 101), 0.0)
    b = sched.schedule(req("b", 201), 0.0)
    c = sched.schedule(req("c", 301), 0.0)
    assert b.ttft is not None and c.ttft is not None
    late = sched.schedule(req("d", 11), 10.0)
    assert late.ttft is not None
    assert late.ttft.queue_s == pytest.approx(b.ttft.prefill_s + c.ttft.prefill_s)
    sched.first_token(a.ticket, 10.5)  # b, c and d are left, from now
    assert sched.queue_s("v0", 10.5) == pytest.approx(
        b.ttft.prefill_s + c.ttft.prefill_s + late.ttft.prefill_s)


@pytest.mark.parametrize(("slowdown", "holder_keeps"), [(1.2, True), (1.5, False)])
def test_the_engine_holding_the_prefix_keeps_it_against_a_speed_difference_within_the_margin(
        slowdown: float, holder_keeps: bool) -> None:
    """The fleet's case (tests/cluster/test_vllm_fleet.py failed on it in CI): both engines
    read the prefix from one store; v0 holds it in its own cache too (nothing more) but measured
    slower on its one calibrating request. Within ``cache_affinity_margin`` (25%) of v1's estimate it
    keeps the follow-up (no bytes move; a real store load costs a lookup and a step the model
    does not price); 1.5x slower, the follow-up goes to v1."""
    sched = shared_store(held_blocks=10)
    d = sched.schedule(req("a", 101), 0.0, {"v0": 1})
    assert d.prefill_instance == "v0" and d.ttft is not None
    sched.first_token(d.ticket, d.ttft.prefill_s * slowdown ** (1 / ALPHA))
    sched.decode_done(d.ticket, 1.0, output_tokens=8)
    assert sched.prefill_speed.factor("v0") == pytest.approx(slowdown)
    follow_up = sched.schedule(req("follow-up", 120, n_keys=12), 2.0, {"v0": 100})
    assert follow_up.prefill_instance == ("v0" if holder_keeps else "v1")
    assert follow_up.engine_cached_tokens == (100 if holder_keeps else 0)
    # With no margin the lower estimate wins outright.
    plain = shared_store(held_blocks=10, cache_affinity_margin=0.0)
    plain.prefill_speed.observe("v0", slowdown ** (1 / ALPHA), 1.0)
    assert plain.schedule(req("f", 120, n_keys=12), 0.0, {"v0": 100}).prefill_instance == "v1"


def test_the_conductors_margin_reaches_its_scheduler_and_a_bad_one_is_refused() -> None:
    from conductor.server import Conductor, ConductorConfig

    conductor = Conductor(ConductorConfig(etcd_endpoint="127.0.0.1:1", cache_affinity_margin=0))
    assert conductor.scheduler.config.cache_affinity_margin == 0
    assert Conductor(ConductorConfig(etcd_endpoint="127.0.0.1:1")).scheduler.config \
        .cache_affinity_margin == 0.25
    for bad in (-0.1, math.inf, "0.2"):
        with pytest.raises(InvalidArgument, match="cache_affinity_margin"):
            ConductorConfig(etcd_endpoint="127.0.0.1:1", cache_affinity_margin=bad)  # type: ignore[arg-type]

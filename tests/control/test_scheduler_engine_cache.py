"""The scheduler prices an engine's own prefix cache (vLLM's, from its KV events) as free,
beside its node's tiers: exact figures with the linear latency model of test_scheduler.py
(1 ms per computed token)."""

from __future__ import annotations

import pytest

from conductor.scheduler import Policy
from kvstore.dataplane.tier import TierKind
from tests.control.test_scheduler import k, keys, make, req

DRAM = TierKind.DRAM


@pytest.mark.parametrize("policy", [Policy.LOCAL_CACHE, Policy.GLOBAL_CACHE])
def test_the_instance_holding_the_prompt_in_its_own_cache_wins(policy: Policy) -> None:
    sched, _ = make(policy)
    dec = sched.schedule(req("r", (), 100), 0.0, {"p1": 64})
    assert dec.accepted and dec.prefill_instance == "p1"
    assert dec.engine_cached_tokens == 64
    assert dec.ttft is not None
    assert dec.ttft.prefill_s == pytest.approx((100 - 64) * 0.001)
    assert dec.ttft.load_s == 0.0
    # Without it the tie goes to the first instance, computing everything.
    plain = sched.schedule(req("s", (), 100), 0.0)
    assert plain.prefill_instance == "p0" and plain.engine_cached_tokens == 0
    assert plain.ttft is not None and plain.ttft.prefill_s == pytest.approx(0.100)


def test_the_own_cache_is_weighed_against_a_node_prefix_and_a_queue() -> None:
    # n0 holds 6 blocks (60 tokens) in DRAM; p1's engine holds 40 tokens itself.
    held = {"n0": [(k(i), DRAM) for i in range(6)]}
    sched, _ = make(Policy.LOCAL_CACHE, held=held)
    dec = sched.schedule(req("a", keys(10), 100), 0.0, {"p1": 40})
    assert dec.prefill_instance == "p0"  # 40 computed + 6 ms of load beats 60 computed
    assert dec.ttft is not None
    assert (dec.ttft.prefill_s, dec.ttft.load_s) == (pytest.approx(0.040), pytest.approx(0.006))
    # p0 is now busy for 40 ms: p1 (60 to compute, idle) wins the same prompt.
    dec2 = sched.schedule(req("b", keys(10), 100), 0.0, {"p1": 40})
    assert dec2.prefill_instance == "p1" and dec2.engine_cached_tokens == 40
    assert dec2.ttft is not None and dec2.ttft.prefill_s == pytest.approx(0.060)


def test_node_blocks_the_engine_holds_are_not_loaded_again() -> None:
    held = {"n0": [(k(i), DRAM) for i in range(6)]}
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), held=held)
    dec = sched.schedule(req("a", keys(10), 100), 0.0, {"p0": 30})
    assert dec.ttft is not None
    # 60 tokens reused: 30 from the engine itself, the 3 blocks beyond from DRAM.
    assert dec.ttft.prefill_s == pytest.approx(0.040)
    assert dec.ttft.load_s == pytest.approx(0.003)
    assert (dec.local_blocks, dec.engine_cached_tokens) == (6, 30)
    whole = sched.schedule(req("b", keys(10), 100), 1.0, {"p0": 80})
    assert whole.ttft is not None
    assert (whole.ttft.prefill_s, whole.ttft.load_s) == (pytest.approx(0.020), 0.0)


def test_a_fetch_is_not_planned_for_what_the_engine_already_holds() -> None:
    sched, index = make(Policy.GLOBAL_CACHE, prefill_nodes=("n0",))
    assert index.apply_snapshot("n1", 1, 0, [(k(i), DRAM) for i in range(5)])  # no engine
    dec = sched.schedule(req("a", keys(10), 100), 0.0, {"p0": 50})
    assert dec.fetch is None and dec.engine_cached_tokens == 50
    fetched = sched.schedule(req("b", keys(10), 100), 1.0, {"p0": 20})
    assert fetched.fetch is not None and fetched.fetch.blocks == 5


def test_the_whole_prompt_cached_still_computes_one_token() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    dec = sched.schedule(req("a", (), 64), 0.0, {"p0": 64})
    assert dec.ttft is not None and dec.ttft.prefill_s == pytest.approx(0.001)

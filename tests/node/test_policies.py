"""Eviction policies: exact victim orders on hand-made sequences, candidate-stream contract,
MQ's adaptation, and Belady against a brute-force optimum (through the real replay)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.replay import replay
from kvstore.dataplane.tier import TierKind
from kvstore.errors import ConfigError
from kvstore.node.index import CacheIndex, TierBudget
from kvstore.node.policies import (
    NEVER,
    BeladyPolicy,
    EvictionPolicy,
    FutureAccesses,
    LRUPolicy,
    MQConfig,
    MQPolicy,
    PolicyName,
    S3FIFOConfig,
    S3FIFOPolicy,
    make_policy,
)
from planner.trace import BLOCK_TOKENS, TraceRequest

DRAM = TierKind.DRAM


@dataclass
class Entry:
    """A stand-in for the index's entry view (policies only read these fields)."""

    key: bytes
    tier: TierKind = DRAM
    size_bytes: int = 1
    depth: int = 0
    access_count: int = 0


def k(name: str) -> bytes:
    return name.encode()


def drain(policy: EvictionPolicy, verdicts: dict[bytes, bool] | None = None,
          limit: int = 100) -> list[bytes]:
    """Run a candidate stream to its end (or ``limit`` keys); return the keys it was offered as
    victims that were taken (default: every offered key is taken)."""
    verdicts = verdicts or {}
    stream = policy.candidates(DRAM)
    taken: list[bytes] = []
    try:
        key = next(stream)
        while len(taken) < limit:
            ok = verdicts.get(key, True)
            if ok:
                taken.append(key)
            key = stream.send(ok)
    except StopIteration:
        pass
    finally:
        stream.close()
    return taken


# -- factory --------------------------------------------------------------------------------------


def test_make_policy_by_name_and_errors() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy(PolicyName.S3FIFO), S3FIFOPolicy)
    assert isinstance(make_policy("mq"), MQPolicy)
    assert isinstance(make_policy("belady", future=FutureAccesses([])), BeladyPolicy)
    with pytest.raises(ConfigError, match="known: lru"):
        make_policy("lfu")
    with pytest.raises(ConfigError, match="offline"):
        make_policy("belady")
    with pytest.raises(ConfigError):
        S3FIFOConfig(small_fraction=1.5)
    with pytest.raises(ConfigError):
        MQConfig(probation_fraction=0.001)


# -- LRU ------------------------------------------------------------------------------------------


def test_lru_order_restore_and_skip() -> None:
    lru = LRUPolicy()
    lru.bind({DRAM: 10})
    for name in ("a", "b", "c"):
        lru.on_insert(Entry(k(name)))
    lru.on_access(Entry(k("a")))
    assert lru.order(DRAM) == [k("b"), k("c"), k("a")]
    # Taken keys are restored at the head when the stream closes (the plan may be dropped).
    assert drain(lru, limit=2) == [k("b"), k("c")]
    assert lru.order(DRAM) == [k("b"), k("c"), k("a")]
    # A skipped key is treated as in use: it goes to the MRU end.
    assert drain(lru, {k("b"): False}) == [k("c"), k("a")]
    assert lru.order(DRAM) == [k("c"), k("a"), k("b")]
    lru.on_remove(Entry(k("c")))
    assert lru.order(DRAM) == [k("a"), k("b")]


def test_lru_through_the_index_evicts_leaves_before_their_parents() -> None:
    index = CacheIndex({DRAM: TierBudget.of(10)}, PolicyName.LRU)
    index.insert_chain([k("a"), k("b"), k("c")], None, DRAM, 1)  # notified c, b, a
    index.insert(k("x"), None, DRAM, 1)
    policy = index.policy
    assert isinstance(policy, LRUPolicy)
    assert policy.order(DRAM) == [k("c"), k("b"), k("a"), k("x")]
    assert index.access_prefix([k("a"), k("b"), k("zz")]) == 2  # touches b, then a
    assert policy.order(DRAM) == [k("c"), k("x"), k("b"), k("a")]
    assert index.plan_eviction(DRAM, 3) == [k("c"), k("x"), k("b")]


# -- S3-FIFO --------------------------------------------------------------------------------------


def test_s3fifo_filters_one_hit_wonders_and_readmits_ghosts_to_main() -> None:
    s3 = S3FIFOPolicy(S3FIFOConfig(small_fraction=0.2, ghost_factor=1.0))
    s3.bind({DRAM: 10})  # small queue target: 2 bytes
    for name in ("a", "b", "c", "d"):
        s3.on_insert(Entry(k(name)))
    s3.on_access(Entry(k("b")))
    # small holds 4 > 2: a (never hit) goes; b was hit, so it is promoted to main; then small
    # (c, d) is within its target and main's head b (its hit spent on the promotion) goes.
    assert drain(s3, limit=2) == [k("a"), k("b")]
    # Nothing was removed, and b stays promoted: small = [a, c, d], main = [b]: the same plan.
    assert drain(s3, limit=2) == [k("a"), k("b")]
    s3.on_remove(Entry(k("a")))  # dropped: remembered by the ghost queue
    s3.on_insert(Entry(k("a")))  # back: straight into main, behind b
    s3.on_access(Entry(k("b")))  # b gets a second chance in main (goes round behind a)
    # small = [c, d] is at its target, so main goes first: a, then b; then small.
    assert drain(s3) == [k("a"), k("b"), k("c"), k("d")]


def test_s3fifo_skips_rotate_and_the_scan_ends() -> None:
    s3 = S3FIFOPolicy()
    s3.bind({DRAM: 10})
    for name in ("a", "b"):
        s3.on_insert(Entry(k(name)))
    assert drain(s3, {k("a"): False, k("b"): False}) == []


# -- MQ -------------------------------------------------------------------------------------------


def test_mq_probation_promotion_and_queues() -> None:
    mq = MQPolicy(MQConfig(probation_fraction=0.05))
    mq.bind({DRAM: 100})  # probation target: 5 bytes
    for i in range(7):
        mq.on_insert(Entry(k(f"p{i}")))
    mq.on_access(Entry(k("p1")))  # hit while on probation
    # 7 > 5: p0 goes; p1 is promoted (score 2, queue 1) when it reaches the head; probation is
    # then within target (5), so main's lowest non-empty queue gives p1.
    assert drain(mq, limit=2) == [k("p0"), k("p1")]
    assert drain(mq, limit=1) == [k("p0")]
    mq.on_remove(Entry(k("p0")))  # ghost remembers score 1
    mq.on_insert(Entry(k("p0")))  # back: score 2 -> main queue 1, behind p1
    for _ in range(2):
        mq.on_access(Entry(k("p1")))  # score 4 -> queue 2
    # probation (p2..p6) is at its target; main: queue 1 = [p0], queue 2 = [p1]
    assert drain(mq) == [k("p0"), k("p1"), k("p2"), k("p3"), k("p4"), k("p5"), k("p6")]


def test_mq_moves_share_toward_the_region_whose_ghosts_come_back() -> None:
    cfg = MQConfig(probation_fraction=0.05, adapt_step_fraction=0.01, adapt_period_fraction=0.1,
                   adapt_window_fraction=0.05)
    mq = MQPolicy(cfg)
    mq.bind({DRAM: 100})  # 100 entries: period 10 drops, window 5 drops
    for i in range(10):
        key = k(f"x{i}")
        mq.on_insert(Entry(key))
        mq.on_remove(Entry(key))  # dropped from probation...
        mq.on_insert(Entry(key))  # ...and back at once: a bigger probation would have hit
    assert mq.probation_fraction(DRAM) == pytest.approx(0.06)
    for i in range(10):
        key = k(f"x{i}")  # all in main now (score 2)
        mq.on_remove(Entry(key))
        mq.on_insert(Entry(key))  # main's ghosts come back: main should grow
    assert mq.probation_fraction(DRAM) == pytest.approx(0.05)


# -- Belady ---------------------------------------------------------------------------------------


def test_future_accesses_next_use() -> None:
    fut = FutureAccesses([[k("a")], [k("b")], [k("a"), k("b")], [k("c")]])
    assert fut.next_use(k("a"), -1) == 0
    assert fut.next_use(k("a"), 0) == 2
    assert fut.next_use(k("a"), 2) == NEVER
    assert fut.next_use(k("zz"), 0) == NEVER


def test_belady_evicts_furthest_next_use_and_refuses_worse_newcomers() -> None:
    steps = [[k("a")], [k("b")], [k("c")], [k("a")], [k("b")], [k("a")]]
    bel = BeladyPolicy(FutureAccesses(steps))
    bel.bind({DRAM: 2})
    for step, name in enumerate(("a", "b")):
        bel.advance(step)
        bel.on_insert(Entry(k(name)))
    bel.advance(2)
    # At step 2: a is next needed at 3, b at 4, c never: c is not worth a slot.
    assert bel.admit(k("c"), DRAM, 1, 0) is False
    assert drain(bel) == [k("b"), k("a")]
    # Ties on the next use go deepest first (a child before its parent).
    bel2 = BeladyPolicy(FutureAccesses([[k("p"), k("q")], [k("p"), k("q")]]))
    bel2.bind({DRAM: 2})
    bel2.advance(0)
    bel2.on_insert(Entry(k("p"), depth=0))
    bel2.on_insert(Entry(k("q"), depth=1))
    assert drain(bel2) == [k("q"), k("p")]


def _opt_hits(seq: tuple[int, ...], capacity: int) -> int:
    """Brute-force optimum (with bypass) for unit-size blocks: max hits over all choices."""

    @functools.cache
    def best(i: int, cache: frozenset[int]) -> int:
        if i == len(seq):
            return 0
        x = seq[i]
        if x in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {x}))
        else:
            options.extend(best(i + 1, (cache - {y}) | {x}) for y in cache)
        return max(options)

    return best(0, frozenset())


@settings(max_examples=80, deadline=None)
@given(seq=st.lists(st.integers(0, 4), min_size=1, max_size=12), capacity=st.integers(1, 3))
def test_belady_replay_matches_brute_force_optimum(seq: list[int], capacity: int) -> None:
    requests = [TraceRequest(i, BLOCK_TOKENS, 1, (x,)) for i, x in enumerate(seq)]
    opt = _opt_hits(tuple(seq), capacity)
    cap_tokens = capacity * BLOCK_TOKENS
    assert replay(requests, cap_tokens, PolicyName.BELADY).hit_blocks == opt
    for online in (PolicyName.LRU, PolicyName.S3FIFO, PolicyName.MQ):
        assert replay(requests, cap_tokens, online).hit_blocks <= opt

"""Eviction policies for the cache index (:mod:`kvstore.node.index`).

A policy only *orders* entries: it never removes anything itself and never sees
bytes. The index owns membership, pins and the prefix rule; it asks the policy
for candidates in eviction order and skips the ones it may not evict.

Contract (:class:`EvictionPolicy`)
    * Every hook is called by the index **while it holds its lock**, so a policy
      needs no locking of its own, must not call back into the index, and must
      be fast: O(1) or O(log n) per call, no scans of all entries.
    * ``on_insert`` / ``on_access`` / ``on_move`` / ``on_remove`` keep the
      policy's view of membership exactly equal to the index's, per tier.
      ``entry`` is a live, read-only view of the index's record
      (:class:`EntryView`); a policy may keep the key, never the view.
    * ``candidates(tier)`` is a generator of keys held in ``tier``, best victim
      first. After each yielded key the index sends back ``True`` (the key was
      taken as a victim; the index will call ``on_remove``/``on_move`` for it
      later, or not at all when the plan is dropped) or ``False`` (the key may
      not be evicted now: it is pinned, or it has cached children and the tier
      drops instead of demoting). A policy may reorder its own state while it
      generates (CLOCK hands, S3-FIFO promotions, "a skipped key counts as
      used"), but must not change membership, must yield each key at most once
      per generator, and must restore any key it took out of its queues when
      the generator is closed (the index always closes it).
    * ``admit`` is asked only when a new key would need an eviction to fit:
      ``False`` means "do not cache it" (the index's caller then also skips the
      key's descendants, which could not be cached without it).

Policies are selected by :class:`PolicyName` through :func:`make_policy`:
LRU (baseline), S3-FIFO, MQ (the best online policy measured on the Mooncake
conversation trace; docs/eviction.md has the figures) and Belady, the offline
optimum, which is given the future and only makes sense in a trace replay.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
from collections import OrderedDict
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.dataplane.tier import TierKind
from kvstore.errors import ConfigError, InvalidArgument, InvariantViolation

CandidateStream = Generator[bytes, bool, None]
"""What ``EvictionPolicy.candidates`` returns: yields keys, receives 'taken?' verdicts."""


class EntryView(Protocol):
    """Read-only view of one index entry, as the index shows it to its policy."""

    @property
    def key(self) -> bytes: ...

    @property
    def tier(self) -> TierKind: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def depth(self) -> int:
        """0 for a root block, parent's depth + 1 otherwise."""
        ...

    @property
    def access_count(self) -> int:
        """Hits since the entry was inserted (0 right after insert)."""
        ...


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders the entries of each tier for eviction. See the module docstring."""

    name: str

    def bind(self, capacity_bytes: Mapping[TierKind, int]) -> None:
        """Called once by the index before any other hook, with each configured tier's capacity."""
        ...

    def on_insert(self, entry: EntryView) -> None: ...

    def on_access(self, entry: EntryView) -> None:
        """A hit on ``entry`` (already counted in ``entry.access_count``)."""
        ...

    def on_move(self, entry: EntryView, from_tier: TierKind) -> None:
        """``entry`` moved from ``from_tier`` to ``entry.tier`` (demotion or promotion)."""
        ...

    def on_remove(self, entry: EntryView) -> None:
        """``entry`` is being dropped from ``entry.tier`` (and from the index)."""
        ...

    def candidates(self, tier: TierKind) -> CandidateStream: ...

    def admit(self, key: bytes, tier: TierKind, size_bytes: int, depth: int) -> bool: ...


class PolicyName(enum.Enum):
    """Policies selectable by name (``--policy``)."""

    LRU = "lru"
    S3FIFO = "s3fifo"
    MQ = "mq"
    BELADY = "belady"


# ---------------------------------------------------------------------------
# Shared helpers


def _queue_candidates(queue: OrderedDict[bytes, int]) -> CandidateStream:
    """Yield the keys of ``queue`` from its head (oldest first), each once.

    A taken key is popped for the rest of this scan and put back at the head,
    in its old order, when the generator closes: the plan may be abandoned, and
    if it is executed ``on_remove`` deletes the key normally. A skipped key goes
    to the tail (it is in use: pinned, or needed by a cached child), so after
    ``len(queue)`` steps every key has been at the head exactly once.
    """
    taken: list[tuple[bytes, int]] = []
    try:
        for _ in range(len(queue)):
            if not queue:
                return
            key = next(iter(queue))
            if (yield key):
                taken.append((key, queue.pop(key)))
            else:
                queue.move_to_end(key)
    finally:
        for key, value in reversed(taken):
            queue[key] = value
            queue.move_to_end(key, last=False)


# ---------------------------------------------------------------------------
# LRU


class LRUPolicy:
    """Least recently used first; ties inside one call are broken by call order.

    The index notifies a chain insert and a prefix hit deepest block first, so a
    parent is always more recent than its children and the LRU end holds leaves.
    A skipped candidate is treated as used (moved to the MRU end): it is pinned,
    or it is the parent of a cached child, and either way it is in use.
    """

    name = PolicyName.LRU.value

    def __init__(self) -> None:
        self._queues: dict[TierKind, OrderedDict[bytes, int]] = {}

    def bind(self, capacity_bytes: Mapping[TierKind, int]) -> None:
        self._queues = {tier: OrderedDict() for tier in capacity_bytes}

    def on_insert(self, entry: EntryView) -> None:
        self._queues[entry.tier][entry.key] = 0

    def on_access(self, entry: EntryView) -> None:
        self._queues[entry.tier].move_to_end(entry.key)

    def on_move(self, entry: EntryView, from_tier: TierKind) -> None:
        del self._queues[from_tier][entry.key]
        self._queues[entry.tier][entry.key] = 0

    def on_remove(self, entry: EntryView) -> None:
        del self._queues[entry.tier][entry.key]

    def candidates(self, tier: TierKind) -> CandidateStream:
        return _queue_candidates(self._queues[tier])

    def admit(self, key: bytes, tier: TierKind, size_bytes: int, depth: int) -> bool:
        return True

    def order(self, tier: TierKind) -> list[bytes]:
        """The current eviction order of ``tier`` (a copy; for tests and debugging)."""
        return list(self._queues[tier])


# ---------------------------------------------------------------------------
# S3-FIFO


@dataclass(frozen=True, slots=True)
class S3FIFOConfig:
    """S3-FIFO knobs (Yang et al., SOSP'23), sizes relative to the tier's capacity."""

    small_fraction: float = 0.1
    """Share of the tier's bytes for the probationary FIFO."""
    ghost_factor: float = 4.0
    """Ghost queue length, in multiples of the number of entries the tier holds.

    The paper uses 1x; this trace's reuse distances are ~10x the cache at 1M
    tokens, so a longer memory of keys (a few dozen bytes each) pays off."""
    max_freq: int = 3

    def __post_init__(self) -> None:
        if not 0.0 < self.small_fraction < 1.0:
            raise ConfigError(f"small_fraction must be in (0, 1), got {self.small_fraction}")
        if self.ghost_factor < 0:
            raise ConfigError(f"ghost_factor must be >= 0, got {self.ghost_factor}")
        if self.max_freq < 1:
            raise ConfigError(f"max_freq must be >= 1, got {self.max_freq}")


class _S3State:
    __slots__ = ("capacity_bytes", "freq", "ghost", "inserted_bytes", "inserted_entries",
                 "main", "main_bytes", "small", "small_bytes")

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.small: OrderedDict[bytes, int] = OrderedDict()  # key -> size_bytes
        self.main: OrderedDict[bytes, int] = OrderedDict()
        self.ghost: OrderedDict[bytes, None] = OrderedDict()
        self.freq: dict[bytes, int] = {}
        self.small_bytes = 0
        self.main_bytes = 0
        self.inserted_bytes = 0
        self.inserted_entries = 0


class S3FIFOPolicy:
    """S3-FIFO: a small probationary FIFO, a main FIFO with lazy promotion, a ghost queue.

    A new key enters the small queue, or the main queue when the ghost queue
    remembers it (it was dropped recently and came back). Leaving the small
    queue, a key that was hit meanwhile moves to main; otherwise it is the
    victim. Leaving main, a key that was hit gets its frequency decremented and
    goes round again (CLOCK). Only drops (``on_remove``) feed the ghost queue.
    """

    name = PolicyName.S3FIFO.value

    def __init__(self, config: S3FIFOConfig | None = None) -> None:
        self.config = config or S3FIFOConfig()
        self._states: dict[TierKind, _S3State] = {}

    def bind(self, capacity_bytes: Mapping[TierKind, int]) -> None:
        self._states = {tier: _S3State(cap) for tier, cap in capacity_bytes.items()}

    def on_insert(self, entry: EntryView) -> None:
        st = self._states[entry.tier]
        st.inserted_bytes += entry.size_bytes
        st.inserted_entries += 1
        st.freq[entry.key] = 0
        if entry.key in st.ghost:  # dropped recently and back: straight to main
            del st.ghost[entry.key]
            st.main[entry.key] = entry.size_bytes
            st.main_bytes += entry.size_bytes
        else:
            st.small[entry.key] = entry.size_bytes
            st.small_bytes += entry.size_bytes

    def on_access(self, entry: EntryView) -> None:
        freq = self._states[entry.tier].freq
        freq[entry.key] = min(freq[entry.key] + 1, self.config.max_freq)

    def _forget(self, st: _S3State, key: bytes) -> None:
        del st.freq[key]
        size = st.small.pop(key, None)
        if size is not None:
            st.small_bytes -= size
        else:
            st.main_bytes -= st.main.pop(key)

    def on_move(self, entry: EntryView, from_tier: TierKind) -> None:
        self._forget(self._states[from_tier], entry.key)
        self.on_insert(entry)

    def on_remove(self, entry: EntryView) -> None:
        st = self._states[entry.tier]
        self._forget(st, entry.key)
        if self.config.ghost_factor > 0:
            st.ghost[entry.key] = None
            mean_size = max(1, st.inserted_bytes // max(1, st.inserted_entries))
            limit = max(1, int(self.config.ghost_factor * st.capacity_bytes / mean_size))
            while len(st.ghost) > limit:
                st.ghost.popitem(last=False)

    def candidates(self, tier: TierKind) -> CandidateStream:
        st = self._states[tier]
        small_target = self.config.small_fraction * st.capacity_bytes
        taken: list[tuple[OrderedDict[bytes, int], bytes, int]] = []
        # Each step yields a key (at most once: taken keys leave the queues),
        # promotes one, decrements a frequency or rotates a skipped key past the
        # head once per lap; a key's frequency lasts at most max_freq laps, so
        # this bound is never reached by a correct scan. It guards the loop.
        budget = 2 * (self.config.max_freq + 2) * (len(st.small) + len(st.main)) + 1
        # A queue is exhausted once every key in it was skipped in this scan
        # (skipped keys keep their frequency 0 and stay in their queue).
        skipped: dict[int, set[bytes]] = {id(st.small): set(), id(st.main): set()}
        try:
            while budget > 0:
                budget -= 1
                small_open = len(st.small) > len(skipped[id(st.small)])
                main_open = len(st.main) > len(skipped[id(st.main)])
                if not (small_open or main_open):
                    return
                from_small = small_open and (st.small_bytes > small_target or not main_open)
                queue = st.small if from_small else st.main
                key = next(iter(queue))
                if key in skipped[id(queue)]:
                    queue.move_to_end(key)
                    continue
                if st.freq[key] > 0:
                    if from_small:  # hit while on probation: promote
                        size = st.small.pop(key)
                        st.small_bytes -= size
                        st.main[key] = size
                        st.main_bytes += size
                        st.freq[key] = 0
                    else:  # second chance in main
                        st.freq[key] -= 1
                        st.main.move_to_end(key)
                    continue
                if (yield key):
                    size = queue.pop(key)
                    if from_small:
                        st.small_bytes -= size
                    else:
                        st.main_bytes -= size
                    taken.append((queue, key, size))
                else:
                    skipped[id(queue)].add(key)
                    queue.move_to_end(key)
        finally:
            for queue, key, size in reversed(taken):
                queue[key] = size
                queue.move_to_end(key, last=False)
                if queue is st.small:
                    st.small_bytes += size
                else:
                    st.main_bytes += size

    def admit(self, key: bytes, tier: TierKind, size_bytes: int, depth: int) -> bool:
        return True


# ---------------------------------------------------------------------------
# MQ: probation FIFO + frequency multi-queue + ghost history, adaptive split


@dataclass(frozen=True, slots=True)
class MQConfig:
    """Knobs of :class:`MQPolicy`. Sizes in entries are derived from the tier's
    capacity and the mean entry size seen so far."""

    probation_fraction: float = 0.05
    """Initial share of the tier for first-time keys; adapted within the bounds below."""
    min_probation_fraction: float = 0.01
    max_probation_fraction: float = 0.9
    queues: int = 4
    """Main queues; a key with score s (hits + 1) lives in queue min(log2 s, queues - 1)."""
    lifetime_factor: float = 4.0
    """A main key not hit for lifetime_factor x (capacity in entries) accesses drops one queue."""
    ghost_factor: float = 4.0
    """Ghost history length, in multiples of the tier's capacity in entries."""
    adapt_window_fraction: float = 0.05
    """A ghost hit counts for a region when the key left it within this many (x capacity) drops."""
    adapt_step_fraction: float = 0.01
    adapt_period_fraction: float = 0.1
    """Re-balance probation vs main after this many (x capacity) drops."""

    def __post_init__(self) -> None:
        lo, init, hi = (self.min_probation_fraction, self.probation_fraction,
                        self.max_probation_fraction)
        if not 0.0 < lo <= init <= hi < 1.0:
            raise ConfigError("probation fractions must satisfy 0 < min <= initial <= max < 1, "
                              f"got {lo}, {init}, {hi}")
        if self.queues < 1:
            raise ConfigError(f"queues must be >= 1, got {self.queues}")
        for name in ("lifetime_factor", "ghost_factor", "adapt_window_fraction",
                     "adapt_step_fraction", "adapt_period_fraction"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")


_PROBATION = -1
"""``_MQState.where`` value of a key in the probation FIFO (main queues are 0..queues-1)."""


class _MQState:
    __slots__ = ("capacity_bytes", "clock", "credit_main", "credit_probation", "drops",
                 "drops_main", "drops_probation", "expire", "ghost", "inserted_bytes",
                 "inserted_entries", "probation", "probation_bytes", "probation_fraction",
                 "queues", "score", "where")

    def __init__(self, capacity_bytes: int, config: MQConfig) -> None:
        self.capacity_bytes = capacity_bytes
        self.probation: OrderedDict[bytes, int] = OrderedDict()  # key -> size_bytes
        self.probation_bytes = 0
        self.queues: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(config.queues)]
        self.where: dict[bytes, int] = {}
        self.score: dict[bytes, int] = {}
        self.expire: dict[bytes, int] = {}  # main keys: clock value when they drop a queue
        # key -> (score, left probation?, that region's drop sequence number)
        self.ghost: OrderedDict[bytes, tuple[int, bool, int]] = OrderedDict()
        self.clock = 0
        self.drops = self.drops_probation = self.drops_main = 0
        self.credit_probation = self.credit_main = 0
        self.probation_fraction = config.probation_fraction
        self.inserted_bytes = 0
        self.inserted_entries = 0

    def capacity_entries(self) -> int:
        mean = max(1, self.inserted_bytes // max(1, self.inserted_entries))
        return max(1, self.capacity_bytes // mean)


class MQPolicy:
    """Frequency-aware eviction for long reuse distances; the best online policy measured.

    * New keys enter a **probation** FIFO. One that is hit there is promoted
      when it reaches the head; one that is not is the victim (S3-FIFO's filter
      for one-hit wonders: most KV blocks are never reused).
    * Promoted keys, and keys the **ghost** history remembers (dropped earlier,
      back now), live in **main**: ``queues`` LRU queues by ``log2(score)``,
      score = hits + 1, restored from the ghost. Victims come from the lowest
      non-empty queue; a key not hit for a lifetime drops one queue (MQ, Zhou
      et al., USENIX ATC'01, built for second-level caches whose reuse distances
      are long, as KV-cache reuse across conversation turns is).
    * The split between probation and main **adapts**: a ghost hit on a key
      that left probation (main) within the last ``adapt_window`` drops is a hit
      a slightly larger probation (main) would have had; every ``adapt_period``
      drops the split moves one step toward the region with more such hits.

    A skipped candidate (leased, or a parent of cached children) goes to the
    tail of its queue. Every operation is O(1) amortized.
    """

    name = PolicyName.MQ.value

    def __init__(self, config: MQConfig | None = None) -> None:
        self.config = config or MQConfig()
        self._states: dict[TierKind, _MQState] = {}

    def bind(self, capacity_bytes: Mapping[TierKind, int]) -> None:
        self._states = {tier: _MQState(cap, self.config) for tier, cap in capacity_bytes.items()}

    def probation_fraction(self, tier: TierKind) -> float:
        """The current probation share of ``tier`` (it adapts)."""
        return self._states[tier].probation_fraction

    def _queue_of(self, score: int) -> int:
        return min(self.config.queues - 1, score.bit_length() - 1)

    def _to_main(self, st: _MQState, key: bytes, size: int) -> None:
        q = self._queue_of(st.score[key])
        st.queues[q][key] = size
        st.where[key] = q
        st.expire[key] = st.clock + int(self.config.lifetime_factor * st.capacity_entries())

    def _place(self, st: _MQState, key: bytes, size: int, score: int) -> None:
        st.score[key] = score
        if score > 1:
            self._to_main(st, key, size)
        else:
            st.probation[key] = size
            st.probation_bytes += size
            st.where[key] = _PROBATION

    def on_insert(self, entry: EntryView) -> None:
        st = self._states[entry.tier]
        st.clock += 1
        st.inserted_bytes += entry.size_bytes
        st.inserted_entries += 1
        score = 1
        remembered = st.ghost.pop(entry.key, None)
        if remembered is not None:
            old_score, from_probation, seq = remembered
            window = self.config.adapt_window_fraction * st.capacity_entries()
            if from_probation and st.drops_probation - seq < window:
                st.credit_probation += 1
            elif not from_probation and st.drops_main - seq < window:
                st.credit_main += 1
            score = old_score + 1
        self._place(st, entry.key, entry.size_bytes, score)

    def on_access(self, entry: EntryView) -> None:
        st = self._states[entry.tier]
        st.clock += 1
        key = entry.key
        st.score[key] += 1
        where = st.where[key]
        if where != _PROBATION:  # probation keys are promoted lazily, at the head
            size = st.queues[where].pop(key)
            self._to_main(st, key, size)

    def _forget(self, st: _MQState, key: bytes) -> tuple[int, bool]:
        where = st.where.pop(key)
        if where == _PROBATION:
            st.probation_bytes -= st.probation.pop(key)
        else:
            del st.queues[where][key]
            del st.expire[key]
        return st.score.pop(key), where == _PROBATION

    def on_move(self, entry: EntryView, from_tier: TierKind) -> None:
        score, _ = self._forget(self._states[from_tier], entry.key)
        st = self._states[entry.tier]
        st.clock += 1
        self._place(st, entry.key, entry.size_bytes, score)

    def on_remove(self, entry: EntryView) -> None:
        st = self._states[entry.tier]
        score, from_probation = self._forget(st, entry.key)
        if from_probation:
            st.drops_probation += 1
            seq = st.drops_probation
        else:
            st.drops_main += 1
            seq = st.drops_main
        st.ghost[entry.key] = (score, from_probation, seq)
        limit = max(1, int(self.config.ghost_factor * st.capacity_entries()))
        while len(st.ghost) > limit:
            st.ghost.popitem(last=False)
        st.drops += 1
        if st.drops >= self.config.adapt_period_fraction * st.capacity_entries():
            self._adapt(st)

    def _adapt(self, st: _MQState) -> None:
        cfg = self.config
        if st.credit_probation > st.credit_main:
            st.probation_fraction = min(cfg.max_probation_fraction,
                                        st.probation_fraction + cfg.adapt_step_fraction)
        elif st.credit_main > st.credit_probation:
            st.probation_fraction = max(cfg.min_probation_fraction,
                                        st.probation_fraction - cfg.adapt_step_fraction)
        st.drops = st.credit_probation = st.credit_main = 0

    def _expire_heads(self, st: _MQState) -> None:
        """MQ's lifetime rule: main keys not hit for a lifetime go down one queue."""
        for q in range(1, len(st.queues)):
            queue = st.queues[q]
            while queue:
                key = next(iter(queue))
                if st.expire[key] > st.clock:
                    break
                size = queue.pop(key)
                st.queues[q - 1][key] = size
                st.where[key] = q - 1
                st.expire[key] = st.clock + int(self.config.lifetime_factor
                                                * st.capacity_entries())

    def candidates(self, tier: TierKind) -> CandidateStream:
        st = self._states[tier]
        self._expire_heads(st)
        target_bytes = st.probation_fraction * st.capacity_bytes
        regions = [st.probation, *st.queues]
        skipped: list[set[bytes]] = [set() for _ in regions]
        taken: list[tuple[int, bytes, int]] = []  # (region index, key, size)
        # Each step yields a key once, promotes one, or rotates a skipped key
        # past the head once per lap: bounded well below this guard.
        budget = 4 * (len(st.where) + 1)
        try:
            while budget > 0:
                budget -= 1
                open_regions = [i for i, r in enumerate(regions) if len(r) > len(skipped[i])]
                if not open_regions:
                    return
                main_open = [i for i in open_regions if i > 0]
                if 0 in open_regions and (st.probation_bytes > target_bytes or not main_open):
                    i = 0
                else:
                    i = main_open[0]
                region = regions[i]
                key = next(iter(region))
                if key in skipped[i]:
                    region.move_to_end(key)
                    continue
                if i == 0 and st.score[key] > 1:  # hit while on probation: promote
                    size = st.probation.pop(key)
                    st.probation_bytes -= size
                    self._to_main(st, key, size)
                    continue
                if (yield key):
                    size = region.pop(key)
                    if i == 0:
                        st.probation_bytes -= size
                    taken.append((i, key, size))
                else:
                    skipped[i].add(key)
                    region.move_to_end(key)
        finally:
            for i, key, size in reversed(taken):
                regions[i][key] = size
                regions[i].move_to_end(key, last=False)
                if i == 0:
                    st.probation_bytes += size

    def admit(self, key: bytes, tier: TierKind, size_bytes: int, depth: int) -> bool:
        return True


# ---------------------------------------------------------------------------
# Belady (offline optimum)


NEVER = 1 << 62
"""Next-use position of a key that is never accessed again."""


class FutureAccesses:
    """The future access sequence of a replay: ``steps[i]`` is the keys step ``i`` reads.

    Answers "when is ``key`` needed next after step ``i``" in O(log k) for a key
    read k times (binary search in its sorted list of steps).
    """

    def __init__(self, steps: Sequence[Sequence[bytes]]) -> None:
        uses: dict[bytes, list[int]] = {}
        for step, keys in enumerate(steps):
            for key in keys:
                positions = uses.setdefault(key, [])
                if not positions or positions[-1] != step:
                    positions.append(step)
        self._uses = uses
        self.steps = len(steps)

    def next_use(self, key: bytes, after_step: int) -> int:
        """The first step after ``after_step`` that reads ``key``, or :data:`NEVER`."""
        positions = self._uses.get(key)
        if positions is None:
            return NEVER
        i = bisect.bisect_right(positions, after_step)
        return positions[i] if i < len(positions) else NEVER


class BeladyPolicy:
    """Evict the key needed furthest in the future (MIN); the offline optimum.

    The driver must call :meth:`advance` with the current step before the step's
    accesses. Ties (keys next needed by the same step) go deepest first, so a
    child always precedes its parent: a request that needs the child needs the
    parent too. ``admit`` refuses a key needed later than every key already in
    the tier (caching it would cost a hit, not win one): MIN with bypass.
    """

    name = PolicyName.BELADY.value

    def __init__(self, future: FutureAccesses) -> None:
        self._future = future
        self._step = -1
        self._heaps: dict[TierKind, list[tuple[int, int, int, bytes]]] = {}
        self._prio: dict[bytes, tuple[int, int, int]] = {}  # key -> (-next_use, -depth, seq)
        self._seq = itertools.count()

    def bind(self, capacity_bytes: Mapping[TierKind, int]) -> None:
        self._heaps = {tier: [] for tier in capacity_bytes}

    def advance(self, step: int) -> None:
        """Set the current step (monotonically non-decreasing)."""
        if step < self._step:
            raise InvalidArgument(f"Belady clock cannot go back from {self._step} to {step}")
        self._step = step

    def _push(self, entry: EntryView) -> None:
        prio = (-self._future.next_use(entry.key, self._step), -entry.depth, next(self._seq))
        self._prio[entry.key] = prio
        heapq.heappush(self._heaps[entry.tier], (*prio, entry.key))

    def on_insert(self, entry: EntryView) -> None:
        self._push(entry)

    def on_access(self, entry: EntryView) -> None:
        self._push(entry)  # the old heap item is now stale

    def on_move(self, entry: EntryView, from_tier: TierKind) -> None:
        self._push(entry)

    def on_remove(self, entry: EntryView) -> None:
        del self._prio[entry.key]

    def _top(self, tier: TierKind) -> tuple[int, int, int, bytes] | None:
        heap = self._heaps[tier]
        while heap:
            item = heap[0]
            if self._prio.get(item[3]) == item[:3]:
                return item
            heapq.heappop(heap)
        return None

    def candidates(self, tier: TierKind) -> CandidateStream:
        heap = self._heaps[tier]
        popped: list[tuple[int, int, int, bytes]] = []
        try:
            while True:
                item = self._top(tier)
                if item is None:
                    return
                heapq.heappop(heap)
                popped.append(item)
                yield item[3]
        finally:
            for item in popped:
                heapq.heappush(heap, item)

    def admit(self, key: bytes, tier: TierKind, size_bytes: int, depth: int) -> bool:
        top = self._top(tier)
        if top is None:
            return True
        return (-self._future.next_use(key, self._step), -depth) > top[:2]


# ---------------------------------------------------------------------------
# Factory


def make_policy(name: PolicyName | str, *, future: FutureAccesses | None = None) -> EvictionPolicy:
    """A fresh policy instance. ``future`` is required for (and only used by) Belady."""
    try:
        kind = name if isinstance(name, PolicyName) else PolicyName(name)
    except ValueError as exc:
        known = ", ".join(p.value for p in PolicyName)
        raise ConfigError(f"unknown eviction policy {name!r} (known: {known})") from exc
    if kind is PolicyName.BELADY:
        if future is None:
            raise ConfigError("the belady policy is offline: it needs the future access sequence")
        return BeladyPolicy(future)
    if kind is PolicyName.LRU:
        return LRUPolicy()
    if kind is PolicyName.S3FIFO:
        return S3FIFOPolicy()
    if kind is PolicyName.MQ:
        return MQPolicy()
    raise InvariantViolation(f"policy {kind} has no constructor")  # pragma: no cover

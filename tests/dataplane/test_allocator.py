"""ExtentAllocator and the ExtentTable on it: exact behaviour, and hypothesis tests against a naive
page-map model, for both uses: memory arenas (allocate/free) and NVMe segments (a layout
rebuilt with ``claim``, ``allocate_run``/``free_run`` reporting the free run).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.dataplane.allocator import ExtentAllocator, align_up
from kvstore.dataplane.compress import CodecKind
from kvstore.dataplane.extent_table import ExtentTable
from kvstore.dataplane.tier import ChunkKey
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    TierUnavailable,
)

U = 4096  # one alignment unit


def test_align_up() -> None:
    assert [align_up(n, U) for n in (1, U - 1, U, U + 1)] == [U, U, U, 2 * U]


def test_requests_are_rounded_to_the_alignment() -> None:
    a = ExtentAllocator(16 * U, U)
    assert a.allocate(1) == 0
    assert a.block_size(0) == U
    assert a.allocate(U + 1) == U
    assert a.block_size(U) == 2 * U
    assert a.used_bytes == 3 * U
    assert a.free_extents() == [(3 * U, 13 * U)]
    a.check_invariants()


def test_capacity_is_rounded_down_and_validated() -> None:
    assert ExtentAllocator(10 * U + 123, U).capacity_bytes == 10 * U
    with pytest.raises(InvalidArgument):
        ExtentAllocator(U - 1, U)
    with pytest.raises(InvalidArgument):
        ExtentAllocator(10 * U, 3000)  # not a power of two
    with pytest.raises(InvalidArgument):
        ExtentAllocator(10 * U, U).allocate(0)


def carve(a: ExtentAllocator, units: list[int]) -> list[int]:
    return [a.allocate(n * U) for n in units]


def test_best_fit_takes_the_smallest_hole_then_the_lowest_offset() -> None:
    a = ExtentAllocator(20 * U, U)
    # Layout (units): [3 A][1 s][1 B][1 s][2 C][1 s][2 D][1 s][rest 8 free]
    blocks = carve(a, [3, 1, 1, 1, 2, 1, 2, 1])
    for off in blocks[0::2]:  # free A, B, C, D; the 1-unit spacers stay
        a.free(off)
    # Holes: 3 units @0, 1 @4U, 2 @6U, 2 @9U, 8 @12U.
    assert a.free_extents() == [
        (0, 3 * U),
        (4 * U, U),
        (6 * U, 2 * U),
        (9 * U, 2 * U),
        (12 * U, 8 * U),
    ]
    assert a.allocate(U) == 4 * U  # the exact 1-unit hole, not the first hole
    assert a.allocate(2 * U) == 6 * U  # two 2-unit holes: the lower one
    assert a.allocate(2 * U) == 9 * U
    assert a.allocate(2 * U) == 0  # 3-unit hole beats the 8-unit tail; remainder stays free
    assert a.free_extents() == [(2 * U, U), (12 * U, 8 * U)]
    assert a.largest_free_bytes == 8 * U
    a.check_invariants()


def test_free_coalesces_with_both_neighbours() -> None:
    a = ExtentAllocator(8 * U, U)
    x, y, z, w = carve(a, [2, 2, 2, 2])
    a.free(x)
    a.free(z)
    assert a.free_extent_count == 2
    a.free(y)  # joins x and z into one 6-unit extent
    assert a.free_extents() == [(0, 6 * U)]
    a.free(w)
    assert a.free_extents() == [(0, 8 * U)] and a.used_bytes == 0 and a.block_count == 0
    a.check_invariants()


def test_full_arena_raises_capacity_error_with_the_numbers() -> None:
    a = ExtentAllocator(4 * U, U)
    first, _ = carve(a, [1, 3])
    a.free(first)
    with pytest.raises(CapacityError, match=r"4096 bytes free in 1 extents, largest 4096"):
        a.allocate(2 * U)
    assert a.fragmentation() == 0.0
    assert a.allocate(U) == 0


def test_double_free_and_unknown_offsets_are_bugs() -> None:
    a = ExtentAllocator(4 * U, U)
    off = a.allocate(U)
    a.free(off)
    with pytest.raises(InvariantViolation):
        a.free(off)
    with pytest.raises(InvariantViolation):
        a.free(123)


def test_fragmentation_metric() -> None:
    a = ExtentAllocator(8 * U, U)
    blocks = carve(a, [1] * 8)
    for off in blocks[::2]:
        a.free(off)  # four 1-unit holes
    assert a.free_bytes == 4 * U and a.largest_free_bytes == U
    assert a.fragmentation() == pytest.approx(0.75)
    with pytest.raises(CapacityError):
        a.allocate(2 * U)


def test_claim_reserves_an_exact_range_and_frees_like_a_block() -> None:
    a = ExtentAllocator(16 * U, U)
    assert a.claim(0, 1) == U  # rounded up like allocate
    assert a.claim(5 * U, 2 * U) == 2 * U  # in the middle of the free tail
    assert a.free_extents() == [(U, 4 * U), (7 * U, 9 * U)]
    assert a.claim(U, 4 * U) == 4 * U  # a whole free extent, by its start
    assert a.claim(10 * U, 6 * U) == 6 * U  # the end of the tail
    assert a.free_extents() == [(7 * U, 3 * U)]
    assert a.used_bytes == 13 * U and a.block_count == 4
    a.check_invariants()
    assert a.free(5 * U) == 2 * U
    assert a.free_extents() == [(5 * U, 5 * U)]
    a.check_invariants()


def test_claim_outside_free_space_is_a_bug() -> None:
    a = ExtentAllocator(8 * U, U)
    a.allocate(2 * U)  # [0, 2U)
    a.claim(4 * U, U)  # [4U, 5U); free: [2U, 4U) and [5U, 8U)
    for offset, size in [(U, U), (0, U), (3 * U, 2 * U), (4 * U, U), (7 * U, 2 * U),
                         (8 * U, U), (9 * U, U)]:
        with pytest.raises(InvariantViolation):
            a.claim(offset, size)
    with pytest.raises(InvalidArgument):
        a.claim(2 * U + 1, U)  # unaligned
    with pytest.raises(InvalidArgument):
        a.claim(2 * U, 0)
    assert a.free_extents() == [(2 * U, 2 * U), (5 * U, 3 * U)]
    a.check_invariants()


def test_allocate_run_reports_the_extent_the_block_was_cut_from() -> None:
    a = ExtentAllocator(64 * U, U)
    for offset, size in [(0, U), (5 * U, 5 * U), (12 * U, 8 * U), (22 * U, 8 * U),
                         (38 * U, 26 * U)]:
        a.claim(offset, size)
    # Free: 4 units @1U, 2 @10U, 2 @20U, 8 @30U.
    assert a.allocate_run(2 * U) == (10 * U, 2 * U)
    assert a.allocate_run(2 * U - 100) == (20 * U, 2 * U)  # rounded like allocate
    assert a.allocate_run(3 * U) == (1 * U, 4 * U)  # leaves (4U, 1U)
    assert a.allocate_run(1 * U) == (4 * U, 1 * U)
    assert a.allocate_run(5 * U) == (30 * U, 8 * U)
    assert a.free_extents() == [(35 * U, 3 * U)]
    with pytest.raises(CapacityError):
        a.allocate_run(4 * U)
    with pytest.raises(InvalidArgument):
        a.allocate_run(0)
    a.check_invariants()


def test_free_run_reports_the_merged_extent() -> None:
    a = ExtentAllocator(16 * U, U)
    a.claim(0, U)  # a segment header
    offsets = [a.allocate(3 * U) for _ in range(5)]
    assert offsets == [U, 4 * U, 7 * U, 10 * U, 13 * U]
    assert a.free_run(4 * U) == (4 * U, 3 * U)
    assert a.free_run(10 * U) == (10 * U, 3 * U)
    assert a.free_run(7 * U) == (4 * U, 9 * U)  # merged with both neighbours
    assert a.free_run(13 * U) == (4 * U, 12 * U)
    assert a.free_extents() == [(4 * U, 12 * U)]
    with pytest.raises(InvariantViolation):
        a.free_run(13 * U)  # double free
    a.check_invariants()


def test_reset_restores_one_extent() -> None:
    a = ExtentAllocator(8 * U, U)
    carve(a, [1, 2, 3])
    a.reset()
    assert a.free_extents() == [(0, 8 * U)] and a.used_bytes == 0
    a.check_invariants()


def test_uniform_sizes_never_fragment() -> None:
    """With one chunk size every hole fits every request: no failure while space is free."""
    rng = random.Random(7)
    a = ExtentAllocator(256 * U, U)
    live: list[int] = []
    for _ in range(5000):
        if live and (rng.random() < 0.5 or a.free_bytes < 4 * U):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.allocate(4 * U))
    a.check_invariants()


# --- the property test --------------------------------------------------------------------------


class AllocatorVsPageMap(RuleBasedStateMachine):
    """Compare against a naive model: a list of unit owners, best fit found by a linear scan."""

    @initialize(units=st.integers(1, 64), alignment=st.sampled_from([256, 4096]))
    def setup(self, units: int, alignment: int) -> None:
        self.unit = alignment
        self.alloc = ExtentAllocator(units * alignment, alignment)
        self.owner: list[int | None] = [None] * units  # block start unit per unit
        self.live: dict[int, int] = {}  # offset -> units

    def model_runs(self) -> list[tuple[int, int]]:
        """Free runs as ``(length, start)`` units."""
        runs: list[tuple[int, int]] = []
        start = None
        for i, o in enumerate([*self.owner, "end"]):
            if o is None and start is None:
                start = i
            elif o is not None and start is not None:
                runs.append((i - start, start))
                start = None
        return runs

    def model_best_fit(self, need: int) -> tuple[int, int] | None:
        """``(start, run length)`` of the smallest run that fits, lowest start first."""
        fitting = [r for r in self.model_runs() if r[0] >= need]
        return None if not fitting else (min(fitting)[1], min(fitting)[0])

    def take(self, start: int, need: int) -> None:
        for i in range(start, start + need):
            assert self.owner[i] is None  # no overlap
            self.owner[i] = start
        self.live[start * self.unit] = need

    def release(self, offset: int) -> int:
        need = self.live.pop(offset)
        start = offset // self.unit
        for i in range(start, start + need):
            self.owner[i] = None
        return need

    @rule(size=st.integers(1, 20 * 4096))
    def allocate(self, size: int) -> None:
        need = -(-size // self.unit)
        expected = self.model_best_fit(need)
        if expected is None:
            with pytest.raises(CapacityError):
                self.alloc.allocate(size)
            return
        offset = self.alloc.allocate(size)
        assert offset == expected[0] * self.unit, (offset, expected)
        self.take(expected[0], need)

    @rule(size=st.integers(1, 20 * 4096))
    def allocate_run(self, size: int) -> None:
        need = -(-size // self.unit)
        expected = self.model_best_fit(need)
        if expected is None:
            with pytest.raises(CapacityError):
                self.alloc.allocate_run(size)
            return
        start, run = expected
        assert self.alloc.allocate_run(size) == (start * self.unit, run * self.unit)
        self.take(start, need)

    @rule(start=st.integers(0, 70), units=st.integers(1, 8), size_cut=st.integers(0, 255))
    def claim(self, start: int, units: int, size_cut: int) -> None:
        size = units * self.unit - size_cut % self.unit  # rounded up to ``units``
        free = start + units <= len(self.owner) and all(
            o is None for o in self.owner[start:start + units])
        if not free:
            with pytest.raises(InvariantViolation):
                self.alloc.claim(start * self.unit, size)
            return
        assert self.alloc.claim(start * self.unit, size) == units * self.unit
        self.take(start, units)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        need = self.release(offset)
        assert self.alloc.free(offset) == need * self.unit

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free_run(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        self.release(offset)
        unit = offset // self.unit
        length, start = next((n, s) for n, s in self.model_runs() if s <= unit < s + n)
        assert self.alloc.free_run(offset) == (start * self.unit, length * self.unit)

    @invariant()
    def accounting_is_exact(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_invariants()
        used_units = sum(1 for o in self.owner if o is not None)
        assert self.alloc.used_bytes == used_units * self.unit
        assert self.alloc.block_count == len(self.live)
        if not self.live:  # everything freed coalesces back to one extent
            assert self.alloc.free_extents() == [(0, self.alloc.capacity_bytes)]


AllocatorVsPageMap.TestCase.settings = settings(
    max_examples=150, stateful_step_count=60, deadline=None
)
TestAllocatorVsPageMap = AllocatorVsPageMap.TestCase


# --- the NVMe use: one allocator per segment file, rebuilt from a recovered layout --------------


@settings(max_examples=150, deadline=None)
@given(layout=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6)), max_size=12),
       shuffled=st.randoms(use_true_random=False))
def test_a_layout_claimed_back_has_exactly_its_gaps_free(
        layout: list[tuple[int, int]], shuffled: random.Random) -> None:
    """Recovery claims the header block and each record a scan found (in address order, or any
    other); the free extents are then exactly the gaps between them, all coalesced."""
    records, pos = [], 1  # unit 0: the segment header
    for gap, units in layout:
        pos += gap
        records.append((pos, units))
        pos += units
    pages = pos + 2
    for order in (records, shuffled.sample(records, len(records))):
        a = ExtentAllocator(pages * U, U)
        a.claim(0, U)
        for start, units in order:
            assert a.claim(start * U, units * U) == units * U
        used = [False] * pages
        used[0] = True
        for start, units in records:
            used[start:start + units] = [True] * units
        gaps, run_start = [], None
        for p in range(pages + 1):
            if p < pages and not used[p]:
                run_start = p if run_start is None else run_start
            elif run_start is not None:
                gaps.append((run_start * U, (p - run_start) * U))
                run_start = None
        assert a.free_extents() == gaps
        assert a.used_bytes == used.count(True) * U and a.block_count == len(records) + 1
        a.check_invariants()


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)),
                max_size=60))
def test_segment_space_agrees_with_a_page_map(ops: list[tuple[bool, int, int]]) -> None:
    """The NVMe writer's calls on a fresh segment (header claimed): ``allocate_run`` where it
    fits (the tier checks ``largest_free_bytes`` first), ``free_run`` on a failed write and
    ``free`` on a remove, against the page-map model."""
    pages = 48
    space = ExtentAllocator(pages * U, U)
    space.claim(0, U)
    used = [True] + [False] * (pages - 1)  # page 0: the segment header
    live: list[tuple[int, int]] = []

    def runs() -> list[tuple[int, int]]:
        found, start = [], None
        for p in range(pages + 1):
            free = p < pages and not used[p]
            if free and start is None:
                start = p
            elif not free and start is not None:
                found.append((p - start, start))
                start = None
        return found

    for is_alloc, npages, pick in ops:
        if is_alloc or not live:
            fits = sorted(r for r in runs() if r[0] >= npages)
            assert (space.largest_free_bytes >= npages * U) == bool(fits)
            if not fits:
                continue
            run_pages, first = fits[0]
            assert space.allocate_run(npages * U) == (first * U, run_pages * U)
            used[first:first + npages] = [True] * npages
            live.append((first, npages))
        else:
            first, npages = live.pop(pick % len(live))
            used[first:first + npages] = [False] * npages
            if pick % 2:
                merged = next((n, s) for n, s in runs() if s <= first < s + n)
                assert space.free_run(first * U) == (merged[1] * U, merged[0] * U)
            else:
                assert space.free(first * U) == npages * U
        space.check_invariants()
        assert space.free_bytes == used.count(False) * U


# --- ExtentTable ----------------------------------------------------------------------------------


def key(name: str) -> ChunkKey:
    return ChunkKey(name.encode())


def test_table_write_lifecycle_and_tokens() -> None:
    table = ExtentTable(ExtentAllocator(8 * U, U), where="test")
    token = object()
    off = table.begin_write(key("a"), U, token)
    assert table.get(key("a")) is None  # pending is invisible
    with pytest.raises(ChunkBusy):
        table.begin_write(key("a"), U, object())
    with pytest.raises(InvalidArgument):
        table.commit_write(key("a"), object(), off, U, U, CodecKind.NONE)  # a foreign token
    extent = table.commit_write(key("a"), token, off, U, U, CodecKind.NONE)
    assert table.get(key("a")) is extent
    with pytest.raises(ChunkExists):
        table.begin_write(key("a"), U, object())
    assert table.abort_write(key("a"), token, off) is False  # committed: nothing to abort
    assert table.usage() == (U, 1, 7 * U)


def test_table_stale_token_cannot_commit_a_newer_write_at_the_same_offset() -> None:
    table = ExtentTable(ExtentAllocator(8 * U, U), where="test")
    old = object()
    off = table.begin_write(key("a"), U, old)
    assert table.abort_write(key("a"), old, off)
    new = object()
    assert table.begin_write(key("a"), U, new) == off  # same key, same offset
    with pytest.raises(InvalidArgument):
        table.commit_write(key("a"), old, off, U, U, CodecKind.NONE)


def test_table_remove_with_a_reader_defers_the_free() -> None:
    table = ExtentTable(ExtentAllocator(8 * U, U), where="test")
    token = object()
    off = table.begin_write(key("a"), 2 * U, token)
    table.commit_write(key("a"), token, off, 2 * U, 2 * U, CodecKind.NONE)
    extent = table.acquire(key("a"))
    assert table.remove(key("a")) is True
    with pytest.raises(ChunkNotFound):
        table.acquire(key("a"))
    assert table.usage()[0] == 2 * U
    table.release(extent)
    assert table.usage()[0] == 0
    table.allocator.check_invariants()


def test_table_close() -> None:
    table = ExtentTable(ExtentAllocator(8 * U, U), where="test")
    assert table.close() is True
    assert table.close() is False
    with pytest.raises(TierUnavailable):
        table.begin_write(key("a"), U, object())

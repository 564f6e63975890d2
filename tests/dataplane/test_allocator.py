"""ExtentAllocator: exact behaviour, and a hypothesis state machine against a naive page-map model."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.dataplane.allocator import ExtentAllocator, ExtentTable, align_up
from kvstore.dataplane.compress import CodecKind
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

    def model_best_fit(self, need: int) -> int | None:
        runs: list[tuple[int, int]] = []  # (length, start)
        start = None
        for i, o in enumerate([*self.owner, "end"]):
            if o is None and start is None:
                start = i
            elif o is not None and start is not None:
                runs.append((i - start, start))
                start = None
        fitting = [r for r in runs if r[0] >= need]
        return min(fitting)[1] if fitting else None

    @rule(size=st.integers(1, 20 * 4096))
    def allocate(self, size: int) -> None:
        need = -(-size // self.unit)
        expected = self.model_best_fit(need)
        if expected is None:
            with pytest.raises(CapacityError):
                self.alloc.allocate(size)
            return
        offset = self.alloc.allocate(size)
        assert offset == expected * self.unit, (offset, expected)
        for i in range(expected, expected + need):
            assert self.owner[i] is None  # no overlap
            self.owner[i] = expected
        self.live[offset] = need

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        need = self.live.pop(offset)
        assert self.alloc.free(offset) == need * self.unit
        start = offset // self.unit
        for i in range(start, start + need):
            self.owner[i] = None

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

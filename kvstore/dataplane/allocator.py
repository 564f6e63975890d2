"""The free-extent allocator of every tier: a DRAM or HBM arena, or one NVMe segment file.

Policy: **address-ordered best fit with immediate coalescing**, every extent aligned.

* Every request is rounded up to ``alignment_bytes`` (a power of two; 4 KiB for DRAM
  so O_DIRECT and GPU DMA can use chunks in place, 256 B for HBM). Offsets are
  therefore always aligned and the *internal* waste of a chunk is below one
  alignment unit.
* Free space is a set of maximal extents: two free extents are never adjacent
  (``free`` merges a released block with both neighbours at once), so when
  everything is freed the arena is one extent again.
* ``allocate`` takes the smallest free extent that fits; among equal sizes the
  lowest offset. Best fit is the policy with the lowest fragmentation in
  published allocator studies (Johnstone & Wilson, ISMM 1998). With a single
  chunk size (the usual KV-cache case: fixed token blocks) any free extent fits
  any request, so there is no external fragmentation at all; docs/dram-arena.md
  has the measured figures for mixed sizes.

Data structures (``n`` = number of free extents, ``m`` = number of live blocks):

* ``_free_by_start`` / ``_free_by_end``: dicts start -> size and end -> start, so
  freeing finds its neighbours in O(1) without a sorted offset list;
* ``_by_size``: a sorted Python list of packed ints ``size << 48 | offset``. One
  ``bisect`` finds the best fit; insert/remove are a ``memmove`` inside the list
  (O(n) but a few microseconds for tens of thousands of extents). Packing into one
  int avoids a tuple per extent: an operation allocates no container objects;
* ``_allocated``: offset -> rounded size of each live block.

Beyond ``allocate``/``free`` (all the memory tiers need, and their put path calls per chunk,
so those two stay free of extra calls and containers), the NVMe tier
(:mod:`kvstore.dataplane.nvme`, one allocator per segment file) uses:

* :meth:`ExtentAllocator.claim`: reserve an exact range. Recovery claims each segment's
  header block and every record the scan found, so the free extents are exactly the gaps
  between them;
* :meth:`ExtentAllocator.allocate_run` / :meth:`ExtentAllocator.free_run`: the same as
  ``allocate``/``free`` that also report the free extent ("run") involved, because the NVMe
  writer stamps a FREE header over the rest of that run so the next scan can hop over it.

The allocator is **not** thread-safe. The memory tiers wrap it in their
:class:`~kvstore.dataplane.extent_table.ExtentTable` (lock, key index); the NVMe tier guards
its allocators with its own lock.
Misuse (freeing an unknown offset, double free, claiming space that is not free) is a bug
in the caller and raises :class:`~kvstore.errors.InvariantViolation`.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from kvstore.errors import CapacityError, InvalidArgument, InvariantViolation

_OFFSET_BITS = 48
"""Offsets and sizes fit in 48 bits (256 TiB): plenty for one arena."""
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
MAX_ARENA_BYTES = 1 << _OFFSET_BITS


def align_up(size_bytes: int, alignment_bytes: int) -> int:
    """Round ``size_bytes`` up to a multiple of ``alignment_bytes`` (a power of two)."""
    return (size_bytes + alignment_bytes - 1) & ~(alignment_bytes - 1)


class ExtentAllocator:
    """Best-fit allocator of aligned extents inside ``[0, capacity_bytes)``.

    ``capacity_bytes`` is rounded *down* to the alignment (a partial unit at the
    end can never be handed out).
    """

    __slots__ = (
        "_alignment_bytes",
        "_allocated",
        "_by_size",
        "_capacity_bytes",
        "_free_by_end",
        "_free_by_start",
        "_used_bytes",
    )

    def __init__(self, capacity_bytes: int, alignment_bytes: int = 4096) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise InvalidArgument(f"alignment must be a power of two, got {alignment_bytes}")
        usable = capacity_bytes - capacity_bytes % alignment_bytes
        if usable <= 0:
            raise InvalidArgument(
                f"capacity {capacity_bytes} bytes holds no {alignment_bytes}-byte unit"
            )
        if usable >= MAX_ARENA_BYTES:
            raise InvalidArgument(f"capacity {capacity_bytes} bytes exceeds {MAX_ARENA_BYTES}")
        self._alignment_bytes = alignment_bytes
        self._capacity_bytes = usable
        self._used_bytes = 0
        self._allocated: dict[int, int] = {}
        self._free_by_start: dict[int, int] = {0: usable}
        self._free_by_end: dict[int, int] = {usable: 0}
        self._by_size: list[int] = [usable << _OFFSET_BITS]

    # --- queries ------------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def alignment_bytes(self) -> int:
        return self._alignment_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes held by live blocks, each counted at its rounded (aligned) size."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self._capacity_bytes - self._used_bytes

    @property
    def largest_free_bytes(self) -> int:
        """The biggest request that would succeed now."""
        return self._by_size[-1] >> _OFFSET_BITS if self._by_size else 0

    @property
    def free_extent_count(self) -> int:
        return len(self._by_size)

    @property
    def block_count(self) -> int:
        return len(self._allocated)

    def block_size(self, offset: int) -> int | None:
        """The rounded size of the live block at ``offset``, or None."""
        return self._allocated.get(offset)

    def fragmentation(self) -> float:
        """External fragmentation ``1 - largest_free / free`` (0.0 when nothing is free)."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_bytes / free

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(offset, size_bytes)`` extents in address order (a snapshot, for tests/debug)."""
        return sorted(self._free_by_start.items())

    # --- allocate / free ------------------------------------------------------------------------

    def allocate(self, size_bytes: int) -> int:
        """Reserve ``size_bytes`` (rounded up to the alignment); return the block's offset.

        Raises ``InvalidArgument`` for a size < 1 and ``CapacityError`` when no free
        extent is large enough (the message says how much is free and in how many pieces).
        """
        if size_bytes < 1:
            raise InvalidArgument(f"allocation size must be >= 1 byte, got {size_bytes}")
        need = align_up(size_bytes, self._alignment_bytes)
        by_size = self._by_size
        # Smallest extent with size >= need; ties broken by the lowest offset.
        idx = bisect_left(by_size, need << _OFFSET_BITS)
        if idx == len(by_size):
            raise CapacityError(
                f"no free extent of {need} bytes: {self.free_bytes} bytes free in "
                f"{len(by_size)} extents, largest {self.largest_free_bytes}"
            )
        packed = by_size.pop(idx)
        extent_size = packed >> _OFFSET_BITS
        offset = packed & _OFFSET_MASK
        del self._free_by_start[offset]
        del self._free_by_end[offset + extent_size]
        rest = extent_size - need
        if rest:
            # Keep the tail free: the block sits at the extent's start (address order).
            self._insert_free(offset + need, rest)
        self._allocated[offset] = need
        self._used_bytes += need
        return offset

    def allocate_run(self, size_bytes: int) -> tuple[int, int]:
        """:meth:`allocate`, also returning the size of the free extent the block was cut from.

        Returns ``(offset, run_bytes)``: ``run_bytes - size`` (the rounded size) stay free
        right after the block. Same errors as :meth:`allocate`.
        """
        if size_bytes < 1:
            raise InvalidArgument(f"allocation size must be >= 1 byte, got {size_bytes}")
        by_size = self._by_size
        idx = bisect_left(by_size, align_up(size_bytes, self._alignment_bytes) << _OFFSET_BITS)
        run_bytes = by_size[idx] >> _OFFSET_BITS if idx < len(by_size) else 0
        return self.allocate(size_bytes), run_bytes  # allocate takes exactly that extent

    def claim(self, offset: int, size_bytes: int) -> int:
        """Reserve exactly ``[offset, offset + size)`` (size rounded up to the alignment) as a
        block, as if :meth:`allocate` had placed it there; return the rounded size.

        For rebuilding a layout found elsewhere: the NVMe tier's recovery claims what its scan
        found on disk. The block is freed like any other (:meth:`free`).

        Raises ``InvalidArgument`` for a size < 1 or an unaligned offset, and
        ``InvariantViolation`` when any part of the range is not free (inside a block, or
        outside the capacity). Cost: O(1) when the range lies in the free extent that ends
        the capacity or starts at ``offset`` (claims in address order on a fresh allocator,
        as recovery makes them), O(free extents) otherwise.
        """
        align = self._alignment_bytes
        if size_bytes < 1:
            raise InvalidArgument(f"claim size must be >= 1 byte, got {size_bytes}")
        if offset < 0 or offset % align:
            raise InvalidArgument(f"claim offset {offset} is not a multiple of {align}")
        need = align_up(size_bytes, align)
        end = offset + need
        start = self._free_extent_holding(offset)
        extent_end = -1 if start is None else start + self._free_by_start[start]
        if start is None or end > extent_end:
            raise InvariantViolation(
                f"claim of ({offset}, {need}), which is not free space of the "
                f"{self._capacity_bytes}-byte range")
        self._remove_free(start, extent_end - start)
        if offset > start:
            self._insert_free(start, offset - start)
        if extent_end > end:
            self._insert_free(end, extent_end - end)
        self._allocated[offset] = need
        self._used_bytes += need
        return need

    def free(self, offset: int) -> int:
        """Release the block at ``offset`` and merge it with free neighbours; return its size.

        Raises ``InvariantViolation`` when ``offset`` is not a live block (double free).
        """
        size = self._allocated.pop(offset, None)
        if size is None:
            raise InvariantViolation(f"free of offset {offset}, which is not an allocated block")
        self._used_bytes -= size
        start, end = offset, offset + size
        left_start = self._free_by_end.get(start)
        if left_start is not None:
            self._remove_free(left_start, start - left_start)
            start = left_start
        right_size = self._free_by_start.get(end)
        if right_size is not None:
            self._remove_free(end, right_size)
            end += right_size
        self._insert_free(start, end - start)
        return size

    def free_run(self, offset: int) -> tuple[int, int]:
        """:meth:`free`, returning the free extent ``(start, size_bytes)`` that now holds the
        block (merged with its free neighbours). Same errors as :meth:`free`."""
        size = self._allocated.get(offset)
        if size is None:
            raise InvariantViolation(f"free of offset {offset}, which is not an allocated block")
        start = self._free_by_end.get(offset, offset)
        end = offset + size
        end += self._free_by_start.get(end, 0)
        self.free(offset)
        return start, end - start

    def reset(self) -> None:
        """Forget every block: the whole arena is one free extent again."""
        self._allocated.clear()
        self._used_bytes = 0
        self._free_by_start = {0: self._capacity_bytes}
        self._free_by_end = {self._capacity_bytes: 0}
        self._by_size = [self._capacity_bytes << _OFFSET_BITS]

    # --- internals ----------------------------------------------------------------------------

    def _insert_free(self, offset: int, size: int) -> None:
        self._free_by_start[offset] = size
        self._free_by_end[offset + size] = offset
        insort(self._by_size, size << _OFFSET_BITS | offset)

    def _free_extent_holding(self, offset: int) -> int | None:
        """The start of the free extent that contains ``offset``, or None."""
        tail = self._free_by_end.get(self._capacity_bytes)
        if tail is not None and tail <= offset:
            return tail if offset < self._capacity_bytes else None
        if offset in self._free_by_start:
            return offset
        for start, size in self._free_by_start.items():
            if start <= offset < start + size:
                return start
        return None

    def _remove_free(self, offset: int, size: int) -> None:
        del self._free_by_start[offset]
        del self._free_by_end[offset + size]
        packed = size << _OFFSET_BITS | offset
        idx = bisect_left(self._by_size, packed)
        if idx == len(self._by_size) or self._by_size[idx] != packed:
            raise InvariantViolation(f"free extent ({offset}, {size}) missing from the size index")
        del self._by_size[idx]

    def check_invariants(self) -> None:
        """Verify every internal invariant (O(n log n); for tests). Raises InvariantViolation."""
        extents = sorted(self._free_by_start.items())
        blocks = sorted(self._allocated.items())
        if sorted((s << _OFFSET_BITS | o) for o, s in extents) != self._by_size:
            raise InvariantViolation("size index disagrees with the free extents")
        if {o + s: o for o, s in extents} != self._free_by_end:
            raise InvariantViolation("end index disagrees with the free extents")
        if sum(s for _, s in blocks) != self._used_bytes:
            raise InvariantViolation("used_bytes disagrees with the live blocks")
        pieces = sorted([(o, s, True) for o, s in extents] + [(o, s, False) for o, s in blocks])
        cursor = 0
        prev_free = False
        for offset, size, is_free in pieces:
            if offset != cursor:
                raise InvariantViolation(f"gap or overlap at offset {cursor} (next piece {offset})")
            if size <= 0 or offset % self._alignment_bytes or size % self._alignment_bytes:
                raise InvariantViolation(f"bad piece ({offset}, {size})")
            if is_free and prev_free:
                raise InvariantViolation(f"adjacent free extents at {offset} were not coalesced")
            prev_free = is_free
            cursor = offset + size
        if cursor != self._capacity_bytes:
            raise InvariantViolation(f"pieces cover {cursor} of {self._capacity_bytes} bytes")

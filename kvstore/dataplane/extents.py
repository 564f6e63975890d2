"""Free space of one NVMe segment file: aligned extents, best fit, immediate coalescing.

The NVMe tier keeps one :class:`SegmentSpace` per segment file. It differs from the DRAM
arena's :class:`~kvstore.dataplane.allocator.ExtentAllocator` in what the on-disk format
needs (see ``docs/nvme-tier.md``):

* it is **built from a recovered layout** (the free gaps between the records a scan found),
  not from an empty range;
* :meth:`SegmentSpace.allocate` also returns the size of the free run the extent was cut
  from, because the writer stamps a FREE header on the remainder so the next scan can hop
  over it;
* a miss returns ``None`` (the tier then tries the next segment or creates one).

Policy: the smallest free extent that fits, lowest offset among equal sizes; the block sits
at the extent's start. Free space is always a set of maximal extents (freeing merges with
both neighbours), so a segment whose chunks were all removed is one extent again.

Data structures (``n`` free extents): ``_free_by_start`` (start -> size) and
``_free_by_end`` (end -> start) find neighbours in O(1); ``_by_size`` is a sorted list of
packed ints ``size << 48 | offset`` (one ``bisect`` finds the best fit; no tuple per extent,
so an operation allocates no container objects). Not thread-safe: the tier's lock guards it.
Misuse (a double free, an overlapping free) is a bug and raises ``InvariantViolation``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable
from itertools import pairwise

from kvstore.errors import InvalidArgument, InvariantViolation

_OFFSET_BITS = 48
_OFFSET_MASK = (1 << _OFFSET_BITS) - 1
MAX_SEGMENT_BYTES = 1 << _OFFSET_BITS


class SegmentSpace:
    """Allocated and free extents of one segment ``[0, total_bytes)``, all ``alignment_bytes``-aligned.

    ``free_extents`` lists the free ``(offset, size_bytes)`` runs; everything else is
    allocated. Adjacent runs given separately are merged.
    """

    __slots__ = ("_alignment_bytes", "_by_size", "_free_by_end", "_free_by_start",
                 "_free_bytes", "_total_bytes")

    def __init__(self, total_bytes: int, free_extents: Iterable[tuple[int, int]],
                 alignment_bytes: int = 4096) -> None:
        if alignment_bytes <= 0 or alignment_bytes & (alignment_bytes - 1):
            raise InvalidArgument(f"alignment must be a power of two, got {alignment_bytes}")
        if total_bytes <= 0 or total_bytes % alignment_bytes or total_bytes >= MAX_SEGMENT_BYTES:
            raise InvalidArgument(f"segment size {total_bytes} is not a positive multiple of "
                                  f"{alignment_bytes} below {MAX_SEGMENT_BYTES}")
        self._alignment_bytes = alignment_bytes
        self._total_bytes = total_bytes
        self._free_bytes = 0
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._by_size: list[int] = []
        for offset, size_bytes in sorted(free_extents):
            if size_bytes > 0:
                self.free(offset, size_bytes)

    # --- queries --------------------------------------------------------------------------

    @property
    def total_bytes(self) -> int:
        return self._total_bytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def largest_free_bytes(self) -> int:
        """The biggest extent :meth:`allocate` would hand out now (0 when full)."""
        return self._by_size[-1] >> _OFFSET_BITS if self._by_size else 0

    def free_extents(self) -> list[tuple[int, int]]:
        """Free ``(offset, size_bytes)`` runs in address order (a snapshot)."""
        return sorted(self._free_by_start.items())

    # --- allocate / free ------------------------------------------------------------------

    def allocate(self, size_bytes: int) -> tuple[int, int] | None:
        """Take ``size_bytes`` (a positive multiple of the alignment) from the best-fitting run.

        Returns ``(offset, run_bytes)``: the extent starts at ``offset`` and was cut from a
        free run of ``run_bytes`` (so ``run_bytes - size_bytes`` stay free right after it).
        Returns None when no run is large enough.
        """
        if size_bytes <= 0 or size_bytes % self._alignment_bytes:
            raise InvalidArgument(f"extent size {size_bytes} is not a positive multiple of "
                                  f"{self._alignment_bytes}")
        idx = bisect_left(self._by_size, size_bytes << _OFFSET_BITS)
        if idx == len(self._by_size):
            return None
        packed = self._by_size.pop(idx)
        run_bytes = packed >> _OFFSET_BITS
        offset = packed & _OFFSET_MASK
        del self._free_by_start[offset]
        del self._free_by_end[offset + run_bytes]
        self._free_bytes -= run_bytes
        if run_bytes > size_bytes:
            self._insert(offset + size_bytes, run_bytes - size_bytes)
        return offset, run_bytes

    def free(self, offset: int, size_bytes: int) -> tuple[int, int]:
        """Return ``[offset, offset + size_bytes)`` to the free set; return the merged run.

        The result is ``(start, size_bytes)`` of the free run that now contains the extent.

        Raises ``InvariantViolation`` when the range is misaligned, outside the segment or
        overlaps free space (a double free).
        """
        align = self._alignment_bytes
        end = offset + size_bytes
        if offset < 0 or size_bytes <= 0 or offset % align or size_bytes % align \
                or end > self._total_bytes:
            raise InvariantViolation(f"free of bad extent ({offset}, {size_bytes}) in a "
                                     f"{self._total_bytes}-byte segment")
        self._check_not_free(offset, end)
        start = offset
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove(left, start - left)
            start = left
        right = self._free_by_start.get(end)
        if right is not None:
            self._remove(end, right)
            end += right
        self._insert(start, end - start)
        return start, end - start

    def check_invariants(self) -> None:
        """Verify the indexes agree and no two free runs touch (for tests). O(n log n)."""
        runs = sorted(self._free_by_start.items())
        if sorted(s << _OFFSET_BITS | o for o, s in runs) != self._by_size:
            raise InvariantViolation("size index disagrees with the free runs")
        if {o + s: o for o, s in runs} != self._free_by_end:
            raise InvariantViolation("end index disagrees with the free runs")
        if sum(s for _, s in runs) != self._free_bytes:
            raise InvariantViolation("free_bytes disagrees with the free runs")
        for (o1, s1), (o2, _) in pairwise(runs):
            if o1 + s1 >= o2:
                raise InvariantViolation(f"free runs at {o1} and {o2} touch or overlap")

    # --- internals ------------------------------------------------------------------------

    def _check_not_free(self, start: int, end: int) -> None:
        # O(1) checks that catch a double free of the same extent; a partial overlap shows
        # up in check_invariants (two free runs overlapping), which the property tests run.
        if start in self._free_by_start or end in self._free_by_end:
            raise InvariantViolation(f"double free of ({start}, {end - start})")

    def _insert(self, offset: int, size_bytes: int) -> None:
        self._free_by_start[offset] = size_bytes
        self._free_by_end[offset + size_bytes] = offset
        self._free_bytes += size_bytes
        insort(self._by_size, size_bytes << _OFFSET_BITS | offset)

    def _remove(self, offset: int, size_bytes: int) -> None:
        del self._free_by_start[offset]
        del self._free_by_end[offset + size_bytes]
        self._free_bytes -= size_bytes
        packed = size_bytes << _OFFSET_BITS | offset
        idx = bisect_left(self._by_size, packed)
        if idx == len(self._by_size) or self._by_size[idx] != packed:
            raise InvariantViolation(f"free run ({offset}, {size_bytes}) missing from size index")
        del self._by_size[idx]

"""The scan of one NVMe segment file: its header chain walked back at open.

The byte layout is :mod:`kvstore.dataplane.nvme.format`.

**The chain.** Every extent's header says how long the extent is, so a scan hops from one
header to the next: LIVE records are indexed, DEAD and FREE extents skipped. The writer keeps
the chain intact: a put that takes the start of a free run writes a FREE header for the rest
of the run right after its own extent (in the same system call), and a remove overwrites the
record's header with a DEAD header of the same length. Invariant: a header that survives
describes a range that is entirely its own (LIVE) or entirely free, so hopping never skips a
live record (``docs/nvme-tier.md`` has the argument).

**Resync.** A torn or corrupt header breaks the chain at one place; the scan then looks at
every following 4 KiB boundary (reading large windows and testing the magic with numpy) for
the next valid header. Everything between is free space. Resyncs only happen after a crash,
a failed write or corruption, and the tier rewrites a FREE header over each repaired gap.

The payload checksum is *not* verified by the scan (that would read the whole directory); the
tier verifies the newest records at open and every record on every read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvstore.dataplane.nvme.directio import ALIGN_BYTES, AlignedBuffer, align_down
from kvstore.dataplane.nvme.format import (
    HEADER_BYTES,
    RECORD_MAGIC_U32,
    HeaderCheck,
    RecordHeader,
    RecordKind,
    decode_record_header,
)

ReadAt = Callable[[memoryview, int], int]
"""``read_at(dst, offset)``: fill ``dst`` from the file at ``offset``; return bytes read."""


@dataclass(frozen=True, slots=True)
class Gap:
    """A free run between records found by a scan. ``clean``: the chain crossed it intact."""

    offset: int
    size_bytes: int
    clean: bool


@dataclass(slots=True)
class SegmentScan:
    """What a scan of one segment found."""

    segment_id: int
    segment_bytes: int
    file_bytes: int
    live: list[RecordHeader] = field(default_factory=list)
    """LIVE headers in address order (non-overlapping by construction)."""
    gaps: list[Gap] = field(default_factory=list)
    invalid_headers: int = 0
    """Places where a header was expected but the block was not a valid header there."""
    corrupt_headers: int = 0
    """Of ``invalid_headers``, those with the record magic but a failed header checksum: a
    header damaged in place (bit rot, a stray write), not a block that never was a header."""
    torn_records: int = 0
    """Records (or header blocks) running past the end of a truncated file."""
    max_seq: int = 0


def scan_segment(read_at: ReadAt, *, segment_id: int, segment_bytes: int, file_bytes: int,
                 window: AlignedBuffer) -> SegmentScan:
    """Walk the header chain of one segment (see the module docstring).

    ``file_bytes`` may be less than ``segment_bytes`` (a truncated file): records running
    past it are torn, and the gap up to ``segment_bytes`` is marked unclean so the tier
    re-extends the file and stamps a FREE header over it. ``window`` (a multiple of 4 KiB)
    is the read buffer; its size bounds each resync read.
    """
    scan = SegmentScan(segment_id, segment_bytes, file_bytes)
    limit = min(segment_bytes, align_down(file_bytes))
    block = window.view[:HEADER_BYTES]
    pos = gap_start = HEADER_BYTES
    gap_clean = True
    while pos < segment_bytes:
        if pos >= limit or read_at(block, pos) < HEADER_BYTES:
            gap_clean = False
            if pos < file_bytes:  # the file ends inside this header block
                scan.torn_records += 1
            break
        check, header = decode_record_header(block, segment_id=segment_id, offset=pos,
                                             segment_bytes=segment_bytes)
        if header is None:
            scan.invalid_headers += 1
            scan.corrupt_headers += check is HeaderCheck.BAD_CHECKSUM
            gap_clean = False
            pos = _resync(read_at, pos + HEADER_BYTES, limit, segment_id, segment_bytes, window)
            continue
        scan.max_seq = max(scan.max_seq, header.seq)
        if header.kind is not RecordKind.LIVE:
            pos = header.end
            continue
        if header.end > limit:
            scan.torn_records += 1
            gap_clean = False
            pos = _resync(read_at, pos + HEADER_BYTES, limit, segment_id, segment_bytes, window)
            continue
        if pos > gap_start:
            scan.gaps.append(Gap(gap_start, pos - gap_start, gap_clean))
        scan.live.append(header)
        pos = gap_start = header.end
        gap_clean = True
    if segment_bytes > gap_start:
        scan.gaps.append(Gap(gap_start, segment_bytes - gap_start, gap_clean))
    return scan


def _resync(read_at: ReadAt, pos: int, limit: int, segment_id: int, segment_bytes: int,
            window: AlignedBuffer) -> int:
    """The first place at or after ``pos`` holding a valid header, else ``segment_bytes``."""
    stride = ALIGN_BYTES // 4
    while pos < limit:
        want = min(window.size_bytes, limit - pos)
        got = align_down(read_at(window.view[:want], pos))
        if got < HEADER_BYTES:
            break
        words = np.frombuffer(window.view[:got], dtype="<u4")[::stride]
        candidates = np.flatnonzero(words == RECORD_MAGIC_U32).tolist()
        del words
        for idx in candidates:
            at = int(idx) * ALIGN_BYTES
            check, _ = decode_record_header(window.view[at:at + HEADER_BYTES],
                                            segment_id=segment_id, offset=pos + at,
                                            segment_bytes=segment_bytes)
            if check is HeaderCheck.OK:
                return pos + at
        pos += got
    return segment_bytes

"""Pure logic under the NVMe tier: record headers, the scan, direct I/O helpers.

(The free space of a segment is the tiers' ``ExtentAllocator``, tested with its NVMe use in
``test_allocator.py``.)

The scan runs here over an in-memory "file" (a bytearray read through the same ``read_at``
callable the tier passes it), so chains with holes and garbage can be built byte by byte.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.dataplane.nvme.directio import (
    ALIGN_BYTES,
    AlignedBuffer,
    BufferPool,
    IoMode,
    preadv_all,
    probe_io_mode,
    pwritev_all,
)
from kvstore.dataplane.nvme.format import (
    HEADER_BYTES,
    HeaderCheck,
    RecordHeader,
    RecordKind,
    SegmentHeader,
    decode_record_header,
    decode_segment_header,
    record_extent_bytes,
)
from kvstore.dataplane.nvme.scan import scan_segment
from kvstore.errors import InvalidArgument

A = ALIGN_BYTES

# --- headers ----------------------------------------------------------------------------------


def _live(offset: int = A, key: bytes = b"key", payload_bytes: int = 5000,
          seq: int = 7, meta: bytes = b"") -> RecordHeader:
    return RecordHeader(RecordKind.LIVE, 3, offset, record_extent_bytes(payload_bytes), seq,
                        payload_bytes, 0x1234, key, meta)


def test_record_header_round_trips_and_knows_its_place() -> None:
    block = memoryview(bytearray(HEADER_BYTES))
    header = _live(offset=5 * A, meta=b"parent-key")
    header.encode_into(block)
    assert decode_record_header(block, segment_id=3, offset=5 * A, segment_bytes=64 * A) \
        == (HeaderCheck.OK, header)
    assert decode_record_header(block, segment_id=3, offset=6 * A, segment_bytes=64 * A)[0] \
        is HeaderCheck.MISPLACED
    assert decode_record_header(block, segment_id=4, offset=5 * A, segment_bytes=64 * A)[0] \
        is HeaderCheck.MISPLACED
    assert decode_record_header(block, segment_id=3, offset=5 * A, segment_bytes=6 * A)[0] \
        is HeaderCheck.BAD_FIELDS  # the extent would run past the segment
    for i in (5, 17, 60, 127, 150, 190):
        damaged = bytearray(block)
        damaged[i] ^= 1
        assert decode_record_header(damaged, segment_id=3, offset=5 * A,
                                    segment_bytes=64 * A)[0] in (HeaderCheck.BAD_CHECKSUM,
                                                                 HeaderCheck.NO_MAGIC)


def test_inconsistent_headers_cannot_be_built() -> None:
    with pytest.raises(InvalidArgument):
        RecordHeader(RecordKind.LIVE, 1, A, 2 * A, 1, 5000, 0, b"k")  # extent too small
    with pytest.raises(InvalidArgument):
        RecordHeader(RecordKind.LIVE, 1, A, 2 * A, 1, 10, 0, b"")  # no key
    with pytest.raises(InvalidArgument):
        RecordHeader(RecordKind.FREE, 1, 0, 2 * A, 1)  # offset 0 is the segment header
    with pytest.raises(InvalidArgument):
        RecordHeader(RecordKind.FREE, 1, A, 100, 1)
    with pytest.raises(InvalidArgument):
        RecordHeader(RecordKind.LIVE, 1, A, 2 * A, 1, 10, 0, b"k", b"m" * 65)  # metadata too long


def test_segment_header_round_trips_and_detects_damage() -> None:
    block = memoryview(bytearray(HEADER_BYTES))
    SegmentHeader(9, 64 * A).encode_into(block)
    assert decode_segment_header(block) == SegmentHeader(9, 64 * A)
    block[12] ^= 1
    assert decode_segment_header(block) is None


# --- the scan ---------------------------------------------------------------------------------


class FakeFile:
    """A segment image in memory, read through the scan's ``read_at`` interface."""

    def __init__(self, size_bytes: int) -> None:
        self.data = bytearray(size_bytes)

    def header(self, header: RecordHeader) -> None:
        block = memoryview(bytearray(HEADER_BYTES))
        header.encode_into(block)
        self.data[header.offset:header.offset + HEADER_BYTES] = block

    def read_at(self, dst: memoryview, offset: int) -> int:
        got = self.data[offset:offset + dst.nbytes]
        dst[:len(got)] = got
        return len(got)


def _scan(f: FakeFile, segment_bytes: int | None = None):  # type: ignore[no-untyped-def]
    window = AlignedBuffer(8 * A)
    try:
        return scan_segment(f.read_at, segment_id=3, segment_bytes=segment_bytes or len(f.data),
                            file_bytes=len(f.data), window=window)
    finally:
        window.close()


def test_scan_hops_the_chain_and_reports_clean_gaps() -> None:
    f = FakeFile(32 * A)
    f.header(_live(A, b"a", 2 * A))  # extent 3A: [A, 4A)
    f.header(RecordHeader(RecordKind.DEAD, 3, 4 * A, 2 * A, 8, key=b"x"))
    f.header(_live(6 * A, b"b", 1))  # extent 2A: [6A, 8A)
    f.header(RecordHeader(RecordKind.FREE, 3, 8 * A, 24 * A, 9))
    f.data[12 * A:12 * A + 4] = b"KVTR"  # stale bytes inside the free run: never looked at
    scan = _scan(f)
    assert [h.key for h in scan.live] == [b"a", b"b"]
    assert [(g.offset, g.size_bytes, g.clean) for g in scan.gaps] == [
        (4 * A, 2 * A, True), (8 * A, 24 * A, True)]
    assert (scan.invalid_headers, scan.torn_records, scan.max_seq) == (0, 0, 9)


def test_scan_resyncs_after_a_broken_header() -> None:
    f = FakeFile(32 * A)
    f.header(_live(A, b"a", 2 * A))
    f.data[4 * A:4 * A + 100] = b"\xee" * 100  # a torn header: the chain breaks here
    f.data[6 * A:6 * A + 4] = b"KVTR"  # magic without a valid header: skipped
    f.header(_live(9 * A, b"b", 3 * A))
    f.header(RecordHeader(RecordKind.FREE, 3, 13 * A, 19 * A, 9))
    scan = _scan(f)
    assert [h.key for h in scan.live] == [b"a", b"b"]
    assert scan.invalid_headers == 1
    assert [(g.offset, g.size_bytes, g.clean) for g in scan.gaps] == [
        (4 * A, 5 * A, False), (13 * A, 19 * A, True)]


def test_scan_of_a_truncated_file_drops_the_record_cut_short() -> None:
    f = FakeFile(32 * A)
    f.header(_live(A, b"a", 2 * A))
    f.header(_live(4 * A, b"b", 6 * A))  # extent [4A, 11A)
    f.data = f.data[:8 * A + 10]
    scan = _scan(f, segment_bytes=32 * A)
    assert [h.key for h in scan.live] == [b"a"]
    assert scan.torn_records == 1
    assert [(g.offset, g.size_bytes, g.clean) for g in scan.gaps] == [(4 * A, 28 * A, False)]


# --- direct I/O helpers -----------------------------------------------------------------------


def test_probe_and_aligned_round_trip_on_the_test_filesystem(tmp_path: Path) -> None:
    mode, reason = probe_io_mode(tmp_path)
    assert isinstance(mode, IoMode) and reason
    assert list(tmp_path.iterdir()) == [], "the probe file was left behind"
    import os

    from kvstore.dataplane.nvme.directio import open_flags

    path = tmp_path / "f"
    path.touch()
    fd = os.open(path, open_flags(mode))
    src, dst = AlignedBuffer(3 * A), AlignedBuffer(3 * A)
    try:
        src.view[:] = bytes(range(256)) * (3 * A // 256)
        assert pwritev_all(fd, [src.view[:A], src.view[A:]], A) == 3 * A
        assert preadv_all(fd, [dst.view], A) == 3 * A
        assert dst.view == src.view
        assert preadv_all(fd, [dst.view], 2 * A) == 2 * A  # short at the end of the file
        assert probe_io_mode(tmp_path, path)[0] is mode
    finally:
        os.close(fd)
        src.close()
        dst.close()


def test_buffer_pool_reuses_buffers() -> None:
    pool = BufferPool(2 * A, max_cached=1)
    first = pool.acquire()
    pool.release(first)
    assert pool.acquire() is first
    other = pool.acquire()
    assert other is not first
    pool.release(first)
    pool.release(other)  # over max_cached: unmapped
    assert pool.acquire() is first
    pool.close()

"""The owner in NVMe records (format version 2) and the records written before it (version 1).

A version-1 header is built here byte by byte from its documented layout (not with the code under
test), so the test pins the old format: such a record must still decode, scan and recover, with
no owner. A version-2 header round-trips its owner, and a tier reopened on its directory returns
every chunk's owner in ``ChunkInfo.owner``.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import xxhash

from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.directio import ALIGN_BYTES
from kvstore.dataplane.nvme.format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    HeaderCheck,
    RecordHeader,
    RecordKind,
    SegmentHeader,
    decode_record_header,
    decode_segment_header,
    record_extent_bytes,
)
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import MAX_OWNER_BYTES
from kvstore.errors import InvalidArgument

A = ALIGN_BYTES
MiB = 1 << 20


def _v1_record(*, segment_id: int, offset: int, payload: bytes, key: bytes, meta: bytes,
               seq: int) -> bytes:
    """A LIVE header as format version 1 wrote it (module docstring of ``nvme/format.py``
    before version 2): 184 bytes of fields, then xxh3_64 of them, then zeros."""
    fields = struct.pack("<4sHBxIHHQQQQQ64s64s", b"KVTR", 1, 1, segment_id, len(key),
                         len(meta), offset, record_extent_bytes(len(payload)), seq,
                         len(payload), xxhash.xxh3_64_intdigest(payload), key, meta)
    assert len(fields) == 184
    block = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    return block + bytes(HEADER_BYTES - len(block))


def _v1_segment(segment_id: int, segment_bytes: int) -> bytes:
    fields = struct.pack("<4sHHIIQ", b"KVTS", 1, 0, A, segment_id, segment_bytes)
    block = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    return block + bytes(HEADER_BYTES - len(block))


def test_a_version_2_header_round_trips_its_owner() -> None:
    assert FORMAT_VERSION == 2
    block = memoryview(bytearray(HEADER_BYTES))
    header = RecordHeader(RecordKind.LIVE, 3, 5 * A, record_extent_bytes(5000), 7, 5000, 0x1234,
                          b"key", b"parent-key", b"alice")
    header.encode_into(block)
    assert struct.unpack_from("<H", block, 4) == (2,)
    assert decode_record_header(block, segment_id=3, offset=5 * A, segment_bytes=64 * A) \
        == (HeaderCheck.OK, header)
    longest = RecordHeader(RecordKind.LIVE, 3, 5 * A, record_extent_bytes(10), 7, 10, 1, b"k",
                           b"m" * 64, b"t" * MAX_OWNER_BYTES)
    longest.encode_into(block)
    assert decode_record_header(block, segment_id=3, offset=5 * A, segment_bytes=64 * A)[1] \
        == longest
    # The owner is under the header checksum: a flipped owner byte is damage, not another owner.
    header.encode_into(block)
    damaged = bytearray(block)
    damaged[192] ^= 0x20  # "alice" -> "Alice"
    assert decode_record_header(damaged, segment_id=3, offset=5 * A,
                                segment_bytes=64 * A)[0] is HeaderCheck.BAD_CHECKSUM
    with pytest.raises(InvalidArgument):
        RecordHeader(RecordKind.LIVE, 3, A, record_extent_bytes(10), 1, 10, 0, b"k",
                     owner=b"t" * (MAX_OWNER_BYTES + 1))


def test_a_version_1_header_decodes_with_no_owner() -> None:
    payload = b"p" * 5000
    block = _v1_record(segment_id=3, offset=5 * A, payload=payload, key=b"key",
                       meta=b"parent-key", seq=7)
    check, header = decode_record_header(block, segment_id=3, offset=5 * A,
                                         segment_bytes=64 * A)
    assert check is HeaderCheck.OK and header is not None
    assert (header.key, header.meta, header.owner, header.seq, header.payload_bytes) \
        == (b"key", b"parent-key", b"", 7, 5000)
    assert header.payload_xxh3 == xxhash.xxh3_64_intdigest(payload)
    damaged = bytearray(block)
    damaged[100] ^= 1
    assert decode_record_header(damaged, segment_id=3, offset=5 * A,
                                segment_bytes=64 * A)[0] is HeaderCheck.BAD_CHECKSUM
    assert decode_segment_header(_v1_segment(4, 64 * A)) == SegmentHeader(4, 64 * A)


def test_a_reopened_tier_returns_each_chunks_owner(tmp_path: Path) -> None:
    config = NvmeTierConfig(directory=tmp_path / "t", capacity_bytes=16 * MiB,
                            segment_bytes=4 * MiB)
    values = {b"a1": (os.urandom(6000), b"", b"alice"), b"b1": (os.urandom(9000), b"a1", b"bob"),
              b"d1": (os.urandom(100), b"", b"")}
    tier = NvmeTier.open(config)
    for key, (value, meta, owner) in values.items():
        info = tier.put_with_meta(key, value, meta, owner)
        assert info.owner == owner
    tier.put(b"plain", b"x" * 10)
    tier.close()
    tier = NvmeTier.open(config)
    try:
        got = {info.key: (info.meta, info.owner) for info in tier.chunks()}
        assert got == {**{k: (m, o) for k, (_v, m, o) in values.items()}, b"plain": (b"", b"")}
        for key, (value, _m, _o) in values.items():
            out = bytearray(len(value))
            tier.get_into(key, out)
            assert out == value
        with pytest.raises(InvalidArgument):
            tier.put_with_meta(b"long", b"x", b"", b"t" * (MAX_OWNER_BYTES + 1))
    finally:
        tier.close()


def test_a_directory_of_version_1_records_recovers_them_without_owner(tmp_path: Path) -> None:
    """A segment file as the previous format wrote it (segment header, two LIVE records, a FREE
    header for the rest): the tier opens it, serves both chunks with their parent link, no
    owner, and writes new records next to them as version 2."""
    directory = tmp_path / "t"
    directory.mkdir(mode=0o700)
    segment_bytes = 64 * A
    root, child = os.urandom(5000), os.urandom(2 * A)
    image = bytearray(segment_bytes)
    image[:A] = _v1_segment(1, segment_bytes)
    at = A
    for key, value, meta, seq in ((b"root", root, b"", 2), (b"child", child, b"root", 3)):
        image[at:at + A] = _v1_record(segment_id=1, offset=at, payload=value, key=key,
                                      meta=meta, seq=seq)
        image[at + A:at + A + len(value)] = value
        at += record_extent_bytes(len(value))
    fields = struct.pack("<4sHBxIHHQQQQQ64s64s", b"KVTR", 1, 3, 1, 0, 0, at, segment_bytes - at,
                         4, 0, 0, b"", b"")
    image[at:at + 192] = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    path = directory / "seg-000001.kvt"
    path.write_bytes(bytes(image))
    path.chmod(0o600)
    config = NvmeTierConfig(directory=directory, capacity_bytes=16 * MiB, segment_bytes=4 * MiB)
    tier = NvmeTier.open(config)
    try:
        report = tier.recovery
        assert (report.chunks, report.invalid_headers, report.corrupt_dropped) == (2, 0, 0)
        got = {info.key: (info.size_bytes, info.meta, info.owner) for info in tier.chunks()}
        assert got == {b"root": (5000, b"", b""), b"child": (2 * A, b"root", b"")}
        for key, value in ((b"root", root), (b"child", child)):
            out = bytearray(len(value))
            tier.get_into(key, out)
            assert out == value
        tier.put_with_meta(b"new", b"n" * 100, b"child", b"alice")
    finally:
        tier.close()
    tier = NvmeTier.open(config)
    try:
        assert {i.key: i.owner for i in tier.chunks()} == {b"root": b"", b"child": b"",
                                                           b"new": b"alice"}
        assert tier.recovery.invalid_headers == 0
    finally:
        tier.close()

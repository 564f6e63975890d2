"""The on-disk format of NVMe segment files: the segment header and the record headers.

A tier directory holds segment files ``seg-NNNNNN.kvt`` of fixed size (preallocated when
created). Every structure starts on a 4 KiB boundary (:data:`ALIGN_BYTES`) so payloads can
move with O_DIRECT straight to and from 4 KiB-aligned memory::

    segment file
    ├── block 0            segment header   (magic "KVTS", version, id, size, checksum)
    └── extents, back to back from offset 4096, each starting with a 4 KiB header block:
        LIVE  header | payload (payload_bytes) | zero padding to 4 KiB      a stored chunk
        DEAD  header | (old bytes)                                          a removed chunk
        FREE  header | (old bytes)                                          free space

Record header, format version 2 (little-endian, in the first 328 bytes of its block; the rest
is zero)::

    0   4s  magic "KVTR"          24  Q  extent_bytes (header block + padded payload)
    4   H   format version (2)    32  Q  sequence number (global, increasing)
    6   B   kind (LIVE/DEAD/FREE) 40  Q  payload_bytes
    7   x                          48  Q  xxh3_64 of the payload
    8   I   segment id            56  64s key (zero padded)
    12  H   key length            120 64s caller metadata (zero padded; e.g. the parent key)
    14  H   metadata length       184 H  owner length
    16  Q   offset of this header 186 6x
            in the file           192 128s owner (zero padded; the cache writes the tenant)
                                  320 Q  xxh3_64 of bytes 0..319 (header checksum)

Version 1 (written before owners were kept) is the same up to byte 184, where its header
checksum (of bytes 0..183) sits instead of the owner. Both versions are read: a version-1
record has no owner (``owner == b""``, which the cache takes as the default tenant). Every
header written now is version 2, so a directory written by this code cannot be opened by code
that knows only version 1 (it would see the new headers as damaged and free their space):
downgrading a daemon over its NVMe directory loses the chunks written since the upgrade.

A header is valid only where it was written: its segment id and offset must match the place
it is read from, so a payload that happens to contain header-like bytes is never mistaken
for a record.

How a scan walks these headers after a restart is :mod:`kvstore.dataplane.nvme.scan`.
"""


from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import xxhash

from kvstore.dataplane.nvme.directio import ALIGN_BYTES, align_up
from kvstore.dataplane.tier import MAX_KEY_BYTES, MAX_META_BYTES, MAX_OWNER_BYTES
from kvstore.errors import InvalidArgument

FORMAT_VERSION = 2
"""The version every header is written with."""
READABLE_VERSIONS = frozenset({1, 2})
"""Record and segment header versions a scan accepts (see the module docstring)."""
RECORD_MAGIC = b"KVTR"
SEGMENT_MAGIC = b"KVTS"
HEADER_BYTES = ALIGN_BYTES
"""Every header (segment or record) occupies one whole 4 KiB block."""

_RECORD_V1 = struct.Struct("<4sHBxIHHQQQQQ64s64s")
_RECORD_V1_CHECKED = _RECORD_V1.size  # 184: a version-1 checksum covers bytes [0, 184)
_OWNER = struct.Struct("<H6x128s")
_RECORD_CHECKED = _RECORD_V1_CHECKED + _OWNER.size  # 320: the version-2 checksum's range
_CHECKSUM = struct.Struct("<Q")
_VERSION = struct.Struct("<H")
_SEGMENT = struct.Struct("<4sHHIIQ")
_SEGMENT_CHECKED = _SEGMENT.size  # 24
RECORD_MAGIC_U32 = int.from_bytes(RECORD_MAGIC, "little")
"""The record magic as a little-endian u32 (what a resync looks for)."""
_ZERO_BLOCK = bytes(HEADER_BYTES)

MAX_RECORD_META_BYTES = 64
"""Room for caller metadata (``ChunkInfo.meta``) in a record header."""
assert MAX_META_BYTES <= MAX_RECORD_META_BYTES, "the Tier contract's metadata must fit a header"

MAX_RECORD_OWNER_BYTES = 128
"""Room for the owner (``ChunkInfo.owner``: the tenant's name) in a record header."""
assert MAX_OWNER_BYTES <= MAX_RECORD_OWNER_BYTES, "the Tier contract's owner must fit a header"

assert _RECORD_V1_CHECKED == 184 and _RECORD_CHECKED == 320 and _SEGMENT_CHECKED == 24


class RecordKind(enum.IntEnum):
    """What an extent holds (stored on disk as one byte)."""

    LIVE = 1
    DEAD = 2
    FREE = 3


class HeaderCheck(enum.Enum):
    """Why a 4 KiB block is or is not a valid record header at its place."""

    OK = "ok"
    NO_MAGIC = "no magic"
    BAD_CHECKSUM = "header checksum mismatch"
    BAD_FIELDS = "inconsistent fields"
    MISPLACED = "header of another place"


def record_extent_bytes(payload_bytes: int) -> int:
    """Bytes a LIVE record of ``payload_bytes`` occupies: header block + padded payload."""
    return HEADER_BYTES + align_up(payload_bytes)


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """One record header. Validates its own fields (``InvalidArgument`` when inconsistent)."""

    kind: RecordKind
    segment_id: int
    offset: int
    extent_bytes: int
    seq: int
    payload_bytes: int = 0
    payload_xxh3: int = 0
    key: bytes = b""
    meta: bytes = b""
    owner: bytes = b""
    """Opaque owner label (the cache stores the owning tenant's name; empty: the default
    tenant, and every version-1 record)."""

    def __post_init__(self) -> None:
        if self.offset < HEADER_BYTES or self.offset % ALIGN_BYTES:
            raise InvalidArgument(f"record offset {self.offset} is not an aligned offset >= "
                                  f"{HEADER_BYTES}")
        if self.extent_bytes < HEADER_BYTES or self.extent_bytes % ALIGN_BYTES:
            raise InvalidArgument(f"extent of {self.extent_bytes} bytes is not aligned")
        if not 0 <= self.segment_id < 1 << 32 or self.seq < 0:
            raise InvalidArgument("segment id or sequence number out of range")
        if len(self.key) > MAX_KEY_BYTES:
            raise InvalidArgument(f"key of {len(self.key)} bytes is longer than {MAX_KEY_BYTES}")
        if len(self.meta) > MAX_RECORD_META_BYTES:
            raise InvalidArgument(f"metadata of {len(self.meta)} bytes is longer than "
                                  f"{MAX_RECORD_META_BYTES}")
        if len(self.owner) > MAX_RECORD_OWNER_BYTES:
            raise InvalidArgument(f"owner of {len(self.owner)} bytes is longer than "
                                  f"{MAX_RECORD_OWNER_BYTES}")
        if self.kind is RecordKind.LIVE:
            if not self.key or self.payload_bytes < 1:
                raise InvalidArgument("a LIVE record needs a key and a payload")
            if self.extent_bytes != record_extent_bytes(self.payload_bytes):
                raise InvalidArgument(f"LIVE extent {self.extent_bytes} does not match "
                                      f"payload of {self.payload_bytes} bytes")

    @property
    def end(self) -> int:
        return self.offset + self.extent_bytes

    def encode_into(self, block: memoryview) -> None:
        """Write this header (version 2) into the first 4 KiB of ``block`` (the rest of the
        block is zeroed)."""
        _RECORD_V1.pack_into(block, 0, RECORD_MAGIC, FORMAT_VERSION, int(self.kind),
                             self.segment_id, len(self.key), len(self.meta), self.offset,
                             self.extent_bytes, self.seq, self.payload_bytes, self.payload_xxh3,
                             self.key, self.meta)
        _OWNER.pack_into(block, _RECORD_V1_CHECKED, len(self.owner), self.owner)
        _CHECKSUM.pack_into(block, _RECORD_CHECKED,
                            xxhash.xxh3_64_intdigest(block[:_RECORD_CHECKED]))
        block[_RECORD_CHECKED + 8:HEADER_BYTES] = _ZERO_BLOCK[_RECORD_CHECKED + 8:]


def decode_record_header(block: memoryview | bytes, *, segment_id: int, offset: int,
                         segment_bytes: int) -> tuple[HeaderCheck, RecordHeader | None]:
    """Parse the 4 KiB ``block`` read at ``offset`` of segment ``segment_id``.

    Returns ``(HeaderCheck.OK, header)`` only for a header with the right magic, checksum,
    self-consistent fields, an extent inside the segment, written at exactly this place.
    Version 1 and 2 headers are read (a version-1 header has no owner).
    """
    if bytes(block[:4]) != RECORD_MAGIC:
        return HeaderCheck.NO_MAGIC, None
    (version,) = _VERSION.unpack_from(block, 4)
    checked = _RECORD_V1_CHECKED if version == 1 else _RECORD_CHECKED
    (stored,) = _CHECKSUM.unpack_from(block, checked)
    if xxhash.xxh3_64_intdigest(block[:checked]) != stored:
        return HeaderCheck.BAD_CHECKSUM, None
    (_, _, kind, seg, key_len, meta_len, off, extent, seq, payload_bytes, payload_xxh3,
     key, meta) = _RECORD_V1.unpack_from(block, 0)
    owner_len, owner = (0, b"") if version == 1 else _OWNER.unpack_from(block, _RECORD_V1_CHECKED)
    if version not in READABLE_VERSIONS or kind not in RecordKind._value2member_map_ \
            or key_len > MAX_KEY_BYTES or meta_len > MAX_RECORD_META_BYTES \
            or owner_len > MAX_RECORD_OWNER_BYTES:
        return HeaderCheck.BAD_FIELDS, None
    try:
        header = RecordHeader(RecordKind(kind), seg, off, extent, seq, payload_bytes,
                              payload_xxh3, key[:key_len], meta[:meta_len], owner[:owner_len])
    except InvalidArgument:
        return HeaderCheck.BAD_FIELDS, None
    if seg != segment_id or off != offset:
        return HeaderCheck.MISPLACED, None
    if header.end > segment_bytes:
        return HeaderCheck.BAD_FIELDS, None
    return HeaderCheck.OK, header


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """Block 0 of a segment file."""

    segment_id: int
    segment_bytes: int

    def __post_init__(self) -> None:
        if not 0 <= self.segment_id < 1 << 32:
            raise InvalidArgument(f"segment id {self.segment_id} out of range")
        if self.segment_bytes < 2 * HEADER_BYTES or self.segment_bytes % ALIGN_BYTES:
            raise InvalidArgument(f"segment of {self.segment_bytes} bytes is not a multiple of "
                                  f"{ALIGN_BYTES} holding at least one record")

    def encode_into(self, block: memoryview) -> None:
        _SEGMENT.pack_into(block, 0, SEGMENT_MAGIC, FORMAT_VERSION, 0, ALIGN_BYTES,
                           self.segment_id, self.segment_bytes)
        _CHECKSUM.pack_into(block, _SEGMENT_CHECKED,
                            xxhash.xxh3_64_intdigest(block[:_SEGMENT_CHECKED]))
        block[_SEGMENT_CHECKED + 8:HEADER_BYTES] = _ZERO_BLOCK[_SEGMENT_CHECKED + 8:]


def decode_segment_header(block: memoryview | bytes) -> SegmentHeader | None:
    """The segment header in ``block``, or None when it is missing or damaged."""
    if bytes(block[:4]) != SEGMENT_MAGIC:
        return None
    (stored,) = _CHECKSUM.unpack_from(block, _SEGMENT_CHECKED)
    if xxhash.xxh3_64_intdigest(block[:_SEGMENT_CHECKED]) != stored:
        return None
    _, version, _, align, seg, size = _SEGMENT.unpack_from(block, 0)
    if version not in READABLE_VERSIONS or align != ALIGN_BYTES:
        return None
    try:
        return SegmentHeader(seg, size)
    except InvalidArgument:
        return None

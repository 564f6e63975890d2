"""The read index's shared-memory layout, and where its seqlock is valid.

What both readers of the table need: the Python writer and reader
(:mod:`kvstore.dataplane.read_index`) and the native one, whose ``cfg[]``
:mod:`kvstore.dataplane.native` fills from these names (the C code hard-codes none of them).
Both import this module; neither imports the other for it.

Layout (all little-endian): a :data:`HEADER_BYTES` header, then ``slots`` slots of
:data:`SLOT_BYTES` (a power of two, at least :data:`MIN_SLOTS`).

* header (:data:`HEADER_STRUCT` at 0): magic :data:`MAGIC`, :data:`VERSION`, slot size, slot
  count, arena size, :class:`IndexState`; the arena's name at :data:`ARENA_NAME_AT` (a length
  byte, then the name); the owner's robust mutex at :data:`OWNER_AT`, whose futex word a reader
  reads with :data:`OWNER_STRUCT`.
* slot: ``seq`` (u64 at :data:`SEQ_AT`; even: stable, odd: being written), then the fields of
  :data:`BODY_STRUCT`: arena offset (u64 at :data:`OFFSET_AT`), size (u64 at :data:`SIZE_AT`),
  :class:`SlotState` (u8 at :data:`STATE_AT`), key length (u8 at :data:`KLEN_AT`), the owner
  tag (48 bits: its low 16 at :data:`TAG_LO_AT`, u16, its high 32 at :data:`TAG_HI_AT`,
  u32; :func:`owner_tag`); the key at :data:`KEY_AT` (1..64 bytes). :data:`SLOT_STRUCT` reads
  seq and the fields in one call.

Version 2 added the owner tag (docs/dram-arena.md, "Owner tags"); a version-1 index is refused
by a version-2 reader and the other way round.
"""

from __future__ import annotations

import enum
import platform
import struct

import xxhash

MAGIC = b"KVTRIDX1"
VERSION = 2
HEADER_BYTES = 4096
SLOT_BYTES = 128
"""Two cache lines: 32 bytes of fields and up to 64 bytes of key."""
SLOT_SHIFT = 7
"""``SLOT_BYTES == 1 << SLOT_SHIFT``."""
KEY_AT = 32
OWNER_AT = 512
"""Where the robust mutex (glibc ``pthread_mutex_t``, 40 bytes) lies in the header."""
ARENA_NAME_AT = 64
MIN_SLOTS = 64

HEADER_STRUCT = struct.Struct("<8sIIQQI")
"""magic, version, slot bytes, slots, arena bytes, state."""
SEQ_STRUCT = struct.Struct("<Q")
BODY_STRUCT = struct.Struct("<QQBBHI")
"""offset, size, state, key length, owner tag (low 16 bits, high 32): the slot's fields after
``seq``."""
SLOT_STRUCT = struct.Struct("<QQQBBHI")
"""seq and the fields, as a reader takes them in one call."""
OWNER_STRUCT = struct.Struct("<I")

SEQ_AT = 0
OFFSET_AT = SEQ_AT + SEQ_STRUCT.size
SIZE_AT = OFFSET_AT + 8
STATE_AT = SIZE_AT + 8
KLEN_AT = STATE_AT + 1
TAG_LO_AT = KLEN_AT + 1
TAG_HI_AT = TAG_LO_AT + 2
TAG_BITS = 48
assert BODY_STRUCT.format == "<QQBBHI" and SLOT_STRUCT.size == TAG_HI_AT + 4 == KEY_AT
assert TAG_LO_AT % 2 == 0 and TAG_HI_AT % 4 == 0  # aligned loads in the native reader
assert SLOT_BYTES == 1 << SLOT_SHIFT


class IndexState(enum.IntEnum):
    OPEN = 1
    CLOSED = 2


class SlotState(enum.IntEnum):
    EMPTY = 0
    LIVE = 1
    TOMBSTONE = 2


def owner_tag(owner: str) -> int:
    """The tag a slot carries for chunks of ``owner`` (a tenant's name; ``""``: the default
    tenant): the high 48 bits of ``xxh3_64`` of its UTF-8 name. Two owners share a tag with
    probability 2**-48 (docs/dram-arena.md, "Owner tags", says what that would mean)."""
    return xxhash.xxh3_64_intdigest(owner.encode()) >> (64 - TAG_BITS)


def split_owner_tag(tag: int) -> tuple[int, int]:
    """(low 16 bits, high 32 bits) of a tag, as a slot stores them."""
    return tag & 0xFFFF, tag >> 16


def lease_free_supported() -> bool:
    """True where the seqlock is correct without explicit barriers: Linux on x86-64
    (``read_index``'s docstring, "Memory ordering")."""
    return platform.system() == "Linux" and platform.machine().lower() in ("x86_64", "amd64")

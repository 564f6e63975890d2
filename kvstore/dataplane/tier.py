"""The storage tier contract shared by HBM, pinned DRAM and NVMe.

A *tier* stores immutable chunks of bytes under opaque keys. It knows nothing
about prefixes, eviction or other tiers: the tiered cache
(:mod:`kvstore.node.cache`) decides what lives where and moves chunks between
tiers with the calls below. Every implementation runs the conformance suite in
``tests/dataplane/tier_conformance.py``.

Ownership and lifetime
    * ``put`` copies out of the caller's buffer before it returns; the caller
      keeps ownership of ``src``.
    * ``get_into`` copies into the caller's buffer; the tier never keeps a
      reference to ``dst``.
    * ``HostMemoryTier.view`` returns a zero-copy view into the tier's own
      memory. It is valid until the chunk is removed. The tier does **not**
      reference-count views: the cache pins a chunk while any view or lease on
      it is outstanding and never removes a pinned chunk.
    * ``reserve`` hands out a writable slot in the tier's memory. The chunk is
      invisible (``contains`` is False, ``get_into`` raises ``ChunkNotFound``)
      until ``commit``; ``abort`` frees the slot. A slot neither committed nor
      aborted leaks its space until the tier is closed, so callers use
      ``try/finally``.

Errors
    Per call, from :mod:`kvstore.errors`: ``ChunkNotFound`` (unknown key),
    ``ChunkExists`` (key already committed: chunks are immutable),
    ``SizeMismatch`` (``dst`` is not exactly the chunk's size), ``CapacityError``
    / ``DiskFull`` (no room; nothing already stored is affected),
    ``ChunkCorrupt`` (checksum mismatch: the chunk is dropped by the tier
    before raising, and never returned), ``TierUnavailable`` (closed, or the
    hardware is missing). A miss on ``contains`` / ``size_of`` is not an error.

Thread safety
    All methods may be called from any thread concurrently. Bulk copies run
    without holding the tier's internal lock, so two large transfers proceed in
    parallel.

Eviction
    A tier never evicts on its own. ``put``/``reserve`` raise ``CapacityError``
    when there is no room, and the cache evicts (via ``remove``) and retries.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NewType, Protocol, runtime_checkable

from kvstore.errors import InvalidArgument

ChunkKey = NewType("ChunkKey", bytes)
"""Opaque key of one chunk. The data plane never interprets it (1 to 64 bytes)."""

MAX_KEY_BYTES = 64

# A host buffer: anything exposing the buffer protocol (bytes, bytearray, memoryview,
# numpy arrays, mmap) or a CPU torch tensor. The HBM tier also accepts CUDA tensors.
Buffer = Any


class TierKind(enum.Enum):
    """Storage tiers, fastest first. ``order`` is the demotion order."""

    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"

    @property
    def order(self) -> int:
        return _TIER_ORDER[self]

    def below(self) -> TierKind | None:
        """The tier a chunk is demoted to when evicted from this one (None: dropped)."""
        idx = _TIER_ORDER[self] + 1
        return _TIERS_BY_ORDER[idx] if idx < len(_TIERS_BY_ORDER) else None


_TIERS_BY_ORDER = (TierKind.HBM, TierKind.DRAM, TierKind.NVME)
_TIER_ORDER = {kind: i for i, kind in enumerate(_TIERS_BY_ORDER)}


def check_key(key: bytes) -> ChunkKey:
    """Validate a key's type and length; return it typed as a ``ChunkKey``."""
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:
        # The common case, on every hot path (several times per chunk of a batch): no copy, no
        # NewType call (ChunkKey(k) is k).
        return key  # type: ignore[return-value]
    if not isinstance(key, bytes | bytearray):
        raise InvalidArgument(f"chunk key must be bytes, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument(f"chunk key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")
    return ChunkKey(bytes(key))


@dataclass(slots=True)
class ChunkInfo:
    """What a tier knows about one committed chunk (a fresh one per call: treat as immutable).
    Not a frozen dataclass: a batch commit builds one per chunk, and a frozen one's
    constructor costs ~1.2 µs here against ~0.15 µs (each field through
    ``object.__setattr__``)."""

    key: ChunkKey
    size_bytes: int
    tier: TierKind
    checksum: int | None = None
    """xxh3_64 of the bytes where the tier keeps one (NVMe always; memory tiers may not)."""
    meta: bytes = b""
    """Opaque caller metadata kept with the chunk by persistent tiers (the cache stores the
    parent key there, so the prefix chain survives a restart); empty elsewhere."""
    owner: bytes = b""
    """Opaque owner label kept with the chunk by persistent tiers (the cache stores the owning
    tenant's name there, so ownership survives a restart); empty elsewhere, and for chunks
    stored without one."""


@dataclass(frozen=True, slots=True)
class TierStats:
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    chunks: int
    largest_free_bytes: int
    """The biggest single chunk that would fit now without evicting anything."""
    corrupt_at_open: int = 0
    """Corruption a persistent tier found and dropped when it opened, before any cache saw
    its chunks (NVMe: ``RecoveryReport.corrupt_found``). Corruption found later, by reads,
    is counted by the cache (``TierCounters.corrupt``); the daemon reports the sum."""

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


@runtime_checkable
class Tier(Protocol):
    """One storage tier. See the module docstring for ownership, errors and threading."""

    @property
    def kind(self) -> TierKind: ...

    @property
    def capacity_bytes(self) -> int: ...

    def put(self, key: bytes, src: Buffer) -> ChunkInfo:
        """Store a copy of ``src`` under ``key``. Raises ChunkExists, CapacityError, DiskFull."""
        ...

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Copy the chunk into ``dst`` (exactly its size); return the byte count.

        Raises ChunkNotFound, SizeMismatch, ChunkCorrupt.
        """
        ...

    def contains(self, key: bytes) -> bool: ...

    def size_of(self, key: bytes) -> int | None:
        """The chunk's size, or None when the tier does not hold it."""
        ...

    def remove(self, key: bytes) -> bool:
        """Free the chunk's space at once. Returns False when the key was not held."""
        ...

    def chunks(self) -> Iterator[ChunkInfo]:
        """Every committed chunk (a snapshot; used to rebuild the index after a restart)."""
        ...

    def stats(self) -> TierStats: ...

    def close(self) -> None:
        """Release memory / flush files. Idempotent. Later calls raise TierUnavailable."""
        ...


@runtime_checkable
class HostMemoryTier(Tier, Protocol):
    """A tier in host-addressable memory: zero-copy views and in-place writes."""

    def view(self, key: bytes) -> memoryview:
        """A read-only zero-copy view of the chunk (see lifetime rules above). Raises ChunkNotFound."""
        ...

    def reserve(self, key: bytes, size_bytes: int) -> WriteSlot:
        """Allocate an invisible writable slot. Raises ChunkExists, CapacityError."""
        ...

    def commit(self, slot: WriteSlot) -> ChunkInfo:
        """Make the slot's chunk visible. Raises InvalidArgument for a foreign or finished slot."""
        ...

    def abort(self, slot: WriteSlot) -> None:
        """Free an uncommitted slot. Idempotent."""
        ...


@runtime_checkable
class BatchHostMemoryTier(HostMemoryTier, Protocol):
    """A host-memory tier that reserves and commits a batch in one bookkeeping round. Per item
    the outcome is what ``reserve``/``commit`` would have returned or raised for it (an item that
    failed holds nothing); items are handled in order."""

    def reserve_many(self, keys: Sequence[bytes], sizes_bytes: Sequence[int]
                     ) -> list[Any]:
        """Per item a ``WriteSlot`` or the ``KvtierError`` ``reserve`` would have raised."""
        ...

    def commit_many(self, slots: Sequence[Any], after: Sequence[int] | None = None
                    ) -> list[Any]:
        """Per slot a ``ChunkInfo`` or the ``KvtierError`` ``commit`` would have raised. With
        ``after``, slot ``i`` is committed only if the earlier slot ``after[i]`` (>= 0) was,
        else it fails; a slot that failed is left as it was (the caller aborts it)."""
        ...


@runtime_checkable
class PersistentTier(Tier, Protocol):
    """A tier whose chunks survive a restart or ``kill -9`` (NVMe).

    Besides the bytes it keeps up to ``MAX_META_BYTES`` of opaque caller metadata and up to
    ``MAX_OWNER_BYTES`` of opaque owner label per chunk, written atomically with the chunk and
    returned by ``chunks()`` in ``ChunkInfo.meta`` and ``ChunkInfo.owner``.
    """

    def put_with_meta(self, key: bytes, src: Buffer, meta: bytes, owner: bytes = b""
                      ) -> ChunkInfo:
        """``put`` that also persists ``meta`` and ``owner``. Raises InvalidArgument when either
        is too long."""
        ...


MAX_META_BYTES = 64
MAX_OWNER_BYTES = 128


class WriteSlot(Protocol):
    """A reserved, not yet visible chunk. ``buffer`` is exactly ``size_bytes`` long and writable."""

    @property
    def key(self) -> ChunkKey: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def buffer(self) -> memoryview: ...

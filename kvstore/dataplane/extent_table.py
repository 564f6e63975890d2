"""The chunk table of the memory tiers (DRAM, HBM): which chunk lies where in the arena.

:class:`ExtentTable` wraps the arena's :class:`~kvstore.dataplane.allocator.ExtentAllocator`
with a lock, the key index, pending writes and readers in flight, so a tier can do its bulk
copies outside the lock; :class:`ExtentPublisher` is its hook for readers outside the tier
(the same-host read index); :class:`ExtentTableTier` answers the Tier methods that need only
the table.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

from kvstore.dataplane.allocator import ExtentAllocator
from kvstore.dataplane.compress import CodecKind
from kvstore.dataplane.tier import ChunkInfo, ChunkKey, TierKind, TierStats, check_key
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    KvtierError,
    TierUnavailable,
)


class Extent:
    """One committed chunk's place in an arena. Mutable only under the table's lock."""

    __slots__ = ("codec", "key", "offset", "readers", "removed", "size_bytes", "stored_bytes")

    def __init__(
        self, key: ChunkKey, offset: int, stored_bytes: int, size_bytes: int, codec: CodecKind
    ) -> None:
        self.key = key
        self.offset = offset
        self.stored_bytes = stored_bytes
        """Bytes occupied in the arena (the compressed size when ``codec`` is not NONE)."""
        self.size_bytes = size_bytes
        """The chunk's logical size: what ``get_into`` fills."""
        self.codec = codec
        self.readers = 0
        """Copies out of this extent in flight: its space is not reused until they end."""
        self.removed = False


class ExtentPublisher(Protocol):
    """Told where committed chunks lie, for readers outside the tier (the same-host read index,
    :class:`~kvstore.dataplane.read_index.ReadIndex`).

    :class:`ExtentTable` calls these under its lock. ``unpublish`` runs **before** the extent's
    space can be reused (before ``free``, and before a removed extent's last reader releases it),
    on every path that ends a committed chunk: remove, drop (corruption) and close. Only extents
    stored raw (``CodecKind.NONE``) are published, each with its ``owner`` (the tenant that
    owns the chunk, an opaque name here; ``""``: the default tenant), as the table's writer
    gave it. The calls must be quick and must not call back into the table; ``publish`` may
    decline (a full index) by returning False.
    """

    def publish(self, key: bytes, offset: int, size_bytes: int, owner: str = "") -> bool: ...

    def publish_many(self, items: Sequence[tuple[bytes, int, int, str]]) -> int:
        """``publish`` each ``(key, offset, size_bytes, owner)`` in order; return how many
        were published."""
        ...

    def unpublish(self, key: bytes) -> bool: ...

    def clear(self) -> None: ...


class ExtentTable:
    """Thread-safe bookkeeping of a memory tier: allocator, committed chunks, pending writes.

    The tier does its bulk copies *outside* this lock, so the table makes them safe:

    * a write first ``begin_write``s (the key is then *pending*: invisible, and a second
      writer of the same key gets ``ChunkBusy``), copies, then ``commit_write``s or
      ``abort_write``s with the same ``token``;
    * a read ``acquire``s the extent (``readers += 1``), copies, then ``release``s it. A
      ``remove`` during the copy hides the key at once but frees the space only when the
      last reader releases it, so a concurrent put can never overwrite bytes being read.
    """

    def __init__(self, allocator: ExtentAllocator, *, where: str,
                 publisher: ExtentPublisher | None = None) -> None:
        self._allocator = allocator
        self._where = where
        self._publisher = publisher
        self._lock = threading.Lock()
        self._committed: dict[ChunkKey, Extent] = {}
        self._pending: dict[ChunkKey, object] = {}
        self._closed = False

    @property
    def allocator(self) -> ExtentAllocator:
        return self._allocator

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"{self._where} is closed")

    def check_open(self) -> None:
        """Raise TierUnavailable when closed."""
        with self._lock:
            self._check_open()

    # --- writes -------------------------------------------------------------------------------

    def begin_write(self, key: ChunkKey, stored_bytes: int, token: object) -> int:
        """Make ``key`` pending under ``token`` and allocate its space; return the offset.

        Raises TierUnavailable, ChunkExists, ChunkBusy (already pending), CapacityError.
        """
        with self._lock:
            self._check_open()
            if key in self._committed:
                raise ChunkExists(f"chunk {key.hex()} is already stored in {self._where}")
            if key in self._pending:
                raise ChunkBusy(f"chunk {key.hex()} is being written to {self._where}")
            offset = self._allocator.allocate(stored_bytes)
            self._pending[key] = token
            return offset

    def allocate_raw(self, stored_bytes: int) -> int:
        """Allocate space outside any key (a pending write moving its bytes, e.g. compressed)."""
        with self._lock:
            self._check_open()
            return self._allocator.allocate(stored_bytes)

    def free_raw(self, offset: int) -> None:
        with self._lock:
            if not self._closed:
                self._allocator.free(offset)

    def is_pending(self, key: ChunkKey, token: object) -> bool:
        with self._lock:
            return self._pending.get(key) is token

    def commit_write(
        self,
        key: ChunkKey,
        token: object,
        offset: int,
        stored_bytes: int,
        size_bytes: int,
        codec: CodecKind,
        owner: str = "",
    ) -> Extent:
        """Publish a pending write (to the publisher as ``owner``'s chunk). Raises
        InvalidArgument when ``token`` is not pending."""
        with self._lock:
            self._check_open()
            if self._pending.get(key) is not token:
                raise InvalidArgument(f"write of {key.hex()} is not pending (committed or aborted)")
            del self._pending[key]
            extent = Extent(key, offset, stored_bytes, size_bytes, codec)
            self._committed[key] = extent
            if self._publisher is not None and codec is CodecKind.NONE:
                self._publisher.publish(key, offset, size_bytes, owner)
            return extent

    def begin_write_many(self, items: Sequence[tuple[ChunkKey, int, object]]
                         ) -> list[int | KvtierError]:
        """:meth:`begin_write` for each ``(key, stored_bytes, token)``, in order, in one lock
        round: per item the offset, or the error ``begin_write`` would have raised for it
        (ChunkExists, ChunkBusy, CapacityError; the item then holds nothing). A key twice in
        ``items`` is ChunkBusy the second time. Raises TierUnavailable (closed)."""
        out: list[int | KvtierError] = []
        with self._lock:
            self._check_open()
            committed, pending, allocate = self._committed, self._pending, self._allocator.allocate
            for key, stored_bytes, token in items:
                if key in committed:
                    out.append(ChunkExists(f"chunk {key.hex()} is already stored in "
                                           f"{self._where}"))
                elif key in pending:
                    out.append(ChunkBusy(f"chunk {key.hex()} is being written to {self._where}"))
                else:
                    try:
                        offset = allocate(stored_bytes)
                    except CapacityError as exc:
                        out.append(exc)
                        continue
                    pending[key] = token
                    out.append(offset)
        return out

    def commit_raw_many(self, items: Sequence[tuple[ChunkKey, object, int, int]],
                        after: Sequence[int] | None = None,
                        owners: Sequence[str] | None = None) -> list[Extent | InvalidArgument]:
        """:meth:`commit_write` of raw (``CodecKind.NONE``) writes, each ``(key, token, offset,
        size_bytes)`` (published as ``owners[i]``'s; None: all the default tenant's ``""``),
        in order, in one lock round: per item its extent (published), or
        InvalidArgument where the write is not pending under that token, or where ``after[i]``
        (the position in ``items`` of an item that must be committed first: a parent; -1 for
        none) failed. A failed item stays as it was (pending: the caller aborts it), so a
        child is never published, not even for a moment, without its parent. Raises
        TierUnavailable (closed)."""
        out: list[Extent | InvalidArgument] = []
        none = CodecKind.NONE
        publish: list[tuple[bytes, int, int, str]] = []
        with self._lock:
            self._check_open()
            committed, pending = self._committed, self._pending
            for i, (key, token, offset, size_bytes) in enumerate(items):
                first = -1 if after is None else after[i]
                if first >= 0 and (first >= i or not isinstance(out[first], Extent)):
                    out.append(InvalidArgument(f"write of {key.hex()} must follow the write "
                                               "before it in the batch, which failed"))
                    continue
                if pending.get(key) is not token:
                    out.append(InvalidArgument(f"write of {key.hex()} is not pending "
                                               "(committed or aborted)"))
                    continue
                del pending[key]
                extent = Extent(key, offset, size_bytes, size_bytes, none)
                committed[key] = extent
                publish.append((key, offset, size_bytes, "" if owners is None else owners[i]))
                out.append(extent)
            # Still under the lock (as ``commit_write``): nothing here can be removed and
            # reused before its publication; a child follows its parent in the index too.
            if self._publisher is not None and publish:
                self._publisher.publish_many(publish)
        return out

    def abort_write(self, key: ChunkKey, token: object, offset: int) -> bool:
        """Drop a pending write and free its space; False when it was not pending (idempotent)."""
        with self._lock:
            if self._pending.get(key) is not token:
                return False
            del self._pending[key]
            if not self._closed:
                self._allocator.free(offset)
            return True

    # --- reads --------------------------------------------------------------------------------

    def get(self, key: ChunkKey) -> Extent | None:
        with self._lock:
            self._check_open()
            return self._committed.get(key)

    def acquire(self, key: ChunkKey) -> Extent:
        """Pin a committed extent for a copy out of it. Raises ChunkNotFound, TierUnavailable."""
        with self._lock:
            self._check_open()
            extent = self._committed.get(key)
            if extent is None:
                raise ChunkNotFound(key, self._where)
            extent.readers += 1
            return extent

    def release(self, extent: Extent) -> None:
        """End a copy started by :meth:`acquire`; frees the space of a removed extent."""
        with self._lock:
            extent.readers -= 1
            if extent.removed and extent.readers == 0 and not self._closed:
                self._allocator.free(extent.offset)

    # --- removal, listing ---------------------------------------------------------------------

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            self._check_open()
            extent = self._committed.pop(key, None)
            if extent is None:
                return False
            if self._publisher is not None:
                self._publisher.unpublish(key)  # before the space can be reused
            extent.removed = True
            if extent.readers == 0:
                self._allocator.free(extent.offset)
            return True

    def drop(self, extent: Extent) -> None:
        """Remove ``extent`` if it is still the committed one for its key (corrupt chunks)."""
        with self._lock:
            if self._committed.get(extent.key) is extent:
                del self._committed[extent.key]
                if self._publisher is not None:
                    self._publisher.unpublish(extent.key)
                extent.removed = True
                if extent.readers == 0 and not self._closed:
                    self._allocator.free(extent.offset)

    def snapshot(self) -> list[Extent]:
        with self._lock:
            self._check_open()
            return list(self._committed.values())

    def usage(self) -> tuple[int, int, int]:
        """``(used_bytes, committed chunks, largest_free_bytes)`` read atomically."""
        with self._lock:
            self._check_open()
            a = self._allocator
            return a.used_bytes, len(self._committed), a.largest_free_bytes

    def close(self) -> bool:
        """Forget everything; True the first time. Readers in flight finish on their own views."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            if self._publisher is not None:
                self._publisher.clear()
            self._committed.clear()
            self._pending.clear()
            self._allocator.reset()
            return True


class ExtentTableTier:
    """The Tier methods that memory tiers (DRAM, HBM) answer from their :class:`ExtentTable` alone.

    Subclasses set ``self._table`` and ``_KIND`` and implement the copies (put, get_into, ...).
    """

    _KIND: TierKind
    _table: ExtentTable

    @property
    def kind(self) -> TierKind:
        return self._KIND

    @property
    def capacity_bytes(self) -> int:
        return self._table.allocator.capacity_bytes

    def contains(self, key: bytes) -> bool:
        return self._table.get(check_key(key)) is not None

    def size_of(self, key: bytes) -> int | None:
        extent = self._table.get(check_key(key))
        return None if extent is None else extent.size_bytes

    def remove(self, key: bytes) -> bool:
        """Free the chunk (at once, or when a copy out of it in flight ends). False on a miss."""
        return self._table.remove(check_key(key))

    def chunks(self) -> Iterator[ChunkInfo]:
        return iter([ChunkInfo(e.key, e.size_bytes, self._KIND) for e in self._table.snapshot()])

    def stats(self) -> TierStats:
        used, count, largest = self._table.usage()
        return TierStats(self._KIND, self.capacity_bytes, used, count, largest)

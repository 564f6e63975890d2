"""A simple, real :class:`~kvstore.dataplane.transport.base.LeaseBackend` over Python memory.

For standalone transport servers (``python -m kvstore.dataplane.transport.tcp``), the transport
tests and the data-path benchmark. The store daemon does not use it: it implements the same
Protocol over its tiered cache. The lease semantics are the real ones (pins, invisible
uncommitted writes, ``ChunkBusy``), only the memory management is naive: one ``bytearray`` per
chunk.

Pre-touched reuse: a freshly allocated large ``bytearray`` is backed by untouched pages, and the
first write into it runs at 0.4-11 GB/s (page faults, see FIELD-NOTES) instead of ~20. The
daemon's arenas are pre-touched, so to measure the transport rather than the page-fault handler
this backend keeps the buffers of removed or aborted chunks, by exact size, up to
``recycle_limit_bytes``, and hands them to the next ``open_write`` of that size. Their old
contents are overwritten before they become visible again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvstore.dataplane.tier import ChunkKey, check_key
from kvstore.dataplane.transport.base import ViewReadLease
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    SizeMismatch,
)


@dataclass(slots=True)
class _Entry:
    data: bytearray
    pins: int = 0


class MemoryReadLease(ViewReadLease):
    """A pin on one committed chunk of a :class:`MemoryBackend`."""

    __slots__ = ("_backend",)

    def __init__(self, backend: MemoryBackend, key: ChunkKey, view: memoryview) -> None:
        super().__init__(key, view)
        self._backend = backend

    def release(self) -> None:
        if self._view is not None:
            self._view = None
            self._backend._unpin(self._key)


class MemoryWriteLease:
    """A reserved, invisible chunk of a :class:`MemoryBackend`."""

    __slots__ = ("_backend", "_data", "_key", "_state")

    def __init__(self, backend: MemoryBackend, key: ChunkKey, data: bytearray) -> None:
        self._backend = backend
        self._key = key
        self._data = data
        self._state = "open"

    @property
    def key(self) -> ChunkKey:
        return self._key

    @property
    def size_bytes(self) -> int:
        return len(self._data)

    @property
    def buffer(self) -> memoryview:
        if self._state != "open":
            raise InvalidArgument(f"write lease on {self._key.hex()} is {self._state}")
        return memoryview(self._data)

    def commit(self) -> None:
        if self._state != "open":
            raise InvalidArgument(f"write lease on {self._key.hex()} is already {self._state}")
        self._state = "committed"
        self._backend._commit(self._key, self._data)

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._backend._abort(self._key, self._data)


class MemoryBackend:
    """Chunks in ``bytearray``s behind read and write leases. Thread-safe.

    ``capacity_bytes`` bounds committed plus reserved bytes (``CapacityError`` beyond it; None:
    unbounded). Nothing is allocated until the first ``open_write``.
    """

    def __init__(self, capacity_bytes: int | None = None,
                 recycle_limit_bytes: int = 1 << 30) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise InvalidArgument(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if recycle_limit_bytes < 0:
            raise InvalidArgument(f"recycle_limit_bytes must be >= 0, got {recycle_limit_bytes}")
        self._capacity_bytes = capacity_bytes
        self._recycle_limit_bytes = recycle_limit_bytes
        self._lock = threading.Lock()
        self._committed: dict[ChunkKey, _Entry] = {}
        self._writing: set[ChunkKey] = set()
        self._used_bytes = 0
        self._free: dict[int, list[bytearray]] = {}
        self._free_bytes = 0

    # --- LeaseBackend -------------------------------------------------------------------------

    def open_read(self, key: bytes) -> MemoryReadLease:
        k = check_key(key)
        with self._lock:
            entry = self._committed.get(k)
            if entry is None:
                raise ChunkNotFound(k, "memory backend")
            entry.pins += 1
            view = memoryview(entry.data).toreadonly()
        return MemoryReadLease(self, k, view)

    def read_into(self, key: bytes, dst: memoryview) -> int:
        k = check_key(key)
        with self._lock:
            entry = self._committed.get(k)
            if entry is None:
                raise ChunkNotFound(k, "memory backend")
            size = len(entry.data)
            if len(dst) != size:
                raise SizeMismatch(f"read_into {k.hex()}", expected=size, actual=len(dst))
            # Under the lock: a chunk is never freed (or recycled) while it is copied.
            dst[:] = entry.data
        return size

    def open_write(self, key: bytes, size_bytes: int) -> MemoryWriteLease:
        k = check_key(key)
        if not isinstance(size_bytes, int) or size_bytes < 0:
            raise InvalidArgument(f"size_bytes must be an int >= 0, got {size_bytes!r}")
        with self._lock:
            if k in self._committed:
                raise ChunkExists(f"chunk {k.hex()} is already stored")
            if k in self._writing:
                raise ChunkBusy(f"chunk {k.hex()} is being written")
            if self._capacity_bytes is not None and \
                    self._used_bytes + size_bytes > self._capacity_bytes:
                raise CapacityError(
                    f"memory backend full: {size_bytes} bytes requested, "
                    f"{self._capacity_bytes - self._used_bytes} of {self._capacity_bytes} free")
            self._writing.add(k)
            self._used_bytes += size_bytes
            spares = self._free.get(size_bytes)
            data = spares.pop() if spares else None
            if data is not None:
                self._free_bytes -= size_bytes
        if data is None:
            # Allocated outside the lock: a large calloc may take a while.
            data = bytearray(size_bytes)
        return MemoryWriteLease(self, k, data)

    def exists(self, key: bytes) -> bool:
        return check_key(key) in self._committed

    def size_of(self, key: bytes) -> int | None:
        entry = self._committed.get(check_key(key))
        return None if entry is None else len(entry.data)

    def remove(self, key: bytes) -> bool:
        k = check_key(key)
        with self._lock:
            entry = self._committed.get(k)
            if entry is None:
                return False
            if entry.pins:
                raise ChunkBusy(f"chunk {k.hex()} has {entry.pins} read lease(s) outstanding")
            del self._committed[k]
            self._used_bytes -= len(entry.data)
            self._recycle_locked(entry.data)
        return True

    # --- introspection (tests, benchmarks) ----------------------------------------------------

    def pins_of(self, key: bytes) -> int:
        """Outstanding read leases on a committed chunk (0 when not held)."""
        entry = self._committed.get(check_key(key))
        return 0 if entry is None else entry.pins

    @property
    def used_bytes(self) -> int:
        """Committed plus reserved bytes."""
        return self._used_bytes

    @property
    def writes_in_progress(self) -> int:
        return len(self._writing)

    # --- lease callbacks ----------------------------------------------------------------------

    def _unpin(self, key: ChunkKey) -> None:
        with self._lock:
            self._committed[key].pins -= 1

    def _commit(self, key: ChunkKey, data: bytearray) -> None:
        with self._lock:
            self._writing.discard(key)
            self._committed[key] = _Entry(data)

    def _abort(self, key: ChunkKey, data: bytearray) -> None:
        with self._lock:
            self._writing.discard(key)
            self._used_bytes -= len(data)
            self._recycle_locked(data)

    def _recycle_locked(self, data: bytearray) -> None:
        if data and self._free_bytes + len(data) <= self._recycle_limit_bytes:
            self._free.setdefault(len(data), []).append(data)
            self._free_bytes += len(data)

"""kvtier's one error hierarchy.

Every error a caller can see derives from :class:`KvtierError`. OS, gRPC and
library errors are translated at the boundary into the most specific class
below and chained (``raise ChunkCorrupt(...) from exc``). A cache *miss* is not
an error: lookups return a count, ``None`` or a bitmap. A broken internal
invariant is a bug and raises :class:`InvariantViolation`.

::

    KvtierError
    ├── ConfigError                 bad config value, file or flag
    ├── InvalidArgument             malformed input from a caller
    │   └── SizeMismatch            buffer or chunk of the wrong size
    ├── ChunkNotFound               explicit read/remove of a key no tier holds
    ├── ChunkExists                 put of a key that is already committed
    ├── ChunkBusy                   pinned / leased / being written: cannot evict or remove now
    ├── CapacityError               a tier cannot make room
    │   └── DiskFull                the filesystem under the NVMe tier is full (ENOSPC/EDQUOT)
    ├── ChunkCorrupt                checksum mismatch, torn or truncated record
    ├── StorageError                I/O failed for a reason other than full or corrupt
    ├── TierUnavailable             the tier cannot run here (no GPU, no O_DIRECT, closed)
    ├── TransportError              a data-plane transfer failed
    │   ├── PeerUnavailable         the peer is dead or unreachable
    │   └── ProtocolError           malformed, oversized or truncated frame
    ├── MembershipError             etcd registration / discovery failed
    └── InvariantViolation          a bug in kvtier; please report it

Errors cross process boundaries by class name (:func:`error_name`, :func:`error_from_name`):
the gRPC services put it in trailing metadata (:mod:`kvstore.wire`), the same-host lease
channel in its error replies (:mod:`kvstore.dataplane.transport.shm`).
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError):
    """A configuration value, file or flag is invalid."""


class InvalidArgument(KvtierError, ValueError):
    """A caller passed malformed input (wrong type, negative size, empty key...)."""


class SizeMismatch(InvalidArgument):
    """A buffer or chunk does not have the size the operation needs."""

    def __init__(self, message: str, *, expected: int, actual: int) -> None:
        super().__init__(f"{message} (expected {expected} bytes, got {actual})")
        self.expected = expected
        self.actual = actual


class ChunkNotFound(KvtierError, KeyError):
    """An explicit read or remove named a key that is not stored."""

    def __init__(self, key: bytes, where: str = "") -> None:
        suffix = f" in {where}" if where else ""
        super().__init__(f"chunk {key.hex()} not found{suffix}")
        self.key = key

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ChunkExists(KvtierError):
    """A put named a key that is already committed; chunks are immutable."""


class ChunkBusy(KvtierError):
    """The chunk is pinned, leased or being written and cannot be evicted or removed now."""


class CapacityError(KvtierError):
    """A tier cannot make room for the request (everything left is pinned, or it is too big)."""


class DiskFull(CapacityError):
    """The filesystem under an NVMe tier ran out of space; nothing stored was lost."""


class ChunkCorrupt(KvtierError):
    """Stored bytes failed their checksum or a record was torn; the chunk is dropped, never returned."""


class StorageError(KvtierError):
    """An I/O operation failed for a reason other than a full disk or corruption."""


class TierUnavailable(KvtierError):
    """The tier cannot run on this machine (no GPU, no shared memory) or was closed."""


class TransportError(KvtierError):
    """A data-plane transfer failed."""


class PeerUnavailable(TransportError):
    """The remote peer is dead or unreachable."""


class ProtocolError(TransportError):
    """A frame was malformed, oversized or truncated."""


class MembershipError(KvtierError):
    """Registration in, or discovery through, etcd failed."""


class InvariantViolation(KvtierError, AssertionError):
    """An internal invariant broke: this is a bug in kvtier."""


_ERROR_CLASSES: dict[str, type[KvtierError]] = {
    name: cls for name, cls in list(globals().items())
    if isinstance(cls, type) and issubclass(cls, KvtierError)
}


def error_name(exc: KvtierError) -> str:
    """The name that travels: the most derived kvtier class of ``exc``."""
    for cls in type(exc).__mro__:
        if cls.__name__ in _ERROR_CLASSES and _ERROR_CLASSES[cls.__name__] is cls:
            return cls.__name__
    return "KvtierError"


def error_from_name(name: str, message: str) -> KvtierError:
    """Rebuild an error from its class name and message (constructors are bypassed: some take
    structured arguments the message already spells out). An unknown name is a plain
    :class:`KvtierError`."""
    cls = _ERROR_CLASSES.get(name, KvtierError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    if isinstance(exc, SizeMismatch):
        exc.expected = exc.actual = -1
    if isinstance(exc, ChunkNotFound):
        exc.key = b""
    return exc

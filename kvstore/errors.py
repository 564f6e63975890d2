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
    │   ├── SizeMismatch            buffer or chunk of the wrong size
    │   └── LeaseExpired            a zero-copy view used past its lease's deadline
    ├── ChunkNotFound               explicit read/remove of a key no tier holds
    ├── ChunkExists                 put of a key that is already committed
    ├── ChunkBusy                   pinned / leased / being written: cannot evict or remove now
    ├── CapacityError               a tier cannot make room
    │   ├── DiskFull                the filesystem under the NVMe tier is full (ENOSPC/EDQUOT)
    │   ├── QuotaExceeded           the writer's tenant is at its cap in the tier (docs/tenants.md)
    │   └── TooManyLeases           the daemon holds ``server.max_leases`` leases and pins already
    ├── ChunkCorrupt                checksum mismatch, torn or truncated record
    ├── StorageError                I/O failed for a reason other than full or corrupt
    ├── TierUnavailable             the tier cannot run here (no GPU, no O_DIRECT, closed)
    ├── TransportError              a data-plane transfer failed
    │   ├── PeerUnavailable         the peer is dead or unreachable
    │   └── ProtocolError           malformed, oversized or truncated frame
    ├── MembershipError             etcd registration / discovery failed
    ├── Unauthenticated             no credentials, or credentials that do not verify
    ├── PermissionDenied            authenticated, but not allowed this operation or tenant
    └── InvariantViolation          a bug in kvtier; please report it

Errors cross process boundaries by class name (:func:`error_name`, :func:`error_from_name`):
the gRPC services put it in trailing metadata (:mod:`kvstore.wire`), the same-host lease
channel in its error replies (:mod:`kvstore.dataplane.transport.shm`).
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""

    batch_outcome: list[bool | None] | None = None
    """Set on the refusal a batch put (``put_many``) raises after storing what it could: per
    item ``True`` stored, ``False`` already stored, ``None`` not stored. None on every other
    error (a transport failure mid-batch leaves the outcome unknown)."""


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


class LeaseExpired(InvalidArgument):
    """A zero-copy view was used after its lease's deadline: the daemon may have ended the
    lease and reused the memory, so its bytes can belong to another chunk."""


SHORT_KEY_BYTES = 16
"""Error messages show at most this many bytes of a key (:func:`short_key`)."""


def short_key(key: bytes | bytearray | memoryview) -> str:
    """A key for an error message: its hex when it is short, else the hex of its first
    :data:`SHORT_KEY_BYTES` bytes and its length (a message never echoes a huge key)."""
    raw = bytes(key[:SHORT_KEY_BYTES + 1])
    if len(raw) <= SHORT_KEY_BYTES:
        return raw.hex()
    return f"{raw[:SHORT_KEY_BYTES].hex()}... ({len(key)} bytes)"


class ChunkNotFound(KvtierError, KeyError):
    """An explicit read or remove named a key that is not stored."""

    def __init__(self, key: bytes, where: str = "") -> None:
        suffix = f" in {where}" if where else ""
        shown = key.hex() if len(key) <= 64 else short_key(key)
        super().__init__(f"chunk {shown} not found{suffix}")
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


class QuotaExceeded(CapacityError):
    """The writer's tenant is at its quota (``max_bytes``) in a tier and evicting its own chunks
    there cannot make room; other tenants' chunks are never taken for it. Audited as a refusal."""


class TooManyLeases(CapacityError):
    """The daemon already holds ``server.max_leases`` pins, read leases and reservations for
    clients; a new one is refused until others end (or expire)."""


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


class Unauthenticated(KvtierError):
    """The caller presented no credentials, or credentials that do not verify (expired,
    untrusted, revoked, badly signed)."""


class PermissionDenied(KvtierError):
    """The caller is authenticated but may not do this: the wrong role for the operation, or a
    tenant its identity does not allow."""


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

"""The data-plane transport contracts: what a server mounts, and what a client calls.

Bytes between hosts never travel inside protobuf at full size. A store daemon mounts a
:class:`LeaseBackend` (its tiered cache, pinning chunks while leased) on a transport *server*; an
engine talks to it through a :class:`Transport` *client*. The TCP transport
(:mod:`kvstore.dataplane.transport.tcp`) is the first implementation; UCX comes later and must fit
the same two Protocols.

Server side: the lease backend
    ``open_read(key)`` returns a :class:`ReadLease`: a read-only, zero-copy ``memoryview`` of the
    whole chunk. The view stays valid, and its bytes unchanged, until ``release()``; the backend
    pins the chunk meanwhile (``remove`` of a leased chunk raises ``ChunkBusy``, eviction skips it).
    After ``release()`` the view must not be touched: its memory may be reused at once.

    ``read_into(key, dst)`` copies a committed chunk into ``dst`` (exactly its size) under no
    lease: for small values, where one copy costs less than pinning the chunk for the duration
    of a send (the TCP server uses it for GETs up to ``copy_read_max_bytes``). It counts as a
    read like ``open_read``. ``SizeMismatch`` (``expected`` = the stored size) leaves ``dst``
    untouched.

    ``open_write(key, size_bytes)`` returns a :class:`WriteLease`: a writable ``memoryview`` of
    exactly ``size_bytes`` into the backend's own memory. The chunk is invisible (``exists`` is
    False, ``open_read`` raises ``ChunkNotFound``) until ``commit()``. ``abort()`` frees the space.
    An aborted, or never committed, write is **never** visible, whatever bytes were written; a
    transport aborts the lease whenever a transfer into it fails or its peer disconnects. While a
    write lease on a key is outstanding, a second ``open_write`` of that key raises ``ChunkBusy``.

    Errors (per call, from :mod:`kvstore.errors`): ``ChunkNotFound`` (``open_read`` or
    ``read_into`` of an unknown key), ``SizeMismatch`` (``read_into`` with a wrong-size buffer), ``ChunkExists`` (``open_write`` of a committed key: chunks are immutable), ``ChunkBusy``
    (key leased or being written), ``CapacityError`` / ``DiskFull`` (no room), ``InvalidArgument``
    (malformed key or size), ``TierUnavailable`` (closed). A miss on ``exists`` / ``size_of`` /
    ``remove`` is not an error.

    Thread safety: every method may be called from any thread; leases are used by one thread at a
    time, but many leases (read and write) are outstanding at once and their buffers are filled or
    drained concurrently, without the backend's lock held.

Client side: the transport
    ``put`` reads ``src`` and ``get_into`` writes ``dst`` only during the call; the transport keeps
    no reference to either after it returns, and the caller must not touch ``dst`` meanwhile. A
    ``get_into`` that fails leaves ``dst`` with unspecified contents. ``put`` is all or nothing: the
    value becomes visible to other clients only once every byte has arrived.

    Errors: ``ChunkNotFound`` (``get``/``get_into`` of a key the peer does not hold), ``ChunkExists``,
    ``ChunkBusy``, ``CapacityError`` (as raised by the peer's backend), ``SizeMismatch`` (``dst`` is
    not exactly the value's size; no bytes were transferred), ``InvalidArgument`` (bad key, value
    over the configured maximum), ``PeerUnavailable`` (connection refused, reset, closed or timed
    out: a transport that cannot detect a dead peer on its own, as UCX over CMA cannot, bounds every
    wait with a timeout and raises this), ``ProtocolError`` (the peer sent a malformed frame, or
    rejected ours). A failed call never leaves a half-written value visible on the peer.

    Thread safety: one client may be shared by many threads; calls proceed in parallel up to the
    client's connection count.

    Ordering: requests on one connection are served in order, but a client's pooled connections
    are not ordered with each other. A server that sends a get from a read lease releases it
    just after the last byte has left, so a ``remove`` issued right behind such a get that used
    another connection (any striped get) may still find the chunk leased and raise
    ``ChunkBusy`` for a moment. Small gets that the server copies out with ``read_into`` (TCP:
    up to ``copy_read_max_bytes``) hold no lease after the copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.dataplane.tier import Buffer, ChunkKey
from kvstore.errors import InvalidArgument


class TransportKind(enum.Enum):
    """Wire protocols a data-plane endpoint may speak."""

    TCP = "tcp"
    UCX = "ucx"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a data-plane server listens: advertised to clients through the control plane.

    A UCX server has no port: clients reach it through its opaque ``worker_address`` (exchanged
    out of band, e.g. in the daemon's gRPC ``Info``), so for ``TransportKind.UCX`` the port is 0
    and ``worker_address`` is required; TCP endpoints carry none.
    """

    kind: TransportKind
    host: str
    port: int
    worker_address: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, TransportKind):
            raise InvalidArgument(f"endpoint kind must be a TransportKind, not {self.kind!r}")
        if not self.host:
            raise InvalidArgument("endpoint host must not be empty")
        if self.kind is TransportKind.UCX:
            if self.port != 0 or not self.worker_address:
                raise InvalidArgument("a UCX endpoint has port 0 and a non-empty worker_address")
            return
        if self.worker_address:
            raise InvalidArgument("only UCX endpoints carry a worker_address")
        if not 0 < self.port < 65536:
            raise InvalidArgument(f"endpoint port must be 1..65535, got {self.port}")


class ReadLease(Protocol):
    """A pinned, read-only, zero-copy view of one committed chunk. See the module docstring."""

    @property
    def key(self) -> ChunkKey: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def view(self) -> memoryview:
        """Read-only, exactly ``size_bytes`` long; valid until ``release()``."""
        ...

    def release(self) -> None:
        """Unpin the chunk. Idempotent. The view must not be used afterwards."""
        ...


class WriteLease(Protocol):
    """An invisible, writable slot for one chunk. Exactly one of commit/abort ends it."""

    @property
    def key(self) -> ChunkKey: ...

    @property
    def size_bytes(self) -> int: ...

    @property
    def buffer(self) -> memoryview:
        """Writable, exactly ``size_bytes`` long; valid until ``commit()`` or ``abort()``."""
        ...

    def commit(self) -> None:
        """Make the chunk visible. Raises InvalidArgument when the lease was already ended."""
        ...

    def abort(self) -> None:
        """Free the slot; the chunk never becomes visible. Idempotent; a no-op after commit."""
        ...


@runtime_checkable
class LeaseBackend(Protocol):
    """What a transport server serves: chunks behind read and write leases (module docstring)."""

    def open_read(self, key: bytes) -> ReadLease:
        """Pin a committed chunk and return its view. Raises ChunkNotFound."""
        ...

    def read_into(self, key: bytes, dst: memoryview) -> int:
        """Copy a committed chunk into ``dst`` (exactly its size); return its size. Raises
        ChunkNotFound, SizeMismatch (``expected`` = the stored size; nothing copied)."""
        ...

    def open_write(self, key: bytes, size_bytes: int) -> WriteLease:
        """Reserve an invisible slot. Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument."""
        ...

    def exists(self, key: bytes) -> bool:
        """True when the chunk is committed (a reserved, uncommitted chunk does not exist)."""
        ...

    def size_of(self, key: bytes) -> int | None:
        """The committed chunk's size, or None."""
        ...

    def remove(self, key: bytes) -> bool:
        """Drop a committed chunk. False when not held; raises ChunkBusy while it is leased."""
        ...


@runtime_checkable
class Transport(Protocol):
    """A data-plane client: moves chunk bytes to and from one peer. See the module docstring."""

    def put(self, key: bytes, src: Buffer) -> None:
        """Store ``src`` under ``key`` on the peer, all or nothing."""
        ...

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` (exactly the value's size) with the value; return the byte count."""
        ...

    def get(self, key: bytes) -> bytearray:
        """The whole value in a new buffer. Raises ChunkNotFound."""
        ...

    def exists(self, key: bytes) -> bool: ...

    def size_of(self, key: bytes) -> int | None: ...

    def remove(self, key: bytes) -> bool:
        """Drop the value on the peer. False when the peer did not hold it."""
        ...

    def close(self) -> None:
        """Close every connection. Idempotent; later calls raise PeerUnavailable."""
        ...


@runtime_checkable
class TransportServer(Protocol):
    """Serves one :class:`LeaseBackend` to remote :class:`Transport` clients."""

    def start(self) -> Endpoint:
        """Bind and begin serving; return the endpoint clients connect to."""
        ...

    @property
    def endpoint(self) -> Endpoint:
        """The bound endpoint. Raises TransportError before ``start()``."""
        ...

    def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop accepting, let in-flight transfers finish for up to ``drain_timeout_s``, then cut
        the rest (their write leases are aborted). Idempotent."""
        ...

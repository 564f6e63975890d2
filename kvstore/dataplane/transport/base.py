"""The data-plane transport contracts: what a server serves, and what a client calls.

Bytes never travel inside protobuf at full size. A store daemon mounts its tiered cache on a
transport *server*; an engine talks to it through a :class:`Transport` *client*. Three
implementations, one conformance suite (``tests/dataplane/transport_conformance.py``):

* TCP (:mod:`.tcp`) and UCX (:mod:`.ucx`), between hosts: the server serves a
  :class:`LeaseBackend` and moves the bytes itself, straight out of a read lease's view or into a
  write lease's buffer;
* shared memory (:mod:`.shm`), on one host: the client maps the peer's DRAM arena and copies the
  bytes itself; the server serves an :class:`ArenaLeaseBackend` (leases by id, with arena offsets)
  over a Unix socket and never touches a byte. Its client is a :class:`MappedTransport`.

Server side: the lease backend (TCP, UCX)
    ``open_read(key)`` returns a :class:`ReadLease`: a read-only, zero-copy ``memoryview`` of the
    whole chunk. The view stays valid, and its bytes unchanged, until ``release()``; the backend
    pins the chunk meanwhile (``remove`` of a leased chunk raises ``ChunkBusy``, eviction skips it).
    After ``release()`` the view must not be touched: its memory may be reused at once.

    ``read_into(key, dst)`` copies a committed chunk into ``dst`` (exactly its size) under no
    lease: for small values, where one copy costs less than pinning the chunk for the duration
    of a send (the TCP server uses it for GETs up to ``copy_read_max_bytes``, UCX for inline
    GETs). It counts as a read like ``open_read``. ``SizeMismatch`` (``expected`` = the stored
    size) leaves ``dst`` untouched.

    ``open_write(key, size_bytes)`` returns a :class:`WriteLease`: a writable ``memoryview`` of
    exactly ``size_bytes`` into the backend's own memory. The chunk is invisible (``exists`` is
    False, ``open_read`` raises ``ChunkNotFound``) until ``commit()``. ``abort()`` frees the space.
    An aborted, or never committed, write is **never** visible, whatever bytes were written; a
    transport aborts the lease whenever a transfer into it fails or its peer disconnects. While a
    write lease on a key is outstanding, a second ``open_write`` of that key raises ``ChunkBusy``.

    Errors (per call, from :mod:`kvstore.errors`): ``ChunkNotFound`` (``open_read`` or
    ``read_into`` of an unknown key), ``SizeMismatch`` (``read_into`` with a wrong-size buffer),
    ``ChunkExists`` (``open_write`` of a committed key: chunks are immutable), ``ChunkBusy``
    (key leased or being written), ``CapacityError`` / ``DiskFull`` (no room), ``InvalidArgument``
    (malformed key or size), ``TierUnavailable`` (closed). A miss on ``exists`` / ``size_of`` /
    ``remove`` is not an error.

    Thread safety: every method may be called from any thread; leases are used by one thread at a
    time, but many leases (read and write) are outstanding at once and their buffers are filled or
    drained concurrently, without the backend's lock held.

Server side: the arena lease backend (shared memory)
    The same two kinds of lease, by id and with :class:`ArenaRange` offsets into an arena that the
    client maps, because the bytes never pass through the server. ``acquire_read(keys)`` pins
    every key (all or nothing; or the longest cached prefix with ``prefix=True``) until
    ``release(lease_id)``; ``reserve(key, size_bytes)`` hands out an invisible slot until
    ``commit`` or ``abort``. Each lease has an *owner* (the connection that took it) and only
    its owner ends it: ``release``, ``commit`` and ``abort`` with another owner treat the id as
    unknown and change nothing, and ids are unguessable, so no client can end (and let the
    cache reuse the memory under) another client's lease. ``drop_owner`` ends every lease of a
    connection that closed (a client that died mid-put never makes its chunk visible; one that
    died mid-get unpins), and a lease past its TTL may be ended by the backend: a read lease's
    bytes are stable until its owner releases it or its TTL (counted from the request) runs
    out, whichever comes first. Same errors and thread safety as :class:`LeaseBackend`.

Client side: the transport
    Buffers: ``put`` reads ``src`` and ``get_into`` writes ``dst`` only during the call; the
    transport keeps no reference to either after it returns, and the caller must not touch
    ``dst`` meanwhile. A ``get_into`` that fails leaves ``dst`` with unspecified contents, except
    that a ``SizeMismatch`` or ``ChunkNotFound`` leaves it untouched. ``get`` returns a new buffer
    that the caller owns. ``put`` is all or nothing: the value becomes visible to other clients
    only once every byte has arrived, and a failed call never leaves a half-written value visible
    on the peer.

    Per-call errors (the call did nothing the caller can see; the client stays usable):
    ``ChunkNotFound`` (``get``/``get_into`` of a key the peer does not hold), ``ChunkExists``,
    ``ChunkBusy``, ``CapacityError`` (as raised by the peer's backend), ``SizeMismatch`` (``dst``
    is not exactly the value's size; no bytes were transferred), ``InvalidArgument`` (bad key,
    buffer or value over the configured maximum; refused before anything is sent),
    ``TierUnavailable`` (the peer is draining). Transport errors: ``PeerUnavailable`` (connection
    refused, reset, closed or timed out: a transport that cannot detect a dead peer on its own,
    as UCX over CMA cannot, bounds every wait with a timeout and raises this), ``ProtocolError``
    (the peer sent a malformed frame, or rejected ours); the connection that saw one is
    discarded, and the next call uses a fresh one. Misses on ``exists`` / ``size_of`` /
    ``remove`` are not errors.

    Per-key outcomes (:class:`BatchTransport`): ``get_many_into`` reports a miss as None in its
    result and ``put_many`` an already stored key as False; any other refusal is raised after
    the whole batch ran (the other buffers are filled, the other values stored).

    Thread safety: one client may be shared by many threads; calls proceed in parallel up to the
    client's connection count.

    Ordering: requests on one connection are served in order, but a client's pooled connections
    are not ordered with each other. A server that sends a get from a read lease releases it
    just after the last byte has left, so a ``remove`` issued right behind such a get that used
    another connection (any striped get) may still find the chunk leased and raise
    ``ChunkBusy`` for a moment. Small gets that the server copies out with ``read_into`` (TCP:
    up to ``copy_read_max_bytes``) hold no lease after the copy. The shared-memory client ends a
    read lease with a message it does not wait for; its own ``remove`` and ``sync`` wait until
    the peer has processed those.

Client side: the mapped transport (shared memory)
    A :class:`MappedTransport` also lends the peer's memory itself, under the same leases the
    server's backend hands out: ``open_read(key)`` returns a :class:`ReadLease` whose ``view`` is
    the chunk in the mapped arena (valid until ``release()``, which the caller must call; the
    chunk cannot be evicted or change meanwhile), and ``open_write(key, size_bytes)`` a
    :class:`WriteLease` whose ``buffer`` is an invisible slot of the arena (a zero-copy put: fill
    it, then ``commit()``; ``abort()`` or a dead client frees it). Both views are the peer's
    memory: after the lease ends they must not be touched.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvstore.dataplane.tier import Buffer, ChunkKey
from kvstore.errors import ChunkExists, InvalidArgument, KvtierError, LeaseExpired, TransportError


class TransportKind(enum.Enum):
    """Wire protocols a data-plane endpoint may speak."""

    TCP = "tcp"
    UCX = "ucx"
    SHM = "shm"
    """Same host: a lease channel on an abstract Unix socket, bytes through a mapped arena."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a data-plane server listens: advertised to clients through the control plane.

    A UCX server has no port: clients reach it through its opaque ``worker_address`` (exchanged
    out of band, e.g. in the daemon's gRPC ``Info``), so for ``TransportKind.UCX`` the port is 0
    and ``worker_address`` is required; TCP endpoints carry none. A shared-memory server's
    ``host`` is its lease channel's abstract socket address (``@name``: reachable from this host
    only) and its port is 0.
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
        if self.kind is TransportKind.SHM:
            if self.port != 0 or self.worker_address or not self.host.startswith("@"):
                raise InvalidArgument("a shared-memory endpoint has an abstract @address as its "
                                      "host, port 0 and no worker_address")
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
        """Read-only, exactly ``size_bytes`` long; valid until ``release()`` or
        ``deadline_s``, whichever comes first (LeaseExpired once the deadline passed)."""
        ...

    @property
    def deadline_s(self) -> float | None:
        """``time.monotonic()`` after which the lease may have ended without ``release()``
        (a client's lease on a peer, taken conservatively from the client's clock when it
        asked: request time + TTL), so the view's bytes may belong to another chunk; None
        when the lease lasts until ``release()`` (a server's own lease)."""
        ...

    def release(self) -> None:
        """Unpin the chunk. Idempotent. The view must not be used afterwards."""
        ...


class ViewReadLease:
    """The state every :class:`ReadLease` implementation shares: the key, the view until
    release, and an optional deadline (``view`` raises LeaseExpired past it). Subclasses
    implement :meth:`release` (set ``_view`` to None first, so a second call is a no-op, then
    unpin)."""

    __slots__ = ("_deadline_s", "_key", "_view")

    def __init__(self, key: ChunkKey, view: memoryview, deadline_s: float | None = None) -> None:
        self._key = key
        self._view: memoryview | None = view
        self._deadline_s = deadline_s

    @property
    def deadline_s(self) -> float | None:
        return self._deadline_s

    @property
    def expired(self) -> bool:
        """Whether the deadline (if any) has passed."""
        return self._deadline_s is not None and time.monotonic() >= self._deadline_s

    @property
    def key(self) -> ChunkKey:
        return self._key

    @property
    def size_bytes(self) -> int:
        return self.view.nbytes

    @property
    def view(self) -> memoryview:
        if self._view is None:
            raise InvalidArgument(f"read lease on {self._key.hex()} was released")
        if self.expired:
            raise LeaseExpired(f"read lease on {self._key.hex()} passed its deadline: the peer "
                               "may have ended it and reused the memory; lease the chunk again")
        return self._view


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
    """What a TCP or UCX server serves: chunks behind read and write leases (module docstring)."""

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


@dataclass(frozen=True, slots=True)
class ArenaRange:
    """Where one leased chunk lies in the arena the client maps."""

    offset: int
    size_bytes: int


@runtime_checkable
class ArenaLeaseBackend(Protocol):
    """What a shared-memory server serves: leases by id on an arena its clients map (module
    docstring). ``owner`` is an opaque object standing for the connection (or session) that takes
    a lease, compared with ``==`` (identity for a connection object); a lease may only be
    released, committed or aborted by its owner. Lease ids are unguessable and never 0.
    ``ttl_s`` must be finite, > 0 and within the backend's maximum (InvalidArgument)."""

    def acquire_read(self, keys: Sequence[bytes], ttl_s: float, *, prefix: bool = False,
                     owner: object | None = None) -> tuple[int, list[ArenaRange]]:
        """Pin ``keys`` in the arena and return a lease id and one range per key. ``prefix``:
        the longest cached prefix of ``keys`` (lease id 0 and no ranges when it is empty);
        otherwise all or nothing. Raises ChunkNotFound, ChunkBusy, CapacityError (the arena
        cannot hold them now: read them another way), InvalidArgument."""
        ...

    def release(self, lease_id: int, *, owner: object | None = None) -> bool:
        """End a read lease of ``owner``. False, changing nothing, when it is unknown (released,
        expired, never issued) or another owner's."""
        ...

    def reserve(self, key: bytes, size_bytes: int, ttl_s: float, *,
                parent: bytes | None = None, owner: object | None = None) -> tuple[int, int]:
        """An invisible slot of ``size_bytes``: (lease id, arena offset). ``parent`` must be
        cached, or be the key of an open reservation of the same ``owner`` (a chain reserved
        parent-first in one batch): then it is checked when this one is committed. Raises
        ChunkExists, ChunkBusy, CapacityError, InvalidArgument (an uncached parent)."""
        ...

    def commit(self, lease_id: int, *, owner: object | None = None) -> object:
        """Make a reserved chunk visible. Raises InvalidArgument (unknown lease, or another
        owner's; its parent is not cached now) and the errors of storing it (the slot is then
        freed)."""
        ...

    def reserve_many(self, items: Sequence[tuple[bytes, bytes | None]], sizes_bytes: Sequence[int],
                     ttl_s: float, *, owner: object | None = None
                     ) -> list[tuple[int, int] | KvtierError]:
        """``reserve`` for a batch of ``(key, parent)`` items, in order: per item (lease id,
        arena offset) or the error ``reserve`` would have raised. A parent may be an earlier
        item of the batch; a child of an item that failed fails too. Raises only for a bad
        ``ttl_s``."""
        ...

    def commit_many(self, lease_ids: Sequence[int], *, owner: object | None = None
                    ) -> list[KvtierError | None]:
        """``commit`` for a batch, in order: per lease None (visible) or the error ``commit``
        would have raised (the slot is then freed). A chunk whose parent is neither cached nor
        committed earlier in the batch is freed unpublished."""
        ...

    def abort(self, lease_id: int, *, owner: object | None = None) -> bool:
        """Free a reserved slot; the chunk never becomes visible. False when unknown."""
        ...

    def put(self, key: bytes, value: bytes | memoryview, *, parent: bytes | None = None) -> None:
        """Store a small value that arrived with its request; ``value`` is read only during the
        call. Raises as ``reserve``."""
        ...

    def size_of(self, key: bytes) -> int | None:
        """The committed chunk's size, or None."""
        ...

    def remove(self, key: bytes) -> bool:
        """Drop a committed chunk. False when not held; raises ChunkBusy while it is leased."""
        ...

    def drop_owner(self, owner: object) -> tuple[int, int]:
        """End every lease of ``owner`` (its connection closed): (reads, writes) ended."""
        ...

    def open_count(self) -> tuple[int, int]:
        """(read leases, write leases) outstanding."""
        ...


@runtime_checkable
class Transport(Protocol):
    """A data-plane client: moves chunk bytes to and from one peer. See the module docstring."""

    def put(self, key: bytes, src: Buffer) -> None:
        """Store ``src`` under ``key`` on the peer, all or nothing. ``src`` is read only during
        the call. Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument."""
        ...

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` (exactly the value's size) with the value; return the byte count.
        ``dst`` is written only during the call. Raises ChunkNotFound, SizeMismatch (``dst``
        untouched)."""
        ...

    def get(self, key: bytes) -> bytearray:
        """The whole value in a new buffer (the caller's). Raises ChunkNotFound."""
        ...

    def exists(self, key: bytes) -> bool: ...

    def size_of(self, key: bytes) -> int | None: ...

    def remove(self, key: bytes) -> bool:
        """Drop the value on the peer. False when the peer did not hold it; raises ChunkBusy
        while it is leased."""
        ...

    def close(self) -> None:
        """Close every connection. Idempotent; later calls raise PeerUnavailable."""
        ...


@runtime_checkable
class BatchTransport(Transport, Protocol):
    """A transport that moves many values per call (TCP pipelines them, shared memory leases
    them together). Per-key outcomes as the module docstring says."""

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store each value; False where the peer already held the key. Other refusals are
        raised after the batch ran."""
        ...

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[int | None]:
        """Fill each buffer; None where the peer does not hold the key. Other refusals
        (``SizeMismatch``...) are raised after the batch ran."""
        ...


@runtime_checkable
class MappedTransport(BatchTransport, Protocol):
    """A same-host transport: the peer's arena is mapped here, so values move by one memcpy
    under the peer's leases, and the leases themselves can be lent out (module docstring)."""

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None) -> None:
        """:meth:`Transport.put`, as a child of ``parent`` (the peer's prefix rule applies)."""
        ...

    def open_read(self, key: bytes) -> ReadLease:
        """Lease a committed chunk; its ``view`` is the chunk in the mapped arena, valid until
        ``release()``. Raises ChunkNotFound, CapacityError (the arena cannot hold it now)."""
        ...

    def open_write(self, key: bytes, size_bytes: int, *, parent: bytes | None = None
                   ) -> WriteLease:
        """Reserve an invisible slot of the mapped arena; ``commit()`` publishes it. Raises
        ChunkExists, ChunkBusy, CapacityError, InvalidArgument."""
        ...

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int:
        """Fill ``dsts`` with the longest cached prefix of ``keys``; return its length (a miss
        is a short count). Raises SizeMismatch (nothing copied)."""
        ...

    def sync(self) -> None:
        """Return once the peer has processed every lease release this client sent without
        waiting for an answer (so a ``remove`` elsewhere cannot find this client's leases)."""
        ...


@runtime_checkable
class TransportServer(Protocol):
    """Serves one backend (:class:`LeaseBackend` or :class:`ArenaLeaseBackend`) to clients."""

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


def put_each(keys: Sequence[bytes], srcs: Sequence[Buffer], parents: Sequence[bytes | None],
             put: Callable[..., None]) -> list[bool]:
    """A batch put (``put_many``'s results) as one ``put(key, src, parent=...)`` per item, in
    order, for planes without a batch that carries parents: True where stored, False where the
    key was already stored. An item refused otherwise is not stored, nor anything under it in
    the batch (its put would only be refused again: its parent is not cached); the rest are,
    and then the first refusal is raised, with every item's outcome as its ``batch_outcome``.
    A transport failure (``TransportError``) is raised at once."""
    outcome: list[bool | None] = [None] * len(keys)
    failed: set[bytes] = set()
    first: KvtierError | None = None
    for i, (key, src, parent) in enumerate(zip(keys, srcs, parents, strict=True)):
        if parent is not None and parent in failed:
            failed.add(key)
            continue
        try:
            put(key, src, parent=parent)
        except ChunkExists:
            outcome[i] = False
            continue
        except TransportError:
            raise
        except KvtierError as exc:
            failed.add(key)
            first = first or exc
            continue
        outcome[i] = True
    return settle_batch(outcome, first)


def settle_batch(outcome: list[bool | None], first: KvtierError | None) -> list[bool]:
    """A batch put's result from its per-item ``outcome`` (True stored, False already stored,
    None refused): the stored flags, or ``first`` raised with the outcome as its
    ``batch_outcome`` when an item was refused."""
    if first is not None:
        first.batch_outcome = outcome
        raise first
    return [o is True for o in outcome]

"""The TCP transport's server: :class:`TcpServer` serves a ``LeaseBackend``, one thread per
connection, the native small-GET loop where it is loaded (design: the package docstring and
docs/transport.md).

Threads: one accept thread, one reservation reaper, and one handler thread per connection.

Bounds (``TcpServerConfig``; docs/transport.md, "Limits"):

* ``max_connections`` connections are served at once; one more is answered with a
  ``CAPACITY`` frame (request id 0: about the connection, not a request; the client raises
  ``CapacityError`` naming the limit) and closed.
* ``idle_timeout_s``: a connection that sent no request for that long is closed. Between
  frames it holds nothing (a multi-part put's reservation belongs to the server and has its own
  ``reservation_ttl_s``), so nothing is lost; the client's pool sends a request that finds its
  pooled connection closed again once on a fresh one. Idleness is counted in receive ticks
  (``_IDLE_TICK_S``, the socket's ``SO_RCVTIMEO``), so a busy connection pays nothing for it.
* ``header_timeout_s``: once a frame's first byte arrived, its header and key must be whole
  within that long (a slow sender holds a thread no longer); otherwise a ``PROTOCOL`` frame
  and the close. A connection's first frame header must be whole within that long of the
  accept (a silent connection holds a ``max_connections`` slot no longer). The clock starts only when a header does not arrive whole with the receive
  that brought its first bytes (no clock read otherwise), and one clock covers the header and
  the key. The native loop keeps the same clock for a frame it holds partial and returns
  ``HEADER_TIMEOUT`` when it runs out, however the bytes trickle in; a frame it hands back
  partial keeps its clock in Python (``NativeLoop.take_frame_clock``).
* ``io_timeout_s``: the longest stall inside a payload, and the send timeout.

Session tickets (``authorize``, optional; :mod:`kvstore.dataplane.transport.auth`): with an
authorizer, the first frame of every connection must be a ``HELLO`` carrying a session ticket,
whole within ``header_timeout_s`` of the accept. Anything else (another opcode, no frame, a
ticket the authorizer refuses: missing, forged, stale, expired) is answered with one
``UNAUTHENTICATED`` (or ``PERMISSION_DENIED``) frame naming the reason, a WARNING log line, and
the close; no other frame of that connection is read, so nothing is served and nothing is
touched in the backend. Garbage in place of a header is a ``PROTOCOL`` frame and the close, as
always. A verified grant is set as the connection thread's :func:`~.auth.current_grant` and
ends the connection once it expires: the check is one wall-clock read per request served in
Python and per return of the native loop (at least one per receive tick, so an expired
connection is closed within a tick of its next request). A later ``HELLO`` on the connection
renews the grant (its ticket must carry the same tenant scope; another is refused and the
connection closed). Without an authorizer every connection is served at once, as
:data:`~.auth.INSECURE_GRANT`, and a ``HELLO`` is answered OK.

TLS (``tls``, optional; :mod:`.tls`): every accepted connection begins a TLS session on its own
thread, with the context ``tls()`` returns then (so rotated certificates reach new
connections), before its first frame; the handshake must be done within ``header_timeout_s``
of the accept. A plain frame in its place is answered in plain text with one ``PROTOCOL``
frame ("this data plane speaks TLS") and the close; a failed handshake (an untrusted or missing
client certificate where the context requires one, garbage) is a WARNING and the close. Either
is counted in ``tls_refused`` and touches nothing else. A :class:`~.tls.CheckedServerContext`
has the client certificate checked (revocation) after the handshake and every
``peer_recheck_s`` before a request is served: a refused one is one ``UNAUTHENTICATED`` frame
(request id 0) naming why, inside TLS, and the close, counted as ``connections_unauthenticated``.
The session ticket's ``HELLO`` then runs inside TLS. TLS connections are served in Python: the native loop reads the raw socket.

Tenants: a grant with a :class:`~.auth.TenantScope` is served through ``backend.scoped(scope)``
for every frame of its connection (the backend passes the tenant to its reads, sizes, removes
and puts); a backend without ``scoped`` cannot keep tenants apart, so such a connection is
refused (PERMISSION_DENIED). A scoped connection runs the native small-GET loop on publishes
verified for its read tenant only (the read index knows no tenant; one table per read tenant,
shared by its connections and kept for the server's life, 256 KiB each:
``native.VerifiedPublishes``): the loop hands a hit on any other
publish back to Python (``NativeLoop.scope``), which serves that GET through the scoped backend
and then, if the read-index slot still holds that publish of that key (``slot_holds``) and the
scoped backend then still sees the key (``size_of``: the tenant check), verifies that publish
for the tenant. A small PUT of a scoped connection verifies the publish it made the same way
(``locate``, then ``size_of``), so a chunk written over TCP is served from C from its first GET.
A slot's sequence number changes with every write to it and never repeats, and a chunk's owner
never changes, so a verified publish stays the tenant's for as long as the loop can find it;
the tenant check runs after the liveness test, so a publish replaced meanwhile by another
tenant's chunk is a dead one, never found again. A chunk neither written by the tenant over TCP
nor read by it before costs one GET in Python, the rest run in C. A multi-part put belongs to the scope
of the connection that began it: a ``PUT_PART`` or ``PUT_ABORT`` from a connection of another
scope finds it unknown (``UNKNOWN_TRANSFER``), whatever its transfer id.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import math
import os
import secrets
import select
import socket
import ssl
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from kvstore.dataplane import native
from kvstore.dataplane.tier import MAX_KEY_BYTES, ChunkKey, check_key
from kvstore.dataplane.transport.auth import (
    MAX_TICKET_BYTES,
    SessionAuthorizer,
    SessionGrant,
    TenantScope,
    renewed_grant,
    scoped_backend,
    set_current_grant,
)
from kvstore.dataplane.transport.base import Endpoint, LeaseBackend, TransportKind, WriteLease
from kvstore.dataplane.transport.frames import (
    DEFAULT_MAX_VALUE_BYTES,
    HEADER_BYTES,
    MAGIC,
    MAX_DETAIL_BYTES,
    VERSION,
    Flags,
    Header,
    Opcode,
    Status,
    decode_header,
    pack_header,
    status_for_error,
)
from kvstore.dataplane.transport.tcp.sockets import (
    ANY_SIZE,
    GET,
    MORE,
    MiB,
    pack_request,
    send_parts,
    tune,
)
from kvstore.dataplane.transport.tcp.tls import (
    CheckedServerContext,
    PeerCheck,
    ServerTlsSource,
    TlsSocket,
    handshake,
    looks_like_plain_frame,
)
from kvstore.errors import (
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PeerUnavailable,
    PermissionDenied,
    ProtocolError,
    SizeMismatch,
    TransportError,
    Unauthenticated,
)

log = logging.getLogger(__name__)

_DRAIN_CHUNK_BYTES = 256 * 1024
DEFAULT_COPY_READ_MAX_BYTES = 64 * 1024
_MAX_COPY_READ_BYTES = 4 * MiB
_RECV_BUFFER_BYTES = 64 * 1024 + HEADER_BYTES + MAX_KEY_BYTES
"""A server connection's receive buffer: one ``recv`` brings a small request whole (header,
key and, for a PUT of up to 64 KiB, its value), or several pipelined ones."""
_IDLE_TICK_S = 0.2
"""A server connection's ``SO_RCVTIMEO``: how often a blocked read looks up to check for
shutdown (instead of a ``poll`` with a wake-up pipe before every request)."""


# --- server ----------------------------------------------------------------------------------------

# Per-connection counters: a flat list indexed by opcode value, then these slots. Each handler
# thread updates its own list without a lock; stats() sums them.
_OPCODE_VALUES = frozenset(int(op) for op in Opcode)
_BYTES_RECEIVED = max(Opcode) + 1
_BYTES_SENT = _BYTES_RECEIVED + 1
_PROTOCOL_ERRORS = _BYTES_SENT + 1
_NATIVE_GETS = _PROTOCOL_ERRORS + 1
_COUNTER_SLOTS = _NATIVE_GETS + 1


@dataclass(frozen=True, slots=True)
class TcpServerConfig:
    """Server settings. ``port=0`` binds an ephemeral port (see ``TcpServer.endpoint``)."""

    host: str = "127.0.0.1"
    port: int = 0
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    socket_buffer_bytes: int | None = None
    io_timeout_s: float = 30.0
    """Longest stall allowed inside a payload; the send timeout."""
    idle_timeout_s: float = 300.0
    """A connection that sent no request for this long is closed (module docstring)."""
    header_timeout_s: float = 10.0
    """Once a frame's first byte arrived, its header and key must be whole within this."""
    max_connections: int = 1024
    """Connections served at once; one more is refused with a ``CAPACITY`` frame and closed."""
    reservation_ttl_s: float = 30.0
    """A multi-part put nobody writes to for this long is aborted."""
    drain_timeout_s: float = 5.0
    """Default time ``close`` gives in-flight transfers to finish."""
    backlog: int = 128
    copy_read_max_bytes: int = DEFAULT_COPY_READ_MAX_BYTES
    """GETs of at most this many bytes are copied out of the backend (``read_into``) into a
    per-connection buffer and sent from there, instead of pinning the chunk under a read lease
    for the send (see docs/transport.md, "Small values"). 0: always lease."""
    native_fast_path: bool = True
    """Serve small GETs of chunks published in the backend's read index from the native loop
    (``native/fastpath.c``) when the library is loaded and the backend offers
    ``native_serving()`` (docs/transport.md, "The native small-GET loop"). False: Python only."""

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidArgument("host must not be empty")
        if not 0 <= self.port < 65536:
            raise InvalidArgument(f"port must be 0..65535, got {self.port}")
        if self.max_value_bytes < 1:
            raise InvalidArgument(f"max_value_bytes must be >= 1, got {self.max_value_bytes}")
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 4096:
            raise InvalidArgument(f"socket_buffer_bytes must be >= 4096 or None, "
                                  f"got {self.socket_buffer_bytes}")
        for name in ("io_timeout_s", "reservation_ttl_s", "idle_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_timeout_s < 0:
            raise InvalidArgument(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {self.max_connections}")
        if self.backlog < 1:
            raise InvalidArgument(f"backlog must be >= 1, got {self.backlog}")
        if not 0 <= self.copy_read_max_bytes <= _MAX_COPY_READ_BYTES:
            raise InvalidArgument(f"copy_read_max_bytes must be 0..{_MAX_COPY_READ_BYTES}, "
                                  f"got {self.copy_read_max_bytes}")


@dataclass(frozen=True, slots=True)
class TcpServerStats:
    """A snapshot of a server's counters."""

    requests: dict[str, int]
    bytes_received: int
    bytes_sent: int
    connections_open: int
    connections_total: int
    reservations_open: int
    reservations_expired: int
    protocol_errors: int
    native_gets: int = 0
    """GETs answered by the native loop (also counted in ``requests["GET"]``)."""
    connections_refused: int = 0
    """Connections refused at ``max_connections``."""
    connections_idle_closed: int = 0
    """Connections closed after ``idle_timeout_s`` without a request."""
    header_timeouts: int = 0
    """Connections closed because a frame's header did not arrive within ``header_timeout_s``
    (also counted in ``protocol_errors``)."""
    connections_unauthenticated: int = 0
    """Connections refused or closed for their session ticket (none, refused, expired)."""
    tls_refused: int = 0
    """Connections of a TLS server closed before their TLS session began: a plain frame
    (answered in plain text), a failed or slow handshake, or nothing sent."""


@dataclass(slots=True)
class _Reservation:
    """A multi-part put in progress. Guarded by ``TcpServer._lock``."""

    transfer_id: int
    key: ChunkKey
    lease: WriteLease
    deadline: float
    claimed: list[tuple[int, int]] = field(default_factory=list)
    received_bytes: int = 0
    writers: int = 0
    """Threads receiving into the lease right now: it is aborted only when this drops to 0."""
    doomed: bool = False
    scope: TenantScope | None = None
    """The tenant scope of the connection that began it (only that scope's parts count)."""


class TcpServer:
    """Serves a :class:`~kvstore.dataplane.transport.base.LeaseBackend` over TCP.

    The constructor only records its arguments; ``start()`` binds, listens and starts the
    accept thread, the reservation reaper and, per connection, one handler thread. ``close()``
    drains (see ``TransportServer.close``). Usable as a context manager (start/close).
    """

    def __init__(self, backend: LeaseBackend, config: TcpServerConfig | None = None, *,
                 authorize: SessionAuthorizer | None = None,
                 tls: ServerTlsSource | None = None) -> None:
        """``authorize``: the session-ticket check every connection passes before any frame
        is served (module docstring, "Session tickets"); None serves every connection.
        ``tls``: every connection speaks TLS, with the context this returns when it is
        accepted (module docstring, "TLS"); None: plain TCP."""
        self._backend = backend
        self._config = config or TcpServerConfig()
        self._authorize = authorize
        self._tls = tls
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._endpoint: Endpoint | None = None
        self._closing = threading.Event()
        self._closed = False
        self._wake_r = self._wake_w = -1
        self._threads: list[threading.Thread] = []
        self._connections: dict[int, _ServerConnection] = {}
        self._reservations: dict[int, _Reservation] = {}
        self._conn_ids = itertools.count(1)
        self._counts: Counter[str] = Counter()
        self._retired_counts = [0] * _COUNTER_SLOTS
        self._native: native.NativeServing | None = None
        self._native_cfg: ctypes.Array[ctypes.c_int64] | None = None
        self._native_closing = ctypes.c_int32(0)
        self._verified: dict[str | None, native.VerifiedPublishes] = {}
        """The native loop's verified publishes per read tenant (module docstring, "Tenants");
        guarded by ``_lock``."""
        self._recv_tick_s = min(_IDLE_TICK_S, self._config.io_timeout_s)
        """Every connection's receive timeout (the native loop shortens it while it holds hits
        and restores it before it returns)."""
        """Read by the C loop: nonzero once ``close`` began (receive only what is there)."""

    @property
    def config(self) -> TcpServerConfig:
        return self._config

    @property
    def backend(self) -> LeaseBackend:
        return self._backend

    @property
    def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            raise TransportError("server is not started")
        return self._endpoint

    @property
    def tls(self) -> bool:
        """Whether connections speak TLS."""
        return self._tls is not None

    @property
    def native_active(self) -> bool:
        """True when connections run the native small-GET loop (set at ``start``)."""
        return self._native is not None

    def _setup_native(self) -> None:
        """Use the native loop when the config allows it, the library loads and the backend
        offers a read source (``native_serving()``, optional); otherwise stay in Python."""
        cfg = self._config
        if not cfg.native_fast_path or cfg.copy_read_max_bytes == 0:
            return
        if self._tls is not None:  # the C loop reads and writes the raw descriptor
            log.info("TCP server: native small-GET loop off (TLS)")
            return
        offer = getattr(self._backend, "native_serving", None)
        if offer is None:
            return
        serving = offer()
        if serving is None:
            return
        self._native = serving
        self._native_cfg = serving.source.config(
            copy_read_max_bytes=cfg.copy_read_max_bytes, max_value_bytes=cfg.max_value_bytes,
            recv_tick_s=self._recv_tick_s, header_timeout_s=cfg.header_timeout_s)
        log.info("TCP server: native small-GET loop on (%s)", serving.library.path)

    def start(self) -> Endpoint:
        with self._lock:
            if self._closed or self._listener is not None:
                raise TransportError("a TcpServer can be started once")
            cfg = self._config
            try:
                listener = socket.create_server((cfg.host, cfg.port), backlog=cfg.backlog)
            except OSError as exc:
                raise TransportError(f"cannot listen on {cfg.host}:{cfg.port}: {exc}") from exc
            self._listener = listener
            self._setup_native()
            host, port = listener.getsockname()[:2]
            self._endpoint = Endpoint(TransportKind.TCP, host, port)
            self._wake_r, self._wake_w = os.pipe()
            for target, name in ((self._accept_loop, "kvtier-tcp-accept"),
                                 (self._reap_loop, "kvtier-tcp-reaper")):
                thread = threading.Thread(target=target, name=name, daemon=True)
                self._threads.append(thread)
                thread.start()
        log.info("data-plane TCP server listening on %s:%d", host, port)
        return self._endpoint

    def close(self, drain_timeout_s: float | None = None) -> None:
        drain_s = self._config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        with self._lock:
            if self._closed:
                return
            self._closed = True
            started = self._listener is not None
            self._closing.set()
            self._native_closing.value = 1
        if not started:
            return
        os.write(self._wake_w, b"x")  # never read: stays readable for every poller
        for thread in self._threads:
            thread.join()
        assert self._listener is not None
        self._listener.close()
        deadline = time.monotonic() + drain_s
        with self._lock:
            handlers = list(self._connections.values())
        for handler in handlers:
            handler.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [h for h in handlers if h.thread.is_alive()]
        for handler in stuck:
            log.warning("cutting connection %s still busy after the %.1f s drain",
                        handler.peer, drain_s)
            handler.cut()
        for handler in stuck:
            handler.thread.join(5.0)
        with self._lock:
            leftovers = list(self._reservations.values())
            self._reservations.clear()
        for res in leftovers:
            res.lease.abort()
        if not any(h.thread.is_alive() for h in stuck):
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> TcpServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def stats(self) -> TcpServerStats:
        """Counters so far (those of open connections may lag by the request in progress)."""
        with self._lock:
            totals = list(self._retired_counts)
            for handler in self._connections.values():
                for i, n in enumerate(handler.snapshot_counts()):
                    totals[i] += n
            return TcpServerStats(
                requests={op.name: totals[op] for op in Opcode},
                bytes_received=totals[_BYTES_RECEIVED],
                bytes_sent=totals[_BYTES_SENT],
                connections_open=len(self._connections),
                connections_total=self._counts["connections"],
                reservations_open=len(self._reservations),
                reservations_expired=self._counts["reservations_expired"],
                protocol_errors=totals[_PROTOCOL_ERRORS],
                native_gets=totals[_NATIVE_GETS],
                connections_refused=self._counts["connections_refused"],
                connections_idle_closed=self._counts["connections_idle_closed"],
                header_timeouts=self._counts["header_timeouts"],
                connections_unauthenticated=self._counts["connections_unauthenticated"],
                tls_refused=self._counts["tls_refused"],
            )

    # --- threads ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        poller = select.poll()
        poller.register(self._listener, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._closing.is_set():
            events = poller.poll()
            if not any(fd == self._listener.fileno() for fd, _ in events):
                continue
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                continue
            with self._lock:
                full = len(self._connections) >= self._config.max_connections
                if full:
                    self._counts["connections_refused"] += 1
            if full:
                self._refuse(sock, f"{addr[0]}:{addr[1]}")
                continue
            try:
                tune(sock, self._config.socket_buffer_bytes, self._config.io_timeout_s,
                      self._recv_tick_s)
            except OSError as exc:
                log.warning("cannot configure connection from %s: %s", addr, exc)
                sock.close()
                continue
            handler = _ServerConnection(self, next(self._conn_ids), sock, f"{addr[0]}:{addr[1]}")
            with self._lock:
                if self._closing.is_set():
                    sock.close()
                    return
                self._connections[handler.conn_id] = handler
                self._counts["connections"] += 1
            handler.thread.start()

    def _refuse(self, sock: socket.socket, peer: str) -> None:
        """Answer a connection over ``max_connections`` with one ``CAPACITY`` frame (request id
        0: about the connection) and close it. Never blocks the accept thread: the frame is a
        few dozen bytes into an empty send buffer."""
        limit = self._config.max_connections
        log.warning("refusing connection from %s: at the limit of %d connections", peer, limit)
        detail = (f"the server is at its limit of {limit} connections (max_connections); "
                  "try again later").encode()
        frame = pack_header(bytearray(HEADER_BYTES), Opcode.PING, status=Status.CAPACITY,
                            payload_len=len(detail)) + detail
        with contextlib.suppress(OSError):
            sock.send(frame, socket.MSG_DONTWAIT)
            sock.shutdown(socket.SHUT_WR)
            # What the client already sent: read so that the close sends a FIN, not a reset
            # (best effort; a reset after the frame still leaves the frame readable on Linux).
            sock.recv(_DRAIN_CHUNK_BYTES, socket.MSG_DONTWAIT)
        sock.close()

    def _reap_loop(self) -> None:
        interval_s = min(1.0, self._config.reservation_ttl_s / 4)
        while not self._closing.wait(interval_s):
            now = time.monotonic()
            expired: list[_Reservation] = []
            with self._lock:
                for tid, res in list(self._reservations.items()):
                    if res.writers == 0 and res.deadline < now:
                        del self._reservations[tid]
                        expired.append(res)
                self._counts["reservations_expired"] += len(expired)
            for res in expired:
                log.info("multi-part put of %s expired after %.1f s without progress",
                         res.key.hex(), self._config.reservation_ttl_s)
                res.lease.abort()

    # --- shared state used by the handlers ----------------------------------------------------

    def _forget(self, handler: _ServerConnection) -> None:
        with self._lock:
            if handler.idle_closed:
                self._counts["connections_idle_closed"] += 1
            if handler.header_timed_out:
                self._counts["header_timeouts"] += 1
            if self._connections.pop(handler.conn_id, None) is not None:
                for i, n in enumerate(handler.snapshot_counts()):
                    self._retired_counts[i] += n

    def _verified_for(self, scope: TenantScope) -> native.VerifiedPublishes:
        """The table of publishes verified for ``scope``'s read tenant (made on first use)."""
        with self._lock:
            table = self._verified.get(scope.read)
            if table is None:
                table = self._verified[scope.read] = native.VerifiedPublishes()
            return table

    def _begin_reservation(self, key: ChunkKey, lease: WriteLease,
                           scope: TenantScope | None = None) -> int:
        with self._lock:
            transfer_id = secrets.randbits(63) or 1
            while transfer_id in self._reservations:
                transfer_id = secrets.randbits(63) or 1
            self._reservations[transfer_id] = _Reservation(
                transfer_id, key, lease, time.monotonic() + self._config.reservation_ttl_s,
                scope=scope)
        return transfer_id

    def _claim_part(self, transfer_id: int, key: ChunkKey, offset: int, length: int,
                    scope: TenantScope | None = None) -> _Reservation | str:
        """Register a writer for ``[offset, offset+length)`` from a connection of ``scope``;
        a string says why not (another scope's transfer reads as unknown)."""
        with self._lock:
            res = self._reservations.get(transfer_id)
            if res is None or res.doomed or res.scope != scope:
                return "unknown, expired or aborted transfer"
            if res.key != key:
                return "transfer belongs to another key"
            if offset + length > res.lease.size_bytes or length == 0:
                return (f"part [{offset}, {offset + length}) outside the "
                        f"{res.lease.size_bytes}-byte value")
            for start, n in res.claimed:
                if offset < start + n and start < offset + length:
                    return f"part [{offset}, {offset + length}) overlaps one already sent"
            res.claimed.append((offset, length))
            res.writers += 1
            res.deadline = time.monotonic() + self._config.reservation_ttl_s
            return res

    def _finish_part(self, res: _Reservation, length: int, ok: bool) -> str:
        """Account for a finished writer. Returns "committed", "partial" or "dropped"."""
        abort = False
        with self._lock:
            res.writers -= 1
            if ok and not res.doomed:
                res.received_bytes += length
                res.deadline = time.monotonic() + self._config.reservation_ttl_s
                if res.received_bytes < res.lease.size_bytes:
                    return "partial"
                # Every byte has arrived, so no other writer is inside the buffer.
                del self._reservations[res.transfer_id]
            else:
                res.doomed = True
                if res.writers == 0:
                    self._reservations.pop(res.transfer_id, None)
                    abort = True
        if abort:
            res.lease.abort()
            return "dropped"
        if not ok or res.doomed:
            return "dropped"
        res.lease.commit()
        return "committed"

    def _abort_reservation(self, transfer_id: int, key: ChunkKey,
                           scope: TenantScope | None = None) -> bool:
        with self._lock:
            res = self._reservations.get(transfer_id)
            if res is None or res.key != key or res.scope != scope:
                return False
            res.doomed = True
            if res.writers:
                return True  # the last writer aborts the lease when it leaves
            del self._reservations[transfer_id]
        res.lease.abort()
        return True


@dataclass(frozen=True, slots=True)
class _NativeOutcome:
    """What the connection loop does after a call into the native loop."""

    announced: bool
    """The last request served announced another (``Flags.MORE``)."""
    again: bool
    """Call the native loop again at once."""
    eof: bool
    """The peer closed the connection."""


_NATIVE_SLOW = int(native.NativeReturn.SLOW)
_NATIVE_IDLE = int(native.NativeReturn.IDLE)
_NATIVE_EOF = int(native.NativeReturn.EOF)
_NATIVE_RING = int(native.NativeReturn.RING)
_NATIVE_RECV_ERROR = int(native.NativeReturn.RECV_ERROR)
_NATIVE_SEND_ERROR = int(native.NativeReturn.SEND_ERROR)
_NATIVE_HEADER_TIMEOUT = int(native.NativeReturn.HEADER_TIMEOUT)


class _ServerConnection:
    """One client connection, served by its own thread until EOF, error or shutdown.

    Reads go through a receive buffer: one ``recv`` takes whatever the client has sent (a
    small request whole, or several pipelined ones), and frames are parsed out of it; a
    payload's first bytes are copied from it and the rest is received straight into the
    destination. There is no ``poll`` per request: the socket's receive timeout is a short
    tick (``_IDLE_TICK_S``) at which an idle read looks up for shutdown and counts the idle
    time (``idle_timeout_s``); a header or key not whole within ``header_timeout_s`` of its
    first bytes, or a payload without progress for ``io_timeout_s``, ends the connection.
    Everything it holds is its own: buffers, the native loop's state, the lease of a request in
    progress (released or aborted on the way out); nothing outlives the thread but counters.
    """

    def __init__(self, server: TcpServer, conn_id: int, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.conn_id = conn_id
        self.sock = sock
        self.peer = peer
        self.rbuf = bytearray(_RECV_BUFFER_BYTES)
        self.rview = memoryview(self.rbuf)
        self.rpos = 0
        """First unparsed byte of ``rbuf``."""
        self.rend = 0
        """End of the bytes received into ``rbuf``."""
        copy_max = server._config.copy_read_max_bytes
        self.out = bytearray(HEADER_BYTES + copy_max)
        """A response header, followed by a copied small value."""
        self.out_view = memoryview(self.out)
        self.scratch: memoryview | None = None
        self.counts = [0] * _COUNTER_SLOTS
        self.thread = threading.Thread(target=self.serve, name=f"kvtier-tcp-conn-{conn_id}",
                                       daemon=True)
        self._max_value_bytes = server._config.max_value_bytes
        self._io_timeout_s = server._config.io_timeout_s
        self._header_timeout_s = server._config.header_timeout_s
        self._idle_ticks_max = max(1, math.ceil(server._config.idle_timeout_s
                                                / server._recv_tick_s))
        self._idle_ticks = 0
        """Receive ticks in a row without a request (``_idle_tick``)."""
        self._served_at_tick = 0
        self.grant: SessionGrant | None = None
        """The verified grant of this connection's ticket (None: no authorizer, or not yet)."""
        self._grant_expires_at = math.inf
        """When ``grant`` ends (wall clock); inf without one."""
        self._peer_check: PeerCheck | None = None
        """The TLS context's check of the client certificate (``.tls``, "Checks after the
        handshake"), run again at ``_peer_check_at``; None: no such check."""
        self._peer_der = b""
        self._peer_recheck_s = math.inf
        self._peer_check_at = math.inf
        self._check_at = math.inf
        """When the session must be looked at again before a request is served (wall clock):
        the earlier of ``_grant_expires_at`` and ``_peer_check_at``; inf: never."""
        self.idle_closed = False
        """Closed after ``idle_timeout_s`` without a request."""
        self.header_timed_out = False
        """Closed because a header or key did not arrive within ``header_timeout_s``."""
        self._frame_deadline = 0.0
        """When the frame being read must be whole (header and key: ``_fill``); 0.0 while it
        is not on the clock. Reset for each frame."""
        self._copy_read_max = copy_max
        self._backend = server._backend
        self._declined: tuple[int, int] | None = None
        """(slot, seq) of the publish the scoped native loop handed the frame at ``rpos`` back
        for (module docstring, "Tenants"); taken by ``_serve_one``."""
        by_opcode: dict[Opcode, Callable[[Header, ChunkKey], None]] = {
            Opcode.PING: self._ping,
            Opcode.PUT: self._put,
            Opcode.GET: self._get,
            Opcode.GET_RANGE: self._get_range,
            Opcode.EXISTS: self._exists,
            Opcode.REMOVE: self._remove,
            Opcode.PUT_BEGIN: self._put_begin,
            Opcode.PUT_PART: self._put_part,
            Opcode.PUT_ABORT: self._put_abort,
        }
        # A list indexed by the opcode's value: hashing an IntEnum member for a dict lookup
        # runs Enum.__hash__ in Python, indexing a list with it does not.
        self._handlers: list[Callable[[Header, ChunkKey], None] | None] = [
            by_opcode.get(Opcode(i)) if i in _OPCODE_VALUES else None
            for i in range(max(Opcode) + 1)]
        self.native_loop: native.NativeLoop | None = None
        """The C loop's state for this connection (None: Python only)."""
        if server._native is not None and server._native_cfg is not None \
                and server._tls is None:
            self.native_loop = native.NativeLoop(server._native, server._native_cfg,
                                                 server._native_closing, sock.fileno(),
                                                 self.rbuf, self.out)

    def snapshot_counts(self) -> list[int]:
        """This connection's counters, the native loop's included (live: the C loop updates
        its own as it serves)."""
        counts = list(self.counts)
        loop = self.native_loop
        if loop is not None:
            counts[GET] += loop.st[native.ST_GETS]
            counts[_NATIVE_GETS] += loop.st[native.ST_GETS]
            counts[_BYTES_SENT] += loop.st[native.ST_BYTES_SENT]
        return counts

    def cut(self) -> None:
        """Force the connection down (from another thread): blocked I/O fails at once."""
        sock = self.sock
        with contextlib.suppress(OSError):
            if isinstance(sock, ssl.SSLSocket):  # mid-handshake: keep its TLS state for the
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # thread inside it
            else:
                sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        header: Header | None = None
        announced = False
        loop = self.native_loop
        try:
            if self.server._tls is not None and not self._start_tls():
                return  # refused or gone: the finally closes it
            if self.server._authorize is not None:
                if not self._authenticate():
                    return  # refused: the finally closes it
                loop = self.native_loop  # scoped to verified publishes for a tenant (_hello)
            elif not self._first_frame_in_time():
                return  # closed before a byte, or shutdown
            while True:
                self._frame_deadline = 0.0
                if self._check_at < math.inf and self._session_ended():
                    break
                if loop is not None:
                    # The C loop serves plain small GETs of published chunks and hands back
                    # everything else with the buffer positions at that frame (module
                    # docstring, "Native small-GET loop"), and that frame's header clock.
                    header = None
                    outcome = self._run_native(loop, announced)
                    announced = outcome.announced
                    if outcome.again:
                        continue
                    if outcome.eof:
                        if self.rpos == self.rend:
                            break
                        raise PeerUnavailable("peer closed the connection inside a frame")
                # After close(), requests already received or on the socket are still served
                # (drained), and the loop ends once the socket has nothing more. A request
                # flagged MORE announced the next one: it is read as part of a frame.
                if self.rend - self.rpos < HEADER_BYTES:
                    if announced:
                        self._fill(HEADER_BYTES, "announced request")
                    elif not self._fill_idle():
                        break  # clean EOF between frames, or shutdown
                header = None
                header = decode_header(self.rbuf, self._max_value_bytes, self.rpos)
                self.rpos += HEADER_BYTES
                announced = bool(header.flags & MORE)
                if self._check_at < math.inf and self._session_ended():
                    break
                self._serve_one(header)
        except PeerUnavailable as exc:
            log.info("connection %s ended mid-frame: %s", self.peer, exc)
        except ProtocolError as exc:
            log.warning("protocol error from %s, closing: %s", self.peer, exc)
            self.counts[_PROTOCOL_ERRORS] += 1
            self._reply_quietly(header, Status.PROTOCOL, str(exc))
        except Exception as exc:
            log.exception("bug while serving %s; closing the connection", self.peer)
            self._reply_quietly(header, Status.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            if loop is not None:
                self._account_native_hits(loop)
            with contextlib.suppress(OSError):
                self.sock.close()
            self.server._forget(self)

    # --- TLS ----------------------------------------------------------------------------------

    def _start_tls(self) -> bool:
        """Begin the connection's TLS session (module docstring, "TLS"): a plain frame first is
        answered in plain text (one PROTOCOL frame saying the plane needs TLS) and refused; the
        handshake must complete within ``header_timeout_s`` of the accept. False when refused
        or gone (to be closed); then ``self.sock`` is a :class:`TlsSocket`."""
        server = self.server
        assert server._tls is not None
        deadline = time.monotonic() + self._header_timeout_s
        raw = self.sock
        assert isinstance(raw, socket.socket)
        while True:  # the first bytes, left in the socket (a receive tick at a time)
            try:
                first = raw.recv(len(MAGIC), socket.MSG_PEEK)
                break
            except (BlockingIOError, TimeoutError):
                if server._closing.is_set() or time.monotonic() >= deadline:
                    return self._tls_refused("sent nothing to begin TLS within "
                                             f"{self._header_timeout_s:g} s")
            except OSError as exc:
                log.info("connection %s ended before TLS: %s", self.peer, exc)
                return False
        if not first:
            return False  # closed at once (a probe)
        if looks_like_plain_frame(first, MAGIC):
            self._tls_refused("sent a plain frame to the TLS data plane")  # counted first
            self._reply_quietly(None, Status.PROTOCOL, "this data plane speaks TLS: connect "
                                "with TLS (the daemon's NodeInfo says data_tls_required)")
            with contextlib.suppress(OSError):
                raw.shutdown(socket.SHUT_WR)
                raw.recv(_DRAIN_CHUNK_BYTES, socket.MSG_DONTWAIT)
            return False
        try:
            context = server._tls()
            raw.settimeout(server._recv_tick_s)
            tls_sock = context.wrap_socket(raw, server_side=True,
                                           do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            return self._tls_refused(f"cannot begin TLS: {exc}")
        self.sock = tls_sock  # closed by serve() from here on, whatever happens
        try:
            handshake(tls_sock, deadline)
        except TimeoutError:
            return self._tls_refused(f"TLS handshake not done {self._header_timeout_s:g} s "
                                     "after the accept")
        except (ssl.SSLError, OSError) as exc:
            return self._tls_refused(f"TLS handshake failed: {exc}")
        # Duck-typed: a TlsSocket has every socket method this connection calls.
        self.sock = cast(socket.socket, TlsSocket(tls_sock, self._io_timeout_s))
        if isinstance(context, CheckedServerContext) and context.peer_check is not None:
            der = tls_sock.getpeercert(binary_form=True)
            if der is not None:  # none: the context does not ask for client certificates
                # Checked when the first frame is in (the HELLO, else before the first request
                # is served), so the refusal answers it rather than racing it into a reset.
                self._peer_check, self._peer_der = context.peer_check, der
                self._peer_recheck_s = context.peer_recheck_s
                self._peer_check_at = self._check_at = 0.0
        return True

    def _peer_still_valid(self, now: float, h: Header | None = None) -> bool:
        """Run the TLS context's check of the client certificate; when it refuses, the
        connection is answered (UNAUTHENTICATED, to ``h`` or with request id 0) and to be
        closed. Schedules the next check."""
        assert self._peer_check is not None
        try:
            self._peer_check(self._peer_der)
        except Unauthenticated as exc:
            self._refuse_session(h, Status.UNAUTHENTICATED, exc)
            return False
        self._peer_check_at = now + self._peer_recheck_s
        self._check_at = min(self._grant_expires_at, self._peer_check_at)
        return True

    def _tls_refused(self, why: str) -> bool:
        log.warning("data connection %s refused: %s", self.peer, why)
        with self.server._lock:
            self.server._counts["tls_refused"] += 1
        return False

    # --- session tickets ----------------------------------------------------------------------

    def _authenticate(self) -> bool:
        """Read the connection's first frame, which must be a HELLO whose ticket the server's
        authorizer accepts, whole within ``header_timeout_s`` of the accept. False when the
        connection was refused (answered, to be closed). Raises ProtocolError (garbage or a
        slow frame), PeerUnavailable (the peer left)."""
        self._frame_deadline = time.monotonic() + self._header_timeout_s
        self._fill(HEADER_BYTES, "session ticket (HELLO)")
        header = decode_header(self.rbuf, self._max_value_bytes, self.rpos)
        self.rpos += HEADER_BYTES
        if header.opcode is not Opcode.HELLO:
            self._refuse_session(header, Status.UNAUTHENTICATED, Unauthenticated(
                f"this data plane requires a session ticket (a HELLO frame) before any "
                f"request; got {header.opcode.name}. Ask the daemon's gRPC service for one"))
            return False
        self.counts[header.opcode] += 1
        return self._hello(header)

    def _hello(self, h: Header) -> bool:
        """Verify the ticket a HELLO carries and make its grant this connection's. False
        when it was refused (answered, to be closed)."""
        if h.key_len or h.payload_len > MAX_TICKET_BYTES:
            self._refuse_session(h, Status.UNAUTHENTICATED, Unauthenticated(
                f"malformed HELLO: a {h.key_len}-byte key and a {h.payload_len}-byte ticket "
                f"(no key, at most {MAX_TICKET_BYTES} bytes)"))
            return False
        self._frame_deadline = self._frame_deadline or \
            time.monotonic() + self._header_timeout_s
        if h.payload_len:
            self._fill(h.payload_len, "session ticket")
        ticket = bytes(self.rview[self.rpos:self.rpos + h.payload_len])
        self.rpos += h.payload_len
        if self._peer_check is not None and not self._peer_still_valid(time.time(), h):
            return False  # the TLS client certificate is refused (revoked, expired)
        authorize = self.server._authorize
        if authorize is None:
            self._reply(h)
            return True
        try:
            grant = renewed_grant(authorize, ticket, self.peer, self.grant)
            scope = None if self.grant is not None else grant.scope  # scoped on the first
            if scope is not None:
                backend = scoped_backend(self.server._backend, scope)
        except (Unauthenticated, PermissionDenied) as exc:
            self._refuse_session(h, status_for_error(exc), exc)
            return False
        if scope is not None:
            self._backend = backend
            if self.native_loop is not None:  # the read index knows no tenant: verified only
                self.native_loop.scope(self.server._verified_for(scope))
        self.grant = grant
        self._grant_expires_at = grant.expires_at_unix_s
        self._check_at = min(self._grant_expires_at, self._peer_check_at)
        set_current_grant(grant)
        log.debug("data connection %s: session of %s (%s) until %.0f", self.peer, grant.name,
                  grant.role, grant.expires_at_unix_s)
        self._reply(h)
        return True

    def _scope(self) -> TenantScope | None:
        """The tenant scope this connection is served as (None: unscoped)."""
        return None if self.grant is None else self.grant.scope

    def _session_ended(self) -> bool:
        """Whether this connection's session has ended (its grant expired, or the TLS
        context's check now refuses its client certificate); if so it is answered (request id
        0: about the connection) and to be closed."""
        now = time.time()
        if now < self._check_at:
            return False
        if now >= self._grant_expires_at:
            self._refuse_session(None, Status.UNAUTHENTICATED, Unauthenticated(
                "the session ticket of this data connection expired; reconnect with a new one"))
            return True
        return not self._peer_still_valid(now)

    def _refuse_session(self, h: Header | None, status: Status, exc: KvtierError) -> None:
        """The last word to a connection refused for its ticket, then its write side shut and
        whatever it already sent read and dropped (so the close sends a FIN, not a reset that
        could discard the answer). The connection is closed by ``serve``'s exit."""
        log.warning("data connection %s refused: %s", self.peer, exc)
        with self.server._lock:
            self.server._counts["connections_unauthenticated"] += 1
        if h is None:
            h = Header(Opcode.PING, 0, Status.OK, 0, 0, 0, 0, 0, 0, 0)
        self._reply_quietly(h, status, str(exc))
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.recv(_DRAIN_CHUNK_BYTES, socket.MSG_DONTWAIT)

    # --- the native loop ----------------------------------------------------------------------

    def _run_native(self, loop: native.NativeLoop, announced: bool) -> _NativeOutcome:
        """One call into the C loop (GIL released), then the hits it served are accounted.
        Raises PeerUnavailable on a receive or send failure, ProtocolError when a frame was not
        whole within ``header_timeout_s``. A frame it hands back keeps the clock the loop
        started for it (``_frame_deadline``)."""
        rc, self.rpos, self.rend, last_flags = loop.serve(self.rpos, self.rend,
                                                          MORE if announced else 0)
        announced = bool(last_flags & MORE)
        self._account_native_hits(loop)
        if rc == _NATIVE_RING:  # called again at once: the frame stays the loop's
            return _NativeOutcome(announced, again=True, eof=False)
        started = loop.take_frame_clock()
        if started:
            self._frame_deadline = started + self._header_timeout_s
        if rc == _NATIVE_SLOW:
            if loop.scoped:
                self._declined = loop.take_declined()
            return _NativeOutcome(announced, again=False, eof=False)
        if rc == _NATIVE_IDLE:
            # Nothing pending and no request announced: wait in C again unless closing. A
            # partial frame, or an announced one, is read by Python (its header clock, drain).
            again = (self.rpos == self.rend and not announced
                     and not self.server._closing.is_set())
            if again and self._idle_tick():
                return _NativeOutcome(announced, again=False, eof=True)  # close, as on EOF
            return _NativeOutcome(announced, again=again, eof=False)
        if rc == _NATIVE_EOF:
            return _NativeOutcome(announced, again=False, eof=True)
        if rc == _NATIVE_HEADER_TIMEOUT:
            raise self._header_timeout("frame header" if self.rend - self.rpos < HEADER_BYTES
                                       else "key")
        err = os.strerror(int(loop.st[native.ST_ERRNO]))
        if rc == _NATIVE_RECV_ERROR:
            raise PeerUnavailable(f"connection failed: {err}")
        if rc == _NATIVE_SEND_ERROR:
            if loop.st[native.ST_ERRNO] in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise PeerUnavailable("timed out sending GET response")
            raise PeerUnavailable(f"connection failed sending GET response: {err}")
        raise InvariantViolation(f"native loop refused its configuration (return code {rc})")

    def _verify_publish(self, key: bytes, slot: int, seq: int) -> None:
        """After a GET the scoped native loop declined: let it serve publish ``seq`` of read
        index slot ``slot`` when that slot still holds it for ``key`` and, after that, this
        connection's (tenant-scoped) backend sees ``key``. In that order: a publish replaced
        between the two by another tenant's chunk is gone for good (module docstring,
        "Tenants")."""
        loop, serving = self.native_loop, self.server._native
        assert loop is not None and loop.verified is not None and serving is not None
        if serving.source.slot_holds(slot, seq, key) and self._backend.size_of(key) is not None:
            loop.verified.verify(slot, seq)

    def _verify_written(self, key: bytes) -> None:
        """After a small PUT on a scoped connection: verify the publish it made for this
        connection's tenant when the read index has it and, after that, the scoped backend
        sees ``key`` (as ``_verify_publish``), so its first GET runs in C."""
        loop, serving = self.native_loop, self.server._native
        assert loop is not None and loop.verified is not None and serving is not None
        located = serving.source.locate(key)
        if located is not None and self._backend.size_of(key) is not None:
            loop.verified.verify(*located)

    def _account_native_hits(self, loop: native.NativeLoop) -> None:
        """Feed the keys the C loop served to the backend (hits, recency), as a same-host
        client's lease-free reads are fed."""
        if loop.st[native.ST_RING_COUNT]:
            assert self.server._native is not None
            self.server._native.record_hits(loop.take_hits())

    # --- the receive buffer -------------------------------------------------------------------

    def _idle_tick(self) -> bool:
        """A receive tick passed with nothing to read between frames. True once the connection
        went ``idle_timeout_s`` without a request (then it is to be closed). Runs only when
        idle, so it may look at every counter: a request served since the last tick (in
        Python or in the native loop) starts the count again."""
        loop = self.native_loop
        served = sum(self.counts[:_BYTES_RECEIVED])
        if loop is not None:
            served += loop.st[native.ST_GETS]
        if served != self._served_at_tick:
            self._served_at_tick = served
            self._idle_ticks = 0
        self._idle_ticks += 1
        if self._idle_ticks < self._idle_ticks_max:
            return False
        log.info("closing connection %s: no request for %.1f s (idle_timeout_s)", self.peer,
                 self.server._config.idle_timeout_s)
        self.idle_closed = True
        return True

    def _first_frame_in_time(self) -> bool:
        """Without an authorizer too, the first frame's header must be whole within
        ``header_timeout_s`` of the accept: a connection that sends nothing holds one of the
        ``max_connections`` no longer than that, so a flood of silent connections cannot keep
        clients out for ``idle_timeout_s`` (found by the fault suite's flood). Clients connect
        when they have a request to send. False: EOF before a byte, or shutdown. Raises
        ProtocolError (nothing, or not a whole header, in time), PeerUnavailable."""
        deadline = time.monotonic() + self._header_timeout_s
        while True:
            try:
                got = self.sock.recv_into(self.rview, _RECV_BUFFER_BYTES)
            except (BlockingIOError, TimeoutError):  # a receive tick without a byte
                if self.server._closing.is_set():
                    return False
                if time.monotonic() >= deadline:
                    self.header_timed_out = True
                    raise ProtocolError(f"no frame {self._header_timeout_s:g} s after the "
                                        "connection was accepted (header_timeout_s)") from None
                continue
            except OSError as exc:
                raise PeerUnavailable(f"connection failed: {exc}") from exc
            if got == 0:
                return False
            self.rpos, self.rend = 0, got
            self._frame_deadline = deadline
            self._fill(HEADER_BYTES, "frame header")
            return True

    def _fill_idle(self) -> bool:
        """Between frames: wait for the next request's first bytes, then for its whole header.
        False on EOF before its first byte, or at shutdown when the socket has nothing more."""
        if self.rpos == self.rend:
            self.rpos = self.rend = 0
            closing = self.server._closing
            sock = self.sock
            while True:
                try:
                    # After close(): only what is already there (a drain), never a wait.
                    got = sock.recv_into(self.rview, _RECV_BUFFER_BYTES,
                                         socket.MSG_DONTWAIT if closing.is_set() else 0)
                except (BlockingIOError, TimeoutError):
                    if closing.is_set() or self._idle_tick():
                        return False
                    continue  # an idle tick: look up, wait again
                except OSError as exc:
                    raise PeerUnavailable(f"connection failed: {exc}") from exc
                if got == 0:
                    return False
                self.rend = got
                break
        self._fill(HEADER_BYTES, "frame header")
        return True

    def _fill(self, size_bytes: int, what: str) -> None:
        """Have at least ``size_bytes`` (<= the buffer: a header and key) unparsed bytes in
        ``rbuf``, receiving as much as arrives. Raises PeerUnavailable on EOF or reset, and
        ProtocolError when the frame is not whole within ``header_timeout_s`` (its clock starts
        here unless the frame's header or the native loop started it, so a frame that arrived
        whole costs no clock read)."""
        if self.rend - self.rpos >= size_bytes:
            return
        if self.rpos + size_bytes > _RECV_BUFFER_BYTES:  # compact: move the rest to the front
            have = self.rend - self.rpos
            self.rbuf[:have] = self.rview[self.rpos:self.rend]
            self.rpos, self.rend = 0, have
        deadline = self._frame_deadline
        if not deadline:
            deadline = self._frame_deadline = time.monotonic() + self._header_timeout_s
        while True:
            try:
                got = self.sock.recv_into(self.rview[self.rend:], _RECV_BUFFER_BYTES - self.rend)
            except (BlockingIOError, TimeoutError):
                got = -1  # a receive tick without a byte
            except OSError as exc:
                raise PeerUnavailable(f"connection failed receiving {what}: {exc}") from exc
            if got == 0:
                raise PeerUnavailable(f"peer closed the connection inside {what}")
            if got > 0:
                self.rend += got
                if self.rend - self.rpos >= size_bytes:
                    return
            if time.monotonic() >= deadline:
                raise self._header_timeout(what)

    def _header_timeout(self, what: str) -> ProtocolError:
        """The error that ends a connection whose frame was not whole in time."""
        self.header_timed_out = True
        return ProtocolError(f"{what} not whole {self._header_timeout_s:g} s after its first "
                             "bytes (header_timeout_s)")

    def _stalled(self, since: float, what: str, exc: BaseException) -> float:
        """One receive tick passed without a byte inside a frame: return when the stall began,
        or raise PeerUnavailable once it lasted ``io_timeout_s``."""
        now = time.monotonic()
        if not since:
            return now - _IDLE_TICK_S
        if now - since >= self._io_timeout_s:
            raise PeerUnavailable(f"timed out receiving {what}") from exc
        return since

    def _recv_into(self, view: memoryview, what: str) -> None:
        """Fill ``view``: first from the receive buffer, the rest straight from the socket."""
        size = len(view)
        have = min(self.rend - self.rpos, size)
        if have:
            view[:have] = self.rview[self.rpos:self.rpos + have]
            self.rpos += have
        pos = have
        stalled_since = 0.0
        while pos < size:
            try:
                got = self.sock.recv_into(view[pos:], size - pos, socket.MSG_WAITALL)
            except (BlockingIOError, TimeoutError) as exc:
                stalled_since = self._stalled(stalled_since, what, exc)
                continue
            except OSError as exc:
                raise PeerUnavailable(f"connection failed receiving {what}: {exc}") from exc
            if got == 0:
                raise PeerUnavailable(f"peer closed the connection after {pos} of {size} "
                                      f"bytes of {what}")
            pos += got
            stalled_since = 0.0

    def _drain(self, size_bytes: int) -> None:
        """Read and discard a refused payload so the connection stays in step."""
        have = min(self.rend - self.rpos, size_bytes)
        self.rpos += have
        size_bytes -= have
        if size_bytes and self.scratch is None:
            self.scratch = memoryview(bytearray(_DRAIN_CHUNK_BYTES))
        while size_bytes:
            assert self.scratch is not None
            n = min(size_bytes, _DRAIN_CHUNK_BYTES)
            self._recv_into(self.scratch[:n], "refused payload")
            size_bytes -= n

    # --- dispatch -----------------------------------------------------------------------------

    def _serve_one(self, h: Header) -> None:
        declined, self._declined = self._declined, None
        if h.status is not Status.OK:
            raise ProtocolError(f"request with status {h.status.name}")
        key = b""
        if h.key_len:
            self._fill(h.key_len, "key")
            key = bytes(self.rview[self.rpos:self.rpos + h.key_len])
            self.rpos += h.key_len
        self.counts[h.opcode] += 1
        if h.opcode is Opcode.HELLO:  # a renewal (or, without an authorizer, a no-op)
            if key:
                self._drain(h.payload_len)
                self._reply(h, Status.BAD_REQUEST, detail="HELLO carries no key")
                return
            if not self._hello(h):
                raise PeerUnavailable("session refused")  # ends the connection (answered)
            return
        if h.payload_len and h.opcode is not Opcode.PUT and h.opcode is not Opcode.PUT_PART:
            self._drain(h.payload_len)
            self._reply(h, Status.BAD_REQUEST, detail=f"{h.opcode.name} carries no payload")
            return
        if h.opcode is not Opcode.PING:
            try:
                key = check_key(key)
            except InvalidArgument as exc:
                self._drain(h.payload_len)
                self._reply(h, Status.BAD_REQUEST, detail=str(exc))
                return
        handler = self._handlers[h.opcode]
        assert handler is not None  # decode_header accepts known opcodes only
        try:
            handler(h, key)  # type: ignore[arg-type]  # checked above (ChunkKey is a NewType)
        except KvtierError as exc:
            if isinstance(exc, TransportError):
                raise
            # Raised by the backend before any payload moved (handlers drain first). A miss
            # needs no words (and a GET's answer may land in the client's buffer).
            self._reply(h, status_for_error(exc),
                        detail="" if isinstance(exc, ChunkNotFound) else str(exc))
        else:
            if declined is not None:
                self._verify_publish(key, *declined)

    # --- replies ------------------------------------------------------------------------------

    def _reply(self, h: Header, status: Status = Status.OK, *, flags: int = 0,
               transfer_id: int = 0, offset: int = 0, length: int = 0, total_size: int = 0,
               payload: memoryview | None = None, detail: str = "") -> None:
        if detail:
            payload = memoryview(detail.encode("utf-8", "replace")[:MAX_DETAIL_BYTES])
        payload_len = 0 if payload is None else len(payload)
        pack_header(self.out, h.opcode, flags=flags, status=status, request_id=h.request_id,
                    transfer_id=transfer_id, offset=offset, length=length,
                    total_size=total_size, payload_len=payload_len)
        send_flags = socket.MSG_MORE if h.flags & MORE else 0
        if payload is None:
            send_parts(self.sock, (self.out_view[:HEADER_BYTES],), HEADER_BYTES, "response",
                        send_flags)
        else:
            send_parts(self.sock, (self.out_view[:HEADER_BYTES], payload),
                        HEADER_BYTES + payload_len, "response", send_flags)
        self.counts[_BYTES_SENT] += payload_len

    def _reply_quietly(self, h: Header | None, status: Status, detail: str) -> None:
        """Best-effort last word before closing; the peer may already be gone."""
        if h is None:  # the header itself was refused: still echo its request id, if it came
            request_id = 0
            if self.rend - self.rpos >= HEADER_BYTES:
                (request_id,) = struct.unpack_from("<Q", self.rbuf, self.rpos + 16)
            h = Header(Opcode.PING, 0, Status.OK, 0, request_id, 0, 0, 0, 0, 0)
        with contextlib.suppress(KvtierError):
            self._reply(h, status, detail=detail)

    # --- opcodes ------------------------------------------------------------------------------

    def _ping(self, h: Header, key: ChunkKey) -> None:
        self._reply(h)

    def _put(self, h: Header, key: ChunkKey) -> None:
        if not (h.offset == 0 and h.length == h.total_size == h.payload_len):
            self._drain(h.payload_len)
            self._reply(h, Status.BAD_REQUEST, detail="PUT must carry the whole value: "
                        "offset 0 and length == total_size == payload_len")
            return
        try:
            lease = self._backend.open_write(key, h.total_size)
        except KvtierError as exc:
            self._drain(h.payload_len)
            self._reply(h, status_for_error(exc), detail=str(exc))
            return
        try:
            self._recv_into(lease.buffer, "PUT payload")
        except BaseException:
            lease.abort()  # the client vanished or stalled: never visible
            raise
        self.counts[_BYTES_RECEIVED] += h.payload_len
        lease.commit()
        self._reply(h, total_size=h.total_size)
        loop = self.native_loop
        if loop is not None and loop.scoped and h.total_size <= self._copy_read_max:
            self._verify_written(key)

    def _get(self, h: Header, key: ChunkKey) -> None:
        size = h.total_size
        if size <= self._copy_read_max and not h.flags & ANY_SIZE:
            self._get_copy(h, key, size)
            return
        lease = self._backend.open_read(key)
        try:
            size = lease.size_bytes
            if not h.flags & ANY_SIZE and h.total_size != size:
                self._refuse_size(h, size)
                return
            self._reply(h, length=size, total_size=size, payload=lease.view)
        finally:
            lease.release()  # also when the client vanished mid-send

    def _get_copy(self, h: Header, key: ChunkKey, size: int) -> None:
        """A small GET: copy the value behind the response header and send both at once. No
        read lease outlives the call, so a ``remove`` right behind the get never finds the
        chunk busy because of it."""
        out = self.out_view
        try:
            self._backend.read_into(key, out[HEADER_BYTES:HEADER_BYTES + size])
        except SizeMismatch as exc:
            self._refuse_size(h, exc.expected)
            return
        end = HEADER_BYTES + size
        pack_request(self.out, 0, MAGIC, VERSION, GET, 0, 0, 0, 0, h.request_id, 0, 0, size,
                      size, size)
        send_parts(self.sock, (out[:end],), end, "GET response",
                    socket.MSG_MORE if h.flags & MORE else 0)
        self.counts[_BYTES_SENT] += size

    def _refuse_size(self, h: Header, stored_size: int) -> None:
        """SIZE_MISMATCH carries no detail (``total_size`` says the stored size), so a client
        receiving the answer of a GET straight into its buffer leaves that buffer untouched."""
        self._reply(h, Status.SIZE_MISMATCH, total_size=stored_size)

    def _get_range(self, h: Header, key: ChunkKey) -> None:
        lease = self._backend.open_read(key)
        try:
            size = lease.size_bytes
            offset, length = h.offset, h.length
            if h.flags & ANY_SIZE:
                length = max(0, min(length, size - offset))
            elif h.total_size != size:
                self._refuse_size(h, size)
                return
            if offset + length > size:
                self._reply(h, Status.BAD_REQUEST, total_size=size,
                            detail=f"range [{offset}, {offset + length}) outside {size} bytes")
                return
            self._reply(h, offset=offset, length=length, total_size=size,
                        payload=lease.view[offset:offset + length])
        finally:
            lease.release()

    def _exists(self, h: Header, key: ChunkKey) -> None:
        size = self._backend.size_of(key)
        if size is None:
            self._reply(h, Status.NOT_FOUND)
        else:
            self._reply(h, total_size=size)

    def _remove(self, h: Header, key: ChunkKey) -> None:
        removed = self._backend.remove(key)
        self._reply(h, Status.OK if removed else Status.NOT_FOUND)

    def _put_begin(self, h: Header, key: ChunkKey) -> None:
        if h.total_size == 0:
            self._reply(h, Status.BAD_REQUEST, detail="a multi-part put needs a size >= 1")
            return
        lease = self._backend.open_write(key, h.total_size)
        transfer_id = self.server._begin_reservation(key, lease, self._scope())
        self._reply(h, transfer_id=transfer_id, total_size=h.total_size)

    def _put_part(self, h: Header, key: ChunkKey) -> None:
        if h.length != h.payload_len:
            self._drain(h.payload_len)
            self._reply(h, Status.BAD_REQUEST, detail="PUT_PART length != payload_len")
            return
        claim = self.server._claim_part(h.transfer_id, key, h.offset, h.length, self._scope())
        if isinstance(claim, str):
            self._drain(h.payload_len)
            self._reply(h, Status.UNKNOWN_TRANSFER, transfer_id=h.transfer_id, detail=claim)
            return
        ok = False
        try:
            self._recv_into(claim.lease.buffer[h.offset:h.offset + h.length], "PUT_PART payload")
            ok = True
        finally:
            outcome = self.server._finish_part(claim, h.length, ok)
        self.counts[_BYTES_RECEIVED] += h.length
        if outcome == "dropped":
            self._reply(h, Status.UNKNOWN_TRANSFER, transfer_id=h.transfer_id,
                        detail="the transfer was aborted while this part arrived")
            return
        flags = Flags.COMMITTED if outcome == "committed" else Flags.NONE
        self._reply(h, flags=flags, transfer_id=h.transfer_id, offset=h.offset,
                    length=h.length, total_size=h.total_size)

    def _put_abort(self, h: Header, key: ChunkKey) -> None:
        found = self.server._abort_reservation(h.transfer_id, key, self._scope())
        self._reply(h, Status.OK if found else Status.UNKNOWN_TRANSFER,
                    transfer_id=h.transfer_id)

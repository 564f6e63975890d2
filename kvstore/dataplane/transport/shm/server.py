"""The shared-memory plane's server half: same-host clients lease arena ranges over a Unix socket.

:class:`ShmServer` serves an :class:`~kvstore.dataplane.transport.base.ArenaLeaseBackend` (the
daemon's is :class:`kvstore.node.backend.ShmLeases`, over its tiered cache) on the lease channel.
Frames: :mod:`.frames`. Leases are owned by the connection that took them: when it closes (the
client exited, crashed, or was killed), every read lease it held is released and every
reservation it did not commit is aborted, so a half-written chunk never becomes visible and a
dead reader pins nothing. A TTL (``lease_ttl_s``) bounds a client that stays connected but
stuck. A frame the server cannot trust (over ``MAX_BODY_BYTES`` or ``MAX_KEYS``, an unknown
op, a malformed body, one not whole within ``header_timeout_s``) gets a ``STATUS_CLOSING``
reply naming a ``ProtocolError`` (the client raises it and drops the connection), then that
connection closes, ending its leases; the others are untouched. A frame truncated by the
client's close gets nothing (nobody is there to read it).

Threads: one accept thread and one thread per connection (a client process keeps a few pooled
connections). A request's work is a few index operations (plus a promotion from NVMe when the
chunk is there); bulk bytes never pass through here: the client copies them itself.

Bounds: at most ``max_connections`` connections are served at once; one more gets a
``STATUS_CLOSING`` reply naming ``CapacityError`` (the limit in its message) and is closed.
Once a frame's first byte arrived, the whole frame (header and body, at most
``MAX_BODY_BYTES``) must arrive within ``header_timeout_s``. A connection that sent no request
for ``idle_timeout_s`` and holds no read lease or reservation is closed (counted in
``idle_closed``); one that holds some is closed once it sent none for the longest TTL among
them too (each was granted at a request, so by then all have expired). The server counts the
leases each connection was granted and has not ended by a request (RELEASE, ABORT, a COMMIT
that succeeded): a few integer operations per lease request, no system call. The count may
only be too high (an expired lease, a COMMIT that failed), which delays a close to that TTL,
never too low. Neither bound costs a request anything: the socket's receive timeout is
``idle_timeout_s`` between frames (set once per connection) and ``header_timeout_s`` only while
a frame is partial (two ``setsockopt`` per such frame, none per whole one); the idle check runs
only when the timeout ran out with no byte of a frame here. The idle close happens before any
byte of a next request was read, so a request that finds its connection closed this way had no
effect, and the shm client sends it again on a fresh connection (:mod:`.client`). Each
connection's frame buffer is an anonymous mapping, unmapped when the connection closes: a
``bytearray`` of that size (1 MiB, zero-filled) freed by an exited thread stayed in the
allocator's per-thread arena, so the server's memory grew with every connection that had been
open at once.

Draining: :meth:`ShmChannelServer.close` stops accepting, refuses new ACQUIRE/RESERVE
(``TierUnavailable``), lets commits, aborts and releases through until no connection holds a
lease or ``drain_timeout_s`` passes, then closes every connection (ending what is left).

Who may connect: the lease channel is an abstract Unix socket (no file, so no file mode
applies; any process in the host's network namespace can connect). What guards it is the
kernel's ``SO_PEERCRED``: at accept the peer's uid and primary gid are checked against a
:class:`~kvstore.dataplane.transport.auth.PeerAllowlist` (default: this process's uid only), and
a peer not on it gets one ``STATUS_CLOSING`` reply naming ``PermissionDenied`` (the allowlist in
its message; the client raises it) and the close, with a WARNING log line, before any frame of
it is read. ``authorize_peer`` (optional) is a further check on the credentials of a peer the
allowlist allows, raising ``PermissionDenied`` or ``Unauthenticated`` the same way.

Session tickets (``authorize``, optional; :mod:`kvstore.dataplane.transport.auth`): with an
authorizer, the first request of every connection must be a ``HELLO`` whose ticket it accepts;
anything else first, or a refused ticket (missing, forged, stale, expired), gets one
``STATUS_CLOSING`` reply naming ``Unauthenticated`` (or ``PermissionDenied``) and the close, with
a WARNING log line, before anything of that connection is served. A grant with a
:class:`~kvstore.dataplane.transport.auth.TenantScope` is served through ``leases.scoped(scope)``
for every request of its connection (reads, sizes and removes see only what that tenant may
read; puts and reservations are owned by it); a backend without ``scoped`` cannot keep tenants
apart, so such a connection is refused, and so is one whose scope ``scoped`` refuses
(PermissionDenied: the daemon's lease channel of one tenant group's arena refuses a tenant of
another group, docs/dram-arena.md, "Arenas per tenant group"). Once the grant expires the connection stays open (its
leases are the client's memory: ending them under a reader would be worse) but every request
that reads, writes or takes a lease is answered ``Unauthenticated`` until a ``HELLO`` renews the
grant (same scope only; one wall-clock read per such request); RELEASE, COMMIT, ABORT, READS and
PING still work, so what it holds can be finished. Without an authorizer a ``HELLO`` is answered
OK and nothing else changes.

Lease-free reads: a client that copied chunks through the read index (no lease, no request)
reports their keys afterwards in READS requests; the server hands them to ``on_reads`` (the
daemon counts hits and refreshes recency). They never fail and never get a reply unless asked.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable

from kvstore.dataplane.transport.auth import (
    PeerAllowlist,
    PeerCredentials,
    SessionAuthorizer,
    SessionGrant,
    renewed_grant,
    scoped_backend,
)
from kvstore.dataplane.transport.base import ArenaLeaseBackend, Endpoint, TransportKind
from kvstore.dataplane.transport.shm.frames import (
    FLAG_NO_REPLY,
    FLAG_PARENTS,
    FLAG_PREFIX,
    ITEM_EXISTS,
    ITEM_FAILED,
    MAX_BODY_BYTES,
    MAX_KEYS,
    RANGE,
    REPLY,
    REQUEST,
    STATUS_CLOSING,
    STATUS_ERROR,
    STATUS_OK,
    TAIL_OPS,
    ChannelOp,
    unpack_keys,
)
from kvstore.errors import (
    CapacityError,
    ChunkExists,
    InvalidArgument,
    KvtierError,
    PermissionDenied,
    ProtocolError,
    TierUnavailable,
    TransportError,
    Unauthenticated,
    error_name,
)

log = logging.getLogger(__name__)


class _IdleTimeout(Exception):
    """A connection sent no request for as long as it may stay idle (module docstring,
    "Bounds"): it is to be closed. Raised only between frames, before any byte of the next."""


class _FrameReader:
    """Reads request frames from one connection into one preallocated buffer.

    The buffer holds the largest legal frame (header + ``MAX_BODY_BYTES``) and is allocated
    once per connection: a request costs no allocation for its bytes, and frames that arrive
    together (a RELEASE followed by the next ACQUIRE) are parsed from one ``recv_into``
    instead of one system call and one thread wake-up each. Views handed out by :meth:`next`
    stay valid only until the following call. The buffer is an anonymous ``mmap``: its pages
    become resident only as frames use them, and :meth:`close` returns them to the system
    (module docstring, "Bounds").

    Between frames the socket's receive timeout is ``idle_timeout_s`` (set here, once); when
    it runs out with no byte of a frame here, ``idle_limit_s()`` says how long this connection
    may stay idle, and the reader waits the rest of it or raises :class:`_IdleTimeout`.
    """

    __slots__ = ("_buf", "_end", "_idle_limit_s", "_idle_timeout_s", "_rcvtimeo_s", "_sock",
                 "_start", "_timeout_s", "_view")

    def __init__(self, sock: socket.socket, frame_timeout_s: float, idle_timeout_s: float,
                 idle_limit_s: Callable[[], float]) -> None:
        self._sock = sock
        self._timeout_s = frame_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._idle_limit_s = idle_limit_s
        self._buf = mmap.mmap(-1, REQUEST.size + MAX_BODY_BYTES)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._rcvtimeo_s = 0.0
        """The socket's receive timeout now (``_set_timeout``)."""
        self._set_timeout(idle_timeout_s)

    def close(self) -> None:
        """Unmap the buffer (the views handed out must be gone; if one lives on, the mapping
        goes when it does)."""
        self._view.release()
        try:
            self._buf.close()
        except BufferError:
            log.debug("a lease channel frame view outlived its connection")

    def next(self) -> tuple[tuple[int, int, int, int, int, float], memoryview] | None:
        """The next (header fields, body view), or None when the peer closed between frames.
        Raises ProtocolError (oversized or truncated frame), _IdleTimeout, OSError."""
        if not self._fill(REQUEST.size):
            return None
        header = REQUEST.unpack_from(self._buf, self._start)
        body_len, nkeys = header[3], header[2]
        if body_len > MAX_BODY_BYTES or nkeys > MAX_KEYS:
            raise ProtocolError(f"lease channel request of {body_len} bytes / {nkeys} "
                                "keys is over the limit")
        if not self._fill(REQUEST.size + body_len):
            raise ProtocolError("lease channel request truncated")
        body_at = self._start + REQUEST.size
        self._start = body_at + body_len
        return header, self._view[body_at:self._start]

    def _fill(self, need: int) -> bool:
        """Make ``need`` bytes available from ``_start``; False on a clean close before any
        byte of them arrived. Raises ProtocolError (truncated, or not whole within the frame
        timeout once its first byte arrived), _IdleTimeout (no byte of a frame came for as
        long as the connection may stay idle)."""
        have = self._end - self._start
        if have >= need:
            return True
        if self._start + need > len(self._buf):  # move the partial frame to the front
            self._view[:have] = self._view[self._start:self._end]
            self._start, self._end = 0, have
        deadline = 0.0
        idle_s = 0.0  # waited so far with no byte of a frame here
        try:
            while self._end - self._start < need:
                if not deadline and self._end > self._start:
                    # Part of a frame is here: from now on the wait is bounded.
                    deadline = time.monotonic() + self._timeout_s
                    self._set_timeout(self._timeout_s)
                try:
                    n = self._sock.recv_into(self._view[self._end:])
                except (BlockingIOError, TimeoutError):
                    n = -1
                if n == 0:
                    if self._end == self._start:
                        return False
                    raise ProtocolError(f"lease channel frame truncated after "
                                        f"{self._end - self._start} of {need} bytes")
                if n > 0:
                    self._end += n
                elif not deadline:
                    # The idle timeout ran out between frames. The kernel's timer never fires
                    # early, so idle_s is at most the time really waited.
                    idle_s += self._rcvtimeo_s
                    limit_s = self._idle_limit_s()
                    if idle_s >= limit_s:
                        raise _IdleTimeout(f"no request for {idle_s:g} s")
                    self._set_timeout(limit_s - idle_s)  # it holds leases: wait for their TTL
                    continue
                if deadline and self._end - self._start < need and \
                        time.monotonic() >= deadline:
                    raise ProtocolError(
                        f"lease channel frame not whole {self._timeout_s:g} s after its first "
                        f"bytes ({self._end - self._start} of {need}; header_timeout_s)")
        finally:
            if self._rcvtimeo_s != self._idle_timeout_s:
                self._set_timeout(self._idle_timeout_s)
        return True

    def _set_timeout(self, seconds: float) -> None:
        """The kernel's ``SO_RCVTIMEO``; the socket stays blocking."""
        sec = int(seconds)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                              struct.pack("ll", sec, int((seconds - sec) * 1_000_000)))
        self._rcvtimeo_s = seconds


def _closing_reply(exc: KvtierError) -> bytes:
    """The last reply on a connection the server closes: the error, by class name."""
    detail = f"{error_name(exc)}\n{exc}".encode()
    return REPLY.pack(STATUS_CLOSING, 0, len(detail), 0) + detail


def _error_reply(exc: KvtierError) -> bytes:
    detail = f"{error_name(exc)}\n{exc}".encode()
    return REPLY.pack(STATUS_ERROR, 0, len(detail), 0) + detail


def _tail(value: memoryview | None, count: int, op: int) -> memoryview:
    """The body tail of a batch op, which must hold at least ``count`` u64 values."""
    if value is None or len(value) < 8 * count:
        raise ProtocolError(f"op {op}: the body's tail is too short for {count} entries")
    return value


def _items(keys: list[bytes], flags: int, op: int) -> list[tuple[bytes, bytes | None]]:
    """A batch op's (key, parent) items: pairs with FLAG_PARENTS (an empty parent: a root),
    else roots."""
    if not flags & FLAG_PARENTS:
        return [(key, None) for key in keys]
    if len(keys) % 2:
        raise ProtocolError(f"op {op} with FLAG_PARENTS carries [key, parent] pairs, got "
                            f"{len(keys)} keys")
    return [(keys[i], keys[i + 1] or None) for i in range(0, len(keys), 2)]


def _per_item_reply(count: int, ranges: bytes, status: bytearray,
                    first: KvtierError | None) -> bytes:
    """An OK reply whose detail is one status byte per item, then the first failure."""
    detail = bytes(status)
    if first is not None:
        detail += f"{error_name(first)}\n{first}".encode()
    return REPLY.pack(STATUS_OK, count, len(detail), 0) + ranges + detail


_SESSION_OPS = frozenset({ChannelOp.ACQUIRE_READ, ChannelOp.RESERVE, ChannelOp.PUT,
                          ChannelOp.PUT_MANY, ChannelOp.RESERVE_MANY, ChannelOp.SIZE_OF,
                          ChannelOp.REMOVE})
"""Requests refused once a connection's session grant expired (module docstring, "Session
tickets"): they read, write or take a lease."""


class _Connection:
    __slots__ = ("expires_at_unix_s", "held", "held_ttl_s", "leases", "peer", "session", "sock",
                 "thread")

    def __init__(self, sock: socket.socket, peer: str, leases: ArenaLeaseBackend) -> None:
        self.sock = sock
        self.peer = peer
        self.leases = leases
        """What this connection's requests are served from (its tenant's view once scoped)."""
        self.session: SessionGrant | None = None
        """The verified grant of its ticket (None: no authorizer, or before its HELLO)."""
        self.expires_at_unix_s = math.inf
        self.thread: threading.Thread | None = None
        self.held = 0
        """Leases granted to this connection and not ended by one of its requests (module
        docstring, "Bounds": never too low). Only this connection's thread touches it."""
        self.held_ttl_s = 0.0
        """The longest TTL of a lease granted to it (all have expired once it sent no request
        for that long)."""

    def grant(self, count: int, ttl_s: float) -> None:
        self.held += count
        if ttl_s > self.held_ttl_s:
            self.held_ttl_s = ttl_s


class ShmServer:
    """Serves an :class:`ArenaLeaseBackend` on an abstract Unix socket (contract:
    ``base.TransportServer``). The constructor records only; :meth:`start` binds and starts the
    accept thread."""

    def __init__(self, leases: ArenaLeaseBackend, *, lease_ttl_s: float,
                 name: str | None = None,
                 on_reads: Callable[[list[bytes]], None] | None = None,
                 header_timeout_s: float = 10.0, idle_timeout_s: float = 300.0,
                 max_connections: int = 1024, allowed_peers: PeerAllowlist | None = None,
                 authorize_peer: Callable[[PeerCredentials], None] | None = None,
                 authorize: SessionAuthorizer | None = None) -> None:
        """``on_reads`` receives the keys of each READS report (module docstring), on the
        connection's thread. ``header_timeout_s``, ``idle_timeout_s``, ``max_connections``:
        module docstring, "Bounds". ``allowed_peers`` (default: this process's uid only) and
        ``authorize_peer``: module docstring, "Who may connect". ``authorize``: the session
        ticket check (module docstring, "Session tickets"); None serves every connection."""
        for bound, value in (("header_timeout_s", header_timeout_s),
                             ("idle_timeout_s", idle_timeout_s)):
            if not 0 < value < math.inf:
                raise InvalidArgument(f"{bound} must be finite and > 0, got {value}")
        if max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {max_connections}")
        self._header_timeout_s = header_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_connections = max_connections
        self.refused = 0
        """Connections refused at ``max_connections``."""
        self.idle_closed = 0
        """Connections closed after ``idle_timeout_s`` without a request (module docstring,
        "Bounds")."""
        self._allowed = allowed_peers if allowed_peers is not None else PeerAllowlist()
        self._authorize_peer = authorize_peer
        self._authorize = authorize
        self.unauthenticated = 0
        """Connections refused for their session ticket (none, refused, another scope)."""
        self.denied = 0
        """Connections refused because their peer's credentials are not allowed."""
        self._leases = leases
        self._on_reads = on_reads
        self._lease_ttl_s = lease_ttl_s
        self._name = name or f"kvtier-{os.getpid()}-{secrets.token_hex(6)}"
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._draining = False
        self._closed = False
        self._accept_thread: threading.Thread | None = None
        self.requests = 0

    @property
    def address(self) -> str:
        """``@name``: the abstract-namespace address clients connect to."""
        return f"@{self._name}"

    @property
    def endpoint(self) -> Endpoint:
        if self._listener is None:
            raise TransportError("the lease channel is not started")
        return Endpoint(TransportKind.SHM, self.address, 0)

    def start(self) -> Endpoint:
        """Bind and start accepting. Raises TransportError (the name is taken)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self._name)
            listener.listen(64)
        except OSError as exc:
            listener.close()
            raise TransportError(f"cannot listen on lease channel {self.address}: {exc}") from exc
        self._listener = listener
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name="kvtier-shm-accept")
        self._accept_thread.start()
        log.info("lease channel listening on %s", self.address)
        return self.endpoint

    def connection_count(self) -> int:
        with self._lock:
            return len(self._connections)

    def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop accepting, drain for up to ``drain_timeout_s`` (default 0; module docstring),
        close every connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._draining = True
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                log.debug("lease channel listener was not connected")
            self._listener.close()
        if self._accept_thread is not None:
            self._accept_thread.join(5.0)
        deadline = time.monotonic() + (drain_timeout_s or 0.0)
        while time.monotonic() < deadline and any(self._leases.open_count()):
            time.sleep(0.02)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                log.debug("lease channel connection %s already closed", conn.peer)
        for conn in connections:
            if conn.thread is not None:
                conn.thread.join(5.0)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _addr = self._listener.accept()
            except OSError:
                return  # closed
            try:
                creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
                peer = PeerCredentials(*struct.unpack("<iII", creds))
            except (OSError, struct.error):
                peer = PeerCredentials(-1, 2**32 - 1, 2**32 - 1)  # unknown: allowed by no list
            pid = peer.pid
            conn = _Connection(sock, str(peer), self._leases)
            refusal = self._check_peer(peer)
            if refusal is not None:
                with self._lock:
                    self.denied += 1
                self._deny(conn, refusal)
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                full = len(self._connections) >= self._max_connections
                if full:
                    self.refused += 1
                else:
                    self._connections.add(conn)
            if full:
                self._refuse(conn)
                continue
            conn.thread = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                           name=f"kvtier-shm-{pid}")
            conn.thread.start()

    @property
    def allowed_peers(self) -> PeerAllowlist:
        return self._allowed

    def _check_peer(self, peer: PeerCredentials) -> KvtierError | None:
        """Why ``peer`` may not use the lease channel, or None when it may."""
        if not self._allowed.allows(peer):
            return PermissionDenied(
                f"the lease channel {self.address} refuses {peer}: it serves only "
                f"{self._allowed.describe()} (the daemon's own uid; a tenant group's lease "
                "channel also its dram.arena_groups users and group)")
        if self._authorize_peer is not None:
            try:
                self._authorize_peer(peer)
            except (PermissionDenied, Unauthenticated) as exc:
                return exc
        return None

    def _deny(self, conn: _Connection, exc: KvtierError) -> None:
        """A peer whose credentials are not allowed: a closing reply naming the error (a
        few dozen bytes into an empty send buffer: never blocks), a log line, the close.
        Nothing of what it sent is read."""
        log.warning("lease channel: refusing %s: %s", conn.peer, exc)
        with contextlib.suppress(OSError):
            conn.sock.send(_closing_reply(exc), socket.MSG_DONTWAIT)
        conn.sock.close()

    def _refuse(self, conn: _Connection) -> None:
        """One connection over ``max_connections``: a closing ``CapacityError`` reply (a few
        dozen bytes into an empty send buffer: never blocks the accept thread), then close."""
        limit = self._max_connections
        log.warning("lease channel: refusing %s, at the limit of %d connections", conn.peer,
                    limit)
        reply = _closing_reply(CapacityError(
            f"the lease channel is at its limit of {limit} connections (max_connections)"))
        with contextlib.suppress(OSError):
            conn.sock.send(reply, socket.MSG_DONTWAIT)
        conn.sock.close()

    def _serve(self, conn: _Connection) -> None:
        # The whole request runs inline on this connection's thread (no hand-off to a pool):
        # a hand-off costs a second thread wake-up, which here is most of a round trip.
        sock = conn.sock
        idle_timeout_s = self._idle_timeout_s

        def idle_limit_s() -> float:
            """How long this connection may send no request (module docstring, "Bounds")."""
            return max(idle_timeout_s, conn.held_ttl_s) if conn.held > 0 else idle_timeout_s

        try:
            reader = _FrameReader(sock, self._header_timeout_s, idle_timeout_s, idle_limit_s)
        except BaseException:
            self._end_connection(conn)
            raise
        try:
            self._serve_frames(conn, reader)
        except _IdleTimeout as exc:
            log.info("lease channel %s: %s (idle_timeout_s %g); closing it", conn.peer, exc,
                     idle_timeout_s)
            with self._lock:
                self.idle_closed += 1
        except ProtocolError as exc:
            log.warning("lease channel %s: %s; closing it", conn.peer, exc)
            with contextlib.suppress(OSError):  # best effort: the peer may be gone
                sock.send(_closing_reply(exc), socket.MSG_DONTWAIT)
        except OSError as exc:
            log.debug("lease channel %s closed: %s", conn.peer, exc)
        finally:
            reader.close()  # no frame view is left: they lived in _serve_frames
            self._end_connection(conn)

    def _end_connection(self, conn: _Connection) -> None:
        """Forget ``conn``, end its leases, close its socket."""
        with self._lock:
            self._connections.discard(conn)
        try:
            reads, writes = self._leases.drop_owner(conn)
            if reads or writes:
                log.info("lease channel %s closed holding %d read and %d write lease(s): ended",
                         conn.peer, reads, writes)
        finally:
            conn.sock.close()

    def _serve_frames(self, conn: _Connection, reader: _FrameReader) -> None:
        """Serve requests until the peer closes between frames. Raises ProtocolError, OSError."""
        sock = conn.sock
        authorize = self._authorize
        while True:
            frame = reader.next()
            if frame is None:
                return
            (op, flags, nkeys, body_len, arg, ttl_s), body = frame
            value: memoryview | None = None
            if op in TAIL_OPS:
                if arg > body_len:
                    raise ProtocolError(f"op {op} tail of {arg} bytes in a {body_len}-byte "
                                        "body")
                body, value = body[:body_len - arg], body[body_len - arg:]
            if authorize is not None and conn.session is None and op != ChannelOp.HELLO:
                self._refuse_session(conn, Unauthenticated(
                    f"this lease channel requires a session ticket (a HELLO request) before "
                    f"any other; got op {op}. Ask the daemon's gRPC service for one "
                    "(IssueDataTicket)"))
                return
            keys = unpack_keys(body, nkeys) if nkeys else []
            self.requests += 1
            if op == ChannelOp.HELLO:
                if nkeys or value is None:
                    raise ProtocolError("HELLO carries no keys, and the ticket as its tail")
                if authorize is not None and not self._hello(conn, authorize, value):
                    return  # refused: answered, closed by _serve
                if not flags & FLAG_NO_REPLY:
                    sock.sendall(REPLY.pack(STATUS_OK, 0, 0, 0))
                continue
            if conn.expires_at_unix_s < math.inf and op in _SESSION_OPS \
                    and time.time() >= conn.expires_at_unix_s:
                reply = _error_reply(Unauthenticated(
                    "the session ticket of this lease channel connection expired; renew it "
                    "with a HELLO (what it holds can still be released, committed or aborted)"))
            else:
                reply = self._handle(conn, op, flags, keys, arg, ttl_s, value)
            if not flags & FLAG_NO_REPLY:
                sock.sendall(reply)

    def _hello(self, conn: _Connection, authorize: SessionAuthorizer,
               ticket: memoryview) -> bool:
        """Verify a HELLO's ticket and make its grant (and scope) the connection's. False when
        it was refused (answered with a closing reply; the caller ends the connection)."""
        try:
            grant = renewed_grant(authorize, bytes(ticket), conn.peer, conn.session)
            if conn.session is None and grant.scope is not None:
                # PermissionDenied also from ``scoped``: e.g. a tenant of another arena's group
                conn.leases = scoped_backend(self._leases, grant.scope)
        except (Unauthenticated, PermissionDenied) as exc:
            self._refuse_session(conn, exc)
            return False
        conn.session = grant
        conn.expires_at_unix_s = grant.expires_at_unix_s
        log.debug("lease channel %s: session of %s (%s) until %.0f", conn.peer, grant.name,
                  grant.role, grant.expires_at_unix_s)
        return True

    def _refuse_session(self, conn: _Connection, exc: KvtierError) -> None:
        """The last word to a connection refused for its ticket: a closing reply naming the
        error and a WARNING; the caller returns, and ``_serve`` ends the connection."""
        log.warning("lease channel %s refused: %s", conn.peer, exc)
        with self._lock:
            self.unauthenticated += 1
        with contextlib.suppress(OSError):
            conn.sock.sendall(_closing_reply(exc))

    def _handle(self, conn: _Connection, op: int, flags: int, keys: list[bytes], arg: int,
                ttl_s: float, value: memoryview | None) -> bytes:
        ttl = self._lease_ttl_s if ttl_s == 0 else ttl_s  # the backend refuses nan, < 0, inf
        try:
            if op == ChannelOp.ACQUIRE_READ:
                self._refuse_when_draining()
                lease_id, ranges = conn.leases.acquire_read(
                    keys, ttl, prefix=bool(flags & FLAG_PREFIX), owner=conn)
                if lease_id:  # (0: an empty prefix, nothing leased)
                    conn.grant(1, ttl)
                return REPLY.pack(STATUS_OK, len(ranges), 0, lease_id) + b"".join(
                    RANGE.pack(r.offset, r.size_bytes) for r in ranges)
            if op == ChannelOp.RELEASE:
                if conn.leases.release(arg, owner=conn):
                    conn.held -= 1
                return REPLY.pack(STATUS_OK, 0, 0, arg)
            if op == ChannelOp.RESERVE:
                self._refuse_when_draining()
                if len(keys) != 2:
                    raise ProtocolError(f"RESERVE carries [key, parent], got {len(keys)} keys")
                lease_id, offset = conn.leases.reserve(keys[0], arg, ttl,
                                                        parent=keys[1] or None, owner=conn)
                conn.grant(1, ttl)
                return REPLY.pack(STATUS_OK, 1, 0, lease_id) + RANGE.pack(offset, arg)
            if op == ChannelOp.COMMIT:
                conn.leases.commit(arg, owner=conn)
                conn.held -= 1
                return REPLY.pack(STATUS_OK, 0, 0, arg)
            if op == ChannelOp.ABORT:
                if conn.leases.abort(arg, owner=conn):
                    conn.held -= 1
                return REPLY.pack(STATUS_OK, 0, 0, arg)
            if op == ChannelOp.PUT:
                self._refuse_when_draining()
                if len(keys) != 2:
                    raise ProtocolError(f"PUT carries [key, parent], got {len(keys)} keys")
                if value is None:
                    raise ProtocolError("PUT without a value")
                conn.leases.put(keys[0], value, parent=keys[1] or None)
                return REPLY.pack(STATUS_OK, 0, 0, 0)
            if op == ChannelOp.PUT_MANY:
                self._refuse_when_draining()
                items = _items(keys, flags, op)
                return self._put_many(conn, items, _tail(value, len(items), op),
                                      per_item=bool(flags & FLAG_PARENTS))
            if op == ChannelOp.RESERVE_MANY:
                self._refuse_when_draining()
                items = _items(keys, flags, op)
                return self._reserve_many(conn, items, _tail(value, len(items), op), ttl,
                                          per_item=bool(flags & FLAG_PARENTS))
            if op == ChannelOp.COMMIT_MANY:
                ids = _tail(value, arg // 8, op)
                return self._commit_many(conn, struct.unpack_from(f"<{len(ids) // 8}Q", ids),
                                         per_item=bool(flags & FLAG_PARENTS))
            if op == ChannelOp.READS:
                if self._on_reads is not None and keys:
                    self._on_reads(keys)
                return REPLY.pack(STATUS_OK, 0, 0, 0)
            if op == ChannelOp.PING:
                return REPLY.pack(STATUS_OK, 0, 0, 0)
            if op == ChannelOp.SIZE_OF:
                sizes = [conn.leases.size_of(key) for key in keys]
                return REPLY.pack(STATUS_OK, len(sizes), 0, 0) + b"".join(
                    RANGE.pack(0, 0) if n is None else RANGE.pack(1, n) for n in sizes)
            if op == ChannelOp.REMOVE:
                if len(keys) != 1:
                    raise ProtocolError(f"REMOVE carries one key, got {len(keys)}")
                return REPLY.pack(STATUS_OK, 0, 0, int(conn.leases.remove(keys[0])))
            raise ProtocolError(f"unknown lease channel op {op}")
        except ProtocolError:
            raise
        except KvtierError as exc:
            return _error_reply(exc)

    def _put_many(self, conn: _Connection, items: list[tuple[bytes, bytes | None]],
                  tail: memoryview, *, per_item: bool) -> bytes:
        sizes = struct.unpack_from(f"<{len(items)}Q", tail)
        pos = 8 * len(items)
        if pos + sum(sizes) != len(tail):
            raise ProtocolError(f"PUT_MANY sizes add up to {sum(sizes)} bytes, the body holds "
                                f"{len(tail) - pos}")
        status = bytearray(len(items))
        first: KvtierError | None = None
        for i, ((key, parent), size) in enumerate(zip(items, sizes, strict=True)):
            try:
                # In order: an item whose parent is an earlier item finds it cached (or, when
                # that one failed, fails too: its prefix is not cached).
                conn.leases.put(key, tail[pos:pos + size], parent=parent)
            except ChunkExists:
                status[i] = ITEM_EXISTS
            except KvtierError as exc:
                if not per_item:
                    raise
                status[i] = ITEM_FAILED
                first = first or exc
            pos += size
        return _per_item_reply(0, b"", status, first)

    def _reserve_many(self, conn: _Connection, items: list[tuple[bytes, bytes | None]],
                      tail: memoryview, ttl_s: float, *, per_item: bool) -> bytes:
        if len(tail) != 8 * len(items):
            raise ProtocolError(f"RESERVE_MANY of {len(items)} items with {len(tail)} size "
                                "bytes")
        sizes = struct.unpack_from(f"<{len(items)}Q", tail)
        flat: list[int] = []  # (offset, lease id) per item, packed at once below
        status = bytearray(len(items))
        first: KvtierError | None = None
        granted = 0
        # One batch call (one lock round, one eviction plan for the batch): a parent reserved
        # earlier by this connection (this request or an earlier one) is accepted and checked
        # at commit; a child of an item that failed fails too.
        results = conn.leases.reserve_many(items, sizes, ttl_s, owner=conn)
        for i, result in enumerate(results):
            if not isinstance(result, KvtierError):
                lease_id, offset = result
                flat += (offset, lease_id)
                granted += 1
                continue
            flat += (0, 0)
            if isinstance(result, ChunkExists):
                status[i] = ITEM_EXISTS
            else:
                status[i] = ITEM_FAILED
                first = first or result
        if first is not None and not per_item:
            for lease_id in flat[1::2]:
                if lease_id:
                    conn.leases.abort(lease_id, owner=conn)
            raise first
        conn.grant(granted, ttl_s)
        head = struct.pack(f"<{len(flat)}Q", *flat)  # RANGE per item
        if not per_item:
            return REPLY.pack(STATUS_OK, len(results), 0, 0) + head
        return _per_item_reply(len(results), head, status, first)

    def _commit_many(self, conn: _Connection, lease_ids: tuple[int, ...], *,
                     per_item: bool) -> bytes:
        status = bytearray(len(lease_ids))
        first: KvtierError | None = None
        for i, err in enumerate(conn.leases.commit_many(lease_ids, owner=conn)):
            if err is not None:
                status[i] = ITEM_FAILED
                first = first or err
            else:
                conn.held -= 1  # (a failed commit may have ended it: too high is safe)
        if not per_item:
            if first is not None:
                raise first
            return REPLY.pack(STATUS_OK, 0, 0, 0)
        return _per_item_reply(0, b"", status, first)

    def _refuse_when_draining(self) -> None:
        if self._draining:
            raise TierUnavailable("the daemon is draining: no new leases")

"""The TCP transport's client: :class:`TcpClient`, a pool of connections to one server
(contract: ``base.Transport``; design: the package docstring and docs/transport.md)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar, cast

from kvstore.dataplane import native
from kvstore.dataplane.arena import host_byte_view
from kvstore.dataplane.tier import MAX_KEY_BYTES, Buffer, ChunkKey, check_key
from kvstore.dataplane.transport.auth import TicketSource, renew_at
from kvstore.dataplane.transport.base import Endpoint, TransportKind
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
    error_for_status,
    pack_header,
)
from kvstore.dataplane.transport.tcp.sockets import (
    GET,
    MORE,
    PUT,
    MiB,
    PeerClosed,
    pack_request,
    peer_closed,
    recv_exact,
    send_parts,
    tune,
)
from kvstore.dataplane.transport.tcp.tls import TlsSocket, handshake
from kvstore.errors import (
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PeerUnavailable,
    ProtocolError,
    TransportError,
    Unauthenticated,
)

log = logging.getLogger(__name__)

DEFAULT_STRIPE_THRESHOLD_BYTES = 8 * MiB
DEFAULT_SPIN_US = 0
_MIN_STRIPE_PART_BYTES = 1 * MiB
_PIPELINE_WINDOW = 64
"""Requests a batch sends before reading their responses (see ``pipelined``)."""
_PIPELINE_LANE_BYTES = 4 * MiB
"""A batch is spread over another connection only when each gets at least this many bytes:
below that, per-request Python work dominates, and more threads on either side only contend
for the GIL (measured: 32 x 4 KiB takes longer on 2 or 4 connections than on 1)."""
_T = TypeVar("_T")



class _Stale(PeerClosed):
    """A request found its pooled connection closed by the server before any byte of it was
    answered (the server closes connections idle for its ``idle_timeout_s``): ``TcpClient``
    sends it again once on a fresh connection. Raised only for a request on a connection that
    carried requests before (request id > 1)."""


def _split(size_bytes: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (offset, length) ranges covering ``size_bytes``; 64 KiB aligned."""
    step = -(-size_bytes // parts)
    step = -(-step // 65536) * 65536
    return [(off, min(step, size_bytes - off)) for off in range(0, size_bytes, step)]


# --- client ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TcpClientConfig:
    """Client tuning. ``socket_buffer_bytes=None`` keeps Linux autotuning (see docs/transport.md)."""

    connections: int = 4
    stripe_threshold_bytes: int = DEFAULT_STRIPE_THRESHOLD_BYTES
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    connect_timeout_s: float = 5.0
    io_timeout_s: float = 30.0
    socket_buffer_bytes: int | None = None
    spin_us: int = DEFAULT_SPIN_US
    """How long a small GET polls for its answer before it sleeps (with the native extension;
    docs/transport.md, "Waiting for an answer"). 0: sleep at once."""

    def __post_init__(self) -> None:
        if not 1 <= self.connections <= 256:
            raise InvalidArgument(f"connections must be 1..256, got {self.connections}")
        if self.stripe_threshold_bytes < _MIN_STRIPE_PART_BYTES:
            raise InvalidArgument(f"stripe_threshold_bytes must be >= {_MIN_STRIPE_PART_BYTES}, "
                                  f"got {self.stripe_threshold_bytes}")
        if self.max_value_bytes < 1:
            raise InvalidArgument(f"max_value_bytes must be >= 1, got {self.max_value_bytes}")
        if self.connect_timeout_s <= 0 or self.io_timeout_s <= 0:
            raise InvalidArgument("timeouts must be > 0 seconds")
        if not 0 <= self.spin_us <= 10_000:
            raise InvalidArgument(f"spin_us must be 0..10000, got {self.spin_us}")
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 4096:
            raise InvalidArgument(f"socket_buffer_bytes must be >= 4096 or None, "
                                  f"got {self.socket_buffer_bytes}")


class _ClientConnection:
    """One pooled socket. Used by one thread at a time; ``broken`` once out of step."""

    __slots__ = ("_fast_get", "_fd", "_get_template", "_ids", "_max_value_bytes", "_spin_ns",
                 "_timeout_ms", "broken", "recv_hdr", "recv_view", "renew_at", "send_buf",
                 "send_hdr", "send_view", "sock")

    def __init__(self, sock: socket.socket, max_value_bytes: int, *,
                 fast_get: Callable[..., int] | None = None, spin_ns: int = 0,
                 timeout_ms: int = -1) -> None:
        """``fast_get``: the native extension's ``tcp_get`` (``native/pyfast.c``), or None;
        ``spin_ns``: how long it polls before sleeping; ``timeout_ms``: how long it sleeps at
        most, or -1 for a blocking socket with kernel timeouts (the pool's)."""
        self.sock = sock
        self._fd = sock.fileno()
        self._fast_get = fast_get
        self._spin_ns = spin_ns
        self._timeout_ms = timeout_ms
        self._get_template = bytearray(HEADER_BYTES)
        pack_request(self._get_template, 0, MAGIC, VERSION, GET, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.send_hdr = bytearray(HEADER_BYTES)
        self.send_buf = bytearray(HEADER_BYTES + MAX_KEY_BYTES)
        """Header and key of a one-value request, sent with one system call."""
        self.send_view = memoryview(self.send_buf)
        self.recv_hdr = bytearray(HEADER_BYTES)
        self.recv_view = memoryview(self.recv_hdr)
        self.broken = False
        self._ids = itertools.count(1)
        self._max_value_bytes = max_value_bytes
        self.renew_at = 0.0
        """When this connection presents a new session ticket (wall clock; 0: never)."""

    def get_into(self, key: ChunkKey, view: memoryview) -> None:
        """GET a value of known size into ``view``: header and key leave in one ``send``, and
        one ``recvmsg_into([header, view])`` usually brings the whole answer (two system calls
        per value, as a bare socket request/response). A refusal's detail message may land in
        ``view`` (a failed get leaves ``dst`` unspecified); SIZE_MISMATCH and NOT_FOUND answers
        carry none, so a wrong-size ``view`` is left untouched."""
        size = len(view)
        request_id = next(self._ids)
        try:
            fast = self._fast_get
            if fast is not None:
                # Send, receive and check a plain OK answer in C (pyfast.c tcp_get); anything
                # else comes back as -1 - (bytes received) and continues below.
                got = fast(self._fd, request_id, key, view, self._get_template, self.recv_hdr,
                           self._spin_ns, self._timeout_ms)
                if got >= 0:
                    return
                got = -1 - got
            else:
                end = HEADER_BYTES + len(key)
                pack_request(self.send_buf, 0, MAGIC, VERSION, GET, 0, 0, len(key), 0,
                              request_id, 0, 0, size, size, 0)
                self.send_buf[HEADER_BYTES:end] = key
                sock = self.sock
                sent = sock.send(self.send_view[:end])
                if sent != end:
                    sock.sendall(self.send_view[sent:end])
                got = sock.recvmsg_into((self.recv_hdr, view))[0]
        except (BlockingIOError, TimeoutError) as exc:
            self.broken = True
            raise PeerUnavailable("timed out on a GET") from exc
        except OSError as exc:
            self.broken = True
            cls = _Stale if request_id > 1 and peer_closed(exc) else PeerUnavailable
            raise cls(f"connection failed on a GET: {exc}") from exc
        if got < HEADER_BYTES:
            if got == 0:
                self.broken = True
                cls = _Stale if request_id > 1 else PeerUnavailable
                raise cls("peer closed the connection before answering a GET")
            self.recv_payload(self.recv_view[got:], "response header")
            got = HEADER_BYTES
        in_view = got - HEADER_BYTES
        header = self._check_header(request_id, view, in_view)
        if header.status is not Status.OK:
            raise self._error(header, key, expected_size=size, received=view[:in_view])
        if header.payload_len != size or header.offset != 0:
            self.broken = True
            raise ProtocolError(f"peer answered {header.payload_len} bytes at {header.offset} "
                                f"to a {size}-byte GET")
        if in_view < size:
            self.recv_payload(view[in_view:], "GET payload")

    def put(self, key: ChunkKey, view: memoryview) -> None:
        """PUT a whole value: one ``sendmsg([header + key, value])``, one receive of the
        answer."""
        size = len(view)
        key_len = len(key)
        request_id = next(self._ids)
        end = HEADER_BYTES + key_len
        pack_request(self.send_buf, 0, MAGIC, VERSION, PUT, 0, 0, key_len, 0, request_id, 0, 0,
                      size, size, size)
        self.send_buf[HEADER_BYTES:end] = key
        self._exchange((self.send_view[:end], view), end + size, "PUT", key, request_id, size)

    def request(self, opcode: Opcode, key: bytes, *, flags: int = 0, transfer_id: int = 0,
                offset: int = 0, length: int = 0, total_size: int = 0,
                payload: memoryview | None = None) -> Header:
        """Send one request and read its response header (the caller reads any payload).

        A non-OK status is raised as its kvtier error after reading the peer's detail message,
        leaving the connection in step; transport failures mark it broken.
        """
        request_id = next(self._ids)
        payload_len = 0 if payload is None else len(payload)
        pack_header(self.send_hdr, opcode, flags=flags, key_len=len(key), request_id=request_id,
                    transfer_id=transfer_id, offset=offset, length=length,
                    total_size=total_size, payload_len=payload_len)
        parts: list[Buffer] = [self.send_hdr, key] if payload is None else \
            [self.send_hdr, key, payload]
        return self._exchange(parts, HEADER_BYTES + len(key) + payload_len, "request", key,
                              request_id, total_size)

    def _exchange(self, parts: Sequence[Buffer], total_bytes: int, what: str, key: bytes,
                  request_id: int, expected_size: int) -> Header:
        """Send one request's parts and read its response header; a non-OK status raises."""
        try:
            send_parts(self.sock, parts, total_bytes, what)
        except PeerUnavailable as exc:
            self.broken = True
            # The peer may have refused the frame and closed (oversized value): its answer
            # is likely already in our receive queue.
            rejection = self._rejection_after_failed_send(key)
            if rejection is not None:
                raise rejection from exc
            _raise_if_stale(exc, request_id > 1)
            raise
        header = self._read_header(request_id, may_be_stale=request_id > 1)
        if header.status is not Status.OK:
            raise self._error(header, key, expected_size=expected_size)
        return header

    def pipelined(self, opcode: Opcode, keys: Sequence[ChunkKey], views: Sequence[memoryview]
                  ) -> list[Header | KvtierError]:
        """Send up to ``_PIPELINE_WINDOW`` PUTs (``views`` are the values) or GETs (``views``
        are the destinations) with one ``sendmsg``, then read every response in order: the
        response header, or the kvtier error of a refused request (the connection stays in
        step). Deadlock-free without a reader thread: a GET window's requests and a PUT window's
        responses are a few KiB, far below the socket buffers, so neither side can block
        sending while the other is blocked sending too."""
        count = len(keys)
        headers = bytearray(HEADER_BYTES * count)
        header_views = memoryview(headers)
        first_id = next(self._ids)
        for _ in range(count - 1):
            next(self._ids)
        parts: list[Buffer] = []
        total_bytes = 0
        put = opcode is Opcode.PUT
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            size = len(view)
            payload_len = size if put else 0
            pack_header(headers, opcode, flags=MORE if i < count - 1 else 0,
                        key_len=len(key), request_id=first_id + i, length=size,
                        total_size=size, payload_len=payload_len, at=i * HEADER_BYTES)
            parts.append(header_views[i * HEADER_BYTES:(i + 1) * HEADER_BYTES])
            parts.append(key)
            if put:
                parts.append(view)
            total_bytes += HEADER_BYTES + len(key) + payload_len
        try:
            send_parts(self.sock, parts, total_bytes, f"{count} pipelined {opcode.name}s")
        except PeerUnavailable as exc:
            self.broken = True
            _raise_if_stale(exc, first_id > 1)
            raise
        results: list[Header | KvtierError] = []
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            header = self._read_header(first_id + i, may_be_stale=i == 0 and first_id > 1)
            if header.status is not Status.OK:
                error = self._error(header, key, expected_size=len(view))
                if isinstance(error, TransportError):
                    raise error
                results.append(error)
                continue
            if not put:
                if header.payload_len != len(view) or header.offset != 0:
                    self.broken = True
                    raise ProtocolError(f"peer answered {header.payload_len} bytes for a "
                                        f"{len(view)}-byte GET")
                self.recv_payload(view, "GET payload")
            results.append(header)
        return results

    def recv_payload(self, view: memoryview, what: str) -> None:
        """Receive the rest of an answer that has begun: an EOF here is PeerUnavailable, never
        PeerClosed (which says nothing of the answer came, so the request may be resent)."""
        try:
            recv_exact(self.sock, view, what)
        except PeerClosed as exc:
            self.broken = True
            raise PeerUnavailable(str(exc)) from exc
        except PeerUnavailable:
            self.broken = True
            raise

    def _read_header(self, request_id: int, *, may_be_stale: bool = False) -> Header:
        """Receive and check the response header to ``request_id``. ``may_be_stale``: nothing
        of this connection's answers has been read since it left the pool, so an EOF or reset
        before the first byte is ``_Stale``."""
        try:
            recv_exact(self.sock, self.recv_view, "response header")
        except PeerClosed as exc:
            self.broken = True
            if may_be_stale:
                raise _Stale(str(exc)) from exc
            raise
        except PeerUnavailable:
            self.broken = True
            raise
        return self._check_header(request_id)

    def _check_header(self, request_id: int, received_into: memoryview | None = None,
                      received: int = 0) -> Header:
        """Decode ``recv_hdr`` and check that it answers ``request_id``. A refusal with
        request id 0 is the server's word about the connection itself (its connection limit,
        a header that came too slowly) before it closes: raised as its error. ``received``
        bytes after the header were already read into ``received_into`` (a GET's buffer)."""
        try:
            header = decode_header(self.recv_hdr, self._max_value_bytes)
        except ProtocolError:
            self.broken = True
            raise
        if header.request_id != request_id or header.key_len:
            self.broken = True
            if header.request_id == 0 and header.status is not Status.OK \
                    and not header.key_len:
                raise self._error(header, b"", received=None if received_into is None
                                  else received_into[:received])
            raise ProtocolError(f"response to request {header.request_id} (key_len "
                                f"{header.key_len}) where {request_id} was expected")
        return header

    def _error(self, header: Header, key: bytes, *, expected_size: int = -1,
               received: memoryview | None = None) -> KvtierError:
        """The error of a refusal, after reading its detail message (``received``: the part of
        it already read, into the caller's buffer)."""
        detail = ""
        if header.payload_len:
            if header.payload_len > MAX_DETAIL_BYTES:
                self.broken = True
                return ProtocolError(f"error detail of {header.payload_len} bytes")
            buf = bytearray(header.payload_len)
            have = 0
            if received is not None and len(received):
                have = min(len(received), header.payload_len)
                buf[:have] = received[:have]
            if have < len(buf):
                self.recv_payload(memoryview(buf)[have:], "error detail")
            detail = buf.decode("utf-8", "replace")
        exc = error_for_status(header, key, detail, expected_size=expected_size)
        if isinstance(exc, TransportError):
            self.broken = True  # the peer closes after PROTOCOL / SHUTTING_DOWN answers
        return exc

    def _rejection_after_failed_send(self, key: bytes) -> KvtierError | None:
        try:
            poller = select.poll()
            poller.register(self.sock, select.POLLIN)
            if not poller.poll(200):
                return None
            got = self.sock.recv_into(self.recv_view, HEADER_BYTES,
                                      socket.MSG_WAITALL | socket.MSG_DONTWAIT)
            if got != HEADER_BYTES:
                return None
            header = decode_header(self.recv_hdr, self._max_value_bytes)
        except (OSError, KvtierError):
            return None
        if header.status is Status.OK:
            return None
        detail = ""
        if 0 < header.payload_len <= MAX_DETAIL_BYTES:
            with contextlib.suppress(OSError):
                detail = self.sock.recv(header.payload_len, socket.MSG_DONTWAIT).decode(
                    "utf-8", "replace")
        return error_for_status(header, key, detail)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class TcpClient:
    """A thread-safe data-plane client for one :class:`TcpServer` (contract: ``base.Transport``).

    Holds up to ``connections`` sockets, opened on first use (the constructor touches no network).
    Calls from many threads proceed in parallel, one connection each; values of at least
    ``stripe_threshold_bytes`` are striped across all connections. A pooled connection that
    fails is discarded, so the call after a server restart succeeds on a fresh one. One retry
    happens behind the caller's back: a request that finds its pooled connection closed by the
    server (EOF or reset before any byte of the answer; the server closes connections idle for
    its ``idle_timeout_s``) is sent again once on a fresh connection, after the other idle
    ones, which idled as long, are dropped. A server that is gone then fails the connect
    (``PeerUnavailable``). Anything else fails the call (``PeerUnavailable``).

    Session tickets (a server that requires them: :mod:`.server`, "Session tickets"): every
    new connection presents one first. With a :class:`~kvstore.dataplane.transport.auth.TicketSource`
    the client also renews: a connection checked out within the renewal margin of its ticket's
    expiry presents ``current()`` again (one HELLO round trip); a ticket refused on a new
    connection is reported (``refused``) and a fresh one presented once more; a request that
    finds its connection's session ended by the server (UNAUTHENTICATED about the connection:
    it expired) is sent again once on a fresh connection.
    """

    def __init__(self, host: str, port: int, connections: int = 4, *,
                 stripe_threshold_bytes: int = DEFAULT_STRIPE_THRESHOLD_BYTES,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0,
                 socket_buffer_bytes: int | None = None,
                 spin_us: int = DEFAULT_SPIN_US,
                 ticket: bytes | Callable[[], bytes] | TicketSource | None = None,
                 tls: ssl.SSLContext | None = None,
                 tls_server_name: str | None = None) -> None:
        """``ticket``: the session ticket every new connection presents first (a HELLO
        frame) to a server that requires one, a callable returning the current one (called
        per new connection), or a :class:`TicketSource` (also renewed: class docstring). A
        refused ticket fails the call that opened the connection with ``Unauthenticated`` /
        ``PermissionDenied``. ``tls``: every connection speaks TLS with this context (a
        server that speaks TLS needs it; :mod:`.tls`), checking the server's certificate
        against ``tls_server_name`` (default: ``host``) when the context checks hostnames;
        TLS connections do not use the native small GET."""
        if ticket is not None and not callable(ticket) and not isinstance(ticket, bytes) \
                and not isinstance(ticket, TicketSource):
            raise InvalidArgument(f"ticket must be bytes, a callable, a TicketSource or None, "
                                  f"got {type(ticket).__name__}")
        self._ticket = ticket
        if tls is not None and not isinstance(tls, ssl.SSLContext):
            raise InvalidArgument(f"tls must be an ssl.SSLContext or None, got "
                                  f"{type(tls).__name__}")
        self._tls = tls
        self._tls_server_name = tls_server_name or host
        self._endpoint = Endpoint(TransportKind.TCP, host, port)
        self._config = TcpClientConfig(
            connections=connections, stripe_threshold_bytes=stripe_threshold_bytes,
            max_value_bytes=max_value_bytes, connect_timeout_s=connect_timeout_s,
            io_timeout_s=io_timeout_s, socket_buffer_bytes=socket_buffer_bytes,
            spin_us=spin_us)
        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._idle: deque[_ClientConnection] = deque()
        self._open = 0
        """Connections checked out or idle (<= ``connections``); guarded by ``_lock``."""
        self._waiting = 0
        """Threads waiting in ``_checkout`` for a connection; guarded by ``_lock``."""
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def endpoint(self) -> Endpoint:
        return self._endpoint

    @property
    def config(self) -> TcpClientConfig:
        return self._config

    @property
    def tls(self) -> bool:
        """Whether this client's connections speak TLS."""
        return self._tls is not None

    # --- Transport ----------------------------------------------------------------------------

    def put(self, key: bytes, src: Buffer) -> None:
        k = check_key(key)
        view = host_byte_view(src)
        size = len(view)
        if size > self._config.max_value_bytes:
            raise InvalidArgument(f"value of {size} bytes exceeds max_value_bytes "
                                  f"{self._config.max_value_bytes}")
        if size < self._config.stripe_threshold_bytes or self._config.connections == 1:
            conn = self._checkout()  # not ``self._retrying``: ~1 µs less per call
            try:
                conn.put(k, view)
            except _Stale:
                self._checkin(conn)
                self._retry_fresh(lambda c: c.put(k, view))
                return
            except BaseException as exc:
                _mark_if_out_of_step(conn, exc)
                self._checkin(conn)
                raise
            self._checkin(conn)
            return
        self._put_striped(k, view)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        k = check_key(key)
        view = host_byte_view(dst, writable=True)
        size = len(view)
        if size < self._config.stripe_threshold_bytes or self._config.connections == 1:
            conn = self._checkout()  # not ``self._retrying``: ~1 µs less per call
            try:
                conn.get_into(k, view)
            except _Stale:
                self._checkin(conn)
                self._retry_fresh(lambda c: c.get_into(k, view))
                return size
            except BaseException as exc:
                _mark_if_out_of_step(conn, exc)
                self._checkin(conn)
                raise
            self._checkin(conn)
            return size
        self._get_ranges(k, view, 0, size)
        return size

    def get(self, key: bytes) -> bytearray:
        """The whole value. Small values take one round trip: the first request asks for up to
        ``stripe_threshold_bytes`` of a value of any size; a larger value's rest is striped."""
        k = check_key(key)
        head_bytes = self._config.stripe_threshold_bytes

        def head(conn: _ClientConnection) -> tuple[Header, bytearray]:
            header = conn.request(Opcode.GET_RANGE, k, flags=Flags.ANY_SIZE, length=head_bytes)
            total = header.total_size
            if header.offset != 0 or header.length != min(head_bytes, total) or \
                    header.payload_len != header.length:
                conn.broken = True
                raise ProtocolError(f"GET_RANGE answered {header.payload_len} bytes at "
                                    f"{header.offset} of a {total}-byte value")
            out = bytearray(total)
            conn.recv_payload(memoryview(out)[:header.length], "GET_RANGE payload")
            return header, out

        header, out = self._retrying(head)
        total = header.total_size
        view = memoryview(out)
        if total > header.length:
            self._get_ranges(k, view, header.length, total)
        return out

    def exists(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    def size_of(self, key: bytes) -> int | None:
        k = check_key(key)

        def exists(conn: _ClientConnection) -> int | None:
            try:
                return conn.request(Opcode.EXISTS, k).total_size
            except ChunkNotFound:
                return None

        return self._retrying(exists)

    def remove(self, key: bytes) -> bool:
        k = check_key(key)

        def remove(conn: _ClientConnection) -> bool:
            try:
                conn.request(Opcode.REMOVE, k)
            except ChunkNotFound:
                return False
            return True

        return self._retrying(remove)

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store many values with pipelined PUTs, spread over the pooled connections.

        Returns, per key, True when stored and False when the peer already held the key (for a
        cache, "already there" is an outcome, not a failure). Every other refusal is raised
        after the whole batch ran (the first one; the others' keys may or may not be stored).
        Values of at least ``stripe_threshold_bytes`` go through the striped ``put``.
        """
        ks, views = self._batch_args(keys, srcs, writable=False)
        for view in views:
            if len(view) > self._config.max_value_bytes:
                raise InvalidArgument(f"value of {len(view)} bytes exceeds max_value_bytes "
                                      f"{self._config.max_value_bytes}")
        outcomes = self._batch(Opcode.PUT, ks, views)
        stored: list[bool] = []
        for outcome in outcomes:
            stored.append(not isinstance(outcome, ChunkExists))
        self._raise_first(o for o in outcomes if not isinstance(o, ChunkExists))
        return stored

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[int | None]:
        """Fill many buffers with pipelined GETs, spread over the pooled connections.

        Returns, per key, the byte count, or None when the peer does not hold the key (a miss
        is not an error). Other refusals (``SizeMismatch``...) are raised after the whole batch
        ran; the other buffers are filled. Destinations of at least ``stripe_threshold_bytes``
        go through the striped ``get_into``.
        """
        ks, views = self._batch_args(keys, dsts, writable=True)
        outcomes = self._batch(Opcode.GET, ks, views)
        self._raise_first(o for o in outcomes if not isinstance(o, ChunkNotFound))
        return [None if isinstance(o, ChunkNotFound) else len(v)
                for o, v in zip(outcomes, views, strict=True)]

    def ping(self) -> None:
        """One round trip on a pooled connection. Raises PeerUnavailable."""
        self._retrying(lambda conn: conn.request(Opcode.PING, b""))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
            self._open -= len(idle)
            executor, self._executor = self._executor, None
            self._slot_freed.notify_all()
        for conn in idle:
            conn.close()
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> TcpClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- batches ------------------------------------------------------------------------------

    @staticmethod
    def _batch_args(keys: Sequence[bytes], buffers: Sequence[Buffer], *, writable: bool
                    ) -> tuple[list[ChunkKey], list[memoryview]]:
        if len(keys) != len(buffers):
            raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers")
        return ([check_key(k) for k in keys],
                [host_byte_view(b, writable=writable) for b in buffers])

    def _batch(self, opcode: Opcode, keys: list[ChunkKey], views: list[memoryview]
               ) -> list[KvtierError | None]:
        """Run a batch: small values pipelined on up to ``connections`` connections in
        parallel, large ones one by one through the striped path. Per key: None (done) or the
        refusal. Transport failures raise at once."""
        outcomes: list[KvtierError | None] = [None] * len(keys)
        threshold = self._config.stripe_threshold_bytes
        small = [i for i, v in enumerate(views) if len(v) < threshold]
        large = [i for i, v in enumerate(views) if len(v) >= threshold]

        def run(start: int, count: int) -> None:
            def windows(conn: _ClientConnection) -> None:
                for w in range(start, start + count, _PIPELINE_WINDOW):
                    idx = small[w:min(w + _PIPELINE_WINDOW, start + count)]
                    try:
                        results = conn.pipelined(opcode, [keys[i] for i in idx],
                                                 [views[i] for i in idx])
                    except _Stale as exc:
                        if w != start:  # earlier windows were answered: not an idle close
                            raise PeerUnavailable(str(exc)) from exc
                        raise
                    for i, result in zip(idx, results, strict=True):
                        if isinstance(result, KvtierError):
                            outcomes[i] = result

            self._retrying(windows)

        if small:
            small_bytes = sum(len(views[i]) for i in small)
            lanes = max(1, min(self._config.connections, len(small),
                               small_bytes // _PIPELINE_LANE_BYTES))
            step = -(-len(small) // lanes)
            self._in_parallel(run, [(s, min(step, len(small) - s))
                                    for s in range(0, len(small), step)])
        for i in large:
            try:
                if opcode is Opcode.PUT:
                    self.put(keys[i], views[i])
                else:
                    self.get_into(keys[i], views[i])
            except TransportError:
                raise
            except KvtierError as exc:
                outcomes[i] = exc
        return outcomes

    @staticmethod
    def _raise_first(outcomes: Iterable[KvtierError | None]) -> None:
        for outcome in outcomes:
            if outcome is not None:
                raise outcome

    # --- striping -----------------------------------------------------------------------------

    def _get_ranges(self, key: ChunkKey, view: memoryview, start: int, total: int) -> None:
        """Fill ``view[start:total]`` with GET_RANGE requests, one range per connection."""
        span = total - start
        parts = max(1, min(self._config.connections, span // _MIN_STRIPE_PART_BYTES))

        def fetch(offset: int, length: int) -> None:
            off = start + offset

            def part(conn: _ClientConnection) -> None:
                header = conn.request(Opcode.GET_RANGE, key, offset=off, length=length,
                                      total_size=total)
                self._check_payload(header, length, off)
                conn.recv_payload(view[off:off + length], "GET_RANGE payload")

            self._retrying(part)

        self._in_parallel(fetch, _split(span, parts))

    def _put_striped(self, key: ChunkKey, view: memoryview) -> None:
        size = len(view)
        header = self._retrying(lambda conn: conn.request(Opcode.PUT_BEGIN, key,
                                                          total_size=size))
        transfer_id = header.transfer_id

        def send(offset: int, length: int) -> bool:
            reply = self._retrying(lambda conn: conn.request(
                Opcode.PUT_PART, key, transfer_id=transfer_id, offset=offset, length=length,
                total_size=size, payload=view[offset:offset + length]))
            return bool(reply.flags & Flags.COMMITTED)

        try:
            committed = self._in_parallel(send, _split(size, self._config.connections))
        except BaseException:
            self._abort_transfer(key, transfer_id)
            raise
        if sum(committed) != 1:
            raise InvariantViolation(f"striped put of {key.hex()}: {sum(committed)} parts "
                                     "reported the commit, expected exactly 1")

    def _abort_transfer(self, key: ChunkKey, transfer_id: int) -> None:
        """Best effort: the server's reaper frees the reservation anyway after its TTL."""
        try:
            self._retrying(lambda conn: conn.request(Opcode.PUT_ABORT, key,
                                                     transfer_id=transfer_id))
        except KvtierError as exc:
            log.debug("PUT_ABORT of transfer %#x failed (reaper will free it): %s",
                      transfer_id, exc)

    def _in_parallel(self, fn: Callable[[int, int], _T], ranges: list[tuple[int, int]]
                     ) -> list[_T]:
        """Run ``fn(offset, length)`` per range: the first in this thread, the rest in the pool.
        Waits for every range, even after a failure (they write into the caller's buffer), then
        raises the first error."""
        futures: list[Future[_T]] = [self._pool_executor().submit(fn, off, n)
                                     for off, n in ranges[1:]]
        results: list[_T] = []
        first_error: BaseException | None = None
        try:
            results.append(fn(*ranges[0]))
        except BaseException as exc:
            first_error = exc
        for fut in futures:
            try:
                results.append(fut.result())
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results

    def _pool_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise PeerUnavailable("client is closed")
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=self._config.connections,
                                                    thread_name_prefix="kvtier-tcp-stripe")
            return self._executor

    # --- pool ---------------------------------------------------------------------------------

    def _retrying(self, fn: Callable[[_ClientConnection], _T]) -> _T:
        """``fn`` on a pooled connection (blocking while all ``connections`` are busy), and
        once more on a fresh one when the pooled one turned out closed by the server
        (``_Stale``: see the class docstring). A refused request leaves the connection in
        step; anything else drops it."""
        conn = self._checkout()
        try:
            result = fn(conn)
        except _Stale:
            self._checkin(conn)
            return self._retry_fresh(fn)
        except Unauthenticated:
            # The server ended this connection's session (its ticket expired before the
            # renewal): closed on its side, so the request did nothing. Once more, fresh.
            conn.broken = True
            self._checkin(conn)
            if not isinstance(self._ticket, TicketSource):
                raise
            return self._retry_fresh(fn)
        except BaseException as exc:
            _mark_if_out_of_step(conn, exc)
            self._checkin(conn)
            raise
        self._checkin(conn)
        return result

    def _retry_fresh(self, fn: Callable[[_ClientConnection], _T]) -> _T:
        """The second try after ``_Stale``: the other idle connections idled as long (the most
        recently used one was taken), so they are dropped and this one is most likely new."""
        log.debug("pooled connection to %s:%d was closed by the server; sending again",
                  self._endpoint.host, self._endpoint.port)
        self._drop_idle()
        conn = self._checkout()
        try:
            result = fn(conn)
        except BaseException as exc:
            _mark_if_out_of_step(conn, exc)
            self._checkin(conn)
            raise
        self._checkin(conn)
        return result

    def _checkin(self, conn: _ClientConnection) -> None:
        """Return a checked-out connection (closing it when broken or the client is closed).

        The fast path is one ``deque.append`` (atomic under the GIL): the lock is taken only
        when a connection is dropped or a thread waits for one. Note the order: append, then
        read ``_waiting``; ``_checkout`` counts itself in ``_waiting`` before it looks at the
        idle deque, so a waiter either finds the connection or is notified."""
        if conn.broken or self._closed:
            conn.close()
            with self._lock:
                self._open -= 1
                self._slot_freed.notify()
            return
        self._idle.append(conn)
        if self._waiting:
            with self._lock:
                self._slot_freed.notify()
        if self._closed:  # close() ran between the check above and the append
            self._drop_idle()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = list(self._idle), deque()
            self._open -= len(idle)
            self._slot_freed.notify_all()
        for conn in idle:
            conn.close()

    def _checkout(self) -> _ClientConnection:
        """A pooled connection: the most recently used idle one (one ``deque.pop``, no lock),
        else a new one while fewer than ``connections`` are open, else wait for a checkin.
        Raises PeerUnavailable (client closed, cannot connect)."""
        if not self._closed:
            try:
                conn = self._idle.pop()
            except IndexError:
                pass
            else:
                if conn.renew_at and time.time() >= conn.renew_at:
                    return self._renewed(conn)
                return conn
        reused: _ClientConnection | None = None
        with self._lock:
            self._waiting += 1
            try:
                while True:
                    if self._closed:
                        raise PeerUnavailable("client is closed")
                    if self._idle:
                        reused = self._idle.pop()
                        if not reused.renew_at or time.time() < reused.renew_at:
                            return reused
                        break  # renewed below, outside the lock
                    if self._open < self._config.connections:
                        self._open += 1
                        break
                    self._slot_freed.wait()
            finally:
                self._waiting -= 1
        if reused is not None:
            return self._renewed(reused)
        try:
            return self._connect()
        except BaseException:
            with self._lock:
                self._open -= 1
                self._slot_freed.notify()
            raise

    def _connect(self) -> _ClientConnection:
        """A new connection, its ticket presented (class docstring, "Session tickets"): a
        TicketSource's ticket refused there (stale: the server restarted, or expired early)
        is reported and a fresh one presented once more, on another new connection."""
        conn = self._connect_plain()
        if self._ticket is None:
            return conn
        ticket = self._ticket
        try:
            self._present_ticket(conn)
            return conn
        except Unauthenticated as exc:
            if not isinstance(ticket, TicketSource):
                raise
            log.info("the data plane at %s:%d refused this client's session ticket (%s); "
                     "presenting a new one", self._endpoint.host, self._endpoint.port, exc)
        conn = self._connect_plain()
        self._present_ticket(conn)
        return conn

    def _connect_plain(self) -> _ClientConnection:
        host, port = self._endpoint.host, self._endpoint.port
        try:
            sock = socket.create_connection((host, port), timeout=self._config.connect_timeout_s)
        except OSError as exc:
            raise PeerUnavailable(f"cannot connect to {host}:{port}: {exc}") from exc
        try:
            sock.settimeout(None)
            tune(sock, self._config.socket_buffer_bytes, self._config.io_timeout_s)
        except OSError as exc:
            sock.close()
            raise PeerUnavailable(f"cannot configure the connection to {host}:{port}: {exc}"
                                  ) from exc
        if self._tls is not None:
            return _ClientConnection(self._start_tls(sock), self._config.max_value_bytes)
        ext = native.load_extension()
        return _ClientConnection(
            sock, self._config.max_value_bytes,
            fast_get=None if ext is None else ext.tcp_get,
            spin_ns=self._config.spin_us * 1000,
            timeout_ms=-1)  # blocking with kernel timeouts (tune): sleep in the receive

    def _start_tls(self, sock: socket.socket) -> socket.socket:
        """``sock`` wrapped in a TLS session, handshaken within ``connect_timeout_s``
        (:mod:`.tls`). Raises Unauthenticated (the server's certificate does not verify),
        PeerUnavailable (the handshake failed or timed out: no TLS there, or it refused ours);
        ``sock`` is closed then."""
        assert self._tls is not None
        host, port = self._endpoint.host, self._endpoint.port
        try:
            sock.settimeout(self._config.io_timeout_s)
            tls_sock = self._tls.wrap_socket(sock, server_hostname=self._tls_server_name,
                                             do_handshake_on_connect=False)
        except (OSError, ValueError) as exc:
            sock.close()
            raise PeerUnavailable(f"cannot begin TLS with {host}:{port}: {exc}") from exc
        try:
            handshake(tls_sock, time.monotonic() + self._config.connect_timeout_s)
        except ssl.SSLCertVerificationError as exc:
            tls_sock.close()
            raise Unauthenticated(f"the data plane at {host}:{port} presented a certificate "
                                  f"that does not verify ({exc.verify_message}): another CA, "
                                  "expired, or not issued for this name") from exc
        except (TimeoutError, OSError) as exc:
            tls_sock.close()
            raise PeerUnavailable(
                f"TLS handshake with the data plane at {host}:{port} failed ({exc}): it may "
                "not speak TLS (server.tcp_tls off), or it refused this client's "
                "certificate") from exc
        # Duck-typed: a TlsSocket has every socket method a connection calls.
        return cast(socket.socket, TlsSocket(tls_sock, self._config.io_timeout_s))

    def _present_ticket(self, conn: _ClientConnection) -> None:
        """Send the session ticket as the connection's first frame and wait for the OK (a
        TicketSource's: reported as ``refused`` when the server refuses it). Raises
        Unauthenticated / PermissionDenied (refused: the server closes), PeerUnavailable; the
        connection is closed on any failure."""
        ticket = self._ticket
        raw = b""
        try:
            if isinstance(ticket, TicketSource):
                current = ticket.current()
                raw = current.ticket
                conn.request(Opcode.HELLO, b"", payload=memoryview(raw))
                conn.renew_at = renew_at(current)
            else:
                raw = ticket() if callable(ticket) else ticket  # type: ignore[assignment]
                if not isinstance(raw, bytes):
                    raise InvalidArgument(f"the ticket provider returned {type(raw).__name__}, "
                                          "not bytes")
                conn.request(Opcode.HELLO, b"", payload=memoryview(raw))
        except Unauthenticated:
            conn.close()
            if isinstance(ticket, TicketSource) and raw:
                ticket.refused(raw)
            raise
        except PeerUnavailable as exc:
            conn.close()
            if self._tls is not None:
                # TLS 1.3: a server refusing our certificate says so after the handshake,
                # on the first read (an alert, or a reset once it closed).
                raise PeerUnavailable(
                    f"the data plane at {self._endpoint.host}:{self._endpoint.port} ended the "
                    f"TLS session at its first request ({exc.__cause__ or exc}): it may refuse "
                    "this client's certificate (missing, expired, or from a CA it does not "
                    "trust)") from exc
            raise
        except BaseException:
            conn.close()
            raise
        # The ticket's exchange does not count as a request: the first real one is again
        # request 1, whose EOF before an answer is the server's (not a stale pool's) doing.
        conn._ids = itertools.count(1)

    def _renewed(self, conn: _ClientConnection) -> _ClientConnection:
        """A checked-out ``conn`` whose ticket is due for renewal, after presenting a new one
        (a HELLO on it); when that fails, a new connection instead (counted as the same one
        in the pool). Raises as ``_connect``."""
        source = self._ticket
        assert isinstance(source, TicketSource)
        try:
            current = source.current()
            conn.request(Opcode.HELLO, b"", payload=memoryview(current.ticket))
            conn.renew_at = renew_at(current)
            return conn
        except KvtierError as exc:
            log.info("renewing the session ticket of a connection to %s:%d failed (%s); "
                     "opening a new one", self._endpoint.host, self._endpoint.port, exc)
        conn.close()
        try:
            return self._connect()
        except BaseException:
            with self._lock:
                self._open -= 1
                self._slot_freed.notify()
            raise

    @staticmethod
    def _check_payload(header: Header, length: int, offset: int) -> None:
        if header.payload_len != length or header.offset != offset:
            raise ProtocolError(f"peer answered {header.payload_len} bytes at {header.offset} "
                                f"where {length} at {offset} were asked for")


def _raise_if_stale(exc: PeerUnavailable, reused: bool) -> None:
    """After a failed send: raise ``_Stale`` when the peer had closed or reset a connection
    that carried requests before."""
    cause = exc.__cause__
    if reused and isinstance(cause, OSError) and peer_closed(cause):
        raise _Stale(str(exc)) from exc


def _mark_if_out_of_step(conn: _ClientConnection, exc: BaseException) -> None:
    """A refusal leaves the connection in step; anything else (transport errors, bugs,
    KeyboardInterrupt mid-transfer) may not: never reuse it."""
    if not isinstance(exc, KvtierError) or isinstance(exc, TransportError):
        conn.broken = True

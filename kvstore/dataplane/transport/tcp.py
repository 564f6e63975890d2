"""The TCP data-plane transport: framed requests, payloads moved without intermediate copies.

Wire format: :mod:`kvstore.dataplane.transport.frames`. Contracts: :mod:`.base`. Design notes and
measured figures: ``docs/transport.md``.

Zero intermediate copies (for large values)
    Payloads are received with ``recv_into`` straight into their destination (the server's
    ``WriteLease.buffer``; the caller's ``dst`` on the client) and sent with one
    ``sendmsg([header, view])`` from their source (the server's ``ReadLease.view``; the
    caller's ``src``). No ``bytes`` object is built for a payload and nothing is joined.
    ``MSG_WAITALL`` lets the kernel fill a whole payload in one system call.

Small values: two system calls per request on each side
    Like a bare socket request/response. The client sends header and key with one ``send``
    (a PUT: one ``sendmsg`` with the value) and receives a GET's answer with one
    ``recvmsg_into([header, dst])``. The server reads through a per-connection receive
    buffer, so one ``recv`` takes a small request whole (several, pipelined); the payload
    bytes that came with it are copied into the lease, the rest is received straight into it.
    A GET of at most ``copy_read_max_bytes`` is copied out of the backend
    (``LeaseBackend.read_into``: no pin) behind the response header and sent with one
    ``send``. Measurements: docs/transport.md, "Small values".

Native small-GET loop
    When the native library is loaded (:mod:`kvstore.dataplane.native`) and the backend offers
    ``native_serving()`` (the daemon's ``CacheLeaseBackend`` with a read index), each connection
    thread runs ``kvt_serve`` from ``native/fastpath.c`` with the GIL released: it answers plain
    small GETs of chunks published in the read index with the same bytes as ``_get_copy`` and
    returns with the receive-buffer positions at any frame it does not serve, which Python then
    serves with the code below before calling back. Keys it served are fed back to the backend
    (hits, recency). Design: docs/transport.md, "The native small-GET loop".

Striping
    Values of at least ``stripe_threshold_bytes`` are split into one range per pooled connection
    and moved in parallel threads (sockets release the GIL). Reads use ``GET_RANGE``; writes use
    ``PUT_BEGIN`` (the server reserves an invisible write lease and returns a transfer id), then
    ``PUT_PART`` per range on any connection: the part that completes the value commits it, so a
    striped put is visible only once every byte has arrived. A failed part aborts the whole
    reservation; a reservation nobody writes to for ``reservation_ttl_s`` is aborted by the
    server's reaper.

Threads, not asyncio
    The server runs one thread per connection. Bulk transfers spend their time inside
    ``recv_into``/``sendmsg`` with the GIL released, so threads overlap them as well as an event
    loop would, without asyncio's per-read buffer copies (``StreamReader`` copies into its own
    buffer) or its per-call scheduling overhead, and a slow backend call blocks only its own
    connection. Connections are few and long-lived (a pool per engine), so thread count stays low.

Timeouts and dead peers
    Every client socket carries ``SO_RCVTIMEO``/``SO_SNDTIMEO`` = ``io_timeout_s`` (set with
    ``setsockopt``, so the socket stays in blocking mode and a read costs one system call, not a
    ``poll`` plus a read). A server socket's receive timeout is a short tick
    (``_IDLE_TICK_S``): an idle connection's read wakes at each tick to check for shutdown (no
    ``poll`` per request), and a read inside a frame gives up after ``io_timeout_s`` without
    progress. A peer that stalls mid-frame, dies or resets raises ``PeerUnavailable`` on the
    client; on the server it ends the connection and aborts its write lease.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import itertools
import logging
import os
import secrets
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstore.dataplane import native
from kvstore.dataplane.tier import MAX_KEY_BYTES, Buffer, ChunkKey, check_key
from kvstore.dataplane.transport.base import Endpoint, LeaseBackend, TransportKind, WriteLease
from kvstore.dataplane.transport.frames import (
    DEFAULT_MAX_VALUE_BYTES,
    HEADER,
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
    status_for_error,
)
from kvstore.errors import (
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PeerUnavailable,
    ProtocolError,
    SizeMismatch,
    TransportError,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_STRIPE_THRESHOLD_BYTES = 8 * MiB
DEFAULT_SPIN_US = 0
_MIN_STRIPE_PART_BYTES = 1 * MiB
_DRAIN_CHUNK_BYTES = 256 * 1024
_PIPELINE_WINDOW = 64
"""Requests a batch sends before reading their responses (see ``pipelined``)."""
_MORE = int(Flags.MORE)
_ANY_SIZE = int(Flags.ANY_SIZE)
_GET = int(Opcode.GET)
_PUT = int(Opcode.PUT)
_pack_request = HEADER.pack_into
"""Positional ``HEADER.pack_into`` for the one-value hot paths (``pack_header``'s keywords and
range check cost more than the packing; the callers pass values already checked)."""
_PIPELINE_LANE_BYTES = 4 * MiB
"""A batch is spread over another connection only when each gets at least this many bytes:
below that, per-request Python work dominates, and more threads on either side only contend
for the GIL (measured: 32 x 4 KiB takes longer on 2 or 4 connections than on 1)."""
_T = TypeVar("_T")
DEFAULT_COPY_READ_MAX_BYTES = 64 * 1024
_MAX_COPY_READ_BYTES = 4 * MiB
_RECV_BUFFER_BYTES = 64 * 1024 + HEADER_BYTES + MAX_KEY_BYTES
"""A server connection's receive buffer: one ``recv`` brings a small request whole (header,
key and, for a PUT of up to 64 KiB, its value), or several pipelined ones."""
_IDLE_TICK_S = 0.2
"""A server connection's ``SO_RCVTIMEO``: how often a blocked read looks up to check for
shutdown (instead of a ``poll`` with a wake-up pipe before every request)."""


# --- socket helpers --------------------------------------------------------------------------------


def _set_io_timeout(sock: socket.socket, io_timeout_s: float,
                    recv_timeout_s: float | None = None) -> None:
    """Kernel-level send/receive timeouts; the socket stays blocking (no extra poll per call).
    ``recv_timeout_s``: another receive timeout (a server's idle tick)."""
    for opt, seconds in ((socket.SO_SNDTIMEO, io_timeout_s),
                         (socket.SO_RCVTIMEO, recv_timeout_s or io_timeout_s)):
        sec = int(seconds)
        usec = int((seconds - sec) * 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", sec, usec))


def _tune(sock: socket.socket, socket_buffer_bytes: int | None, io_timeout_s: float,
          recv_timeout_s: float | None = None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if socket_buffer_bytes:
        # Setting these turns off Linux's buffer autotuning for this socket; see docs/transport.md
        # for why the default leaves them alone.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer_bytes)
    _set_io_timeout(sock, io_timeout_s, recv_timeout_s)


def _recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill ``view`` from the socket. Raises PeerUnavailable on EOF, reset or timeout."""
    size = len(view)
    pos = 0
    while pos < size:
        try:
            got = sock.recv_into(view[pos:] if pos else view, size - pos, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError) as exc:
            raise PeerUnavailable(f"timed out receiving {what} ({pos} of {size} bytes)") from exc
        except OSError as exc:
            raise PeerUnavailable(f"connection failed receiving {what}: {exc}") from exc
        if got == 0:
            raise PeerUnavailable(f"peer closed the connection after {pos} of {size} bytes "
                                  f"of {what}")
        pos += got


def _send_parts(sock: socket.socket, parts: Sequence[Buffer], total_bytes: int, what: str,
                flags: int = 0) -> None:
    """Send ``parts`` (``total_bytes`` together) back to back with one ``sendmsg``; a loop only
    if the kernel sends less. ``flags``: ``MSG_MORE`` to hold a partial segment back."""
    try:
        sent = sock.sendmsg(parts, (), flags)
        if sent == total_bytes:
            return
        for part in parts:  # rare: interrupted or timed-out partial send
            if sent >= len(part):
                sent -= len(part)
                continue
            sock.sendall(memoryview(part)[sent:], flags)
            sent = 0
    except (BlockingIOError, TimeoutError) as exc:
        raise PeerUnavailable(f"timed out sending {what}") from exc
    except OSError as exc:
        raise PeerUnavailable(f"connection failed sending {what}: {exc}") from exc


def byte_view(buf: Buffer, *, writable: bool) -> memoryview:
    """A flat, C-contiguous ``uint8`` view of ``buf`` (no copy). Accepts anything with the buffer
    protocol and CPU torch tensors. Raises InvalidArgument otherwise."""
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)
    except TypeError:
        if type(buf).__module__.split(".")[0] != "torch":
            raise InvalidArgument(f"expected a buffer, got {type(buf).__name__}") from None
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise InvalidArgument("a torch tensor buffer must be contiguous and on the CPU"
                                  ) from None
        import torch  # a tensor was passed, so torch is already imported

        view = memoryview(buf.view(torch.uint8).numpy())
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument("destination buffer is read-only")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


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
                 "_timeout_ms", "broken", "recv_hdr", "recv_view", "send_buf", "send_hdr",
                 "send_view", "sock")

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
        _pack_request(self._get_template, 0, MAGIC, VERSION, _GET, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        self.send_hdr = bytearray(HEADER_BYTES)
        self.send_buf = bytearray(HEADER_BYTES + MAX_KEY_BYTES)
        """Header and key of a one-value request, sent with one system call."""
        self.send_view = memoryview(self.send_buf)
        self.recv_hdr = bytearray(HEADER_BYTES)
        self.recv_view = memoryview(self.recv_hdr)
        self.broken = False
        self._ids = itertools.count(1)
        self._max_value_bytes = max_value_bytes

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
                _pack_request(self.send_buf, 0, MAGIC, VERSION, _GET, 0, 0, len(key), 0,
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
            raise PeerUnavailable(f"connection failed on a GET: {exc}") from exc
        if got < HEADER_BYTES:
            if got == 0:
                self.broken = True
                raise PeerUnavailable("peer closed the connection before answering a GET")
            self.recv_payload(self.recv_view[got:], "response header")
            got = HEADER_BYTES
        header = self._check_header(request_id)
        in_view = got - HEADER_BYTES
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
        _pack_request(self.send_buf, 0, MAGIC, VERSION, _PUT, 0, 0, key_len, 0, request_id, 0, 0,
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
            _send_parts(self.sock, parts, total_bytes, what)
        except PeerUnavailable as exc:
            self.broken = True
            # The peer may have refused the frame and closed (oversized value): its answer
            # is likely already in our receive queue.
            rejection = self._rejection_after_failed_send(key)
            if rejection is not None:
                raise rejection from exc
            raise
        header = self._read_header(request_id)
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
            pack_header(headers, opcode, flags=_MORE if i < count - 1 else 0,
                        key_len=len(key), request_id=first_id + i, length=size,
                        total_size=size, payload_len=payload_len, at=i * HEADER_BYTES)
            parts.append(header_views[i * HEADER_BYTES:(i + 1) * HEADER_BYTES])
            parts.append(key)
            if put:
                parts.append(view)
            total_bytes += HEADER_BYTES + len(key) + payload_len
        try:
            _send_parts(self.sock, parts, total_bytes, f"{count} pipelined {opcode.name}s")
        except PeerUnavailable:
            self.broken = True
            raise
        results: list[Header | KvtierError] = []
        for i, (key, view) in enumerate(zip(keys, views, strict=True)):
            header = self._read_header(first_id + i)
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
        try:
            _recv_exact(self.sock, view, what)
        except PeerUnavailable:
            self.broken = True
            raise

    def _read_header(self, request_id: int) -> Header:
        try:
            _recv_exact(self.sock, self.recv_view, "response header")
        except PeerUnavailable:
            self.broken = True
            raise
        return self._check_header(request_id)

    def _check_header(self, request_id: int) -> Header:
        """Decode ``recv_hdr`` and check that it answers ``request_id``."""
        try:
            header = decode_header(self.recv_hdr, self._max_value_bytes)
        except ProtocolError:
            self.broken = True
            raise
        if header.request_id != request_id or header.key_len:
            self.broken = True
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
    fails is discarded, so the call after a server restart succeeds on a fresh one (the failing
    call raises ``PeerUnavailable``: nothing is retried behind the caller's back).
    """

    def __init__(self, host: str, port: int, connections: int = 4, *,
                 stripe_threshold_bytes: int = DEFAULT_STRIPE_THRESHOLD_BYTES,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 connect_timeout_s: float = 5.0, io_timeout_s: float = 30.0,
                 socket_buffer_bytes: int | None = None,
                 spin_us: int = DEFAULT_SPIN_US) -> None:
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

    # --- Transport ----------------------------------------------------------------------------

    def put(self, key: bytes, src: Buffer) -> None:
        k = check_key(key)
        view = byte_view(src, writable=False)
        size = len(view)
        if size > self._config.max_value_bytes:
            raise InvalidArgument(f"value of {size} bytes exceeds max_value_bytes "
                                  f"{self._config.max_value_bytes}")
        if size < self._config.stripe_threshold_bytes or self._config.connections == 1:
            conn = self._checkout()  # not ``with self._connection()``: ~1 µs less per call
            try:
                conn.put(k, view)
            except BaseException as exc:
                _mark_if_out_of_step(conn, exc)
                raise
            finally:
                self._checkin(conn)
            return
        self._put_striped(k, view)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        k = check_key(key)
        view = byte_view(dst, writable=True)
        size = len(view)
        if size < self._config.stripe_threshold_bytes or self._config.connections == 1:
            conn = self._checkout()  # not ``with self._connection()``: ~1 µs less per call
            try:
                conn.get_into(k, view)
            except BaseException as exc:
                _mark_if_out_of_step(conn, exc)
                raise
            finally:
                self._checkin(conn)
            return size
        self._get_ranges(k, view, 0, size)
        return size

    def get(self, key: bytes) -> bytearray:
        """The whole value. Small values take one round trip: the first request asks for up to
        ``stripe_threshold_bytes`` of a value of any size; a larger value's rest is striped."""
        k = check_key(key)
        head_bytes = self._config.stripe_threshold_bytes
        with self._connection() as conn:
            header = conn.request(Opcode.GET_RANGE, k, flags=Flags.ANY_SIZE, length=head_bytes)
            total = header.total_size
            if header.offset != 0 or header.length != min(head_bytes, total) or \
                    header.payload_len != header.length:
                conn.broken = True
                raise ProtocolError(f"GET_RANGE answered {header.payload_len} bytes at "
                                    f"{header.offset} of a {total}-byte value")
            out = bytearray(total)
            view = memoryview(out)
            conn.recv_payload(view[:header.length], "GET_RANGE payload")
        if total > header.length:
            self._get_ranges(k, view, header.length, total)
        return out

    def exists(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    def size_of(self, key: bytes) -> int | None:
        k = check_key(key)
        with self._connection() as conn:
            try:
                header = conn.request(Opcode.EXISTS, k)
            except ChunkNotFound:
                return None
        return header.total_size

    def remove(self, key: bytes) -> bool:
        k = check_key(key)
        with self._connection() as conn:
            try:
                conn.request(Opcode.REMOVE, k)
            except ChunkNotFound:
                return False
        return True

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
        with self._connection() as conn:
            conn.request(Opcode.PING, b"")

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
                [byte_view(b, writable=writable) for b in buffers])

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
            with self._connection() as conn:
                for w in range(start, start + count, _PIPELINE_WINDOW):
                    idx = small[w:min(w + _PIPELINE_WINDOW, start + count)]
                    results = conn.pipelined(opcode, [keys[i] for i in idx],
                                             [views[i] for i in idx])
                    for i, result in zip(idx, results, strict=True):
                        if isinstance(result, KvtierError):
                            outcomes[i] = result

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
            with self._connection() as conn:
                header = conn.request(Opcode.GET_RANGE, key, offset=off, length=length,
                                      total_size=total)
                self._check_payload(header, length, off)
                conn.recv_payload(view[off:off + length], "GET_RANGE payload")

        self._in_parallel(fetch, _split(span, parts))

    def _put_striped(self, key: ChunkKey, view: memoryview) -> None:
        size = len(view)
        with self._connection() as conn:
            header = conn.request(Opcode.PUT_BEGIN, key, total_size=size)
        transfer_id = header.transfer_id

        def send(offset: int, length: int) -> bool:
            with self._connection() as conn:
                reply = conn.request(Opcode.PUT_PART, key, transfer_id=transfer_id,
                                     offset=offset, length=length, total_size=size,
                                     payload=view[offset:offset + length])
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
            with self._connection() as conn:
                conn.request(Opcode.PUT_ABORT, key, transfer_id=transfer_id)
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

    def _connection(self) -> _Checkout:
        """``with self._connection() as conn``: a pooled connection, blocking while all
        ``connections`` are busy. A plain class rather than ``contextlib.contextmanager``: this
        runs on every request and a generator-based context manager costs several µs more."""
        return _Checkout(self)

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
                return self._idle.pop()
            except IndexError:
                pass
        with self._lock:
            self._waiting += 1
            try:
                while True:
                    if self._closed:
                        raise PeerUnavailable("client is closed")
                    if self._idle:
                        return self._idle.pop()
                    if self._open < self._config.connections:
                        self._open += 1
                        break
                    self._slot_freed.wait()
            finally:
                self._waiting -= 1
        try:
            return self._connect()
        except BaseException:
            with self._lock:
                self._open -= 1
                self._slot_freed.notify()
            raise

    def _connect(self) -> _ClientConnection:
        host, port = self._endpoint.host, self._endpoint.port
        try:
            sock = socket.create_connection((host, port), timeout=self._config.connect_timeout_s)
        except OSError as exc:
            raise PeerUnavailable(f"cannot connect to {host}:{port}: {exc}") from exc
        try:
            sock.settimeout(None)
            _tune(sock, self._config.socket_buffer_bytes, self._config.io_timeout_s)
        except OSError as exc:
            sock.close()
            raise PeerUnavailable(f"cannot configure the connection to {host}:{port}: {exc}"
                                  ) from exc
        ext = native.load_extension()
        return _ClientConnection(
            sock, self._config.max_value_bytes,
            fast_get=None if ext is None else ext.tcp_get,
            spin_ns=self._config.spin_us * 1000,
            timeout_ms=-1)  # blocking with kernel timeouts (_tune): sleep in the receive

    @staticmethod
    def _check_payload(header: Header, length: int, offset: int) -> None:
        if header.payload_len != length or header.offset != offset:
            raise ProtocolError(f"peer answered {header.payload_len} bytes at {header.offset} "
                                f"where {length} at {offset} were asked for")


class _Checkout:
    """One checked-out pooled connection; returns it (or drops it when broken) on exit."""

    __slots__ = ("_client", "_conn")

    def __init__(self, client: TcpClient) -> None:
        self._client = client

    def __enter__(self) -> _ClientConnection:
        self._conn = self._client._checkout()
        return self._conn

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if exc is not None:
            _mark_if_out_of_step(self._conn, exc)
        self._client._checkin(self._conn)


def _mark_if_out_of_step(conn: _ClientConnection, exc: BaseException) -> None:
    """A refusal leaves the connection in step; anything else (transport errors, bugs,
    KeyboardInterrupt mid-transfer) may not: never reuse it."""
    if not isinstance(exc, KvtierError) or isinstance(exc, TransportError):
        conn.broken = True


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
    """Longest stall allowed inside one frame (an idle connection may wait forever)."""
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
        for name in ("io_timeout_s", "reservation_ttl_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        if self.drain_timeout_s < 0:
            raise InvalidArgument(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
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


class TcpServer:
    """Serves a :class:`~kvstore.dataplane.transport.base.LeaseBackend` over TCP.

    The constructor only records its arguments; ``start()`` binds, listens and starts the
    accept thread, the reservation reaper and, per connection, one handler thread. ``close()``
    drains (see ``TransportServer.close``). Usable as a context manager (start/close).
    """

    def __init__(self, backend: LeaseBackend, config: TcpServerConfig | None = None) -> None:
        self._backend = backend
        self._config = config or TcpServerConfig()
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
    def native_active(self) -> bool:
        """True when connections run the native small-GET loop (set at ``start``)."""
        return self._native is not None

    def _setup_native(self) -> None:
        """Use the native loop when the config allows it, the library loads and the backend
        offers a read source (``native_serving()``, optional); otherwise stay in Python."""
        cfg = self._config
        if not cfg.native_fast_path or cfg.copy_read_max_bytes == 0:
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
            recv_tick_s=self._recv_tick_s)
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
            try:
                _tune(sock, self._config.socket_buffer_bytes, self._config.io_timeout_s,
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
            if self._connections.pop(handler.conn_id, None) is not None:
                for i, n in enumerate(handler.snapshot_counts()):
                    self._retired_counts[i] += n

    def _begin_reservation(self, key: ChunkKey, lease: WriteLease) -> int:
        with self._lock:
            transfer_id = secrets.randbits(63) or 1
            while transfer_id in self._reservations:
                transfer_id = secrets.randbits(63) or 1
            self._reservations[transfer_id] = _Reservation(
                transfer_id, key, lease, time.monotonic() + self._config.reservation_ttl_s)
        return transfer_id

    def _claim_part(self, transfer_id: int, key: ChunkKey, offset: int, length: int
                    ) -> _Reservation | str:
        """Register a writer for ``[offset, offset+length)``; a string says why not."""
        with self._lock:
            res = self._reservations.get(transfer_id)
            if res is None or res.doomed:
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

    def _abort_reservation(self, transfer_id: int, key: ChunkKey) -> bool:
        with self._lock:
            res = self._reservations.get(transfer_id)
            if res is None or res.key != key:
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


class _ServerConnection:
    """One client connection, served by its own thread until EOF, error or shutdown.

    Reads go through a receive buffer: one ``recv`` takes whatever the client has sent (a
    small request whole, or several pipelined ones), and frames are parsed out of it; a
    payload's first bytes are copied from it and the rest is received straight into the
    destination. There is no ``poll`` per request: the socket's receive timeout is a short
    tick (``_IDLE_TICK_S``) at which an idle read looks up for shutdown, and a read inside a
    frame gives up only after ``io_timeout_s`` without progress.
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
        self._copy_read_max = copy_max
        self._backend = server._backend
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
        if server._native is not None and server._native_cfg is not None:
            self.native_loop = native.NativeLoop(server._native, server._native_cfg,
                                                 server._native_closing, sock.fileno(),
                                                 self.rbuf, self.out)

    def snapshot_counts(self) -> list[int]:
        """This connection's counters, the native loop's included (live: the C loop updates
        its own as it serves)."""
        counts = list(self.counts)
        loop = self.native_loop
        if loop is not None:
            counts[_GET] += loop.st[native.ST_GETS]
            counts[_NATIVE_GETS] += loop.st[native.ST_GETS]
            counts[_BYTES_SENT] += loop.st[native.ST_BYTES_SENT]
        return counts

    def cut(self) -> None:
        """Force the connection down (from another thread): blocked I/O fails at once."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def serve(self) -> None:
        header: Header | None = None
        announced = False
        loop = self.native_loop
        try:
            while True:
                if loop is not None:
                    # The C loop serves plain small GETs of published chunks and hands back
                    # everything else with the buffer positions at that frame (module
                    # docstring, "Native small-GET loop").
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
                announced = bool(header.flags & _MORE)
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

    # --- the native loop ----------------------------------------------------------------------

    def _run_native(self, loop: native.NativeLoop, announced: bool) -> _NativeOutcome:
        """One call into the C loop (GIL released), then the hits it served are accounted.
        Raises PeerUnavailable on a receive or send failure."""
        rc, self.rpos, self.rend, last_flags = loop.serve(self.rpos, self.rend,
                                                          _MORE if announced else 0)
        announced = bool(last_flags & _MORE)
        self._account_native_hits(loop)
        if rc == _NATIVE_SLOW:
            return _NativeOutcome(announced, again=False, eof=False)
        if rc == _NATIVE_RING:
            return _NativeOutcome(announced, again=True, eof=False)
        if rc == _NATIVE_IDLE:
            # Nothing pending and no request announced: wait in C again unless closing. A
            # partial frame, or an announced one, is read by Python (stall timeout, drain).
            again = (self.rpos == self.rend and not announced
                     and not self.server._closing.is_set())
            return _NativeOutcome(announced, again=again, eof=False)
        if rc == _NATIVE_EOF:
            return _NativeOutcome(announced, again=False, eof=True)
        err = os.strerror(int(loop.st[native.ST_ERRNO]))
        if rc == _NATIVE_RECV_ERROR:
            raise PeerUnavailable(f"connection failed: {err}")
        if rc == _NATIVE_SEND_ERROR:
            if loop.st[native.ST_ERRNO] in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise PeerUnavailable("timed out sending GET response")
            raise PeerUnavailable(f"connection failed sending GET response: {err}")
        raise InvariantViolation(f"native loop refused its configuration (return code {rc})")

    def _account_native_hits(self, loop: native.NativeLoop) -> None:
        """Feed the keys the C loop served to the backend (hits, recency), as a same-host
        client's lease-free reads are fed."""
        if loop.st[native.ST_RING_COUNT]:
            assert self.server._native is not None
            self.server._native.record_hits(loop.take_hits())

    # --- the receive buffer -------------------------------------------------------------------

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
                    if closing.is_set():
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
        """Have at least ``size_bytes`` (<= the buffer) unparsed bytes in ``rbuf``, receiving
        as much as arrives. Raises PeerUnavailable on EOF, reset or an ``io_timeout_s`` stall."""
        if self.rend - self.rpos >= size_bytes:
            return
        if self.rpos + size_bytes > _RECV_BUFFER_BYTES:  # compact: move the rest to the front
            have = self.rend - self.rpos
            self.rbuf[:have] = self.rview[self.rpos:self.rend]
            self.rpos, self.rend = 0, have
        stalled_since = 0.0
        while self.rend - self.rpos < size_bytes:
            try:
                got = self.sock.recv_into(self.rview[self.rend:], _RECV_BUFFER_BYTES - self.rend)
            except (BlockingIOError, TimeoutError) as exc:
                stalled_since = self._stalled(stalled_since, what, exc)
                continue
            except OSError as exc:
                raise PeerUnavailable(f"connection failed receiving {what}: {exc}") from exc
            if got == 0:
                raise PeerUnavailable(f"peer closed the connection inside {what}")
            self.rend += got
            stalled_since = 0.0

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
        if h.status is not Status.OK:
            raise ProtocolError(f"request with status {h.status.name}")
        key = b""
        if h.key_len:
            self._fill(h.key_len, "key")
            key = bytes(self.rview[self.rpos:self.rpos + h.key_len])
            self.rpos += h.key_len
        self.counts[h.opcode] += 1
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
        send_flags = socket.MSG_MORE if h.flags & _MORE else 0
        if payload is None:
            _send_parts(self.sock, (self.out_view[:HEADER_BYTES],), HEADER_BYTES, "response",
                        send_flags)
        else:
            _send_parts(self.sock, (self.out_view[:HEADER_BYTES], payload),
                        HEADER_BYTES + payload_len, "response", send_flags)
        self.counts[_BYTES_SENT] += payload_len

    def _reply_quietly(self, h: Header | None, status: Status, detail: str) -> None:
        """Best-effort last word before closing; the peer may already be gone."""
        if h is None:  # the header itself was refused: still echo its request id
            at = self.rpos if self.rend - self.rpos >= HEADER_BYTES else 0
            (request_id,) = struct.unpack_from("<Q", self.rbuf, at + 16)
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
            lease = self.server._backend.open_write(key, h.total_size)
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

    def _get(self, h: Header, key: ChunkKey) -> None:
        size = h.total_size
        if size <= self._copy_read_max and not h.flags & _ANY_SIZE:
            self._get_copy(h, key, size)
            return
        lease = self.server._backend.open_read(key)
        try:
            size = lease.size_bytes
            if not h.flags & _ANY_SIZE and h.total_size != size:
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
        _pack_request(self.out, 0, MAGIC, VERSION, _GET, 0, 0, 0, 0, h.request_id, 0, 0, size,
                      size, size)
        _send_parts(self.sock, (out[:end],), end, "GET response",
                    socket.MSG_MORE if h.flags & _MORE else 0)
        self.counts[_BYTES_SENT] += size

    def _refuse_size(self, h: Header, stored_size: int) -> None:
        """SIZE_MISMATCH carries no detail (``total_size`` says the stored size), so a client
        receiving the answer of a GET straight into its buffer leaves that buffer untouched."""
        self._reply(h, Status.SIZE_MISMATCH, total_size=stored_size)

    def _get_range(self, h: Header, key: ChunkKey) -> None:
        lease = self.server._backend.open_read(key)
        try:
            size = lease.size_bytes
            offset, length = h.offset, h.length
            if h.flags & _ANY_SIZE:
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
        size = self.server._backend.size_of(key)
        if size is None:
            self._reply(h, Status.NOT_FOUND)
        else:
            self._reply(h, total_size=size)

    def _remove(self, h: Header, key: ChunkKey) -> None:
        removed = self.server._backend.remove(key)
        self._reply(h, Status.OK if removed else Status.NOT_FOUND)

    def _put_begin(self, h: Header, key: ChunkKey) -> None:
        if h.total_size == 0:
            self._reply(h, Status.BAD_REQUEST, detail="a multi-part put needs a size >= 1")
            return
        lease = self.server._backend.open_write(key, h.total_size)
        transfer_id = self.server._begin_reservation(key, lease)
        self._reply(h, transfer_id=transfer_id, total_size=h.total_size)

    def _put_part(self, h: Header, key: ChunkKey) -> None:
        if h.length != h.payload_len:
            self._drain(h.payload_len)
            self._reply(h, Status.BAD_REQUEST, detail="PUT_PART length != payload_len")
            return
        claim = self.server._claim_part(h.transfer_id, key, h.offset, h.length)
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
        found = self.server._abort_reservation(h.transfer_id, key)
        self._reply(h, Status.OK if found else Status.UNKNOWN_TRANSFER,
                    transfer_id=h.transfer_id)


# --- standalone server (tests, benchmarks, a quick peer by hand) -----------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvstore.dataplane.transport``: serve an in-memory backend.

    Prints ``LISTENING <host> <port>`` once bound, then serves until SIGTERM/SIGINT (or, with
    ``--exit-on-stdin-eof``, until its parent closes stdin), draining in-flight transfers. A test
    and benchmark harness, not the store daemon: it reads flags only, no config tree.
    """
    from kvstore.dataplane.transport.memory_backend import MemoryBackend

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--max-value-bytes", type=int, default=DEFAULT_MAX_VALUE_BYTES)
    parser.add_argument("--capacity-bytes", type=int, default=None)
    parser.add_argument("--socket-buffer-bytes", type=int, default=None)
    parser.add_argument("--io-timeout-s", type=float, default=30.0)
    parser.add_argument("--reservation-ttl-s", type=float, default=30.0)
    parser.add_argument("--drain-timeout-s", type=float, default=5.0)
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = TcpServerConfig(
            host=args.host, port=args.port, max_value_bytes=args.max_value_bytes,
            socket_buffer_bytes=args.socket_buffer_bytes, io_timeout_s=args.io_timeout_s,
            reservation_ttl_s=args.reservation_ttl_s, drain_timeout_s=args.drain_timeout_s)
    except InvalidArgument as exc:
        parser.error(str(exc))
    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.exit_on_stdin_eof:
        def watch_stdin() -> None:
            # A raw fd read: a daemon thread blocked in the buffered reader would hold its lock
            # and abort interpreter shutdown.
            while os.read(sys.stdin.fileno(), 4096):
                pass
            stop.set()

        threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    server = TcpServer(MemoryBackend(capacity_bytes=args.capacity_bytes), config)
    endpoint = server.start()
    print(f"LISTENING {endpoint.host} {endpoint.port}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0


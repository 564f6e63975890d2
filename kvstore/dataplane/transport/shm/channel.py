"""One client connection to a lease channel (frames: :mod:`.frames`).

:class:`LeaseChannel` sends a request and, unless it carries ``FLAG_NO_REPLY``, reads its reply.
It is used by one thread at a time: :class:`~.client.ShmClient` pools them, its read reporter
keeps one of its own, and tools and tests may use one directly to speak the protocol.

The server closes a connection that sent no request for its ``idle_timeout_s`` and holds no
lease (:mod:`.server`, "Bounds"), before reading any byte of a next request. A request that then
finds the connection closed (the send fails with EPIPE or a reset, or the reply ends or is reset
before its first byte) raises :class:`ChannelClosed` when the channel is marked
``may_be_stale``; the pool (:class:`~.client.ShmClient`) marks the channels it reuses and sends
such a request again once on a fresh connection.

Session tickets: a channel given a :class:`~kvstore.dataplane.transport.auth.TicketSource`
presents its ``current()`` ticket as a HELLO request when it connects (and waits for the OK:
a refused ticket is reported to the source, and a fresh one presented once more on a new
connection), and again, as a renewal without a reply (``FLAG_NO_REPLY``), before the first
request it sends within the renewal margin of that ticket's expiry. A refused renewal is the
server's closing reply, raised by the next reply read.
"""

from __future__ import annotations

import errno
import socket
import struct
import time
from collections.abc import Sequence

from kvstore.dataplane.transport.auth import TicketSource, renew_at
from kvstore.dataplane.transport.shm.frames import (
    FLAG_NO_REPLY,
    RANGE,
    REPLY,
    REQUEST,
    STATUS_CLOSING,
    STATUS_OK,
    ChannelOp,
    pack_keys,
)
from kvstore.errors import (
    InvalidArgument,
    KvtierError,
    PeerUnavailable,
    Unauthenticated,
    error_from_name,
)

_IOV_MAX = 1024
_CLOSED_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


class ChannelClosed(PeerUnavailable):
    """The server had closed (or reset) this channel's connection before any byte of the reply
    to the request: raised instead of PeerUnavailable only on a channel marked
    ``may_be_stale`` (one a pool reused, before its first reply since). The server closes an
    idle connection only before reading any byte of a next request, so this request had no
    effect there if that was why (module docstring)."""


class LeaseChannel:
    """One connection to a lease channel at an abstract address (``@name``).

    ``io_timeout_s`` bounds every send and every wait for a reply (kernel ``SO_SNDTIMEO`` /
    ``SO_RCVTIMEO``: the socket stays blocking, no poll per call); a stopped or stuck peer is
    then ``PeerUnavailable`` after that long instead of a hang. None: no bound."""

    def __init__(self, address: str, *, io_timeout_s: float | None = None,
                 ticket: TicketSource | None = None) -> None:
        """Connect (and present ``ticket``'s current ticket: module docstring). Raises
        InvalidArgument (not an abstract address), PeerUnavailable, and the server's refusal
        of the ticket (Unauthenticated, PermissionDenied)."""
        self._ticket = ticket
        self._renew_at = 0.0
        """When the next request is preceded by a renewal HELLO (wall clock; 0: never)."""
        self._connect(address, io_timeout_s)
        if ticket is None:
            return
        try:
            self._hello(ticket)
        except Unauthenticated:
            self.sock.close()  # the server closed it too
            self._connect(address, io_timeout_s)  # reported: the source has a fresh one
            try:
                self._hello(ticket)
            except BaseException:
                self.sock.close()
                raise
        except BaseException:
            self.sock.close()
            raise

    def _hello(self, ticket: TicketSource) -> None:
        """Present ``ticket.current()`` and wait for the OK (reporting a refusal to it)."""
        current = ticket.current()
        try:
            self.call(ChannelOp.HELLO, arg=len(current.ticket),
                      payload=memoryview(current.ticket))
        except Unauthenticated:
            ticket.refused(current.ticket)
            raise
        self._renew_at = renew_at(current)

    def _connect(self, address: str, io_timeout_s: float | None) -> None:
        if not address.startswith("@"):
            raise InvalidArgument(f"lease channel address must be abstract (@name): {address!r}")
        if io_timeout_s is not None and not io_timeout_s > 0:
            raise InvalidArgument(f"io_timeout_s must be > 0 or None, got {io_timeout_s}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect("\0" + address[1:])
            if io_timeout_s is not None:
                sec = int(io_timeout_s)
                timeval = struct.pack("ll", sec, int((io_timeout_s - sec) * 1_000_000))
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        except OSError as exc:
            self.sock.close()
            raise PeerUnavailable(f"cannot reach the lease channel {address}: {exc}") from exc
        self._reply = memoryview(bytearray(REPLY.size))
        self.detail = b""
        """The detail bytes of the last successful reply (PUT_MANY: one status per key)."""
        self.unacknowledged = False
        """A request without a reply (RELEASE) was sent and nothing has been answered since."""
        self.broken = False
        """A send or receive failed (or a reply was malformed): the connection may be out of
        step and is not reused."""
        self.may_be_stale = False
        """Set by a pool that reuses this channel; cleared by the next reply. While set, a
        request that finds the connection closed raises :class:`ChannelClosed`."""

    def send(self, op: ChannelOp, *, flags: int = 0, keys: Sequence[bytes] = (), arg: int = 0,
             ttl_s: float = 0.0, payload: memoryview | None = None,
             payloads: Sequence[memoryview] = ()) -> None:
        """Send one request; ``payload`` (or the buffers of ``payloads``, gathered by one
        ``sendmsg`` without copying) follow the keys in the body. The payloads are read only
        during the call."""
        if self._renew_at and time.time() >= self._renew_at:
            self._renew()
        body = pack_keys(list(keys)) if keys else b""
        parts = [payload] if payload is not None else list(payloads)
        extra = sum(p.nbytes for p in parts)
        header = REQUEST.pack(op, flags, len(keys), len(body) + extra, arg, ttl_s) + body
        try:
            if not parts:
                self.sock.sendall(header)
            else:
                sendmsg_all(self.sock, [memoryview(header), *parts])
        except (BlockingIOError, TimeoutError) as exc:
            self.broken = True
            raise PeerUnavailable("lease channel send timed out") from exc
        except OSError as exc:
            self.broken = True
            refusal = self._closing_reply()
            if refusal is not None:
                raise refusal from exc
            if self.may_be_stale and exc.errno in _CLOSED_ERRNOS:
                raise ChannelClosed(f"lease channel send found it closed: {exc}") from exc
            raise PeerUnavailable(f"lease channel send failed: {exc}") from exc
        if flags & FLAG_NO_REPLY:
            self.unacknowledged = True

    def _renew(self) -> None:
        """Present a new ticket without waiting for a reply (module docstring)."""
        assert self._ticket is not None
        current = self._ticket.current()
        self._renew_at = 0.0  # (send() below must not renew again)
        self.send(ChannelOp.HELLO, flags=FLAG_NO_REPLY, arg=len(current.ticket),
                  payload=memoryview(current.ticket))
        self._renew_at = renew_at(current)

    def call(self, op: ChannelOp, *, flags: int = 0, keys: Sequence[bytes] = (), arg: int = 0,
             ttl_s: float = 0.0, payload: memoryview | None = None,
             payloads: Sequence[memoryview] = ()) -> tuple[int, list[tuple[int, int]]]:
        """Send a request and read its reply: (lease id, ranges). Raises the peer's error."""
        self.send(op, flags=flags, keys=keys, arg=arg, ttl_s=ttl_s, payload=payload,
                  payloads=payloads)
        return self.recv_reply()

    def recv_reply(self) -> tuple[int, list[tuple[int, int]]]:
        """Read the reply to the oldest request sent and not answered yet (requests may be
        pipelined: replies come in order): (lease id, ranges); its detail in :attr:`detail`.
        Raises the peer's error."""
        self._recv_into(self._reply, first=True)
        status, count, detail_len, lease_id = REPLY.unpack(self._reply)
        self.unacknowledged = self.may_be_stale = False
        tail = bytearray(count * RANGE.size + detail_len)
        if tail:
            self._recv_into(memoryview(tail))
        if status != STATUS_OK:
            if status == STATUS_CLOSING:
                self.broken = True  # the server closes this connection after this reply
            name, _, message = bytes(tail[count * RANGE.size:]).decode(errors="replace") \
                .partition("\n")
            raise error_from_name(name, message)
        ranges = [RANGE.unpack_from(tail, i * RANGE.size) for i in range(count)]
        self.detail = bytes(tail[count * RANGE.size:])
        return lease_id, ranges

    def _closing_reply(self) -> KvtierError | None:
        """After a failed send: the error of a closing reply the server left before it hung
        up (it refused the connection at its limit), if one is waiting."""
        try:
            data = self.sock.recv(REPLY.size + 4096, socket.MSG_DONTWAIT)
        except OSError:
            return None
        if len(data) < REPLY.size:
            return None
        status, count, detail_len, _ = REPLY.unpack_from(data)
        if status != STATUS_CLOSING or count:
            return None
        name, _, message = data[REPLY.size:REPLY.size + detail_len].decode(
            errors="replace").partition("\n")
        return error_from_name(name, message)

    def _recv_into(self, view: memoryview, *, first: bool = False) -> None:
        """Fill ``view`` from the socket. ``first``: it is the start of a reply (an EOF or a
        reset before its first byte is ChannelClosed on a ``may_be_stale`` channel)."""
        pos = 0
        try:
            while pos < len(view):
                n = self.sock.recv_into(view[pos:], len(view) - pos, socket.MSG_WAITALL)
                if n == 0:
                    self.broken = True
                    if first and pos == 0 and self.may_be_stale:
                        raise ChannelClosed("the peer had closed the lease channel")
                    raise PeerUnavailable("the peer closed the lease channel")
                pos += n
        except (BlockingIOError, TimeoutError) as exc:
            self.broken = True
            raise PeerUnavailable("lease channel reply timed out") from exc
        except OSError as exc:
            self.broken = True
            if first and pos == 0 and self.may_be_stale and exc.errno in _CLOSED_ERRNOS:
                raise ChannelClosed(f"the peer had reset the lease channel: {exc}") from exc
            raise PeerUnavailable(f"lease channel receive failed: {exc}") from exc

    def close(self) -> None:
        self.sock.close()


def sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send every buffer, in order, with as few ``sendmsg`` calls as the socket allows."""
    while buffers:
        sent = sock.sendmsg(buffers[:_IOV_MAX])
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]

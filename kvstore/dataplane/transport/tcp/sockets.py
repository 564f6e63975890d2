"""What both ends of the TCP transport share: socket set-up, exact receives, gathered sends, and
the few header fields the hot paths pack positionally. Wire format: :mod:`..frames`."""

from __future__ import annotations

import errno
import socket
import ssl
import struct
from collections.abc import Sequence

from kvstore.dataplane.tier import Buffer
from kvstore.dataplane.transport.frames import HEADER, Flags, Opcode
from kvstore.errors import PeerUnavailable

MiB = 1 << 20
MORE = int(Flags.MORE)
ANY_SIZE = int(Flags.ANY_SIZE)
GET = int(Opcode.GET)
PUT = int(Opcode.PUT)
pack_request = HEADER.pack_into
"""Positional ``HEADER.pack_into`` for the one-value hot paths (``pack_header``'s keywords and
range check cost more than the packing; the callers pass values already checked)."""

_CLOSED_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


class PeerClosed(PeerUnavailable):
    """The peer closed or reset the connection before the first byte of what was awaited: on
    a connection that carried requests before, the server may have closed it as idle
    (``TcpClient`` then sends the request again once on a fresh connection)."""


def peer_closed(exc: OSError) -> bool:
    """Whether ``exc`` says the peer closed or reset the connection. Under TLS a send into a
    connection the peer closed fails with OpenSSL's own EOF (``SSLEOFError``, or a clean
    ``close_notify``: ``SSLZeroReturnError``), which carries no errno."""
    return exc.errno in _CLOSED_ERRNOS or isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError)


# --- socket helpers --------------------------------------------------------------------------------


def set_io_timeout(sock: socket.socket, io_timeout_s: float,
                    recv_timeout_s: float | None = None) -> None:
    """Kernel-level send/receive timeouts; the socket stays blocking (no extra poll per call).
    ``recv_timeout_s``: another receive timeout (a server's idle tick)."""
    for opt, seconds in ((socket.SO_SNDTIMEO, io_timeout_s),
                         (socket.SO_RCVTIMEO, recv_timeout_s or io_timeout_s)):
        sec = int(seconds)
        usec = int((seconds - sec) * 1_000_000)
        sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", sec, usec))


def tune(sock: socket.socket, socket_buffer_bytes: int | None, io_timeout_s: float,
          recv_timeout_s: float | None = None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if socket_buffer_bytes:
        # Setting these turns off Linux's buffer autotuning for this socket; see docs/transport.md
        # for why the default leaves them alone.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, socket_buffer_bytes)
    set_io_timeout(sock, io_timeout_s, recv_timeout_s)


def recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill ``view`` from the socket. Raises PeerUnavailable on EOF, reset or timeout
    (PeerClosed for an EOF or reset before its first byte)."""
    size = len(view)
    pos = 0
    while pos < size:
        try:
            got = sock.recv_into(view[pos:] if pos else view, size - pos, socket.MSG_WAITALL)
        except (BlockingIOError, TimeoutError) as exc:
            raise PeerUnavailable(f"timed out receiving {what} ({pos} of {size} bytes)") from exc
        except OSError as exc:
            cls = PeerClosed if pos == 0 and peer_closed(exc) else PeerUnavailable
            raise cls(f"connection failed receiving {what}: {exc}") from exc
        if got == 0:
            cls = PeerClosed if pos == 0 else PeerUnavailable
            raise cls(f"peer closed the connection after {pos} of {size} bytes of {what}")
        pos += got


def send_parts(sock: socket.socket, parts: Sequence[Buffer], total_bytes: int, what: str,
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

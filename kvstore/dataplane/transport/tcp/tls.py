"""TLS on the TCP data plane (optional; docs/security.md, "TLS on the TCP data plane").

The data plane knows no certificates: the daemon hands :class:`~.server.TcpServer` a
:data:`ServerTlsSource` (a callable returning the current ``ssl.SSLContext``, asked once per
accepted connection, so rotated certificate files take effect on new connections: the
daemon's comes from :meth:`kvstore.security.tls.ServerCertificates.ssl_context`) and
a client hands :class:`~.client.TcpClient` an ``ssl.SSLContext`` (and the name to check the
server's certificate against).

:class:`TlsSocket` puts an ``ssl.SSLSocket`` behind the few socket methods the transport calls
(``recv_into``, ``recvmsg_into``, ``send``, ``sendall``, ``sendmsg``, ``recv``, ``shutdown``),
so the framing code runs unchanged over TLS. What differs, and why:

* **Timeouts.** The plain transport keeps sockets blocking with kernel ``SO_RCVTIMEO`` /
  ``SO_SNDTIMEO``. OpenSSL turns the ``EAGAIN`` such a timeout returns into
  ``SSL_ERROR_WANT_READ``, which CPython retries forever on a blocking socket, so a TLS socket
  runs in CPython's timeout mode instead (non-blocking descriptor, a ``poll`` only when a read
  or write would block) and raises ``TimeoutError`` where a plain read would: the server's
  idle ticks and header clocks work as they do without TLS.
* **Partial reads.** One ``SSL_read`` returns at most one TLS record (16 KiB), whatever
  ``MSG_WAITALL`` asked: every caller loops until its buffer is full, as it does for a short
  plain read. ``recvmsg_into`` fills the header buffer, then hands the payload buffer only what
  OpenSSL already decrypted (``pending``), never waiting for it.
* **Writes.** There is no ``sendmsg`` (or ``sendfile``) through TLS: ``sendmsg`` joins small
  parts into one record (a header and a small value: one copy of a few KiB, cheaper than a
  record each) and writes large parts one after another from the caller's buffer. A write that
  times out is retried with the same buffer (OpenSSL's rule for a retried ``SSL_write``) for
  up to ``io_timeout_s`` per 256 KiB piece, so a slow reader is given as long as without TLS.
* **Flags.** ``MSG_MORE`` is dropped (records are already whole writes); ``MSG_DONTWAIT``
  becomes "only what is already there" (OpenSSL's buffer or a zero-timeout ``poll``).
* **No native loop.** The native small-GET loop (server) and the extension's small GET
  (client) read and write the raw descriptor, so neither runs on a TLS connection.

Checks after the handshake (:class:`CheckedServerContext`): OpenSSL verifies the client
certificate's chain and dates, not what the daemon decides about it (revocation by its CRL or
``revoked_serials``). A context that carries a ``peer_check`` has it run on the client's
certificate once the handshake is done and again every ``peer_recheck_s`` while the connection
serves (before its next request), so a certificate revoked later, or one that expires on an
open connection, ends it as gRPC refuses its next call; the refusal is one ``UNAUTHENTICATED``
frame inside TLS naming the reason, then the close.

Plain clients: a plain frame arriving on a TLS port (its first bytes are the frame magic, not a
TLS record) is answered in plain text with one ``PROTOCOL`` frame saying the plane needs TLS,
and closed (:func:`looks_like_plain_frame`), so a client that does not speak TLS hears why
instead of waiting on a handshake.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable, Sequence

from kvstore.dataplane.tier import Buffer

ServerTlsSource = Callable[[], ssl.SSLContext]
"""The TLS context for the next accepted connection (called once per connection, on its own
thread; it must be thread-safe and cheap when nothing changed). A
:class:`CheckedServerContext` also checks each client certificate after the handshake."""

PeerCheck = Callable[[bytes], None]
"""Called with the client's certificate (DER) after the handshake and while the connection
serves; raises :class:`~kvstore.errors.Unauthenticated` naming why it is refused (revoked,
expired). Thread-safe, cheap (called at most once per ``peer_recheck_s`` per connection)."""


class CheckedServerContext(ssl.SSLContext):
    """A server context whose connections' client certificates are also checked by
    ``peer_check`` (module docstring, "Checks after the handshake"); with ``peer_check`` None
    it is a plain ``ssl.SSLContext``."""

    peer_check: PeerCheck | None = None
    peer_recheck_s: float = 1.0

_WRITE_PIECE_BYTES = 256 * 1024
"""Large writes go out in pieces of this many bytes, each with its own ``io_timeout_s``."""
_JOIN_MAX_BYTES = 64 * 1024
"""``sendmsg`` parts of at most this many bytes together are joined into one write."""
TLS_RECORD_TYPE_HANDSHAKE = 0x16
"""The first byte of a TLS ClientHello (a handshake record)."""


def looks_like_plain_frame(first: bytes, magic: bytes) -> bool:
    """Whether the first bytes a TLS port received are a plain data-plane frame (they begin
    with ``magic``) rather than a TLS handshake. ``first`` may be shorter than ``magic``."""
    return bool(first) and first[0] != TLS_RECORD_TYPE_HANDSHAKE \
        and magic.startswith(first[:len(magic)])


class TlsSocket:
    """An established TLS connection with the socket methods the TCP transport uses (module
    docstring). Used by one thread at a time, as the plain socket it replaces."""

    __slots__ = ("_io_timeout_s", "_ssl", "tls_version")

    def __init__(self, ssl_sock: ssl.SSLSocket, io_timeout_s: float) -> None:
        """``ssl_sock``: handshaken, in timeout mode (its timeout is the read tick);
        ``io_timeout_s``: how long one piece of a write may stall."""
        self._ssl = ssl_sock
        self._io_timeout_s = io_timeout_s
        self.tls_version = ssl_sock.version() or ""

    @property
    def ssl_socket(self) -> ssl.SSLSocket:
        return self._ssl

    def fileno(self) -> int:
        return self._ssl.fileno()

    def getpeercert(self) -> dict[str, object] | None:
        return self._ssl.getpeercert()  # type: ignore[return-value]

    def _ready_now(self) -> bool:
        """Whether a read would find bytes without waiting (decrypted ones, or the socket's)."""
        if self._ssl.pending():
            return True
        poller = select.poll()
        poller.register(self._ssl.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    # --- reads --------------------------------------------------------------------------------

    def recv_into(self, buffer: Buffer, nbytes: int = 0, flags: int = 0) -> int:
        if flags & socket.MSG_DONTWAIT and not self._ready_now():
            raise BlockingIOError("nothing to read now")
        return self._ssl.recv_into(buffer, nbytes or len(memoryview(buffer)))

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        if flags & socket.MSG_DONTWAIT and not self._ready_now():
            raise BlockingIOError("nothing to read now")
        return self._ssl.recv(bufsize)

    def recvmsg_into(self, buffers: Sequence[Buffer], ancbufsize: int = 0, flags: int = 0
                     ) -> tuple[int, list[tuple[int, int, bytes]], int, None]:
        """Fill ``buffers`` in order with one wait at most: the first read may wait, later
        buffers get only what is already decrypted."""
        total = 0
        for i, buf in enumerate(buffers):
            view = memoryview(buf).cast("B")
            pos = 0
            while pos < len(view):
                if (i or pos) and not self._ssl.pending():
                    return total + pos, [], 0, None
                got = self._ssl.recv_into(view[pos:], len(view) - pos)
                if got == 0:
                    return total + pos, [], 0, None
                pos += got
            total += pos
        return total, [], 0, None

    # --- writes -------------------------------------------------------------------------------

    def _write(self, view: memoryview) -> None:
        """Write all of ``view``; a piece whose write keeps timing out for ``io_timeout_s``
        raises TimeoutError. A retried write passes the same buffer, as OpenSSL requires."""
        ssl_sock = self._ssl
        pos, size = 0, len(view)
        while pos < size:
            piece = view[pos:pos + _WRITE_PIECE_BYTES]
            deadline = 0.0
            while True:
                try:
                    sent = ssl_sock.send(piece)
                    break
                except (TimeoutError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                    now = time.monotonic()
                    if not deadline:
                        deadline = now + self._io_timeout_s
                    elif now >= deadline:
                        raise TimeoutError(f"TLS write stalled for {self._io_timeout_s:g} s"
                                           ) from None
            pos += sent

    def send(self, data: Buffer, flags: int = 0) -> int:
        view = memoryview(data).cast("B")
        self._write(view)
        return len(view)

    def sendall(self, data: Buffer, flags: int = 0) -> None:
        self._write(memoryview(data).cast("B"))

    def sendmsg(self, buffers: Sequence[Buffer], ancdata: Sequence[object] = (),
                flags: int = 0, address: object = None) -> int:
        """Small parts together (at most ``_JOIN_MAX_BYTES``) go out as one joined write;
        larger ones are written one after another from the caller's buffers."""
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        if total <= _JOIN_MAX_BYTES:
            self._write(memoryview(b"".join(views)))
            return total
        for view in views:
            self._write(view)
        return total

    # --- the connection -----------------------------------------------------------------------

    def shutdown(self, how: int) -> None:
        # Shut the TCP socket itself: an SSL close_notify exchange could block here.
        socket.socket.shutdown(self._ssl, how)

    def close(self) -> None:
        self._ssl.close()

    def settimeout(self, value: float | None) -> None:
        self._ssl.settimeout(value)


def handshake(ssl_sock: ssl.SSLSocket, deadline: float) -> None:
    """Run the TLS handshake of ``ssl_sock`` (in timeout mode, created with
    ``do_handshake_on_connect=False``) until it completes; TimeoutError once ``deadline``
    (``time.monotonic()``) passed, ``ssl.SSLError`` when it fails."""
    while True:
        try:
            ssl_sock.do_handshake()
            return
        except (TimeoutError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            if time.monotonic() >= deadline:
                raise TimeoutError("the TLS handshake did not complete in time") from None

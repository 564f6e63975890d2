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

TLS (optional)
    ``TcpServer(tls=)`` / ``TcpClient(tls=)``: every connection speaks TLS (:mod:`.tls`, which
    says what changes underneath: timeouts, one record per read, no ``sendmsg``); its
    connections run in Python, since the native loops use the raw descriptor.

Layout
    :mod:`.sockets` the socket helpers and wire shortcuts both ends share, :mod:`.client`
    :class:`TcpClient`, :mod:`.server` :class:`TcpServer`, :mod:`.tls` the TLS socket,
    :mod:`.standalone` the standalone server over a ``MemoryBackend``
    (``python -m kvstore.dataplane.transport`` or ``... .tcp``).
"""

from __future__ import annotations

from kvstore.dataplane.transport.tcp.client import (
    DEFAULT_SPIN_US,
    DEFAULT_STRIPE_THRESHOLD_BYTES,
    TcpClient,
    TcpClientConfig,
)
from kvstore.dataplane.transport.tcp.server import (
    DEFAULT_COPY_READ_MAX_BYTES,
    TcpServer,
    TcpServerConfig,
    TcpServerStats,
)
from kvstore.dataplane.transport.tcp.standalone import main

__all__ = [
    "DEFAULT_COPY_READ_MAX_BYTES",
    "DEFAULT_SPIN_US",
    "DEFAULT_STRIPE_THRESHOLD_BYTES",
    "TcpClient",
    "TcpClientConfig",
    "TcpServer",
    "TcpServerConfig",
    "TcpServerStats",
    "main",
]

"""Reports of lease-free reads: the keys a client copied through the read index, sent to the
server afterwards (READS, no reply) so that it counts the hits and refreshes recency."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections import deque

from kvstore.dataplane.transport.auth import TicketSource
from kvstore.dataplane.transport.shm.channel import ChannelClosed, LeaseChannel
from kvstore.dataplane.transport.shm.frames import FLAG_NO_REPLY, MAX_KEYS, ChannelOp
from kvstore.errors import PeerUnavailable, PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)


class ReadReporter:
    """Reports the keys of lease-free reads to the server (READS, no reply) from a thread of its
    own, every ``interval_s`` or as soon as ``batch`` are waiting, over a connection of its own.

    Recording is one ``deque.append`` (thread-safe); the queue is bounded, so a reporter that
    cannot keep up drops the oldest keys (recency and hit counts are approximate anyway).

    The server closes this connection when nothing was reported for its ``idle_timeout_s``
    (it holds no lease). A send that finds it closed (``ChannelClosed``: EPIPE or a reset)
    reconnects once and sends the batch again; a batch sent into the socket just as the server
    closed it is lost (acceptable: it is only hit counting), and then ``flush(wait=True)``
    returns without it. Any other failure, or one on the fresh connection (the server is gone
    or stuck), stops reporting; nothing else depends on it and nothing is raised to callers.
    """

    MAX_QUEUED = 1 << 16

    def __init__(self, address: str, *, interval_s: float, batch: int,
                 io_timeout_s: float | None = None, ticket: TicketSource | None = None) -> None:
        """Record the settings; :meth:`start` opens the eventfd and starts the thread.
        ``ticket``: the session ticket its connection presents (a server that requires one)."""
        self._address = address
        self._ticket = ticket
        self._io_timeout_s = io_timeout_s
        self._interval_s = interval_s
        self.batch = batch
        self.queue: deque[bytes] = deque(maxlen=self.MAX_QUEUED)
        self.wake_fd = -1
        self._chan: LeaseChannel | None = None
        self._send_lock = threading.Lock()
        self._stopping = False
        self._broken = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="kvtier-read-reports",
                                        daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Ask the thread to send now (a full batch is waiting)."""
        if not self._stopping and self.wake_fd >= 0:
            os.eventfd_write(self.wake_fd, 1)

    def _run(self) -> None:
        while not self._stopping:
            readable, _, _ = select.select([self.wake_fd], [], [], self._interval_s)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self.wake_fd)
            self.flush()

    def flush(self, *, wait: bool = False) -> None:
        """Send what is queued; with ``wait``, return only once the server has processed it
        (a PING after the reports on the same connection, which is served in order)."""
        with self._send_lock:
            if self._broken:
                return
            try:
                while self.queue:
                    keys = []
                    with contextlib.suppress(IndexError):
                        for _ in range(min(len(self.queue), MAX_KEYS)):
                            keys.append(self.queue.popleft())
                    self._send(keys)
                if wait and self._chan is not None:
                    try:
                        self._chan.call(ChannelOp.PING)
                    except ChannelClosed:  # closed idle: it had processed everything first
                        self._drop_channel()
                    else:
                        self._chan.may_be_stale = True
            except (PeerUnavailable, Unauthenticated, PermissionDenied) as exc:
                log.info("lease-free read reports stop: %s", exc)
                self._broken = True
                self._drop_channel()

    def _send(self, keys: list[bytes]) -> None:
        """One READS report; a connection found closed is replaced once (class docstring).
        Raises PeerUnavailable."""
        chan = self._chan
        if chan is not None:
            try:
                chan.send(ChannelOp.READS, flags=FLAG_NO_REPLY, keys=keys)
                return
            except ChannelClosed as exc:
                log.debug("read report connection closed by the server (%s): reconnecting", exc)
                self._drop_channel()
        chan = self._chan = LeaseChannel(self._address, io_timeout_s=self._io_timeout_s,
                                         ticket=self._ticket)
        # Only a PING is ever answered on it: a later send that finds it closed (idle) is
        # ChannelClosed, and reconnects.
        chan.may_be_stale = True
        chan.send(ChannelOp.READS, flags=FLAG_NO_REPLY, keys=keys)

    def _drop_channel(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def close(self) -> None:
        """Flush, stop the thread, close the connection. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None:
            os.eventfd_write(self.wake_fd, 1)
            self._thread.join(5.0)
        self.flush()
        with self._send_lock:
            self._broken = True
            self._drop_channel()
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1

"""The connector's :class:`KVClient`, kept alive across daemon failures.

vLLM must never wait for kvtier: :meth:`ClientSession.get` answers at once with the client or
None (no daemon now: 0 hits, loads fail, saves are skipped). The first connect runs in the
constructor (bounded by the connect timeout), later ones in a background thread at most once
per ``reconnect_interval_s`` after :meth:`ClientSession.failed` dropped a client whose daemon
died or restarted (a restarted daemon has a new arena: the old connection cannot be reused).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstore.client.kv_client import KVClient
from kvstore.errors import KvtierError

log = logging.getLogger(__name__)

__all__ = ["ClientSession"]


class ClientSession:
    def __init__(self, connect: Callable[[], KVClient], reconnect_interval_s: float,
                 what: str) -> None:
        self._connect = connect
        self._interval_s = reconnect_interval_s
        self._what = what
        self._lock = threading.Lock()
        self._client: KVClient | None = None
        self._next_try = 0.0
        self._connecting = False
        self._closed = False
        self._try_connect()

    def _try_connect(self) -> None:
        try:
            client = self._connect()
        except KvtierError as exc:
            log.warning("kvtier connector (%s): no daemon (%s: %s); serving without kvtier, "
                        "retrying every %.1f s", self._what, type(exc).__name__, exc,
                        self._interval_s)
            client = None
        stale = None
        with self._lock:
            self._connecting = False
            self._next_try = time.monotonic() + self._interval_s
            if self._closed:
                stale = client
            else:
                self._client = client
        if stale is not None:
            stale.close()
        if client is not None and stale is None:
            log.info("kvtier connector (%s): connected to %s", self._what, client.store.address)

    def get(self) -> KVClient | None:
        """The client, or None while there is no daemon (a reconnect is started if due)."""
        with self._lock:
            client = self._client
            due = (client is None and not self._connecting and not self._closed
                   and time.monotonic() >= self._next_try)
            if due:
                self._connecting = True
        if due:
            threading.Thread(target=self._try_connect, name="kvtier-reconnect",
                             daemon=True).start()
        return client

    def failed(self, client: KVClient, why: str) -> None:
        """``client``'s daemon failed: drop it (closed in the background) and reconnect later."""
        with self._lock:
            if self._client is not client:
                return
            self._client = None
            self._next_try = time.monotonic() + self._interval_s
        log.warning("kvtier connector (%s): daemon failed (%s); serving without kvtier until "
                    "it is back", self._what, why)
        threading.Thread(target=client.close, name="kvtier-close", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

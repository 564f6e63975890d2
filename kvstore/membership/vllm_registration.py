"""A vLLM server's engine records in etcd, held by a sidecar while the server is healthy.

vLLM does not speak etcd, so something beside it holds its :class:`EngineRecord` (with its
``http_url`` and, for KV-aware routing, its :class:`VllmKvEvents`) under a lease:
:func:`hold_while_healthy` (``kvtier vllm-register`` runs it for a ``vllm serve``; the local
cluster and the tests call it in-process, with their own health check).

Lifecycle::

    wait until healthy ──► register every record (one lease each, kept alive) ──► poll health
          ▲                                                                       │
          └────── revoke the leases (the records vanish at once) ◄── N failures in a row

* A server that stops answering ``/health`` (``failures_to_drop`` polls in a row, so one slow
  answer under load does not flap the record) loses its records at once: the conductor drops
  its cache view and stops routing there. When it answers again (a restart) the records are
  written under new leases, which the conductor sees as a new registration (its view of the
  engine's cache starts over: a restarted vLLM's cache is empty).
* If the sidecar itself dies, the leases expire after ``ttl_s``: the records go then.
* Why here and not in ``kvstore/cluster/``: the launcher of a local cluster, the CLI and the
  tests all need it, and it is etcd membership (below all of them); it speaks only stdlib HTTP.

Asyncio only; one call holds one server's records.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence

import aetcd

from kvstore.errors import InvalidArgument, MembershipError
from kvstore.membership.engines import EngineRecord, register_engine
from kvstore.membership.etcd import DEFAULT_LAYOUT, KeyLayout
from kvstore.membership.registration import Registration

log = logging.getLogger(__name__)

__all__ = ["HealthCheck", "hold_while_healthy", "http_health"]

HealthCheck = Callable[[], Awaitable[bool]]


def http_health(base_url: str, *, timeout_s: float = 2.0) -> HealthCheck:
    """A health check: ``GET <base_url>/health`` answers 200 within ``timeout_s``."""
    url = base_url.rstrip("/") + "/health"

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    async def check() -> bool:
        return await asyncio.to_thread(probe)

    return check


async def hold_while_healthy(client: aetcd.Client, records: Sequence[EngineRecord],
                             healthy: HealthCheck, *, ttl_s: int = 10,
                             layout: KeyLayout = DEFAULT_LAYOUT, poll_interval_s: float = 1.0,
                             failures_to_drop: int = 3,
                             on_change: Callable[[bool], None] | None = None) -> None:
    """Hold ``records`` in etcd while ``healthy()`` says so (see the module docstring); runs
    until cancelled, then revokes. ``on_change(registered)`` is called after each change.
    Raises InvalidArgument for bad arguments; etcd failures while registering are logged and
    retried (the server may be fine while etcd is away)."""
    if not records or not all(isinstance(r, EngineRecord) for r in records):
        raise InvalidArgument("records must be a non-empty sequence of EngineRecord")
    if isinstance(failures_to_drop, bool) or not isinstance(failures_to_drop, int) \
            or failures_to_drop < 1:
        raise InvalidArgument(f"failures_to_drop must be an int >= 1, got {failures_to_drop!r}")
    if not poll_interval_s > 0:
        raise InvalidArgument(f"poll_interval_s must be > 0, got {poll_interval_s!r}")
    names = ", ".join(r.key(layout) for r in records)
    held: list[Registration[EngineRecord]] = []
    try:
        while True:
            while not await healthy():
                await asyncio.sleep(poll_interval_s)
            try:
                for record in records:
                    registration = register_engine(client, record, ttl_s=ttl_s, layout=layout)
                    await registration.start()
                    held.append(registration)
            except MembershipError as exc:  # etcd away: retried below
                log.warning("registering %s failed (%s); retrying", names, exc)
                await _release(held)
                await asyncio.sleep(poll_interval_s)
                continue
            log.info("registered %s (the server is healthy)", names)
            if on_change is not None:
                on_change(True)
            failures = 0
            while failures < failures_to_drop:
                await asyncio.sleep(poll_interval_s)
                failures = 0 if await healthy() else failures + 1
            log.warning("the server failed %d health checks in a row: dropping %s",
                        failures, names)
            await _release(held)
            if on_change is not None:
                on_change(False)
    finally:
        await asyncio.shield(_release(held))


async def _release(held: list[Registration[EngineRecord]]) -> None:
    while held:
        registration = held.pop()
        with contextlib.suppress(Exception):  # etcd away: the lease expires by itself
            await registration.close()

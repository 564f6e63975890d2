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

**Where vLLM publishes its KV events** (docs/security.md, "vLLM's KV events"). vLLM's ZMQ
publisher authenticates nobody (no CURVE): whoever can connect to its PUB socket reads every
block hash the engine stores, and whoever can bind the endpoint before it (or answer on its
replay socket) feeds the conductor forged events, steering routing. So the endpoint is the
boundary, and kvtier's launchers choose one that only the engine's own user (or group) can
reach: :func:`kv_events_endpoints` gives ``ipc://`` sockets in a private directory (``0700``;
``0750`` to let a group connect, which also needs the server's umask to leave the sockets
group-writable), and :func:`check_kv_events_endpoint` refuses a ``tcp://`` endpoint that is not
loopback (another host, a wildcard) unless ``insecure`` is set, which logs a WARNING (and
warns about an ``ipc://`` directory other users may enter).
:func:`hold_while_healthy` checks the records it registers the same way. Loopback ``tcp://``
keeps the network out but not the other users of the host (any of them may connect, or bind
the port while the engine is down): ``ipc://`` is the default for that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aetcd

from kvstore.errors import ConfigError, InvalidArgument, MembershipError
from kvstore.membership.endpoints import parse_host_port
from kvstore.membership.engines import EngineRecord, register_engine
from kvstore.membership.etcd import DEFAULT_LAYOUT, KeyLayout
from kvstore.membership.registration import Registration
from kvstore.security.config import is_loopback

log = logging.getLogger(__name__)

__all__ = ["KV_EVENTS_DIR_NAME", "HealthCheck", "check_kv_events_endpoint",
           "hold_while_healthy", "http_health", "kv_events_endpoints"]

HealthCheck = Callable[[], Awaitable[bool]]

KV_EVENTS_DIR_NAME = "kvtier-kv-events"
"""The private directory :func:`kv_events_endpoints` makes for the sockets."""
_IPC_PATH_MAX = 107
"""Longest ``ipc://`` socket path (Linux ``sun_path`` holds 107 bytes and a NUL)."""
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", ""})


def kv_events_endpoints(directory: Path, name: str, *, group: bool = False
                        ) -> tuple[str, str]:
    """``(endpoint, replay_endpoint)``: ``ipc://`` sockets for the KV event publisher of the
    vLLM server ``name``, in ``<directory>/kvtier-kv-events``, created (or tightened) ``0700``
    (``0750`` with ``group``) and owned by this process's user: what a launcher passes in
    ``--kv-events-config`` and in the server's :class:`~kvstore.membership.engines.VllmKvEvents`
    (module docstring). Raises ConfigError when the directory cannot be made private (a
    symlink, another owner) or a path is too long for a Unix socket."""
    where = Path(directory).resolve() / KV_EVENTS_DIR_NAME
    mode = 0o750 if group else 0o700
    try:
        where.mkdir(mode=mode, exist_ok=True)
        st = os.lstat(where)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"{where} is not a directory (a symlink?): the KV event sockets "
                              "need a private directory")
        if st.st_uid != os.geteuid():
            raise ConfigError(f"{where} belongs to uid {st.st_uid}, not this process's "
                              f"{os.geteuid()}: the KV event sockets need a directory of "
                              "their own user")
        os.chmod(where, mode)
    except OSError as exc:
        raise ConfigError(f"cannot make the KV event socket directory {where}: {exc}") from exc
    endpoint, replay = f"ipc://{where}/{name}-kv.sock", f"ipc://{where}/{name}-replay.sock"
    if len(replay) - len("ipc://") > _IPC_PATH_MAX:
        raise ConfigError(f"{where}: KV event socket paths over {_IPC_PATH_MAX} bytes (the "
                          "AF_UNIX limit); use a shorter directory")
    return endpoint, replay


def check_kv_events_endpoint(endpoint: str, *, insecure: bool = False,
                             what: str = "the KV event endpoint") -> None:
    """Refuse (ConfigError naming the fix) a vLLM KV event endpoint on the network (module
    docstring): ``tcp://`` to another host or a wildcard (how vLLM binds ``tcp://*:port``),
    unless ``insecure`` (then a WARNING). Loopback ``tcp://`` (``127.0.0.0/8``, ``[::1]``,
    ``localhost``) passes. An ``ipc://`` socket whose directory other users may enter, or
    its group write (anything beyond ``0750``), is a WARNING naming the mode and the fix
    (:func:`kv_events_endpoints`), not a refusal: a socket file created under a umask of 022
    still refuses their connections, and a launcher's own work directory is often ``0755``.
    A directory that does not exist yet passes (vLLM cannot bind there). Works on the bind
    form and the connect form alike."""
    if endpoint.startswith("ipc://"):
        directory = Path(endpoint[len("ipc://"):]).parent
        try:
            st = os.stat(directory)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(f"{what} {endpoint}: cannot check its directory: {exc}") from exc
        if st.st_mode & 0o027:
            log.warning("%s %s: its directory %s is mode %04o, so other users may reach vLLM's "
                        "unauthenticated KV event sockets where the socket's own mode lets "
                        "them (a umask of 0): use a 0700 (or 0750) directory "
                        "(kvstore.membership.vllm_registration.kv_events_endpoints makes one)",
                        what, endpoint, directory, stat.S_IMODE(st.st_mode))
        return
    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://"):]
        host = rest.rpartition(":")[0].strip("[]") if ":" in rest else rest
        if host not in _WILDCARD_HOSTS:
            host = parse_host_port(rest)[0]
        if is_loopback(host):
            return
        where = "every address" if host in _WILDCARD_HOSTS else f"host {host!r}"
        if insecure:
            log.warning("%s %s is on %s, WITHOUT AUTHENTICATION: anyone who can reach it reads "
                        "the engine's block hashes, and anyone who can bind it steers routing "
                        "(--insecure)", what, endpoint, where)
            return
        raise ConfigError(
            f"{what} {endpoint} is on {where}: vLLM's KV event publisher authenticates nobody, "
            "so anyone who reaches it reads the engine's block hashes and anyone who binds it "
            "steers routing. Use ipc:// in a private directory or loopback tcp (tcp://[::1]:"
            "PORT), or pass --insecure to accept that (docs/security.md, \"vLLM's KV events\")")
    raise ConfigError(f"{what} {endpoint!r}: expected ipc://PATH or tcp://HOST:PORT")


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
                             on_change: Callable[[bool], None] | None = None,
                             insecure: bool = False) -> None:
    """Hold ``records`` in etcd while ``healthy()`` says so (see the module docstring); runs
    until cancelled, then revokes. ``on_change(registered)`` is called after each change.
    Raises InvalidArgument for bad arguments, ConfigError for a KV event endpoint others may
    reach (:func:`check_kv_events_endpoint`; ``insecure`` lets a non-loopback ``tcp://`` one
    through with a WARNING), before anything is registered; etcd failures while registering
    are logged and retried (the server may be fine while etcd is away)."""
    if not records or not all(isinstance(r, EngineRecord) for r in records):
        raise InvalidArgument("records must be a non-empty sequence of EngineRecord")
    for record in records:
        events = record.vllm_kv_events
        if events is not None:
            check_kv_events_endpoint(events.endpoint, insecure=insecure,
                                     what=f"{record.instance_id}'s KV event endpoint")
            if events.replay_endpoint is not None:
                check_kv_events_endpoint(events.replay_endpoint, insecure=insecure,
                                         what=f"{record.instance_id}'s KV replay endpoint")
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

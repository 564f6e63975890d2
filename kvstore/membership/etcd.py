"""etcd plumbing every box shares: the key layout, a client with deadlines, watched prefixes.

Key layout (under a configurable prefix, ``/kvtier/`` by default; see :class:`KeyLayout`)::

    /kvtier/nodes/<node_id>                    NodeRecord as JSON, under the daemon's lease (nodes.py)
    /kvtier/engines/<role>/<instance_id>       EngineRecord as JSON, under the engine's lease (engines.py)
    /kvtier/conductor/leader                   the conductor leader's record (election.py)
    /kvtier/conductor/term                     who won the newest term, or that it resigned (election.py)

Contracts
    * Every etcd or gRPC failure surfaces as :class:`~kvstore.errors.MembershipError`,
      chained to the library error (``raise ... from exc``). Every etcd call has a deadline
      (:func:`etcd_call`), so a paused or partitioned etcd makes calls fail, never hang.
    * Only asyncio; nothing here is thread-safe. One ``aetcd.Client`` can serve any number
      of registrations and watches in the same event loop.
    * TLS, client certificates and etcd users (:func:`etcd_client`, :mod:`.etcd_auth`) come
      from an :class:`~kvstore.security.etcd.EtcdSecurity`, by default the ``KVTIER_ETCD_*``
      environment; a refusal for security reasons says what to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import aetcd
import grpc

from kvstore.errors import ConfigError, InvalidArgument, MembershipError
from kvstore.membership.endpoints import parse_etcd_endpoints
from kvstore.membership.endpoints import parse_host_port as parse_host_port  # re-exported
from kvstore.membership.failover import (
    EtcdClusterClient,
    Member,
    forget_member,
    last_member,
    report_failure,
)
from kvstore.security.etcd import EtcdSecurity

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_PREFIX = "/kvtier/"

DEFAULT_RPC_TIMEOUT_S = 5.0
WATCH_RETRY_INTERVAL_S = 0.5

EventT = TypeVar("EventT")

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_id(what: str, value: str) -> str:
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        raise InvalidArgument(
            f"{what} must be 1-128 characters of [A-Za-z0-9._-] starting with a letter or "
            f"digit, got {value!r}"
        )
    return value


# --------------------------------------------------------------------------- key layout


@dataclass(frozen=True, slots=True)
class KeyLayout:
    """Where kvtier keeps its keys in etcd. ``prefix`` starts and ends with ``/``.

    Give each cluster (and each test) its own prefix to share one etcd safely.
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if (
            not isinstance(self.prefix, str)
            or not self.prefix.startswith("/")
            or not self.prefix.endswith("/")
            or "//" in self.prefix
        ):
            raise InvalidArgument(
                f"etcd key prefix must start and end with '/' and contain no '//', "
                f"got {self.prefix!r}"
            )

    @property
    def nodes_prefix(self) -> str:
        return f"{self.prefix}nodes/"

    def node_key(self, node_id: str) -> str:
        return f"{self.nodes_prefix}{check_id('node_id', node_id)}"

    def node_id_of(self, key: str) -> str | None:
        """The node id a ``nodes/`` key names, or None when the key is not a node key."""
        if not key.startswith(self.nodes_prefix):
            return None
        node_id = key[len(self.nodes_prefix) :]
        return node_id if _ID_RE.fullmatch(node_id) else None

    def engine_key(self, role: str, instance_id: str) -> str:
        return f"{self.prefix}engines/{check_id('role', role)}/{check_id('instance_id', instance_id)}"

    @property
    def conductor_leader_key(self) -> str:
        return f"{self.prefix}conductor/leader"

    @property
    def conductor_term_key(self) -> str:
        """Under no lease: who won the newest term, or that its leader resigned (the
        takeover fence, :mod:`~kvstore.membership.election`)."""
        return f"{self.prefix}conductor/term"


DEFAULT_LAYOUT = KeyLayout()


# --------------------------------------------------------------------------- etcd plumbing


EtcdClient = aetcd.Client
"""The etcd client type, for annotations in boxes that reach etcd only through this package
(what :func:`etcd_client` returns is an :class:`EtcdClusterClient`, a subclass)."""


def etcd_client(endpoint: str | Sequence[str], *, rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                security: EtcdSecurity | None = None) -> EtcdClusterClient:
    """A client for one etcd member or a cluster's members: ``endpoint`` is ``host:port``,
    ``http://host:port`` or ``https://host:port``, or a list of them (a sequence, or
    comma-separated text: :mod:`.endpoints`). It connects lazily, to one member at a time, and
    moves to the next when a request times out or cannot connect
    (:class:`~kvstore.membership.failover.EtcdClusterClient`, docs/etcd-failover.md).

    ``security`` (default: :meth:`EtcdSecurity.from_env`, the ``KVTIER_ETCD_*`` variables)
    says how to authenticate: with a CA bundle (or ``https://`` endpoints) the channel speaks
    TLS, with a client certificate and an etcd user as configured
    (:class:`~kvstore.membership.etcd_auth.SecureEtcdClient`); without any, plain gRPC. Every
    RPC gets a ``rpc_timeout_s`` deadline, and gRPC's reconnect backoff is capped at one
    second so a restarted etcd is found again quickly (the default grows to two minutes).
    Use it as ``async with etcd_client(url) as client``. Raises InvalidArgument for malformed
    endpoints, ConfigError for inconsistent settings or unreadable certificate files.
    """
    if rpc_timeout_s <= 0:
        raise InvalidArgument(f"rpc_timeout_s must be positive, got {rpc_timeout_s}")
    if security is None:
        security = EtcdSecurity.from_env()
    members = parse_etcd_endpoints(endpoint)
    if security.tls:
        for member in members:
            if member.scheme == "http":
                raise ConfigError(f"etcd endpoint {member.text!r} says http:// but an etcd CA "
                                  "is configured (TLS): write https://host:port or host:port")
    options = {
        "grpc.initial_reconnect_backoff_ms": 100,
        "grpc.max_reconnect_backoff_ms": 1000,
    }
    use_tls = security.tls or any(member.scheme == "https" for member in members)
    if security.server_name and not use_tls:
        raise ConfigError("the etcd server name checks etcd's TLS certificate: give the CA "
                          "(--etcd-ca) or an https:// endpoint")
    # gRPC takes min_reconnect_backoff_ms as the deadline of one connection attempt (HTTP/2
    # SETTINGS, TLS handshake included): 100 ms aborted handshakes on a loaded 2-core host
    # ("Handshake read failed (Endpoint closing)"), and plaintext connects too at load 20
    # ("connection attempt timed out before receiving SETTINGS frame": a chaos daemon that
    # could not start). The backoff between attempts stays short.
    options["grpc.min_reconnect_backoff_ms"] = max(1000, int(rpc_timeout_s * 1000))
    return EtcdClusterClient(members=members, security=security, use_tls=use_tls,
                             timeout=rpc_timeout_s, options=options)


async def etcd_call(what: str, call: Awaitable[T], timeout_s: float) -> T:
    """Await one etcd call with a deadline, translating failures into MembershipError.

    A deadline that passes, or a member that cannot be reached, moves the client that made
    the call to its next member (:func:`~kvstore.membership.failover.report_failure`); the
    caller's retry goes there.

    ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 ``wait_for`` swallows a
    cancellation that arrives as the call completes, which once left a keepalive task
    running after ``close()`` had cancelled it.
    """
    forget_member()
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError as exc:
        await report_failure(last_member(), exc)
        raise MembershipError(f"{what}: etcd did not answer within {timeout_s:.1f} s") from exc
    except (aetcd.ClientError, grpc.RpcError) as exc:
        from kvstore.membership.etcd_auth import explain_etcd_error

        await report_failure(last_member(), exc)
        hint = explain_etcd_error(exc)
        raise MembershipError(f"{what}: {hint or exc}") from exc


async def etcd_read(what: str, read: Callable[[], Awaitable[T]], timeout_s: float) -> T:
    """:func:`etcd_call` for a request that may be repeated (a read): made by ``read()``, and
    made again on each other member when a member does not answer (the failure moved the
    client on), as etcd's own client repeats reads. A one-shot command (``kvtier nodes``,
    :func:`~kvstore.client.discovery.discover_nodes`) so succeeds while a member is paused.
    Raises MembershipError once every member has failed, or at once for an answer (an error
    that moved nothing)."""
    tried = 0
    while True:
        try:
            return await etcd_call(what, read(), timeout_s)
        except MembershipError:
            member = last_member()
            tried += 1
            if (member is None or member[0].generation == member[1]
                    or tried >= len(member[0].members)):
                raise
            log.info("%s: asking etcd member %s", what, member[0].member)


class PrefixWatch(Generic[EventT]):
    """The keys under one etcd prefix as a stream of events: the snapshot, then every change.

    Entering (``async with``) reads the snapshot and opens an etcd watch from just after its
    revision. If the stream later breaks (a member paused or gone, etcd restarted) the watch
    resumes from the last revision it has seen, on whichever member the client talks to by
    then (:mod:`.failover`), so every change is reported once, in order. Only when that
    revision was compacted away does it re-list, yield the difference against what it has
    reported, and watch from the new snapshot. It retries every ``retry_interval_s``.
    Subclasses say how to list (``_open``, which opens its watch with :meth:`_watch_from`),
    which prefix they watch (``_prefix_bytes``) and how to turn one etcd event into theirs
    (``_apply_event``). Iterate from one task only.
    """

    _what = "keys"

    def __init__(
        self,
        client: aetcd.Client,
        *,
        layout: KeyLayout = DEFAULT_LAYOUT,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        retry_interval_s: float = WATCH_RETRY_INTERVAL_S,
    ) -> None:
        """Record settings only; nothing talks to etcd until entered (:meth:`start`)."""
        if rpc_timeout_s <= 0 or retry_interval_s <= 0:
            raise InvalidArgument("rpc_timeout_s and retry_interval_s must be positive")
        self._client = client
        self._layout = layout
        self._rpc_timeout_s = rpc_timeout_s
        self._retry_interval_s = retry_interval_s
        self._events: AsyncGenerator[EventT, None] | None = None
        self.revision = 0
        """The last revision this watch has seen: its snapshot's, then each event's."""
        self.resumes = 0
        """Times the watch resumed from :attr:`revision` after its stream broke."""
        self.relists = 0
        """Times it had to re-list instead (the revision was compacted)."""
        self._member: Member | None = None

    async def start(self) -> None:
        """Read the snapshot and open the watch. Raises MembershipError."""
        if self._events is not None:
            raise MembershipError(f"this {self._what} watch was already started")
        watch, pending = await self._open()
        self._events = self._run(watch, pending)

    async def close(self) -> None:
        """Cancel the etcd watch. Idempotent."""
        if self._events is not None:
            await self._events.aclose()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> EventT:
        if self._events is None:
            raise MembershipError(f"iterate a {self._what} watch inside 'async with'")
        return await anext(self._events)

    @property
    def _prefix_bytes(self) -> bytes:
        """The watched prefix."""
        raise NotImplementedError

    async def _open(self) -> tuple[Any, list[EventT]]:
        """Snapshot, then a watch from just after it (:meth:`_watch_from`); the events that
        bring us up to date."""
        raise NotImplementedError

    def _apply_event(self, event: Any) -> Iterable[EventT]:
        """What one etcd watch event means to the consumer (often nothing)."""
        raise NotImplementedError

    async def _watch_from(self, start_revision: int) -> Any:
        """An etcd watch of the prefix from ``start_revision`` on (everything after
        ``start_revision - 1``, the revision seen so far). Raises MembershipError (its cause an
        ``aetcd.RevisionCompactedError`` when that history is gone)."""
        watch = await etcd_call(
            f"watch {self._what}s",
            self._client.watch_prefix(self._prefix_bytes, start_revision=start_revision),
            self._rpc_timeout_s,
        )
        self._member = last_member()
        self.revision = start_revision - 1
        return watch

    async def _run(self, watch: Any, pending: list[EventT]) -> AsyncGenerator[EventT, None]:
        while True:
            broke: BaseException | None = None
            try:
                for item in pending:
                    yield item
                async for event in watch:
                    # aetcd queues a whole watch response before the stream's end or error,
                    # so a revision is never seen in part: resuming after it loses nothing.
                    self.revision = max(self.revision, int(event.kv.mod_revision))
                    for item in self._apply_event(event):
                        yield item
                log.info("%s watch: stream ended; resuming after revision %d", self._what,
                         self.revision)
            except (aetcd.ClientError, grpc.RpcError) as exc:
                broke = exc
                log.warning("%s watch: stream broken (%s); resuming after revision %d",
                            self._what, exc, self.revision)
            finally:
                with contextlib.suppress(aetcd.ClientError, grpc.RpcError, TimeoutError):
                    async with asyncio.timeout(self._rpc_timeout_s):
                        await watch.cancel()
            if broke is not None:  # a member that stopped answering: ask the next one
                await report_failure(self._member, broke)
            watch, pending = await self._reopen(
                compacted=isinstance(broke, aetcd.RevisionCompactedError))

    async def _reopen(self, *, compacted: bool) -> tuple[Any, list[EventT]]:
        """Watch again after the last revision seen; re-list when it was compacted. Retries
        until etcd answers."""
        while True:
            try:
                if not compacted:
                    try:
                        watch = await self._watch_from(self.revision + 1)
                        self.resumes += 1
                        return watch, []
                    except MembershipError as exc:
                        if not isinstance(exc.__cause__, aetcd.RevisionCompactedError):
                            raise
                        log.warning("%s watch: history after revision %d was compacted; "
                                    "re-listing", self._what, self.revision)
                        compacted = True
                opened = await self._open()
                self.relists += 1
                return opened
            except MembershipError as exc:
                log.debug("%s watch: cannot watch again yet (%s); retrying", self._what, exc)
                await asyncio.sleep(self._retry_interval_s)

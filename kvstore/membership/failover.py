"""One etcd client over a cluster's members: :class:`EtcdClusterClient` (docs/etcd-failover.md).

The client talks to one member at a time (one gRPC channel) and moves to the next member of
its list, round robin, when a request to the current one **times out** or **cannot connect**:

* :func:`~kvstore.membership.etcd.etcd_call` reports a deadline that passed, or a
  ``ConnectionFailedError``/``ConnectionTimeoutError``/``WatchTimeoutError`` (gRPC's
  UNAVAILABLE and DEADLINE_EXCEEDED), through :func:`report_failure`; a broken watch stream
  reports itself the same way (:class:`~kvstore.membership.etcd.PrefixWatch`). Which member
  and which connection a request went to is recorded when it starts (:meth:`connect` runs
  first in every aetcd call): the connection it used is in a context variable the caller reads
  back, so a late failure of a request sent to a member the client has already left moves
  nothing.
* Moving closes the old channel at once: its calls fail (CANCELLED), its watches end, and
  their owners retry on the new member (a registration's next keepalive step, a watch's
  resume from its last revision). The next request connects to the next member (TLS and an
  etcd user authenticate again there).
* Per-request deadlines are the callers' (a registration uses its keepalive interval,
  ``ttl_s / 3``), so a keepalive reaches a live member well within the lease's TTL. A member
  that is paused (SIGSTOP, a long GC) keeps its TCP connection open and answers nothing: a
  watch alone would never notice, so with several members the channel also sends gRPC
  keepalive pings (every :data:`PING_INTERVAL_S`, while calls are open; etcd's default
  ``--grpc-keepalive-min-time`` is 5 s) and a member that does not answer one within
  :data:`PING_TIMEOUT_S` is dropped like a failed request.

With one member nothing moves: the client behaves as a single-endpoint client always did
(gRPC reconnects to the same member by itself). etcd's own Go client does the same with its
balancer: all members, keepalive pings, and retries of failed requests on another member.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Sequence
from typing import Any

import aetcd
import grpc

from kvstore.membership.endpoints import EtcdEndpoint
from kvstore.membership.etcd_auth import SecureEtcdClient
from kvstore.security.etcd import EtcdSecurity

log = logging.getLogger(__name__)

__all__ = ["PING_INTERVAL_S", "PING_TIMEOUT_S", "EtcdClusterClient", "Member", "fails_over",
           "last_member", "report_failure"]

PING_INTERVAL_S = 6.0
"""gRPC keepalive ping interval with several members: above etcd's default 5 s minimum (a
client that pings more often is told "too_many_pings" and disconnected)."""
PING_TIMEOUT_S = 3.0
"""A member that does not answer a ping within this is dropped (its calls fail UNAVAILABLE)."""

Member = tuple["EtcdClusterClient", int]
"""A client and the number of the connection (its generation) a request went out on."""

_LAST_MEMBER: contextvars.ContextVar[Member | None] = contextvars.ContextVar(
    "kvtier_etcd_last_member", default=None)

# What says "this member did not answer": a passed deadline, a refused or broken connection,
# a watch that was never confirmed. Anything else (a failed compare, a permission) is an
# answer, and moves nothing.
_MEMBER_FAILURES: tuple[type[BaseException], ...] = (
    TimeoutError, aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError,
    aetcd.WatchTimeoutError)
_MEMBER_FAILURE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def fails_over(exc: BaseException) -> bool:
    """Whether ``exc`` says the member did not answer (so another one should be asked)."""
    if isinstance(exc, _MEMBER_FAILURES):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _MEMBER_FAILURE_CODES


def forget_member() -> None:
    """Start a request afresh: no member recorded yet in this context."""
    _LAST_MEMBER.set(None)


def last_member() -> Member | None:
    """The client and connection the last request made in this context went to (None when
    none was made through an :class:`EtcdClusterClient`)."""
    return _LAST_MEMBER.get()


async def report_failure(member: Member | None, exc: BaseException) -> None:
    """Tell the client that the request that ended in ``exc`` went unanswered, when it did
    (:func:`fails_over`): it moves to its next member unless it already left that connection."""
    if member is not None and fails_over(exc):
        client, generation = member
        await client.fail_over(generation, exc)


class EtcdClusterClient(SecureEtcdClient):
    """An aetcd client over a list of etcd members, connected to one at a time (module
    docstring). Build it with :func:`kvstore.membership.etcd.etcd_client`; it connects lazily.
    TLS and etcd users as :class:`~kvstore.membership.etcd_auth.SecureEtcdClient`."""

    def __init__(self, *, members: Sequence[EtcdEndpoint], security: EtcdSecurity,
                 use_tls: bool, timeout: float, options: dict[str, Any]) -> None:
        if not members:
            raise ValueError("an etcd client needs at least one member")  # a bug in the caller
        options = dict(options)
        if len(members) > 1:
            options.update({
                "grpc.keepalive_time_ms": int(PING_INTERVAL_S * 1000),
                "grpc.keepalive_timeout_ms": int(PING_TIMEOUT_S * 1000),
                # newer gRPC cores time a ping out by this one (default: a minute)
                "grpc.http2.ping_timeout_ms": int(PING_TIMEOUT_S * 1000),
                "grpc.keepalive_permit_without_calls": 0,
                "grpc.http2.max_pings_without_data": 0,
            })
        super().__init__(host=members[0].host, port=members[0].port, security=security,
                         use_tls=use_tls, timeout=timeout, options=options)
        self.members: tuple[EtcdEndpoint, ...] = tuple(members)
        self._index = 0
        self.generation = 0
        """Counts connections: each move to another member starts a new one."""
        self.failovers = 0

    @property
    def member(self) -> EtcdEndpoint:
        """The member requests go to now."""
        return self.members[self._index]

    async def connect(self) -> None:
        """Connect to the current member if not connected, and record it as the member of the
        request this call starts (:func:`last_member`). Raises MembershipError or ConfigError."""
        while True:
            generation = self.generation
            _LAST_MEMBER.set((self, generation))
            await super().connect()
            if generation == self.generation:
                return
            # The client moved on while this connected (it authenticates, which waits): that
            # channel went to the member just left. Drop it and connect to the current one.
            await self._drop_channel()

    async def fail_over(self, generation: int, exc: BaseException | None = None) -> None:
        """Move to the next member if connection ``generation`` is still the current one (a
        late failure of an old connection moves nothing), closing the old channel: its calls
        fail and its watches end. With one member, nothing happens."""
        if generation != self.generation or len(self.members) == 1:
            return
        failed = self.member
        self.generation += 1
        self.failovers += 1
        self._index = (self._index + 1) % len(self.members)
        self._host, self._port = self.member.host, self.member.port
        log.warning("etcd member %s did not answer (%s); moving to %s", failed,
                    _describe(exc), self.member)
        await self._drop_channel()

    async def _drop_channel(self) -> None:
        """Forget the current channel and watcher at once (the next call connects anew), then
        shut them down."""
        channel, watcher = self.channel, self._watcher
        self._init_channel_attrs()
        self._connected.clear()
        if watcher is not None:
            await watcher.shutdown()  # every watch on it ends
        if channel is not None:
            await channel.close()

    async def watch(self, *args: Any, **kwargs: Any) -> Any:
        """aetcd's ``watch``, whose ``cancel`` does nothing once the watcher it was made on is
        gone: aetcd's would cancel that watch id on the *current* watcher, where it may name
        another watch (ids restart at 0 on every stream)."""
        await self.connect()
        made_on = self._watcher
        watch = await super().watch(*args, **kwargs)
        cancel = watch._cancel

        async def cancel_if_current() -> None:
            if self._watcher is made_on:
                await cancel()

        watch._cancel = cancel_if_current
        return watch


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no answer"
    if isinstance(exc, TimeoutError):
        return "request timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

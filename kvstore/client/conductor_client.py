"""A client of the conductor that finds the leader through etcd and follows it across failovers.

::

    async with ConductorClient(etcd_endpoint="http://127.0.0.1:2379") as client:
        reply = await client.schedule("req-1", "llama", keys=keys, input_tokens=4096)

Leader discovery: the leader's address is read from etcd (``<prefix>conductor/leader``) and
cached. A call that fails with UNAVAILABLE (the leader died or is restarting) or with
FAILED_PRECONDITION from a follower (it names the leader in the trailing metadata
``kvtier-leader``) is retried against the leader named by the follower, or else the one
etcd names now, with a short backoff, until ``failover_timeout_s`` has passed since the
first attempt; then :class:`~kvstore.errors.MembershipError` (chained to the last gRPC
error). A client built with ``address=`` instead of an etcd endpoint talks to that one
conductor and retries only UNAVAILABLE.

Retrying Schedule after UNAVAILABLE can place a request twice if the old leader decided it
before dying; the dead leader's reservation died with it, so nothing is double-booked on
the new leader. Other errors are raised at once as the kvtier error the conductor named
(``InvalidArgument`` for malformed requests and unknown models).

Credentials (docs/security.md): ``security`` (a
:class:`~kvstore.security.config.ClientSecurity`; None: from the ``KVTIER_TLS_*`` and
``KVTIER_TOKEN_FILE`` environment) makes the channels speak TLS with the client's certificate,
and every call carry its bearer token. A refusal is ``Unauthenticated`` or ``PermissionDenied``.
``tenant`` (None: the credentials' only tenant, or every tenant for an operator) travels as
``kvtier-tenant`` metadata on every call: the tenant whose chunks Schedule and Lookup may match
(credentials of several tenants must name one). The ``tenant`` argument of :meth:`schedule` and
:meth:`lookup` is something else: the key namespace token ids are hashed in.

asyncio (grpc.aio) only; one client may be shared by any number of tasks of one event loop.
The constructor records settings only; channels and the etcd client open lazily.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc

from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore._proto.kvtier.v1 import conductor_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument, KvtierError, MembershipError
from kvstore.membership.election import read_leader
from kvstore.membership.etcd import (
    DEFAULT_LAYOUT,
    EtcdClient,
    KeyLayout,
    etcd_client,
    parse_host_port,
)
from kvstore.security.client import TokenSource, aio_channel, token_source
from kvstore.security.config import ClientSecurity
from kvstore.wire import (
    ERROR_METADATA_KEY,
    LEADER_METADATA_KEY,
    TENANT_MAX_CHARS,
    TENANT_METADATA_KEY,
    error_from_name,
)

__all__ = ["ConductorClient"]

_RETRY_MIN_S = 0.05
_RETRY_MAX_S = 0.5


def _metadata(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    for k, v in exc.trailing_metadata() or ():
        if k == key:
            return str(v)
    return None


def _check_tenant(tenant: object) -> None:
    if not isinstance(tenant, str) or len(tenant) > TENANT_MAX_CHARS \
            or not all(" " <= c <= "~" for c in tenant):
        raise InvalidArgument(f"tenant must be None or at most {TENANT_MAX_CHARS} printable "
                              f"ASCII characters (it travels as {TENANT_METADATA_KEY} "
                              f"metadata), got {tenant!r}")


class ConductorClient:
    """See the module docstring. Give exactly one of ``etcd_endpoint`` and ``address``."""

    def __init__(self, *, etcd_endpoint: str | None = None, address: str | None = None,
                 layout: KeyLayout = DEFAULT_LAYOUT, failover_timeout_s: float = 10.0,
                 rpc_timeout_s: float = 5.0, security: ClientSecurity | None = None,
                 tenant: str | None = None) -> None:
        if (etcd_endpoint is None) == (address is None):
            raise InvalidArgument("give exactly one of etcd_endpoint and address")
        if tenant is not None:
            _check_tenant(tenant)
        self._tenant_metadata: tuple[tuple[str, str], ...] = () if tenant is None else (
            (TENANT_METADATA_KEY, tenant),)
        if address is not None:
            parse_host_port(address)
        if not failover_timeout_s > 0 or not rpc_timeout_s > 0:
            raise InvalidArgument("failover_timeout_s and rpc_timeout_s must be positive")
        self._etcd_endpoint = etcd_endpoint
        self._fixed_address = address
        self._layout = layout
        self._failover_timeout_s = failover_timeout_s
        self._rpc_timeout_s = rpc_timeout_s
        self._etcd: EtcdClient | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, pb_grpc.ConductorStub] = {}
        self._leader: str | None = address
        self._security = security
        self._token: TokenSource | None = None
        self._credentials_loaded = False
        self.failovers = 0
        """How many times a call moved to another conductor (for tests and benchmarks)."""

    async def __aenter__(self) -> ConductorClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        self._stubs = {}
        for channel in channels:
            await channel.close()
        if self._etcd is not None:
            with contextlib.suppress(Exception):  # etcd may be gone; nothing to release then
                await self._etcd.close()
            self._etcd = None

    # ------------------------------------------------------------------ calls

    async def schedule(self, request_id: str, model: str, *, keys: Sequence[bytes] = (),
                       token_ids: Sequence[int] = (), tenant: str = "", input_tokens: int = 0,
                       expected_output_tokens: int = 0, at_s: float = 0.0) -> pb.ScheduleReply:
        """Place a request; a rejection is a reply with ``accepted`` false (not an error).
        ``at_s``: the caller's clock, only for a conductor run with ``--clock client``."""
        request = pb.ScheduleRequest(request_id=request_id, model=model, tenant=tenant,
                                     keys=list(keys), token_ids=list(token_ids),
                                     input_tokens=input_tokens,
                                     expected_output_tokens=expected_output_tokens, at_s=at_s)
        reply: pb.ScheduleReply = await self.call("Schedule", request)
        return reply

    async def schedule_batch(self, requests: Sequence[pb.ScheduleRequest]
                             ) -> list[pb.ScheduleBatchItem]:
        """Place several requests in one call, in order. Each item holds a reply, or the
        kvtier error class and message of that item alone (``error``, ``detail``)."""
        reply: pb.ScheduleBatchReply = await self.call(
            "ScheduleBatch", pb.ScheduleBatchRequest(items=list(requests)))
        return list(reply.items)

    async def lookup(self, *, keys: Sequence[bytes] = (), token_ids: Sequence[int] = (),
                     model: str = "", tenant: str = "") -> pb.ConductorLookupReply:
        reply: pb.ConductorLookupReply = await self.call("Lookup", pb.ConductorLookupRequest(
            model=model, tenant=tenant, keys=list(keys), token_ids=list(token_ids)))
        return reply

    async def report_load(self, instance_id: str, *, queued_prefill_tokens: int = 0,
                          running_decode_batch: int = 0, kv_used_tokens: int = 0,
                          at_s: float = 0.0) -> bool:
        """An engine's load (see ``EngineLoad`` in conductor.proto); False: unknown instance."""
        reply = await self.call("ReportLoad", pb.EngineLoad(
            instance_id=instance_id, queued_prefill_tokens=queued_prefill_tokens,
            running_decode_batch=running_decode_batch, kv_used_tokens=kv_used_tokens,
            at_s=at_s))
        return bool(reply.known)

    async def report_completion(self, report: pb.CompletionReport) -> None:
        await self.call("ReportCompletion", report)

    async def leader_info(self) -> pb.LeaderReply:
        reply: pb.LeaderReply = await self.call("Leader", pb.LeaderRequest())
        return reply

    async def call(self, method: str, request: Any, *, tenant: str | None = None) -> Any:
        """One RPC on the leader, following failovers (see the module docstring). ``tenant``:
        the ``kvtier-tenant`` of this call instead of the client's (a front door of several
        tenants naming each request's)."""
        if tenant is not None:
            _check_tenant(tenant)
        deadline = time.monotonic() + self._failover_timeout_s
        backoff_s = _RETRY_MIN_S
        last: BaseException | None = None
        while True:
            address = self._leader
            try:
                if address is None:
                    address = await self._discover()
                return await getattr(self._stub(address), method)(
                    request, timeout=self._rpc_timeout_s, metadata=self._call_metadata(tenant))
            except grpc.aio.AioRpcError as exc:
                last = exc
                code = exc.code()
                if code == grpc.StatusCode.FAILED_PRECONDITION and \
                        _metadata(exc, ERROR_METADATA_KEY) == "NotLeader" and \
                        self._fixed_address is None:
                    hint = _metadata(exc, LEADER_METADATA_KEY)
                    self._leader = hint.partition("@")[2] if hint else None
                    if self._leader == address:  # stale hint: ask etcd next time
                        self._leader = None
                elif code == grpc.StatusCode.UNAVAILABLE:
                    if self._fixed_address is None:
                        self._leader = None
                else:
                    raise self._translate(exc, method) from exc
            except MembershipError as exc:  # etcd unreachable or no leader yet
                last = exc
            self.failovers += 1
            if time.monotonic() + backoff_s >= deadline:
                raise MembershipError(
                    f"{method}: no conductor leader answered within "
                    f"{self._failover_timeout_s:.1f} s (last error: {last})") from last
            await asyncio.sleep(backoff_s)
            backoff_s = min(_RETRY_MAX_S, backoff_s * 2)

    # ------------------------------------------------------------------ plumbing

    async def _discover(self) -> str:
        if self._etcd is None:
            assert self._etcd_endpoint is not None
            self._etcd = etcd_client(self._etcd_endpoint, rpc_timeout_s=self._rpc_timeout_s)
        view = await read_leader(self._etcd, layout=self._layout,
                                 rpc_timeout_s=self._rpc_timeout_s)
        if view is None:
            raise MembershipError("no conductor leader is registered in etcd")
        self._leader = view.record.address
        return view.record.address

    def _client_security(self) -> ClientSecurity:
        """The credentials, read at the first call (the constructor touches no file)."""
        if not self._credentials_loaded:
            if self._security is None:
                self._security = ClientSecurity.from_env()
            self._token = token_source(self._security)
            self._credentials_loaded = True
        assert self._security is not None
        return self._security

    def _call_metadata(self, tenant: str | None = None) -> tuple[tuple[str, str], ...]:
        """The bearer token (re-read when its file changed) and the ``kvtier-tenant``:
        ``tenant``, else the client's."""
        self._client_security()
        named = self._tenant_metadata if tenant is None else ((TENANT_METADATA_KEY, tenant),)
        if self._token is None:
            return named
        return (self._token.metadata(), *named)

    def _stub(self, address: str) -> pb_grpc.ConductorStub:
        # One channel and one stub per conductor, reused by every call (a stub builds a
        # callable per method: tens of microseconds, too much per call).
        stub = self._stubs.get(address)
        if stub is None:
            channel = aio_channel(address, self._client_security(), options=[
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)])
            self._channels[address] = channel
            stub = pb_grpc.ConductorStub(channel)  # type: ignore[no-untyped-call]
            self._stubs[address] = stub
        return stub

    @staticmethod
    def _translate(exc: grpc.aio.AioRpcError, method: str) -> KvtierError:
        name = _metadata(exc, ERROR_METADATA_KEY)
        details = exc.details() or ""
        if name and name != "NotLeader":
            return error_from_name(name, details)
        return KvtierError(f"{method}: {exc.code().name}: {details}")

"""The daemon's gRPC control service (``kvtier.v1.Store``, see ``proto/kvtier/v1/store.proto``).

Runs on ``grpc.aio``. Cache operations that may block (copies, evictions to NVMe, promotions)
run in the daemon's thread pool; index-only calls (lookup, exists, stats) run in the event loop.
Every kvtier error becomes a gRPC status (:data:`kvstore.wire.GRPC_CODE_NAMES`) with
the error's class name in the trailing metadata ``kvtier-error``; every call is timed into
``kvtier_rpc_seconds``. While the daemon drains, calls that would start new work (puts,
reservations, reads) fail with UNAVAILABLE; commits, releases and metadata calls still work.

Sessions: a pin, read lease or reservation belongs to the *session* whose call took it, and
only that session can end it (Unpin, Release, Commit, Abort of another session's id do
nothing: released/aborted false, Commit INVALID_ARGUMENT as for an unknown id). The session is
the ``kvtier-session`` request metadata when the call carries it (``DaemonControl`` sends a
random token per client, or one the caller chose, on every call of its channel; reconnects
keep it), else the call's HTTP/2 connection (``context.peer()``). Pin ids are drawn like lease
ids (:class:`~kvstore.node.backend.LeaseIds`): unguessable, so guessing a neighbour's id gets
nothing either.

Tenants (docs/security.md, "Tenant isolation"): each handler resolves the tenant its call acts
for (:func:`resolve_tenant`) on the event loop, before anything runs in the pool (the caller's
principal is a contextvar the pool's threads do not see), and passes it explicitly to the cache:
reads see that tenant's chunks and the shared tenant's, writes store chunks as that tenant, and
remove, pin, inspect, list and evict by prefix touch only chunks it may see (remove and evict:
only its own). The tenant is the ``kvtier-tenant`` metadata checked against the caller's
credentials: an engine names one of its tenants, or none when it has exactly one; an operator
or peer of every tenant that names none acts for every tenant (reads; writes are the default
tenant's); writing the shared tenant needs ``shared_writer``; a name the credentials do not
allow is PERMISSION_DENIED. Without security configured (the ``INSECURE`` principal) the
metadata is taken as given, and a call naming none acts for the default tenant, except the admin
calls (ls, inspect, pin, remove, evict, snapshot), which see every tenant. Evict by bytes and
Subscribe act on every tenant, so a call scoped to one is refused; a scoped Snapshot lists only
what that tenant may see.

Data-plane tickets: ``IssueDataTicket`` resolves the call's tenant as every chunk call does
(reads: :func:`resolve_tenant`; writes: the same with ``write=True``, or none when that is
refused) and has the daemon's :class:`~kvstore.security.tickets.TicketAuthority` mint a ticket
for the caller with that :class:`~kvstore.dataplane.transport.auth.TenantScope`; the TCP plane
and the lease channel then serve that connection as that tenant. A daemon without security
issues none (INVALID_ARGUMENT: its data planes need no ticket).

Bad input: every TTL is 0 (the default) or finite, > 0 and at most ``server.max_ttl_s``;
every key field is checked (``check_key``) before use; an undecodable request is
INVALID_ARGUMENT (:func:`kvstore.wire.service_handler`); error messages show at most a short
prefix of a key (``short_key``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import grpc

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc
from kvstore.dataplane.tier import MAX_KEY_BYTES, ChunkKey, TierKind, check_key
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.errors import (
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PermissionDenied,
    TierUnavailable,
    short_key,
)
from kvstore.node.backend import LeaseIds, check_ttl
from kvstore.node.events import ChunkEvent, EventKind, Resync
from kvstore.node.index import IndexEntry, Lease
from kvstore.security.identity import current_principal
from kvstore.security.tenancy import requested_tenant, resolve_tenant
from kvstore.wire import (
    ERROR_METADATA_KEY,
    PB_TO_TIER,
    SESSION_MAX_CHARS,
    SESSION_METADATA_KEY,
    SESSION_MIN_CHARS,
    TENANT_METADATA_KEY,
    TIER_TO_PB,
    UndecodableRequest,
    error_name,
    grpc_code_name,
    service_handler,
    undecodable_error,
)

if TYPE_CHECKING:
    from kvstore.node.cache import TieredCache
    from kvstore.node.daemon import StoreDaemon

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Store"].full_name
DEFAULT_LIST_LIMIT = 1000
DEFAULT_SNAPSHOT_PAGE = 4096
SUBSCRIBE_POLL_S = 0.5
"""How often an idle Subscribe stream checks whether the daemon is stopping."""

EVENT_TO_PB = {EventKind.STORED: pb.EVENT_STORED, EventKind.REMOVED: pb.EVENT_REMOVED,
               EventKind.MOVED: pb.EVENT_MOVED}

_R = TypeVar("_R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def tier_from_pb(value: int, *, required: bool = True) -> TierKind | None:
    if value == pb.TIER_UNSPECIFIED and not required:
        return None
    try:
        return PB_TO_TIER[value]
    except KeyError:
        raise InvalidArgument(f"unknown tier {value}") from None


def session_of(context: Any) -> tuple[str, str]:
    """Who a call belongs to (module docstring): ``("session", token)`` from the
    ``kvtier-session`` metadata, else ``("peer", context.peer())``. Raises InvalidArgument for
    a token of the wrong length."""
    for key, value in context.invocation_metadata() or ():
        if key == SESSION_METADATA_KEY:
            token = str(value)
            if not SESSION_MIN_CHARS <= len(token) <= SESSION_MAX_CHARS:
                raise InvalidArgument(f"{SESSION_METADATA_KEY} must be {SESSION_MIN_CHARS} to "
                                      f"{SESSION_MAX_CHARS} characters, got {len(token)}")
            return "session", token
    return "peer", str(context.peer())


def _check_field(key: bytes, field: str) -> ChunkKey:
    """``check_key`` with the request field named in the message (which never echoes the key)."""
    try:
        return check_key(key)
    except InvalidArgument as exc:
        raise InvalidArgument(f"{field}: {exc}") from None


def _check_keys(keys: Sequence[bytes], field: str = "keys") -> list[ChunkKey]:
    return [_check_field(key, f"{field}[{i}]") for i, key in enumerate(keys)]


def _check_prefix(prefix: bytes, field: str = "key_prefix") -> bytes:
    if len(prefix) > MAX_KEY_BYTES:
        raise InvalidArgument(f"{field} is {len(prefix)} bytes; keys are at most "
                              f"{MAX_KEY_BYTES} ({short_key(prefix)})")
    return bytes(prefix)


def _rpc(method: Handler) -> Handler:
    """Time the call and turn kvtier errors into gRPC statuses (an undecodable request is
    INVALID_ARGUMENT)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: StoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        code = "OK"
        try:
            if isinstance(request, UndecodableRequest):
                raise undecodable_error(request)
            return await method(self, request, context)
        except KvtierError as exc:
            code = grpc_code_name(exc)
            await context.abort(getattr(grpc.StatusCode, code), str(exc),
                                trailing_metadata=((ERROR_METADATA_KEY, error_name(exc)),))
        finally:
            self._daemon.metrics.rpc_seconds.labels(name, code).observe(
                time.perf_counter() - started)

    return wrapper


def entry_to_pb(entry: IndexEntry, now_s: float) -> pb.ChunkEntry:
    return pb.ChunkEntry(key=entry.key, parent=entry.parent or b"", tier=TIER_TO_PB[entry.tier],
                         size_bytes=entry.size_bytes, depth=entry.depth,
                         access_count=entry.access_count, children=entry.children,
                         pinned=entry.pinned, age_s=max(0.0, now_s - entry.inserted_at_s),
                         idle_s=max(0.0, now_s - entry.last_access_s), tenant=entry.tenant)


def tenant_stats_pb(cache: TieredCache, scope: frozenset[str] | None) -> list[pb.TenantStats]:
    """The Stats RPC's per-tenant rows (``TieredCache.tenant_report``); a caller scoped to some
    tenants (``scope``; None: every tenant) gets only their rows (none for an untracked one,
    and never the "other" row)."""
    rows: list[pb.TenantStats] = []
    index = cache.index
    for r in cache.tenant_report():
        if scope is not None and r.tenant not in scope:
            continue
        tiers = []
        for kind in index.tiers:
            q = None if r.tenant is None else index.quota(kind, r.tenant)
            tiers.append(pb.TenantTierStats(
                tier=TIER_TO_PB[kind], used_bytes=r.used_bytes.get(kind, 0),
                max_bytes=(q.max_bytes or 0) if q is not None else 0,
                guaranteed_bytes=q.guaranteed_bytes if q is not None else 0))
        c = r.counters
        rows.append(pb.TenantStats(tenant=r.tenant or "", other=r.tenant is None, hits=c.hits,
                                   misses=c.misses, bytes_read=c.bytes_read,
                                   bytes_written=c.bytes_written, refused=c.refused,
                                   tiers=tiers))
    return rows


def event_to_pb(event: ChunkEvent, epoch: str) -> pb.ChunkEvent:
    return pb.ChunkEvent(seq=event.seq, epoch=epoch, kind=EVENT_TO_PB[event.kind], key=event.key,
                         tier=TIER_TO_PB[event.tier],
                         from_tier=TIER_TO_PB[event.from_tier] if event.from_tier else pb.TIER_UNSPECIFIED,
                         size_bytes=event.size_bytes, parent=event.parent or b"",
                         tenant=event.tenant or "")


async def _abort(context: Any, exc: KvtierError) -> NoReturn:
    """End a streaming call (not wrapped by ``_rpc``) with ``exc``'s status."""
    await context.abort(getattr(grpc.StatusCode, grpc_code_name(exc)), str(exc),
                        trailing_metadata=((ERROR_METADATA_KEY, error_name(exc)),))
    raise InvariantViolation("context.abort returned")


async def _refuse_undecodable(request: Any, context: Any) -> None:
    """For the streaming methods (not wrapped by ``_rpc``)."""
    if isinstance(request, UndecodableRequest):
        await _abort(context, undecodable_error(request))


@dataclass(slots=True)
class _Pin:
    lease: Lease
    owner: tuple[str, str]


class StoreService(pb_grpc.StoreServicer):
    """The servicer. Holds no state of its own beyond the gRPC pins table (public pin id ->
    the index lease and the session that owns it). Pin/Unpin and the reaper's
    :meth:`expire_pins` run on the event loop, so the table needs no lock."""

    def __init__(self, daemon: StoreDaemon) -> None:
        self._daemon = daemon
        self._pins: dict[int, _Pin] = {}
        self._pin_ids = LeaseIds()
        daemon.metrics.tenant_source = lambda: daemon.cache.tenant_report()

    def register(self, server: grpc.aio.Server) -> None:
        """Serve this servicer on ``server``, as the generated ``add_StoreServicer_to_server``
        would, but with deserializers that answer undecodable bytes with INVALID_ARGUMENT
        (:func:`kvstore.wire.service_handler`)."""
        server.add_generic_rpc_handlers(
            (service_handler(self, pb.DESCRIPTOR.services_by_name["Store"]),))

    # --- helpers ----------------------------------------------------------------------------

    async def _blocking(self, fn: Callable[..., _R], *args: Any) -> _R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._daemon.executor, functools.partial(fn, *args))

    def _tenant(self, context: Any, *, admin: bool = False) -> str | None:
        """The tenant a read acts for (:func:`resolve_tenant`), resolved on the event loop:
        the caller's principal is a contextvar, which the executor's threads do not see. A
        refusal is counted for the tenant named (``TenantMeter``: never a new label)."""
        requested = requested_tenant(context)
        try:
            return resolve_tenant(current_principal(), requested, admin=admin)
        except PermissionDenied:
            self._cache.tenants.refused(requested)
            raise

    def _write_tenant(self, context: Any) -> str:
        """The tenant a write stores its chunks as (see :meth:`_tenant`)."""
        requested = requested_tenant(context)
        try:
            tenant = resolve_tenant(current_principal(), requested, write=True)
        except PermissionDenied:
            self._cache.tenants.refused(requested)
            raise
        assert tenant is not None
        return tenant

    def _refuse_when_draining(self) -> None:
        if self._daemon.draining:
            raise TierUnavailable(f"node {self._daemon.config.node_id} is draining")

    @property
    def _cache(self):  # type: ignore[no-untyped-def]
        return self._daemon.cache

    def _ttl(self, ttl_s: float, default: float) -> float:
        """A request's TTL: 0 is ``default``; otherwise :func:`check_ttl` (finite, > 0, at
        most ``server.max_ttl_s``)."""
        if ttl_s == 0:
            return default
        return check_ttl(ttl_s, self._daemon.config.server.max_ttl_s)

    def expire_pins(self) -> int:
        """Forget gRPC pins past their deadline (the index already ignores them; unpinning
        makes it drop their records now) and give their place in the lease budget back."""
        now = time.monotonic()
        dead = [i for i, pin in self._pins.items() if pin.lease.expires_at_s < now]
        for lease_id in dead:
            pin = self._pins.pop(lease_id)
            try:
                self._cache.unpin(pin.lease)
            finally:
                self._daemon.leases.budget.give()
        return len(dead)

    @property
    def pins_held(self) -> int:
        return len(self._pins)

    # --- identity ---------------------------------------------------------------------------

    @_rpc
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.NodeInfo:
        # With arena groups the same-host fields are the caller's tenant's arena's (a caller
        # that may not act for the tenant it names gets the default arena's; its data-plane
        # calls are refused as ever).
        try:
            tenant = resolve_tenant(current_principal(), requested_tenant(context))
        except PermissionDenied:
            tenant = None
        return self._daemon.node_info(tenant)

    @_rpc
    async def IssueDataTicket(self, request: pb.IssueDataTicketRequest, context: Any
                              ) -> pb.IssueDataTicketResponse:
        authority = self._daemon.tickets
        if authority is None:
            raise InvalidArgument(f"node {self._daemon.config.node_id} runs without "
                                  "security: its data planes need no ticket (NodeInfo."
                                  "data_ticket_required is false)")
        principal = current_principal()
        requested = requested_tenant(context)
        read = resolve_tenant(principal, requested)
        try:
            write: str | None = resolve_tenant(principal, requested, write=True)
        except PermissionDenied:
            write = None  # it may read what it names (the shared tenant) but not write it
        ttl_s = request.ttl_s or authority.ttl_s
        if not 0 < ttl_s <= authority.ttl_s:
            raise InvalidArgument(f"a data ticket lives at most {authority.ttl_s:g} s on this "
                                  f"daemon (0: that long), got ttl_s {request.ttl_s!r}")
        issued = authority.mint(principal, scope=TenantScope(read, write), ttl_s=ttl_s)
        return pb.IssueDataTicketResponse(
            ticket=issued.ticket, expires_at_unix_s=issued.expires_at_unix_s,
            ttl_s=ttl_s, tenant=write or "", every_tenant=read is None)

    # --- inline values ----------------------------------------------------------------------

    def _put_one(self, item: pb.PutRequest, tenant: str) -> TierKind:
        limit = self._daemon.config.server.inline_max_bytes
        if len(item.value) > limit:
            raise InvalidArgument(f"an inline value is at most {limit} bytes, got "
                                  f"{len(item.value)}: send it over the data plane")
        key = _check_field(item.key, "key")
        parent = _check_field(item.parent, "parent") if item.parent else None
        info = self._cache.put(key, item.value, parent=parent, tenant=tenant)
        self._daemon.metrics.inline_bytes.labels("in").inc(len(item.value))
        return info.tier  # type: ignore[no-any-return]

    def _get_one(self, key: bytes, tenant: str | None) -> pb.GetResponse:
        k = check_key(key)
        entry = self._cache.entry(k, tenant)
        if entry is None:
            self._cache.count_miss(tenant)
            return pb.GetResponse(found=False)
        limit = self._daemon.config.server.inline_max_bytes
        if entry.size_bytes > limit:
            raise InvalidArgument(f"chunk {k.hex()} is {entry.size_bytes} bytes, above the "
                                  f"inline limit of {limit}: read it over the data plane")
        value = bytearray(entry.size_bytes)
        try:
            self._cache.get_into(k, value, tenant)
        except ChunkNotFound:
            return pb.GetResponse(found=False)
        self._daemon.metrics.inline_bytes.labels("out").inc(len(value))
        return pb.GetResponse(found=True, value=bytes(value), tier=TIER_TO_PB[entry.tier])

    @_rpc
    async def Put(self, request: pb.PutRequest, context: Any) -> pb.PutResponse:
        self._refuse_when_draining()
        tier = await self._blocking(self._put_one, request, self._write_tenant(context))
        return pb.PutResponse(tier=TIER_TO_PB[tier])

    @_rpc
    async def BatchPut(self, request: pb.BatchPutRequest, context: Any) -> pb.BatchPutResponse:
        self._refuse_when_draining()
        tenant = self._write_tenant(context)

        def run() -> list[pb.ItemStatus]:
            out = []
            for item in request.items:
                try:
                    self._put_one(item, tenant)
                    out.append(pb.ItemStatus(ok=True))
                except KvtierError as exc:
                    out.append(pb.ItemStatus(ok=False, error=error_name(exc), detail=str(exc)))
            return out

        return pb.BatchPutResponse(items=await self._blocking(run))

    @_rpc
    async def Get(self, request: pb.GetRequest, context: Any) -> pb.GetResponse:
        self._refuse_when_draining()
        return await self._blocking(self._get_one, request.key, self._tenant(context))

    @_rpc
    async def BatchGet(self, request: pb.BatchGetRequest, context: Any) -> pb.BatchGetResponse:
        self._refuse_when_draining()
        tenant = self._tenant(context)
        items = await self._blocking(lambda: [self._get_one(k, tenant) for k in request.keys])
        return pb.BatchGetResponse(items=items)

    # --- metadata ---------------------------------------------------------------------------

    def _lookup(self, keys: Sequence[bytes], tenant: str | None) -> pb.LookupResponse:
        match = self._cache.lookup(_check_keys(keys), tenant)
        return pb.LookupResponse(
            length=match.length, tiers=[TIER_TO_PB[t] for t in match.tiers],
            per_tier={t.value: n for t, n in match.by_tier().items()})

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return self._lookup(request.keys, self._tenant(context))

    @_rpc
    async def BatchLookup(self, request: pb.BatchLookupRequest, context: Any
                          ) -> pb.BatchLookupResponse:
        tenant = self._tenant(context)
        return pb.BatchLookupResponse(items=[self._lookup(i.keys, tenant)
                                             for i in request.items])

    @_rpc
    async def Exists(self, request: pb.ExistsRequest, context: Any) -> pb.ExistsResponse:
        tenant = self._tenant(context)
        entries = [self._cache.entry(k, tenant) for k in _check_keys(request.keys)]
        return pb.ExistsResponse(exists=[e is not None for e in entries],
                                 size_bytes=[-1 if e is None else e.size_bytes for e in entries])

    def _remove_one(self, key: bytes, tenant: str | None) -> pb.RemoveResponse:
        try:
            removed = self._cache.remove(check_key(key), tenant)
        except ChunkNotFound:
            return pb.RemoveResponse(found=False)
        return pb.RemoveResponse(found=True, removed=removed)

    @_rpc
    async def Remove(self, request: pb.RemoveRequest, context: Any) -> pb.RemoveResponse:
        return await self._blocking(self._remove_one, request.key,
                                    self._tenant(context, admin=True))

    @_rpc
    async def BatchRemove(self, request: pb.BatchRemoveRequest, context: Any
                          ) -> pb.BatchRemoveResponse:
        tenant = self._tenant(context, admin=True)
        items = await self._blocking(lambda: [self._remove_one(k, tenant) for k in request.keys])
        return pb.BatchRemoveResponse(items=items)

    @_rpc
    async def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.ChunkEntry:
        key = check_key(request.key)
        entry = self._cache.entry(key, self._tenant(context, admin=True))
        if entry is None:
            raise ChunkNotFound(key, f"node {self._daemon.config.node_id}")
        return entry_to_pb(entry, self._daemon.index_clock())

    @_rpc
    async def List(self, request: pb.ListRequest, context: Any) -> pb.ListResponse:
        tier = tier_from_pb(request.tier, required=False)
        limit = request.limit or DEFAULT_LIST_LIMIT
        if limit < 0:
            raise InvalidArgument(f"limit must be >= 0, got {limit}")
        entries, truncated = await self._blocking(
            self._daemon.list_entries, _check_prefix(request.key_prefix), tier, limit,
            self._tenant(context, admin=True))
        now = self._daemon.index_clock()
        return pb.ListResponse(entries=[entry_to_pb(e, now) for e in entries],
                               truncated=truncated)

    # --- pins -------------------------------------------------------------------------------

    def _pin(self, request: pb.PinRequest, owner: tuple[str, str],
             tenant: str | None) -> pb.PinResponse:
        if not request.keys:
            raise InvalidArgument("pin needs at least one key")
        ttl = self._ttl(request.ttl_s, self._daemon.config.cache.lease_ttl_s)
        keys = _check_keys(request.keys)
        budget = self._daemon.leases.budget
        budget.take()
        try:
            lease = self._cache.pin(keys, ttl, tenant)
        except BaseException:
            budget.give()
            raise
        pin_id = self._pin_ids.new(self._pins)
        self._pins[pin_id] = _Pin(lease, owner)
        return pb.PinResponse(lease_id=pin_id, expires_in_s=ttl)

    def _unpin(self, pin_id: int, owner: tuple[str, str]) -> bool:
        """End a pin of ``owner``; False (nothing changes) when unknown or another session's."""
        pin = self._pins.get(pin_id)
        if pin is None or pin.owner != owner:
            return False
        del self._pins[pin_id]
        try:
            return bool(self._cache.unpin(pin.lease))
        finally:
            self._daemon.leases.budget.give()

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        return self._pin(request, session_of(context), self._tenant(context, admin=True))

    @_rpc
    async def BatchPin(self, request: pb.BatchPinRequest, context: Any) -> pb.BatchPinResponse:
        owner = session_of(context)
        tenant = self._tenant(context, admin=True)
        items: list[pb.PinResponse] = []
        try:
            for item in request.items:
                items.append(self._pin(item, owner, tenant))
        except BaseException:
            for done in items:  # all or nothing: the caller never learns these ids
                self._unpin(done.lease_id, owner)
            raise
        return pb.BatchPinResponse(items=items)

    @_rpc
    async def Unpin(self, request: pb.UnpinRequest, context: Any) -> pb.UnpinResponse:
        return pb.UnpinResponse(released=self._unpin(request.lease_id, session_of(context)))

    @_rpc
    async def BatchUnpin(self, request: pb.BatchUnpinRequest, context: Any
                         ) -> pb.BatchUnpinResponse:
        owner = session_of(context)
        return pb.BatchUnpinResponse(released=[self._unpin(i, owner) for i in request.lease_ids])

    # --- operations -------------------------------------------------------------------------

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        # The per-tenant rows a caller sees: the tenant it names (checked), else those its
        # credentials name (every tenant: an operator of every tenant, or no security).
        scope: frozenset[str] | None
        if requested_tenant(context) is not None:
            named = self._tenant(context, admin=True)
            scope = None if named is None else frozenset((named,))
        else:
            scope = current_principal().tenants
        reply = self._daemon.stats_pb()
        reply.tenants.extend(tenant_stats_pb(self._cache, scope))
        return reply

    @_rpc
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        tenant = self._tenant(context, admin=True)
        if request.key_prefix:
            if request.bytes:
                raise InvalidArgument("evict by key prefix or by bytes, not both")
            tier = tier_from_pb(request.tier, required=False)
            removed, busy, freed = await self._blocking(
                self._daemon.evict_prefix, _check_prefix(request.key_prefix), tier, tenant)
            return pb.EvictResponse(freed_bytes=freed, removed_chunks=removed, busy_chunks=busy)
        if request.bytes <= 0:
            raise InvalidArgument("evict needs bytes > 0 with a tier, or a key prefix")
        if tenant is not None:
            raise PermissionDenied(f"evict by bytes frees space of every tenant: it needs an "
                                   f"operator of every tenant and no {TENANT_METADATA_KEY} "
                                   f"(this call acts for tenant {tenant!r}); evict by key "
                                   "prefix instead")
        tier = tier_from_pb(request.tier)
        assert tier is not None
        freed = await self._blocking(self._cache.evict, tier, request.bytes)
        return pb.EvictResponse(freed_bytes=freed)

    @_rpc
    async def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:
        accepted = self._daemon.request_drain("Drain RPC")
        return pb.DrainResponse(accepted=accepted)

    # --- same-host leases -------------------------------------------------------------------

    @_rpc
    async def AcquireRead(self, request: pb.AcquireReadRequest, context: Any
                          ) -> pb.AcquireReadResponse:
        self._refuse_when_draining()
        ttl = self._ttl(request.ttl_s, self._daemon.config.cache.lease_ttl_s)
        tenant = self._tenant(context)
        lease_id, ranges = await self._blocking(
            functools.partial(self._daemon.leases_for(tenant).acquire_read,
                              _check_keys(request.keys), ttl, prefix=request.prefix,
                              owner=session_of(context), tenant=tenant))
        return pb.AcquireReadResponse(lease_id=lease_id, chunks=[
            pb.ChunkLocation(offset=r.offset, size_bytes=r.size_bytes) for r in ranges])

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        owner = session_of(context)
        return pb.ReleaseResponse(released=any(
            table.release(request.lease_id, owner=owner) for table in self._daemon.lease_tables()))

    @_rpc
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        self._refuse_when_draining()
        ttl = self._ttl(request.ttl_s, self._daemon.config.server.reservation_ttl_s)
        key = _check_field(request.key, "key")
        parent = _check_field(request.parent, "parent") if request.parent else None
        tenant = self._write_tenant(context)
        lease_id, offset = await self._blocking(functools.partial(
            self._daemon.leases_for(tenant).reserve, key, int(request.size_bytes), ttl,
            parent=parent, owner=session_of(context), tenant=tenant))
        return pb.ReserveResponse(lease_id=lease_id, offset=offset)

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        owner = session_of(context)
        table = next((t for t in self._daemon.lease_tables()
                      if t.has_write(request.lease_id, owner)), self._daemon.leases)
        tier = await self._blocking(functools.partial(table.commit, request.lease_id,
                                                      owner=owner))
        return pb.CommitResponse(tier=TIER_TO_PB[tier])

    @_rpc
    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        owner = session_of(context)
        return pb.AbortResponse(aborted=any(
            table.abort(request.lease_id, owner=owner) for table in self._daemon.lease_tables()))

    @_rpc
    async def SetParents(self, request: pb.SetParentsRequest, context: Any
                         ) -> pb.SetParentsResponse:
        if len(request.keys) != len(request.parents):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(request.parents)} parents")
        ttl = self._ttl(request.ttl_s, self._daemon.config.server.reservation_ttl_s)
        keys, parents = _check_keys(request.keys), _check_keys(request.parents, "parents")
        tenant = self._write_tenant(context)  # only this tenant's TCP puts take the hints
        for key, parent in zip(keys, parents, strict=True):
            self._daemon.backend.parents.expect(key, parent, ttl, tenant=tenant)
        return pb.SetParentsResponse()

    # --- events -----------------------------------------------------------------------------

    async def Subscribe(self, request: pb.SubscribeRequest, context: Any
                        ) -> AsyncIterator[pb.ChunkEvent]:
        await _refuse_undecodable(request, context)
        try:
            tenant = self._tenant(context, admin=True)
            if tenant is not None:
                raise PermissionDenied(f"Subscribe streams the chunk events of every tenant: it "
                                       f"needs a caller of every tenant and no "
                                       f"{TENANT_METADATA_KEY} (this call acts for {tenant!r})")
        except KvtierError as exc:
            await _abort(context, exc)
        events = self._daemon.events
        epoch = events.epoch
        after = int(request.from_seq)
        wanted_epoch = request.epoch or None
        while not self._daemon.stopping.is_set():
            batch = events.since(after, epoch=wanted_epoch)
            if isinstance(batch, Resync):
                log.info("subscriber must resync: %s", batch.reason)
                yield pb.ChunkEvent(seq=batch.last_seq, epoch=epoch, kind=pb.EVENT_RESYNC)
                return
            for event in batch:
                yield event_to_pb(event, epoch)
            if batch:
                after = batch[-1].seq
                wanted_epoch = epoch
                continue
            await events.wait_beyond(after, timeout_s=SUBSCRIBE_POLL_S)

    async def Snapshot(self, request: pb.SnapshotRequest, context: Any
                       ) -> AsyncIterator[pb.SnapshotPage]:
        await _refuse_undecodable(request, context)
        page = request.page_entries or DEFAULT_SNAPSHOT_PAGE
        if page < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_entries must be >= 1")
        try:
            tenant = self._tenant(context, admin=True)
        except KvtierError as exc:
            await _abort(context, exc)
        epoch, seq = self._daemon.events.epoch, self._daemon.events.last_seq
        entries, _ = await self._blocking(self._daemon.list_entries, b"", None, 0, tenant)
        now = self._daemon.index_clock()
        if not entries:
            yield pb.SnapshotPage(epoch=epoch, seq=seq, last=True)
            return
        for start in range(0, len(entries), page):
            chunk = entries[start:start + page]
            yield pb.SnapshotPage(epoch=epoch, seq=seq, entries=[entry_to_pb(e, now) for e in chunk],
                                  last=start + page >= len(entries))


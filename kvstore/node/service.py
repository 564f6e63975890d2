"""The daemon's gRPC control service (``kvtier.v1.Store``, see ``proto/kvtier/v1/store.proto``).

Runs on ``grpc.aio``. Cache operations that may block (copies, evictions to NVMe, promotions)
run in the daemon's thread pool; index-only calls (lookup, exists, stats) run in the event loop.
Every kvtier error becomes a gRPC status (:data:`kvstore.wire.GRPC_CODE_NAMES`) with
the error's class name in the trailing metadata ``kvtier-error``; every call is timed into
``kvtier_rpc_seconds``. While the daemon drains, calls that would start new work (puts,
reservations, reads) fail with UNAVAILABLE; commits, releases and metadata calls still work.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc
from kvstore.dataplane.tier import TierKind, check_key
from kvstore.errors import (
    ChunkNotFound,
    InvalidArgument,
    KvtierError,
    TierUnavailable,
)
from kvstore.node.events import ChunkEvent, EventKind, Resync
from kvstore.node.index import IndexEntry, Lease
from kvstore.wire import ERROR_METADATA_KEY, PB_TO_TIER, TIER_TO_PB, error_name, grpc_code_name

if TYPE_CHECKING:
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


def _rpc(method: Handler) -> Handler:
    """Time the call and turn kvtier errors into gRPC statuses."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: StoreService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        code = "OK"
        try:
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
                         idle_s=max(0.0, now_s - entry.last_access_s))


def event_to_pb(event: ChunkEvent, epoch: str) -> pb.ChunkEvent:
    return pb.ChunkEvent(seq=event.seq, epoch=epoch, kind=EVENT_TO_PB[event.kind], key=event.key,
                         tier=TIER_TO_PB[event.tier],
                         from_tier=TIER_TO_PB[event.from_tier] if event.from_tier else pb.TIER_UNSPECIFIED,
                         size_bytes=event.size_bytes, parent=event.parent or b"")


class StoreService(pb_grpc.StoreServicer):
    """The servicer. Holds no state of its own beyond the gRPC pins table."""

    def __init__(self, daemon: StoreDaemon) -> None:
        self._daemon = daemon
        self._pins: dict[int, Lease] = {}

    # --- helpers ----------------------------------------------------------------------------

    async def _blocking(self, fn: Callable[..., _R], *args: Any) -> _R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._daemon.executor, functools.partial(fn, *args))

    def _refuse_when_draining(self) -> None:
        if self._daemon.draining:
            raise TierUnavailable(f"node {self._daemon.config.node_id} is draining")

    @property
    def _cache(self):  # type: ignore[no-untyped-def]
        return self._daemon.cache

    def _ttl(self, ttl_s: float, default: float) -> float:
        if ttl_s < 0:
            raise InvalidArgument(f"ttl_s must be >= 0, got {ttl_s}")
        return ttl_s or default

    def expire_pins(self) -> int:
        """Forget gRPC pins past their deadline (the index already ignores them)."""
        now = time.monotonic()
        dead = [i for i, lease in self._pins.items() if lease.expires_at_s < now]
        for lease_id in dead:
            del self._pins[lease_id]
        return len(dead)

    # --- identity ---------------------------------------------------------------------------

    @_rpc
    async def Info(self, request: pb.InfoRequest, context: Any) -> pb.NodeInfo:
        return self._daemon.node_info()

    # --- inline values ----------------------------------------------------------------------

    def _put_one(self, item: pb.PutRequest) -> TierKind:
        limit = self._daemon.config.server.inline_max_bytes
        if len(item.value) > limit:
            raise InvalidArgument(f"an inline value is at most {limit} bytes, got "
                                  f"{len(item.value)}: send it over the data plane")
        info = self._cache.put(check_key(item.key), item.value, parent=item.parent or None)
        self._daemon.metrics.inline_bytes.labels("in").inc(len(item.value))
        return info.tier  # type: ignore[no-any-return]

    def _get_one(self, key: bytes) -> pb.GetResponse:
        k = check_key(key)
        entry = self._cache.entry(k)
        if entry is None:
            self._cache.misses += 1
            return pb.GetResponse(found=False)
        limit = self._daemon.config.server.inline_max_bytes
        if entry.size_bytes > limit:
            raise InvalidArgument(f"chunk {k.hex()} is {entry.size_bytes} bytes, above the "
                                  f"inline limit of {limit}: read it over the data plane")
        value = bytearray(entry.size_bytes)
        try:
            self._cache.get_into(k, value)
        except ChunkNotFound:
            return pb.GetResponse(found=False)
        self._daemon.metrics.inline_bytes.labels("out").inc(len(value))
        return pb.GetResponse(found=True, value=bytes(value), tier=TIER_TO_PB[entry.tier])

    @_rpc
    async def Put(self, request: pb.PutRequest, context: Any) -> pb.PutResponse:
        self._refuse_when_draining()
        tier = await self._blocking(self._put_one, request)
        return pb.PutResponse(tier=TIER_TO_PB[tier])

    @_rpc
    async def BatchPut(self, request: pb.BatchPutRequest, context: Any) -> pb.BatchPutResponse:
        self._refuse_when_draining()

        def run() -> list[pb.ItemStatus]:
            out = []
            for item in request.items:
                try:
                    self._put_one(item)
                    out.append(pb.ItemStatus(ok=True))
                except KvtierError as exc:
                    out.append(pb.ItemStatus(ok=False, error=error_name(exc), detail=str(exc)))
            return out

        return pb.BatchPutResponse(items=await self._blocking(run))

    @_rpc
    async def Get(self, request: pb.GetRequest, context: Any) -> pb.GetResponse:
        self._refuse_when_draining()
        return await self._blocking(self._get_one, request.key)

    @_rpc
    async def BatchGet(self, request: pb.BatchGetRequest, context: Any) -> pb.BatchGetResponse:
        self._refuse_when_draining()
        items = await self._blocking(lambda: [self._get_one(k) for k in request.keys])
        return pb.BatchGetResponse(items=items)

    # --- metadata ---------------------------------------------------------------------------

    def _lookup(self, keys: Sequence[bytes]) -> pb.LookupResponse:
        match = self._cache.lookup([check_key(k) for k in keys])
        return pb.LookupResponse(
            length=match.length, tiers=[TIER_TO_PB[t] for t in match.tiers],
            per_tier={t.value: n for t, n in match.by_tier().items()})

    @_rpc
    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return self._lookup(request.keys)

    @_rpc
    async def BatchLookup(self, request: pb.BatchLookupRequest, context: Any
                          ) -> pb.BatchLookupResponse:
        return pb.BatchLookupResponse(items=[self._lookup(i.keys) for i in request.items])

    @_rpc
    async def Exists(self, request: pb.ExistsRequest, context: Any) -> pb.ExistsResponse:
        entries = [self._cache.entry(check_key(k)) for k in request.keys]
        return pb.ExistsResponse(exists=[e is not None for e in entries],
                                 size_bytes=[-1 if e is None else e.size_bytes for e in entries])

    def _remove_one(self, key: bytes) -> pb.RemoveResponse:
        try:
            removed = self._cache.remove(check_key(key))
        except ChunkNotFound:
            return pb.RemoveResponse(found=False)
        return pb.RemoveResponse(found=True, removed=removed)

    @_rpc
    async def Remove(self, request: pb.RemoveRequest, context: Any) -> pb.RemoveResponse:
        return await self._blocking(self._remove_one, request.key)

    @_rpc
    async def BatchRemove(self, request: pb.BatchRemoveRequest, context: Any
                          ) -> pb.BatchRemoveResponse:
        items = await self._blocking(lambda: [self._remove_one(k) for k in request.keys])
        return pb.BatchRemoveResponse(items=items)

    @_rpc
    async def Inspect(self, request: pb.InspectRequest, context: Any) -> pb.ChunkEntry:
        key = check_key(request.key)
        entry = self._cache.entry(key)
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
            self._daemon.list_entries, bytes(request.key_prefix), tier, limit)
        now = self._daemon.index_clock()
        return pb.ListResponse(entries=[entry_to_pb(e, now) for e in entries],
                               truncated=truncated)

    # --- pins -------------------------------------------------------------------------------

    def _pin(self, request: pb.PinRequest) -> pb.PinResponse:
        if not request.keys:
            raise InvalidArgument("pin needs at least one key")
        ttl = self._ttl(request.ttl_s, self._daemon.config.cache.lease_ttl_s)
        lease = self._cache.pin([check_key(k) for k in request.keys], ttl)
        self._pins[lease.lease_id] = lease
        return pb.PinResponse(lease_id=lease.lease_id, expires_in_s=ttl)

    def _unpin(self, lease_id: int) -> bool:
        lease = self._pins.pop(lease_id, None)
        return lease is not None and bool(self._cache.unpin(lease))

    @_rpc
    async def Pin(self, request: pb.PinRequest, context: Any) -> pb.PinResponse:
        return self._pin(request)

    @_rpc
    async def BatchPin(self, request: pb.BatchPinRequest, context: Any) -> pb.BatchPinResponse:
        return pb.BatchPinResponse(items=[self._pin(i) for i in request.items])

    @_rpc
    async def Unpin(self, request: pb.UnpinRequest, context: Any) -> pb.UnpinResponse:
        return pb.UnpinResponse(released=self._unpin(request.lease_id))

    @_rpc
    async def BatchUnpin(self, request: pb.BatchUnpinRequest, context: Any
                         ) -> pb.BatchUnpinResponse:
        return pb.BatchUnpinResponse(released=[self._unpin(i) for i in request.lease_ids])

    # --- operations -------------------------------------------------------------------------

    @_rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        return self._daemon.stats_pb()

    @_rpc
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictResponse:
        if request.key_prefix:
            if request.bytes:
                raise InvalidArgument("evict by key prefix or by bytes, not both")
            tier = tier_from_pb(request.tier, required=False)
            removed, busy, freed = await self._blocking(
                self._daemon.evict_prefix, bytes(request.key_prefix), tier)
            return pb.EvictResponse(freed_bytes=freed, removed_chunks=removed, busy_chunks=busy)
        if request.bytes <= 0:
            raise InvalidArgument("evict needs bytes > 0 with a tier, or a key prefix")
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
        lease_id, ranges = await self._blocking(
            functools.partial(self._daemon.leases.acquire_read, list(request.keys), ttl,
                              prefix=request.prefix))
        return pb.AcquireReadResponse(lease_id=lease_id, chunks=[
            pb.ChunkLocation(offset=r.offset, size_bytes=r.size_bytes) for r in ranges])

    @_rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self._daemon.leases.release(request.lease_id))

    @_rpc
    async def Reserve(self, request: pb.ReserveRequest, context: Any) -> pb.ReserveResponse:
        self._refuse_when_draining()
        ttl = self._ttl(request.ttl_s, self._daemon.config.server.reservation_ttl_s)
        lease_id, offset = await self._blocking(functools.partial(
            self._daemon.leases.reserve, request.key, int(request.size_bytes), ttl,
            parent=request.parent or None))
        return pb.ReserveResponse(lease_id=lease_id, offset=offset)

    @_rpc
    async def Commit(self, request: pb.CommitRequest, context: Any) -> pb.CommitResponse:
        tier = await self._blocking(self._daemon.leases.commit, request.lease_id)
        return pb.CommitResponse(tier=TIER_TO_PB[tier])

    @_rpc
    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self._daemon.leases.abort(request.lease_id))

    @_rpc
    async def SetParents(self, request: pb.SetParentsRequest, context: Any
                         ) -> pb.SetParentsResponse:
        if len(request.keys) != len(request.parents):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(request.parents)} parents")
        ttl = self._ttl(request.ttl_s, self._daemon.config.server.reservation_ttl_s)
        for key, parent in zip(request.keys, request.parents, strict=True):
            self._daemon.backend.parents.expect(key, parent, ttl)
        return pb.SetParentsResponse()

    # --- events -----------------------------------------------------------------------------

    async def Subscribe(self, request: pb.SubscribeRequest, context: Any
                        ) -> AsyncIterator[pb.ChunkEvent]:
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
        page = request.page_entries or DEFAULT_SNAPSHOT_PAGE
        if page < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "page_entries must be >= 1")
        epoch, seq = self._daemon.events.epoch, self._daemon.events.last_seq
        entries, _ = await self._blocking(self._daemon.list_entries, b"", None, 0)
        now = self._daemon.index_clock()
        if not entries:
            yield pb.SnapshotPage(epoch=epoch, seq=seq, last=True)
            return
        for start in range(0, len(entries), page):
            chunk = entries[start:start + page]
            yield pb.SnapshotPage(epoch=epoch, seq=seq, entries=[entry_to_pb(e, now) for e in chunk],
                                  last=start + page >= len(entries))


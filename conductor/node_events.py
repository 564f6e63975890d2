"""Following one store daemon's chunk events into a :class:`~conductor.index.GlobalPrefixIndex`.

:func:`follow_node` is the loop the conductor runs per live daemon (conductor/server.py), and
the front door's in-process router runs too (kvstore/frontdoor/local.py), so both index the
daemons' tiers the same way:

* a **snapshot** first (``Snapshot``, paged), which replaces the node's entries;
* then ``Subscribe(from_seq=<snapshot seq>, epoch)``, each event applied in order
  (:meth:`GlobalPrefixIndex.apply_event`). On a gap or a new epoch the index says where to
  re-open (``needs_resync``); when the daemon's ring no longer holds that far back it answers
  ``EVENT_RESYNC`` and a snapshot is taken again. An event of unknown kind or a malformed one
  is a snapshot too (skipping it would leave a gap replayed forever);
* the stream ending (the daemon stopping) or failing (killed, unreachable) is reported
  (``on_state(False, why)``) and retried with backoff (0.1 s doubling to 1 s), from a snapshot.

``on_state(connected, why)`` is called once per attempt's outcome: True once a snapshot is
loaded, False when the attempt ended. A node that is not connected must not be placed on
(the conductor's rule: its index entries are gone with ``remove_node``, which the caller does
in ``on_state``).

Runs until cancelled; one task per node. No state of its own beyond the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from conductor.index import ChunkEvent, ChunkEventKind, EventOutcome, GlobalPrefixIndex
from kvstore._proto.kvtier.v1 import store_pb2 as store_pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as store_grpc
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument, KvtierError
from kvstore.security.client import aio_channel
from kvstore.security.config import ClientSecurity
from kvstore.wire import PB_TO_TIER

__all__ = ["GRPC_MAX_MESSAGE_BYTES", "follow_node"]

log = logging.getLogger(__name__)

_PB_EVENT = {store_pb.EVENT_STORED: ChunkEventKind.STORED,
             store_pb.EVENT_REMOVED: ChunkEventKind.REMOVED,
             store_pb.EVENT_MOVED: ChunkEventKind.MOVED}
_HEALED = (EventOutcome.APPLIED, EventOutcome.DUPLICATE, EventOutcome.STALE)
_RECONNECT_MIN_S = 0.1
_RECONNECT_MAX_S = 1.0
_SNAPSHOT_PAGE_ENTRIES = 8192
GRPC_MAX_MESSAGE_BYTES = 16 << 20

OnState = Callable[[bool, str], None]
Metadata = Callable[[], tuple[tuple[str, str], ...]]


async def follow_node(index: GlobalPrefixIndex, node_id: str, grpc_address: str,
                      security: ClientSecurity, on_state: OnState,
                      metadata: Metadata = tuple) -> None:
    """Snapshot, then Subscribe; resync on gaps; reconnect with backoff; until cancelled (see
    the module docstring). ``security`` is the channel's (its ``for_node`` is applied here);
    ``metadata()`` the call metadata (a bearer token) of each call."""
    backoff_s = _RECONNECT_MIN_S
    async with aio_channel(grpc_address, security.for_node(node_id), options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)]) as channel:
        stub = store_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
        while True:
            try:
                seq, epoch = await _load_snapshot(index, stub, node_id, metadata)
                on_state(True, "")
                backoff_s = _RECONNECT_MIN_S
                after: int | None = seq
                while after is not None:
                    after, epoch = await _subscribe(index, stub, node_id, after, epoch,
                                                    metadata)
                # The daemon ended the stream (stopping); its key leaves etcd shortly.
                on_state(False, "event stream ended")
            except grpc.aio.AioRpcError as exc:
                on_state(False, f"{exc.code().name}: {exc.details()}")
            except KvtierError as exc:  # a snapshot the index refused, a malformed stream
                log.warning("node %s: %s: %s", node_id, type(exc).__name__, exc)
                on_state(False, str(exc))
            await asyncio.sleep(backoff_s)
            backoff_s = min(_RECONNECT_MAX_S, backoff_s * 2)


async def _load_snapshot(index: GlobalPrefixIndex, stub: Any, node_id: str,
                         metadata: Metadata) -> tuple[int, str]:
    """Replace the node's index entries with a snapshot; (its seq, its epoch)."""
    loader = None
    try:
        async for page in stub.Snapshot(
                store_pb.SnapshotRequest(page_entries=_SNAPSHOT_PAGE_ENTRIES),
                metadata=metadata()):
            if loader is None:
                loader = index.begin_snapshot(node_id, page.epoch, int(page.seq))
            by_tenant: dict[str, list[tuple[bytes, TierKind]]] = {}
            for e in page.entries:
                if e.tier in PB_TO_TIER:  # filed under its owner (conductor/index.py)
                    by_tenant.setdefault(e.tenant, []).append((e.key, PB_TO_TIER[e.tier]))
            for tenant, entries in by_tenant.items():
                loader.add(entries, tenant)
        if loader is None:
            raise InvalidArgument(f"node {node_id} sent an empty snapshot stream")
    except BaseException:
        if loader is not None:
            loader.abort()
        raise
    if not loader.commit():
        log.info("snapshot of %s superseded; following from its seq anyway", node_id)
    log.info("node %s: snapshot of %d blocks at seq %d (epoch %s)", node_id, loader.blocks,
             loader.seq, loader.epoch)
    return loader.seq, str(loader.epoch)


async def _subscribe(index: GlobalPrefixIndex, stub: Any, node_id: str, after: int, epoch: str,
                     metadata: Metadata) -> tuple[int | None, str]:
    """Apply events after ``after`` until the stream ends or must be re-opened.

    Returns where to re-open from, or None when the daemon ended the stream.
    """
    stream = stub.Subscribe(store_pb.SubscribeRequest(from_seq=after, epoch=epoch),
                            metadata=metadata())
    try:
        async for ev in stream:
            if ev.kind == store_pb.EVENT_RESYNC:
                log.info("node %s: the daemon no longer holds events after %d; snapshot",
                         node_id, after)
                return await _load_snapshot(index, stub, node_id, metadata)
            kind = _PB_EVENT.get(ev.kind)
            if kind is None:
                log.warning("node %s sent an event of unknown kind %d; snapshot", node_id,
                            ev.kind)
                return await _load_snapshot(index, stub, node_id, metadata)
            try:
                event = ChunkEvent(
                    node_id, ev.epoch, int(ev.seq), kind, ev.key,
                    PB_TO_TIER.get(ev.tier) if kind is not ChunkEventKind.REMOVED else None,
                    tenant=ev.tenant)
            except InvalidArgument as exc:
                # Skipping it would leave a gap that replays the same event forever.
                log.warning("node %s sent a malformed event (%s); snapshot", node_id, exc)
                return await _load_snapshot(index, stub, node_id, metadata)
            outcome = index.apply_event(event)
            if outcome in _HEALED:
                if outcome is EventOutcome.APPLIED:
                    after, epoch = int(ev.seq), ev.epoch
                continue
            need = index.needs_resync(node_id)
            if need is None:  # a new epoch's seq 1 was applied
                after, epoch = int(ev.seq), ev.epoch
                continue
            log.info("node %s: %s at seq %d; replay after %d", node_id, outcome.value,
                     ev.seq, need.after_seq)
            return need.after_seq, str(need.epoch)
    finally:
        stream.cancel()
    return None, epoch

"""The prefill worker: serves ``generate``: loads the reusable prefix through kvtier (its node's
daemon, and another node's for a conductor fetch plan), computes the rest, saves every full
block its daemon lacks layer by layer, answers the first token and hands the request to the
decode worker.

**Whose prefix length is used.** The conductor's ``prefix_blocks`` says how much of the prompt
is cached on the prefill node. The worker also asks its daemon itself just before loading (the
conductor's index trails the daemon's events by a few milliseconds, so the request right after
the one that stored a prefix may be scheduled before the conductor heard of it) and loads the
longer of the two; a load that comes back short degrades to computing more. Both counts are
reported.

**Fetch plans.** With a plan (blocks ``[first_block, end_block)`` held by another node's
daemon, the ``fetch`` field of the frame), the blocks the own daemon lacks are loaded from that
node (``KVClient.load(..., remote=RemoteFetch)``) and put into the own daemon after the forward
(``replicate``); the worker waits for that before it saves the new blocks, which chain onto
them. A fetch that comes back short computes more, never wrong (tests/engine/test_fetch.py).

**When the own daemon is gone** (killed, paused past the KV client's ``rpc_timeout_s``:
``WorkerConfig.kv_rpc_timeout_s``, cut off), the lookup's PeerUnavailable is not the
request's: the worker computes the whole prompt and saves nothing, and the decode worker,
whose load of the blocks then fails too, recomputes them (docs/chaos.md: the engines under
the fault suite).

One prompt per forward, in arrival order, on the compute thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from kvstore.engine.frames import read_frame, write_frame
from kvstore.engine.worker.base import WorkerBase, doc_field, doc_token_ids
from kvstore.errors import InvalidArgument, KvtierError, PeerUnavailable

if TYPE_CHECKING:
    from kvstore.client.handles import LoadHandle
    from kvstore.client.kv_client import KVClient
    from kvstore.client.requests import RemoteFetch

log = logging.getLogger(__name__)

__all__ = ["PrefillWorker"]


@dataclass(frozen=True, slots=True)
class _PrefillOutcome:
    first_token: int
    tail: bytes
    tail_tokens: int
    full_blocks: int
    reused_tokens: int
    computed_tokens: int
    local_lookup_blocks: int
    load_s: float
    compute_s: float
    save_s: float
    loaded_bytes: int
    """Loaded from the own daemon and the fetch plan's node together."""
    stored_bytes: int
    """Put into the own daemon: new blocks and fetched blocks replicated."""
    load_tiers: dict[str, int]
    fetch_plan_blocks: int = 0
    """Blocks the fetch plan offered beyond the own daemon's prefix (0: no plan)."""
    fetched_blocks: int = 0
    """Blocks that came from the plan's node."""
    fetched_bytes: int = 0
    fetch_node: str = ""


class PrefillWorker(WorkerBase):
    """Serves ``generate``: prefill with reuse, save, hand the request to the decode worker."""

    async def handle(self, doc: dict[str, Any], payload: bytes,
                     writer: asyncio.StreamWriter) -> None:
        if doc.get("op") != "generate":
            raise InvalidArgument(f"a prefill worker serves 'generate', not {doc.get('op')!r}")
        token_ids = doc_token_ids(doc)
        tenant = doc_field(doc, "tenant", str)
        reuse = doc_field(doc, "reuse", bool)
        planned = doc_field(doc, "prefix_blocks", int)
        ticket = doc_field(doc, "ticket", int)
        decode_address = doc_field(doc, "decode_address", str)
        max_new_tokens = doc_field(doc, "max_new_tokens", int)
        if max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")
        fetch = _fetch_plan(doc)
        self._queued_tokens += len(token_ids)
        self._report_load()
        loop = asyncio.get_running_loop()
        received = time.time()
        try:
            out = await loop.run_in_executor(self._compute, self._prefill, token_ids, tenant,
                                             reuse, planned, fetch)
        except KvtierError:
            self._cancel(ticket)
            raise
        finally:
            self._queued_tokens -= len(token_ids)
            self._report_load()
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        assert self._conductor is not None
        self._report(self._conductor.report_completion(pb.CompletionReport(
            ticket=ticket, prefill=pb.PrefillDone(
                prefill_s=out.compute_s, computed_tokens=out.computed_tokens,
                reused_tokens=out.reused_tokens,
                transfer_s=out.load_s if out.fetched_blocks else 0.0,
                transferred_bytes=out.fetched_bytes))))
        stats = {k: v for k, v in asdict(out).items() if k not in ("tail", "first_token")}
        await write_frame(writer, {"event": "first_token", "token": out.first_token,
                                   "received_unix_s": received, "prefill": stats})
        # Hand over to the decode worker and relay its answer.
        try:
            d_reader, d_writer = await asyncio.open_connection(
                *decode_address.rsplit(":", 1))
        except OSError as exc:
            self._cancel(ticket)
            raise PeerUnavailable(f"decode worker {decode_address}: {exc}") from exc
        try:
            await write_frame(d_writer, {
                "op": "decode", "token_ids": token_ids, "tenant": tenant, "ticket": ticket,
                "first_token": out.first_token, "max_new_tokens": max_new_tokens,
                "kv_address": self.config.daemon_address, "full_blocks": out.full_blocks,
                "tail_tokens": out.tail_tokens}, out.tail)
            reply, _ = await read_frame(d_reader)
        finally:
            d_writer.close()
        await write_frame(writer, reply)

    def _cancel(self, ticket: int) -> None:
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        assert self._conductor is not None
        self._report(self._conductor.report_completion(
            pb.CompletionReport(ticket=ticket, cancelled=True)))

    def _prefill(self, token_ids: list[int], tenant: str, reuse: bool,
                 planned_blocks: int, fetch: RemoteFetch | None = None) -> _PrefillOutcome:
        """Load the reusable prefix (own daemon, then ``fetch``'s node for the blocks it holds
        beyond), compute the rest, save every full block the own daemon lacks."""
        import torch
        from transformers.cache_utils import DynamicCache

        from kvstore.client.layouts import ContiguousKV, HFCacheKV
        from kvstore.engine.remote import layered_cache

        lay = self.layout
        B = lay.block_tokens
        full = len(token_ids) // B
        reusable = min(full, (len(token_ids) - 1) // B) if reuse else 0
        t0 = time.perf_counter()
        local = 0
        tiers: dict[str, int] = {}
        client: KVClient | None = None
        try:
            client = self.kv_client(self.config.daemon_address, tenant)
            if reusable:
                match = client.lookup(token_ids[:reusable * B])
                local = match.blocks
                tiers = {k.value: v for k, v in match.by_tier.items()}
        except PeerUnavailable as exc:
            # The own daemon is gone (killed, paused, cut off): compute the whole prompt and
            # save nothing; slower, never wrong (the decode worker recomputes what it lacks).
            log.warning("daemon %s unreachable, computing without kvtier: %s",
                        self.config.daemon_address, exc)
            self.drop_kv_client(self.config.daemon_address, tenant)
            client = None
        fetch_end = min(reusable, fetch.end_block) if fetch is not None else 0
        remote = fetch if fetch is not None and fetch_end > local else None
        want = (min(reusable, max(local, planned_blocks, fetch_end)) if client is not None
                else 0)
        handle: LoadHandle | None = None
        loaded = 0
        cache: Any = DynamicCache()
        if want and client is not None:
            buffer = torch.empty((lay.num_layers, 2, lay.num_kv_heads, want * B, lay.head_dim),
                                 dtype=lay.dtype, device=self.device)
            # Blocks the own daemon lacks come from the plan's node, and are put into the own
            # daemon afterwards (replicate): the saves below chain onto them, and the decode
            # worker loads every full block from this node.
            handle = client.load(token_ids[:want * B], ContiguousKV(buffer, lay),
                                 remote=remote, replicate=remote is not None)
            loaded = handle.transferred()
            if loaded:
                cache = layered_cache(buffer, loaded * B, handle)
        t1 = time.perf_counter()
        saver = (client.begin_save(token_ids, HFCacheKV(cache, lay), first_block=loaded)
                 if full > loaded and client is not None else None)
        hooks = []
        for index, layer in enumerate(self.model.model.layers):
            if loaded and handle is not None:
                def wait(_m: Any, _a: Any, index: int = index) -> None:
                    assert handle is not None
                    handle.wait_for_layer(index)
                hooks.append(layer.register_forward_pre_hook(wait))
            if saver is not None:
                def save(_m: Any, _a: Any, _o: Any, index: int = index) -> None:
                    assert saver is not None
                    saver.save_layer(index)
                hooks.append(layer.register_forward_hook(save))
        rest = torch.tensor([token_ids[loaded * B:]], dtype=torch.long, device=self.device)
        try:
            with torch.no_grad():
                # Only the last position's logits are needed (the lm_head over every prompt token
                # would be ~40% of this small model's prefill FLOPs).
                out = self.model(input_ids=rest, past_key_values=cache, use_cache=True,
                                 logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        t2 = time.perf_counter()
        load = handle.result() if handle is not None else None
        stored = 0
        if handle is not None and remote is not None:
            # The fetched blocks must be in the own daemon before the new blocks that chain
            # onto them are put (a chunk's parent must be cached).
            replicated = handle.replication()
            if replicated is not None:
                stored += replicated.stored_bytes
                if replicated.failed_blocks:
                    log.warning("replicating fetched blocks %s failed: %s",
                                replicated.failed_blocks, replicated.error)
        if saver is not None:
            result = saver.finish().result()
            stored += result.stored_bytes
            if result.failed_blocks:
                # The decode worker would find fewer blocks and recompute them: slower, not wrong.
                log.warning("save failed for blocks %s: %s", result.failed_blocks, result.error)
        t3 = time.perf_counter()
        past = out.past_key_values
        tail = torch.stack([torch.stack((past.layers[i].keys[0, :, full * B:],
                                         past.layers[i].values[0, :, full * B:]))
                            for i in range(lay.num_layers)]).cpu().contiguous()
        fetched = load.remote_blocks if load is not None else 0
        return _PrefillOutcome(
            first_token=int(torch.argmax(out.logits[0, -1])),
            # As bytes through a uint8 view: numpy has no bfloat16.
            tail=tail.view(torch.uint8).numpy().tobytes(),
            tail_tokens=len(token_ids) - full * B, full_blocks=full,
            reused_tokens=loaded * B, computed_tokens=len(token_ids) - loaded * B,
            local_lookup_blocks=local, load_s=t1 - t0, compute_s=t2 - t1, save_s=t3 - t2,
            loaded_bytes=load.loaded_bytes if load is not None else 0, stored_bytes=stored,
            load_tiers=tiers, fetch_plan_blocks=fetch_end - min(local, fetch_end),
            fetched_blocks=fetched, fetched_bytes=fetched * lay.chunk_bytes,
            fetch_node=fetch.node_id if fetch is not None else "")


def _fetch_plan(doc: dict[str, Any]) -> RemoteFetch | None:
    """The ``fetch`` field of a ``generate`` frame (see :func:`kvstore.engine.gateway.
    fetch_plan_doc`): None, or another node's blocks as a :class:`RemoteFetch`."""
    from kvstore.client.requests import RemoteFetch

    plan = doc.get("fetch")
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise InvalidArgument(f"field 'fetch' must be an object or null, got {plan!r}")
    return RemoteFetch(node_id=doc_field(plan, "src_node", str),
                       address=doc_field(plan, "src_address", str),
                       first_block=doc_field(plan, "first_block", int),
                       end_block=doc_field(plan, "end_block", int))


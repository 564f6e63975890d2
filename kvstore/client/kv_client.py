"""The engine-facing client: token prefixes in, KV tensors in the engine's own layout out.

:class:`KVClient` sits on top of a :class:`~kvstore.client.store_client.StoreClient` of its own
daemon (shared-memory or TCP data plane) and speaks the engine's language: token ids, layers,
torch tensors. It owns the namespace (model fingerprint + tenant), the block size and the hash
mode (``KVClientConfig.hash_mode``: xxh3, or vLLM's own ``sha256_cbor`` block hashes behind the
namespace prefix), so the engine never sees a chunk key unless it has one already
(:class:`BlockKeys`, e.g. from vLLM's block hashes).

Three ways to move more than one request's prefix
    * batch APIs for one engine step: :meth:`KVClient.lookup_many` (one round trip),
      :meth:`KVClient.load_many` (one handle per request, batched transfers),
      :meth:`KVClient.begin_save_many` (one staging set, one copy task per layer, one flush);
    * loads from *another node's* daemon: :meth:`KVClient.load_from` (an address) and
      ``load(..., remote=RemoteFetch)`` (a conductor fetch plan: the own daemon first, the
      rest from that node), with one StoreClient per remote address kept by the client;
    * optional replication of the fetched blocks into the own daemon (``replicate``).

Chunks are per *block*, not per layer
    One chunk is one block of ``block_tokens`` tokens for every layer (:class:`KVLayout`'s
    ``[layer, k|v, kv_head, token, head_dim]``). Per-layer chunks would let the first layer's
    bytes arrive before the last layer's, but they multiply keys (index entries, events, lease
    round trips) by the number of layers, and they split a prefix into L chains the daemon can
    evict independently. Measured on this machine (``bench/kv_client.py``, see
    ``docs/vllm-connector.md``): per-layer chunks of a 4 MiB block move several times slower
    through the daemon than whole-block chunks. So the layer pipeline lives on the engine's side
    of the store: a save copies each layer out of the engine's buffers as soon as the engine is
    done with it (:meth:`LayerwiseSave.save_layer`) and puts whole chunks once every layer is
    in; a load fetches whole chunks, then scatters them into the engine's buffers one layer at
    a time, so layer ``l``'s attention waits only for layer ``l`` (:meth:`LoadHandle.wait_for_layer`).

Engine layouts (:class:`EngineKV`)
    * :class:`ContiguousKV`: one sequence as ``[layers, 2, kv_heads, tokens, head_dim]``.
    * :class:`PagedKV`: vLLM's paged cache, ``kv_caches[layer]`` of shape
      ``[2, num_pages, page_tokens, kv_heads, head_dim]``, and the request's block table (page
      ids of its logical pages, in order). ``page_tokens`` need not equal ``block_tokens``.
    * :class:`ChunkKV`: kvtier's own chunk layout ``[n_blocks, *chunk_shape]`` (no reshuffle).
    * :class:`HFCacheKV`: a transformers ``DynamicCache`` (a save source only).

Failures are results, not exceptions
    A load stops at the first block it cannot get (a miss, a chunk evicted since
    :meth:`KVClient.lookup`, a corrupt chunk the daemon dropped, a daemon, own or remote, that
    died mid-load or cannot be reached):
    :class:`LoadResult` says how many leading blocks arrived and which ones failed, and the
    engine recomputes those. KV after a failed block is useless (it depends on the missing
    block), so a load result is always a prefix. A save reports the blocks it stored, the ones
    that were already there and the ones it could not store. Bad arguments (wrong shapes,
    layer out of range) still raise ``InvalidArgument`` at the call.

Threading
    ``lookup``, ``load`` and ``save`` may be called from any thread. Transfers and copies run on
    the client's executor (``KVClientConfig.workers`` threads); handles are futures. The engine
    must not write the destination of a load before :meth:`LoadHandle.wait_for_layer` (or
    :meth:`LoadHandle.result`) returned for that layer, nor overwrite the source of a save's
    layer before that layer's copy finished (:meth:`LayerwiseSave.finish` waits for all).

Ownership
    Handles copy into and out of the engine's tensors; the client keeps no reference to them
    once the handle has completed. Staging buffers are the client's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.client.kvlayout import KVLayout
from kvstore.client.store_client import (
    DataPlane,
    StoreClient,
    StoreClientConfig,
)
from kvstore.dataplane.tier import TierKind
from kvstore.errors import (
    ChunkExists,
    InvalidArgument,
    KvtierError,
    MembershipError,
    PeerUnavailable,
    SizeMismatch,
)
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace, PrefixKey

if TYPE_CHECKING:
    import torch

    from kvstore.membership.etcd import KeyLayout
    from kvstore.membership.nodes import NodeRecord

log = logging.getLogger(__name__)


__all__ = [
    "BatchSave",
    "BlockKeys",
    "ChunkKV",
    "ContiguousKV",
    "EngineKV",
    "HFCacheKV",
    "KVClient",
    "KVClientConfig",
    "LayerwiseSave",
    "LoadHandle",
    "LoadRequest",
    "LoadResult",
    "PagedKV",
    "PrefixMatch",
    "RemoteFetch",
    "SaveRequest",
    "SaveResult",
    "StagingPool",
    "namespace_for",
]


# --- engine layouts ------------------------------------------------------------------------------


class EngineKV(Protocol):
    """An engine's KV buffers, seen one layer and a range of logical blocks at a time.

    ``blocks`` are indices of the request's logical blocks (block ``b`` holds tokens
    ``[b * block_tokens, (b + 1) * block_tokens)``). ``chunks`` is ``[len(blocks), 2, kv_heads,
    block_tokens, head_dim]``: layer ``layer`` of those blocks in kvtier's chunk layout.
    Implementations copy; they never keep ``chunks``.
    """

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        """Copy layer ``layer`` of ``blocks`` from the engine's buffers into ``chunks``."""
        ...

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        """Copy ``chunks`` into layer ``layer`` of ``blocks`` in the engine's buffers."""
        ...


def _check_dtype(what: str, tensor: torch.Tensor, layout: KVLayout) -> None:
    if tensor.dtype != layout.dtype:
        raise InvalidArgument(f"{what} has dtype {tensor.dtype}, the layout says {layout.dtype}")


@dataclass(frozen=True, slots=True)
class ChunkKV:
    """kvtier's own layout: ``tensor[i]`` is the chunk of logical block ``first_block + i``."""

    tensor: torch.Tensor
    layout: KVLayout
    first_block: int = 0

    def __post_init__(self) -> None:
        if tuple(self.tensor.shape[1:]) != self.layout.chunk_shape or self.tensor.ndim != 6:
            raise InvalidArgument(f"ChunkKV needs [n, *{self.layout.chunk_shape}], got "
                                  f"{tuple(self.tensor.shape)}")
        _check_dtype("ChunkKV", self.tensor, self.layout)

    def _rows(self, blocks: range) -> slice:
        lo = blocks.start - self.first_block
        if lo < 0 or lo + len(blocks) > self.tensor.shape[0]:
            raise InvalidArgument(f"blocks {blocks} outside ChunkKV rows from {self.first_block}")
        return slice(lo, lo + len(blocks))

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        chunks.copy_(self.tensor[self._rows(blocks), layer])

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self.tensor[self._rows(blocks), layer].copy_(chunks)


@dataclass(frozen=True, slots=True)
class ContiguousKV:
    """One sequence's KV as ``[layers, 2, kv_heads, tokens, head_dim]`` (token 0 = block 0)."""

    tensor: torch.Tensor
    layout: KVLayout

    def __post_init__(self) -> None:
        t, lay = self.tensor, self.layout
        if (t.ndim != 5 or t.shape[0] != lay.num_layers or t.shape[1] != 2
                or t.shape[2] != lay.num_kv_heads or t.shape[4] != lay.head_dim):
            raise InvalidArgument(
                f"ContiguousKV needs [{lay.num_layers}, 2, {lay.num_kv_heads}, tokens, "
                f"{lay.head_dim}], got {tuple(t.shape)}")
        _check_dtype("ContiguousKV", t, lay)

    def _tokens(self, layer: int, blocks: range) -> torch.Tensor:
        B = self.layout.block_tokens
        start, stop = blocks.start * B, blocks.stop * B
        if stop > self.tensor.shape[3]:
            raise InvalidArgument(f"blocks {blocks} need {stop} tokens; the buffer has "
                                  f"{self.tensor.shape[3]}")
        # [2, H, n*B, D] -> [2, H, n, B, D] -> [n, 2, H, B, D]
        view = self.tensor[layer, :, :, start:stop]
        # view, never reshape: a scatter must write the engine's buffer, not a silent copy.
        return view.view(2, self.layout.num_kv_heads, len(blocks), B,
                         self.layout.head_dim).permute(2, 0, 1, 3, 4)

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        chunks.copy_(self._tokens(layer, blocks))

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._tokens(layer, blocks).copy_(chunks)


@dataclass(frozen=True, slots=True)
class HFCacheKV:
    """A transformers ``DynamicCache`` of one sequence (``layers[l].keys``: ``[1, H, T, D]``).

    A save source only: a load cannot grow a ``DynamicCache`` in place (load into a
    :class:`ContiguousKV` and hand its views to the cache instead)."""

    cache: Any
    layout: KVLayout

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        B = self.layout.block_tokens
        start, stop = blocks.start * B, blocks.stop * B
        lay = self.cache.layers[layer]
        for kv, t in enumerate((lay.keys, lay.values)):
            if t.shape[0] != 1 or t.shape[2] < stop:
                raise InvalidArgument(f"cache layer {layer} has shape {tuple(t.shape)}; need "
                                      f"batch 1 and >= {stop} tokens")
            # [H, n*B, D] -> [n, H, B, D]
            heads, dim = t.shape[1], t.shape[3]
            chunks[:, kv].copy_(t[0, :, start:stop].view(heads, len(blocks), B, dim)
                                .transpose(0, 1))

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        raise InvalidArgument("HFCacheKV is a save source; load into ContiguousKV instead")


class PagedKV:
    """vLLM's paged KV cache: ``kv_caches[layer]`` is ``[2, num_pages, page_tokens, kv_heads,
    head_dim]`` and ``block_table[i]`` the page holding the request's tokens
    ``[i * page_tokens, (i + 1) * page_tokens)``.

    The slot of every token is computed once here (``page * page_tokens + offset``), so a layer
    copy is one ``index_select`` / ``index_copy_`` over the flattened pages, whatever the ratio
    of ``page_tokens`` to ``block_tokens``.
    """

    __slots__ = ("_slots", "kv_caches", "layout", "page_tokens")

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_table: Sequence[int] | torch.Tensor,
                 layout: KVLayout) -> None:
        import torch

        if len(kv_caches) != layout.num_layers:
            raise InvalidArgument(f"{len(kv_caches)} layer caches for {layout.num_layers} layers")
        first = kv_caches[0]
        if (first.ndim != 5 or first.shape[0] != 2 or first.shape[3] != layout.num_kv_heads
                or first.shape[4] != layout.head_dim):
            raise InvalidArgument(
                f"a paged layer cache is [2, pages, page_tokens, {layout.num_kv_heads}, "
                f"{layout.head_dim}], got {tuple(first.shape)}")
        for t in kv_caches:
            if t.shape != first.shape or not t.is_contiguous():
                raise InvalidArgument("every layer cache must be contiguous and of one shape")
            _check_dtype("PagedKV", t, layout)
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self.page_tokens = int(first.shape[2])
        table = torch.as_tensor(block_table, dtype=torch.long, device=first.device)
        if table.ndim != 1 or (table.numel() and (int(table.min()) < 0
                                                 or int(table.max()) >= first.shape[1])):
            raise InvalidArgument("block_table must list page ids in [0, num_pages)")
        offsets = torch.arange(self.page_tokens, device=first.device)
        self._slots = (table[:, None] * self.page_tokens + offsets).reshape(-1)

    def _slots_for(self, blocks: range) -> torch.Tensor:
        B = self.layout.block_tokens
        start, stop = blocks.start * B, blocks.stop * B
        if stop > self._slots.numel():
            raise InvalidArgument(f"blocks {blocks} need {stop} tokens; the block table maps "
                                  f"{self._slots.numel()}")
        return self._slots[start:stop]

    def _flat(self, layer: int) -> torch.Tensor:
        t = self.kv_caches[layer]
        return t.view(2, t.shape[1] * t.shape[2], t.shape[3], t.shape[4])  # [2, slots, H, D]

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        picked = self._flat(layer).index_select(1, self._slots_for(blocks))  # [2, n*B, H, D]
        lay = self.layout
        chunks.copy_(picked.view(2, len(blocks), lay.block_tokens, lay.num_kv_heads,
                                 lay.head_dim).permute(1, 0, 3, 2, 4))  # -> [n, 2, H, B, D]

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        src = chunks.permute(1, 0, 3, 2, 4).reshape(2, -1, self.layout.num_kv_heads,
                                                    self.layout.head_dim)  # [2, n*B, H, D]
        self._flat(layer).index_copy_(1, self._slots_for(blocks), src)


# --- results ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What :meth:`KVClient.lookup` found: a hint, not a promise (chunks may go before a load)."""

    blocks: int
    """Leading full blocks of the tokens that the daemon holds."""
    block_tokens: int
    by_tier: dict[TierKind, int]
    """How many of those blocks live in each tier."""
    node_id: str

    @property
    def reusable_tokens(self) -> int:
        return self.blocks * self.block_tokens


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How a load ended. Blocks ``[first_block, first_block + loaded_blocks)`` hold valid KV in
    every layer of the destination; ``failed_blocks`` were asked for and did not arrive."""

    first_block: int
    requested_blocks: int
    loaded_blocks: int
    failed_blocks: tuple[int, ...]
    error: str | None
    """Why the load stopped early (None: a plain miss, or nothing failed)."""
    loaded_bytes: int
    transfer_s: float
    scatter_s: float
    remote_blocks: int = 0
    """How many of ``loaded_blocks`` came from another node's daemon (the last ones)."""
    remote_node: str = ""
    """That daemon's gRPC address ("" when nothing was asked of another node)."""

    @property
    def complete(self) -> bool:
        return self.loaded_blocks == self.requested_blocks


@dataclass(frozen=True, slots=True)
class SaveResult:
    stored_blocks: tuple[int, ...]
    existing_blocks: tuple[int, ...]
    """Blocks the daemon already held (chunks are immutable; not an error)."""
    failed_blocks: tuple[int, ...]
    error: str | None
    stored_bytes: int
    gather_s: float
    put_s: float


# --- requests -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """Chunk keys an engine already has (e.g. from vLLM's block hashes through
    :meth:`KVClient.keys_from_vllm`): pass one wherever a method takes ``token_ids`` to skip
    hashing. ``keys[i]`` is the key of logical block ``i``."""

    keys: tuple[PrefixKey, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.keys, tuple) or not all(isinstance(k, bytes) for k in self.keys):
            raise InvalidArgument("BlockKeys.keys must be a tuple of bytes keys")


@dataclass(frozen=True, slots=True)
class RemoteFetch:
    """Blocks ``[first_block, end_block)`` of a request that another node's daemon holds: a
    conductor ``FetchPlan`` in the client's terms (:meth:`from_plan`).

    ``address`` is that daemon's gRPC ``host:port``; when empty, the client resolves
    ``node_id`` through etcd (:meth:`KVClient.node_address`). ``first_block`` is a hint: the
    remote part of a load starts wherever the local daemon's part stopped (the source holds the
    whole chain up to ``end_block``, the conductor checked that), so blocks evicted locally
    since the decision are fetched from the remote node too.
    """

    node_id: str
    address: str
    first_block: int
    end_block: int

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not isinstance(self.address, str):
            raise InvalidArgument("RemoteFetch.node_id and address must be str")
        if not (self.node_id or self.address):
            raise InvalidArgument("RemoteFetch needs an address or a node id")
        if not 0 <= self.first_block <= self.end_block:
            raise InvalidArgument(f"RemoteFetch blocks [{self.first_block}, {self.end_block}) "
                                  f"are not a range")

    @classmethod
    def from_plan(cls, plan: Any, address: str = "") -> RemoteFetch:
        """From a ``FetchPlan``: the conductor's reply (``kvtier.v1.FetchPlan``, which carries
        ``src_grpc_address``) or ``conductor.scheduler.FetchPlan`` (node id only: give
        ``address`` or let the client resolve it through etcd)."""
        return cls(node_id=str(plan.src_node),
                   address=address or str(getattr(plan, "src_grpc_address", "") or ""),
                   first_block=int(plan.first_block), end_block=int(plan.end_block))


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request's part of :meth:`KVClient.load_many` (same meaning as ``load``'s arguments;
    a request with a ``remote`` fetch plan is loaded on its own, as ``load(..., remote=)``)."""

    token_ids: object
    into: EngineKV
    first_block: int = 0
    num_blocks: int | None = None
    remote: RemoteFetch | None = None


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """One request's part of :meth:`KVClient.begin_save_many` (as ``begin_save``'s arguments)."""

    token_ids: object
    from_: EngineKV
    first_block: int = 0


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVClientConfig:
    data_plane: DataPlane = DataPlane.AUTO
    """SHM when the daemon is on this host (AUTO), or force TCP (a remote node's path)."""
    workers: int = 2
    """Threads that run transfers and layer copies."""
    load_batch_blocks: int = 32
    """Blocks fetched per daemon call in a load (one lease round trip each on SHM)."""
    rpc_timeout_s: float = 30.0
    staging_pool_bytes: int = 256 << 20
    """Chunk-layout staging buffers kept for reuse (pre-touched); more are made on demand."""
    hash_mode: HashMode = HashMode.XXH3_128
    """How token blocks become chunk keys. ``SHA256_CBOR`` makes every key
    ``namespace prefix (16 B) || vLLM's own block hash (32 B)``, so a vLLM connector maps
    ``request.block_hashes`` to keys without rehashing (:meth:`KVClient.keys_from_vllm`)."""
    vllm_hash_seed: str | None = None
    """``SHA256_CBOR`` only (and required there): the vLLM processes' ``PYTHONHASHSEED``."""
    batch_blocks: int = 256
    """Blocks per daemon call in :meth:`KVClient.load_many` (all requests' blocks together)."""
    remote_data_plane: DataPlane = DataPlane.AUTO
    """Data plane to another node's daemon (:meth:`KVClient.load_from`): AUTO picks shared
    memory when that daemon is in fact on this host, else UCX, else TCP."""
    replicate_remote: bool = False
    """Default of ``replicate`` in remote loads: put the blocks fetched from another node into
    this client's own daemon afterwards (a replication step; the engine does not wait for it)."""

    def __post_init__(self) -> None:
        if self.staging_pool_bytes < 0:
            raise InvalidArgument("staging_pool_bytes must be >= 0")
        if not isinstance(self.hash_mode, HashMode):
            raise InvalidArgument(f"hash_mode must be a HashMode, got {self.hash_mode!r}")
        if (self.hash_mode is HashMode.SHA256_CBOR) != (self.vllm_hash_seed is not None):
            raise InvalidArgument("vllm_hash_seed is required with, and only with, "
                                  "HashMode.SHA256_CBOR")
        if not isinstance(self.remote_data_plane, DataPlane):
            raise InvalidArgument(f"remote_data_plane must be a DataPlane, got "
                                  f"{self.remote_data_plane!r}")
        if self.batch_blocks < 1:
            raise InvalidArgument("batch_blocks must be >= 1")
        if not isinstance(self.data_plane, DataPlane):
            raise InvalidArgument(f"data_plane must be a DataPlane, got {self.data_plane!r}")
        if self.workers < 1 or self.load_batch_blocks < 1:
            raise InvalidArgument("workers and load_batch_blocks must be >= 1")
        if self.rpc_timeout_s <= 0:
            raise InvalidArgument("rpc_timeout_s must be > 0")


def namespace_for(layout: KVLayout, model_name: str, tenant: str = "", *, tp_rank: int = 0,
                  tp_size: int = 1) -> Namespace:
    """The namespace of a model's KV in ``layout`` (same model + layout + tenant = same keys)."""
    fingerprint = KVFingerprint(
        model=model_name, dtype=KVDtype.from_torch(layout.dtype), num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        block_size_tokens=layout.block_tokens, tp_rank=tp_rank, tp_size=tp_size)
    return Namespace(fingerprint, tenant)


# --- staging buffers ----------------------------------------------------------------------------


class StagingPool:
    """Reusable chunk-layout buffers ``[n_blocks, *chunk_shape]`` for loads and saves.

    Copying into freshly allocated memory pays its first touch (page faults: measured 0.4-11 GB/s
    here, against ~20 GB/s into touched memory, FIELD-NOTES), so buffers are zeroed once when
    made and reused afterwards. ``acquire`` hands out the smallest free buffer that fits (a view
    of its first ``n_blocks`` rows) or makes one; ``release`` keeps it while the pool holds less
    than ``max_bytes``. Thread-safe.
    """

    def __init__(self, layout: KVLayout, max_bytes: int) -> None:
        self._layout = layout
        self._max_bytes = max_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def acquire(self, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(view of ``n_blocks`` rows, the buffer to give back to :meth:`release`)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.shape[0] >= n_blocks]
            if fits:
                # By index: list.remove(tensor) compares with ==, which is elementwise on
                # tensors (RuntimeError as soon as the buffer is not the first one held).
                buf = self._free.pop(min(fits, key=lambda i: int(self._free[i].shape[0])))
                return buf[:n_blocks], buf
        buf = self._layout.empty_chunks(max(n_blocks, 1))
        buf.zero_()  # first touch now, not inside the timed copy
        return buf[:n_blocks], buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            held = sum(b.numel() * b.element_size() for b in self._free)
            if held + buf.numel() * buf.element_size() <= self._max_bytes:
                self._free.append(buf)


# --- handles ------------------------------------------------------------------------------------


class LoadHandle:
    """A load in flight. ``transferred()`` waits until the chunks are fetched (and says how
    many arrived); ``wait_for_layer(l)`` until layer ``l`` is in the destination;
    ``result()`` until everything is done. All three are safe from any thread."""

    def __init__(self, num_layers: int, first_block: int, requested_blocks: int) -> None:
        self._layer_ready = [threading.Event() for _ in range(num_layers)]
        self._fetched: cf.Future[int] = cf.Future()
        self._done: cf.Future[LoadResult] = cf.Future()
        self._replicated: cf.Future[SaveResult | None] = cf.Future()
        self._remote_blocks = 0  # written before _fetched completes, read after
        self.first_block = first_block
        self.requested_blocks = requested_blocks

    def transferred(self, timeout_s: float | None = None) -> int:
        """How many leading blocks arrived from the store (the count the result will carry)."""
        return self._fetched.result(timeout_s)

    def transferred_remote(self, timeout_s: float | None = None) -> int:
        """How many of the :meth:`transferred` blocks (the last ones) came from another node:
        the own daemon lacks them, so a save that follows should start before them."""
        self._fetched.result(timeout_s)
        return self._remote_blocks

    def wait_for_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Block until layer ``layer`` of every loaded block is in the destination."""
        if not self._layer_ready[layer].wait(timeout_s):
            raise TimeoutError(f"layer {layer} not loaded within {timeout_s} s")

    def result(self, timeout_s: float | None = None) -> LoadResult:
        return self._done.result(timeout_s)

    def done(self) -> bool:
        return self._done.done()

    def replication(self, timeout_s: float | None = None) -> SaveResult | None:
        """After a remote load with ``replicate``: how putting the fetched blocks into the local
        daemon went (waits for it). None when nothing was to be replicated."""
        self._done.result(timeout_s)
        return self._replicated.result(timeout_s)

    def _finish(self, result: LoadResult) -> None:
        if not self._fetched.done():
            self._fetched.set_result(result.loaded_blocks)
        for event in self._layer_ready:
            event.set()
        self._done.set_result(result)

    def _finish_replication(self, result: SaveResult | None) -> None:
        if not self._replicated.done():
            self._replicated.set_result(result)


class LayerwiseSave:
    """A save fed layer by layer: ``save_layer(l)`` after the engine wrote layer ``l``'s KV of
    the blocks being saved; ``finish()`` once every layer was given. Layer copies run on the
    client's executor while the engine computes the next layer; the chunks are put when all
    layers are in (a chunk is all layers of one block). Dropping a save unfinished stores
    nothing."""

    def __init__(self, client: KVClient, keys: list[PrefixKey], first_block: int,
                 source: EngineKV) -> None:
        self._client = client
        self._keys = keys
        self._first_block = first_block
        self._source = source
        layout = client.layout
        n = len(keys) - first_block
        self._blocks = range(first_block, len(keys))
        self._staging, self._buffer = client._staging.acquire(max(n, 0))
        self._copies: list[cf.Future[None] | None] = [None] * layout.num_layers
        self._gather_s = [0.0] * layout.num_layers
        self._finished: cf.Future[SaveResult] | None = None

    @property
    def blocks(self) -> range:
        return self._blocks

    def save_layer(self, layer: int) -> cf.Future[None]:
        """Copy layer ``layer`` out of the source in the background. Raises InvalidArgument
        for a layer out of range or given twice."""
        if not 0 <= layer < len(self._copies):
            raise InvalidArgument(f"layer {layer} out of range [0, {len(self._copies)})")
        if self._copies[layer] is not None or self._finished is not None:
            raise InvalidArgument(f"layer {layer} was already saved (or the save is finished)")

        def copy() -> None:
            t0 = time.perf_counter()
            if len(self._blocks):
                self._source.gather_layer(layer, self._blocks, self._staging[:, layer])
            self._gather_s[layer] = time.perf_counter() - t0

        fut = self._client._pool.submit(copy)
        self._copies[layer] = fut
        return fut

    def finish(self) -> cf.Future[SaveResult]:
        """Put the chunks once every layer's copy is done; the future's SaveResult says which
        blocks were stored. Raises InvalidArgument when a layer was never given."""
        missing = [i for i, c in enumerate(self._copies) if c is None]
        if missing:
            raise InvalidArgument(f"layers {missing} were never saved")
        if self._finished is None:
            copies = [c for c in self._copies if c is not None]

            def put() -> SaveResult:
                for c in copies:
                    c.result()  # a copy that raised (a bug or bad shapes) raises here
                try:
                    return self._client._put_chain(self._keys, self._first_block, self._staging,
                                                   sum(self._gather_s))
                finally:
                    self._client._staging.release(self._buffer)

            self._finished = self._client._pool.submit(put)
        return self._finished


class BatchSave:
    """Layer-by-layer saves of several requests (one engine step) that share one staging
    buffer, one copy task per layer and one flush.

    ``save_layer(l)`` queues one task that copies layer ``l`` of every request's blocks out of
    the engine's buffers; ``finish()`` puts every request's chunks once all layers are in (one
    flush task per worker thread, each for a share of the requests), and its future gives one
    :class:`SaveResult` per request, in order. A refusal stops
    that request's chain only (the others are still put). Same ownership rules as
    :class:`LayerwiseSave`: after ``save_layer(l)``'s future, the engine may overwrite layer
    ``l`` of the sources (vLLM's ``wait_for_save`` = every layer's copy future done)."""

    def __init__(self, client: KVClient,
                 parts: list[tuple[list[PrefixKey], int, EngineKV]]) -> None:
        self._client = client
        self._parts = parts
        # One pooled staging buffer per request (as in load_many: request-sized buffers are
        # the ones the pool holds; one for the whole step was a fresh allocation each time).
        self._held = [client._staging.acquire(len(keys) - first) for keys, first, _s in parts]
        self._copies: list[cf.Future[None] | None] = [None] * client.layout.num_layers
        self._gather_s = [0.0] * client.layout.num_layers
        self._finished: cf.Future[list[SaveResult]] | None = None

    def save_layer(self, layer: int) -> cf.Future[None]:
        """Copy layer ``layer`` of every request out of its source in the background. Raises
        InvalidArgument for a layer out of range or given twice."""
        if not 0 <= layer < len(self._copies):
            raise InvalidArgument(f"layer {layer} out of range [0, {len(self._copies)})")
        if self._copies[layer] is not None or self._finished is not None:
            raise InvalidArgument(f"layer {layer} was already saved (or the save is finished)")

        def copy() -> None:
            t0 = time.perf_counter()
            for (keys, first, source), (view, _buf) in zip(self._parts, self._held,
                                                            strict=True):
                if len(keys) > first:
                    source.gather_layer(layer, range(first, len(keys)), view[:, layer])
            self._gather_s[layer] = time.perf_counter() - t0

        fut = self._client._pool.submit(copy)
        self._copies[layer] = fut
        return fut

    def finish(self) -> cf.Future[list[SaveResult]]:
        """Put every request's chunks once every layer's copy is done. Raises InvalidArgument
        when a layer was never given."""
        missing = [i for i, c in enumerate(self._copies) if c is None]
        if missing:
            raise InvalidArgument(f"layers {missing} were never saved")
        if self._finished is None:
            copies = [c for c in self._copies if c is not None]

            def put(group: list[int]) -> list[SaveResult]:
                try:
                    for c in copies:  # queued before this task: running or done, not waiting
                        c.result()
                    gather_s = sum(self._gather_s)
                    return [self._client._put_chain(self._parts[i][0], self._parts[i][1],
                                                    self._held[i][0], gather_s)
                            for i in group]
                finally:
                    for i in group:
                        self._client._staging.release(self._held[i][1])

            # One flush per worker thread (requests split by blocks), as N single saves run.
            groups = _split_even([len(k) - f for k, f, _s in self._parts],
                                 self._client.config.workers)
            self._finished = _gather_futures(
                [self._client._pool.submit(put, g) for g in groups])
        return self._finished


# --- the client ---------------------------------------------------------------------------------


class KVClient:
    """KV of token prefixes between kvtier daemons and an engine's tensors.

    Build with :meth:`connect` (an explicit daemon address) or :meth:`from_etcd` (discover the
    daemons in etcd and pick this host's, or a named node). That daemon is the client's own
    (``store``): lookups, loads and saves go there. :meth:`load_from` and ``load(...,
    remote=...)`` also read from *another* node's daemon; the client keeps one
    :class:`StoreClient` per remote address, opened on first use and closed with the client.
    See the module docstring for the contracts. ``close()`` closes every store connection and
    the executor.
    """

    def __init__(self, store: StoreClient, layout: KVLayout, namespace: Namespace,
                 config: KVClientConfig | None = None, *, etcd_endpoint: str | None = None,
                 key_layout: KeyLayout | None = None) -> None:
        """Wrap an open StoreClient (the KVClient owns it from now on) and start the executor.
        ``etcd_endpoint``/``key_layout`` are only remembered, for :meth:`node_address`."""
        if namespace.fingerprint.block_size_tokens != layout.block_tokens:
            raise InvalidArgument("the namespace's block size differs from the layout's")
        if (namespace.fingerprint.num_layers, namespace.fingerprint.num_kv_heads,
                namespace.fingerprint.head_dim) != (layout.num_layers, layout.num_kv_heads,
                                                    layout.head_dim):
            raise InvalidArgument("the namespace's fingerprint does not match the layout")
        self.store = store
        self.layout = layout
        self.namespace = namespace
        self.config = config or KVClientConfig()
        self.hasher = BlockHasher(namespace, mode=self.config.hash_mode,
                                  vllm_hash_seed=self.config.vllm_hash_seed)
        self._etcd_endpoint = etcd_endpoint
        self._key_layout = key_layout
        self._remotes: dict[str, StoreClient] = {}
        self._node_addresses: dict[str, str] = {}
        self._remote_lock = threading.Lock()
        self._closed = False
        self._pool = cf.ThreadPoolExecutor(self.config.workers, thread_name_prefix="kvclient")
        self._staging = StagingPool(layout, self.config.staging_pool_bytes)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: str, layout: KVLayout, namespace: Namespace,
                config: KVClientConfig | None = None, *, etcd_endpoint: str | None = None,
                key_layout: KeyLayout | None = None) -> KVClient:
        """Connect to the daemon at ``host:port``. Raises PeerUnavailable."""
        cfg = config or KVClientConfig()
        store = StoreClient.connect(address, StoreClientConfig(data_plane=cfg.data_plane,
                                                               rpc_timeout_s=cfg.rpc_timeout_s))
        try:
            return cls(store, layout, namespace, cfg, etcd_endpoint=etcd_endpoint,
                       key_layout=key_layout)
        except BaseException:
            store.close()
            raise

    @classmethod
    def from_etcd(cls, etcd_endpoint: str, layout: KVLayout, namespace: Namespace,
                  config: KVClientConfig | None = None, *, node_id: str | None = None,
                  key_layout: KeyLayout | None = None) -> KVClient:
        """Find the daemons registered in etcd and connect to ``node_id``, or else to one on
        this host (shared memory), or else to the first by id. Raises MembershipError (etcd
        unreachable, no such node, no node at all), PeerUnavailable."""
        nodes = discover_nodes(etcd_endpoint, key_layout)
        record = choose_node(nodes, node_id)
        client = cls.connect(record.grpc_address, layout, namespace, config,
                             etcd_endpoint=etcd_endpoint, key_layout=key_layout)
        client._node_addresses.update({n: r.grpc_address for n, r in nodes.items()})
        return client

    # --- keys and lookup ----------------------------------------------------------------------

    def keys(self, token_ids: object) -> list[PrefixKey]:
        """The chunk keys of the full blocks of ``token_ids`` (or the keys a :class:`BlockKeys`
        carries, checked for this client's key length)."""
        if isinstance(token_ids, BlockKeys):
            size = self.hasher.key_size_bytes
            if any(len(k) != size for k in token_ids.keys):
                raise InvalidArgument(f"this client's keys are {size} bytes "
                                      f"({self.hasher.mode.value})")
            return list(token_ids.keys)
        return self.hasher.hash_blocks(token_ids)

    def keys_from_vllm(self, block_hashes: Sequence[bytes]) -> BlockKeys:
        """The keys of blocks whose vLLM ``sha256_cbor`` hashes the engine already computed
        (``request.block_hashes``), without rehashing any token. Equal to ``keys(tokens)``
        when vLLM ran with this client's ``vllm_hash_seed`` as ``PYTHONHASHSEED`` and
        ``cache_salt == tenant``. Raises InvalidArgument outside ``HashMode.SHA256_CBOR``."""
        return BlockKeys(tuple(self.hasher.key_from_vllm_hash(bytes(h)) for h in block_hashes))

    def lookup(self, token_ids: object, *, address: str | None = None) -> PrefixMatch:
        """How many leading full blocks of ``token_ids`` the daemon holds (the client's own, or
        the one at ``address``), and in which tiers. A miss is ``blocks == 0``. Raises
        PeerUnavailable when the daemon is gone."""
        store = self.store if address is None else self._remote_store(address)
        keys = self.keys(token_ids)
        if not keys:
            return PrefixMatch(0, self.layout.block_tokens, {}, store.info.node_id)
        found = store.lookup(keys)
        return PrefixMatch(found.length, self.layout.block_tokens, found.by_tier(),
                           store.info.node_id)

    def lookup_many(self, token_lists: Sequence[object], *,
                    address: str | None = None) -> list[PrefixMatch]:
        """:meth:`lookup` of several requests in one daemon round trip (``BatchLookup``); one
        match per request, in order. Raises PeerUnavailable."""
        store = self.store if address is None else self._remote_store(address)
        key_lists = [self.keys(t) for t in token_lists]
        asked = [i for i, keys in enumerate(key_lists) if keys]
        node_id = store.info.node_id
        out = [PrefixMatch(0, self.layout.block_tokens, {}, node_id) for _ in key_lists]
        found = store.lookup_many([key_lists[i] for i in asked])
        for i, result in zip(asked, found, strict=True):
            out[i] = PrefixMatch(result.length, self.layout.block_tokens, result.by_tier(),
                                 node_id)
        return out

    # --- load ---------------------------------------------------------------------------------

    def load(self, token_ids: object, into: EngineKV, *, first_block: int = 0,
             num_blocks: int | None = None,
             on_blocks_fetched: Callable[[int], None] | None = None,
             remote: RemoteFetch | None = None, replicate: bool | None = None) -> LoadHandle:
        """Load blocks ``[first_block, first_block + num_blocks)`` of ``token_ids`` (default: all
        its full blocks) into ``into``; returns at once with a :class:`LoadHandle`.

        Blocks before ``first_block`` must already be in the engine's buffers (a prefix the
        engine holds itself). With ``remote`` (a conductor fetch plan), the blocks the
        client's own daemon does not have are fetched from that other node, from where the
        local part stopped up to ``remote.end_block`` (``replicate``: then put them into the
        own daemon, see :meth:`load_from`). ``on_blocks_fetched(n)`` is called on the
        executor after each batch with the running count of arrived blocks (progress; tests
        use it to fault mid-load). Never raises for store failures: the result says what
        arrived.
        """
        keys = self.keys(token_ids)
        total = self._check_range(keys, first_block, num_blocks)
        handle = LoadHandle(self.layout.num_layers, first_block, total)
        self._pool.submit(self._run_load, handle, keys, into, on_blocks_fetched, True, remote,
                          self._replicate(replicate))
        return handle

    def load_from(self, address: str, token_ids: object, into: EngineKV, *,
                  first_block: int = 0, num_blocks: int | None = None,
                  replicate: bool | None = None,
                  on_blocks_fetched: Callable[[int], None] | None = None) -> LoadHandle:
        """Load blocks ``[first_block, first_block + num_blocks)`` of ``token_ids`` from the
        daemon of *another node* at ``address`` (gRPC ``host:port``, e.g. a fetch plan's
        ``src_grpc_address``; see :meth:`node_address` for a node id) into ``into``.

        Same contract as :meth:`load`: returns at once; a dead or unreachable node, or blocks it
        evicted, end the load early and the result names the failed blocks (recompute them).
        The connection to that daemon is opened on first use and kept (shared memory when it
        is in fact on this host, else UCX or TCP: ``KVClientConfig.remote_data_plane``).
        ``replicate`` (default ``KVClientConfig.replicate_remote``): after the blocks are in
        ``into``, put them into this client's own daemon too (their parent, block
        ``first_block - 1``, must be there); :meth:`LoadHandle.replication` reports it.
        """
        keys = self.keys(token_ids)
        total = self._check_range(keys, first_block, num_blocks)
        handle = LoadHandle(self.layout.num_layers, first_block, total)
        plan = RemoteFetch("", address, first_block, first_block + total)
        self._pool.submit(self._run_load, handle, keys, into, on_blocks_fetched, False, plan,
                          self._replicate(replicate))
        return handle

    def load_many(self, requests: Sequence[LoadRequest]) -> list[LoadHandle]:
        """Load several requests' blocks (one engine step) from the own daemon: one handle per
        request, in order, with per-request layer readiness; the blocks of all requests move
        together in calls of up to ``KVClientConfig.batch_blocks`` (``get_many_into``: one
        lease round trip per call on shared memory, one pipelined batch over TCP).

        The requests are cut into ``KVClientConfig.workers`` groups of about equal blocks,
        one executor task each (N single loads would run that many at once too: one task
        alone measured slower than them on 2 cores). Within a group, layers are scattered
        layer-major (layer 0 of every request, then layer 1...), so a step's
        ``wait_for_layer(0)`` on every handle returns first. Ask only for blocks a
        :meth:`lookup_many` found: a miss inside a call makes the StoreClient read that call's
        keys one by one. Per request, the result is a prefix as in :meth:`load`.
        """
        jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]] = []
        handles: list[LoadHandle] = []
        remote: list[tuple[LoadHandle, list[PrefixKey], LoadRequest]] = []
        for req in requests:
            keys = self.keys(req.token_ids)
            total = self._check_range(keys, req.first_block, req.num_blocks)
            handle = LoadHandle(self.layout.num_layers, req.first_block, total)
            handles.append(handle)
            if req.remote is not None:
                remote.append((handle, keys, req))
            else:
                jobs.append((handle, keys[req.first_block:req.first_block + total], req.into))
        for group in _split_even([len(keys) for _h, keys, _i in jobs], self.config.workers):
            self._pool.submit(self._run_load_many, [jobs[i] for i in group])
        for handle, keys, req in remote:  # after the batch: local KV first
            self._pool.submit(self._run_load, handle, keys, req.into, None, True, req.remote,
                              self._replicate(None))
        return handles

    def _replicate(self, replicate: bool | None) -> bool:
        return self.config.replicate_remote if replicate is None else replicate

    @staticmethod
    def _check_range(keys: list[PrefixKey], first_block: int, num_blocks: int | None) -> int:
        total = len(keys) - first_block if num_blocks is None else num_blocks
        if first_block < 0 or total < 0 or first_block + total > len(keys):
            raise InvalidArgument(f"blocks [{first_block}, {first_block + total}) outside the "
                                  f"{len(keys)} full blocks of the tokens")
        return total

    def _run_load(self, handle: LoadHandle, keys: list[PrefixKey], into: EngineKV,
                  on_fetched: Callable[[int], None] | None, use_local: bool,
                  remote: RemoteFetch | None, replicate: bool) -> None:
        try:
            self._load(handle, keys, into, on_fetched, use_local, remote, replicate)
        except BaseException as exc:  # a bug: never leave the engine waiting on a layer
            log.exception("load failed unexpectedly")
            _fail_all(handle, f"{type(exc).__name__}: {exc}")
            raise

    def _load(self, handle: LoadHandle, keys: list[PrefixKey], into: EngineKV,
              on_fetched: Callable[[int], None] | None, use_local: bool,
              remote: RemoteFetch | None, replicate: bool) -> None:
        first, total = handle.first_block, handle.requested_blocks
        wanted = keys[first:first + total]
        staging, buffer = self._staging.acquire(total)
        try:
            t0 = time.perf_counter()
            loaded, error = 0, None
            if use_local:
                loaded, error = self._fetch_prefix(self.store, wanted, staging, 0, total,
                                                   on_fetched, first)
            remote_from, address = loaded, ""
            remote_stop = 0 if remote is None else min(total, remote.end_block - first)
            if remote is not None and loaded < remote_stop:
                loaded, error, address = self._fetch_remote(remote, wanted, staging, loaded,
                                                            remote_stop, on_fetched, first)
            t1 = time.perf_counter()
            handle._remote_blocks = loaded - remote_from
            handle._fetched.set_result(loaded)
            blocks = range(first, first + loaded)
            for layer in range(self.layout.num_layers):
                if loaded:
                    into.scatter_layer(layer, blocks, staging[:loaded, layer])
                handle._layer_ready[layer].set()
            t2 = time.perf_counter()
            failed = tuple(range(first + loaded, first + total))
            why = _describe(error) if failed and error is not None else None
            handle._finish(LoadResult(first, total, loaded, failed, why,
                                      loaded * self.layout.chunk_bytes, t1 - t0, t2 - t1,
                                      loaded - remote_from, address))
            replicated = None
            if replicate and loaded > remote_from:
                # The staging rows are ours until released: put them after the engine has its
                # KV, so replication never delays the forward pass.
                replicated = self._put_chain(keys[:first + loaded], first + remote_from,
                                             staging[remote_from:loaded], 0.0)
            handle._finish_replication(replicated)
        finally:
            self._staging.release(buffer)

    def _fetch_remote(self, remote: RemoteFetch, keys: list[PrefixKey], staging: torch.Tensor,
                      start: int, stop: int, on_fetched: Callable[[int], None] | None,
                      first_block: int) -> tuple[int, KvtierError | None, str]:
        """Fetch ``keys[start:stop]`` from the plan's node: (blocks reached, error, address)."""
        address = remote.address
        try:
            if not address:
                address = self.node_address(remote.node_id)
            store = self._remote_store(address)
        except KvtierError as exc:  # not registered, unreachable: recompute
            log.warning("remote load from %s failed: %s", address or remote.node_id,
                        _describe(exc))
            if remote.node_id:
                self._forget_node(remote.node_id)
            return start, exc, address
        loaded, error = self._fetch_prefix(store, keys, staging, start, stop, on_fetched,
                                           first_block)
        if isinstance(error, PeerUnavailable):
            self._drop_remote(address, store)  # reconnect next time (it may come back)
            if remote.node_id:
                self._forget_node(remote.node_id)
        return loaded, error, address

    def _fetch_prefix(self, store: StoreClient, keys: list[PrefixKey], staging: torch.Tensor,
                      start: int, stop: int, on_fetched: Callable[[int], None] | None,
                      first_block: int) -> tuple[int, KvtierError | None]:
        """Fetch the longest held prefix of ``keys[start:stop]`` into the same staging rows, in
        batches; return (index reached, the error that stopped it early or None)."""
        loaded: int = start
        error: KvtierError | None = None
        batch = self.config.load_batch_blocks
        while loaded < stop:
            before, end = loaded, min(loaded + batch, stop)
            try:
                got = store.load_prefix(keys[before:end], list(staging[before:end]))
            except SizeMismatch as exc:  # a chunk of another layout under our key: a bug
                error = exc
                log.error("load from %s stopped at block %d: %s", store.address,
                          first_block + loaded, _describe(exc))
                break
            except KvtierError as exc:  # dead daemon, corrupt chunk, ...: recompute the rest
                error = exc
                log.warning("load from %s stopped at block %d: %s", store.address,
                            first_block + loaded, _describe(exc))
                break
            loaded += got
            if on_fetched is not None:
                on_fetched(loaded)
            if got < end - before:
                break  # a miss: evicted since lookup, or never there
        return loaded, error

    def _run_load_many(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]]) -> None:
        try:
            self._load_many(jobs)
        except BaseException as exc:  # a bug: never leave the engine waiting on a layer
            log.exception("batch load failed unexpectedly")
            for handle, _keys, _into in jobs:
                _fail_all(handle, f"{type(exc).__name__}: {exc}")
            raise

    def _load_many(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]]) -> None:
        # One pooled staging buffer per request, not one for the step: the destinations of a
        # batched read need not be contiguous, and per-request sizes reuse the buffers single
        # calls left in the pool (one big buffer measured 4x slower: a fresh 128 MiB buffer
        # per step, first-touched, when the pool was full of request-sized ones).
        held = [self._staging.acquire(len(keys)) for _h, keys, _i in jobs]
        try:
            flat = [k for _h, keys, _i in jobs for k in keys]
            rows = [row for view, _buf in held for row in view]
            total = len(flat)
            got: list[int | None] = [None] * total
            t0 = time.perf_counter()
            pos, error, step = 0, None, self.config.batch_blocks
            while pos < total:
                end = min(pos + step, total)
                try:
                    got[pos:end] = self.store.get_many_into(flat[pos:end], rows[pos:end])
                except KvtierError as exc:  # dead daemon, size mismatch: the rest failed
                    error = _describe(exc)
                    log.warning("batch load stopped at %d of %d blocks: %s", pos, total, error)
                    break
                pos = end
            t1 = time.perf_counter()
            loaded: list[int] = []
            offset = 0
            for handle, keys, _into in jobs:
                n = 0
                while n < len(keys) and got[offset + n] is not None:
                    n += 1
                loaded.append(n)
                handle._fetched.set_result(n)
                offset += len(keys)
            for layer in range(self.layout.num_layers):
                for (handle, _keys, into), n, (view, _buf) in zip(jobs, loaded, held,
                                                                  strict=True):
                    if n:
                        into.scatter_layer(layer, range(handle.first_block,
                                                        handle.first_block + n),
                                           view[:n, layer])
                    handle._layer_ready[layer].set()
            t2 = time.perf_counter()
            offset = 0
            for (handle, keys, _into), n in zip(jobs, loaded, strict=True):
                first = handle.first_block
                failed = tuple(range(first + n, first + len(keys)))
                # The batch error explains this request's stop only if it stopped where the
                # fetch did (a plain miss before it is a miss).
                why = error if failed and offset + n >= pos else None
                handle._finish(LoadResult(first, len(keys), n, failed, why,
                                          n * self.layout.chunk_bytes, t1 - t0, t2 - t1))
                handle._finish_replication(None)
                offset += len(keys)
        finally:
            for _view, buf in held:
                self._staging.release(buf)

    # --- other nodes --------------------------------------------------------------------------

    def node_address(self, node_id: str) -> str:
        """The gRPC address of daemon ``node_id``, from etcd (cached; needs a client built by
        :meth:`from_etcd` or given ``etcd_endpoint``). Raises MembershipError."""
        with self._remote_lock:
            address = self._node_addresses.get(node_id)
        if address is not None:
            return address
        if self._etcd_endpoint is None:
            raise MembershipError(f"node {node_id!r}: no address and no etcd endpoint to ask")
        record = choose_node(discover_nodes(self._etcd_endpoint, self._key_layout), node_id)
        with self._remote_lock:
            self._node_addresses[node_id] = record.grpc_address
        return record.grpc_address

    def _forget_node(self, node_id: str) -> None:
        with self._remote_lock:
            self._node_addresses.pop(node_id, None)

    def _remote_store(self, address: str) -> StoreClient:
        """The StoreClient of the daemon at ``address`` (the own one if it is that address),
        connected on first use. Raises PeerUnavailable, TierUnavailable."""
        if address == self.store.address:
            return self.store
        with self._remote_lock:
            if self._closed:
                raise PeerUnavailable("the client is closed")
            store = self._remotes.get(address)
        if store is not None:
            return store
        cfg = self.config
        store = StoreClient.connect(address, StoreClientConfig(
            data_plane=cfg.remote_data_plane, rpc_timeout_s=cfg.rpc_timeout_s))
        with self._remote_lock:
            kept = None if self._closed else self._remotes.setdefault(address, store)
        if kept is not store:  # closed meanwhile, or another thread connected first
            store.close()
            if kept is None:
                raise PeerUnavailable("the client is closed")
        return kept

    def _drop_remote(self, address: str, store: StoreClient) -> None:
        with self._remote_lock:
            if self._remotes.get(address) is store:
                del self._remotes[address]
            else:
                return
        store.close()

    @property
    def remote_addresses(self) -> list[str]:
        """Addresses of the other nodes' daemons this client holds a connection to."""
        with self._remote_lock:
            return sorted(self._remotes)

    # --- save ---------------------------------------------------------------------------------

    def begin_save(self, token_ids: object, from_: EngineKV, *,
                   first_block: int = 0) -> LayerwiseSave:
        """Start a layer-by-layer save of the full blocks ``[first_block, ...)`` of
        ``token_ids`` (blocks before it are assumed stored: the first saved chunk's parent)."""
        keys = self.keys(token_ids)
        if not 0 <= first_block <= len(keys):
            raise InvalidArgument(f"first_block {first_block} outside [0, {len(keys)}]")
        return LayerwiseSave(self, keys, first_block, from_)

    def save(self, token_ids: object, from_: EngineKV, *,
             first_block: int = 0) -> cf.Future[SaveResult]:
        """Save every layer of the full blocks ``[first_block, ...)`` at once (a future)."""
        saver = self.begin_save(token_ids, from_, first_block=first_block)
        for layer in range(self.layout.num_layers):
            saver.save_layer(layer)
        return saver.finish()

    def begin_save_many(self, requests: Sequence[SaveRequest]) -> BatchSave:
        """Start layer-by-layer saves of several requests (one engine step) that share one
        staging buffer, one copy task per layer and one flush (:class:`BatchSave`)."""
        parts: list[tuple[list[PrefixKey], int, EngineKV]] = []
        for req in requests:
            keys = self.keys(req.token_ids)
            if not 0 <= req.first_block <= len(keys):
                raise InvalidArgument(f"first_block {req.first_block} outside "
                                      f"[0, {len(keys)}]")
            parts.append((keys, req.first_block, req.from_))
        return BatchSave(self, parts)

    def save_many(self, requests: Sequence[SaveRequest]) -> cf.Future[list[SaveResult]]:
        """Save every layer of several requests at once: one SaveResult per request."""
        saver = self.begin_save_many(requests)
        for layer in range(self.layout.num_layers):
            saver.save_layer(layer)
        return saver.finish()

    def _put_chain(self, keys: list[PrefixKey], first_block: int, staging: torch.Tensor,
                   gather_s: float) -> SaveResult:
        t0 = time.perf_counter()
        stored: list[int] = []
        existing: list[int] = []
        error = None
        failed_from = len(keys)
        for i in range(first_block, len(keys)):
            parent = keys[i - 1] if i else None
            try:
                self.store.put(keys[i], staging[i - first_block], parent=parent)
                stored.append(i)
            except ChunkExists:
                existing.append(i)
            except KvtierError as exc:  # full, parent evicted, daemon gone: later blocks too
                error = f"{type(exc).__name__}: {exc}"
                log.warning("save stopped at block %d: %s", i, error)
                failed_from = i
                break
        return SaveResult(tuple(stored), tuple(existing), tuple(range(failed_from, len(keys))),
                          error, len(stored) * self.layout.chunk_bytes, gather_s,
                          time.perf_counter() - t0)

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for transfers in flight, then close the executor and every store connection."""
        self._pool.shutdown(wait=True)
        with self._remote_lock:
            self._closed = True
            remotes, self._remotes = list(self._remotes.values()), {}
        for store in remotes:
            store.close()
        self.store.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _split_even(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into at most ``parts`` contiguous non-empty groups of about
    equal sum (in order; every index in exactly one group): each item goes to the share of the
    total its midpoint falls in."""
    total = sum(sizes)
    groups: dict[int, list[int]] = {}
    acc = 0
    for i, size in enumerate(sizes):
        share = min(parts - 1, (2 * acc + size) * parts // (2 * total)) if total else 0
        groups.setdefault(share, []).append(i)
        acc += size
    return [groups[g] for g in sorted(groups)]


def _gather_futures(futures: list[cf.Future[list[SaveResult]]]
                    ) -> cf.Future[list[SaveResult]]:
    """One future of the concatenated results of ``futures`` (in order), completed when the
    last one is. The first exception (in order) wins."""
    out: cf.Future[list[SaveResult]] = cf.Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: cf.Future[list[SaveResult]]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result([r for f in futures for r in f.result()])

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(one_done)
    return out


def _describe(exc: BaseException) -> str:
    """``LoadResult.error``/``SaveResult.error`` text: the error class, then its message."""
    return f"{type(exc).__name__}: {exc}"


def _fail_all(handle: LoadHandle, error: str) -> None:
    """End a handle whose load hit a bug: every block failed, every layer released."""
    if not handle.done():
        first, n = handle.first_block, handle.requested_blocks
        handle._finish(LoadResult(first, n, 0, tuple(range(first, first + n)), error, 0, 0.0,
                                  0.0))
    handle._finish_replication(None)


# --- discovery ----------------------------------------------------------------------------------


def discover_nodes(etcd_endpoint: str, key_layout: KeyLayout | None = None
                   ) -> dict[str, NodeRecord]:
    """The daemons registered in etcd, by id. Runs the asyncio etcd client on a private thread
    and loop, so it works from synchronous code and from inside a running event loop alike.
    Raises MembershipError."""
    from kvstore.membership.etcd import DEFAULT_LAYOUT, etcd_client
    from kvstore.membership.nodes import list_nodes

    layout = key_layout or DEFAULT_LAYOUT
    out: cf.Future[dict[str, NodeRecord]] = cf.Future()

    async def read() -> dict[str, NodeRecord]:
        async with etcd_client(etcd_endpoint) as client:
            return await list_nodes(client, layout=layout)

    def run() -> None:
        try:
            out.set_result(asyncio.run(read()))
        except BaseException as exc:  # handed to the caller below
            out.set_exception(exc)

    thread = threading.Thread(target=run, name="kvclient-etcd", daemon=True)
    thread.start()
    thread.join()
    return out.result()


def choose_node(nodes: dict[str, NodeRecord], node_id: str | None = None) -> NodeRecord:
    """``node_id``'s record, else the first node on this host, else the first by id."""
    if not nodes:
        raise MembershipError("no store daemon is registered in etcd")
    if node_id is not None:
        if node_id not in nodes:
            raise MembershipError(f"node {node_id!r} is not registered (known: {sorted(nodes)})")
        return nodes[node_id]
    here = socket.gethostname()
    local = [r for r in nodes.values() if r.hostname == here]
    return local[0] if local else next(iter(nodes.values()))


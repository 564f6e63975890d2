"""vLLM's KV tensors as :class:`~kvstore.client.layouts.EngineKV` layouts.

CPU vLLM (``cpu_attn.py``) gives every attention layer a view of one allocation,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; the backend reads it as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits dim 2 in halves, so in
memory one (block, head) is K of ``block_size`` tokens, then V: ``[block, head, k|v, token,
dim]``. One block of one layer is one contiguous run, and a layer copy of ``n`` blocks to
kvtier's chunk layout (``[k|v, head, token, dim]`` per block and layer) is one
``index_select`` over whole blocks written through a view that swaps the head and k|v axes
(:class:`CpuBlocksKV`); a save in one copy does the same into runs of reserved extents of the
daemon's arena (:meth:`CpuBlocksKV.gather_chunks`). Loads on the daemon's host use
:meth:`CpuBlocksKV.scatter_chunks`: whole chunks copied straight out of the daemon's arena, one
strided copy per block for every layer (vLLM's layer tensors are views of one allocation at one
layer stride). CUDA backends with ``[2, num_blocks, block_size, heads, dim]`` are the
client's :class:`~kvstore.client.layouts.PagedKV` (:func:`engine_kv_for` picks).

:class:`GuardedKV` wraps a load destination so that a load given up (timeout) can never write
the engine's blocks afterwards: vLLM recomputes those blocks, and a late scatter would
overwrite the recomputed KV.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore.client.kvlayout import KVLayout
from kvstore.client.layouts import EngineKV, PagedKV, strided_runs
from kvstore.errors import ConfigError, InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = ["CpuBlocksKV", "GuardedKV", "InferenceModeKV", "engine_kv_for", "layout_of"]


def _is_cpu_layout(t: torch.Tensor, layout: KVLayout) -> bool:
    return (t.ndim == 4 and t.shape[1] == layout.num_kv_heads
            and t.shape[2] == layout.block_tokens and t.shape[3] == 2 * layout.head_dim)


def layout_of(kv_caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int,
              block_tokens: int) -> KVLayout:
    """The :class:`KVLayout` of vLLM's per-layer tensors, checked against the KV-cache spec.
    Raises ConfigError for a tensor shape this connector cannot read."""
    if not kv_caches:
        raise ConfigError("kvtier connector: vLLM registered no KV caches")
    layout = KVLayout(len(kv_caches), num_kv_heads, head_dim, block_tokens, kv_caches[0].dtype)
    first = kv_caches[0]
    paged = (first.ndim == 5 and first.shape[0] == 2 and first.shape[2] == block_tokens
             and first.shape[3] == num_kv_heads and first.shape[4] == head_dim)
    if not (_is_cpu_layout(first, layout) or paged):
        raise ConfigError(
            f"kvtier connector: unsupported KV tensor shape {tuple(first.shape)}; expected CPU "
            f"[blocks, {num_kv_heads}, {block_tokens}, {2 * head_dim}] or "
            f"[2, blocks, {block_tokens}, {num_kv_heads}, {head_dim}]")
    for t in kv_caches:
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ConfigError("kvtier connector: KV tensors of different shapes or dtypes "
                              "(hybrid models are not supported)")
    return layout


class CpuBlocksKV:
    """CPU vLLM's KV tensors (``[num_blocks, heads, block_size, 2 * head_size]`` per layer) and a
    request's block ids: logical block ``i`` lives in vLLM block ``block_ids[i]``."""

    __slots__ = ("_all", "_ids", "kv_caches", "layout")

    def __init__(self, kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                 layout: KVLayout) -> None:
        import torch

        if len(kv_caches) != layout.num_layers:
            raise InvalidArgument(f"{len(kv_caches)} layer caches for {layout.num_layers} layers")
        first = kv_caches[0]
        for t in kv_caches:
            if not _is_cpu_layout(t, layout) or t.shape != first.shape:
                raise InvalidArgument(f"a CPU layer cache is [blocks, {layout.num_kv_heads}, "
                                      f"{layout.block_tokens}, {2 * layout.head_dim}], got "
                                      f"{tuple(t.shape)}")
            if t.dtype != layout.dtype:
                raise InvalidArgument(f"layer cache dtype {t.dtype}, the layout says "
                                      f"{layout.dtype}")
        ids = torch.as_tensor(list(block_ids), dtype=torch.long, device=first.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= first.shape[0]):
            raise InvalidArgument("block ids must lie in [0, num_blocks)")
        self.kv_caches = list(kv_caches)
        self.layout = layout
        self._ids = ids
        self._all: torch.Tensor | bool | None = False  # False: not looked at yet

    def _blocks(self, layer: int) -> torch.Tensor:
        # A view (never a copy): [blocks, heads, k|v, tokens, dim], as cpu_attn reads it.
        t = self.kv_caches[layer]
        lay = self.layout
        return t.view(t.shape[0], lay.num_kv_heads, 2, lay.block_tokens, lay.head_dim)

    def _ids_for(self, blocks: range) -> torch.Tensor:
        if blocks.start < 0 or blocks.stop > self._ids.numel():
            raise InvalidArgument(f"blocks {blocks} outside the {self._ids.numel()} block ids")
        return self._ids[blocks.start:blocks.stop]

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        import torch

        lay = self.layout
        heads, run = lay.num_kv_heads, lay.block_tokens * lay.head_dim
        ids = self._ids_for(blocks)
        try:  # [n, k|v, H, B*D] seen as [n, H, k|v, B*D]: vLLM's order, no copy
            out = chunks.view(ids.numel(), 2, heads, run).transpose(1, 2)
        except RuntimeError:  # chunks that cannot be viewed so: pick, then one copy
            picked = self._blocks(layer).index_select(0, ids)
            chunks.copy_(picked.transpose(1, 2))  # [n, H, 2, B, D] -> [n, 2, H, B, D]
            return
        # One index_select straight into the transposed view (index_select into a temporary
        # and a transposing copy was two copies, the second a 5-d strided one; a copy per
        # block was one torch call per block).
        t = self.kv_caches[layer]
        torch.index_select(t.view(t.shape[0], heads, 2, run), 0, ids, out=out)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        # One 3-d copy per block ([k|v, heads, tokens*dim] -> [heads, k|v, tokens*dim]). The
        # whole-layer form (transpose + contiguous + index_copy_ over [n, 2, H, B, D]) ran at
        # ~0.1 GB/s here, 50x slower than these copies: torch's 5-d strided copy loop.
        lay = self.layout
        t = self.kv_caches[layer]
        dst = t.view(t.shape[0], lay.num_kv_heads, 2, lay.block_tokens * lay.head_dim)
        ids = self._ids_for(blocks).tolist()
        src = chunks.to(t.device, non_blocking=True)
        src = src.reshape(len(ids), 2, lay.num_kv_heads, lay.block_tokens * lay.head_dim)
        for i, b in enumerate(ids):
            dst[b].copy_(src[i].transpose(0, 1))


    def scatter_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                       ) -> None:
        """Copy layers ``layers`` of whole chunks (``chunks[i]``: ``[layers, k|v, heads,
        tokens, dim]`` of block ``blocks[i]``, e.g. a view of the daemon's arena) into vLLM's
        blocks: the one copy of a same-host load. When vLLM's layer tensors are views of one
        allocation at one layer stride (its ``allocate_kv_cache``: layer ``l`` of block ``b``
        at ``offset + l * layer_stride + b * block_stride``), one strided copy per block moves
        every layer; otherwise one copy per block and layer. Measured here for 96 blocks of 512
        KiB (8 layers): per block 13.3 ms, per block and layer 20.6 ms, one memcpy of the same
        bytes 11.3 ms: each torch copy call costs ~12 us besides its bytes."""
        lay = self.layout
        ids = self._ids_for(blocks).tolist()
        if len(chunks) != len(ids):
            raise InvalidArgument(f"{len(chunks)} chunks for {len(ids)} blocks")
        lo, hi = layers.start, layers.stop
        if not 0 <= lo <= hi <= lay.num_layers:
            raise InvalidArgument(f"layers {layers} outside [0, {lay.num_layers})")
        heads, run = lay.num_kv_heads, lay.block_tokens * lay.head_dim
        every = self._all_layers()
        if every is not None:
            if (lo, hi) != (0, lay.num_layers):
                every = every[lo:hi]
            # [L, k|v, H, B*D] read as [L, H, k|v, B*D] (vLLM's order within a block): one
            # as_strided call per contiguous chunk instead of a slice, a view and a transpose
            size, layer = (hi - lo, heads, 2, run), 2 * heads * run
            stride = (layer, run, heads * run, 1)
            for b, chunk in zip(ids, chunks, strict=True):
                src = chunk.as_strided(size, stride, chunk.storage_offset() + lo * layer) \
                    if chunk.is_contiguous() else \
                    chunk[lo:hi].view(hi - lo, 2, heads, run).transpose(1, 2)
                every.select(1, b).copy_(src)
            return
        for layer in layers:
            t = self.kv_caches[layer]
            dst = t.view(t.shape[0], heads, 2, run)
            for b, chunk in zip(ids, chunks, strict=True):
                dst[b].copy_(chunk[layer].view(2, heads, run).transpose(0, 1))

    def gather_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                      ) -> None:
        """Copy layers ``layers`` of blocks ``blocks`` out of vLLM's blocks into whole chunks
        (``chunks[i]``: ``[layers, k|v, heads, tokens, dim]`` of block ``blocks[i]``, e.g. a
        view of a reserved extent of the daemon's arena): the counterpart of
        :meth:`scatter_chunks`, for a save in one copy. Writes nothing else of the chunks.

        The chunks are cut into runs lying at one stride in one storage (:func:`~kvstore.client.layouts.strided_runs`:
        the extents one RESERVE_MANY reserves are mostly adjacent in the arena); a run is one
        strided view, filled by one ``index_select`` of vLLM's blocks per layer (per run for
        every layer of ``layers`` at once when vLLM's layer tensors are one allocation at one
        layer stride), so a step's layer is a few torch calls, not one per block. A chunk
        alone (not adjacent to the next) is a run of one. Measured here for 96 blocks of 512
        KiB, 8 layers, one layer at a time: one copy per block and layer 5.6-6.2 ms, one
        ``index_select`` per layer 3.9-4.3 ms, a memcpy of the same bytes 2.7-3.1 ms."""
        import torch

        lay = self.layout
        ids = self._ids_for(blocks)
        if len(chunks) != ids.numel():
            raise InvalidArgument(f"{len(chunks)} chunks for {ids.numel()} blocks")
        lo, hi = layers.start, layers.stop
        if not 0 <= lo <= hi <= lay.num_layers or layers.step != 1:
            raise InvalidArgument(f"layers {layers} outside [0, {lay.num_layers})")
        if lo == hi:
            return
        heads, run = lay.num_kv_heads, lay.block_tokens * lay.head_dim
        layer = 2 * heads * run  # elements of one layer of a chunk
        every = self._all_layers() if hi - lo > 1 else None
        for a, b, step in strided_runs(chunks, lay.num_layers * layer):
            first, picked = chunks[a], ids[a:b]
            if step == 0:  # not a contiguous chunk: one copy per layer, as it is
                for layer_i in layers:
                    t = self.kv_caches[layer_i]
                    block = t.view(t.shape[0], heads, 2, lay.block_tokens, lay.head_dim)
                    first[layer_i].copy_(block[int(picked[0])].transpose(0, 1))
                continue
            base = first.storage_offset()
            if every is not None:
                # [layers, run of chunks, heads, k|v, tokens*dim]: vLLM's order within a block
                out = first.as_strided((hi - lo, b - a, heads, 2, run),
                                       (layer, step, run, heads * run, 1), base + lo * layer)
                torch.index_select(every[lo:hi], 1, picked, out=out)
                continue
            for layer_i in layers:
                t = self.kv_caches[layer_i]
                out = first.as_strided((b - a, heads, 2, run), (step, run, heads * run, 1),
                                       base + layer_i * layer)
                torch.index_select(t.view(t.shape[0], heads, 2, run), 0, picked, out=out)

    def _all_layers(self) -> torch.Tensor | None:
        """``[layers, num_blocks, heads, k|v, tokens*dim]`` over every layer tensor at once
        (no copy), or None when the layers are not one allocation at one layer stride."""
        if self._all is False:
            self._all = self._find_all_layers()
        return self._all  # type: ignore[return-value]

    def _find_all_layers(self) -> torch.Tensor | None:
        lay = self.layout
        caches = self.kv_caches
        first = caches[0]
        heads, run = lay.num_kv_heads, lay.block_tokens * lay.head_dim
        # Within a block: [heads, tokens, 2*dim] contiguous (the block stride may be anything)
        if tuple(first.stride()[1:]) != (2 * run, 2 * lay.head_dim, 1):
            return None
        base = first.untyped_storage().data_ptr()
        offsets = [t.storage_offset() for t in caches]
        step = offsets[1] - offsets[0] if len(caches) > 1 else 1
        for i, t in enumerate(caches):
            if (t.untyped_storage().data_ptr() != base or t.stride() != first.stride()
                    or offsets[i] != offsets[0] + i * step):
                return None
        if step <= 0:
            return None
        return first.as_strided((len(caches), first.shape[0], heads, 2, run),
                                (step, first.stride(0), 2 * run, run, 1), offsets[0])


def _has_scatter_chunks(kv: object) -> bool:
    return getattr(kv, "scatter_chunks", None) is not None


def engine_kv_for(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int],
                  layout: KVLayout) -> EngineKV:
    """The layout of vLLM's tensors for one request's blocks (CPU or ``[2, blocks, ...]``),
    copying under ``torch.inference_mode`` (:class:`InferenceModeKV`)."""
    if _is_cpu_layout(kv_caches[0], layout):
        return InferenceModeKV(CpuBlocksKV(kv_caches, block_ids, layout))
    return InferenceModeKV(PagedKV(kv_caches, list(block_ids), layout))


class InferenceModeKV:
    """vLLM allocates its KV caches as inference tensors, which torch lets be updated only in
    inference mode. The client copies on its own threads (where vLLM's mode does not reach), so
    every gather and scatter enters it here; without it the first save or load raised
    ``RuntimeError: Inplace update to inference tensor outside InferenceMode`` inside vLLM."""

    __slots__ = ("_inner",)

    def __init__(self, inner: EngineKV) -> None:
        self._inner = inner

    @property
    def scatter_chunks(self) -> Callable[[range, range, Sequence[torch.Tensor]], None] | None:
        """The one-copy load path's entry (layouts.py, EngineKV), only where the inner has it."""
        return self._scatter_chunks if _has_scatter_chunks(self._inner) else None

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        import torch

        with torch.inference_mode():
            self._inner.gather_layer(layer, blocks, chunks)

    @property
    def gather_chunks(self) -> Callable[[range, range, Sequence[torch.Tensor]], None] | None:
        """The one-copy save's entry (:meth:`CpuBlocksKV.gather_chunks`), where the inner
        has it."""
        return self._gather_chunks if getattr(self._inner, "gather_chunks", None) is not None \
            else None

    def _gather_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                       ) -> None:
        import torch

        with torch.inference_mode():
            self._inner.gather_chunks(layers, blocks, chunks)  # type: ignore[attr-defined]

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        import torch

        with torch.inference_mode():
            self._inner.scatter_layer(layer, blocks, chunks)

    def _scatter_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                        ) -> None:
        import torch

        with torch.inference_mode():
            self._inner.scatter_chunks(layers, blocks, chunks)  # type: ignore[attr-defined]


class GuardedKV:
    """A load destination that can be closed: after :meth:`close` returns, no scatter (nor
    ``scatter_chunks``, the one-copy path's) writes the engine's buffers any more (one that was
    running has finished). Saves pass through."""

    __slots__ = ("_closed", "_inner", "_lock")

    def __init__(self, inner: EngineKV) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._closed = False

    @property
    def scatter_chunks(self) -> Callable[[range, range, Sequence[torch.Tensor]], None] | None:
        """The one-copy load path's entry, guarded, only where the inner has it."""
        return self._scatter_chunks if _has_scatter_chunks(self._inner) else None

    def close(self) -> None:
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.gather_layer(layer, blocks, chunks)

    @property
    def gather_chunks(self) -> Callable[[range, range, Sequence[torch.Tensor]], None] | None:
        """The inner's one-copy save entry (saves pass through unguarded), or None."""
        return getattr(self._inner, "gather_chunks", None)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        with self._lock:
            if not self._closed:
                self._inner.scatter_layer(layer, blocks, chunks)

    def _scatter_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                        ) -> None:
        # Under the lock like scatter_layer: close() waits for a copy that is running, and no
        # copy starts after it (the one-copy path's lease is released only after this).
        with self._lock:
            if not self._closed:
                self._inner.scatter_chunks(layers, blocks, chunks)  # type: ignore[attr-defined]

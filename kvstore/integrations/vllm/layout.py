"""vLLM's KV tensors as :class:`~kvstore.client.layouts.EngineKV` layouts.

CPU vLLM (``cpu_attn.py``) gives every attention layer a view of one allocation,
``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; the backend reads it as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits dim 2 in halves, so in
memory one (block, head) is K of ``block_size`` tokens, then V: ``[block, head, k|v, token,
dim]``. One block of one layer is one contiguous run, and a layer copy of ``n`` blocks to
kvtier's chunk layout (``[k|v, head, token, dim]`` per block and layer) is one
``index_select``/``index_copy_`` over whole blocks plus a swap of the head and k|v axes
(:class:`CpuBlocksKV`). CUDA backends with ``[2, num_blocks, block_size, heads, dim]`` are the
client's :class:`~kvstore.client.layouts.PagedKV` (:func:`engine_kv_for` picks).

:class:`GuardedKV` wraps a load destination so that a load given up (timeout) can never write
the engine's blocks afterwards: vLLM recomputes those blocks, and a late scatter would
overwrite the recomputed KV.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.client.kvlayout import KVLayout
from kvstore.client.layouts import EngineKV, PagedKV
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

    __slots__ = ("_ids", "kv_caches", "layout")

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
        picked = self._blocks(layer).index_select(0, self._ids_for(blocks))  # [n, H, 2, B, D]
        chunks.copy_(picked.transpose(1, 2))  # -> [n, 2, H, B, D]

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

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        import torch

        with torch.inference_mode():
            self._inner.gather_layer(layer, blocks, chunks)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        import torch

        with torch.inference_mode():
            self._inner.scatter_layer(layer, blocks, chunks)


class GuardedKV:
    """A load destination that can be closed: after :meth:`close` returns, no scatter writes the
    engine's buffers any more (one that was running has finished). Saves pass through."""

    __slots__ = ("_closed", "_inner", "_lock")

    def __init__(self, inner: EngineKV) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.gather_layer(layer, blocks, chunks)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        with self._lock:
            if not self._closed:
                self._inner.scatter_layer(layer, blocks, chunks)

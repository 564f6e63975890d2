"""Engine layouts: how :class:`~kvstore.client.kv_client.KVClient` reads and writes an engine's
own KV buffers, one layer and a range of logical blocks at a time.

Every layout implements :class:`EngineKV` (``gather_layer`` for saves, ``scatter_layer`` for
loads) and converts between the engine's buffers and kvtier's chunk layout
(:class:`~kvstore.client.kvlayout.KVLayout`: ``[layer, k|v, kv_head, token, head_dim]`` per
block):

    * :class:`ContiguousKV`: one sequence as ``[layers, 2, kv_heads, tokens, head_dim]``.
    * :class:`PagedKV`: vLLM's paged cache, ``kv_caches[layer]`` of shape
      ``[2, num_pages, page_tokens, kv_heads, head_dim]``, and the request's block table (page
      ids of its logical pages, in order). ``page_tokens`` need not equal ``block_tokens``.
    * :class:`ChunkKV`: kvtier's own chunk layout ``[n_blocks, *chunk_shape]`` (no reshuffle).
    * :class:`HFCacheKV`: a transformers ``DynamicCache`` (a save source only).

A layout may also have ``scatter_chunks(layers, blocks, chunks)`` (see :class:`EngineKV`): the
one-copy load path, which copies straight out of the daemon's shared-memory arena; the client
uses it where it is there and not None (:class:`ContiguousKV`, :class:`ChunkKV` and vLLM's CPU
layout have it; :class:`PagedKV` has not: its destinations may be on a GPU, where a copy out
of the arena is asynchronous and could outlive the read lease). Likewise
``gather_chunks(layers, blocks, chunks)``, the one-copy save path, which writes straight into
reserved ranges of the arena (:class:`ContiguousKV`, :class:`ChunkKV` and vLLM's CPU layout).

:func:`strided_runs` cuts a list of chunk views into runs that one strided view covers, so a
layout (and the client's own copies) can move a run of chunks in one torch call.

Layouts copy; they never keep the chunk tensors they are given. Bad shapes, dtypes or block
ranges raise ``InvalidArgument``. torch is imported only when a tensor is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstore.client.kvlayout import KVLayout
from kvstore.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = ["ChunkKV", "ContiguousKV", "EngineKV", "HFCacheKV", "PagedKV", "strided_runs"]


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

    # Optional (not part of the protocol, found with getattr; a wrapper sets it to None when
    # what it wraps has none):
    #   scatter_chunks(layers: range, blocks: range, chunks: Sequence[torch.Tensor]) -> None
    # copies layers ``layers`` of whole chunks, ``chunks[i]`` being ``[num_layers, 2, kv_heads,
    # block_tokens, head_dim]`` of block ``blocks[i]`` (views of the daemon's arena, anywhere
    # in it), into the engine's buffers, synchronously: when it returns the chunks are no
    # longer read (the client then releases their lease). The one-copy load path.
    #   gather_chunks(layers: range, blocks: range, chunks: Sequence[torch.Tensor]) -> None
    # the reverse: copies layers ``layers`` of ``blocks`` out of the engine's buffers into
    # whole chunks (views of reserved arena ranges), writing nothing else of them,
    # synchronously. The one-copy save path.


def strided_runs(chunks: Sequence[torch.Tensor], numel: int) -> list[tuple[int, int, int]]:
    """``chunks`` (each of ``numel`` elements) cut into runs ``(start, stop, step)``: chunks
    ``start..stop-1`` are contiguous views of one storage at storage offsets ``step`` elements
    apart (``step >= numel``: they never overlap), so one strided view covers them (the
    extents one batch reserves or reads are mostly adjacent in the daemon's arena). A chunk
    that is not contiguous or not of ``numel`` elements is a run of its own with ``step`` 0;
    another storage, dtype or stride starts a new run."""
    runs: list[tuple[int, int, int]] = []
    n = len(chunks)
    i = 0
    while i < n:
        t = chunks[i]
        if not t.is_contiguous() or t.numel() != numel:
            runs.append((i, i + 1, 0))
            i += 1
            continue
        ptr, prev = t.untyped_storage().data_ptr(), int(t.storage_offset())
        j, step = i + 1, 0
        while j < n:
            u = chunks[j]
            if (not u.is_contiguous() or u.numel() != numel or u.dtype != t.dtype
                    or u.untyped_storage().data_ptr() != ptr):
                break
            off = int(u.storage_offset())
            d = off - prev
            if (d < numel) if j == i + 1 else (d != step):
                break
            step, prev = d, off
            j += 1
        step = step or numel  # a run of one: any stride >= numel will do
        runs.append((i, j, step))
        i = j
    return runs


def _check_chunks(layers: range, blocks: range, chunks: Sequence[torch.Tensor],
                  layout: KVLayout) -> None:
    if len(chunks) != len(blocks):
        raise InvalidArgument(f"{len(chunks)} chunks for {len(blocks)} blocks")
    if not 0 <= layers.start <= layers.stop <= layout.num_layers or layers.step != 1:
        raise InvalidArgument(f"layers {layers} outside [0, {layout.num_layers})")


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

    def scatter_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                       ) -> None:
        _check_chunks(layers, blocks, chunks, self.layout)
        rows = self._rows(blocks)
        lo, hi = layers.start, layers.stop
        for row, chunk in zip(range(rows.start, rows.stop), chunks, strict=True):
            self.tensor[row, lo:hi].copy_(chunk[lo:hi])

    def gather_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                      ) -> None:
        _check_chunks(layers, blocks, chunks, self.layout)
        rows = self._rows(blocks)
        lo, hi = layers.start, layers.stop
        for row, chunk in zip(range(rows.start, rows.stop), chunks, strict=True):
            chunk[lo:hi].copy_(self.tensor[row, lo:hi])


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

    def _check_runs(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]) -> int:
        """Checks of a whole-chunk copy; the block size in tokens."""
        _check_chunks(layers, blocks, chunks, self.layout)
        B = self.layout.block_tokens
        if blocks.stop * B > self.tensor.shape[3]:
            raise InvalidArgument(f"blocks {blocks} need {blocks.stop * B} tokens; the buffer "
                                  f"has {self.tensor.shape[3]}")
        return B

    def scatter_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                       ) -> None:
        B = self._check_runs(layers, blocks, chunks)
        lo, hi = layers.start, layers.stop
        for b, chunk in zip(blocks, chunks, strict=True):
            # [l, 2, H, B, D] of one block: one strided copy for all its layers
            self.tensor[lo:hi, :, :, b * B:(b + 1) * B].copy_(chunk[lo:hi])

    def gather_chunks(self, layers: range, blocks: range, chunks: Sequence[torch.Tensor]
                      ) -> None:
        B = self._check_runs(layers, blocks, chunks)
        lo, hi = layers.start, layers.stop
        for b, chunk in zip(blocks, chunks, strict=True):
            chunk[lo:hi].copy_(self.tensor[lo:hi, :, :, b * B:(b + 1) * B])


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
        flat = self._flat(layer)
        # index_copy_ wants its source on the cache's device: a host staging buffer is copied
        # over first (one transfer; on the same stream, so it is ordered before the scatter),
        # then permuted there.
        src = chunks.to(flat.device, non_blocking=True).permute(1, 0, 3, 2, 4).reshape(
            2, -1, self.layout.num_kv_heads, self.layout.head_dim)  # [2, n*B, H, D]
        flat.index_copy_(1, self._slots_for(blocks), src)

"""How a model's KV cache is cut into the chunks kvtier stores.

One chunk holds one block of ``block_tokens`` tokens for every layer, laid out as
``[layer, k|v, kv_head, token, head_dim]`` in the model's dtype and contiguous, so a chunk is one
memcpy in and out of a tier. Only full blocks are stored: a trailing partial block is recomputed.
:func:`namespace_for` names a model's KV in a layout (the root of its chunk keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import InvalidArgument, SizeMismatch
from kvstore.keys import KVDtype, KVFingerprint, Namespace

if TYPE_CHECKING:
    import torch

__all__ = ["KVLayout", "namespace_for"]


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"KVLayout.{name} must be positive")

    @classmethod
    def for_model(cls, model: Any, block_tokens: int) -> KVLayout:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, block_tokens,
                   next(model.parameters()).dtype)

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        import torch

        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def empty_chunks(self, n_blocks: int, device: str = "cpu") -> torch.Tensor:
        """A ``[n_blocks, *chunk_shape]`` buffer to load chunks into (one slice per chunk)."""
        import torch

        return torch.empty((n_blocks, *self.chunk_shape), dtype=self.dtype, device=device)

    def pack(self, cache: Any, first_block: int, n_blocks: int) -> torch.Tensor:
        """Copy blocks ``[first_block, first_block + n_blocks)`` of a one-sequence cache into chunks.

        ``cache`` is a transformers ``DynamicCache`` (or anything with ``.layers[l].keys/.values`` of
        shape ``[1, kv_heads, seq, head_dim]``). Returns ``[n_blocks, *chunk_shape]``, contiguous.
        """
        import torch

        start = first_block * self.block_tokens
        stop = start + n_blocks * self.block_tokens
        out = self.empty_chunks(n_blocks, device=str(cache.layers[0].keys.device))
        for layer_idx, layer in enumerate(cache.layers[: self.num_layers]):
            for kv, tensor in enumerate((layer.keys, layer.values)):
                if tensor.shape[0] != 1 or tensor.shape[2] < stop:
                    raise InvalidArgument(
                        f"cache layer {layer_idx} has shape {tuple(tensor.shape)}; need batch 1 and "
                        f">= {stop} tokens")
                # [1, H, n*B, D] -> [n, H, B, D]
                blocks = tensor[0, :, start:stop, :].reshape(
                    self.num_kv_heads, n_blocks, self.block_tokens, self.head_dim).transpose(0, 1)
                out[:, layer_idx, kv].copy_(blocks)
        return out if out.is_contiguous() else torch.Tensor.contiguous(out)

    def unpack(self, chunks: torch.Tensor) -> Any:
        """Build a ``DynamicCache`` holding ``n_blocks * block_tokens`` tokens from loaded chunks."""
        from transformers.cache_utils import DynamicCache

        if tuple(chunks.shape[1:]) != self.chunk_shape:
            raise SizeMismatch("chunk tensor has the wrong shape", expected=self.chunk_bytes,
                               actual=int(chunks[0].numel() * chunks.element_size()) if len(chunks) else 0)
        n_blocks = chunks.shape[0]
        cache = DynamicCache()
        for layer_idx in range(self.num_layers):
            kv = []
            for which in (0, 1):
                # [n, H, B, D] -> [1, H, n*B, D]
                t = chunks[:, layer_idx, which].transpose(0, 1).reshape(
                    1, self.num_kv_heads, n_blocks * self.block_tokens, self.head_dim)
                kv.append(t.contiguous())
            cache.update(kv[0], kv[1], layer_idx)
        return cache


def namespace_for(layout: KVLayout, model_name: str, tenant: str = "", *, tp_rank: int = 0,
                  tp_size: int = 1) -> Namespace:
    """The namespace of a model's KV in ``layout`` (same model + layout + tenant = same keys)."""
    fingerprint = KVFingerprint(
        model=model_name, dtype=KVDtype.from_torch(layout.dtype), num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
        block_size_tokens=layout.block_tokens, tp_rank=tp_rank, tp_size=tp_size)
    return Namespace(fingerprint, tenant)

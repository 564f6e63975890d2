"""vLLM's CPU KV-cache tensors as tests build them (no vLLM needed)."""

from __future__ import annotations

from typing import Any

from kvstore.client.kvlayout import KVLayout


def vllm_caches(layout: KVLayout, num_blocks: int, kind: str, seed: int | None) -> list[Any]:
    """CPU vLLM's per-layer tensors ``[num_blocks, heads, block, 2 * head_dim]``, laid out as
    vLLM may allocate them: ``layer-major`` (one allocation, layer l at l * layer_stride),
    ``block-major`` (one allocation, the layers of a block side by side) or ``separate`` (one
    tensor per layer: no common layer stride). Random from ``seed``, or zeros (None)."""
    import torch

    L = layout.num_layers
    shape = (num_blocks, layout.num_kv_heads, layout.block_tokens, 2 * layout.head_dim)
    g = torch.Generator().manual_seed(seed or 0)

    def fill(dims: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(dims, generator=g) if seed is not None else torch.zeros(dims)

    if kind == "layer-major":
        whole = fill((L, *shape))
        return [whole[i] for i in range(L)]
    if kind == "block-major":
        whole = fill((num_blocks, L, *shape[1:]))
        return [whole[:, i] for i in range(L)]
    return [fill(shape) for _ in range(L)]

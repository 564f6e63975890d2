"""CpuBlocksKV.gather_chunks, the copy of a one-copy save (vLLM's CPU blocks straight into
whole chunks, e.g. reserved extents of the daemon's arena): byte for byte what the two-copy
path (gather_layer into staging rows) produces, for every way vLLM may allocate its layer
tensors, for a range of layers at a time, and writing nothing outside the layers asked for."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.kvlayout import KVLayout  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.integrations.vllm.layout import CpuBlocksKV, GuardedKV, engine_kv_for  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16,
                  dtype=torch.float32)
NUM_BLOCKS = 12
SHAPE = (NUM_BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_tokens, 2 * LAYOUT.head_dim)


def caches(kind: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    L = LAYOUT.num_layers
    if kind == "layer-major":  # vLLM's allocate_kv_cache: one allocation, one layer stride
        whole = torch.randn((L, *SHAPE), generator=g)
        return [whole[i] for i in range(L)]
    if kind == "block-major":
        whole = torch.randn((NUM_BLOCKS, L, *SHAPE[1:]), generator=g)
        return [whole[:, i] for i in range(L)]
    return [torch.randn(SHAPE, generator=g) for _ in range(L)]


def two_copy(kv: CpuBlocksKV, blocks: range) -> torch.Tensor:
    """Today's save path: one gather_layer per layer into staging rows."""
    staging = LAYOUT.empty_chunks(len(blocks))
    for layer in range(LAYOUT.num_layers):
        kv.gather_layer(layer, blocks, staging[:, layer])
    return staging


@pytest.mark.parametrize("kind", ["layer-major", "block-major", "separate"])
def test_gather_chunks_writes_the_bytes_of_the_two_copy_path(kind: str) -> None:
    kv = CpuBlocksKV(caches(kind), [9, 2, 5, 0, 11], LAYOUT)
    blocks = range(1, 5)
    expected = two_copy(kv, blocks)
    # Destinations scattered in one buffer, as reserved extents lie anywhere in an arena
    arena = torch.full((4 * len(blocks) * LAYOUT.chunk_bytes // 4,), -1.0)
    n = LAYOUT.chunk_bytes // 4
    dsts = [arena[(3 * i + 1) * n:(3 * i + 2) * n].view(LAYOUT.chunk_shape)
            for i in range(len(blocks))]
    kv.gather_chunks(range(LAYOUT.num_layers), blocks, dsts)
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, expected[i]), i
    written = torch.zeros_like(arena, dtype=torch.bool)
    for i in range(len(blocks)):
        written[(3 * i + 1) * n:(3 * i + 2) * n] = True
    assert bool((arena[~written] == -1.0).all())  # nothing outside the extents


@pytest.mark.parametrize("kind", ["layer-major", "separate"])
def test_gather_chunks_layer_by_layer_equals_all_at_once(kind: str) -> None:
    """Layer-by-layer saving: the layers handed over so far are copied into the same chunks,
    a range at a time, and only those layers are written."""
    kv = CpuBlocksKV(caches(kind), [3, 8, 1], LAYOUT)
    blocks = range(0, 3)
    expected = two_copy(kv, blocks)
    dsts = [torch.full(LAYOUT.chunk_shape, -1.0) for _ in blocks]
    kv.gather_chunks(range(0, 1), blocks, dsts)
    assert all(bool((d[1:] == -1.0).all()) for d in dsts)
    kv.gather_chunks(range(1, 3), blocks, dsts)
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, expected[i]), i


def test_gather_chunks_is_reached_through_the_connectors_wrappers() -> None:
    src = caches("layer-major")
    kv = GuardedKV(engine_kv_for(src, [4, 6], LAYOUT))
    gather = kv.gather_chunks
    assert gather is not None
    dsts = [torch.zeros(LAYOUT.chunk_shape) for _ in range(2)]
    gather(range(LAYOUT.num_layers), range(0, 2), dsts)  # under inference mode inside
    expected = two_copy(CpuBlocksKV(src, [4, 6], LAYOUT), range(0, 2))
    assert all(torch.equal(d, expected[i]) for i, d in enumerate(dsts))


def test_gather_chunks_refuses_bad_ranges() -> None:
    kv = CpuBlocksKV(caches("layer-major"), [1, 2], LAYOUT)
    with pytest.raises(InvalidArgument):
        kv.gather_chunks(range(0, 4), range(0, 2), [torch.zeros(LAYOUT.chunk_shape)] * 2)
    with pytest.raises(InvalidArgument):
        kv.gather_chunks(range(0, 3), range(0, 2), [torch.zeros(LAYOUT.chunk_shape)])
    with pytest.raises(InvalidArgument):
        kv.gather_chunks(range(0, 3), range(1, 3), [torch.zeros(LAYOUT.chunk_shape)] * 2)

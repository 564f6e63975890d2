"""CpuBlocksKV.gather_chunks over runs of chunks (issue 13): chunks lying at one stride in one
storage (the extents of one RESERVE_MANY, mostly adjacent in the arena) are filled with one
``index_select`` per layer for the whole run; chunks that are not (gaps that change, another
storage, a chunk that is not contiguous) fall back to smaller runs, down to one chunk each,
and every way writes the bytes of the two-copy path, byte for byte, and nothing else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.overrides import TorchFunctionMode  # noqa: E402

from kvstore.client.kvlayout import KVLayout  # noqa: E402
from kvstore.client.layouts import strided_runs as _strided_runs  # noqa: E402
from kvstore.integrations.vllm.layout import CpuBlocksKV  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16,
                  dtype=torch.float32)
NUM_BLOCKS = 16
SHAPE = (NUM_BLOCKS, LAYOUT.num_kv_heads, LAYOUT.block_tokens, 2 * LAYOUT.head_dim)
N = LAYOUT.chunk_bytes // 4  # elements of one chunk


def caches(kind: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    L = LAYOUT.num_layers
    if kind == "layer-major":  # vLLM's allocate_kv_cache: one allocation, one layer stride
        whole = torch.randn((L, *SHAPE), generator=g)
        return [whole[i] for i in range(L)]
    if kind == "block-major":
        whole = torch.randn((NUM_BLOCKS, L, *SHAPE[1:]), generator=g)
        return [whole[:, i] for i in range(L)]
    return [torch.randn(SHAPE, generator=g) for _ in range(L)]


def two_copy(kv: CpuBlocksKV, blocks: range) -> torch.Tensor:
    """The staging path's bytes: one gather_layer per layer into staging rows."""
    staging = LAYOUT.empty_chunks(len(blocks))
    for layer in range(LAYOUT.num_layers):
        kv.gather_layer(layer, blocks, staging[:, layer])
    return staging


# Chunk slots (in chunks) in one arena: a run of 3 adjacent, a run of 2 after a gap, a run of
# 2 at a stride of 2 chunks, one going backwards and the next 9 chunks on, then one going
# backwards again (alone).
SLOTS = [0, 1, 2, 5, 6, 8, 10, 4, 13, 3]


def arena_chunks(extra: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    arena = torch.full((15 * N,), -1.0)
    dsts = [arena[s * N:(s + 1) * N].view(LAYOUT.chunk_shape) for s in SLOTS]
    if extra is not None:
        dsts.insert(4, extra)  # another storage inside the adjacent run 5, 6
    return arena, dsts


def test_runs_are_cut_where_the_stride_or_the_storage_changes() -> None:
    arena, dsts = arena_chunks()
    assert _strided_runs(dsts, N) == [(0, 3, N), (3, 5, N), (5, 7, 2 * N), (7, 9, 9 * N),
                                      (9, 10, N)]
    _arena, dsts = arena_chunks(torch.zeros(LAYOUT.chunk_shape))
    assert _strided_runs(dsts, N) == [(0, 3, N), (3, 4, N), (4, 5, N), (5, 8, 2 * N),
                                      (8, 10, 9 * N), (10, 11, N)]
    shape = LAYOUT.chunk_shape
    strided = torch.zeros((*shape[:-1], 2 * shape[-1]))[..., :shape[-1]]  # not contiguous
    assert not strided.is_contiguous()
    assert _strided_runs([arena[:N], strided, arena[N:2 * N]], N) == [
        (0, 1, N), (1, 2, 0), (2, 3, N)]
    assert _strided_runs([], N) == []


def test_overlapping_chunks_never_share_a_run() -> None:
    arena = torch.zeros(3 * N)
    parts = [arena[0:N], arena[N // 2:N // 2 + N], arena[N:2 * N]]
    assert _strided_runs(parts, N) == [(0, 1, N), (1, 2, N), (2, 3, N)]


@pytest.mark.parametrize("kind", ["layer-major", "block-major", "separate"])
@pytest.mark.parametrize("with_other_storage", [False, True])
def test_gather_over_runs_and_fallbacks_writes_the_two_copy_bytes(
        kind: str, with_other_storage: bool) -> None:
    n_blocks = len(SLOTS) + int(with_other_storage)
    ids = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3))[:n_blocks]
    kv = CpuBlocksKV(caches(kind), ids.tolist(), LAYOUT)
    blocks = range(n_blocks)
    expected = two_copy(kv, blocks)
    other = torch.full(LAYOUT.chunk_shape, -1.0) if with_other_storage else None
    for by_layer in (True, False):
        arena, dsts = arena_chunks(other)
        if other is not None:
            other.fill_(-1.0)
        if by_layer:  # as a step saves: one layer at a time
            for layer in range(LAYOUT.num_layers):
                kv.gather_chunks(range(layer, layer + 1), blocks, dsts)
        else:
            kv.gather_chunks(range(LAYOUT.num_layers), blocks, dsts)
        for i, dst in enumerate(dsts):
            assert torch.equal(dst, expected[i]), (by_layer, i)
        written = torch.zeros_like(arena, dtype=torch.bool)
        for s in SLOTS:
            written[s * N:(s + 1) * N] = True
        assert bool((arena[~written] == -1.0).all())  # nothing outside the extents


@pytest.mark.parametrize("kind", ["layer-major", "separate"])
def test_gather_into_a_chunk_that_is_not_contiguous(kind: str) -> None:
    kv = CpuBlocksKV(caches(kind), [6, 1, 10], LAYOUT)
    expected = two_copy(kv, range(3))
    shape = LAYOUT.chunk_shape
    wide = torch.full((*shape[:-1], 2 * shape[-1]), -1.0)
    arena = torch.full((2 * N,), -1.0)
    dsts = [arena[:N].view(shape), wide[..., :shape[-1]], arena[N:].view(shape)]
    kv.gather_chunks(range(LAYOUT.num_layers), range(3), dsts)
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, expected[i]), i
    assert bool((wide[..., shape[-1]:] == -1.0).all())


def test_gather_writes_only_the_layers_asked_for_across_a_run() -> None:
    kv = CpuBlocksKV(caches("layer-major"), [4, 9, 1, 7], LAYOUT)
    arena = torch.full((4 * N,), -1.0)
    dsts = [arena[i * N:(i + 1) * N].view(LAYOUT.chunk_shape) for i in range(4)]
    kv.gather_chunks(range(1, 2), range(4), dsts)
    expected = two_copy(kv, range(4))
    for i, dst in enumerate(dsts):
        assert torch.equal(dst[1], expected[i][1])
        assert bool((dst[0] == -1.0).all()) and bool((dst[2] == -1.0).all())


class _CopyCalls(TorchFunctionMode):
    """Counts the copying torch calls made under it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("copy_", "index_select", "index_copy_"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["layer-major", "separate"])
def test_a_layer_of_adjacent_chunks_is_one_copy_call(kind: str) -> None:
    kv = CpuBlocksKV(caches(kind), [12, 3, 8, 0, 5, 14, 2, 9], LAYOUT)
    arena = torch.zeros(8 * N)
    dsts = [arena[i * N:(i + 1) * N].view(LAYOUT.chunk_shape) for i in range(8)]
    with _CopyCalls() as counted:
        kv.gather_chunks(range(2, 3), range(8), dsts)
    assert counted.calls == 1
    with _CopyCalls() as counted:
        kv.gather_chunks(range(LAYOUT.num_layers), range(8), dsts)
    # every layer at once where vLLM's layers are one allocation, else one call per layer
    assert counted.calls == (1 if kind == "layer-major" else LAYOUT.num_layers)


def test_round_trip_from_vllms_layout_through_adjacent_chunks() -> None:
    """Save (gather_chunks into adjacent chunks, layer by layer) and load (scatter_chunks into
    other blocks of another cache): the loaded blocks are the saved blocks, byte for byte."""
    src = caches("layer-major")
    dst_whole = torch.zeros((LAYOUT.num_layers, *SHAPE))
    dst = [dst_whole[i] for i in range(LAYOUT.num_layers)]
    src_ids, dst_ids = [5, 0, 11, 7, 3], [2, 9, 4, 15, 6]
    arena = torch.zeros(6 * N)
    chunks = [arena[(i + 1) * N:(i + 2) * N].view(LAYOUT.chunk_shape) for i in range(5)]
    saver = CpuBlocksKV(src, src_ids, LAYOUT)
    for layer in range(LAYOUT.num_layers):
        saver.gather_chunks(range(layer, layer + 1), range(5), chunks)
    CpuBlocksKV(dst, dst_ids, LAYOUT).scatter_chunks(range(LAYOUT.num_layers), range(5), chunks)
    for s, d in zip(src_ids, dst_ids, strict=True):
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(dst[layer][d], src[layer][s])
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
    assert bool((dst_whole[:, untouched] == 0).all())

"""A real transformer prefilling through the tiered cache: reuse skips prefill, outputs stay identical."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.dataplane.dram import DramTier  # noqa: E402
from kvstore.dataplane.nvme.config import NvmeTierConfig  # noqa: E402
from kvstore.dataplane.nvme.tier import NvmeTier  # noqa: E402
from kvstore.dataplane.tier import TierKind  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.engine.reuse import ReuseEngine  # noqa: E402
from kvstore.node.cache import CacheConfig, TieredCache  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

BLOCK = 16
SPEC = tiny_spec()
MiB = 1 << 20


@pytest.fixture(scope="module")
def model() -> object:
    return build_reference_model(SPEC)


def make_engine(model: object, tmp_path: Path, *, dram_chunks: int = 64,
                promote: bool = True) -> ReuseEngine:
    probe = ReuseEngine(model, TieredCache({TierKind.DRAM: DramTier(MiB)}), block_tokens=BLOCK)
    chunk = probe.layout.chunk_bytes
    probe.cache.close()
    tiers = {TierKind.DRAM: DramTier(dram_chunks * chunk),
             TierKind.NVME: NvmeTier.open(NvmeTierConfig(directory=tmp_path / "nvme",
                                                         capacity_bytes=16 * MiB,
                                                         segment_bytes=4 * MiB))}
    return ReuseEngine(model, TieredCache(tiers, config=CacheConfig(promote_on_hit=promote)),
                       block_tokens=BLOCK)


@pytest.fixture
def engine(model: object, tmp_path: Path) -> Iterator[ReuseEngine]:
    eng = make_engine(model, tmp_path)
    yield eng
    eng.cache.close()


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def assert_same_output(engine: ReuseEngine, tokens: list[int], *, expect_reused: int) -> None:
    got = engine.prefill(tokens)
    assert got.reused_tokens == expect_reused
    assert got.computed_tokens == len(tokens) - expect_reused
    out, logits = engine.decode(got, 6)
    ref = engine.prefill(tokens, reuse=False)
    ref_out, ref_logits = engine.decode(ref, 6)
    assert out == ref_out
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefix_len", [3 * BLOCK, 3 * BLOCK + 5, 3 * BLOCK - 1])
def test_shared_prefix_is_reused_and_output_is_identical(engine: ReuseEngine, prefix_len: int) -> None:
    system = prompt(prefix_len, seed=1)
    first = engine.prefill(system + prompt(20, seed=2))
    assert first.reused_tokens == 0
    assert first.saved_blocks == (prefix_len + 20) // BLOCK
    # A second request with the same prefix reuses every full block of it.
    assert_same_output(engine, system + prompt(25, seed=3), expect_reused=(prefix_len // BLOCK) * BLOCK)


def test_a_prompt_that_is_entirely_cached_still_computes_its_last_token(engine: ReuseEngine) -> None:
    tokens = prompt(4 * BLOCK, seed=4)
    engine.prefill(tokens)
    assert_same_output(engine, tokens, expect_reused=3 * BLOCK)


def test_kv_loaded_from_nvme_gives_identical_output(model: object, tmp_path: Path) -> None:
    eng = make_engine(model, tmp_path, dram_chunks=2, promote=False)
    try:
        shared = prompt(6 * BLOCK, seed=5)
        eng.prefill([*shared, 1, 2, 3])
        eng.prefill(prompt(5 * BLOCK, seed=6))  # pushes the first chain down to NVMe
        where = eng.cache.lookup(eng.hasher.hash_blocks(shared))
        assert where.count(TierKind.NVME) >= 4
        assert_same_output(eng, [*shared, 9, 9], expect_reused=6 * BLOCK)
    finally:
        eng.cache.close()


def test_a_corrupt_chunk_degrades_to_recompute_not_to_wrong_output(model: object,
                                                                    tmp_path: Path) -> None:
    eng = make_engine(model, tmp_path, dram_chunks=1, promote=False)
    try:
        shared = prompt(5 * BLOCK, seed=8)
        eng.prefill([*shared, 4])
        keys = eng.hasher.hash_blocks(shared)
        nvme = eng.cache.tier(TierKind.NVME)
        loc = nvme.record_location(keys[2])  # type: ignore[attr-defined]
        assert loc is not None
        with open(loc.path, "r+b") as f:
            f.seek(loc.payload_offset + 64)
            f.write(b"\x7f" * 32)
        assert_same_output(eng, [*shared, 5, 6], expect_reused=2 * BLOCK)
    finally:
        eng.cache.close()

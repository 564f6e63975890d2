"""HbmTier: the tier conformance suite on a real GPU, device-tensor round trips, and the CPU-only refusal.

Everything marked ``gpu`` is skipped by ``tests/conftest.py`` when no CUDA device is present;
nothing here fakes one.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.dataplane.arena import PinMode
from kvstore.dataplane.cuda import cuda_available
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.hbm import HbmTier
from kvstore.dataplane.tier import Tier, TierKind
from kvstore.errors import TierUnavailable

from .tier_conformance import MiB, TierConformance, TierFactory, payload, read_back


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present")
def test_constructing_on_a_cpu_only_machine_raises_tier_unavailable() -> None:
    with pytest.raises(TierUnavailable, match="no CUDA device"):
        HbmTier(MiB)


@pytest.mark.gpu
class TestHbmTierConformance(TierConformance):
    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        tiers: list[HbmTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = HbmTier(capacity_bytes)
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            tier.close()


@pytest.fixture
def hbm() -> Iterator[HbmTier]:
    tier = HbmTier(64 * MiB, staging_bytes=MiB)
    yield tier
    tier.close()


@pytest.mark.gpu
def test_device_tensor_round_trip(hbm: HbmTier) -> None:
    import torch

    src = torch.randn(256, 1024, dtype=torch.float16, device="cuda")
    info = hbm.put(b"dev", src)
    assert info.size_bytes == src.numel() * 2 and info.tier is TierKind.HBM
    dst = torch.empty_like(src)
    assert hbm.get_into(b"dev", dst) == info.size_bytes
    assert torch.equal(src, dst)
    assert hbm.transfer_counts().device == 2
    # The same chunk read into host memory holds the same bytes.
    host = np.empty(src.numel(), dtype=np.float16)
    hbm.get_into(b"dev", host)
    assert host.tobytes() == src.cpu().numpy().tobytes()


@pytest.mark.gpu
def test_put_waits_for_kernels_queued_on_the_callers_stream(hbm: HbmTier) -> None:
    import torch

    base = torch.randn(8 * MiB // 4, device="cuda")
    produced = (base * 3 + 1).sin()  # queued on the current stream; put must see its result
    hbm.put(b"k", produced)
    expected = produced.cpu()
    out = torch.empty(expected.numel(), dtype=torch.float32, device="cuda")
    hbm.get_into(b"k", out)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.gpu
def test_pageable_host_memory_goes_through_staging_in_pieces(hbm: HbmTier) -> None:
    data = payload(5 * MiB + 3, seed=21)  # 6 pieces of the 1 MiB staging buffer
    hbm.put(b"big", data)
    assert read_back(hbm, b"big") == data
    counts = hbm.transfer_counts()
    assert counts.staged == 2 and counts.pinned == 0


@pytest.mark.gpu
def test_pinned_dram_arena_is_copied_directly() -> None:
    dram = DramTier(16 * MiB, pin=PinMode.REQUIRE)
    hbm = HbmTier(16 * MiB, staging_bytes=MiB)
    try:
        assert dram.pinned
        data = payload(3 * MiB, seed=22)
        dram.put(b"k", data)
        hbm.put(b"k", dram.view(b"k"))  # promotion DRAM -> HBM
        slot = dram.reserve(b"k2", 3 * MiB)
        try:
            hbm.get_into(b"k", slot.buffer)  # demotion HBM -> DRAM, straight into the arena
        except BaseException:
            dram.abort(slot)
            raise
        dram.commit(slot)
        assert read_back(dram, b"k2") == data
        assert hbm.transfer_counts().pinned == 2
        assert hbm.transfer_counts().staged == 0
    finally:
        hbm.close()
        dram.close()


@pytest.mark.gpu
def test_pinned_cpu_tensor_is_copied_directly(hbm: HbmTier) -> None:
    import torch

    src = torch.arange(MiB, dtype=torch.int32).pin_memory()
    hbm.put(b"p", src)
    dst = torch.empty_like(src).pin_memory()
    hbm.get_into(b"p", dst)
    assert torch.equal(src, dst)
    assert hbm.transfer_counts().pinned == 2


@pytest.mark.gpu
def test_non_contiguous_device_destination_is_rejected(hbm: HbmTier) -> None:
    import torch

    from kvstore.errors import InvalidArgument

    hbm.put(b"k", torch.zeros(64, 64, dtype=torch.float16, device="cuda"))
    dst = torch.empty(64, 128, dtype=torch.float16, device="cuda")[:, ::2]
    with pytest.raises(InvalidArgument):
        hbm.get_into(b"k", dst)

"""The conformance suite every :class:`kvstore.dataplane.tier.Tier` implementation runs.

Use it by subclassing in a ``test_*.py`` module and providing a ``make_tier`` fixture::

    class TestDramTier(TierConformance):
        @pytest.fixture
        def make_tier(self, tmp_path):
            tiers = []
            def factory(capacity_bytes: int) -> Tier:
                tier = DramTier(capacity_bytes=capacity_bytes)
                tiers.append(tier)
                return tier
            yield factory
            for t in tiers:
                t.close()

Host-memory tiers subclass :class:`HostMemoryTierConformance` instead, which adds the zero-copy
``view`` and the ``reserve``/``commit``/``abort`` contract. The suite is written against the contract
in ``kvstore/dataplane/tier.py``; when it and an implementation disagree, the contract wins.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest

from kvstore.dataplane.tier import ChunkInfo, HostMemoryTier, Tier, TierStats
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    SizeMismatch,
    TierUnavailable,
)
from tests.support.common import payload

MiB = 1 << 20
KiB = 1 << 10

TierFactory = Callable[[int], Tier]




def read_back(tier: Tier, key: bytes) -> bytes:
    size = tier.size_of(key)
    assert size is not None, f"{key!r} should be stored"
    dst = bytearray(size)
    assert tier.get_into(key, dst) == size
    return bytes(dst)


class TierConformance:
    """Contract tests for any Tier. Subclasses provide the ``make_tier`` fixture."""

    @pytest.fixture
    def make_tier(self) -> TierFactory:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def tier(self, make_tier: TierFactory) -> Tier:
        return make_tier(8 * MiB)

    # --- round trips -------------------------------------------------------------------------

    @pytest.mark.parametrize("size_bytes", [1, 4095, 4 * KiB, 64 * KiB + 7, MiB + 3])
    def test_put_then_get_into_returns_the_same_bytes(self, tier: Tier, size_bytes: int) -> None:
        data = payload(size_bytes, seed=size_bytes)
        info = tier.put(b"k", data)
        assert isinstance(info, ChunkInfo)
        assert info.size_bytes == size_bytes
        assert info.tier == tier.kind
        assert read_back(tier, b"k") == data

    def test_accepts_every_host_buffer_type(self, tier: Tier) -> None:
        data = payload(10_000, seed=1)
        arr = np.frombuffer(data, dtype=np.uint8).copy()
        sources: dict[bytes, object] = {
            b"bytes": data,
            b"bytearray": bytearray(data),
            b"memoryview": memoryview(data),
            b"numpy": arr,
            b"numpy-f16": arr.view(np.float16),
        }
        for key, src in sources.items():
            tier.put(key, src)
            assert read_back(tier, key) == data, key
        dst = np.zeros(10_000, dtype=np.uint8)
        tier.get_into(b"numpy", dst)
        assert dst.tobytes() == data

    def test_accepts_cpu_torch_tensors(self, tier: Tier) -> None:
        torch = pytest.importorskip("torch")
        src = torch.arange(4096, dtype=torch.float16)
        tier.put(b"t", src)
        dst = torch.empty_like(src)
        tier.get_into(b"t", dst)
        assert torch.equal(src, dst)

    def test_put_copies_out_of_the_callers_buffer(self, tier: Tier) -> None:
        src = bytearray(payload(4096, seed=2))
        expected = bytes(src)
        tier.put(b"k", src)
        src[:] = b"\x00" * len(src)
        assert read_back(tier, b"k") == expected

    # --- misses and bad input --------------------------------------------------------------

    def test_a_miss_is_not_an_error(self, tier: Tier) -> None:
        assert tier.contains(b"absent") is False
        assert tier.size_of(b"absent") is None
        assert tier.remove(b"absent") is False

    def test_get_into_unknown_key_raises_chunk_not_found(self, tier: Tier) -> None:
        with pytest.raises(ChunkNotFound):
            tier.get_into(b"absent", bytearray(16))

    @pytest.mark.parametrize("dst_size", [0, 4095, 4097])
    def test_get_into_wrong_size_raises_and_keeps_the_chunk(self, tier: Tier, dst_size: int) -> None:
        data = payload(4096, seed=3)
        tier.put(b"k", data)
        with pytest.raises(SizeMismatch):
            tier.get_into(b"k", bytearray(dst_size))
        assert read_back(tier, b"k") == data

    def test_chunks_are_immutable(self, tier: Tier) -> None:
        first = payload(4096, seed=4)
        tier.put(b"k", first)
        with pytest.raises(ChunkExists):
            tier.put(b"k", payload(4096, seed=5))
        assert read_back(tier, b"k") == first

    @pytest.mark.parametrize("key", [b"", b"x" * 65])
    def test_bad_keys_are_rejected(self, tier: Tier, key: bytes) -> None:
        with pytest.raises(InvalidArgument):
            tier.put(key, b"data")

    def test_non_bytes_key_is_rejected(self, tier: Tier) -> None:
        with pytest.raises(InvalidArgument):
            tier.put("text-key", b"data")  # type: ignore[arg-type]

    def test_empty_value_is_rejected(self, tier: Tier) -> None:
        with pytest.raises(InvalidArgument):
            tier.put(b"k", b"")
        assert not tier.contains(b"k")

    # --- capacity -----------------------------------------------------------------------------

    def test_capacity_error_when_full_and_nothing_is_lost(self, make_tier: TierFactory) -> None:
        tier = make_tier(MiB)
        stored: dict[bytes, bytes] = {}
        with pytest.raises(CapacityError):
            for i in range(1000):
                key = f"c{i}".encode()
                data = payload(64 * KiB, seed=i)
                tier.put(key, data)
                stored[key] = data
        # At most a few chunks' worth of overhead: a 1 MiB tier holds at least 14 of 64 KiB.
        assert len(stored) >= 14
        for key, data in stored.items():
            assert read_back(tier, key) == data
        # Removing one makes room again.
        victim = next(iter(stored))
        assert tier.remove(victim) is True
        tier.put(b"again", payload(64 * KiB, seed=999))
        assert read_back(tier, b"again") == payload(64 * KiB, seed=999)

    def test_a_chunk_larger_than_the_tier_is_a_capacity_error(self, make_tier: TierFactory) -> None:
        tier = make_tier(MiB)
        with pytest.raises(CapacityError):
            tier.put(b"huge", payload(2 * MiB, seed=6))
        assert not tier.contains(b"huge")

    def test_stats_track_usage(self, tier: Tier) -> None:
        before = tier.stats()
        assert isinstance(before, TierStats)
        assert before.kind == tier.kind
        assert before.chunks == 0
        tier.put(b"a", payload(100 * KiB, seed=7))
        tier.put(b"b", payload(50 * KiB, seed=8))
        mid = tier.stats()
        assert mid.chunks == 2
        assert mid.used_bytes >= 150 * KiB
        assert mid.used_bytes <= mid.capacity_bytes
        tier.remove(b"a")
        after = tier.stats()
        assert after.chunks == 1
        assert after.used_bytes < mid.used_bytes

    def test_remove_frees_space_for_reuse_many_times(self, make_tier: TierFactory) -> None:
        tier = make_tier(MiB)
        for i in range(200):  # far more than fits at once: space must really be freed
            key = f"r{i}".encode()
            tier.put(key, payload(256 * KiB, seed=i))
            assert tier.remove(key)
        assert tier.stats().chunks == 0

    # --- listing, lifecycle, threads ----------------------------------------------------------

    def test_chunks_lists_committed_chunks(self, tier: Tier) -> None:
        tier.put(b"a", b"1" * 10)
        tier.put(b"b", b"2" * 20)
        listed = {info.key: info.size_bytes for info in tier.chunks()}
        assert listed == {b"a": 10, b"b": 20}

    def test_close_is_idempotent_and_later_calls_fail_clearly(self, make_tier: TierFactory) -> None:
        tier = make_tier(MiB)
        tier.put(b"k", b"v" * 100)
        tier.close()
        tier.close()
        with pytest.raises(TierUnavailable):
            tier.put(b"k2", b"v")
        with pytest.raises(TierUnavailable):
            tier.get_into(b"k", bytearray(100))

    def test_concurrent_puts_and_gets_from_many_threads(self, tier: Tier) -> None:
        errors: list[BaseException] = []

        def worker(t: int) -> None:
            try:
                for i in range(20):
                    key = f"t{t}-{i}".encode()
                    data = payload(16 * KiB + i, seed=t * 100 + i)
                    tier.put(key, data)
                    assert read_back(tier, key) == data
            except BaseException as exc:  # collected and re-raised in the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert tier.stats().chunks == 80


class HostMemoryTierConformance(TierConformance):
    """Adds the zero-copy view and reserve/commit/abort contract of host-memory tiers."""

    @pytest.fixture
    def tier(self, make_tier: TierFactory) -> HostMemoryTier:
        tier = make_tier(8 * MiB)
        assert isinstance(tier, HostMemoryTier)
        return tier

    def test_view_is_a_read_only_zero_copy_view(self, tier: HostMemoryTier) -> None:
        data = payload(8192, seed=10)
        tier.put(b"k", data)
        view = tier.view(b"k")
        assert isinstance(view, memoryview)
        assert view.readonly
        assert view.nbytes == 8192
        assert bytes(view) == data
        # Zero-copy: two views of the same chunk share memory.
        a = np.frombuffer(view, dtype=np.uint8)
        b = np.frombuffer(tier.view(b"k"), dtype=np.uint8)
        assert np.shares_memory(a, b)

    def test_view_of_unknown_key_raises(self, tier: HostMemoryTier) -> None:
        with pytest.raises(ChunkNotFound):
            tier.view(b"absent")

    def test_reserved_chunk_is_invisible_until_commit(self, tier: HostMemoryTier) -> None:
        data = payload(4096, seed=11)
        slot = tier.reserve(b"k", 4096)
        assert slot.size_bytes == 4096
        assert slot.key == b"k"
        assert not slot.buffer.readonly and slot.buffer.nbytes == 4096
        slot.buffer[:] = data
        assert not tier.contains(b"k")
        with pytest.raises(ChunkNotFound):
            tier.get_into(b"k", bytearray(4096))
        info = tier.commit(slot)
        assert info.size_bytes == 4096
        assert read_back(tier, b"k") == data

    def test_abort_frees_the_slot_and_is_idempotent(self, make_tier: TierFactory) -> None:
        tier = make_tier(MiB)
        assert isinstance(tier, HostMemoryTier)
        for _ in range(50):  # would exhaust 1 MiB if abort leaked
            slot = tier.reserve(b"k", 256 * KiB)
            tier.abort(slot)
            tier.abort(slot)
        assert not tier.contains(b"k")
        assert tier.stats().used_bytes == 0

    def test_commit_twice_or_after_abort_is_rejected(self, tier: HostMemoryTier) -> None:
        slot = tier.reserve(b"a", 100)
        tier.commit(slot)
        with pytest.raises(InvalidArgument):
            tier.commit(slot)
        slot2 = tier.reserve(b"b", 100)
        tier.abort(slot2)
        with pytest.raises(InvalidArgument):
            tier.commit(slot2)
        assert not tier.contains(b"b")

    def test_reserving_a_committed_key_raises_exists(self, tier: HostMemoryTier) -> None:
        tier.put(b"k", b"v" * 10)
        with pytest.raises(ChunkExists):
            tier.reserve(b"k", 10)

    def test_reserving_a_key_with_a_pending_slot_raises_busy(self, tier: HostMemoryTier) -> None:
        slot = tier.reserve(b"k", 10)
        with pytest.raises(ChunkBusy):
            tier.reserve(b"k", 10)
        tier.abort(slot)
        tier.reserve(b"k", 10)  # free again after the abort

    def test_reserve_beyond_capacity_raises(self, make_tier: TierFactory) -> None:
        tier = make_tier(MiB)
        assert isinstance(tier, HostMemoryTier)
        with pytest.raises(CapacityError):
            tier.reserve(b"k", 2 * MiB)

    def test_uncommitted_slot_does_not_show_in_listing(self, tier: HostMemoryTier) -> None:
        slot = tier.reserve(b"pending", 64)
        tier.put(b"done", b"x" * 64)
        assert [info.key for info in tier.chunks()] == [b"done"]
        tier.abort(slot)


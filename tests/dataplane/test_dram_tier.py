"""DramTier: the host-memory conformance suite, plus what is specific to the shared-memory arena."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.dataplane.arena import ArenaAccess, PinMode, ShmArena
from kvstore.dataplane.compress import CodecKind, CodecSpec
from kvstore.dataplane.cuda import cuda_available
from kvstore.dataplane.dram import DramSlot, DramTier
from kvstore.dataplane.tier import HostMemoryTier, Tier
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkCorrupt,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    TierUnavailable,
)

from .tier_conformance import HostMemoryTierConformance, KiB, MiB, TierFactory, payload, read_back


class TestDramTierConformance(HostMemoryTierConformance):
    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        tiers: list[DramTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = DramTier(capacity_bytes)
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            tier.close()


class TestCompressedDramTierConformance(HostMemoryTierConformance):
    """The same contract with zstd + byte shuffle on (payloads are random: stored raw)."""

    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        tiers: list[DramTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = DramTier(capacity_bytes, codec=CodecSpec(CodecKind.ZSTD, shuffle_bytes=2))
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            tier.close()


@pytest.fixture
def tier() -> Iterator[DramTier]:
    t = DramTier(8 * MiB)
    yield t
    t.close()


def fp16_like(size_bytes: int, seed: int) -> bytes:
    """Compressible-after-shuffle bytes: fp16 with a narrow exponent range, like KV values."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(size_bytes // 2).astype(np.float16).tobytes()


def test_is_a_host_memory_tier(tier: DramTier) -> None:
    assert isinstance(tier, HostMemoryTier)


def test_arena_lives_in_dev_shm_and_is_unlinked_on_close() -> None:
    t = DramTier(MiB)
    path = f"/dev/shm/{t.arena_name}"
    assert os.path.exists(path)
    assert os.path.getsize(path) == MiB
    t.close()
    assert not os.path.exists(path)


def test_chunks_are_page_aligned_and_located(tier: DramTier) -> None:
    tier.put(b"a", payload(100, seed=1))
    tier.put(b"b", payload(5000, seed=2))
    loc_a, loc_b = tier.locate(b"a"), tier.locate(b"b")
    assert loc_a is not None and loc_b is not None
    assert loc_a.offset % 4096 == 0 and loc_b.offset % 4096 == 0
    assert (loc_a.size_bytes, loc_b.size_bytes) == (100, 5000)
    assert loc_a.codec is CodecKind.NONE and loc_a.stored_bytes == 100
    assert tier.locate(b"absent") is None
    # Two chunks never share a 4 KiB page.
    assert abs(loc_a.offset - loc_b.offset) >= 4096


def test_another_process_reads_a_chunk_through_the_arena(tier: DramTier) -> None:
    data = payload(3 * MiB + 5, seed=3)
    tier.put(b"shared", data)
    loc = tier.locate(b"shared")
    assert loc is not None
    code = (
        "import sys, hashlib\n"
        "from kvstore.dataplane.arena import ShmArena\n"
        f"a = ShmArena.attach({tier.arena_name!r})\n"
        f"v = a.view({loc.offset}, {loc.size_bytes})\n"
        "sys.stdout.write(hashlib.sha256(v).hexdigest())\n"
        "v.release(); a.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    import hashlib

    assert out.stdout == hashlib.sha256(data).hexdigest()
    assert os.path.exists(f"/dev/shm/{tier.arena_name}")  # an attacher never unlinks


def test_read_only_attach_cannot_write(tier: DramTier) -> None:
    tier.put(b"k", b"x" * 4096)
    arena = ShmArena.attach(tier.arena_name)
    try:
        assert arena.access is ArenaAccess.READ_ONLY
        view = arena.view(0, 4096)
        assert view.readonly
        with pytest.raises(InvalidArgument):
            arena.view(0, 4096, readonly=False)
        with pytest.raises(TypeError):
            view[0] = 1  # type: ignore[index]
        view.release()
    finally:
        arena.close()


def test_get_into_numpy_and_torch_of_other_dtypes(tier: DramTier) -> None:
    torch = pytest.importorskip("torch")
    src = torch.randn(64, 128, dtype=torch.bfloat16)
    tier.put(b"bf16", src)
    assert tier.size_of(b"bf16") == 64 * 128 * 2
    dst = torch.empty(64, 128, dtype=torch.bfloat16)
    tier.get_into(b"bf16", dst)
    assert torch.equal(src, dst)
    as_f16 = np.empty(64 * 128, dtype=np.float16)
    tier.get_into(b"bf16", as_f16)
    assert as_f16.tobytes() == src.view(torch.uint8).numpy().tobytes()


def test_non_contiguous_source_is_copied_but_destination_is_rejected(tier: DramTier) -> None:
    base = np.arange(2048, dtype=np.uint16).reshape(32, 64)
    src = base[:, ::2]  # non-contiguous
    tier.put(b"nc", src)
    assert read_back(tier, b"nc") == np.ascontiguousarray(src).tobytes()
    dst = np.empty((32, 64), dtype=np.uint16)[:, ::2]
    with pytest.raises(InvalidArgument):
        tier.get_into(b"nc", dst)


def test_read_only_destination_is_rejected(tier: DramTier) -> None:
    tier.put(b"k", b"v" * 10)
    with pytest.raises(InvalidArgument):
        tier.get_into(b"k", b"\x00" * 10)


def test_cuda_tensor_or_garbage_source_is_rejected(tier: DramTier) -> None:
    with pytest.raises(InvalidArgument):
        tier.put(b"k", 12345)
    assert not tier.contains(b"k")


def test_concurrent_put_of_the_same_key_stores_one_copy(tier: DramTier) -> None:
    big = [payload(2 * MiB, seed=s) for s in range(4)]
    outcomes: list[str] = []
    lock = threading.Lock()

    def writer(i: int) -> None:
        try:
            tier.put(b"same", big[i])
            result = f"ok{i}"
        except (ChunkBusy, ChunkExists) as exc:
            result = type(exc).__name__
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [o for o in outcomes if o.startswith("ok")]
    assert len(winners) == 1, outcomes
    assert set(outcomes) - set(winners) <= {"ChunkBusy", "ChunkExists"}
    assert read_back(tier, b"same") == big[int(winners[0][2:])]
    assert tier.stats().used_bytes == 2 * MiB


def test_remove_during_get_into_defers_the_free(tier: DramTier) -> None:
    data = payload(4 * MiB, seed=5)
    tier.put(b"k", data)
    extent = tier._table.acquire(tier._table.get(b"k").key)  # type: ignore[union-attr]
    # A copy "in flight": removing hides the key but keeps the space.
    assert tier.remove(b"k") is True
    assert not tier.contains(b"k")
    assert tier.stats().used_bytes == 4 * MiB
    with pytest.raises(ChunkNotFound):
        tier.get_into(b"k", bytearray(4 * MiB))
    tier._table.release(extent)
    assert tier.stats().used_bytes == 0


def test_view_stays_readable_after_close() -> None:
    t = DramTier(MiB)
    t.put(b"k", b"q" * 5000)
    view = t.view(b"k")
    t.close()
    # The mapping is kept alive by the view (never a dangling pointer); the name is gone.
    assert bytes(view[:3]) == b"qqq"
    assert not os.path.exists(f"/dev/shm/{t.arena_name}")
    view.release()


def test_slot_buffer_is_revoked_after_commit(tier: DramTier) -> None:
    slot = tier.reserve(b"k", 16)
    buffer = slot.buffer
    buffer[:] = b"0123456789abcdef"
    tier.commit(slot)
    with pytest.raises(ValueError):
        buffer[0] = 0
    assert read_back(tier, b"k") == b"0123456789abcdef"


def test_slot_from_another_tier_is_rejected(tier: DramTier) -> None:
    other = DramTier(MiB)
    try:
        slot = other.reserve(b"k", 10)
        with pytest.raises(InvalidArgument):
            tier.commit(slot)
        other.abort(slot)
    finally:
        other.close()


# --- compression -------------------------------------------------------------------------------


@pytest.fixture
def zstd_tier() -> Iterator[DramTier]:
    t = DramTier(8 * MiB, codec=CodecSpec(CodecKind.ZSTD, level=1, shuffle_bytes=2))
    yield t
    t.close()


def test_compressible_chunk_is_stored_smaller_and_reads_back(zstd_tier: DramTier) -> None:
    data = fp16_like(MiB, seed=7)
    info = zstd_tier.put(b"kv", data)
    assert info.size_bytes == MiB
    assert zstd_tier.size_of(b"kv") == MiB
    loc = zstd_tier.locate(b"kv")
    assert loc is not None and loc.codec is CodecKind.ZSTD
    assert loc.stored_bytes < 0.95 * MiB
    assert zstd_tier.stats().used_bytes < MiB
    assert read_back(zstd_tier, b"kv") == data
    assert zstd_tier.is_zero_copy(b"kv") is False
    view = zstd_tier.view(b"kv")
    assert view.readonly and bytes(view) == data


def test_incompressible_chunk_is_stored_raw(zstd_tier: DramTier) -> None:
    zstd_tier.put(b"rnd", payload(MiB, seed=8))
    loc = zstd_tier.locate(b"rnd")
    assert loc is not None and loc.codec is CodecKind.NONE and loc.stored_bytes == MiB
    assert zstd_tier.is_zero_copy(b"rnd") is True


def test_commit_compresses_a_reserved_slot(zstd_tier: DramTier) -> None:
    data = fp16_like(2 * MiB, seed=9)
    slot = zstd_tier.reserve(b"s", len(data))
    slot.buffer[:] = data
    zstd_tier.commit(slot)
    loc = zstd_tier.locate(b"s")
    assert loc is not None and loc.codec is CodecKind.ZSTD
    assert zstd_tier.stats().used_bytes < 2 * MiB  # the raw slot was freed
    assert read_back(zstd_tier, b"s") == data
    zstd_tier._table.allocator.check_invariants()


def test_corrupt_compressed_chunk_is_dropped_and_raises(zstd_tier: DramTier) -> None:
    data = fp16_like(256 * KiB, seed=10)
    zstd_tier.put(b"kv", data)
    loc = zstd_tier.locate(b"kv")
    assert loc is not None and loc.codec is CodecKind.ZSTD
    # Flip bytes in the middle of the stored frame, through a second (writable) mapping.
    arena = ShmArena.attach(zstd_tier.arena_name, access=ArenaAccess.READ_WRITE)
    try:
        raw = arena.array(loc.offset + loc.stored_bytes // 2, 16)
        raw ^= 0xFF
        del raw
    finally:
        arena.close()
    with pytest.raises(ChunkCorrupt):
        zstd_tier.get_into(b"kv", bytearray(256 * KiB))
    assert not zstd_tier.contains(b"kv")
    assert zstd_tier.stats().used_bytes == 0


# --- pinning ---------------------------------------------------------------------------------------


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present")
def test_without_a_gpu_the_arena_is_not_pinned_and_require_fails() -> None:
    with DramTier(MiB) as t:
        assert t.pinned is False
    with pytest.raises(TierUnavailable):
        DramTier(MiB, pin=PinMode.REQUIRE)


@pytest.mark.gpu
def test_with_a_gpu_the_arena_is_pinned_by_default() -> None:
    with DramTier(MiB) as t:
        assert t.pinned is True
        t.put(b"k", payload(4096, seed=1))
        assert read_back(t, b"k") == payload(4096, seed=1)


# --- batches: reserve_many / commit_many (one table lock round each) -----------------------


@pytest.fixture(params=["raw", "zstd"])
def batch_tier(request: pytest.FixtureRequest) -> Iterator[DramTier]:
    """The batch paths with and without compression (compressed commits go slot by slot)."""
    codec = CodecSpec(CodecKind.ZSTD, shuffle_bytes=2) if request.param == "zstd" else None
    t = DramTier(1 * MiB, codec=codec, read_index_slots=64)
    yield t
    t.close()


def test_reserve_many_gives_each_item_its_own_outcome(batch_tier: DramTier) -> None:
    batch_tier.put(b"b-stored", payload(4 * KiB, seed=1))
    out = batch_tier.reserve_many(
        [b"b-0", b"b-stored", b"b-1", b"b-1", b"", b"b-2", b"b-huge", b"b-3"],
        [8 * KiB, 4 * KiB, 8 * KiB, 8 * KiB, 8 * KiB, 0, 4 * MiB, 8 * KiB])
    assert isinstance(out[1], ChunkExists)
    assert isinstance(out[3], ChunkBusy)  # the same key twice: the second is being written
    assert isinstance(out[4], InvalidArgument) and isinstance(out[5], InvalidArgument)
    assert isinstance(out[6], CapacityError)
    slots = [out[0], out[2], out[7]]
    assert all(isinstance(s, DramSlot) for s in slots)
    assert not batch_tier.contains(b"b-0")  # invisible until committed
    for i, slot in enumerate(slots):
        slot.buffer[:] = payload(8 * KiB, seed=10 + i)  # type: ignore[union-attr]
    infos = batch_tier.commit_many(slots)  # type: ignore[arg-type]
    assert [i.key for i in infos] == [b"b-0", b"b-1", b"b-3"]  # type: ignore[union-attr]
    for i, key in enumerate([b"b-0", b"b-1", b"b-3"]):
        assert read_back(batch_tier, key) == payload(8 * KiB, seed=10 + i)
    with pytest.raises(InvalidArgument):
        batch_tier.reserve_many([b"b-4"], [])


def test_commit_many_fails_finished_and_foreign_slots_only(batch_tier: DramTier) -> None:
    other = DramTier(1 * MiB)
    try:
        a, b, c = batch_tier.reserve_many([b"c-a", b"c-b", b"c-c"], [4 * KiB] * 3)
        foreign = other.reserve(b"c-f", 4 * KiB)
        batch_tier.abort(b)  # type: ignore[arg-type]
        for s in (a, c):
            s.buffer[:] = payload(4 * KiB, seed=3)  # type: ignore[union-attr]
        out = batch_tier.commit_many([a, b, foreign, c])  # type: ignore[list-item]
        assert isinstance(out[1], InvalidArgument) and isinstance(out[2], InvalidArgument)
        assert batch_tier.contains(b"c-a") and batch_tier.contains(b"c-c")
        assert not batch_tier.contains(b"c-b") and not other.contains(b"c-f")
        again = batch_tier.commit_many([a])  # type: ignore[list-item]
        assert isinstance(again[0], InvalidArgument)  # committed already: unchanged
        other.abort(foreign)
    finally:
        other.close()


def test_commit_many_never_publishes_a_child_whose_parent_failed(batch_tier: DramTier) -> None:
    """``after``: a slot is committed only after the earlier slot it names; one whose parent
    failed stays pending (not readable, not in the read index) for the caller to abort."""
    p, c, g, r = batch_tier.reserve_many([b"a-p", b"a-c", b"a-g", b"a-r"], [4 * KiB] * 4)
    batch_tier.abort(p)  # type: ignore[arg-type]
    out = batch_tier.commit_many([p, c, g, r], [-1, 0, 1, -1])  # type: ignore[list-item]
    assert all(isinstance(o, InvalidArgument) for o in out[:3])
    assert not isinstance(out[3], Exception)
    index = batch_tier.read_index
    for key in (b"a-p", b"a-c", b"a-g"):
        assert not batch_tier.contains(key)
        assert index is None or index.location(key) is None
    for slot in (c, g):
        batch_tier.abort(slot)  # type: ignore[arg-type]
    assert batch_tier.stats().used_bytes == 4 * KiB  # only a-r holds space
    with pytest.raises(InvalidArgument):
        batch_tier.commit_many([r], [])  # type: ignore[list-item]


def test_a_batch_commit_publishes_in_the_read_index() -> None:
    t = DramTier(1 * MiB, read_index_slots=64)
    try:
        slots = t.reserve_many([b"ri-0", b"ri-1"], [8 * KiB, 12 * KiB])
        t.commit_many(slots)  # type: ignore[arg-type]
        index = t.read_index
        assert index is not None
        for key, size in ((b"ri-0", 8 * KiB), (b"ri-1", 12 * KiB)):
            loc = t.locate(key)
            assert loc is not None and index.location(key) == (loc.offset, size)
    finally:
        t.close()

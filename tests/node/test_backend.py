"""The daemon's lease backend and same-host leases over a real tiered cache (shared-memory DRAM,
NVMe files), plus the cache's zero-copy additions they rest on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.dataplane.arena import ArenaAccess, ShmArena
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.base import LeaseBackend
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    SizeMismatch,
)
from kvstore.node.backend import CacheLeaseBackend, ParentHints, ShmLeases
from kvstore.node.cache import ChunkChange, ChunkChangeKind, TieredCache
from tests.dataplane.lease_backend_conformance import LeaseBackendConformance

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


def data(i: int, size: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def make_cache(tmp: Path, dram_bytes: int, *, observer: object = None) -> TieredCache:
    nvme = NvmeTier.open(NvmeTierConfig(directory=tmp / "nvme", capacity_bytes=8 * MiB,
                                        segment_bytes=MiB))
    return TieredCache({TierKind.DRAM: DramTier(dram_bytes), TierKind.NVME: nvme},
                       observer=observer)  # type: ignore[arg-type]


class TestCacheLeaseBackend(LeaseBackendConformance):
    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[LeaseBackend]:
        cache = make_cache(tmp_path, 24 * MiB)
        yield CacheLeaseBackend(cache)
        cache.close()


@pytest.fixture
def changes() -> list[ChunkChange]:
    return []


@pytest.fixture
def small(tmp_path: Path, changes: list[ChunkChange]) -> Iterator[TieredCache]:
    """DRAM for 4 chunks over NVMe: puts beyond that demote the oldest."""
    cache = make_cache(tmp_path, 4 * CHUNK, observer=changes.append)
    yield cache
    cache.close()


def test_read_of_a_chunk_in_nvme_promotes_it_and_serves_the_arena(small: TieredCache) -> None:
    for i in range(6):
        small.put(b"k%d" % i, data(i), parent=b"k%d" % (i - 1) if i else None)
    assert small.entry(b"k0").tier is TierKind.NVME  # type: ignore[union-attr]
    backend = CacheLeaseBackend(small)
    lease = backend.open_read(b"k0")
    try:
        assert bytes(lease.view) == data(0)
        assert small.entry(b"k0").tier is TierKind.DRAM  # type: ignore[union-attr]
        with pytest.raises(ChunkBusy):
            backend.remove(b"k0")
    finally:
        lease.release()


def test_read_falls_back_to_a_private_copy_when_dram_cannot_take_it(small: TieredCache) -> None:
    for i in range(6):
        small.put(b"k%d" % i, data(i), parent=b"k%d" % (i - 1) if i else None)
    held = small.pin([b"k2", b"k3", b"k4", b"k5"])  # everything in DRAM is pinned
    backend = CacheLeaseBackend(small)
    lease = backend.open_read(b"k0")
    try:
        assert bytes(lease.view) == data(0)
        assert small.entry(b"k0").tier is TierKind.NVME  # type: ignore[union-attr]
    finally:
        lease.release()
        small.unpin(held)


def _dram_counters(cache: TieredCache) -> tuple[int, int]:
    report = next(r for r in cache.report() if r.kind is TierKind.DRAM)
    return report.counters.hits, report.counters.bytes_read


def test_read_into_counts_a_dram_hit_refreshes_recency_and_pins_nothing(small: TieredCache
                                                                        ) -> None:
    small.put(b"a", data(1))
    small.put(b"b", data(2))
    backend = CacheLeaseBackend(small)
    before = small.entry(b"a")
    hits, nbytes = _dram_counters(small)
    dst = bytearray(CHUNK)
    assert backend.read_into(b"a", memoryview(dst)) == CHUNK
    assert dst == data(1)
    after = small.entry(b"a")
    assert before is not None and after is not None
    assert after.access_count == before.access_count + 1
    assert _dram_counters(small) == (hits + 1, nbytes + CHUNK)
    assert after.pinned is False
    assert small.remove(b"a") == [b"a"]  # no lease outlives the copy: never ChunkBusy


def test_read_into_of_a_chunk_in_nvme_promotes_it(small: TieredCache) -> None:
    for i in range(6):
        small.put(b"k%d" % i, data(i), parent=b"k%d" % (i - 1) if i else None)
    assert small.entry(b"k0").tier is TierKind.NVME  # type: ignore[union-attr]
    backend = CacheLeaseBackend(small)
    dst = bytearray(CHUNK)
    assert backend.read_into(b"k0", memoryview(dst)) == CHUNK
    assert dst == data(0)
    assert small.entry(b"k0").tier is TierKind.DRAM  # type: ignore[union-attr]
    wrong = bytearray(b"\xee" * 10)
    with pytest.raises(SizeMismatch):
        backend.read_into(b"k1", memoryview(wrong))
    assert wrong == b"\xee" * 10
    with pytest.raises(ChunkNotFound):
        backend.read_into(b"missing", memoryview(dst))


def test_tcp_put_takes_an_announced_parent(small: TieredCache) -> None:
    small.put(b"root", data(0))
    backend = CacheLeaseBackend(small)
    backend.parents.expect(b"child", b"root", ttl_s=10)
    lease = backend.open_write(b"child", CHUNK)
    lease.buffer[:] = data(1)
    lease.commit()
    assert small.entry(b"child").parent == b"root"  # type: ignore[union-attr]
    assert len(backend.parents) == 0
    lease = backend.open_write(b"orphan", 10)  # no hint: a root
    lease.buffer[:] = b"x" * 10
    lease.commit()
    assert small.entry(b"orphan").parent is None  # type: ignore[union-attr]


def test_expired_parent_hint_is_ignored() -> None:
    hints = ParentHints()
    hints.expect(b"a", b"p", ttl_s=0.01)
    time.sleep(0.03)
    assert hints.take(b"a") is None


def test_changes_are_observed_in_order(small: TieredCache, changes: list[ChunkChange]) -> None:
    for i in range(5):
        small.put(b"k%d" % i, data(i), parent=b"k%d" % (i - 1) if i else None)
    kinds = [(c.kind, c.key, c.tier) for c in changes]
    assert kinds[:4] == [(ChunkChangeKind.STORED, b"k%d" % i, TierKind.DRAM) for i in range(4)]
    # the fifth put demoted the least recently used chunk (k0) to NVMe first
    assert (ChunkChangeKind.MOVED, b"k0", TierKind.NVME) in kinds
    assert kinds[-1] == (ChunkChangeKind.STORED, b"k4", TierKind.DRAM)
    moved = next(c for c in changes if c.kind is ChunkChangeKind.MOVED)
    assert moved.from_tier is TierKind.DRAM
    assert changes[1].parent == b"k0"
    changes.clear()
    small.remove(b"k3")  # and its child k4
    assert [(c.kind, c.key) for c in changes] == [(ChunkChangeKind.REMOVED, b"k4"),
                                                  (ChunkChangeKind.REMOVED, b"k3")]
    assert all(c.size_bytes == CHUNK for c in changes)


def test_reserve_commit_is_invisible_until_commit_and_abort_frees(small: TieredCache) -> None:
    slot = small.reserve(b"a", CHUNK)
    slot.buffer[:] = data(7)
    assert small.entry(b"a") is None
    with pytest.raises(ChunkBusy):
        small.reserve(b"a", CHUNK)
    small.commit(slot)
    assert small.entry(b"a").tier is TierKind.DRAM  # type: ignore[union-attr]
    with pytest.raises(ChunkExists):
        small.reserve(b"a", CHUNK)
    slot = small.reserve(b"b", CHUNK, parent=b"a")
    small.abort(slot)
    small.abort(slot)
    assert small.entry(b"b") is None
    with pytest.raises(InvalidArgument):
        small.reserve(b"c", CHUNK, parent=b"missing")
    with pytest.raises(CapacityError):
        small.reserve(b"huge", 5 * CHUNK)


def test_shm_leases_give_offsets_a_mapped_reader_can_copy_from(small: TieredCache) -> None:
    leases = ShmLeases(small)
    arena = ShmArena.attach(leases.arena_name, access=ArenaAccess.READ_WRITE)
    try:
        lease_id, offset = leases.reserve(b"w", CHUNK, ttl_s=10)
        arena.view(offset, CHUNK, readonly=False)[:] = data(3)
        assert small.entry(b"w") is None
        assert leases.commit(lease_id) is TierKind.DRAM
        with pytest.raises(InvalidArgument):
            leases.commit(lease_id)
        read_id, ranges = leases.acquire_read([b"w"], ttl_s=10)
        assert bytes(arena.view(ranges[0].offset, ranges[0].size_bytes)) == data(3)
        with pytest.raises(ChunkBusy):
            small.remove(b"w")
        assert leases.release(read_id) is True
        assert leases.release(read_id) is False
        small.remove(b"w")
    finally:
        arena.close()


def test_shm_prefix_acquire_leases_the_cached_prefix_only(small: TieredCache) -> None:
    small.put(b"p0", data(0))
    small.put(b"p1", data(1), parent=b"p0")
    leases = ShmLeases(small)
    lease_id, ranges = leases.acquire_read([b"p0", b"p1", b"p2"], ttl_s=10, prefix=True)
    assert [r.size_bytes for r in ranges] == [CHUNK, CHUNK]
    leases.release(lease_id)
    assert leases.acquire_read([b"zz"], ttl_s=10, prefix=True) == (0, [])
    with pytest.raises(ChunkNotFound):
        leases.acquire_read([b"p0", b"p2"], ttl_s=10)


def test_dropping_an_owner_aborts_its_writes_and_releases_its_reads(small: TieredCache) -> None:
    small.put(b"r", data(0))
    leases = ShmLeases(small)
    owner = object()
    leases.acquire_read([b"r"], ttl_s=60, owner=owner)
    leases.reserve(b"half", CHUNK, ttl_s=60, owner=owner)
    used = small.tiers[TierKind.DRAM].stats().used_bytes
    assert leases.drop_owner(owner) == (1, 1)
    assert small.entry(b"half") is None
    assert small.tiers[TierKind.DRAM].stats().used_bytes == used - CHUNK
    small.remove(b"r")  # no longer pinned
    assert leases.open_count() == (0, 0)


def test_expired_leases_are_ended(small: TieredCache) -> None:
    small.put(b"r", data(0))
    leases = ShmLeases(small)
    leases.acquire_read([b"r"], ttl_s=60)
    write_id, _ = leases.reserve(b"w", CHUNK, ttl_s=60)
    assert leases.expire(time.monotonic() + 61) == (1, 1)
    with pytest.raises(InvalidArgument):
        leases.commit(write_id)
    assert small.entry(b"w") is None


def test_shm_reserve_many_commit_many_store_a_chain_owned_and_counted(
        small: TieredCache, changes: list[ChunkChange]) -> None:
    """One batch of a chain (parents reserved earlier in the same batch): one lease each,
    counted in the budget until committed, only the owner commits, one STORED each in order."""
    leases = ShmLeases(small, max_leases=8)
    arena = ShmArena.attach(leases.arena_name, access=ArenaAccess.READ_WRITE)
    owner, other = object(), object()
    try:
        items = [(b"c0", None), (b"c1", b"c0"), (b"c2", b"c1")]
        out = leases.reserve_many(items, [CHUNK] * 3, 10, owner=owner)
        assert all(isinstance(o, tuple) for o in out)
        assert leases.budget.held == 3 and leases.open_count() == (0, 3)
        for i, (_lease_id, offset) in enumerate(out):  # type: ignore[misc]
            arena.view(offset, CHUNK, readonly=False)[:] = data(i)
        ids = [o[0] for o in out]  # type: ignore[index]
        assert all(isinstance(e, InvalidArgument) for e in leases.commit_many(ids, owner=other))
        assert leases.open_count() == (0, 3) and small.entry(b"c0") is None
        changes.clear()
        assert leases.commit_many(ids, owner=owner) == [None] * 3
        assert leases.budget.held == 0 and leases.open_count() == (0, 0)
        assert [(c.kind, c.key) for c in changes] == [(ChunkChangeKind.STORED, k)
                                                      for k in (b"c0", b"c1", b"c2")]
        assert small.entry(b"c2").parent == b"c1"  # type: ignore[union-attr]
        assert leases.bytes_written == 3 * CHUNK
        assert all(isinstance(e, InvalidArgument) for e in leases.commit_many(ids, owner=owner))
    finally:
        arena.close()


def test_shm_reserve_many_fails_items_past_the_lease_budget_and_their_children(
        small: TieredCache) -> None:
    leases = ShmLeases(small, max_leases=2)
    small.put(b"e", data(9))
    items = [(b"e", None), (b"d0", None), (b"d1", b"d0"), (b"d2", b"d1"), (b"x", b"missing")]
    out = leases.reserve_many(items, [CHUNK] * 5, 10)
    assert isinstance(out[0], ChunkExists)
    assert isinstance(out[1], tuple) and isinstance(out[2], tuple)
    assert type(out[3]).__name__ == "TooManyLeases"
    assert isinstance(out[4], InvalidArgument)
    assert leases.budget.held == 2 and leases.open_count() == (0, 2)
    assert leases.commit_many([out[1][0], out[2][0]]) == [None, None]  # type: ignore[index]
    assert leases.budget.held == 0
    assert small.entry(b"d1").parent == b"d0"  # type: ignore[union-attr]


def test_shm_commit_many_frees_a_child_whose_parent_reservation_was_aborted(
        small: TieredCache) -> None:
    """The parent was reserved by an earlier request of the same owner and aborted: the child,
    and its child in the same batch, are freed unpublished; a sibling root stores."""
    leases = ShmLeases(small)
    owner = object()
    [(parent_id, _)] = leases.reserve_many([(b"p", None)], [CHUNK], 10, owner=owner)  # type: ignore[misc]
    out = leases.reserve_many([(b"q", b"p"), (b"r", b"q"), (b"s", None)], [CHUNK] * 3, 10,
                              owner=owner)
    assert all(isinstance(o, tuple) for o in out)
    assert leases.abort(parent_id, owner=owner)
    errors = leases.commit_many([o[0] for o in out], owner=owner)  # type: ignore[index]
    assert isinstance(errors[0], InvalidArgument) and isinstance(errors[1], InvalidArgument)
    assert errors[2] is None
    assert small.entry(b"q") is None and small.entry(b"r") is None
    assert small.entry(b"s") is not None
    assert small.tiers[TierKind.DRAM].stats().used_bytes == CHUNK
    assert leases.budget.held == 0 and leases.open_count() == (0, 0)

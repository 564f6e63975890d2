"""The daemon's data-plane backends as one tenant's session sees them (``scoped``), on a real
tiered cache (DRAM arena and NVMe files in a temp directory): reads see only the tenant's and
the shared chunks, writes are owned by it, and a chunk replaced by another tenant's under the
same key in the middle of a pin-free copy is never served."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.errors import ChunkNotFound, PermissionDenied
from kvstore.node.backend import CacheLeaseBackend, ShmLeases
from kvstore.node.cache import TieredCache
from kvstore.node.index import SHARED_TENANT

ALICE = TenantScope("alice", "alice")
BOB = TenantScope("bob", "bob")
K = b"k" * 16


@pytest.fixture
def cache(tmp_path: Path) -> Iterator[TieredCache]:
    nvme = NvmeTier.open(NvmeTierConfig(directory=tmp_path / "nvme", capacity_bytes=16 << 20,
                                        segment_bytes=4 << 20))
    c = TieredCache({TierKind.DRAM: DramTier(16 << 20), TierKind.NVME: nvme})
    try:
        yield c
    finally:
        for tier in c.tiers.values():
            tier.close()


def test_tcp_scope_reads_writes_and_removes_as_its_tenant(cache: TieredCache) -> None:
    backend = CacheLeaseBackend(cache)
    alice, bob = backend.scoped(ALICE), backend.scoped(BOB)
    value = os.urandom(5000)
    lease = alice.open_write(K, len(value))
    lease.buffer[:] = value
    lease.commit()
    assert cache.entry(K, "alice") is not None and cache.entry(K, "bob") is None
    out = bytearray(len(value))
    assert alice.read_into(K, memoryview(out)) == len(value) and out == value
    with pytest.raises(ChunkNotFound):
        bob.read_into(K, memoryview(bytearray(len(value))))
    with pytest.raises(ChunkNotFound):
        bob.open_read(K)
    assert bob.size_of(K) is None and not bob.exists(K) and bob.remove(K) is False
    with pytest.raises(PermissionDenied):
        bob.open_write(K, 10)
    with pytest.raises(PermissionDenied):  # a scope that may not write
        backend.scoped(TenantScope(SHARED_TENANT, None)).open_write(b"s" * 16, 10)
    assert alice.size_of(K) == len(value) and alice.remove(K) is True


def test_a_chunk_in_nvme_is_read_under_a_lease_and_checked(cache: TieredCache) -> None:
    value = os.urandom(9000)
    cache.put(K, value, tier=TierKind.NVME, tenant="alice")
    alice = CacheLeaseBackend(cache).scoped(ALICE)
    out = bytearray(len(value))
    assert alice.read_into(K, memoryview(out)) == len(value) and out == value
    with pytest.raises(ChunkNotFound):
        CacheLeaseBackend(cache).scoped(BOB).read_into(K, memoryview(bytearray(len(value))))


def test_a_chunk_replaced_by_another_tenant_during_the_copy_is_not_served(
        cache: TieredCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Alice's pin-free read finds her chunk, and in the middle of the copy it is removed and
    bob stores his own bytes under the same key: she gets not-found, never bob's bytes."""
    mine, his = b"A" * 4096, b"B" * 4096
    cache.put(K, mine, tenant="alice")
    backend = CacheLeaseBackend(cache)
    dram = backend.dram
    real_get_into = dram.get_into

    def racing_get_into(key: bytes, dst: object) -> int:
        monkeypatch.setattr(dram, "get_into", real_get_into)  # once
        cache.remove(K, "alice")
        cache.put(K, his, tenant="bob")
        return real_get_into(key, dst)

    monkeypatch.setattr(dram, "get_into", racing_get_into)
    out = bytearray(len(mine))
    with pytest.raises(ChunkNotFound):
        backend.scoped(ALICE).read_into(K, memoryview(out))
    # Bob's chunk is his: he reads it; without the race alice would have read hers.
    assert backend.scoped(BOB).read_into(K, memoryview(out)) == len(his) and out == his


def test_shm_scope_puts_reserves_and_batches_as_its_tenant(cache: TieredCache) -> None:
    leases = ShmLeases(cache)
    alice, bob = leases.scoped(ALICE), leases.scoped(BOB)
    alice.put(K, b"v" * 100)
    assert cache.entry(K, "alice") is not None
    with pytest.raises(PermissionDenied):
        bob.put(K, b"x" * 100)
    with pytest.raises(ChunkNotFound):
        bob.acquire_read([K], 5.0, owner="b")
    assert bob.acquire_read([K], 5.0, prefix=True, owner="b") == (0, [])
    assert bob.size_of(K) is None and bob.remove(K) is False
    # A batch: a chain reserved parent-first, committed in order, owned by bob.
    items = [(b"p" * 16, None), (b"c" * 16, b"p" * 16), (K, None)]
    results = bob.reserve_many(items, [10, 10, 10], 5.0, owner="b")
    assert isinstance(results[2], PermissionDenied)  # alice's key
    ids = [r[0] for r in results[:2] if isinstance(r, tuple)]
    assert len(ids) == 2
    assert bob.commit_many(ids, owner="b") == [None, None]
    assert cache.entry(b"c" * 16, "bob") is not None and cache.entry(b"c" * 16, "alice") is None
    assert alice.size_of(b"p" * 16) is None and bob.size_of(b"p" * 16) == 10
    assert leases.open_count() == (0, 0)

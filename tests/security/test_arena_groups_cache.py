"""Arenas per tenant group under the real cache (issue 15; docs/dram-arena.md, "Arenas per tenant
group"): a full group's arena evicts only chunks of its own group, demotion to NVMe and promotion
back keep a chunk in its group's arena, the same-host lease table of one arena serves only its
group's tenants, and ``dram.arena_groups`` is validated loudly (config and daemon start). Real
shared memory and real NVMe files; the daemon-level attempts are in test_arena_groups.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.dataplane.dram import DEFAULT_ARENA, ArenaGroup, GroupedDramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.dataplane.transport.base import LeaseBackend
from kvstore.errors import CapacityError, ChunkNotFound, ConfigError, PermissionDenied
from kvstore.node.backend import CacheLeaseBackend, ShmLeases
from kvstore.node.cache import CacheConfig, TieredCache
from kvstore.node.config import load_config
from kvstore.node.daemon import StoreDaemon
from tests.dataplane.lease_backend_conformance import LeaseBackendConformance

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


def _groups() -> list[ArenaGroup]:
    return [ArenaGroup("a", frozenset({"alice"}), MiB), ArenaGroup("b", frozenset({"bob"}), MiB)]


@pytest.fixture
def dram_only() -> Iterator[tuple[TieredCache, GroupedDramTier]]:
    dram = GroupedDramTier(4 * MiB, _groups(), read_index_slots=64)
    cache = TieredCache({TierKind.DRAM: dram})
    try:
        yield cache, dram
    finally:
        cache.close()


def _key(tenant: str, i: int) -> bytes:
    return f"{tenant}-{i:04d}".encode()


def test_a_full_groups_arena_evicts_only_its_own_groups_chunks(
        dram_only: tuple[TieredCache, GroupedDramTier]) -> None:
    cache, dram = dram_only
    stored: dict[bytes, bytes] = {}
    # Bob's arena and the default one are filled first: the oldest chunks in LRU order.
    for tenant, count in (("bob", 16), ("", 32)):
        for i in range(count):
            value = os.urandom(CHUNK)
            cache.put(_key(tenant or "default", i), value, tenant=tenant)
            stored[_key(tenant or "default", i)] = value
    # Every arena but alice's is full; she writes three times her arena's size (the whole tier
    # is full from her 16th chunk on).
    alice = [_key("alice", i) for i in range(48)]
    for key in alice:
        cache.put(key, os.urandom(CHUNK), tenant="alice")
    for key, value in stored.items():
        tenant = "bob" if key.startswith(b"bob") else ""
        out = bytearray(CHUNK)
        assert cache.get_into(key, out, tenant) == CHUNK and out == value, \
            f"{key!r} of another group was evicted by alice's writes"
    held = [key for key in alice if cache.entry(key) is not None]
    assert held == alice[-16:]  # her newest, as many as her arena holds
    assert dram.arena("a").stats().chunks == 16
    assert all(dram.arena("a").contains(key) for key in held)
    # Bob's arena is as full as before and still takes his writes (evicting his own).
    cache.put(_key("bob", 99), os.urandom(CHUNK), tenant="bob")
    assert cache.entry(_key("bob", 0)) is None
    assert all(cache.entry(k) is not None for k in stored if k.startswith(b"default"))


def test_a_small_groups_full_arena_evicts_what_a_write_needs_not_a_share_of_the_tier() -> None:
    """An evict-and-retry round is sized by the writer's arena (a 64th of it, at least the
    chunk), not by the whole tier: alice's 1 MiB arena in a 64 MiB tier keeps all but the one
    chunk each new write needs."""
    dram = GroupedDramTier(64 * MiB, [ArenaGroup("a", frozenset({"alice"}), MiB)])
    cache = TieredCache({TierKind.DRAM: dram})
    try:
        keys = [_key("alice", i) for i in range(24)]
        for key in keys:
            cache.put(key, os.urandom(CHUNK), tenant="alice")
        held = [key for key in keys if cache.entry(key) is not None]
        assert held == keys[-16:], f"{len(held)} of alice's chunks left in her 16-chunk arena"
    finally:
        cache.close()


def test_the_watermark_demoter_brings_each_arena_down_by_its_own_chunks() -> None:
    """Background demotion works per arena: the default arena and bob's above their high
    watermark lose their own oldest chunks; alice's arena, below its own, keeps all of hers
    (they are the oldest in the tier, so one watermark for the whole tier took them first)."""
    dram = GroupedDramTier(4 * MiB, _groups())
    cache = TieredCache({TierKind.DRAM: dram},
                        config=CacheConfig(high_watermark=0.9, low_watermark=0.5))
    try:
        alice = [_key("alice", i) for i in range(12)]  # 75% of her arena, written first
        for key in alice:
            cache.put(key, os.urandom(CHUNK), tenant="alice")
        for tenant, count in (("bob", 16), ("", 32)):  # both full: the tier is at 94%
            for i in range(count):
                cache.put(_key(tenant or "default", i), os.urandom(CHUNK), tenant=tenant)
        assert cache.demote_to_low_watermark()[TierKind.DRAM] > 0
        assert all(cache.entry(key) is not None for key in alice)
        for name in ("b", DEFAULT_ARENA):
            stats = dram.arena(name).stats()
            assert stats.used_bytes <= stats.capacity_bytes // 2, (name, stats)
        assert cache.entry(_key("bob", 15)) is not None and cache.entry(_key("bob", 0)) is None
    finally:
        cache.close()


def test_the_batch_reserve_evicts_only_its_own_groups_chunks(
        dram_only: tuple[TieredCache, GroupedDramTier]) -> None:
    cache, dram = dram_only
    others = []
    for tenant, count in (("bob", 16), ("", 32)):
        for i in range(count):
            cache.put(_key(tenant or "default", i), os.urandom(CHUNK), tenant=tenant)
            others.append(_key(tenant or "default", i))
    for batch in range(4):
        keys = [_key("alice", batch * 8 + i) for i in range(8)]
        slots = cache.reserve_many(keys, [CHUNK] * 8, [None] * 8, tier=TierKind.DRAM,
                                   tenant="alice")
        assert not any(isinstance(s, Exception) for s in slots), slots
        results = cache.commit_many(slots, [None] * 8, tier=TierKind.DRAM,  # type: ignore[arg-type]
                                    tenant="alice")
        assert not any(isinstance(r, Exception) for r in results), results
    assert all(cache.entry(k) is not None for k in others)
    assert all(dram.arena("a").contains(_key("alice", 31 - i)) for i in range(8))


@pytest.fixture
def with_nvme(tmp_path: Path) -> Iterator[tuple[TieredCache, GroupedDramTier]]:
    dram = GroupedDramTier(4 * MiB, _groups(), read_index_slots=64)
    nvme = NvmeTier.open(NvmeTierConfig(directory=tmp_path / "nvme", capacity_bytes=16 * MiB,
                                        segment_bytes=MiB))
    cache = TieredCache({TierKind.DRAM: dram, TierKind.NVME: nvme})
    try:
        yield cache, dram
    finally:
        cache.close()


def test_demotion_to_nvme_and_promotion_back_keep_a_chunk_in_its_groups_arena(
        with_nvme: tuple[TieredCache, GroupedDramTier]) -> None:
    cache, dram = with_nvme
    values = {tenant: os.urandom(CHUNK) for tenant in ("alice", "bob", "")}
    for tenant, value in values.items():
        cache.put(f"k-{tenant}".encode(), value, tenant=tenant)
    cache.evict(TierKind.DRAM, 3 * CHUNK)  # all three go down to NVMe
    for tenant in values:
        entry = cache.entry(f"k-{tenant}".encode())
        assert entry is not None and entry.tier is TierKind.NVME
    assert dram.stats().chunks == 0
    for tenant, value in values.items():
        key = f"k-{tenant}".encode()
        lease = cache.pin_in(TierKind.DRAM, [key], 10.0, tenant)  # promote into DRAM
        try:
            for name in ("a", "b", DEFAULT_ARENA):
                assert dram.arena(name).contains(key) is (name == dram.arena_of(tenant))
            assert bytes(dram.view(key)) == value
        finally:
            cache.unpin(lease)


def test_one_arenas_lease_table_serves_only_its_groups_tenants(
        dram_only: tuple[TieredCache, GroupedDramTier]) -> None:
    cache, dram = dram_only
    leases_a = ShmLeases(cache, arena="a")
    leases_default = ShmLeases(cache)
    try:
        cache.put(b"alice-root", b"a" * CHUNK, tenant="alice")
        cache.put(b"alice-child", b"c" * CHUNK, parent=b"alice-root", tenant="alice")
        cache.put(b"shared", b"s" * CHUNK, tenant="")
        for tenant in ("bob", ""):
            with pytest.raises(PermissionDenied, match="not in this arena's group"):
                leases_a.scoped(TenantScope(tenant, tenant))
            with pytest.raises(PermissionDenied, match="not in this arena's group"):
                leases_a.reserve(b"x", CHUNK, 10.0, tenant=tenant)
            with pytest.raises(PermissionDenied, match="not in this arena's group"):
                leases_a.put(b"x", b"x" * 10, tenant=tenant)
            (refused,) = leases_a.reserve_many([(b"x", None)], [CHUNK], 10.0, tenant=tenant)
            assert isinstance(refused, PermissionDenied)
        with pytest.raises(PermissionDenied, match="not in this arena's group"):
            leases_default.scoped(TenantScope("alice", "alice"))
        # Alice's own session: her chunks, at offsets in her arena.
        scoped = leases_a.scoped(TenantScope("alice", "alice"))
        lease_id, ranges = scoped.acquire_read([b"alice-root", b"alice-child"], 10.0)
        arena = dram.arena("a")
        for r, key, fill in zip(ranges, (b"alice-root", b"alice-child"), (b"a", b"c"),
                                strict=True):
            location = arena.locate(key)
            assert location is not None and (location.offset, location.size_bytes) == \
                (r.offset, r.size_bytes)
            assert bytes(arena.view(key)) == fill * CHUNK
        assert scoped.release(lease_id)
        # Another arena's chunk is not leased here (read it over TCP): for every tenant's
        # reader (the operator's), and for alice's of the default tenant's chunk...
        for leases, key in ((leases_a, b"shared"), (leases_default, b"alice-root")):
            with pytest.raises(CapacityError, match="lies in another arena"):
                leases.acquire_read([key], 10.0)
        # ... while a chunk alice may not read at all is a plain miss.
        cache.put(b"bob-root", b"b" * CHUNK, tenant="bob")
        with pytest.raises(ChunkNotFound):
            scoped.acquire_read([b"bob-root"], 10.0)
        lease_id, ranges = leases_default.acquire_read([b"shared", b"alice-root"], 10.0,
                                                       prefix=True)
        assert len(ranges) == 1 and leases_default.release(lease_id)
    finally:
        leases_a.close()
        leases_default.close()


class TestCacheLeaseBackendOverArenaGroups(LeaseBackendConformance):
    """The TCP plane's lease backend runs its conformance suite over a grouped DRAM tier (an
    unscoped connection writes the default tenant: the default arena)."""

    @pytest.fixture
    def backend(self, tmp_path: Path) -> Iterator[LeaseBackend]:
        nvme = NvmeTier.open(NvmeTierConfig(directory=tmp_path / "nvme", capacity_bytes=8 * MiB,
                                            segment_bytes=MiB))
        dram = GroupedDramTier(28 * MiB, [ArenaGroup("a", frozenset({"alice"}), 4 * MiB)])
        cache = TieredCache({TierKind.DRAM: dram, TierKind.NVME: nvme})
        yield CacheLeaseBackend(cache)
        cache.close()


GOOD = "team-a:tenants=alice+carol;group=4242;users=65534;capacity=8MiB"


def _load(groups: str, capacity: str = "32MiB") -> object:
    return load_config(env={}, overrides={"dram.capacity_bytes": capacity,
                                          "dram.arena_groups": groups})


def test_arena_groups_parse() -> None:
    cfg = load_config(env={}, overrides={
        "dram.capacity_bytes": "32MiB",
        "dram.arena_groups": GOOD + ",team-b:tenants=bob;group=nogroup;capacity=4MiB"})
    a, b = cfg.dram.arena_group_list()
    assert (a.name, a.tenants, a.gid, a.uids, a.capacity_bytes) == \
        ("team-a", frozenset({"alice", "carol"}), 4242, frozenset({65534}), 8 * MiB)
    assert (b.name, b.gid, b.uids) == ("team-b", 65534, frozenset())
    assert load_config(env={}).dram.arena_group_list() == ()


@pytest.mark.parametrize(("groups", "capacity", "message"), [
    (GOOD + ",team-b:tenants=bob+carol;group=4243;capacity=4MiB", "32MiB",
     "tenant 'carol' is in groups 'team-a' and 'team-b'"),
    (GOOD + ",team-a:tenants=bob;group=4243;capacity=4MiB", "32MiB",
     "two groups are named 'team-a'"),
    (GOOD, "8MiB", "the default arena .* needs at least 64 KiB"),
    ("team-a:tenants=alice;group=no-such-group-here;capacity=8MiB", "32MiB",
     "no unix group 'no-such-group-here'"),
    ("team-a:tenants=alice;group=4242;users=no-such-user-here;capacity=8MiB", "32MiB",
     "no user 'no-such-user-here'"),
    ("team-a:tenants=alice;capacity=8MiB", "32MiB", "needs group="),
    ("team-a:tenants=alice;group=4242;capacity=lots", "32MiB", "not a size"),
    ("team-a:tenants=alice;group=4242;capacity=8MiB;color=red", "32MiB", "fields are"),
    ("bad name:tenants=alice;group=4242;capacity=8MiB", "32MiB", "name"),
    ("team-a", "32MiB", "must read NAME:"),
])
def test_bad_arena_groups_fail_loudly_naming_the_key(groups: str, capacity: str,
                                                     message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _load(groups, capacity)
    assert "dram" in str(info.value)


def test_a_daemon_with_arena_groups_needs_security() -> None:
    cfg = load_config(env={}, overrides={"dram.capacity_bytes": "32MiB",
                                         "dram.arena_groups": GOOD})
    with pytest.raises(ConfigError, match=r"dram\.arena_groups needs security"):
        asyncio.run(StoreDaemon(cfg).start())

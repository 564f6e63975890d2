"""The cache writes each chunk's tenant into its NVMe record on every path there (durable puts,
demotion, backing copies of ancestors) and ``recover`` restores it; a chunk whose recorded owner
may not hang under its parent's is dropped with what hangs under it. Real tiers (DRAM, NVMe
files), in process."""

from __future__ import annotations

from pathlib import Path

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.node.cache import CacheConfig, TieredCache
from kvstore.node.index import DEFAULT_TENANT, SHARED_TENANT

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


def _cache(directory: Path, *, dram_bytes: int = 8 * CHUNK,
           write_tier: TierKind | None = None) -> TieredCache:
    nvme = NvmeTier.open(NvmeTierConfig(directory=directory, capacity_bytes=8 * MiB,
                                        segment_bytes=MiB))
    return TieredCache({TierKind.DRAM: DramTier(dram_bytes), TierKind.NVME: nvme},
                       config=CacheConfig(write_tier=write_tier))


def _key(tag: str, i: int) -> bytes:
    return f"{tag}-{i:02d}".encode()


def _owners(cache: TieredCache, keys: list[bytes]) -> list[str | None]:
    return [None if (e := cache.entry(k)) is None else e.tenant for k in keys]


def test_demoted_and_durable_chunks_recover_their_tenant(tmp_path: Path) -> None:
    directory = tmp_path / "nvme"
    cache = _cache(directory)
    shared = _key("shared", 0)
    cache.put(shared, b"s" * CHUNK, tenant=SHARED_TENANT)
    alice = [_key("alice", i) for i in range(12)]  # more than DRAM holds: most are demoted
    parent = shared
    for k in alice:
        cache.put(k, k * (CHUNK // len(k)), parent=parent, tenant="alice")
        parent = k
    bob = [_key("bob", i) for i in range(4)]
    for i, k in enumerate(bob):
        cache.put(k, k * (CHUNK // len(k)), parent=bob[i - 1] if i else None, tenant="bob")
    cache.put(_key("default", 0), b"d" * CHUNK)
    cache.persist()  # what is still in DRAM goes down too (demotion, as at a drain)
    cache.close()

    again = _cache(directory)
    report = again.recover()
    try:
        assert (report.recovered, report.dropped_orphans) == (18, 0)
        assert _owners(again, alice) == ["alice"] * 12
        assert _owners(again, bob) == ["bob"] * 4
        assert _owners(again, [shared, _key("default", 0)]) == [SHARED_TENANT, DEFAULT_TENANT]
        assert again.lookup(alice, tenant="bob").length == 0
        assert again.lookup([shared, *alice], tenant="alice").length == 13
        # Recovered bytes count for their owners (quotas and shares apply to them) and the
        # writers get their metrics labels back.
        assert again.index.tenant_usage()[TierKind.NVME] == {
            "alice": 12 * CHUNK, "bob": 4 * (CHUNK // 6 * 6), SHARED_TENANT: CHUNK,
            DEFAULT_TENANT: CHUNK}
        assert {r.tenant for r in again.tenant_report()} == {"alice", "bob", SHARED_TENANT,
                                                              DEFAULT_TENANT, None}
    finally:
        again.close()


def test_write_through_backs_ancestors_with_their_own_tenant(tmp_path: Path) -> None:
    """Durable puts (write tier NVMe) into DRAM: each put is written through, and a dropped
    ancestor copy is rewritten as its owner's, not the writer's."""
    directory = tmp_path / "nvme"
    cache = _cache(directory, write_tier=TierKind.NVME)
    keys = [_key("alice", i) for i in range(3)]
    for i, k in enumerate(keys):
        cache.put(k, b"a" * CHUNK, parent=keys[i - 1] if i else None, tier=TierKind.DRAM,
                  tenant="alice")
    cache.close()
    again = _cache(directory, write_tier=TierKind.NVME)
    again.recover()
    try:
        assert _owners(again, keys) == ["alice"] * 3
    finally:
        again.close()


def test_a_child_whose_owner_cannot_hang_under_its_parent_is_dropped(tmp_path: Path) -> None:
    """A chain begun before owners were kept (root: no owner, the default tenant) and continued
    as alice: alice's child is unusable (its parent is not hers) and goes, with its own child."""
    directory = tmp_path / "nvme"
    tier = NvmeTier.open(NvmeTierConfig(directory=directory, capacity_bytes=8 * MiB,
                                        segment_bytes=MiB))
    tier.put(b"root", b"r" * 100)
    tier.put_with_meta(b"child", b"c" * 100, b"root", b"alice")
    tier.put_with_meta(b"grandchild", b"g" * 100, b"child", b"alice")
    tier.put_with_meta(b"fine", b"f" * 100, b"root", b"")
    tier.close()
    cache = _cache(directory)
    report = cache.recover()
    try:
        assert (report.recovered, report.dropped_orphans) == (2, 2)
        assert _owners(cache, [b"root", b"fine", b"child", b"grandchild"]) \
            == [DEFAULT_TENANT, DEFAULT_TENANT, None, None]
        assert {i.key for i in cache.tier(TierKind.NVME).chunks()} == {b"root", b"fine"}
    finally:
        cache.close()

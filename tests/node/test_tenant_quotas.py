"""Per-tenant quotas in the index's eviction plans, the bytes it keeps per tenant, and the
tenant meter's bounded labels (issue 15): pure logic with exact plans, in order; then the
cache over real tiers (a cap demotes the tenant's own chunks, a share survives a flood and an
operator's evict, a drain still persists it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.errors import CapacityError, ConfigError
from kvstore.node.cache import TieredCache
from kvstore.node.index import CacheIndex, TierBudget
from kvstore.node.tenants import OTHER_LABEL, TenantMeter, TenantQuota

DRAM, NVME = TierKind.DRAM, TierKind.NVME
KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _index(*quotas: TenantQuota, nvme: bool = False) -> CacheIndex:
    budgets = {DRAM: TierBudget.of(1000)}
    if nvme:
        budgets[NVME] = TierBudget.of(1000)
    return CacheIndex(budgets, quotas=quotas, clock=Clock())


def _fill(index: CacheIndex, tenant: str, n: int, size: int = 100) -> list[bytes]:
    keys = [f"{tenant}-{i}".encode() for i in range(n)]
    for k in keys:
        index.insert(k, None, DRAM, size, tenant=tenant)
    return keys


def test_tenant_usage_follows_inserts_moves_backing_and_removes() -> None:
    index = _index(nvme=True)
    a = _fill(index, "a", 3)
    index.insert(b"b-0", None, DRAM, 50, tenant="b", backing=NVME)
    assert index.tenant_usage() == {DRAM: {"a": 300, "b": 50}, NVME: {"b": 50}}
    index.move(a[0], NVME)
    index.move(b"b-0", NVME)  # to its backing tier: the DRAM copy is forgotten
    assert index.tenant_usage() == {DRAM: {"a": 200}, NVME: {"a": 100, "b": 50}}
    index.move(a[0], DRAM, keep_source=True)  # a promotion keeping its NVMe copy
    assert index.tenant_usage() == {DRAM: {"a": 300}, NVME: {"a": 100, "b": 50}}
    index.drop_backing(a[0])
    index.remove(b"b-0")
    index.remove_subtree(a[1])
    assert index.tenant_usage() == {DRAM: {"a": 200}, NVME: {}}


def test_eviction_for_another_tenant_keeps_a_guaranteed_share() -> None:
    def world() -> tuple[CacheIndex, list[bytes], list[bytes]]:
        index = _index(TenantQuota("b", DRAM, guaranteed_bytes=300))
        b = _fill(index, "b", 4)  # 400 bytes, 100 above b's floor
        a = _fill(index, "a", 6)  # the tier is full
        return index, a, b  # LRU order: b0 b1 b2 b3 a0..a5 (a plan may reorder: one each)

    index, a, b = world()  # a's write may take b0 (b keeps 300), not b1
    assert index.plan_eviction(DRAM, 300, tenant="a") == [b[0], a[0], a[1]]
    index, a, b = world()  # the cache's own work (no tenant) keeps the floor too
    assert index.plan_eviction(DRAM, 200) == [b[0], a[0]]
    index, a, b = world()  # b's own write is not protected from itself
    assert index.plan_eviction(DRAM, 300, tenant="b") == b[:3]
    index, a, b = world()  # a drain persisting memory ignores floors
    assert index.plan_eviction(DRAM, 400, guarantees=False) == b
    index, a, b = world()  # only the floor left: no plan for a, and the error says why
    with pytest.raises(CapacityError, match="guaranteed shares"):
        index.plan_eviction(DRAM, 800, tenant="a")


def test_a_cap_refuses_the_insert_and_plans_only_the_tenants_own_chunks() -> None:
    index = _index(TenantQuota("a", DRAM, max_bytes=300))
    b = _fill(index, "b", 2)
    a = _fill(index, "a", 3)
    assert index.over_cap(DRAM, "a", 100) == 100 and index.over_cap(DRAM, "b", 900) == 0
    with pytest.raises(CapacityError, match=r"tenant 'a' is over its quota in dram.*300"):
        index.insert(b"a-x", None, DRAM, 100, tenant="a")
    errors = index.insert_many([(b"a-y", None, 100, None)], DRAM, "a")
    assert isinstance(errors[0], CapacityError) and "max_bytes of 300" in str(errors[0])
    assert index.plan_eviction(DRAM, 250, tenant="a", only_tenant="a") == a
    with pytest.raises(CapacityError, match="of tenant 'a'"):
        index.plan_eviction(DRAM, 400, tenant="a", only_tenant="a")
    assert b[0] in index  # nothing of b's planned
    # A chunk a restart found is indexed over the cap (its bytes are there).
    index.insert(b"a-r", None, DRAM, 100, tenant="a", check_quota=False)
    assert index.tenant_usage()[DRAM]["a"] == 400


def test_quotas_are_checked_when_the_index_is_built() -> None:
    with pytest.raises(ConfigError, match="sum to 1200 bytes"):
        _index(TenantQuota("a", DRAM, guaranteed_bytes=600),
               TenantQuota("b", DRAM, guaranteed_bytes=600))
    with pytest.raises(ConfigError, match="not configured"):
        _index(TenantQuota("a", NVME, max_bytes=10))
    with pytest.raises(ConfigError, match="two quotas"):
        _index(TenantQuota("a", DRAM, max_bytes=10), TenantQuota("a", DRAM, max_bytes=20))
    with pytest.raises(ConfigError, match="exceeds max_bytes"):
        TenantQuota("a", DRAM, max_bytes=10, guaranteed_bytes=20)
    with pytest.raises(ConfigError):
        TenantQuota("a", DRAM, max_bytes=0)


def test_the_meter_tracks_at_most_max_tenants_and_only_writers_get_labels() -> None:
    meter = TenantMeter(max_tenants=2)
    meter.refused("mallory")  # refusals, reads and misses never create a label
    meter.missed("mallory")
    meter.read("mallory", 10)
    meter.stored("alice", 100)
    meter.stored("", 5)
    meter.stored("carol", 7)  # a third writer: folded
    meter.read("alice", 40)
    meter.read("carol", 1)
    rows = {r.label: r for r in meter.report({DRAM: {"alice": 100, "carol": 7, "": 5}})}
    assert set(rows) == {"alice", "(default)", OTHER_LABEL}
    assert (rows["alice"].counters.bytes_written, rows["alice"].counters.hits,
            rows["alice"].counters.bytes_read) == (100, 1, 40)
    other = rows[OTHER_LABEL].counters
    assert (other.refused, other.misses, other.hits, other.bytes_read, other.bytes_written) \
        == (1, 1, 2, 11, 7)
    assert rows[OTHER_LABEL].used_bytes == {DRAM: 7}
    assert rows["(default)"].used_bytes == {DRAM: 5}
    assert meter.label("carol") == OTHER_LABEL and meter.label("alice") == "alice"


# --- the cache over real tiers (DRAM, NVMe files) ------------------------------------------------


def _cache(tmp_path: Path, *quotas: TenantQuota) -> TieredCache:
    nvme = NvmeTier.open(NvmeTierConfig(directory=tmp_path / "nvme", capacity_bytes=8 * MiB,
                                        segment_bytes=MiB))
    return TieredCache({DRAM: DramTier(8 * CHUNK), NVME: nvme}, quotas=quotas)


def test_a_put_over_its_dram_cap_demotes_its_own_chunks(tmp_path: Path) -> None:
    cache = _cache(tmp_path, TenantQuota("a", DRAM, max_bytes=3 * CHUNK))
    try:
        for i in range(2):
            cache.put(b"b-%d" % i, b"b" * CHUNK, tenant="b")
        for i in range(5):
            cache.put(b"a-%d" % i, b"a" * CHUNK, tenant="a")
        tiers = {k: e.tier for k in [b"b-0", b"b-1", *(b"a-%d" % i for i in range(5))]
                 if (e := cache.entry(k)) is not None}
        assert tiers == {b"b-0": DRAM, b"b-1": DRAM, b"a-0": NVME, b"a-1": NVME,
                         b"a-2": DRAM, b"a-3": DRAM, b"a-4": DRAM}
        with pytest.raises(CapacityError, match="tenant 'a' is at its quota in dram"):
            cache.put(b"a-big", b"x" * (4 * CHUNK), tenant="a")
        assert cache.tenants.report()[0].counters.refused == 1
    finally:
        cache.close()


def test_a_guaranteed_dram_share_stays_in_dram_and_a_drain_still_persists_it(
        tmp_path: Path) -> None:
    cache = _cache(tmp_path, TenantQuota("b", DRAM, guaranteed_bytes=2 * CHUNK))
    try:
        for i in range(2):
            cache.put(b"b-%d" % i, b"b" * CHUNK, tenant="b")
        for i in range(20):  # 2.5 DRAM tiers of a's
            cache.put(b"a-%02d" % i, b"a" * CHUNK, tenant="a")
        assert [cache.entry(b"b-%d" % i).tier for i in range(2)] == [DRAM, DRAM]  # type: ignore[union-attr]
        cache.evict(DRAM, 8 * CHUNK - 2 * CHUNK)  # an operator's evict keeps the share
        assert cache.index.tenant_usage()[DRAM] == {"b": 2 * CHUNK}
        assert cache.persist() == 2 * CHUNK  # a drain moves it to NVMe all the same
        assert [cache.entry(b"b-%d" % i).tier for i in range(2)] == [NVME, NVME]  # type: ignore[union-attr]
    finally:
        cache.close()

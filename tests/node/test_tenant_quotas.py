"""Per-tenant quotas in the index's eviction plans, the bytes it keeps per tenant, and the
tenant meter's bounded labels (issue 15). Pure logic: exact plans, in order."""

from __future__ import annotations

import pytest

from kvstore.dataplane.tier import TierKind
from kvstore.errors import CapacityError, ConfigError
from kvstore.node.index import CacheIndex, TierBudget
from kvstore.node.tenants import OTHER_LABEL, TenantMeter, TenantQuota

DRAM, NVME = TierKind.DRAM, TierKind.NVME


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

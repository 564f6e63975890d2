"""The batched same-host write path (issue 13) on a real DRAM tier with its read index: a scoped
session's batches are one batch for its tenant (owners, visibility and quota per chunk, as
item-by-item reserves give), the read index publishes a batch as ``publish`` would one by one,
a batch commit's events go to the event log in one call, and a batch-reserved slot makes its
arena view only when asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.read_index import ReadIndex
from kvstore.dataplane.read_index_layout import HEADER_BYTES
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.errors import ChunkExists, InvalidArgument, PermissionDenied, QuotaExceeded
from kvstore.node.backend import ShmLeases
from kvstore.node.cache import ChunkChange, ChunkChangeKind, TieredCache
from kvstore.node.events import EventLog
from kvstore.node.index import SHARED_TENANT
from kvstore.node.tenants import TenantQuota

DRAM = TierKind.DRAM
KiB = 1 << 10


def _key(name: str) -> bytes:
    return name.encode().ljust(16, b".")


@pytest.fixture
def log() -> EventLog:
    return EventLog(1024)


@pytest.fixture
def cache(log: EventLog) -> Iterator[TieredCache]:
    c = TieredCache({DRAM: DramTier(4 << 20, read_index_slots=1024)}, observer=log.record,
                    observe_many=log.record_many)
    try:
        yield c
    finally:
        c.close()


def test_a_tenant_batch_checks_owners_and_parents_as_reserve_does(cache: TieredCache) -> None:
    cache.put(_key("bob"), b"b" * 100, tenant="bob")
    cache.put(_key("mine"), b"a" * 100, tenant="alice")
    cache.put(_key("shared"), b"s" * 100, tenant=SHARED_TENANT)
    keys = [_key("bob"), _key("mine"), _key("x1"), _key("x2"), _key("x3")]
    parents = [None, None, _key("bob"), _key("shared"), _key("x2")]
    out = cache.reserve_many(keys, [100] * 5, parents, tier=DRAM, tenant="alice")
    assert isinstance(out[0], PermissionDenied)  # bob's key
    assert isinstance(out[1], ChunkExists)  # alice's own
    assert isinstance(out[2], InvalidArgument)  # a parent alice cannot see
    slots = out[3:]
    assert not any(isinstance(s, Exception) for s in slots)
    # Unscoped (None): a key any tenant holds is there already.
    unscoped = cache.reserve_many([_key("bob")], [100], [None], tier=DRAM)
    assert isinstance(unscoped[0], ChunkExists)
    infos = cache.commit_many(slots, parents[3:], tier=DRAM, tenant="alice")  # type: ignore[arg-type]
    assert not any(isinstance(i, Exception) for i in infos)
    for key in (_key("x2"), _key("x3")):
        entry = cache.entry(key, "alice")
        assert entry is not None and entry.tenant == "alice"
        assert cache.entry(key, "bob") is None
    dram = cache.tier(DRAM)
    assert isinstance(dram, DramTier) and dram.read_index is not None
    tagged = dram.read_index.location(_key("x3"))
    assert tagged is not None  # published, under alice's tag (the owner of the slot)


def test_a_scoped_session_batch_is_its_tenants_and_a_child_needs_its_parent(
        cache: TieredCache, log: EventLog) -> None:
    leases = ShmLeases(cache)
    alice = leases.scoped(TenantScope("alice", "alice"))
    keys = [_key(f"c{i}") for i in range(4)]
    items = list(zip(keys, [None, *keys[:-1]], strict=True))
    got = alice.reserve_many(items, [8 * KiB] * 4, 5.0, owner="a")
    ids = [r[0] for r in got if isinstance(r, tuple)]
    assert len(ids) == 4
    before = log.last_seq
    # The parent's lease is aborted: its chain is freed unpublished, nothing orphaned shows.
    assert alice.abort(ids[1], owner="a")
    out = alice.commit_many([ids[0], ids[2], ids[3]], owner="a")
    assert out[0] is None and isinstance(out[1], InvalidArgument) \
        and isinstance(out[2], InvalidArgument)
    assert cache.entry(keys[0], "alice") is not None
    assert all(cache.entry(k) is None for k in keys[1:])
    events = log.since(before)
    assert isinstance(events, list) and [(e.key, e.tenant) for e in events] == \
        [(keys[0], "alice")]
    assert leases.open_count() == (0, 0)
    # A session that may not write is refused per item.
    reader = leases.scoped(TenantScope(SHARED_TENANT, None))
    refused = reader.reserve_many([(_key("r"), None)], [100], 5.0, owner="r")
    assert isinstance(refused[0], PermissionDenied)


def test_a_tenant_with_a_quota_makes_room_from_its_own_chunks_in_a_batch(log: EventLog) -> None:
    cache = TieredCache({DRAM: DramTier(4 << 20)},
                        quotas=[TenantQuota("alice", DRAM, max_bytes=64 * KiB)])
    try:
        old = [_key(f"old{i}") for i in range(4)]
        for key in old:
            cache.put(key, b"o" * (16 * KiB), tenant="alice")
        keys = [_key("n0")]
        slots = cache.reserve_many(keys, [16 * KiB], [None], tier=DRAM, tenant="alice")
        assert not any(isinstance(s, Exception) for s in slots)
        assert sum(cache.entry(k) is not None for k in old) == 3  # its own, evicted for room
        infos = cache.commit_many(slots, [None], tier=DRAM,  # type: ignore[arg-type]
                                  tenant="alice")
        assert not any(isinstance(i, Exception) for i in infos)
        too_big = cache.reserve_many([_key("big")], [128 * KiB], [None], tier=DRAM,
                                     tenant="alice")
        assert isinstance(too_big[0], QuotaExceeded)
    finally:
        cache.close()


def test_record_many_numbers_events_in_order_and_wakes_once(log: EventLog) -> None:
    changes = [ChunkChange(ChunkChangeKind.STORED, _key(f"e{i}"), DRAM, 10, None, None, "t")
               for i in range(3)]
    log.record(changes[0])
    assert log.record_many(changes[1:]) == 3
    assert log.record_many([]) == 3
    events = log.since(0)
    assert isinstance(events, list)
    assert [(e.seq, e.key, e.tenant) for e in events] == [
        (i + 1, c.key, "t") for i, c in enumerate(changes)]


def test_publish_many_writes_the_same_table_as_publish() -> None:
    one = ReadIndex.create(64, arena_name="a", arena_bytes=1 << 20)
    many = ReadIndex.create(64, arena_name="a", arena_bytes=1 << 20)
    try:
        first = [(_key(f"k{i}"), i * 4096, 100 + i, "alice" if i % 2 else "") for i in range(40)]
        for key, offset, size, owner in first:
            one.publish(key, offset, size, owner)
        assert many.publish_many(first) == 40
        # Tombstones, a re-publish of a live key, then more new keys (some land on tombstones).
        for index in (one, many):
            for key, *_rest in first[::3]:
                assert index.unpublish(key)
        second = [(_key("k1"), 9 * 4096, 7, "bob"),
                  *((_key(f"m{i}"), i * 8192, 50, "") for i in range(20))]
        for key, offset, size, owner in second:
            one.publish(key, offset, size, owner)
        assert many.publish_many(second) == 21
        assert one.tombstones == many.tombstones
        for key in [k for k, *_r in first + second]:
            assert one.location(key) == many.location(key)
            assert one.slot_of(key) == many.slot_of(key)
        # The shared segment itself (slots, seqs, owner tags) is byte for byte the same.
        assert bytes(one._buf[HEADER_BYTES:]) == bytes(many._buf[HEADER_BYTES:])
        # Past the load limit both refuse the same keys.
        full = [(_key(f"f{i}"), 0, 1, "") for i in range(64)]
        taken = sum(one.publish(*item) for item in full)
        assert many.publish_many(full) == taken and one.refused == many.refused
    finally:
        one.close()
        many.close()


def test_a_batch_reserved_slot_makes_its_view_only_when_asked() -> None:
    with DramTier(1 << 20) as tier:
        slots = tier.reserve_many([_key("v0"), _key("v1")], [4096, 4096])
        s0, s1 = slots
        assert not isinstance(s0, Exception) and not isinstance(s1, Exception)
        assert s0._buffer is None  # no view per slot
        s0.buffer[:] = b"\x07" * 4096
        tier.commit_many([s0, s1])
        for slot in (s0, s1):  # made and released, or never made: refused either way
            with pytest.raises(ValueError):
                slot.buffer[0] = 1
        out = bytearray(4096)
        tier.get_into(_key("v0"), out)
        assert out == b"\x07" * 4096

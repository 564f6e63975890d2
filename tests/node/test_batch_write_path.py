"""The batched same-host write path (issue 13) on a real DRAM tier with its read index: a scoped
session's batches are one batch for its tenant (owners, visibility and quota per chunk, as
item-by-item reserves give), the read index publishes a batch as ``publish`` would one by one,
a batch commit's events go to the event log in one call, and a batch-reserved slot makes its
arena view only when asked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from xxhash import xxh3_64_intdigest

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.read_index import MAX_LOAD, ReadIndex
from kvstore.dataplane.read_index_layout import (
    BODY_STRUCT,
    HEADER_BYTES,
    KEY_AT,
    SEQ_STRUCT,
    SLOT_SHIFT,
    SlotState,
    owner_tag,
)
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.errors import ChunkExists, InvalidArgument, PermissionDenied, QuotaExceeded
from kvstore.node.backend import ShmLeases
from kvstore.node.cache import ChunkChange, ChunkChangeKind, TieredCache
from kvstore.node.events import EventLog
from kvstore.node.index import SHARED_TENANT
from kvstore.node.tenants import TenantQuota

DRAM = TierKind.DRAM
EMPTY, LIVE, TOMB = SlotState.EMPTY.value, SlotState.LIVE.value, SlotState.TOMBSTONE.value
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


class _TableModel:
    """A naive model of the read index's table (linear probing, tombstones, one rebuild when a
    new key would fill it past ``MAX_LOAD``), to check the segment the index writes."""

    def __init__(self, slots: int) -> None:
        self.slots: list[tuple[int, bytes, int, int, int]] = [(EMPTY, b"", 0, 0, 0)] * slots
        self.entries: dict[bytes, int] = {}
        self.tombstones = 0
        self.refused = 0
        self.max_used = int(slots * MAX_LOAD)

    def _probe(self, key: bytes) -> int:
        i = xxh3_64_intdigest(key) % len(self.slots)
        while self.slots[i][0] == LIVE:
            i = (i + 1) % len(self.slots)
        return i

    def publish(self, key: bytes, offset: int, size: int, owner: str) -> bool:
        row = (LIVE, key, offset, size, owner_tag(owner))
        if key in self.entries:
            self.slots[self.entries[key]] = row
            return True
        i = self._probe(key)
        if self.slots[i][0] != TOMB and len(self.entries) + self.tombstones >= self.max_used:
            if not self.tombstones:
                self.refused += 1
                return False
            live = [(k, self.slots[j]) for k, j in self.entries.items()]
            self.slots = [(EMPTY, b"", 0, 0, 0)] * len(self.slots)
            self.entries, self.tombstones = {}, 0
            for k, old in live:
                j = self._probe(k)
                self.slots[j] = old
                self.entries[k] = j
            i = self._probe(key)
            if len(self.entries) >= self.max_used:
                self.refused += 1
                return False
        if self.slots[i][0] == TOMB:
            self.tombstones -= 1
        self.slots[i] = row
        self.entries[key] = i
        return True

    def unpublish(self, key: bytes) -> None:
        n = len(self.slots)
        i = self.entries.pop(key)
        if self.slots[(i + 1) % n][0] != EMPTY:
            self.slots[i] = (TOMB, b"", 0, 0, 0)
            self.tombstones += 1
            return
        self.slots[i] = (EMPTY, b"", 0, 0, 0)
        j = (i - 1) % n
        while self.slots[j][0] == TOMB:
            self.slots[j] = (EMPTY, b"", 0, 0, 0)
            self.tombstones -= 1
            j = (j - 1) % n


def _segment_rows(index: ReadIndex, slots: int) -> list[tuple[int, bytes, int, int, int]]:
    """Each slot of the shared segment as (state, key, offset, size, tag); every seq even."""
    rows = []
    for i in range(slots):
        at = HEADER_BYTES + (i << SLOT_SHIFT)
        seq, = SEQ_STRUCT.unpack_from(index._buf, at)
        assert seq % 2 == 0, f"slot {i} left half-written"
        offset, size, state, key_len, lo, hi = BODY_STRUCT.unpack_from(index._buf, at + 8)
        if state == LIVE:
            key = bytes(index._buf[at + KEY_AT:at + KEY_AT + key_len])
            rows.append((state, key, offset, size, lo | hi << 16))
        else:
            rows.append((state, b"", 0, 0, 0))
    return rows


def test_publish_and_publish_many_write_the_table_a_naive_model_predicts() -> None:
    """Byte for byte (slots, seqs, owner tags): new keys, re-published keys, keys on
    tombstones, a rebuild in the middle of a batch, refusals past the load limit, and the
    reader finds every published key at its place."""
    slots = 64
    index = ReadIndex.create(slots, arena_name="a", arena_bytes=1 << 30)
    model = _TableModel(slots)

    def publish_many(items: list[tuple[bytes, int, int, str]]) -> None:
        assert index.publish_many(items) == sum(model.publish(*item) for item in items)

    try:
        first = [(_key(f"k{i}"), i * 4096, 100 + i, "alice" if i % 2 else "") for i in range(40)]
        publish_many(first[:30])
        for item in first[30:]:
            assert index.publish(*item) == model.publish(*item)
        for key, *_rest in first[::3]:
            assert index.unpublish(key)
            model.unpublish(key)
        assert _segment_rows(index, slots) == model.slots
        # A re-publish of a live key, then new keys (some land on tombstones).
        publish_many([(_key("k1"), 9 * 4096, 7, "bob"),
                      *((_key(f"m{i}"), i * 8192, 50, "") for i in range(10))])
        assert _segment_rows(index, slots) == model.slots
        assert index.tombstones == model.tombstones
        # Tombstones that would fill the table: one batch rebuilds in its middle (the rows
        # before the rebuild written first), then refuses past the limit.
        for key in [k for k in model.entries if k.startswith(b"m")][:8]:
            assert index.unpublish(key)
            model.unpublish(key)
        rebuilds = index.rebuilds
        publish_many([(_key(f"f{i}"), i, 1 + i, "carol") for i in range(30)])
        assert index.rebuilds == rebuilds + 1 and index.refused == model.refused > 0
        assert _segment_rows(index, slots) == model.slots
        assert index.tombstones == model.tombstones == 0
        for key, at in model.entries.items():
            assert index.slot_of(key) == at
            assert index.location(key) == model.slots[at][2:4]
    finally:
        index.close()


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

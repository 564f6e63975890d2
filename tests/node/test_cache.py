"""The tiered cache over the real DRAM tier (shared memory) and the real NVMe tier (files, fsync)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.errors import CapacityError, ChunkCorrupt, ChunkExists, ChunkNotFound, InvalidArgument
from kvstore.node.cache import CacheConfig, ChunkChange, ChunkChangeKind, TieredCache
from kvstore.node.policies import PolicyName

KiB = 1 << 10
MiB = 1 << 20
CHUNK = 64 * KiB


def chunk(i: int, size: int = CHUNK) -> bytes:
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return f"block-{i:06d}".encode()


def chain_keys(n: int, start: int = 0) -> list[bytes]:
    return [key(i) for i in range(start, start + n)]


def read(cache: TieredCache, k: bytes, size: int = CHUNK) -> bytes:
    dst = bytearray(size)
    cache.get_into(k, dst)
    return bytes(dst)


def assert_no_orphans(cache: TieredCache) -> None:
    """Every copy a tier holds is indexed (as the primary or the backing copy), every indexed
    copy is held, and no chunk is cached without its parent."""
    for tier in cache.tiers.values():
        for info in tier.chunks():
            entry = cache.entry(info.key)
            assert entry is not None, f"{info.key!r} is in {tier.kind.value} but not indexed"
            assert tier.kind in (entry.tier, entry.backing)
            assert cache.tier(entry.tier).contains(info.key)
            if entry.backing is not None:
                assert cache.tier(entry.backing).contains(info.key)
            if entry.parent is not None:
                assert cache.entry(entry.parent) is not None, f"{info.key!r} is an orphan"
    for kind, tier in cache.tiers.items():
        assert cache.index.usage(kind).entries == tier.stats().chunks, kind


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Path:
    return tmp_path / "nvme"


def make_cache(nvme_dir: Path, *, dram_bytes: int = 16 * CHUNK, nvme_bytes: int = 4 * MiB,
               policy: PolicyName = PolicyName.LRU,
               observer: Callable[[ChunkChange], None] | None = None,
               **config: object) -> TieredCache:
    dram = DramTier(dram_bytes)
    nvme = NvmeTier.open(NvmeTierConfig(directory=nvme_dir, capacity_bytes=nvme_bytes,
                                        segment_bytes=MiB))
    return TieredCache({TierKind.DRAM: dram, TierKind.NVME: nvme}, policy=policy,
                       config=CacheConfig(**config), observer=observer)  # type: ignore[arg-type]


@pytest.fixture
def cache(nvme_dir: Path) -> Iterator[TieredCache]:
    c = make_cache(nvme_dir)
    yield c
    c.close()


def test_put_lands_in_dram_and_reads_back(cache: TieredCache) -> None:
    cache.put(key(0), chunk(0))
    cache.put(key(1), chunk(1), parent=key(0))
    assert cache.entry(key(1)).tier is TierKind.DRAM  # type: ignore[union-attr]
    assert read(cache, key(0)) == chunk(0)
    assert read(cache, key(1)) == chunk(1)
    assert cache.lookup([key(0), key(1), key(2)]).length == 2


def test_a_chunk_without_its_cached_parent_is_refused(cache: TieredCache) -> None:
    with pytest.raises(InvalidArgument, match="parent"):
        cache.put(key(1), chunk(1), parent=key(0))
    assert key(1) not in cache
    assert not cache.tier(TierKind.DRAM).contains(key(1))


def test_chunks_are_immutable(cache: TieredCache) -> None:
    cache.put(key(0), chunk(0))
    with pytest.raises(ChunkExists):
        cache.put(key(0), chunk(1))
    assert read(cache, key(0)) == chunk(0)


def test_full_dram_demotes_to_nvme_and_everything_stays_readable(cache: TieredCache) -> None:
    keys = chain_keys(40)  # 40 x 64 KiB = 2.5 MiB through a 1 MiB DRAM tier
    assert cache.put_chain(keys, [chunk(i) for i in range(40)]) == 40
    where = cache.lookup(keys)
    assert where.length == 40
    assert where.count(TierKind.NVME) >= 24
    assert where.count(TierKind.DRAM) <= 16
    # LRU demotes the oldest: the first blocks went down to NVMe.
    assert where.tiers[0] is TierKind.NVME and where.tiers[-1] is TierKind.DRAM
    nvme = cache.tier(TierKind.NVME)
    assert nvme.contains(keys[0]) and not cache.tier(TierKind.DRAM).contains(keys[0])
    for i, k in enumerate(keys):
        assert read(cache, k) == chunk(i), i
    assert_no_orphans(cache)
    demoted = {r.kind: r.counters for r in cache.report()}[TierKind.DRAM].demotions_out
    assert demoted >= 24


def test_a_hit_in_nvme_promotes_to_dram(cache: TieredCache) -> None:
    keys = chain_keys(30)
    cache.put_chain(keys, [chunk(i) for i in range(30)])
    assert cache.entry(keys[0]).tier is TierKind.NVME  # type: ignore[union-attr]
    nvme_used = cache.index.usage(TierKind.NVME).used_bytes
    assert read(cache, keys[0]) == chunk(0)
    entry = cache.entry(keys[0])
    assert entry is not None and entry.tier is TierKind.DRAM
    # The promotion copied: NVMe keeps its copy (issue 12), and still counts it.
    assert entry.backing is TierKind.NVME
    assert cache.tier(TierKind.NVME).contains(keys[0])
    assert cache.tier(TierKind.DRAM).contains(keys[0])
    # + the DRAM victim demoted to make room; the promoted chunk's NVMe copy still counts.
    assert cache.index.usage(TierKind.NVME).used_bytes == nvme_used + CHUNK
    assert read(cache, keys[0]) == chunk(0)
    assert_no_orphans(cache)


def test_no_promotion_when_disabled(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir, promote_on_hit=False)
    try:
        keys = chain_keys(30)
        cache.put_chain(keys, [chunk(i) for i in range(30)])
        read(cache, keys[0])
        assert cache.entry(keys[0]).tier is TierKind.NVME  # type: ignore[union-attr]
    finally:
        cache.close()


def test_last_tier_drops_leaves_first_and_never_orphans(nvme_dir: Path) -> None:
    # NVMe of 1 MiB holds ~12 chunks of 64 KiB (+4 KiB header each); many chains overflow both tiers.
    cache = make_cache(nvme_dir, dram_bytes=4 * CHUNK, nvme_bytes=MiB)
    try:
        for c in range(12):
            root = key(10_000 + c)
            keys = [root, *chain_keys(3, start=c * 10)]
            cache.put_chain(keys, [chunk(c * 100 + j) for j in range(4)])
            assert_no_orphans(cache)
        assert len(cache) < 48
        for tier in cache.tiers.values():
            for info in tier.chunks():
                assert cache.entry(info.key) is not None
    finally:
        cache.close()


def test_put_fails_cleanly_when_everything_is_pinned(nvme_dir: Path) -> None:
    dram = DramTier(4 * CHUNK)
    cache = TieredCache({TierKind.DRAM: dram})
    try:
        keys = chain_keys(4)
        cache.put_chain(keys, [chunk(i) for i in range(4)])
        lease = cache.pin(keys)
        with pytest.raises(CapacityError):
            cache.put(key(100), chunk(100))
        assert key(100) not in cache and not dram.contains(key(100))
        for i, k in enumerate(keys):
            assert read(cache, k) == chunk(i)
        cache.unpin(lease)
        cache.put(key(100), chunk(100))  # room again once unpinned
        assert read(cache, key(100)) == chunk(100)
    finally:
        cache.close()


def test_corrupt_nvme_chunk_is_dropped_with_its_descendants(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir, promote_on_hit=False)
    try:
        keys = chain_keys(30)
        cache.put_chain(keys, [chunk(i) for i in range(30)])
        victim = keys[3]
        assert cache.entry(victim).tier is TierKind.NVME  # type: ignore[union-attr]
        loc = cache.tier(TierKind.NVME).record_location(victim)  # type: ignore[attr-defined]
        assert loc is not None
        with open(loc.path, "r+b") as f:  # flip payload bytes on disk
            f.seek(loc.payload_offset + 100)
            f.write(b"\xff" * 8)
            f.flush()
        dsts = [bytearray(CHUNK) for _ in keys]
        loaded = cache.load_prefix(keys, dsts)
        assert loaded == 3  # stops before the corrupt block; the caller recomputes the rest
        assert [bytes(d) for d in dsts[:3]] == [chunk(i) for i in range(3)]
        assert cache.lookup(keys).length == 3
        with pytest.raises(ChunkNotFound):
            read(cache, keys[10])
        assert_no_orphans(cache)
        # Already stored chunks above the corruption stay readable.
        assert read(cache, keys[2]) == chunk(2)
    finally:
        cache.close()


def test_corrupt_chunk_read_directly_raises(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir, promote_on_hit=False)
    try:
        keys = chain_keys(30)
        cache.put_chain(keys, [chunk(i) for i in range(30)])
        loc = cache.tier(TierKind.NVME).record_location(keys[0])  # type: ignore[attr-defined]
        with open(loc.path, "r+b") as f:
            f.seek(loc.payload_offset)
            f.write(b"\x00" * 16)
        with pytest.raises(ChunkCorrupt):
            read(cache, keys[0])
        assert len(cache) == 0  # everything hung under block 0
    finally:
        cache.close()


def test_recover_rebuilds_the_index_with_parents_after_restart(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir, dram_bytes=4 * CHUNK)
    keys = chain_keys(20)
    cache.put_chain(keys, [chunk(i) for i in range(20)])
    on_nvme = [k for k in keys if cache.entry(k).tier is TierKind.NVME]  # type: ignore[union-attr]
    assert len(on_nvme) >= 16
    cache.close()  # DRAM contents are gone; NVMe stays

    reopened = make_cache(nvme_dir, dram_bytes=4 * CHUNK)
    try:
        report = reopened.recover()
        assert report.recovered == len(on_nvme)
        assert reopened.lookup(keys).length == len(on_nvme)  # the prefix, in order
        for i, k in enumerate(on_nvme):
            assert reopened.entry(k).parent == (keys[i - 1] if i else None)  # type: ignore[union-attr]
            assert read(reopened, k) == chunk(i)
        assert_no_orphans(reopened)
    finally:
        reopened.close()


def test_load_prefix_reports_partial_hits(cache: TieredCache) -> None:
    keys = chain_keys(5)
    cache.put_chain(keys[:3], [chunk(i) for i in range(3)])
    dsts = [bytearray(CHUNK) for _ in keys]
    assert cache.load_prefix(keys, dsts) == 3
    assert cache.load_prefix([key(99)], [bytearray(CHUNK)]) == 0


def test_evict_by_bytes_demotes(cache: TieredCache) -> None:
    keys = chain_keys(8)
    cache.put_chain(keys, [chunk(i) for i in range(8)])
    freed = cache.evict(TierKind.DRAM, 3 * CHUNK)
    assert freed >= 3 * CHUNK
    assert cache.lookup(keys).count(TierKind.NVME) >= 3
    for i, k in enumerate(keys):
        assert read(cache, k) == chunk(i)


@pytest.mark.parametrize("policy", [p for p in PolicyName if p is not PolicyName.BELADY])
def test_every_online_policy_keeps_data_readable(nvme_dir: Path, policy: PolicyName) -> None:
    cache = make_cache(nvme_dir, policy=policy)
    try:
        keys = chain_keys(40)
        cache.put_chain(keys, [chunk(i) for i in range(40)])
        for i, k in enumerate(keys):
            if k in cache:
                assert read(cache, k) == chunk(i)
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_persist_then_recover_keeps_whole_chains(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir, dram_bytes=4 * CHUNK)
    keys = chain_keys(10)
    cache.put_chain(keys, [chunk(i) for i in range(10)])
    assert cache.lookup(keys).count(TierKind.DRAM) == 4
    assert cache.persist() == 4 * CHUNK
    assert cache.lookup(keys).count(TierKind.NVME) == 10
    cache.close()

    reopened = make_cache(nvme_dir, dram_bytes=4 * CHUNK)
    try:
        assert reopened.recover().recovered == 10
        assert reopened.lookup(keys).length == 10
        for i, k in enumerate(keys):
            assert read(reopened, k) == chunk(i)
    finally:
        reopened.close()


def test_record_reads_counts_reads_of_chunks_still_in_the_tier(cache: TieredCache) -> None:
    """Lease-free reads reported after the fact: a hit per read of a key still in DRAM, one
    recency refresh per distinct key; keys moved to NVMe or gone are skipped."""
    for i in range(4):
        cache.put(key(i), chunk(i))
    cache.evict(TierKind.DRAM, CHUNK)  # LRU: key(0) goes down to NVMe
    assert cache.entry(key(0)).tier is TierKind.NVME  # type: ignore[union-attr]
    before = {k: cache.entry(k) for k in (key(1), key(2), key(3))}
    hits_before = {r.kind: r.counters for r in cache.report()}[TierKind.DRAM].hits
    got = cache.record_reads([key(1), key(1), key(2), key(0), b"never-stored", key(1)])
    assert got == (4, 4 * CHUNK)
    dram = {r.kind: r.counters for r in cache.report()}[TierKind.DRAM]
    assert dram.hits - hits_before == 4 and dram.bytes_read >= 4 * CHUNK
    after = {k: cache.entry(k) for k in before}
    for k in (key(1), key(2)):
        assert after[k].access_count == before[k].access_count + 1  # type: ignore[union-attr]
        assert after[k].last_access_s >= before[k].last_access_s  # type: ignore[union-attr]
    assert after[key(3)] == before[key(3)]
    # Recency: key(1) and key(2) were refreshed, so key(3) is now the oldest in DRAM.
    cache.evict(TierKind.DRAM, CHUNK)
    assert cache.entry(key(3)).tier is TierKind.NVME  # type: ignore[union-attr]


# -- copies: a promotion keeps the NVMe copy; durable puts write through (issue 12) -------------


def counters(cache: TieredCache, kind: TierKind):  # type: ignore[no-untyped-def]
    return {r.kind: r.counters for r in cache.report()}[kind]


def disk_digest(nvme_dir: Path) -> str:
    """A digest of every segment file's bytes: equal before and after means nothing was written."""
    h = hashlib.sha256()
    for path in sorted(nvme_dir.glob("seg-*.kvt")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def promoted_pair(cache: TieredCache) -> None:
    """key(0) <- key(1), both on NVMe, then both read back into DRAM (promoted copies)."""
    cache.put(key(0), chunk(0))
    cache.put(key(1), chunk(1), parent=key(0))
    cache.evict(TierKind.DRAM, 2 * CHUNK)
    assert cache.lookup([key(0), key(1)]).tiers == (TierKind.NVME, TierKind.NVME)
    assert read(cache, key(0)) == chunk(0) and read(cache, key(1)) == chunk(1)
    for k in (key(0), key(1)):
        entry = cache.entry(k)
        assert entry is not None and (entry.tier, entry.backing) == (TierKind.DRAM, TierKind.NVME)


def test_evicting_a_backed_dram_copy_writes_nothing_to_nvme(nvme_dir: Path) -> None:
    events: list[ChunkChange] = []
    cache = make_cache(nvme_dir, observer=events.append)
    try:
        promoted_pair(cache)
        nvme = cache.tier(TierKind.NVME)
        before = (disk_digest(nvme_dir), nvme.stats(), counters(cache, TierKind.NVME).bytes_written,
                  cache.index.usage(TierKind.NVME))
        events.clear()
        assert cache.evict(TierKind.DRAM, 2 * CHUNK) == 2 * CHUNK
        after = (disk_digest(nvme_dir), nvme.stats(), counters(cache, TierKind.NVME).bytes_written,
                 cache.index.usage(TierKind.NVME))
        assert after == before  # a drop of the DRAM copy: no byte written, NVMe unchanged
        assert cache.index.usage(TierKind.DRAM).used_bytes == 0
        assert not cache.tier(TierKind.DRAM).contains(key(0))
        for k in (key(0), key(1)):
            entry = cache.entry(k)
            assert entry is not None and (entry.tier, entry.backing) == (TierKind.NVME, None)
        # The conductor learns that the fastest copy is now the NVMe one.
        assert sorted((e.kind, e.key, e.tier, e.from_tier) for e in events) == [
            (ChunkChangeKind.MOVED, key(i), TierKind.NVME, TierKind.DRAM) for i in (0, 1)]
        assert read(cache, key(1)) == chunk(1)
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_promotion_events_name_the_fastest_copy(nvme_dir: Path) -> None:
    events: list[ChunkChange] = []
    cache = make_cache(nvme_dir, observer=events.append)
    try:
        cache.put(key(0), chunk(0))
        cache.evict(TierKind.DRAM, CHUNK)
        events.clear()
        assert read(cache, key(0)) == chunk(0)
        assert [(e.kind, e.tier, e.from_tier) for e in events] == [
            (ChunkChangeKind.MOVED, TierKind.DRAM, TierKind.NVME)]
    finally:
        cache.close()


def test_remove_drops_every_copy_with_one_event_per_chunk(nvme_dir: Path) -> None:
    events: list[ChunkChange] = []
    cache = make_cache(nvme_dir, observer=events.append)
    try:
        promoted_pair(cache)
        events.clear()
        assert sorted(cache.remove(key(0))) == [key(0), key(1)]
        for kind in (TierKind.DRAM, TierKind.NVME):
            assert not cache.tier(kind).contains(key(0)) and not cache.tier(kind).contains(key(1))
            usage = cache.index.usage(kind)
            assert (usage.used_bytes, usage.entries) == (0, 0), kind
        assert sorted((e.kind, e.key) for e in events) == [
            (ChunkChangeKind.REMOVED, key(0)), (ChunkChangeKind.REMOVED, key(1))]
        assert_no_orphans(cache)
    finally:
        cache.close()
    reopened = make_cache(nvme_dir)
    try:
        assert reopened.recover().recovered == 0  # the NVMe copies are gone too
    finally:
        reopened.close()


def test_a_corrupt_backing_copy_is_found_when_it_is_read_and_drops_the_subtree(
        nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir)
    try:
        promoted_pair(cache)
        loc = cache.tier(TierKind.NVME).record_location(key(0))  # type: ignore[attr-defined]
        with open(loc.path, "r+b") as f:
            f.seek(loc.payload_offset + 100)
            f.write(b"\xff" * 8)
        assert read(cache, key(0)) == chunk(0)  # reads use the fastest copy: DRAM, intact
        cache.evict(TierKind.DRAM, 2 * CHUNK)  # DRAM copies dropped: NVMe is the only copy
        with pytest.raises(ChunkCorrupt):
            read(cache, key(0))
        assert cache.entry(key(0)) is None and cache.entry(key(1)) is None
        assert counters(cache, TierKind.NVME).corrupt == 1
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_promoting_chain_roots_keeps_every_chain_recoverable(nvme_dir: Path) -> None:
    """Before issue 12 a promotion moved the root out of NVMe, and recovery then dropped every
    descendant as an orphan."""
    cache = make_cache(nvme_dir, dram_bytes=8 * CHUNK, nvme_bytes=4 * MiB)
    chains = [chain_keys(6, start=100 * c) for c in range(6)]
    for c, keys in enumerate(chains):
        assert cache.put_chain(keys, [chunk(100 * c + i) for i in range(6)]) == 6
    cache.evict(TierKind.DRAM, cache.index.usage(TierKind.DRAM).used_bytes)
    for c, keys in enumerate(chains):
        assert read(cache, keys[0]) == chunk(100 * c)
        assert cache.entry(keys[0]).tier is TierKind.DRAM  # type: ignore[union-attr]
    cache.close()  # like a kill -9: DRAM is gone, nothing was persisted

    reopened = make_cache(nvme_dir, dram_bytes=8 * CHUNK, nvme_bytes=4 * MiB)
    try:
        report = reopened.recover()
        assert (report.recovered, report.dropped_orphans) == (36, 0)
        for c, keys in enumerate(chains):
            for i, k in enumerate(keys):
                assert read(reopened, k) == chunk(100 * c + i)
    finally:
        reopened.close()


def test_nvme_usage_counts_backing_copies_and_stats_stay_truthful(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir)
    try:
        promoted_pair(cache)
        dram, nvme = cache.index.usage(TierKind.DRAM), cache.index.usage(TierKind.NVME)
        assert (dram.used_bytes, dram.entries) == (2 * CHUNK, 2)
        assert (nvme.used_bytes, nvme.entries) == (2 * CHUNK, 2)
        stats = {r.kind: r.stats for r in cache.report()}
        assert stats[TierKind.DRAM].chunks == 2 and stats[TierKind.NVME].chunks == 2
        assert_no_orphans(cache)
    finally:
        cache.close()


def durable_cache(nvme_dir: Path, **kw: object) -> TieredCache:
    return make_cache(nvme_dir, write_tier=TierKind.NVME, **kw)  # type: ignore[arg-type]


def test_a_durable_reserve_commit_is_on_nvme_when_commit_returns(nvme_dir: Path) -> None:
    """write_tier=nvme: a zero-copy put into DRAM (the daemon's TCP/UCX/shm puts) is written
    through to NVMe before commit returns; DRAM keeps a clean copy."""
    cache = durable_cache(nvme_dir)
    assert cache.durable_tier is TierKind.NVME
    slot = cache.reserve(key(0), CHUNK, tier=TierKind.DRAM)
    slot.buffer[:] = chunk(0)
    assert not cache.tier(TierKind.NVME).contains(key(0))
    cache.commit(slot, tier=TierKind.DRAM)
    assert cache.tier(TierKind.NVME).contains(key(0))
    slot = cache.reserve(key(1), CHUNK, parent=key(0), tier=TierKind.DRAM)
    slot.buffer[:] = chunk(1)
    cache.commit(slot, parent=key(0), tier=TierKind.DRAM)
    cache.put(key(2), chunk(2), parent=key(1), tier=TierKind.DRAM)  # a put into DRAM, too
    for k in (key(0), key(1), key(2)):
        entry = cache.entry(k)
        assert entry is not None and (entry.tier, entry.backing) == (TierKind.DRAM, TierKind.NVME)
    assert read(cache, key(1)) == chunk(1)
    assert_no_orphans(cache)
    cache.close()  # like a kill -9: no persist

    reopened = durable_cache(nvme_dir)
    try:
        assert reopened.recover().recovered == 3
        for i in range(3):
            assert read(reopened, key(i)) == chunk(i)
        assert reopened.entry(key(2)).parent == key(1)  # type: ignore[union-attr]
    finally:
        reopened.close()


def test_a_durable_commit_that_cannot_reach_nvme_publishes_nothing(nvme_dir: Path) -> None:
    cache = durable_cache(nvme_dir, dram_bytes=32 * CHUNK, nvme_bytes=MiB)
    try:
        slot = cache.reserve(key(0), 2 * MiB - 4 * KiB, tier=TierKind.DRAM)  # above NVMe's size
        with pytest.raises(CapacityError):
            cache.commit(slot, tier=TierKind.DRAM)
        assert key(0) not in cache
        assert not cache.tier(TierKind.DRAM).contains(key(0))
        assert cache.index.usage(TierKind.DRAM).used_bytes == 0
        cache.abort(slot, tier=TierKind.DRAM)  # idempotent: the slot is already freed
        assert cache.tier(TierKind.DRAM).stats().used_bytes == 0
    finally:
        cache.close()


def test_durable_dram_eviction_drops_copies_and_a_full_nvme_drops_backing_copies_last(
        nvme_dir: Path) -> None:
    """NVMe full: NVMe-only chunks go first (the policy's order), then backing copies, oldest
    first, leaves before parents; the background demoter never drops a backing copy."""
    cache = durable_cache(nvme_dir, dram_bytes=8 * CHUNK, nvme_bytes=MiB)
    try:
        nvme = cache.tier(TierKind.NVME)
        n = nvme.capacity_bytes // (CHUNK + 4 * KiB)  # what the NVMe tier can really hold
        keys = chain_keys(n)
        for i, k in enumerate(keys):  # a chain: each commit writes NVMe first
            slot = cache.reserve(k, CHUNK, parent=keys[i - 1] if i else None, tier=TierKind.DRAM)
            slot.buffer[:] = chunk(i)
            cache.commit(slot, parent=keys[i - 1] if i else None, tier=TierKind.DRAM)
        # DRAM holds the newest 8; evicting the older ones wrote nothing (they were backed).
        assert counters(cache, TierKind.NVME).bytes_written == n * CHUNK
        assert cache.lookup(keys).count(TierKind.DRAM) == 8
        assert all(nvme.contains(k) for k in keys)
        assert cache.demote_to_low_watermark().get(TierKind.NVME, 0) == 0
        # Room for a new root: the NVMe-only chunks all have children, so they stay; the
        # oldest backing copy without a child holding a copy is the chain's last block.
        slot = cache.reserve(key(9999), CHUNK, tier=TierKind.DRAM)
        slot.buffer[:] = chunk(9999)
        cache.commit(slot, tier=TierKind.DRAM)
        assert nvme.contains(key(9999))
        assert not nvme.contains(keys[-1])
        entry = cache.entry(keys[-1])
        assert entry is not None and (entry.tier, entry.backing) == (TierKind.DRAM, None)
        assert all(nvme.contains(k) for k in keys[:-1])
        assert read(cache, keys[-1]) == chunk(n - 1)
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_a_durable_child_re_backs_a_parent_whose_nvme_copy_was_dropped(nvme_dir: Path) -> None:
    """A full NVMe dropped the parent's copy for room (the parent stays in DRAM); a child put
    later must not leave an NVMe copy whose parent has none: after a crash that child would be
    dropped as an orphan. The put writes the parent's copy again first."""
    cache = durable_cache(nvme_dir, dram_bytes=64 * CHUNK, nvme_bytes=MiB)
    nvme = cache.tier(TierKind.NVME)
    n = nvme.capacity_bytes // (CHUNK + 4 * KiB)
    parent = key(0)
    for i in range(n + 1):  # the last put takes the room of the oldest copy: the parent's
        slot = cache.reserve(key(i), CHUNK, tier=TierKind.DRAM)
        slot.buffer[:] = chunk(i)
        cache.commit(slot, tier=TierKind.DRAM)
    assert not nvme.contains(parent)
    assert cache.entry(parent).backing is None  # type: ignore[union-attr]
    child = key(5000)
    slot = cache.reserve(child, CHUNK, parent=parent, tier=TierKind.DRAM)
    slot.buffer[:] = chunk(5000)
    cache.commit(slot, parent=parent, tier=TierKind.DRAM)
    cache.put(key(5001), chunk(5001), parent=child)  # an inline put under it, too
    assert nvme.contains(parent) and nvme.contains(child) and nvme.contains(key(5001))
    assert cache.entry(parent).backing is TierKind.NVME  # type: ignore[union-attr]
    assert_no_orphans(cache)
    cache.close()  # like a kill -9

    reopened = durable_cache(nvme_dir, dram_bytes=64 * CHUNK, nvme_bytes=MiB)
    try:
        report = reopened.recover()
        assert report.dropped_orphans == 0
        assert read(reopened, key(5001)) == chunk(5001)
        assert reopened.lookup([parent, child, key(5001)]).length == 3
    finally:
        reopened.close()


# -- batches: reserve_many / commit_many (the shm RESERVE_MANY / COMMIT_MANY path, issue 13) --------


def fill(slots: list[object], first: int = 0) -> list[object]:
    for i, slot in enumerate(slots):
        slot.buffer[:] = chunk(first + i)  # type: ignore[attr-defined]
    return slots


def test_reserve_many_commit_many_store_a_chain_with_one_event_per_chunk_in_order(
        nvme_dir: Path) -> None:
    changes: list[ChunkChange] = []
    cache = make_cache(nvme_dir, observer=changes.append)
    try:
        keys = chain_keys(6)
        slots = cache.reserve_many(keys, [CHUNK] * 6, [None, *keys[:-1]], tier=TierKind.DRAM)
        fill(slots)
        assert all(k not in cache for k in keys)  # invisible until committed
        infos = cache.commit_many(slots, [None, *keys[:-1]], tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert [i.key for i in infos] == keys  # type: ignore[union-attr]
        assert [(c.kind, c.key, c.tier, c.parent) for c in changes] == [
            (ChunkChangeKind.STORED, k, TierKind.DRAM, p) for k, p in zip(keys, [None, *keys[:-1]],
                                                                          strict=True)]
        assert [read(cache, k) for k in keys] == [chunk(i) for i in range(6)]
        assert cache.entry(keys[3]).parent == keys[2]  # type: ignore[union-attr]
        counters = {r.kind: r.counters for r in cache.report()}[TierKind.DRAM]
        assert (counters.puts, counters.bytes_written) == (6, 6 * CHUNK)
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_a_failure_in_the_middle_of_a_batch_fails_its_descendants_only(nvme_dir: Path) -> None:
    """Item 2 exists already (not a failure: its child may follow it), item 3 is refused (bad
    size): item 4, its child, and item 5 under that fail too; a second root stores."""
    cache = make_cache(nvme_dir)
    try:
        cache.put(key(2), chunk(2), parent=None)
        keys = [key(0), key(1), key(2), key(3), key(4), key(5), key(9)]
        parents = [None, key(0), None, key(2), key(3), key(4), None]
        sizes = [CHUNK, CHUNK, CHUNK, 0, CHUNK, CHUNK, CHUNK]
        out = cache.reserve_many(keys, sizes, parents, tier=TierKind.DRAM)
        assert isinstance(out[2], ChunkExists)
        assert isinstance(out[3], InvalidArgument)
        assert isinstance(out[4], InvalidArgument) and "parent" in str(out[4])
        assert isinstance(out[5], InvalidArgument) and "parent" in str(out[5])
        ok = [(k, p, s) for k, p, s in zip(keys, parents, out, strict=True)
              if not isinstance(s, Exception)]
        assert [k for k, _p, _s in ok] == [key(0), key(1), key(9)]
        # Committing in an order where the child comes first: it is freed, not published.
        slots = [ok[1][2], ok[0][2], ok[2][2]]
        fill(slots)
        infos = cache.commit_many(slots, [key(0), None, None], tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert isinstance(infos[0], InvalidArgument) and not isinstance(infos[1], Exception)
        assert key(1) not in cache and key(0) in cache and key(9) in cache
        assert not cache.tier(TierKind.DRAM).contains(key(1))
        assert cache.index.usage(TierKind.DRAM).used_bytes == 3 * CHUNK
        assert cache.tier(TierKind.DRAM).stats().used_bytes == 3 * CHUNK
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_commit_many_refuses_a_chunk_whose_parent_was_dropped_meanwhile(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir)
    try:
        cache.put(key(0), chunk(0))
        slots = cache.reserve_many([key(1), key(2), key(3)], [CHUNK] * 3,
                                   [key(0), key(1), None], tier=TierKind.DRAM)
        fill(slots)
        cache.remove(key(0))  # the parent goes between reserve and commit
        out = cache.commit_many(slots, [key(0), key(1), None], tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert isinstance(out[0], InvalidArgument) and isinstance(out[1], InvalidArgument)
        assert not isinstance(out[2], Exception)
        assert read(cache, key(3)) == chunk(2)
        assert len(cache) == 1
        assert cache.tier(TierKind.DRAM).stats().used_bytes == CHUNK
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_reserve_many_evicts_once_for_the_whole_batch(nvme_dir: Path) -> None:
    cache = make_cache(nvme_dir, dram_bytes=8 * CHUNK)
    try:
        old = chain_keys(8, start=100)
        assert cache.put_chain(old, [chunk(i) for i in range(8)]) == 8
        keys = chain_keys(4)
        slots = cache.reserve_many(keys, [CHUNK] * 4, [None, *keys[:-1]], tier=TierKind.DRAM)
        assert not any(isinstance(s, Exception) for s in slots)
        fill(slots)
        cache.commit_many(slots, [None, *keys[:-1]], tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert [cache.entry(k).tier for k in old[4:]] == [TierKind.DRAM] * 4  # type: ignore[union-attr]
        assert [cache.entry(k).tier for k in old[:4]] == [TierKind.NVME] * 4  # type: ignore[union-attr]
        assert [read(cache, k) for k in keys] == [chunk(i) for i in range(4)]
        assert_no_orphans(cache)
    finally:
        cache.close()


def test_a_durable_commit_many_writes_each_chunk_to_nvme_before_publishing_it(
        nvme_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_tier=nvme: each chunk's NVMe record exists when its DRAM slot is published (the
    write-through comes first), one STORED event per chunk, and the chain survives a restart."""
    changes: list[ChunkChange] = []
    cache = durable_cache(nvme_dir, observer=changes.append)
    dram, nvme = cache.tier(TierKind.DRAM), cache.tier(TierKind.NVME)
    on_nvme: list[bool] = []
    publish = dram.commit  # type: ignore[attr-defined]

    def checked_publish(slot: object) -> object:
        on_nvme.append(nvme.contains(slot.key))  # type: ignore[attr-defined]
        return publish(slot)

    monkeypatch.setattr(dram, "commit", checked_publish)
    try:
        keys = chain_keys(4)
        parents = [None, *keys[:-1]]
        slots = cache.reserve_many(keys, [CHUNK] * 4, parents, tier=TierKind.DRAM)
        fill(slots)
        assert not any(cache.tier(TierKind.NVME).contains(k) for k in keys)
        out = cache.commit_many(slots, parents, tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert not any(isinstance(o, Exception) for o in out)
        assert on_nvme == [True] * 4
        assert [c.key for c in changes] == keys
        for k in keys:
            entry = cache.entry(k)
            assert entry is not None
            assert (entry.tier, entry.backing) == (TierKind.DRAM, TierKind.NVME)
        assert_no_orphans(cache)
    finally:
        cache.close()
    reopened = durable_cache(nvme_dir)
    try:
        assert reopened.recover().recovered == 4
        assert [read(reopened, k) for k in keys] == [chunk(i) for i in range(4)]
    finally:
        reopened.close()


def test_a_durable_commit_many_that_cannot_reach_nvme_fails_that_chunk_and_its_children(
        nvme_dir: Path) -> None:
    cache = durable_cache(nvme_dir, dram_bytes=64 * CHUNK, nvme_bytes=MiB)
    try:
        keys = [key(0), key(1), key(2), key(3)]
        parents = [None, key(0), key(1), None]
        sizes = [CHUNK, 2 * MiB - 4 * KiB, CHUNK, CHUNK]  # key(1) is larger than NVMe
        slots = cache.reserve_many(keys, sizes, parents, tier=TierKind.DRAM)
        assert not any(isinstance(s, Exception) for s in slots)
        out = cache.commit_many(slots, parents, tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert isinstance(out[1], CapacityError) and isinstance(out[2], InvalidArgument)
        assert not isinstance(out[0], Exception) and not isinstance(out[3], Exception)
        assert sorted(cache.tier(TierKind.NVME).contains(k) for k in keys) == [False, False,
                                                                               True, True]
        assert key(1) not in cache and key(2) not in cache
        assert cache.tier(TierKind.DRAM).stats().used_bytes == 2 * CHUNK
        assert_no_orphans(cache)
    finally:
        cache.close()


@pytest.mark.parametrize("tier_batch", [True, False], ids=["tier-batch", "per-item"])
@pytest.mark.parametrize("write_tier", [TierKind.DRAM, TierKind.NVME])
def test_commit_many_frees_the_descendants_of_a_slot_the_tier_refuses(
        nvme_dir: Path, write_tier: TierKind, tier_batch: bool) -> None:
    """A parent's slot that can no longer be committed (aborted meanwhile) fails, and its child
    and grandchild in the same batch are freed, never published (not indexed, not in the tier,
    not in the read index), while an unrelated root is stored; with write_tier=nvme too (each
    chunk written through before it is published), and through the per-item path a tier
    without batch calls gets (HBM)."""
    changes: list[ChunkChange] = []
    cache = make_cache(nvme_dir, observer=changes.append, write_tier=write_tier)
    if not tier_batch:
        cache._batch_memory.clear()  # as for a host-memory tier without reserve_many
    try:
        keys = [*chain_keys(3), key(50)]
        parents = [None, keys[0], keys[1], None]
        slots = cache.reserve_many(keys, [CHUNK] * 4, parents, tier=TierKind.DRAM)
        fill(slots)  # type: ignore[arg-type]
        cache.abort(slots[0], tier=TierKind.DRAM)  # type: ignore[arg-type]
        out = cache.commit_many(slots, parents, tier=TierKind.DRAM)  # type: ignore[arg-type]
        assert all(isinstance(o, InvalidArgument) for o in out[:3])
        assert not isinstance(out[3], Exception)
        dram = cache.tier(TierKind.DRAM)
        for k in keys[:3]:
            assert k not in cache and not dram.contains(k)
        assert read(cache, key(50)) == chunk(3)
        assert [c.key for c in changes] == [key(50)]
        assert dram.stats().used_bytes == CHUNK
        assert_no_orphans(cache)
    finally:
        cache.close()

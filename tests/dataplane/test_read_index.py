"""The read index (lease-free same-host reads): the table, the seqlock, and the DRAM tier's hook.

Everything runs on real shared memory: a :class:`DramTier` with its read index as the writer, and a
:class:`ReadIndexReader` over a read-only attachment of the same segments as the reader (as a
client process maps them). The daemon-level tests are in ``tests/node/test_lease_free.py``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from kvstore.dataplane.arena import ArenaAccess, ShmArena
from kvstore.dataplane.compress import CodecKind, CodecSpec
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.read_index import ReadIndex, ReadIndexReader, ReadResult, slots_for
from kvstore.dataplane.read_index_layout import (
    HEADER_BYTES,
    MIN_SLOTS,
    SLOT_BYTES,
    SlotState,
    lease_free_supported,
)
from kvstore.dataplane.tier import Tier
from kvstore.errors import InvalidArgument, TierUnavailable
from tests.support.native import built_extension

from .tier_conformance import HostMemoryTierConformance, KiB, MiB, TierFactory

pytestmark = pytest.mark.skipif(not lease_free_supported(),
                                reason="lease-free reads need Linux on x86-64")

SLOTS = MIN_SLOTS  # 64 slots, 48 usable: small enough to fill and to wrap around


def pattern(tag: int, size: int) -> np.ndarray:
    """Bytes derived from ``tag``: a read of another chunk (or a torn one) cannot match."""
    return np.random.default_rng(tag).integers(0, 256, size, dtype=np.uint8)


def keys_hashing_to(slot: int, count: int, slots: int = SLOTS) -> list[bytes]:
    """``count`` distinct keys whose home slot is ``slot``."""
    found: list[bytes] = []
    i = 0
    while len(found) < count:
        key = b"home-%d-%d" % (slot, i)
        if xxhash.xxh3_64_intdigest(key) & (slots - 1) == slot:
            found.append(key)
        i += 1
    return found


class Pair:
    """A DRAM tier with a read index, and a reader mapping both read-only."""

    def __init__(self, capacity_bytes: int = 4 * MiB, slots: int = SLOTS,
                 codec: CodecSpec | None = None) -> None:
        self.tier = DramTier(capacity_bytes, read_index_slots=slots, codec=codec)
        index = self.tier.read_index
        assert index is not None
        self.index: ReadIndex = index
        self.arena = ShmArena.attach(self.tier.arena_name)
        self.reader = ReadIndexReader.attach(self.tier.read_index_name, self.arena)

    def read(self, key: bytes, size: int) -> tuple[int, np.ndarray]:
        out = np.full(size, 0xEE, dtype=np.uint8)
        return self.reader.read_into(key, memoryview(out).cast("B")), out

    def close(self) -> None:
        self.reader.close()
        self.arena.close()
        self.tier.close()


@pytest.fixture(params=["python", "native"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """Every reader test runs twice: copies in Python, and through the native extension's
    ``IndexReader`` (tests that set ``before_copy`` run in Python both times: the hook needs
    the Python copy)."""
    p = Pair()
    if request.param == "native":
        p.reader.use_extension(built_extension())
        assert p.reader.native
    yield p
    p.close()


# --- the table ---------------------------------------------------------------------------------


def test_published_chunks_are_copied_and_others_miss(pair: Pair) -> None:
    value = pattern(1, 64 * KiB)
    pair.tier.put(b"k1", value)
    loc = pair.tier.locate(b"k1")
    assert loc is not None and pair.index.location(b"k1") == (loc.offset, 64 * KiB)
    n, out = pair.read(b"k1", 64 * KiB)
    assert n == 64 * KiB and np.array_equal(out, value)
    n, out = pair.read(b"absent", 64 * KiB)
    assert n == ReadResult.MISS and (out == 0xEE).all()  # a miss copies nothing


def test_a_wrong_size_is_a_conflict_and_copies_nothing(pair: Pair) -> None:
    pair.tier.put(b"k1", pattern(1, 8 * KiB))
    n, out = pair.read(b"k1", 4 * KiB)
    assert n == ReadResult.CONFLICT and (out == 0xEE).all()


def test_remove_unpublishes_before_the_extent_is_reused(pair: Pair) -> None:
    pair.tier.put(b"k1", pattern(1, 4 * KiB))
    pair.tier.remove(b"k1")
    assert pair.index.location(b"k1") is None
    assert pair.read(b"k1", 4 * KiB)[0] == ReadResult.MISS


def test_probe_wraps_around_the_end_of_the_table_and_passes_tombstones(pair: Pair) -> None:
    a, b, c = keys_hashing_to(SLOTS - 1, 3)
    for i, key in enumerate((a, b, c)):
        pair.tier.put(key, pattern(i, 4 * KiB))
    assert [pair.index.slot_of(k) for k in (a, b, c)] == [SLOTS - 1, 0, 1]
    for i, key in enumerate((a, b, c)):
        n, out = pair.read(key, 4 * KiB)
        assert n == 4 * KiB and np.array_equal(out, pattern(i, 4 * KiB))
    # Removing b leaves a tombstone (c lies behind it on the same probe path)...
    pair.tier.remove(b)
    assert pair.index.slot_state(0) is SlotState.TOMBSTONE and pair.index.tombstones == 1
    n, out = pair.read(c, 4 * KiB)
    assert n == 4 * KiB and np.array_equal(out, pattern(2, 4 * KiB))
    # ...removing c (the path's end) empties its slot and the tombstone before it.
    pair.tier.remove(c)
    assert pair.index.slot_state(1) is SlotState.EMPTY
    assert pair.index.slot_state(0) is SlotState.EMPTY and pair.index.tombstones == 0
    assert pair.read(a, 4 * KiB)[0] == 4 * KiB
    # A new key reuses the first free slot on its path.
    (d,) = [k for k in keys_hashing_to(SLOTS - 1, 4) if k not in (a, b, c)]
    pair.tier.put(d, pattern(3, 4 * KiB))
    assert pair.index.slot_of(d) == 0


def test_a_full_table_refuses_and_the_chunk_stays_readable_through_the_tier(pair: Pair) -> None:
    usable = SLOTS * 3 // 4
    for i in range(usable):
        pair.tier.put(b"full-%d" % i, pattern(i, 4 * KiB))
    assert len(pair.index) == usable and pair.index.refused == 0
    pair.tier.put(b"one-too-many", pattern(99, 4 * KiB))
    assert pair.index.refused == 1 and pair.index.location(b"one-too-many") is None
    assert pair.read(b"one-too-many", 4 * KiB)[0] == ReadResult.MISS  # the leased path serves it
    out = np.empty(4 * KiB, np.uint8)
    pair.tier.get_into(b"one-too-many", out)
    assert np.array_equal(out, pattern(99, 4 * KiB))
    for i in range(usable):  # every published one still reads right
        n, got = pair.read(b"full-%d" % i, 4 * KiB)
        assert n == 4 * KiB and np.array_equal(got, pattern(i, 4 * KiB))


def test_tombstones_are_rebuilt_away_when_they_would_fill_the_table(pair: Pair) -> None:
    usable = SLOTS * 3 // 4
    keys = [b"t-%d" % i for i in range(usable)]
    for i, key in enumerate(keys):
        pair.tier.put(key, pattern(i, 4 * KiB))
    for key in keys[::2]:
        pair.tier.remove(key)
    assert pair.index.tombstones > 0
    live = keys[1::2]
    # Keep adding new keys: the table must never refuse while live keys fit.
    fresh = [b"fresh-%d" % i for i in range(usable - len(live))]
    for i, key in enumerate(fresh):
        pair.tier.put(key, pattern(1000 + i, 4 * KiB))
    assert pair.index.refused == 0
    assert len(pair.index) == usable
    for key in live:
        n, got = pair.read(key, 4 * KiB)
        assert n == 4 * KiB and np.array_equal(got, pattern(keys.index(key), 4 * KiB))
    for i, key in enumerate(fresh):
        n, got = pair.read(key, 4 * KiB)
        assert n == 4 * KiB and np.array_equal(got, pattern(1000 + i, 4 * KiB))


def test_keys_of_every_legal_length_round_trip(pair: Pair) -> None:
    for length in (1, 16, 32, 48, 64):
        key = bytes([length]) * length
        pair.tier.put(key, pattern(length, 4 * KiB))
        n, got = pair.read(key, 4 * KiB)
        assert n == 4 * KiB and np.array_equal(got, pattern(length, 4 * KiB))
    assert pair.read(b"\x10" * 15, 4 * KiB)[0] == ReadResult.MISS  # a prefix is another key


def test_compressed_chunks_are_never_published() -> None:
    p = Pair(codec=CodecSpec(kind=CodecKind.ZSTD, level=1))
    try:
        zeros = np.zeros(64 * KiB, np.uint8)  # compresses: stored as a frame
        p.tier.put(b"squeezed", zeros)
        assert p.tier.is_zero_copy(b"squeezed") is False
        assert p.index.location(b"squeezed") is None
        assert p.read(b"squeezed", 64 * KiB)[0] == ReadResult.MISS
        noise = pattern(5, 64 * KiB)  # does not compress: stored raw, published
        p.tier.put(b"raw", noise)
        assert p.tier.is_zero_copy(b"raw") is True
        n, got = p.read(b"raw", 64 * KiB)
        assert n == 64 * KiB and np.array_equal(got, noise)
        slot = p.tier.reserve(b"reserved-zeros", 64 * KiB)  # commit compresses too
        slot.buffer[:] = bytes(64 * KiB)
        p.tier.commit(slot)
        assert p.index.location(b"reserved-zeros") is None
    finally:
        p.close()


def test_pending_writes_are_invisible_until_commit(pair: Pair) -> None:
    slot = pair.tier.reserve(b"pending", 4 * KiB)
    slot.buffer[:] = pattern(7, 4 * KiB).tobytes()
    assert pair.read(b"pending", 4 * KiB)[0] == ReadResult.MISS
    pair.tier.commit(slot)
    n, got = pair.read(b"pending", 4 * KiB)
    assert n == 4 * KiB and np.array_equal(got, pattern(7, 4 * KiB))
    aborted = pair.tier.reserve(b"aborted", 4 * KiB)
    pair.tier.abort(aborted)
    assert pair.read(b"aborted", 4 * KiB)[0] == ReadResult.MISS


# --- the seqlock -------------------------------------------------------------------------------


def test_a_seq_bumped_during_the_copy_is_retried(pair: Pair) -> None:
    value = pattern(1, 16 * KiB)
    pair.tier.put(b"k1", value)
    offset, size = pair.index.location(b"k1") or (0, 0)
    calls = []

    def republish() -> None:  # same place, same bytes: only the seq moves on
        calls.append(1)
        if len(calls) == 1:
            pair.index.publish(b"k1", offset, size)

    pair.reader.before_copy = republish
    n, out = pair.read(b"k1", 16 * KiB)
    assert n == 16 * KiB and np.array_equal(out, value)
    assert len(calls) == 2 and pair.reader.retries == 1


def test_an_odd_seq_is_never_read_and_gives_up_as_a_conflict(pair: Pair) -> None:
    pair.tier.put(b"k1", pattern(1, 4 * KiB))
    slot = pair.index.slot_of(b"k1")
    assert slot is not None
    at = HEADER_BYTES + slot * SLOT_BYTES
    raw = ShmArena.attach(pair.tier.read_index_name, access=ArenaAccess.READ_WRITE)
    try:
        seq = np.frombuffer(raw.view(at, 8, readonly=False), dtype=np.uint64)
        seq[0] += 1  # "being written"
        n, out = pair.read(b"k1", 4 * KiB)
        assert n == ReadResult.CONFLICT and (out == 0xEE).all()
        seq[0] += 1  # written
        assert pair.read(b"k1", 4 * KiB)[0] == 4 * KiB
        del seq
    finally:
        raw.close()


def test_a_chunk_removed_and_its_extent_reused_during_the_copy_is_rejected(pair: Pair) -> None:
    """The ordering guarantee: remove + a new put into the same extent between the reader's
    seq1 and its copy. The copy then holds the new chunk's bytes, and the re-read of seq must
    reject it (without the check this read would return another chunk's bytes)."""
    old, new = pattern(1, 64 * KiB), pattern(2, 64 * KiB)
    pair.tier.put(b"victim", old)
    victim_at = pair.tier.locate(b"victim")
    assert victim_at is not None
    reused = []

    def remove_and_reuse() -> None:
        if reused:
            return
        pair.tier.remove(b"victim")
        pair.tier.put(b"newcomer", new)
        loc = pair.tier.locate(b"newcomer")
        reused.append(loc is not None and loc.offset == victim_at.offset)

    pair.reader.before_copy = remove_and_reuse
    n, out = pair.read(b"victim", 64 * KiB)
    assert reused == [True], "the test must reuse the very extent being read"
    assert np.array_equal(out, new), "the copy did read the reused extent"
    assert n == ReadResult.MISS and pair.reader.retries == 1  # rejected, then not found


def test_a_closed_index_serves_nothing(pair: Pair) -> None:
    pair.tier.put(b"k1", pattern(1, 4 * KiB))
    assert pair.reader.alive()
    pair.tier.close()
    assert not pair.reader.alive()
    assert pair.read(b"k1", 4 * KiB)[0] in (ReadResult.MISS, ReadResult.DEAD)
    with pytest.raises(InvalidArgument):  # unlinked: a new client cannot even attach
        ReadIndexReader.attach(pair.tier.read_index_name, pair.arena)


@pytest.mark.parametrize("copier", ["python", "native"])
def test_a_killed_owner_is_seen_by_the_next_read(copier: str) -> None:
    """``kill -9`` of the process owning the index: its segments stay mapped here, frozen, with
    the chunk still published; the next read must say DEAD, not return the bytes."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from kvstore.dataplane.dram import DramTier
        t = DramTier(1 << 20, read_index_slots=64)
        t.put(b"k", np.full(4096, 7, np.uint8))
        print(t.arena_name, t.read_index_name, flush=True)
        sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    names: list[str] = []
    try:
        assert proc.stdout is not None
        names = proc.stdout.readline().split()
        arena_name, index_name = names
        arena = ShmArena.attach(arena_name)
        reader = ReadIndexReader.attach(index_name, arena)
        if copier == "native":
            reader.use_extension(built_extension())
        out = np.empty(4096, np.uint8)
        assert reader.read_into(b"k", memoryview(out)) == 4096 and (out == 7).all()
        proc.kill()
        proc.wait(10)
        assert not reader.alive()
        assert reader.read_into(b"k", memoryview(out)) == ReadResult.DEAD
        with pytest.raises(TierUnavailable):
            ReadIndexReader.attach(index_name, arena)
        reader.close()
        arena.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        for name in names:  # the dead owner could not unlink them
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


def test_an_index_of_another_arena_is_refused(pair: Pair) -> None:
    with DramTier(1 * MiB) as other:
        other_arena = ShmArena.attach(other.arena_name)
        try:
            with pytest.raises(InvalidArgument):
                ReadIndexReader.attach(pair.tier.read_index_name, other_arena)
        finally:
            other_arena.close()


def test_slot_counts() -> None:
    assert slots_for(256 * MiB) == 8192
    assert slots_for(64 * KiB) == MIN_SLOTS
    with pytest.raises(InvalidArgument):
        ReadIndex.create(100, arena_name="x", arena_bytes=4096)


# --- the tier contract still holds with an index, and the index follows the tier ---------------


class TestDramTierWithReadIndexConformance(HostMemoryTierConformance):
    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        tiers: list[DramTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = DramTier(capacity_bytes, read_index_slots=1024)
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            index = tier.read_index
            if index is not None and not tier._table._closed:
                # Every chunk the tier holds is published where the tier says, and nothing else.
                held = {info.key for info in tier.chunks()}
                assert len(index) == len(held)
                for key in held:
                    loc = tier.locate(key)
                    assert loc is not None
                    assert index.location(key) == (loc.offset, loc.size_bytes)
            tier.close()


@pytest.mark.parametrize("size", [4 * KiB, 4 * KiB + 37, 64 * KiB, 100_003, 1 * MiB])
def test_copies_land_whole_at_any_destination_offset(pair: Pair, size: int) -> None:
    """The native copier takes a vector loop when the destination's page offset differs from
    the arena's (``copy_out`` in fastpath.c): head, body and tail must all land, nothing past."""
    value = pattern(size, size)
    pair.tier.put(b"odd", value)
    backing = np.full(size + 8 * KiB, 0xEE, dtype=np.uint8)
    base = -backing.ctypes.data % 4096  # the first page-aligned byte of backing
    for offset in (0, 1, 16, 31, 2048):
        backing[:] = 0xEE
        out = backing[base + offset:base + offset + size]
        assert pair.reader.read_into(b"odd", memoryview(out).cast("B")) == size
        assert np.array_equal(out, value), offset
        assert (backing[:base + offset] == 0xEE).all() and (backing[base + offset + size:] == 0xEE).all()

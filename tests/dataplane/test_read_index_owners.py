"""The read index's owner tags (issue 15): every published chunk carries its owning tenant's
tag, and a reader attached with ``owners`` copies only those owners' chunks; any other is a miss
(the caller's leased, tenant-checked path decides). Real shared memory: a :class:`DramTier` with
its read index as the writer and a read-only attachment as the reader, through the Python reader
and the native one. The daemon-level tests are in ``tests/security/test_read_index_tenants.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.dataplane.arena import ShmArena
from kvstore.dataplane.dram import DramTier, writing_for
from kvstore.dataplane.read_index import ReadIndexReader, ReadResult
from kvstore.dataplane.read_index_layout import (
    HEADER_BYTES,
    KEY_AT,
    MIN_SLOTS,
    SLOT_BYTES,
    SLOT_STRUCT,
    TAG_HI_AT,
    TAG_LO_AT,
    lease_free_supported,
    owner_tag,
)
from kvstore.errors import InvalidArgument
from tests.support.native import built_extension

pytestmark = pytest.mark.skipif(not lease_free_supported(),
                                reason="lease-free reads need Linux on x86-64")

SHARED = "kvtier.shared"
SIZE = 4096


def chunk(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, SIZE, dtype=np.uint8)


@pytest.fixture(params=["python", "native"])
def reader_kind(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and built_extension() is None:
        pytest.skip("the native extension is not built")
    return str(request.param)


@pytest.fixture
def tier() -> Iterator[DramTier]:
    t = DramTier(1 << 20, read_index_slots=MIN_SLOTS)
    yield t
    t.close()


class Readers:
    """Readers of one tier's index, each with its owners, all of the same kind."""

    def __init__(self, tier: DramTier, kind: str) -> None:
        self._tier = tier
        self._kind = kind
        self._open: list[tuple[ShmArena, ReadIndexReader]] = []

    def __call__(self, owners: tuple[str, ...] | None) -> ReadIndexReader:
        arena = ShmArena.attach(self._tier.arena_name)
        reader = ReadIndexReader.attach(self._tier.read_index_name, arena, owners=owners)
        if self._kind == "native":
            reader.use_extension(built_extension())
            assert reader.native and reader.fast_get is not None
        self._open.append((arena, reader))
        return reader

    def close(self) -> None:
        for arena, reader in self._open:
            reader.close()
            arena.close()


@pytest.fixture
def readers(tier: DramTier, reader_kind: str) -> Iterator[Readers]:
    r = Readers(tier, reader_kind)
    yield r
    r.close()


def read(reader: ReadIndexReader, key: bytes) -> tuple[int, np.ndarray]:
    out = np.full(SIZE, 0xEE, dtype=np.uint8)
    return reader.read_into(key, memoryview(out).cast("B")), out


def fast(reader: ReadIndexReader, key: bytes) -> tuple[int, np.ndarray]:
    """The native ``fast_get`` (StoreClient's hot path), or ``read_into`` without it."""
    out = np.full(SIZE, 0xEE, dtype=np.uint8)
    if reader.fast_get is None:
        return reader.read_into(key, memoryview(out).cast("B")), out
    return int(reader.fast_get(key, out)), out


def store(tier: DramTier, owners: dict[bytes, str | None]) -> dict[bytes, np.ndarray]:
    """Put each key as its owner's (None: outside ``writing_for``, the default tenant)."""
    values: dict[bytes, np.ndarray] = {}
    for i, (key, owner) in enumerate(owners.items()):
        values[key] = chunk(i)
        if owner is None:
            tier.put(key, values[key])
        else:
            with writing_for(owner):
                tier.put(key, values[key])
    return values


def slot_tag(tier: DramTier, key: bytes) -> int:
    """The owner tag in ``key``'s slot, read straight from the index's bytes."""
    index = tier.read_index
    assert index is not None
    slot = index.slot_of(key)
    assert slot is not None
    segment = ShmArena.attach(tier.read_index_name)
    try:
        view = segment.view(0, segment.size_bytes)
        at = HEADER_BYTES + slot * SLOT_BYTES
        fields = SLOT_STRUCT.unpack_from(view, at)
        assert bytes(view[at + KEY_AT:at + KEY_AT + len(key)]) == key
        lo = int.from_bytes(view[at + TAG_LO_AT:at + TAG_LO_AT + 2], "little")
        hi = int.from_bytes(view[at + TAG_HI_AT:at + TAG_HI_AT + 4], "little")
        assert (fields[5], fields[6]) == (lo, hi)
        view.release()
    finally:
        segment.close()
    return lo | hi << 16


def test_each_slot_carries_its_owners_tag(tier: DramTier) -> None:
    store(tier, {b"a": "alice", b"b": "bob", b"s": SHARED, b"d": None})
    assert slot_tag(tier, b"a") == owner_tag("alice")
    assert slot_tag(tier, b"b") == owner_tag("bob")
    assert slot_tag(tier, b"s") == owner_tag(SHARED)
    assert slot_tag(tier, b"d") == owner_tag("")  # the default tenant
    assert len({owner_tag(t) for t in ("alice", "bob", SHARED, "")}) == 4
    assert all(0 <= owner_tag(t) < 1 << 48 for t in ("alice", "bob"))


def test_a_scoped_reader_copies_only_its_own_and_shared_chunks(tier: DramTier,
                                                               readers: Readers) -> None:
    values = store(tier, {b"alice-1": "alice", b"bob-1": "bob", b"shared-1": SHARED,
                          b"default-1": None})
    alice = readers(("alice", SHARED))
    for get in (read, fast):
        n, out = get(alice, b"alice-1")
        assert n == SIZE and np.array_equal(out, values[b"alice-1"])
        n, out = get(alice, b"shared-1")
        assert n == SIZE and np.array_equal(out, values[b"shared-1"])
        for foreign in (b"bob-1", b"default-1"):
            n, out = get(alice, foreign)
            assert n == ReadResult.MISS
            assert (out == 0xEE).all()  # nothing of it was copied
        assert alice.locate(b"bob-1") is None and alice.locate(b"default-1") is None
        assert alice.locate(b"alice-1") is not None and alice.locate(b"shared-1") is not None
    # Bob's reader is the mirror image; an unscoped one (no security) reads every chunk.
    bob = readers(("bob", SHARED))
    assert read(bob, b"bob-1")[0] == SIZE and read(bob, b"alice-1")[0] == ReadResult.MISS
    anyone = readers(None)
    for key, value in values.items():
        n, out = fast(anyone, key)
        assert n == SIZE and np.array_equal(out, value)
        assert anyone.locate(key) is not None


def test_a_reader_with_no_owners_copies_nothing(tier: DramTier, readers: Readers) -> None:
    store(tier, {b"alice-1": "alice", b"default-1": None})
    nobody = readers(())
    for key in (b"alice-1", b"default-1"):
        assert read(nobody, key)[0] == ReadResult.MISS
        assert fast(nobody, key)[0] == ReadResult.MISS
        assert nobody.locate(key) is None


def test_reserved_slots_keep_the_owner_they_were_reserved_under(tier: DramTier,
                                                                readers: Readers) -> None:
    with writing_for("alice"):
        one = tier.reserve(b"alice-r", SIZE)
        (two,) = tier.reserve_many([b"alice-m"], [SIZE])
    bob_slot = tier.reserve(b"default-r", SIZE)  # outside writing_for: the default tenant
    for slot, seed in ((one, 1), (two, 2), (bob_slot, 3)):
        np.frombuffer(slot.buffer, dtype=np.uint8)[:] = chunk(seed)
    with writing_for("bob"):  # the committing thread's owner does not matter
        tier.commit(one)
        tier.commit_many([two, bob_slot])
    assert slot_tag(tier, b"alice-r") == slot_tag(tier, b"alice-m") == owner_tag("alice")
    assert slot_tag(tier, b"default-r") == owner_tag("")
    alice = readers(("alice",))
    assert read(alice, b"alice-r")[0] == read(alice, b"alice-m")[0] == SIZE
    assert read(alice, b"default-r")[0] == ReadResult.MISS


def test_writing_for_nests_and_ends(tier: DramTier) -> None:
    with writing_for("alice"):
        with writing_for("bob"):
            tier.put(b"inner", chunk(1))
        tier.put(b"outer", chunk(2))
    tier.put(b"after", chunk(3))
    assert slot_tag(tier, b"inner") == owner_tag("bob")
    assert slot_tag(tier, b"outer") == owner_tag("alice")
    assert slot_tag(tier, b"after") == owner_tag("")


def test_tags_survive_a_rebuild_and_follow_a_replaced_chunk(tier: DramTier,
                                                            readers: Readers) -> None:
    index = tier.read_index
    assert index is not None
    with writing_for("alice"):
        tier.put(b"k", chunk(1))
    alice = readers(("alice",))
    assert read(alice, b"k")[0] == SIZE
    # Removed and stored again by another tenant under the same key: the new publish is bob's.
    assert tier.remove(b"k")
    with writing_for("bob"):
        tier.put(b"k", chunk(2))
    assert read(alice, b"k")[0] == ReadResult.MISS
    # Tombstones, then new keys until the writer rebuilds the table: every tag is kept.
    usable = MIN_SLOTS * 3 // 4 - 1
    keys = [b"t-%d" % i for i in range(usable)]
    with writing_for("alice"):
        for key in keys:
            tier.put(key, chunk(3))
    for key in keys[::2]:
        tier.remove(key)
    with writing_for("alice"):
        for i in range(len(keys[::2])):
            tier.put(b"fresh-%d" % i, chunk(4))
    assert index.rebuilds >= 1 and index.refused == 0
    assert slot_tag(tier, b"k") == owner_tag("bob")
    assert read(readers(("bob",)), b"k")[0] == SIZE
    for key in [*keys[1::2], b"fresh-0"]:
        assert slot_tag(tier, key) == owner_tag("alice")
        assert read(alice, key)[0] == SIZE


def test_more_than_two_owners_or_non_names_are_refused(tier: DramTier) -> None:
    arena = ShmArena.attach(tier.arena_name)
    try:
        with pytest.raises(InvalidArgument, match="at most two owners"):
            ReadIndexReader.attach(tier.read_index_name, arena, owners=("a", "b", "c"))
        with pytest.raises(InvalidArgument):
            ReadIndexReader.attach(tier.read_index_name, arena,
                                   owners=(b"alice",))  # type: ignore[arg-type]
    finally:
        arena.close()

"""GroupedDramTier: the DRAM tier as one arena per tenant group plus the default one (issue 15,
docs/dram-arena.md "Arenas per tenant group"). The host-memory conformance suite, then what is
specific: writes land in the writer's arena (``writing_for``), a key lives in one arena, the
segments carry their group's gid and mode, a full arena is full whatever the others hold, and
bad groups are refused. The cache over it (capacity isolation, demotion and promotion keeping
a chunk in its group's arena): tests/security/test_arena_groups_cache.py.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

import pytest

from kvstore.dataplane.arena import SHM_DIR, ArenaAccess, ShmArena
from kvstore.dataplane.dram import (
    DEFAULT_ARENA,
    ArenaGroup,
    DramSlot,
    GroupedDramTier,
    writing_for,
)
from kvstore.dataplane.tier import Tier
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
)

from .tier_conformance import HostMemoryTierConformance, KiB, MiB, TierFactory

GID_A = 4242


class TestGroupedDramTierConformance(HostMemoryTierConformance):
    """The contract, for the default arena's writers (the suite writes as no tenant)."""

    @pytest.fixture
    def make_tier(self) -> Iterator[TierFactory]:
        tiers: list[GroupedDramTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = GroupedDramTier(capacity_bytes + 64 * KiB,
                                   [ArenaGroup("g", frozenset({"someone"}), 64 * KiB)])
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            tier.close()


@pytest.fixture
def tier() -> Iterator[GroupedDramTier]:
    t = GroupedDramTier(4 * MiB, [ArenaGroup("a", frozenset({"alice", "carol"}), MiB, GID_A),
                                  ArenaGroup("b", frozenset({"bob"}), MiB)],
                        read_index_slots=64)
    try:
        yield t
    finally:
        t.close()


def _content(name: str) -> bytes:
    arena = ShmArena.attach(name, access=ArenaAccess.READ_ONLY)
    try:
        return bytes(arena.view(0, arena.size_bytes))
    finally:
        arena.close()


def test_each_tenants_chunks_land_in_its_groups_arena_and_read_back(
        tier: GroupedDramTier) -> None:
    values = {"alice": os.urandom(8 * KiB), "carol": os.urandom(8 * KiB),
              "bob": os.urandom(8 * KiB), "dave": os.urandom(8 * KiB), "": os.urandom(8 * KiB)}
    for tenant, value in values.items():
        with writing_for(tenant):
            tier.put(f"k-{tenant}".encode(), value)
    expected = {"alice": "a", "carol": "a", "bob": "b", "dave": DEFAULT_ARENA,
                "": DEFAULT_ARENA}
    for tenant, value in values.items():
        key = f"k-{tenant}".encode()
        assert tier.arena_of(tenant) == expected[tenant]
        for name in ("a", "b", DEFAULT_ARENA):
            part = tier.arena(name)
            assert part.contains(key) is (name == expected[tenant])
            assert (_content(part.arena_name).find(value) >= 0) is (name == expected[tenant])
        out = bytearray(len(value))
        assert tier.get_into(key, out) == len(value) and out == value
        assert bytes(tier.view(key)) == value
        location = tier.locate(key)
        assert location is not None
        assert _content(tier.arena(expected[tenant]).arena_name)[
            location.offset:location.offset + len(value)] == value
        read_index = tier.arena(expected[tenant]).read_index
        assert read_index is not None and read_index.location(key) == (location.offset,
                                                                       len(value))
    assert tier.stats().chunks == 5 and len(list(tier.chunks())) == 5
    assert tier.remove(b"k-bob") and not tier.contains(b"k-bob")
    with pytest.raises(ChunkNotFound):
        tier.get_into(b"k-bob", bytearray(8 * KiB))


def test_reserved_slots_and_batches_land_in_the_writers_arena(tier: GroupedDramTier) -> None:
    value = os.urandom(12 * KiB)
    with writing_for("bob"):
        slot = tier.reserve(b"slot", len(value))
        got = tier.reserve_many([b"m1", b"m2"], [4 * KiB, 4 * KiB])
    slot.buffer[:] = value
    tier.commit(slot)
    assert all(isinstance(s, DramSlot) for s in got)
    assert all(not isinstance(r, Exception) for r in tier.commit_many(got))  # type: ignore[arg-type]
    for key in (b"slot", b"m1", b"m2"):
        assert tier.arena("b").contains(key) and not tier.arena(DEFAULT_ARENA).contains(key)
    assert bytes(tier.view(b"slot")) == value


def test_a_key_lives_in_one_arena(tier: GroupedDramTier) -> None:
    with writing_for("alice"):
        tier.put(b"k", b"x" * 100)
    with writing_for("bob"), pytest.raises(ChunkExists):
        tier.put(b"k", b"y" * 100)
    with writing_for("bob"), pytest.raises(ChunkExists):
        tier.reserve(b"k", 100)
    with writing_for("bob"):
        (result,) = tier.reserve_many([b"k"], [100])
    assert isinstance(result, ChunkExists)
    assert tier.arena("a").contains(b"k") and not tier.arena("b").contains(b"k")


def test_a_key_being_written_in_one_arena_is_busy_for_the_others(
        tier: GroupedDramTier) -> None:
    """Two writers of one key in different arenas at once: the second is ChunkBusy (each arena
    alone would take it, and the key would then live in two arenas)."""
    with writing_for("alice"):
        slot = tier.reserve(b"k", 4 * KiB)
    with writing_for("bob"):
        with pytest.raises(ChunkBusy, match="another arena"):
            tier.put(b"k", b"b" * 100)
        with pytest.raises(ChunkBusy):
            tier.reserve(b"k", 100)
        (busy,) = tier.reserve_many([b"k"], [100])
        assert isinstance(busy, ChunkBusy)
    tier.abort(slot)  # the write ended: bob may write the key now
    with writing_for("bob"):
        tier.put(b"k", b"b" * 100)
    assert tier.arena("b").contains(b"k") and not tier.arena("a").contains(b"k")
    with writing_for("alice"):
        slots = tier.reserve_many([b"m", b"n"], [4 * KiB, 4 * KiB])
    assert all(not isinstance(r, Exception) for r in tier.commit_many(slots))  # type: ignore[arg-type]
    with writing_for("bob"), pytest.raises(ChunkExists):  # committed: held, no longer busy
        tier.put(b"m", b"b" * 100)


def test_a_full_arena_is_full_while_the_others_have_room(tier: GroupedDramTier) -> None:
    with writing_for("bob"):
        tier.put(b"b0", b"b" * (MiB - 64 * KiB))
        with pytest.raises(CapacityError):
            tier.put(b"b1", b"b" * (128 * KiB))
    with writing_for("alice"):
        tier.put(b"a0", b"a" * (128 * KiB))  # room in alice's arena, untouched by bob's
    tier.put(b"d0", b"d" * (128 * KiB))


def test_the_segments_belong_to_their_group_with_its_mode(tier: GroupedDramTier) -> None:
    def mode_gid(name: str) -> tuple[int, int]:
        st = os.stat(os.path.join(SHM_DIR, name))
        return stat.S_IMODE(st.st_mode), st.st_gid

    a, b, default = tier.arena("a"), tier.arena("b"), tier.arena(DEFAULT_ARENA)
    assert mode_gid(a.arena_name) == (0o660, GID_A)
    assert mode_gid(a.read_index_name) == (0o640, GID_A)
    assert mode_gid(b.arena_name)[0] == mode_gid(default.arena_name)[0] == 0o600
    assert mode_gid(b.read_index_name)[0] == 0o600
    assert tier.capacity_bytes == 4 * MiB
    assert tier.arena_name == default.arena_name
    names = [a.arena_name, a.read_index_name, b.arena_name, default.arena_name]
    tier.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)


@pytest.mark.parametrize(("groups", "message"), [
    ([], "at least one arena group"),
    ([ArenaGroup("a", frozenset({"x"}), MiB), ArenaGroup("a", frozenset({"y"}), MiB)],
     "two arena groups are named 'a'"),
    ([ArenaGroup("a", frozenset({"x"}), MiB), ArenaGroup("b", frozenset({"x", "y"}), MiB)],
     "tenant 'x' is in arena groups 'a' and 'b'"),
    ([ArenaGroup("a", frozenset({"x"}), 2 * MiB), ArenaGroup("b", frozenset({"y"}), 2 * MiB)],
     "leaving the default arena"),
])
def test_bad_groups_are_refused_and_leave_nothing_behind(groups: list[ArenaGroup],
                                                         message: str) -> None:
    before = set(os.listdir(SHM_DIR))
    with pytest.raises(InvalidArgument, match=message):
        GroupedDramTier(4 * MiB, groups)
    assert set(os.listdir(SHM_DIR)) == before


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"name": "bad name", "tenants": frozenset({"x"}), "capacity_bytes": MiB}, "name"),
    ({"name": "a", "tenants": frozenset(), "capacity_bytes": MiB}, "non-empty"),
    ({"name": "a", "tenants": frozenset({"x"}), "capacity_bytes": 0}, "capacity_bytes"),
    ({"name": "a", "tenants": frozenset({"x"}), "capacity_bytes": MiB, "gid": -1}, "gid"),
])
def test_an_arena_group_validates_itself(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        ArenaGroup(**kwargs)  # type: ignore[arg-type]

"""The conductor's global prefix index: events, resync rules, node removal, flat lookups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.index import (
    ChunkEvent,
    ChunkEventKind,
    EventOutcome,
    GlobalPrefixIndex,
    ResyncKind,
    ResyncNeed,
    TierCounts,
)
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, KVDtype, KVFingerprint, Namespace

HBM, DRAM, NVME = TierKind.HBM, TierKind.DRAM, TierKind.NVME
STORED, REMOVED, MOVED = ChunkEventKind.STORED, ChunkEventKind.REMOVED, ChunkEventKind.MOVED


def k(i: int) -> bytes:
    return b"key-%04d" % i


def chain(n: int, start: int = 0) -> list[bytes]:
    return [k(i) for i in range(start, start + n)]


class Daemon:
    """Numbers events the way a store daemon does (seq 1, 2, ... per epoch)."""

    def __init__(self, index: GlobalPrefixIndex, node_id: str, epoch: int = 1) -> None:
        self.index = index
        self.node_id = node_id
        self.epoch = epoch
        self.seq = 0

    def join(self, entries: list[tuple[bytes, TierKind]] | None = None) -> None:
        assert self.index.apply_snapshot(self.node_id, self.epoch, self.seq, entries or [])

    def event(self, kind: ChunkEventKind, key: bytes, tier: TierKind | None = DRAM) -> ChunkEvent:
        self.seq += 1
        return ChunkEvent(self.node_id, self.epoch, self.seq, kind, key,
                          None if kind is REMOVED else tier)

    def send(self, kind: ChunkEventKind, key: bytes, tier: TierKind | None = DRAM) -> EventOutcome:
        return self.index.apply_event(self.event(kind, key, tier))

    def store(self, keys: list[bytes], tier: TierKind = DRAM) -> None:
        for key in keys:
            assert self.send(STORED, key, tier) is EventOutcome.APPLIED

    def restart(self) -> None:
        self.epoch += 1
        self.seq = 0


@pytest.fixture
def index() -> GlobalPrefixIndex:
    return GlobalPrefixIndex()


# -- lookups -------------------------------------------------------------------


def test_match_reports_each_nodes_leading_run_and_tiers(index: GlobalPrefixIndex) -> None:
    a, b, c = Daemon(index, "a"), Daemon(index, "b"), Daemon(index, "c")
    for d in (a, b, c):
        d.join()
    a.store(chain(3), DRAM)
    b.store(chain(6)[:2], HBM)
    b.store(chain(6)[2:], NVME)
    c.store(chain(6)[1:])  # holds blocks 1..5 but not block 0: no leading run
    m = index.match(chain(8))
    assert m.lengths == {"a": 3, "b": 6}
    assert m.best_length == 6 and m.best_nodes() == ["b"]
    assert m.tier_counts("b") == TierCounts(hbm=2, dram=0, nvme=4)
    assert m.tier_counts("b", length=3) == TierCounts(hbm=2, nvme=1)
    assert m.tier_counts("a") == TierCounts(dram=3)
    assert m.tiers("b") == (HBM, HBM, NVME, NVME, NVME, NVME)
    assert m.length("c") == 0 and m.tier_counts("c") == TierCounts()
    assert index.holders(k(1)) == {"a": DRAM, "b": HBM, "c": DRAM}


def test_remove_and_move_events_update_the_run(index: GlobalPrefixIndex) -> None:
    a = Daemon(index, "a")
    a.join()
    a.store(chain(4))
    assert a.send(MOVED, k(1), NVME) is EventOutcome.APPLIED
    assert index.match(chain(4)).tiers("a") == (DRAM, NVME, DRAM, DRAM)
    assert a.send(REMOVED, k(2)) is EventOutcome.APPLIED
    assert index.match(chain(4)).lengths == {"a": 2}
    assert a.send(REMOVED, k(2)) is EventOutcome.APPLIED  # idempotent on the state
    assert index.node_blocks("a") == 3
    for i in (0, 1, 3):
        a.send(REMOVED, k(i))
    assert len(index) == 0 and index.node_blocks("a") == 0
    assert index.match(chain(4)).lengths == {}


def test_a_miss_is_an_empty_answer_and_bad_input_is_an_error(index: GlobalPrefixIndex) -> None:
    assert index.match([]).lengths == {}
    assert index.match(chain(3)).best_length == 0
    with pytest.raises(InvalidArgument):
        index.match(iter(chain(3)))  # type: ignore[arg-type]


def test_unknown_namespace_is_a_miss_not_an_error(index: GlobalPrefixIndex) -> None:
    fp = KVFingerprint("m", KVDtype.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=4,
                       block_size_tokens=4)
    known, unknown = BlockHasher(Namespace(fp, "t1")), BlockHasher(Namespace(fp, "t2"))
    tokens = list(range(16))
    a = Daemon(index, "a")
    a.join()
    a.store(known.hash_blocks(tokens))
    assert index.match_tokens(known, tokens).lengths == {"a": 4}
    # Same tokens, a namespace no node ever reported: zero, as docs/conductor.md decides.
    assert index.match_tokens(unknown, tokens).lengths == {}


# -- sequence numbers and epochs ---------------------------------------------------


def test_duplicates_are_ignored(index: GlobalPrefixIndex) -> None:
    a = Daemon(index, "a")
    a.join()
    ev = a.event(STORED, k(0))
    assert index.apply_event(ev) is EventOutcome.APPLIED
    assert index.apply_event(ev) is EventOutcome.DUPLICATE
    assert index.node_blocks("a") == 1


def test_gap_asks_for_a_replay_and_the_missing_events_heal_it(index: GlobalPrefixIndex) -> None:
    a = Daemon(index, "a")
    a.join()
    a.store(chain(2))  # seq 1, 2
    lost = a.event(STORED, k(2))  # seq 3 never arrives
    later = a.event(REMOVED, k(0))  # seq 4: a gap of exactly one event
    assert index.apply_event(later) is EventOutcome.GAP
    assert index.needs_resync("a") == ResyncNeed("a", ResyncKind.REPLAY, 1, 3)
    after = a.event(STORED, k(3))  # seq 5
    assert index.apply_event(after) is EventOutcome.AWAITING_RESYNC
    # Nothing past the gap was applied: block 0 is still there.
    assert index.match(chain(4)).lengths == {"a": 2}
    # The replay: 3, 4, 5 in order.
    assert index.apply_events([lost, later, after]) == [EventOutcome.APPLIED] * 3
    assert index.needs_resync("a") is None
    assert index.match(chain(4)).lengths == {}  # block 0 removed
    assert index.holders(k(2)) == {"a": DRAM} and index.holders(k(3)) == {"a": DRAM}
    assert index.apply_event(ChunkEvent("a", 1, 6, STORED, k(9), DRAM)) is EventOutcome.APPLIED
    assert index.holders(k(9)) == {"a": DRAM}


def test_new_epoch_drops_the_node_at_once_and_replays_from_its_first_event(
        index: GlobalPrefixIndex) -> None:
    a, b = Daemon(index, "a"), Daemon(index, "b")
    a.join()
    b.join()
    a.store(chain(3))
    b.store(chain(1))
    old = a.event(STORED, k(7))  # in flight when the daemon died
    a.restart()
    # The new epoch starts by re-announcing what NVMe kept: seq 1 is applied at once.
    assert a.send(STORED, k(0), NVME) is EventOutcome.NEW_EPOCH
    assert index.match(chain(3)).lengths == {"a": 1, "b": 1}
    assert index.match(chain(3)).tiers("a") == (NVME,)
    assert index.needs_resync("a") is None
    assert index.apply_event(old) is EventOutcome.STALE  # the retired epoch
    assert a.send(STORED, k(1), NVME) is EventOutcome.APPLIED
    assert index.match(chain(3)).lengths == {"a": 2, "b": 1}
    assert index.node_blocks("a") == 2
    with pytest.raises(InvalidArgument, match="already left"):
        index.begin_snapshot("a", 1, 0)  # a snapshot of the retired epoch


def test_new_epoch_seen_mid_stream_needs_a_replay_from_the_start(
        index: GlobalPrefixIndex) -> None:
    a = Daemon(index, "a")
    a.join()
    a.store(chain(3))
    a.restart()
    first = [a.event(STORED, k(0), NVME), a.event(STORED, k(1), NVME)]
    third = a.event(STORED, k(2), DRAM)
    assert index.apply_event(third) is EventOutcome.NEW_EPOCH
    assert index.match(chain(3)).lengths == {}  # the old epoch's blocks left at once
    need = index.needs_resync("a")
    assert need == ResyncNeed("a", ResyncKind.REPLAY, 2, 1) and need.after_seq == 0
    assert index.apply_events([*first, third]) == [EventOutcome.APPLIED] * 3
    assert index.match(chain(3)).lengths == {"a": 3} and index.needs_resync("a") is None


def test_epochs_are_opaque_ids(index: GlobalPrefixIndex) -> None:
    """The daemon draws a random hex epoch at each start: only equality means anything."""
    e1, e2 = "9f3a0c1d2b4e5f60", "0123456789abcdef"  # e2 < e1 as strings: no ordering used
    assert index.apply_snapshot("a", e1, 5, [(k(0), DRAM)])
    assert index.apply_event(ChunkEvent("a", e1, 6, STORED, k(1), DRAM)) is EventOutcome.APPLIED
    assert index.apply_event(ChunkEvent("a", e2, 1, STORED, k(0), HBM)) is EventOutcome.NEW_EPOCH
    assert index.apply_event(ChunkEvent("a", e1, 7, STORED, k(2), DRAM)) is EventOutcome.STALE
    assert index.match(chain(3)).tiers("a") == (HBM,)
    with pytest.raises(InvalidArgument):
        ChunkEvent("a", "", 1, STORED, k(0), DRAM)


def test_unknown_node_is_tracked_from_its_first_event(index: GlobalPrefixIndex) -> None:
    assert index.needs_resync("x") is None
    assert index.apply_event(ChunkEvent("x", 3, 1, STORED, k(0), DRAM)) is (
        EventOutcome.UNKNOWN_NODE)
    assert index.match(chain(2)).lengths == {"x": 1}
    assert index.needs_resync("x") is None
    # A node first heard of mid-stream needs its history: replay or snapshot.
    ev = ChunkEvent("y", "e", 7, STORED, k(0), DRAM)
    assert index.apply_event(ev) is EventOutcome.UNKNOWN_NODE
    assert index.resync_needed() == [ResyncNeed("y", ResyncKind.REPLAY, "e", 1)]
    assert index.match(chain(2)).lengths == {"x": 1}
    assert index.apply_snapshot("y", "e", 7, [(k(0), DRAM)])
    assert index.apply_event(ev) is EventOutcome.DUPLICATE  # seq 7 is in the snapshot
    assert index.apply_event(ChunkEvent("y", "e", 8, STORED, k(1), HBM)) is EventOutcome.APPLIED
    assert index.match(chain(2)).lengths == {"x": 1, "y": 2}
    assert index.resync_needed() == []
    stats = index.stats()
    assert (stats.events_applied, stats.events_dropped) == (2, 2)


def test_snapshot_is_invisible_until_commit_and_replaces_everything(
        index: GlobalPrefixIndex) -> None:
    a = Daemon(index, "a")
    a.join()
    a.store(chain(3, start=100))
    loader = index.begin_snapshot("a", 1, a.seq)
    loader.add([(key, HBM) for key in chain(2)])
    assert index.match(chain(2)).lengths == {}  # not yet visible
    assert index.match(chain(3, start=100)).lengths == {"a": 3}  # old state still answers
    assert loader.commit()
    assert index.match(chain(2)).lengths == {"a": 2}
    assert index.match(chain(3, start=100)).lengths == {}
    assert index.node_blocks("a") == 2
    with pytest.raises(InvalidArgument):
        loader.add([(k(5), DRAM)])


def test_older_loader_cannot_commit_over_a_newer_one(index: GlobalPrefixIndex) -> None:
    first = index.begin_snapshot("a", 1, 0)
    second = index.begin_snapshot("a", 1, 0)
    first.add([(k(0), DRAM)])
    second.add([(k(1), DRAM)])
    assert second.commit()
    assert not first.commit()
    assert index.holders(k(1)) == {"a": DRAM} and index.holders(k(0)) == {}


def test_events_past_the_snapshot_point_are_replayed_after_commit(
        index: GlobalPrefixIndex) -> None:
    a = Daemon(index, "a")
    a.join()
    a.store(chain(2))  # seq 1, 2
    loader = index.begin_snapshot("a", 1, 2)
    loader.add([(k(0), DRAM), (k(1), DRAM)])
    ev3 = a.event(STORED, k(2))
    assert index.apply_event(ev3) is EventOutcome.APPLIED  # reaches the old slot only
    assert loader.commit()
    assert index.needs_resync("a") == ResyncNeed("a", ResyncKind.REPLAY, 1, 3)
    assert index.apply_event(ev3) is EventOutcome.APPLIED
    assert index.match(chain(3)).lengths == {"a": 3}


def test_snapshot_input_is_validated(index: GlobalPrefixIndex) -> None:
    with pytest.raises(InvalidArgument):
        index.apply_snapshot("a", 1, 0, [(k(0), "dram")])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        index.apply_snapshot("a", 1, 0, [("k0", DRAM)])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        index.begin_snapshot("", 1, 0)
    assert index.nodes() == []


@pytest.mark.parametrize("kwargs", [
    {"seq": 0}, {"epoch": -1}, {"kind": "stored"}, {"key": b""}, {"tier": None},
    {"node_id": ""}, {"parent": "p"},
])
def test_event_validation(kwargs: dict[str, object]) -> None:
    fields: dict[str, object] = {"node_id": "a", "epoch": 1, "seq": 1, "kind": STORED,
                                 "key": b"k", "tier": DRAM}
    fields.update(kwargs)
    with pytest.raises(InvalidArgument):
        ChunkEvent(**fields)  # type: ignore[arg-type]


# -- node removal and sweeping --------------------------------------------------------


def test_removed_node_leaves_lookups_at_once_and_sweep_reclaims_it(
        index: GlobalPrefixIndex) -> None:
    a, b = Daemon(index, "a"), Daemon(index, "b")
    a.join()
    b.join()
    a.store(chain(5))
    b.store(chain(2))
    assert index.remove_node("a")
    assert not index.remove_node("a")
    assert index.match(chain(5)).lengths == {"b": 2}
    assert index.holders(k(3)) == {}
    assert a.send(STORED, k(6)) is EventOutcome.STALE  # same epoch: a dead lease's stragglers
    assert index.needs_resync("a") is None
    stats = index.stats()
    assert stats.retired_slots == 1 and stats.keys == 5  # bits still there, invisible
    assert index.sweep(max_keys=2) > 0  # bounded step
    assert index.sweep() == 0
    stats = index.stats()
    assert stats.retired_slots == 0 and stats.keys == 2
    # The freed slot is reused by the next node, which must not inherit anything.
    c = Daemon(index, "c")
    c.join()
    assert index.match(chain(5)).lengths == {"b": 2}
    c.store(chain(1))
    assert index.match(chain(5)).lengths == {"b": 2, "c": 1}
    # "a" was alive: it re-registers and sends a snapshot of the same epoch.
    a.join([(k(0), DRAM)])
    assert index.match(chain(5)).lengths == {"b": 2, "c": 1, "a": 1}
    assert a.send(STORED, k(1)) is EventOutcome.APPLIED


def test_lookup_cost_is_flat_in_index_size_and_node_count() -> None:
    """Counted operations, not timings: the probes of one lookup depend on the query only."""
    query = chain(10) + [b"absent-%d" % i for i in range(10)]

    def build(extra_keys: int, nodes: int) -> GlobalPrefixIndex:
        idx = GlobalPrefixIndex()
        for n in range(nodes):
            filler = [(b"filler-%d-%d" % (n, i), DRAM) for i in range(extra_keys // nodes)]
            head = [(key, DRAM) for key in chain(10)] if n == 0 else []
            assert idx.apply_snapshot(f"n{n}", 1, 0, head + filler)
        return idx

    answers = []
    for extra, nodes in [(1_000, 2), (100_000, 2), (1_000, 32), (100_000, 32)]:
        idx = build(extra, nodes)
        before = idx.stats().probes
        m = idx.match(query)
        assert m.probes == 11 == idx.stats().probes - before  # 10 hits and the first miss
        answers.append(m.lengths)
    assert all(a == {"n0": 10} for a in answers)


# -- a model check ----------------------------------------------------------------------

NODE_IDS = ["a", "b", "c"]
TIERS = [HBM, DRAM, NVME]

op_strategy = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(NODE_IDS), st.integers(0, 7), st.sampled_from(TIERS)),
    st.tuples(st.just("remove"), st.sampled_from(NODE_IDS), st.integers(0, 7), st.just(DRAM)),
    st.tuples(st.just("move"), st.sampled_from(NODE_IDS), st.integers(0, 7), st.sampled_from(TIERS)),
    st.tuples(st.just("drop_node"), st.sampled_from(NODE_IDS), st.just(0), st.just(DRAM)),
    st.tuples(st.just("snapshot"), st.sampled_from(NODE_IDS), st.integers(0, 7), st.sampled_from(TIERS)),
    st.tuples(st.just("sweep"), st.just("a"), st.integers(1, 5), st.just(DRAM)),
    st.tuples(st.just("restart"), st.sampled_from(NODE_IDS), st.integers(0, 7), st.sampled_from(TIERS)),
)


def _naive_lengths(model: dict[str, dict[bytes, TierKind]], keys: list[bytes]) -> dict[str, int]:
    out = {}
    for node, held in model.items():
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        if n:
            out[node] = n
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(op_strategy, max_size=60))
def test_index_matches_a_naive_model(ops: list[tuple[str, str, int, TierKind]]) -> None:
    index = GlobalPrefixIndex()
    model: dict[str, dict[bytes, TierKind]] = {}
    daemons = {n: Daemon(index, n) for n in NODE_IDS}
    for op, node, i, tier in ops:
        d = daemons[node]
        if op == "sweep":
            index.sweep(max_keys=i)
        elif op == "drop_node":
            index.remove_node(node)
            model.pop(node, None)
            d.restart()
        elif op == "snapshot":
            entries = [(k(j), tier) for j in range(i)]
            d.restart()
            assert index.apply_snapshot(node, d.epoch, 0, entries)
            model[node] = dict(entries)
        elif op == "restart":  # a new epoch whose first event re-announces one block
            d.restart()
            assert d.send(STORED, k(i), tier) in (EventOutcome.NEW_EPOCH,
                                                   EventOutcome.UNKNOWN_NODE)
            model[node] = {k(i): tier}
        elif node in model:
            kind = {"store": STORED, "remove": REMOVED, "move": MOVED}[op]
            assert d.send(kind, k(i), tier) is EventOutcome.APPLIED
            if kind is REMOVED:
                model[node].pop(k(i), None)
            elif kind is STORED or k(i) in model[node]:  # MOVED of an unknown key: ignored
                model[node][k(i)] = tier
        for start in range(0, 8, 3):
            keys = chain(8 - start, start)
            m = index.match(keys)
            assert m.lengths == _naive_lengths(model, keys)
            for n, length in m.lengths.items():
                assert m.tiers(n) == tuple(model[n][key] for key in keys[:length])
        for node_id, held in model.items():
            assert index.node_blocks(node_id) == len(held)

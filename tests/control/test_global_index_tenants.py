"""The conductor's global prefix index kept per owner tenant (conductor/index.py, "Tenants"): a
lookup for one tenant sees its own chunks and the shared tenant's, never another tenant's (also
for a key it knows or guesses), through events and snapshots, REMOVED and MOVED events (which
name no owner), node removal and sweeps; against a naive model too."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.index import ChunkEvent, ChunkEventKind, EventOutcome, GlobalPrefixIndex
from kvstore.dataplane.tier import TierKind
from kvstore.security.tenancy import DEFAULT_TENANT, SHARED_TENANT

DRAM, NVME, HBM = TierKind.DRAM, TierKind.NVME, TierKind.HBM
STORED, REMOVED, MOVED = ChunkEventKind.STORED, ChunkEventKind.REMOVED, ChunkEventKind.MOVED
TENANTS = (DEFAULT_TENANT, "alice", "bob", SHARED_TENANT)


def k(i: int) -> bytes:
    return b"key-%04d" % i


class Daemon:
    def __init__(self, index: GlobalPrefixIndex, node_id: str) -> None:
        self.index, self.node_id, self.epoch, self.seq = index, node_id, 1, 0

    def send(self, kind: ChunkEventKind, key: bytes, tier: TierKind | None = DRAM,
             tenant: str = DEFAULT_TENANT) -> EventOutcome:
        self.seq += 1
        return self.index.apply_event(ChunkEvent(
            self.node_id, self.epoch, self.seq, kind, key, None if kind is REMOVED else tier,
            tenant=tenant))

    def restart(self) -> None:
        self.epoch += 1
        self.seq = 0


def test_a_lookup_sees_its_own_and_the_shared_tenants_chunks_only() -> None:
    index = GlobalPrefixIndex()
    a, b = Daemon(index, "a"), Daemon(index, "b")
    a.send(STORED, k(0), DRAM, SHARED_TENANT)  # a system prompt everyone may read
    for i in (1, 2):
        a.send(STORED, k(i), DRAM, "alice")
    b.send(STORED, k(0), DRAM, SHARED_TENANT)
    b.send(STORED, k(1), NVME, "bob")  # the same key, bob's on node b (keys are per node)
    chain = [k(0), k(1), k(2)]
    assert index.match(chain, "alice").lengths == {"a": 3, "b": 1}
    assert index.match(chain, "bob").lengths == {"a": 1, "b": 2}
    assert index.match(chain, "mallory").lengths == {"a": 1, "b": 1}
    assert index.match(chain).lengths == {"a": 1, "b": 1}  # the default tenant: shared only
    assert index.match(chain, None).lengths == {"a": 3, "b": 2}  # every tenant
    assert index.match(chain, SHARED_TENANT).lengths == {"a": 1, "b": 1}
    # A key bob knows (or guessed) is still alice's: absent to him.
    assert index.match([k(2)], "bob").lengths == {}
    assert index.holders(k(2), "bob") == {} and index.holders(k(2), "alice") == {"a": DRAM}
    assert index.holders(k(1), None) == {"a": DRAM, "b": NVME}
    assert index.match(chain, "alice").tier_counts("b").nvme == 0  # only the shared block
    # REMOVED and MOVED name no owner: the index finds whose entry it is on that node.
    assert a.send(MOVED, k(2), HBM) is EventOutcome.APPLIED
    assert index.holders(k(2), "alice") == {"a": HBM} and index.holders(k(2), None) == {"a": HBM}
    assert b.send(REMOVED, k(1)) is EventOutcome.APPLIED
    assert index.match(chain, "bob").lengths == {"a": 1, "b": 1}
    assert index.match(chain, "alice").lengths == {"a": 3, "b": 1}
    # A MOVED of a key the node is not known to hold files nothing (under nobody).
    assert b.send(MOVED, k(5), DRAM) is EventOutcome.APPLIED
    assert index.holders(k(5), None) == {}
    assert index.node_blocks("a") == 3 and index.node_blocks("b") == 1


def test_snapshots_file_each_entry_under_its_owner_and_sweeps_clear_every_tenant() -> None:
    index = GlobalPrefixIndex()
    loader = index.begin_snapshot("a", "e1", 7)
    loader.add([(k(0), DRAM)], SHARED_TENANT)
    loader.add([(k(1), DRAM), (k(2), NVME)], "alice")
    loader.add([(k(3), DRAM)], "bob")
    assert index.match([k(0), k(1)], "alice").lengths == {}  # invisible until the commit
    assert loader.commit()
    assert index.match([k(0), k(1), k(2)], "alice").lengths == {"a": 3}
    assert index.match([k(0), k(1), k(2)], "bob").lengths == {"a": 1}
    assert index.match([k(3)], "bob").lengths == {"a": 1}
    assert len(index) == 4 and index.stats().keys == 4
    # Events after the snapshot: REMOVED finds alice's entry on this node.
    assert index.apply_event(ChunkEvent("a", "e1", 8, REMOVED, k(2))) is EventOutcome.APPLIED
    assert index.match([k(0), k(1), k(2)], "alice").lengths == {"a": 2}
    # The node leaves; a sweep in small steps clears its bits from every tenant's dict.
    index.remove_node("a")
    assert index.match([k(0), k(1)], None).lengths == {}
    remaining = index.sweep(max_keys=1)
    while remaining:
        remaining = index.sweep(max_keys=1)
    assert len(index) == 0 and index.stats().retired_slots == 0
    # The slot is reused; nothing of the old entries shows through for anyone.
    d = Daemon(index, "b")
    d.send(STORED, k(1), DRAM, "bob")
    assert index.match([k(1)], "alice").lengths == {} and index.match([k(1)], "bob").lengths == {
        "b": 1}


NODES = ("a", "b")
ops = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from(NODES), st.integers(0, 5),
              st.sampled_from(TENANTS)),
    st.tuples(st.just("remove"), st.sampled_from(NODES), st.integers(0, 5), st.just("")),
    st.tuples(st.just("move"), st.sampled_from(NODES), st.integers(0, 5), st.just("")),
    st.tuples(st.just("snapshot"), st.sampled_from(NODES), st.integers(0, 5),
              st.sampled_from(TENANTS)),
    st.tuples(st.just("drop_node"), st.sampled_from(NODES), st.just(0), st.just("")),
    st.tuples(st.just("sweep"), st.just("a"), st.integers(1, 4), st.just(""))), max_size=50)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_tenant_scoped_lookups_match_a_naive_model(
        steps: list[tuple[str, str, int, str]]) -> None:
    index = GlobalPrefixIndex()
    daemons = {n: Daemon(index, n) for n in NODES}
    model: dict[str, dict[bytes, str]] = {}  # node -> key -> owner
    for op, node, i, tenant in steps:
        d = daemons[node]
        held = model.get(node)
        if op == "store" and held is not None:
            if held.get(k(i), tenant) != tenant:
                continue  # the daemon refuses another tenant's key: no event
            d.send(STORED, k(i), DRAM, tenant)
            held[k(i)] = tenant
        elif op == "remove" and held is not None:
            d.send(REMOVED, k(i))
            held.pop(k(i), None)
        elif op == "move" and held is not None:
            d.send(MOVED, k(i), NVME)
        elif op == "snapshot":  # keys 0..i, split between the tenant and the shared one
            d.restart()
            loader = index.begin_snapshot(node, d.epoch, 0)
            loader.add([(k(j), DRAM) for j in range(i) if j % 2 == 0], tenant)
            loader.add([(k(j), DRAM) for j in range(i) if j % 2 == 1], SHARED_TENANT)
            assert loader.commit()
            model[node] = {k(j): tenant if j % 2 == 0 else SHARED_TENANT for j in range(i)}
        elif op == "drop_node":
            index.remove_node(node)
            model.pop(node, None)
            d.restart()
        elif op == "sweep":
            index.sweep(max_keys=i)
        chain = [k(j) for j in range(6)]
        for scope in (*TENANTS, "mallory", None):
            expect = {}
            for n, owned in model.items():
                length = 0
                for key in chain:
                    owner = owned.get(key)
                    if owner is None or not (scope is None or owner in (scope, SHARED_TENANT)):
                        break
                    length += 1
                if length:
                    expect[n] = length
            assert index.match(chain, scope).lengths == expect, (scope, model)
        for n, owned in model.items():
            assert index.node_blocks(n) == len(owned)

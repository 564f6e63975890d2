"""The conductor's global prefix index: which store node holds which chunk, in which tier.

Fed by the store daemons' chunk events and answers, for a request's chained
prefix keys, how many leading blocks each node holds and in which tiers. It
holds metadata only (no bytes, no buffer pointers) and never talks to a node:
the service that wires it to the daemons' event streams asks for resyncs when
:meth:`GlobalPrefixIndex.needs_resync` says so.

Shape (why lookups stay flat as the index grows)
    One dict from chunk key to a small int, the key's *placement code*: two bits
    per node slot (``0`` absent, ``1`` HBM, ``2`` DRAM, ``3`` NVMe), slot ``s``
    at bits ``2s..2s+1``. A lookup of ``k`` keys costs at most ``k`` dict probes
    plus one bit operation per probe and one per node that drops out of the
    match, whatever the number of keys indexed or nodes known: no per-node dict
    is consulted, nothing is scanned. Equal codes share one int object (see
    ``_intern``), so a block costs its key object, one dict slot and nothing
    more; ``bench/schedule.py`` measures the bytes per block at 1M and 10M.

Events, sequence numbers and epochs (the daemon side is kvstore/node/events.py)
    Each daemon numbers its chunk events ``seq = 1, 2, 3...`` within an
    ``epoch``, an opaque id (a str or an int) drawn anew at every daemon start
    and compared only for equality. Per node the index keeps the epoch, the
    epochs it has retired, and the last sequence number applied:

    * ``seq == last + 1``: applied. ``seq <= last``: a duplicate, ignored.
    * ``seq > last + 1``: a **gap** (events were lost). The event is dropped and
      the node needs a REPLAY of what follows ``last``: feed the replayed events
      to :meth:`apply_event` in order and the node is in sync again as soon as
      the missing sequence number arrives. Events past the gap are dropped until
      then (applying them out of order could resurrect a removed chunk). A
      daemon whose ring no longer holds them sends a snapshot instead.
    * an **epoch not seen before** (the daemon restarted, or first contact):
      what the index knew of the node leaves lookups at once and the node is
      tracked again from an empty state at ``last = 0``. A new epoch replayed
      from its first event rebuilds the node exactly (the daemon re-announces
      what it recovered as STORED events), so an event with ``seq == 1`` is
      simply applied; a later one is a gap (replay from the start, or snapshot).
    * an epoch the node already retired: stale, ignored.

    :meth:`apply_snapshot` (or :meth:`begin_snapshot` and a
    :class:`SnapshotLoader`) replaces everything a node holds atomically: the
    new entries are written into a fresh slot that lookups cannot see, and one
    commit swaps the node onto it. A snapshot taken at ``seq = S`` sets the
    node's last sequence number to ``S``. Applying an event is idempotent on
    the state (STORED of a held key, REMOVED of an absent one change nothing),
    so a snapshot that already reflects a few events after ``S`` is harmless:
    the daemon does not take snapshots atomically with changes in flight.

Node removal
    :meth:`remove_node` (a lease expired in etcd) takes the node out of every
    lookup at once, in O(1): its slot leaves the mask of live slots. The stale
    bits it leaves in placement codes are cleared by :meth:`sweep`, which runs
    in bounded steps (the caller decides when); retired slots are reused only
    after a sweep has cleared them. Lookups never see a retired slot.

Tenants (docs/security.md, "The conductor")
    Every entry belongs to the tenant that owns the chunk on its node: the daemons send the
    owner with each STORED event and snapshot entry (``ChunkEvent.tenant``; a daemon stores
    one owner per key, and nobody replaces another tenant's chunk). Entries live in one dict
    per tenant, so a block costs what it did, whatever the number of tenants. A lookup acts
    for one tenant (:meth:`GlobalPrefixIndex.match`'s ``tenant``; the default tenant unless
    told otherwise) and sees that tenant's entries and the shared tenant's
    (``kvstore.security.tenancy.SHARED_TENANT``): another tenant's chunk is absent, also when
    its key is known or guessed (a hash of the tenant in the key is not a boundary).
    ``tenant=None`` (an operator or peer of every tenant) sees every tenant's. One key may
    belong to different tenants on different nodes; on one node it has one owner, so the
    codes of two tenants' dicts never share a node's bits and OR together. REMOVED and MOVED
    events carry no owner: the index finds the key among the tenants the node has stored for
    (a probe per such tenant). A MOVED of a key the node is not known to hold is ignored
    (its STORED, which names the owner, always comes first).

Namespaces
    Keys are opaque here. A namespace (model + tenant) no node has reported is
    not an error for the index: its blocks are simply absent, as they are for a
    brand-new model in a running cluster or for any model after a full restart,
    and a miss is not an error (STYLE). The scheduler is where an unknown
    *model* is an error (no instance can run it): docs/conductor.md.

Thread safety and cost
    Every public method takes one lock; lookups cost O(keys + nodes in the
    answer): one probe per key, two when the shared tenant has entries, one per
    tenant for a lookup of every tenant (operators). A snapshot loads in batches, taking the lock once per batch, so a
    large one does not stall lookups; :meth:`sweep` works the same way.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument, InvariantViolation
from kvstore.keys import BlockHasher
from kvstore.security.tenancy import DEFAULT_TENANT, SHARED_TENANT

__all__ = [
    "ChunkEvent",
    "ChunkEventKind",
    "Epoch",
    "EventOutcome",
    "GlobalMatch",
    "GlobalPrefixIndex",
    "IndexStats",
    "ResyncKind",
    "ResyncNeed",
    "SnapshotLoader",
    "TierCounts",
]

_TIER_CODE = {TierKind.HBM: 1, TierKind.DRAM: 2, TierKind.NVME: 3}
_CODE_TIER = (None, TierKind.HBM, TierKind.DRAM, TierKind.NVME)
_SNAPSHOT_BATCH = 8192
_INTERN_LIMIT = 1 << 16
"""Distinct placement codes shared before the intern table is reset (bounds its memory)."""
_RETIRED_EPOCHS_KEPT = 64

Epoch = str | int
"""A daemon incarnation's id: opaque, compared only for equality."""


def _check_epoch(epoch: object) -> None:
    if isinstance(epoch, bool) or not (
            (isinstance(epoch, int) and epoch >= 0) or (isinstance(epoch, str) and epoch)):
        raise InvalidArgument(f"epoch must be a non-empty str or a non-negative int, got {epoch!r}")


class ChunkEventKind(enum.Enum):
    STORED = "stored"
    """The node now holds the chunk in ``tier``."""
    REMOVED = "removed"
    """The node dropped the chunk (evicted, removed, found corrupt)."""
    MOVED = "moved"
    """The chunk changed tier inside the node (demotion or promotion) and is now in ``tier``."""


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """One chunk event from a store daemon.

    ``parent`` is the chunk's parent key (the namespace prefix for a first
    block, see :mod:`kvstore.keys`); the index does not store it (lookups get
    the chain from the request) but daemons send it so other consumers can.
    ``tier`` is required for STORED and MOVED and ignored for REMOVED. ``tenant`` is the
    chunk's owner (STORED; ignored for REMOVED and MOVED, whose owner the index knows).
    """

    node_id: str
    epoch: Epoch
    seq: int
    kind: ChunkEventKind
    key: bytes
    tier: TierKind | None = None
    parent: bytes | None = None
    tenant: str = DEFAULT_TENANT

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str):
            raise InvalidArgument(f"tenant must be a str, got {self.tenant!r}")
        if not isinstance(self.node_id, str) or not self.node_id:
            raise InvalidArgument(f"node_id must be a non-empty str, got {self.node_id!r}")
        _check_epoch(self.epoch)
        if isinstance(self.seq, bool) or not isinstance(self.seq, int) or self.seq < 0:
            raise InvalidArgument(f"seq must be a non-negative int, got {self.seq!r}")
        if self.seq == 0:
            raise InvalidArgument("event sequence numbers start at 1 (0 is 'before any event')")
        if not isinstance(self.kind, ChunkEventKind):
            raise InvalidArgument(f"kind must be a ChunkEventKind, got {self.kind!r}")
        if not isinstance(self.key, bytes) or not self.key:
            raise InvalidArgument(f"key must be non-empty bytes, got {self.key!r}")
        if self.kind is not ChunkEventKind.REMOVED and not isinstance(self.tier, TierKind):
            raise InvalidArgument(f"a {self.kind.value} event needs a TierKind, got {self.tier!r}")
        if self.parent is not None and not isinstance(self.parent, bytes):
            raise InvalidArgument(f"parent must be bytes or None, got {type(self.parent).__name__}")


class EventOutcome(enum.Enum):
    """What :meth:`GlobalPrefixIndex.apply_event` did with one event."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    """``seq`` was already applied: ignored."""
    STALE = "stale"
    """From an epoch the node retired, or from a node that was removed: ignored."""
    GAP = "gap"
    """Events were missed: dropped, and the node now needs a REPLAY."""
    NEW_EPOCH = "new_epoch"
    """The node restarted: its old entries left lookups; it is tracked from empty again.
    Applied when ``seq == 1``; otherwise the node needs a REPLAY from the start."""
    UNKNOWN_NODE = "unknown_node"
    """First event of a node: tracked from empty. Applied when ``seq == 1``; otherwise
    the node needs a REPLAY from the start (or a snapshot)."""
    AWAITING_RESYNC = "awaiting_resync"
    """The node already needs a resync and this event does not heal it: dropped."""


class ResyncKind(enum.Enum):
    REPLAY = "replay"
    """Send the events from ``from_seq`` on, in order (through ``apply_event``); a daemon
    that no longer holds them answers with a snapshot (through ``apply_snapshot``)."""


@dataclass(frozen=True, slots=True)
class ResyncNeed:
    node_id: str
    kind: ResyncKind
    epoch: Epoch
    """The epoch the index tracks the node in (the newest one seen)."""
    from_seq: int
    """The first sequence number missing."""

    @property
    def after_seq(self) -> int:
        """The last sequence number applied: what a daemon's ``Subscribe(from_seq=...)`` takes."""
        return self.from_seq - 1


@dataclass(frozen=True, slots=True)
class TierCounts:
    """How many blocks of a matched prefix one node holds in each tier."""

    hbm: int = 0
    dram: int = 0
    nvme: int = 0

    def of(self, tier: TierKind) -> int:
        return {TierKind.HBM: self.hbm, TierKind.DRAM: self.dram, TierKind.NVME: self.nvme}[tier]

    @property
    def total(self) -> int:
        return self.hbm + self.dram + self.nvme


class GlobalMatch:
    """The answer to one lookup: per node, how many leading blocks it holds, and where.

    ``lengths`` maps each node holding at least the first block to the length
    of its leading run (nodes holding nothing are absent). Tier details are
    decoded lazily from the placement codes captured at lookup time, so the
    answer is a consistent snapshot even if the index changes afterwards.
    """

    __slots__ = ("_codes", "_slots", "lengths", "probes")

    def __init__(self, lengths: dict[str, int], slots: dict[str, int], codes: list[int],
                 probes: int) -> None:
        self.lengths = lengths
        self._slots = slots
        self._codes = codes
        self.probes = probes
        """Dict lookups this match made (at most ``len(keys)``; for flat-cost tests)."""

    def length(self, node_id: str) -> int:
        """Leading blocks ``node_id`` holds (0 when none, or an unknown node)."""
        return self.lengths.get(node_id, 0)

    @property
    def best_length(self) -> int:
        return len(self._codes)

    def best_nodes(self) -> list[str]:
        """The nodes holding the longest run, in node-id order (empty on a full miss)."""
        best = self.best_length
        return sorted(n for n, length in self.lengths.items() if length == best) if best else []

    def tier_counts(self, node_id: str, length: int | None = None) -> TierCounts:
        """Per-tier counts of the first ``length`` blocks (default: all ``node_id`` holds)."""
        held = self.lengths.get(node_id, 0)
        n = held if length is None else min(length, held)
        if n == 0:
            return TierCounts()
        shift = 2 * self._slots[node_id]
        counts = [0, 0, 0, 0]
        for code in self._codes[:n]:
            counts[(code >> shift) & 3] += 1
        if counts[0]:
            raise InvariantViolation(f"node {node_id} matched a block it does not hold")
        return TierCounts(counts[1], counts[2], counts[3])

    def tiers(self, node_id: str) -> tuple[TierKind, ...]:
        """The tier of each leading block ``node_id`` holds."""
        n = self.lengths.get(node_id, 0)
        if n == 0:
            return ()
        shift = 2 * self._slots[node_id]
        out: list[TierKind] = []
        for code in self._codes[:n]:
            tier = _CODE_TIER[(code >> shift) & 3]
            if tier is None:
                raise InvariantViolation(f"node {node_id} matched a block it does not hold")
            out.append(tier)
        return tuple(out)

    def __repr__(self) -> str:
        return f"GlobalMatch(best={self.best_length}, lengths={self.lengths})"


@dataclass(frozen=True, slots=True)
class IndexStats:
    keys: int
    """Distinct (owner tenant, chunk key) pairs indexed (including keys only retired slots
    still mark)."""
    nodes: int
    blocks_by_node: dict[str, int]
    retired_slots: int
    """Slots of removed or re-snapshotted nodes whose bits a sweep has not cleared yet."""
    events_applied: int
    events_dropped: int
    probes: int
    """Dict lookups made by all matches so far."""


class _NodeState:
    __slots__ = ("blocks", "epoch", "last_seq", "node_id", "resync", "slot", "tenants")

    def __init__(self, node_id: str, slot: int, epoch: Epoch, last_seq: int, blocks: int,
                 tenants: set[str] | None = None) -> None:
        self.node_id = node_id
        self.slot = slot
        self.epoch = epoch
        self.last_seq = last_seq
        self.blocks = blocks
        self.resync: ResyncKind | None = None
        self.tenants: set[str] = set() if tenants is None else tenants
        """Tenants this node has stored chunks for in its slot (where REMOVED looks)."""


class GlobalPrefixIndex:
    """Which node holds which chunk key, in which tier. See the module docstring.

    The constructor only builds empty in-memory structures.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[bytes, int] = {}
        """The default tenant's entries (``_tenants[DEFAULT_TENANT]``)."""
        self._tenants: dict[str, dict[bytes, int]] = {DEFAULT_TENANT: self._entries}
        """Per owner tenant: chunk key -> placement code (module docstring, "Tenants")."""
        self._intern: dict[int, int] = {}
        self._nodes: dict[str, _NodeState] = {}
        self._slot_node: dict[int, str] = {}
        self._live_mask = 0
        """Bit ``2s`` set for every live slot ``s``."""
        self._next_slot = 0
        self._free_slots: list[int] = []
        self._retired: set[int] = set()
        self._retired_epochs: dict[str, deque[Epoch]] = {}
        """Per node, epochs it ran before (or ran when it was removed): their events are stale."""
        self._loader_gens = itertools.count(1)
        self._latest_loader: dict[str, int] = {}
        """Per node, the generation of the newest snapshot loader begun: only it may commit."""
        self._events_applied = 0
        self._events_dropped = 0
        self._probes = 0
        # Sweep in progress: a snapshot of the keys, a position, the slots it clears.
        self._sweep_keys: list[bytes] | None = None
        self._sweep_queue: list[tuple[dict[bytes, int], list[bytes]]] = []
        """The other tenants' dicts and key lists this sweep still has to go through."""
        self._sweep_dict: dict[bytes, int] = self._entries
        self._sweep_pos = 0
        self._sweep_slots: frozenset[int] = frozenset()
        self._sweep_clear = 0

    # -- lookups ---------------------------------------------------------------

    def __len__(self) -> int:
        """Entries: distinct (owner tenant, key) pairs."""
        with self._lock:
            return sum(len(d) for d in self._tenants.values())

    def _visible(self, tenant: str | None) -> list[dict[bytes, int]]:
        """The dicts a lookup for ``tenant`` reads (module docstring, "Tenants")."""
        if tenant is None:
            return [d for d in self._tenants.values() if d]
        own = self._tenants.get(tenant)
        shared = self._tenants.get(SHARED_TENANT) if tenant != SHARED_TENANT else None
        return [d for d in (own, shared) if d]

    def match(self, keys: Sequence[bytes], tenant: str | None = DEFAULT_TENANT) -> GlobalMatch:
        """For chained prefix ``keys``: each node's leading run of held blocks.

        Not counted as a hit anywhere (nodes track their own hits). ``keys`` is a
        list or tuple of bytes; a key the index does not know ends every run
        (a miss is not an error). Only chunks ``tenant`` may see count: its own and the
        shared tenant's (None: every tenant's; module docstring, "Tenants").
        """
        if not isinstance(keys, list | tuple):
            raise InvalidArgument(f"keys must be a list or tuple of bytes, got {type(keys).__name__}")
        with self._lock:
            alive = self._live_mask
            visible = self._visible(tenant)
            if not visible:
                alive = 0
            get = visible[0].get if len(visible) == 1 else self._union_get(visible)
            codes: list[int] = []
            drops: list[tuple[int, int]] = []  # (slot bits that dropped out, their run length)
            probes = 0
            if alive:
                for key in keys:
                    probes += 1
                    code = get(key, 0)
                    # Bit 2s of (code | code >> 1) is set iff slot s holds the key.
                    present = (code | (code >> 1)) & alive
                    if present != alive:
                        if codes:
                            drops.append((alive ^ present, len(codes)))
                        alive = present
                        if not alive:
                            break
                    codes.append(code)
            self._probes += probes
            if alive and codes:
                drops.append((alive, len(codes)))
            lengths: dict[str, int] = {}
            slots: dict[str, int] = {}
            slot_node = self._slot_node
            for bits, length in drops:
                while bits:
                    low = bits & -bits
                    slot = (low.bit_length() - 1) >> 1
                    node_id = slot_node[slot]
                    lengths[node_id] = length
                    slots[node_id] = slot
                    bits ^= low
            return GlobalMatch(lengths, slots, codes, probes)

    @staticmethod
    def _union_get(dicts: list[dict[bytes, int]]) -> Callable[[bytes, int], int]:
        """A ``get`` over several tenants' dicts: their codes OR'ed (disjoint per node)."""
        gets = [d.get for d in dicts]

        def get(key: bytes, default: int) -> int:
            code = default
            for g in gets:
                code |= g(key, 0)
            return code

        return get

    def match_tokens(self, hasher: BlockHasher, token_ids: object,
                     tenant: str | None = DEFAULT_TENANT) -> GlobalMatch:
        """:meth:`match` on the keys of the full blocks of ``token_ids`` (see ``BlockHasher``)."""
        return self.match(hasher.hash_blocks(token_ids), tenant)

    def holders(self, key: bytes, tenant: str | None = DEFAULT_TENANT) -> dict[str, TierKind]:
        """The live nodes holding ``key`` for ``tenant`` (as :meth:`match`) and the tier each
        holds it in (empty on a miss)."""
        with self._lock:
            visible = self._visible(tenant)
            code = 0
            for d in visible:
                code |= d.get(key, 0)
            code &= self._live_mask * 3
            out: dict[str, TierKind] = {}
            while code:
                low_pair = code & -code
                slot = (low_pair.bit_length() - 1) >> 1
                tier = _CODE_TIER[(code >> (2 * slot)) & 3]
                if tier is None:
                    raise InvariantViolation("a placement code had a set bit but no tier")
                out[self._slot_node[slot]] = tier
                code &= ~(3 << (2 * slot))
            return out

    # -- node state ------------------------------------------------------------

    def nodes(self) -> list[str]:
        """Nodes with a live slot (their entries answer lookups), sorted."""
        with self._lock:
            return sorted(self._nodes)

    def node_blocks(self, node_id: str) -> int:
        """Chunks the index records for ``node_id`` (0 for an unknown node)."""
        with self._lock:
            st = self._nodes.get(node_id)
            return 0 if st is None else st.blocks

    def needs_resync(self, node_id: str) -> ResyncNeed | None:
        """What ``node_id`` must send for the index to trust it again; None when in sync.

        A node never heard of needs nothing yet: it joins with its first events
        (from seq 1) or a snapshot.
        """
        with self._lock:
            return self._need(node_id)

    def resync_needed(self) -> list[ResyncNeed]:
        """Every node that needs a resync, sorted by node id."""
        with self._lock:
            needs = [self._need(n) for n in sorted(self._nodes)]
            return [n for n in needs if n is not None]

    def _need(self, node_id: str) -> ResyncNeed | None:
        st = self._nodes.get(node_id)
        if st is None or st.resync is None:
            return None
        return ResyncNeed(node_id, st.resync, st.epoch, st.last_seq + 1)

    def remove_node(self, node_id: str) -> bool:
        """Take ``node_id`` out of every lookup now (its lease expired). False if unknown.

        Later events of the epoch it ran are STALE; the node comes back through a
        snapshot (of any epoch) or the events of a new epoch.
        """
        with self._lock:
            st = self._nodes.pop(node_id, None)
            if st is None:
                return False
            self._retire_epoch(node_id, st.epoch)
            self._retire(st.slot)
            return True

    def _retire_epoch(self, node_id: str, epoch: Epoch) -> None:
        retired = self._retired_epochs.setdefault(node_id, deque(maxlen=_RETIRED_EPOCHS_KEPT))
        if epoch not in retired:
            retired.append(epoch)

    def _is_retired(self, node_id: str, epoch: Epoch) -> bool:
        retired = self._retired_epochs.get(node_id)
        return retired is not None and epoch in retired

    # -- events ----------------------------------------------------------------

    def apply_event(self, event: ChunkEvent) -> EventOutcome:
        """Apply one daemon event in sequence order; see the module docstring for the rules."""
        with self._lock:
            outcome = self._apply(event)
            self._count(outcome, event)
            return outcome

    def apply_events(self, events: Iterable[ChunkEvent]) -> list[EventOutcome]:
        """:meth:`apply_event` on each event in order (one lock acquisition)."""
        out: list[EventOutcome] = []
        with self._lock:
            for event in events:
                outcome = self._apply(event)
                self._count(outcome, event)
                out.append(outcome)
        return out

    def _count(self, outcome: EventOutcome, event: ChunkEvent) -> None:
        if outcome is EventOutcome.APPLIED or (
                event.seq == 1 and outcome in (EventOutcome.NEW_EPOCH, EventOutcome.UNKNOWN_NODE)):
            self._events_applied += 1
        else:
            self._events_dropped += 1

    def _apply(self, ev: ChunkEvent) -> EventOutcome:
        node_id = ev.node_id
        st = self._nodes.get(node_id)
        if st is None or ev.epoch != st.epoch:
            if self._is_retired(node_id, ev.epoch):
                return EventOutcome.STALE
            # First contact, or the daemon restarted: what we knew of it is void. It leaves
            # lookups now and is tracked from empty; its new epoch's events rebuild it.
            outcome = EventOutcome.UNKNOWN_NODE if st is None else EventOutcome.NEW_EPOCH
            if st is not None:
                self._retire_epoch(node_id, st.epoch)
                self._retire(st.slot)
            st = self._start_node(node_id, ev.epoch)
            if ev.seq != 1:
                st.resync = ResyncKind.REPLAY
                return outcome
            st.last_seq = 1
            self._set(ev.key, st, ev.kind, ev.tier, ev.tenant)
            return outcome
        if ev.seq <= st.last_seq:
            return EventOutcome.DUPLICATE
        if ev.seq > st.last_seq + 1:
            if st.resync is None:
                st.resync = ResyncKind.REPLAY
                return EventOutcome.GAP
            return EventOutcome.AWAITING_RESYNC
        # In order: apply. A pending REPLAY is healed by the missing event itself.
        st.resync = None
        st.last_seq = ev.seq
        self._set(ev.key, st, ev.kind, ev.tier, ev.tenant)
        return EventOutcome.APPLIED

    def _holding(self, key: bytes, st: _NodeState) -> dict[bytes, int] | None:
        """The dict of the tenant whose entry says ``st``'s node holds ``key`` (None: no
        tenant's does)."""
        shift = 2 * st.slot
        for tenant in st.tenants:
            entries = self._tenants.get(tenant)
            if entries is not None and (entries.get(key, 0) >> shift) & 3:
                return entries
        return None

    def _tenant_entries(self, tenant: str) -> dict[bytes, int]:
        entries = self._tenants.get(tenant)
        if entries is None:
            entries = self._tenants[tenant] = {}
        return entries

    def _set(self, key: bytes, st: _NodeState, kind: ChunkEventKind, tier: TierKind | None,
             tenant: str) -> None:
        shift = 2 * st.slot
        if kind is ChunkEventKind.STORED:
            entries = self._tenant_entries(tenant)
            st.tenants.add(tenant)
        else:  # the owner is whoever's entry holds it on this node
            found = self._holding(key, st)
            if found is None:
                return  # REMOVED: idempotent (it did not hold it); MOVED: see "Tenants"
            entries = found
        code = entries.get(key, 0)
        had = (code >> shift) & 3
        if kind is ChunkEventKind.REMOVED:
            if not had:
                return  # idempotent: the node did not hold it (as far as we knew)
            code &= ~(3 << shift)
            st.blocks -= 1
            if code:
                entries[key] = self._intern_code(code)
            else:
                del entries[key]
            return
        if tier is None:
            raise InvariantViolation(f"{kind.value} event without a tier passed validation")
        code = (code & ~(3 << shift)) | (_TIER_CODE[tier] << shift)
        if not had:
            st.blocks += 1
        entries[key] = self._intern_code(code)

    def _start_node(self, node_id: str, epoch: Epoch) -> _NodeState:
        """Track ``node_id`` in ``epoch`` from an empty, live slot (last seq 0)."""
        slot = self._alloc_slot()
        st = _NodeState(node_id, slot, epoch, 0, 0)
        self._nodes[node_id] = st
        self._slot_node[slot] = node_id
        self._live_mask |= 1 << (2 * slot)
        return st

    def _intern_code(self, code: int) -> int:
        # Every distinct placement code is one int object shared by all keys with that
        # placement: codes above 256 are not cached by CPython, and 10M keys held by
        # "node 5, DRAM" would otherwise cost 10M separate 28-byte ints.
        interned = self._intern.get(code)
        if interned is not None:
            return interned
        if len(self._intern) >= _INTERN_LIMIT:
            self._intern.clear()  # only stops sharing for new codes; never wrong
        self._intern[code] = code
        return code

    # -- snapshots -------------------------------------------------------------

    def begin_snapshot(self, node_id: str, epoch: Epoch, seq: int) -> SnapshotLoader:
        """Start replacing everything ``node_id`` holds with a snapshot taken at ``seq``.

        Entries added to the loader are invisible to lookups until ``commit``. A
        newer ``begin_snapshot`` for the same node makes an older loader's commit
        fail. Raises InvalidArgument for a bad id, epoch or seq, or an epoch the
        node already retired (the daemon restarted since).
        """
        if not isinstance(node_id, str) or not node_id:
            raise InvalidArgument(f"node_id must be a non-empty str, got {node_id!r}")
        _check_epoch(epoch)
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise InvalidArgument(f"seq must be a non-negative int, got {seq!r}")
        with self._lock:
            st = self._nodes.get(node_id)
            if self._is_retired(node_id, epoch) and (st is None or st.epoch != epoch):
                retired = self._retired_epochs[node_id]
                if st is None and retired[-1] == epoch:
                    # Removed (lease expired) while this epoch ran, and re-registered alive.
                    retired.pop()
                else:
                    raise InvalidArgument(
                        f"snapshot of {node_id} is from epoch {epoch!r}, which it already left")
            gen = next(self._loader_gens)
            self._latest_loader[node_id] = gen
            slot = self._alloc_slot()
            return SnapshotLoader(self, node_id, epoch, seq, slot, gen)

    def apply_snapshot(self, node_id: str, epoch: Epoch, seq: int,
                       entries: Iterable[tuple[bytes, TierKind]],
                       tenant: str = DEFAULT_TENANT) -> bool:
        """Replace everything ``node_id`` holds with ``entries`` (key, tier), all owned by
        ``tenant``, atomically (a snapshot of several tenants: :meth:`begin_snapshot`).

        Loads in batches (the lock is released between them) and commits once.
        Returns what :meth:`SnapshotLoader.commit` returns.
        """
        loader = self.begin_snapshot(node_id, epoch, seq)
        try:
            batch: list[tuple[bytes, TierKind]] = []
            for entry in entries:
                batch.append(entry)
                if len(batch) >= _SNAPSHOT_BATCH:
                    loader.add(batch, tenant)
                    batch = []
            if batch:
                loader.add(batch, tenant)
        except BaseException:
            loader.abort()
            raise
        return loader.commit()

    def _load(self, loader: SnapshotLoader, entries: Sequence[tuple[bytes, TierKind]],
              tenant: str) -> int:
        shift = 2 * loader.slot
        mask = ~(3 << shift)
        added = 0
        with self._lock:
            store = self._tenant_entries(tenant)
            loader.tenants.add(tenant)
            intern = self._intern_code
            for key, tier in entries:
                if not isinstance(key, bytes) or not key:
                    raise InvalidArgument(f"snapshot keys must be non-empty bytes, got {key!r}")
                try:
                    tcode = _TIER_CODE[tier]
                except KeyError:
                    raise InvalidArgument(f"snapshot tier must be a TierKind, got {tier!r}") from None
                code = store.get(key, 0)
                if not (code >> shift) & 3:
                    added += 1
                store[key] = intern((code & mask) | (tcode << shift))
        return added

    def _commit(self, loader: SnapshotLoader) -> bool:
        with self._lock:
            st = self._nodes.get(loader.node_id)
            superseded = self._latest_loader.get(loader.node_id) != loader.gen
            if superseded or self._is_retired(loader.node_id, loader.epoch):
                self._retire(loader.slot)
                return False
            new = _NodeState(loader.node_id, loader.slot, loader.epoch, loader.seq, loader.blocks,
                             loader.tenants)
            if st is not None:
                self._retire(st.slot)
                if st.epoch != loader.epoch:
                    self._retire_epoch(loader.node_id, st.epoch)
                elif st.last_seq > loader.seq:
                    # Events after the snapshot reached the old slot only: replay them.
                    new.resync = ResyncKind.REPLAY
            self._nodes[loader.node_id] = new
            self._slot_node[loader.slot] = loader.node_id
            self._live_mask |= 1 << (2 * loader.slot)
            return True

    def _abort(self, loader: SnapshotLoader) -> None:
        with self._lock:
            self._retire(loader.slot)

    # -- slots and sweeping ------------------------------------------------------

    def _alloc_slot(self) -> int:
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def _retire(self, slot: int) -> None:
        self._live_mask &= ~(1 << (2 * slot))
        self._slot_node.pop(slot, None)
        self._retired.add(slot)

    def sweep(self, max_keys: int | None = None) -> int:
        """Clear retired slots' bits from up to ``max_keys`` keys; return how many remain.

        A sweep snapshots the key list when it starts and clears the slots retired
        by then; it frees those slots for reuse when it finishes (returns 0). Call
        it in bounded steps from a background task; ``sweep()`` runs to the end.
        """
        if max_keys is not None and max_keys <= 0:
            raise InvalidArgument(f"max_keys must be positive, got {max_keys}")
        with self._lock:
            if self._sweep_keys is None:
                if not self._retired:
                    return 0
                # One tenant's dict at a time (no list of every tenant's keys at once).
                queue = [(d, list(d)) for d in self._tenants.values() if d]
                self._sweep_dict, self._sweep_keys = queue.pop() if queue else ({}, [])
                self._sweep_queue = queue
                self._sweep_pos = 0
                self._sweep_slots = frozenset(self._retired)
                clear = 0
                for slot in self._sweep_slots:
                    clear |= 3 << (2 * slot)
                self._sweep_clear = clear
        while True:
            with self._lock:
                keys = self._sweep_keys
                if keys is None:
                    return 0
                end = len(keys) if max_keys is None else min(len(keys), self._sweep_pos + max_keys)
                end = min(end, self._sweep_pos + _SNAPSHOT_BATCH)
                clear = self._sweep_clear
                keep = ~clear
                entries = self._sweep_dict
                for key in keys[self._sweep_pos:end]:
                    code = entries.get(key)
                    if code is not None and code & clear:
                        code &= keep
                        if code:
                            entries[key] = self._intern_code(code)
                        else:
                            del entries[key]
                done = end - self._sweep_pos
                self._sweep_pos = end
                if end >= len(keys) and self._sweep_queue:  # the next tenant's dict
                    self._sweep_dict, self._sweep_keys = self._sweep_queue.pop()
                    keys, end = self._sweep_keys, 0
                    self._sweep_pos = 0
                elif end >= len(keys):
                    for tenant in [t for t, d in self._tenants.items()
                                   if not d and t != DEFAULT_TENANT]:
                        del self._tenants[tenant]  # (nodes' ``tenants`` may name it again)
                    for slot in self._sweep_slots:
                        self._retired.discard(slot)
                        heapq.heappush(self._free_slots, slot)
                    self._sweep_keys = None
                    self._sweep_dict = self._entries
                    self._sweep_slots = frozenset()
                    self._intern.clear()  # drop codes that only retired slots used
                    return 0
                if max_keys is not None:
                    max_keys -= done
                    if max_keys <= 0:
                        return len(keys) - end + sum(len(k) for _d, k in self._sweep_queue)

    def stats(self) -> IndexStats:
        with self._lock:
            return IndexStats(
                keys=sum(len(d) for d in self._tenants.values()), nodes=len(self._nodes),
                blocks_by_node={n: st.blocks for n, st in sorted(self._nodes.items())},
                retired_slots=len(self._retired), events_applied=self._events_applied,
                events_dropped=self._events_dropped, probes=self._probes)


class SnapshotLoader:
    """Loads one node's snapshot into a fresh slot; ``commit`` swaps it in atomically.

    Made by :meth:`GlobalPrefixIndex.begin_snapshot`. ``add`` may be called any
    number of times (each call takes the index lock once); then exactly one of
    ``commit`` or ``abort``. Not thread-safe itself: one owner drives a loader.
    """

    def __init__(self, index: GlobalPrefixIndex, node_id: str, epoch: Epoch, seq: int,
                 slot: int, gen: int) -> None:
        self._index = index
        self.node_id = node_id
        self.epoch = epoch
        self.seq = seq
        self.slot = slot
        self.gen = gen
        self.blocks = 0
        self.tenants: set[str] = set()
        """The owner tenants added so far."""
        self._closed = False

    def add(self, entries: Sequence[tuple[bytes, TierKind]],
            tenant: str = DEFAULT_TENANT) -> None:
        """Record that the node holds each ``(key, tier)``, owned by ``tenant`` (a key repeated:
        the last tier wins; one key under two tenants of one node is the daemon's bug)."""
        if self._closed:
            raise InvalidArgument("this snapshot loader was already committed or aborted")
        if not isinstance(tenant, str):
            raise InvalidArgument(f"tenant must be a str, got {tenant!r}")
        self.blocks += self._index._load(self, entries, tenant)

    def commit(self) -> bool:
        """Make the snapshot the node's state. False (and nothing changes) when a newer
        snapshot was begun for the node, or the node left this epoch meanwhile."""
        if self._closed:
            raise InvalidArgument("this snapshot loader was already committed or aborted")
        self._closed = True
        return self._index._commit(self)

    def abort(self) -> None:
        """Discard the loaded entries (their slot is swept later)."""
        if not self._closed:
            self._closed = True
            self._index._abort(self)

"""The tiered cache: real tiers (HBM, DRAM, NVMe) kept in step with one :class:`CacheIndex`.

The index decides (what is cached, where, what to evict: :mod:`kvstore.node.index`); the tiers hold
the bytes (:mod:`kvstore.dataplane.tier`); this module executes the decisions and keeps both equal.

Placement
    A put lands in the *write tier* (the fastest configured tier unless configured otherwise).
    When it is full, the index plans victims; each is **demoted** one tier down (HBM -> DRAM ->
    NVMe), making room there the same way, and victims of the last tier are **dropped**. A read
    from a slower tier **promotes** the chunk one tier up when that tier has room or can make it
    (best effort: a failed promotion leaves the chunk where it was).

Copies: a primary tier, and at most one persistent backing copy
    A chunk has one *primary* copy, in the fastest tier holding it (reads, pins and events name
    it), and may have a second, clean *backing* copy in the persistent tier (NVMe):

    * a promotion out of NVMe **copies**: the NVMe copy stays, so a crash (or a restart without
      ``persist_dram``) loses no chunk that was promoted, and no chain loses its root;
    * with a persistent write tier (``write_tier=nvme``: durable puts), a put into a faster tier
      (the daemon's zero-copy puts: ``reserve``/``commit`` in DRAM) is **written through**: the
      NVMe copy is written (and fdatasync'd) from the slot before ``commit`` publishes the DRAM
      copy and returns;
    * evicting a backed memory copy forgets it (no write: the NVMe copy becomes the primary one);
    * NVMe space counts backing copies. Making room in NVMe drops NVMe-only leaves first, in
      the policy's order; only when those are not enough it drops backing copies (the chunk stays
      cached in memory, but no longer survives a crash). The background watermark demoter never
      drops backing copies;
    * ``remove`` and a corrupt read drop every copy; ``persist`` writes only unbacked chunks;
    * with durable puts, a chunk written to NVMe (put, write-through or demotion) first gets a
      copy there of every ancestor that lacks one (a full NVMe may have dropped it), so what
      NVMe holds stays recoverable after a crash.

Prefix rule
    A chunk is useless without its parent. ``put`` refuses a chunk whose parent is not cached, the
    index never plans a drop that would orphan a child, and a chunk found corrupt is dropped
    together with everything cached under it.

Leases
    Reads pin the chunks they copy (a shared lease with a timeout), moves claim theirs (exclusive),
    so a chunk being read or moved cannot be evicted, and a crashed reader's pin expires.
    ``pin``/``unpin`` expose the same leases to callers that hand out zero-copy views.

Persistence
    A persistent tier (NVMe) keeps each chunk's parent key in the record's metadata and its
    tenant as the record's owner, so :meth:`TieredCache.recover` rebuilds the index, parents and
    owners included, after a restart or a ``kill -9``. Chunks whose parent did not survive are
    dropped (they could never be used).
    What survives a crash: every chunk with an NVMe copy (primary or backing). With a persistent
    write tier that is every acknowledged put not evicted or removed since; with a memory write
    tier, only what was demoted or promoted out of NVMe (and, at a drain, ``persist``).

Zero-copy access (the store daemon)
    ``reserve``/``commit``/``abort`` put a chunk by writing straight into a slot of a host-memory
    tier (invisible until ``commit``). ``pin_in`` pins chunks after moving them into one tier
    (promoting from NVMe into DRAM), so a reader may copy straight out of the tier's memory
    (``HostMemoryTier.view``/``locate``) until it ``unpin``s.

Reads that bypass the cache
    Same-host clients copy DRAM chunks the read index publishes without asking the daemon
    (:mod:`kvstore.dataplane.read_index`). The tier unpublishes a chunk before its extent can be
    reused, so such reads need no lease; the daemon reports them afterwards through
    :meth:`TieredCache.record_reads`, which counts the hits and refreshes recency (late and
    deduplicated per report: approximate).

Change notifications
    An optional ``observer`` is called with a :class:`ChunkChange` after every chunk the cache
    stores, moves or removes (recovery included), in the thread that made the change. It must be
    quick and must not raise, nor call back into the cache. The tier of a change is always the
    chunk's primary (fastest) tier: a promotion that keeps the NVMe copy is MOVED to DRAM, the
    eviction of a backed DRAM copy is MOVED to NVMe, a removal is one REMOVED, and adding or
    dropping a backing copy alone is no change (the fastest copy stays where it was). With
    ``observe_many`` as well, a batch commit's STORED changes go to it in one call, in order
    (the daemon's event log then takes its lock once per batch, not once per chunk).

Tenants
    The calls that take ``tenant`` pass it to the index (:mod:`kvstore.node.index`, "Tenants"):
    reads (``entry``, ``lookup``, ``get_into``, ``pin``, ``pin_in``) see only that tenant's
    chunks and the shared tenant's (``None``: every chunk), ``remove`` drops only the tenant's
    own, and writes (``put``, ``reserve``/``commit``) record it as the owner (the default
    tenant when not given). The cache's own work (eviction, moves, promotion) is unscoped, but
    every copy it writes to a persistent tier (write-through, demotion, backing copies) carries
    the chunk's tenant in the record (``PersistentTier.put_with_meta``'s owner), so ``recover``
    restores each chunk's owner; a record written before owners were kept (NVMe format
    version 1) recovers as the default tenant.

    Per tenant the cache counts hits, misses, bytes read and written and refusals
    (``tenants``, a :class:`~kvstore.node.tenants.TenantMeter` with a bounded label set) and
    enforces the ``quotas`` it was built with (index, "Quotas"): a placement over the owner's
    cap in a tier first evicts that owner's own chunks there (else CapacityError naming the
    tenant and the quota), and eviction made for a tenant's write (``_place``'s ``driver``, passed
    down through demotions) keeps other tenants' guaranteed shares; ``persist`` ignores them.

Thread safety
    Every method may be called from any thread. Metadata decisions run under the index's lock;
    byte copies run outside it, protected by leases.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvstore.dataplane.dram import writing_for
from kvstore.dataplane.tier import (
    BatchHostMemoryTier,
    Buffer,
    ChunkInfo,
    HostMemoryTier,
    PersistentTier,
    Tier,
    TierKind,
    TierStats,
    WriteSlot,
    check_key,
)
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkCorrupt,
    ChunkExists,
    ChunkNotFound,
    ConfigError,
    DiskFull,
    InvalidArgument,
    KvtierError,
    PermissionDenied,
    QuotaExceeded,
)
from kvstore.node.index import (
    DEFAULT_TENANT,
    CacheIndex,
    IndexEntry,
    Lease,
    PrefixMatch,
    TierBudget,
)
from kvstore.node.policies import EvictionPolicy, PolicyName
from kvstore.node.tenants import DEFAULT_MAX_TENANTS, TenantMeter, TenantQuota, TenantReport

log = logging.getLogger(__name__)

_MAX_ROOM_ATTEMPTS = 8
"""Evict-and-retry rounds before a put gives up. The index counts logical bytes; a tier may need a
little more (alignment, record headers, fragmentation), so a put that the index admits can still
find the tier full and evicts again."""

_R = TypeVar("_R")
_T = TypeVar("_T")

_PIN_IN_ATTEMPTS = 8
"""Move-then-pin rounds ``pin_in`` tries before giving up: a chunk promoted for a reader can be
demoted again by a racing put before the reader's pin lands."""


class ChunkChangeKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    MOVED = "moved"


@dataclass(slots=True)
class ChunkChange:
    """One change the cache made: a chunk stored in, removed from, or moved into ``tier``.
    Treat as immutable. Not a frozen dataclass: one is built per chunk stored, and a frozen
    one's constructor costs ~1.5 µs here against ~0.15 µs (each field through
    ``object.__setattr__``)."""

    kind: ChunkChangeKind
    key: bytes
    tier: TierKind
    size_bytes: int
    parent: bytes | None = None
    """STORED only: the chunk's parent key (None for the first block of a sequence)."""
    from_tier: TierKind | None = None
    """MOVED only: where the chunk was before."""
    tenant: str | None = None
    """STORED only: the tenant that owns the chunk (what the conductor's index files it under)."""


ChangeObserver = Callable[[ChunkChange], object]


@dataclass(frozen=True, slots=True)
class CacheConfig:
    write_tier: TierKind | None = None
    """Where puts land; None: the fastest configured tier."""
    promote_on_hit: bool = True
    """Move a chunk read from a slower tier one tier up."""
    lease_ttl_s: float = 30.0
    """How long a pin or move claim protects a chunk if its holder never releases it."""
    high_watermark: float = 0.95
    low_watermark: float = 0.85

    def __post_init__(self) -> None:
        if not self.lease_ttl_s > 0:
            raise ConfigError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if not 0.0 <= self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError("watermarks must satisfy 0 <= low <= high <= 1")


@dataclass(slots=True)
class TierCounters:
    """What happened in one tier since the cache started (monotonic counters)."""

    hits: int = 0
    puts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    demotions_out: int = 0
    promotions_in: int = 0
    drops: int = 0
    corrupt: int = 0
    seconds_writing: float = 0.0
    seconds_reading: float = 0.0


@dataclass(frozen=True, slots=True)
class TierReport:
    kind: TierKind
    stats: TierStats
    counters: TierCounters

    @property
    def corrupt(self) -> int:
        """Corrupt chunks found: by reads since start, and by the tier when it opened."""
        return self.counters.corrupt + self.stats.corrupt_at_open


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    recovered: int
    dropped_orphans: int
    by_tier: dict[TierKind, int] = field(default_factory=dict)


class TieredCache:
    """Tiers plus the index that says what lives where. See the module docstring."""

    def __init__(self, tiers: Mapping[TierKind, Tier], *,
                 policy: EvictionPolicy | PolicyName | str = PolicyName.LRU,
                 config: CacheConfig | None = None,
                 observer: ChangeObserver | None = None,
                 observe_many: Callable[[list[ChunkChange]], object] | None = None,
                 quotas: Sequence[TenantQuota] = (),
                 max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if not tiers:
            raise ConfigError("a tiered cache needs at least one tier")
        for kind, tier in tiers.items():
            if tier.kind is not kind:
                raise ConfigError(f"tier {tier!r} is a {tier.kind.value} tier, configured as {kind.value}")
        self._config = config or CacheConfig()
        self._tiers = dict(sorted(tiers.items(), key=lambda kv: kv[0].order))
        budgets = {kind: TierBudget.of(tier.capacity_bytes, high_fraction=self._config.high_watermark,
                                       low_fraction=self._config.low_watermark)
                   for kind, tier in self._tiers.items()}
        self._index = CacheIndex(budgets, policy, quotas=quotas)
        write = self._config.write_tier or next(iter(self._tiers))
        if write not in self._tiers:
            raise ConfigError(f"write tier {write.value} is not configured")
        self._write_tier = write
        self._persistent = frozenset(kind for kind, tier in self._tiers.items()
                                     if isinstance(tier, PersistentTier))
        self._durable: TierKind | None = write if write in self._persistent else None
        """Puts are durable (a persistent write tier): a put into a faster tier is written
        through to this one before it is acknowledged. None: puts stay where they land."""
        # isinstance() against a runtime-checkable Protocol walks its attributes (~20 µs):
        # decide once per tier, not per put.
        self._host_memory: dict[TierKind, HostMemoryTier] = {
            kind: tier for kind, tier in self._tiers.items() if isinstance(tier, HostMemoryTier)}
        self._batch_memory: dict[TierKind, BatchHostMemoryTier] = {
            kind: tier for kind, tier in self._host_memory.items()
            if isinstance(tier, BatchHostMemoryTier)}
        """The host-memory tiers that reserve and commit a batch in one round."""
        self._counters = {kind: TierCounters() for kind in self._tiers}
        self._quotas = bool(quotas)
        """Some tenant has a quota (else puts skip the cap check: one index round less)."""
        self._counter_lock = threading.Lock()
        self.misses = 0
        self.lookups = 0
        self.tenants = TenantMeter(max_tenants)
        """Per-tenant counters (:mod:`kvstore.node.tenants`)."""
        self._observer = observer
        self._observe_many = observe_many if observer is not None else None
        """``observer`` for several changes in one call (a batch commit's STORED events)."""

    # -- introspection ---------------------------------------------------------------------

    @property
    def index(self) -> CacheIndex:
        return self._index

    @property
    def config(self) -> CacheConfig:
        return self._config

    @property
    def write_tier(self) -> TierKind:
        return self._write_tier

    @property
    def durable_tier(self) -> TierKind | None:
        """Where every put is written before it is acknowledged, when puts are durable (the
        write tier is persistent); None otherwise."""
        return self._durable

    @property
    def tiers(self) -> Mapping[TierKind, Tier]:
        return self._tiers

    def tier(self, kind: TierKind) -> Tier:
        try:
            return self._tiers[kind]
        except KeyError:
            raise InvalidArgument(f"tier {kind.value} is not configured") from None

    def report(self) -> list[TierReport]:
        with self._counter_lock:
            return [TierReport(kind, tier.stats(), _copy(self._counters[kind]))
                    for kind, tier in self._tiers.items()]

    def tenant_report(self) -> list[TenantReport]:
        """Per-tenant counters, bytes held and quotas per tier (bounded labels:
        ``TenantMeter``)."""
        reports = self.tenants.report(self._index.tenant_usage())
        if not self._quotas:
            return reports
        index = self._index
        return [dataclasses.replace(r, quotas={
            kind: q for kind in index.tiers
            if r.tenant is not None and (q := index.quota(kind, r.tenant)) is not None})
            for r in reports]

    def entry(self, key: bytes, tenant: str | None = None) -> IndexEntry | None:
        """``key``'s index entry; None when not cached or ``tenant`` may not see it."""
        return self._index.get(key, tenant)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    # -- lookups ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], tenant: str | None = None) -> PrefixMatch:
        """The longest cached prefix of ``keys`` (of chunks ``tenant`` may see) and the tier of
        each block (not a hit)."""
        return self._index.match_prefix(keys, tenant)

    # -- writes ----------------------------------------------------------------------------

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None,
            tier: TierKind | None = None, tenant: str = DEFAULT_TENANT) -> ChunkInfo:
        """Store ``src`` under ``key`` (a child of ``parent``) in the write tier, making room;
        ``tenant`` owns it (:mod:`kvstore.node.index`, "Tenants").

        Raises ChunkExists (already cached: chunks are immutable), PermissionDenied (another
        tenant owns ``key``), InvalidArgument (the parent is not cached or not visible to
        ``tenant``, bad key), CapacityError (nothing evictable frees enough: everything is
        pinned, or the chunk is larger than the tier).
        """
        key = check_key(key)
        kind = tier or self._write_tier
        target = self.tier(kind)
        self._check_writable(key, parent, tenant)
        size = _nbytes(src)
        backing = self._backing_for(kind)
        if backing is not None:
            self._write_backing(backing, key, src, size, parent, tenant)
        elif kind is self._durable and parent is not None:
            self._back_ancestors(kind, parent)
        try:
            info, seconds = self._place(kind, target, key, size,
                                        lambda: _put(target, key, src, parent, tenant),
                                        owner=tenant)
        except BaseException:
            if backing is not None:
                self._tiers[backing].remove(key)
            raise
        try:
            self._index.insert(key, parent, kind, size, info.checksum, backing=backing,
                               tenant=tenant)
        except KvtierError:
            target.remove(key)  # the index refused it (a racing put, or the parent vanished)
            if backing is not None:
                self._tiers[backing].remove(key)
            raise
        self._count(kind, puts=1, bytes_written=size, seconds_writing=seconds)
        self.tenants.stored(tenant, size)
        self._notify(ChunkChangeKind.STORED, key, kind, size, parent=parent, tenant=tenant)
        return info

    def reserve(self, key: bytes, size_bytes: int, *, parent: bytes | None = None,
                tier: TierKind | None = None, tenant: str = DEFAULT_TENANT) -> WriteSlot:
        """An invisible writable slot for ``key`` in a host-memory tier, making room for it.

        The caller fills ``slot.buffer`` and then calls exactly one of :meth:`commit` (with the
        same ``parent`` and ``tenant``) or :meth:`abort`; an unfinished slot keeps its space.
        Raises ChunkExists, PermissionDenied (another tenant owns ``key``), ChunkBusy (the key
        is being written), InvalidArgument (parent uncached or not visible to ``tenant``, bad
        size, ``tier`` not in host memory), CapacityError.
        """
        key = check_key(key)
        kind = tier or self._write_tier
        target = self._host_memory_tier(kind)
        if not isinstance(size_bytes, int) or size_bytes < 1:
            raise InvalidArgument(f"chunk size must be a positive int, got {size_bytes!r}")
        self._check_writable(key, parent, tenant)
        slot, _seconds = self._place(kind, target, key, size_bytes,
                                     lambda: target.reserve(key, size_bytes), owner=tenant)
        return slot

    def commit(self, slot: WriteSlot, *, parent: bytes | None = None,
               tier: TierKind | None = None, tenant: str = DEFAULT_TENANT) -> ChunkInfo:
        """Publish a slot from :meth:`reserve` (``parent``/``tier``/``tenant`` as given there).

        With durable puts (:attr:`durable_tier`) the chunk is first written from the slot to
        the persistent tier (durable when this returns), then published in ``tier``; the
        memory copy stays as a clean cached copy. Raises InvalidArgument (a finished or foreign
        slot; or the parent was dropped meanwhile: the chunk is then discarded), ChunkExists (a
        racing put of the same key won), and with durable puts the persistent tier's write
        errors (CapacityError, DiskFull, StorageError...); on any error the slot is freed.
        """
        kind = tier or self._write_tier
        target = self._host_memory_tier(kind)
        key, size = slot.key, slot.size_bytes
        backing = self._backing_for(kind)
        if backing is not None:
            try:
                _ = slot.buffer.nbytes  # released once the slot was committed or aborted
            except ValueError:
                raise InvalidArgument(f"slot {key.hex()} is not pending (committed or "
                                      "aborted)") from None
            try:
                self._write_backing(backing, key, slot.buffer, size, parent, tenant)
            except BaseException:
                target.abort(slot)
                raise
        try:
            info = target.commit(slot)
        except BaseException:
            if backing is not None:
                self._tiers[backing].remove(key)
            raise
        try:
            self._index.insert(key, parent, kind, size, info.checksum, backing=backing,
                               tenant=tenant)
        except KvtierError:
            target.remove(key)
            if backing is not None:
                self._tiers[backing].remove(key)
            raise
        self._count(kind, puts=1, bytes_written=size)
        self.tenants.stored(tenant, size)
        self._notify(ChunkChangeKind.STORED, key, kind, size, parent=parent, tenant=tenant)
        return info

    def abort(self, slot: WriteSlot, *, tier: TierKind | None = None) -> None:
        """Free a slot from :meth:`reserve`; the chunk never becomes visible. Idempotent."""
        self._host_memory_tier(tier or self._write_tier).abort(slot)

    def reserve_many(self, keys: Sequence[bytes], sizes_bytes: Sequence[int],
                     parents: Sequence[bytes | None], *, tier: TierKind | None = None,
                     tenant: str | None = None) -> list[WriteSlot | KvtierError]:
        """:meth:`reserve` for a batch, in order, with one outcome per item: a slot, or the
        error ``reserve`` would have raised for it (a failed item reserves nothing).

        A parent may also be an earlier item of the batch reserved here: a chain reserved
        parent first. Such a child must be committed after its parent (:meth:`commit_many`
        checks it); a child of a failed item fails (InvalidArgument: its prefix is not cached).
        ``tenant``: whose chunks they will be, checked as ``reserve`` checks them (ChunkExists
        where it sees the key, PermissionDenied where another tenant owns it, a parent it must
        see); None: the default tenant's, the key refused when any tenant holds it. A tenant
        with a quota in the tier has each item placed as ``reserve`` places it (its own chunks
        make room under its cap). Cheaper per item than ``reserve``: one index lookup round for
        the batch, and one eviction for the bytes the whole batch needs beyond the tier's free
        space.
        """
        n = len(keys)
        if len(sizes_bytes) != n or len(parents) != n:
            raise InvalidArgument(f"{n} keys, {len(sizes_bytes)} sizes, {len(parents)} parents")
        kind = tier or self._write_tier
        target = self._host_memory_tier(kind)
        owner = DEFAULT_TENANT if tenant is None else tenant
        out: list[WriteSlot | KvtierError | None] = [None] * n
        checked: list[bytes] = []
        for i, (key, size) in enumerate(zip(keys, sizes_bytes, strict=True)):
            k = b""
            try:
                k = check_key(key)
                if type(size) is not int or size < 1:
                    raise InvalidArgument(f"chunk size must be a positive int, got {size!r}")
            except InvalidArgument as exc:
                out[i] = exc
            checked.append(k)
        # Per key already indexed: whether the writer may see it (None: every tenant may).
        seen = self._index.seen_by([*checked, *(p for p in parents if p is not None)], tenant)
        # In order, what each item gets if the items before it are reserved (a child of a
        # refused item is refused: its prefix is not cached)...
        todo: list[int] = []
        expected: set[bytes] = set()
        total = 0
        for i, (key, parent) in enumerate(zip(checked, parents, strict=True)):
            if out[i] is not None:
                continue
            visible = seen.get(key)
            if visible is not None:
                if visible:
                    out[i] = ChunkExists(f"chunk {key.hex()} is already cached")
                else:
                    self.tenants.refused(owner)
                    out[i] = PermissionDenied(f"chunk {key.hex()} belongs to another tenant; "
                                              f"tenant {owner!r} cannot write it")
                continue
            if parent is not None and not seen.get(parent) and parent not in expected:
                out[i] = _orphan_error(key, parent)
                continue
            todo.append(i)
            expected.add(key)
            total += sizes_bytes[i]
        keys_todo = [checked[i] for i in todo]
        sizes_todo = [sizes_bytes[i] for i in todo]
        got: list[WriteSlot | KvtierError]
        batch = self._batch_memory.get(kind)
        capped = self._quotas and self._index.quota(kind, owner) is not None
        if batch is not None and not capped:
            used, capacity = self._index.room(kind)
            shortfall = used + total - capacity
            if shortfall > 0 and total <= capacity:
                try:
                    self._evict(kind, shortfall, driver=owner, only=_arena_mates(target, owner))
                except CapacityError as exc:  # each item below makes what room it can
                    log.debug("batch reserve of %d bytes in %s: %s", total, kind.value, exc)
            # ...then one tier call for them (room made above)...
            with writing_for(owner):  # the read index tags the chunks with their owner
                got = batch.reserve_many(keys_todo, sizes_todo)
        else:
            got = [_try(self._place_slot, kind, target, key, size, owner)
                   for key, size in zip(keys_todo, sizes_todo, strict=True)]
        # ...and in order again: an item the tier refused for room makes what room it can
        # alone, and a child of an item that failed after all gives its slot back.
        reserved: set[bytes] = set()
        for i, result in zip(todo, got, strict=True):
            key, parent = checked[i], parents[i]
            if parent is not None and parent not in reserved and not seen.get(parent):
                if not isinstance(result, KvtierError):
                    target.abort(result)
                out[i] = _orphan_error(key, parent)
                continue
            if isinstance(result, CapacityError) and not capped:
                result = _try(self._place_slot, kind, target, key, sizes_bytes[i], owner)
            out[i] = result
            if not isinstance(result, KvtierError):
                reserved.add(key)
        return [r for r in out if r is not None]

    def _place_slot(self, kind: TierKind, target: HostMemoryTier, key: bytes, size: int,
                    owner: str) -> WriteSlot:
        slot, _seconds = self._place(kind, target, key, size,
                                     functools.partial(target.reserve, key, size), owner=owner)
        return slot

    def commit_many(self, slots: Sequence[WriteSlot], parents: Sequence[bytes | None], *,
                    tier: TierKind | None = None, tenant: str = DEFAULT_TENANT
                    ) -> list[ChunkInfo | KvtierError]:
        """:meth:`commit` for a batch, in order, with one outcome per slot: its info, or the
        error ``commit`` would have raised (that slot is then freed).

        A slot whose parent is neither cached nor committed earlier in this call is freed
        unpublished (InvalidArgument), so a chain's child whose parent failed fails too. With
        durable puts each chunk is written through and published one by one, as ``commit``
        does (its NVMe record is written before it is published); otherwise the slots are
        published in the tier, then indexed in one lock round (:meth:`CacheIndex.insert_many`),
        counted once, and notified one STORED event per chunk, in order (one observer call
        for the batch where the cache has ``observe_many``). The chunks are ``tenant``'s (as
        reserved: :meth:`reserve_many`), each parent one it sees.
        """
        if len(parents) != len(slots):
            raise InvalidArgument(f"{len(slots)} slots but {len(parents)} parents")
        kind = tier or self._write_tier
        target = self._host_memory_tier(kind)
        present = self._index.present((p for p in parents if p is not None), tenant)
        done: set[bytes] = set()
        out: list[ChunkInfo | KvtierError] = []

        def orphan(slot: WriteSlot, parent: bytes) -> InvalidArgument:
            target.abort(slot)
            return InvalidArgument(f"parent {bytes(parent).hex()} of {slot.key.hex()} is not "
                                   "cached: a chunk without its prefix is useless")

        if self._backing_for(kind) is not None:
            for slot, parent in zip(slots, parents, strict=True):
                if parent is not None and parent not in done and parent not in present \
                        and self.entry(parent, tenant) is None:
                    out.append(orphan(slot, parent))
                    continue
                try:
                    out.append(self.commit(slot, parent=parent, tier=kind, tenant=tenant))
                except KvtierError as exc:
                    target.abort(slot)
                    out.append(exc)
                else:
                    done.add(slot.key)
            return out
        # In order, which slots can be published if the slots before them are...
        results: list[ChunkInfo | KvtierError | None] = []
        todo: list[int] = []
        todo_slots: list[WriteSlot] = []
        after: list[int] = []  # per slot of ``todo``: its parent's position there, or -1
        position: dict[bytes, int] = {}
        for slot, parent in zip(slots, parents, strict=True):
            if parent is None or parent in present:
                after.append(-1)
            else:
                first = position.get(parent)
                if first is None:
                    results.append(orphan(slot, parent))
                    continue
                after.append(first)
            position[slot.key] = len(todo)
            todo.append(len(results))
            todo_slots.append(slot)
            results.append(None)
        # ...then one tier call for them, and in order again: a slot the tier refused is
        # freed, and a child of a slot that failed after all is unpublished (never indexed).
        published: list[tuple[int, ChunkInfo]] = []
        items: list[tuple[bytes, bytes | None, int, int | None]] = []
        try:
            infos: list[ChunkInfo | KvtierError]
            batch = self._batch_memory.get(kind)
            if batch is not None:
                # The tier commits a child only after its parent (never published without it).
                infos = batch.commit_many(todo_slots, after)
            else:
                infos = []
                for slot, first in zip(todo_slots, after, strict=True):
                    infos.append(_orphan_error(slot.key, todo_slots[first].key)
                                 if first >= 0 and isinstance(infos[first], KvtierError)
                                 else _try(target.commit, slot))
            for i, info in zip(todo, infos, strict=True):
                results[i] = info
                if isinstance(info, KvtierError):
                    target.abort(slots[i])
                else:
                    published.append((i, info))
                    items.append((info.key, parents[i], info.size_bytes, info.checksum))
        except BaseException:
            for _i, info in published:
                target.remove(info.key)
            raise
        out = [r for r in results if r is not None]
        errors = self._index.insert_many(items, kind, tenant)
        stored: list[tuple[ChunkInfo, bytes | None]] = []
        for (i, info), err in zip(published, errors, strict=True):
            if err is not None:
                target.remove(info.key)  # the index refused it (a racing put, parent gone)
                out[i] = err
            else:
                stored.append((info, parents[i]))
        if stored:
            nbytes = 0
            for info, _p in stored:
                nbytes += info.size_bytes
            with self._counter_lock:
                c = self._counters[kind]
                c.puts += len(stored)
                c.bytes_written += nbytes
            self.tenants.stored(tenant, nbytes)
            if self._observe_many is not None:
                self._observe_many([ChunkChange(ChunkChangeKind.STORED, info.key, kind,
                                                info.size_bytes, parent, None, tenant)
                                    for info, parent in stored])
            else:
                for info, parent in stored:
                    self._notify(ChunkChangeKind.STORED, info.key, kind, info.size_bytes,
                                 parent=parent, tenant=tenant)
        return out

    def _check_writable(self, key: bytes, parent: bytes | None, tenant: str) -> None:
        """Before any bytes move: ChunkExists (``tenant`` already sees ``key``: chunks are
        immutable), PermissionDenied (another tenant owns it), InvalidArgument (the parent is not
        cached, or not visible to ``tenant``: a chunk without its prefix is useless)."""
        try:
            self._index.check_writable(key, parent, tenant)
        except ChunkExists:
            raise ChunkExists(f"chunk {key.hex()} is already cached") from None
        except PermissionDenied:
            self.tenants.refused(tenant)
            raise

    def _write_backing(self, kind: TierKind, key: bytes, src: Buffer, size: int,
                       parent: bytes | None, tenant: str) -> None:
        """Write the persistent copy of a put into a faster tier (write-through), making room.

        First every ancestor without a copy in ``kind`` gets one (root first): a full tier may
        have dropped the parent's copy for room, and a copy whose parent has none would be an
        orphan at the next start."""
        if parent is not None:
            self._back_ancestors(kind, parent)
        tier = self._tiers[kind]
        _info, seconds = self._place(kind, tier, key, size,
                                     lambda: _put(tier, key, src, parent, tenant), owner=tenant)
        self._count(kind, bytes_written=size, seconds_writing=seconds)

    def _back_ancestors(self, kind: TierKind, parent: bytes) -> None:
        missing: list[IndexEntry] = []
        up: bytes | None = parent
        while up is not None:
            entry = self._index.get(up)
            if entry is None or kind in (entry.tier, entry.backing):
                break
            missing.append(entry)
            up = entry.parent
        for entry in reversed(missing):
            try:
                self._add_backing(kind, entry)
            except (ChunkBusy, ChunkNotFound) as exc:
                # Claimed by a mover (a demotion, which writes the copy anyway) or gone.
                log.debug("ancestor %s of a durable copy not backed now: %s", entry.key.hex(), exc)
                return

    def _add_backing(self, kind: TierKind, entry: IndexEntry) -> None:
        """Give a cached chunk a backing copy in ``kind``, read from its primary copy under a
        pin (so it can neither move nor go meanwhile)."""
        key, size = entry.key, entry.size_bytes
        lease = self._index.pin(key, self._config.lease_ttl_s)
        try:
            entry = self._index.get(key) or entry
            if kind in (entry.tier, entry.backing):
                return  # another put backed it meanwhile
            host = self._host_memory.get(entry.tier)
            if host is not None:
                data: Buffer = host.view(key)
            else:
                data = bytearray(size)
                self._tiers[entry.tier].get_into(key, data)
            tier = self._tiers[kind]
            try:
                _info, seconds = self._place(kind, tier, key, size,
                                             lambda: _put(tier, key, data, entry.parent,
                                                          entry.tenant), owner=entry.tenant)
            except (ChunkExists, ChunkBusy):
                return  # a racing put is writing the same copy
            try:
                self._index.add_backing(key, kind)
            except KvtierError:
                tier.remove(key)
                raise
            self._count(kind, bytes_written=size, seconds_writing=seconds)
        finally:
            self._index.unpin(lease)

    def _backing_for(self, kind: TierKind) -> TierKind | None:
        """The tier a durable put into ``kind`` also writes (write-through), or None: the
        durable tier when ``write_tier`` is persistent and ``kind`` is faster than it."""
        durable = self._durable
        return durable if durable is not None and kind.order < durable.order else None

    def _host_memory_tier(self, kind: TierKind) -> HostMemoryTier:
        target = self._host_memory.get(kind)
        if target is None:
            self.tier(kind)  # raises for an unconfigured tier
            raise InvalidArgument(f"tier {kind.value} is not in host memory")
        return target

    def put_chain(self, keys: Sequence[bytes], chunks: Sequence[Buffer], *,
                  parent: bytes | None = None) -> int:
        """Store a chain of chunks (``keys[i]`` is the child of ``keys[i-1]``); skip cached ones.

        Returns how many were newly stored. Stops at the first chunk that cannot be placed
        (its descendants would be orphans) and re-raises that error only when nothing was stored.
        """
        if len(keys) != len(chunks):
            raise InvalidArgument(f"{len(keys)} keys but {len(chunks)} chunks")
        stored = 0
        up = parent
        for key, chunk in zip(keys, chunks, strict=True):
            if key not in self._index:
                try:
                    self.put(key, chunk, parent=up)
                except (CapacityError, ChunkBusy):
                    if stored == 0:
                        raise
                    break
                except ChunkExists:
                    pass  # another writer stored the same prefix meanwhile: same bytes
                else:
                    stored += 1
            up = key
        return stored

    # -- reads -----------------------------------------------------------------------------

    def get_into(self, key: bytes, dst: Buffer, tenant: str | None = None) -> int:
        """Copy one chunk into ``dst`` (exactly its size). A hit; may promote the chunk.

        Raises ChunkNotFound (also when ``tenant`` may not see it), SizeMismatch, ChunkCorrupt
        (the chunk and its descendants are dropped).
        """
        key = check_key(key)
        try:
            lease = self._index.pin_many((key,), self._config.lease_ttl_s, tenant)
        except ChunkNotFound:
            self.count_miss(tenant)
            raise
        try:
            kind = self._read_pinned(key, dst, tenant)
        finally:
            self._index.unpin(lease)
        self._index.touch(key)
        self._maybe_promote(key, kind, dst)
        return _nbytes(dst)

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int:
        """Copy the longest cached prefix of ``keys`` into ``dsts``; return how many blocks loaded.

        Loads stop early at a chunk that turns out corrupt or vanished: the caller recomputes
        from there (fewer blocks, never wrong bytes). Counts as one hit on the loaded prefix.
        """
        if len(keys) != len(dsts):
            raise InvalidArgument(f"{len(keys)} keys but {len(dsts)} destinations")
        self.lookups += 1
        lease = self._index.pin_prefix(keys, self._config.lease_ttl_s)
        if lease is None:
            self.misses += 1
            return 0
        loaded = 0
        found: list[TierKind] = []
        try:
            for key, dst in zip(lease.keys, dsts, strict=False):
                try:
                    found.append(self._read_pinned(key, dst, None))
                except (ChunkCorrupt, ChunkNotFound) as exc:
                    log.warning("prefix load stops at block %d: %s", loaded, exc)
                    break
                loaded += 1
        finally:
            self._index.unpin(lease)
        self._index.access_prefix(keys[:loaded])
        for key, kind, dst in zip(keys[:loaded], found, dsts, strict=False):
            self._maybe_promote(key, kind, dst)
        return loaded

    def _read_pinned(self, key: bytes, dst: Buffer, reader: str | None) -> TierKind:
        """Copy a pinned chunk out of its tier; counted for ``reader`` (None: its owner)."""
        entry = self._index.get(key)
        if entry is None:
            raise ChunkNotFound(key, "the tiered cache")
        kind = entry.tier
        start = time.perf_counter()
        try:
            n = self._tiers[kind].get_into(key, dst)
        except ChunkCorrupt:
            self._count(kind, corrupt=1)
            self._drop_subtree(key)
            raise
        except ChunkNotFound:
            # The tier lost it (a file deleted by hand): the index must not keep promising it.
            self._drop_subtree(key)
            raise
        self._count(kind, hits=1, bytes_read=n, seconds_reading=time.perf_counter() - start)
        self.tenants.read(entry.tenant if reader is None else reader, n)
        return kind

    def record_reads(self, keys: Sequence[bytes], kind: TierKind = TierKind.DRAM
                     ) -> tuple[int, int]:
        """Account reads that copied chunks out of tier ``kind`` without the cache (lease-free
        same-host reads, reported after the fact): one hit per key still in ``kind``, and one
        recency refresh per distinct key (a key read many times in one report is touched once).
        Keys gone or moved meanwhile are skipped. Returns (hits, bytes read) counted."""
        counts: dict[bytes, int] = {}
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        hits, nbytes = self._index.touch_held_in(counts, kind)
        if hits:
            self._count(kind, hits=hits, bytes_read=nbytes)
        return hits, nbytes

    # -- pins for zero-copy readers -----------------------------------------------------------

    def pin(self, keys: Sequence[bytes], ttl_s: float | None = None,
            tenant: str | None = None) -> Lease:
        """Pin chunks (all or nothing) so they are neither evicted nor moved until ``unpin``.
        Raises ChunkNotFound (also for a chunk ``tenant`` may not see), ChunkBusy."""
        return self._index.pin_many(keys, ttl_s or self._config.lease_ttl_s, tenant)

    def unpin(self, lease: Lease) -> bool:
        return self._index.unpin(lease)

    def renew(self, lease: Lease, ttl_s: float | None = None) -> Lease | None:
        """Extend a live lease; None when it already expired (see ``CacheIndex.renew``)."""
        return self._index.renew(lease, ttl_s or self._config.lease_ttl_s)

    def pin_in(self, kind: TierKind, keys: Sequence[bytes], ttl_s: float | None = None,
               tenant: str | None = None) -> Lease:
        """Move ``keys`` into tier ``kind`` when they live elsewhere, then pin them there.

        For readers that copy straight out of a tier's memory: while the lease lives, every key
        stays in ``kind`` at the same place. Counts one hit per key (and a miss when a key is
        not cached). Raises ChunkNotFound (also for a key ``tenant`` may not see), ChunkBusy
        (a key is claimed by a mover, or pinned by
        a reader in its old tier so it cannot move now), CapacityError (``kind`` cannot make
        room), ChunkCorrupt (the copy found it corrupt: it was dropped).
        """
        self.tier(kind)
        ttl = ttl_s or self._config.lease_ttl_s
        checked = [check_key(k) for k in keys]
        for _attempt in range(_PIN_IN_ATTEMPTS):
            # Pin first and check where the chunks are: the common case (already in ``kind``)
            # costs one pin and one snapshot per key.
            try:
                lease = self._index.pin_many(checked, ttl, tenant)
            except ChunkNotFound:
                self.count_miss(tenant)
                raise
            entries = [self._index.get(key) for key in checked]
            if all(e is not None and e.tier is kind for e in entries):
                for e in entries:
                    assert e is not None
                    self._count(kind, hits=1, bytes_read=e.size_bytes)
                    self.tenants.read(e.tenant if tenant is None else tenant, e.size_bytes)
                self._index.access_prefix(checked)
                return lease
            self._index.unpin(lease)
            for key, e in zip(checked, entries, strict=True):
                if e is not None and e.tier is not kind:
                    self._move_claimed(key, e.tier, kind, ttl)
        raise ChunkBusy(f"could not hold {len(checked)} chunk(s) in {kind.value}: "
                        "they keep being evicted")

    def _move_claimed(self, key: bytes, src_kind: TierKind, dst_kind: TierKind,
                      ttl_s: float) -> None:
        claim = self._index.claim([key], ttl_s)
        try:
            entry = self._index.get(key)
            if entry is None:
                raise ChunkNotFound(key, "the tiered cache")
            if entry.tier is dst_kind:
                return
            src_kind = entry.tier
            self._move(key, src_kind, dst_kind, claim)
            if key not in self._index:  # found corrupt while copying: dropped
                raise ChunkCorrupt(f"chunk {key.hex()} failed its checksum and was dropped")
        finally:
            self._index.unpin(claim)

    # -- removal and eviction ----------------------------------------------------------------

    def remove(self, key: bytes, tenant: str | None = None) -> list[bytes]:
        """Drop a chunk and everything cached under it; return the dropped keys. With
        ``tenant``, only a chunk that tenant owns (another tenant's, a shared one too, is
        ChunkNotFound).

        Raises ChunkNotFound, ChunkBusy (some of them are pinned).
        """
        dropped = self._index.remove_subtree(key, tenant=tenant)
        for k in dropped:
            self._remove_bytes(k)
        return dropped

    def evict(self, kind: TierKind, bytes_needed: int, *, guarantees: bool = True) -> int:
        """Free at least ``bytes_needed`` in one tier (demoting or dropping); return bytes freed.
        Tenants' guaranteed shares are kept unless ``guarantees`` is False."""
        self.tier(kind)
        before = self._index.usage(kind).used_bytes
        self._evict(kind, bytes_needed, guarantees=guarantees)
        return before - self._index.usage(kind).used_bytes

    def demote_to_low_watermark(self) -> dict[TierKind, int]:
        """Background work: bring every tier above its high watermark down to its low one."""
        freed: dict[TierKind, int] = {}
        for kind, tier in self._tiers.items():
            arenas = getattr(tier, "arenas", None)
            if arenas is not None:  # several arenas: each against its own watermarks
                freed[kind] = self._demote_arenas(kind, arenas())
                continue
            if self._index.over_high_watermark(kind):
                need = self._index.bytes_above_low_watermark(kind)
                before = self._index.usage(kind).used_bytes
                try:
                    # Never backing copies: that would give up durability to make room nobody
                    # asked for yet.
                    self._evict(kind, need, include_backing=False)
                    freed[kind] = before - self._index.usage(kind).used_bytes
                except CapacityError as exc:
                    log.info("cannot reach the low watermark of %s: %s", kind.value, exc)
        return freed

    def _demote_arenas(self, kind: TierKind,
                       arenas: Mapping[str, tuple[int, Callable[[str], bool]]]) -> int:
        """``demote_to_low_watermark`` for a tier of several arenas (``GroupedDramTier``):
        each arena above its own high watermark is brought down to its low one by evicting
        only its own tenants' chunks, so one full group never moves another group's chunks.
        Returns the bytes freed."""
        freed = 0
        for name, (capacity, members) in arenas.items():
            held = self._index.tenant_usage().get(kind, {})
            used = sum(n for tenant, n in held.items() if members(tenant))
            if used <= capacity * self._config.high_watermark:
                continue
            need = used - int(capacity * self._config.low_watermark)
            before = self._index.usage(kind).used_bytes
            try:
                self._evict(kind, need, include_backing=False, only=members)
            except CapacityError as exc:
                log.info("cannot reach the low watermark of %s arena %s: %s", kind.value,
                         name or "(default)", exc)
            freed += before - self._index.usage(kind).used_bytes
        return freed

    def persist(self) -> int:
        """Demote every chunk held in memory tiers down to the persistent tier (before a shutdown
        whose restart should find them: a chunk left only in memory is lost, and with it every
        persisted descendant, which ``recover`` would then drop as an orphan). A chunk that
        already has a persistent copy is only dropped from memory (nothing is written). Returns
        the bytes that left the memory tiers. Where the persistent tier is full, its own
        eviction makes room as usual."""
        persistent = [kind for kind, tier in self._tiers.items() if isinstance(tier, PersistentTier)]
        if not persistent:
            return 0
        moved = 0
        for kind in self._tiers:
            if kind.order >= persistent[0].order:
                break
            used = self._index.usage(kind).used_bytes
            if used:
                try:
                    # Guaranteed shares bound eviction, not a drain's demotion to disk.
                    moved += self.evict(kind, used, guarantees=False)
                except CapacityError as exc:  # pinned chunks stay; persist what can be
                    log.warning("persist: %s keeps some chunks: %s", kind.value, exc)
        return moved

    # -- recovery -----------------------------------------------------------------------------

    def recover(self) -> RecoveryReport:
        """Index the chunks persistent tiers already hold (after a restart). Call once, first.

        A chunk is indexed only when its parent is (the chain is rebuilt root first), as the
        tenant its record names (none: the default tenant); chunks whose parent did not survive,
        or whose owner may not hang under its parent's, are dropped from their tier (with what
        hangs under them), since they could never be used.
        """
        pending: dict[bytes, tuple[TierKind, ChunkInfo, bytes | None]] = {}
        for kind, tier in self._tiers.items():
            for info in tier.chunks():
                if info.key in self._index or info.key in pending:
                    continue
                pending[info.key] = (kind, info, _parent_of(info))
        unowned: list[bytes] = []
        # Index root first: a breadth-first walk from chunks whose parent is known (O(n)).
        children: dict[bytes | None, list[bytes]] = {}
        for key, (_kind, _info, parent) in pending.items():
            children.setdefault(parent, []).append(key)
        ready = [k for parent, keys in children.items()
                 if parent is None or parent in self._index for k in keys]
        by_tier: dict[TierKind, int] = {}
        while ready:
            key = ready.pop()
            kind, info, parent = pending[key]
            tenant = _tenant_of(info)
            try:
                if tenant is None:
                    raise InvalidArgument(f"owner {info.owner!r:.80} is not a tenant's name")
                self._index.insert(key, parent, kind, info.size_bytes, info.checksum,
                                   tenant=tenant, check_quota=False)
                self.tenants.track((tenant,))
            except (InvalidArgument, PermissionDenied) as exc:
                # Its parent belongs to a tenant it may not hang under (a chain begun by a
                # daemon that kept no owners, continued by one that does): unusable, as an
                # orphan is; its children stay pending and go with it.
                log.warning("dropping recovered chunk %s from %s: %s", key.hex(), kind.value, exc)
                unowned.append(key)
                continue
            del pending[key]
            self._notify(ChunkChangeKind.STORED, key, kind, info.size_bytes, parent=parent,
                         tenant=tenant)
            by_tier[kind] = by_tier.get(kind, 0) + 1
            ready.extend(children.get(key, ()))
        recovered = sum(by_tier.values())
        for key, (kind, _info, _parent) in pending.items():
            if key not in unowned:
                log.warning("dropping recovered chunk %s from %s: its parent did not survive",
                            key.hex(), kind.value)
            self._tiers[kind].remove(key)
        return RecoveryReport(recovered, len(pending), by_tier)

    def close(self) -> None:
        for tier in self._tiers.values():
            tier.close()

    # -- internals ------------------------------------------------------------------------------

    def _place(self, kind: TierKind, target: Tier, key: bytes, size: int,
               write: Callable[[], _T], *, owner: str, driver: str | None = None,
               request: bool = True) -> tuple[_T, float]:
        """Make room for ``size`` bytes of ``owner``'s in ``kind`` and run ``write`` (a tier
        put), evicting on CapacityError until it fits or nothing more can be evicted (backing
        copies last); DiskFull (the filesystem, not the budget) propagates at once, nothing
        evicted. ``driver``: whose write the room is made for (guaranteed shares of others are
        kept; None: ``owner``). Over ``owner``'s cap in ``kind``, only its own chunks there make
        room first, else CapacityError naming the tenant and the quota (counted as a refused
        request of ``owner`` when ``request``: a put, not the cache's own move).
        Returns the chunk's info and the seconds the write itself took (evictions excluded)."""
        usage = self._index.usage(kind)
        if size > usage.capacity_bytes:
            raise CapacityError(f"{kind.value}: a {size}-byte chunk is larger than the tier "
                                f"({usage.capacity_bytes} bytes)")
        driver = owner if driver is None else driver
        if self._quotas:
            self._make_room_under_cap(kind, owner, size, request)
            usage = self._index.usage(kind)
        mates = _arena_mates(target, owner)
        shortfall = usage.used_bytes + size - usage.capacity_bytes
        if shortfall > 0:
            self._evict(kind, shortfall, driver=driver, only=mates)
        for _attempt in range(_MAX_ROOM_ATTEMPTS):
            try:
                start = time.perf_counter()
                with writing_for(owner):  # the read index tags DRAM chunks with their owner
                    result = write()
                return result, time.perf_counter() - start
            except DiskFull:
                # The filesystem is full, not the tier's budget: evicting stored chunks to
                # reuse their space would trade acknowledged (durable) data for new puts.
                raise
            except CapacityError:
                # Logical room exists but the tier needs more (alignment, headers, fragments;
                # or, in a tier of several arenas, the owner's arena is full).
                self._evict(kind, max(size, _arena_capacity(target, owner) // 64),
                            driver=driver, only=mates)
        raise CapacityError(f"{kind.value}: no room for {size} bytes after evicting "
                            f"{_MAX_ROOM_ATTEMPTS} times")

    def _make_room_under_cap(self, kind: TierKind, owner: str, size: int, request: bool) -> None:
        """Evict ``owner``'s own chunks in ``kind`` until ``size`` more bytes fit under its
        cap there; QuotaExceeded (a CapacityError) naming the tenant and the quota when they
        cannot."""
        over = self._index.over_cap(kind, owner, size)
        if not over:
            return
        quota = self._index.quota(kind, owner)
        assert quota is not None and quota.max_bytes is not None
        try:
            if size > quota.max_bytes:
                raise CapacityError("the chunk alone is larger than the cap")
            self._evict(kind, over, driver=owner, only=owner)
        except CapacityError as exc:
            if request:
                self.tenants.refused(owner)
            raise QuotaExceeded(
                f"tenant {owner!r} is at its quota in {kind.value} (max_bytes "
                f"{quota.max_bytes}): a {size}-byte chunk needs {over} bytes of its own chunks "
                f"there evicted first, which is not possible ({exc})") from exc

    def _evict(self, kind: TierKind, bytes_needed: int, *, include_backing: bool = True,
               driver: str | None = None, only: str | Callable[[str], bool] | None = None,
               guarantees: bool = True) -> None:
        """Free ``bytes_needed`` in ``kind`` (demoting, else dropping) for ``driver``'s write
        (None: the cache's own work); ``only``: only that tenant's chunks (or those of the
        tenants the test admits: :func:`_arena_mates`); ``guarantees``:
        keep other tenants' guaranteed shares (``CacheIndex``, "Quotas")."""
        claim = self._index.claim_eviction(kind, bytes_needed, self._config.lease_ttl_s,
                                           include_backing=include_backing, tenant=driver,
                                           only_tenant=only, guarantees=guarantees)
        below = self._index.demotion_target(kind)
        try:
            for key in claim.keys:
                entry = self._index.get(key)
                if entry is None:
                    continue  # dropped with a corrupt ancestor meanwhile
                if entry.tier is not kind:  # a backing copy the plan fell back to
                    self._drop_backing(kind, key, claim)
                    continue
                if below is None:
                    self._drop(kind, key, claim)
                    continue
                try:
                    self._move(key, kind, below, claim, entry, driver=driver)
                except CapacityError:
                    self._drop(kind, key, claim)  # nothing below can take it
        finally:
            self._index.unpin(claim)

    def _drop(self, kind: TierKind, key: bytes, claim: Lease) -> None:
        """Drop a claimed victim, index first: the index refuses (ChunkBusy) when a child was
        inserted under it since the plan, and then the bytes must stay."""
        try:
            snap = self._index.remove(key, lease=claim)
        except (ChunkBusy, ChunkNotFound) as exc:
            log.debug("victim %s kept: %s", key.hex(), exc)
            return
        self._tiers[kind].remove(key)
        self._count(kind, drops=1)
        self._notify(ChunkChangeKind.REMOVED, key, kind, snap.size_bytes)

    def _drop_backing(self, kind: TierKind, key: bytes, claim: Lease) -> None:
        """Drop a claimed chunk's backing copy in ``kind``; its primary copy stays cached (no
        event: its fastest tier did not change)."""
        try:
            self._index.drop_backing(key, lease=claim)
        except (ChunkBusy, ChunkNotFound, InvalidArgument) as exc:
            log.debug("backing copy of %s kept: %s", key.hex(), exc)
            return
        self._tiers[kind].remove(key)
        self._count(kind, drops=1)

    def _move(self, key: bytes, src_kind: TierKind, dst_kind: TierKind, claim: Lease,
              entry: IndexEntry | None = None, *, driver: str | None = None) -> None:
        """Copy a claimed chunk from one tier to another, then retarget the index.

        When ``dst_kind`` already holds its backing copy, nothing is copied: the source copy is
        forgotten. A promotion out of a persistent tier keeps the source as the backing copy.
        ``entry``: the claimed chunk's snapshot, when the caller already took one; ``driver``:
        whose write the move makes room for (room in ``dst_kind`` is made for it too)."""
        src, dst = self._tiers[src_kind], self._tiers[dst_kind]
        if entry is None:
            entry = self._index.get(key)
        if entry is None:
            return
        size = entry.size_bytes
        parent = entry.parent
        if entry.backing is dst_kind:
            self._index.move(key, dst_kind, lease=claim)
            src.remove(key)
            self._notify(ChunkChangeKind.MOVED, key, dst_kind, size, from_tier=src_kind)
            self._count(src_kind, demotions_out=1)
            return
        keep_source = (entry.backing is None and src_kind in self._persistent
                       and dst_kind.order < src_kind.order)
        if dst_kind is self._durable and parent is not None:
            self._back_ancestors(dst_kind, parent)

        def write() -> ChunkInfo:
            host_dst = self._host_memory.get(dst_kind)
            if host_dst is not None:
                slot = host_dst.reserve(key, size)
                try:
                    src.get_into(key, slot.buffer)
                    return host_dst.commit(slot)
                except BaseException:
                    host_dst.abort(slot)
                    raise
            host_src = self._host_memory.get(src_kind)
            if host_src is not None:
                return _put(dst, key, host_src.view(key), parent, entry.tenant)
            bounce = bytearray(size)
            src.get_into(key, bounce)
            return _put(dst, key, bounce, parent, entry.tenant)

        try:
            _info, seconds = self._place(dst_kind, dst, key, size, write, owner=entry.tenant,
                                         driver=driver, request=False)
        except ChunkCorrupt:
            self._count(src_kind, corrupt=1)
            self._index.unpin(claim)
            self._drop_subtree(key)
            return
        try:
            self._index.move(key, dst_kind, lease=claim, keep_source=keep_source)
        except KvtierError:
            dst.remove(key)  # the index refused the move: the copy below must not linger
            raise
        if not keep_source:
            src.remove(key)
        self._notify(ChunkChangeKind.MOVED, key, dst_kind, size, from_tier=src_kind)
        if dst_kind.order > src_kind.order:
            self._count(src_kind, demotions_out=1)
        else:
            self._count(dst_kind, promotions_in=1)
        self._count(dst_kind, bytes_written=size, seconds_writing=seconds)

    def _maybe_promote(self, key: bytes, kind: TierKind, data: Buffer) -> None:
        if not self._config.promote_on_hit:
            return
        order = list(self._tiers)
        up_idx = order.index(kind) - 1
        if up_idx < 0 or order[up_idx].order < self._write_tier.order:
            return  # already in the fastest tier a put would use
        up = order[up_idx]
        try:
            claim = self._index.claim([key], self._config.lease_ttl_s)
        except (ChunkBusy, ChunkNotFound):
            return  # someone else is reading or moving it; promotion is best effort
        try:
            self._move(key, kind, up, claim)
        except (CapacityError, ChunkBusy) as exc:
            log.debug("promotion of %s to %s skipped: %s", key.hex(), up.value, exc)
        finally:
            self._index.unpin(claim)

    def _drop_subtree(self, key: bytes) -> None:
        try:
            dropped = self._index.remove_subtree(key, force=True)
        except ChunkNotFound:
            return
        for k in dropped:
            self._remove_bytes(k)

    def _remove_bytes(self, key: bytes) -> None:
        """Drop every copy of an unindexed chunk; one REMOVED event, from the fastest tier."""
        notified = False
        for kind, tier in self._tiers.items():
            size = tier.size_of(key) if self._observer is not None and not notified else 0
            if tier.remove(key):
                self._count(kind, drops=1)
                if not notified:
                    self._notify(ChunkChangeKind.REMOVED, key, kind, size or 0)
                    notified = True

    def _notify(self, kind: ChunkChangeKind, key: bytes, tier: TierKind, size_bytes: int, *,
                parent: bytes | None = None, from_tier: TierKind | None = None,
                tenant: str | None = None) -> None:
        if self._observer is not None:
            self._observer(ChunkChange(kind, bytes(key), tier, size_bytes,
                                       None if parent is None else bytes(parent), from_tier,
                                       tenant))

    def count_hit(self, kind: TierKind, size_bytes: int, tenant: str | None = None) -> None:
        """Account one read of ``size_bytes`` that a caller copied out of tier ``kind`` itself
        (a backend's copy-read), without :meth:`record_reads`' index lookup, for ``tenant``
        (the reader's, else the chunk's owner: ``index.touch_owner``; None: untracked).
        Recency is the caller's (``index.touch``/``touch_owner``)."""
        self._count(kind, hits=1, bytes_read=size_bytes)
        self.tenants.read(tenant, size_bytes)

    def count_miss(self, tenant: str | None = None) -> None:
        """Account one read that found nothing (``tenant``: the one the read acted for)."""
        self.misses += 1
        self.tenants.missed(DEFAULT_TENANT if tenant is None else tenant)

    def _count(self, kind: TierKind, **deltas: float) -> None:
        with self._counter_lock:
            c = self._counters[kind]
            for name, delta in deltas.items():
                setattr(c, name, getattr(c, name) + delta)


def _arena_mates(target: Tier, owner: str) -> Callable[[str], bool] | None:
    """In a tier of several arenas (``GroupedDramTier``): which tenants' chunks share
    ``owner``'s arena, the only ones whose eviction makes room for its write (a full arena of
    one tenant group never evicts another group's chunks). None: any tenant's."""
    same_arena = getattr(target, "same_arena", None)
    return None if same_arena is None else same_arena(owner)


def _arena_capacity(target: Tier, owner: str) -> int:
    """The capacity of ``owner``'s arena in ``target`` (a tier of several arenas), else of the
    tier: what an evict-and-retry round is sized by (a 64th of it), so a small group's full
    arena is not emptied for one chunk because the whole tier is large."""
    arena_of = getattr(target, "arena_of", None)
    if arena_of is None:
        return target.capacity_bytes
    return int(target.arena(arena_of(owner)).capacity_bytes)  # type: ignore[attr-defined]


def _orphan_error(key: bytes, parent: bytes) -> InvalidArgument:
    return InvalidArgument(f"parent {bytes(parent).hex()} of {key.hex()} is not cached: a "
                           "chunk without its prefix is useless")


def _try(call: Callable[..., _R], *args: Any) -> _R | KvtierError:
    """``call(*args)``, or the KvtierError it raised (a per-item outcome of a batch)."""
    try:
        return call(*args)
    except KvtierError as exc:
        return exc


def _nbytes(buf: Buffer) -> int:
    if hasattr(buf, "nbytes") and not isinstance(buf, memoryview):
        return int(buf.nbytes)
    if hasattr(buf, "element_size"):  # torch tensors
        return int(buf.numel() * buf.element_size())
    return memoryview(buf).nbytes


def _put(tier: Tier, key: bytes, src: Buffer, parent: bytes | None,
         tenant: str = DEFAULT_TENANT) -> ChunkInfo:
    """Put into a tier; persistent tiers also keep the parent key and the owning tenant (its
    UTF-8 name; the default tenant is no owner), for ``recover``."""
    if (parent is not None or tenant != DEFAULT_TENANT) and isinstance(tier, PersistentTier):
        return tier.put_with_meta(key, src, b"" if parent is None else bytes(parent),
                                  tenant.encode())
    return tier.put(key, src)


def _parent_of(info: ChunkInfo) -> bytes | None:
    return bytes(info.meta) if info.meta else None


def _tenant_of(info: ChunkInfo) -> str | None:
    """The tenant a persistent tier's chunk belongs to (no owner: the default tenant, as every
    record written before owners were kept); None when the owner is not a tenant's name."""
    try:
        return info.owner.decode() if info.owner else DEFAULT_TENANT
    except UnicodeDecodeError:
        return None


def _copy(c: TierCounters) -> TierCounters:
    return TierCounters(**{name: getattr(c, name) for name in TierCounters.__slots__})


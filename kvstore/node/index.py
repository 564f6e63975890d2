"""The cache index: which chunk lives in which tier, what is pinned, and what to evict.

Metadata only: the index never sees bytes. The tiered cache
(:mod:`kvstore.node.cache`) owns the tiers (:mod:`kvstore.dataplane.tier`) and
keeps this index equal to what they hold; the index answers lookups, hands out
leases, and plans evictions that respect pins and the prefix rule.

Entries
    One entry per chunk key: its *primary* tier (the fastest tier holding it:
    reads, pins and the policy's queues use it), optionally a *backing* tier (a
    slower, persistent tier that holds a second, clean copy: see below), its
    size, optional checksum, its parent key (``None`` for the first block of a
    sequence), last access time, hit count and leases. Keys are chained prefix
    keys, so a chunk is useless without its parent: an entry is only inserted
    under a cached parent, and the parent may live in any tier (slower than the
    child is fine: it is still "somewhere").

Backing copies
    A chunk in a memory tier may also have a copy in a slower tier (NVMe): a
    write-through put (``insert(..., backing=NVME)``) or a promotion that keeps
    its source (``move(..., keep_source=True)``). The backing tier's usage
    counts the copy (its bytes are really there). ``move`` of a backed entry
    *to its backing tier* only forgets the faster copy (nothing to write, no
    room needed). ``drop_backing`` forgets the backing copy (the entry stays
    cached in its primary tier). Backing copies are not in the policy's queues
    (those follow the primary tier), so the plan of a backing tier takes them
    only as a fallback, after every candidate the policy offers, and only when
    asked (``include_backing``): dropping one costs durability, not a cached
    chunk. Such a fallback takes leaf copies first: a copy whose child keeps a
    copy in the same tier is skipped, so what a persistent tier holds stays a
    set of whole prefixes (a restart can index every one of them).

The prefix rule
    Nothing the index does, or plans, ever leaves a cached child whose parent
    is in no tier. Demotion to the next configured tier down is always allowed
    (the entry stays cached). Dropping from the last configured tier (NVMe, or
    the only tier) takes **leaves only**: an entry with cached children is
    skipped until its children are gone, and a plan drops a child before its
    parent. ``remove`` refuses an entry with children; ``remove_subtree`` drops
    an entry and everything under it (for chunks found corrupt or lost).
    docs/eviction.md says why leaves-only rather than subtree drops.

Tenants
    Every entry records the tenant that owns it (``""``: the default tenant of every
    unauthenticated client; :data:`SHARED_TENANT`: chunks every tenant may read, such as system
    prompts). Calls that take ``tenant`` see only the entries that tenant may read: its own and
    the shared tenant's (``tenant=None``: every entry, for operators and the cache's own work).
    An entry another tenant owns is *absent* to such a call (``get`` None, a prefix match stops
    before it, ``pin_many`` and ``remove_subtree`` raise ChunkNotFound), so a guessed or leaked
    key reveals nothing. An insert names its tenant; its parent must be visible to that tenant
    (its own or shared): a child of a shared chunk may belong to any tenant, a child of a
    tenant's chunk belongs to that tenant. An insert of a key that another tenant owns is
    PermissionDenied (keys are global: one tenant can never replace another's chunk).

Quotas
    Each tier may give tenants a :class:`~kvstore.node.tenants.TenantQuota`. The index keeps
    the bytes each tenant holds per tier (``tenant_usage``; backing copies count in their
    tier). **Cap** (``max_bytes``): an insert that would take the tenant past it is
    CapacityError naming the tenant and the quota (``over_cap`` says how much to evict first;
    the cache plans that with ``only_tenant``, so a tenant over its cap loses only its own
    chunks). **Guaranteed share** (``guaranteed_bytes``): a plan never takes a victim whose
    owner would drop below its floor in that tier, unless the plan is for that owner's own
    write (``tenant=``); plans for the cache's own work (``tenant=None``: the watermark
    demoter, an operator's evict by bytes) keep every floor; only ``guarantees=False`` (a drain
    persisting DRAM to NVMe) ignores them. The floors of a tier sum to at most its capacity
    (checked at construction). A floor is a limit on eviction, not a reservation: a tenant
    below its floor has no room set aside, and may find the tier full of other guaranteed
    shares.

Leases
    ``pin*`` hand out SHARED leases (readers: the entry may not be moved or
    removed); ``claim``/``claim_eviction`` hand out EXCLUSIVE leases (a mover:
    nobody may pin it meanwhile). A lease expires after ``ttl_s`` on the
    index's clock and then protects nothing, so a crashed reader cannot pin
    forever; ``renew`` extends a live lease, ``unpin`` ends one. ``move`` and
    ``remove`` accept the caller's own lease so a claim holder can act.

How the tiered cache uses it (one put, one read)::

    # read: match, pin, copy out, unpin
    lease = index.pin_prefix(keys, ttl_s=5.0)            # None: no hit
    ... copy the leased chunks out of their tiers ...
    index.access_prefix(lease.keys); index.unpin(lease)

    # put into HBM: make room (demoting), then insert
    claim = index.claim_eviction(TierKind.HBM, size_bytes, ttl_s=30.0)
    for key in claim.keys:                               # victims, in order
        below = index.demotion_target(TierKind.HBM)      # None: drop
        ... copy the chunk down (which may make room below the same way) ...
        index.move(key, below, lease=claim)              # or index.remove(key, lease=claim)
    index.unpin(claim)
    hbm.put(key, src); index.insert(key, parent, TierKind.HBM, size_bytes)

Errors
    ``ChunkNotFound`` (unknown key in an explicit operation), ``ChunkExists``
    (insert of a present key), ``ChunkBusy`` (leased by someone else, or has
    cached children where that matters), ``CapacityError`` (no room, or no
    evictable set of entries frees enough), ``InvalidArgument`` (unconfigured
    tier, orphan insert, bad size/ttl). A miss in a lookup returns 0 or None.

Thread safety and cost
    Every public method takes one lock (policies run under it). Lookups, touches,
    inserts, moves and removes are O(1) per key plus the policy's O(1)/O(log n);
    ``plan_eviction`` is O(victims + skipped candidates); nothing scans all
    entries. ``get`` and ``usage`` return immutable snapshots.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvstore.dataplane.tier import TierKind
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    ConfigError,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PermissionDenied,
)
from kvstore.node.policies import EvictionPolicy, PolicyName, make_policy
from kvstore.node.tenants import TenantQuota, quota_table

# The rule and these names live in kvstore/security/tenancy.py (the conductor shares them).
from kvstore.security.tenancy import DEFAULT_TENANT as DEFAULT_TENANT
from kvstore.security.tenancy import SHARED_TENANT as SHARED_TENANT

Clock = Callable[[], float]
"""Seconds on a monotonic clock; injectable so tests control lease expiry."""


@dataclass(frozen=True, slots=True)
class TierBudget:
    """Capacity and watermarks of one tier, in bytes.

    Above ``high_watermark_bytes`` the cache should start demoting in the
    background, down to ``low_watermark_bytes``.
    """

    capacity_bytes: int
    high_watermark_bytes: int
    low_watermark_bytes: int

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0:
            raise ConfigError(f"tier capacity must be > 0 bytes, got {self.capacity_bytes}")
        if not 0 <= self.low_watermark_bytes <= self.high_watermark_bytes <= self.capacity_bytes:
            raise ConfigError(
                "watermarks must satisfy 0 <= low <= high <= capacity, got "
                f"low={self.low_watermark_bytes} high={self.high_watermark_bytes} "
                f"capacity={self.capacity_bytes}")

    @classmethod
    def of(cls, capacity_bytes: int, *, high_fraction: float = 0.95,
           low_fraction: float = 0.85) -> TierBudget:
        """A budget with watermarks as fractions of the capacity."""
        if not 0.0 <= low_fraction <= high_fraction <= 1.0:
            raise ConfigError(f"watermark fractions must satisfy 0 <= low <= high <= 1, "
                              f"got low={low_fraction} high={high_fraction}")
        return cls(capacity_bytes, int(capacity_bytes * high_fraction),
                   int(capacity_bytes * low_fraction))


class LeaseMode(enum.Enum):
    SHARED = "shared"
    """A reader's pin: the entries may not be moved or removed; others may pin too."""
    EXCLUSIVE = "exclusive"
    """A mover's claim: nobody else may pin, move or remove the entries."""


@dataclass(frozen=True, slots=True)
class Lease:
    """A time-limited hold on entries. Hand it back with ``unpin``; it dies at ``expires_at_s``."""

    lease_id: int
    keys: tuple[bytes, ...]
    mode: LeaseMode
    expires_at_s: float


@dataclass(frozen=True, slots=True)
class IndexEntry:
    """A snapshot of one entry."""

    key: bytes
    parent: bytes | None
    tier: TierKind
    size_bytes: int
    checksum: int | None
    depth: int
    inserted_at_s: float
    last_access_s: float
    access_count: int
    children: int
    """Cached children, in any tier."""
    pinned: bool
    """A live lease (shared or exclusive) holds it now."""
    backing: TierKind | None = None
    """A slower tier that holds a second copy (see "Backing copies"); None: ``tier`` only."""
    tenant: str = DEFAULT_TENANT
    """The tenant that owns the chunk (see "Tenants")."""


@dataclass(frozen=True, slots=True)
class TierUsage:
    tier: TierKind
    capacity_bytes: int
    used_bytes: int
    entries: int
    high_watermark_bytes: int
    low_watermark_bytes: int

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a key sequence and where each of its blocks lives."""

    length: int
    tiers: tuple[TierKind, ...]
    """``tiers[i]`` holds ``keys[i]`` for ``i < length``."""

    def count(self, tier: TierKind) -> int:
        return sum(1 for t in self.tiers if t is tier)

    def by_tier(self) -> dict[TierKind, int]:
        out: dict[TierKind, int] = {}
        for t in self.tiers:
            out[t] = out.get(t, 0) + 1
        return out


class _Node:
    """The index's record of one entry; policies see it through ``EntryView`` (read-only)."""

    __slots__ = ("access_count", "backing", "checksum", "children", "depth", "exclusive",
                 "inserted_at_s", "key", "last_access_s", "parent", "shared", "size_bytes",
                 "tenant", "tier")

    def __init__(self, key: bytes, parent: _Node | None, tier: TierKind, size_bytes: int,
                 checksum: int | None, now: float, tenant: str = DEFAULT_TENANT) -> None:
        self.key = key
        self.tenant = tenant
        self.parent = parent
        self.tier = tier
        self.backing: TierKind | None = None
        self.size_bytes = size_bytes
        self.checksum = checksum
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.inserted_at_s = now
        self.last_access_s = now
        self.access_count = 0
        self.children: set[_Node] | None = None
        self.shared: dict[int, float] | None = None  # lease_id -> expires_at_s
        self.exclusive: tuple[int, float] | None = None  # (lease_id, expires_at_s)

    def held(self, now: float, except_lease: int = -1) -> bool:
        """True while a live lease other than ``except_lease`` holds this entry."""
        ex = self.exclusive
        if ex is not None and ex[0] != except_lease and ex[1] > now:
            return True
        if self.shared:
            for lease_id, expires_at_s in self.shared.items():
                if lease_id != except_lease and expires_at_s > now:
                    return True
        return False

    def n_children(self) -> int:
        return len(self.children) if self.children else 0


def visible_to(owner: str, tenant: str | None) -> bool:
    """Whether a chunk owned by ``owner`` is visible to a call for ``tenant`` (None: every
    tenant): the tenant's own chunks and the shared tenant's."""
    return tenant is None or owner in (tenant, SHARED_TENANT)


def _visible(node: _Node | None, tenant: str | None) -> _Node | None:
    if node is None or tenant is None or node.tenant in (tenant, SHARED_TENANT):
        return node
    return None


class _TierState:
    __slots__ = ("backed", "budget", "entries", "quotas", "tenant_bytes", "used_bytes")

    def __init__(self, budget: TierBudget) -> None:
        self.budget = budget
        self.used_bytes = 0
        """Primary and backing copies held in this tier."""
        self.tenant_bytes: dict[str, int] = {}
        """``used_bytes`` by owning tenant (tenants holding nothing here are absent)."""
        self.quotas: dict[str, TenantQuota] = {}
        """The tier's quotas by tenant ("Quotas")."""
        self.entries = 0
        """Chunks with a copy (primary or backing) in this tier."""
        self.backed: dict[_Node, None] = {}
        """Entries whose backing copy is in this tier, oldest first (an ordered set)."""

    def add(self, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` more (or fewer, negative) held here by ``tenant``."""
        self.used_bytes += nbytes
        held = self.tenant_bytes.get(tenant, 0) + nbytes
        if held:
            self.tenant_bytes[tenant] = held
        else:
            del self.tenant_bytes[tenant]


class _LeaseRecord:
    __slots__ = ("expires_at_s", "lease_id", "mode", "nodes")

    def __init__(self, lease_id: int, nodes: list[_Node], mode: LeaseMode,
                 expires_at_s: float) -> None:
        self.lease_id = lease_id
        self.nodes = nodes
        self.mode = mode
        self.expires_at_s = expires_at_s


class CacheIndex:
    """Metadata of a tiered chunk cache. See the module docstring for the contract.

    ``budgets`` names the configured tiers; demotion goes to the next configured
    tier in :class:`TierKind` order and the last one drops. ``policy`` is an
    :class:`EvictionPolicy` instance or a :class:`PolicyName`. The constructor
    only builds in-memory structures.
    """

    def __init__(self, budgets: Mapping[TierKind, TierBudget],
                 policy: EvictionPolicy | PolicyName | str = PolicyName.LRU, *,
                 clock: Clock = time.monotonic, quotas: Iterable[TenantQuota] = ()) -> None:
        if not budgets:
            raise ConfigError("a cache index needs at least one tier")
        for tier, budget in budgets.items():
            if not isinstance(tier, TierKind) or not isinstance(budget, TierBudget):
                raise ConfigError(f"budgets must map TierKind to TierBudget, got {tier!r}: {budget!r}")
        order = sorted(budgets, key=lambda t: t.order)
        self._tiers = {tier: _TierState(budgets[tier]) for tier in order}
        for tier, row in quota_table(quotas, {t: budgets[t].capacity_bytes
                                              for t in order}).items():
            self._tiers[tier].quotas = row
        self._below: dict[TierKind, TierKind | None] = {
            tier: (order[i + 1] if i + 1 < len(order) else None) for i, tier in enumerate(order)}
        self._policy = policy if not isinstance(policy, PolicyName | str) else make_policy(policy)
        self._policy.bind({tier: budgets[tier].capacity_bytes for tier in order})
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[bytes, _Node] = {}
        self._leases: dict[int, _LeaseRecord] = {}
        self._lease_deadlines: list[tuple[float, int]] = []
        self._lease_ids = itertools.count(1)

    # -- configuration -------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def tiers(self) -> tuple[TierKind, ...]:
        """Configured tiers, fastest first."""
        return tuple(self._tiers)

    def demotion_target(self, tier: TierKind) -> TierKind | None:
        """The configured tier an entry evicted from ``tier`` goes to; None: it is dropped."""
        self._state(tier)
        return self._below[tier]

    def _state(self, tier: TierKind) -> _TierState:
        try:
            return self._tiers[tier]
        except KeyError:
            raise InvalidArgument(f"tier {tier!r} is not configured in this index") from None

    # -- lookups -------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: bytes, tenant: str | None = None) -> IndexEntry | None:
        """A snapshot of ``key``'s entry, or None when no tier holds it (or ``tenant`` may not
        see it: "Tenants")."""
        with self._lock:
            node = _visible(self._entries.get(key), tenant)
            return None if node is None else self._snapshot(node, self._clock())

    def _snapshot(self, node: _Node, now: float) -> IndexEntry:
        return IndexEntry(
            key=node.key, parent=None if node.parent is None else node.parent.key,
            tier=node.tier, size_bytes=node.size_bytes, checksum=node.checksum,
            depth=node.depth, inserted_at_s=node.inserted_at_s,
            last_access_s=node.last_access_s, access_count=node.access_count,
            children=node.n_children(), pinned=node.held(now), backing=node.backing,
            tenant=node.tenant)

    def longest_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> int:
        """How many leading ``keys`` are cached (and visible to ``tenant``), in any tier. Does
        not count as a hit."""
        entries = self._entries
        with self._lock:
            n = 0
            for key in keys:
                if _visible(entries.get(key), tenant) is None:
                    break
                n += 1
            return n

    def match_prefix(self, keys: Sequence[bytes], tenant: str | None = None) -> PrefixMatch:
        """The longest cached prefix (of chunks visible to ``tenant``) with the tier of each
        block. Does not count as a hit."""
        entries = self._entries
        with self._lock:
            tiers: list[TierKind] = []
            for key in keys:
                node = _visible(entries.get(key), tenant)
                if node is None:
                    break
                tiers.append(node.tier)
            return PrefixMatch(len(tiers), tuple(tiers))

    # -- hits ----------------------------------------------------------------

    def touch(self, key: bytes) -> bool:
        """Record a hit on one key. False when it is not cached (a miss is not an error)."""
        with self._lock:
            node = self._entries.get(key)
            if node is None:
                return False
            self._hit(node, self._clock())
            return True

    def touch_owner(self, key: bytes) -> str | None:
        """``touch`` that returns the chunk's owning tenant (None: not cached)."""
        with self._lock:
            node = self._entries.get(key)
            if node is None:
                return None
            self._hit(node, self._clock())
            return node.tenant

    def touch_held_in(self, counts: Mapping[bytes, int], tier: TierKind) -> tuple[int, int]:
        """Record reads that copied chunks out of ``tier`` (``counts[key]`` reads of each):
        one hit per key that ``tier`` still holds (others are skipped), under one lock and one
        clock read. Returns (reads counted, bytes read)."""
        hits = nbytes = 0
        entries = self._entries
        with self._lock:
            now = self._clock()
            for key, n in counts.items():
                node = entries.get(key)
                if node is None or node.tier is not tier:
                    continue
                self._hit(node, now)
                hits += n
                nbytes += n * node.size_bytes
        return hits, nbytes

    def access_prefix(self, keys: Sequence[bytes]) -> int:
        """Record a hit on the longest cached prefix of ``keys``; return its length.

        The hit blocks are notified deepest first, so recency-ordered policies see
        each parent as more recent than its children (leaves age first).
        """
        entries = self._entries
        with self._lock:
            hit: list[_Node] = []
            for key in keys:
                node = entries.get(key)
                if node is None:
                    break
                hit.append(node)
            if hit:
                now = self._clock()
                for node in reversed(hit):
                    self._hit(node, now)
            return len(hit)

    def _hit(self, node: _Node, now: float) -> None:
        node.access_count += 1
        node.last_access_s = now
        self._policy.on_access(node)

    # -- inserts -------------------------------------------------------------

    def insert(self, key: bytes, parent: bytes | None, tier: TierKind, size_bytes: int,
               checksum: int | None = None, *, backing: TierKind | None = None,
               tenant: str = DEFAULT_TENANT, check_quota: bool = True) -> None:
        """Record that ``tier`` now holds ``key`` (and ``backing``, a slower tier, a second
        copy: a write-through put). Its parent must be cached (any tier).

        ``tenant`` owns it ("Tenants"). Raises ChunkExists, PermissionDenied (another tenant
        owns ``key``), InvalidArgument (orphan, or a parent ``tenant`` may not see; bad size,
        unconfigured tier, ``backing`` not slower than ``tier``), CapacityError (a tier's recorded usage
        would exceed its capacity, or the tenant's cap there: make room first with
        ``plan_eviction``/``claim_eviction``).
        """
        self.insert_chain((key,), parent, tier, size_bytes,
                          None if checksum is None else (checksum,), backing=backing,
                          tenant=tenant, check_quota=check_quota)

    def insert_chain(self, keys: Sequence[bytes], parent: bytes | None, tier: TierKind,
                     size_bytes: int | Sequence[int],
                     checksums: Sequence[int | None] | None = None, *,
                     backing: TierKind | None = None, tenant: str = DEFAULT_TENANT,
                     check_quota: bool = True) -> None:
        """Insert ``keys[0]`` under ``parent``, ``keys[i]`` under ``keys[i-1]``: all or nothing.

        ``size_bytes`` is one size for every key or one per key; ``backing`` as in
        ``insert``, for every key. The policy is notified deepest key first (see
        ``access_prefix``). ``check_quota=False`` skips the tenant's cap ("Quotas"; for chunks
        a restart found, whose bytes are there anyway).
        """
        n = len(keys)
        sizes = [size_bytes] * n if isinstance(size_bytes, int) else list(size_bytes)
        if len(sizes) != n or (checksums is not None and len(checksums) != n):
            raise InvalidArgument(f"{n} keys but {len(sizes)} sizes"
                                  + ("" if checksums is None else f" and {len(checksums)} checksums"))
        with self._lock:
            st = self._state(tier)
            back = None if backing is None else self._state(backing)
            if backing is not None and backing.order <= tier.order:
                raise InvalidArgument(f"a backing copy in {backing.value} must be in a tier "
                                      f"slower than {tier.value}")
            parent_node: _Node | None = None
            if parent is not None:
                parent_node = _visible(self._entries.get(parent), tenant)
                if parent_node is None:
                    raise InvalidArgument(
                        f"parent {bytes(parent).hex()} of {bytes(keys[0]).hex() if keys else '?'} "
                        "is not cached: a chunk without its prefix is useless")
            seen: set[bytes] = set()
            for key, size in zip(keys, sizes, strict=True):
                if not isinstance(key, bytes) or not key:
                    raise InvalidArgument(f"keys must be non-empty bytes, got {key!r}")
                if not isinstance(size, int) or size <= 0:
                    raise InvalidArgument(f"size_bytes must be a positive int, got {size!r}")
                if key in seen:
                    raise ChunkExists(f"chunk {key.hex()} is already indexed")
                _check_owner(self._entries.get(key), tenant)
                seen.add(key)
            total = sum(sizes)
            if check_quota:
                _check_cap(st, tier, tenant, total)
                if back is not None and backing is not None:
                    _check_cap(back, backing, tenant, total)
            if st.used_bytes + total > st.budget.capacity_bytes:
                raise CapacityError(
                    f"{tier.value}: inserting {total} bytes would exceed capacity "
                    f"({st.used_bytes}/{st.budget.capacity_bytes} bytes used)")
            if backing is not None and back is not None \
                    and back.used_bytes + total > back.budget.capacity_bytes:
                raise CapacityError(
                    f"{backing.value}: a backing copy of {total} bytes would exceed capacity "
                    f"({back.used_bytes}/{back.budget.capacity_bytes} bytes used)")
            now = self._clock()
            nodes: list[_Node] = []
            up = parent_node
            for i, key in enumerate(keys):
                node = _Node(key, up, tier, sizes[i],
                             None if checksums is None else checksums[i], now, tenant)
                if up is not None:
                    if up.children is None:
                        up.children = set()
                    up.children.add(node)
                self._entries[key] = node
                nodes.append(node)
                up = node
                if back is not None:
                    node.backing = backing
                    back.backed[node] = None
            st.add(tenant, total)
            st.entries += n
            if back is not None:
                back.add(tenant, total)
                back.entries += n
            for node in reversed(nodes):
                self._policy.on_insert(node)

    def insert_many(self, items: Sequence[tuple[bytes, bytes | None, int, int | None]],
                    tier: TierKind, tenant: str = DEFAULT_TENANT) -> list[KvtierError | None]:
        """Insert ``(key, parent, size_bytes, checksum)`` items in order under one lock round,
        each as ``insert`` would (a parent may be an earlier item), with one outcome per item:
        None, or the error ``insert`` would have raised (that item is not indexed, and an item
        under it then fails too: its parent is not cached). The policy is notified per item,
        in order, as by one ``insert`` each."""
        out: list[KvtierError | None] = []
        with self._lock:
            # ``insert_chain``'s checks for one key, inlined: this runs per block of a batch.
            st = self._state(tier)
            entries = self._entries
            capacity = st.budget.capacity_bytes
            on_insert = self._policy.on_insert
            now = self._clock()
            for key, parent, size, checksum in items:
                if not isinstance(key, bytes) or not key:
                    out.append(InvalidArgument(f"keys must be non-empty bytes, got {key!r}"))
                    continue
                if not isinstance(size, int) or size <= 0:
                    out.append(InvalidArgument(f"size_bytes must be a positive int, got {size!r}"))
                    continue
                up: _Node | None = None
                if parent is not None:
                    up = _visible(entries.get(parent), tenant)
                    if up is None:
                        out.append(InvalidArgument(
                            f"parent {bytes(parent).hex()} of {key.hex()} is not cached: a chunk "
                            "without its prefix is useless"))
                        continue
                if key in entries:
                    out.append(_owner_error(entries[key], tenant))
                    continue
                if st.used_bytes + size > capacity:
                    out.append(CapacityError(
                        f"{tier.value}: inserting {size} bytes would exceed capacity "
                        f"({st.used_bytes}/{capacity} bytes used)"))
                    continue
                if st.quotas:
                    try:
                        _check_cap(st, tier, tenant, size)
                    except CapacityError as exc:
                        out.append(exc)
                        continue
                node = _Node(key, up, tier, size, checksum, now, tenant)
                if up is not None:
                    if up.children is None:
                        up.children = set()
                    up.children.add(node)
                entries[key] = node
                st.add(tenant, size)
                st.entries += 1
                on_insert(node)
                out.append(None)
        return out

    def present(self, keys: Iterable[bytes], tenant: str | None = None) -> set[bytes]:
        """Which of ``keys`` are cached (any tier; visible to ``tenant``), in one lock round."""
        with self._lock:
            entries = self._entries
            return {k for k in keys if _visible(entries.get(k), tenant) is not None}

    def seen_by(self, keys: Iterable[bytes], tenant: str | None) -> dict[bytes, bool]:
        """Of ``keys``, those cached (any tier), each with whether ``tenant`` sees it (True for
        every one when ``tenant`` is None), in one lock round: what a batch of writes by
        ``tenant`` checks (a key it sees exists, another tenant's is refused, a parent must be
        seen)."""
        with self._lock:
            entries = self._entries
            if tenant is None:
                return {k: True for k in keys if k in entries}
            out: dict[bytes, bool] = {}
            for k in keys:
                node = entries.get(k)
                if node is not None:
                    out[k] = node.tenant in (tenant, SHARED_TENANT)
            return out

    def check_writable(self, key: bytes, parent: bytes | None, tenant: str) -> None:
        """The checks an insert of ``key`` by ``tenant`` makes, before any bytes move: ChunkExists
        (``tenant`` already sees that key), PermissionDenied (another tenant owns it),
        InvalidArgument (``parent`` is not cached or not visible to ``tenant``)."""
        with self._lock:
            _check_owner(self._entries.get(key), tenant)
            if parent is not None and _visible(self._entries.get(parent), tenant) is None:
                raise InvalidArgument(f"parent {bytes(parent).hex()} of {bytes(key).hex()} is "
                                      "not cached: a chunk without its prefix is useless")

    def admit_count(self, keys: Sequence[bytes], parent: bytes | None, tier: TierKind,
                    size_bytes: int) -> int:
        """How many leading ``keys`` of a new chain the policy wants cached in ``tier``.

        Keys that fit in the free space are admitted; after that the policy's
        ``admit`` decides, and the first refusal ends the chain (a child cannot
        be cached without its parent). LRU and S3-FIFO admit everything.
        """
        with self._lock:
            st = self._state(tier)
            free = st.budget.capacity_bytes - st.used_bytes
            depth = 0
            if parent is not None:
                node = self._entries.get(parent)
                depth = 0 if node is None else node.depth + 1
            for i, key in enumerate(keys):
                free -= size_bytes
                if free < 0 and not self._policy.admit(key, tier, size_bytes, depth + i):
                    return i
            return len(keys)

    # -- moves and removals ----------------------------------------------------

    def _lease_id(self, lease: Lease | None) -> int:
        return -1 if lease is None else lease.lease_id

    def _require(self, key: bytes, tenant: str | None = None) -> _Node:
        node = _visible(self._entries.get(key), tenant)
        if node is None:
            raise ChunkNotFound(bytes(key), "the cache index")
        return node

    def move(self, key: bytes, to_tier: TierKind, *, lease: Lease | None = None,
             keep_source: bool = False) -> None:
        """Record that ``key``'s primary copy is now in ``to_tier`` (demotion or promotion).

        When ``to_tier`` is the entry's backing tier, the faster copy is forgotten and
        the backing copy becomes the primary one (no room needed: it is already counted).
        ``keep_source`` (a promotion out of a persistent tier) keeps the old copy as the
        entry's backing copy. Raises ChunkNotFound, ChunkBusy (leased by anyone but
        ``lease``), CapacityError (no room recorded in ``to_tier``), InvalidArgument
        (already there; ``keep_source`` on a backed entry or a demotion; a move past
        the backing tier).
        """
        with self._lock:
            node = self._require(key)
            dst = self._state(to_tier)
            if node.tier is to_tier:
                raise InvalidArgument(f"chunk {key.hex()} is already in {to_tier.value}")
            now = self._clock()
            if node.held(now, self._lease_id(lease)):
                raise ChunkBusy(f"chunk {key.hex()} is leased; it cannot move now")
            src = self._tiers[node.tier]
            from_tier = node.tier
            if node.backing is to_tier:
                if keep_source:
                    raise InvalidArgument(f"chunk {key.hex()} already has a copy in "
                                          f"{to_tier.value}")
                src.add(node.tenant, -node.size_bytes)
                src.entries -= 1
                del dst.backed[node]
                node.backing = None
                node.tier = to_tier
                self._policy.on_move(node, from_tier)
                return
            if keep_source and (node.backing is not None or to_tier.order > from_tier.order):
                raise InvalidArgument(f"chunk {key.hex()}: only a promotion of an unbacked "
                                      "entry keeps its source copy")
            if node.backing is not None and to_tier.order > node.backing.order:
                raise InvalidArgument(f"chunk {key.hex()} cannot move below its backing copy "
                                      f"in {node.backing.value}")
            if dst.used_bytes + node.size_bytes > dst.budget.capacity_bytes:
                raise CapacityError(f"{to_tier.value}: no room for {node.size_bytes} bytes "
                                    f"({dst.used_bytes}/{dst.budget.capacity_bytes} used)")
            if keep_source:
                node.backing = from_tier
                src.backed[node] = None
            else:
                src.add(node.tenant, -node.size_bytes)
                src.entries -= 1
            dst.add(node.tenant, node.size_bytes)
            dst.entries += 1
            node.tier = to_tier
            self._policy.on_move(node, from_tier)

    def add_backing(self, key: bytes, tier: TierKind) -> None:
        """Record that ``tier`` (slower than the primary tier) now holds a backing copy of
        ``key`` too. The primary copy does not change, so readers' pins do not stand in the way;
        the caller holds a pin of its own while it writes the copy.

        Raises ChunkNotFound, ChunkExists (it already has a backing copy), ChunkBusy (a mover
        claimed it), CapacityError (no room recorded in ``tier``), InvalidArgument.
        """
        with self._lock:
            node = self._require(key)
            back = self._state(tier)
            if node.backing is not None:
                raise ChunkExists(f"chunk {key.hex()} already has a copy in {node.backing.value}")
            if tier.order <= node.tier.order:
                raise InvalidArgument(f"a backing copy in {tier.value} must be in a tier slower "
                                      f"than {node.tier.value}")
            if self._claimed(node, self._clock()):
                raise ChunkBusy(f"chunk {key.hex()} is being moved or evicted")
            if back.used_bytes + node.size_bytes > back.budget.capacity_bytes:
                raise CapacityError(f"{tier.value}: no room for {node.size_bytes} bytes "
                                    f"({back.used_bytes}/{back.budget.capacity_bytes} used)")
            node.backing = tier
            back.backed[node] = None
            back.add(node.tenant, node.size_bytes)
            back.entries += 1

    def drop_backing(self, key: bytes, *, lease: Lease | None = None) -> TierKind:
        """Forget ``key``'s backing copy (its tier dropped it); the entry stays cached in its
        primary tier. Returns the tier the copy was in.

        Raises ChunkNotFound, ChunkBusy (leased by anyone but ``lease``), InvalidArgument
        (the entry has no backing copy).
        """
        with self._lock:
            node = self._require(key)
            if node.backing is None:
                raise InvalidArgument(f"chunk {key.hex()} has no backing copy")
            if node.held(self._clock(), self._lease_id(lease)):
                raise ChunkBusy(f"chunk {key.hex()} is leased; its copies cannot change now")
            backing = node.backing
            self._forget_backing(node)
            return backing

    def _forget_backing(self, node: _Node) -> None:
        if node.backing is not None:
            back = self._tiers[node.backing]
            back.add(node.tenant, -node.size_bytes)
            back.entries -= 1
            del back.backed[node]
            node.backing = None

    def remove(self, key: bytes, *, lease: Lease | None = None) -> IndexEntry:
        """Drop ``key`` from the index (its tier dropped the chunk). Returns its last snapshot.

        Raises ChunkNotFound, ChunkBusy (leased by anyone but ``lease``, or it
        still has cached children: remove those first, or use ``remove_subtree``).
        """
        with self._lock:
            node = self._require(key)
            now = self._clock()
            if node.held(now, self._lease_id(lease)):
                raise ChunkBusy(f"chunk {key.hex()} is leased; it cannot be removed now")
            if node.children:
                raise ChunkBusy(f"chunk {key.hex()} has {len(node.children)} cached children; "
                                "dropping it would orphan them")
            snap = self._snapshot(node, now)
            self._unlink(node)
            return snap

    def remove_subtree(self, key: bytes, *, force: bool = False,
                       lease: Lease | None = None, tenant: str | None = None) -> list[bytes]:
        """Drop ``key`` and every cached descendant, deepest first; return the dropped keys.

        For chunks found corrupt or lost: their descendants are useless. Without
        ``force`` nothing is dropped when any of them is leased (ChunkBusy); with
        ``force`` leases are ignored (the bytes are gone anyway). With ``tenant``, only a
        chunk that tenant owns: another tenant's (a shared one too) is ChunkNotFound.
        """
        with self._lock:
            root = self._require(key)
            if tenant is not None and root.tenant != tenant:
                raise ChunkNotFound(bytes(key), "the cache index")
            now = self._clock()
            order: list[_Node] = []
            stack = [root]
            while stack:
                node = stack.pop()
                order.append(node)
                if node.children:
                    stack.extend(node.children)
            if not force:
                busy = [n for n in order if n.held(now, self._lease_id(lease))]
                if busy:
                    raise ChunkBusy(f"{len(busy)} chunk(s) under {key.hex()} are leased")
            order.sort(key=lambda n: n.depth, reverse=True)
            for node in order:
                self._unlink(node)
            return [n.key for n in order]

    def _unlink(self, node: _Node) -> None:
        self._policy.on_remove(node)
        self._forget_backing(node)
        st = self._tiers[node.tier]
        st.add(node.tenant, -node.size_bytes)
        st.entries -= 1
        del self._entries[node.key]
        parent = node.parent
        if parent is not None and parent.children is not None:
            parent.children.discard(node)
            if not parent.children:
                parent.children = None

    # -- leases --------------------------------------------------------------

    def _reap_leases(self, now: float) -> None:
        """Forget leases whose deadline passed (amortized O(log n) per lease)."""
        heap = self._lease_deadlines
        while heap and heap[0][0] <= now:
            _, lease_id = heapq.heappop(heap)
            rec = self._leases.get(lease_id)
            if rec is not None and rec.expires_at_s <= now:
                self._release(rec)

    def _release(self, rec: _LeaseRecord) -> None:
        del self._leases[rec.lease_id]
        for node in rec.nodes:
            if rec.mode is LeaseMode.SHARED:
                if node.shared is not None:
                    node.shared.pop(rec.lease_id, None)
                    if not node.shared:
                        node.shared = None
            elif node.exclusive is not None and node.exclusive[0] == rec.lease_id:
                node.exclusive = None

    def _grant(self, nodes: list[_Node], mode: LeaseMode, ttl_s: float, now: float) -> Lease:
        if not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}")
        lease_id = next(self._lease_ids)
        expires = now + ttl_s
        for node in nodes:
            if mode is LeaseMode.SHARED:
                if node.shared is None:
                    node.shared = {}
                node.shared[lease_id] = expires
            else:
                node.exclusive = (lease_id, expires)
        self._leases[lease_id] = _LeaseRecord(lease_id, nodes, mode, expires)
        heapq.heappush(self._lease_deadlines, (expires, lease_id))
        return Lease(lease_id, tuple(n.key for n in nodes), mode, expires)

    @staticmethod
    def _claimed(node: _Node, now: float) -> bool:
        ex = node.exclusive
        return ex is not None and ex[1] > now

    def pin(self, key: bytes, ttl_s: float) -> Lease:
        """A SHARED lease on one key. Raises ChunkNotFound, ChunkBusy (claimed by a mover)."""
        return self.pin_many((key,), ttl_s)

    def pin_many(self, keys: Iterable[bytes], ttl_s: float, tenant: str | None = None) -> Lease:
        """A SHARED lease on every key, all or nothing. Raises ChunkNotFound (also for a key
        ``tenant`` may not see), ChunkBusy."""
        with self._lock:
            now = self._clock()
            self._reap_leases(now)
            nodes = [self._require(key, tenant) for key in keys]
            for node in nodes:
                if self._claimed(node, now):
                    raise ChunkBusy(f"chunk {node.key.hex()} is being moved or evicted")
            return self._grant(nodes, LeaseMode.SHARED, ttl_s, now)

    def pin_prefix(self, keys: Sequence[bytes], ttl_s: float,
                   tenant: str | None = None) -> Lease | None:
        """Pin the longest cached, unclaimed prefix of ``keys`` (visible to ``tenant``); None
        when it is empty.

        Match and pin are atomic, so the leased chunks cannot be evicted between
        the lookup and the copy. Not counted as a hit (call ``access_prefix``).
        """
        with self._lock:
            now = self._clock()
            self._reap_leases(now)
            nodes: list[_Node] = []
            for key in keys:
                node = _visible(self._entries.get(key), tenant)
                if node is None or self._claimed(node, now):
                    break
                nodes.append(node)
            return self._grant(nodes, LeaseMode.SHARED, ttl_s, now) if nodes else None

    def claim(self, keys: Iterable[bytes], ttl_s: float) -> Lease:
        """An EXCLUSIVE lease (for moving or dropping), all or nothing.

        Raises ChunkNotFound, ChunkBusy (any key is leased by anyone).
        """
        with self._lock:
            now = self._clock()
            self._reap_leases(now)
            nodes = [self._require(key) for key in keys]
            for node in nodes:
                if node.held(now):
                    raise ChunkBusy(f"chunk {node.key.hex()} is leased")
            return self._grant(nodes, LeaseMode.EXCLUSIVE, ttl_s, now)

    def unpin(self, lease: Lease) -> bool:
        """End a lease. False when it had already expired or been ended (not an error)."""
        with self._lock:
            rec = self._leases.get(lease.lease_id)
            if rec is None:
                return False
            live = rec.expires_at_s > self._clock()
            self._release(rec)
            return live

    def renew(self, lease: Lease, ttl_s: float) -> Lease | None:
        """Extend a live lease to ``now + ttl_s``; None when it already expired (re-pin instead)."""
        if not ttl_s > 0:
            raise InvalidArgument(f"ttl_s must be > 0, got {ttl_s}")
        with self._lock:
            now = self._clock()
            rec = self._leases.get(lease.lease_id)
            if rec is None or rec.expires_at_s <= now:
                self._reap_leases(now)
                return None
            rec.expires_at_s = expires = now + ttl_s
            for node in rec.nodes:
                if rec.mode is LeaseMode.SHARED:
                    if node.shared is not None and rec.lease_id in node.shared:
                        node.shared[rec.lease_id] = expires
                elif node.exclusive is not None and node.exclusive[0] == rec.lease_id:
                    node.exclusive = (rec.lease_id, expires)
            heapq.heappush(self._lease_deadlines, (expires, rec.lease_id))
            return Lease(rec.lease_id, lease.keys, rec.mode, expires)

    # -- capacity ------------------------------------------------------------

    def usage(self, tier: TierKind) -> TierUsage:
        with self._lock:
            st = self._state(tier)
            b = st.budget
            return TierUsage(tier, b.capacity_bytes, st.used_bytes, st.entries,
                             b.high_watermark_bytes, b.low_watermark_bytes)

    def room(self, tier: TierKind) -> tuple[int, int]:
        """``(used_bytes, capacity_bytes)`` of ``tier``: :meth:`usage`'s two figures a batch
        reserve needs, without building a :class:`TierUsage` (a frozen dataclass: ~1 µs)."""
        with self._lock:
            st = self._state(tier)
            return st.used_bytes, st.budget.capacity_bytes

    def over_high_watermark(self, tier: TierKind) -> bool:
        """True when ``tier`` uses more than its high watermark: start demoting."""
        with self._lock:
            st = self._state(tier)
            return st.used_bytes > st.budget.high_watermark_bytes

    def bytes_above_low_watermark(self, tier: TierKind) -> int:
        """How much to evict to get back to the low watermark (0 when below it)."""
        with self._lock:
            st = self._state(tier)
            return max(0, st.used_bytes - st.budget.low_watermark_bytes)

    def tenant_usage(self) -> dict[TierKind, dict[str, int]]:
        """Bytes each tenant holds per tier (primary and backing copies), a snapshot."""
        with self._lock:
            return {tier: dict(st.tenant_bytes) for tier, st in self._tiers.items()}

    def quota(self, tier: TierKind, tenant: str) -> TenantQuota | None:
        """``tenant``'s quota in ``tier`` ("Quotas"), or None."""
        return self._state(tier).quotas.get(tenant)

    def over_cap(self, tier: TierKind, tenant: str, size_bytes: int) -> int:
        """How many bytes ``tenant`` holds in ``tier`` beyond its cap once ``size_bytes`` more
        are added (0: within it, or no cap)."""
        with self._lock:
            st = self._state(tier)
            q = st.quotas.get(tenant)
            if q is None or q.max_bytes is None:
                return 0
            return max(0, st.tenant_bytes.get(tenant, 0) + size_bytes - q.max_bytes)

    def plan_eviction(self, tier: TierKind, bytes_needed: int, *,
                      include_backing: bool = False, tenant: str | None = None,
                      only_tenant: str | Callable[[str], bool] | None = None,
                      guarantees: bool = True) -> list[bytes]:
        """Victims to evict from ``tier``, in order, freeing at least ``bytes_needed``.

        Pure planning: nothing is removed (the policy may reorder its own state).
        Never a leased entry; in the last tier (drop) never an entry with cached
        children unless its children precede it in the plan. The caller demotes
        each victim to ``demotion_target(tier)`` or drops it. With
        ``include_backing``, backing copies held in ``tier`` follow the policy's
        candidates when those are not enough (oldest first, never one whose child
        keeps a copy in ``tier`` unless that child's copy precedes it): the caller
        tells them by ``get(key).tier is not tier`` and drops just that copy
        (``drop_backing``). ``tenant``: whose write the room is for (its own guaranteed share
        does not protect it from itself); ``only_tenant``: plan only that tenant's chunks (a
        put over its cap), or those of the tenants a test admits (a tier of several arenas:
        only chunks sharing the writer's arena free room for it); ``guarantees=False``: ignore guaranteed shares (a drain persisting
        memory tiers). "Quotas" says the rule. Raises CapacityError when no such set exists
        (everything left is leased, guaranteed, or ``bytes_needed`` exceeds the capacity).
        """
        with self._lock:
            now = self._clock()
            self._reap_leases(now)
            return [n.key for n in self._plan(tier, bytes_needed, now, include_backing,
                                              tenant, only_tenant, guarantees)]

    def claim_eviction(self, tier: TierKind, bytes_needed: int, ttl_s: float, *,
                       include_backing: bool = False, tenant: str | None = None,
                       only_tenant: str | Callable[[str], bool] | None = None,
                       guarantees: bool = True) -> Lease:
        """``plan_eviction`` plus an EXCLUSIVE lease on the victims, atomically.

        ``lease.keys`` is the plan, in order. Readers cannot pin the victims while
        the claim lives; pass the lease to ``move``/``remove`` and ``unpin`` it at
        the end (or let it expire: unexecuted victims simply stay cached).
        """
        with self._lock:
            now = self._clock()
            self._reap_leases(now)
            nodes = self._plan(tier, bytes_needed, now, include_backing, tenant, only_tenant,
                               guarantees)
            return self._grant(nodes, LeaseMode.EXCLUSIVE, ttl_s, now)

    def _plan_backing(self, st: _TierState, tier: TierKind, bytes_needed: int, freed: int,
                      now: float, victims: list[_Node], taken: set[_Node],
                      may_take: Callable[[_Node], bool]) -> int:
        """Append backing copies held in ``tier`` to ``victims`` until ``freed`` reaches
        ``bytes_needed``; return the new ``freed``. Oldest copy first, but never one whose
        child keeps a copy in ``tier`` (after a restart that child would be an orphan): such
        a copy is skipped and taken right after its last such child (a cascade, as in
        ``_plan``). O(victims + skipped)."""
        def blocked(node: _Node) -> bool:
            return bool(node.children) and any(
                (c.tier is tier or c.backing is tier) and c not in taken
                for c in node.children)  # type: ignore[union-attr]

        skipped: set[_Node] = set()
        for node in st.backed:
            if node in taken or node.held(now):
                continue
            if blocked(node):
                skipped.add(node)
                continue
            cascade: _Node | None = node
            while cascade is not None and freed < bytes_needed:
                if not may_take(cascade):
                    break
                victims.append(cascade)
                taken.add(cascade)
                freed += cascade.size_bytes
                up = cascade.parent
                cascade = up if up is not None and up in skipped and not blocked(up) else None
                if cascade is not None:
                    skipped.discard(cascade)
            if freed >= bytes_needed:
                break
        return freed

    def _plan(self, tier: TierKind, bytes_needed: int, now: float,
              include_backing: bool = False, driver: str | None = None,
              only: str | Callable[[str], bool] | None = None,
              guarantees: bool = True) -> list[_Node]:
        st = self._state(tier)
        if bytes_needed <= 0:
            return []
        admits: Callable[[str], bool] | None = (
            None if only is None else only if callable(only) else only.__eq__)
        # Quotas: which victims this plan may take (``only``: that tenant's; a guaranteed share
        # of a tenant other than ``driver`` is never planned below its floor).
        planned: dict[str, int] = {}
        kept_for_guarantee = 0
        floors = {t: q.guaranteed_bytes for t, q in st.quotas.items()
                  if q.guaranteed_bytes and t != driver} if guarantees else {}

        def may_take(node: _Node) -> bool:
            nonlocal kept_for_guarantee
            owner = node.tenant
            if admits is not None and not admits(owner):
                return False
            floor = floors.get(owner)
            if floor is not None:
                held = st.tenant_bytes.get(owner, 0) - planned.get(owner, 0)
                if held - node.size_bytes < floor:
                    kept_for_guarantee += 1
                    return False
            if floors:
                planned[owner] = planned.get(owner, 0) + node.size_bytes
            return True

        if bytes_needed > st.budget.capacity_bytes:
            raise CapacityError(f"{tier.value}: {bytes_needed} bytes needed but the tier "
                                f"holds only {st.budget.capacity_bytes}")
        drops = self._below[tier] is None
        entries = self._entries
        victims: list[_Node] = []
        taken: set[_Node] = set()
        freed = 0
        # Drop tier only: children already planned per parent, and parents skipped
        # because they had children, so a parent whose last child gets planned is
        # taken right after it (it was older in the policy's order).
        planned_children: dict[_Node, int] = {}
        blocked: set[_Node] = set()

        stream = self._policy.candidates(tier)
        try:
            key = next(stream)
            while True:
                node = entries.get(key)
                if node is None or node.tier is not tier or node in taken:
                    raise InvariantViolation(
                        f"policy {self._policy.name} offered {key!r} for {tier.value}, "
                        "which is not an untaken entry of that tier")
                ok = not node.held(now)
                if ok and drops and node.children and \
                        len(node.children) > planned_children.get(node, 0):
                    ok = False
                    blocked.add(node)
                if ok and (floors or admits is not None) and not may_take(node):
                    ok = False
                if ok:
                    cascade: _Node | None = node
                    while cascade is not None:
                        victims.append(cascade)
                        taken.add(cascade)
                        freed += cascade.size_bytes
                        parent = cascade.parent
                        cascade = None
                        if drops and parent is not None and parent.tier is tier:
                            done = planned_children.get(parent, 0) + 1
                            planned_children[parent] = done
                            # A parent skipped earlier (older) whose last child is now
                            # planned goes next, unless the plan is already big enough.
                            if freed < bytes_needed and parent in blocked \
                                    and done == parent.n_children() and not parent.held(now) \
                                    and (not (floors or admits is not None) or may_take(parent)):
                                blocked.discard(parent)
                                cascade = parent
                    if freed >= bytes_needed:
                        break
                key = stream.send(ok)
        except StopIteration:
            pass
        finally:
            stream.close()
        if freed < bytes_needed and include_backing:
            freed = self._plan_backing(st, tier, bytes_needed, freed, now, victims, taken,
                                       may_take)
        if freed < bytes_needed:
            whose = "" if only is None else f" of tenant {only!r}" if isinstance(only, str) \
                else " of the tenants sharing the writer's arena"
            raise CapacityError(
                f"{tier.value}: cannot free {bytes_needed} bytes{whose}; only {freed} are "
                f"evictable ({st.used_bytes}/{st.budget.capacity_bytes} used; the rest is leased"
                + (", holds cached children" if drops else "")
                + (f", or is {kept_for_guarantee} chunk(s) of other tenants' guaranteed shares"
                   if kept_for_guarantee else "") + ")")
        return victims


def _owner_error(node: _Node, tenant: str) -> KvtierError:
    """What an insert by ``tenant`` of ``node``'s key is told: ChunkExists when ``tenant`` may
    see it, else PermissionDenied (it never replaces another tenant's chunk)."""
    if _visible(node, tenant) is not None:
        return ChunkExists(f"chunk {node.key.hex()} is already indexed")
    return PermissionDenied(f"chunk {node.key.hex()} belongs to another tenant; tenant "
                            f"{tenant!r} cannot write it")


def _check_owner(node: _Node | None, tenant: str) -> None:
    if node is not None:
        raise _owner_error(node, tenant)


def _check_cap(st: _TierState, tier: TierKind, tenant: str, nbytes: int) -> None:
    q = st.quotas.get(tenant)
    if q is not None and q.max_bytes is not None:
        held = st.tenant_bytes.get(tenant, 0)
        if held + nbytes > q.max_bytes:
            raise CapacityError(
                f"tenant {tenant!r} is over its quota in {tier.value}: it holds {held} bytes, "
                f"{nbytes} more would pass its max_bytes of {q.max_bytes}")

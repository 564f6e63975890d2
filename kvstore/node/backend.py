"""The daemon's data-plane side of its tiered cache: a LeaseBackend and same-host leases.

:class:`CacheLeaseBackend` implements the transport's
:class:`~kvstore.dataplane.transport.base.LeaseBackend` over a
:class:`~kvstore.node.cache.TieredCache`, so a ``TcpServer`` sends chunks straight out of the
DRAM arena and receives puts straight into it:

* ``open_read`` moves the chunk into DRAM when it lives elsewhere (a chunk in NVMe is promoted,
  the cache's ``pin_in``) and pins it there; the read lease's view is the arena range itself,
  and ``release`` unpins. When DRAM cannot take it (everything pinned, chunk larger than DRAM,
  or another reader holds it in NVMe) the chunk is copied into a private buffer instead: slower,
  never wrong.
* ``open_write`` reserves an invisible DRAM slot (the cache evicts to make room); ``commit``
  publishes it into the cache index, ``abort`` frees it. TCP frames carry no parent key, so a
  put arriving over TCP is a root chunk unless :meth:`ParentHints.expect` named its parent
  first (the ``SetParents`` RPC).

:class:`ShmLeases` implements the shared-memory plane's
:class:`~kvstore.dataplane.transport.base.ArenaLeaseBackend`: the same two kinds of lease by id,
with arena offsets instead of views, for clients on the same host that map the arena themselves
(through the lease channel, :class:`~kvstore.dataplane.transport.shm.ShmServer`, or the gRPC
lease calls). Each lease has an *owner* (a channel connection, or the gRPC session that took
it) and a deadline: only its owner can release, commit or abort it (another owner's id is
"unknown"); :meth:`ShmLeases.drop_owner` ends every lease of a connection that closed (a client
that died mid-put never makes its chunk visible; one that died mid-get unpins), and
:meth:`ShmLeases.expire` ends leases past their deadline.

Bounds (issue 12): lease ids are unguessable (:class:`LeaseIds`: 63 bits of a keyed hash,
never 0, never two live at once), every client TTL is checked by :func:`check_ttl` (finite,
> 0, at most ``server.max_ttl_s``), and :class:`LeaseBudget` caps the pins, read leases and
reservations held for clients at once (``server.max_leases``; ``TooManyLeases`` beyond it).

Tenants (docs/security.md, "Tenant isolation"): the gRPC lease calls pass their caller's tenant
(``acquire_read(tenant=)``, ``reserve(tenant=)``, kept for its ``commit``). A data-plane
connection whose session ticket carries a
:class:`~kvstore.dataplane.transport.auth.TenantScope` (every connection to a daemon with
security) is served through ``scoped(scope)``: :class:`TenantLeaseBackend` (TCP) and
:class:`TenantShmLeases` (the lease channel) pass the scope's read tenant to every read, size
and remove, and its write tenant to every put and reservation, as the gRPC handlers pass
theirs: reads see that tenant's chunks and the shared ones, puts are owned by it, a key another
tenant owns is PermissionDenied, and remove drops only its own chunks. A scope that may not
write (it named the shared tenant without ``shared_writer``) has every put refused. An unscoped
connection (no security: no ticket) reads every chunk and writes the default tenant, as before.
Scoped batches on the lease channel reserve and commit as a batch for the scope's write tenant
(the cache's batch calls check owners and parents for it, and place each item of a tenant with
a quota one by one, so its own chunks make room under its cap); a scoped TCP connection's small reads that Python serves copy pin-free between
two tenant-checked index look-ups (:meth:`TenantLeaseBackend.read_into`); the native loop
serves such a connection only publishes the TCP server verified for its tenant with
``size_of`` (kvstore/dataplane/transport/tcp/server.py, "Tenants").

Thread safety: everything here may be called from any thread.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import secrets
import struct
import threading
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass

from kvstore.dataplane import native
from kvstore.dataplane.arena import copy_bytes
from kvstore.dataplane.compress import CodecKind
from kvstore.dataplane.dram import DEFAULT_ARENA, DramSlot, DramTier, GroupedDramTier
from kvstore.dataplane.tier import MAX_KEY_BYTES, ChunkKey, TierKind, WriteSlot, check_key
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.dataplane.transport.base import ArenaRange, ViewReadLease
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PermissionDenied,
    SizeMismatch,
    TierUnavailable,
    TooManyLeases,
    short_key,
)
from kvstore.node.cache import TieredCache
from kvstore.node.index import DEFAULT_TENANT, Lease

log = logging.getLogger(__name__)

_PREFIX_RETRIES = 4
MAX_PARENT_HINTS = 1 << 20
DEFAULT_MAX_TTL_S = 3600.0
"""``server.max_ttl_s``'s default, for backends built without a config (tests)."""
DEFAULT_MAX_LEASES = 65536
"""``server.max_leases``'s default, likewise."""


def check_ttl(ttl_s: float, max_ttl_s: float, *, what: str = "ttl_s") -> float:
    """A TTL a client asked for, checked: finite, > 0 and at most ``max_ttl_s`` (the daemon's
    ``server.max_ttl_s``); anything else (inf, nan, 1e300, 0, -1) is InvalidArgument. Callers
    that give 0 the meaning "the default" substitute it before calling."""
    if not (isinstance(ttl_s, int | float) and math.isfinite(ttl_s) and 0 < ttl_s <= max_ttl_s):
        raise InvalidArgument(f"{what} must be finite, > 0 and <= {max_ttl_s:g} s "
                              f"(server.max_ttl_s), got {ttl_s!r}")
    return float(ttl_s)


class LeaseIds:
    """Lease ids no client can guess: 63 bits of a keyed BLAKE2b of a counter (the key is
    random per instance, so per daemon), never 0, and never one that is still live.

    A counter from a random start, as before, let any client reach another's lease by trying
    the neighbours of its own id. A keyed hash costs ~0.5 µs and no system call per id
    (``secrets`` would read ``/dev/urandom`` each time); truncated to 63 bits two counters
    can collide, so :meth:`new` skips an id that ``live`` still holds. Not thread-safe: call
    under the owner's lock."""

    __slots__ = ("_counter", "_key")

    def __init__(self) -> None:
        self._key = secrets.token_bytes(32)
        self._counter = itertools.count(1)

    def new(self, live: Container[int]) -> int:
        while True:
            digest = hashlib.blake2b(next(self._counter).to_bytes(8, "little"),
                                     key=self._key, digest_size=8).digest()
            lease_id = int.from_bytes(digest, "little") >> 1
            if lease_id and lease_id not in live:
                return lease_id

    def new_many(self, n: int, live: Container[int]) -> list[int]:
        """``n`` ids as :meth:`new`'s, distinct, from one keyed hash per 8 (a 64-byte digest
        of a counter split into 8-byte words: as unguessable as one hash per id, ~8x cheaper;
        measured 3.8 µs per BLAKE2b call here)."""
        out: list[int] = []
        seen: set[int] = set()
        while len(out) < n:
            digest = hashlib.blake2b(b"many" + next(self._counter).to_bytes(8, "little"),
                                     key=self._key, digest_size=64).digest()
            for word in struct.unpack("<8Q", digest):
                lease_id = word >> 1
                if lease_id and lease_id not in live and lease_id not in seen:
                    seen.add(lease_id)
                    out.append(lease_id)
                    if len(out) == n:
                        break
        return out


class LeaseBudget:
    """How many pins, read leases and reservations the daemon holds for clients at once,
    against ``server.max_leases``. Shared by :class:`ShmLeases` and the gRPC pins.
    Thread-safe."""

    def __init__(self, max_leases: int = DEFAULT_MAX_LEASES) -> None:
        if max_leases < 1:
            raise InvalidArgument(f"max_leases must be >= 1, got {max_leases}")
        self.max_leases = max_leases
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def take(self) -> None:
        """Count one more lease; TooManyLeases (RESOURCE_EXHAUSTED) when the budget is spent."""
        with self._lock:
            if self._held >= self.max_leases:
                raise TooManyLeases(f"the daemon already holds {self.max_leases} pins, read "
                                    "leases and reservations (server.max_leases); release some "
                                    "or retry once they expire")
            self._held += 1

    def take_up_to(self, n: int) -> int:
        """Count up to ``n`` more leases, as many as the budget has left; return how many."""
        with self._lock:
            granted = max(0, min(n, self.max_leases - self._held))
            self._held += granted
            return granted

    def give(self, n: int = 1) -> None:
        """Count ``n`` leases as ended."""
        with self._lock:
            if n > self._held:
                raise InvariantViolation(f"{n} leases given back, {self._held} held")
            self._held -= n


class ParentHints:
    """Parents announced for puts that will arrive without one (over TCP), for ``ttl_s``
    (at most ``max_ttl_s``); at most ``max_entries`` are pending. A hint belongs to the tenant
    that announced it and a scoped put takes only its own tenant's (another tenant can neither
    replace it nor make one of its puts a child of a chunk it may not see); an unscoped put (a
    daemon without security) takes the latest hint for its key, whoever announced it."""

    def __init__(self, max_entries: int = MAX_PARENT_HINTS, *,
                 max_ttl_s: float = DEFAULT_MAX_TTL_S) -> None:
        self._lock = threading.Lock()
        self._hints: dict[tuple[str, bytes], tuple[bytes, float]] = {}
        self._latest: dict[bytes, str] = {}
        """Key -> the tenant that announced a hint for it last (for unscoped puts)."""
        self._max_entries = max_entries
        self._max_ttl_s = max_ttl_s

    def expect(self, key: bytes, parent: bytes, ttl_s: float, *,
               tenant: str = DEFAULT_TENANT) -> None:
        """The next put of ``key`` by ``tenant`` within ``ttl_s`` is a child of ``parent``.
        Raises InvalidArgument (bad key, or a TTL :func:`check_ttl` refuses), CapacityError."""
        k, p = check_key(key), check_key(parent)
        check_ttl(ttl_s, self._max_ttl_s)
        now = time.monotonic()
        with self._lock:
            if len(self._hints) >= self._max_entries:
                self._purge_locked(now)
                if len(self._hints) >= self._max_entries:
                    raise CapacityError(f"{self._max_entries} parent hints are pending")
            self._hints[(tenant, k)] = (p, now + ttl_s)
            self._latest[k] = tenant

    def take(self, key: bytes, tenant: str | None = None) -> bytes | None:
        """The parent ``tenant`` announced for ``key`` (None: the latest announced, by any
        tenant), forgotten once taken; or None."""
        with self._lock:
            owner = self._latest.get(key) if tenant is None else tenant
            if owner is None:
                return None
            hint = self._hints.pop((owner, key), None)
            if self._latest.get(key) == owner:
                del self._latest[key]
        if hint is None or hint[1] < time.monotonic():
            return None
        return hint[0]

    def _purge_locked(self, now: float) -> None:
        for tenant, key in [k for k, (_p, deadline) in self._hints.items() if deadline < now]:
            del self._hints[(tenant, key)]
            if self._latest.get(key) == tenant:
                del self._latest[key]

    def __len__(self) -> int:
        return len(self._hints)


# --- the LeaseBackend --------------------------------------------------------------------------


class CacheReadLease(ViewReadLease):
    """A read lease of :class:`CacheLeaseBackend`: an arena view under a cache pin, or a
    private copy (no pin) when the chunk could not be brought into DRAM."""

    __slots__ = ("_cache", "_lease")

    def __init__(self, cache: TieredCache, key: ChunkKey, view: memoryview,
                 lease: Lease | None) -> None:
        super().__init__(key, view)
        self._cache = cache
        self._lease = lease

    def release(self) -> None:
        if self._view is None:
            return
        self._view = None
        if self._lease is not None:
            self._cache.unpin(self._lease)
            self._lease = None


class CacheWriteLease:
    """A reserved DRAM slot; ``commit`` publishes it into the cache with its parent."""

    __slots__ = ("_backend", "_parent", "_slot", "_state", "_tenant")

    def __init__(self, backend: CacheLeaseBackend, slot: WriteSlot, parent: bytes | None,
                 tenant: str = DEFAULT_TENANT) -> None:
        self._backend = backend
        self._slot = slot
        self._parent = parent
        self._tenant = tenant
        self._state = "open"

    @property
    def key(self) -> ChunkKey:
        return self._slot.key

    @property
    def size_bytes(self) -> int:
        return self._slot.size_bytes

    @property
    def buffer(self) -> memoryview:
        if self._state != "open":
            raise InvalidArgument(f"write lease on {self.key.hex()} is {self._state}")
        return self._slot.buffer

    def commit(self) -> None:
        if self._state != "open":
            raise InvalidArgument(f"write lease on {self.key.hex()} is already {self._state}")
        self._state = "committed"
        try:
            self._backend.cache.commit(self._slot, parent=self._parent, tier=TierKind.DRAM,
                                       tenant=self._tenant)
        except BaseException:
            self._backend.cache.abort(self._slot, tier=TierKind.DRAM)
            raise

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
            self._backend.cache.abort(self._slot, tier=TierKind.DRAM)


class CacheLeaseBackend:
    """A :class:`~kvstore.dataplane.transport.base.LeaseBackend` over a tiered cache with a
    DRAM tier (module docstring). Nothing happens at construction."""

    def __init__(self, cache: TieredCache, *, parents: ParentHints | None = None,
                 read_ttl_s: float | None = None) -> None:
        dram = cache.tiers.get(TierKind.DRAM)
        if not isinstance(dram, DramTier | GroupedDramTier):
            raise InvalidArgument("the daemon's lease backend needs a DRAM tier")
        self.cache = cache
        self.dram: DramTier | GroupedDramTier = dram
        self.parents = parents or ParentHints()
        self._read_ttl_s = read_ttl_s or cache.config.lease_ttl_s
        self._native_lock = threading.Lock()
        self._native_source: native.NativeReadSource | None = None
        self.native_hits = 0
        """Hits served by the TCP server's native loop (accounted through ``record_reads``)."""
        self.native_bytes = 0

    def native_serving(self) -> native.NativeServing | None:
        """What the TCP server's native small-GET loop needs (``native/fastpath.c``): the
        loaded library and this DRAM tier's arena and read index mapped for it; None when the
        library is not loaded (or ``KVTIER_NATIVE=0``) or the tier publishes no read index.
        The mappings are made once and kept for this backend's life."""
        library = native.load()
        index_name = self.dram.read_index_name
        if library is None or not index_name:
            return None
        with self._native_lock:
            if self._native_source is None:
                try:
                    self._native_source = native.NativeReadSource.attach(self.dram.arena_name,
                                                                        index_name)
                except (InvalidArgument, TierUnavailable) as exc:
                    log.warning("native fast path off: %s", exc)
                    return None
            source = self._native_source
        return native.NativeServing(library, source, self.record_native_reads)

    def record_native_reads(self, keys: list[bytes]) -> None:
        """Account chunks the native loop copied out of DRAM (one key per hit): hits and
        recency, as for a same-host client's lease-free reads (``TieredCache.record_reads``)."""
        hits, nbytes = self.cache.record_reads(keys)
        self.native_hits += hits
        self.native_bytes += nbytes

    def scoped(self, scope: TenantScope) -> TenantLeaseBackend:
        """This backend as one data-plane session of ``scope`` sees it (module docstring,
        "Tenants")."""
        return TenantLeaseBackend(self, scope)

    def open_read(self, key: bytes, *, tenant: str | None = None) -> CacheReadLease:
        """A read lease on ``key`` (a chunk ``tenant`` may see; None: any chunk)."""
        k = check_key(key)
        try:
            lease = self.cache.pin_in(TierKind.DRAM, [k], self._read_ttl_s, tenant)
        except (CapacityError, ChunkBusy) as exc:
            entry = self.cache.entry(k, tenant)
            if entry is None:
                raise ChunkNotFound(k, "the tiered cache") from exc
            log.debug("serving %s from a private copy: %s", k.hex(), exc)
            copy = bytearray(entry.size_bytes)
            self.cache.get_into(k, copy, tenant)
            return CacheReadLease(self.cache, k, memoryview(copy).toreadonly(), None)
        try:
            view = self.dram.view(k)
        except BaseException:
            self.cache.unpin(lease)
            raise
        return CacheReadLease(self.cache, k, view, lease)

    def read_into(self, key: bytes, dst: memoryview) -> int:
        """Copy a chunk into ``dst`` with no cache pin (small GETs; ``LeaseBackend.read_into``).

        A chunk in DRAM is copied straight out of the arena by the tier, whose extent table
        keeps the extent's space from being reused during the copy (a racing eviction or
        remove cannot hand the bytes to another chunk mid-copy); then the hit is counted and
        its recency refreshed, as ``open_read`` does. This costs about a third of a pin, a
        view and an unpin (measured: ~4 vs ~11 µs), and leaves no lease behind the send, so a
        ``remove`` right after a small get never finds the chunk busy. A chunk elsewhere (NVMe)
        takes the lease path, which promotes it into DRAM.
        """
        k = check_key(key)
        try:
            size = self.dram.get_into(k, dst)
        except ChunkNotFound:
            lease = self.open_read(k)  # raises ChunkNotFound when no tier holds it
            try:
                size = lease.size_bytes
                if len(dst) != size:
                    raise SizeMismatch(f"read_into {k.hex()}", expected=size,
                                       actual=len(dst)) from None
                copy_bytes(dst, lease.view)
            finally:
                lease.release()
            return size
        owner = self.cache.index.touch_owner(k)
        self.cache.count_hit(TierKind.DRAM, size, owner)  # not record_reads: ~3 µs less
        return size

    def open_write(self, key: bytes, size_bytes: int, *,
                   tenant: str | None = None) -> CacheWriteLease:
        """A write lease for a chunk ``tenant`` will own (None: unscoped, the default tenant);
        its parent: the one ``tenant`` announced with ``SetParents`` (unscoped: the latest
        announced), if any."""
        k = check_key(key)
        parent = self.parents.take(k, tenant)
        owner = DEFAULT_TENANT if tenant is None else tenant
        slot = self.cache.reserve(k, size_bytes, parent=parent, tier=TierKind.DRAM,
                                  tenant=owner)
        return CacheWriteLease(self, slot, parent, owner)

    def exists(self, key: bytes, *, tenant: str | None = None) -> bool:
        return self.cache.entry(check_key(key), tenant) is not None

    def size_of(self, key: bytes, *, tenant: str | None = None) -> int | None:
        entry = self.cache.entry(check_key(key), tenant)
        return None if entry is None else entry.size_bytes

    def remove(self, key: bytes, *, tenant: str | None = None) -> bool:
        """Drop ``key`` and what is cached under it (with ``tenant``: only a chunk it owns)."""
        try:
            self.cache.remove(check_key(key), tenant)
        except ChunkNotFound:
            return False
        return True


def _refuse_write(scope: TenantScope) -> PermissionDenied:
    return PermissionDenied(f"this data-plane session acts for tenant {scope.read!r}, which "
                            "it may read but not write (the shared tenant needs shared_writer)")


class TenantLeaseBackend:
    """:class:`CacheLeaseBackend` as one TCP data-plane session of ``scope`` sees it (module
    docstring, "Tenants"); made by ``CacheLeaseBackend.scoped``. Offers no ``native_serving``:
    the TCP server runs its native loop from the unscoped backend's, on publishes it verified
    for this scope's tenant (``size_of`` here is that check)."""

    __slots__ = ("_backend", "_read", "_scope", "_write")

    def __init__(self, backend: CacheLeaseBackend, scope: TenantScope) -> None:
        self._backend = backend
        self._scope = scope
        self._read = scope.read
        self._write = scope.write

    @property
    def scope(self) -> TenantScope:
        return self._scope

    def open_read(self, key: bytes) -> CacheReadLease:
        return self._backend.open_read(key, tenant=self._read)

    def read_into(self, key: bytes, dst: memoryview) -> int:
        """Copy a chunk this tenant may see into ``dst``, pin-free when it is in DRAM (as
        ``CacheLeaseBackend.read_into``), else under a read lease.

        The pin-free copy is bracketed by two index look-ups of the entry, each tenant-checked:
        the bytes count only when both find the same insert (its ``inserted_at_s``), so a chunk
        removed and replaced by another tenant's under the same key during the copy is never
        served (nor its size told); then, and for a chunk elsewhere, the lease path runs, where
        the pin keeps the checked chunk in place for the copy."""
        k = check_key(key)
        backend = self._backend
        cache = backend.cache
        before = cache.entry(k, self._read)
        if before is None:
            raise ChunkNotFound(k, "the tiered cache")
        if before.tier is TierKind.DRAM:
            try:
                size = backend.dram.get_into(k, dst)
            except ChunkNotFound:
                pass  # moved or removed since: the lease path decides
            except SizeMismatch:
                if self._same_insert(k, before.inserted_at_s):
                    raise
            else:
                if self._same_insert(k, before.inserted_at_s):
                    cache.index.touch(k)
                    cache.count_hit(TierKind.DRAM, size,
                                    before.tenant if self._read is None else self._read)
                    return size
        return self._leased_read_into(k, dst)

    def _same_insert(self, key: ChunkKey, inserted_at_s: float) -> bool:
        after = self._backend.cache.entry(key, self._read)
        return after is not None and after.inserted_at_s == inserted_at_s

    def _leased_read_into(self, key: ChunkKey, dst: memoryview) -> int:
        lease = self._backend.open_read(key, tenant=self._read)
        try:
            size = lease.size_bytes
            if len(dst) != size:
                raise SizeMismatch(f"read_into {lease.key.hex()}", expected=size,
                                   actual=len(dst))
            copy_bytes(dst, lease.view)
        finally:
            lease.release()
        return size

    def open_write(self, key: bytes, size_bytes: int) -> CacheWriteLease:
        if self._write is None:
            raise _refuse_write(self._scope)
        return self._backend.open_write(key, size_bytes, tenant=self._write)

    def exists(self, key: bytes) -> bool:
        return self._backend.exists(key, tenant=self._read)

    def size_of(self, key: bytes) -> int | None:
        return self._backend.size_of(key, tenant=self._read)

    def remove(self, key: bytes) -> bool:
        return self._backend.remove(key, tenant=self._read)


# --- same-host leases by id --------------------------------------------------------------------


@dataclass(slots=True)
class _ReadRecord:
    lease: Lease
    owner: object | None
    deadline: float
    size_bytes: int


@dataclass(slots=True)
class _WriteRecord:
    slot: WriteSlot
    parent: bytes | None
    owner: object | None
    deadline: float
    offset: int
    parent_pending: bool = False
    """The parent was an open reservation of the same owner at reserve time: checked at commit."""
    tenant: str = DEFAULT_TENANT
    """Who the chunk will belong to (the tenant of the gRPC ``Reserve``)."""


class ShmLeases:
    """Read and write leases on the DRAM arena by id (module docstring; contract:
    ``ArenaLeaseBackend``). Nothing happens at construction; :meth:`close` ends every lease.

    ``max_ttl_s`` bounds every TTL (:func:`check_ttl`); ``budget`` counts this object's
    leases (one per read lease, however many keys, and one per reservation) together with the
    daemon's gRPC pins (a fresh one of ``max_leases`` when not given).

    Arenas per tenant group (a :class:`~kvstore.dataplane.dram.GroupedDramTier`): these leases
    are on one arena, ``arena`` (a group's name; None or "": the default arena), whose clients
    map only it. They serve only the tenants whose chunks that arena holds: a session of another
    tenant is refused (:meth:`scoped`: PermissionDenied, "not in this arena's group"), as is a
    write for one, and a read leases only chunks of this arena (another arena's that the reader
    may see, such as a shared chunk in the default arena read through a group's leases, is
    CapacityError: the client reads it over TCP; a prefix read stops before it)."""

    def __init__(self, cache: TieredCache, *, max_ttl_s: float = DEFAULT_MAX_TTL_S,
                 max_leases: int = DEFAULT_MAX_LEASES, budget: LeaseBudget | None = None,
                 arena: str | None = None) -> None:
        dram = cache.tiers.get(TierKind.DRAM)
        if isinstance(dram, GroupedDramTier):
            self.arena = arena or DEFAULT_ARENA
            part = dram.arena(self.arena)
            self._grouped: GroupedDramTier | None = dram
        elif isinstance(dram, DramTier):
            if arena:
                raise InvalidArgument(f"no arena group {arena!r}: the DRAM tier has one arena")
            self.arena, part, self._grouped = DEFAULT_ARENA, dram, None
        else:
            raise InvalidArgument("same-host leases need a DRAM tier")
        self._cache = cache
        self._dram: DramTier = part
        self._lock = threading.Lock()
        self._reads: dict[int, _ReadRecord] = {}
        self._writes: dict[int, _WriteRecord] = {}
        self._writing: dict[bytes, int] = {}
        """Key -> lease id of every open reservation (a key has at most one: the cache refuses
        a second reserve of a key being written)."""
        self._ids = LeaseIds()
        self.max_ttl_s = max_ttl_s
        self.budget = budget if budget is not None else LeaseBudget(max_leases)
        self.bytes_read = 0
        self.bytes_written = 0

    @property
    def arena_name(self) -> str:
        return self._dram.arena_name

    @property
    def read_index_name(self) -> str:
        """The read index of this arena ("" when off)."""
        return self._dram.read_index_name

    def admits(self, tenant: str) -> bool:
        """Whether ``tenant``'s chunks live in this arena (always, with one arena)."""
        return self._grouped is None or self._grouped.arena_of(tenant) == self.arena

    def _check_admits(self, tenant: str) -> None:
        if not self.admits(tenant):
            assert self._grouped is not None
            raise PermissionDenied(
                f"tenant {tenant!r} is not in this arena's group ("
                f"{self.arena or 'the default arena'}): its chunks live in arena group "
                f"{self._grouped.arena_of(tenant) or '(default)'}, served on that group's lease "
                "channel only")

    def has_write(self, lease_id: int, owner: object | None) -> bool:
        """Whether ``lease_id`` is an open reservation of ``owner`` here."""
        with self._lock:
            rec = self._writes.get(lease_id)
            return rec is not None and rec.owner == owner

    def open_count(self) -> tuple[int, int]:
        """(read leases, write leases) outstanding."""
        with self._lock:
            return len(self._reads), len(self._writes)

    def _new_id_locked(self) -> int:
        # Unguessable (LeaseIds), unique among both kinds, so an id names one lease.
        while True:
            lease_id = self._ids.new(self._reads)
            if lease_id not in self._writes:
                return lease_id

    def acquire_read(self, keys: Sequence[bytes], ttl_s: float, *, prefix: bool = False,
                     owner: object | None = None, tenant: str | None = None
                     ) -> tuple[int, list[ArenaRange]]:
        """Pin ``keys`` in DRAM (promoting them) and return a lease id and their ranges.

        ``prefix``: lease the longest cached prefix of ``keys`` (lease id 0 and no ranges when
        it is empty); otherwise all or nothing (ChunkNotFound). Only chunks ``tenant`` may see
        count (None: every chunk: an unscoped lease channel session). The lease belongs to ``owner``
        and ends by ``release`` with the same owner, or ``ttl_s`` after this call started.
        Raises ChunkBusy, CapacityError (DRAM cannot hold them now: read over TCP instead;
        TooManyLeases when the lease budget is spent), InvalidArgument (bad key, TTL refused
        by :func:`check_ttl`).
        """
        check_ttl(ttl_s, self.max_ttl_s)
        checked = [check_key(k) for k in keys]
        if not checked:
            raise InvalidArgument("acquire_read needs at least one key")
        # The deadline is taken before the pin, so it never lies past the cache's own.
        deadline = time.monotonic() + ttl_s
        self.budget.take()
        try:
            lease, ranges = self._pin_ranges(checked, ttl_s, prefix, tenant)
        except BaseException:
            self.budget.give()
            raise
        if lease is None:
            self.budget.give()
            return 0, []
        size = sum(r.size_bytes for r in ranges)
        with self._lock:
            lease_id = self._new_id_locked()
            self._reads[lease_id] = _ReadRecord(lease, owner, deadline, size)
            self.bytes_read += size
        return lease_id, ranges

    def _pin_ranges(self, checked: list[ChunkKey], ttl_s: float, prefix: bool,
                    tenant: str | None = None) -> tuple[Lease | None, list[ArenaRange]]:
        lease: Lease | None = None
        for _attempt in range(_PREFIX_RETRIES):
            wanted = checked[:self._cache.lookup(checked, tenant).length] if prefix else checked
            if self._grouped is not None:
                wanted = self._in_this_arena(wanted, tenant, prefix)
            if not wanted:
                self._cache.count_miss(tenant)
                return None, []
            try:
                lease = self._cache.pin_in(TierKind.DRAM, wanted, ttl_s, tenant)
                break
            except ChunkNotFound:
                if not prefix:
                    raise
        if lease is None:
            raise ChunkBusy("the prefix kept changing while it was leased; retry")
        ranges: list[ArenaRange] = []
        try:
            for key in lease.keys:
                loc = self._dram.locate(key)
                if loc is None:
                    raise InvariantViolation(f"pinned chunk {key.hex()} is not in DRAM")
                if loc.codec is not CodecKind.NONE:
                    raise InvariantViolation("the daemon's DRAM tier must not compress")
                ranges.append(ArenaRange(loc.offset, loc.size_bytes))
        except BaseException:
            self._cache.unpin(lease)
            raise
        return lease, ranges

    def _in_this_arena(self, keys: list[ChunkKey], tenant: str | None, prefix: bool
                       ) -> list[ChunkKey]:
        """``keys`` up to the first one whose chunk ``tenant`` may read but lies in another
        arena (a shared chunk read through a group's leases: a chunk's arena is its owner's,
        which never changes, so this holds for the pin that follows). Without ``prefix`` such a
        key raises CapacityError, the refusal a same-host client answers by reading over TCP,
        where the tenant check serves it. A key not cached, or not ``tenant``'s to read, stays:
        ``pin_in`` reports it as a miss."""
        assert self._grouped is not None
        arena_of = self._grouped.arena_of
        for i, key in enumerate(keys):
            entry = self._cache.entry(key, tenant)
            if entry is not None and arena_of(entry.tenant) != self.arena:
                if not prefix:
                    raise CapacityError(
                        f"chunk {short_key(key)} lies in another arena than this lease "
                        f"channel's ({self.arena or 'the default arena'}): read it over TCP")
                return keys[:i]
        return keys

    def release(self, lease_id: int, *, owner: object | None = None) -> bool:
        """End a read lease of ``owner``. False, and nothing changes, when it is unknown
        (released, expired, never issued) or another owner's."""
        with self._lock:
            rec = self._reads.get(lease_id)
            if rec is None or rec.owner != owner:
                return False
            del self._reads[lease_id]
        self._end_read(rec)
        return True

    def _end_read(self, rec: _ReadRecord) -> None:
        try:
            self._cache.unpin(rec.lease)
        finally:
            self.budget.give()

    def reserve(self, key: bytes, size_bytes: int, ttl_s: float, *, parent: bytes | None = None,
                owner: object | None = None, tenant: str = DEFAULT_TENANT) -> tuple[int, int]:
        """Reserve an invisible DRAM slot; return (lease id, arena offset).

        The reservation belongs to ``owner``, the chunk (once committed) to ``tenant``;
        uncommitted ``ttl_s`` after this call started, it is aborted. Raises ChunkExists,
        PermissionDenied (another tenant owns ``key``), ChunkBusy, CapacityError (TooManyLeases
        when the lease budget is spent), InvalidArgument (as ``TieredCache.reserve``; a TTL
        :func:`check_ttl` refuses).
        """
        check_ttl(ttl_s, self.max_ttl_s)
        k = check_key(key)
        p = None if parent is None else check_key(parent)
        self._check_admits(tenant)
        pending = p is not None and self._reserved_by(p, owner)
        deadline = time.monotonic() + ttl_s
        self.budget.take()
        try:
            # A parent still being written by this owner (a chain reserved parent-first) is
            # not cached yet: the cache's check moves to commit (commit).
            slot = self._cache.reserve(k, size_bytes, parent=None if pending else p,
                                       tier=TierKind.DRAM, tenant=tenant)
        except BaseException:
            self.budget.give()
            raise
        try:
            offset = _slot_offset(slot)
        except BaseException:
            self._cache.abort(slot, tier=TierKind.DRAM)
            self.budget.give()
            raise
        with self._lock:
            lease_id = self._new_id_locked()
            self._writes[lease_id] = _WriteRecord(slot, p, owner, deadline, offset, pending,
                                                  tenant)
            self._writing[k] = lease_id
        return lease_id, offset

    def reserve_many(self, items: Sequence[tuple[bytes, bytes | None]], sizes_bytes: Sequence[int],
                     ttl_s: float, *, owner: object | None = None, tenant: str | None = None
                     ) -> list[tuple[int, int] | KvtierError]:
        """:meth:`reserve` for a batch of ``(key, parent)`` items, in order, with one outcome
        per item: (lease id, arena offset), or the error ``reserve`` would have raised for it.

        A parent may be an open reservation of ``owner`` (an earlier request's, or an earlier
        item's of this batch): it is checked at commit. A child of an item that failed here
        fails too (its prefix is not cached). ``tenant``: whose chunks they will be, checked
        as ``TieredCache.reserve_many`` checks them (None: the default tenant's, refused where
        any tenant holds the key). Raises only for a TTL :func:`check_ttl` refuses. One lock
        round, one budget count and one ``TieredCache.reserve_many`` for the batch.
        """
        check_ttl(ttl_s, self.max_ttl_s)
        n = len(items)
        if len(sizes_bytes) != n:
            raise InvalidArgument(f"{n} items but {len(sizes_bytes)} sizes")
        if not self.admits(DEFAULT_TENANT if tenant is None else tenant):
            try:
                self._check_admits(DEFAULT_TENANT if tenant is None else tenant)
            except PermissionDenied as exc:
                return [exc for _item in items]
        out: list[tuple[int, int] | KvtierError | None] = [None] * n
        wanted: list[int] = []
        keys: list[bytes] = []
        sizes: list[int] = []
        parents: list[bytes | None] = []
        pending: list[bool] = []
        with self._lock:
            writing, writes = self._writing, self._writes
            for i, (key, parent) in enumerate(items):
                # check_key's common case inlined (this loop runs per block).
                k, p = key, parent
                if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES or (
                        p is not None and (type(p) is not bytes
                                           or not 0 < len(p) <= MAX_KEY_BYTES)):
                    try:
                        k = check_key(key)
                        p = None if parent is None else check_key(parent)
                    except InvalidArgument as exc:
                        out[i] = exc
                        continue
                # A parent still being written by this owner (reserved parent-first) is not
                # cached yet: the cache's check moves to commit, as in ``reserve``.
                lease_id = None if p is None else writing.get(p)
                rec = None if lease_id is None else writes.get(lease_id)
                pending.append(rec is not None and rec.owner == owner)
                wanted.append(i)
                keys.append(k)
                sizes.append(sizes_bytes[i])
                parents.append(p)
        deadline = time.monotonic() + ttl_s
        slots = self._cache.reserve_many(
            keys, sizes, [None if w else p for p, w in zip(parents, pending, strict=True)],
            tier=TierKind.DRAM, tenant=tenant)
        got: list[tuple[int, int, WriteSlot]] = []  # (item, position in ``wanted``, slot)
        for j, (i, slot) in enumerate(zip(wanted, slots, strict=True)):
            if isinstance(slot, KvtierError):
                out[i] = slot
            else:
                got.append((i, j, slot))
        # Only items that got a slot take a lease (as ``reserve``: a failed item holds none).
        # Past the budget the rest are freed in order, so no kept item's parent in the batch
        # is one of them.
        granted = self.budget.take_up_to(len(got))
        for i, _j, slot in got[granted:]:
            self._cache.abort(slot, tier=TierKind.DRAM)
            out[i] = TooManyLeases(f"the daemon already holds {self.budget.max_leases} pins, "
                                   "read leases and reservations (server.max_leases); release "
                                   "some or retry once they expire")
        owner_tenant = DEFAULT_TENANT if tenant is None else tenant
        records: list[tuple[int, _WriteRecord]] = []
        reserved: set[bytes] = set()
        try:
            for i, j, slot in got[:granted]:
                up = parents[j]
                records.append((i, _WriteRecord(slot, up, owner, deadline, _slot_offset(slot),
                                                pending[j] or (up is not None and up in reserved),
                                                owner_tenant)))
                reserved.add(slot.key)
        except BaseException:
            for _i, _j, slot in got[:granted]:
                self._cache.abort(slot, tier=TierKind.DRAM)
            self.budget.give(granted)
            raise
        with self._lock:
            writes, writing = self._writes, self._writing
            ids = self._ids.new_many(len(records), self._reads)
            for (i, rec), lease_id in zip(records, ids, strict=True):
                if lease_id in writes:
                    lease_id = self._new_id_locked()
                writes[lease_id] = rec
                writing[rec.slot.key] = lease_id
                out[i] = (lease_id, rec.offset)
        return [r for r in out if r is not None]

    def commit_many(self, lease_ids: Sequence[int], *, owner: object | None = None
                    ) -> list[KvtierError | None]:
        """:meth:`commit` for a batch, in order, with one outcome per lease: None (published)
        or the error ``commit`` would have raised (the slot is then freed). A chunk whose
        parent is neither cached nor committed earlier in this batch is freed unpublished;
        one ``TieredCache.commit_many`` for each run of leases of one tenant (one for the
        batch of a session: its reservations are all its tenant's)."""
        out: list[KvtierError | None] = [None] * len(lease_ids)
        recs: list[tuple[int, _WriteRecord]] = []
        with self._lock:
            writes, writing = self._writes, self._writing
            for i, lease_id in enumerate(lease_ids):
                rec = writes.get(lease_id)
                if rec is None or rec.owner != owner:
                    out[i] = _unknown_write(lease_id)
                    continue
                del writes[lease_id]
                key = rec.slot.key
                if writing.get(key) == lease_id:  # (_forget_key_locked, inlined: per block)
                    del writing[key]
                recs.append((i, rec))
        if recs:
            self.budget.give(len(recs))
        written = 0
        start = 0
        while start < len(recs):  # runs of one tenant, in order
            tenant = recs[start][1].tenant
            end = start + 1
            while end < len(recs) and recs[end][1].tenant == tenant:
                end += 1
            run = recs[start:end]
            try:
                results = self._cache.commit_many([rec.slot for _i, rec in run],
                                                  [rec.parent for _i, rec in run],
                                                  tier=TierKind.DRAM, tenant=tenant)
            except BaseException:
                for _i, rec in recs[start:]:
                    self._cache.abort(rec.slot, tier=TierKind.DRAM)  # (a no-op once committed)
                raise
            for (i, rec), result in zip(run, results, strict=True):
                if isinstance(result, KvtierError):
                    out[i] = result
                else:
                    written += rec.slot.size_bytes
            start = end
        with self._lock:
            self.bytes_written += written
        return out

    def _reserved_by(self, key: bytes, owner: object | None) -> bool:
        """Whether ``key`` is an open reservation of ``owner``."""
        with self._lock:
            return self._reserved_by_locked(key, owner)

    def _reserved_by_locked(self, key: bytes, owner: object | None) -> bool:
        lease_id = self._writing.get(key)
        rec = None if lease_id is None else self._writes.get(lease_id)
        return rec is not None and rec.owner == owner

    def scoped(self, scope: TenantScope) -> TenantShmLeases:
        """These leases as one lease-channel session of ``scope`` sees them (module docstring,
        "Tenants"). Raises PermissionDenied for a scope whose tenant is not in this arena's
        group (class docstring)."""
        for tenant in (scope.read, scope.write):
            if tenant is not None:
                self._check_admits(tenant)
        return TenantShmLeases(self, scope)

    def size_of(self, key: bytes, *, tenant: str | None = None) -> int | None:
        """The committed chunk's size (in any tier; a chunk ``tenant`` may see), or None."""
        entry = self._cache.entry(check_key(key), tenant)
        return None if entry is None else entry.size_bytes

    def remove(self, key: bytes, *, tenant: str | None = None) -> bool:
        """Drop a chunk and everything cached under it (``TieredCache.remove``; with
        ``tenant``: only a chunk it owns). False when it is not held; raises ChunkBusy while
        any of them is pinned."""
        try:
            self._cache.remove(check_key(key), tenant)
        except ChunkNotFound:
            return False
        return True

    def put(self, key: bytes, value: bytes | memoryview, *, parent: bytes | None = None,
            tenant: str = DEFAULT_TENANT) -> None:
        """Store a small value that arrived with its request (no lease), owned by ``tenant``;
        as ``TieredCache.put``. ``value`` is read only during the call (the lease channel lends
        its receive buffer)."""
        self._check_admits(tenant)
        self._cache.put(check_key(key), value, parent=None if parent is None else
                        check_key(parent), tenant=tenant)
        with self._lock:
            self.bytes_written += memoryview(value).nbytes

    def commit(self, lease_id: int, *, owner: object | None = None) -> TierKind:
        """Publish a reserved chunk. Raises InvalidArgument for an unknown (aborted, expired,
        committed) lease or another owner's, and the cache's commit errors (the slot is then
        freed)."""
        rec = self._pop_write(lease_id, owner)
        self.budget.give()
        if rec.parent_pending and self._cache.entry(rec.parent or b"", rec.tenant) is None:
            # Its parent's reservation failed, was aborted or expired, or the parent was
            # dropped since: publishing it would break the prefix rule (and, with write-through,
            # write an orphan to NVMe first).
            self._cache.abort(rec.slot, tier=TierKind.DRAM)
            raise InvalidArgument(f"parent {short_key(rec.parent or b'')} of "
                                  f"{short_key(rec.slot.key)} is not cached: a chunk without "
                                  "its prefix is useless")
        try:
            self._cache.commit(rec.slot, parent=rec.parent, tier=TierKind.DRAM,
                               tenant=rec.tenant)
        except BaseException:
            self._cache.abort(rec.slot, tier=TierKind.DRAM)
            raise
        with self._lock:
            self.bytes_written += rec.slot.size_bytes
        return TierKind.DRAM

    def abort(self, lease_id: int, *, owner: object | None = None) -> bool:
        """Free a reserved slot of ``owner``; False (and nothing changes) when the lease is
        unknown or another owner's."""
        try:
            rec = self._pop_write(lease_id, owner)
        except InvalidArgument:
            return False
        self._end_write(rec)
        return True

    def _end_write(self, rec: _WriteRecord) -> None:
        try:
            self._cache.abort(rec.slot, tier=TierKind.DRAM)
        finally:
            self.budget.give()

    def _pop_write(self, lease_id: int, owner: object | None) -> _WriteRecord:
        with self._lock:
            rec = self._writes.get(lease_id)
            # Another owner's lease reads as unknown: the reply tells a prober nothing.
            if rec is None or rec.owner != owner:
                raise _unknown_write(lease_id)
            del self._writes[lease_id]
            self._forget_key_locked(rec, lease_id)
            return rec

    def _forget_key_locked(self, rec: _WriteRecord, lease_id: int) -> None:
        if self._writing.get(rec.slot.key) == lease_id:
            del self._writing[rec.slot.key]

    def drop_owner(self, owner: object) -> tuple[int, int]:
        """End every lease of ``owner`` (its connection closed); return (reads, writes) ended."""
        with self._lock:
            reads = [i for i, r in self._reads.items() if r.owner == owner]
            writes = [i for i, w in self._writes.items() if w.owner == owner]
        return self._end(reads, writes)

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """End every lease past its deadline; return (reads, writes) ended."""
        t = time.monotonic() if now is None else now
        with self._lock:
            reads = [i for i, r in self._reads.items() if r.deadline < t]
            writes = [i for i, w in self._writes.items() if w.deadline < t]
        return self._end(reads, writes)

    def close(self) -> tuple[int, int]:
        """End every lease (shutdown)."""
        with self._lock:
            reads, writes = list(self._reads), list(self._writes)
        return self._end(reads, writes)

    def _end(self, reads: list[int], writes: list[int]) -> tuple[int, int]:
        ended_reads = ended_writes = 0
        for lease_id in reads:
            with self._lock:
                read = self._reads.pop(lease_id, None)
            if read is not None:
                self._end_read(read)
                ended_reads += 1
        for lease_id in writes:
            with self._lock:
                write = self._writes.pop(lease_id, None)
                if write is not None:
                    self._forget_key_locked(write, lease_id)
            if write is not None:
                self._end_write(write)
                ended_writes += 1
        return ended_reads, ended_writes


class TenantShmLeases:
    """:class:`ShmLeases` as one lease-channel session of ``scope`` sees them (module
    docstring, "Tenants"; contract: ``ArenaLeaseBackend``); made by ``ShmLeases.scoped``.
    Leases stay the shared table's (``drop_owner``, ``expire`` and ``close`` act on it); a
    reservation keeps its tenant for its commit. Batches go as ``ShmLeases``' batches, for the
    session's write tenant."""

    __slots__ = ("_leases", "_read", "_scope", "_write")

    def __init__(self, leases: ShmLeases, scope: TenantScope) -> None:
        self._leases = leases
        self._scope = scope
        self._read = scope.read
        self._write = scope.write

    @property
    def scope(self) -> TenantScope:
        return self._scope

    @property
    def arena_name(self) -> str:
        return self._leases.arena_name

    def _write_tenant(self) -> str:
        if self._write is None:
            raise _refuse_write(self._scope)
        return self._write

    def acquire_read(self, keys: Sequence[bytes], ttl_s: float, *, prefix: bool = False,
                     owner: object | None = None) -> tuple[int, list[ArenaRange]]:
        return self._leases.acquire_read(keys, ttl_s, prefix=prefix, owner=owner,
                                         tenant=self._read)

    def release(self, lease_id: int, *, owner: object | None = None) -> bool:
        return self._leases.release(lease_id, owner=owner)

    def reserve(self, key: bytes, size_bytes: int, ttl_s: float, *, parent: bytes | None = None,
                owner: object | None = None) -> tuple[int, int]:
        return self._leases.reserve(key, size_bytes, ttl_s, parent=parent, owner=owner,
                                    tenant=self._write_tenant())

    def commit(self, lease_id: int, *, owner: object | None = None) -> TierKind:
        return self._leases.commit(lease_id, owner=owner)

    def reserve_many(self, items: Sequence[tuple[bytes, bytes | None]], sizes_bytes: Sequence[int],
                     ttl_s: float, *, owner: object | None = None
                     ) -> list[tuple[int, int] | KvtierError]:
        """``ShmLeases.reserve_many`` for the session's write tenant (its chunks, checked as
        ``reserve`` checks them, its quota); PermissionDenied for every item when the session
        may not write."""
        check_ttl(ttl_s, self._leases.max_ttl_s)
        if len(sizes_bytes) != len(items):
            raise InvalidArgument(f"{len(items)} items but {len(sizes_bytes)} sizes")
        if self._write is None:
            return [_refuse_write(self._scope) for _item in items]
        return self._leases.reserve_many(items, sizes_bytes, ttl_s, owner=owner,
                                         tenant=self._write)

    def commit_many(self, lease_ids: Sequence[int], *, owner: object | None = None
                    ) -> list[KvtierError | None]:
        """``ShmLeases.commit_many``: each reservation keeps its tenant."""
        return self._leases.commit_many(lease_ids, owner=owner)

    def abort(self, lease_id: int, *, owner: object | None = None) -> bool:
        return self._leases.abort(lease_id, owner=owner)

    def put(self, key: bytes, value: bytes | memoryview, *, parent: bytes | None = None) -> None:
        self._leases.put(key, value, parent=parent, tenant=self._write_tenant())

    def size_of(self, key: bytes) -> int | None:
        return self._leases.size_of(key, tenant=self._read)

    def remove(self, key: bytes) -> bool:
        return self._leases.remove(key, tenant=self._read)

    def drop_owner(self, owner: object) -> tuple[int, int]:
        return self._leases.drop_owner(owner)

    def open_count(self) -> tuple[int, int]:
        return self._leases.open_count()


def _unknown_write(lease_id: int) -> InvalidArgument:
    # Another owner's lease reads as unknown too: the reply tells a prober nothing.
    return InvalidArgument(f"write lease {lease_id} is unknown (committed, aborted, expired, "
                           "or another session's)")


def _slot_offset(slot: WriteSlot) -> int:
    if not isinstance(slot, DramSlot):
        raise InvariantViolation(f"slot {slot!r} is not a DRAM arena slot")
    return slot.offset

"""The read index: lease-free same-host reads of DRAM chunks through a seqlock table in shared memory.

A same-host client maps the daemon's DRAM arena. Without this module each copy out of it costs a
lease round trip on the lease channel (~30 µs against a 2 µs memcpy at 4 KiB). With it, the daemon
*publishes* where each committed, uncompressed DRAM chunk lies in a second shared-memory segment
(the read index, named in ``NodeInfo.shm_read_index``), and a client copies a chunk with no round
trip at all. Design notes and measurements: ``docs/dram-arena.md`` ("Lease-free reads").

Layout (all little-endian; the constants, shared with the native reader, are in
:mod:`kvstore.dataplane.read_index_layout`)
    A 4 KiB header, then ``slots`` slots of :data:`SLOT_BYTES` (a power of two; open addressing
    with linear probing from ``xxh3_64(key) & (slots - 1)``).

    * header: magic ``KVTRIDX1``, version, slot size, slot count, arena size, state (OPEN/CLOSED),
      the arena's name, and at :data:`OWNER_AT` a robust process-shared pthread mutex that one
      daemon thread holds for the index's whole life (see "Liveness").
    * slot: ``seq`` (u64; even: stable, odd: being written), arena offset (u64), size (u64),
      state (u8: EMPTY, LIVE, TOMBSTONE), key length (u8), the owner tag (48 bits in bytes
      26..31: :func:`~kvstore.dataplane.read_index_layout.owner_tag` of the tenant that owns
      the chunk), and the key at byte 32 (1..64 bytes).

Writer (:class:`ReadIndex`, the daemon only)
    Every change of a slot is ``seq += 1`` (odd), the fields, ``seq += 1`` (even), under the
    index's lock; ``seq`` only ever grows, so a reader can never see an old value again (no ABA).
    The DRAM tier's extent table calls :meth:`ReadIndex.unpublish` *before* it frees an extent
    (remove, eviction, demotion, corruption, close), so an extent is never reused while the index
    still points at it. Only committed chunks stored raw (``CodecKind.NONE``) are published,
    each with its owner's tag (the tier is told the owner where the chunk is written:
    :func:`kvstore.dataplane.dram.writing_for`).

Reader (:class:`ReadIndexReader`, a client)
    probe → ``seq1`` (even, key matches) → copy ``size`` bytes → re-read ``seq``; equal: the copy
    is the chunk's (no write touched the slot meanwhile, hence the extent was not freed, hence not
    reused); different: retry a few times, then the caller takes the leased path. A key not found
    is a miss here (the leased path decides: the chunk may live in NVMe, or nowhere).

Owners
    A reader attached with ``owners`` (a tenant-scoped session: its own tenant and the shared
    one) treats a slot whose owner tag is none of theirs as a miss, so the read takes the leased
    path, where the daemon checks the tenant and refuses it (absent). This stops an honest
    client's bug or guessed key; it is no boundary against a process that maps the arena (it
    can read every byte anyway). Two owners share a tag with probability 2**-48 per pair; such
    a pair is not kept apart here, only by the leased path's check, which this then skips
    (docs/dram-arena.md, "Owner tags"). Without ``owners`` (no security) every slot is read.

Memory ordering
    Correct on x86-64 only, where loads are not reordered with other loads and stores not with
    other stores (TSO), and stores become visible to all other cores in one order. Each field is
    read or written by its own C call from Python, so the compiler cannot move a load across
    another either. The reader's loads are seq1, key, offset/size, the copied bytes, seq2 in that
    order; the writer's stores are seq (odd), fields, seq (even); a writer that reuses an extent
    writes it only after the daemon made the unpublishing stores visible (the lease channel's
    reply to the reservation is a system call, which drains the store buffer). So a copy that
    saw any byte of a new chunk sees the bumped ``seq`` when it re-reads it.
    :func:`lease_free_supported` is False elsewhere (ARM would need explicit barriers).

Liveness
    A reader must never serve bytes of a daemon that died (its mapping stays readable after a
    ``kill -9``, frozen). At creation a dedicated daemon thread locks the robust mutex in the
    header; its futex word then holds that thread's id. When the thread (or the whole process)
    dies, the *kernel* sets ``FUTEX_OWNER_DIED`` in that word, before the death is visible to
    anyone (a parent's ``wait`` returns later); on a graceful close the thread unlocks it (the
    word becomes 0). A reader checks the word after every copy: one 4-byte load, no system call.

Threads: :class:`ReadIndex` may be called from any thread. A :class:`ReadIndexReader` may be
used from several threads at once (it keeps no per-read state besides counters).
"""

from __future__ import annotations

import ctypes
import enum
import logging
import platform
import threading
import weakref
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import xxhash

from kvstore.dataplane.arena import (
    GIL_RELEASE_COPY_BYTES,
    ArenaAccess,
    PinMode,
    ShmArena,
    buffer_address,
    copy_bytes,
)
from kvstore.dataplane.native import index_read_config
from kvstore.dataplane.read_index_layout import (
    ARENA_NAME_AT,
    BODY_STRUCT,
    HEADER_BYTES,
    HEADER_STRUCT,
    KEY_AT,
    MAGIC,
    MIN_SLOTS,
    OWNER_AT,
    OWNER_STRUCT,
    SEQ_STRUCT,
    SLOT_BYTES,
    SLOT_SHIFT,
    SLOT_STRUCT,
    VERSION,
    IndexState,
    SlotState,
    lease_free_supported,
    owner_tag,
    split_owner_tag,
)
from kvstore.dataplane.tier import MAX_KEY_BYTES
from kvstore.errors import InvalidArgument, InvariantViolation, TierUnavailable

log = logging.getLogger(__name__)

MAX_LOAD = 0.75
"""Live entries plus tombstones never exceed this share of the slots (a probe always ends)."""
_xxh3_64 = xxhash.xxh3_64_intdigest

_FUTEX_OWNER_DIED = 0x40000000
_FUTEX_TID_MASK = 0x3FFFFFFF
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1


_EMPTY, _LIVE, _TOMB = SlotState.EMPTY.value, SlotState.LIVE.value, SlotState.TOMBSTONE.value


class ReadResult(enum.IntEnum):
    """What :meth:`ReadIndexReader.read_into` returns instead of a size (all negative)."""

    MISS = -1
    """The key is not published (not in DRAM, compressed, or not stored): take the leased path."""
    CONFLICT = -2
    """The slot kept changing during the copy, or its size does not fit the destination."""
    DEAD = -3
    """The daemon that owns the index died or closed it: never use this index again."""


_MISS, _CONFLICT, _DEAD = ReadResult.MISS.value, ReadResult.CONFLICT.value, ReadResult.DEAD.value
NOT_TRIED = -4
"""What a native read returns when it did not try (``ReadIndexReader.fast_get``)."""


def slots_for(capacity_bytes: int, chunk_bytes_hint: int = 64 << 10) -> int:
    """A slot count for an arena: room for every chunk of ``chunk_bytes_hint`` at ``MAX_LOAD``,
    rounded up to a power of two, at least :data:`MIN_SLOTS`."""
    need = int(capacity_bytes // max(1, chunk_bytes_hint) / MAX_LOAD) + 1
    return max(MIN_SLOTS, 1 << (need - 1).bit_length())


def _hash(key: bytes) -> int:
    return _xxh3_64(key)


# --- the daemon's liveness word ------------------------------------------------------------------


class _OwnerLock:
    """A robust, process-shared pthread mutex at an address in the index, held by one thread of
    this process until :meth:`release` (module docstring, "Liveness")."""

    def __init__(self, address: int) -> None:
        """Initialise the mutex at ``address`` and start the thread that holds it (waits until
        it is held). Raises TierUnavailable when the C library has no robust mutexes."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            init_attr = libc.pthread_mutexattr_init
            set_shared = libc.pthread_mutexattr_setpshared
            set_robust = libc.pthread_mutexattr_setrobust
        except (OSError, AttributeError) as exc:
            raise TierUnavailable(f"no robust pthread mutexes here: {exc}") from exc
        self._libc = libc
        self._mutex = ctypes.c_void_p(address)
        attr = ctypes.create_string_buffer(64)
        if init_attr(attr) or set_shared(attr, _PTHREAD_PROCESS_SHARED) \
                or set_robust(attr, _PTHREAD_MUTEX_ROBUST) \
                or libc.pthread_mutex_init(self._mutex, attr):
            raise TierUnavailable("cannot initialise a robust process-shared mutex")
        libc.pthread_mutexattr_destroy(attr)
        self._held = threading.Event()
        self._release = threading.Event()
        self._error = 0
        self._thread = threading.Thread(target=self._hold, name="kvtier-read-index-owner",
                                        daemon=True)
        self._thread.start()
        self._held.wait()
        if self._error:
            raise TierUnavailable(f"cannot lock the read index's owner mutex: error {self._error}")

    def _hold(self) -> None:
        self._error = int(self._libc.pthread_mutex_lock(self._mutex))
        self._held.set()
        if self._error:
            return
        self._release.wait()
        self._libc.pthread_mutex_unlock(self._mutex)

    def release(self) -> None:
        """Unlock (readers then see the daemon as gone) and end the thread. Idempotent."""
        self._release.set()
        self._thread.join(5.0)


# --- the writer ----------------------------------------------------------------------------------


class ReadIndex:
    """The daemon's side: publishes committed DRAM chunks (module docstring). Build with
    :meth:`create`; :meth:`close` unpublishes everything, releases the owner word and unlinks."""

    def __init__(self, segment: ShmArena, slots: int, owner: _OwnerLock | None) -> None:
        """Wrap an initialised segment; use :meth:`create`."""
        self._segment = segment
        self._buf = segment.view(0, segment.size_bytes, readonly=False)
        self._slots = slots
        self._mask = slots - 1
        self._max_used = int(slots * MAX_LOAD)
        self._owner = owner
        self._lock = threading.Lock()
        self._states = bytearray(slots)
        """Mirror of each slot's state, so the writer probes without reading shared memory."""
        self._entries: dict[bytes, tuple[int, int, int, int]] = {}
        """key -> (slot, offset, size, owner tag) of every live entry."""
        self._tags: dict[str, int] = {}
        """owner -> its tag (a few tenants: computed once each)."""
        self._tombstones = 0
        self._closed = False
        self.refused = 0
        """Publications refused because the table was full (those chunks use the leased path)."""
        self.rebuilds = 0

    @classmethod
    def create(cls, slots: int, *, arena_name: str, arena_bytes: int,
               name: str | None = None, group: int | None = None) -> ReadIndex:
        """Make, map and initialise an index segment of ``slots`` slots (a power of two >=
        :data:`MIN_SLOTS`) for the arena ``arena_name`` of ``arena_bytes``. ``group`` (a gid):
        the segment is that group's, ``0640`` (its arena's readers map it read-only); else
        ``0600``.

        Raises InvalidArgument (bad slot count or name), CapacityError (no room in /dev/shm),
        TierUnavailable (not supported here: :func:`lease_free_supported`, robust mutexes).
        """
        if not lease_free_supported():
            raise TierUnavailable(f"lease-free reads need Linux on x86-64, not "
                                  f"{platform.system()} on {platform.machine()}")
        if slots < MIN_SLOTS or slots & (slots - 1):
            raise InvalidArgument(f"read index slots must be a power of two >= {MIN_SLOTS}, "
                                  f"got {slots}")
        encoded = arena_name.encode()
        if len(encoded) > 255:
            raise InvalidArgument(f"arena name {arena_name!r} is too long for the read index")
        segment = ShmArena.create(HEADER_BYTES + slots * SLOT_BYTES, name=name, pin=PinMode.OFF,
                                  group=group, group_access=ArenaAccess.READ_ONLY)
        try:
            buf = segment.view(0, HEADER_BYTES, readonly=False)
            HEADER_STRUCT.pack_into(buf, 0, MAGIC, VERSION, SLOT_BYTES, slots, arena_bytes,
                              IndexState.OPEN)
            buf[ARENA_NAME_AT] = len(encoded)
            buf[ARENA_NAME_AT + 1:ARENA_NAME_AT + 1 + len(encoded)] = encoded
            owner = _OwnerLock(buffer_address(segment.view(0, HEADER_BYTES)) + OWNER_AT)
            buf.release()
            return cls(segment, slots, owner)
        except BaseException:
            segment.close()
            raise

    # --- identity and stats -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The shared-memory name a client passes to :meth:`ReadIndexReader.attach`."""
        return self._segment.name

    @property
    def slots(self) -> int:
        return self._slots

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @property
    def tombstones(self) -> int:
        return self._tombstones

    def location(self, key: bytes) -> tuple[int, int] | None:
        """(offset, size) published for ``key``, or None (for tests and debugging)."""
        with self._lock:
            entry = self._entries.get(bytes(key))
        return None if entry is None else (entry[1], entry[2])

    def slot_of(self, key: bytes) -> int | None:
        """The slot ``key`` is published in, or None (for tests and debugging)."""
        with self._lock:
            entry = self._entries.get(bytes(key))
        return None if entry is None else entry[0]

    def slot_state(self, slot: int) -> SlotState:
        """A slot's state (for tests and debugging)."""
        with self._lock:
            return SlotState(self._states[slot])

    # --- changes ------------------------------------------------------------------------------

    def publish(self, key: bytes, offset: int, size_bytes: int, owner: str = "") -> bool:
        """Point ``key`` at ``size_bytes`` at ``offset`` in the arena, tagged as ``owner``'s (a
        tenant's name; ``""``: the default tenant; module docstring, "Owners"). False when the
        table is full (the chunk is then read through leases). Re-publishing a key moves it.
        :meth:`publish_many` of one item: the two share one implementation."""
        return self.publish_many(((key, offset, size_bytes, owner),)) == 1

    def publish_many(self, items: Sequence[tuple[bytes, int, int, str]]) -> int:
        """:meth:`publish` each ``(key, offset, size_bytes, owner)``, in order, in one lock
        round; return how many were published (the others: a full table, as ``publish``).

        The only publishing path (``publish`` calls it with one item): each key's slot is
        found here (its own for a key already published, else the first non-live slot on its
        probe path, after one rebuild when taking it would fill the table past ``MAX_LOAD``)
        and the batch's seqlock writes are one :meth:`_write_many`, in order. Measured (8 and
        32 keys of a batch commit, alternating call by call): 1.1-1.4 µs a key this way,
        1.6-2.1 µs calling a per-key probe and write."""
        for key, _offset, _size, _owner in items:
            if not 1 <= len(key) <= MAX_KEY_BYTES:
                raise InvalidArgument(f"read index keys are 1..{MAX_KEY_BYTES} bytes, got "
                                      f"{len(key)}")
        tags = self._tags
        rows: list[tuple[int, int, bytes, int, int, int]] = []
        published = 0
        with self._lock:
            if self._closed:
                return 0
            entries, states, mask = self._entries, self._states, self._mask
            for key, offset, size_bytes, owner in items:
                k = key if type(key) is bytes else bytes(key)
                tag = tags.get(owner)
                if tag is None:
                    tag = owner_tag(owner)
                    if len(tags) < 4096:
                        tags[owner] = tag
                old = entries.get(k)
                if old is not None:
                    i = old[0]
                else:
                    for attempt in range(2):
                        i = _hash(k) & mask
                        while states[i] == _LIVE:
                            i = (i + 1) & mask
                        if states[i] == _TOMB:
                            self._tombstones -= 1
                        elif len(entries) + self._tombstones >= self._max_used:
                            if attempt or not self._tombstones:
                                i = -1
                                break
                            # The rebuild rewrites every slot from ``entries``: the rows
                            # found so far go first.
                            self._write_many(rows)
                            rows.clear()
                            self._rebuild()
                            mask = self._mask
                            continue
                        break
                    if i < 0:
                        self.refused += 1
                        continue
                    states[i] = _LIVE  # (taken: the next key probes past it)
                rows.append((i, _LIVE, k, offset, size_bytes, tag))
                entries[k] = (i, offset, size_bytes, tag)
                published += 1
            self._write_many(rows)
        return published

    def unpublish(self, key: bytes) -> bool:
        """Withdraw ``key`` (its slot's ``seq`` moves on, so a copy in flight is rejected).
        Call before the chunk's extent may be reused. False when it was not published."""
        with self._lock:
            entry = self._entries.pop(bytes(key), None)
            if entry is None:
                return False
            self._vacate(entry[0])
            return True

    def clear(self) -> None:
        """Withdraw every key (the tier is closing or forgetting everything)."""
        with self._lock:
            self._entries.clear()
            self._reset_slots()

    def close(self) -> None:
        """Withdraw every key, mark the index CLOSED, release the owner word, unmap and unlink.
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.clear()
        HEADER_STRUCT.pack_into(self._buf, 0, MAGIC, VERSION, SLOT_BYTES, self._slots, 0,
                          IndexState.CLOSED)
        if self._owner is not None:
            self._owner.release()
            self._owner = None
        self._buf.release()
        self._segment.close()

    # --- internals (under the lock) -----------------------------------------------------------

    def _vacate(self, slot: int) -> None:
        """Empty a live slot: a tombstone, unless the next slot is empty (then no probe path runs
        through it, nor through the tombstones right before it, which are emptied too)."""
        mask, states = self._mask, self._states
        if states[(slot + 1) & mask] != _EMPTY:
            self._write(slot, _TOMB, b"", 0, 0)
            self._tombstones += 1
            return
        self._write(slot, _EMPTY, b"", 0, 0)
        i = (slot - 1) & mask
        while states[i] == _TOMB:
            self._write(i, _EMPTY, b"", 0, 0)
            self._tombstones -= 1
            i = (i - 1) & mask

    def _rebuild(self) -> None:
        """Empty every slot (seq moving on) and re-insert the live entries: drops tombstones.
        Readers meanwhile miss and take the leased path."""
        self.rebuilds += 1
        live = list(self._entries.items())
        for slot, state in enumerate(self._states):
            if state != _EMPTY:
                self._write(slot, _EMPTY, b"", 0, 0)
        self._tombstones = 0
        self._entries.clear()
        mask, states = self._mask, self._states
        for key, (_slot, offset, size, tag) in live:
            i = _hash(key) & mask
            while states[i] != _EMPTY:
                i = (i + 1) & mask
            self._write(i, _LIVE, key, offset, size, tag)
            self._entries[key] = (i, offset, size, tag)

    def _reset_slots(self) -> None:
        for slot, state in enumerate(self._states):
            if state != _EMPTY:
                self._write(slot, _EMPTY, b"", 0, 0)
        self._tombstones = 0

    def _write(self, slot: int, state: int, key: bytes, offset: int, size_bytes: int,
               tag: int = 0) -> None:
        """One slot's seqlock write (:meth:`_write_many`)."""
        self._write_many(((slot, state, key, offset, size_bytes, tag),))

    def _write_many(self, rows: Sequence[tuple[int, int, bytes, int, int, int]]) -> None:
        """The seqlock write of each ``(slot, state, key, offset, size_bytes, owner tag)``, in
        order: seq odd, fields, seq even (module docstring). The only code that writes a slot."""
        buf, states = self._buf, self._states
        seq_at, seq_put, body_put = SEQ_STRUCT.unpack_from, SEQ_STRUCT.pack_into, \
            BODY_STRUCT.pack_into
        for slot, state, key, offset, size_bytes, tag in rows:
            at = HEADER_BYTES + (slot << SLOT_SHIFT)
            seq = seq_at(buf, at)[0]
            if seq & 1:
                raise InvariantViolation(f"read index slot {slot} was left half-written")
            seq_put(buf, at, seq + 1)
            body_put(buf, at + 8, offset, size_bytes, state, len(key), tag & 0xFFFF, tag >> 16)
            if key:
                buf[at + KEY_AT:at + KEY_AT + len(key)] = key
            seq_put(buf, at, seq + 2)
            states[slot] = state

    def __repr__(self) -> str:
        return (f"ReadIndex({self._segment.name!r}, {len(self._entries)}/{self._slots} live, "
                f"{self._tombstones} tombstones)")


# --- the reader ----------------------------------------------------------------------------------


class ReadIndexReader:
    """A client's side: copies published chunks out of a mapped arena without a round trip
    (module docstring). Build with :meth:`attach`."""

    def __init__(self, segment: ShmArena, arena: ShmArena, slots: int, owner_word: int,
                 attempts: int, owners: Sequence[str] | None = None) -> None:
        """Wrap an attached, verified index; use :meth:`attach`."""
        self._segment = segment
        self._buf = segment.view(0, segment.size_bytes)
        self._arena = arena.view(0, arena.size_bytes)
        self._arena_bytes = arena.size_bytes
        self._mask = slots - 1
        self._slots = slots
        self._owner_word = owner_word
        self._attempts = attempts
        self._owners = None if owners is None else tuple(owners)
        self._tags = _tags_for(self._owners)
        self._retries = 0
        self._before_copy: Callable[[], None] | None = None
        self._native: Any = None
        self._holder: _Mappings | None = None
        self.fast_get: Callable[[bytes, Any], int] | None = None
        """The native ``get_into(key, dst)`` (:meth:`use_extension`: a read with its accounting,
        for ``StoreClient``), or None. Returns the size, a negative :class:`ReadResult`, or
        :data:`NOT_TRIED` (the key is not ``bytes`` or ``dst`` not a writable C-contiguous
        buffer: the caller's own path decides)."""

    @property
    def before_copy(self) -> Callable[[], None] | None:
        """Test hook: called after a slot was found and validated, just before the copy. While
        one is set every read runs in Python (``fast_get`` is None)."""
        return self._before_copy

    @before_copy.setter
    def before_copy(self, hook: Callable[[], None] | None) -> None:
        self._before_copy = hook
        self.fast_get = None if hook is not None or self._native is None \
            else self._native.get_into

    def use_extension(self, module: ModuleType | None) -> None:
        """Read through the native extension's ``IndexReader`` (``native/pyfast.c``: the same
        probe, seqlock, bounds and liveness checks in C, the GIL released for big copies, an
        aligned-store copier for destinations at another page offset than the arena's) instead
        of Python; None goes back to Python."""
        if module is None:
            self._drop_native()
            return
        cfg = index_read_config(
            arena_address=buffer_address(self._arena), arena_bytes=self._arena_bytes,
            index_address=buffer_address(self._buf), slots=self._slots,
            attempts=self._attempts, owner_tags=self._tags)
        self._holder = _Mappings()
        self._native = module.IndexReader(
            bytes(cfg), buffer_address(self._buf) + OWNER_AT, self._owner_word, MAX_KEY_BYTES,
            GIL_RELEASE_COPY_BYTES, self._holder)
        self.before_copy = self._before_copy  # sets fast_get

    def report_reads_to(self, queue: Any, batch: int, wake: Callable[[], None]) -> None:
        """Where ``fast_get`` reports hits: ``queue.append(key)``, then ``wake()`` when
        ``len(queue) == batch`` (``StoreClient``'s read reporter). Needs the extension."""
        if self._native is not None:
            self._native.set_report(queue, batch, wake)

    @property
    def owners(self) -> tuple[str, ...] | None:
        """The owners whose chunks this reader copies (module docstring, "Owners"); None:
        every owner's."""
        return self._owners

    @property
    def native(self) -> bool:
        """Whether reads go through the native extension."""
        return self._native is not None

    def native_counters(self) -> tuple[int, int, int]:
        """(hits, misses, conflicts) counted by ``fast_get`` (zeros without the extension)."""
        if self._native is None:
            return 0, 0, 0
        hits, misses, conflicts, _retries = self._native.counters()
        return int(hits), int(misses), int(conflicts)

    @property
    def retries(self) -> int:
        """Copies rejected because the slot changed meanwhile (each was retried)."""
        if self._native is None:
            return self._retries
        return self._retries + int(self._native.counters()[3])

    @classmethod
    def attach(cls, name: str, arena: ShmArena, *, attempts: int = 4,
               owners: Sequence[str] | None = None) -> ReadIndexReader:
        """Map the index ``name`` read-only and check that it indexes ``arena`` and that its
        daemon is alive. ``owners``: the tenants whose chunks this reader may copy (at most
        two: a session's own and the shared tenant; empty: none), every other chunk is a miss
        (module docstring, "Owners"); None: every chunk (no security). Raises
        InvalidArgument (no such index, it belongs to another arena, more than two owners),
        TierUnavailable (closed, dead owner, or lease-free reads unsupported here)."""
        if not lease_free_supported():
            raise TierUnavailable("lease-free reads need Linux on x86-64")
        if attempts < 1:
            raise InvalidArgument(f"attempts must be >= 1, got {attempts}")
        _tags_for(None if owners is None else tuple(owners))  # checks them before mapping
        segment = ShmArena.attach(name, access=ArenaAccess.READ_ONLY)
        try:
            if segment.size_bytes < HEADER_BYTES:
                raise InvalidArgument(f"{name!r} is too small to be a read index")
            buf = segment.view(0, HEADER_BYTES)
            magic, version, slot_bytes, slots, arena_bytes, state = HEADER_STRUCT.unpack_from(buf, 0)
            name_len = buf[ARENA_NAME_AT]
            arena_name = bytes(buf[ARENA_NAME_AT + 1:ARENA_NAME_AT + 1 + name_len]).decode()
            owner_word = OWNER_STRUCT.unpack_from(buf, OWNER_AT)[0]
            buf.release()
            if magic != MAGIC or version != VERSION or slot_bytes != SLOT_BYTES:
                raise InvalidArgument(f"{name!r} is not a version-{VERSION} read index")
            if slots < MIN_SLOTS or slots & (slots - 1) \
                    or segment.size_bytes < HEADER_BYTES + slots * SLOT_BYTES:
                raise InvalidArgument(f"read index {name!r} has a bad slot count {slots}")
            if arena_name != arena.name or arena_bytes != arena.size_bytes:
                raise InvalidArgument(f"read index {name!r} indexes arena {arena_name!r} of "
                                      f"{arena_bytes} bytes, not {arena.name!r}")
            if state != IndexState.OPEN or not owner_word & _FUTEX_TID_MASK \
                    or owner_word & _FUTEX_OWNER_DIED:
                raise TierUnavailable(f"read index {name!r} is closed or its daemon is gone")
            return cls(segment, arena, slots, owner_word, attempts, owners)
        except BaseException:
            segment.close()
            raise

    def alive(self) -> bool:
        """Whether the daemon still holds the index (one load; module docstring, "Liveness")."""
        return bool(OWNER_STRUCT.unpack_from(self._buf, OWNER_AT)[0] == self._owner_word)

    def read_into(self, key: bytes, out: memoryview) -> int:
        """Copy chunk ``key`` into ``out`` (a flat writable byte view) if it is published and
        exactly ``out``'s size; return its size, or a negative :class:`ReadResult` value.

        On CONFLICT or DEAD, ``out`` may hold garbage; on MISS it is untouched.
        """
        fast = self._native
        if fast is not None and self._before_copy is None:
            n = fast.read_into(key, out)
            if n != NOT_TRIED:
                return int(n)
        # The hot path of a same-host get: locals only, one unpack per slot, plain ints.
        buf, mask, arena, tags = self._buf, self._mask, self._arena, self._tags
        slot_of, seq_of, owner_of = SLOT_STRUCT.unpack_from, SEQ_STRUCT.unpack_from, OWNER_STRUCT.unpack_from
        klen = len(key)
        start = _xxh3_64(key) & mask
        for _attempt in range(self._attempts):
            i = start
            for _probe in range(self._slots):
                at = HEADER_BYTES + (i << SLOT_SHIFT)
                # One unpack reads seq first, then the fields (struct reads them in order,
                # each through its own call; module docstring, "Memory ordering").
                seq, offset, size, state, kl, tag_lo, tag_hi = slot_of(buf, at)
                if seq & 1:
                    break  # being written: retry
                if state == _LIVE:
                    if kl == klen and buf[at + KEY_AT:at + KEY_AT + klen] == key:
                        if tags is not None and (tag_lo, tag_hi) not in tags:
                            return _MISS  # another tenant's: the leased path refuses it
                        if size != out.nbytes or offset + size > self._arena_bytes:
                            if seq_of(buf, at)[0] == seq:
                                return _CONFLICT  # a real size mismatch: the leased path says so
                            break
                        if self.before_copy is not None:
                            self.before_copy()
                        if size >= GIL_RELEASE_COPY_BYTES:
                            copy_bytes(out, arena[offset:offset + size])
                        else:
                            out[:] = arena[offset:offset + size]
                        if seq_of(buf, at)[0] != seq:
                            break  # the slot changed during the copy: retry
                        if owner_of(buf, OWNER_AT)[0] != self._owner_word:
                            return _DEAD
                        return int(size)
                elif state == _EMPTY:
                    return _MISS
                i = (i + 1) & mask
            else:
                return _MISS  # a full circle without an empty slot (a torn probe)
            self._retries += 1
        return _CONFLICT

    def locate(self, key: bytes) -> tuple[int, int, int, int] | None:
        """Where chunk ``key`` lies now, for a caller that copies it out of the arena itself:
        ``(slot, seq, offset, size)``, or None (not published, being written: the leased path
        decides; another tenant's chunk for a reader with ``owners``). The caller's copy is the chunk's only if :meth:`unchanged` ``(slot, seq)``
        and :meth:`alive` are true after it (the reader's protocol, module docstring, with the
        copy in between done by the caller)."""
        buf, mask = self._buf, self._mask
        klen = len(key)
        i = _xxh3_64(key) & mask
        for _probe in range(self._slots):
            at = HEADER_BYTES + (i << SLOT_SHIFT)
            seq, offset, size, state, kl, tag_lo, tag_hi = SLOT_STRUCT.unpack_from(buf, at)
            if seq & 1:
                return None
            if state == _LIVE:
                if kl == klen and buf[at + KEY_AT:at + KEY_AT + klen] == key:
                    if offset + size > self._arena_bytes or (
                            self._tags is not None and (tag_lo, tag_hi) not in self._tags):
                        return None
                    return at, seq, offset, size
            elif state == _EMPTY:
                return None
            i = (i + 1) & mask
        return None

    def unchanged(self, slot: int, seq: int) -> bool:
        """Whether the slot :meth:`locate` gave is as it was (so no write touched it since)."""
        return bool(SEQ_STRUCT.unpack_from(self._buf, slot)[0] == seq)

    def close(self) -> None:
        """Unmap the index (the arena stays the caller's). Idempotent.

        With the native extension, another thread may be inside a native read right now (it
        holds the extension's reader, not this object): the views that keep both mappings alive
        (see :meth:`ShmArena.close`) are then released only once that reader is gone."""
        if self._native is not None:
            self._native.close()  # later native reads miss
            holder = self._holder
            self._drop_native()
            weakref.finalize(holder, _release_views, self._buf, self._arena, self._segment)
            return
        for view in (self._buf, self._arena):
            try:
                view.release()
            except BufferError:  # a copy in another thread still holds a slice: it ends soon
                log.debug("read index view still exported at close")
        self._segment.close()

    def _drop_native(self) -> None:
        self._native = self._holder = self.fast_get = None


def _tags_for(owners: tuple[str, ...] | None) -> tuple[tuple[int, int], ...] | None:
    """The (low, high) tag halves a reader of ``owners`` accepts (None: every slot)."""
    if owners is None:
        return None
    if len(owners) > 2 or not all(isinstance(o, str) for o in owners):
        raise InvalidArgument(f"a read index reader takes at most two owners (a tenant and the "
                              f"shared one), got {owners!r}")
    return tuple(split_owner_tag(owner_tag(o)) for o in owners)


class _Mappings:
    """Held by a native ``IndexReader`` for its whole life: when it goes, a finalizer set by
    :meth:`ReadIndexReader.close` releases the views behind the reader's raw addresses."""

    __slots__ = ("__weakref__",)


def _release_views(buf: memoryview, arena: memoryview, segment: ShmArena) -> None:
    """A natively used reader's deferred close (:meth:`ReadIndexReader.close`)."""
    for view in (buf, arena):
        try:
            view.release()
        except BufferError:
            log.debug("read index view still exported at close")
    segment.close()

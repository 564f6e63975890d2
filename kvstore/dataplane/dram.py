"""The pinned-DRAM tier: chunks in one pre-touched shared-memory arena (or one per tenant group).

``DramTier`` implements :class:`~kvstore.dataplane.tier.HostMemoryTier` (see that
module for ownership, errors and threading). What is specific here:

* **Memory.** One :class:`~kvstore.dataplane.arena.ShmArena` of ``capacity_bytes``
  is created, reserved and pre-faulted by the constructor (≈0.5 s per GiB on the
  reference machine) and pinned with CUDA when a GPU exists. Nothing is allocated
  from the OS afterwards. Other local processes can map it read-only by
  :attr:`arena_name` and copy a chunk straight out at :meth:`locate`'s offset
  (the cache must hold a lease on that chunk meanwhile: the tier does not know
  about outside readers).
* **Layout.** :class:`~kvstore.dataplane.allocator.ExtentAllocator`: best fit,
  coalescing, every chunk at a multiple of ``alignment_bytes`` (4 KiB default, so
  O_DIRECT writes and GPU DMA can use a chunk in place).
* **Copies.** ``put`` = allocate under the lock, one memcpy outside it, publish
  under the lock; ``get_into`` = one memcpy outside the lock (the extent is pinned
  against reuse meanwhile: a ``remove`` during the copy frees the space when the
  copy ends). Copies of >= 256 KiB release the GIL.
* **Compression** (``CodecSpec``, off by default). ``put`` compresses before
  allocating and stores the frame when it saves at least ``min_saving``, raw bytes
  otherwise; ``commit`` does the same with a reserved slot's bytes (moving them).
  ``size_of``/``ChunkInfo.size_bytes`` are always the logical size; ``stats`` count
  the stored (compressed) bytes. ``view`` of a compressed chunk cannot be zero-copy:
  it **decompresses into a new read-only buffer** (correct bytes, one allocation)
  rather than fail, and :meth:`is_zero_copy` tells which a key gets. A frame that
  fails to decode drops the chunk and raises ``ChunkCorrupt``.
* **Read index** (``read_index_slots`` > 0, off by default). A second shared-memory segment,
  :class:`~kvstore.dataplane.read_index.ReadIndex`, where every committed raw chunk is
  published (key, offset, size) so same-host clients copy it with no lease at all. The extent
  table unpublishes a chunk before its space can be reused. Where the index cannot be made
  (not x86-64 Linux), the tier logs why and runs without one.
* **Owners.** Each published chunk carries its owning tenant's tag in the read index, so a
  tenant-scoped reader can refuse another tenant's chunk (``read_index``, "Owners"). The
  ``Tier`` calls take no tenant, so the writer names it around them: a chunk ``put`` or
  ``reserve``-d while the calling thread is inside :func:`writing_for` ``(owner)`` is
  ``owner``'s (a reserved slot keeps the owner it was reserved under for its commit); outside
  it, the default tenant's (``""``). The cache wraps every tier write it makes for a tenant
  (``TieredCache._place``).
* **Arenas per tenant group.** :class:`GroupedDramTier` is the tier as one ``DramTier`` per
  :class:`ArenaGroup` (its tenants, capacity and gid) plus the default one, for hosts shared by
  engines that must not read each other's chunks: a write goes to the arena of the tenant it is
  made for (:func:`writing_for`), so a process that may map one group's arena reads only that
  group's tenants' chunks (docs/dram-arena.md, "Arenas per tenant group").
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvstore.dataplane.allocator import ExtentAllocator
from kvstore.dataplane.arena import PinMode, ShmArena, copy_bytes, host_byte_view
from kvstore.dataplane.compress import Codec, CodecKind, CodecSpec, make_codec
from kvstore.dataplane.extent_table import Extent, ExtentTable, ExtentTableTier
from kvstore.dataplane.read_index import ReadIndex, slots_for
from kvstore.dataplane.tier import ChunkInfo, ChunkKey, TierKind, TierStats, check_key
from kvstore.errors import (
    ChunkBusy,
    ChunkCorrupt,
    ChunkExists,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    SizeMismatch,
    TierUnavailable,
)

log = logging.getLogger(__name__)

DEFAULT_ALIGNMENT_BYTES = 4096


class _Writer(threading.local):
    owner = ""


_writer = _Writer()


class writing_for:
    """Chunks this thread puts or reserves in a :class:`DramTier` meanwhile are ``owner``'s
    (a tenant's name) in the read index (module docstring, "Owners"). Nests; other threads
    are not affected. A class, not a ``contextlib`` generator: it wraps every batch reserve
    (a generator's context costs ~3x as much)."""

    __slots__ = ("_owner", "_previous")

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._previous = ""

    def __enter__(self) -> None:
        self._previous = _writer.owner
        _writer.owner = self._owner

    def __exit__(self, *exc_info: object) -> None:
        _writer.owner = self._previous


@dataclass(frozen=True, slots=True)
class ChunkLocation:
    """Where a chunk's bytes lie in the arena, for a same-host reader mapping it.

    ``stored_bytes`` bytes at ``offset`` are the chunk itself when ``codec`` is NONE
    (then ``stored_bytes == size_bytes``), else a frame of that codec.
    """

    offset: int
    stored_bytes: int
    size_bytes: int
    codec: CodecKind


class _SlotState(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"
    ABORTED = "aborted"


class DramSlot:
    """A reserved, invisible chunk in the arena (a :class:`~kvstore.dataplane.tier.WriteSlot`).

    ``buffer`` is released when the slot is committed or aborted, so a late write
    through it raises ``ValueError`` instead of corrupting a neighbour (unless the
    caller exported it further, e.g. ``np.frombuffer(slot.buffer)``: don't keep those).
    """

    __slots__ = ("_buffer", "_key", "_offset", "_owner", "_size_bytes", "_state", "_tier",
                 "_token")

    def __init__(
        self,
        tier: DramTier,
        key: ChunkKey,
        offset: int,
        size_bytes: int,
        buffer: memoryview | None,
        token: object,
    ) -> None:
        self._tier = tier
        self._token = token
        self._key = key
        self._offset = offset
        self._size_bytes = size_bytes
        self._buffer = buffer
        """None until ``buffer`` is first asked for: a same-host writer that mapped the arena
        writes at ``offset`` and never needs this view (a batch reserve makes none per slot)."""
        self._state = _SlotState.PENDING
        self._owner = _writer.owner
        """Whose chunk it is (:func:`writing_for` at reserve), for the read index."""

    @property
    def key(self) -> ChunkKey:
        return self._key

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def buffer(self) -> memoryview:
        """The slot's bytes in the arena, writable. Raises ValueError once the slot is
        committed or aborted (as a released memoryview does)."""
        if self._buffer is None:
            if self._state is not _SlotState.PENDING:
                raise ValueError(f"slot {self._key.hex()} is {self._state.value}: its buffer "
                                 "was released")
            self._buffer = self._tier._arena.view(self._offset, self._size_bytes,
                                                  readonly=False)
        return self._buffer

    @property
    def offset(self) -> int:
        """Where the slot lies in the arena (a same-host writer that mapped it writes there)."""
        return self._offset

    def _finish(self, state: _SlotState) -> None:
        self._state = state
        if self._buffer is None:
            return
        try:
            self._buffer.release()
        except BufferError:
            # The caller still holds an export of it (numpy/torch view): nothing to revoke.
            log.debug("slot %s finished while its buffer is still exported", self._key.hex())

    def __repr__(self) -> str:
        return f"DramSlot({self._key.hex()}, {self._size_bytes} bytes, {self._state.value})"


class DramTier(ExtentTableTier):
    """Chunks in pinned shared memory. See the module docstring.

    The constructor creates, reserves, pre-faults and (with a GPU) pins the arena, and with
    ``read_index_slots`` > 0 creates the read index beside it (one more segment and one thread
    that holds its liveness word); it raises ``CapacityError`` when ``/dev/shm`` lacks the room
    and ``TierUnavailable`` when POSIX shared memory is missing.
    """

    _KIND = TierKind.DRAM

    def __init__(
        self,
        capacity_bytes: int,
        *,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
        codec: CodecSpec | None = None,
        pin: PinMode = PinMode.AUTO,
        arena_name: str | None = None,
        prefault: bool = True,
        read_index_slots: int = 0,
        group: int | None = None,
    ) -> None:
        """``group`` (a gid): the arena is that group's, ``0660``, and its read index ``0640``
        (same-host clients of the group map them); else both are ``0600``
        (:func:`~kvstore.dataplane.arena.arena_mode`)."""
        if not isinstance(capacity_bytes, int) or capacity_bytes < alignment_bytes:
            raise InvalidArgument(
                f"capacity must be an int >= {alignment_bytes} bytes, got {capacity_bytes!r}"
            )
        spec = codec or CodecSpec()
        self._codec: Codec | None = make_codec(spec)
        self._codec_spec = spec
        allocator = ExtentAllocator(capacity_bytes, alignment_bytes)  # validates alignment
        self._arena = ShmArena.create(
            allocator.capacity_bytes, name=arena_name, prefault=prefault, pin=pin, group=group
        )
        self._read_index: ReadIndex | None = None
        if read_index_slots > 0:
            try:
                self._read_index = ReadIndex.create(
                    read_index_slots, arena_name=self._arena.name,
                    arena_bytes=self._arena.size_bytes,
                    name=None if arena_name is None else f"{arena_name}.index", group=group)
            except TierUnavailable as exc:
                log.warning("DRAM tier without a read index (same-host reads take leases): %s",
                            exc)
            except BaseException:
                self._arena.close()
                raise
        self._table = ExtentTable(allocator, where=f"DRAM tier {self._arena.name}",
                                  publisher=self._read_index)
        log.info(
            "DRAM tier: %d bytes in %s, pre-fault %.3f s, pinned=%s, codec=%s",
            allocator.capacity_bytes,
            self._arena.name,
            self._arena.prefault_s or 0.0,
            self._arena.pinned,
            spec.kind.value,
        )

    # --- identity -----------------------------------------------------------------------------

    @property
    def arena_name(self) -> str:
        """The shared-memory name a same-host process passes to ``ShmArena.attach``."""
        return self._arena.name

    @property
    def read_index(self) -> ReadIndex | None:
        """The read index publishing this tier's raw chunks (None when off)."""
        return self._read_index

    @property
    def read_index_name(self) -> str:
        """The read index's shared-memory name ("" when off)."""
        return "" if self._read_index is None else self._read_index.name

    @property
    def pinned(self) -> bool:
        return self._arena.pinned

    @property
    def prefault_s(self) -> float | None:
        return self._arena.prefault_s

    @property
    def codec(self) -> CodecSpec:
        return self._codec_spec

    # --- writes -------------------------------------------------------------------------------

    def put(self, key: bytes, src: object) -> ChunkInfo:
        """Store a copy of ``src``. Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument."""
        chunk_key = check_key(key)
        view = host_byte_view(src)
        size = view.nbytes
        if size == 0:
            raise InvalidArgument("cannot store an empty chunk")
        self._table.check_open()
        packed = self._codec.compress(view) if self._codec is not None else None
        stored: memoryview = memoryview(packed) if packed is not None else view
        codec = self._codec_spec.kind if packed is not None else CodecKind.NONE
        token = object()
        offset = self._table.begin_write(chunk_key, stored.nbytes, token)
        try:
            copy_bytes(self._arena.view(offset, stored.nbytes, readonly=False), stored)
            self._table.commit_write(chunk_key, token, offset, stored.nbytes, size, codec,
                                     _writer.owner)
        except BaseException:
            self._table.abort_write(chunk_key, token, offset)
            raise
        return ChunkInfo(chunk_key, size, TierKind.DRAM)

    def reserve(self, key: bytes, size_bytes: int) -> DramSlot:
        """An invisible writable slot of ``size_bytes``. Raises ChunkExists, ChunkBusy, CapacityError."""
        chunk_key = check_key(key)
        if not isinstance(size_bytes, int) or size_bytes < 1:
            raise InvalidArgument(f"slot size must be a positive int, got {size_bytes!r}")
        token = object()
        offset = self._table.begin_write(chunk_key, size_bytes, token)
        try:
            buffer = self._arena.view(offset, size_bytes, readonly=False)
        except BaseException:
            self._table.abort_write(chunk_key, token, offset)
            raise
        return DramSlot(self, chunk_key, offset, size_bytes, buffer, token)

    def commit(self, slot: DramSlot) -> ChunkInfo:
        """Publish a reserved slot. Raises InvalidArgument for a foreign or finished slot."""
        token = self._slot_token(slot)
        if slot._state is not _SlotState.PENDING or not self._table.is_pending(slot.key, token):
            raise InvalidArgument(f"slot {slot.key.hex()} is {slot._state.value}, not pending")
        offset, stored_bytes, codec = slot._offset, slot.size_bytes, CodecKind.NONE
        if self._codec is not None:
            packed = self._codec.compress(slot.buffer)
            if packed is not None:
                # Move the frame to a smaller extent; the raw one is freed after publishing.
                new_offset = self._table.allocate_raw(len(packed))
                try:
                    copy_bytes(
                        self._arena.view(new_offset, len(packed), readonly=False),
                        memoryview(packed),
                    )
                except BaseException:
                    self._table.free_raw(new_offset)
                    raise
                offset, stored_bytes, codec = new_offset, len(packed), self._codec_spec.kind
        try:
            self._table.commit_write(slot.key, token, offset, stored_bytes, slot.size_bytes, codec,
                                     slot._owner)
        except BaseException:
            if offset != slot._offset:
                self._table.free_raw(offset)
            raise
        if offset != slot._offset:
            self._table.free_raw(slot._offset)
        slot._finish(_SlotState.COMMITTED)
        return ChunkInfo(slot.key, slot.size_bytes, TierKind.DRAM)

    def reserve_many(self, keys: Sequence[bytes], sizes_bytes: Sequence[int]
                     ) -> list[DramSlot | KvtierError]:
        """:meth:`reserve` for a batch, in order, in one table lock round: per item a slot, or
        the error ``reserve`` would have raised for it (the item then holds nothing). Raises
        InvalidArgument (lengths differ), TierUnavailable (closed)."""
        if len(keys) != len(sizes_bytes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes_bytes)} sizes")
        out: list[DramSlot | KvtierError | None] = [None] * len(keys)
        wanted: list[tuple[ChunkKey, int, object]] = []
        at: list[int] = []
        for i, (key, size) in enumerate(zip(keys, sizes_bytes, strict=True)):
            try:
                k = check_key(key)
                if not isinstance(size, int) or size < 1:
                    raise InvalidArgument(f"slot size must be a positive int, got {size!r}")
            except InvalidArgument as exc:
                out[i] = exc
                continue
            wanted.append((k, size, object()))
            at.append(i)
        arena_bytes = self._arena.size_bytes
        for i, (key, size, token), got in zip(at, wanted, self._table.begin_write_many(wanted),
                                              strict=True):
            if isinstance(got, KvtierError):
                out[i] = got
                continue
            if got + size > arena_bytes:  # (a broken allocator: the range is off the arena)
                self._table.abort_write(key, token, got)
                out[i] = InvariantViolation(f"slot [{got}, {got + size}) lies past the "
                                            f"{arena_bytes}-byte arena")
                continue
            # No view per slot: a same-host writer writes at the offset (``DramSlot.buffer``
            # makes one when asked).
            out[i] = DramSlot(self, key, got, size, None, token)
        return [r for r in out if r is not None]

    def commit_many(self, slots: Sequence[DramSlot], after: Sequence[int] | None = None
                    ) -> list[ChunkInfo | KvtierError]:
        """:meth:`commit` for a batch, in order: per slot its info, or the error ``commit``
        would have raised (InvalidArgument for a foreign or finished slot). ``after[i]`` >= 0:
        slot ``i`` is committed only if slot ``after[i]`` (an earlier one: its parent) was,
        else it fails with InvalidArgument. A slot that failed is unchanged (still pending:
        the caller aborts it). Without compression in one table lock round; with it, slot by
        slot."""
        if after is not None and len(after) != len(slots):
            raise InvalidArgument(f"{len(slots)} slots but {len(after)} parent positions")
        if self._codec is not None:
            out: list[ChunkInfo | KvtierError] = []
            for i, slot in enumerate(slots):
                first = -1 if after is None else after[i]
                if first >= 0 and (first >= i or isinstance(out[first], KvtierError)):
                    out.append(InvalidArgument(f"slot {slot.key.hex()} must follow the slot "
                                               "before it in the batch, which failed"))
                    continue
                try:
                    out.append(self.commit(slot))
                except KvtierError as exc:
                    out.append(exc)
            return out
        results: list[ChunkInfo | KvtierError | None] = [None] * len(slots)
        wanted: list[tuple[ChunkKey, object, int, int]] = []
        owners: list[str] = []
        at: list[int] = []
        where = [-1] * len(slots)  # a slot's position in ``wanted``
        order: list[int] | None = None if after is None else []
        for i, slot in enumerate(slots):
            if not isinstance(slot, DramSlot) or slot._tier is not self:
                results[i] = InvalidArgument("slot was not reserved from this tier")
            elif slot._state is not _SlotState.PENDING:
                results[i] = InvalidArgument(f"slot {slot.key.hex()} is {slot._state.value}, "
                                             "not pending")
            elif after is not None and order is not None and after[i] >= 0 \
                    and where[after[i]] < 0:
                results[i] = InvalidArgument(f"slot {slot.key.hex()} must follow the slot "
                                             "before it in the batch, which failed")
            else:
                if after is not None and order is not None:
                    order.append(where[after[i]] if after[i] >= 0 else -1)
                where[i] = len(wanted)
                wanted.append((slot._key, slot._token, slot._offset, slot._size_bytes))
                owners.append(slot._owner)
                at.append(i)
        for i, extent in zip(at, self._table.commit_raw_many(wanted, order, owners),
                             strict=True):
            if isinstance(extent, KvtierError):
                results[i] = extent
                continue
            slot = slots[i]
            slot._finish(_SlotState.COMMITTED)
            results[i] = ChunkInfo(slot._key, slot._size_bytes, TierKind.DRAM)
        return [r for r in results if r is not None]

    def abort(self, slot: DramSlot) -> None:
        """Free an uncommitted slot. Idempotent; a no-op on a committed slot."""
        token = self._slot_token(slot)
        if slot._state is not _SlotState.PENDING:
            return
        self._table.abort_write(slot.key, token, slot._offset)
        slot._finish(_SlotState.ABORTED)

    def _slot_token(self, slot: DramSlot) -> object:
        if not isinstance(slot, DramSlot) or slot._tier is not self:
            raise InvalidArgument("slot was not reserved from this tier")
        return slot._token

    # --- reads --------------------------------------------------------------------------------

    def get_into(self, key: bytes, dst: object) -> int:
        """Copy the chunk into ``dst`` (exactly its size). Raises ChunkNotFound, SizeMismatch, ChunkCorrupt."""
        chunk_key = check_key(key)
        out = host_byte_view(dst, writable=True)
        extent = self._table.acquire(chunk_key)
        try:
            if out.nbytes != extent.size_bytes:
                raise SizeMismatch(
                    f"get_into {chunk_key.hex()}", expected=extent.size_bytes, actual=out.nbytes
                )
            stored = self._arena.view(extent.offset, extent.stored_bytes)
            if extent.codec is CodecKind.NONE:
                copy_bytes(out, stored)
            else:
                self._decompress(extent, stored, out)
        finally:
            self._table.release(extent)
        return extent.size_bytes

    def view(self, key: bytes) -> memoryview:
        """A read-only view of the chunk: zero-copy unless it is compressed (see module doc)."""
        chunk_key = check_key(key)
        extent = self._table.acquire(chunk_key)
        try:
            stored = self._arena.view(extent.offset, extent.stored_bytes)
            if extent.codec is CodecKind.NONE:
                return stored
            out = bytearray(extent.size_bytes)
            self._decompress(extent, stored, memoryview(out))
            return memoryview(out).toreadonly()
        finally:
            self._table.release(extent)

    def _decompress(self, extent: Extent, stored: memoryview, out: memoryview) -> None:
        # A tier compresses with its one codec only: a compressed extent implies self._codec.
        if self._codec is None or extent.codec is not self._codec_spec.kind:
            raise InvariantViolation(
                f"extent codec {extent.codec} but tier codec {self._codec_spec}"
            )
        try:
            self._codec.decompress_into(stored, out)
        except ChunkCorrupt:
            self._table.drop(extent)
            log.error("DRAM chunk %s failed to decompress and was dropped", extent.key.hex())
            raise

    def is_zero_copy(self, key: bytes) -> bool | None:
        """Whether ``view(key)`` is zero-copy (stored raw); None when the key is absent."""
        extent = self._table.get(check_key(key))
        return None if extent is None else extent.codec is CodecKind.NONE

    def locate(self, key: bytes) -> ChunkLocation | None:
        """Where the chunk lies in the arena (see :class:`ChunkLocation`); None on a miss."""
        extent = self._table.get(check_key(key))
        if extent is None:
            return None
        return ChunkLocation(extent.offset, extent.stored_bytes, extent.size_bytes, extent.codec)

    def close(self) -> None:
        """Forget every chunk (unpublishing them), close the read index, unpin, unmap and unlink
        the arena. Idempotent."""
        if self._table.close():
            if self._read_index is not None:
                self._read_index.close()
            self._arena.close()

    def __enter__(self) -> DramTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DramTier({self.capacity_bytes} bytes, arena={self._arena.name!r})"


# --- arenas per tenant group ----------------------------------------------------------------

DEFAULT_ARENA = ""
"""The name of a :class:`GroupedDramTier`'s default arena: the chunks of every tenant in no
group (the default tenant's and the shared tenant's among them)."""

_GROUP_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


@dataclass(frozen=True, slots=True)
class ArenaGroup:
    """One arena of a :class:`GroupedDramTier`: the ``tenants`` whose chunks it alone holds,
    its ``capacity_bytes``, and ``gid``, the group it is handed to (``0660``; None: ``0600``,
    the daemon's uid only). Validates itself (InvalidArgument)."""

    name: str
    tenants: frozenset[str]
    capacity_bytes: int
    gid: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _GROUP_NAME_RE.match(self.name):
            raise InvalidArgument(f"an arena group's name is 1-64 of [A-Za-z0-9_-], starting "
                                  f"with a letter or digit, got {self.name!r}")
        if not isinstance(self.tenants, frozenset) or not self.tenants or not all(
                isinstance(t, str) for t in self.tenants):
            raise InvalidArgument(f"arena group {self.name!r} needs a non-empty frozenset of "
                                  f"tenant names, got {self.tenants!r}")
        if not isinstance(self.capacity_bytes, int) or isinstance(self.capacity_bytes, bool) \
                or self.capacity_bytes < 1:
            raise InvalidArgument(f"arena group {self.name!r}: capacity_bytes must be a "
                                  f"positive int, got {self.capacity_bytes!r}")
        if self.gid is not None and (not isinstance(self.gid, int) or isinstance(self.gid, bool)
                                     or self.gid < 0):
            raise InvalidArgument(f"arena group {self.name!r}: gid must be an int >= 0 or None, "
                                  f"got {self.gid!r}")


class GroupedDramTier:
    """The pinned-DRAM tier as several arenas, one per tenant group plus the default one
    (:data:`DEFAULT_ARENA`: every tenant in no group), for hosts shared by engines that must
    not read each other's chunks (docs/dram-arena.md, "Arenas per tenant group").

    Each arena is a :class:`DramTier` of its own (shared-memory segment handed to its group's
    gid, allocator, extent table, read index): a process that may map one arena reads only the
    chunks of that group's tenants. Writes go to the arena of the tenant the calling thread
    writes for (:func:`writing_for`, as the read index's owner tags do), so every copy the
    cache places in DRAM (a put, a reservation, a promotion back from NVMe) lands in its
    owner's arena; an arena that is full raises CapacityError even where another has room (the
    cache then evicts only chunks of that arena's tenants: ``same_arena``). Reads, sizes and
    removes find the key in whichever arena holds it (a key is in at most one: a write of a key
    another arena holds is ChunkExists).

    The ``Tier`` contract is :class:`DramTier`'s; ``capacity_bytes`` and ``stats`` are the
    sums over the arenas. ``arena_name``, ``read_index`` and ``read_index_name`` are the default
    arena's; :meth:`arena` gives a group's. Raises InvalidArgument for groups that overlap (a
    tenant in two, two of one name) or leave the default arena less than ``alignment_bytes``,
    and what :class:`DramTier` raises (nothing is left behind when one arena fails)."""

    _KIND = TierKind.DRAM

    def __init__(
        self,
        capacity_bytes: int,
        groups: Sequence[ArenaGroup],
        *,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
        codec: CodecSpec | None = None,
        pin: PinMode = PinMode.AUTO,
        arena_name: str | None = None,
        prefault: bool = True,
        read_index_slots: int = 0,
        group: int | None = None,
    ) -> None:
        """``capacity_bytes``: all arenas together; the default arena gets what the groups
        leave. ``read_index_slots`` > 0: the default arena's index has that many slots and each
        group's :func:`~kvstore.dataplane.read_index.slots_for` its capacity. ``group``: the
        default arena's gid (as :class:`DramTier`'s)."""
        if not groups:
            raise InvalidArgument("a grouped DRAM tier needs at least one arena group")
        owner_of: dict[str, str] = {}
        names: set[str] = set()
        for g in groups:
            if not isinstance(g, ArenaGroup):
                raise InvalidArgument(f"arena groups must be ArenaGroup, got {g!r}")
            if g.name in names:
                raise InvalidArgument(f"two arena groups are named {g.name!r}")
            names.add(g.name)
            for tenant in sorted(g.tenants):
                if tenant in owner_of:
                    raise InvalidArgument(f"tenant {tenant!r} is in arena groups "
                                          f"{owner_of[tenant]!r} and {g.name!r}: a tenant's "
                                          "chunks live in one arena")
                owner_of[tenant] = g.name
        rest = capacity_bytes - sum(g.capacity_bytes for g in groups)
        if rest < alignment_bytes:
            raise InvalidArgument(
                f"the arena groups take {capacity_bytes - rest} of the tier's {capacity_bytes} "
                f"bytes, leaving the default arena (every tenant in no group) {rest}: less than "
                f"{alignment_bytes}")
        self._group_of = owner_of
        self._groups = tuple(groups)
        self._parts: dict[str, DramTier] = {}
        try:
            self._parts[DEFAULT_ARENA] = DramTier(
                rest, alignment_bytes=alignment_bytes, codec=codec, pin=pin,
                arena_name=arena_name, prefault=prefault, read_index_slots=read_index_slots,
                group=group)
            for g in groups:
                self._parts[g.name] = DramTier(
                    g.capacity_bytes, alignment_bytes=alignment_bytes, codec=codec, pin=pin,
                    arena_name=None if arena_name is None else f"{arena_name}.{g.name}",
                    prefault=prefault,
                    read_index_slots=slots_for(g.capacity_bytes) if read_index_slots > 0 else 0,
                    group=g.gid)
        except BaseException:
            for part in self._parts.values():
                part.close()
            raise
        self._default = self._parts[DEFAULT_ARENA]
        self._all = tuple(self._parts.values())
        self._lock = threading.Lock()
        self._claims: dict[ChunkKey, tuple[DramTier, int]] = {}
        """Keys being written (put, or reserved and not yet committed or aborted) -> the arena
        and how many writes there: a write of the key in another arena meanwhile is ChunkBusy,
        so a key never lands in two arenas (each arena alone refuses a second writer)."""
        log.info("DRAM tier in %d arenas: %s", len(self._parts), ", ".join(
            f"{name or '(default)'} {part.capacity_bytes} bytes in {part.arena_name}"
            for name, part in self._parts.items()))

    # --- arenas -------------------------------------------------------------------------------

    @property
    def groups(self) -> tuple[ArenaGroup, ...]:
        return self._groups

    def arena(self, name: str) -> DramTier:
        """The arena ``name`` (a group's, or :data:`DEFAULT_ARENA`). Raises InvalidArgument."""
        part = self._parts.get(name)
        if part is None:
            raise InvalidArgument(f"no arena group {name!r} (groups: "
                                  f"{', '.join(g.name for g in self._groups)})")
        return part

    def arena_of(self, tenant: str) -> str:
        """The arena whose chunks are ``tenant``'s (:data:`DEFAULT_ARENA` for a tenant in no
        group)."""
        return self._group_of.get(tenant, DEFAULT_ARENA)

    def same_arena(self, tenant: str) -> Callable[[str], bool]:
        """A test of whether another tenant's chunks share ``tenant``'s arena: what eviction
        made for ``tenant``'s write may take (a full arena frees room only in itself)."""
        group_of, mine = self._group_of, self.arena_of(tenant)
        return lambda other: group_of.get(other, DEFAULT_ARENA) == mine

    def arenas(self) -> dict[str, tuple[int, Callable[[str], bool]]]:
        """Each arena's capacity and a test of which tenants' chunks it holds, by name
        (:data:`DEFAULT_ARENA` first): what per-arena watermarks are applied with."""
        group_of = self._group_of

        def members(name: str) -> Callable[[str], bool]:
            return lambda tenant: group_of.get(tenant, DEFAULT_ARENA) == name

        return {name: (part.capacity_bytes, members(name)) for name, part in self._parts.items()}

    def _writing(self) -> DramTier:
        return self._parts[self._group_of.get(_writer.owner, DEFAULT_ARENA)]

    def _holder(self, key: bytes) -> DramTier | None:
        for part in self._all:
            if part.contains(key):
                return part
        return None

    def _elsewhere(self, key: bytes, part: DramTier) -> bool:
        """Whether an arena other than ``part`` holds ``key``."""
        return any(p is not part and p.contains(key) for p in self._all)

    def _claim(self, key: bytes, part: DramTier) -> ChunkKey:
        """Note a write of ``key`` in ``part``. Raises ChunkBusy (being written in another
        arena), ChunkExists (another arena holds it), InvalidArgument (bad key)."""
        k = check_key(key)
        with self._lock:
            held = self._claims.get(k)
            if held is not None and held[0] is not part:
                raise ChunkBusy(f"chunk {k.hex()} is being written in another arena")
            if self._elsewhere(k, part):
                raise ChunkExists(f"chunk {k.hex()} is held in another arena")
            self._claims[k] = (part, 1 if held is None else held[1] + 1)
        return k

    def _unclaim(self, key: ChunkKey) -> None:
        with self._lock:
            held = self._claims.get(key)
            if held is None:
                return
            if held[1] <= 1:
                del self._claims[key]
            else:
                self._claims[key] = (held[0], held[1] - 1)

    def _slot_part(self, slot: object) -> DramTier:
        tier = slot._tier if isinstance(slot, DramSlot) else None
        if tier is None or all(tier is not p for p in self._all):
            raise InvalidArgument("slot was not reserved from this tier")
        return tier

    # --- identity -----------------------------------------------------------------------------

    @property
    def kind(self) -> TierKind:
        return self._KIND

    @property
    def capacity_bytes(self) -> int:
        return sum(p.capacity_bytes for p in self._all)

    @property
    def arena_name(self) -> str:
        """The default arena's shared-memory name (a group's: ``arena(name).arena_name``)."""
        return self._default.arena_name

    @property
    def read_index(self) -> ReadIndex | None:
        return self._default.read_index

    @property
    def read_index_name(self) -> str:
        return self._default.read_index_name

    @property
    def pinned(self) -> bool:
        return all(p.pinned for p in self._all)

    @property
    def prefault_s(self) -> float | None:
        times = [p.prefault_s for p in self._all if p.prefault_s is not None]
        return sum(times) if times else None

    @property
    def codec(self) -> CodecSpec:
        return self._default.codec

    # --- writes -------------------------------------------------------------------------------

    def put(self, key: bytes, src: object) -> ChunkInfo:
        """:meth:`DramTier.put` into the writer's arena (ChunkExists when another holds it,
        ChunkBusy while another writes it)."""
        part = self._writing()
        k = self._claim(key, part)
        try:
            return part.put(k, src)
        finally:
            self._unclaim(k)

    def reserve(self, key: bytes, size_bytes: int) -> DramSlot:
        """:meth:`DramTier.reserve` in the writer's arena (ChunkExists when another holds it,
        ChunkBusy while another writes it)."""
        part = self._writing()
        k = self._claim(key, part)
        try:
            return part.reserve(k, size_bytes)
        except BaseException:
            self._unclaim(k)
            raise

    def commit(self, slot: DramSlot) -> ChunkInfo:
        info = self._slot_part(slot).commit(slot)
        self._unclaim(slot.key)
        return info

    def abort(self, slot: DramSlot) -> None:
        part = self._slot_part(slot)
        pending = slot._state is _SlotState.PENDING
        part.abort(slot)
        if pending:
            self._unclaim(slot.key)

    def reserve_many(self, keys: Sequence[bytes], sizes_bytes: Sequence[int]
                     ) -> list[DramSlot | KvtierError]:
        """:meth:`DramTier.reserve_many` in the writer's arena; ChunkExists for a key another
        arena holds."""
        if len(keys) != len(sizes_bytes):
            raise InvalidArgument(f"{len(keys)} keys but {len(sizes_bytes)} sizes")
        part = self._writing()
        out: list[DramSlot | KvtierError | None] = [None] * len(keys)
        at: list[int] = []
        claimed: list[ChunkKey] = []
        for i, key in enumerate(keys):
            try:
                claimed.append(self._claim(key, part))
            except KvtierError as exc:
                out[i] = exc
                continue
            at.append(i)
        try:
            got = part.reserve_many(claimed, [sizes_bytes[i] for i in at])
        except BaseException:
            for k in claimed:
                self._unclaim(k)
            raise
        for i, k, result in zip(at, claimed, got, strict=True):
            out[i] = result
            if isinstance(result, KvtierError):
                self._unclaim(k)
        return [r for r in out if r is not None]

    def commit_many(self, slots: Sequence[DramSlot], after: Sequence[int] | None = None
                    ) -> list[ChunkInfo | KvtierError]:
        """:meth:`DramTier.commit_many`: in one call to the arena when every slot is one
        arena's (a tenant's batch), else slot by slot (``after`` as there)."""
        if after is not None and len(after) != len(slots):
            raise InvalidArgument(f"{len(slots)} slots but {len(after)} parent positions")
        first = slots[0]._tier if slots and isinstance(slots[0], DramSlot) else None
        if first is not None and any(first is p for p in self._all) and all(
                isinstance(s, DramSlot) and s._tier is first for s in slots):
            results = first.commit_many(slots, after)
            for slot, result in zip(slots, results, strict=True):
                if not isinstance(result, KvtierError):
                    self._unclaim(slot.key)
            return results
        out: list[ChunkInfo | KvtierError] = []
        for i, slot in enumerate(slots):
            parent = -1 if after is None else after[i]
            if parent >= 0 and (parent >= i or isinstance(out[parent], KvtierError)):
                out.append(InvalidArgument(f"slot {slot.key.hex()} must follow the slot "
                                           "before it in the batch, which failed"))
                continue
            try:
                out.append(self.commit(slot))
            except KvtierError as exc:
                out.append(exc)
        return out

    # --- reads --------------------------------------------------------------------------------

    def get_into(self, key: bytes, dst: object) -> int:
        return (self._holder(key) or self._default).get_into(key, dst)

    def view(self, key: bytes) -> memoryview:
        return (self._holder(key) or self._default).view(key)

    def is_zero_copy(self, key: bytes) -> bool | None:
        part = self._holder(key)
        return None if part is None else part.is_zero_copy(key)

    def locate(self, key: bytes) -> ChunkLocation | None:
        """Where the chunk lies in the arena holding it (which one: :meth:`arena_of` its
        owner), or None."""
        part = self._holder(key)
        return None if part is None else part.locate(key)

    def contains(self, key: bytes) -> bool:
        return self._holder(key) is not None

    def size_of(self, key: bytes) -> int | None:
        part = self._holder(key)
        return None if part is None else part.size_of(key)

    def remove(self, key: bytes) -> bool:
        part = self._holder(key)
        return False if part is None else part.remove(key)

    def chunks(self) -> Iterator[ChunkInfo]:
        return iter([info for part in self._all for info in part.chunks()])

    def stats(self) -> TierStats:
        parts = [p.stats() for p in self._all]
        return TierStats(self._KIND, sum(s.capacity_bytes for s in parts),
                         sum(s.used_bytes for s in parts), sum(s.chunks for s in parts),
                         max(s.largest_free_bytes for s in parts))

    def close(self) -> None:
        """Close every arena. Idempotent."""
        for part in self._all:
            part.close()

    def __enter__(self) -> GroupedDramTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GroupedDramTier({self.capacity_bytes} bytes, arenas "
                f"{[name or '(default)' for name in self._parts]})")

"""The shared-memory plane's client half: :class:`ShmClient`, a :class:`~..base.MappedTransport`.

It maps the peer's DRAM arena (read-write) and reaches its lease channel (:mod:`.channel`), and
moves every byte itself with one memcpy:

* ``get_into`` of a chunk the peer's **read index** publishes (in DRAM, stored raw) is
  lease-free: a lookup in the mapped index, one memcpy and a seqlock check, no round trip at
  all (:mod:`kvstore.dataplane.read_index`; Linux on x86-64 only; through the native extension
  when it is built, which also does the read's accounting). The keys read are reported to the
  peer in batches afterwards (:mod:`.reports`). Otherwise (not published, moved during the
  copy, or in NVMe) one ACQUIRE_READ round trip (the peer pins the chunk in its arena,
  promoting it first), one memcpy out of the mapped arena, and a RELEASE sent without waiting
  for a reply.
* ``put`` = RESERVE (an invisible slot) + one memcpy into the arena + COMMIT; values up to
  ``INLINE_PUT_MAX_BYTES`` (64 KiB) travel inside one PUT request instead (one round trip).
  Batches (``put_many``, with parents: a chain in one call, parent-first): runs of values up
  to 16 KiB in PUT_MANY requests, runs of larger ones in pipelined RESERVE_MANY requests, one
  copy each into the arena and COMMIT_MANY requests (docs/transport.md, "Batched same-host
  puts").
* ``open_read_parts`` leases the parts of a batch (one ACQUIRE_READ each, all sent at once on
  one connection and served in order) and lends out torch views of the chunks, for a caller that
  copies them straight into its own buffers (:class:`ShmBatchRead`); ``read_free`` lends views of
  the chunks the read index publishes with no lease at all, checked by the index's seqlock after
  the caller's copy (:class:`ShmFreeRead`).
* A chunk the arena cannot take right now (``CapacityError``, ``ChunkBusy``) is read through
  the ``fallback`` transport when one is given (the daemon's TCP plane), else the error is
  raised.

Leases belong to the channel connection that took them: if this process dies, the peer ends
them (no half-written chunk becomes visible; nothing stays pinned).

CUDA tensors: ``put``/``get_into`` copy between the device and the arena directly (the arena is
registered with CUDA when a GPU exists, so the copy is DMA), under the same leases.

Thread safety: one client may be used from many threads; channel connections are pooled (one
per concurrent call), the read index is read without locks.

Idle connections: the peer closes a pooled connection that sent no request for its
``idle_timeout_s`` while it held no lease, before reading any byte of a next request
(:mod:`.server`, "Bounds"). The first request of a call on a reused connection that then finds
it closed (EOF or a reset before any byte of its reply: ``ChannelClosed``) is sent again once on
a fresh connection, after the other idle ones, which idled as long, are dropped; the caller sees
nothing. That is safe for every first request: an idle close means the peer never read it;
otherwise the connection closed because the peer is shutting down or died, and then the fresh
connection cannot be made (``PeerUnavailable``): the listener closes before the connections
do. A lease a request took (ACQUIRE_READ, RESERVE, RESERVE_MANY) dies with the connection that
took it in any case. Later requests of the same call (the COMMIT after a RESERVE, a RELEASE, the
next batch of ``put_many``) are never resent: each follows a reply on the same connection, so it
finds the connection idle-closed only when the call itself paused for ``idle_timeout_s``
(holding a lease: for its TTL too), and what the connection held ended with it: that failure is
the call's (``PeerUnavailable``). ``put_many`` sends all RESERVE_MANY parts of a run before
their first reply, and a ChannelClosed can come only before that reply, when the peer read none
of them: the run is sent again, as a first request is.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self, TypeVar

import numpy as np

from kvstore.dataplane import cuda
from kvstore.dataplane.arena import (
    ArenaAccess,
    PinMode,
    ShmArena,
    copy_bytes,
    host_byte_view,
    is_cuda_tensor,
)
from kvstore.dataplane.read_index import NOT_TRIED, ReadIndexReader, ReadResult
from kvstore.dataplane.tier import Buffer, ChunkKey, check_key
from kvstore.dataplane.transport.auth import TicketSource
from kvstore.dataplane.transport.base import (
    BatchTransport,
    Endpoint,
    TransportKind,
    ViewReadLease,
    put_each,
    settle_batch,
)
from kvstore.dataplane.transport.shm.channel import ChannelClosed, LeaseChannel
from kvstore.dataplane.transport.shm.frames import (
    FLAG_NO_REPLY,
    FLAG_PARENTS,
    FLAG_PREFIX,
    INLINE_PUT_MAX_BYTES,
    ITEM_EXISTS,
    ITEM_STORED,
    MAX_BODY_BYTES,
    MAX_KEYS,
    REQUEST,
    ChannelOp,
    item_error,
    key_parent_pairs,
)
from kvstore.dataplane.transport.shm.reports import ReadReporter
from kvstore.dataplane.transport.shm.writes import WRITE_TTL_S, ShmWriter
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkNotFound,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PeerUnavailable,
    SizeMismatch,
    TierUnavailable,
    TransportError,
)

log = logging.getLogger(__name__)

_FALLBACK = (CapacityError, ChunkBusy)
"""Refusals of a read lease that another transport may still serve (the peer cannot bring the
chunk into its arena now)."""
_PAGE_BYTES = 4096
_BATCH_MAX_KEYS = 512
"""Keys per batched put request (the buffers of one request stay under IOV_MAX)."""
_BATCH_INLINE_MAX_BYTES = 16 << 10
"""Batched values up to this size travel inside PUT_MANY requests; larger ones are reserved,
copied once and committed (measured: for 32 x 64 KiB values inline cost ~3x the reserved path:
two more copies, the socket's and the daemon's)."""
_PIPELINE_ITEMS = 8
"""Most items per RESERVE_MANY / COMMIT_MANY of a pipelined batch of large values (the daemon
reserves the next part while the client copies this one; :func:`_pipeline_parts`)..."""
_PIPELINE_PART_BYTES = 2 << 20
"""...unless that many are fewer bytes than this: smaller values go in larger parts, since each
request costs the daemon a fixed ~40 µs and a copy of small values is short (measured: 32 x 64
KiB in 6 parts spent ~12 % of the daemon's time on the per-request costs)."""
_T = TypeVar("_T")


def _pipeline_parts(n: int, value_bytes: int) -> list[tuple[int, int]]:
    """The [a, b) parts of a pipelined run of ``n`` large values of up to ``value_bytes``
    each: 2 items first (the client copies as soon as the daemon reserved those) or a
    quarter of ``_PIPELINE_PART_BYTES`` of them, then doubling up to ``_PIPELINE_ITEMS`` items
    or ``_PIPELINE_PART_BYTES``, and a last part of at most 2 (its COMMIT_MANY is what the
    call waits for at the end)."""
    most = max(_PIPELINE_ITEMS, _PIPELINE_PART_BYTES // max(value_bytes, 1))
    parts: list[tuple[int, int]] = []
    a, size = 0, min(most, max(2, (_PIPELINE_PART_BYTES // 4) // max(value_bytes, 1)))
    while a < n:
        b = min(n, a + size)
        parts.append((a, b))
        a, size = b, min(2 * size, most)
    a, b = parts[-1]
    if b - a > 2:
        parts[-1:] = [(a, b - 2), (b - 2, b)]
    return parts


_ITEM_OUTCOME: dict[int, bool] = {ITEM_STORED: True, ITEM_EXISTS: False}
"""A per-item status byte as a batch put's outcome (absent: refused, None)."""


VIEW_LEASE_TTL_S = 60.0
"""TTL of a lease :meth:`ShmClient.open_read` lends out when ``lease_ttl_s`` is 0: sent
explicitly, so the client knows the lease's deadline (the peer's default TTL is its own)."""


@dataclass(frozen=True, slots=True)
class ShmClientConfig:
    lease_ttl_s: float = 0.0
    """TTL of this client's leases (0: the peer's default; :data:`VIEW_LEASE_TTL_S` for the
    leases ``open_read`` lends out, whose deadline the client must know)."""
    populate_arena: bool = True
    """Fault the whole mapped arena into this process's page tables at ``connect`` (one read
    per page: ~30 ms per 256 MiB here, plus 2 MiB of page tables per GiB). Without it the first
    copy to or from each arena page costs a page fault: measured 340 µs instead of 52 µs for a
    first 1 MiB copy, i.e. a cold client runs at a sixth of memcpy until it has touched the
    whole arena."""
    lease_free_reads: bool = True
    """Copy chunks the peer's read index publishes without a lease round trip (Linux on x86-64
    only; elsewhere, or when the peer serves no index, every read takes a lease)."""
    lease_free_attempts: int = 4
    """Copies of one chunk tried lease-free before the read takes a lease (each retry follows
    a copy the peer invalidated meanwhile: the chunk was evicted, moved or removed)."""
    read_report_interval_s: float = 0.05
    """Lease-free reads are reported to the peer (hits, recency) at least this often..."""
    read_report_batch: int = 1024
    """...and as soon as this many are waiting."""
    max_value_bytes: int = 0
    """Larger values are refused (InvalidArgument) before anything is sent; 0: no limit of the
    client's own (the peer refuses what its arena cannot hold: CapacityError)."""
    io_timeout_s: float = 30.0
    """Longest wait for the lease channel (a send, a reply): a stopped or stuck peer is then
    PeerUnavailable. Lease-free reads never wait for the peer."""

    def __post_init__(self) -> None:
        if self.lease_ttl_s < 0 or self.max_value_bytes < 0 or not self.io_timeout_s > 0:
            raise InvalidArgument("lease_ttl_s and max_value_bytes must be >= 0 and "
                                  "io_timeout_s > 0")
        if self.lease_free_attempts < 1 or self.read_report_interval_s <= 0 \
                or not 1 <= self.read_report_batch <= MAX_KEYS:
            raise InvalidArgument(f"lease_free_attempts must be >= 1, read_report_interval_s "
                                  f"> 0 and read_report_batch 1..{MAX_KEYS}")


@dataclass(frozen=True, slots=True)
class LeaseFreeCounters:
    """What a client's lease-free reads did (monotonic counts since connect)."""

    active: bool
    """Whether reads are tried lease-free now (False: off, unsupported, or the peer died)."""
    hits: int
    """Chunks copied with no lease."""
    misses: int
    """Reads the index could not serve (not published: NVMe, compressed, unknown): leased."""
    conflicts: int
    """Reads that kept finding the chunk changed under the copy (or of the wrong size):
    leased after ``lease_free_attempts`` tries."""
    retries: int
    """Copies thrown away because the peer invalidated the slot meanwhile."""


def _populate(arena: ShmArena) -> None:
    """Map every page of an attached arena into this process (reads only: the peer's bytes
    are untouched). A read fault on a shared tmpfs mapping installs a writable entry, so puts
    profit too."""
    pages = np.frombuffer(arena.view(0, arena.size_bytes), dtype=np.uint8)[::_PAGE_BYTES]
    try:
        int(pages.max())
    finally:
        del pages


def _device_bytes(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous CUDA tensor (no copy)."""
    if not tensor.is_contiguous():
        raise InvalidArgument("a GPU buffer must be contiguous")
    torch = cuda.torch_module()
    return tensor.detach().reshape(-1).view(torch.uint8)


class ShmReadLease(ViewReadLease):
    """A read lease of :meth:`ShmClient.open_read`: the chunk's range of the mapped arena,
    pinned by the peer for this client's connection alone until :meth:`release` (which sends
    RELEASE without waiting) or until ``deadline_s`` (``time.monotonic()`` when the client
    asked, plus the TTL it asked for: never later than the peer's own deadline). Past the
    deadline the peer may have ended the lease and reused the memory, so ``view`` raises
    LeaseExpired. A memoryview (or numpy array) taken from ``view`` earlier cannot be revoked:
    read it before the deadline."""

    __slots__ = ("_chan", "_client", "_lease_id")

    def __init__(self, client: ShmClient, chan: LeaseChannel, key: ChunkKey, lease_id: int,
                 view: memoryview, deadline_s: float) -> None:
        super().__init__(key, view, deadline_s)
        self._client = client
        self._chan = chan
        self._lease_id = lease_id

    @property
    def lease_id(self) -> int:
        """The peer's id of this lease (only this client's connection can release it)."""
        return self._lease_id

    def release(self) -> None:
        """Unpin the chunk. Idempotent. Raises BufferError while an export of the view (a
        numpy array over it...) is still alive: the view must not outlive the lease."""
        view = self._view
        if view is None:
            return
        view.release()
        self._view = None
        try:
            self._chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=self._lease_id)
        finally:
            self._client._checkin(self._chan)


class ShmBatchRead:
    """Read leases on several parts of a batch of chunks, taken on one connection
    (:meth:`ShmClient.open_read_parts`): the ACQUIRE_READ of every part is sent at once and
    the peer serves them in order, so part ``k + 1`` is pinned while the caller copies part
    ``k`` (each part all or nothing, one lease each). :meth:`next_part` gives the next part's
    ``(arena offset, size)`` ranges, in the order of its keys, or raises that part's error
    (ChunkNotFound, ChunkCorrupt, CapacityError...: the later parts go on; a TransportError
    ends them all). :meth:`tensors` views ranges as torch tensors, so the caller copies each
    chunk straight out of the arena into its own buffers. Every lease lasts until
    :meth:`release` (one RELEASE each, not waited for; a part not read yet closes the
    connection instead, which ends its lease) or ``deadline_s`` (``time.monotonic()`` when
    the requests were sent, plus the TTL asked for), whichever comes first: past it the peer
    may have reused the memory, so a copy that *ended* after it may hold another chunk's
    bytes (:attr:`expired`, asked after the copy, says so). Views taken cannot be revoked:
    drop them before :meth:`release`. One thread at a time."""

    __slots__ = ("_chan", "_client", "_deadline_s", "_first", "_lease_ids", "_parts", "_read")

    def __init__(self, client: ShmClient, chan: LeaseChannel, parts: list[list[bytes]],
                 first: tuple[int, list[tuple[int, int]]] | KvtierError,
                 deadline_s: float) -> None:
        self._client = client
        self._chan: LeaseChannel | None = chan
        self._parts = parts
        self._first: tuple[int, list[tuple[int, int]]] | KvtierError | None = first
        self._read = 0
        self._lease_ids: list[int] = []
        self._deadline_s = deadline_s

    @property
    def parts(self) -> int:
        return len(self._parts)

    @property
    def deadline_s(self) -> float:
        return self._deadline_s

    @property
    def expired(self) -> bool:
        """Whether the deadline has passed (ask *after* the copies: see the class docstring)."""
        return time.monotonic() >= self._deadline_s

    def next_part(self) -> list[tuple[int, int]]:
        """The ranges of the next part's chunks (its lease is held until :meth:`release`), or
        its error. Raises InvalidArgument past the last part or once released."""
        chan = self._chan
        if chan is None or self._read >= len(self._parts):
            raise InvalidArgument("no part left in this batch read")
        keys = self._parts[self._read]
        self._read += 1
        if self._first is not None:
            reply, self._first = self._first, None
            if isinstance(reply, KvtierError):
                raise reply
        else:
            try:
                reply = chan.recv_reply()
            except TransportError:
                chan.broken = True  # out of step with the peer: closed at release
                raise
        lease_id, ranges = reply
        self._lease_ids.append(lease_id)
        if len(ranges) != len(keys):
            raise InvariantViolation(f"ACQUIRE_READ of {len(keys)} keys answered "
                                     f"{len(ranges)} ranges")
        return [(int(offset), int(size)) for offset, size in ranges]

    def tensors(self, ranges: Sequence[tuple[int, int]], dtype: Any,
                shape: tuple[int, ...]) -> list[Any]:
        """One torch tensor of ``dtype`` and ``shape`` per range (from :meth:`next_part`),
        viewing the arena (no copy; writable only because the mapping is: never write them).
        Raises SizeMismatch (no view made) when a range is not exactly that size."""
        return self._client._arena_tensors(ranges, dtype, shape)

    def release(self) -> None:
        """End every lease: RELEASE for each part read, and the connection closed when a
        part was not read (its reply, and so its lease id, never came). Idempotent. May raise
        PeerUnavailable (the leases ended with the connection anyway)."""
        chan, self._chan = self._chan, None
        if chan is None:
            return
        try:
            if self._read < len(self._parts):
                chan.broken = True
            else:
                for lease_id in self._lease_ids:
                    if lease_id:
                        chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        except BaseException:
            chan.broken = True
            raise
        finally:
            self._client._checkin(chan)


class ShmFreeRead:
    """Chunks the peer's read index publishes, viewed in the mapped arena with no lease and no
    round trip (:meth:`ShmClient.read_free`), for a caller that copies them into its own
    buffers itself. ``tensors`` are the views (read-only in spirit: never write them), of the
    leading keys asked for that were published when asked. Nothing keeps their bytes still:
    after its copy the caller asks :meth:`confirm` how many leading chunks stayed put during it
    (the read index's seqlock, :mod:`kvstore.dataplane.read_index`); only those copies are the
    chunks' bytes, the rest must be read again (a lease) or dropped. One thread at a time."""

    __slots__ = ("_client", "_keys", "_reader", "_slots", "tensors")

    def __init__(self, client: ShmClient, reader: ReadIndexReader, keys: Sequence[bytes],
                 slots: list[tuple[int, int]], tensors: list[Any]) -> None:
        self._client = client
        self._reader = reader
        self._keys = keys
        self._slots = slots
        self.tensors = tensors

    def confirm(self) -> int:
        """After the copy: how many leading chunks were the keys' own for all of it (their
        slots unchanged and the daemon alive). Those are reported as lease-free hits (the
        daemon's counters and recency, as for ``get_into``). Call once, after the copy."""
        reader = self._reader
        n = 0
        for slot, seq in self._slots:
            if not reader.unchanged(slot, seq):
                break
            n += 1
        client = self._client
        if not reader.alive():
            client._drop_dead_reader()
            return 0
        client._lf_hits += n
        client._lf_conflicts += int(n < len(self._slots))
        reporter = client._reporter
        if reporter is not None and n:
            queue = reporter.queue
            for key in self._keys[:n]:
                queue.append(key)
                if len(queue) == reporter.batch:
                    reporter.wake()
        return n


class ShmWriteLease:
    """A write lease of :meth:`ShmClient.open_write`: an invisible slot of the mapped arena.
    Exactly one of :meth:`commit` / :meth:`abort` ends it (a dead client's is aborted)."""

    __slots__ = ("_buffer", "_chan", "_client", "_key", "_lease_id", "_size_bytes")

    def __init__(self, client: ShmClient, chan: LeaseChannel, key: ChunkKey, lease_id: int,
                 buffer: memoryview) -> None:
        self._client = client
        self._chan = chan
        self._key = key
        self._lease_id = lease_id
        self._size_bytes = buffer.nbytes
        self._buffer: memoryview | None = buffer

    @property
    def key(self) -> ChunkKey:
        return self._key

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def buffer(self) -> memoryview:
        if self._buffer is None:
            raise InvalidArgument(f"write lease on {self._key.hex()} has ended")
        return self._buffer

    def commit(self) -> None:
        """Publish the chunk. Raises BufferError (the lease stays open) while an export of the
        buffer is alive, InvalidArgument once ended, and the peer's commit errors."""
        buffer = self._buffer
        if buffer is None:
            raise InvalidArgument(f"write lease on {self._key.hex()} has already ended")
        buffer.release()
        self._buffer = None
        try:
            self._chan.call(ChannelOp.COMMIT, arg=self._lease_id)
        finally:
            self._client._checkin(self._chan)

    def abort(self) -> None:
        """Free the slot. Idempotent; a no-op after commit."""
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        with contextlib.suppress(BufferError):  # failing anyway: the caller's export dangles
            buffer.release()
        try:
            with contextlib.suppress(KvtierError):  # the peer aborts it on disconnect anyway
                self._chan.call(ChannelOp.ABORT, arg=self._lease_id)
        finally:
            self._client._checkin(self._chan)


class ShmClient:
    """A client of one peer's shared-memory plane (module docstring). Build with
    :meth:`connect`."""

    def __init__(self, address: str, arena: ShmArena, config: ShmClientConfig,
                 fallback: Callable[[], BatchTransport] | None,
                 ticket: TicketSource | None = None) -> None:
        """Wrap an attached arena; use :meth:`connect`."""
        self._ticket = ticket
        self._address = address
        self._arena = arena
        self._config = config
        self._fallback = fallback
        self._lock = threading.Lock()
        self._idle: list[LeaseChannel] = []
        self._all: list[LeaseChannel] = []
        self._closed = False
        self._reader: ReadIndexReader | None = None
        self._reporter: ReadReporter | None = None
        self._lf_hits = self._lf_misses = self._lf_conflicts = 0
        self._typed: dict[Any, Any] = {}
        """dtype -> a torch tensor over the whole arena (:meth:`_arena_tensors`)."""
        self._geometries: dict[tuple[Any, tuple[int, ...]], tuple[int, int, int]] = {}
        """(dtype, shape) -> (element size, bytes, elements) (:meth:`_geometry`)."""

    @classmethod
    def connect(cls, address: str, arena_name: str, *, read_index: str = "",
                config: ShmClientConfig | None = None,
                fallback: Callable[[], BatchTransport] | None = None,
                ticket: TicketSource | None = None) -> Self:
        """Map the peer's arena ``arena_name`` and check that its lease channel at ``address``
        (``@name``) answers; with ``read_index`` (the peer's index segment) reads go lease-free
        where it publishes the chunk. ``fallback`` makes the transport that reads what the arena
        cannot take now (called once, when first needed). ``ticket``: the session tickets every
        lease channel connection presents to a peer that requires them
        (:mod:`.channel`, "Session tickets").

        Raises TierUnavailable (the arena cannot be mapped here), PeerUnavailable (the channel
        does not answer), InvalidArgument.
        """
        cfg = config or ShmClientConfig()
        try:
            # PinMode.AUTO registers the mapping with CUDA when a GPU exists, so copies
            # between the arena and engine HBM run as DMA.
            arena = ShmArena.attach(arena_name, access=ArenaAccess.READ_WRITE, pin=PinMode.AUTO)
        except KvtierError as exc:
            raise TierUnavailable(f"cannot map arena {arena_name}: {exc}") from exc
        try:
            if cfg.populate_arena:
                _populate(arena)
            client = cls(address, arena, cfg, fallback, ticket)
        except BaseException:
            arena.close()
            raise
        try:
            client._checkin(client._checkout())  # the lease channel must answer too
            if read_index and cfg.lease_free_reads:
                client._attach_read_index(read_index)
        except BaseException:
            client.close()
            raise
        return client

    def _attach_read_index(self, name: str) -> None:
        """Map the peer's read index for lease-free reads; when that fails every read takes a
        lease (logged once)."""
        cfg = self._config
        # A ticketed session copies only its tenants' chunks lease-free (read_index, "Owners").
        owners = None if self._ticket is None else self._ticket.current().read_owners
        try:
            reader = ReadIndexReader.attach(name, self._arena, attempts=cfg.lease_free_attempts,
                                            owners=owners)
        except KvtierError as exc:
            log.info("same-host reads take leases: %s", exc)
            return
        from kvstore.dataplane import native

        reader.use_extension(native.load_extension())  # None (not built, KVTIER_NATIVE=0): Python
        reporter = ReadReporter(self._address, interval_s=cfg.read_report_interval_s,
                                batch=cfg.read_report_batch, io_timeout_s=cfg.io_timeout_s,
                                ticket=self._ticket)
        try:
            reporter.start()
        except BaseException:
            reader.close()
            raise
        reader.report_reads_to(reporter.queue, reporter.batch, reporter.wake)
        self._reader, self._reporter = reader, reporter

    # --- identity ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The peer's lease channel (``@name``)."""
        return self._address

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(TransportKind.SHM, self._address, 0)

    @property
    def arena(self) -> ShmArena:
        """The peer's arena as mapped here (for tools; the peer owns its bytes)."""
        return self._arena

    @property
    def reader(self) -> ReadIndexReader | None:
        """The read index used for lease-free reads, or None (off, or the peer died)."""
        return self._reader

    # --- values -----------------------------------------------------------------------------

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` (exactly the chunk's size) with the chunk; return its size.

        Raises ChunkNotFound, SizeMismatch (nothing copied), PeerUnavailable, CapacityError /
        ChunkBusy (the arena cannot take it now, and there is no fallback).
        """
        # The hot path of a same-host get: when the native extension reads the index, a hit is
        # this frame and one C call (which also accounts the read), nothing else.
        reader = self._reader
        tried = False
        if reader is not None:
            fast = reader.fast_get  # the native read, with its accounting (read_index.py)
            if fast is not None:
                n = fast(key, dst)
                if n >= 0:
                    return n
                if n == ReadResult.DEAD:
                    self._drop_dead_reader()
                tried = n != NOT_TRIED
        k = check_key(key)
        if is_cuda_tensor(dst):
            return self._get_into_device(k, dst)
        out = host_byte_view(dst, writable=True)
        if not tried and self._reader is not None and self._read_lease_free(k, out) >= 0:
            return out.nbytes
        try:
            return self._get_leased(k, out)
        except _FALLBACK as exc:
            if self._fallback is None:
                raise
            log.debug("reading %s through the fallback: %s", k.hex(), exc)
        return self._fallback().get_into(k, out)

    def get(self, key: bytes) -> bytearray:
        """The whole chunk in a new buffer (one lease round trip). Raises ChunkNotFound."""
        k = check_key(key)
        ttl_s = self._config.lease_ttl_s
        try:
            chan, (lease_id, ranges) = self._first(
                lambda c: c.call(ChannelOp.ACQUIRE_READ, keys=[k], ttl_s=ttl_s))
        except _FALLBACK as exc:
            if self._fallback is None:
                raise
            log.debug("reading %s through the fallback: %s", k.hex(), exc)
            return self._fallback().get(k)
        try:
            offset, size = ranges[0]
            try:
                out = bytearray(size)
                copy_bytes(memoryview(out), self._arena.view(offset, size))
            finally:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        finally:
            self._checkin(chan)
        return out

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None) -> None:
        """Store ``src`` under ``key`` (a child of ``parent``), all or nothing.

        Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument (bad key, empty value,
        over ``max_value_bytes``, uncached parent), PeerUnavailable.
        """
        k = check_key(key)
        p = check_key(parent) if parent is not None else None
        if is_cuda_tensor(src):
            self._put_from_device(k, src, p)
            return
        self._put(k, host_byte_view(src), p)

    def _put(self, key: bytes, view: memoryview, parent: bytes | None) -> None:
        if view.nbytes == 0:
            raise InvalidArgument("cannot store an empty chunk")
        limit = self._config.max_value_bytes
        if limit and view.nbytes > limit:
            raise InvalidArgument(f"value of {view.nbytes} bytes exceeds max_value_bytes {limit}")
        keys = [key, parent or b""]
        if view.nbytes <= INLINE_PUT_MAX_BYTES:  # one round trip beats reserve + commit
            chan, _ = self._first(
                lambda c: c.call(ChannelOp.PUT, keys=keys, arg=view.nbytes, payload=view))
            self._checkin(chan)
            return
        ttl_s = self._config.lease_ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.RESERVE, keys=keys, arg=view.nbytes, ttl_s=ttl_s))
        try:
            offset = ranges[0][0]
            try:
                copy_bytes(self._arena.view(offset, view.nbytes, readonly=False), view)
            except BaseException:
                with contextlib.suppress(KvtierError):  # the peer aborts it on disconnect
                    chan.call(ChannelOp.ABORT, arg=lease_id)
                raise
            chan.call(ChannelOp.COMMIT, arg=lease_id)
        finally:
            self._checkin(chan)

    def size_of(self, key: bytes) -> int | None:
        k = check_key(key)
        chan, (_lease_id, ranges) = self._first(lambda c: c.call(ChannelOp.SIZE_OF, keys=[k]))
        self._checkin(chan)
        present, size = ranges[0]
        return size if present else None

    def exists(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    def remove(self, key: bytes) -> bool:
        """Drop a chunk (and what the peer keeps under it). False when it was not held; raises
        ChunkBusy while it is leased (this client's own releases are waited for first)."""
        k = check_key(key)
        self.sync()
        chan, (removed, _ranges) = self._first(lambda c: c.call(ChannelOp.REMOVE, keys=[k]))
        self._checkin(chan)
        return removed == 1

    # --- batches ----------------------------------------------------------------------------

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                 parents: Sequence[bytes | None] | None = None) -> list[bool]:
        """Store several chunks, ``keys[i]`` a child of ``parents[i]`` (None or no
        ``parents``: a root). ``True`` where stored, ``False`` where the key was already stored.

        A parent must be cached or be an earlier item of the batch (parent-first: a chain is
        ``parents = [p, keys[0], keys[1], ...]``); the daemon stores the items in order. An item
        refused for another reason (CapacityError, an uncached parent...) is not stored, nor
        is anything under it in the batch (its prefix is not cached); the other items are, and
        then the first refusal is raised. Values up to ``INLINE_PUT_MAX_BYTES`` travel in
        PUT_MANY requests; larger ones are reserved with RESERVE_MANY requests, copied straight
        from ``srcs`` into the arena and published with COMMIT_MANY, pipelined on one
        connection (the daemon reserves the next part while this client copies the previous
        one) and with one round trip's wait in all. The refusal raised carries every item's
        outcome as its ``batch_outcome`` (:class:`~kvstore.errors.KvtierError`)."""
        if len(keys) != len(srcs):
            raise InvalidArgument(f"{len(keys)} keys but {len(srcs)} values")
        if parents is not None and len(parents) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys but {len(parents)} parents")
        checked: list[bytes] = [check_key(k) for k in keys]
        pars: list[bytes | None] = [None] * len(checked) if parents is None else \
            [None if p is None else check_key(p) for p in parents]
        if any(is_cuda_tensor(s) for s in srcs):
            return put_each(checked, srcs, pars, self.put)
        views = [host_byte_view(s) for s in srcs]
        if any(v.nbytes == 0 for v in views):
            raise InvalidArgument("cannot store an empty chunk")
        limit = self._config.max_value_bytes
        if limit and any(v.nbytes > limit for v in views):
            raise InvalidArgument(f"a value exceeds max_value_bytes {limit}")
        return self._put_many(checked, pars, views)

    def _put_many(self, keys: list[bytes], parents: list[bytes | None],
                  views: list[memoryview]) -> list[bool]:
        """Runs of small values travel inside PUT_MANY requests (one round trip per ~1 MiB),
        runs of large ones are reserved, copied and committed (:meth:`_put_many_reserved`).
        Runs go in order on one connection, so a run's items may be children of an earlier
        run's. Each run fills its items' ``outcome`` (True stored, False already stored, None
        refused)."""
        outcome: list[bool | None] = [None] * len(keys)
        first: KvtierError | None = None
        chan = self._checkout()
        try:
            i = 0
            while i < len(keys):
                small = views[i].nbytes <= _BATCH_INLINE_MAX_BYTES
                j, body = i, 0
                while j < len(keys) and j - i < _BATCH_MAX_KEYS \
                        and (views[j].nbytes <= _BATCH_INLINE_MAX_BYTES) == small:
                    item = 10 + len(keys[j]) + len(parents[j] or b"") \
                        + (views[j].nbytes if small else 0)
                    if small and j > i and body + item > MAX_BODY_BYTES - REQUEST.size:
                        break
                    body += item
                    j += 1
                batch = self._put_many_inline if small else self._put_many_reserved
                run = (keys[i:j], parents[i:j], views[i:j], outcome, i)
                try:
                    failed = batch(chan, *run)
                except ChannelClosed:  # only before the first reply of a reused channel: resent
                    self._checkin(chan)
                    chan = self._fresh_after_closed()
                    failed = batch(chan, *run)
                first = first or failed
                i = j
        finally:
            self._checkin(chan)
        return settle_batch(outcome, first)

    def _put_many_inline(self, chan: LeaseChannel, keys: list[bytes],
                         parents: list[bytes | None], views: list[memoryview],
                         outcome: list[bool | None], at: int) -> KvtierError | None:
        sizes = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        tail = len(sizes) + sum(v.nbytes for v in views)
        chan.call(ChannelOp.PUT_MANY, flags=FLAG_PARENTS, keys=key_parent_pairs(keys, parents), arg=tail,
                  payloads=[memoryview(sizes), *views])
        detail = chan.detail
        for k in range(len(keys)):
            outcome[at + k] = _ITEM_OUTCOME.get(detail[k])
        return item_error(detail, len(keys))

    def _put_many_reserved(self, chan: LeaseChannel, keys: list[bytes],
                           parents: list[bytes | None], views: list[memoryview],
                           outcome: list[bool | None], at: int) -> KvtierError | None:
        """RESERVE_MANY for every part of ``_PIPELINE_ITEMS`` items, sent at once; then per
        part its reply, the copies into the reserved ranges and its COMMIT_MANY (not waited
        for); then the commits' replies. The daemon serves one connection's requests in order,
        so it reserves part k + 1 while this client copies part k, and commits a chain's
        parents before their children. A failure in between leaves the connection out of step:
        it is closed, which ends its open reservations (never visible)."""
        ttl_s = self._config.lease_ttl_s
        parts = _pipeline_parts(len(keys), max(v.nbytes for v in views))
        first: KvtierError | None = None
        committing: list[list[int]] = []
        try:
            for a, b in parts:
                sizes = struct.pack(f"<{b - a}Q", *(v.nbytes for v in views[a:b]))
                chan.send(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS,
                          keys=key_parent_pairs(keys[a:b], parents[a:b]), arg=len(sizes), ttl_s=ttl_s,
                          payload=memoryview(sizes))
            for a, b in parts:
                _lease_id, ranges = chan.recv_reply()
                reserved = chan.detail
                first = first or item_error(reserved, b - a)
                items: list[int] = []
                ids: list[int] = []
                for k, (offset, lease_id) in enumerate(ranges):
                    if reserved[k] == ITEM_EXISTS:
                        outcome[at + a + k] = False
                    elif lease_id:
                        view = views[a + k]
                        copy_bytes(self._arena.view(offset, view.nbytes, readonly=False), view)
                        items.append(a + k)
                        ids.append(lease_id)
                if ids:
                    packed = struct.pack(f"<{len(ids)}Q", *ids)
                    chan.send(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(packed),
                              payload=memoryview(packed))
                    committing.append(items)
            for items in committing:
                chan.recv_reply()
                detail = chan.detail
                for k, item in enumerate(items):
                    outcome[at + item] = True if detail[k] == ITEM_STORED else None
                first = first or item_error(detail, len(items))
        except BaseException:
            chan.broken = True  # requests may be outstanding: closed at checkin
            raise
        return first

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[int | None]:
        """Fill ``dsts[i]`` with chunk ``keys[i]``; None where it is not stored. Published
        chunks are read lease-free, the rest leased with one round trip when all are present
        (per key otherwise, reporting the misses)."""
        if len(keys) != len(dsts):
            raise InvalidArgument(f"{len(keys)} keys but {len(dsts)} destinations")
        checked: list[bytes] = [check_key(k) for k in keys]
        outs = [host_byte_view(d, writable=True) for d in dsts]
        if not checked:
            return []
        if self._reader is not None:
            got_free = [self._read_lease_free(k, out)
                        for k, out in zip(checked, outs, strict=True)]
            rest = [i for i, n in enumerate(got_free) if n < 0]
            if not rest:
                return [out.nbytes for out in outs]
            got_rest = self._get_many_leased([checked[i] for i in rest], [outs[i] for i in rest])
            result: list[int | None] = [n if n >= 0 else None for n in got_free]
            for i, n in zip(rest, got_rest, strict=True):
                result[i] = n
            return result
        return self._get_many_leased(checked, outs)

    def _get_many_leased(self, checked: list[bytes], outs: list[memoryview]
                         ) -> list[int | None]:
        try:
            return self._get_many_shm(checked, outs)
        except ChunkNotFound:
            pass  # some are missing: per key below, reporting the misses
        except _FALLBACK as exc:
            if self._fallback is None:
                raise
            log.debug("batch read through the fallback: %s", exc)
            return self._fallback().get_many_into(checked, outs)
        got: list[int | None] = []
        for key, out in zip(checked, outs, strict=True):
            try:
                got.append(self.get_into(key, out))
            except ChunkNotFound:
                got.append(None)
        return got

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int:
        """Copy the longest cached prefix of ``keys`` into ``dsts``; return how many loaded.

        Every ``dsts[i]`` must be exactly the size of chunk ``keys[i]`` (SizeMismatch
        otherwise, nothing copied). A miss is a short count, not an error. Published chunks are
        read lease-free; the rest of the prefix with one lease.
        """
        if len(keys) != len(dsts):
            raise InvalidArgument(f"{len(keys)} keys but {len(dsts)} destinations")
        if not keys:
            return 0
        checked: list[bytes] = [check_key(k) for k in keys]
        outs = [host_byte_view(d, writable=True) for d in dsts]
        done = 0
        while done < len(checked) and self._reader is not None \
                and self._read_lease_free(checked[done], outs[done]) >= 0:
            done += 1
        if done == len(checked):
            return done
        try:
            # The rest with one lease; a prefix of the remaining keys continues this one.
            return done + self._load_prefix_shm(checked[done:], outs[done:])
        except _FALLBACK as exc:
            if self._fallback is None:
                raise
            log.debug("prefix load through the fallback: %s", exc)
        # Keys past the first miss cannot be cached (a chunk is cached only under its parent),
        # so the prefix is the leading run of hits.
        loaded = done
        for size in self._fallback().get_many_into(checked[done:], outs[done:]):
            if size is None:
                break
            loaded += 1
        return loaded

    # --- leases lent to the caller ----------------------------------------------------------

    def open_read(self, key: bytes) -> ShmReadLease:
        """A read lease whose view is the chunk in the mapped arena (``MappedTransport``),
        with a deadline (:class:`ShmReadLease`; TTL ``lease_ttl_s``, or
        :data:`VIEW_LEASE_TTL_S`). Raises ChunkNotFound, CapacityError (the arena cannot hold
        it now: use ``get_into``), InvalidArgument (the peer's ``max_ttl_s`` is lower)."""
        k = check_key(key)
        ttl_s = self._config.lease_ttl_s or VIEW_LEASE_TTL_S
        # Taken before the request: the peer's deadline (its clock when it got the request,
        # plus the same TTL) can only be later.
        deadline_s = time.monotonic() + ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.ACQUIRE_READ, keys=[k], ttl_s=ttl_s))
        return ShmReadLease(self, chan, k, lease_id, self._arena.view(ranges[0][0], ranges[0][1]),
                            deadline_s)

    def open_read_parts(self, parts: Sequence[Sequence[bytes]]) -> ShmBatchRead:
        """Read leases on every part of ``parts`` (lists of keys), pipelined on one
        connection (:class:`ShmBatchRead`): every ACQUIRE_READ is sent now, the first reply is
        waited for. Each part is all or nothing (chunks in NVMe are promoted first); TTL
        ``lease_ttl_s``, or :data:`VIEW_LEASE_TTL_S`. Lease-free reads are not tried: the
        caller copies out of the arena itself, and only a lease keeps the bytes still during
        that copy (:meth:`read_free` is the lease-free way, checked after the copy). Raises
        InvalidArgument (no part, an empty part, a bad key),
        PeerUnavailable; a part's own refusals come from :meth:`ShmBatchRead.next_part`."""
        checked: list[list[bytes]] = [[check_key(k) for k in part] for part in parts]
        if not checked or not all(checked):
            raise InvalidArgument("open_read_parts needs parts of at least one key")
        ttl_s = self._config.lease_ttl_s or VIEW_LEASE_TTL_S

        def send_all(chan: LeaseChannel) -> tuple[int, list[tuple[int, int]]] | KvtierError:
            try:
                for part in checked:
                    chan.send(ChannelOp.ACQUIRE_READ, keys=part, ttl_s=ttl_s)
                return chan.recv_reply()
            except TransportError:
                chan.broken = True  # requests may be outstanding: closed at checkin
                raise
            except KvtierError as exc:  # the first part's refusal: the rest go on
                return exc

        deadline_s = time.monotonic() + ttl_s  # before the requests: the peer's is later
        # A reused connection the peer closed fails before the first reply, when the peer
        # read none of the requests: _first sends them all again on a fresh one.
        chan, first = self._first(send_all)
        return ShmBatchRead(self, chan, checked, first, deadline_s)

    def read_free(self, keys: Sequence[bytes], dtype: Any, shape: tuple[int, ...]
                  ) -> ShmFreeRead | None:
        """Views (``shape`` of ``dtype``) of the leading chunks of ``keys`` the peer's read
        index publishes now, with no lease and no round trip (:class:`ShmFreeRead`: copy them,
        then ``confirm()``). None without a read index (none published, lease-free reads off,
        a daemon gone) or when the first key is not published; a chunk of another size ends
        the run (the leased path says why). A tenant-scoped session (one with a ticket) sees
        only its tenants' chunks here (the reader's owners: another tenant's chunk ends the
        run, and the leased path refuses it). Raises InvalidArgument for a bad key."""
        reader = self._reader
        if reader is None or self._closed:
            return None
        checked = [check_key(k) for k in keys]
        _elem, want, _n = self._geometry(dtype, shape)
        slots: list[tuple[int, int]] = []
        ranges: list[tuple[int, int]] = []
        for key in checked:
            found = reader.locate(key)
            if found is None or found[3] != want:
                break
            slot, seq, offset, size = found
            slots.append((slot, seq))
            ranges.append((offset, size))
        if not slots:
            self._lf_misses += 1
            return None
        return ShmFreeRead(self, reader, checked[:len(slots)], slots,
                           self._arena_tensors(ranges, dtype, shape))

    def _geometry(self, dtype: Any, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """(element size, bytes, elements) of a chunk of ``shape`` and ``dtype``, cached."""
        geometry = self._geometries.get((dtype, shape))
        if geometry is None:
            elem = cuda.torch_module().empty(0, dtype=dtype).element_size()
            n = int(np.prod(shape))
            geometry = self._geometries.setdefault((dtype, shape), (elem, n * elem, n))
        return geometry

    def _arena_tensors(self, ranges: Sequence[tuple[int, int]], dtype: Any,
                       shape: tuple[int, ...]) -> list[Any]:
        """Torch views of arena ranges (see :meth:`ShmBatchRead.tensors`)."""
        torch = cuda.torch_module()
        elem, want, n = self._geometry(dtype, shape)
        for offset, size in ranges:
            if size != want:
                raise SizeMismatch(f"batch read of the chunk at arena offset {offset}",
                                   expected=size, actual=want)
        typed = self._typed.get(dtype)
        if typed is None:
            with self._lock:
                if self._closed:
                    raise PeerUnavailable("the client is closed")
                # One tensor over the whole arena per dtype, made once: a chunk's view is then
                # one slice and one view (two calls), not four. Made outside inference mode
                # whatever the caller's (vLLM loads inside it): every later view derives from
                # it, a save's reserved chunks too, and an inference tensor could not be
                # written outside inference mode.
                with torch.inference_mode(False):
                    whole = torch.from_numpy(self._arena.array(0, self._arena.size_bytes))
                    usable = self._arena.size_bytes // elem * elem
                    typed = self._typed.setdefault(dtype, whole[:usable].view(dtype))
        if any(offset % elem for offset, _size in ranges):  # not aligned: one view each
            array = self._arena.array
            return [torch.from_numpy(array(offset, size)).view(dtype).view(shape)
                    for offset, size in ranges]
        return [typed[offset // elem:offset // elem + n].view(shape) for offset, _ in ranges]

    def open_write(self, key: bytes, size_bytes: int, *, parent: bytes | None = None
                   ) -> ShmWriteLease:
        """An invisible slot of ``size_bytes`` in the mapped arena (``MappedTransport``).
        Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument."""
        k = check_key(key)
        p = check_key(parent) if parent is not None else b""
        limit = self._config.max_value_bytes
        if limit and size_bytes > limit:
            raise InvalidArgument(f"value of {size_bytes} bytes exceeds max_value_bytes {limit}")
        ttl_s = self._config.lease_ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.RESERVE, keys=[k, p], arg=size_bytes, ttl_s=ttl_s))
        return ShmWriteLease(self, chan, k, lease_id,
                             self._arena.view(ranges[0][0], size_bytes, readonly=False))

    # --- GPU buffers: straight between the device and the (pinned) arena -------------------

    def _get_into_device(self, key: bytes, dst: Any) -> int:
        torch = cuda.torch_module()
        flat = _device_bytes(dst)
        ttl_s = self._config.lease_ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.ACQUIRE_READ, keys=[key], ttl_s=ttl_s))
        try:
            offset, size = ranges[0]
            try:
                if size != flat.numel():
                    raise SizeMismatch(f"get_into {key.hex()}", expected=size,
                                       actual=flat.numel())
                host = torch.frombuffer(self._arena.view(offset, size, readonly=False),
                                        dtype=torch.uint8)
                flat.copy_(host)  # host-to-device; DMA when the arena is pinned
            finally:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        finally:
            self._checkin(chan)
        return int(size)

    def _put_from_device(self, key: bytes, src: Any, parent: bytes | None) -> None:
        torch = cuda.torch_module()
        flat = _device_bytes(src)
        size = int(flat.numel())
        if size == 0:
            raise InvalidArgument("cannot store an empty chunk")
        lease = self.open_write(key, size, parent=parent)
        try:
            slot = torch.frombuffer(lease.buffer, dtype=torch.uint8)
            try:
                slot.copy_(flat)  # device-to-host, straight into the reserved slot
            finally:
                del slot  # the tensor exports the lease's buffer until it is gone
        except BaseException:
            lease.abort()
            raise
        lease.commit()

    # --- the read index -------------------------------------------------------------------

    def _read_lease_free(self, key: bytes, out: memoryview) -> int:
        """One lease-free copy through the read index: the size, or a negative ReadResult (the
        caller then takes a lease). A DEAD index is dropped for good."""
        reader = self._reader
        if reader is None:
            return ReadResult.MISS.value
        n = reader.read_into(key, out)
        if n >= 0:
            self._lf_hits += 1
            reporter = self._reporter
            if reporter is not None:
                queue = reporter.queue
                queue.append(key)
                if len(queue) == reporter.batch:
                    reporter.wake()
            return n
        if n == ReadResult.MISS:
            self._lf_misses += 1
        elif n == ReadResult.CONFLICT:
            self._lf_conflicts += 1
        else:
            self._drop_dead_reader()
        return n

    def _drop_dead_reader(self) -> None:
        reader = self._reader
        if reader is not None:
            log.warning("the peer's read index is gone (the daemon died or stopped): "
                        "reads take leases from now on")
            self._reader = None
            hits, misses, conflicts = reader.native_counters()  # kept in the counters
            self._lf_hits += hits
            self._lf_misses += misses
            self._lf_conflicts += conflicts

    def lease_free_counters(self) -> LeaseFreeCounters:
        """What lease-free reads did so far (see :class:`LeaseFreeCounters`)."""
        reader = self._reader
        hits, misses, conflicts = (0, 0, 0) if reader is None else reader.native_counters()
        return LeaseFreeCounters(
            active=reader is not None and not self._closed, hits=self._lf_hits + hits,
            misses=self._lf_misses + misses, conflicts=self._lf_conflicts + conflicts,
            retries=0 if reader is None else reader.retries)

    def flush_reads(self) -> None:
        """Send the pending reports of lease-free reads and wait until the peer counted them
        (its hit counters and recency then include every read this client finished)."""
        if self._reporter is not None:
            self._reporter.flush(wait=True)

    # --- leased reads -----------------------------------------------------------------------

    def _get_leased(self, key: bytes, out: memoryview) -> int:
        ttl_s = self._config.lease_ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.ACQUIRE_READ, keys=[key], ttl_s=ttl_s))
        try:
            offset, size = ranges[0]
            try:
                if size != out.nbytes:
                    raise SizeMismatch(f"get_into {key.hex()}", expected=size, actual=out.nbytes)
                copy_bytes(out, self._arena.view(offset, size))
            finally:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        finally:
            self._checkin(chan)
        return size

    def _load_prefix_shm(self, keys: list[bytes], outs: list[memoryview]) -> int:
        ttl_s = self._config.lease_ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.ACQUIRE_READ, flags=FLAG_PREFIX, keys=keys, ttl_s=ttl_s))
        try:
            if not ranges:
                return 0
            try:
                for i, (_offset, size) in enumerate(ranges):
                    if size != outs[i].nbytes:
                        raise SizeMismatch(f"load_prefix block {i} ({keys[i].hex()})",
                                           expected=size, actual=outs[i].nbytes)
                for i, (offset, size) in enumerate(ranges):
                    copy_bytes(outs[i], self._arena.view(offset, size))
            finally:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        finally:
            self._checkin(chan)
        return len(ranges)

    def _get_many_shm(self, keys: list[bytes], outs: list[memoryview]) -> list[int | None]:
        ttl_s = self._config.lease_ttl_s
        chan, (lease_id, ranges) = self._first(
            lambda c: c.call(ChannelOp.ACQUIRE_READ, keys=keys, ttl_s=ttl_s))
        try:
            try:
                for i, (_offset, size) in enumerate(ranges):
                    if size != outs[i].nbytes:
                        raise SizeMismatch(f"get_many_into {keys[i].hex()}", expected=size,
                                           actual=outs[i].nbytes)
                for i, (offset, size) in enumerate(ranges):
                    copy_bytes(outs[i], self._arena.view(offset, size))
            finally:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        finally:
            self._checkin(chan)
        return [size for _offset, size in ranges]

    # --- the channel pool -------------------------------------------------------------------

    def _checkout(self) -> LeaseChannel:
        """A pooled channel (the most recently used: marked ``may_be_stale``) or a new one."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable("the client is closed")
            if self._idle:
                chan = self._idle.pop()
                chan.may_be_stale = True
                return chan
        return self._new_channel()

    def _new_channel(self) -> LeaseChannel:
        """A new channel connection, closed with this client (give it back with ``_checkin``)."""
        chan = LeaseChannel(self._address, io_timeout_s=self._config.io_timeout_s,
                            ticket=self._ticket)
        with self._lock:
            if self._closed:
                chan.close()
                raise PeerUnavailable("the client is closed")
            self._all.append(chan)
        return chan

    def open_writer(self) -> ShmWriter:
        """A connection for successive batches written in place (reserve, write, commit), whose
        reservations may be the parents of a later batch's (:mod:`.writes`); TTL
        ``lease_ttl_s``, or :data:`~.writes.WRITE_TTL_S`. Close it when done."""
        return ShmWriter(self, self._config.lease_ttl_s or WRITE_TTL_S)

    def _first(self, request: Callable[[LeaseChannel], _T]) -> tuple[LeaseChannel, _T]:
        """A checked-out channel and what ``request`` (the call's first request on it)
        returned; the caller checks the channel in. When ``request`` finds a reused channel
        closed by the peer (``ChannelClosed``: module docstring, "Idle connections"), it runs
        once more on a fresh one. On any failure the channel is checked in and the error
        raised."""
        chan = self._checkout()
        try:
            return chan, request(chan)
        except ChannelClosed:
            self._checkin(chan)  # broken: closed
        except BaseException:
            self._checkin(chan)
            raise
        chan = self._fresh_after_closed()
        try:
            return chan, request(chan)
        except BaseException:
            self._checkin(chan)
            raise

    def _fresh_after_closed(self) -> LeaseChannel:
        """After ``ChannelClosed``: the other idle channels idled as long (the most recently
        used one was taken), so they are dropped and a new one is checked out."""
        log.debug("a pooled lease channel connection to %s was closed by the peer; sending "
                  "again", self._address)
        with self._lock:
            idle, self._idle = self._idle, []
            for chan in idle:
                self._all.remove(chan)
        for chan in idle:
            chan.close()
        return self._checkout()

    def _checkin(self, chan: LeaseChannel) -> None:
        """Return a channel to the pool; a broken one (or any, once closed) is closed."""
        with self._lock:
            if not self._closed and not chan.broken:
                self._idle.append(chan)
                return
            if chan.broken and chan in self._all:
                self._all.remove(chan)
        chan.close()

    def sync(self) -> None:
        """Wait until the peer has processed every RELEASE this client sent (one PING per
        channel that has one outstanding). Reports of lease-free reads: :meth:`flush_reads`.
        A channel found closed by the peer has nothing left to wait for: its leases ended with
        the connection (an idle close comes after the peer read everything sent on it)."""
        with self._lock:
            pending = [c for c in self._idle if c.unacknowledged]
            for c in pending:
                self._idle.remove(c)
                c.may_be_stale = True
        try:
            for chan in pending:
                with contextlib.suppress(ChannelClosed):
                    chan.call(ChannelOp.PING)
        finally:
            for chan in pending:
                self._checkin(chan)

    # --- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close every connection and unmap the arena. Idempotent; later calls raise
        PeerUnavailable."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            chans, self._all, self._idle = self._all, [], []
            reader, self._reader = self._reader, None
            reporter, self._reporter = self._reporter, None
            self._typed = {}  # their exports of the mapping go before it is closed
        if reporter is not None:
            reporter.close()
        if reader is not None:
            reader.close()
        for chan in chans:
            chan.close()
        self._arena.close()

    def __enter__(self) -> ShmClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

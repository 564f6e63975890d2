"""The NVMe tier: chunks in preallocated segment files, checksummed, crash-safe.

``NvmeTier`` implements :class:`~kvstore.dataplane.tier.Tier` (see that module for
ownership, errors and threading). The on-disk format and the recovery scan are in
:mod:`kvstore.dataplane.segments`; decisions and measurements in ``docs/nvme-tier.md``.

Space
    ``capacity_bytes`` is the budget for the directory: the sum of the segment files'
    sizes. Segment files are created on demand, about ``segment_bytes`` each (a whole
    number of the records that triggered them, so uniform chunks leave no tail waste; the
    last one smaller to fit the budget), preallocated (:class:`Preallocation`), and never
    shrink. Inside each one the tiers' free-extent allocator
    (:class:`~kvstore.dataplane.allocator.ExtentAllocator`: best fit, coalescing) places each
    record; ``remove`` frees its extent at once. A chunk costs its size rounded up to
    4 KiB plus one 4 KiB header block.

Writes (``put``)
    Under the tier's *write lock* (puts write one at a time; reads and removes do not wait
    for it) an extent is allocated and written. A chunk up to ``io_block_bytes`` is hashed
    (xxh3_64, before taking the lock) and goes out in one ``pwritev``: header | payload |
    padding | FREE header for the rest of the free run (4 KiB-aligned caller memory is
    written in place, other memory is copied once into an aligned staging buffer). A
    larger chunk streams in pieces with one write in flight on the I/O thread while the
    caller hashes (and, if unaligned, stages) the next piece (aligned memory: one write of
    the whole payload while the caller hashes it); its header goes last. After
    the write lock is released, ``fdatasync``; the chunk becomes visible when that returns.
    Concurrent puts therefore overlap one write with other puts' flushes; the kernel
    merges concurrent flushes of one file (no explicit group commit).

Reads (``get_into``)
    The payload is read with ``os.preadv`` (the GIL is released): straight into the
    caller's buffer when it is 4 KiB-aligned, otherwise through reused aligned bounce
    buffers with one copy. Chunks larger than ``io_block_bytes`` are read in pieces on a
    small thread pool (``io_threads`` in flight) while the calling thread hashes the pieces
    already read. The payload's xxh3_64 must match **on every read** (the header block is
    not re-read: the 64-bit payload checksum already tells a wrong or stale extent);
    otherwise the chunk is dropped (a DEAD header is written so it stays dropped),
    counted, logged, ``dst`` is zeroed and ``ChunkCorrupt`` raised.

Removal
    ``remove`` overwrites the record's header with a DEAD header and ``fdatasync``-s
    before freeing the extent, so a removed chunk never comes back after a restart. A
    removal during a read of the same chunk frees the space when the read ends.

Recovery (:meth:`NvmeTier.open`)
    Each segment's header chain is scanned; LIVE records rebuild the index
    ``key -> (segment, offset, size, checksum)``. A torn or corrupt header is reported
    and skipped (resync to the next valid header), a record running past a truncated
    file is dropped, duplicates of one key keep the highest sequence number, and the
    ``open_verify_newest`` newest records (the only ones a crash can have left half
    written) have their payload checksum verified. Repaired gaps get a FREE header. The
    result is in :attr:`NvmeTier.recovery`.

Thread safety
    Every public method may be called from any thread. One lock guards the index and the
    allocators; no I/O happens under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import fcntl
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.dataplane.allocator import ExtentAllocator
from kvstore.dataplane.arena import copy_bytes, host_byte_view
from kvstore.dataplane.directio import (
    ALIGN_BYTES,
    AlignedBuffer,
    BufferPool,
    IoMode,
    align_down,
    align_up,
    is_aligned,
    open_flags,
    preadv_all,
    probe_io_mode,
    pwritev_all,
)
from kvstore.dataplane.segments import (
    HEADER_BYTES,
    RecordHeader,
    RecordKind,
    SegmentHeader,
    SegmentScan,
    decode_segment_header,
    record_extent_bytes,
    scan_segment,
)
from kvstore.dataplane.tier import (
    MAX_META_BYTES,
    ChunkInfo,
    ChunkKey,
    TierKind,
    TierStats,
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
    SizeMismatch,
    StorageError,
    TierUnavailable,
)

log = logging.getLogger(__name__)

MiB = 1 << 20
LOCK_FILE_NAME = "LOCK"
SEGMENT_NAME = "seg-{:06d}.kvt"
_SEGMENT_RE = re.compile(r"^seg-(\d{6,10})\.kvt$")
_TMP_SUFFIX = ".tmp"
_MIN_SEGMENT_BYTES = 3 * ALIGN_BYTES
"""A segment header, one record header and one payload block."""
_ZERO_PAD = bytes(ALIGN_BYTES)
_SCAN_THREADS = 8
"""Segments scanned in parallel at open."""


class Preallocation(enum.Enum):
    """How a new segment file's space is reserved."""

    ZERO_FILL = "zero-fill"
    """Write zeros over the whole file once (~0.1 s per 256 MiB here). Later puts overwrite
    written blocks, so their fdatasync flushes data only: measured ~2x faster durable puts
    than FALLOCATE on ext4. The default."""
    FALLOCATE = "fallocate"
    """``posix_fallocate``: instant, space reserved, but each first write of a block converts
    an unwritten extent (a journal commit inside the put's fdatasync)."""
    SPARSE = "sparse"
    """``ftruncate`` only: nothing reserved; a full filesystem surfaces as ``DiskFull`` from
    the put whose write hits it (still safe: that record is discarded)."""


class OpenVerify(enum.Enum):
    """Which payload checksums :meth:`NvmeTier.open` verifies (every read verifies anyway)."""

    NEWEST = "newest"
    """The ``open_verify_newest`` records with the highest sequence numbers: a crash can
    only have torn records still in flight, which are the newest."""
    ALL = "all"
    """Every record (reads the whole directory)."""
    NONE = "none"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    """Configuration of one NVMe tier. Validates itself (``ConfigError``)."""

    directory: Path
    capacity_bytes: int
    """Budget for the segment files in ``directory`` (rounded down to 4 KiB)."""
    segment_bytes: int = 256 * MiB
    io_mode: IoMode | None = None
    """None: O_DIRECT when the filesystem takes it (probed), else buffered. DIRECT: require it."""
    preallocation: Preallocation = Preallocation.ZERO_FILL
    io_block_bytes: int = 4 * MiB
    """Size of staging/bounce buffers and of the pieces large transfers are split into."""
    io_threads: int = 2
    """Reads of one large chunk keep this many pieces in flight."""
    open_verify: OpenVerify = OpenVerify.NEWEST
    open_verify_newest: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.directory, str):
            object.__setattr__(self, "directory", Path(self.directory))
        if not isinstance(self.directory, Path):
            raise ConfigError(f"directory must be a path, not {type(self.directory).__name__}")
        for name in ("capacity_bytes", "segment_bytes", "io_block_bytes", "io_threads",
                     "open_verify_newest"):
            if not _is_int(getattr(self, name)):
                raise ConfigError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.capacity_bytes < _MIN_SEGMENT_BYTES:
            raise ConfigError(f"capacity_bytes {self.capacity_bytes} is below the minimum "
                              f"{_MIN_SEGMENT_BYTES}")
        if self.segment_bytes < _MIN_SEGMENT_BYTES or self.segment_bytes % ALIGN_BYTES:
            raise ConfigError(f"segment_bytes {self.segment_bytes} must be a multiple of "
                              f"{ALIGN_BYTES} and at least {_MIN_SEGMENT_BYTES}")
        if self.io_block_bytes < ALIGN_BYTES or self.io_block_bytes % ALIGN_BYTES:
            raise ConfigError(f"io_block_bytes {self.io_block_bytes} must be a positive "
                              f"multiple of {ALIGN_BYTES}")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io_threads must be 1..64, got {self.io_threads}")
        if self.open_verify_newest < 0:
            raise ConfigError("open_verify_newest must be >= 0")
        if self.io_mode is not None and not isinstance(self.io_mode, IoMode):
            raise ConfigError(f"io_mode must be an IoMode or None, got {self.io_mode!r}")
        if not isinstance(self.preallocation, Preallocation):
            raise ConfigError(f"preallocation must be a Preallocation, got {self.preallocation!r}")
        if not isinstance(self.open_verify, OpenVerify):
            raise ConfigError(f"open_verify must be an OpenVerify, got {self.open_verify!r}")


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`NvmeTier.open` found and repaired."""

    segments: int
    chunks: int
    invalid_headers: int
    """Places where the header chain was broken (torn/corrupt header): resynced."""
    torn_records: int
    """Records running past the end of a truncated segment file: dropped."""
    corrupt_dropped: int
    """Records whose payload failed its checksum at open: dropped."""
    duplicates_dropped: int
    damaged_segment_headers: int
    repaired_gaps: int
    """Free runs that got a fresh FREE header (after a resync or a dropped record)."""
    verified_records: int
    elapsed_s: float


@dataclass(frozen=True, slots=True)
class NvmeTierStats:
    """NVMe-specific figures beside the generic :class:`TierStats`."""

    tier: TierStats
    io_mode: IoMode
    io_mode_reason: str
    segments: int
    segment_bytes_total: int
    corrupt_dropped: int
    """Chunks dropped by a failed checksum on read since open (recovery drops are separate)."""
    quarantined_bytes: int
    """Extents neither usable nor freeable after a failed write *and* failed clean-up."""


@dataclass(frozen=True, slots=True)
class RecordLocation:
    """Where a chunk lies on disk (for tooling and tests)."""

    path: Path
    header_offset: int
    payload_offset: int
    payload_bytes: int
    extent_bytes: int


class _Segment:
    __slots__ = ("fd", "id", "path", "size_bytes", "space")

    def __init__(self, seg_id: int, path: Path, fd: int, size_bytes: int,
                 space: ExtentAllocator) -> None:
        self.id = seg_id
        self.path = path
        self.fd = fd
        self.size_bytes = size_bytes
        self.space = space
        """Allocated and free extents of the file; the segment header is a claimed block."""


class _State(enum.Enum):
    WRITING = "writing"
    LIVE = "live"
    REMOVING = "removing"


class _Record:
    """One chunk in the index. Mutable only under the tier's lock."""

    __slots__ = ("checksum", "extent_bytes", "free_when_idle", "key", "meta", "offset",
                 "payload_bytes", "readers", "segment", "seq", "state")

    def __init__(self, key: ChunkKey, segment: _Segment | None, offset: int, payload_bytes: int,
                 checksum: int, seq: int, state: _State, meta: bytes = b"") -> None:
        self.key = key
        self.meta = meta
        self.segment = segment
        self.offset = offset
        self.payload_bytes = payload_bytes
        self.extent_bytes = record_extent_bytes(payload_bytes)
        self.checksum = checksum
        self.seq = seq
        self.state = state
        self.readers = 0
        """Reads in flight: the extent is not reused until they end."""
        self.free_when_idle = False


class NvmeTier:
    """Chunks persisted in segment files under one directory. Create with :meth:`open`."""

    def __init__(self, config: NvmeTierConfig, *, lock_fd: int, io_mode: IoMode,
                 io_mode_reason: str) -> None:
        """Internal: :meth:`open` locks the directory, picks the I/O mode and recovers.

        The constructor only sets fields (no I/O, no threads).
        """
        self._config = config
        self._dir = config.directory
        self._budget_bytes = align_down(config.capacity_bytes)
        self._lock_fd = lock_fd
        self._io_mode = io_mode
        self._io_mode_reason = io_mode_reason
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._write_lock = threading.Lock()
        self._index: dict[ChunkKey, _Record] = {}
        self._segments: list[_Segment] = []
        self._segment_bytes_total = 0
        self._next_segment_id = 1
        self._next_seq = 1
        self._active_ops = 0
        self._closed = False
        self._corrupt_dropped = 0
        self._live_chunks = 0
        self._quarantined_bytes = 0
        self._recovery: RecoveryReport | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._window = max(2, config.io_threads)
        self._blocks = BufferPool(config.io_block_bytes, max_cached=2 * (self._window + 1))
        self._small = BufferPool(2 * ALIGN_BYTES, max_cached=32)
        # Owned by the thread holding the write lock: header + tail + trailer blocks, and
        # two staging buffers for unaligned sources. Created on first use.
        self._wblocks: AlignedBuffer | None = None
        self._wstage: list[AlignedBuffer] = []
        self._zeros: AlignedBuffer | None = None

    # --- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, config: NvmeTierConfig) -> NvmeTier:
        """Open (creating it if needed) and lock ``config.directory``, then recover its chunks.

        Raises ``TierUnavailable`` when another tier holds the directory or O_DIRECT was
        required but is unsupported, ``ConfigError`` when the segments found exceed the
        capacity, ``StorageError``/``DiskFull`` when the directory cannot be used.
        """
        try:
            config.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create NVMe tier directory {config.directory}: "
                               f"{exc.strerror}") from exc
        lock_fd = _lock_directory(config.directory)
        tier: NvmeTier | None = None
        try:
            existing = [p for p in sorted(config.directory.glob("seg-*.kvt"))
                        if _SEGMENT_RE.match(p.name) and p.stat().st_size >= ALIGN_BYTES]
            try:
                probed, reason = probe_io_mode(config.directory,
                                               existing[0] if existing else None)
            except OSError as exc:
                raise _os_error(exc, f"probing O_DIRECT in {config.directory}") from exc
            if config.io_mode is IoMode.DIRECT and probed is not IoMode.DIRECT:
                raise TierUnavailable(f"O_DIRECT required but {config.directory} refuses it: "
                                      f"{reason}")
            if config.io_mode is IoMode.BUFFERED:
                probed, reason = IoMode.BUFFERED, "buffered I/O requested by configuration"
            tier = cls(config, lock_fd=lock_fd, io_mode=probed, io_mode_reason=reason)
            tier._recover()
        except BaseException:
            if tier is not None:
                tier.close()
            else:
                os.close(lock_fd)
            raise
        return tier

    # --- Tier protocol ----------------------------------------------------------------------

    @property
    def kind(self) -> TierKind:
        return TierKind.NVME

    @property
    def capacity_bytes(self) -> int:
        return self._budget_bytes

    @property
    def io_mode(self) -> IoMode:
        return self._io_mode

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def recovery(self) -> RecoveryReport:
        """What the last :meth:`open` found and repaired."""
        if self._recovery is None:
            raise TierUnavailable("tier was not opened through NvmeTier.open")
        return self._recovery

    def put(self, key: bytes, src: object) -> ChunkInfo:
        """Persist a copy of ``src`` (durable when this returns). See the module docstring.

        Raises ChunkExists, ChunkBusy (a put of the same key is in flight), CapacityError,
        DiskFull, StorageError, InvalidArgument, TierUnavailable.
        """
        return self.put_with_meta(key, src, b"")

    def put_with_meta(self, key: bytes, src: object, meta: bytes) -> ChunkInfo:
        """``put`` that also persists up to ``MAX_META_BYTES`` of caller metadata in the header.

        The metadata is written with the chunk (same header, same fdatasync) and comes back
        in ``ChunkInfo.meta`` from :meth:`chunks`, also after a restart.
        """
        if not isinstance(meta, bytes | bytearray) or len(meta) > MAX_META_BYTES:
            raise InvalidArgument(f"chunk metadata must be bytes of at most {MAX_META_BYTES}, "
                                  f"got {meta!r:.80}")
        chunk_key = check_key(key)
        view = host_byte_view(src)
        size = view.nbytes
        if size == 0:
            raise InvalidArgument("an empty chunk cannot be stored")
        extent = record_extent_bytes(size)
        with self._operation():
            with self._lock:
                held = self._index.get(chunk_key)
                if held is not None:
                    if held.state is _State.LIVE:
                        raise ChunkExists(f"chunk {chunk_key.hex()} is already stored")
                    raise ChunkBusy(f"chunk {chunk_key.hex()} is being {held.state.value}")
                if extent + HEADER_BYTES > self._budget_bytes:
                    raise CapacityError(f"a chunk of {size} bytes cannot fit in an NVMe tier "
                                        f"of {self._budget_bytes} bytes")
                rec = _Record(chunk_key, None, 0, size, 0, 0, _State.WRITING, bytes(meta))
                self._index[chunk_key] = rec
            try:
                if not self._pipelined(size):  # else hashed piece by piece while writing
                    rec.checksum = xxhash.xxh3_64_intdigest(view)
                self._place_and_write(rec, view)
                segment = rec.segment
                assert segment is not None
                try:
                    os.fdatasync(segment.fd)
                except OSError as exc:
                    self._discard(rec)
                    raise _os_error(exc, f"syncing chunk {chunk_key.hex()}") from exc
            except BaseException:
                with self._lock:
                    del self._index[chunk_key]
                raise
            with self._lock:
                rec.state = _State.LIVE
                self._live_chunks += 1
            return ChunkInfo(chunk_key, size, TierKind.NVME, rec.checksum, meta=rec.meta)

    def get_into(self, key: bytes, dst: object) -> int:
        """Read the chunk into ``dst`` (exactly its size), verifying its checksum; return the size.

        Raises ChunkNotFound, SizeMismatch, ChunkCorrupt (``dst`` is then zeroed),
        StorageError, TierUnavailable.
        """
        chunk_key = check_key(key)
        dst_view = host_byte_view(dst, writable=True)
        with self._operation():
            with self._lock:
                rec = self._index.get(chunk_key)
                if rec is None or rec.state is not _State.LIVE:
                    raise ChunkNotFound(chunk_key, "the NVMe tier")
                if dst_view.nbytes != rec.payload_bytes:
                    raise SizeMismatch(f"destination for chunk {chunk_key.hex()}",
                                       expected=rec.payload_bytes, actual=dst_view.nbytes)
                rec.readers += 1
            try:
                self._transfer_in(rec, dst_view)
            except ChunkCorrupt as exc:
                dst_view[:] = bytes(dst_view.nbytes)
                if not self._drop_corrupt(rec, str(exc)):
                    raise ChunkNotFound(chunk_key, "the NVMe tier (removed during the read)") \
                        from exc
                raise
            except OSError as exc:
                raise _os_error(exc, f"reading chunk {chunk_key.hex()}") from exc
            finally:
                with self._lock:
                    rec.readers -= 1
                    if rec.readers == 0 and rec.free_when_idle:
                        self._free_extent_locked(rec)
            return rec.payload_bytes

    def contains(self, key: bytes) -> bool:
        chunk_key = check_key(key)
        with self._lock:
            self._check_open()
            rec = self._index.get(chunk_key)
            return rec is not None and rec.state is _State.LIVE

    def size_of(self, key: bytes) -> int | None:
        chunk_key = check_key(key)
        with self._lock:
            self._check_open()
            rec = self._index.get(chunk_key)
            return rec.payload_bytes if rec is not None and rec.state is _State.LIVE else None

    def remove(self, key: bytes) -> bool:
        """Durably remove the chunk (DEAD header + fdatasync) and free its space.

        Returns False when the key is not stored. Raises ChunkBusy while the key is being
        written or removed by another call, StorageError when the DEAD header cannot be
        written (the chunk then stays stored).
        """
        chunk_key = check_key(key)
        with self._operation():
            with self._lock:
                rec = self._index.get(chunk_key)
                if rec is None:
                    return False
                if rec.state is not _State.LIVE:
                    raise ChunkBusy(f"chunk {chunk_key.hex()} is being {rec.state.value}")
                rec.state = _State.REMOVING
                self._live_chunks -= 1
                seq = self._take_seq_locked()
            try:
                self._write_dead(rec, seq)
            except OSError as exc:
                with self._lock:
                    rec.state = _State.LIVE
                    self._live_chunks += 1
                raise _os_error(exc, f"removing chunk {chunk_key.hex()}") from exc
            with self._lock:
                del self._index[chunk_key]
                self._release_extent_locked(rec)
            return True

    def chunks(self) -> Iterator[ChunkInfo]:
        """A snapshot of every stored chunk (with its xxh3_64)."""
        with self._lock:
            self._check_open()
            infos = [ChunkInfo(rec.key, rec.payload_bytes, TierKind.NVME, rec.checksum,
                               meta=rec.meta)
                     for rec in self._index.values() if rec.state is _State.LIVE]
        return iter(infos)

    def stats(self) -> TierStats:
        with self._lock:
            self._check_open()
            return self._stats_locked()

    def nvme_stats(self) -> NvmeTierStats:
        with self._lock:
            self._check_open()
            return NvmeTierStats(self._stats_locked(), self._io_mode, self._io_mode_reason,
                                 len(self._segments), self._segment_bytes_total,
                                 self._corrupt_dropped, self._quarantined_bytes)

    def record_location(self, key: bytes) -> RecordLocation | None:
        """Where the chunk's record lies on disk (None when not stored). For tooling and tests."""
        chunk_key = check_key(key)
        with self._lock:
            self._check_open()
            rec = self._index.get(chunk_key)
            if rec is None or rec.state is not _State.LIVE or rec.segment is None:
                return None
            return RecordLocation(rec.segment.path, rec.offset, rec.offset + HEADER_BYTES,
                                  rec.payload_bytes, rec.extent_bytes)

    def close(self) -> None:
        """Wait for calls in flight, then close files, threads and buffers and unlock the directory.

        Idempotent. Everything stored stays on disk; later calls raise TierUnavailable.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._active_ops:
                self._idle.wait()
            segments, self._segments = self._segments, []
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for seg in segments:
            os.close(seg.fd)
        for buf in [self._wblocks, self._zeros, *self._wstage]:
            if buf is not None:
                buf.close()
        self._wblocks, self._zeros, self._wstage = None, None, []
        self._blocks.close()
        self._small.close()
        os.close(self._lock_fd)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NvmeTier({str(self._dir)!r}, capacity_bytes={self._budget_bytes}, "
                f"io_mode={self._io_mode.value})")

    # --- bookkeeping ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        with self._lock:
            self._check_open()
            self._active_ops += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_ops -= 1
                if self._active_ops == 0:
                    self._idle.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable(f"NVMe tier at {self._dir} is closed")

    def _take_seq_locked(self, count: int = 1) -> int:
        seq = self._next_seq
        self._next_seq += count
        return seq

    def _stats_locked(self) -> TierStats:
        unallocated = self._budget_bytes - self._segment_bytes_total
        free = unallocated + sum(seg.space.free_bytes for seg in self._segments)
        largest_extent = max((seg.space.largest_free_bytes for seg in self._segments), default=0)
        largest = max(largest_extent - HEADER_BYTES, unallocated - 2 * HEADER_BYTES, 0)
        return TierStats(TierKind.NVME, self._budget_bytes, self._budget_bytes - free,
                         self._live_chunks, largest)

    def _release_extent_locked(self, rec: _Record) -> None:
        """The record left the index: free its extent now, or when its last read ends."""
        if rec.readers:
            rec.free_when_idle = True
        else:
            self._free_extent_locked(rec)

    def _free_extent_locked(self, rec: _Record) -> None:
        rec.free_when_idle = False
        segment = rec.segment
        if segment is not None and segment in self._segments:
            segment.space.free(rec.offset)
            rec.segment = None

    def _pool_get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self._config.io_threads,
                                                thread_name_prefix="kvtier-nvme-io")
            return self._pool

    # --- writing ----------------------------------------------------------------------------

    def _place_and_write(self, rec: _Record, view: memoryview) -> None:
        """Allocate ``rec``'s extent and write header, payload and the FREE trailer.

        On failure the extent is given back (with a FREE header over it) and ``OSError`` /
        ``CapacityError`` / ``DiskFull`` propagate.
        """
        with self._write_lock:
            segment, offset, run_bytes = self._allocate(rec.extent_bytes)
            with self._lock:
                seq = self._take_seq_locked(2)
            rec.segment, rec.offset, rec.seq = segment, offset, seq
            header = RecordHeader(RecordKind.LIVE, segment.id, offset, rec.extent_bytes, seq,
                                  rec.payload_bytes, rec.checksum, rec.key, rec.meta)
            trailer = None
            if run_bytes > rec.extent_bytes:
                trailer = RecordHeader(RecordKind.FREE, segment.id, offset + rec.extent_bytes,
                                       run_bytes - rec.extent_bytes, seq + 1)
            try:
                rec.checksum = self._write_record(segment.fd, header, view, trailer)
            except OSError as exc:
                self._give_back_after_failed_write(rec)
                raise _os_error(exc, f"writing chunk {rec.key.hex()}") from exc
            except BaseException:
                self._give_back_after_failed_write(rec)
                raise

    def _allocate(self, extent_bytes: int) -> tuple[_Segment, int, int]:
        """Best fit in the existing segments, else a new segment. Caller holds the write lock."""
        with self._lock:
            self._check_open()
            for segment in self._segments:
                if segment.space.largest_free_bytes >= extent_bytes:
                    offset, run_bytes = segment.space.allocate_run(extent_bytes)
                    return segment, offset, run_bytes
            unallocated = self._budget_bytes - self._segment_bytes_total
            if extent_bytes + HEADER_BYTES > unallocated:
                stats = self._stats_locked()
                raise CapacityError(
                    f"no room for a {extent_bytes}-byte record in the NVMe tier: "
                    f"{stats.free_bytes} bytes free, largest chunk that fits "
                    f"{stats.largest_free_bytes}")
            size = min(self._new_segment_bytes(extent_bytes), unallocated)
            seg_id = self._next_segment_id
            self._next_segment_id += 1
            seq = self._take_seq_locked()
            self._segment_bytes_total += size  # reserved while the file is made
        try:
            segment = self._create_segment(seg_id, size, seq)
        except BaseException:
            with self._lock:
                self._segment_bytes_total -= size
            raise
        with self._lock:
            self._segments.append(segment)
            offset, run_bytes = segment.space.allocate_run(extent_bytes)
            return segment, offset, run_bytes

    def _new_segment_bytes(self, extent_bytes: int) -> int:
        """Size of a segment created for a record of ``extent_bytes``.

        A whole number of such records (the one nearest ``segment_bytes``, at least one)
        plus the segment header: with uniform chunk sizes, the usual KV-cache case, no
        segment ends in a run too short for another chunk (256 MiB segments of 64 MiB chunks
        would otherwise waste a quarter of the disk).
        """
        records = max(1, round((self._config.segment_bytes - HEADER_BYTES) / extent_bytes))
        return HEADER_BYTES + records * extent_bytes

    def _pipelined(self, size_bytes: int) -> bool:
        """Whether a put of this size streams in pieces (hash and copy overlap the writes)."""
        return self._io_mode is IoMode.DIRECT and size_bytes > self._config.io_block_bytes

    def _write_record(self, fd: int, header: RecordHeader, view: memoryview,
                      trailer: RecordHeader | None) -> int:
        """Write header | payload | padding | FREE trailer; return the payload's xxh3_64.

        Small chunks (and buffered mode) go out in one ``pwritev`` whose header carries
        ``header.payload_xxh3`` (computed by the caller). Larger ones stream in pieces, see
        :meth:`_write_pipelined`.
        """
        if self._wblocks is None:
            self._wblocks = AlignedBuffer(3 * ALIGN_BYTES)
        blocks = self._wblocks.view
        head = blocks[:ALIGN_BYTES]
        tail_iov: list[memoryview] = []
        if trailer is not None:
            trailer.encode_into(blocks[2 * ALIGN_BYTES:])
            tail_iov.append(blocks[2 * ALIGN_BYTES:])
        if self._pipelined(view.nbytes):
            return self._write_pipelined(fd, header, view, blocks, tail_iov)
        header.encode_into(head)
        size = view.nbytes
        offset = header.offset
        if self._io_mode is IoMode.BUFFERED:
            pad = align_up(size) - size
            pwritev_all(fd, [head, view, *([memoryview(_ZERO_PAD)[:pad]] if pad else []),
                             *tail_iov], offset)
            return header.payload_xxh3
        bulk = align_down(size)
        rem = size - bulk
        if bulk and not is_aligned(view):  # stage through an aligned buffer (one copy)
            if not self._wstage:
                self._wstage.append(AlignedBuffer(self._config.io_block_bytes))
            stage = self._wstage[0].view
            padded = align_up(size)
            copy_bytes(stage[:size], view)
            stage[size:padded] = _ZERO_PAD[:padded - size]
            pwritev_all(fd, [head, stage[:padded], *tail_iov], offset)
            return header.payload_xxh3
        iov = [head]
        if bulk:
            iov.append(view[:bulk])
        if rem:
            tail = blocks[ALIGN_BYTES:2 * ALIGN_BYTES]
            tail[:rem] = view[bulk:]
            tail[rem:] = _ZERO_PAD[rem:]
            iov.append(tail)
        pwritev_all(fd, [*iov, *tail_iov], offset)
        return header.payload_xxh3

    def _write_pipelined(self, fd: int, header: RecordHeader, view: memoryview,
                         blocks: memoryview, tail_iov: list[memoryview]) -> int:
        """Write a large payload with its hash (and copy) overlapped, then its header.

        Aligned memory: one ``pwritev`` of the whole payload on the I/O thread while this
        thread hashes it. Unaligned memory: :meth:`_write_staged_pieces`. The header, which
        needs the finished checksum, is written last: a crash before it leaves the old
        FREE/DEAD header in place, so a half-written record never looks like one.
        """
        size = view.nbytes
        bulk = align_down(size)
        pool = self._pool_get()
        if is_aligned(view):
            # One pwritev of the whole payload (the device sees the deepest queue) on the I/O
            # thread while this thread hashes the same memory.
            iov = [view[:bulk]]
            if size > bulk:
                tail = blocks[ALIGN_BYTES:2 * ALIGN_BYTES]
                tail[:size - bulk] = view[bulk:]
                tail[size - bulk:] = _ZERO_PAD[size - bulk:]
                iov.append(tail)
            written = pool.submit(pwritev_all, fd, [*iov, *tail_iov],
                                  header.offset + HEADER_BYTES)
            try:
                digest = xxhash.xxh3_64_intdigest(view)
            finally:
                wait_futures([written])
            written.result()
        else:
            digest = self._write_staged_pieces(fd, header.offset, view, tail_iov)
        head = blocks[:ALIGN_BYTES]
        dataclasses.replace(header, payload_xxh3=digest).encode_into(head)
        pwritev_all(fd, [head], header.offset)
        return digest

    def _write_staged_pieces(self, fd: int, offset: int, view: memoryview,
                             tail_iov: list[memoryview]) -> int:
        """Copy unaligned memory through aligned staging buffers: up to ``window`` pieces are
        written on the I/O threads while the next one is copied and hashed here (one 4 MiB
        write at a time reaches ~70% of the device here, two ~100%). Returns the xxh3_64."""
        piece_bytes = self._config.io_block_bytes
        depth = self._window
        while len(self._wstage) < depth + 1:
            self._wstage.append(AlignedBuffer(piece_bytes))
        size = view.nbytes
        starts = range(0, size, piece_bytes)
        hasher = xxhash.xxh3_64()
        pool = self._pool_get()
        inflight: deque[Future[int]] = deque()
        try:
            for k, start in enumerate(starts):
                end = min(start + piece_bytes, size)
                n = end - start
                padded = align_up(n)
                if len(inflight) == depth:
                    inflight.popleft().result()  # frees the buffer piece k reuses
                stage = self._wstage[k % (depth + 1)].view
                copy_bytes(stage[:n], view[start:end])
                stage[n:padded] = _ZERO_PAD[:padded - n]
                iov = [stage[:padded]]
                hasher.update(stage[:n])
                if k == len(starts) - 1:
                    iov.extend(tail_iov)
                inflight.append(pool.submit(pwritev_all, fd, iov, offset + HEADER_BYTES + start))
            while inflight:
                inflight.popleft().result()
        finally:
            if inflight:  # an error: let writes out of our buffers finish before reuse
                wait_futures(list(inflight))
        return hasher.intdigest()

    def _give_back_after_failed_write(self, rec: _Record) -> None:
        """Free the extent of a failed write behind a FREE header (caller holds the write lock).

        The FREE header makes sure a half-written LIVE header cannot resurface at the next
        open. If even that write fails, the extent stays allocated (quarantined) until the
        tier is reopened, and the recovery scan sorts it out.
        """
        segment = rec.segment
        assert segment is not None
        with self._lock:
            start, run = segment.space.free_run(rec.offset)
            seq = self._take_seq_locked()
        free_len = start + run - rec.offset
        try:
            self._write_header(segment.fd, RecordHeader(RecordKind.FREE, segment.id, rec.offset,
                                                        free_len, seq))
        except OSError as exc:
            with self._lock:
                # Take exactly this extent back out of the free space.
                segment.space.claim(rec.offset, rec.extent_bytes)
                self._quarantined_bytes += rec.extent_bytes
            log.error("NVMe tier %s: could not clear the failed record at %s+%d (%s); its "
                      "%d bytes are quarantined until the tier is reopened", self._dir,
                      segment.path.name, rec.offset, exc, rec.extent_bytes)
        rec.segment = None

    def _discard(self, rec: _Record) -> None:
        """A put wrote its record but could not make it durable: clear and free it."""
        with self._write_lock:
            self._give_back_after_failed_write(rec)

    def _write_header(self, fd: int, header: RecordHeader) -> None:
        """Write one header block in place and fdatasync."""
        buf = self._small.acquire()
        try:
            block = buf.view[:ALIGN_BYTES]
            header.encode_into(block)
            pwritev_all(fd, [block], header.offset)
            os.fdatasync(fd)
        finally:
            del block
            self._small.release(buf)

    def _write_dead(self, rec: _Record, seq: int) -> None:
        segment = rec.segment
        assert segment is not None
        self._write_header(segment.fd, RecordHeader(RecordKind.DEAD, segment.id, rec.offset,
                                                    rec.extent_bytes, seq, key=rec.key))

    def _drop_corrupt(self, rec: _Record, reason: str) -> bool:
        """Drop a chunk that failed verification; False when it was removed meanwhile."""
        with self._lock:
            if self._index.get(rec.key) is not rec or rec.state is not _State.LIVE:
                return False
            rec.state = _State.REMOVING
            self._live_chunks -= 1
            seq = self._take_seq_locked()
            self._corrupt_dropped += 1
        log.error("NVMe tier %s: dropping corrupt chunk %s: %s", self._dir, rec.key.hex(), reason)
        try:
            self._write_dead(rec, seq)
            cleared = True
        except OSError as exc:
            cleared = False
            log.error("NVMe tier %s: could not mark corrupt chunk %s dead (%s); its extent is "
                      "quarantined until the tier is reopened", self._dir, rec.key.hex(), exc)
        with self._lock:
            del self._index[rec.key]
            if cleared:
                self._release_extent_locked(rec)
            else:
                self._quarantined_bytes += rec.extent_bytes
        return True

    # --- segment files ----------------------------------------------------------------------

    def _create_segment(self, seg_id: int, size_bytes: int, seq: int) -> _Segment:
        """Make, preallocate and publish one segment file (tmp name, fsync, rename, fsync dir)."""
        final = self._dir / SEGMENT_NAME.format(seg_id)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | open_flags(self._io_mode), 0o644)
        except OSError as exc:
            raise _os_error(exc, f"creating segment {tmp.name}") from exc
        try:
            self._preallocate(fd, 0, size_bytes)
            buf = self._small.acquire()
            try:
                SegmentHeader(seg_id, size_bytes).encode_into(buf.view[:ALIGN_BYTES])
                RecordHeader(RecordKind.FREE, seg_id, HEADER_BYTES, size_bytes - HEADER_BYTES,
                             seq).encode_into(buf.view[ALIGN_BYTES:])
                pwritev_all(fd, [buf.view], 0)
            finally:
                self._small.release(buf)
            os.fsync(fd)
            os.rename(tmp, final)
            _fsync_directory(self._dir)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise _os_error(exc, f"creating segment {final.name} of {size_bytes} bytes") from exc
        log.info("NVMe tier %s: created segment %s (%d bytes, %s)", self._dir, final.name,
                 size_bytes, self._config.preallocation.value)
        return _Segment(seg_id, final, fd, size_bytes, _segment_space(size_bytes))

    def _preallocate(self, fd: int, start: int, end: int) -> None:
        """Reserve ``[start, end)`` of a segment file per the configured Preallocation."""
        mode = self._config.preallocation
        if mode is Preallocation.SPARSE:
            os.ftruncate(fd, end)
        elif mode is Preallocation.FALLOCATE:
            os.posix_fallocate(fd, start, end - start)
        else:
            if self._zeros is None:
                self._zeros = AlignedBuffer(self._config.io_block_bytes)
            zeros = self._zeros.view
            pos = start
            while pos < end:
                n = min(zeros.nbytes, end - pos)
                pwritev_all(fd, [zeros[:n]], pos)
                pos += n

    # --- reading ----------------------------------------------------------------------------

    def _transfer_in(self, rec: _Record, dst: memoryview | None) -> None:
        """Read ``rec``'s payload, copy it into ``dst`` unless None, and verify its xxh3_64.

        Only the payload is read: its 64-bit checksum already proves the bytes are this
        chunk's (a stale or misplaced extent fails it), so re-reading the header block would
        cost a 4 KiB transfer per get for nothing. Raises ChunkCorrupt (short file, checksum
        mismatch) or OSError.
        """
        segment = rec.segment
        if segment is None:
            raise ChunkCorrupt(f"chunk {rec.key.hex()} has no extent")
        fd, size = segment.fd, rec.payload_bytes
        if dst is not None and self._io_mode is IoMode.BUFFERED:
            if preadv_all(fd, [dst], rec.offset + HEADER_BYTES) != size:
                raise ChunkCorrupt(f"chunk {rec.key.hex()}: file ends inside the record")
            digest = xxhash.xxh3_64_intdigest(dst)
        elif dst is not None and is_aligned(dst):
            digest = self._read_direct(rec, fd, dst)
        else:
            digest = self._read_bounced(rec, fd, dst)
        if digest != rec.checksum:
            raise ChunkCorrupt(f"chunk {rec.key.hex()} at {segment.path.name}+{rec.offset}: "
                               f"payload xxh3 {digest:016x} != stored {rec.checksum:016x}")

    def _pieces(self, size: int, *, quarters: bool = False) -> list[tuple[int, int]]:
        """Split the padded payload ``[0, align_up(size))`` into io_block pieces.

        ``quarters``: pieces of at least a quarter of the chunk (reads straight into the
        caller's memory: big requests keep the device queue deep, and only the last
        quarter's hash is not overlapped with a read).
        """
        padded = align_up(size)
        step = self._config.io_block_bytes
        if quarters:
            step = max(step, align_up(-(-padded // 4)))
        return [(s, min(s + step, padded)) for s in range(0, padded, step)]

    def _read_direct(self, rec: _Record, fd: int, dst: memoryview) -> int:
        """O_DIRECT into 4 KiB-aligned ``dst``; the last partial block through a bounce block."""
        size = rec.payload_bytes
        bulk = align_down(size)
        rem = size - bulk
        pieces = self._pieces(size, quarters=True)
        hasher = xxhash.xxh3_64()
        payload_at = rec.offset + HEADER_BYTES
        small = self._small.acquire() if rem else None
        tail = small.view[:ALIGN_BYTES] if small is not None else None

        def iov_of(k: int) -> tuple[list[memoryview], int]:
            s, e = pieces[k]
            iov = [dst[s:min(e, bulk)]] if min(e, bulk) > s else []
            if e > bulk and tail is not None:
                iov.append(tail)
            return iov, payload_at + s

        def after(k: int, got: int, want: int) -> None:
            if got != want:
                raise ChunkCorrupt(f"chunk {rec.key.hex()}: file ends inside the record")
            s, e = pieces[k]
            if e > bulk and tail is not None:
                dst[bulk:size] = tail[:rem]
            hasher.update(dst[s:min(e, size)])

        try:
            self._run_pieces(fd, len(pieces), iov_of, after)
        finally:
            if small is not None:
                del tail
                self._small.release(small)
        return hasher.intdigest()

    def _read_bounced(self, rec: _Record, fd: int, dst: memoryview | None) -> int:
        """Read through aligned bounce buffers, copying into ``dst`` (if any) and hashing."""
        size = rec.payload_bytes
        pieces = self._pieces(size)
        window = 1 if len(pieces) == 1 else self._window
        nbuf = 1 if window == 1 else window + 1  # window reads in flight + the one being copied
        bounces = [self._blocks.acquire() for _ in range(nbuf)]
        hasher = xxhash.xxh3_64()
        payload_at = rec.offset + HEADER_BYTES
        try:
            def iov_of(k: int) -> tuple[list[memoryview], int]:
                s, e = pieces[k]
                return [bounces[k % nbuf].view[:e - s]], payload_at + s

            def after(k: int, got: int, want: int) -> None:
                if got != want:
                    raise ChunkCorrupt(f"chunk {rec.key.hex()}: file ends inside the record")
                s, e = pieces[k]
                data = bounces[k % nbuf].view[:min(e, size) - s]
                if dst is not None:
                    copy_bytes(dst[s:s + data.nbytes], data)
                hasher.update(data)

            self._run_pieces(fd, len(pieces), iov_of, after, window=window)
        finally:
            for buf in bounces:
                self._blocks.release(buf)
        return hasher.intdigest()

    def _run_pieces(self, fd: int, count: int,
                    iov_of: Callable[[int], tuple[list[memoryview], int]],
                    after: Callable[[int, int, int], None], window: int | None = None) -> None:
        """Read ``count`` pieces with ``window`` in flight; run ``after`` on each in order.

        ``after(k, got, want)`` runs in the calling thread while pieces k+1..k+window are
        read (piece k+window is submitted before ``after(k)``, so ``iov_of`` must give it a
        buffer other than piece k's). A single piece is read inline, with no thread.
        """
        if count == 1:
            iov, at = iov_of(0)
            after(0, preadv_all(fd, iov, at), sum(v.nbytes for v in iov))
            return
        depth = window or self._window
        pool = self._pool_get()
        inflight: deque[tuple[Future[int], int]] = deque()
        try:
            for k in range(min(depth, count)):
                iov, at = iov_of(k)
                inflight.append((pool.submit(preadv_all, fd, iov, at), sum(v.nbytes for v in iov)))
            for k in range(count):
                fut, want = inflight.popleft()
                got = fut.result()
                nxt = k + depth
                if nxt < count:
                    iov, at = iov_of(nxt)
                    inflight.append((pool.submit(preadv_all, fd, iov, at),
                                     sum(v.nbytes for v in iov)))
                after(k, got, want)
        finally:
            if inflight:  # an error: let reads into our buffers finish before they are reused
                wait_futures([f for f, _ in inflight])

    # --- recovery ---------------------------------------------------------------------------

    def _recover(self) -> None:
        """Scan the directory and rebuild the index (called once, by :meth:`open`)."""
        started = time.monotonic()
        for leftover in self._dir.glob("seg-*" + _TMP_SUFFIX):
            log.warning("NVMe tier %s: removing unfinished segment file %s", self._dir,
                        leftover.name)
            leftover.unlink(missing_ok=True)
        found: list[tuple[int, Path]] = []
        for path in self._dir.iterdir():
            match = _SEGMENT_RE.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        found.sort()
        scans: list[tuple[_Segment, SegmentScan, bool]] = []
        damaged = 0
        # Segments are scanned in parallel: a scan is a chain of dependent 4 KiB reads, so
        # it is bound by latency, and several chains keep the device queue busy.
        error: BaseException | None = None
        workers = min(_SCAN_THREADS, max(1, len(found)))
        with ThreadPoolExecutor(max_workers=workers,
                                thread_name_prefix="kvtier-nvme-scan") as scan_pool:
            futures = [scan_pool.submit(self._open_segment, seg_id, path)
                       for seg_id, path in found]
            for (seg_id, _), fut in zip(found, futures, strict=True):
                try:
                    opened = fut.result()
                except BaseException as exc:  # re-raised below, once every fd is accounted for
                    error = error or exc
                    continue
                if opened is None:
                    continue
                segment, scan, header_ok = opened
                damaged += not header_ok
                scans.append((segment, scan, header_ok))
                self._segments.append(segment)  # so close() closes its fd on a later error
                self._segment_bytes_total += segment.size_bytes
                self._next_segment_id = max(self._next_segment_id, seg_id + 1)
        if error is not None:
            raise error
        if self._segment_bytes_total > self._budget_bytes:
            raise ConfigError(
                f"{self._dir} holds {self._segment_bytes_total} bytes of segments, more than "
                f"capacity_bytes={self._budget_bytes}: raise the capacity or empty the directory")
        self._next_seq = max((scan.max_seq for _, scan, _ in scans), default=0) + 1

        # Keep the newest record of each key.
        best: dict[bytes, tuple[RecordHeader, _Segment]] = {}
        duplicates = 0
        for segment, scan, _ in scans:
            for header in scan.live:
                other = best.get(header.key)
                if other is not None:
                    duplicates += 1
                    if other[0].seq > header.seq:
                        continue
                best[header.key] = (header, segment)
        records = {key: _Record(ChunkKey(key), seg, h.offset, h.payload_bytes, h.payload_xxh3,
                                h.seq, _State.LIVE, h.meta) for key, (h, seg) in best.items()}

        # Verify the payloads a crash may have torn (or all of them).
        if self._config.open_verify is OpenVerify.ALL:
            to_verify = list(records.values())
        elif self._config.open_verify is OpenVerify.NEWEST:
            to_verify = sorted(records.values(), key=lambda r: r.seq)[
                -self._config.open_verify_newest:] if self._config.open_verify_newest else []
        else:
            to_verify = []
        corrupt = 0
        workers = min(_SCAN_THREADS, max(1, len(to_verify)))
        with ThreadPoolExecutor(max_workers=workers,
                                thread_name_prefix="kvtier-nvme-verify") as verify_pool:
            verdicts = list(verify_pool.map(self._verify_at_open, to_verify))
        for rec, problem in zip(to_verify, verdicts, strict=True):
            if problem is not None:
                corrupt += 1
                log.error("NVMe tier %s: dropping chunk %s at open: %s", self._dir,
                          rec.key.hex(), problem)
                del records[rec.key]

        # Claim the records kept in each segment's space (the rest is free); repair unclean gaps.
        by_segment: dict[int, list[_Record]] = {}
        for rec in records.values():
            assert rec.segment is not None
            by_segment.setdefault(rec.segment.id, []).append(rec)
        repaired = 0
        for segment, scan, header_ok in scans:
            kept = sorted(by_segment.get(segment.id, []), key=lambda r: r.offset)
            for rec in kept:  # in address order: each claim finds its free extent in O(1)
                segment.space.claim(rec.offset, rec.extent_bytes)
            clean = {(g.offset, g.size_bytes) for g in scan.gaps if g.clean}
            dirty = [gap for gap in segment.space.free_extents() if gap not in clean]
            repaired += len(dirty)
            if dirty or not header_ok or scan.file_bytes < segment.size_bytes:
                self._repair_segment(segment, scan, header_ok, dirty)
        self._index = {ChunkKey(k): r for k, r in records.items()}
        self._live_chunks = len(records)
        report = RecoveryReport(
            segments=len(scans), chunks=len(records),
            invalid_headers=sum(s.invalid_headers for _, s, _ in scans),
            torn_records=sum(s.torn_records for _, s, _ in scans),
            corrupt_dropped=corrupt, duplicates_dropped=duplicates,
            damaged_segment_headers=damaged, repaired_gaps=repaired,
            verified_records=len(to_verify), elapsed_s=time.monotonic() - started)
        self._recovery = report
        problems = (report.invalid_headers + report.torn_records + report.corrupt_dropped
                    + report.duplicates_dropped + report.damaged_segment_headers)
        (log.warning if problems else log.info)(
            "NVMe tier %s opened (%s I/O: %s): %s", self._dir, self._io_mode.value,
            self._io_mode_reason, report)

    def _verify_at_open(self, rec: _Record) -> str | None:
        """Read and check one record's payload; the reason it is corrupt, or None."""
        try:
            self._transfer_in(rec, None)
        except ChunkCorrupt as exc:
            return str(exc)
        except OSError as exc:
            raise _os_error(exc, f"verifying chunk {rec.key.hex()} at open") from exc
        return None

    def _open_segment(self, seg_id: int, path: Path) -> tuple[_Segment, SegmentScan, bool] | None:
        """Open and scan one segment file (None: it was unusable and has been removed)."""
        window = self._blocks.acquire()
        try:
            return self._open_and_scan(seg_id, path, window)
        finally:
            self._blocks.release(window)

    def _open_and_scan(self, seg_id: int, path: Path, window: AlignedBuffer,
                       ) -> tuple[_Segment, SegmentScan, bool] | None:
        try:
            fd = os.open(path, open_flags(self._io_mode))
        except OSError as exc:
            raise _os_error(exc, f"opening segment {path.name}") from exc
        try:
            file_bytes = os.fstat(fd).st_size
            block = window.view[:ALIGN_BYTES]
            got = preadv_all(fd, [block], 0)
            header = decode_segment_header(block) if got == ALIGN_BYTES else None
            del block
            header_ok = header is not None and header.segment_id == seg_id
            size = header.segment_bytes if header is not None and header_ok \
                else align_down(file_bytes)
            if size < _MIN_SEGMENT_BYTES:
                log.warning("NVMe tier %s: segment %s has no usable header and %d bytes; "
                            "removing it", self._dir, path.name, file_bytes)
                os.close(fd)
                path.unlink()
                _fsync_directory(self._dir)
                return None
            if not header_ok:
                log.warning("NVMe tier %s: segment %s has a damaged header; assuming %d bytes "
                            "and scanning its records", self._dir, path.name, size)

            def read_at(dst: memoryview, offset: int) -> int:
                return preadv_all(fd, [dst], offset)

            scan = scan_segment(read_at, segment_id=seg_id, segment_bytes=size,
                                file_bytes=file_bytes, window=window)
        except OSError as exc:
            os.close(fd)
            raise _os_error(exc, f"scanning segment {path.name}") from exc
        except BaseException:
            os.close(fd)
            raise
        return _Segment(seg_id, path, fd, size, _segment_space(size)), scan, header_ok

    def _repair_segment(self, segment: _Segment, scan: SegmentScan, header_ok: bool,
                        dirty: list[tuple[int, int]]) -> None:
        """Re-extend a truncated file, rewrite a damaged header, stamp FREE over dirty gaps."""
        fd = segment.fd
        try:
            if scan.file_bytes < segment.size_bytes:
                log.warning("NVMe tier %s: segment %s is truncated at %d of %d bytes; "
                            "re-extending it", self._dir, segment.path.name, scan.file_bytes,
                            segment.size_bytes)
                self._preallocate(fd, align_down(scan.file_bytes), segment.size_bytes)
            if not header_ok:
                buf = self._small.acquire()
                try:
                    SegmentHeader(segment.id, segment.size_bytes).encode_into(
                        buf.view[:ALIGN_BYTES])
                    pwritev_all(fd, [buf.view[:ALIGN_BYTES]], 0)
                finally:
                    self._small.release(buf)
            for offset, size in dirty:
                self._write_header(fd, RecordHeader(RecordKind.FREE, segment.id, offset, size,
                                                    self._take_seq_locked()))
            os.fsync(fd)
        except OSError as exc:
            raise _os_error(exc, f"repairing segment {segment.path.name}") from exc


def _segment_space(size_bytes: int) -> ExtentAllocator:
    """The space of a segment file with nothing stored: all free but its header block."""
    space = ExtentAllocator(size_bytes, ALIGN_BYTES)
    space.claim(0, HEADER_BYTES)
    return space


def _os_error(exc: OSError, what: str) -> KvtierError:
    """Translate an OSError into the most specific kvtier error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{what}: filesystem full ({exc.strerror})")
    return StorageError(f"{what}: {exc.strerror or exc}")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lock_directory(directory: Path) -> int:
    """Take the directory's exclusive ``flock`` (released by the kernel if the process dies)."""
    path = directory / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise _os_error(exc, f"opening lock file {path}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise TierUnavailable(f"{directory} is in use by another NVMe tier (pid {holder})") \
            from exc
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd

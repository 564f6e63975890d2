"""The NVMe tier's public class: chunks in preallocated segment files, checksummed, crash-safe.

``NvmeTier`` implements :class:`~kvstore.dataplane.tier.Tier` (see that module for
ownership, errors and threading) on a :class:`~kvstore.dataplane.nvme.core.TierCore` shared
with its write path (:mod:`~kvstore.dataplane.nvme.write`), read path
(:mod:`~kvstore.dataplane.nvme.read`) and recovery (:mod:`~kvstore.dataplane.nvme.recovery`).
The on-disk format is :mod:`~kvstore.dataplane.nvme.format`, the recovery scan
:mod:`~kvstore.dataplane.nvme.scan`; decisions and measurements in ``docs/nvme-tier.md``.

Space
    ``capacity_bytes`` is the budget for the directory: the sum of the segment files'
    sizes. Segment files are created on demand, about ``segment_bytes`` each (a whole
    number of the records that triggered them, so uniform chunks leave no tail waste; the
    last one smaller to fit the budget), preallocated
    (:class:`~kvstore.dataplane.nvme.config.Preallocation`), and never
    shrink. Inside each one the tiers' free-extent allocator
    (:class:`~kvstore.dataplane.allocator.ExtentAllocator`: best fit, coalescing) places each
    record; ``remove`` frees its extent at once. A chunk costs its size rounded up to
    4 KiB plus one 4 KiB header block.

    The filesystem's real room is checked (``os.statvfs``): at open, a configured capacity
    larger than the free space plus the tier's own files is lowered to that figure, with a
    warning (refused below ``MIN_REAL_CAPACITY_BYTES``); a new segment is cut to the space
    the filesystem has left. When other files fill the filesystem later, the put that
    needs a new segment gets ``DiskFull`` (a ``CapacityError``) and stores nothing; chunks
    already stored stay readable.

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
    Every public method may be called from any thread. One lock (the core's) guards the
    index and the segments' allocators; no I/O happens under it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore.dataplane.arena import host_byte_view
from kvstore.dataplane.nvme.config import MIN_REAL_CAPACITY_BYTES, NvmeTierConfig
from kvstore.dataplane.nvme.core import (
    LOCK_FILE_NAME,
    SEGMENT_RE,
    TMP_SUFFIX,
    Record,
    RecordState,
    TierCore,
    filesystem_free_bytes,
    os_error,
)
from kvstore.dataplane.nvme.directio import ALIGN_BYTES, IoMode, align_down, probe_io_mode
from kvstore.dataplane.nvme.format import HEADER_BYTES, record_extent_bytes
from kvstore.dataplane.nvme.read import ReadPath
from kvstore.dataplane.nvme.recovery import RecoveryReport, recover
from kvstore.dataplane.nvme.write import WritePath
from kvstore.dataplane.tier import (
    MAX_META_BYTES,
    MAX_OWNER_BYTES,
    ChunkInfo,
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
    SizeMismatch,
    StorageError,
    TierUnavailable,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NvmeTierStats:
    """NVMe-specific figures beside the generic :class:`TierStats`."""

    tier: TierStats
    io_mode: IoMode
    io_mode_reason: str
    segments: int
    segment_bytes_total: int
    corrupt_dropped: int
    """Chunks dropped by a failed checksum on read since open (found at open:
    ``TierStats.corrupt_at_open``)."""
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


class NvmeTier:
    """Chunks persisted in segment files under one directory. Create with :meth:`open`."""

    def __init__(self, config: NvmeTierConfig, *, lock_fd: int, io_mode: IoMode,
                 io_mode_reason: str, capacity_bytes: int | None = None) -> None:
        """Internal: :meth:`open` locks the directory, checks the filesystem's real room,
        picks the I/O mode and recovers.

        The constructor only sets fields (no I/O, no threads). ``capacity_bytes``: the
        capacity in use when it is less than the configured one.
        """
        self._core = TierCore(config, io_mode=io_mode, io_mode_reason=io_mode_reason,
                              budget_bytes=capacity_bytes)
        self._reader = ReadPath(self._core)
        self._writer = WritePath(self._core)
        self._lock_fd = lock_fd
        self._recovery: RecoveryReport | None = None

    # --- opening ----------------------------------------------------------------------------

    @classmethod
    def open(cls, config: NvmeTierConfig) -> NvmeTier:
        """Open (creating it if needed) and lock ``config.directory``, then recover its chunks.

        When the filesystem cannot give ``config.capacity_bytes`` (its free space plus what
        this tier's own files already hold is less), a warning is logged and that real
        figure becomes :attr:`capacity_bytes`, so the cache's budgets and the daemon's Stats
        are true; below ``MIN_REAL_CAPACITY_BYTES`` the open is refused with ``DiskFull``.

        The directory gets ``config.directory_mode`` (0700, or 0750 for ``config.group``) and
        existing segment and lock files ``config.file_mode`` (0600 / 0640): only the daemon's
        uid and the group can open them.

        Raises ``TierUnavailable`` when another tier holds the directory or O_DIRECT was
        required but is unsupported, ``ConfigError`` when the segments found exceed the
        capacity or the directory is world-writable, ``DiskFull`` when the filesystem has no sane room for the tier,
        ``StorageError`` when the directory cannot be used.
        """
        _make_private_directory(config)
        lock_fd = _lock_directory(config.directory, config.file_mode)
        tier: NvmeTier | None = None
        try:
            existing = [p for p in sorted(config.directory.glob("seg-*.kvt"))
                        if SEGMENT_RE.match(p.name) and p.stat().st_size >= ALIGN_BYTES]
            capacity = _capacity_the_filesystem_gives(config)
            try:
                probed, reason = probe_io_mode(config.directory,
                                               existing[0] if existing else None)
            except OSError as exc:
                raise os_error(exc, f"probing O_DIRECT in {config.directory}") from exc
            if config.io_mode is IoMode.DIRECT and probed is not IoMode.DIRECT:
                raise TierUnavailable(f"O_DIRECT required but {config.directory} refuses it: "
                                      f"{reason}")
            if config.io_mode is IoMode.BUFFERED:
                probed, reason = IoMode.BUFFERED, "buffered I/O requested by configuration"
            _restrict_files(config, existing)
            tier = cls(config, lock_fd=lock_fd, io_mode=probed, io_mode_reason=reason,
                       capacity_bytes=capacity)
            tier._recovery = recover(tier._core, tier._reader, tier._writer)
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
        return self._core.budget_bytes

    @property
    def io_mode(self) -> IoMode:
        return self._core.io_mode

    @property
    def directory(self) -> Path:
        return self._core.directory

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

    def put_with_meta(self, key: bytes, src: object, meta: bytes, owner: bytes = b""
                      ) -> ChunkInfo:
        """``put`` that also persists up to ``MAX_META_BYTES`` of caller metadata and up to
        ``MAX_OWNER_BYTES`` of owner label in the header.

        Both are written with the chunk (same header, same fdatasync) and come back in
        ``ChunkInfo.meta`` / ``ChunkInfo.owner`` from :meth:`chunks`, also after a restart.
        """
        core = self._core
        if not isinstance(meta, bytes | bytearray) or len(meta) > MAX_META_BYTES:
            raise InvalidArgument(f"chunk metadata must be bytes of at most {MAX_META_BYTES}, "
                                  f"got {meta!r:.80}")
        if not isinstance(owner, bytes | bytearray) or len(owner) > MAX_OWNER_BYTES:
            raise InvalidArgument(f"chunk owner must be bytes of at most {MAX_OWNER_BYTES}, "
                                  f"got {owner!r:.80}")
        chunk_key = check_key(key)
        view = host_byte_view(src)
        size = view.nbytes
        if size == 0:
            raise InvalidArgument("an empty chunk cannot be stored")
        extent = record_extent_bytes(size)
        with self._operation():
            with core.lock:
                held = core.index.get(chunk_key)
                if held is not None:
                    if held.state is RecordState.LIVE:
                        raise ChunkExists(f"chunk {chunk_key.hex()} is already stored")
                    raise ChunkBusy(f"chunk {chunk_key.hex()} is being {held.state.value}")
                if extent + HEADER_BYTES > core.budget_bytes:
                    raise CapacityError(f"a chunk of {size} bytes cannot fit in an NVMe tier "
                                        f"of {core.budget_bytes} bytes")
                rec = Record(chunk_key, None, 0, size, 0, 0, RecordState.WRITING, bytes(meta),
                             bytes(owner))
                core.index[chunk_key] = rec
            try:
                if not self._writer.pipelined(size):  # else hashed piece by piece while writing
                    rec.checksum = xxhash.xxh3_64_intdigest(view)
                self._writer.place_and_write(rec, view)
                segment = rec.segment
                assert segment is not None
                try:
                    os.fdatasync(segment.fd)
                except OSError as exc:
                    self._writer.discard(rec)
                    raise os_error(exc, f"syncing chunk {chunk_key.hex()}") from exc
            except BaseException:
                with core.lock:
                    del core.index[chunk_key]
                raise
            with core.lock:
                rec.state = RecordState.LIVE
                core.live_chunks += 1
            return ChunkInfo(chunk_key, size, TierKind.NVME, rec.checksum, meta=rec.meta,
                             owner=rec.owner)

    def get_into(self, key: bytes, dst: object) -> int:
        """Read the chunk into ``dst`` (exactly its size), verifying its checksum; return the size.

        Raises ChunkNotFound, SizeMismatch, ChunkCorrupt (``dst`` is then zeroed),
        StorageError, TierUnavailable.
        """
        core = self._core
        chunk_key = check_key(key)
        dst_view = host_byte_view(dst, writable=True)
        with self._operation():
            with core.lock:
                rec = core.index.get(chunk_key)
                if rec is None or rec.state is not RecordState.LIVE:
                    raise ChunkNotFound(chunk_key, "the NVMe tier")
                if dst_view.nbytes != rec.payload_bytes:
                    raise SizeMismatch(f"destination for chunk {chunk_key.hex()}",
                                       expected=rec.payload_bytes, actual=dst_view.nbytes)
                rec.readers += 1
            try:
                self._reader.transfer_in(rec, dst_view)
            except ChunkCorrupt as exc:
                dst_view[:] = bytes(dst_view.nbytes)
                if not self._drop_corrupt(rec, str(exc)):
                    raise ChunkNotFound(chunk_key, "the NVMe tier (removed during the read)") \
                        from exc
                raise
            except OSError as exc:
                raise os_error(exc, f"reading chunk {chunk_key.hex()}") from exc
            finally:
                with core.lock:
                    rec.readers -= 1
                    if rec.readers == 0 and rec.free_when_idle:
                        core.free_extent_locked(rec)
            return rec.payload_bytes

    def contains(self, key: bytes) -> bool:
        core = self._core
        chunk_key = check_key(key)
        with core.lock:
            core.check_open()
            rec = core.index.get(chunk_key)
            return rec is not None and rec.state is RecordState.LIVE

    def size_of(self, key: bytes) -> int | None:
        core = self._core
        chunk_key = check_key(key)
        with core.lock:
            core.check_open()
            rec = core.index.get(chunk_key)
            return rec.payload_bytes if rec is not None and rec.state is RecordState.LIVE else None

    def remove(self, key: bytes) -> bool:
        """Durably remove the chunk (DEAD header + fdatasync) and free its space.

        Returns False when the key is not stored. Raises ChunkBusy while the key is being
        written or removed by another call, StorageError when the DEAD header cannot be
        written (the chunk then stays stored).
        """
        core = self._core
        chunk_key = check_key(key)
        with self._operation():
            with core.lock:
                rec = core.index.get(chunk_key)
                if rec is None:
                    return False
                if rec.state is not RecordState.LIVE:
                    raise ChunkBusy(f"chunk {chunk_key.hex()} is being {rec.state.value}")
                rec.state = RecordState.REMOVING
                core.live_chunks -= 1
                seq = core.take_seq_locked()
            try:
                self._writer.write_dead(rec, seq)
            except OSError as exc:
                with core.lock:
                    rec.state = RecordState.LIVE
                    core.live_chunks += 1
                raise os_error(exc, f"removing chunk {chunk_key.hex()}") from exc
            with core.lock:
                del core.index[chunk_key]
                core.release_extent_locked(rec)
            return True

    def chunks(self) -> Iterator[ChunkInfo]:
        """A snapshot of every stored chunk (with its xxh3_64)."""
        core = self._core
        with core.lock:
            core.check_open()
            infos = [ChunkInfo(rec.key, rec.payload_bytes, TierKind.NVME, rec.checksum,
                               meta=rec.meta, owner=rec.owner)
                     for rec in core.index.values() if rec.state is RecordState.LIVE]
        return iter(infos)

    def stats(self) -> TierStats:
        core = self._core
        with core.lock:
            core.check_open()
            return core.stats_locked()

    def nvme_stats(self) -> NvmeTierStats:
        core = self._core
        with core.lock:
            core.check_open()
            return NvmeTierStats(core.stats_locked(), core.io_mode, core.io_mode_reason,
                                 len(core.segments), core.segment_bytes_total,
                                 core.corrupt_dropped, core.quarantined_bytes)

    def record_location(self, key: bytes) -> RecordLocation | None:
        """Where the chunk's record lies on disk (None when not stored). For tooling and tests."""
        core = self._core
        chunk_key = check_key(key)
        with core.lock:
            core.check_open()
            rec = core.index.get(chunk_key)
            if rec is None or rec.state is not RecordState.LIVE or rec.segment is None:
                return None
            return RecordLocation(rec.segment.path, rec.offset, rec.offset + HEADER_BYTES,
                                  rec.payload_bytes, rec.extent_bytes)

    def close(self) -> None:
        """Wait for calls in flight, then close files, threads and buffers and unlock the directory.

        Idempotent. Everything stored stays on disk; later calls raise TierUnavailable.
        """
        core = self._core
        with core.lock:
            if core.closed:
                return
            core.closed = True
            while core.active_ops:
                core.idle.wait()
            segments, core.segments = core.segments, []
        if core.pool is not None:
            core.pool.shutdown(wait=True)
        for seg in segments:
            os.close(seg.fd)
        self._writer.close()
        core.blocks.close()
        core.small.close()
        os.close(self._lock_fd)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        core = self._core
        return (f"NvmeTier({str(core.directory)!r}, capacity_bytes={core.budget_bytes}, "
                f"io_mode={core.io_mode.value})")

    # --- bookkeeping ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        core = self._core
        with core.lock:
            core.check_open()
            core.active_ops += 1
        try:
            yield
        finally:
            with core.lock:
                core.active_ops -= 1
                if core.active_ops == 0:
                    core.idle.notify_all()

    def _drop_corrupt(self, rec: Record, reason: str) -> bool:
        """Drop a chunk that failed verification; False when it was removed meanwhile."""
        core = self._core
        with core.lock:
            if core.index.get(rec.key) is not rec or rec.state is not RecordState.LIVE:
                return False
            rec.state = RecordState.REMOVING
            core.live_chunks -= 1
            seq = core.take_seq_locked()
            core.corrupt_dropped += 1
        log.error("NVMe tier %s: dropping corrupt chunk %s: %s", core.directory, rec.key.hex(),
                  reason)
        try:
            self._writer.write_dead(rec, seq)
            cleared = True
        except OSError as exc:
            cleared = False
            log.error("NVMe tier %s: could not mark corrupt chunk %s dead (%s); its extent is "
                      "quarantined until the tier is reopened", core.directory, rec.key.hex(),
                      exc)
        with core.lock:
            del core.index[rec.key]
            if cleared:
                core.release_extent_locked(rec)
            else:
                core.quarantined_bytes += rec.extent_bytes
        return True


def _capacity_the_filesystem_gives(config: NvmeTierConfig) -> int:
    """``config.capacity_bytes``, or less when the filesystem cannot give that much.

    The real room is the free space (:func:`~kvstore.dataplane.nvme.core.filesystem_free_bytes`)
    plus the blocks this tier's own files already hold (segments, and unfinished segments
    that recovery is about to delete). Existing segments are never cut: when sparse ones
    hold fewer blocks than their size, their size is kept (later puts into their holes may
    get ``DiskFull``). Raises ``DiskFull`` below ``MIN_REAL_CAPACITY_BYTES``.
    """
    directory = config.directory
    configured = align_down(config.capacity_bytes)
    try:
        free = filesystem_free_bytes(directory)
        own_blocks = own_size = 0
        for path in directory.iterdir():
            name = path.name
            if SEGMENT_RE.match(name) or (name.startswith("seg-") and name.endswith(TMP_SUFFIX)):
                st = path.stat()
                own_blocks += st.st_blocks * 512
                if SEGMENT_RE.match(name):
                    own_size += st.st_size
    except OSError as exc:
        raise os_error(exc, f"measuring the free space under {directory}") from exc
    real = align_down(free + own_blocks)
    if real >= configured:
        return configured
    if real < MIN_REAL_CAPACITY_BYTES:
        raise DiskFull(f"NVMe tier {directory}: the filesystem can give it only {real} bytes "
                       f"({free} free + {own_blocks} in its own files), below the minimum "
                       f"{MIN_REAL_CAPACITY_BYTES}; capacity_bytes={configured} was configured. "
                       f"Free space there or point the tier at a bigger filesystem")
    capacity = max(real, min(align_down(own_size), configured))
    log.warning("NVMe tier %s: capacity_bytes=%d configured but the filesystem can give only "
                "%d bytes (%d free + %d in the tier's files); using %d bytes", directory,
                configured, real, free, own_blocks, capacity)
    return capacity


def _make_private_directory(config: NvmeTierConfig) -> None:
    """Create ``config.directory`` (parents as the umask allows) and give the directory itself
    ``config.directory_mode`` and ``config.group``, so only the daemon's uid (and the group)
    can reach the segment files inside, whatever their own modes. A directory others may
    write to (``/tmp``-like: world-writable) is refused: the tier needs a directory of its
    own. Raises StorageError, ConfigError."""
    directory = config.directory
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=config.directory_mode)
        st = directory.stat()
    except OSError as exc:
        raise StorageError(f"cannot create NVMe tier directory {directory}: "
                           f"{exc.strerror}") from exc
    if st.st_mode & 0o002:
        raise ConfigError(f"NVMe tier directory {directory} is world-writable "
                          f"({st.st_mode & 0o7777:#o}): give the tier a directory of its own")
    try:
        if config.group is not None and st.st_gid != config.group:
            os.chown(directory, -1, config.group)
        if st.st_mode & 0o7777 != config.directory_mode:
            os.chmod(directory, config.directory_mode)
    except OSError as exc:
        raise StorageError(f"cannot restrict NVMe tier directory {directory} to mode "
                           f"{config.directory_mode:#o} (group {config.group}): "
                           f"{exc.strerror}") from exc


def _restrict_files(config: NvmeTierConfig, segments: list[Path]) -> None:
    """Give existing segment files ``config.file_mode`` and ``config.group`` (files written
    by an older version were ``0644``). Raises StorageError."""
    for path in segments:
        try:
            st = path.stat()
            if config.group is not None and st.st_gid != config.group:
                os.chown(path, -1, config.group)
            if st.st_mode & 0o7777 != config.file_mode:
                os.chmod(path, config.file_mode)
        except OSError as exc:
            raise os_error(exc, f"restricting segment {path.name} to mode "
                               f"{config.file_mode:#o}") from exc


def _lock_directory(directory: Path, file_mode: int = 0o600) -> int:
    """Take the directory's exclusive ``flock`` (released by the kernel if the process dies)."""
    path = directory / LOCK_FILE_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, file_mode)
    except OSError as exc:
        raise os_error(exc, f"opening lock file {path}") from exc
    try:
        os.fchmod(fd, file_mode)  # a lock file an older version made 0644
    except OSError as exc:
        os.close(fd)
        raise os_error(exc, f"restricting lock file {path}") from exc
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

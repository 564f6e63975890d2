"""What the parts of one NVMe tier share: the index of records, the segment files, the locks,
the buffer pools and the I/O threads (:class:`TierCore`).

The public :class:`~kvstore.dataplane.nvme.tier.NvmeTier` owns one core; its write path
(:mod:`~kvstore.dataplane.nvme.write`), read path (:mod:`~kvstore.dataplane.nvme.read`) and
recovery (:mod:`~kvstore.dataplane.nvme.recovery`) work on it.

Locking
    ``lock`` guards the index, the segment list, every segment's allocator, the counters and
    the sequence numbers; no I/O happens under it. ``write_lock`` is held by one put at a time
    while it allocates and writes its extent (so no other put can take the rest of its free run
    before the FREE header there is on disk), and by the clean-up of a failed write. It is
    taken before ``lock``, never while holding it.
"""

from __future__ import annotations

import enum
import errno
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvstore.dataplane.allocator import ExtentAllocator
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.directio import ALIGN_BYTES, BufferPool, IoMode, align_down
from kvstore.dataplane.nvme.format import HEADER_BYTES, record_extent_bytes
from kvstore.dataplane.tier import ChunkKey, TierKind, TierStats
from kvstore.errors import DiskFull, KvtierError, StorageError, TierUnavailable

LOCK_FILE_NAME = "LOCK"
SEGMENT_NAME = "seg-{:06d}.kvt"
SEGMENT_RE = re.compile(r"^seg-(\d{6,10})\.kvt$")
TMP_SUFFIX = ".tmp"


class Segment:
    """One open segment file."""

    __slots__ = ("fd", "id", "path", "size_bytes", "space")

    def __init__(self, seg_id: int, path: Path, fd: int, size_bytes: int,
                 space: ExtentAllocator) -> None:
        self.id = seg_id
        self.path = path
        self.fd = fd
        self.size_bytes = size_bytes
        self.space = space
        """Allocated and free extents of the file; the segment header is a claimed block."""


def segment_space(size_bytes: int) -> ExtentAllocator:
    """The space of a segment file with nothing stored: all free but its header block."""
    space = ExtentAllocator(size_bytes, ALIGN_BYTES)
    space.claim(0, HEADER_BYTES)
    return space


class RecordState(enum.Enum):
    WRITING = "writing"
    LIVE = "live"
    REMOVING = "removing"


class Record:
    """One chunk in the index. Mutable only under the core's lock."""

    __slots__ = ("checksum", "extent_bytes", "free_when_idle", "key", "meta", "offset", "owner",
                 "payload_bytes", "readers", "segment", "seq", "state")

    def __init__(self, key: ChunkKey, segment: Segment | None, offset: int, payload_bytes: int,
                 checksum: int, seq: int, state: RecordState, meta: bytes = b"",
                 owner: bytes = b"") -> None:
        self.key = key
        self.meta = meta
        self.owner = owner
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


class TierCore:
    """The state of one NVMe tier. Fields other than the locks are read and written under
    ``lock`` (module docstring), except ``config`` and the I/O mode, which never change."""

    def __init__(self, config: NvmeTierConfig, *, io_mode: IoMode, io_mode_reason: str,
                 budget_bytes: int | None = None) -> None:
        """Only sets fields (no I/O, no threads). ``budget_bytes``: the capacity in use, when
        the filesystem gives less than ``config.capacity_bytes``."""
        self.config = config
        self.directory = config.directory
        self.budget_bytes = align_down(config.capacity_bytes if budget_bytes is None
                                       else budget_bytes)
        self.io_mode = io_mode
        self.io_mode_reason = io_mode_reason
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        """Notified when the last call in flight ends (``active_ops`` drops to 0)."""
        self.write_lock = threading.Lock()
        self.index: dict[ChunkKey, Record] = {}
        self.segments: list[Segment] = []
        self.segment_bytes_total = 0
        self.next_segment_id = 1
        self.next_seq = 1
        self.active_ops = 0
        self.closed = False
        self.corrupt_dropped = 0
        self.corrupt_at_open = 0
        """``RecoveryReport.corrupt_found`` of the open that made this core."""
        self.live_chunks = 0
        self.quarantined_bytes = 0
        self.pool: ThreadPoolExecutor | None = None
        self.window = max(2, config.io_threads)
        """Pieces of one transfer in flight."""
        self.blocks = BufferPool(config.io_block_bytes, max_cached=2 * (self.window + 1))
        self.small = BufferPool(2 * ALIGN_BYTES, max_cached=32)

    def check_open(self) -> None:
        if self.closed:
            raise TierUnavailable(f"NVMe tier at {self.directory} is closed")

    def take_seq_locked(self, count: int = 1) -> int:
        seq = self.next_seq
        self.next_seq += count
        return seq

    def stats_locked(self) -> TierStats:
        unallocated = self.budget_bytes - self.segment_bytes_total
        free = unallocated + sum(seg.space.free_bytes for seg in self.segments)
        largest_extent = max((seg.space.largest_free_bytes for seg in self.segments), default=0)
        largest = max(largest_extent - HEADER_BYTES, unallocated - 2 * HEADER_BYTES, 0)
        return TierStats(TierKind.NVME, self.budget_bytes, self.budget_bytes - free,
                         self.live_chunks, largest, self.corrupt_at_open)

    def release_extent_locked(self, rec: Record) -> None:
        """The record left the index: free its extent now, or when its last read ends."""
        if rec.readers:
            rec.free_when_idle = True
        else:
            self.free_extent_locked(rec)

    def free_extent_locked(self, rec: Record) -> None:
        rec.free_when_idle = False
        segment = rec.segment
        if segment is not None and segment in self.segments:
            segment.space.free(rec.offset)
            rec.segment = None

    def pool_get(self) -> ThreadPoolExecutor:
        """The I/O threads (started on first use)."""
        with self.lock:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(max_workers=self.config.io_threads,
                                               thread_name_prefix="kvtier-nvme-io")
            return self.pool


def os_error(exc: OSError, what: str) -> KvtierError:
    """Translate an OSError into the most specific kvtier error."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"{what}: filesystem full ({exc.strerror})")
    return StorageError(f"{what}: {exc.strerror or exc}")


def filesystem_free_bytes(directory: Path) -> int:
    """Bytes the filesystem under ``directory`` can still give a file (``f_bavail``: what an
    unprivileged writer may use, so the root reserve stays as slack for metadata)."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

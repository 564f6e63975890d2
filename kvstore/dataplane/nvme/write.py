"""The NVMe tier's write path: records onto disk, durably, keeping the header chain intact.

A chunk up to ``io_block_bytes`` (hashed by the caller before it takes the write lock) goes
out in one ``pwritev``: header | payload | padding | FREE header for the rest of the free run
(4 KiB-aligned caller memory is written in place, other memory is copied once into an aligned
staging buffer). A larger chunk in O_DIRECT mode streams with the hash (and, if unaligned,
the copy) overlapped with the writes on the core's I/O threads, and its header goes last: a
crash before it leaves the old FREE/DEAD header in place. The allocation and the write happen
under the core's write lock, so no other put takes the run's remainder before its FREE
header is on disk (``docs/nvme-tier.md``, "The header chain"). The caller ``fdatasync``-s
after releasing the lock.

Also here: DEAD headers for removals, the clean-up of a failed write (a FREE header over
it, or quarantine), and segment files: created on demand (tmp name, fsync, rename, fsync
the directory), cut to the space the filesystem has left (``DiskFull`` before anything is
written when not one record fits), and preallocated per
:class:`~kvstore.dataplane.nvme.config.Preallocation`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import xxhash

from kvstore.dataplane.arena import copy_bytes
from kvstore.dataplane.nvme.config import Preallocation
from kvstore.dataplane.nvme.core import (
    SEGMENT_NAME,
    TMP_SUFFIX,
    Record,
    Segment,
    TierCore,
    filesystem_free_bytes,
    fsync_directory,
    os_error,
    segment_space,
)
from kvstore.dataplane.nvme.directio import (
    ALIGN_BYTES,
    AlignedBuffer,
    IoMode,
    align_down,
    align_up,
    is_aligned,
    open_flags,
    pwritev_all,
)
from kvstore.dataplane.nvme.format import HEADER_BYTES, RecordHeader, RecordKind, SegmentHeader
from kvstore.errors import CapacityError, DiskFull

log = logging.getLogger(__name__)

_ZERO_PAD = bytes(ALIGN_BYTES)


class WritePath:
    """Writes records, headers and segment files of one tier.

    :meth:`place_and_write` and :meth:`discard` take the core's write lock themselves; the
    staging buffers below belong to whoever holds it. :meth:`write_header` and
    :meth:`write_dead` touch only the block they are given and may run from any thread;
    :meth:`preallocate` runs under the write lock or in recovery, before the tier is shared.
    """

    def __init__(self, core: TierCore) -> None:
        self._core = core
        # Fixed for the tier's life:
        self._config = core.config
        self._io_mode = core.io_mode
        self._dir = core.directory
        self._lock = core.lock
        self._write_lock = core.write_lock
        self._small = core.small
        self._window = core.window
        self._pool_get = core.pool_get
        # Owned by the thread holding the write lock: header + tail + trailer blocks, and
        # staging buffers for unaligned sources. Created on first use.
        self._wblocks: AlignedBuffer | None = None
        self._wstage: list[AlignedBuffer] = []
        self._zeros: AlignedBuffer | None = None
        """Zeros for ``ZERO_FILL`` preallocation (segments are made under the write lock;
        recovery re-extends files before the tier is shared)."""

    def close(self) -> None:
        """Release the staging buffers (once no write can be in flight)."""
        for buf in [self._wblocks, self._zeros, *self._wstage]:
            if buf is not None:
                buf.close()
        self._wblocks, self._zeros, self._wstage = None, None, []

    def pipelined(self, size_bytes: int) -> bool:
        """Whether a put of this size streams in pieces (hash and copy overlap the writes)."""
        return self._io_mode is IoMode.DIRECT and size_bytes > self._config.io_block_bytes

    def place_and_write(self, rec: Record, view: memoryview) -> None:
        """Allocate ``rec``'s extent and write header, payload and the FREE trailer.

        On failure the extent is given back (with a FREE header over it) and ``OSError`` /
        ``CapacityError`` / ``DiskFull`` propagate.
        """
        with self._write_lock:
            segment, offset, run_bytes = self._allocate(rec.extent_bytes)
            with self._lock:
                seq = self._core.take_seq_locked(2)
            rec.segment, rec.offset, rec.seq = segment, offset, seq
            header = RecordHeader(RecordKind.LIVE, segment.id, offset, rec.extent_bytes, seq,
                                  rec.payload_bytes, rec.checksum, rec.key, rec.meta, rec.owner)
            trailer = None
            if run_bytes > rec.extent_bytes:
                trailer = RecordHeader(RecordKind.FREE, segment.id, offset + rec.extent_bytes,
                                       run_bytes - rec.extent_bytes, seq + 1)
            try:
                rec.checksum = self._write_record(segment.fd, header, view, trailer)
            except OSError as exc:
                self._give_back_after_failed_write(rec)
                raise os_error(exc, f"writing chunk {rec.key.hex()}") from exc
            except BaseException:
                self._give_back_after_failed_write(rec)
                raise

    def discard(self, rec: Record) -> None:
        """A put wrote its record but could not make it durable: clear and free it."""
        with self._write_lock:
            self._give_back_after_failed_write(rec)

    def write_dead(self, rec: Record, seq: int) -> None:
        segment = rec.segment
        assert segment is not None
        self.write_header(segment.fd, RecordHeader(RecordKind.DEAD, segment.id, rec.offset,
                                                   rec.extent_bytes, seq, key=rec.key))

    def write_header(self, fd: int, header: RecordHeader) -> None:
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

    def _allocate(self, extent_bytes: int) -> tuple[Segment, int, int]:
        """Best fit in the existing segments, else a new segment. Caller holds the write lock."""
        with self._lock:
            self._core.check_open()
            for segment in self._core.segments:
                if segment.space.largest_free_bytes >= extent_bytes:
                    offset, run_bytes = segment.space.allocate_run(extent_bytes)
                    return segment, offset, run_bytes
            unallocated = self._core.budget_bytes - self._core.segment_bytes_total
            if extent_bytes + HEADER_BYTES > unallocated:
                stats = self._core.stats_locked()
                raise CapacityError(
                    f"no room for a {extent_bytes}-byte record in the NVMe tier: "
                    f"{stats.free_bytes} bytes free, largest chunk that fits "
                    f"{stats.largest_free_bytes}")
            size = min(self._new_segment_bytes(extent_bytes), unallocated)
            seg_id = self._core.next_segment_id
            self._core.next_segment_id += 1
            seq = self._core.take_seq_locked()
            self._core.segment_bytes_total += size  # reserved while the file is made
        reserved = size
        try:
            size = self._fit_to_filesystem(size, extent_bytes)
            with self._lock:
                self._core.segment_bytes_total -= reserved - size
                reserved = size
            segment = self._create_segment(seg_id, size, seq)
        except BaseException:
            with self._lock:
                self._core.segment_bytes_total -= reserved
            raise
        with self._lock:
            self._core.segments.append(segment)
            offset, run_bytes = segment.space.allocate_run(extent_bytes)
            return segment, offset, run_bytes

    def _fit_to_filesystem(self, size_bytes: int, extent_bytes: int) -> int:
        """``size_bytes``, or fewer whole records of ``extent_bytes`` when the filesystem has
        less room left (other files may have filled it since open). Raises ``DiskFull``,
        before writing anything, when not even one record fits. ``SPARSE`` segments reserve
        nothing, so they are not cut (a full filesystem surfaces mid-write there)."""
        if self._config.preallocation is Preallocation.SPARSE:
            return size_bytes
        try:
            free = align_down(filesystem_free_bytes(self._dir))
        except OSError as exc:
            raise os_error(exc, f"measuring the free space under {self._dir}") from exc
        if free >= size_bytes:
            return size_bytes
        records = max(0, free - HEADER_BYTES) // extent_bytes
        if records < 1:
            raise DiskFull(f"no room for a new segment of the NVMe tier {self._dir}: the "
                           f"filesystem has {free} bytes free, a {extent_bytes}-byte record "
                           f"needs {HEADER_BYTES + extent_bytes}")
        fitted = HEADER_BYTES + records * extent_bytes
        log.warning("NVMe tier %s: the filesystem has only %d bytes free; the new segment gets "
                    "%d bytes instead of %d", self._dir, free, fitted, size_bytes)
        return fitted

    def _new_segment_bytes(self, extent_bytes: int) -> int:
        """Size of a segment created for a record of ``extent_bytes``.

        A whole number of such records (the one nearest ``segment_bytes``, at least one)
        plus the segment header: with uniform chunk sizes, the usual KV-cache case, no
        segment ends in a run too short for another chunk (256 MiB segments of 64 MiB chunks
        would otherwise waste a quarter of the disk).
        """
        records = max(1, round((self._config.segment_bytes - HEADER_BYTES) / extent_bytes))
        return HEADER_BYTES + records * extent_bytes

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
        if self.pipelined(view.nbytes):
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

    def _give_back_after_failed_write(self, rec: Record) -> None:
        """Free the extent of a failed write behind a FREE header (caller holds the write lock).

        The FREE header makes sure a half-written LIVE header cannot resurface at the next
        open. If even that write fails, the disk may still hold, at the failed record's place,
        the FREE header of the whole run it was cut from; a later record put into the rest of
        that run would be hidden behind it from the next open's scan. So the extent *and the
        rest of its free run* are claimed back (quarantined) until the tier is reopened, and
        the recovery scan sorts them out (``docs/nvme-tier.md``, "Quarantine").
        """
        segment = rec.segment
        assert segment is not None
        with self._lock:
            start, run = segment.space.free_run(rec.offset)
            seq = self._core.take_seq_locked()
        free_len = start + run - rec.offset
        try:
            self.write_header(segment.fd, RecordHeader(RecordKind.FREE, segment.id, rec.offset,
                                                       free_len, seq))
        except OSError as exc:
            with self._lock:
                # Take the extent and everything a stale header there may cover back out of
                # the free space: nothing may be written where the next scan would hop over it.
                segment.space.claim(rec.offset, free_len)
                self._core.quarantined_bytes += free_len
            log.error("NVMe tier %s: could not clear the failed record at %s+%d (%s); it and "
                      "the rest of its free run, %d bytes, are quarantined until the tier is "
                      "reopened", self._dir, segment.path.name, rec.offset, exc, free_len)
        rec.segment = None

    def _create_segment(self, seg_id: int, size_bytes: int, seq: int) -> Segment:
        """Make, preallocate and publish one segment file (tmp name, fsync, rename, fsync dir)."""
        final = self._dir / SEGMENT_NAME.format(seg_id)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        try:
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | open_flags(self._io_mode), 0o644)
        except OSError as exc:
            raise os_error(exc, f"creating segment {tmp.name}") from exc
        try:
            self.preallocate(fd, 0, size_bytes)
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
            fsync_directory(self._dir)
        except OSError as exc:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise os_error(exc, f"creating segment {final.name} of {size_bytes} bytes") from exc
        log.info("NVMe tier %s: created segment %s (%d bytes, %s)", self._dir, final.name,
                 size_bytes, self._config.preallocation.value)
        return Segment(seg_id, final, fd, size_bytes, segment_space(size_bytes))

    def preallocate(self, fd: int, start: int, end: int) -> None:
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

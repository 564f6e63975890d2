"""The NVMe tier's recovery: rebuilding the index of a directory's segment files at open.

Each segment's header chain is scanned (:func:`~kvstore.dataplane.nvme.scan.scan_segment`,
several segments at once: a scan is a chain of dependent 4 KiB reads, so latency-bound). LIVE
records rebuild the index ``key -> (segment, offset, size, checksum, metadata, owner)``
(a record of format version 1 has no owner: ``b""``). A torn or corrupt
header is reported and skipped (the scan resyncs to the next valid header), a record running
past a truncated file is dropped, duplicates of one key keep the highest sequence number, and
the ``open_verify_newest`` newest records (the only ones a crash can have left half written)
have their payload checksum verified. Each segment's allocator then claims the records kept,
so exactly the gaps between them are free; gaps the chain did not cross intact get a fresh
FREE header, a damaged segment header is rewritten and a truncated file re-extended.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from kvstore.dataplane.nvme.config import MIN_SEGMENT_BYTES, OpenVerify
from kvstore.dataplane.nvme.core import (
    SEGMENT_RE,
    TMP_SUFFIX,
    Record,
    RecordState,
    Segment,
    TierCore,
    fsync_directory,
    os_error,
    segment_space,
)
from kvstore.dataplane.nvme.directio import (
    ALIGN_BYTES,
    AlignedBuffer,
    align_down,
    open_flags,
    preadv_all,
    pwritev_all,
)
from kvstore.dataplane.nvme.format import (
    RecordHeader,
    RecordKind,
    SegmentHeader,
    decode_segment_header,
)
from kvstore.dataplane.nvme.read import ReadPath
from kvstore.dataplane.nvme.scan import SegmentScan, scan_segment
from kvstore.dataplane.nvme.write import WritePath
from kvstore.dataplane.tier import ChunkKey
from kvstore.errors import ChunkCorrupt, ConfigError

log = logging.getLogger(__name__)

_SCAN_THREADS = 8
"""Segments scanned (and records verified) in parallel at open."""


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :meth:`~kvstore.dataplane.nvme.tier.NvmeTier.open` found and repaired."""

    segments: int
    chunks: int
    invalid_headers: int
    """Places where the header chain was broken (torn/corrupt header): resynced."""
    corrupt_headers: int
    """Of ``invalid_headers``, headers with the record magic whose own checksum failed: damaged
    in place. Whatever chunk such a header described is lost."""
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

    @property
    def corrupt_found(self) -> int:
        """Corruption found at open: payloads that failed their checksum plus damaged headers.
        The tier reports it as ``TierStats.corrupt_at_open`` (the daemon's corrupt counter)."""
        return self.corrupt_dropped + self.corrupt_headers


def recover(core: TierCore, reader: ReadPath, writer: WritePath) -> RecoveryReport:
    """Scan ``core.directory`` and fill the core's index and segments (once, before the tier
    is shared). Raises ConfigError (segments beyond the capacity), StorageError."""
    return Recovery(core, reader, writer).run()


class Recovery:
    """One open's recovery (:func:`recover`)."""

    def __init__(self, core: TierCore, reader: ReadPath, writer: WritePath) -> None:
        self._core = core
        self._reader = reader
        self._writer = writer
        self._config = core.config
        self._dir = core.directory

    def run(self) -> RecoveryReport:
        """Scan the directory and rebuild the index (once, by :func:`recover`)."""
        core = self._core
        started = time.monotonic()
        for leftover in self._dir.glob("seg-*" + TMP_SUFFIX):
            log.warning("NVMe tier %s: removing unfinished segment file %s", self._dir,
                        leftover.name)
            leftover.unlink(missing_ok=True)
        found: list[tuple[int, Path]] = []
        for path in self._dir.iterdir():
            match = SEGMENT_RE.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        found.sort()
        scans: list[tuple[Segment, SegmentScan, bool]] = []
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
                core.segments.append(segment)  # so close() closes its fd on a later error
                core.segment_bytes_total += segment.size_bytes
                core.next_segment_id = max(core.next_segment_id, seg_id + 1)
        if error is not None:
            raise error
        if core.segment_bytes_total > core.budget_bytes:
            raise ConfigError(
                f"{self._dir} holds {core.segment_bytes_total} bytes of segments, more than "
                f"capacity_bytes={core.budget_bytes}: raise the capacity or empty the "
                f"directory")
        core.next_seq = max((scan.max_seq for _, scan, _ in scans), default=0) + 1

        # Keep the newest record of each key.
        best: dict[bytes, tuple[RecordHeader, Segment]] = {}
        duplicates = 0
        for segment, scan, _ in scans:
            for header in scan.live:
                other = best.get(header.key)
                if other is not None:
                    duplicates += 1
                    if other[0].seq > header.seq:
                        continue
                best[header.key] = (header, segment)
        records = {key: Record(ChunkKey(key), seg, h.offset, h.payload_bytes, h.payload_xxh3,
                                h.seq, RecordState.LIVE, h.meta, h.owner)
                   for key, (h, seg) in best.items()}

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
        by_segment: dict[int, list[Record]] = {}
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
        core.index = {ChunkKey(k): r for k, r in records.items()}
        core.live_chunks = len(records)
        report = RecoveryReport(
            segments=len(scans), chunks=len(records),
            invalid_headers=sum(s.invalid_headers for _, s, _ in scans),
            corrupt_headers=sum(s.corrupt_headers for _, s, _ in scans),
            torn_records=sum(s.torn_records for _, s, _ in scans),
            corrupt_dropped=corrupt, duplicates_dropped=duplicates,
            damaged_segment_headers=damaged, repaired_gaps=repaired,
            verified_records=len(to_verify), elapsed_s=time.monotonic() - started)
        core.corrupt_at_open = report.corrupt_found
        problems = (report.invalid_headers + report.torn_records + report.corrupt_dropped
                    + report.duplicates_dropped + report.damaged_segment_headers)
        (log.warning if problems else log.info)(
            "NVMe tier %s opened (%s I/O: %s): %s", self._dir, core.io_mode.value,
            core.io_mode_reason, report)
        return report

    def _verify_at_open(self, rec: Record) -> str | None:
        """Read and check one record's payload; the reason it is corrupt, or None."""
        try:
            self._reader.transfer_in(rec, None)
        except ChunkCorrupt as exc:
            return str(exc)
        except OSError as exc:
            raise os_error(exc, f"verifying chunk {rec.key.hex()} at open") from exc
        return None

    def _open_segment(self, seg_id: int, path: Path) -> tuple[Segment, SegmentScan, bool] | None:
        """Open and scan one segment file (None: it was unusable and has been removed)."""
        core = self._core
        window = core.blocks.acquire()
        try:
            return self._open_and_scan(seg_id, path, window)
        finally:
            core.blocks.release(window)

    def _open_and_scan(self, seg_id: int, path: Path, window: AlignedBuffer,
                       ) -> tuple[Segment, SegmentScan, bool] | None:
        core = self._core
        try:
            fd = os.open(path, open_flags(core.io_mode))
        except OSError as exc:
            raise os_error(exc, f"opening segment {path.name}") from exc
        try:
            file_bytes = os.fstat(fd).st_size
            block = window.view[:ALIGN_BYTES]
            got = preadv_all(fd, [block], 0)
            header = decode_segment_header(block) if got == ALIGN_BYTES else None
            del block
            header_ok = header is not None and header.segment_id == seg_id
            size = header.segment_bytes if header is not None and header_ok \
                else align_down(file_bytes)
            if size < MIN_SEGMENT_BYTES:
                log.warning("NVMe tier %s: segment %s has no usable header and %d bytes; "
                            "removing it", self._dir, path.name, file_bytes)
                os.close(fd)
                path.unlink()
                fsync_directory(self._dir)
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
            raise os_error(exc, f"scanning segment {path.name}") from exc
        except BaseException:
            os.close(fd)
            raise
        return Segment(seg_id, path, fd, size, segment_space(size)), scan, header_ok

    def _repair_segment(self, segment: Segment, scan: SegmentScan, header_ok: bool,
                        dirty: list[tuple[int, int]]) -> None:
        """Re-extend a truncated file, rewrite a damaged header, stamp FREE over dirty gaps."""
        core = self._core
        fd = segment.fd
        try:
            if scan.file_bytes < segment.size_bytes:
                log.warning("NVMe tier %s: segment %s is truncated at %d of %d bytes; "
                            "re-extending it", self._dir, segment.path.name, scan.file_bytes,
                            segment.size_bytes)
                self._writer.preallocate(fd, align_down(scan.file_bytes), segment.size_bytes)
            if not header_ok:
                buf = core.small.acquire()
                try:
                    SegmentHeader(segment.id, segment.size_bytes).encode_into(
                        buf.view[:ALIGN_BYTES])
                    pwritev_all(fd, [buf.view[:ALIGN_BYTES]], 0)
                finally:
                    core.small.release(buf)
            for offset, size in dirty:
                self._writer.write_header(fd, RecordHeader(
                    RecordKind.FREE, segment.id, offset, size, core.take_seq_locked()))
            os.fsync(fd)
        except OSError as exc:
            raise os_error(exc, f"repairing segment {segment.path.name}") from exc

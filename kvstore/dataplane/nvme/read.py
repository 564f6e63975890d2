"""The NVMe tier's read path: a record's payload into the caller's memory, checksummed.

The payload is read with ``os.preadv`` (the GIL is released): straight into the caller's
buffer when it is 4 KiB-aligned (O_DIRECT; a partial last block through a bounce block),
otherwise through reused aligned bounce buffers with one copy. Chunks larger than
``io_block_bytes`` are read in pieces on the core's I/O threads (``io_threads`` in flight)
while the calling thread hashes the pieces already read. The payload's xxh3_64 must match on
every read; the header block is not re-read (the 64-bit payload checksum already tells a
wrong or stale extent). What to do with a corrupt chunk is the tier's business
(:meth:`~kvstore.dataplane.nvme.tier.NvmeTier.get_into`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import xxhash

from kvstore.dataplane.arena import copy_bytes
from kvstore.dataplane.nvme.core import Record, TierCore
from kvstore.dataplane.nvme.directio import (
    ALIGN_BYTES,
    IoMode,
    align_down,
    align_up,
    is_aligned,
    preadv_all,
)
from kvstore.dataplane.nvme.format import HEADER_BYTES
from kvstore.errors import ChunkCorrupt


class ReadPath:
    """Reads records of one tier. Thread-safe: any number of reads run at once; each takes
    its buffers from the core's pools."""

    def __init__(self, core: TierCore) -> None:
        # Fixed for the tier's life:
        self._config = core.config
        self._io_mode = core.io_mode
        self._blocks = core.blocks
        self._small = core.small
        self._window = core.window
        self._pool_get = core.pool_get

    def transfer_in(self, rec: Record, dst: memoryview | None) -> None:
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

    def _read_direct(self, rec: Record, fd: int, dst: memoryview) -> int:
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

    def _read_bounced(self, rec: Record, fd: int, dst: memoryview | None) -> int:
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

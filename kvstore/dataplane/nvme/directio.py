"""Aligned buffers and O_DIRECT file I/O for the NVMe tier.

O_DIRECT moves bytes between the device and user memory without the page cache, so a
read really comes from the disk and a write does not evict the host's working set. Linux
asks three things of every O_DIRECT transfer: the file offset, the length and the memory
address of each buffer are multiples of the device's logical block size. kvtier uses
:data:`ALIGN_BYTES` (4 KiB), which satisfies 512-byte and 4 KiB-sector devices alike.

* :class:`AlignedBuffer` is anonymous ``mmap`` memory: page-aligned by construction and
  pre-touched once, so reusing it costs no page faults.
* :class:`BufferPool` hands out buffers of one size and takes them back: the hot paths
  reuse bounce buffers instead of allocating one per call.
* :func:`probe_io_mode` finds out whether a directory's filesystem takes O_DIRECT by trying
  it (open *and* an aligned write and read back): tmpfs on older kernels and some network
  filesystems refuse it, and the tier then runs the same on-disk format with buffered I/O.
* :func:`pwritev_all` / :func:`preadv_all` loop over short transfers. ``os.pwritev`` and
  ``os.preadv`` release the GIL, so transfers on several threads proceed in parallel.

Errors here are ``OSError`` (the caller, which knows what it was doing, translates them
into :mod:`kvstore.errors`), except :class:`BufferPool` misuse, which is a bug.
"""

from __future__ import annotations

import enum
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.dataplane.arena import buffer_address
from kvstore.errors import InvalidArgument, InvariantViolation

ALIGN_BYTES = 4096
"""Offset, length and address alignment of every O_DIRECT transfer kvtier makes."""

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
"""0 where the platform has no O_DIRECT (then only buffered mode is available)."""

_MAX_IO_BYTES = 0x7FFFF000
"""Linux transfers at most this many bytes per read/write system call."""


class IoMode(enum.Enum):
    """How segment files are read and written."""

    DIRECT = "direct"
    """O_DIRECT: aligned transfers between the device and user memory, no page cache."""
    BUFFERED = "buffered"
    """Through the page cache (filesystems without O_DIRECT); durability still by fdatasync."""


def align_up(size_bytes: int, alignment_bytes: int = ALIGN_BYTES) -> int:
    """Round up to a multiple of ``alignment_bytes`` (a power of two)."""
    return (size_bytes + alignment_bytes - 1) & ~(alignment_bytes - 1)


def align_down(size_bytes: int, alignment_bytes: int = ALIGN_BYTES) -> int:
    """Round down to a multiple of ``alignment_bytes`` (a power of two)."""
    return size_bytes & ~(alignment_bytes - 1)


def is_aligned(view: memoryview, alignment_bytes: int = ALIGN_BYTES) -> bool:
    """True when the view's first byte sits at a multiple of ``alignment_bytes``."""
    return view.nbytes > 0 and buffer_address(view) % alignment_bytes == 0


class AlignedBuffer:
    """``size_bytes`` (rounded up to a page) of zeroed, page-aligned, pre-touched anonymous memory.

    The constructor maps and touches the memory (that is its one effect); :meth:`close`
    unmaps it. ``view`` is a writable flat byte view of exactly ``size_bytes``; views
    derived from it must be released before :meth:`close` (Python refuses to unmap
    exported memory and :meth:`close` then leaves the unmap to the garbage collector).
    """

    __slots__ = ("_mmap", "_size_bytes", "view")

    def __init__(self, size_bytes: int) -> None:
        if size_bytes <= 0:
            raise InvalidArgument(f"buffer size must be positive, got {size_bytes}")
        self._size_bytes = size_bytes
        self._mmap = mmap.mmap(-1, align_up(size_bytes, mmap.PAGESIZE),
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Touch every page now: a first write into fresh memory runs at a fraction of
        # memcpy speed (page faults), and the hot paths must not pay for it.
        touch = np.frombuffer(self._mmap, dtype=np.uint8)
        touch[:: mmap.PAGESIZE] = 0
        del touch
        self.view = memoryview(self._mmap)[:size_bytes]

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    def close(self) -> None:
        """Unmap the memory. Idempotent."""
        try:
            self.view.release()
            self._mmap.close()
        except BufferError:  # a caller still holds a derived view: the GC unmaps later
            return


class BufferPool:
    """A thread-safe free list of :class:`AlignedBuffer` of one size.

    :meth:`acquire` reuses a returned buffer or maps a new one (so a pool never blocks);
    :meth:`release` keeps up to ``max_cached`` buffers and unmaps the rest. Buffers are
    created lazily: an unused pool holds no memory.
    """

    def __init__(self, buffer_bytes: int, max_cached: int) -> None:
        if buffer_bytes <= 0 or buffer_bytes % ALIGN_BYTES:
            raise InvalidArgument(f"pool buffer size must be a positive multiple of "
                                  f"{ALIGN_BYTES}, got {buffer_bytes}")
        self._buffer_bytes = buffer_bytes
        self._max_cached = max_cached
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def buffer_bytes(self) -> int:
        return self._buffer_bytes

    def acquire(self) -> AlignedBuffer:
        with self._lock:
            if self._closed:
                raise InvariantViolation("acquire from a closed buffer pool")
            if self._free:
                return self._free.pop()
        return AlignedBuffer(self._buffer_bytes)

    def release(self, buf: AlignedBuffer) -> None:
        if buf.size_bytes != self._buffer_bytes:
            raise InvariantViolation("buffer returned to a pool of another size")
        with self._lock:
            if not self._closed and len(self._free) < self._max_cached:
                self._free.append(buf)
                return
        buf.close()

    def close(self) -> None:
        """Unmap every cached buffer; buffers still out are unmapped when released."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for buf in free:
            buf.close()


def open_flags(mode: IoMode) -> int:
    """``os.open`` flags for a segment file opened read-write in ``mode``."""
    flags = os.O_RDWR | os.O_CLOEXEC
    return flags | O_DIRECT if mode is IoMode.DIRECT else flags


def probe_io_mode(directory: Path, existing_file: Path | None = None) -> tuple[IoMode, str]:
    """Find out whether ``directory``'s filesystem takes O_DIRECT; return the mode and why.

    With ``existing_file`` (a file of at least 4 KiB in ``directory``) the probe only opens
    it with O_DIRECT and reads its first block, so it works on a full filesystem.
    Otherwise it writes, syncs, reads back and deletes one aligned 4 KiB probe file.
    ``EINVAL`` (or ``EOPNOTSUPP``) from the open or a transfer means no O_DIRECT; any other
    ``OSError`` propagates (the directory is unusable either way).
    """
    if not O_DIRECT:
        return IoMode.BUFFERED, "the platform has no O_DIRECT"
    buf = AlignedBuffer(ALIGN_BYTES)
    try:
        if existing_file is not None:
            return _probe_read(existing_file, buf)
        return _probe_write(directory, buf)
    finally:
        buf.close()


def _refused(exc: OSError) -> bool:
    return exc.errno in (errno.EINVAL, errno.EOPNOTSUPP)


def _probe_read(path: Path, buf: AlignedBuffer) -> tuple[IoMode, str]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | O_DIRECT)
    except OSError as exc:
        if _refused(exc):
            return IoMode.BUFFERED, f"O_DIRECT open refused ({exc.strerror})"
        raise
    try:
        os.preadv(fd, [buf.view], 0)
    except OSError as exc:
        if _refused(exc):
            return IoMode.BUFFERED, f"O_DIRECT read refused ({exc.strerror})"
        raise
    finally:
        os.close(fd)
    return IoMode.DIRECT, f"O_DIRECT aligned read of {path.name} succeeded"


def _probe_write(directory: Path, buf: AlignedBuffer) -> tuple[IoMode, str]:
    path = directory / f".kvtier-odirect-probe-{os.getpid()}-{threading.get_ident()}"
    buf.view[:16] = b"kvtier-probe-ok!"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | open_flags(IoMode.DIRECT), 0o600)
    except OSError as exc:
        if _refused(exc):
            return IoMode.BUFFERED, f"O_DIRECT open refused ({exc.strerror})"
        raise
    try:
        os.pwrite(fd, buf.view, 0)
        os.fdatasync(fd)
        buf.view[:16] = bytes(16)
        if os.preadv(fd, [buf.view], 0) != ALIGN_BYTES \
                or bytes(buf.view[:16]) != b"kvtier-probe-ok!":
            return IoMode.BUFFERED, "O_DIRECT read-back did not match"
    except OSError as exc:
        if _refused(exc):
            return IoMode.BUFFERED, f"O_DIRECT transfer refused ({exc.strerror})"
        raise
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return IoMode.DIRECT, "O_DIRECT aligned write and read-back succeeded"


def _advance(buffers: Sequence[Any], done: int) -> list[memoryview]:
    """The part of ``buffers`` (a list of byte views) not yet transferred after ``done`` bytes."""
    rest: list[memoryview] = []
    for b in buffers:
        view = b if isinstance(b, memoryview) else memoryview(b)
        if done >= view.nbytes:
            done -= view.nbytes
            continue
        rest.append(view[done:] if done else view)
        done = 0
    return rest


def _clip(buffers: list[memoryview], limit: int) -> list[memoryview]:
    """At most ``limit`` bytes of ``buffers`` (one system call's worth)."""
    out: list[memoryview] = []
    for view in buffers:
        if limit <= 0:
            break
        out.append(view if view.nbytes <= limit else view[:limit])
        limit -= view.nbytes
    return out


def pwritev_all(fd: int, buffers: Sequence[Any], offset: int) -> int:
    """Write every byte of ``buffers`` at ``offset``, looping over short writes; return the count.

    A write that makes no progress raises ``OSError(ENOSPC)`` (what a short write at a full
    filesystem means).
    """
    pending = _advance(buffers, 0)
    total = sum(v.nbytes for v in pending)
    done = 0
    while done < total:
        chunk = _clip(pending, _MAX_IO_BYTES)
        n = os.pwritev(fd, chunk, offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n
        pending = _advance(pending, n)
    return done


def preadv_all(fd: int, buffers: Sequence[Any], offset: int) -> int:
    """Fill ``buffers`` from ``offset``, looping over short reads; return the count (less at EOF)."""
    pending = _advance(buffers, 0)
    total = sum(v.nbytes for v in pending)
    done = 0
    while done < total:
        n = os.preadv(fd, _clip(pending, _MAX_IO_BYTES), offset + done)
        if n <= 0:
            break
        done += n
        pending = _advance(pending, n)
    return done

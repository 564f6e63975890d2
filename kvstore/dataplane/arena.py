"""The shared-memory arena: one pre-touched POSIX shared-memory mapping per DRAM tier.

This module is the one place that opens, maps, pre-faults, pins (through
:mod:`kvstore.dataplane.cuda`) and unmaps host memory, and the one place that turns
caller buffers (bytes, numpy, torch CPU tensors...) into flat byte views.

Lifecycle and ownership
    * :meth:`ShmArena.create` makes ``/dev/shm/<name>``, reserves its pages with
      ``posix_fallocate`` (so a full ``/dev/shm`` is an error at start, never a
      ``SIGBUS`` mid-copy), maps it shared and pre-faults every page
      (``MADV_POPULATE_WRITE``; a numpy page-stride write on kernels without it).
      The creating process **owns** the segment and unlinks it on :meth:`close`
      (or at interpreter exit if never closed). A ``SIGKILL`` leaves the segment
      behind; :func:`remove_stale_arenas` sweeps segments of dead processes.
    * Who may map it: the segment is created ``0600`` (only the daemon's uid can open it;
      a process of another user cannot map it at all). With ``group`` it is handed to that
      group and made ``0660`` (``group_access=READ_WRITE``: same-host clients of the group
      write reserved slots in place) or ``0640`` (``READ_ONLY``), set with ``fchown`` /
      ``fchmod`` on the new descriptor before any byte is written, so the umask changes
      nothing and no other mode is ever visible. A process that may map an arena can read
      every chunk in it, of every tenant: keep tenant groups that must not see each other in
      separate arenas (one per group: :class:`~kvstore.dataplane.dram.GroupedDramTier`, each
      handed to its group's gid).
    * :meth:`ShmArena.attach` maps an existing arena read-only (the default) or
      read-write from another local process; it never unlinks.
    * Views handed out (:meth:`view`) keep the mapping alive: if any is still
      referenced at :meth:`close`, the unmap is left to the last view's release
      (Python's buffer protocol refuses to unmap exported memory), so a stale view
      never points at unmapped memory. The name is unlinked at once regardless.

Pinning
    With ``PinMode.AUTO`` the arena is registered with ``cudaHostRegister`` when a
    CUDA device exists (so GPU copies to and from it are DMA at full PCIe/NVLink
    speed) and left unpinned with a log line otherwise. ``PinMode.REQUIRE`` raises
    ``TierUnavailable`` without a GPU.

Threads
    An arena has no lock: the tier that owns it serialises allocation. Copies into
    disjoint ranges may run concurrently; :func:`copy_bytes` releases the GIL for
    large copies so they really do.
"""

from __future__ import annotations

import enum
import errno
import logging
import mmap
import os
import re
import secrets
import time
import weakref
from typing import Any

import numpy as np

from kvstore.dataplane import cuda
from kvstore.errors import CapacityError, InvalidArgument, StorageError, TierUnavailable

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
ARENA_PREFIX = "kvtier-"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_STALE_RE = re.compile(r"^kvtier-(\d+)-[0-9a-f]+$")

PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux >= 5.14: fault every page of the range in, writable, in one system call."""

GIL_RELEASE_COPY_BYTES = 256 << 10
"""Copies at least this big go through numpy ``copyto``, which releases the GIL (two
threads copy in parallel); smaller ones use memoryview slice assignment, ~4x less
per-call overhead (0.4 vs 1.6 µs) but holding the GIL. Same bandwidth either way."""


class ArenaAccess(enum.Enum):
    """How :meth:`ShmArena.attach` maps an existing arena."""

    READ_ONLY = "ro"
    READ_WRITE = "rw"


class PinMode(enum.Enum):
    """Whether to register the arena with CUDA as pinned host memory."""

    AUTO = "auto"
    """Pin when a CUDA device exists; otherwise log and continue unpinned."""
    REQUIRE = "require"
    """Pin or raise TierUnavailable."""
    OFF = "off"


def default_arena_name() -> str:
    """``kvtier-<pid>-<random>``: unique, and tells :func:`remove_stale_arenas` the owner."""
    return f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"


def arena_mode(group: int | None, group_access: ArenaAccess = ArenaAccess.READ_WRITE) -> int:
    """The file mode of a new arena: ``0600``; with a group ``0660`` or ``0640``. Raises
    InvalidArgument for a bad gid."""
    if group is None:
        return 0o600
    if not isinstance(group, int) or isinstance(group, bool) or group < 0:
        raise InvalidArgument(f"arena group must be a gid (int >= 0), got {group!r}")
    return 0o660 if group_access is ArenaAccess.READ_WRITE else 0o640


def _shm_path(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidArgument(f"bad shared-memory arena name {name!r} (letters, digits, '._-')")
    if not os.path.isdir(SHM_DIR):
        raise TierUnavailable(f"{SHM_DIR} does not exist: no POSIX shared memory here")
    return os.path.join(SHM_DIR, name)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        log.warning("shared-memory arena %s was already unlinked by someone else", path)


def _unlink_if_creator(path: str, creator_pid: int) -> None:
    # A forked child inherits the finalizer (and runs it at its own exit): only the
    # creating process may unlink, or a child's exit would pull the arena's name away.
    if os.getpid() == creator_pid:
        _unlink_quietly(path)


class ShmArena:
    """One shared-memory mapping. Build with :meth:`create` or :meth:`attach`, not directly."""

    def __init__(
        self,
        *,
        name: str,
        mapping: mmap.mmap,
        access: ArenaAccess,
        owner: bool,
        prefault_s: float | None,
    ) -> None:
        """Wrap an already-made mapping; no I/O. Use :meth:`create` / :meth:`attach`."""
        self._name = name
        self._mmap: mmap.mmap | None = mapping
        self._access = access
        self._owner = owner
        self._prefault_s = prefault_s
        self._size_bytes = len(mapping)
        # Both exports come straight from the mapping (not one from the other), so
        # close() can release each without tripping over the other's export.
        buffer = memoryview(mapping)
        self._buffer: memoryview = (
            buffer if access is ArenaAccess.READ_WRITE else buffer.toreadonly()
        )
        self._array: np.ndarray = np.frombuffer(mapping, dtype=np.uint8)
        self._address = int(self._array.ctypes.data)
        self._pinned = False
        self._finalizer = (
            weakref.finalize(self, _unlink_if_creator, os.path.join(SHM_DIR, name), os.getpid())
            if owner
            else None
        )

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        size_bytes: int,
        *,
        name: str | None = None,
        prefault: bool = True,
        pin: PinMode = PinMode.AUTO,
        group: int | None = None,
        group_access: ArenaAccess = ArenaAccess.READ_WRITE,
    ) -> ShmArena:
        """Create, reserve, map and pre-fault a new arena of ``size_bytes`` (page-rounded).

        Mode ``0600``; with ``group`` (a gid) the segment belongs to that group and is ``0660``
        (``group_access`` READ_WRITE) or ``0640`` (READ_ONLY): module docstring.

        Raises ``InvalidArgument`` (bad size, name or group, or the name exists),
        ``CapacityError`` (``/dev/shm`` lacks the room), ``TierUnavailable`` (no
        ``/dev/shm``; or ``PinMode.REQUIRE`` without a GPU).
        """
        if not isinstance(size_bytes, int) or size_bytes < 1:
            raise InvalidArgument(f"arena size must be a positive int, got {size_bytes!r}")
        size_bytes = -(-size_bytes // PAGE_BYTES) * PAGE_BYTES
        name = default_arena_name() if name is None else name
        path = _shm_path(name)
        if pin is PinMode.REQUIRE and not cuda.cuda_available():
            raise TierUnavailable("PinMode.REQUIRE but no CUDA device is available")
        mode = arena_mode(group, group_access)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except FileExistsError as exc:
            raise InvalidArgument(f"shared-memory arena {name!r} already exists") from exc
        except OSError as exc:
            raise StorageError(f"cannot create {path}: {exc}") from exc
        arena: ShmArena | None = None
        try:
            try:
                if group is not None:
                    os.fchown(fd, -1, group)
                os.fchmod(fd, mode)  # explicit: the umask only ever narrows O_CREAT's mode
            except OSError as exc:
                raise StorageError(f"cannot give {path} to group {group} with mode "
                                   f"{mode:#o}: {exc}") from exc
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                    raise CapacityError(
                        f"{SHM_DIR} has no room for a {size_bytes}-byte arena: {exc}"
                    ) from exc
                raise StorageError(f"cannot reserve {size_bytes} bytes in {path}: {exc}") from exc
            mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            started = time.perf_counter()
            if prefault:
                _prefault(mapping)
            prefault_s = time.perf_counter() - started if prefault else None
            arena = cls(
                name=name,
                mapping=mapping,
                access=ArenaAccess.READ_WRITE,
                owner=True,
                prefault_s=prefault_s,
            )
            if pin is not PinMode.OFF:
                arena._pinned = cuda.host_register(arena._buffer)
            return arena
        except BaseException:
            if arena is not None:
                arena.close()
            else:
                _unlink_quietly(path)
            raise
        finally:
            os.close(fd)  # the mapping keeps the segment alive

    @classmethod
    def attach(
        cls, name: str, *, access: ArenaAccess = ArenaAccess.READ_ONLY, pin: PinMode = PinMode.OFF
    ) -> ShmArena:
        """Map an existing arena made by another process (or this one). Never unlinks it.

        Raises ``InvalidArgument`` when no arena has that name.
        """
        path = _shm_path(name)
        flags = os.O_RDONLY if access is ArenaAccess.READ_ONLY else os.O_RDWR
        try:
            fd = os.open(path, flags | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise InvalidArgument(f"no shared-memory arena named {name!r}") from exc
        except OSError as exc:
            raise StorageError(f"cannot open {path}: {exc}") from exc
        try:
            size_bytes = os.fstat(fd).st_size
            if size_bytes == 0:
                raise InvalidArgument(f"shared-memory arena {name!r} is empty")
            # ACCESS_READ maps PROT_READ *and* exports a read-only buffer (a PROT_READ
            # mapping made with prot= would export a writable one that segfaults on write).
            mode = mmap.ACCESS_READ if access is ArenaAccess.READ_ONLY else mmap.ACCESS_WRITE
            mapping = mmap.mmap(fd, size_bytes, access=mode)
        finally:
            os.close(fd)
        arena = cls(name=name, mapping=mapping, access=access, owner=False, prefault_s=None)
        if pin is not PinMode.OFF:
            if pin is PinMode.REQUIRE and not cuda.cuda_available():
                arena.close()
                raise TierUnavailable("PinMode.REQUIRE but no CUDA device is available")
            arena._pinned = cuda.host_register(
                arena._buffer, read_only=access is ArenaAccess.READ_ONLY
            )
        return arena

    # --- properties ---------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The POSIX shared-memory name other local processes pass to :meth:`attach`."""
        return self._name

    @property
    def size_bytes(self) -> int:
        return self._size_bytes

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def access(self) -> ArenaAccess:
        return self._access

    @property
    def pinned(self) -> bool:
        """True when registered with CUDA as pinned host memory."""
        return self._pinned

    @property
    def prefault_s(self) -> float | None:
        """Seconds spent pre-faulting at creation (None when attached or not pre-faulted)."""
        return self._prefault_s

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def view(self, offset: int, size_bytes: int, *, readonly: bool = True) -> memoryview:
        """A zero-copy view of ``[offset, offset + size_bytes)``. Bounds-checked."""
        self._check_range(offset, size_bytes)
        view = self._buffer[offset : offset + size_bytes]
        if readonly and not view.readonly:
            return view.toreadonly()
        if not readonly and view.readonly:
            raise InvalidArgument(f"arena {self._name!r} is attached read-only")
        return view

    def array(self, offset: int, size_bytes: int) -> np.ndarray:
        """A zero-copy uint8 numpy view of a range (writable when the arena is)."""
        self._check_range(offset, size_bytes)
        return self._array[offset : offset + size_bytes]

    def _check_range(self, offset: int, size_bytes: int) -> None:
        if self._mmap is None:
            raise TierUnavailable(f"arena {self._name!r} is closed")
        if offset < 0 or size_bytes < 0 or offset + size_bytes > self._size_bytes:
            raise InvalidArgument(
                f"range [{offset}, {offset + size_bytes}) outside arena of {self._size_bytes} bytes"
            )

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Unpin, unmap and (when owner) unlink. Idempotent.

        Views still referenced elsewhere keep the pages mapped until they are released.
        Closing must not race a GPU copy in flight to or from the arena: the range is
        unregistered from CUDA here, and a DMA still using it would be undefined.
        """
        mapping = self._mmap
        if mapping is None:
            return
        self._mmap = None
        if self._pinned:
            cuda.host_unregister(self._address)
            self._pinned = False
        # Drop our own exports of the mapping, then try to unmap.
        self._array = np.empty(0, dtype=np.uint8)
        try:
            self._buffer.release()
        except BufferError:
            # Something still holds an export of our whole-arena view (a pinned tensor
            # slice in a copy in flight): it keeps the mapping alive until it is dropped.
            log.debug("arena %s: whole-arena view still exported at close", self._name)
        try:
            mapping.close()
        except BufferError:
            # Views handed out are still alive; the mapping is unmapped when the last goes.
            log.debug("arena %s: views outstanding at close; unmap deferred to them", self._name)
        if self._finalizer is not None:
            self._finalizer()  # unlinks the name now, and never again

    def __enter__(self) -> ShmArena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else self._access.value
        return f"ShmArena({self._name!r}, {self._size_bytes} bytes, {state}, pinned={self._pinned})"


def _prefault(mapping: mmap.mmap) -> None:
    """Fault every page in, writable: MADV_POPULATE_WRITE, else one write per page."""
    try:
        mapping.madvise(MADV_POPULATE_WRITE)
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise StorageError(f"pre-faulting the arena failed: {exc}") from exc
    view = np.frombuffer(mapping, dtype=np.uint8)
    try:
        view[::PAGE_BYTES] = 0  # fresh pages are zero already: this only faults them in
    finally:
        del view


def remove_stale_arenas() -> list[str]:
    """Unlink ``kvtier-<pid>-*`` segments whose creating process is gone; return their names.

    For a node's start-up: arenas of a SIGKILLed predecessor otherwise hold RAM forever.
    """
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        match = _STALE_RE.match(name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
            continue  # alive (or a pid we may not signal, which is alive too)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except FileNotFoundError:
            continue
    return removed


# --- caller buffers -------------------------------------------------------------------------


def _is_torch_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def is_cuda_tensor(obj: object) -> bool:
    """True for a torch tensor on a CUDA device (never imports torch)."""
    return _is_torch_tensor(obj) and bool(getattr(obj, "is_cuda", False))


def host_byte_view(buf: Any, *, writable: bool = False) -> memoryview:
    """A flat, C-contiguous, format-``B`` view of a host buffer, without copying.

    Accepts anything with the buffer protocol (bytes, bytearray, memoryview, numpy,
    mmap) and CPU torch tensors of any dtype. A non-contiguous *source* is copied
    once into a contiguous one; a non-contiguous or read-only *destination*
    (``writable=True``) is rejected with ``InvalidArgument``, as is a CUDA tensor.

    The one conversion every data path uses (the tiers, the TCP and UCX transports, the
    same-host client). The buffer protocol is tried first because it is the common case on
    the hot paths: a flat byte buffer costs one ``memoryview`` (none for a memoryview) and
    three attribute checks; torch tensors, which do not export a buffer, are recognised after.
    """
    try:
        view = buf if type(buf) is memoryview else memoryview(buf)
    except TypeError as exc:
        if not _is_torch_tensor(buf):
            raise InvalidArgument(f"{type(buf).__name__} does not expose a byte buffer"
                                  ) from exc
        if buf.is_cuda:
            raise InvalidArgument("a CUDA tensor is not a host buffer; use the HBM tier"
                                  ) from None
        tensor = buf.detach()
        if not tensor.is_contiguous():
            if writable:
                raise InvalidArgument("destination tensor must be contiguous") from None
            tensor = tensor.contiguous()
        import torch

        flat: np.ndarray = tensor.reshape(-1).view(torch.uint8).numpy()
        return flat.data
    if writable and view.readonly:
        raise InvalidArgument(f"destination {type(buf).__name__} is read-only")
    if view.ndim == 1 and view.format == "B" and view.c_contiguous:  # bytes, bytearray, mmap
        return view
    if not view.c_contiguous:
        if writable:
            raise InvalidArgument("destination buffer must be C-contiguous")
        return np.ascontiguousarray(np.asarray(view)).reshape(-1).view(np.uint8).data
    try:
        return view.cast("B")
    except TypeError:  # a non-native format (numpy structured dtypes...): go through numpy
        return np.asarray(view).reshape(-1).view(np.uint8).data


def buffer_address(view: memoryview) -> int:
    """The address of a host view's first byte (for matching pinned ranges)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """One memcpy between equal-length flat byte views; releases the GIL for large copies."""
    if src.nbytes >= GIL_RELEASE_COPY_BYTES:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        dst[:] = src

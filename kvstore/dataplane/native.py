"""The optional native fast path: loaders, layout hand-over, and a small typed wrapper around
the TCP server's small-GET loop.

Two artifacts are built from ``native/``:

* ``fastpath.c`` -> ``native/build/libkvtier_fastpath.so``, plain C loaded with ``ctypes``
  (:func:`load`): the daemon's small-GET loop;
* ``pyfast.c`` (which includes ``fastpath.c``) -> ``native/build/kvtier_native<EXT_SUFFIX>``, a
  CPython extension module (:func:`load_extension`): the client's lease-free read and small TCP
  GET, where a ctypes call alone would cost as much as the work.

The library is an accelerator, never a requirement: :func:`load` returns None when it is not
built, cannot be loaded, was built for another ABI, or ``KVTIER_NATIVE=0``; everything then runs
in Python exactly as without it. Build it with ``make native`` (``scripts/setup.sh`` does it too):
``gcc -O2 -shared -fPIC``, output ``native/build/libkvtier_fastpath.so`` (ignored by git).
``KVTIER_NATIVE_DIR`` names another directory holding both builds (an installed package, the
image: ``Dockerfile``). Design and measurements: ``native/README.md``,
``docs/transport.md`` ("The native small-GET loop").

``ctypes.CDLL`` functions release the GIL for the duration of each call, so a connection thread
inside :meth:`NativeLoop.serve` lets every other thread of the daemon run.

The read index's layout (slot size, field offsets, header size) is passed from
:mod:`kvstore.dataplane.read_index_layout` into the C code at start (:func:`index_read_config`),
so the C side never hard-codes it. This module imports that layout, never
:mod:`kvstore.dataplane.read_index` itself (which imports this one for its native reader).
"""

from __future__ import annotations

import ctypes
import enum
import functools
import logging
import os
import shutil
import subprocess
import sysconfig
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import xxhash

from kvstore.dataplane import read_index_layout as layout
from kvstore.dataplane.arena import ArenaAccess, ShmArena, buffer_address
from kvstore.dataplane.tier import MAX_KEY_BYTES
from kvstore.errors import InvalidArgument, TierUnavailable

log = logging.getLogger(__name__)

ABI = 6
"""Must equal ``KVT_ABI`` in fastpath.c (checked at load); bumped whenever ``cfg[]``/``st[]``
or a signature changes."""
REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE_PATH = REPO_ROOT / "native" / "fastpath.c"
LIBRARY_PATH = REPO_ROOT / "native" / "build" / "libkvtier_fastpath.so"
EXTENSION_ABI = 1
"""Must equal ``PYFAST_ABI`` in pyfast.c (checked at load)."""
EXTENSION_SOURCE_PATH = REPO_ROOT / "native" / "pyfast.c"
EXTENSION_NAME = "kvtier_native"
EXTENSION_PATH = REPO_ROOT / "native" / "build" / (
    EXTENSION_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
_SOURCES = (SOURCE_PATH, EXTENSION_SOURCE_PATH, REPO_ROOT / "native" / "third_party" / "xxhash.h")
ENV_SWITCH = "KVTIER_NATIVE"
ENV_DIR = "KVTIER_NATIVE_DIR"

RING_ENTRIES = 256
"""Hit-ring entries per connection; the loop returns to Python when half are used."""
RING_ENTRY_BYTES = 1 + MAX_KEY_BYTES + 7
"""A key-length byte, the key, padding to 72 bytes."""
COPY_ATTEMPTS = 4
"""Seqlock copies tried before a hit is handed to Python (which then takes its own path)."""
DRAIN_WAIT_MS = 1
"""While its hit ring holds keys, the loop waits at most this long for the next request before
returning so that Python accounts them (hits land within about this long of their answers;
back-to-back requests pay one ``poll`` each instead of a return to Python)."""

# cfg[] and st[] indexes: mirror the enums at the top of fastpath.c.
(_CFG_ABI, _CFG_ARENA_ADDR, _CFG_ARENA_BYTES, _CFG_INDEX_ADDR, _CFG_INDEX_SLOTS,
 _CFG_INDEX_HEADER_BYTES, _CFG_SLOT_BYTES, _CFG_SEQ_AT, _CFG_OFFSET_AT, _CFG_SIZE_AT,
 _CFG_STATE_AT, _CFG_KLEN_AT, _CFG_KEY_AT, _CFG_STATE_LIVE, _CFG_STATE_EMPTY,
 _CFG_MAX_KEY_BYTES, _CFG_FRAME_MAGIC, _CFG_FRAME_VERSION, _CFG_OP_GET, _CFG_FLAG_ANY_SIZE,
 _CFG_FLAG_MORE, _CFG_COPY_READ_MAX, _CFG_MAX_VALUE_BYTES, _CFG_ATTEMPTS, _CFG_RING_ENTRIES,
 _CFG_RING_ENTRY_BYTES, _CFG_DRAIN_WAIT_MS, _CFG_RECV_TICK_US, _CFG_HEADER_TIMEOUT_NS,
 _CFG_TAG_LO_AT, _CFG_TAG_HI_AT, _CFG_OWNER_CHECK, _CFG_OWNER_A, _CFG_OWNER_B,
 _CFG_COUNT) = range(35)
(ST_RPOS, ST_REND, ST_LAST_FLAGS, ST_GETS, ST_BYTES_SENT, ST_RING_COUNT, ST_RETRIES,
 ST_FALLBACKS, ST_ERRNO, ST_SENT, ST_SHORT_TICK, ST_FRAME_CLOCK, _ST_VERIFIED_ADDR,
 _ST_VERIFIED_MASK, _ST_DECLINED_SLOT, _ST_DECLINED_SEQ, _ST_COUNT) = range(17)
VERIFIED_ENTRIES = 16384
"""Entries of one tenant's table of verified publishes (:class:`VerifiedPublishes`; 16 bytes
each: 256 KiB per tenant; direct-mapped by read-index slot, so a collision only costs a
re-check)."""

class NativeReturn(enum.IntEnum):
    """Why :meth:`NativeLoop.serve` returned (``KVT_*`` in fastpath.c)."""

    SLOW = 1
    """A complete frame header at ``rpos`` that Python must serve."""
    IDLE = 2
    """The buffer needs bytes and none came within the receive tick (or the server closes)."""
    EOF = 3
    """The peer closed the connection."""
    RING = 4
    """The hit ring needs draining."""
    RECV_ERROR = 5
    SEND_ERROR = 6
    BAD_CONFIG = 7
    HEADER_TIMEOUT = 8
    """The frame at ``rpos`` was not whole ``header_timeout_s`` after its first bytes (they
    kept trickling in, so no receive tick passed without one)."""


class _Library:
    """The loaded shared library with its function signatures declared."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        i64p = ctypes.POINTER(ctypes.c_int64)
        u8p = ctypes.c_void_p
        self.serve = lib.kvt_serve
        self.serve.argtypes = [i64p, i64p, ctypes.c_int, u8p, ctypes.c_int64, u8p,
                               ctypes.c_int64, u8p, ctypes.c_void_p]
        self.serve.restype = ctypes.c_int
        self.xxh3_64 = lib.kvt_xxh3_64
        self.xxh3_64.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        self.xxh3_64.restype = ctypes.c_uint64
        self.index_read = lib.kvt_index_read
        self.index_read.argtypes = [i64p, i64p, ctypes.c_char_p, ctypes.c_uint32,
                                    ctypes.c_int64, u8p, ctypes.c_int64]
        self.index_read.restype = ctypes.c_int64
        lib.kvt_abi.restype = ctypes.c_int
        self.abi = int(lib.kvt_abi())


def enabled_by_env() -> bool:
    """False when ``KVTIER_NATIVE=0`` (or ``false``/``off``/``no``)."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")


def library_path() -> Path:
    """Where :func:`load` looks: ``$KVTIER_NATIVE_DIR``, else the checkout's ``native/build``."""
    override = os.environ.get(ENV_DIR)
    return Path(override) / LIBRARY_PATH.name if override else LIBRARY_PATH


def extension_path() -> Path:
    """Where :func:`load_extension` looks (as :func:`library_path`)."""
    override = os.environ.get(ENV_DIR)
    return Path(override) / EXTENSION_PATH.name if override else EXTENSION_PATH


_load_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _load_path(path: str) -> _Library | None:
    try:
        lib = _Library(ctypes.CDLL(path), Path(path))
    except (OSError, AttributeError) as exc:
        log.info("native fast path unavailable (%s): %s", path, exc)
        return None
    if lib.abi != ABI:
        log.warning("native library %s has ABI %d, this code needs %d: rebuild it (make native)",
                    path, lib.abi, ABI)
        return None
    return lib


def load() -> _Library | None:
    """The native library, or None (not built, not loadable, another ABI, older than
    ``native/fastpath.c`` in a source checkout, ``KVTIER_NATIVE=0``). Checked on every call
    (cheap: the loaded library is cached per path)."""
    if not enabled_by_env():
        return None
    path = library_path()
    if not path.is_file():
        return None
    if _stale(path, (SOURCE_PATH, _SOURCES[2])):
        log.warning("native library %s is older than %s: rebuild it (make native); "
                    "running in Python", path, SOURCE_PATH)
        return None
    with _load_lock:
        return _load_path(str(path))


def build(output: Path | None = None, *, compiler: str | None = None) -> Path:
    """Compile ``native/fastpath.c`` into ``output`` (default :data:`LIBRARY_PATH`) and return
    it. Raises TierUnavailable when no C compiler is installed or the build fails."""
    return _compile([SOURCE_PATH], output or LIBRARY_PATH, compiler, "the native fast path")


def build_extension(output: Path | None = None, *, compiler: str | None = None) -> Path:
    """Compile ``native/pyfast.c`` into the extension module ``output`` (default
    :data:`EXTENSION_PATH`). Raises TierUnavailable without a C compiler or ``Python.h``."""
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise TierUnavailable(f"no Python.h in {include} to build the native extension "
                              f"(install the Python development headers)")
    return _compile([EXTENSION_SOURCE_PATH], output or EXTENSION_PATH, compiler,
                    "the native extension", [f"-I{include}"])


def _compile(sources: list[Path], out: Path, compiler: str | None, what: str,
             flags: list[str] | None = None) -> Path:
    cc = compiler or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise TierUnavailable(f"no C compiler (gcc) to build {what}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    cmd = [cc, "-O2", "-Wall", "-shared", "-fPIC", *(flags or []), "-o", str(tmp),
           *map(str, sources)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise TierUnavailable(f"building {what} failed: {done.stderr.strip()}")
    os.replace(tmp, out)  # a process that loaded the old file keeps its mapping
    return out


def _stale(path: Path, sources: tuple[Path, ...]) -> bool:
    """Whether a source next to ``path`` is newer (False for an installed build)."""
    try:
        built = path.stat().st_mtime
    except FileNotFoundError:
        return False
    return any(src.is_file() and src.stat().st_mtime > built for src in sources)


def load_extension() -> ModuleType | None:
    """The extension module (``native/pyfast.c``), or None (not built, not loadable, another
    ABI, older than its sources, ``KVTIER_NATIVE=0``). Cached once loaded."""
    if not enabled_by_env():
        return None
    path = extension_path()
    if not path.is_file():
        return None
    if _stale(path, _SOURCES):
        log.warning("native extension %s is older than its sources: rebuild it (make native); "
                    "running in Python", path)
        return None
    with _load_lock:
        return _load_extension(str(path))


@functools.lru_cache(maxsize=4)
def _load_extension(path: str) -> ModuleType | None:
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(EXTENSION_NAME, path)
    spec = importlib.util.spec_from_file_location(EXTENSION_NAME, path, loader=loader)
    if spec is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as exc:
        log.info("native extension unavailable (%s): %s", path, exc)
        return None
    if getattr(module, "ABI", None) != EXTENSION_ABI or getattr(module, "KVT_ABI", None) != ABI:
        log.warning("native extension %s has another ABI: rebuild it (make native)", path)
        return None
    return module


def index_read_config(*, arena_address: int, arena_bytes: int, index_address: int, slots: int,
                      attempts: int, owner_tags: tuple[tuple[int, int], ...] | None = None
                      ) -> ctypes.Array[ctypes.c_int64]:
    """A ``cfg[]`` with the read-index fields filled in: enough for the extension's
    ``IndexReader`` (the lease-free client read) and ``kvt_index_read``; the TCP loop adds its
    frame fields (:meth:`NativeReadSource.config`). ``owner_tags``: the (low, high) owner-tag
    halves a tenant-scoped reader accepts (at most two; any other slot is a miss:
    ``read_index.py``, "Owners"); None: every slot.
    The addresses are of mappings the caller keeps alive while the config is in use."""
    cfg = (ctypes.c_int64 * _CFG_COUNT)()
    cfg[_CFG_ABI] = ABI
    cfg[_CFG_ARENA_ADDR] = arena_address
    cfg[_CFG_ARENA_BYTES] = arena_bytes
    cfg[_CFG_INDEX_ADDR] = index_address
    cfg[_CFG_INDEX_SLOTS] = slots
    cfg[_CFG_INDEX_HEADER_BYTES] = layout.HEADER_BYTES
    cfg[_CFG_SLOT_BYTES] = layout.SLOT_BYTES
    cfg[_CFG_SEQ_AT] = layout.SEQ_AT
    cfg[_CFG_OFFSET_AT] = layout.OFFSET_AT
    cfg[_CFG_SIZE_AT] = layout.SIZE_AT
    cfg[_CFG_STATE_AT] = layout.STATE_AT
    cfg[_CFG_KLEN_AT] = layout.KLEN_AT
    cfg[_CFG_KEY_AT] = layout.KEY_AT
    cfg[_CFG_STATE_LIVE] = layout.SlotState.LIVE.value
    cfg[_CFG_STATE_EMPTY] = layout.SlotState.EMPTY.value
    cfg[_CFG_ATTEMPTS] = attempts
    cfg[_CFG_TAG_LO_AT] = layout.TAG_LO_AT
    cfg[_CFG_TAG_HI_AT] = layout.TAG_HI_AT
    if owner_tags is not None:
        if len(owner_tags) > 2:
            raise InvalidArgument(f"the native reader takes at most two owner tags, got "
                                  f"{len(owner_tags)}")
        accepted = [lo | hi << 16 for lo, hi in owner_tags] + [-1, -1]  # -1: never a tag
        cfg[_CFG_OWNER_CHECK] = 1
        cfg[_CFG_OWNER_A], cfg[_CFG_OWNER_B] = accepted[0], accepted[1]
    return cfg


# --- the read source: the daemon's arena and read index, mapped for the C loop ------------------


class NativeReadSource:
    """The daemon's DRAM arena and read index mapped (read-only) for the native loop, with the
    index's layout. Holds its own views for its whole life, so the addresses handed to C stay
    valid even after the tier closes its mappings (the tier clears the index before it closes:
    every lookup then misses and Python answers).

    Build with :meth:`attach`; :meth:`close` releases the mappings (only once no connection can
    be inside the C loop: the owner calls it at shutdown, or never and lets the process end).
    """

    def __init__(self, arena: ShmArena, index: ShmArena, slots: int) -> None:
        """Wrap two attached segments; use :meth:`attach`."""
        self._arena = arena
        self._index = index
        self._arena_view = arena.view(0, arena.size_bytes)
        self._index_view = index.view(0, index.size_bytes)
        self.arena_address = buffer_address(self._arena_view)
        self.arena_bytes = arena.size_bytes
        self.index_address = buffer_address(self._index_view)
        self.slots = slots

    @classmethod
    def attach(cls, arena_name: str, index_name: str) -> NativeReadSource:
        """Map the arena and its read index by name. Raises InvalidArgument (no such segment,
        or the index does not describe that arena), TierUnavailable (not supported here)."""
        if not layout.lease_free_supported():
            raise TierUnavailable("the read index's seqlock needs Linux on x86-64")
        arena = ShmArena.attach(arena_name, access=ArenaAccess.READ_ONLY)
        try:
            index = ShmArena.attach(index_name, access=ArenaAccess.READ_ONLY)
        except BaseException:
            arena.close()
            raise
        try:
            head = index.view(0, layout.HEADER_BYTES)
            magic, version, slot_bytes, slots, arena_bytes, _state = \
                layout.HEADER_STRUCT.unpack_from(head)
            head.release()
            if magic != layout.MAGIC or version != layout.VERSION \
                    or slot_bytes != layout.SLOT_BYTES \
                    or slots < layout.MIN_SLOTS or slots & (slots - 1) \
                    or index.size_bytes < layout.HEADER_BYTES + slots * layout.SLOT_BYTES \
                    or arena_bytes != arena.size_bytes:
                raise InvalidArgument(f"{index_name!r} is not a read index of {arena_name!r}")
            return cls(arena, index, slots)
        except BaseException:
            index.close()
            arena.close()
            raise

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """(slot, seq) of ``key``'s publish in the read index now, or None (not published, or
        being written). The probe of the C loop, in Python (xxh3 of the key, linear probing)."""
        mask = self.slots - 1
        view = self._index_view
        klen = len(key)
        i = xxhash.xxh3_64_intdigest(key) & mask
        for _ in range(self.slots):
            at = layout.HEADER_BYTES + i * layout.SLOT_BYTES
            seq, _offset, _size, state, kl, _tag_lo, _tag_hi = layout.SLOT_STRUCT.unpack_from(
                view, at)
            if seq & 1:
                return None
            if state == layout.SlotState.EMPTY:
                return None
            if state == layout.SlotState.LIVE and kl == klen \
                    and view[at + layout.KEY_AT:at + layout.KEY_AT + klen] == key:
                return i, seq
            i = (i + 1) & mask
        return None

    def slot_holds(self, slot: int, seq: int, key: bytes) -> bool:
        """Whether read-index slot ``slot`` holds, right now, the publish ``seq`` of ``key``
        (live, stable, that key): the check a tenant-scoped connection makes before it lets
        the C loop serve that publish (:meth:`NativeLoop.verify`). A seqlock read, as the C
        loop's."""
        if not 0 <= slot < self.slots or seq & 1:
            return False
        at = layout.HEADER_BYTES + slot * layout.SLOT_BYTES
        view = self._index_view
        first, _offset, _size, state, klen, _lo, _hi = layout.SLOT_STRUCT.unpack_from(view, at)
        if first != seq or state != layout.SlotState.LIVE or klen != len(key):
            return False
        same = view[at + layout.KEY_AT:at + layout.KEY_AT + klen] == key
        (again,) = layout.SEQ_STRUCT.unpack_from(view, at + layout.SEQ_AT)
        return same and again == seq

    def close(self) -> None:
        """Release the views and unmap. Idempotent."""
        for view in (self._arena_view, self._index_view):
            view.release()
        self._index.close()
        self._arena.close()

    def config(self, *, copy_read_max_bytes: int, max_value_bytes: int,
               recv_tick_s: float = 0.2,
               header_timeout_s: float = 10.0) -> ctypes.Array[ctypes.c_int64]:
        """The ``cfg[]`` array the C loop reads (fastpath.c). ``recv_tick_s``: the receive
        timeout the server gives its connections (the loop restores it before returning);
        ``header_timeout_s``: how long a partial frame may take to be whole
        (``NativeReturn.HEADER_TIMEOUT``)."""
        # Imported here: the transport package imports this module.
        from kvstore.dataplane.transport.frames import MAGIC, VERSION, Flags, Opcode

        cfg = index_read_config(arena_address=self.arena_address, arena_bytes=self.arena_bytes,
                                index_address=self.index_address, slots=self.slots,
                                attempts=COPY_ATTEMPTS)
        cfg[_CFG_MAX_KEY_BYTES] = MAX_KEY_BYTES
        cfg[_CFG_FRAME_MAGIC] = int.from_bytes(MAGIC, "little")
        cfg[_CFG_FRAME_VERSION] = VERSION
        cfg[_CFG_OP_GET] = int(Opcode.GET)
        cfg[_CFG_FLAG_ANY_SIZE] = int(Flags.ANY_SIZE)
        cfg[_CFG_FLAG_MORE] = int(Flags.MORE)
        cfg[_CFG_COPY_READ_MAX] = copy_read_max_bytes
        cfg[_CFG_MAX_VALUE_BYTES] = max_value_bytes
        cfg[_CFG_RING_ENTRIES] = RING_ENTRIES
        cfg[_CFG_RING_ENTRY_BYTES] = RING_ENTRY_BYTES
        cfg[_CFG_DRAIN_WAIT_MS] = DRAIN_WAIT_MS
        cfg[_CFG_RECV_TICK_US] = max(1, round(recv_tick_s * 1e6))
        cfg[_CFG_HEADER_TIMEOUT_NS] = max(1, round(header_timeout_s * 1e9))
        return cfg


@dataclass(frozen=True, slots=True)
class NativeServing:
    """What a TCP server needs to run the native loop: the library, the mapped source, and the
    callback that accounts hits served natively (keys, one per hit, in serving order)."""

    library: _Library
    source: NativeReadSource
    record_hits: Callable[[list[bytes]], None]

    def __post_init__(self) -> None:
        if not callable(self.record_hits):
            raise InvalidArgument("record_hits must be callable")


class VerifiedPublishes:
    """One tenant's table of read-index publishes the native loop may serve to that tenant's
    scoped connections (fastpath.c, ``index_copy``): (slot + 1, seq) pairs, direct-mapped by
    slot. Shared by every connection of the tenant (the C loops read it while Python threads
    add to it: :meth:`verify` writes an entry in the order the C side's reads expect, writers
    serialized by a lock). Entries are never removed: a replaced chunk is a new publish."""

    __slots__ = ("_lock", "_table", "address")

    def __init__(self) -> None:
        self._table = (ctypes.c_uint64 * (2 * VERIFIED_ENTRIES))()
        self._lock = threading.Lock()
        self.address = ctypes.addressof(self._table)

    def verify(self, slot: int, seq: int) -> None:
        """Let the C loop serve publish ``seq`` of read-index slot ``slot`` to this tenant.
        The caller checked that the publish is of a chunk the tenant may read
        (:meth:`NativeReadSource.slot_holds` or :meth:`NativeReadSource.locate`, then the
        tenant check, in that order)."""
        table = self._table
        at = 2 * (slot & (VERIFIED_ENTRIES - 1))
        with self._lock:
            if table[at] == slot + 1 and table[at + 1] == seq:
                return
            table[at] = 0  # never a slot with another entry's seq (fastpath.c's reads)
            table[at + 1] = seq
            table[at] = slot + 1


class NativeLoop:
    """One connection's state for the C loop: the ``st[]`` counters, the hit ring and the
    buffers, pinned as ctypes addresses (the bytearrays stay exported, hence unresizable, for
    this object's life). Used by one thread (the connection's); other threads may read ``st``'s
    counters (``TcpServer.stats``)."""

    __slots__ = ("_cfg", "_closing", "_fd", "_lib", "_out", "_out_addr", "_rbuf", "_rbuf_addr",
                 "_ring", "_ring_addr", "_serve", "_verified", "st")

    def __init__(self, serving: NativeServing, cfg: ctypes.Array[ctypes.c_int64],
                 closing: ctypes.c_int32, fd: int, rbuf: bytearray, out: bytearray) -> None:
        """``rbuf`` and ``out`` must not be resized while this loop lives (their addresses
        are taken once)."""
        self._lib = serving.library
        self._serve = serving.library.serve
        self._cfg = cfg
        self._closing = closing
        self._fd = fd
        self._rbuf = (ctypes.c_uint8 * len(rbuf)).from_buffer(rbuf)
        self._out = (ctypes.c_uint8 * len(out)).from_buffer(out)
        self._ring = (ctypes.c_uint8 * (RING_ENTRIES * RING_ENTRY_BYTES))()
        self._rbuf_addr = ctypes.addressof(self._rbuf)
        self._out_addr = ctypes.addressof(self._out)
        self._ring_addr = ctypes.addressof(self._ring)
        self.st = (ctypes.c_int64 * _ST_COUNT)()
        self._verified: VerifiedPublishes | None = None

    @property
    def verified(self) -> VerifiedPublishes | None:
        """The table this loop serves from (:meth:`scope`), or None: unscoped."""
        return self._verified

    @property
    def scoped(self) -> bool:
        """Whether this loop serves verified publishes only (:meth:`scope`)."""
        return self._verified is not None

    def scope(self, verified: VerifiedPublishes) -> None:
        """From now on serve only publishes in ``verified`` (a tenant-scoped connection, its
        tenant's table: fastpath.c, ``index_copy``); any other hit comes back as ``SLOW`` with
        :meth:`take_declined` naming its slot and seq. Irreversible for this loop."""
        if self._verified is None:
            self._verified = verified  # kept alive here: the C loop holds its address
            self.st[_ST_VERIFIED_ADDR] = verified.address
            self.st[_ST_VERIFIED_MASK] = VERIFIED_ENTRIES - 1

    def take_declined(self) -> tuple[int, int] | None:
        """(slot, seq) of the hit the last ``SLOW`` return handed back for want of
        verification, or None; resets it."""
        st = self.st
        slot_plus_one = st[_ST_DECLINED_SLOT]
        if not slot_plus_one:
            return None
        st[_ST_DECLINED_SLOT] = 0
        return slot_plus_one - 1, st[_ST_DECLINED_SEQ]

    def serve(self, rpos: int, rend: int, last_flags: int) -> tuple[int, int, int, int]:
        """Run the C loop from these buffer positions; return (NativeReturn value, rpos, rend,
        last request flags). The GIL is released meanwhile."""
        st = self.st
        st[ST_RPOS] = rpos
        st[ST_REND] = rend
        st[ST_LAST_FLAGS] = last_flags
        rc = self._serve(self._cfg, st, self._fd, self._rbuf_addr, len(self._rbuf),
                         self._out_addr, len(self._out), self._ring_addr,
                         ctypes.addressof(self._closing))
        return rc, st[ST_RPOS], st[ST_REND], st[ST_LAST_FLAGS]

    def take_frame_clock(self) -> float:
        """When the C loop first saw the frame at ``rpos`` partial, as a ``time.monotonic()``
        value (both read ``CLOCK_MONOTONIC``), or 0.0 when it did not time it; resets it. Call
        after every return but ``RING``: the frame is the caller's then."""
        st = self.st
        started_ns = st[ST_FRAME_CLOCK]
        if not started_ns:
            return 0.0
        st[ST_FRAME_CLOCK] = 0
        return started_ns / 1e9

    def take_hits(self) -> list[bytes]:
        """The keys served since the last call (one per hit), emptying the ring."""
        n = self.st[ST_RING_COUNT]
        if not n:
            return []
        raw = ctypes.string_at(self._ring_addr, n * RING_ENTRY_BYTES)
        self.st[ST_RING_COUNT] = 0
        keys = []
        for at in range(0, n * RING_ENTRY_BYTES, RING_ENTRY_BYTES):
            keys.append(raw[at + 1:at + 1 + raw[at]])
        return keys


def ensure_built() -> list[str]:
    """Build the library and the extension where missing or older than their sources; what
    happened, one line each. A failed build is reported, not raised (both are optional)."""
    said = []
    for path, sources, make in ((LIBRARY_PATH, (SOURCE_PATH, _SOURCES[2]), build),
                                (EXTENSION_PATH, _SOURCES, build_extension)):
        if path.is_file() and not _stale(path, sources):
            continue
        try:
            said.append(f"native: built {make().relative_to(REPO_ROOT)}")
        except TierUnavailable as exc:
            said.append(f"native: warning: {exc}; that part runs in Python")
    return said


if __name__ == "__main__":
    for line in ensure_built():
        print(line)

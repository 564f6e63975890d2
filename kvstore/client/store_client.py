"""The store daemon's client: gRPC for control, a data plane for the bytes.

``StoreClient.connect(address)`` asks the daemon for its :class:`NodeInfo` and picks the data
plane (:class:`DataPlane`):

* **SHM**, when the daemon runs on this host (same hostname and boot id), its DRAM arena can be
  mapped and its lease channel reached. ``get_into`` of a chunk the daemon's **read index**
  publishes (it is in DRAM, stored raw) is lease-free: a lookup in the mapped index, one memcpy
  and a seqlock check, no round trip at all (:mod:`kvstore.dataplane.read_index`; Linux on
  x86-64 only, ``StoreClientConfig.lease_free_reads``); the keys read are reported to the
  daemon in batches afterwards (hits, recency). Otherwise (not published, moved during the
  copy, or in NVMe) ``get_into`` = one ACQUIRE_READ round trip on the
  lease channel (~30 µs; the daemon pins the chunk in DRAM, promoting it from NVMe first) +
  one memcpy out of the mapped arena + a RELEASE sent without waiting for a reply. ``put`` =
  RESERVE (an invisible slot) + one memcpy into the arena + COMMIT (values up to 64 KiB
  travel inside one PUT request instead: one round trip). Leases belong to the
  channel connection: if this process dies, the daemon ends them (no half-written chunk
  becomes visible; nothing stays pinned). A chunk DRAM cannot take right now is read over
  TCP instead.
* **UCX** when the daemon advertises a UCX worker address (``NodeInfo.ucx_worker_address``)
  and ``ucxx`` imports here (:class:`~kvstore.dataplane.transport.ucx.UcxClient`: tag messages
  received straight into ``dst``; RDMA where the hardware has it). UCX cannot see a dead peer
  on its own, so waits are bounded and the daemon's gRPC health is asked every
  ``ucx_liveness_interval_s`` while one lasts. A UCX failure (``TransportError``) falls back to
  TCP for that call and keeps UCX off for ``ucx_retry_after_s``. Batches stay on TCP (its
  pipelining suits many small values).
* **TCP** otherwise: the framed TCP transport (:class:`~kvstore.dataplane.transport.tcp.TcpClient`,
  ``recv_into`` straight into ``dst``, striping large values over pooled connections). TCP
  frames carry no parent key, so a put with a parent goes inline over gRPC when it is small
  (one call) and otherwise announces the parent with ``SetParents`` first.

``AUTO`` (the default) chooses SHM when possible, then UCX, then TCP. Every error is a
:mod:`kvstore.errors` class: the daemon's own errors keep their class across the wire
(``ChunkExists``, ``SizeMismatch``...); a dead or unreachable daemon is ``PeerUnavailable``.

Ownership: ``put`` reads ``src`` and ``get_into`` writes ``dst`` only during the call. Misses:
``get_into`` of an unknown key raises ``ChunkNotFound`` (an explicit read); ``lookup``,
``exists`` and ``load_prefix`` report misses as counts. Thread safety: one client may be used
from many threads (the lease channel and TCP connections are pooled).

GPU buffers: ``put``/``get_into`` also take contiguous CUDA tensors. On the shared-memory plane
the bytes are copied between the device and the arena directly (the client registers the mapped
arena with CUDA, so the copy is DMA); over TCP they go through a pinned host bounce buffer.

Ordering: a RELEASE travels after the get returns; a gRPC ``remove`` right behind a get waits
for the releases this client sent (one ping per channel) so it never sees its own read lease.
Lease-free reads are reported late: :meth:`StoreClient.flush_reads` waits until the daemon has
counted them (``stats`` does it first).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc
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
from kvstore.dataplane.tier import Buffer, TierKind, check_key
from kvstore.dataplane.transport.shm_frames import (
    FLAG_NO_REPLY,
    FLAG_PREFIX,
    INLINE_PUT_MAX_BYTES,
    MAX_BODY_BYTES,
    MAX_KEYS,
    RANGE,
    REPLY,
    REQUEST,
    STATUS_OK,
    ChannelOp,
    pack_keys,
)
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.dataplane.transport.ucx import UcxClient, ucx_unavailable
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    KvtierError,
    PeerUnavailable,
    SizeMismatch,
    TierUnavailable,
    TransportError,
)
from kvstore.wire import ERROR_METADATA_KEY, PB_TO_TIER, TIER_TO_PB, error_from_name

log = logging.getLogger(__name__)

GRPC_MAX_MESSAGE_BYTES = 64 << 20
_FALLBACK_TO_TCP = (CapacityError, ChunkBusy)
_PAGE_BYTES = 4096
_IOV_MAX = 1024
_BATCH_MAX_KEYS = 512
"""Keys per batched put request (the buffers of one request stay under IOV_MAX)."""


class DataPlane(enum.Enum):
    AUTO = "auto"
    SHM = "shm"
    UCX = "ucx"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class StoreClientConfig:
    data_plane: DataPlane = DataPlane.AUTO
    tcp_connections: int = 4
    rpc_timeout_s: float = 30.0
    lease_ttl_s: float = 0.0
    """TTL of same-host leases (0: the daemon's default)."""
    wait_for_ready: bool = False
    """``connect`` waits up to ``rpc_timeout_s`` for a daemon that is not listening yet,
    instead of failing at once with PeerUnavailable."""
    populate_arena: bool = True
    """On the shared-memory plane, fault the whole mapped arena into this process's page
    tables at ``connect`` (one read per page: ~30 ms per 256 MiB here, plus 2 MiB of page
    tables per GiB). Without it the first copy to or from each arena page costs a page fault:
    measured 340 µs instead of 52 µs for a first 1 MiB copy, i.e. a cold client runs at a
    sixth of memcpy until it has touched the whole arena."""
    ucx_io_timeout_s: float = 30.0
    """Longest a UCX transfer may wait (UCX does not detect a dead peer by itself)."""
    ucx_liveness_interval_s: float = 0.5
    """While a UCX call waits, the daemon's gRPC health is asked this often."""
    ucx_retry_after_s: float = 30.0
    """After a UCX failure, calls use TCP for this long before UCX is tried again."""
    ucx_min_bytes: int = 1 << 20
    """Smaller values go over TCP even when UCX is chosen: measured here (one host, CMA), a
    4-64 KiB value cost 120-250 µs over UCX against 55-115 µs over TCP, while from 4 MiB up
    UCX moved 1.2-2x what TCP did (docs/transport.md). 0: every value over UCX."""
    tcp_spin_us: int = 0
    """How long a small TCP get polls for its answer before its thread sleeps (needs the
    native extension; ``TcpClientConfig.spin_us``). Trades a core's time while waiting for one
    scheduler wake-up less per get (docs/transport.md, "Waiting for an answer")."""
    lease_free_reads: bool = True
    """On the shared-memory plane, copy chunks the daemon's read index publishes without a
    lease round trip (Linux on x86-64 only; elsewhere, or when the daemon serves no index,
    every read takes a lease)."""
    lease_free_attempts: int = 4
    """Copies of one chunk tried lease-free before the read takes a lease (each retry follows
    a copy the daemon invalidated meanwhile: the chunk was evicted, moved or removed)."""
    read_report_interval_s: float = 0.05
    """Lease-free reads are reported to the daemon (hits, recency) at least this often..."""
    read_report_batch: int = 1024
    """...and as soon as this many are waiting."""

    def __post_init__(self) -> None:
        if not isinstance(self.data_plane, DataPlane):
            raise InvalidArgument(f"data_plane must be a DataPlane, got {self.data_plane!r}")
        if self.tcp_connections < 1:
            raise InvalidArgument("tcp_connections must be >= 1")
        if not 0 <= self.tcp_spin_us <= 10_000:
            raise InvalidArgument(f"tcp_spin_us must be 0..10000, got {self.tcp_spin_us}")
        if self.rpc_timeout_s <= 0 or self.lease_ttl_s < 0:
            raise InvalidArgument("rpc_timeout_s must be > 0 and lease_ttl_s >= 0")
        if min(self.ucx_io_timeout_s, self.ucx_liveness_interval_s) <= 0 \
                or self.ucx_retry_after_s < 0 or self.ucx_min_bytes < 0:
            raise InvalidArgument("ucx_io_timeout_s and ucx_liveness_interval_s must be > 0, "
                                  "ucx_retry_after_s and ucx_min_bytes >= 0")
        if self.lease_free_attempts < 1 or self.read_report_interval_s <= 0 \
                or not 1 <= self.read_report_batch <= MAX_KEYS:
            raise InvalidArgument(f"lease_free_attempts must be >= 1, read_report_interval_s "
                                  f"> 0 and read_report_batch 1..{MAX_KEYS}")


@dataclass(frozen=True, slots=True)
class LeaseFreeCounters:
    """What this client's lease-free reads did (monotonic counts since connect)."""

    active: bool
    """Whether reads are tried lease-free now (False: off, unsupported, or the daemon died)."""
    hits: int
    """Chunks copied with no lease."""
    misses: int
    """Reads the index could not serve (not published: NVMe, compressed, unknown): leased."""
    conflicts: int
    """Reads that kept finding the chunk changed under the copy (or of the wrong size):
    leased after ``lease_free_attempts`` tries."""
    retries: int
    """Copies thrown away because the daemon invalidated the slot meanwhile."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    length: int
    """How many leading keys are cached."""
    tiers: tuple[TierKind, ...]
    """Where each of them lives."""

    def by_tier(self) -> dict[TierKind, int]:
        out: dict[TierKind, int] = {}
        for t in self.tiers:
            out[t] = out.get(t, 0) + 1
        return out


def local_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def translate_rpc_error(exc: grpc.RpcError, what: str) -> KvtierError:
    """The kvtier error a failed call stands for (the daemon names it in trailing metadata)."""
    call: Any = exc
    name = None
    with contextlib.suppress(AttributeError, TypeError):
        for key, value in call.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                name = value
    details = call.details() if hasattr(call, "details") else str(exc)
    if name:
        return error_from_name(name, details)
    code = call.code() if hasattr(call, "code") else None
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED):
        return PeerUnavailable(f"{what}: {code.name}: {details}")
    return TransportError(f"{what}: {getattr(code, 'name', code)}: {details}")


def _device_bytes(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous CUDA tensor (no copy)."""
    if not tensor.is_contiguous():
        raise InvalidArgument("a GPU buffer must be contiguous")
    torch = cuda.torch_module()
    return tensor.detach().reshape(-1).view(torch.uint8)


def _populate(arena: ShmArena) -> None:
    """Map every page of an attached arena into this process (reads only: the daemon's bytes
    are untouched). A read fault on a shared tmpfs mapping installs a writable entry, so puts
    profit too."""
    pages = np.frombuffer(arena.view(0, arena.size_bytes), dtype=np.uint8)[::_PAGE_BYTES]
    try:
        int(pages.max())
    finally:
        del pages


# --- the lease channel ---------------------------------------------------------------------------


class LeaseChannel:
    """One connection to a daemon's lease channel (:mod:`kvstore.dataplane.transport.shm_frames`), used by one
    thread at a time. :class:`StoreClient` pools these; tools and tests may use one directly."""

    def __init__(self, address: str) -> None:
        if not address.startswith("@"):
            raise InvalidArgument(f"lease channel address must be abstract (@name): {address!r}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.connect("\0" + address[1:])
        except OSError as exc:
            self.sock.close()
            raise PeerUnavailable(f"cannot reach the lease channel {address}: {exc}") from exc
        self._reply = memoryview(bytearray(REPLY.size))
        self.detail = b""
        """The detail bytes of the last successful reply (PUT_MANY: one status per key)."""
        self.unacknowledged = False
        """A RELEASE was sent without a reply and nothing has been answered since."""

    def send(self, op: ChannelOp, *, flags: int = 0, keys: Sequence[bytes] = (), arg: int = 0,
             ttl_s: float = 0.0, payload: memoryview | None = None,
             payloads: Sequence[memoryview] = ()) -> None:
        """Send one request; ``payload`` (or the buffers of ``payloads``, gathered by one
        ``sendmsg`` without copying) follow the keys in the body."""
        body = pack_keys(list(keys)) if keys else b""
        parts = [payload] if payload is not None else list(payloads)
        extra = sum(p.nbytes for p in parts)
        header = REQUEST.pack(op, flags, len(keys), len(body) + extra, arg, ttl_s) + body
        try:
            if not parts:
                self.sock.sendall(header)
            else:
                _sendmsg_all(self.sock, [memoryview(header), *parts])
        except OSError as exc:
            raise PeerUnavailable(f"lease channel send failed: {exc}") from exc
        if flags & FLAG_NO_REPLY:
            self.unacknowledged = True

    def call(self, op: ChannelOp, *, flags: int = 0, keys: Sequence[bytes] = (), arg: int = 0,
             ttl_s: float = 0.0, payload: memoryview | None = None,
             payloads: Sequence[memoryview] = ()) -> tuple[int, list[tuple[int, int]]]:
        """Send a request and read its reply: (lease id, ranges). Raises the daemon's error."""
        self.send(op, flags=flags, keys=keys, arg=arg, ttl_s=ttl_s, payload=payload,
                  payloads=payloads)
        self._recv_into(self._reply)
        status, count, detail_len, lease_id = REPLY.unpack(self._reply)
        self.unacknowledged = False
        tail = bytearray(count * RANGE.size + detail_len)
        if tail:
            self._recv_into(memoryview(tail))
        if status != STATUS_OK:
            name, _, message = bytes(tail[count * RANGE.size:]).decode(errors="replace") \
                .partition("\n")
            raise error_from_name(name, message)
        ranges = [RANGE.unpack_from(tail, i * RANGE.size) for i in range(count)]
        self.detail = bytes(tail[count * RANGE.size:])
        return lease_id, ranges

    def _recv_into(self, view: memoryview) -> None:
        pos = 0
        try:
            while pos < len(view):
                n = self.sock.recv_into(view[pos:], len(view) - pos, socket.MSG_WAITALL)
                if n == 0:
                    raise PeerUnavailable("the daemon closed the lease channel")
                pos += n
        except OSError as exc:
            raise PeerUnavailable(f"lease channel receive failed: {exc}") from exc

    def close(self) -> None:
        self.sock.close()


def _sendmsg_all(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send every buffer, in order, with as few ``sendmsg`` calls as the socket allows."""
    while buffers:
        sent = sock.sendmsg(buffers[:_IOV_MAX])
        while buffers and sent >= buffers[0].nbytes:
            sent -= buffers[0].nbytes
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]


class _ReadReporter:
    """Reports the keys of lease-free reads to the daemon (READS, no reply) from a thread of its
    own, every ``interval_s`` or as soon as ``batch`` are waiting, over a connection of its own.

    Recording is one ``deque.append`` (thread-safe); the queue is bounded, so a reporter that
    cannot keep up drops the oldest keys (recency and hit counts are approximate anyway). A
    failed send (the daemon is gone) stops reporting; nothing else depends on it.
    """

    MAX_QUEUED = 1 << 16

    def __init__(self, address: str, *, interval_s: float, batch: int) -> None:
        """Record the settings; :meth:`start` opens the eventfd and starts the thread."""
        self._address = address
        self._interval_s = interval_s
        self.batch = batch
        self.queue: deque[bytes] = deque(maxlen=self.MAX_QUEUED)
        self.wake_fd = -1
        self._chan: LeaseChannel | None = None
        self._send_lock = threading.Lock()
        self._stopping = False
        self._broken = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name="kvtier-read-reports",
                                        daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Ask the thread to send now (a full batch is waiting)."""
        if not self._stopping and self.wake_fd >= 0:
            os.eventfd_write(self.wake_fd, 1)

    def _run(self) -> None:
        while not self._stopping:
            readable, _, _ = select.select([self.wake_fd], [], [], self._interval_s)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self.wake_fd)
            self.flush()

    def flush(self, *, wait: bool = False) -> None:
        """Send what is queued; with ``wait``, return only once the daemon has processed it
        (a PING after the reports on the same connection, which is served in order)."""
        with self._send_lock:
            if self._broken:
                return
            try:
                while self.queue:
                    keys = []
                    with contextlib.suppress(IndexError):
                        for _ in range(min(len(self.queue), MAX_KEYS)):
                            keys.append(self.queue.popleft())
                    if self._chan is None:
                        self._chan = LeaseChannel(self._address)
                    self._chan.send(ChannelOp.READS, flags=FLAG_NO_REPLY, keys=keys)
                if wait and self._chan is not None:
                    self._chan.call(ChannelOp.PING)
            except PeerUnavailable as exc:
                log.info("lease-free read reports stop: %s", exc)
                self._broken = True

    def close(self) -> None:
        """Flush, stop the thread, close the connection. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self._thread is not None:
            os.eventfd_write(self.wake_fd, 1)
            self._thread.join(5.0)
        self.flush()
        with self._send_lock:
            self._broken = True
            if self._chan is not None:
                self._chan.close()
                self._chan = None
        if self.wake_fd >= 0:
            os.close(self.wake_fd)
            self.wake_fd = -1


# --- the client ----------------------------------------------------------------------------------


class StoreClient:
    """A client of one store daemon. Build with :meth:`connect`; see the module docstring."""

    def __init__(self, address: str, info: pb.NodeInfo, channel: grpc.Channel,
                 config: StoreClientConfig, arena: ShmArena | None) -> None:
        """Wrap already-made connections; use :meth:`connect`."""
        self._address = address
        self._info = info
        self._channel = channel
        self._stub = pb_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
        self._config = config
        self._arena = arena
        self._plane = DataPlane.SHM if arena is not None else DataPlane.TCP
        if arena is None and self._ucx_possible(info, config):
            self._plane = DataPlane.UCX
        self._ucx: UcxClient | None = None
        self._ucx_bad_until = 0.0
        self._lock = threading.Lock()
        self._idle: list[LeaseChannel] = []
        self._all: list[LeaseChannel] = []
        self._tcp: TcpClient | None = None
        self._closed = False
        self._reader: ReadIndexReader | None = None
        self._reporter: _ReadReporter | None = None
        self._lf_hits = self._lf_misses = self._lf_conflicts = 0

    @classmethod
    def connect(cls, address: str, config: StoreClientConfig | None = None) -> StoreClient:
        """Open a gRPC channel to ``host:port``, fetch the daemon's info and pick the data plane.

        Raises PeerUnavailable (no daemon there), TierUnavailable (SHM was required but is not
        possible from here).
        """
        cfg = config or StoreClientConfig()
        channel = grpc.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES)])
        try:
            stub = pb_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
            try:
                info = stub.Info(pb.InfoRequest(), timeout=cfg.rpc_timeout_s,
                                 wait_for_ready=cfg.wait_for_ready)
            except grpc.RpcError as exc:
                raise translate_rpc_error(exc, f"Info from {address}") from exc
            arena = None
            if cfg.data_plane in (DataPlane.AUTO, DataPlane.SHM):
                arena = cls._attach_same_host(info, required=cfg.data_plane is DataPlane.SHM,
                                              populate=cfg.populate_arena)
            if cfg.data_plane is DataPlane.UCX and not cls._ucx_possible(info, cfg):
                reason = ucx_unavailable() or "the daemon serves no UCX data plane"
                raise TierUnavailable(f"UCX data plane unavailable: {reason}")
            client = cls(address, info, channel, cfg, arena)
            if arena is not None:
                client._checkin(client._checkout())  # the lease channel must answer too
                client._attach_read_index()
            return client
        except BaseException:
            channel.close()
            raise

    def _attach_read_index(self) -> None:
        """Map the daemon's read index for lease-free reads, when it serves one and this client
        wants them; otherwise every read takes a lease (logged once)."""
        assert self._arena is not None
        cfg, name = self._config, self._info.shm_read_index
        if not cfg.lease_free_reads or not name:
            return
        try:
            reader = ReadIndexReader.attach(name, self._arena, attempts=cfg.lease_free_attempts)
        except KvtierError as exc:
            log.info("same-host reads take leases: %s", exc)
            return
        from kvstore.dataplane import native

        reader.use_extension(native.load_extension())  # None (not built, KVTIER_NATIVE=0): Python
        reporter = _ReadReporter(self._info.shm_socket, interval_s=cfg.read_report_interval_s,
                                 batch=cfg.read_report_batch)
        try:
            reporter.start()
        except BaseException:
            reader.close()
            raise
        reader.report_reads_to(reporter.queue, reporter.batch, reporter.wake)
        self._reader, self._reporter = reader, reporter

    @staticmethod
    def _ucx_possible(info: pb.NodeInfo, config: StoreClientConfig) -> bool:
        if config.data_plane not in (DataPlane.AUTO, DataPlane.UCX):
            return False
        if not info.ucx_worker_address:
            return False
        reason = ucx_unavailable()
        if reason is not None:
            log.info("not using UCX: %s", reason)
            return False
        return True

    @staticmethod
    def _attach_same_host(info: pb.NodeInfo, *, required: bool,
                          populate: bool) -> ShmArena | None:
        reason = ""
        if info.hostname != socket.gethostname() or info.boot_id != local_boot_id():
            reason = f"the daemon runs on {info.hostname}, not on this host"
        elif not info.shm_arena or not info.shm_socket:
            reason = "the daemon serves no shared-memory arena or lease channel"
        else:
            try:
                # PinMode.AUTO registers the mapping with CUDA when a GPU exists, so copies
                # between the arena and engine HBM run as DMA.
                arena = ShmArena.attach(info.shm_arena, access=ArenaAccess.READ_WRITE,
                                        pin=PinMode.AUTO)
            except KvtierError as exc:
                reason = f"cannot map arena {info.shm_arena}: {exc}"
            else:
                if populate:
                    _populate(arena)
                return arena
        if required:
            raise TierUnavailable(f"shared-memory data plane unavailable: {reason}")
        log.info("using the TCP data plane: %s", reason)
        return None

    # --- identity ---------------------------------------------------------------------------

    @property
    def info(self) -> pb.NodeInfo:
        """What the daemon said about itself at connect time."""
        return self._info

    @property
    def data_plane(self) -> DataPlane:
        """SHM, UCX or TCP: the plane this client moves single values over (a UCX client
        falls back to TCP per call while UCX is marked bad)."""
        return self._plane

    @property
    def address(self) -> str:
        return self._address

    def refresh_info(self) -> pb.NodeInfo:
        self._info = self._call("Info", pb.InfoRequest())
        return self._info

    # --- values -----------------------------------------------------------------------------

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None) -> None:
        """Store ``src`` under ``key`` (a child of ``parent``), all or nothing.

        Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument (bad key, empty value,
        uncached parent), PeerUnavailable.
        """
        k = check_key(key)
        p = check_key(parent) if parent is not None else None
        if is_cuda_tensor(src):
            self._put_from_device(k, src, p)
            return
        view = host_byte_view(src)
        if self._arena is not None:
            self._put_shm(k, view, p)
            return
        if p is not None and view.nbytes <= self._info.inline_max_bytes:
            self._call("Put", pb.PutRequest(key=k, parent=p, value=bytes(view)))  # small: one copy
            return
        if p is not None:
            self._call("SetParents", pb.SetParentsRequest(keys=[k], parents=[p]))
        self._remote_put(k, view)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` (exactly the chunk's size) with the chunk; return its size.

        Raises ChunkNotFound, SizeMismatch (nothing copied), PeerUnavailable.
        """
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
        elif self._plane is DataPlane.TCP and not is_cuda_tensor(dst):
            # The TCP plane's common case, straight to the transport (which checks the key and
            # the buffer itself): ~1.5 µs less per small get than the general path below.
            tcp = self._tcp
            return (tcp if tcp is not None else self._tcp_client()).get_into(key, dst)
        k = check_key(key)
        if is_cuda_tensor(dst):
            return self._get_into_device(k, dst)
        out = host_byte_view(dst, writable=True)
        if self._arena is not None:
            if not tried and self._reader is not None and self._read_lease_free(k, out) >= 0:
                return out.nbytes
            try:
                return self._get_shm(k, out)
            except _FALLBACK_TO_TCP as exc:
                log.debug("reading %s over TCP: %s", k.hex(), exc)
        return self._remote_get_into(k, out)

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer]) -> list[bool]:
        """Store several root chunks; ``False`` where the key was already stored. Other
        refusals raise (after the values before them were stored)."""
        if len(keys) != len(srcs):
            raise InvalidArgument(f"{len(keys)} keys but {len(srcs)} values")
        if self._arena is None:
            return self._tcp_client().put_many([check_key(k) for k in keys],
                                               [host_byte_view(s) for s in srcs])
        checked: list[bytes] = [check_key(k) for k in keys]
        if any(is_cuda_tensor(s) for s in srcs):
            stored: list[bool] = []
            for key, src in zip(checked, srcs, strict=True):
                try:
                    self.put(key, src)
                    stored.append(True)
                except ChunkExists:
                    stored.append(False)
            return stored
        views = [host_byte_view(s) for s in srcs]
        if any(v.nbytes == 0 for v in views):
            raise InvalidArgument("cannot store an empty chunk")
        return self._put_many_shm(checked, views)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[int | None]:
        """Fill ``dsts[i]`` with chunk ``keys[i]``; None where it is not stored. Over shared
        memory all of them are leased with one round trip when all are present."""
        if len(keys) != len(dsts):
            raise InvalidArgument(f"{len(keys)} keys but {len(dsts)} destinations")
        checked: list[bytes] = [check_key(k) for k in keys]
        outs = [host_byte_view(d, writable=True) for d in dsts]
        if self._arena is not None and checked and self._reader is not None:
            # Lease-free where the index publishes them; the rest in one leased batch.
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
        if self._arena is not None and checked:
            return self._get_many_leased(checked, outs)
        return self._tcp_client().get_many_into(checked, outs)

    def _get_many_leased(self, checked: list[bytes], outs: list[memoryview]
                         ) -> list[int | None]:
        """``get_many_into`` on the shared-memory plane with leases (one round trip when all are
        present; per key otherwise, reporting the misses)."""
        if checked:
            try:
                return self._get_many_shm(checked, outs)
            except ChunkNotFound:
                pass  # some are missing: per key below, reporting the misses
            except _FALLBACK_TO_TCP as exc:
                log.debug("batch read over TCP: %s", exc)
                return self._tcp_client().get_many_into(checked, outs)
            got: list[int | None] = []
            for key, out in zip(checked, outs, strict=True):
                try:
                    got.append(self.get_into(key, out))
                except ChunkNotFound:
                    got.append(None)
            return got
        return []

    @contextlib.contextmanager
    def read_view(self, key: bytes) -> Iterator[memoryview]:
        """A read-only, zero-copy view of the chunk in the daemon's arena, valid inside the
        ``with`` block (the chunk is leased meanwhile; its bytes cannot change or move).

        Same host only (TierUnavailable over TCP). Raises ChunkNotFound, CapacityError (the
        chunk lives in a slower tier and DRAM cannot take it now: use ``get_into``).
        """
        if self._arena is None:
            raise TierUnavailable("zero-copy views need the shared-memory data plane")
        k = check_key(key)
        chan = self._checkout()
        try:
            lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[k],
                                         ttl_s=self._config.lease_ttl_s)
        except BaseException:
            self._checkin(chan)
            raise
        view = self._arena.view(ranges[0][0], ranges[0][1])
        try:
            yield view
        finally:
            view.release()
            try:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
            finally:
                self._checkin(chan)

    def get(self, key: bytes) -> bytearray:
        """The whole chunk in a new buffer. Raises ChunkNotFound."""
        k = check_key(key)
        sizes = self.sizes([k])
        if sizes[0] is None:
            raise ChunkNotFound(k, f"node {self._info.node_id}")
        out = bytearray(sizes[0])
        self.get_into(k, out)
        return out

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int:
        """Copy the longest cached prefix of ``keys`` into ``dsts``; return how many loaded.

        Every ``dsts[i]`` must be exactly the size of chunk ``keys[i]`` (SizeMismatch
        otherwise, nothing copied). A miss is a short count, not an error.
        """
        if len(keys) != len(dsts):
            raise InvalidArgument(f"{len(keys)} keys but {len(dsts)} destinations")
        if not keys:
            return 0
        checked: list[bytes] = [check_key(k) for k in keys]
        outs = [host_byte_view(d, writable=True) for d in dsts]
        if self._arena is not None:
            done = 0
            while done < len(checked) and self._reader is not None \
                    and self._read_lease_free(checked[done], outs[done]) >= 0:
                done += 1
            if done == len(checked):
                return done
            try:
                # The rest with one lease; a prefix of the remaining keys continues this one.
                return done + self._load_prefix_shm(checked[done:], outs[done:])
            except _FALLBACK_TO_TCP as exc:
                log.debug("prefix load over TCP: %s", exc)
            checked, outs = checked[done:], outs[done:]
            loaded_before = done
        else:
            loaded_before = 0
        n = self.lookup(checked).length
        if n == 0:
            return loaded_before
        got = self._tcp_client().get_many_into(checked[:n], outs[:n])
        loaded = loaded_before
        for size in got:
            if size is None:
                break
            loaded += 1
        return loaded

    # --- GPU buffers: through the (pinned) arena, or a host bounce buffer over TCP -----------

    def _get_into_device(self, key: bytes, dst: Any) -> int:
        torch = cuda.torch_module()
        flat = _device_bytes(dst)
        if self._arena is not None:
            chan = self._checkout()
            try:
                lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[key],
                                             ttl_s=self._config.lease_ttl_s)
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
        bounce = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        n = self._remote_get_into(key, memoryview(bounce.numpy()))
        flat.copy_(bounce)
        return n

    def _put_from_device(self, key: bytes, src: Any, parent: bytes | None) -> None:
        torch = cuda.torch_module()
        flat = _device_bytes(src)
        size = int(flat.numel())
        if self._arena is None or size == 0:
            self.put(key, flat.cpu().numpy(), parent=parent)
            return
        chan = self._checkout()
        try:
            lease_id, ranges = chan.call(ChannelOp.RESERVE, keys=[key, parent or b""],
                                         arg=size, ttl_s=self._config.lease_ttl_s)
            try:
                slot = torch.frombuffer(self._arena.view(ranges[0][0], size, readonly=False),
                                        dtype=torch.uint8)
                slot.copy_(flat)  # device-to-host, straight into the reserved slot
            except BaseException:
                with contextlib.suppress(KvtierError):
                    chan.call(ChannelOp.ABORT, arg=lease_id)
                raise
            chan.call(ChannelOp.COMMIT, arg=lease_id)
        finally:
            self._checkin(chan)

    # --- the shared-memory plane ------------------------------------------------------------

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
            log.warning("the daemon's read index is gone (the daemon died or stopped): "
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
        """Send the pending reports of lease-free reads and wait until the daemon counted them
        (its hit counters and recency then include every read this client finished)."""
        if self._reporter is not None:
            self._reporter.flush(wait=True)

    def _get_shm(self, key: bytes, out: memoryview) -> int:
        assert self._arena is not None
        chan = self._checkout()
        try:
            lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[key],
                                         ttl_s=self._config.lease_ttl_s)
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
        assert self._arena is not None
        chan = self._checkout()
        try:
            lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, flags=FLAG_PREFIX, keys=keys,
                                         ttl_s=self._config.lease_ttl_s)
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
        assert self._arena is not None
        chan = self._checkout()
        try:
            lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=keys,
                                         ttl_s=self._config.lease_ttl_s)
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

    def _put_shm(self, key: bytes, view: memoryview, parent: bytes | None) -> None:
        assert self._arena is not None
        if view.nbytes == 0:
            raise InvalidArgument("cannot store an empty chunk")
        chan = self._checkout()
        if view.nbytes <= INLINE_PUT_MAX_BYTES:  # one round trip beats reserve + commit
            try:
                chan.call(ChannelOp.PUT, keys=[key, parent or b""], arg=view.nbytes,
                          payload=view)
            finally:
                self._checkin(chan)
            return
        try:
            lease_id, ranges = chan.call(ChannelOp.RESERVE, keys=[key, parent or b""],
                                         arg=view.nbytes, ttl_s=self._config.lease_ttl_s)
            offset = ranges[0][0]
            try:
                copy_bytes(self._arena.view(offset, view.nbytes, readonly=False), view)
            except BaseException:
                with contextlib.suppress(KvtierError):  # the daemon aborts it on disconnect
                    chan.call(ChannelOp.ABORT, arg=lease_id)
                raise
            chan.call(ChannelOp.COMMIT, arg=lease_id)
        finally:
            self._checkin(chan)

    def _put_many_shm(self, keys: list[bytes], views: list[memoryview]) -> list[bool]:
        """Batched puts over the lease channel: runs of small values travel inside PUT_MANY
        requests (one round trip per ~1 MiB), runs of large ones are reserved with one
        RESERVE_MANY, copied, and published with one COMMIT_MANY."""
        stored = [False] * len(keys)
        chan = self._checkout()
        try:
            i = 0
            while i < len(keys):
                small = views[i].nbytes <= INLINE_PUT_MAX_BYTES
                j, body = i, 0
                while j < len(keys) and j - i < _BATCH_MAX_KEYS \
                        and (views[j].nbytes <= INLINE_PUT_MAX_BYTES) == small:
                    item = 9 + len(keys[j]) + (views[j].nbytes if small else 0)
                    if small and j > i and body + item > MAX_BODY_BYTES - REQUEST.size:
                        break
                    body += item
                    j += 1
                if small:
                    self._put_many_inline(chan, keys[i:j], views[i:j], stored, i)
                else:
                    self._put_many_reserved(chan, keys[i:j], views[i:j], stored, i)
                i = j
        finally:
            self._checkin(chan)
        return stored

    def _put_many_inline(self, chan: LeaseChannel, keys: list[bytes], views: list[memoryview],
                         stored: list[bool], at: int) -> None:
        sizes = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        tail = len(sizes) + sum(v.nbytes for v in views)
        chan.call(ChannelOp.PUT_MANY, keys=keys, arg=tail,
                  payloads=[memoryview(sizes), *views])
        for k, existed in enumerate(chan.detail):
            stored[at + k] = not existed

    def _put_many_reserved(self, chan: LeaseChannel, keys: list[bytes],
                           views: list[memoryview], stored: list[bool], at: int) -> None:
        assert self._arena is not None
        sizes = struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        _lease_id, ranges = chan.call(ChannelOp.RESERVE_MANY, keys=keys, arg=len(sizes),
                                      ttl_s=self._config.lease_ttl_s, payload=memoryview(sizes))
        lease_ids = [lease_id for _offset, lease_id in ranges if lease_id]
        try:
            for view, (offset, lease_id) in zip(views, ranges, strict=True):
                if lease_id:
                    copy_bytes(self._arena.view(offset, view.nbytes, readonly=False), view)
        except BaseException:
            with contextlib.suppress(KvtierError):  # the daemon aborts them on disconnect too
                for lease_id in lease_ids:
                    chan.call(ChannelOp.ABORT, arg=lease_id)
            raise
        if lease_ids:
            ids = struct.pack(f"<{len(lease_ids)}Q", *lease_ids)
            chan.call(ChannelOp.COMMIT_MANY, arg=len(ids), payload=memoryview(ids))
        for k, (_offset, lease_id) in enumerate(ranges):
            stored[at + k] = bool(lease_id)

    def _checkout(self) -> LeaseChannel:
        with self._lock:
            if self._closed:
                raise PeerUnavailable("the client is closed")
            if self._idle:
                return self._idle.pop()
        chan = LeaseChannel(self._info.shm_socket)
        with self._lock:
            self._all.append(chan)
        return chan

    def _checkin(self, chan: LeaseChannel) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(chan)
                return
        chan.close()

    def _sync_releases(self) -> None:
        """Wait until the daemon has processed every RELEASE this client sent."""
        if self._arena is None:
            return
        with self._lock:
            pending = [c for c in self._idle if c.unacknowledged]
            for c in pending:
                self._idle.remove(c)
        try:
            for chan in pending:
                chan.call(ChannelOp.PING)
        finally:
            for chan in pending:
                self._checkin(chan)

    # --- the UCX plane, with TCP as the fallback ---------------------------------------------

    def _ucx_client(self, size_bytes: int) -> UcxClient | None:
        """The UCX client for a value of ``size_bytes``, or None when this client does not use
        UCX, the value is below ``ucx_min_bytes`` or UCX is marked bad."""
        if self._plane is not DataPlane.UCX or size_bytes < self._config.ucx_min_bytes \
                or time.monotonic() < self._ucx_bad_until:
            return None
        with self._lock:
            if self._ucx is None:
                cfg = self._config
                self._ucx = UcxClient(self._info.ucx_worker_address,
                                      io_timeout_s=cfg.ucx_io_timeout_s,
                                      liveness=self._daemon_alive,
                                      liveness_interval_s=cfg.ucx_liveness_interval_s,
                                      max_value_bytes=self._info.max_value_bytes or (1 << 30))
            return self._ucx

    def _ucx_failed(self, exc: TransportError) -> None:
        log.warning("UCX transfer failed, using TCP for %g s: %s",
                    self._config.ucx_retry_after_s, exc)
        self._ucx_bad_until = time.monotonic() + self._config.ucx_retry_after_s

    def _daemon_alive(self) -> bool:
        """The control plane's view of the daemon: its gRPC health (asked during UCX waits)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        timeout_s = max(0.2, self._config.ucx_liveness_interval_s)
        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    def _remote_put(self, key: bytes, view: memoryview) -> None:
        ucx = self._ucx_client(view.nbytes)
        if ucx is not None:
            try:
                ucx.put(key, view)
                return
            except TransportError as exc:  # PeerUnavailable, ProtocolError: not a refusal
                self._ucx_failed(exc)
        self._tcp_client().put(key, view)

    def _remote_get_into(self, key: bytes, out: memoryview) -> int:
        ucx = self._ucx_client(out.nbytes)
        if ucx is not None:
            try:
                return ucx.get_into(key, out)
            except TransportError as exc:
                self._ucx_failed(exc)
        return self._tcp_client().get_into(key, out)

    def _tcp_client(self) -> TcpClient:
        with self._lock:
            if self._tcp is None:
                host, _, port = self._info.tcp_address.rpartition(":")
                self._tcp = TcpClient(host, int(port), connections=self._config.tcp_connections,
                                      spin_us=self._config.tcp_spin_us)
            return self._tcp

    # --- metadata ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """The longest cached prefix of ``keys`` and the tier of each block (not a hit)."""
        reply = self._call("Lookup", pb.LookupRequest(keys=[check_key(k) for k in keys]))
        return LookupResult(reply.length, tuple(PB_TO_TIER[t] for t in reply.tiers))

    def lookup_many(self, key_lists: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        """:meth:`lookup` of several key lists in one round trip (``BatchLookup``), in order."""
        if not key_lists:
            return []
        reply = self._call("BatchLookup", pb.BatchLookupRequest(
            items=[pb.LookupRequest(keys=[check_key(k) for k in keys]) for keys in key_lists]))
        return [LookupResult(item.length, tuple(PB_TO_TIER[t] for t in item.tiers))
                for item in reply.items]

    def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each chunk's size, or None when the daemon does not hold it."""
        reply = self._call("Exists", pb.ExistsRequest(keys=[check_key(k) for k in keys]))
        return [None if s < 0 else int(s) for s in reply.size_bytes]

    def exists(self, key: bytes) -> bool:
        return self.sizes([key])[0] is not None

    def remove(self, key: bytes) -> list[bytes]:
        """Drop a chunk and everything cached under it; return the dropped keys (empty: it was
        not held). Raises ChunkBusy while any of them is pinned."""
        self._sync_releases()
        reply = self._call("Remove", pb.RemoveRequest(key=check_key(key)))
        return list(reply.removed)

    def pin(self, keys: Sequence[bytes], ttl_s: float = 0.0) -> int:
        """Pin chunks (all or nothing) for ``ttl_s`` (0: the daemon's default); return the
        lease id for :meth:`unpin`."""
        reply = self._call("Pin", pb.PinRequest(keys=[check_key(k) for k in keys], ttl_s=ttl_s))
        return int(reply.lease_id)

    def unpin(self, lease_id: int) -> bool:
        return bool(self._call("Unpin", pb.UnpinRequest(lease_id=lease_id)).released)

    def inspect(self, key: bytes) -> pb.ChunkEntry:
        """Everything the daemon knows about one chunk. Raises ChunkNotFound."""
        entry: pb.ChunkEntry = self._call("Inspect", pb.InspectRequest(key=check_key(key)))
        return entry

    def list_chunks(self, key_prefix: bytes = b"", tier: TierKind | None = None,
             limit: int = 0) -> pb.ListResponse:
        reply: pb.ListResponse = self._call("List", pb.ListRequest(
            key_prefix=key_prefix, tier=TIER_TO_PB[tier] if tier else pb.TIER_UNSPECIFIED,
            limit=limit))
        return reply

    def stats(self) -> pb.StatsResponse:
        """Per-tier figures of the daemon (after reporting this client's lease-free reads)."""
        self.flush_reads()
        reply: pb.StatsResponse = self._call("Stats", pb.StatsRequest())
        return reply

    def evict(self, *, tier: TierKind | None = None, bytes_: int = 0,
              key_prefix: bytes = b"") -> pb.EvictResponse:
        """Free ``bytes_`` in ``tier`` (demoting), or remove chunks whose key starts with
        ``key_prefix`` (optionally only in ``tier``)."""
        self._sync_releases()
        reply: pb.EvictResponse = self._call("Evict", pb.EvictRequest(
            tier=TIER_TO_PB[tier] if tier else pb.TIER_UNSPECIFIED, bytes=bytes_,
            key_prefix=key_prefix))
        return reply

    def drain(self) -> bool:
        """Ask the daemon to stop gracefully; False when it was already draining."""
        return bool(self._call("Drain", pb.DrainRequest()).accepted)

    def subscribe(self, from_seq: int = 0, epoch: str = "",
                  timeout_s: float | None = None) -> Iterator[pb.ChunkEvent]:
        """Chunk events after ``from_seq`` of ``epoch`` (see :mod:`kvstore.node.events`); an
        EVENT_RESYNC event ends the stream when they are gone. Stops after ``timeout_s``."""
        stream = self._stub.Subscribe(pb.SubscribeRequest(from_seq=from_seq, epoch=epoch),
                                      timeout=timeout_s)
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise translate_rpc_error(exc, "Subscribe") from exc
        finally:
            stream.cancel()

    def snapshot(self) -> tuple[str, int, list[pb.ChunkEntry]]:
        """(epoch, seq, every chunk): continue a subscription from ``seq``."""
        epoch, seq, entries = "", 0, []
        try:
            for page in self._stub.Snapshot(pb.SnapshotRequest(),
                                            timeout=self._config.rpc_timeout_s):
                epoch, seq = page.epoch, page.seq
                entries.extend(page.entries)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, "Snapshot") from exc
        return epoch, seq, entries

    def _call(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self._config.rpc_timeout_s)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, method) from exc

    def stub(self) -> pb_grpc.StoreStub:
        """The raw gRPC stub (for calls this class does not wrap)."""
        return self._stub

    # --- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close every connection and unmap the arena. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            chans, self._all, self._idle = self._all, [], []
            tcp, self._tcp = self._tcp, None
            ucx, self._ucx = self._ucx, None
            reader, self._reader = self._reader, None
            reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.close()
        if reader is not None:
            reader.close()
        for chan in chans:
            chan.close()
        if tcp is not None:
            tcp.close()
        if ucx is not None:
            ucx.close()
        if self._arena is not None:
            self._arena.close()
        self._channel.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


"""Which data plane a :class:`~kvstore.client.store_client.StoreClient` moves values over, and
what it dispatches to.

:func:`open_plane` makes the choice at connect time (:class:`DataPlane`):

* **SHM** when the daemon runs on this host (same hostname and boot id), advertises its arena
  and lease channel, and the arena maps here: a
  :class:`~kvstore.dataplane.transport.shm.ShmClient` (lease-free reads through the daemon's
  read index, leases on the lease channel; chunks DRAM cannot take right now are read over TCP);
* **UCX** when the daemon advertises a worker address and ``ucxx`` imports here, for values of
  at least ``ucx_min_bytes``, with TCP for smaller values, batches, and for ``ucx_retry_after_s``
  after any UCX failure (:class:`RemotePlane`);
* **TCP** otherwise (:class:`RemotePlane`).

Session tickets: a daemon with security (``NodeInfo.data_ticket_required``) serves its TCP
plane, UCX plane and lease channel only after a ticket from its ``IssueDataTicket`` call, which
acts for the tenant this client's gRPC calls resolve to (``StoreClientConfig.tenant`` and its
credentials). :class:`DataTickets` fetches one when first needed, shares it between the TCP,
UCX and shared-memory clients (every connection or UCX lane of each presents it), fetches a new one
a margin before it expires (connections renew theirs with a HELLO) and at once after a plane
refused it (a stale ticket after the daemon restarted).

TLS: a daemon whose TCP plane speaks TLS (``server.tcp_tls``) says so in
``NodeInfo.data_tls_required``; the TCP client then speaks TLS with the CA, certificate and
server name of this client's gRPC security (``StoreClientConfig.security``, or the
environment): the daemon serves both ports with the same certificate. Without a CA that is a
ConfigError on the first TCP call, naming the fix.

Both planes offer what :class:`ValuePlane` says, so ``StoreClient`` holds one and calls it
without asking which it is; its ``get_into`` *is* the plane's (bound once at connect: a get
costs no dispatch frame, so a lease-free get is still one Python frame and one C call).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl
from kvstore.client.store_config import DataPlane, StoreClientConfig
from kvstore.dataplane import cuda
from kvstore.dataplane.arena import host_byte_view, is_cuda_tensor
from kvstore.dataplane.tier import Buffer, ChunkKey, check_key
from kvstore.dataplane.transport.auth import SessionTicket, renew_at
from kvstore.dataplane.transport.base import ReadLease, put_each
from kvstore.dataplane.transport.shm import LeaseFreeCounters, ShmBatchRead, ShmClient
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.dataplane.transport.ucx import UcxClient, ucx_unavailable
from kvstore.errors import InvalidArgument, PeerUnavailable, TierUnavailable, TransportError
from kvstore.security.tenancy import readable_owners
from kvstore.security.tls import data_plane_client_context

log = logging.getLogger(__name__)

_NO_LEASE_FREE = LeaseFreeCounters(active=False, hits=0, misses=0, conflicts=0, retries=0)


class ValuePlane(Protocol):
    """What :class:`~kvstore.client.store_client.StoreClient` dispatches value calls to. The
    buffer and error contract is ``kvstore.dataplane.transport.base``'s; keys are checked
    here (InvalidArgument). :class:`~kvstore.dataplane.transport.shm.ShmClient` is one as it
    is; :class:`RemotePlane` is the other."""

    def get_into(self, key: bytes, dst: Buffer) -> int: ...

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None) -> None: ...

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                 parents: Sequence[bytes | None] | None = None) -> list[bool]: ...

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]
                      ) -> list[int | None]: ...

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int: ...

    def open_read(self, key: bytes) -> ReadLease:
        """A zero-copy lease (same host only: TierUnavailable elsewhere)."""
        ...

    def open_read_parts(self, parts: Sequence[Sequence[bytes]]) -> ShmBatchRead:
        """Zero-copy leases on parts of a batch, pipelined (same host only: TierUnavailable
        elsewhere)."""
        ...

    def sync(self) -> None:
        """Wait until the daemon processed this client's unanswered releases."""
        ...

    def flush_reads(self) -> None: ...

    def lease_free_counters(self) -> LeaseFreeCounters: ...

    def close(self) -> None: ...


class DataTickets:
    """The data-plane session tickets of one client of one daemon (module docstring; a
    :class:`~kvstore.dataplane.transport.auth.TicketSource`). Thread-safe: one thread fetches
    while the others wait for its ticket. Nothing is fetched at construction."""

    def __init__(self, control: DaemonControl, *, ttl_s: float = 0.0) -> None:
        """``ttl_s``: the lifetime to ask for (0: the daemon's)."""
        self._control = control
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._ticket: SessionTicket | None = None
        self.fetched = 0
        """Tickets fetched so far."""

    def current(self) -> SessionTicket:
        """A ticket valid for a while yet, fetched over gRPC when there is none, it is due for
        renewal, or it was refused. Raises the call's errors (PermissionDenied: the
        credentials do not allow the configured tenant)."""
        with self._lock:
            ticket = self._ticket
            if ticket is None or time.time() >= renew_at(ticket):
                reply = self._control.call("IssueDataTicket",
                                           pb.IssueDataTicketRequest(ttl_s=self._ttl_s))
                ticket = self._ticket = SessionTicket(bytes(reply.ticket),
                                                      reply.expires_at_unix_s, reply.ttl_s,
                                                      readable_owners(reply))
                self.fetched += 1
            return ticket

    def refused(self, ticket: bytes) -> None:
        """A plane refused ``ticket``: the next :meth:`current` fetches another."""
        with self._lock:
            if self._ticket is not None and self._ticket.ticket == ticket:
                self._ticket = None


def local_boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _device_bytes(tensor: Any) -> Any:
    """A flat uint8 view of a contiguous CUDA tensor (no copy)."""
    if not tensor.is_contiguous():
        raise InvalidArgument("a GPU buffer must be contiguous")
    torch = cuda.torch_module()
    return tensor.detach().reshape(-1).view(torch.uint8)


class RemotePlane:
    """Values over the daemon's TCP plane, or over UCX with TCP as the fallback (module
    docstring). Clients are made on first use. TCP frames carry no parent key, so a put with a
    parent goes inline over gRPC when it is small (one call) and otherwise announces the parent
    with ``SetParents`` first; ``load_prefix`` asks ``Lookup`` for the prefix first."""

    def __init__(self, control: DaemonControl, config: StoreClientConfig, *, ucx: bool) -> None:
        self.kind = DataPlane.UCX if ucx else DataPlane.TCP
        self._control = control
        self._config = config
        self._use_ucx = ucx
        self._lock = threading.Lock()
        self._tcp: TcpClient | None = None
        self._ucx: UcxClient | None = None
        self._ucx_bad_until = 0.0
        self._closed = False
        self.tickets: DataTickets | None = DataTickets(
            control, ttl_s=config.data_ticket_ttl_s) \
            if control.info.data_ticket_required else None
        """The daemon's data-plane tickets (None: it requires none)."""

    # --- values -----------------------------------------------------------------------------

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` over UCX or TCP; a CUDA ``dst`` through a pinned host bounce buffer."""
        if not self._use_ucx and not is_cuda_tensor(dst):
            # The TCP plane's common case, straight to the transport (which checks the key and
            # the buffer itself).
            tcp = self._tcp
            return (tcp if tcp is not None else self.tcp_client()).get_into(key, dst)
        k = check_key(key)
        if is_cuda_tensor(dst):
            return self._get_into_device(k, dst)
        return self._remote_get_into(k, host_byte_view(dst, writable=True))

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None) -> None:
        k = check_key(key)
        p = check_key(parent) if parent is not None else None
        if is_cuda_tensor(src):
            self.put(k, _device_bytes(src).cpu().numpy(), parent=p)
            return
        view = host_byte_view(src)
        if p is not None and view.nbytes <= self._control.info.inline_max_bytes:
            self._control.call("Put", pb.PutRequest(key=k, parent=p, value=bytes(view)))  # small: one copy
            return
        if p is not None:
            self._control.call("SetParents", pb.SetParentsRequest(keys=[k], parents=[p]))
        self._remote_put(k, view)

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                 parents: Sequence[bytes | None] | None = None) -> list[bool]:
        """Roots: pipelined TCP puts. With parents: TCP frames carry none, and a batch may spread
        over connections (unordered), so one :meth:`put` per item in order (inline over gRPC
        when small, else ``SetParents`` and a TCP put): the same results (``put_each``)."""
        if parents is None or all(p is None for p in parents):
            return self.tcp_client().put_many(keys, srcs)
        if len(parents) != len(keys) or len(srcs) != len(keys):
            raise InvalidArgument(f"{len(keys)} keys, {len(srcs)} values, {len(parents)} "
                                  "parents")
        return put_each([check_key(k) for k in keys], srcs,
                        [None if p is None else check_key(p) for p in parents], self.put)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[int | None]:
        return self.tcp_client().get_many_into(keys, dsts)

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int:
        if len(keys) != len(dsts):
            raise InvalidArgument(f"{len(keys)} keys but {len(dsts)} destinations")
        if not keys:
            return 0
        checked: list[bytes] = [check_key(k) for k in keys]
        outs = [host_byte_view(d, writable=True) for d in dsts]
        n = self._control.lookup(checked).length
        if n == 0:
            return 0
        loaded = 0
        for size in self.tcp_client().get_many_into(checked[:n], outs[:n]):
            if size is None:
                break
            loaded += 1
        return loaded

    def open_read(self, key: bytes) -> ReadLease:
        raise TierUnavailable("zero-copy views need the shared-memory data plane")

    def open_read_parts(self, parts: Sequence[Sequence[bytes]]) -> ShmBatchRead:
        raise TierUnavailable("zero-copy views need the shared-memory data plane")

    def sync(self) -> None:
        """Nothing is sent without an answer here."""

    def flush_reads(self) -> None:
        """No lease-free reads here."""

    def lease_free_counters(self) -> LeaseFreeCounters:
        return _NO_LEASE_FREE

    def _get_into_device(self, key: ChunkKey, dst: Any) -> int:
        torch = cuda.torch_module()
        flat = _device_bytes(dst)
        bounce = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        n = self._remote_get_into(key, memoryview(bounce.numpy()))
        flat.copy_(bounce)
        return n

    # --- UCX with TCP as the fallback -------------------------------------------------------

    def _ucx_client(self, size_bytes: int) -> UcxClient | None:
        """The UCX client for a value of ``size_bytes``, or None when this plane does not use
        UCX, the value is below ``ucx_min_bytes`` or UCX is marked bad."""
        if not self._use_ucx or size_bytes < self._config.ucx_min_bytes \
                or time.monotonic() < self._ucx_bad_until:
            return None
        with self._lock:
            if self._ucx is None:
                cfg, info = self._config, self._control.info
                self._ucx = UcxClient(info.ucx_worker_address,
                                      io_timeout_s=cfg.ucx_io_timeout_s,
                                      liveness=self._control.daemon_alive,
                                      liveness_interval_s=cfg.ucx_liveness_interval_s,
                                      max_value_bytes=info.max_value_bytes or (1 << 30),
                                      ticket=self.tickets)
            return self._ucx

    def _ucx_failed(self, exc: TransportError) -> None:
        log.warning("UCX transfer failed, using TCP for %g s: %s",
                    self._config.ucx_retry_after_s, exc)
        self._ucx_bad_until = time.monotonic() + self._config.ucx_retry_after_s

    def _remote_put(self, key: bytes, view: memoryview) -> None:
        ucx = self._ucx_client(view.nbytes)
        if ucx is not None:
            try:
                ucx.put(key, view)
                return
            except TransportError as exc:  # PeerUnavailable, ProtocolError: not a refusal
                self._ucx_failed(exc)
        self.tcp_client().put(key, view)

    def _remote_get_into(self, key: bytes, out: memoryview) -> int:
        ucx = self._ucx_client(out.nbytes)
        if ucx is not None:
            try:
                return ucx.get_into(key, out)
            except TransportError as exc:
                self._ucx_failed(exc)
        return self.tcp_client().get_into(key, out)

    def tcp_client(self) -> TcpClient:
        """The daemon's TCP plane (made on first use; also the shared-memory plane's way to
        read what DRAM cannot take now)."""
        with self._lock:
            if self._tcp is None:
                if self._closed:
                    raise PeerUnavailable("the client is closed")
                host, _, port = self._control.info.tcp_address.rpartition(":")
                io_timeout_s = self._config.tcp_io_timeout_s
                tls, server_name = None, None
                if self._control.info.data_tls_required:
                    security = self._config.client_security()
                    tls, server_name = data_plane_client_context(security), security.server_name
                self._tcp = TcpClient(host, int(port), connections=self._config.tcp_connections,
                                      spin_us=self._config.tcp_spin_us,
                                      io_timeout_s=io_timeout_s,
                                      connect_timeout_s=min(5.0, io_timeout_s),
                                      ticket=self.tickets, tls=tls,
                                      tls_server_name=server_name)
            return self._tcp

    def close(self) -> None:
        with self._lock:
            self._closed = True
            tcp, self._tcp = self._tcp, None
            ucx, self._ucx = self._ucx, None
        if tcp is not None:
            tcp.close()
        if ucx is not None:
            ucx.close()


# --- the choice ----------------------------------------------------------------------------


def same_host_reason(info: pb.NodeInfo) -> str:
    """Why the shared-memory plane cannot be used for this daemon, or "" when it may be."""
    if info.hostname != socket.gethostname() or info.boot_id != local_boot_id():
        return f"the daemon runs on {info.hostname}, not on this host"
    if not info.shm_arena or not info.shm_socket:
        return "the daemon serves no shared-memory arena or lease channel"
    return ""


def ucx_possible(info: pb.NodeInfo, config: StoreClientConfig) -> bool:
    if config.data_plane not in (DataPlane.AUTO, DataPlane.UCX):
        return False
    if not info.ucx_worker_address:
        return False
    reason = ucx_unavailable()
    if reason is not None:
        log.info("not using UCX: %s", reason)
        return False
    return True


def open_plane(control: DaemonControl, config: StoreClientConfig
               ) -> tuple[ValuePlane, RemotePlane, DataPlane]:
    """(the plane values move over, the remote plane, which one it is). The two planes are one
    object unless the choice is shared memory, which reads through the remote plane's TCP client
    what DRAM cannot take right now.

    Raises TierUnavailable (SHM or UCX was required but is not possible from here),
    PeerUnavailable (the lease channel does not answer).
    """
    info = control.info
    if config.data_plane is DataPlane.UCX and not ucx_possible(info, config):
        reason = ucx_unavailable() or "the daemon serves no UCX data plane"
        raise TierUnavailable(f"UCX data plane unavailable: {reason}")
    if config.data_plane in (DataPlane.AUTO, DataPlane.SHM):
        reason = same_host_reason(info)
        if not reason:
            remote = RemotePlane(control, config, ucx=False)
            try:
                shm = ShmClient.connect(info.shm_socket, info.shm_arena,
                                        read_index=info.shm_read_index,
                                        config=config.shm_config(), fallback=remote.tcp_client,
                                        ticket=remote.tickets)
            except TierUnavailable as exc:  # the arena does not map here
                reason = str(exc)
            except BaseException:
                remote.close()
                raise
            else:
                return shm, remote, DataPlane.SHM
        if config.data_plane is DataPlane.SHM:
            raise TierUnavailable(f"shared-memory data plane unavailable: {reason}")
        log.info("using the TCP data plane: %s", reason)
    remote = RemotePlane(control, config, ucx=ucx_possible(info, config))
    return remote, remote, remote.kind

"""The store daemon: one node's tiers served over gRPC, TCP and shared memory.

What :meth:`StoreDaemon.start` brings up, in order (the constructor only records the config):

1. sweep shared-memory arenas left by dead daemons, build the tiers (DRAM arena with its read
   index for lease-free same-host reads, NVMe files, HBM with a GPU) and the
   :class:`~kvstore.node.cache.TieredCache`, and **recover** what NVMe kept (each recovered
   chunk is a STORED event of the new epoch);
2. the TCP data plane (:class:`~kvstore.dataplane.transport.tcp.TcpServer`, TLS with
   ``server.tcp_tls``, over
   :class:`~kvstore.node.backend.CacheLeaseBackend`), the UCX data plane over the same backend
   when ``ucxx`` imports and ``server.ucx`` allows (its worker address goes into ``Info`` and
   the etcd record), the same-host lease channel
   (:class:`~kvstore.dataplane.transport.shm.ShmServer` over :class:`~kvstore.node.backend.ShmLeases`),
   the gRPC service with health checking and reflection (authenticated as ``security`` says:
   mTLS or bearer tokens, or no authentication on loopback; see docs/security.md),
   and the metrics endpoint when enabled. With authentication configured the daemon draws a
   :class:`~kvstore.security.tickets.TicketAuthority` (a random key per start) and the data
   planes serve a connection (a UCX lane) only after a session ticket from ``IssueDataTicket``,
   acting for the tenant it names (``NodeInfo.data_ticket_required``);
3. background tasks: a reaper (expired same-host leases and pins, every 0.5 s) and a demoter
   (tiers above their high watermark down to their low one);
4. etcd registration under a lease with keepalive, when an endpoint is configured.

Graceful stop (SIGTERM, SIGINT or the Drain RPC, e.g. ``kvtier drain``): health turns
NOT_SERVING and calls that start new work fail with UNAVAILABLE; the node deregisters from
etcd at once (nobody should route to a node that refuses work); transfers in flight get
``shutdown.drain_timeout_s`` to finish (TCP connections, lease-channel clients holding leases,
gRPC calls); leftover reservations are aborted; with ``shutdown.persist_dram`` every DRAM chunk
is demoted to NVMe; the tiers close (NVMe is durable at every put; the DRAM arena is unlinked).
``kvtier daemon`` then exits 0. A ``kill -9`` skips all this: the etcd key expires after its TTL,
and the next start recovers the NVMe chunks and sweeps the old arena.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvstore import __version__
from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.dataplane.arena import remove_stale_arenas
from kvstore.dataplane.dram import DEFAULT_ARENA, DramTier, GroupedDramTier
from kvstore.dataplane.read_index import slots_for
from kvstore.dataplane.tier import Tier, TierKind, TierStats
from kvstore.dataplane.transport.auth import PeerAllowlist
from kvstore.dataplane.transport.shm import ShmServer
from kvstore.dataplane.transport.tcp import TcpServer, TcpServerConfig
from kvstore.dataplane.transport.tcp.tls import ServerTlsSource
from kvstore.dataplane.transport.ucx import UcxServer, UcxServerConfig, ucx_unavailable
from kvstore.errors import ChunkBusy, ChunkNotFound, ConfigError, KvtierError, TierUnavailable
from kvstore.node.backend import CacheLeaseBackend, ParentHints, ShmLeases
from kvstore.node.cache import CacheConfig, ChunkChange, TieredCache
from kvstore.node.config import DaemonConfig, UcxMode
from kvstore.node.events import EventLog
from kvstore.node.index import IndexEntry
from kvstore.node.metrics import DaemonMetrics, MetricsSnapshot
from kvstore.node.service import SERVICE_NAME, StoreService
from kvstore.security.server import SecureServing
from kvstore.security.tickets import TicketAuthority
from kvstore.wire import TIER_TO_PB

log = logging.getLogger(__name__)

READY_PREFIX = "KVTIER-DAEMON-READY "
"""``kvtier daemon`` prints this, then its :class:`DaemonAddresses` as JSON, once serving."""
GRPC_MAX_MESSAGE_BYTES = 64 << 20
"""Batches of inline values may exceed gRPC's 4 MiB default; single values are capped by
``server.inline_max_bytes``."""
REAPER_INTERVAL_S = 0.5


def boot_id() -> str:
    """This boot's id (equal on two processes only when they run on the same host and boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class DaemonAddresses:
    node_id: str
    epoch: str
    pid: int
    grpc_address: str
    tcp_address: str
    shm_arena: str
    shm_socket: str
    metrics_address: str
    ucx_address: str = ""
    """The UCX worker address, hex ("" when the daemon serves no UCX data plane)."""

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


class StoreDaemon:
    """One node. ``await start()``, then ``await wait_stopped()`` (or ``await drain()``)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.events = EventLog(config.events.ring_capacity)
        self.metrics = DaemonMetrics()
        self.draining = False
        self.started_monotonic = 0.0
        self.lease_free_hits = 0
        """Reads reported by same-host clients that copied through the read index."""
        self.lease_free_bytes = 0
        self._cache: TieredCache | None = None
        self._backend: CacheLeaseBackend | None = None
        self._leases: ShmLeases | None = None
        self._tcp: TcpServer | None = None
        self._ucx: UcxServer | None = None
        self._shm: ShmServer | None = None
        self._group_leases: dict[str, ShmLeases] = {}
        """Each arena group's leases (``dram.arena_groups``; docs/dram-arena.md)."""
        self._group_shm: dict[str, ShmServer] = {}
        """Each arena group's lease channel, admitting only that group's users."""
        self._grpc: grpc.aio.Server | None = None
        self._health: Any = None
        self._service: StoreService | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._etcd: Any = None
        self._registration: Any = None
        self._addresses: DaemonAddresses | None = None
        self._stopping: asyncio.Event | None = None
        self._stopped: asyncio.Event | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self.serving: SecureServing | None = None
        """How the gRPC service authenticates (valid after start)."""
        self.tickets: TicketAuthority | None = None
        """The data planes' session tickets (after start; None without authentication)."""

    # --- parts (valid after start) ------------------------------------------------------------

    @property
    def cache(self) -> TieredCache:
        if self._cache is None:
            raise TierUnavailable("the daemon is not started")
        return self._cache

    @property
    def backend(self) -> CacheLeaseBackend:
        assert self._backend is not None
        return self._backend

    @property
    def leases(self) -> ShmLeases:
        assert self._leases is not None
        return self._leases

    @property
    def executor(self) -> ThreadPoolExecutor:
        assert self._executor is not None
        return self._executor

    @property
    def stopping(self) -> asyncio.Event:
        assert self._stopping is not None
        return self._stopping

    @property
    def addresses(self) -> DaemonAddresses:
        assert self._addresses is not None
        return self._addresses

    @staticmethod
    def index_clock() -> float:
        return time.monotonic()

    # --- start ------------------------------------------------------------------------------

    async def start(self) -> DaemonAddresses:
        cfg = self.config
        self._stopping = asyncio.Event()
        self._stopped = asyncio.Event()
        self.started_monotonic = time.monotonic()
        # Refuse an unauthenticated non-loopback bind (ConfigError naming the fix) and load
        # the certificates before anything is built or bound.
        self.serving = SecureServing(cfg.security, cfg.server.host, "the daemon's gRPC service")
        if self.serving.authenticator is not None:
            self.tickets = TicketAuthority(cfg.node_id)
        if cfg.dram.arena_groups and self.tickets is None:
            raise ConfigError("dram.arena_groups needs security (security.token_keys or mTLS): "
                              "a same-host session's tenant, which picks its arena, comes from "
                              "its identity, and without it every session is the default "
                              "tenant's")
        if cfg.etcd.enabled:  # a wrong etcd certificate or password path fails before binding
            cfg.etcd.security().check_files()
        swept = remove_stale_arenas()
        if swept:
            log.info("removed %d shared-memory arena(s) of dead processes", len(swept))
        self._executor = ThreadPoolExecutor(cfg.server.rpc_workers, thread_name_prefix="kvtier-rpc")
        loop = asyncio.get_running_loop()
        try:
            self._cache = await loop.run_in_executor(self._executor, self._build_cache)
            report = await loop.run_in_executor(self._executor, self._cache.recover)
            log.info("recovered %d chunk(s) %s, dropped %d orphan(s)", report.recovered,
                     {k.value: n for k, n in report.by_tier.items()}, report.dropped_orphans)
            self._leases = ShmLeases(self._cache, max_ttl_s=cfg.server.max_ttl_s,
                                     max_leases=cfg.server.max_leases)
            self._backend = CacheLeaseBackend(
                self._cache, parents=ParentHints(max_ttl_s=cfg.server.max_ttl_s))
            self._tcp = TcpServer(self._backend, TcpServerConfig(
                host=cfg.server.host, port=cfg.server.tcp_port,
                max_value_bytes=cfg.server.max_value_bytes,
                io_timeout_s=cfg.server.tcp_io_timeout_s,
                reservation_ttl_s=cfg.server.reservation_ttl_s,
                drain_timeout_s=cfg.shutdown.drain_timeout_s,
                idle_timeout_s=cfg.server.idle_timeout_s,
                header_timeout_s=cfg.server.header_timeout_s,
                max_connections=cfg.server.max_connections),
                authorize=None if self.tickets is None else self.tickets.authorize,
                tls=self._data_plane_tls())
            tcp_endpoint = self._tcp.start()
            ucx_address = self._start_ucx()
            shm_socket = ""
            if cfg.server.shm_channel:
                self._shm = ShmServer(self._leases, lease_ttl_s=cfg.server.shm_lease_ttl_s,
                                      on_reads=self._record_lease_free_reads,
                                      header_timeout_s=cfg.server.header_timeout_s,
                                      idle_timeout_s=cfg.server.idle_timeout_s,
                                      max_connections=cfg.server.max_connections,
                                      authorize=None if self.tickets is None
                                      else self.tickets.authorize)
                shm_socket = self._shm.start().host  # the abstract address, @kvtier-...
                self._start_group_channels()
            grpc_port = await self._start_grpc()
            metrics_address = ""
            self.metrics.source = self
            if cfg.metrics.enabled:
                port = await loop.run_in_executor(self._executor, self.metrics.serve,
                                                  cfg.metrics.host, cfg.metrics.port,
                                                  cfg.security, self.serving)
                metrics_address = f"{cfg.metrics.host}:{port}"
            host = self._advertised_host()
            self._addresses = DaemonAddresses(
                node_id=cfg.node_id, epoch=self.events.epoch, pid=os.getpid(),
                grpc_address=f"{host}:{grpc_port}",
                tcp_address=f"{host}:{tcp_endpoint.port}",
                shm_arena=self.backend.dram.arena_name, shm_socket=shm_socket,
                metrics_address=metrics_address, ucx_address=ucx_address.hex())
            self._tasks = [loop.create_task(self._reaper(), name="kvtier-reaper"),
                           loop.create_task(self._demoter(), name="kvtier-demoter")]
            if cfg.etcd.enabled:
                await self._register()
        except BaseException:
            await self._teardown()
            raise
        log.info("node %s serving: gRPC %s, TCP %s, epoch %s", cfg.node_id,
                 self._addresses.grpc_address, self._addresses.tcp_address, self.events.epoch)
        return self._addresses

    def _start_group_channels(self) -> None:
        """One lease table and one lease channel per arena group (``dram.arena_groups``): the
        channel admits (``SO_PEERCRED``) the daemon's uid, the group's users and peers whose
        primary gid is the group's, and serves only sessions of the group's tenants."""
        cfg = self.config
        for group in cfg.dram.arena_group_list():
            leases = ShmLeases(self.cache, max_ttl_s=cfg.server.max_ttl_s,
                               budget=self.leases.budget, arena=group.name)
            self._group_leases[group.name] = leases
            server = ShmServer(leases, lease_ttl_s=cfg.server.shm_lease_ttl_s,
                               on_reads=self._record_lease_free_reads,
                               header_timeout_s=cfg.server.header_timeout_s,
                               idle_timeout_s=cfg.server.idle_timeout_s,
                               max_connections=cfg.server.max_connections,
                               allowed_peers=PeerAllowlist.of(uids=sorted(group.uids),
                                                              gids=[group.gid]),
                               authorize=None if self.tickets is None
                               else self.tickets.authorize)
            self._group_shm[group.name] = server
            log.info("arena group %s (tenants %s): arena %s, lease channel %s for %s",
                     group.name, ", ".join(sorted(group.tenants)),
                     leases.arena_name, server.start().host, server.allowed_peers.describe())

    def leases_for(self, tenant: str | None) -> ShmLeases:
        """The same-host leases on ``tenant``'s arena (the default arena's for None and for a
        tenant in no arena group)."""
        dram = self.cache.tier(TierKind.DRAM)
        if tenant is None or not isinstance(dram, GroupedDramTier):
            return self.leases
        return self._group_leases.get(dram.arena_of(tenant), self.leases)

    def lease_tables(self) -> list[ShmLeases]:
        """Every same-host lease table: the default arena's, then each group's."""
        return [self.leases, *self._group_leases.values()]

    def _leases_open(self) -> tuple[int, int]:
        """(read leases, write leases) open in every lease table."""
        counts = [t.open_count() for t in self.lease_tables()]
        return sum(r for r, _w in counts), sum(w for _r, w in counts)

    def _data_plane_tls(self) -> ServerTlsSource | None:
        """The TCP plane's TLS context source with ``server.tcp_tls`` (the gRPC certificate
        files, loaded now so that a broken set fails the start), else None."""
        if not self.config.server.tcp_tls:
            return None
        assert self.serving is not None
        certificates = self.serving.certificates
        if certificates is None:
            raise ConfigError("server.tcp_tls needs the daemon's certificate: set "
                              "security.cert_file and security.key_file (the TCP data plane "
                              "serves the gRPC port's certificate)")
        certificates.ssl_context()
        return certificates.ssl_context

    def _start_ucx(self) -> bytes:
        """Serve the UCX data plane when the config and this machine allow; its worker address
        (empty when not serving)."""
        cfg = self.config.server
        if cfg.ucx is UcxMode.DISABLED:
            return b""
        if self.tickets is not None and cfg.ucx is UcxMode.AUTO:
            # Secure by default: a ticketed lane is bound only by its unauthenticated 32-bit
            # id in the tags (docs/security.md, "Data planes"), so UCX under security is served
            # only when asked for (server.ucx: required, on a trusted network).
            log.info("no UCX data plane: security is configured and server.ucx is auto (set "
                     "it to required to serve UCX with session tickets on a trusted network)")
            return b""
        reason = ucx_unavailable()
        if reason is not None:
            if cfg.ucx is UcxMode.REQUIRED:
                raise TierUnavailable(f"server.ucx is required but {reason}")
            log.info("no UCX data plane: %s", reason)
            return b""
        self._ucx = UcxServer(self.backend, UcxServerConfig(
            host=self._advertised_host(), max_value_bytes=cfg.max_value_bytes,
            io_timeout_s=cfg.ucx_io_timeout_s,
            drain_timeout_s=self.config.shutdown.drain_timeout_s,
            # Bounded and reaped as the TCP plane's connections are (docs/transport.md).
            max_connections=cfg.max_connections,
            client_idle_ttl_s=min(cfg.idle_timeout_s, 86400.0)),
            # With security each lane's HELLO carries a session ticket, as a TCP connection's.
            authorize=None if self.tickets is None else self.tickets.authorize)
        return self._ucx.start().worker_address

    def _build_cache(self) -> TieredCache:
        cfg = self.config
        tiers: dict[TierKind, Tier] = {}
        try:
            if cfg.hbm.capacity_bytes > 0:
                from kvstore.dataplane.hbm import HbmTier

                tiers[TierKind.HBM] = HbmTier(cfg.hbm.capacity_bytes, device=cfg.hbm.device)
            slots = 0
            if cfg.dram.read_index and cfg.server.shm_channel:  # no channel: no same-host client
                slots = cfg.dram.read_index_slots or slots_for(cfg.dram.capacity_bytes)
                if self.tickets is not None:
                    log.warning("the lease-free read index is on (dram.read_index): a same-host "
                                "process that may map an arena reads every published chunk in "
                                "it by key without a tenant check (every tenant's with one arena, "
                                "its group's tenants' with dram.arena_groups; owner tags only keep "
                                "kvtier's own ticketed readers to their tenant's); set "
                                "dram.read_index: false to lease and check every same-host read "
                                "(docs/security.md, \"Data planes\")")
            groups = cfg.dram.arena_group_list()
            if groups:
                tiers[TierKind.DRAM] = GroupedDramTier(
                    cfg.dram.capacity_bytes, [g.arena() for g in groups],
                    prefault=cfg.dram.prefault, arena_name=cfg.dram.arena_name,
                    read_index_slots=slots)
            else:
                tiers[TierKind.DRAM] = DramTier(cfg.dram.capacity_bytes,
                                                prefault=cfg.dram.prefault,
                                                arena_name=cfg.dram.arena_name,
                                                read_index_slots=slots)
            if cfg.nvme.directory is not None:
                from kvstore.dataplane.nvme.config import NvmeTierConfig
                from kvstore.dataplane.nvme.tier import NvmeTier

                tiers[TierKind.NVME] = NvmeTier.open(NvmeTierConfig(
                    directory=cfg.nvme.directory, capacity_bytes=cfg.nvme.capacity_bytes,
                    segment_bytes=cfg.nvme.segment_bytes))
            return TieredCache(tiers, policy=cfg.cache.policy, observer=self._observe,
                               observe_many=self.events.record_many,
                               config=CacheConfig(
                                   write_tier=cfg.cache.write_tier,
                                   promote_on_hit=cfg.cache.promote_on_hit,
                                   lease_ttl_s=cfg.cache.lease_ttl_s,
                                   high_watermark=cfg.cache.high_watermark,
                                   low_watermark=cfg.cache.low_watermark),
                               quotas=cfg.tenants.quota_list(),
                               max_tenants=cfg.tenants.max_tracked)
        except BaseException:
            for tier in tiers.values():
                tier.close()
            raise

    def _observe(self, change: ChunkChange) -> None:
        self.events.record(change)

    def _record_lease_free_reads(self, keys: list[bytes]) -> None:
        """A same-host client's report of chunks it copied through the read index."""
        hits, nbytes = self.cache.record_reads(keys)
        self.lease_free_hits += hits
        self.lease_free_bytes += nbytes

    async def _start_grpc(self) -> int:
        cfg = self.config
        assert self.serving is not None
        server = grpc.aio.server(interceptors=self.serving.aio_interceptors(), options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # Bounded as each data-plane listener is: a flood of idle HTTP/2 connections would
            # otherwise hold descriptors up to the process limit (found by the fault suite).
            ("grpc.max_allowed_incoming_connections", cfg.server.max_connections),
            # ... and one with no call for idle_timeout_s is closed (GOAWAY), as a data-plane
            # connection is: at the bound, idle connections kept an arriving client out.
            ("grpc.max_connection_idle_ms", max(1, round(cfg.server.idle_timeout_s * 1000))),
        ])
        self._service = StoreService(self)
        self._service.register(server)  # decode-safe: bad bytes are INVALID_ARGUMENT
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        port = self.serving.add_port(server, f"{cfg.server.host}:{cfg.server.grpc_port}")
        if port == 0:
            raise TierUnavailable(f"cannot bind gRPC on {cfg.server.host}:{cfg.server.grpc_port}")
        await server.start()
        self._grpc = server
        for name in ("", SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    def _advertised_host(self) -> str:
        cfg = self.config.server
        if cfg.advertise_host:
            return cfg.advertise_host
        if cfg.host in ("0.0.0.0", "::", ""):
            return socket.gethostname()
        return cfg.host

    async def _register(self) -> None:
        from kvstore.membership.etcd import KeyLayout, etcd_client
        from kvstore.membership.nodes import NodeRecord, register_node

        cfg = self.config
        record = NodeRecord(
            node_id=cfg.node_id, grpc_address=self.addresses.grpc_address,
            tcp_address=self.addresses.tcp_address, hostname=socket.gethostname(),
            tier_capacity_bytes={kind: tier.capacity_bytes
                                 for kind, tier in self.cache.tiers.items()},
            started_at_unix_s=time.time(), version=__version__,
            shm_arena=self.addresses.shm_arena,
            ucx_address=self.addresses.ucx_address or None)
        self._etcd = etcd_client(cfg.etcd.endpoints, security=cfg.etcd.security())
        self._registration = register_node(self._etcd, record, ttl_s=cfg.etcd.ttl_s,
                                           layout=KeyLayout(cfg.etcd.prefix))
        await self._registration.start()
        log.info("registered in etcd at %s as %s", ",".join(cfg.etcd.endpoints),
                 self._registration.key)

    # --- background work --------------------------------------------------------------------

    async def _reaper(self) -> None:
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(REAPER_INTERVAL_S):
                    await self.stopping.wait()
            reads = writes = 0
            for table in self.lease_tables():
                r, w = table.expire()
                reads, writes = reads + r, writes + w
            if reads or writes:
                log.info("expired %d read and %d write lease(s)", reads, writes)
            if self._service is not None:
                self._service.expire_pins()

    async def _demoter(self) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.cache.demote_interval_s
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.stopping.wait()
            if self.stopping.is_set():
                return
            try:
                await loop.run_in_executor(self.executor, self.cache.demote_to_low_watermark)
            except KvtierError as exc:
                log.warning("background demotion failed: %s", exc)

    # --- queries used by the service --------------------------------------------------------

    def node_info(self, tenant: str | None = None) -> pb.NodeInfo:
        """What Info answers. With arena groups, the same-host fields (arena, lease channel,
        read index) are those of ``tenant``'s arena: the caller's (None: the default arena)."""
        a = self.addresses
        shm_arena, shm_socket = a.shm_arena, a.shm_socket
        read_index = self.backend.dram.read_index_name
        leases = self.leases_for(tenant) if shm_socket else self.leases
        if leases.arena != DEFAULT_ARENA:
            shm_arena, read_index = leases.arena_name, leases.read_index_name
            shm_socket = self._group_shm[leases.arena].address
        return pb.NodeInfo(
            node_id=a.node_id, epoch=a.epoch, hostname=socket.gethostname(), boot_id=boot_id(),
            version=__version__, pid=a.pid, grpc_address=a.grpc_address,
            tcp_address=a.tcp_address, shm_arena=shm_arena, shm_socket=shm_socket,
            inline_max_bytes=self.config.server.inline_max_bytes,
            max_value_bytes=self.config.server.max_value_bytes,
            tier_capacity_bytes={k.value: t.capacity_bytes for k, t in self.cache.tiers.items()},
            draining=self.draining, ucx_worker_address=bytes.fromhex(a.ucx_address),
            shm_read_index=read_index if shm_socket else "",
            data_ticket_required=self.tickets is not None,
            data_tls_required=self.config.server.tcp_tls)

    def list_entries(self, key_prefix: bytes, tier: TierKind | None, limit: int,
                     tenant: str | None = None) -> tuple[list[IndexEntry], bool]:
        """Index entries whose key starts with ``key_prefix`` (with a copy in ``tier``: its
        primary or its backing copy; visible to ``tenant``, None: every tenant), sorted by
        key, each once; at most ``limit`` (0: all). Returns them and whether more matched."""
        found: set[bytes] = set()
        for kind, t in self.cache.tiers.items():
            if tier is not None and kind is not tier:
                continue
            found.update(info.key for info in t.chunks() if info.key.startswith(key_prefix))
        keys = sorted(found)
        entries: list[IndexEntry] = []
        for key in keys:
            entry = self.cache.entry(key, tenant)
            if entry is None:
                continue
            if limit and len(entries) == limit:
                return entries, True
            entries.append(entry)
        return entries, False

    def evict_prefix(self, key_prefix: bytes, tier: TierKind | None,
                     tenant: str | None = None) -> tuple[int, int, int]:
        """Remove every chunk whose key starts with ``key_prefix`` (and its descendants); with
        ``tenant``, only chunks that tenant owns.

        Returns (chunks removed, pinned chunks skipped, bytes freed). Bytes freed is how much
        less the tiers' indexes hold afterwards (puts running meanwhile are netted in).
        """
        def held() -> int:
            return sum(self.cache.index.usage(kind).used_bytes for kind in self.cache.tiers)

        before = held()
        entries, _ = self.list_entries(key_prefix, tier, 0, tenant)
        removed = busy = 0
        gone: set[bytes] = set()
        for entry in sorted(entries, key=lambda e: -e.depth):
            if entry.key in gone:
                continue
            try:
                dropped = self.cache.remove(entry.key, tenant)
            except ChunkNotFound:  # gone meanwhile, or a shared chunk ``tenant`` may not drop
                continue
            except ChunkBusy:
                busy += 1
                continue
            gone.update(dropped)
            removed += len(dropped)
        return removed, busy, max(0, before - held())

    def stats_pb(self) -> pb.StatsResponse:
        cache = self.cache
        reads, writes = self._leases_open()
        tiers = []
        for report in cache.report():
            s, c = report.stats, report.counters
            tiers.append(pb.TierStats(
                tier=TIER_TO_PB[report.kind], capacity_bytes=s.capacity_bytes,
                used_bytes=s.used_bytes, chunks=s.chunks, largest_free_bytes=s.largest_free_bytes,
                hits=c.hits, puts=c.puts, bytes_written=c.bytes_written, bytes_read=c.bytes_read,
                demotions_out=c.demotions_out, promotions_in=c.promotions_in, drops=c.drops,
                corrupt=report.corrupt))
        tcp_open = self._tcp.stats().connections_open if self._tcp is not None else 0
        ucx_open = self._ucx.stats().endpoints_open if self._ucx is not None else 0
        return pb.StatsResponse(
            node_id=self.config.node_id, epoch=self.events.epoch, tiers=tiers,
            misses=cache.misses, lookups=cache.lookups, last_seq=self.events.last_seq,
            shm_leases_open=reads + writes, tcp_connections_open=tcp_open,
            ucx_endpoints_open=ucx_open, uptime_s=time.monotonic() - self.started_monotonic)

    def metrics_snapshot(self) -> MetricsSnapshot:
        tcp = self._tcp.stats() if self._tcp is not None else None
        return MetricsSnapshot(
            tiers=self.cache.report(), misses=self.cache.misses,
            events_last_seq=self.events.last_seq, shm_leases_open=self._leases_open(),
            shm_bytes=(sum(t.bytes_read for t in self.lease_tables()) + self.lease_free_bytes,
                       sum(t.bytes_written for t in self.lease_tables())),
            tcp_bytes=(tcp.bytes_sent, tcp.bytes_received) if tcp else (0, 0),
            tcp_connections_open=tcp.connections_open if tcp else 0,
            dram_arenas=self._arena_stats())

    def _arena_stats(self) -> tuple[tuple[str, TierStats], ...]:
        """Each DRAM arena's stats, with arena groups (none with one arena)."""
        dram = self.cache.tier(TierKind.DRAM)
        if not isinstance(dram, GroupedDramTier):
            return ()
        return tuple((name, dram.arena(name).stats()) for name in dram.arenas())

    # --- stop -------------------------------------------------------------------------------

    def request_drain(self, reason: str) -> bool:
        """Start a graceful stop in the background; False when one is already under way."""
        if self._drain_task is not None:
            return False
        log.info("draining: %s", reason)
        self._drain_task = asyncio.get_running_loop().create_task(self.drain(),
                                                                  name="kvtier-drain")
        return True

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def drain(self) -> None:
        """The graceful stop described in the module docstring. Idempotent."""
        if self.draining:
            assert self._stopped is not None
            await self._stopped.wait()
            return
        self.draining = True
        cfg = self.config
        loop = asyncio.get_running_loop()
        timeout = cfg.shutdown.drain_timeout_s
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._registration is not None:
            await self._deregister()
        self.stopping.set()  # ends Subscribe streams and the background tasks
        stops = []
        if self._shm is not None:
            stops.append(loop.run_in_executor(self.executor, self._shm.close, timeout))
        for group_shm in self._group_shm.values():
            stops.append(loop.run_in_executor(self.executor, group_shm.close, timeout))
        if self._tcp is not None:
            stops.append(loop.run_in_executor(self.executor, self._tcp.close, timeout))
        if self._ucx is not None:
            stops.append(loop.run_in_executor(self.executor, self._ucx.close, timeout))
        await asyncio.gather(*stops)
        if self._grpc is not None:
            await self._grpc.stop(timeout)
            self._grpc = None
        if cfg.shutdown.persist_dram:
            moved = await loop.run_in_executor(self.executor, self.cache.persist)
            log.info("persisted %d bytes of memory-tier chunks to NVMe", moved)
        await self._teardown()
        log.info("node %s drained", cfg.node_id)

    async def _deregister(self) -> None:
        try:
            await self._registration.close()
        except KvtierError as exc:
            log.warning("deregistering failed (the key expires by itself): %s", exc)
        self._registration = None
        if self._etcd is not None:
            await self._etcd.close()
            self._etcd = None

    async def _teardown(self) -> None:
        """Release whatever start() made (also after a failed start)."""
        if self._stopping is not None:
            self._stopping.set()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []
        if self._registration is not None:
            await self._deregister()
        if self._grpc is not None:
            await self._grpc.stop(0)
            self._grpc = None
        if self._shm is not None:
            self._shm.close()
        for group_shm in self._group_shm.values():
            group_shm.close()
        if self._tcp is not None:
            self._tcp.close(0)
        if self._ucx is not None:
            self._ucx.close(0)
        for group_leases in self._group_leases.values():
            group_leases.close()
        if self._leases is not None:
            self._leases.close()
        self.metrics.close()
        if self._cache is not None:
            self._cache.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._stopped is not None:
            self._stopped.set()


async def run_daemon(config: DaemonConfig, *, ready_file: str | None = None) -> int:
    """Start a daemon, print the ready line, serve until SIGTERM/SIGINT or a Drain, drain.
    Returns the exit status (0 after a graceful stop)."""
    import json

    daemon = StoreDaemon(config)
    addresses = await daemon.start()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, daemon.request_drain, signal.Signals(signum).name)
    line = json.dumps(addresses.to_dict(), sort_keys=True)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            f.write(line + "\n")
        os.replace(tmp, ready_file)
    sys.stdout.write(READY_PREFIX + line + "\n")
    sys.stdout.flush()
    await daemon.wait_stopped()
    return 0

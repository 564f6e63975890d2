"""The conductor process: discovery, event subscriptions, leader election, serving.

::

    etcd nodes/      ──watch_nodes──► live nodes ──► one Subscribe task per daemon ──► index
    etcd engines/    ──EngineWatch──► engine records ─┐
                                                      ├─► scheduler instances (node alive only)
    etcd conductor/leader ◄──Election──► leading? ────┴─► Schedule served (leader only)
    vLLM KV events (ZMQ) ──EngineEventFollower──► EngineCacheIndex (each engine's own cache)

What the conductor believes, and when it changes
    * A node is *live* while its key is in etcd AND its event stream is connected (from its
      first snapshot on: a node that just joined is not placed on before it). A node whose key vanishes (lease expired, clean
      exit) or whose event stream breaks (process killed: the TCP connection resets at once)
      leaves the index at once (:meth:`GlobalPrefixIndex.remove_node`) and every engine on
      it leaves the scheduler in the same event-loop step, so no decision made afterwards
      names it. A node whose stream reconnects is rebuilt from a snapshot.
    * Each daemon is followed from a **snapshot** first (``Snapshot`` RPC), then
      ``Subscribe(from_seq=<snapshot seq>, epoch)``. On a gap or a new epoch the index says
      what it needs (``needs_resync``) and the stream is re-opened from there; when the
      daemon's ring no longer holds it the daemon answers ``EVENT_RESYNC`` and we take a
      snapshot again. Starting from a snapshot costs one read per node join, and makes a
      node that was removed and comes back with the same epoch (a partition) whole again.
    * Every conductor, leader or not, follows every daemon, so a standby that takes over
      has a current index at once (failover does not wait for a rebuild).
    * Engines are schedulable while their record is in etcd and their ``node_id`` is live.
    * An engine record with ``vllm_kv_events`` is followed over ZMQ
      (:mod:`conductor.engine_events`) into :attr:`Conductor.engine_cache`, whatever its
      node's state; a new registration (its key's create revision changed: a new lease)
      starts its view over, and the view leaves when the record does (lease expired).
    * **No answers from a half-built view** (issue 12). Starting, the conductor follows every
      registered node and waits for their snapshots (and their engines) before it campaigns.
      After an etcd outage long enough to expire leases (etcd then deletes every member's key
      at once and the members write them again), Schedule, ScheduleBatch and Lookup answer
      UNAVAILABLE (``MembershipError``: retryable) until every node and engine that was live
      before the outage is back: registered, seen under the create revision etcd now has,
      snapshot loaded, engines schedulable; or until ``view_rebuild_grace_s`` (a member that
      died meanwhile never returns). The refusal starts when the election hears from etcd
      again, or earlier, as soon as etcd removes an expected member. Without it a new leader
      answered "no prefill instance serves model" for a fraction of a second. A shorter
      outage is compared with etcd too (no refusal past one read when nothing changed).
    * **Leases revoked early** (issue 16: etcd 3.4.23 revokes every lease a paused etcd
      leader thinks lapsed when it resumes, etcd-io/etcd#15247, with no outage any clock
      sees). When a live node or a scheduled engine leaves etcd and no rebuild is pending,
      the conductor still drops it at once, refuses (UNAVAILABLE) for 0.1 s plus one read of
      the leader key, and rebuilds as above if the leader's term it knew is gone with it
      (every lease went); a plain departure costs that 0.1 s of refusals only.

Threading: discovery, event subscriptions and the election run on one asyncio event loop.
RPCs are served by gRPC's threaded server (a pool of ``rpc_workers`` threads): measured here,
an empty unary call costs the server ~170 us of CPU on the threaded server and ~310 us on
grpc.aio, which decides whether 5,000 decisions/s fit on two cores. The scheduler is not
thread-safe, so every use of it, and every change to the node and engine tables, holds
:attr:`Conductor.lock` (held for tens of microseconds); the index has its own lock.
The constructor builds in-memory state only; :meth:`Conductor.start` talks to etcd, binds
the gRPC port and starts the background tasks; :meth:`Conductor.stop` undoes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import aetcd
import grpc
import xxhash

from conductor.engine_events import EngineFollowers
from conductor.engine_index import EngineCacheIndex, PromptMatch, TokenIds
from conductor.index import GlobalPrefixIndex
from conductor.instances import InstanceBook
from conductor.node_events import GRPC_MAX_MESSAGE_BYTES, follow_node
from conductor.perf.engine_model import default_engine_model
from conductor.scheduler import (
    Policy,
    Scheduler,
    SchedulerConfig,
)
from conductor.store_keys import store_hasher
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument, MembershipError
from kvstore.keys import BlockHasher
from kvstore.membership.election import Election, LeaderRecord, LeaderView, read_leader
from kvstore.membership.engines import (
    EngineRecord,
    EngineRole,
    EngineWatch,
    engine_create_revisions,
)
from kvstore.membership.etcd import DEFAULT_LAYOUT, KeyLayout, etcd_client, parse_host_port
from kvstore.membership.nodes import (
    NodeEventKind,
    NodeRecord,
    node_create_revisions,
    watch_nodes,
)
from kvstore.security.client import TokenSource, token_source
from kvstore.security.config import ClientSecurity, ServerSecurity
from kvstore.security.server import SecureServing
from kvstore.security.tls import client_credentials

log = logging.getLogger(__name__)

__all__ = ["READY_PREFIX", "ClockMode", "Conductor", "ConductorConfig", "default_conductor_id",
           "run_conductor"]

READY_PREFIX = "KVTIER-CONDUCTOR-READY "
"""``kvtier conductor`` prints this, then its address as JSON, once it serves."""

_HASHERS_KEPT = 1024
LEASES_MAY_EXPIRE_S = 1.0
"""An etcd outage shorter than this cannot have expired a registration's lease by the clocks
(leases are at least 2 s, refreshed every third of that), so its rebuild compares the view
with etcd at once, without waiting for expiries to settle; etcd 3.4 revokes leases early
(etcd-io/etcd#15247), so it is compared all the same."""
_LEASE_EXPIRY_SETTLE_S = 1.0
"""After a longer outage, wait this long before comparing the view with etcd: etcd revokes the
leases that expired while it was away on its 0.5 s expiry tick, one proposal each."""
_REBUILD_POLL_S = 0.05
_REVOCATION_BURST_S = 0.1
"""After a live member left etcd, read the leader key this much later: etcd 3.4 revokes the
leases it thinks lapsed one proposal each, all within ~30 ms (measured in the fault suite)."""


class ClockMode(enum.Enum):
    """Whose clock the scheduler runs on."""

    WALL = "wall"
    """The conductor's own monotonic clock (production)."""
    CLIENT = "client"
    """The ``at_s`` the caller puts in each Schedule, ReportLoad and ReportCompletion: trace
    replay on a simulated clock (``kvtier bench schedule --real``). One driver only: the
    scheduler trusts the times it is given."""


def default_conductor_id() -> str:
    """``<hostname>-<pid>``, reduced to the id alphabet."""
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())
    return f"{host or 'conductor'}-{os.getpid()}"[:128]


@dataclass(frozen=True)
class ConductorConfig:
    """Everything one conductor process needs. Times in seconds."""

    etcd_endpoint: str
    """One etcd member or a comma-separated list of them; the client fails over between them
    (docs/etcd-failover.md)."""
    conductor_id: str = field(default_factory=default_conductor_id)
    listen: str = "127.0.0.1:0"
    """``host:port`` to bind (port 0: any free port)."""
    advertise_host: str | None = None
    """Host published in etcd for clients (default: the listen host, or the hostname if 0.0.0.0)."""
    layout: KeyLayout = DEFAULT_LAYOUT
    policy: Policy = Policy.GLOBAL_CACHE
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    cache_affinity_margin: float = 0.25
    """``SchedulerConfig.cache_affinity_margin``: how much faster another engine must be
    predicted before a request leaves the engine holding its prefix in its own cache."""
    block_size_tokens: int = 512
    election_ttl_s: int = 2
    sweep_interval_s: float = 1.0
    rpc_workers: int = 4
    """Threads serving RPCs (they share the GIL; a few hide the gaps between calls)."""
    preload_blocks: int = 0
    """Benchmark only: load this many synthetic blocks (keys no request will ever name) into
    the index at start, through its snapshot path, under node ids ``preload-<i>``."""
    clock: ClockMode = ClockMode.WALL
    view_rebuild_grace_s: float = 5.0
    """After starting, and after an etcd outage long enough to expire leases, the conductor
    neither decides nor answers Lookup (UNAVAILABLE) until its view matches etcd again:
    every member it expects (those etcd lists at start; those it had live before the outage)
    registered, seen under its current create revision, its snapshot loaded and its engines
    schedulable. It serves anyway after this many seconds (a member that died meanwhile never
    comes back), logging who is missing."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """How the conductor's gRPC service authenticates callers (docs/security.md): without it,
    loopback only; a non-loopback ``listen`` needs mTLS, tokens or ``insecure``."""
    daemon_security: ClientSecurity = field(default_factory=ClientSecurity)
    """What the conductor presents to the daemons it follows (a ``peer`` identity: its
    certificate or token)."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise InvalidArgument(f"policy must be a Policy, got {self.policy!r}")
        if not isinstance(self.clock, ClockMode):
            raise InvalidArgument(f"clock must be a ClockMode, got {self.clock!r}")
        if not isinstance(self.security, ServerSecurity) or \
                not isinstance(self.daemon_security, ClientSecurity):
            raise InvalidArgument("security must be a ServerSecurity and daemon_security a "
                                  "ClientSecurity")
        host, port = _split_listen(self.listen)
        del host, port
        if isinstance(self.election_ttl_s, bool) or not isinstance(self.election_ttl_s, int) \
                or self.election_ttl_s < 2:
            raise InvalidArgument(f"election_ttl_s must be an int >= 2, got {self.election_ttl_s!r}")
        if isinstance(self.rpc_workers, bool) or not isinstance(self.rpc_workers, int) \
                or self.rpc_workers < 1:
            raise InvalidArgument(f"rpc_workers must be an int >= 1, got {self.rpc_workers!r}")
        if not self.view_rebuild_grace_s > 0:
            raise InvalidArgument(
                f"view_rebuild_grace_s must be > 0, got {self.view_rebuild_grace_s!r}")
        margin = self.cache_affinity_margin
        if isinstance(margin, bool) or not isinstance(margin, int | float) or \
                not math.isfinite(margin) or margin < 0:
            raise InvalidArgument(f"cache_affinity_margin must be a finite number >= 0, got "
                                  f"{margin!r}")
        if not self.sweep_interval_s > 0:
            raise InvalidArgument(f"sweep_interval_s must be > 0, got {self.sweep_interval_s!r}")
        if isinstance(self.preload_blocks, bool) or not isinstance(self.preload_blocks, int) \
                or self.preload_blocks < 0:
            raise InvalidArgument(f"preload_blocks must be an int >= 0, got {self.preload_blocks!r}")
        LeaderRecord(self.conductor_id, "127.0.0.1:1")  # validates the id


def _split_listen(listen: str) -> tuple[str, int]:
    host, _, port_text = listen.rpartition(":")
    if not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidArgument(f"listen must be 'host:port' (port 0: any), got {listen!r}")
    return host, int(port_text)


class _NodeFollower:
    """One daemon's event stream into the index (a task), with its connection."""

    __slots__ = ("connected", "create_revision", "record", "settled", "task")

    def __init__(self, record: NodeRecord, create_revision: int) -> None:
        self.record = record
        self.create_revision = create_revision
        """Of the node's etcd key when it joined: tells this registration from a later one."""
        self.task: asyncio.Task[None] | None = None
        self.connected = False
        self.settled = False
        """The first snapshot attempt ended (loaded, or the daemon did not answer)."""


@dataclass(eq=False)
class _Rebuild:
    """The view is being rebuilt (see ConductorConfig.view_rebuild_grace_s)."""

    why: str
    nodes: set[str] | None
    """Node ids to wait for; None: those registered in etcd."""
    engines: set[str] | None
    """Engine instance ids to wait for; None: those in etcd whose node is registered."""
    gating: bool = False
    """True while RPCs are refused (not while etcd is away: the view we have is served)."""
    started: bool = False
    """The rebuild began; a later short outage does not cancel it."""
    revoked: bool = False
    """Begun while etcd answered (a live member left and our term's key went with it: leases
    revoked early); the election's report of the lost lease does not stop it."""
    task: asyncio.Task[None] | None = None


class Conductor:
    """One conductor process's state and background work. See the module docstring."""

    def __init__(self, config: ConductorConfig) -> None:
        """In-memory state only: no etcd, no sockets, no tasks until :meth:`start`."""
        self.config = config
        engine = default_engine_model(config.block_size_tokens)
        self.engine_model = engine
        self.index = GlobalPrefixIndex()
        self.scheduler = Scheduler(self.index, engine.latency, SchedulerConfig(
            policy=config.policy, block_size_tokens=engine.block_size_tokens,
            block_size_bytes=engine.block_size_bytes, ttft_slo_s=config.ttft_slo_s,
            tpot_slo_s=config.tpot_slo_s, cache_affinity_margin=config.cache_affinity_margin))
        self.nodes: dict[str, _NodeFollower] = {}
        """Nodes registered in etcd (live or not: see :meth:`live_nodes`)."""
        self.engines: dict[str, EngineRecord] = {}
        """Engine records in etcd, by instance id."""
        self.engine_load: dict[str, tuple[int, int, int, float]] = {}
        """Latest ReportLoad per instance: (queued prefill tokens, decode batch, KV tokens, at)."""
        self.instances = InstanceBook()
        """The scheduler's instances and the engine records it knows now (record present and
        node live): ``conductor.instances``."""
        self._hashers: dict[tuple[str, str], BlockHasher] = {}
        self.election: Election | None = None
        self.address: str | None = None
        self._etcd: aetcd.Client | None = None
        self._server: grpc.Server | None = None
        self.lock = threading.Lock()
        """Guards the scheduler, ``nodes``, ``engines`` and the scheduled instances."""
        self._health: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._ready = asyncio.Event()
        self._stopping = False
        self.leader_changes = 0
        self._engine_created: dict[str, int] = {}
        """Create revision of each engine record's key, by instance id."""
        self._rebuild: _Rebuild | None = None
        self.engine_cache = EngineCacheIndex()
        """Each vLLM engine's own prefix cache, from its KV events (thread-safe by itself)."""
        self.engine_events = EngineFollowers(self.engine_cache, "kvtier-conductor-kv-events")
        self.serving: SecureServing | None = None
        """How the gRPC service authenticates (valid after start)."""
        self._daemon_token: TokenSource | None = None

    # ------------------------------------------------------------------ views

    def live_nodes(self) -> list[str]:
        """Nodes a decision may name: registered, and their event stream connected.

        Call with :attr:`lock` held from RPC threads."""
        return sorted(n for n, f in self.nodes.items() if f.connected)

    def scheduled_instances(self, role: EngineRole) -> list[str]:
        return sorted(i for i, rec in self.instances.scheduled.items() if rec.role is role)

    @property
    def is_leader(self) -> bool:
        return self.election is not None and self.election.is_leader

    def view_unready(self) -> str | None:
        """Why decisions and lookups must wait (the view is being rebuilt), or None."""
        rebuild = self._rebuild
        return rebuild.why if rebuild is not None and rebuild.gating else None

    def leader(self) -> LeaderView | None:
        return None if self.election is None else self.election.leader

    def now_s(self, at_s: float = 0.0) -> float:
        """The scheduler's clock: monotonic seconds, or the caller's ``at_s`` when the
        conductor runs on the client's clock. InvalidArgument for an ``at_s`` that does not
        fit the mode (a non-zero time sent to a wall-clock conductor, or a negative or
        non-finite one)."""
        if self.config.clock is ClockMode.WALL:
            if at_s:
                raise InvalidArgument(
                    f"at_s={at_s!r}: this conductor schedules on its own clock (start it with "
                    "--clock client to replay on a caller's clock)")
            return time.monotonic()
        if not math.isfinite(at_s) or at_s < 0:
            raise InvalidArgument(f"at_s must be a finite time >= 0, got {at_s!r}")
        return at_s

    def has_engine_events(self, model: str) -> bool:
        """Whether an engine of ``model`` publishes KV events (its own cache can be matched)."""
        with self.lock:
            return any(rec.model == model and rec.vllm_kv_events is not None
                       for rec in self.engines.values())

    def has_fingerprint(self, model: str) -> bool:
        """Whether an engine of ``model`` published a KV fingerprint (store keys can be made)."""
        with self.lock:
            return any(rec.model == model and rec.kv_fingerprint is not None
                       for rec in self.engines.values())

    def engine_cached_tokens(self, model: str, tenant: str, token_ids: TokenIds
                             ) -> dict[str, int]:
        """Per engine of ``model`` followed through KV events: the leading tokens of the
        prompt it holds in its own prefix cache. Any thread (takes :attr:`lock` briefly)."""
        return self.engine_match(model, tenant, token_ids).cached_tokens

    def engine_match(self, model: str, tenant: str, token_ids: TokenIds) -> PromptMatch:
        """:meth:`engine_cached_tokens` with the prompt's hashes kept (for
        :meth:`EngineCacheIndex.expect_routed`). Any thread."""
        with self.lock:
            instances = {i for i, rec in self.engines.items()
                         if rec.model == model and rec.vllm_kv_events is not None}
        if not instances:
            return PromptMatch({}, tenant, {})
        return self.engine_cache.match(token_ids, tenant, instances)

    def hasher(self, model: str, tenant: str) -> BlockHasher:
        """The key chain of ``model`` for ``tenant``, as its engine records name it
        (:func:`conductor.store_keys.store_hasher`: kvtier's own chain, or, for vLLM engines
        with kvtier's connector, vLLM's ``sha256_cbor`` block hashes with the records' seed and
        the tenant as the salt, which are the connector's keys). InvalidArgument when no
        engine of the model published a KV fingerprint (then requests must carry keys), or
        when its engines make their keys differently (one request's keys could not be priced
        on all of them)."""
        with self.lock:
            cached = self._hashers.get((model, tenant))
            if cached is not None:
                return cached
            records = list(self.engines.items())
        hasher = store_hasher(records, model, tenant, self.engine_model.block_size_tokens)
        if hasher is None:
            known = sorted({rec.model for _, rec in records})
            raise InvalidArgument(
                f"cannot hash token ids for model {model!r}: no engine of it published a KV "
                f"fingerprint (known models: {', '.join(known) or 'none'}); send chained keys")
        with self.lock:
            if len(self._hashers) >= _HASHERS_KEPT:
                self._hashers.clear()
            self._hashers[(model, tenant)] = hasher
        return hasher

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> str:
        """Connect to etcd, serve gRPC, campaign, follow nodes and engines. Returns the address.

        Raises MembershipError when etcd cannot be reached, InvalidArgument when the listen
        address cannot be bound, ConfigError when it may not listen there without
        authentication or its certificates do not load.
        """
        from conductor.service import ConductorService, add_to_server

        cfg = self.config
        host, port = _split_listen(cfg.listen)
        self.serving = SecureServing(cfg.security, host, "the conductor's gRPC service")
        if cfg.daemon_security.tls:  # the daemons' channels open later, in tasks: check now
            client_credentials(cfg.daemon_security)
        self._daemon_token = token_source(cfg.daemon_security)
        if cfg.preload_blocks:
            self._preload(cfg.preload_blocks)
        self._etcd = etcd_client(cfg.etcd_endpoint)
        server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=cfg.rpc_workers, thread_name_prefix="kvtier-conductor-rpc"),
            interceptors=self.serving.sync_interceptors(), options=[
            ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self._health = add_to_server(ConductorService(self), server)
        bound = self.serving.add_port(server, f"{host}:{port}")
        if bound == 0:
            raise InvalidArgument(f"cannot bind the conductor's gRPC service on {cfg.listen}")
        advertise = cfg.advertise_host or (socket.gethostname() if host in ("0.0.0.0", "::")
                                           else host)
        self.address = f"{advertise}:{bound}"
        parse_host_port(self.address)
        server.start()
        self._server = server
        self._set_health()
        loop = asyncio.get_running_loop()
        try:
            node_watch = watch_nodes(self._etcd, layout=cfg.layout)
            await node_watch.start()
            engine_watch = EngineWatch(self._etcd, layout=cfg.layout)
            await engine_watch.__aenter__()
            self._tasks = [
                loop.create_task(self._follow_membership(node_watch),
                                 name="kvtier-conductor-nodes"),
                loop.create_task(self._follow_engines(engine_watch),
                                 name="kvtier-conductor-engines"),
                loop.create_task(self._sweep_loop(), name="kvtier-conductor-sweep"),
            ]
            # Campaign only with a built view: snapshots of the registered nodes loaded.
            await self._rebuild_view(_Rebuild("starting", None, None), settle_s=0.0)
            self.election = Election(self._etcd, LeaderRecord(cfg.conductor_id, self.address),
                                     ttl_s=cfg.election_ttl_s, layout=cfg.layout,
                                     on_change=self._on_leadership, on_etcd=self._on_etcd)
            await self.election.start()
        except BaseException:
            await self.stop()
            raise
        return self.address

    async def stop(self) -> None:
        """Resign (the standby takes over at once), stop every task, stop serving. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        if self.election is not None:
            await self.election.resign()
        tasks = self._tasks + [f.task for f in self.nodes.values() if f.task is not None]
        tasks += self.engine_events.close()
        if self._rebuild is not None and self._rebuild.task is not None:
            tasks.append(self._rebuild.task)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._tasks = []
        if self._server is not None:
            stopped = self._server.stop(grace=0.5)
            self._server = None
            await asyncio.get_running_loop().run_in_executor(None, stopped.wait, 5.0)
        if self._etcd is not None:
            with contextlib.suppress(Exception):  # closing a client whose etcd is gone
                await self._etcd.close()
            self._etcd = None
        self.engine_events.destroy()

    # ------------------------------------------------------------------ leadership

    def _on_leadership(self, leading: bool) -> None:
        self.leader_changes += 1
        log.info("conductor %s is now %s", self.config.conductor_id,
                 "the leader" if leading else "a follower")
        self._set_health()

    def _set_health(self) -> None:
        from grpc_health.v1 import health_pb2

        from conductor.service import SERVICE_NAME

        if self._health is None:
            return
        serving = health_pb2.HealthCheckResponse.SERVING
        self._health.set("", serving)
        self._health.set(SERVICE_NAME, serving if self.is_leader and self.view_unready() is None
                               else health_pb2.HealthCheckResponse.NOT_SERVING)

    # ------------------------------------------------------------------ rebuilding the view

    def _on_etcd(self, reachable: bool, outage_s: float) -> None:
        """The election lost etcd, or reached it again after ``outage_s`` seconds."""
        if not reachable:
            with self.lock:
                if self._rebuild is not None and self._rebuild.revoked:
                    return  # etcd answers; the rebuild under way reads it (its grace bounds it)
                if self._rebuild is None:
                    self._rebuild = _Rebuild("etcd was unreachable", set(self.live_nodes()),
                                             set(self.instances.scheduled))
                rebuild = self._rebuild
                rebuild.gating = False  # until etcd is back, serve the view we have
            if rebuild.task is not None:
                rebuild.task.cancel()
                rebuild.task = None
            self._set_health()
            return
        pending = self._rebuild
        if pending is None or pending.task is not None:
            return
        # A short outage cannot have expired a lease by the clocks, but etcd 3.4 revokes
        # leases early (etcd-io/etcd#15247; the election reports ours lost the same way): read
        # the membership again at once rather than assume it is unchanged.
        short = outage_s < LEASES_MAY_EXPIRE_S and not pending.started
        log.log(logging.INFO if short else logging.WARNING,
                "etcd answers again after %.1f s: rebuilding the view before deciding", outage_s)
        pending.task = asyncio.get_running_loop().create_task(
            self._rebuild_view(pending, settle_s=0.0 if short else _LEASE_EXPIRY_SETTLE_S),
            name="kvtier-conductor-rebuild")

    async def _rebuild_view(self, rebuild: _Rebuild, settle_s: float) -> None:
        """Refuse decisions and lookups until the view matches etcd (or the grace ran out)."""
        assert self._etcd is not None
        layout = self.config.layout
        with self.lock:
            self._rebuild = rebuild
            rebuild.gating = rebuild.started = True
        self._set_health()
        started = time.monotonic()
        deadline = started + self.config.view_rebuild_grace_s
        if settle_s:
            await asyncio.sleep(settle_s)
        while True:
            try:
                nodes = await node_create_revisions(self._etcd, layout=layout)
                engines = await engine_create_revisions(self._etcd, layout=layout)
            except MembershipError as exc:
                missing = [f"etcd ({exc})"]
            else:
                with self.lock:
                    missing = self._not_rebuilt(rebuild, nodes, engines)
                if not missing:
                    log.info("view rebuilt (%s) in %.2f s", rebuild.why,
                             time.monotonic() - started)
                    break
            if time.monotonic() >= deadline:
                log.warning("view rebuild (%s): serving after %.1f s without %s", rebuild.why,
                            self.config.view_rebuild_grace_s, ", ".join(missing[:8]))
                break
            await asyncio.sleep(_REBUILD_POLL_S)
        with self.lock:
            if self._rebuild is rebuild:
                self._rebuild = None
        self._set_health()

    def _hold_for_rebuild(self, kind: str, member_id: str) -> None:
        """etcd removed a member we expect back while the election still waits for etcd: etcd
        is back and expiring the leases that lapsed while it was away. Refuse from now on,
        not only once the election notices (hold the lock)."""
        rebuild = self._rebuild
        if rebuild is None:
            self._check_departure(kind, member_id)
            return
        if rebuild.gating:
            return
        expected = rebuild.nodes if kind == "node" else rebuild.engines
        if expected is not None and member_id in expected:
            log.info("%s %s left etcd after an outage: refusing until the view is rebuilt",
                     kind, member_id)
            rebuild.gating = True

    def _check_departure(self, kind: str, member_id: str) -> None:
        """A live member left etcd while no rebuild is pending (hold the lock). Usually it died
        or its lease lapsed; but etcd 3.4 also revokes leases early (etcd-io/etcd#15247: every
        lease it thinks lapsed, the leader's too, in one burst with no outage any clock sees)
        and the members register again a moment later. So refuse (UNAVAILABLE) until one read
        of the leader key, after the burst, tells which: the leader's term as this conductor
        knew it still there, a plain departure: serve again; gone, rebuild the view as after
        an outage (wait for what was live to be back). Followers too: one of them may lead
        next, from the same gap."""
        election = self.election
        if election is None:
            return
        live = self.live_nodes() if kind == "node" else list(self.instances.scheduled)
        if member_id not in live:
            return
        known = election.leader
        rebuild = _Rebuild(f"{kind} {member_id} left etcd", set(self.live_nodes()),
                           set(self.instances.scheduled), gating=True, started=True,
                           revoked=True)
        self._rebuild = rebuild
        rebuild.task = asyncio.get_running_loop().create_task(
            self._after_departure(rebuild, None if known is None else known.term),
            name="kvtier-conductor-departure")

    async def _after_departure(self, rebuild: _Rebuild, term: int | None) -> None:
        """See :meth:`_check_departure`."""
        assert self._etcd is not None
        self._set_health()
        await asyncio.sleep(_REVOCATION_BURST_S)
        try:
            view = await read_leader(self._etcd, layout=self.config.layout)
        except MembershipError:
            pass  # cannot tell: rebuild (bounded by its grace)
        else:
            if (None if view is None else view.term) == term:
                with self.lock:
                    if self._rebuild is rebuild:
                        self._rebuild = None
                self._set_health()
                return
        log.warning("%s and the leader's term %s with it (leases revoked early): rebuilding "
                    "the view before deciding", rebuild.why, term)
        await self._rebuild_view(rebuild, settle_s=0.0)

    def _not_rebuilt(self, rebuild: _Rebuild, nodes: dict[str, int],
                     engines: dict[str, tuple[int, EngineRecord]]) -> list[str]:
        """What the view still lacks of what etcd holds now (hold the lock)."""
        want_nodes = rebuild.nodes if rebuild.nodes is not None else set(nodes)
        want_engines = rebuild.engines if rebuild.engines is not None else {
            i for i, (_, rec) in engines.items() if rec.node_id in nodes}
        missing = []
        for node_id in sorted(want_nodes):
            follower = self.nodes.get(node_id)
            if node_id not in nodes:
                missing.append(f"node {node_id} (not registered)")
            elif follower is None or follower.create_revision != nodes[node_id]:
                missing.append(f"node {node_id} (its registration not seen yet)")
            elif not follower.settled:
                missing.append(f"node {node_id} (snapshot not loaded)")
        for instance_id in sorted(want_engines):
            if instance_id not in engines:
                missing.append(f"engine {instance_id} (not registered)")
            elif self._engine_created.get(instance_id) != engines[instance_id][0]:
                missing.append(f"engine {instance_id} (its record not seen yet)")
            elif instance_id not in self.instances.scheduled:
                missing.append(f"engine {instance_id} (its node not live)")
        return missing

    # ------------------------------------------------------------------ membership

    async def _follow_membership(self, events: Any) -> None:
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(events.close)
            async for event in events:
                node_id = event.node_id
                if event.kind is not NodeEventKind.UPDATED:
                    with self.lock:
                        self._hold_for_rebuild("node", node_id)
                if event.kind is NodeEventKind.LEFT:
                    self._drop_node(node_id, "its etcd key is gone")
                elif event.kind is NodeEventKind.JOINED or (
                        event.kind is NodeEventKind.UPDATED
                        and self.nodes[node_id].record.grpc_address != event.record.grpc_address):
                    self._drop_node(node_id, "it re-registered")
                    self._add_node(event.record, event.create_revision)
                else:
                    with self.lock:
                        self.nodes[node_id].record = event.record

    def _add_node(self, record: NodeRecord, create_revision: int) -> None:
        follower = _NodeFollower(record, create_revision)
        with self.lock:
            self.nodes[record.node_id] = follower
        follower.task = asyncio.get_running_loop().create_task(
            self._follow_node(follower), name=f"kvtier-conductor-follow-{record.node_id}")
        log.info("node %s joined (%s)", record.node_id, record.grpc_address)

    def _drop_node(self, node_id: str, why: str) -> None:
        with self.lock:
            follower = self.nodes.pop(node_id, None)
            if follower is None:
                return
            self.index.remove_node(node_id)
            self._sync_instances()
        if follower.task is not None:
            follower.task.cancel()
        log.info("node %s left the index: %s", node_id, why)

    def _set_connected(self, follower: _NodeFollower, connected: bool, why: str = "") -> None:
        if follower.connected == connected:
            return
        node_id = follower.record.node_id
        with self.lock:
            follower.connected = connected
            if not connected:
                # The process is dead or unreachable: nothing may name it from now on.
                self.index.remove_node(node_id)
            self._sync_instances()
        if not connected:
            log.warning("node %s unreachable (%s): out of the index until it answers again",
                        node_id, why)

    async def _follow_node(self, follower: _NodeFollower) -> None:
        """Snapshot, then Subscribe; resync on gaps; reconnect with backoff; forever
        (:func:`conductor.node_events.follow_node`, which the front door's router runs too)."""
        record = follower.record

        def on_state(connected: bool, why: str) -> None:
            self._set_connected(follower, connected, why)
            follower.settled = True

        await follow_node(self.index, record.node_id, record.grpc_address,
                          self.config.daemon_security, on_state, self._daemon_metadata)

    def _daemon_metadata(self) -> tuple[tuple[str, str], ...]:
        """The bearer token the daemons get from this conductor, when it has one."""
        return () if self._daemon_token is None else (self._daemon_token.metadata(),)

    # ------------------------------------------------------------------ engines

    async def _follow_engines(self, changes: EngineWatch) -> None:
        try:
            async for change in changes:
                with self.lock:
                    if change.record is None:
                        self._hold_for_rebuild("engine", change.instance_id)
                        self.engines.pop(change.instance_id, None)
                        self.engine_load.pop(change.instance_id, None)
                        self._engine_created.pop(change.instance_id, None)
                    else:
                        self.engines[change.instance_id] = change.record
                        self._engine_created[change.instance_id] = change.create_revision
                    self._hashers.clear()
                    self._sync_instances()
                self._sync_engine_events()
        finally:
            await changes.__aexit__(None, None, None)

    def _sync_engine_events(self) -> None:
        """Follow the KV events of every engine record that has them
        (:class:`conductor.engine_events.EngineFollowers`)."""
        with self.lock:
            wanted = {i: (rec.vllm_kv_events, self._engine_created.get(i, 0))
                      for i, rec in self.engines.items() if rec.vllm_kv_events is not None}
        for instance_id in self.engine_events.sync(wanted):
            log.info("engine %s left the engine cache index (its record is gone)", instance_id)

    def _sync_instances(self) -> None:
        """Make the scheduler's instances = engine records whose node is live, a prefill and
        a decode record of one server paired into one colocated instance
        (:class:`conductor.instances.InstanceBook`). Hold the lock."""
        self.instances.sync(self.scheduler, self.engines,
                            {n for n, f in self.nodes.items() if f.connected})

    def scheduler_instance(self, record_id: str) -> str:
        """The scheduler instance an engine record stands in (a colocated pair's decode
        record is its prefill record's instance); the id itself when unknown."""
        return self.instances.scheduler_instance(record_id)

    # ------------------------------------------------------------------ upkeep

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            if self.index.stats().retired_slots:
                self.index.sweep(max_keys=65536)

    def _preload(self, blocks: int, nodes: int = 8) -> None:
        """Benchmark only: synthetic blocks under ``preload-<i>`` (see ConductorConfig)."""
        per_node = -(-blocks // nodes)
        counter = itertools.count()
        for n in range(nodes):
            count = min(per_node, blocks - n * per_node)
            if count <= 0:
                break
            entries: Iterable[tuple[bytes, TierKind]] = (
                (xxhash.xxh3_128_digest(b"kvtier-preload:%d" % next(counter)), TierKind.DRAM)
                for _ in range(count))
            self.index.apply_snapshot(f"preload-{n}", "preload", 0, entries)
        log.info("preloaded %d synthetic blocks on %d synthetic nodes", blocks, nodes)


async def run_conductor(config: ConductorConfig, *, ready: Any = None) -> None:
    """Run a conductor until cancelled; ``ready(address)`` is called once it serves."""
    conductor = Conductor(config)
    try:
        address = await conductor.start()
        if ready is not None:
            ready(conductor, address)
        await asyncio.Event().wait()
    finally:
        await conductor.stop()


"""Trace replay through a REAL conductor process and REAL store daemons, on a simulated clock.

``kvtier bench schedule --real`` (``bench/schedule.py``) and
``tests/planner/test_live_replay.py`` run this; :mod:`planner.replay` is the fast
in-process mode (same engines, same latency model, simulated node caches).

What is real
    * etcd (``LocalEtcd``), ``nodes`` store daemons (``kvtier daemon``, separate processes,
      DRAM only) and one conductor (``kvtier conductor --clock client --policy P``).
    * The daemons hold the trace's blocks **at full scale in count, tiny in bytes**: every
      block is a real chunk of ``block_value_bytes`` (4 KiB: one DRAM allocation unit, so
      the daemon's logical budget and its arena agree; a 1-byte value would still take
      4 KiB of arena and the two would disagree). ``node_capacity_blocks`` x 4 KiB of DRAM
      per daemon (6,000 blocks = 23.4 MiB, standing for ~1 TB of 160 MiB blocks), LRU, the
      daemon's own eviction; the watermark demoter is switched off (high = low = 1.0) so
      evictions happen only on puts, in the driver's order.
    * The conductor learns every block from the daemons' event streams (snapshot, then
      Subscribe), exactly as in production. Engines are EngineRecords in etcd.
    * Every decision comes from ``Schedule`` over gRPC (timed: the scheduling latency);
      engines report ``ReportLoad`` (every ``report_interval_s`` simulated seconds, when
      their load changed) and ``ReportCompletion`` (prefill and decode timings).

What is simulated
    Time, engine compute and links (as in :mod:`planner.replay`: the planner's roofline
    times a hidden per-instance speed factor and log-normal noise; links carry
    ``link_efficiency`` of the nominal bandwidth, one transfer at a time per source).
    The conductor runs on the driver's clock (``at_s`` in every call), so its estimates and
    the engines' times are in the same simulated seconds, whatever the machine's speed.

One request (discrete events in simulated-time order, one at a time)
    1. Arrival: ``Schedule``. The decision is checked against the daemons at that instant
       (``Lookup`` on the prefill node and the fetch source): its local prefix and its fetch
       range must really be held there (``consistency``).
    2. Prefill start (FIFO per instance): the engine reads its node's longest prefix
       (``get_many_into``: an LRU hit in the daemon), and fetches the planned range from the
       source daemon into its own (``get_many_into`` there, ``put`` with parents here);
       bytes are counted as full-size blocks (``EngineModel.block_size_bytes``).
    3. Prefill end: the whole chain is stored in the node's daemon (``put`` with parents,
       evicting LRU), then the driver waits until the conductor's ``Lookup`` shows the last
       stored block on that node (``sync``): per node, events apply in order, so every
       eviction before it is applied too. Then ``ReportCompletion(prefill)``.
    4. Decode end: ``ReportCompletion(decode)``.

The driver is one asyncio task; its StoreClient calls block the loop briefly, which is fine
because nothing else runs in it.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from conductor.perf.engine_model import EngineModel, default_engine_model
from conductor.scheduler import Policy
from kvstore.errors import CapacityError, ChunkExists, InvalidArgument, KvtierError
from planner.replay import ClusterSpec, ReplayMetrics, _keys_of, _percentiles
from planner.workload import Workload

__all__ = ["LiveCluster", "LiveReplayResult", "LiveSpec", "live_replay", "run_live_replay"]

MODEL_NAME = "trace-model"
_REPO = Path(__file__).resolve().parents[1]
_DAEMON_READY = "KVTIER-DAEMON-READY "
_CONDUCTOR_READY = "KVTIER-CONDUCTOR-READY "
_SYNC_TIMEOUT_S = 5.0
_START_ATTEMPTS = 3


@dataclass(frozen=True)
class LiveSpec:
    """The real processes' settings (the simulated engines are a :class:`ClusterSpec`)."""

    block_value_bytes: int = 4096
    """Bytes stored per block in the daemons (one DRAM allocation unit)."""
    report_interval_s: float = 1.0
    """Simulated seconds between engines' load reports (only changed loads are sent)."""
    verify: bool = True
    """Check each decision against the daemons' contents (two Lookups per decision)."""
    start_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.block_value_bytes < 1 or not self.report_interval_s > 0:
            raise InvalidArgument("block_value_bytes must be >= 1 and report_interval_s > 0")


@dataclass(frozen=True, kw_only=True)
class LiveReplayResult(ReplayMetrics):
    """One policy replayed through real processes: the metrics every replay shares (a decision
    is one ``Schedule`` RPC, one in flight), plus what only real daemons and a real conductor
    show."""

    fetched_bytes: int
    """Counted as full-size blocks of the engine model."""
    stored_blocks: int
    """Chunks put into daemons (prefill ends and fetches)."""
    consistency: dict[str, int]
    """Decisions checked against the daemons: ``local_held`` / ``fetch_held`` (the named
    node really holds the prefix the decision counts on), ``local_exact`` (the daemon's
    longest prefix equals the decision's local_blocks), ``violations``."""
    violations: list[dict[str, Any]]
    sync_wait_ms: dict[str, float | None]
    """Wall time until the conductor's index showed a node's newest block."""
    sync_timeouts: int
    load_reports: int
    indexed_blocks: int
    """Distinct blocks in the conductor's index at the end."""
    daemon_blocks: int
    """Distinct blocks held by the daemons at the end (their snapshots)."""


# --------------------------------------------------------------------------- processes


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(_REPO)
    return env


def _wait_ready(proc: subprocess.Popen[str], prefix: str, what: str, log_path: Path,
                deadline: float) -> dict[str, Any]:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return dict(json.loads(line[len(prefix):]))
    tail = log_path.read_text(errors="replace").splitlines()[-20:] if log_path.exists() else []
    raise KvtierError(f"{what} did not become ready; log {log_path}:\n" + "\n".join(tail))


class LiveCluster:
    """etcd, ``nodes`` daemons (``node-<i>``) and one conductor, as child processes.

    The constructor records settings; :meth:`start` starts everything (daemons in
    parallel), :meth:`close` stops it all (SIGTERM, then SIGKILL after 15 s). Use as a
    context manager.
    """

    def __init__(self, work_dir: Path, *, nodes: int, capacity_blocks: int, policy: Policy,
                 block_value_bytes: int = 4096, ttft_slo_s: float | None = None,
                 tpot_slo_s: float | None = None, prefix: str = "/replay/",
                 start_timeout_s: float = 60.0) -> None:
        if nodes <= 0 or capacity_blocks <= 0:
            raise InvalidArgument("nodes and capacity_blocks must be positive")
        self.work_dir = work_dir
        self.nodes = nodes
        self.capacity_bytes = max(capacity_blocks * max(block_value_bytes, 4096), 64 << 10)
        self.policy = policy
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.prefix = prefix
        self.start_timeout_s = start_timeout_s
        self.etcd: Any = None
        self.procs: list[subprocess.Popen[str]] = []
        self.daemons: dict[str, dict[str, Any]] = {}
        """node id -> the addresses its ready line printed."""
        self.conductor_address = ""

    def _spawn(self, args: list[str], log_name: str) -> subprocess.Popen[str]:
        with (self.work_dir / log_name).open("a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", *args],
                                    cwd=_REPO, env=_child_env(), stdout=subprocess.PIPE,
                                    stderr=log, text=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        from kvstore.membership.launcher import LocalEtcd

        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.etcd = LocalEtcd(work_dir=self.work_dir / "etcd")
        self.etcd.start()
        url = self.etcd.client_url
        deadline = time.monotonic() + self.start_timeout_s
        pending = []
        for i in range(self.nodes):
            node_id = f"node-{i}"
            settings = {"node_id": node_id, "dram.capacity_bytes": str(self.capacity_bytes),
                        "cache.high_watermark": "1.0", "cache.low_watermark": "1.0",
                        "etcd.endpoint": url, "etcd.prefix": self.prefix, "etcd.ttl_s": "5",
                        "log_level": "WARNING", "shutdown.drain_timeout_s": "2"}
            args = ["daemon"]
            for key, value in settings.items():
                args += ["--set", f"{key}={value}"]
            pending.append((node_id, self._spawn(args, f"{node_id}.log")))
        for node_id, proc in pending:
            self.daemons[node_id] = _wait_ready(proc, _DAEMON_READY, f"daemon {node_id}",
                                                self.work_dir / f"{node_id}.log", deadline)
        args = ["conductor", "--etcd", url, "--prefix", self.prefix, "--id", "replay",
                "--clock", "client", "--policy", self.policy.value, "--log-level", "WARNING"]
        if self.ttft_slo_s is not None:
            args += ["--ttft-slo-s", str(self.ttft_slo_s)]
        if self.tpot_slo_s is not None:
            args += ["--tpot-slo-s", str(self.tpot_slo_s)]
        proc = self._spawn(args, "conductor.log")
        ready = _wait_ready(proc, _CONDUCTOR_READY, "conductor", self.work_dir / "conductor.log",
                            deadline)
        self.conductor_address = str(ready["address"])

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.procs = []
        self.daemons = {}
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None

    def __enter__(self) -> LiveCluster:
        """Start (unless :meth:`start` already ran) and return self."""
        if not self.procs:
            try:
                self.start()
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- simulated engines


class _Job:
    __slots__ = ("arrival_s", "decision", "idx", "keys")

    def __init__(self, idx: int, keys: tuple[bytes, ...], decision: Any, arrival_s: float) -> None:
        self.idx = idx
        self.keys = keys
        self.decision = decision
        self.arrival_s = arrival_s


class _Prefill:
    __slots__ = ("busy_until_s", "factor", "instance_id", "node_id", "queue", "running")

    def __init__(self, instance_id: str, node_id: str, factor: float) -> None:
        self.instance_id = instance_id
        self.node_id = node_id
        self.factor = factor
        self.queue: deque[_Job] = deque()
        self.running: tuple[_Job, float, float, int, int, float | None, int] | None = None
        """(job, started_s, end_s, computed, reused tokens, transfer_s, moved bytes)."""
        self.busy_until_s = 0.0


class _Decode:
    __slots__ = ("active", "context_tokens", "factor", "instance_id")

    def __init__(self, instance_id: str, factor: float) -> None:
        self.instance_id = instance_id
        self.factor = factor
        self.active = 0
        self.context_tokens = 0


_ARRIVAL, _PREFILL_DONE, _DECODE_DONE, _REPORT = range(4)


async def live_replay(workload: Workload, policy: Policy, *, cluster: ClusterSpec | None = None,
                      engine: EngineModel | None = None, live: LiveSpec | None = None,
                      ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                      work_dir: Path | None = None) -> LiveReplayResult:
    """Replay ``workload`` (already at the wanted rate) under ``policy`` through real
    processes; see the module docstring. ``work_dir`` keeps the processes' logs (default: a
    temporary directory, removed afterwards)."""
    cluster = cluster or ClusterSpec()
    live = live or LiveSpec()
    engine = engine or default_engine_model(workload.block_tokens)
    if engine.block_size_tokens != workload.block_tokens:
        raise InvalidArgument(f"engine blocks of {engine.block_size_tokens} tokens cannot replay "
                              f"a trace of {workload.block_tokens}-token blocks")
    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="kvtier-live-replay-") as tmp:
            return await live_replay(workload, policy, cluster=cluster, engine=engine, live=live,
                                     ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                                     work_dir=Path(tmp))
    started = time.perf_counter()
    procs = LiveCluster(work_dir, nodes=cluster.prefill_instances,
                        capacity_blocks=cluster.node_capacity_blocks, policy=policy,
                        block_value_bytes=live.block_value_bytes, ttft_slo_s=ttft_slo_s,
                        tpot_slo_s=tpot_slo_s, start_timeout_s=live.start_timeout_s)
    for attempt in range(_START_ATTEMPTS):
        try:
            procs.start()
            break
        except KvtierError:
            # On a loaded machine a daemon's first etcd connection can time out: start
            # everything afresh (the processes of the failed attempt are stopped first).
            procs.close()
            if attempt + 1 == _START_ATTEMPTS:
                raise
    with procs:
        driver = _Driver(workload, policy, cluster, engine, live, procs)
        try:
            await driver.setup()
            await driver.run()
            return await driver.result(time.perf_counter() - started,
                                       {"ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s})
        finally:
            await driver.close()


def run_live_replay(workload: Workload, policy: Policy, **kwargs: Any) -> LiveReplayResult:
    """:func:`live_replay` in a fresh event loop (for synchronous callers)."""
    return asyncio.run(live_replay(workload, policy, **kwargs))


class _Driver:
    """The discrete-event loop of :func:`live_replay` (one instance per run)."""

    def __init__(self, workload: Workload, policy: Policy, cluster: ClusterSpec,
                 engine: EngineModel, live: LiveSpec, procs: LiveCluster) -> None:
        self.wl = workload
        self.policy = policy
        self.cluster = cluster
        self.engine = engine
        self.live = live
        self.procs = procs
        self.rng = random.Random(cluster.seed)
        self.noise = random.Random(cluster.seed + 1)
        self.client: Any = None
        self.stores: dict[str, Any] = {}
        self.prefills: dict[str, _Prefill] = {}
        self.decodes: dict[str, _Decode] = {}
        self.value = bytes(live.block_value_bytes)
        self.scratch = [bytearray(live.block_value_bytes) for _ in range(64)]
        self.events: list[tuple[float, int, int, Any]] = []
        self.order = 0
        self.nic_free_s: dict[str, float] = {}
        from conductor.scheduler import SchedulerConfig

        nominal = SchedulerConfig(policy=policy, block_size_tokens=engine.block_size_tokens,
                                  block_size_bytes=engine.block_size_bytes)
        self.true_bandwidth = nominal.remote_link_bytes_per_s * cluster.link_efficiency
        self.dram_read_bytes_per_s = nominal.dram_read_bytes_per_s
        # measurements
        self.sched_ns: list[int] = []
        self.ttft_actual: list[float] = []
        self.ttft_est: list[float] = []
        self.tpots: list[float] = []
        self.reused_tokens = 0
        self.input_tokens = 0
        self.fetched_blocks = 0
        self.stored_blocks = 0
        self.accepted = 0
        self.rejected: dict[str, int] = {}
        self.consistency = {"checked": 0, "local_held": 0, "local_exact": 0, "fetches": 0,
                            "fetch_held": 0, "violations": 0}
        self.violations: list[dict[str, Any]] = []
        self.sync_ms: list[float] = []
        self.sync_timeouts = 0
        self.load_reports = 0
        self.last_load: dict[str, tuple[int, int, int]] = {}

    # ------------------------------------------------------------------ setup

    async def setup(self) -> None:
        from kvstore.client.conductor_client import ConductorClient
        from kvstore.client.store_client import StoreClient
        from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
        from kvstore.membership.etcd import KeyLayout, etcd_client

        cluster, procs = self.cluster, self.procs
        layout = KeyLayout(procs.prefix)
        spread = cluster.speed_spread
        async with etcd_client(procs.etcd.client_url) as etcd:
            for i in range(cluster.prefill_instances):
                rec = EngineRecord(f"prefill-{i}", EngineRole.PREFILL, MODEL_NAME, f"node-{i}")
                await put_engine_record(etcd, rec, layout=layout)
                self.prefills[rec.instance_id] = _Prefill(rec.instance_id, rec.node_id,
                                                          self.rng.uniform(1 - spread, 1 + spread))
            for j in range(cluster.decode_instances):
                rec = EngineRecord(f"decode-{j}", EngineRole.DECODE, MODEL_NAME,
                                   f"node-{j % cluster.prefill_instances}",
                                   kv_capacity_tokens=cluster.decode_kv_capacity_tokens)
                await put_engine_record(etcd, rec, layout=layout)
                self.decodes[rec.instance_id] = _Decode(rec.instance_id,
                                                        self.rng.uniform(1 - spread, 1 + spread))
        for node_id, addresses in procs.daemons.items():
            self.stores[node_id] = StoreClient.connect(str(addresses["grpc_address"]))
        self.client = ConductorClient(address=procs.conductor_address)
        deadline = time.monotonic() + self.live.start_timeout_s
        while True:  # discovery is asynchronous: wait for every node and engine
            info = await self.client.leader_info()
            if (info.is_leader and len(info.live_nodes) == cluster.prefill_instances
                    and len(info.prefill_instances) == cluster.prefill_instances
                    and len(info.decode_instances) == cluster.decode_instances):
                break
            if time.monotonic() > deadline:
                raise KvtierError(f"conductor not ready: {info}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
        for store in self.stores.values():
            store.close()

    # ------------------------------------------------------------------ events

    def push(self, at_s: float, kind: int, payload: Any) -> None:
        self.order += 1
        heapq.heappush(self.events, (at_s, self.order, kind, payload))

    def jitter(self) -> float:
        sigma = self.cluster.noise_sigma
        return math.exp(self.noise.gauss(0.0, sigma)) if sigma else 1.0

    async def run(self) -> None:
        keys_of = _keys_of(self.wl)
        for i, t in enumerate(self.wl.arrival_s):
            self.push(float(t), _ARRIVAL, (i, keys_of[i]))
        if len(self.wl):
            self.push(float(self.wl.arrival_s[0]) + self.live.report_interval_s, _REPORT, None)
        while self.events:
            now_s, _, kind, payload = heapq.heappop(self.events)
            if kind == _ARRIVAL:
                await self.arrival(now_s, *payload)
            elif kind == _PREFILL_DONE:
                await self.prefill_done(now_s, payload)
            elif kind == _DECODE_DONE:
                await self.decode_done(now_s, payload)
            else:
                await self.report(now_s)
                if any(k != _REPORT for _, _, k, _ in self.events):
                    self.push(now_s + self.live.report_interval_s, _REPORT, None)

    async def arrival(self, now_s: float, i: int, keys: tuple[bytes, ...]) -> None:
        n_input = int(self.wl.prompt_tokens[i])
        t0 = time.perf_counter_ns()
        dec = await self.client.schedule(f"r{i}", MODEL_NAME, keys=keys, input_tokens=n_input,
                                         at_s=now_s)
        self.sched_ns.append(time.perf_counter_ns() - t0)
        if not dec.accepted:
            reason = dec.reason
            name = {1: "ttft_slo", 2: "tpot_slo", 3: "decode_kv_full"}.get(reason, str(reason))
            self.rejected[name] = self.rejected.get(name, 0) + 1
            return
        self.accepted += 1
        if self.live.verify:
            self.check(i, keys, dec)
        sp = self.prefills[dec.prefill_instance]
        sp.queue.append(_Job(i, keys, dec, now_s))
        await self.start_next(sp, now_s)

    def check(self, i: int, keys: tuple[bytes, ...], dec: Any) -> None:
        """Is what the decision counts on really held by the nodes it names, now?"""
        c = self.consistency
        c["checked"] += 1
        held = self.stores[dec.prefill_node].lookup(keys).length if keys else 0
        ok = held >= dec.local_blocks
        c["local_held"] += ok
        c["local_exact"] += held == dec.local_blocks
        if dec.HasField("fetch"):
            c["fetches"] += 1
            f = dec.fetch
            src = self.stores.get(f.src_node)
            src_held = src.lookup(keys[: f.end_block]).length if src is not None else 0
            fetch_ok = src_held >= f.end_block and f.first_block == dec.local_blocks
            c["fetch_held"] += fetch_ok
            ok = ok and fetch_ok
        else:
            src_held = None
        if not ok:
            c["violations"] += 1
            if len(self.violations) < 20:
                self.violations.append({"request": i, "prefill_node": dec.prefill_node,
                                        "local_blocks": dec.local_blocks, "node_holds": held,
                                        "fetch_src": dec.fetch.src_node if src_held is not None
                                        else None, "fetch_end": dec.fetch.end_block
                                        if src_held is not None else None,
                                        "src_holds": src_held})

    def _read(self, store: Any, keys: Sequence[bytes]) -> int:
        """Read ``keys`` from a daemon (as an engine loads KV): how many leading ones it had."""
        got = 0
        for start in range(0, len(keys), len(self.scratch)):
            part = keys[start:start + len(self.scratch)]
            sizes = store.get_many_into(part, self.scratch[: len(part)])
            for size in sizes:
                if size is None:
                    return got
                got += 1
        return got

    def _store_chain(self, node_id: str, keys: Sequence[bytes], have: int) -> int:
        """Put ``keys[have:]`` (parents chained) into a daemon; the index of the last block
        put + 1, or 0 when nothing new was stored."""
        store = self.stores[node_id]
        last = 0
        for j in range(have, len(keys)):
            try:
                store.put(keys[j], self.value, parent=keys[j - 1] if j else None)
            except ChunkExists:
                continue
            except (CapacityError, InvalidArgument):
                # No room the cache may make (everything pinned), or the parent was evicted
                # meanwhile: the rest of the chain cannot be cached.
                break
            self.stored_blocks += 1
            last = j + 1
        return last

    async def sync(self, node_id: str, keys: Sequence[bytes], upto: int) -> None:
        """Wait until the conductor's index shows ``keys[:upto]`` on ``node_id``."""
        if upto <= 0:
            return
        t0 = time.perf_counter()
        deadline = t0 + _SYNC_TIMEOUT_S
        probe = list(keys[:upto])
        while True:
            reply = await self.client.lookup(keys=probe)
            if any(n.node_id == node_id and n.blocks >= upto for n in reply.nodes):
                self.sync_ms.append((time.perf_counter() - t0) * 1000)
                return
            if time.perf_counter() > deadline:
                self.sync_timeouts += 1
                return
            await asyncio.sleep(0.0005)

    async def start_next(self, sp: _Prefill, now_s: float) -> None:
        if sp.running is not None or not sp.queue:
            return
        job = sp.queue.popleft()
        dec = job.decision
        engine = self.engine
        n_input = int(self.wl.prompt_tokens[job.idx])
        store = self.stores[sp.node_id]
        local = self._read(store, store_lookup_prefix(store, job.keys))
        reused, ready_s, transfer_s, moved = local, now_s, None, 0
        if dec.HasField("fetch") and dec.fetch.src_node in self.stores:
            f = dec.fetch
            src = self.stores[f.src_node]
            want = job.keys[local:f.end_block]
            available = local + self._read(src, want) if want else local
            if available > local:
                last = self._store_chain(sp.node_id, job.keys[:available], local)
                await self.sync(sp.node_id, job.keys, last)
                moved = (available - local) * engine.block_size_bytes
                begin = max(now_s, self.nic_free_s.get(f.src_node, 0.0))
                transfer_s = moved / self.true_bandwidth * self.jitter()
                self.nic_free_s[f.src_node] = begin + transfer_s
                ready_s = begin + transfer_s
                self.fetched_blocks += available - local
                reused = available
        prior = min(reused * engine.block_size_tokens, n_input - 1)
        computed = n_input - prior
        prefill_s = sp.factor * engine.latency.prefill_s([computed], [prior]) * self.jitter()
        load_s = local * engine.block_size_bytes / self.dram_read_bytes_per_s
        end_s = ready_s + max(prefill_s, load_s)
        sp.running = (job, now_s, end_s, computed, prior, transfer_s, moved)
        sp.busy_until_s = end_s
        self.push(end_s, _PREFILL_DONE, (sp, prefill_s))

    async def prefill_done(self, now_s: float, payload: tuple[_Prefill, float]) -> None:
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        sp, prefill_s = payload
        assert sp.running is not None
        job, _, _, computed, prior, transfer_s, moved = sp.running
        sp.running = None
        store = self.stores[sp.node_id]
        have = store.lookup(job.keys).length if job.keys else 0
        last = self._store_chain(sp.node_id, job.keys, have)
        await self.sync(sp.node_id, job.keys, last)
        dec = job.decision
        await self.client.report_completion(pb.CompletionReport(
            ticket=dec.ticket, at_s=now_s, prefill=pb.PrefillDone(
                prefill_s=prefill_s, computed_tokens=computed, reused_tokens=prior,
                transfer_s=transfer_s or 0.0, transferred_bytes=moved)))
        self.ttft_actual.append(now_s - job.arrival_s)
        self.ttft_est.append(dec.ttft_estimate_s)
        self.reused_tokens += prior
        self.input_tokens += computed + prior
        sd = self.decodes[dec.decode_instance]
        sd.active += 1
        sd.context_tokens += computed + prior
        fixed_s, per_token_s = self.engine.latency.decode_coeffs(sd.active)
        tpot = sd.factor * (fixed_s + per_token_s * sd.context_tokens) * self.jitter()
        self.tpots.append(tpot)
        out = int(self.wl.output_tokens[job.idx])
        self.push(now_s + out * tpot, _DECODE_DONE,
                  (sd, dec.ticket, out, tpot, sd.active, sd.context_tokens, computed + prior))
        await self.start_next(sp, now_s)

    async def decode_done(self, now_s: float, payload: tuple[Any, ...]) -> None:
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        sd, ticket, out, tpot, batch, context, n_input = payload
        await self.client.report_completion(pb.CompletionReport(
            ticket=ticket, at_s=now_s, decode=pb.DecodeDone(
                output_tokens=out, tpot_s=tpot, batch_size=batch, context_tokens=context)))
        sd.active -= 1
        sd.context_tokens -= n_input

    async def report(self, now_s: float) -> None:
        """Every engine whose load changed reports it (queued prefill tokens: what it has not
        computed yet; decode: batch and KV in use)."""
        block = self.engine.block_size_tokens
        for sp in self.prefills.values():
            queued = 0
            if sp.running is not None:
                _, begin_s, end_s, computed, _, _, _ = sp.running
                left = (end_s - now_s) / (end_s - begin_s) if end_s > begin_s else 0.0
                queued += int(computed * min(1.0, max(0.0, left)))
            for job in sp.queue:
                n = int(self.wl.prompt_tokens[job.idx])
                queued += n - min(job.decision.prefix_blocks * block, n - 1)
            await self._report(sp.instance_id, now_s, (queued, 0, 0))
        for sd in self.decodes.values():
            await self._report(sd.instance_id, now_s, (0, sd.active, sd.context_tokens))

    async def _report(self, instance_id: str, now_s: float, load: tuple[int, int, int]) -> None:
        if self.last_load.get(instance_id) == load:
            return
        self.last_load[instance_id] = load
        self.load_reports += 1
        await self.client.report_load(instance_id, queued_prefill_tokens=load[0],
                                      running_decode_batch=load[1], kv_used_tokens=load[2],
                                      at_s=now_s)

    # ------------------------------------------------------------------ results

    async def result(self, wall_s: float, extra: dict[str, object]) -> LiveReplayResult:
        info = await self.client.leader_info()
        daemon_keys: set[bytes] = set()
        for store in self.stores.values():
            _, _, entries = store.snapshot()
            daemon_keys.update(e.key for e in entries)
        errors = [abs(e - a) / a for e, a in zip(self.ttft_est, self.ttft_actual, strict=True)
                  if a > 0]
        total_sched_s = sum(self.sched_ns) / 1e9
        return LiveReplayResult(
            policy=self.policy.value, trace=self.wl.name, requests=len(self.wl),
            accepted=self.accepted, rejected=self.rejected,
            hit_ratio=self.reused_tokens / self.input_tokens if self.input_tokens else 0.0,
            fetched_blocks=self.fetched_blocks,
            fetched_bytes=self.fetched_blocks * self.engine.block_size_bytes,
            stored_blocks=self.stored_blocks,
            ttft_s=_percentiles(self.ttft_actual), ttft_estimate_s=_percentiles(self.ttft_est),
            ttft_estimate_error=float(np.median(errors)) if errors else None,
            tpot_s=_percentiles(self.tpots),
            schedule_latency_us=_percentiles([ns / 1000 for ns in self.sched_ns]),
            decisions_per_s=len(self.sched_ns) / total_sched_s if total_sched_s else 0.0,
            consistency=dict(self.consistency), violations=self.violations,
            sync_wait_ms=_percentiles(self.sync_ms), sync_timeouts=self.sync_timeouts,
            load_reports=self.load_reports, indexed_blocks=int(info.indexed_blocks),
            daemon_blocks=len(daemon_keys), wall_s=wall_s,
            config={"cluster": asdict(self.cluster), "live": asdict(self.live),
                    "engine": self.engine.label, "rate_per_s": self.wl.rate_per_s, **extra})


def store_lookup_prefix(store: Any, keys: Sequence[bytes]) -> Sequence[bytes]:
    """The leading keys a daemon holds now (one Lookup)."""
    if not keys:
        return ()
    return keys[: store.lookup(keys).length]

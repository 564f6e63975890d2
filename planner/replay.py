"""Trace replay: requests through the real prefix index and scheduler onto simulated engines.

What is real and what is simulated
    Real: the :class:`~conductor.index.GlobalPrefixIndex` (fed only by chunk
    events and snapshots, never read from the nodes directly), the
    :class:`~conductor.scheduler.Scheduler` and its calibration, and each
    node's :class:`~kvstore.node.index.CacheIndex` (LRU, one DRAM tier,
    capacity in blocks), whose inserts and evictions become the node's
    numbered chunk events. Simulated: time (a discrete-event loop), prefill
    and decode engines, and transfers.

The simulated cluster (:class:`ClusterSpec`)
    ``prefill_instances`` prefill engines, each on its own node (store
    daemon); ``decode_instances`` decode engines. Engine speed follows one
    latency model (:class:`EngineModel`, by default the planner's roofline of
    Llama-3-70B on 8xH100) times a per-instance *true* factor drawn once in
    ``[1 - speed_spread, 1 + speed_spread]`` that the scheduler does not know
    and must calibrate, times log-normal noise per run. Links carry
    ``link_efficiency`` of the scheduler's nominal bandwidth, one transfer
    at a time per source node (FIFO), so a hot node congests.

One request
    1. Arrival: ``Scheduler.schedule`` (timed: the scheduling latency); a
       rejection ends it. A replication hint starts background copies.
    2. Prefill start (FIFO per instance): reuse what the node holds *now* (a
       planned prefix may have been evicted since the decision) plus what the
       fetch source still holds; the fetch waits for the source's link.
    3. Prefill end (TTFT): the node stores the whole chain (LRU, evictions
       become REMOVED events, new blocks STORED events, into the global
       index); the scheduler is told the measured times.
    4. Decode: ``output_tokens * TPOT`` at the batch it joins; the scheduler is
       told when it ends.

Single-threaded and deterministic for a given seed (scheduling latencies are
wall-clock measurements and vary).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import xxhash

from conductor.index import ChunkEvent, ChunkEventKind, GlobalPrefixIndex
from conductor.perf.engine_model import EngineModel, default_engine_model
from conductor.perf.latency import LatencyModel
from conductor.scheduler import (
    Decision,
    DecodeInstance,
    Policy,
    PrefillInstance,
    RejectReason,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
)
from kvstore.dataplane.tier import TierKind
from kvstore.errors import CapacityError, InvalidArgument
from kvstore.node.index import CacheIndex, TierBudget
from planner.trace import block_key
from planner.workload import Workload

__all__ = [
    "ClusterSpec",
    "EngineModel",
    "ReplayMetrics",
    "ReplayResult",
    "default_engine_model",
    "offered_prefill_load",
    "replay",
    "scale_to_load",
    "synthetic_keys",
]

MODEL_NAME = "trace-model"
_TIER = TierKind.DRAM
_PIN_TTL_S = 3600.0


@dataclass(frozen=True)
class ClusterSpec:
    prefill_instances: int = 8
    decode_instances: int = 8
    node_capacity_blocks: int = 6000
    """DRAM cache of each prefill node, in blocks (6,000 x 160 MiB ~ 1 TB with the default model)."""
    decode_kv_capacity_tokens: int = 1_200_000
    speed_spread: float = 0.2
    link_efficiency: float = 0.8
    noise_sigma: float = 0.05
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("prefill_instances", "decode_instances", "node_capacity_blocks",
                     "decode_kv_capacity_tokens"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be positive")
        if not 0 <= self.speed_spread < 1 or not self.link_efficiency > 0 or self.noise_sigma < 0:
            raise InvalidArgument("need 0 <= speed_spread < 1, link_efficiency > 0, noise >= 0")


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass(frozen=True, kw_only=True)
class ReplayMetrics:
    """What every scheduling replay measures, in process (:class:`ReplayResult`) or through real
    processes (:class:`planner.live_replay.LiveReplayResult`). Times in seconds unless named
    otherwise; a latency summary is ``{"mean", "p50", "p90", "p99"}`` (None when empty).

    A *decision* is one ``Scheduler.schedule`` call in process, one ``Schedule`` RPC (one in
    flight) through real processes.
    """

    policy: str
    trace: str
    requests: int
    accepted: int
    rejected: dict[str, int]
    """Rejected requests by reason."""
    hit_ratio: float
    """Reused input tokens / input tokens of accepted requests (what engines actually reused)."""
    fetched_blocks: int
    """Blocks an engine fetched from another node before its prefill."""
    ttft_s: dict[str, float | None]
    """Simulated TTFT (arrival to end of prefill) of accepted requests."""
    ttft_estimate_s: dict[str, float | None]
    """The scheduler's TTFT estimates of the same requests."""
    ttft_estimate_error: float | None
    """Median of |estimate - simulated| / simulated."""
    tpot_s: dict[str, float | None]
    schedule_latency_us: dict[str, float | None]
    """Wall-clock time of each decision (in process, includes being descheduled)."""
    decisions_per_s: float
    """Decisions / total wall-clock time spent deciding."""
    wall_s: float
    config: dict[str, object] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class ReplayResult(ReplayMetrics):
    """One policy replayed in process (:func:`replay`): the shared metrics, plus what only the
    in-process replay sees."""

    replication_hints: int
    schedule_cpu_us: dict[str, float | None]
    """CPU time of each call on its thread: the scheduler's own cost, without preemption."""
    preloaded_blocks: int
    index_keys: int
    events_applied: int
    events_dropped: int


class _Clock:
    __slots__ = ("now_s",)

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class SimNode:
    """A store daemon's metadata: an LRU DRAM cache index that reports numbered chunk events."""

    def __init__(self, node_id: str, capacity_blocks: int, index: GlobalPrefixIndex,
                 clock: _Clock, epoch: int = 1) -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.seq = 0
        self.cache = CacheIndex({_TIER: TierBudget(capacity_blocks, capacity_blocks,
                                                   capacity_blocks)}, "lru", clock=clock)
        self.held: set[bytes] = set()
        """The keys this node reported as stored and not removed (what its snapshot lists)."""
        self._index = index

    def join(self, extra: Iterable[bytes] = ()) -> None:
        """Join the global index with a snapshot of what it holds (empty at start).

        ``extra`` keys are reported too (as DRAM blocks) without being cached here:
        the replay's synthetic preload.
        """
        entries = itertools.chain(((key, _TIER) for key in self.held),
                                  ((key, _TIER) for key in extra))
        if not self._index.apply_snapshot(self.node_id, self.epoch, self.seq, entries):
            raise InvalidArgument(f"snapshot of {self.node_id} was superseded")

    def longest_prefix(self, keys: Sequence[bytes]) -> int:
        return self.cache.longest_prefix(keys)

    def store(self, keys: Sequence[bytes]) -> None:
        """Cache a request's whole chain (as an engine does after its prefill), LRU."""
        idx = self.cache
        hit = idx.longest_prefix(keys)
        lease = idx.pin_many(keys[:hit], _PIN_TTL_S) if hit else None
        events: list[tuple[ChunkEventKind, bytes]] = []
        new = keys[hit:]
        if new:
            parent = keys[hit - 1] if hit else None
            n = idx.admit_count(new, parent, _TIER, 1)
            if n:
                need = n - idx.usage(_TIER).free_bytes
                try:
                    victims = idx.plan_eviction(_TIER, need) if need > 0 else []
                except CapacityError:
                    victims, n = [], 0  # the chain alone is bigger than what can be freed
                for key in victims:
                    idx.remove(key)
                    events.append((ChunkEventKind.REMOVED, key))
                if n:
                    idx.insert_chain(new[:n], parent, _TIER, 1)
                    events.extend((ChunkEventKind.STORED, key) for key in new[:n])
        if hit:
            idx.access_prefix(keys[:hit])
        if lease is not None:
            idx.unpin(lease)
        self._emit(events)

    def _emit(self, events: list[tuple[ChunkEventKind, bytes]]) -> None:
        out = []
        for kind, key in events:
            if kind is ChunkEventKind.REMOVED:
                self.held.discard(key)
            else:
                self.held.add(key)
            self.seq += 1
            out.append(ChunkEvent(self.node_id, self.epoch, self.seq, kind, key,
                                  None if kind is ChunkEventKind.REMOVED else _TIER))
        self._index.apply_events(out)


class _Job:
    __slots__ = ("arrival_s", "decision", "idx", "keys")

    def __init__(self, idx: int, keys: tuple[bytes, ...], decision: Decision,
                 arrival_s: float) -> None:
        self.idx = idx
        self.keys = keys
        self.decision = decision
        self.arrival_s = arrival_s


class _SimPrefill:
    __slots__ = ("busy", "factor", "instance", "queue")

    def __init__(self, instance: PrefillInstance, factor: float) -> None:
        self.instance = instance
        self.factor = factor
        self.queue: deque[_Job] = deque()
        self.busy = False


class _SimDecode:
    __slots__ = ("active", "context_tokens", "factor", "instance")

    def __init__(self, instance: DecodeInstance, factor: float) -> None:
        self.instance = instance
        self.factor = factor
        self.active = 0
        self.context_tokens = 0


_ARRIVAL, _PREFILL_DONE, _DECODE_DONE, _COPY_DONE = range(4)


def synthetic_keys(stream: int, count: int) -> Iterator[bytes]:
    """``count`` distinct 16-byte keys of stream ``stream``, never equal to a trace key (8 bytes)."""
    digest = xxhash.xxh3_128_digest
    for i in range(count):
        yield digest(b"kvtier-preload:%d:%d" % (stream, i))


def offered_prefill_load(workload: Workload, latency: LatencyModel, prefill_instances: int) -> float:
    """Utilization of the prefill instances if nothing were reused, at the trace's timing."""
    work = sum(latency.prefill_s([int(n)], [0]) for n in workload.prompt_tokens)
    duration = max(workload.duration_s, 1e-9)
    return work / (prefill_instances * duration)


def scale_to_load(workload: Workload, latency: LatencyModel, prefill_instances: int,
                  target_load: float) -> Workload:
    """The workload with arrivals rescaled so that :func:`offered_prefill_load` is ``target_load``."""
    if not target_load > 0:
        raise InvalidArgument(f"target_load must be positive, got {target_load}")
    if not workload.duration_s > 0:
        raise InvalidArgument(f"the {len(workload)} requests of {workload.name!r} all arrive at "
                              "once: no rate to rescale (replay more requests)")
    load = offered_prefill_load(workload, latency, prefill_instances)
    return workload.at_rate(workload.rate_per_s * target_load / load)


def _keys_of(workload: Workload) -> list[tuple[bytes, ...]]:
    if workload.block_ids is None:
        return [() for _ in range(len(workload))]
    return [tuple(block_key(h) for h in ids) for ids in workload.block_ids]


def replay(workload: Workload, policy: Policy, *, cluster: ClusterSpec | None = None,
           engine: EngineModel | None = None, ttft_slo_s: float | None = None,
           tpot_slo_s: float | None = None, kvcache_balancing_threshold: float = 1.0,
           hot_prefix_fetches: int = 0, preload_blocks: int = 0) -> ReplayResult:
    """Replay ``workload`` (already at the wanted rate) under ``policy``. See the module docstring.

    ``preload_blocks`` synthetic blocks (keys no request uses, spread over the
    nodes) are put in the global index first, so lookups run against an index of
    that size; the nodes' own caches do not hold them.
    """
    if preload_blocks < 0:
        raise InvalidArgument(f"preload_blocks must be >= 0, got {preload_blocks}")
    cluster = cluster or ClusterSpec()
    engine = engine or default_engine_model(workload.block_tokens)
    if engine.block_size_tokens != workload.block_tokens:
        raise InvalidArgument(f"engine blocks of {engine.block_size_tokens} tokens cannot replay "
                              f"a trace of {workload.block_tokens}-token blocks")
    started = time.perf_counter()
    rng = random.Random(cluster.seed)
    noise = random.Random(cluster.seed + 1)
    sigma = cluster.noise_sigma
    latency = engine.latency
    clock = _Clock()
    index = GlobalPrefixIndex()
    config = SchedulerConfig(
        policy=policy, block_size_tokens=engine.block_size_tokens,
        block_size_bytes=engine.block_size_bytes, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
        kvcache_balancing_threshold=kvcache_balancing_threshold,
        hot_prefix_fetches=hot_prefix_fetches, seed=cluster.seed)
    scheduler = Scheduler(index, latency, config)
    true_bandwidth = config.remote_link_bytes_per_s * cluster.link_efficiency

    nodes: dict[str, SimNode] = {}
    prefills: dict[str, _SimPrefill] = {}
    decodes: dict[str, _SimDecode] = {}
    for i in range(cluster.prefill_instances):
        node = SimNode(f"node-{i}", cluster.node_capacity_blocks, index, clock)
        share = preload_blocks // cluster.prefill_instances + (
            1 if i < preload_blocks % cluster.prefill_instances else 0)
        node.join(synthetic_keys(i, share))
        nodes[node.node_id] = node
        inst = PrefillInstance(f"prefill-{i}", node.node_id, MODEL_NAME)
        scheduler.add_prefill_instance(inst)
        spread = cluster.speed_spread
        prefills[inst.instance_id] = _SimPrefill(inst, rng.uniform(1 - spread, 1 + spread))
    for i in range(cluster.decode_instances):
        dinst = DecodeInstance(f"decode-{i}", f"decode-node-{i}", MODEL_NAME,
                               cluster.decode_kv_capacity_tokens)
        scheduler.add_decode_instance(dinst)
        spread = cluster.speed_spread
        decodes[dinst.instance_id] = _SimDecode(dinst, rng.uniform(1 - spread, 1 + spread))
    nic_free_s: dict[str, float] = {}

    all_keys = _keys_of(workload)
    events: list[tuple[float, int, int, object]] = []
    order = 0
    for i, t in enumerate(workload.arrival_s):
        events.append((float(t), order, _ARRIVAL, i))
        order += 1
    heapq.heapify(events)

    def push(at_s: float, kind: int, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(events, (at_s, order, kind, payload))

    def jitter() -> float:
        return math.exp(noise.gauss(0.0, sigma)) if sigma else 1.0

    def link_transfer(src: str, start_s: float, size_bytes: int) -> tuple[float, float]:
        """(end time, pure transfer seconds) of a transfer out of ``src`` queued at ``start_s``."""
        begin = max(start_s, nic_free_s.get(src, 0.0))
        seconds = size_bytes / true_bandwidth * jitter()
        nic_free_s[src] = begin + seconds
        return begin + seconds, seconds

    sched_ns: list[int] = []
    sched_cpu_ns: list[int] = []
    ttft_actual: list[float] = []
    ttft_est: list[float] = []
    tpots: list[float] = []
    reused_tokens_total = 0
    input_tokens_total = 0
    fetched_blocks = 0
    hints = 0
    rejected = {r.value: 0 for r in RejectReason}
    # per prefill job in flight: (job, prefill_s, computed, reused, transfer_s, bytes)
    running: dict[str, tuple[_Job, float, int, int, float | None, int]] = {}

    def start_next(sp: _SimPrefill, now_s: float) -> None:
        nonlocal fetched_blocks
        if sp.busy or not sp.queue:
            return
        job = sp.queue.popleft()
        sp.busy = True
        dec = job.decision
        node = nodes[sp.instance.node_id]
        n_input = int(workload.prompt_tokens[job.idx])
        local = node.longest_prefix(job.keys)
        reused = local
        ready_s = now_s
        transfer_s: float | None = None
        moved = 0
        if dec.fetch is not None and dec.fetch.src_node in nodes:
            src = nodes[dec.fetch.src_node]
            available = min(dec.fetch.end_block, src.longest_prefix(job.keys[: dec.fetch.end_block]))
            if available > local:
                moved = (available - local) * engine.block_size_bytes
                ready_s, transfer_s = link_transfer(src.node_id, now_s, moved)
                fetched_blocks += available - local
                reused = available
        prior = min(reused * engine.block_size_tokens, n_input - 1)
        computed = n_input - prior
        prefill_s = sp.factor * latency.prefill_s([computed], [prior]) * jitter()
        local_load_s = local * engine.block_size_bytes / config.dram_read_bytes_per_s
        running[sp.instance.instance_id] = (job, prefill_s, computed, prior, transfer_s, moved)
        push(ready_s + max(prefill_s, local_load_s), _PREFILL_DONE, sp)

    while events:
        now_s, _, kind, payload = heapq.heappop(events)
        clock.now_s = now_s
        if kind == _ARRIVAL:
            if not isinstance(payload, int):
                raise InvalidArgument("bad arrival payload")
            i = payload
            keys = all_keys[i]
            req = ScheduleRequest(f"r{i}", MODEL_NAME, keys, int(workload.prompt_tokens[i]))
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            dec = scheduler.schedule(req, now_s)
            sched_ns.append(time.perf_counter_ns() - t0)
            sched_cpu_ns.append(time.thread_time_ns() - c0)
            if not dec.accepted:
                if dec.reason is not None:
                    rejected[dec.reason.value] += 1
                continue
            if dec.replicate is not None:
                hint = dec.replicate
                src = nodes.get(hint.src_node)
                if src is not None:
                    have = src.longest_prefix(keys[: hint.blocks])
                    for dst in hint.dst_nodes:
                        missing = have - nodes[dst].longest_prefix(keys[:have])
                        if missing > 0:
                            end_s, _ = link_transfer(src.node_id, now_s,
                                                     missing * engine.block_size_bytes)
                            push(end_s, _COPY_DONE, (dst, keys[:have]))
                            hints += 1
            assert dec.prefill_instance is not None
            sp = prefills[dec.prefill_instance]
            sp.queue.append(_Job(i, keys, dec, now_s))
            start_next(sp, now_s)
        elif kind == _PREFILL_DONE:
            if not isinstance(payload, _SimPrefill):
                raise InvalidArgument("bad prefill payload")
            sp = payload
            job, prefill_s, computed, prior, transfer_s, moved = running.pop(sp.instance.instance_id)
            nodes[sp.instance.node_id].store(job.keys)
            dec = job.decision
            scheduler.prefill_done(dec.ticket, now_s, prefill_s=prefill_s,
                                   computed_tokens=computed, reused_tokens=prior,
                                   transfer_s=transfer_s, transferred_bytes=moved)
            ttft_actual.append(now_s - job.arrival_s)
            ttft_est.append(dec.ttft.total_s if dec.ttft is not None else float("nan"))
            reused_tokens_total += prior
            input_tokens_total += computed + prior
            assert dec.decode_instance is not None
            sd = decodes[dec.decode_instance]
            sd.active += 1
            sd.context_tokens += computed + prior
            fixed_s, per_token_s = latency.decode_coeffs(sd.active)
            tpot = sd.factor * (fixed_s + per_token_s * sd.context_tokens) * jitter()
            tpots.append(tpot)
            out = int(workload.output_tokens[job.idx])
            push(now_s + out * tpot, _DECODE_DONE,
                 (sd, dec.ticket, out, tpot, sd.active, sd.context_tokens, computed + prior))
            sp.busy = False
            start_next(sp, now_s)
        elif kind == _DECODE_DONE:
            if not isinstance(payload, tuple):
                raise InvalidArgument("bad decode payload")
            sd, ticket, out, tpot, batch, context, n_input = payload
            scheduler.decode_done(ticket, now_s, output_tokens=out, tpot_s=tpot,
                                  batch_size=batch, context_tokens=context)
            sd.active -= 1
            sd.context_tokens -= n_input
        else:
            if not isinstance(payload, tuple):
                raise InvalidArgument("bad copy payload")
            dst, chain = payload
            nodes[dst].store(chain)

    stats = index.stats()
    errors = [abs(e - a) / a for e, a in zip(ttft_est, ttft_actual, strict=True) if a > 0]
    total_sched_s = sum(sched_ns) / 1e9
    return ReplayResult(
        policy=policy.value, trace=workload.name, requests=len(workload),
        accepted=scheduler.accepted, rejected=rejected,
        hit_ratio=reused_tokens_total / input_tokens_total if input_tokens_total else 0.0,
        fetched_blocks=fetched_blocks, replication_hints=hints,
        ttft_s=_percentiles(ttft_actual), ttft_estimate_s=_percentiles(ttft_est),
        ttft_estimate_error=float(np.median(errors)) if errors else None,
        tpot_s=_percentiles(tpots),
        schedule_latency_us=_percentiles([ns / 1000 for ns in sched_ns]),
        schedule_cpu_us=_percentiles([ns / 1000 for ns in sched_cpu_ns]),
        preloaded_blocks=preload_blocks,
        decisions_per_s=len(sched_ns) / total_sched_s if total_sched_s else 0.0,
        index_keys=stats.keys, events_applied=stats.events_applied,
        events_dropped=stats.events_dropped, wall_s=time.perf_counter() - started,
        config={"cluster": asdict(cluster), "engine": engine.label,
                "rate_per_s": workload.rate_per_s, "ttft_slo_s": ttft_slo_s,
                "tpot_slo_s": tpot_slo_s,
                "kvcache_balancing_threshold": kvcache_balancing_threshold,
                "hot_prefix_fetches": hot_prefix_fetches})

"""The discrete-event simulator of one deployment serving one workload.

Architectures
    * ``COLOCATED`` -- continuous batching with prefill priority (vLLM as DistServe compared against): an
      iteration is either a batch of whole prefills or a decode step of every running request, so each
      prefill stalls all decodes of its instance.
    * ``CHUNKED`` -- SARATHI-Serve: every iteration carries all running decodes plus prefill chunks up to a
      token budget (``chunk_tokens``, decodes included), so decodes never stall but prefills take several
      iterations, each paying the iteration's fixed cost.
    * ``DISAGGREGATED`` -- DistServe / Splitwise: prefill instances batch whole prompts (up to
      ``prefill_token_budget`` tokens), emit the first token, and the decode instance *pulls* the KV over
      ``link`` once it has room for it (the prefill GPU holds the KV until then). With
      ``layerwise_transfer`` the transfer overlaps the prefill layer by layer when the decode side admitted
      the request as its prefill finished.
    * Any architecture may add a ``prefix_cache``: a global LRU pool of 512-token blocks (Mooncake's); a
      prompt's cached prefix is loaded instead of recomputed (the load overlaps the prefill layer by layer
      when ``layerwise_transfer``), and its blocks are written back after the prefill.

Routing: a new request goes to the front instance (colocated or prefill) with the fewest queued prefill
tokens; a prefilled request to the decode instance with the most free KV memory. Memory: a request reserves
the KV of its whole prompt and output where it decodes, and of its prompt on the prefill instance until
the transfer completes; no preemption. A request whose KV cannot fit one instance is rejected.

Parallelism: an instance of ``tp x pp`` GPUs has ``pp`` lanes (micro-batches in flight), each with the
TP-only latency and ``1/pp`` of the instance's KV capacity; each lane stands for ``tp`` GPUs' power and
network interfaces. One NIC per GPU: a lane sends and receives at ``link bandwidth x tp``.

Speed
    Events (arrivals, iteration ends, transfer ends) live in one ``heapq``. Decode progress is a counter
    per instance: a request joining at counter ``n`` finishes when the counter reaches ``n + output - 1``,
    so an iteration costs O(1) however large the batch, and a run of decode-only iterations between two
    events is one event whose duration is a closed-form sum (iteration time is affine in the total
    context, which grows by the batch size each step). An arrival cuts such a run at the next iteration
    boundary. Chunked prefill steps one iteration at a time.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from conductor.perf.hardware import LINKS, GpuSpec, Link
from conductor.perf.latency import LatencyModel, LatencyProvider
from conductor.perf.models import DType, ModelSpec
from kvstore.errors import ConfigError, InvalidArgument, InvariantViolation
from planner.kv import exposed_transfer_s
from planner.metrics import SimResult
from planner.prefix_cache import PrefixCache
from planner.workload import Workload


class Architecture(enum.Enum):
    COLOCATED = "colocated"
    CHUNKED = "chunked"
    DISAGGREGATED = "disaggregated"


@dataclass(frozen=True)
class InstanceGroup:
    """``count`` identical instances of ``tp x pp`` GPUs each."""

    count: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.count <= 0 or self.tp <= 0 or self.pp <= 0:
            raise InvalidArgument(f"instance group needs positive count, tp and pp, got {self}")

    @property
    def gpus(self) -> int:
        return self.count * self.tp * self.pp

    @property
    def label(self) -> str:
        pp = f",pp{self.pp}" if self.pp > 1 else ""
        return f"{self.count}x(tp{self.tp}{pp})"


@dataclass(frozen=True)
class PrefixCacheSpec:
    """A tiered KV pool holding ``capacity_tokens`` (in ``block_tokens`` blocks).

    ``bandwidth_bytes_per_s`` is per GPU, from the pool to a prefill GPU; ``None`` means the deployment's
    link.
    """

    capacity_tokens: int
    block_tokens: int = 512
    bandwidth_bytes_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.capacity_tokens < self.block_tokens or self.block_tokens <= 0:
            raise InvalidArgument("prefix cache must hold at least one block of positive size")
        if self.bandwidth_bytes_per_s is not None and self.bandwidth_bytes_per_s <= 0:
            raise InvalidArgument("prefix cache bandwidth must be positive")


@dataclass(frozen=True)
class Deployment:
    """How GPUs are organised: the architecture, instance groups and scheduling knobs."""

    architecture: Architecture
    colocated: InstanceGroup | None = None
    prefill: InstanceGroup | None = None
    decode: InstanceGroup | None = None
    chunk_tokens: int = 512
    prefill_token_budget: int = 4096
    max_batch_requests: int = 256
    link: Link = field(default_factory=lambda: LINKS["roce-400g"])
    layerwise_transfer: bool = True
    prefix_cache: PrefixCacheSpec | None = None

    def __post_init__(self) -> None:
        if self.architecture is Architecture.DISAGGREGATED:
            if self.prefill is None or self.decode is None or self.colocated is not None:
                raise InvalidArgument(
                    "a disaggregated deployment needs prefill and decode groups only"
                )
        elif self.colocated is None or self.prefill is not None or self.decode is not None:
            raise InvalidArgument(
                f"a {self.architecture.value} deployment needs one colocated group only"
            )
        if self.chunk_tokens <= 0 or self.prefill_token_budget <= 0 or self.max_batch_requests <= 0:
            raise InvalidArgument(
                "chunk_tokens, prefill_token_budget and max_batch_requests must be positive"
            )

    @property
    def groups(self) -> list[InstanceGroup]:
        return [g for g in (self.colocated, self.prefill, self.decode) if g is not None]

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    @property
    def instances(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def label(self) -> str:
        cache = f" +cache {self.prefix_cache.capacity_tokens:,} tok" if self.prefix_cache else ""
        if self.architecture is Architecture.DISAGGREGATED:
            assert self.prefill is not None and self.decode is not None
            return f"disagg P {self.prefill.label} : D {self.decode.label} over {self.link.name}{cache}"
        assert self.colocated is not None
        if self.architecture is Architecture.CHUNKED:
            return f"chunked({self.chunk_tokens}) {self.colocated.label}{cache}"
        return f"colocated {self.colocated.label}{cache}"


@dataclass(frozen=True, eq=False)
class ClusterSpec:
    """The model, the GPU type and the latency models, shared by every deployment being compared."""

    model: ModelSpec
    gpu: GpuSpec
    latency: LatencyProvider
    kv_dtype: DType = DType.FP16
    weight_dtype: DType = DType.FP16
    memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.memory_fraction <= 1:
            raise InvalidArgument("memory_fraction must be in (0, 1]")

    def kv_capacity_tokens(self, tp: int, pp: int) -> int:
        """KV tokens one ``tp x pp`` instance can hold: published (DistServe's table) or from memory."""
        published = self.latency.kv_capacity.get((tp, pp))
        if published is not None:
            return published
        free = self.gpu.memory_bytes * self.memory_fraction * tp * pp - self.model.weight_bytes(
            self.weight_dtype
        )
        return max(int(free // self.model.kv_bytes_per_token(self.kv_dtype)), 0)

    def check(self, deployment: Deployment) -> None:
        """Raise :class:`ConfigError` when the deployment cannot run (no latency model, weights do not fit)."""
        for group in deployment.groups:
            self.latency.for_tp(group.tp)
            if self.kv_capacity_tokens(group.tp, group.pp) < group.pp * 2048:
                raise ConfigError(
                    f"{self.model.name} does not fit tp{group.tp} pp{group.pp} on "
                    f"{self.gpu.name} with room for KV"
                )


_COLO, _PREFILL, _DECODE = 0, 1, 2
_IDLE, _STEP_PREFILL, _STEP_MIXED, _STEP_DECODE = 0, 1, 2, 3
_EV_ARRIVAL, _EV_STEP, _EV_TRANSFER = 0, 1, 2


class _Engine:
    """One lane of one instance. Mutable simulator state only; no behaviour beyond bookkeeping."""

    __slots__ = (
        "busy_decode_s",
        "busy_prefill_s",
        "chunked",
        "gpus",
        "heap",
        "idx",
        "iters",
        "kv_cap",
        "kv_used",
        "lat",
        "link_free",
        "pending_tokens",
        "plan",
        "prefill_q",
        "prefilling",
        "ready_q",
        "role",
        "step_b",
        "step_items",
        "step_kind",
        "sum_ctx",
        "version",
    )

    def __init__(
        self, idx: int, role: int, lat: LatencyModel, kv_cap: int, gpus: int, chunked: bool
    ) -> None:
        self.idx = idx
        self.role = role
        self.lat = lat
        self.kv_cap = kv_cap
        self.kv_used = 0
        self.gpus = gpus
        self.chunked = chunked
        self.prefill_q: deque[int] = deque()
        self.prefilling: list[int] = []  # chunked: admitted, prefill in progress (FCFS)
        self.ready_q: deque[int] = deque()  # decode role: KV arrived, joins at the next iteration
        self.heap: list[tuple[int, int]] = []  # (finish counter, request) of running decodes
        self.iters = 0  # decode iterations this lane has run
        self.sum_ctx = 0  # sum(prompt + 1 - join counter) over running requests
        self.pending_tokens = 0  # queued prefill tokens (routing)
        self.step_kind = _IDLE
        self.step_items: list[tuple[int, int]] = []
        self.step_b = 0
        self.plan: list[float] = []  # decode run: t0, n0, k, alpha, beta
        self.version = 0
        self.link_free = 0.0
        self.busy_prefill_s = 0.0
        self.busy_decode_s = 0.0


def _run_duration(alpha: float, beta: float, k: int) -> float:
    return k * alpha + beta * k * (k - 1) / 2.0


class _Simulation:
    def __init__(self, cluster: ClusterSpec, deployment: Deployment, workload: Workload) -> None:
        cluster.check(deployment)
        self.cluster = cluster
        self.dep = deployment
        self.wl = workload
        n = len(workload)
        self.n = n
        # Python lists, not arrays: the event loop reads one element at a time, where lists are faster.
        self.arrival: list[float] = workload.arrival_s.tolist()
        self.prompt: list[int] = workload.prompt_tokens.tolist()
        self.output: list[int] = workload.output_tokens.tolist()
        self.blocks = workload.block_ids
        nan = math.nan
        self.prefill_start = [nan] * n
        self.first_token = [nan] * n
        self.finish = [nan] * n
        self.transfer = [0.0] * n
        self.decode_wait = [0.0] * n
        self.cached = [0] * n
        self.rejected = [False] * n
        self.join_iter = [0] * n
        self.progress = [0] * n
        self.target = [0] * n
        self.p_engine = [-1] * n
        self.kv_bpt = cluster.model.kv_bytes_per_token(cluster.kv_dtype)
        self.layers = cluster.model.layers
        self.link = deployment.link
        self.layerwise = deployment.layerwise_transfer
        self.budget = deployment.prefill_token_budget
        self.chunk = deployment.chunk_tokens
        self.max_batch = deployment.max_batch_requests
        self.cache: PrefixCache | None = None
        self.cache_block_tokens = 512
        self.cache_bw = self.link.bandwidth_bytes_per_s
        if deployment.prefix_cache is not None:
            spec = deployment.prefix_cache
            self.cache = PrefixCache(spec.capacity_tokens // spec.block_tokens)
            self.cache_block_tokens = spec.block_tokens
            if spec.bandwidth_bytes_per_s is not None:
                self.cache_bw = spec.bandwidth_bytes_per_s
            if workload.block_ids is not None and workload.block_tokens != spec.block_tokens:
                raise ConfigError(
                    f"trace blocks are {workload.block_tokens} tokens, cache blocks "
                    f"{spec.block_tokens}"
                )
        self.kv_transfer_bytes = 0
        self.cache_load_bytes = 0
        self.cache_write_bytes = 0
        self.engines: list[_Engine] = []
        self.front: list[_Engine] = []
        self.back: list[_Engine] = []
        if deployment.architecture is Architecture.DISAGGREGATED:
            assert deployment.prefill is not None and deployment.decode is not None
            self.front = self._make(deployment.prefill, _PREFILL, chunked=False)
            self.back = self._make(deployment.decode, _DECODE, chunked=False)
        else:
            assert deployment.colocated is not None
            chunked = deployment.architecture is Architecture.CHUNKED
            self.front = self._make(deployment.colocated, _COLO, chunked=chunked)
        self.pending_decode: deque[int] = deque()
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0

    def _make(self, group: InstanceGroup, role: int, chunked: bool) -> list[_Engine]:
        lat = self.cluster.latency.for_tp(group.tp)
        lane_cap = self.cluster.kv_capacity_tokens(group.tp, group.pp) // group.pp
        made = []
        for _ in range(group.count * group.pp):
            eng = _Engine(len(self.engines), role, lat, lane_cap, group.tp, chunked)
            self.engines.append(eng)
            made.append(eng)
        return made

    # -- event plumbing -------------------------------------------------------------------------------
    def _push(self, time: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time, self.seq, kind, a, b))

    def _schedule_step(self, eng: _Engine, kind: int, duration: float) -> None:
        eng.step_kind = kind
        eng.version += 1
        self._push(self.now + duration, _EV_STEP, eng.idx, eng.version)

    def run(self) -> SimResult:
        for rid, t in enumerate(self.arrival):
            self._push(t, _EV_ARRIVAL, rid, 0)
        events = self.events
        pop = heapq.heappop
        engines = self.engines
        while events:
            t, _, kind, a, b = pop(events)
            self.now = t
            if kind == _EV_STEP:
                eng = engines[a]
                if b == eng.version:
                    self._step_done(eng)
            elif kind == _EV_ARRIVAL:
                self._arrive(a)
            else:
                self._transfer_done(a, engines[b])
        return self._result()

    # -- arrivals and routing -------------------------------------------------------------------------
    def _arrive(self, rid: int) -> None:
        best = self.front[0]
        for eng in self.front:
            if (eng.pending_tokens, eng.kv_used) < (best.pending_tokens, best.kv_used):
                best = eng
        best.prefill_q.append(rid)
        best.pending_tokens += self.prompt[rid]
        self._poke(best)

    def _poke(self, eng: _Engine) -> None:
        """New work for ``eng``: start it if idle, or cut its decode run at the next iteration boundary."""
        if eng.step_kind == _IDLE:
            self._plan(eng)
        elif eng.step_kind == _STEP_DECODE:
            t0, _, k, alpha, beta = eng.plan
            elapsed = self.now - t0
            if beta > 0:
                half = alpha - beta / 2.0
                j = math.ceil((-half + math.sqrt(half * half + 2.0 * beta * elapsed)) / beta)
            else:
                j = math.ceil(elapsed / alpha) if alpha > 0 else 1
            j = max(j, 1)
            while j > 1 and _run_duration(alpha, beta, j - 1) >= elapsed:
                j -= 1
            while _run_duration(alpha, beta, j) < elapsed:
                j += 1
            if j < k:
                eng.plan[2] = j
                eng.version += 1
                self._push(t0 + _run_duration(alpha, beta, j), _EV_STEP, eng.idx, eng.version)

    # -- planning -------------------------------------------------------------------------------------
    def _plan(self, eng: _Engine) -> None:
        role = eng.role
        if role != _DECODE:
            if eng.chunked:
                if self._start_mixed(eng):
                    return
            elif eng.prefill_q and self._start_prefill(eng):
                return
        if role != _PREFILL:
            if role == _DECODE:
                ready = eng.ready_q
                while ready and len(eng.heap) < self.max_batch:
                    self._join(eng, ready.popleft())
            if eng.heap:
                self._start_decode(eng)
                return
        eng.step_kind = _IDLE

    def _reserve(self, eng: _Engine, rid: int) -> int:
        return self.prompt[rid] if eng.role == _PREFILL else self.prompt[rid] + self.output[rid]

    def _reject(self, eng: _Engine, rid: int) -> None:
        eng.prefill_q.popleft()
        eng.pending_tokens -= self.prompt[rid]
        self.rejected[rid] = True

    def _cached_tokens(self, rid: int, touch: bool) -> int:
        if self.cache is None or self.blocks is None:
            return 0
        ids = self.blocks[rid]
        hits = self.cache.match(ids) if touch else self.cache.peek(ids)
        return min(hits * self.cache_block_tokens, self.prompt[rid] - 1)

    def _load_exposed_s(self, eng: _Engine, cached_total: int, compute_s: float) -> float:
        if cached_total == 0:
            return 0.0
        size = cached_total * self.kv_bpt
        self.cache_load_bytes += size
        load_s = size / (self.cache_bw * eng.gpus)
        return exposed_transfer_s(load_s, compute_s, self.layers, self.layerwise)

    def _start_prefill(self, eng: _Engine) -> bool:
        q = eng.prefill_q
        batch: list[int] = []
        news: list[int] = []
        priors: list[int] = []
        tokens = 0
        colo = eng.role == _COLO
        while q:
            rid = q[0]
            need = self._reserve(eng, rid)
            if need > eng.kv_cap:
                self._reject(eng, rid)
                continue
            if eng.kv_used + need > eng.kv_cap:
                break
            if colo and len(eng.heap) + len(batch) >= self.max_batch:
                break
            new = self.prompt[rid] - self._cached_tokens(rid, touch=False)
            if batch and tokens + new > self.budget:
                break
            q.popleft()
            cached = self._cached_tokens(rid, touch=True)
            new = self.prompt[rid] - cached
            eng.pending_tokens -= self.prompt[rid]
            eng.kv_used += need
            self.cached[rid] = cached
            self.prefill_start[rid] = self.now
            batch.append(rid)
            news.append(new)
            priors.append(cached)
            tokens += new
        if not batch:
            return False
        compute = eng.lat.prefill_s(news, priors)
        duration = compute + self._load_exposed_s(eng, sum(priors), compute)
        eng.busy_prefill_s += duration
        eng.step_items = [(rid, 0) for rid in batch]
        self._schedule_step(eng, _STEP_PREFILL, duration)
        return True

    def _start_mixed(self, eng: _Engine) -> bool:
        b = len(eng.heap)
        budget = self.chunk - b
        if budget <= 0:
            return False
        items: list[tuple[int, int]] = []
        news: list[int] = []
        priors: list[int] = []
        cached_new = 0
        for rid in eng.prefilling:
            take = min(self.target[rid] - self.progress[rid], budget)
            items.append((rid, take))
            news.append(take)
            priors.append(self.cached[rid] + self.progress[rid])
            budget -= take
            if budget == 0:
                break
        q = eng.prefill_q
        while budget > 0 and q:
            rid = q[0]
            need = self._reserve(eng, rid)
            if need > eng.kv_cap:
                self._reject(eng, rid)
                continue
            if eng.kv_used + need > eng.kv_cap or b + len(eng.prefilling) >= self.max_batch:
                break
            q.popleft()
            eng.pending_tokens -= self.prompt[rid]
            eng.kv_used += need
            cached = self._cached_tokens(rid, touch=True)
            self.cached[rid] = cached
            cached_new += cached
            self.target[rid] = self.prompt[rid] - cached
            self.progress[rid] = 0
            self.prefill_start[rid] = self.now
            eng.prefilling.append(rid)
            take = min(self.target[rid], budget)
            items.append((rid, take))
            news.append(take)
            priors.append(cached)
            budget -= take
        if not items:
            return False
        compute = (
            eng.lat.mixed_s(news, priors, b, eng.sum_ctx + b * eng.iters)
            if b
            else eng.lat.prefill_s(news, priors)
        )
        duration = compute + self._load_exposed_s(eng, cached_new, compute)
        eng.busy_prefill_s += duration
        eng.step_items = items
        eng.step_b = b
        self._schedule_step(eng, _STEP_MIXED, duration)
        return True

    def _start_decode(self, eng: _Engine) -> None:
        b = len(eng.heap)
        k = eng.heap[0][0] - eng.iters
        if k <= 0:
            raise InvariantViolation(f"decode run of {k} iterations on lane {eng.idx}")
        fixed, per_ctx = eng.lat.decode_coeffs(b)
        alpha = fixed + per_ctx * (eng.sum_ctx + b * eng.iters)
        beta = per_ctx * b
        eng.plan = [self.now, float(eng.iters), float(k), alpha, beta]
        self._schedule_step(eng, _STEP_DECODE, _run_duration(alpha, beta, k))

    # -- completions ----------------------------------------------------------------------------------
    def _join(self, eng: _Engine, rid: int) -> None:
        self.join_iter[rid] = eng.iters
        eng.sum_ctx += self.prompt[rid] + 1 - eng.iters
        heapq.heappush(eng.heap, (eng.iters + self.output[rid] - 1, rid))
        if eng.role == _DECODE:
            self.decode_wait[rid] = self.now - self.first_token[rid] - self.transfer[rid]

    def _retire(self, eng: _Engine) -> bool:
        heap = eng.heap
        freed = False
        while heap and heap[0][0] <= eng.iters:
            _, rid = heapq.heappop(heap)
            eng.sum_ctx -= self.prompt[rid] + 1 - self.join_iter[rid]
            eng.kv_used -= self.prompt[rid] + self.output[rid]
            self.finish[rid] = self.now
            freed = True
        return freed

    def _prefilled(self, eng: _Engine, rid: int) -> None:
        """``rid`` has its first token now."""
        self.first_token[rid] = self.now
        if self.cache is not None and self.blocks is not None:
            new_blocks = self.cache.insert(self.blocks[rid])
            self.cache_write_bytes += (
                min(new_blocks * self.cache_block_tokens, self.prompt[rid]) * self.kv_bpt
            )
        if eng.role == _PREFILL:
            if self.output[rid] == 1:
                eng.kv_used -= self.prompt[rid]
                self.finish[rid] = self.now
                return
            self.p_engine[rid] = eng.idx
            self.pending_decode.append(rid)
            return
        if self.output[rid] == 1:
            eng.kv_used -= self.prompt[rid] + 1
            self.finish[rid] = self.now
            return
        self._join(eng, rid)

    def _step_done(self, eng: _Engine) -> None:
        kind = eng.step_kind
        if kind == _STEP_PREFILL:
            for rid, _ in eng.step_items:
                self._prefilled(eng, rid)
            if eng.role == _PREFILL:
                self._dispatch_decodes()
        elif kind == _STEP_MIXED:
            if eng.step_b:
                eng.iters += 1
                self._retire(eng)
            for rid, take in eng.step_items:
                self.progress[rid] += take
                if self.progress[rid] >= self.target[rid]:
                    eng.prefilling.remove(rid)
                    self._prefilled(eng, rid)
        elif kind == _STEP_DECODE:
            eng.busy_decode_s += self.now - eng.plan[0]
            eng.iters = int(eng.plan[1]) + int(eng.plan[2])
            if self._retire(eng) and eng.role == _DECODE:
                self._dispatch_decodes()
        else:
            raise InvariantViolation(f"step completion on idle lane {eng.idx}")
        eng.step_kind = _IDLE
        self._plan(eng)

    # -- disaggregation: decode placement and KV transfer ---------------------------------------------
    def _dispatch_decodes(self) -> None:
        pending = self.pending_decode
        while pending:
            rid = pending[0]
            need = self.prompt[rid] + self.output[rid]
            best: _Engine | None = None
            best_free = -1
            fits_anywhere = False
            for eng in self.back:
                if need <= eng.kv_cap:
                    fits_anywhere = True
                free = eng.kv_cap - eng.kv_used
                if free >= need and free > best_free:
                    best, best_free = eng, free
            if not fits_anywhere:
                pending.popleft()
                self.rejected[rid] = True
                self._free_prefill(rid)
                continue
            if best is None:
                return
            pending.popleft()
            best.kv_used += need
            self._start_transfer(rid, self.engines[self.p_engine[rid]], best)

    def _start_transfer(self, rid: int, src: _Engine, dst: _Engine) -> None:
        size = self.prompt[rid] * self.kv_bpt
        self.kv_transfer_bytes += size
        duration = self.link.setup_s + size / (
            self.link.bandwidth_bytes_per_s * min(src.gpus, dst.gpus)
        )
        now = self.now
        if self.layerwise and self.first_token[rid] == now:
            start = max(src.link_free, self.prefill_start[rid])
            done = max(start + duration, now + duration / self.layers)
        else:
            start = max(src.link_free, now)
            done = start + duration
        src.link_free = done
        # Exposed transfer: from the decode side's admission (the prefill's end when there was room) to
        # the last byte. Waiting for decode memory before that is decode wait, not transfer.
        self.transfer[rid] = done - now
        self._push(done, _EV_TRANSFER, rid, dst.idx)

    def _free_prefill(self, rid: int) -> None:
        src = self.engines[self.p_engine[rid]]
        src.kv_used -= self.prompt[rid]
        if src.step_kind == _IDLE:
            self._plan(src)

    def _transfer_done(self, rid: int, dst: _Engine) -> None:
        self._free_prefill(rid)
        dst.ready_q.append(rid)
        self._poke(dst)

    # -- results --------------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        cluster, dep = self.cluster, self.dep
        finish = np.array(self.finish)
        rejected = np.array(self.rejected, dtype=bool)
        unfinished = ~np.isfinite(finish) & ~rejected
        if unfinished.any():
            raise InvariantViolation(
                f"{int(unfinished.sum())} requests neither finished nor were rejected"
            )
        makespan = float(np.nanmax(finish)) if np.isfinite(finish).any() else 0.0
        prefill_gpu_s = sum(e.busy_prefill_s * e.gpus for e in self.engines)
        decode_gpu_s = sum(e.busy_decode_s * e.gpus for e in self.engines)
        gpus = dep.gpus
        gpu = cluster.gpu
        energy = (
            gpus * gpu.idle_w * makespan
            + (gpu.prefill_w - gpu.idle_w) * prefill_gpu_s
            + (gpu.decode_w - gpu.idle_w) * decode_gpu_s
        )
        weights = cluster.model.weight_bytes(cluster.weight_dtype)
        return SimResult(
            workload=self.wl.name,
            deployment=dep.label,
            gpus=gpus,
            arrival_s=np.array(self.arrival),
            prefill_start_s=np.array(self.prefill_start),
            first_token_s=np.array(self.first_token),
            finish_s=finish,
            transfer_s=np.array(self.transfer),
            decode_wait_s=np.array(self.decode_wait),
            prompt_tokens=np.array(self.prompt),
            output_tokens=np.array(self.output),
            cached_tokens=np.array(self.cached),
            rejected=rejected,
            makespan_s=makespan,
            prefill_busy_gpu_s=prefill_gpu_s,
            decode_busy_gpu_s=decode_gpu_s,
            kv_transfer_bytes=self.kv_transfer_bytes,
            cache_load_bytes=self.cache_load_bytes,
            cache_write_bytes=self.cache_write_bytes,
            cache_hit_rate=self.cache.hit_rate if self.cache is not None else 0.0,
            weight_bytes_total=weights * dep.instances,
            weight_bytes_duplicated=weights * (dep.instances - 1),
            hbm_bytes_total=gpu.memory_bytes * gpus,
            energy_j=energy,
            power_model=(
                f"{gpu.name}: idle {gpu.idle_w:.0f} W, prefill {gpu.prefill_w:.0f} W, "
                f"decode {gpu.decode_w:.0f} W per GPU while busy"
            ),
        )


def simulate(cluster: ClusterSpec, deployment: Deployment, workload: Workload) -> SimResult:
    """Replay ``workload`` on ``deployment``; deterministic for a given input."""
    return _Simulation(cluster, deployment, workload).run()

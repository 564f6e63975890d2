"""KV-aware scheduling: which prefill and decode instances run a request, and what it reuses.

The baseline is the Mooncake conductor (FAST'25, Algorithm 1). For each
prefill instance the scheduler estimates the time to first token

    TTFT = T_queue + T_transfer + max(T_prefill, T_load)

* ``T_queue``: the work already queued on the instance: the sum of the
  estimated durations of the requests it was given and has not finished,
  re-anchored at every completion report (``queue drains at now + remaining
  work``), so one late request delays the estimate of those behind it once;
  never less than the work queued behind the oldest unfinished request
  (``_queue_at``). Ties go to the instance with fewer requests waiting.
* ``T_prefill``: ``factor(instance) * latency_model.prefill_s(uncached,
  reused)``: the latency model of :mod:`conductor.perf.latency`, corrected
  per instance by a moving average of measured/modelled times
  (:class:`~conductor.calibration.SpeedCalibration`).
* ``T_load``: reading the reused blocks of the instance's own node into the
  GPU, per tier (HBM free, DRAM over PCIe, NVMe at disk speed). Layer-wise
  prefill overlaps it with compute (Mooncake section 5.2), hence the max.
* ``T_transfer``: blocks fetched from another node: bytes over the link's
  calibrated bandwidth (:class:`~conductor.calibration.LinkCalibration`), plus
  the wait behind transfers already scheduled out of the same source node.

An engine's own prefix cache (vLLM's, learned from its KV events:
:mod:`conductor.engine_index`) is passed per decision as ``engine_cached_tokens``: those
leading tokens cost the instance nothing (they are in its GPU memory already), so the tokens
it reuses are the larger of its own cached prefix and its node's; store blocks it already
holds are not loaded again.
The instance holding the most of the prompt in its own cache keeps the request, when no
more of our requests wait there, unless another is predicted faster by more than
``cache_affinity_margin`` (25%): like engines' speed factors differ by noise, and a store
load costs a real engine more than the model's bytes over PCIe.

Policies (:class:`Policy`), compared by ``kvtier bench schedule``:

* ``RANDOM``: any prefill instance; the engine still reuses its node's prefix.
* ``LOAD``: the instance with the least queued work.
* ``LOCAL_CACHE``: the lowest TTFT reusing only the instance's own node.
* ``GLOBAL_CACHE`` (Mooncake's KVCache-centric scheduling): also consider
  fetching the longest prefix any node holds, from that node, when
  ``best / local >= kvcache_balancing_threshold``. Algorithm 1 then always
  fetches; here the fetch is taken only when its TTFT is lower than local
  reuse (with a threshold of 1 this is a pure cost comparison).

Decode: the instance with the lowest predicted time per output token at the
moment the request will reach it (``now + TTFT``): requests predicted to have
finished by then are not counted, requests admitted but still prefilling are.
Predicting the load at arrival, instead of reading it now, is what keeps
prefill-side and decode-side rejections from oscillating (Mooncake section
7.4): an admitted burst is seen by the decode check before it lands.

Colocated engines: one instance that runs both phases (a vLLM serving requests end to end,
the usual deployment) is registered with :meth:`Scheduler.add_colocated_instance` under one id
in both roles. A decision that picks it for prefill decodes on it too (no KV moves between the
phases: ``decode_instance == prefill_instance``); a colocated instance without KV room for the
request is not a prefill candidate. Requests prefilled on a prefill-only instance decode on a
decode-only one (a colocated instance only when the model has none).

Early rejection: when ``ttft_slo_s`` or ``tpot_slo_s`` is set and the best
estimate misses it, or no decode instance has KV room, the decision says so
(``accepted=False`` with a :class:`RejectReason` and a message) and nothing is
reserved. A rejection is an answer, not an exception; malformed requests and
unknown models raise :class:`~kvstore.errors.InvalidArgument`.

Hot prefixes: when ``GLOBAL_CACHE`` fetches the same prefix from a remote node
``hot_prefix_fetches`` times, the decision carries a :class:`ReplicationHint`
to copy it to the least-loaded nodes that lack it (the fetch itself already
leaves a copy on the chosen node, as in Mooncake).

Feedback: the caller reports completions (:meth:`Scheduler.prefill_done`, or
:meth:`Scheduler.first_token` from a caller that sees only a request's first token,
:meth:`Scheduler.decode_done`) with measured times; these calibrate the
estimators and correct the queue predictions. Time is the caller's clock,
passed in as ``now_s`` (seconds, monotonic).

Thread safety: none. One owner (the conductor's event loop, or the replay)
drives a scheduler; the prefix index it reads is thread-safe on its own.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

from conductor.calibration import LinkCalibration, MeanEstimate, SpeedCalibration
from conductor.index import GlobalMatch, GlobalPrefixIndex, TierCounts
from conductor.perf.latency import LatencyModel
from kvstore.errors import InvalidArgument, InvariantViolation
from kvstore.security.tenancy import DEFAULT_TENANT

__all__ = [
    "Decision",
    "DecodeInstance",
    "FetchPlan",
    "Policy",
    "PrefillInstance",
    "RejectReason",
    "ReplicationHint",
    "ScheduleRequest",
    "Scheduler",
    "SchedulerConfig",
    "TtftEstimate",
]

_HOT_COUNTER_LIMIT = 1 << 16
_PREFILL_MEMO_LIMIT = 1 << 16


class Policy(enum.Enum):
    RANDOM = "random"
    LOAD = "load"
    LOCAL_CACHE = "local-cache"
    GLOBAL_CACHE = "global-cache"


class RejectReason(enum.Enum):
    TTFT_SLO = "ttft_slo"
    """The lowest estimated TTFT over all prefill instances exceeds the TTFT target."""
    TPOT_SLO = "tpot_slo"
    """The lowest predicted time per output token over all decode instances exceeds the target."""
    DECODE_KV_FULL = "decode_kv_full"
    """No decode instance has room for the request's KV cache."""


def _check_number(name: str, value: object, *, low: float = 0.0, strict: bool = True,
                  allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidArgument(f"{name} must be a finite number, got {value!r}")
    if (strict and not value > low) or (not strict and not value >= low):
        raise InvalidArgument(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")


def _check_id(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name} must be a non-empty str, got {value!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Everything that shapes decisions. Bandwidths in bytes per second, times in seconds."""

    policy: Policy
    block_size_tokens: int
    block_size_bytes: int
    """KV bytes of one block (all layers): what a fetch moves per block."""
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    kvcache_balancing_threshold: float = 1.0
    """GLOBAL_CACHE considers a fetch when ``best / local >= threshold`` (local 0: always)."""
    cache_affinity_margin: float = 0.25
    """A request goes to the instance holding the most of its prompt in its own cache (engine
    KV events), when no more of our requests wait there for a first token, unless another is
    predicted faster by more than this fraction of the best predicted TTFT; 0: the lowest
    prediction wins outright. Two like engines' speed factors,
    learned from a few noisy first tokens, differ by more than the compute a cached prefix
    saves them, and the store load the model hides under compute costs a real engine a lookup
    and a scheduler step more (docs/conductor.md)."""
    remote_link_bytes_per_s: float = 45e9
    """Nominal node-to-node bandwidth before calibration (400 Gb/s RoCE, ~45 GB/s effective)."""
    dram_read_bytes_per_s: float = 64e9
    """Host DRAM to GPU (PCIe Gen5 x16)."""
    nvme_read_bytes_per_s: float = 6e9
    hot_prefix_fetches: int = 0
    """Remote fetches of one prefix that make it hot (a replication hint); 0: never."""
    replication_fanout: int = 1
    initial_output_tokens: float = 256.0
    """Expected output length before any request has finished (then a moving average)."""
    seed: int = 0
    """Seeds the RANDOM policy."""
    report_prompt_tokens: int = 8192
    """Queued prefill tokens in an engine's load report are priced as prompts of this many
    tokens (``Q / n`` prompts of ``n``): a queue is many prompts, and pricing it as one long
    prompt would charge attention quadratically over unrelated requests."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise InvalidArgument(f"policy must be a Policy, got {self.policy!r}")
        for name in ("block_size_tokens", "block_size_bytes", "replication_fanout",
                     "report_prompt_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"{name} must be a positive int, got {value!r}")
        if (isinstance(self.hot_prefix_fetches, bool) or not isinstance(self.hot_prefix_fetches, int)
                or self.hot_prefix_fetches < 0):
            raise InvalidArgument(
                f"hot_prefix_fetches must be a non-negative int, got {self.hot_prefix_fetches!r}")
        _check_number("ttft_slo_s", self.ttft_slo_s, allow_none=True)
        _check_number("tpot_slo_s", self.tpot_slo_s, allow_none=True)
        _check_number("kvcache_balancing_threshold", self.kvcache_balancing_threshold,
                      low=1.0, strict=False)
        _check_number("cache_affinity_margin", self.cache_affinity_margin, low=0.0,
                      strict=False)
        for name in ("remote_link_bytes_per_s", "dram_read_bytes_per_s", "nvme_read_bytes_per_s",
                     "initial_output_tokens"):
            _check_number(name, getattr(self, name))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidArgument(f"seed must be an int, got {self.seed!r}")


@dataclass(frozen=True, slots=True)
class PrefillInstance:
    """A prefill engine. ``node_id`` is the store node on its host (its local cache)."""

    instance_id: str
    node_id: str
    model: str

    def __post_init__(self) -> None:
        for name in ("instance_id", "node_id", "model"):
            _check_id(name, getattr(self, name))


@dataclass(frozen=True, slots=True)
class DecodeInstance:
    """A decode engine with room for ``kv_capacity_tokens`` tokens of KV cache."""

    instance_id: str
    node_id: str
    model: str
    kv_capacity_tokens: int

    def __post_init__(self) -> None:
        for name in ("instance_id", "node_id", "model"):
            _check_id(name, getattr(self, name))
        if (isinstance(self.kv_capacity_tokens, bool) or not isinstance(self.kv_capacity_tokens, int)
                or self.kv_capacity_tokens <= 0):
            raise InvalidArgument(
                f"kv_capacity_tokens must be a positive int, got {self.kv_capacity_tokens!r}")


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    """One request to place: its chained block keys (one per block, in order) and length.

    ``keys`` may cover a trailing partial block (as the Mooncake traces do) but
    never more blocks than ``input_tokens`` fill.
    """

    request_id: str
    model: str
    keys: tuple[bytes, ...]
    input_tokens: int
    expected_output_tokens: int | None = None
    """The caller's expectation of the output length (None: the scheduler's moving average).
    Sizes the decode KV reservation and the predicted decode end."""
    tenant: str | None = DEFAULT_TENANT
    """Whose chunks the prefix match may use (``GlobalPrefixIndex.match``; None: every
    tenant's). The conductor's service resolves it from the caller's credentials."""

    def __post_init__(self) -> None:
        _check_id("request_id", self.request_id)
        _check_id("model", self.model)
        if not isinstance(self.keys, tuple):
            raise InvalidArgument(f"keys must be a tuple of bytes, got {type(self.keys).__name__}")
        for key in self.keys:
            if not isinstance(key, bytes) or not key:
                raise InvalidArgument(f"keys must be non-empty bytes, got {key!r}")
        if (isinstance(self.input_tokens, bool) or not isinstance(self.input_tokens, int)
                or self.input_tokens <= 0):
            raise InvalidArgument(f"input_tokens must be a positive int, got {self.input_tokens!r}")
        out = self.expected_output_tokens
        if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out <= 0):
            raise InvalidArgument(
                f"expected_output_tokens must be a positive int or None, got {out!r}")


@dataclass(frozen=True, slots=True)
class TtftEstimate:
    """The parts of one TTFT estimate, in seconds. ``total_s = queue + transfer + max(prefill, load)``."""

    queue_s: float
    transfer_s: float
    prefill_s: float
    load_s: float

    @property
    def total_s(self) -> float:
        return self.queue_s + self.transfer_s + max(self.prefill_s, self.load_s)


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """Load blocks ``[first_block, end_block)`` of the request from ``src_node`` into ``dst_node``."""

    src_node: str
    dst_node: str
    first_block: int
    end_block: int
    size_bytes: int

    @property
    def blocks(self) -> int:
        return self.end_block - self.first_block


@dataclass(frozen=True, slots=True)
class ReplicationHint:
    """Copy the request's first ``blocks`` blocks from ``src_node`` to each of ``dst_nodes``."""

    src_node: str
    dst_nodes: tuple[str, ...]
    blocks: int


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request runs, or why it does not.

    Accepted: ``prefill_instance``/``decode_instance`` name the instances;
    ``prefix_blocks`` leading blocks are reused, ``local_blocks`` of them from
    the prefill instance's own node (``local_tiers`` says from which tiers) and
    the rest by ``fetch``. ``ticket`` identifies the request in completion
    reports. Rejected: ``reason`` and ``message`` say why; the estimates that
    led there are filled in where they were computed.
    """

    request_id: str
    accepted: bool
    reason: RejectReason | None = None
    message: str = ""
    prefill_instance: str | None = None
    prefill_node: str | None = None
    decode_instance: str | None = None
    prefix_blocks: int = 0
    local_blocks: int = 0
    local_tiers: TierCounts = field(default_factory=TierCounts)
    fetch: FetchPlan | None = None
    replicate: ReplicationHint | None = None
    ttft: TtftEstimate | None = None
    tpot_s: float | None = None
    ticket: int = 0
    engine_cached_tokens: int = 0
    """Leading prompt tokens the prefill instance holds in its own prefix cache (counted in
    the reuse; 0 when unknown)."""

    @property
    def estimated_ttft_s(self) -> float | None:
        return None if self.ttft is None else self.ttft.total_s


class _PrefillState:
    __slots__ = ("anchored_at_s", "busy_until_s", "instance", "outstanding", "pending_work_s",
                 "queued")

    def __init__(self, instance: PrefillInstance) -> None:
        self.instance = instance
        self.busy_until_s = 0.0
        """When the queue is predicted to drain."""
        self.outstanding = 0
        self.pending_work_s = 0.0
        """Estimated durations of the outstanding requests, summed."""
        self.queued: dict[int, _Ticket] = {}
        """Tickets given to this instance whose prefill has not been reported done."""
        self.anchored_at_s = -math.inf
        """When ``busy_until_s`` was last re-anchored on news from the engine (a completion or
        a load report); an older load report is stale and ignored."""


class _DecodeReport:
    """The latest load report of a decode engine, and what the scheduler itself had placed
    on that engine by then (tickets prefilled at or before ``at_s`` and outstanding when the
    report came, plus any reported prefilled later with an earlier time)."""

    __slots__ = ("at_s", "batch", "kv_tokens", "own_batch", "own_context_tokens", "own_kv_tokens")

    def __init__(self, at_s: float, batch: int, kv_tokens: int) -> None:
        self.at_s = at_s
        self.batch = batch
        self.kv_tokens = kv_tokens
        self.own_batch = 0
        self.own_context_tokens = 0
        self.own_kv_tokens = 0

    def count(self, tk: _Ticket, sign: int) -> None:
        self.own_batch += sign
        self.own_context_tokens += sign * (tk.new_tokens + tk.prior_tokens)
        self.own_kv_tokens += sign * tk.kv_tokens

    def covers(self, tk: _Ticket) -> bool:
        """Whether the engine already held ``tk`` when it reported."""
        return tk.prefilled_at_s is not None and tk.prefilled_at_s <= self.at_s


class _DecodeState:
    __slots__ = ("context_tokens", "ends", "instance", "kv_used_tokens", "report", "tickets")

    def __init__(self, instance: DecodeInstance) -> None:
        self.instance = instance
        self.ends: list[float] = []
        """Predicted finish times of the requests assigned here, sorted."""
        self.context_tokens = 0
        self.kv_used_tokens = 0
        """KV reserved by the outstanding requests assigned here (input + expected output)."""
        self.tickets: dict[int, _Ticket] = {}
        self.report: _DecodeReport | None = None

    def unknown_kv_tokens(self) -> int:
        """KV the engine reported in use beyond what our own tickets there reserve (requests
        another leader placed, or a reservation too small): never negative."""
        r = self.report
        return 0 if r is None else max(0, r.kv_tokens - r.own_kv_tokens)

    def kv_committed_tokens(self) -> int:
        return self.kv_used_tokens + self.unknown_kv_tokens()


class _Ticket:
    __slots__ = ("alone", "decided_at_s", "decode_end_s", "decode_id", "fetch", "kv_tokens",
                 "new_tokens", "prefill_id", "prefill_work_s", "prefilled", "prefilled_at_s",
                 "prior_tokens", "request_id", "tpot_s")

    def __init__(self, request_id: str, prefill_id: str, decode_id: str, prefill_work_s: float,
                 new_tokens: int, prior_tokens: int, fetch: FetchPlan | None, decode_end_s: float,
                 kv_tokens: int, tpot_s: float, decided_at_s: float) -> None:
        self.request_id = request_id
        self.prefill_id = prefill_id
        self.decode_id = decode_id
        self.prefill_work_s = prefill_work_s
        self.new_tokens = new_tokens
        self.prior_tokens = prior_tokens
        self.fetch = fetch
        self.decode_end_s = decode_end_s
        self.kv_tokens = kv_tokens
        self.tpot_s = tpot_s
        self.prefilled = False
        self.decided_at_s = decided_at_s
        self.prefilled_at_s: float | None = None
        self.alone = False
        """Nothing else of ours waited to prefill on its instance when it was decided: the
        time from the decision to its first token is its own prefill (:meth:`Scheduler.
        first_token`)."""


@dataclass(frozen=True, slots=True)
class _Option:
    """One way to run the request on one prefill instance."""

    state: _PrefillState
    ttft: TtftEstimate
    local_blocks: int
    local_tiers: TierCounts
    prefix_blocks: int
    fetch: FetchPlan | None
    new_tokens: int
    prior_tokens: int
    engine_cached_tokens: int = 0



class Scheduler:
    """Places requests on prefill and decode instances. See the module docstring.

    ``latency`` is the model of one prefill/decode instance (all instances run
    the same model and parallelism; per-instance differences are calibrated).
    The constructor builds in-memory state only.
    """

    def __init__(self, index: GlobalPrefixIndex, latency: LatencyModel, config: SchedulerConfig,
                 *, prefill_speed: SpeedCalibration | None = None,
                 decode_speed: SpeedCalibration | None = None,
                 links: LinkCalibration | None = None) -> None:
        if not isinstance(config, SchedulerConfig):
            raise InvalidArgument(f"config must be a SchedulerConfig, got {config!r}")
        self._index = index
        self._latency = latency
        self._config = config
        self.prefill_speed = prefill_speed or SpeedCalibration()
        self.decode_speed = decode_speed or SpeedCalibration()
        self.links = links or LinkCalibration(config.remote_link_bytes_per_s)
        self.output_tokens = MeanEstimate(config.initial_output_tokens)
        self._rng = random.Random(config.seed)
        self._prefill: dict[str, _PrefillState] = {}
        self._decode: dict[str, _DecodeState] = {}
        self._prefill_by_model: dict[str, list[_PrefillState]] = {}
        self._decode_by_model: dict[str, list[_DecodeState]] = {}
        self._colocated: set[str] = set()
        """Instances registered in both roles (one engine runs prefill and decode)."""
        self._src_busy_until: dict[str, float] = {}
        """Per source node: when the transfers already scheduled out of it end."""
        self._tickets: dict[int, _Ticket] = {}
        self._ticket_ids = itertools.count(1)
        self._fetch_counts: dict[bytes, int] = {}
        self._decode_coeffs: dict[int, tuple[float, float]] = {}
        self._prefill_model_s: dict[tuple[int, int], float] = {}
        """The latency model's prefill seconds by (tokens computed, tokens reused): it is pure,
        and the same pairs recur (a prompt length with nothing cached, a conversation's
        turns), so a decision mostly reads it instead of the model (~10 us a call here)."""
        self.accepted = 0
        self.rejected: dict[RejectReason, int] = dict.fromkeys(RejectReason, 0)

    @property
    def config(self) -> SchedulerConfig:
        return self._config

    # -- instances ---------------------------------------------------------------

    def add_prefill_instance(self, instance: PrefillInstance) -> None:
        """Register a prefill instance (raises InvalidArgument if the id is taken)."""
        if not isinstance(instance, PrefillInstance):
            raise InvalidArgument(f"expected a PrefillInstance, got {instance!r}")
        if instance.instance_id in self._prefill or instance.instance_id in self._decode:
            raise InvalidArgument(f"instance {instance.instance_id} is already registered")
        st = _PrefillState(instance)
        self._prefill[instance.instance_id] = st
        group = self._prefill_by_model.setdefault(instance.model, [])
        group.append(st)
        group.sort(key=lambda s: s.instance.instance_id)

    def add_decode_instance(self, instance: DecodeInstance) -> None:
        """Register a decode instance (raises InvalidArgument if the id is taken)."""
        if not isinstance(instance, DecodeInstance):
            raise InvalidArgument(f"expected a DecodeInstance, got {instance!r}")
        if instance.instance_id in self._prefill or instance.instance_id in self._decode:
            raise InvalidArgument(f"instance {instance.instance_id} is already registered")
        self._add_decode_state(instance)

    def add_colocated_instance(self, instance: PrefillInstance, kv_capacity_tokens: int) -> None:
        """Register one engine that runs both phases of its requests (prefill and decode in one
        instance, e.g. a vLLM serving requests end to end), with room for
        ``kv_capacity_tokens`` tokens of KV while decoding. It is a prefill and a decode
        instance under the same id: decisions that prefill on it decode on it (see the module
        docstring). Raises InvalidArgument if the id is taken or the capacity is bad."""
        if not isinstance(instance, PrefillInstance):
            raise InvalidArgument(f"expected a PrefillInstance, got {instance!r}")
        decode = DecodeInstance(instance.instance_id, instance.node_id, instance.model,
                                kv_capacity_tokens)  # validates the capacity first
        self.add_prefill_instance(instance)  # raises if the id is taken in either role
        self._add_decode_state(decode)
        self._colocated.add(instance.instance_id)

    def is_colocated(self, instance_id: str) -> bool:
        """Whether ``instance_id`` runs both phases (:meth:`add_colocated_instance`)."""
        return instance_id in self._colocated

    def _add_decode_state(self, instance: DecodeInstance) -> None:
        st = _DecodeState(instance)
        self._decode[instance.instance_id] = st
        group = self._decode_by_model.setdefault(instance.model, [])
        group.append(st)
        group.sort(key=lambda s: s.instance.instance_id)

    def remove_instance(self, instance_id: str) -> bool:
        """Forget an instance (it died or left); its outstanding tickets are dropped."""
        st_p = self._prefill.pop(instance_id, None)
        st_d = self._decode.pop(instance_id, None)
        if st_p is not None:
            self._prefill_by_model[st_p.instance.model].remove(st_p)
            self.prefill_speed.forget(instance_id)
        if st_d is not None:
            self._decode_by_model[st_d.instance.model].remove(st_d)
            self.decode_speed.forget(instance_id)
        self._colocated.discard(instance_id)
        if st_p is None and st_d is None:
            return False
        for ticket_id in [t for t, tk in self._tickets.items()
                          if instance_id in (tk.prefill_id, tk.decode_id)]:
            self.cancel(ticket_id)
        return True

    def queue_s(self, instance_id: str, now_s: float) -> float:
        """Predicted seconds of work queued on a prefill instance."""
        st = self._prefill.get(instance_id)
        if st is None:
            raise InvalidArgument(f"unknown prefill instance {instance_id!r}")
        return max(0.0, st.busy_until_s - now_s)

    # -- scheduling --------------------------------------------------------------

    def schedule(self, request: ScheduleRequest, now_s: float,
                 engine_cached_tokens: Mapping[str, int] | None = None) -> Decision:
        """Decide where ``request`` runs. Accepted decisions reserve queue, link and KV room.

        ``engine_cached_tokens``: per prefill instance, the leading prompt tokens it holds in
        its own prefix cache (free to reuse; instances not named hold none).

        Raises InvalidArgument for a malformed request or a model no registered
        prefill or decode instance serves.
        """
        if not isinstance(request, ScheduleRequest):
            raise InvalidArgument(f"expected a ScheduleRequest, got {type(request).__name__}")
        _check_number("now_s", now_s, low=0.0, strict=False)
        cfg = self._config
        block = cfg.block_size_tokens
        if len(request.keys) > -(-request.input_tokens // block):
            raise InvalidArgument(
                f"request {request.request_id}: {len(request.keys)} block keys for "
                f"{request.input_tokens} tokens at {block} tokens per block")
        prefills = self._prefill_by_model.get(request.model)
        decodes = self._decode_by_model.get(request.model)
        if not prefills or not decodes:
            served = sorted(m for m in self._prefill_by_model if self._prefill_by_model[m])
            raise InvalidArgument(
                f"no {'prefill' if not prefills else 'decode'} instance serves model "
                f"{request.model!r} (prefill instances serve: {', '.join(served) or 'nothing'})")

        out_tokens = (float(request.expected_output_tokens) if request.expected_output_tokens
                      else self.output_tokens.value)
        kv_tokens = request.input_tokens + math.ceil(out_tokens)
        rid = request.request_id
        match = self._index.match(request.keys, request.tenant)
        engine_cached = engine_cached_tokens or {}
        pool = prefills
        if self._colocated:  # a colocated engine decodes what it prefills: it needs the room
            pool = [st for st in prefills if st.instance.instance_id not in self._colocated
                    or self._has_room(self._decode[st.instance.instance_id], kv_tokens)]
            if not pool:
                option = self._choose_prefill(request, match, prefills, now_s, engine_cached)
                return self._reject(rid, RejectReason.DECODE_KV_FULL,
                                    f"no instance of {request.model!r} has room for "
                                    f"{kv_tokens} KV tokens", option, None)
        option = self._choose_prefill(request, match, pool, now_s, engine_cached)
        ttft = option.ttft

        if cfg.ttft_slo_s is not None and ttft.total_s > cfg.ttft_slo_s:
            return self._reject(rid, RejectReason.TTFT_SLO,
                                f"estimated TTFT {ttft.total_s:.3f} s > target {cfg.ttft_slo_s} s "
                                f"on prefill instance {option.state.instance.instance_id} "
                                f"({cfg.policy.value} policy)",
                                option, None)

        arrival_s = now_s + ttft.total_s
        chosen_id = option.state.instance.instance_id
        picked: tuple[_DecodeState, float] | None
        if chosen_id in self._colocated:  # the same engine decodes: no KV moves
            own = self._decode[chosen_id]
            picked = own, self._tpot_at(own, request.input_tokens, arrival_s)
        else:
            if self._colocated:  # prefill-only instances hand over to decode-only ones
                decodes = [d for d in decodes
                           if d.instance.instance_id not in self._colocated] or decodes
            picked = self._choose_decode(decodes, request.input_tokens, kv_tokens, arrival_s)
        if picked is None:
            return self._reject(rid, RejectReason.DECODE_KV_FULL,
                                f"no decode instance of {request.model!r} has room for "
                                f"{kv_tokens} KV tokens", option, None)
        dstate, tpot_s = picked
        if cfg.tpot_slo_s is not None and tpot_s > cfg.tpot_slo_s:
            return self._reject(rid, RejectReason.TPOT_SLO,
                                f"predicted TPOT {tpot_s * 1000:.1f} ms > target "
                                f"{cfg.tpot_slo_s * 1000:.1f} ms on the best decode instance "
                                f"{dstate.instance.instance_id}", option, tpot_s)

        # Accepted: reserve the prefill queue, the source link and the decode room.
        pst = option.state
        start_s = now_s + ttft.queue_s  # behind what is queued (see _queue_at)
        work_s = ttft.transfer_s + max(ttft.prefill_s, ttft.load_s)
        done_s = start_s + work_s
        pst.busy_until_s = done_s
        pst.outstanding += 1
        pst.pending_work_s += work_s
        if option.fetch is not None:
            self._reserve_link(option.fetch.src_node, start_s, option.fetch.size_bytes,
                               option.fetch.dst_node)
        decode_end_s = done_s + out_tokens * tpot_s
        bisect.insort(dstate.ends, decode_end_s)
        dstate.context_tokens += request.input_tokens
        dstate.kv_used_tokens += kv_tokens
        ticket = next(self._ticket_ids)
        tk = _Ticket(rid, pst.instance.instance_id, dstate.instance.instance_id, work_s,
                     option.new_tokens, option.prior_tokens, option.fetch, decode_end_s,
                     kv_tokens, tpot_s, now_s)
        tk.alone = not pst.queued
        self._tickets[ticket] = tk
        pst.queued[ticket] = tk
        dstate.tickets[ticket] = tk
        hint = self._replication_hint(request, match, option, prefills, now_s)
        self.accepted += 1
        return Decision(
            request_id=rid, accepted=True, prefill_instance=pst.instance.instance_id,
            prefill_node=pst.instance.node_id, decode_instance=dstate.instance.instance_id,
            prefix_blocks=option.prefix_blocks, local_blocks=option.local_blocks,
            local_tiers=option.local_tiers, fetch=option.fetch, replicate=hint, ttft=ttft,
            tpot_s=tpot_s, ticket=ticket, engine_cached_tokens=option.engine_cached_tokens)

    def _reject(self, request_id: str, reason: RejectReason, message: str, option: _Option,
                tpot_s: float | None) -> Decision:
        self.rejected[reason] += 1
        return Decision(request_id=request_id, accepted=False, reason=reason, message=message,
                        prefix_blocks=option.prefix_blocks, local_blocks=option.local_blocks,
                        ttft=option.ttft, tpot_s=tpot_s,
                        engine_cached_tokens=option.engine_cached_tokens)

    # -- the cost model --------------------------------------------------------------

    @staticmethod
    def _tokens_reused(input_tokens: int, reused_tokens: int) -> tuple[int, int]:
        """(tokens to compute, tokens reused) with ``reused_tokens`` leading tokens cached.

        At least one token is always computed (the engine needs its logits).
        """
        prior = min(reused_tokens, input_tokens - 1)
        return input_tokens - prior, prior

    def prefill_estimate_s(self, instance_id: str, new_tokens: int, prior_tokens: int) -> float:
        """Calibrated prefill compute time on one instance."""
        return self.prefill_speed.factor(instance_id) * self._latency.prefill_s(
            [new_tokens], [prior_tokens])

    def _load_s(self, tiers: TierCounts) -> float:
        cfg = self._config
        size = cfg.block_size_bytes
        return (tiers.dram * size / cfg.dram_read_bytes_per_s
                + tiers.nvme * size / cfg.nvme_read_bytes_per_s)

    def _transfer_s(self, src: str, dst: str, size_bytes: int, start_s: float) -> float:
        wait = max(0.0, self._src_busy_until.get(src, 0.0) - start_s)
        return wait + self.links.transfer_s(src, dst, size_bytes)

    def _reserve_link(self, src: str, start_s: float, size_bytes: int, dst: str) -> None:
        begin = max(start_s, self._src_busy_until.get(src, 0.0))
        self._src_busy_until[src] = begin + self.links.transfer_s(src, dst, size_bytes)

    def _fetch_source(self, match: GlobalMatch) -> tuple[str, int] | None:
        best = match.best_length
        if best == 0:
            return None
        nodes = match.best_nodes()
        if len(nodes) > 1:  # the least busy holder of the longest prefix
            nodes.sort(key=lambda n: (self._src_busy_until.get(n, 0.0), n))
        return nodes[0], best

    def _choose_prefill(self, request: ScheduleRequest, match: GlobalMatch,
                        prefills: list[_PrefillState], now_s: float,
                        engine_cached: Mapping[str, int]) -> _Option:
        # Candidates are ranked on plain floats and tuples; only the winner becomes an
        # _Option. The latency model is pure, so its answers are memoized (for this call:
        # instances on nodes with equal prefixes ask it the same question; and across calls,
        # bounded: _prefill_model_s).
        policy = self._config.policy
        if policy is Policy.RANDOM:
            pool = [prefills[self._rng.randrange(len(prefills))]]
        elif policy is Policy.LOAD:
            pool = [min(prefills, key=lambda s: (s.busy_until_s, s.instance.instance_id))]
        else:
            pool = prefills
        source = self._fetch_source(match) if policy is Policy.GLOBAL_CACHE else None
        threshold = self._config.kvcache_balancing_threshold
        input_tokens = request.input_tokens
        block = self._config.block_size_tokens
        block_bytes = self._config.block_size_bytes
        model_s: dict[int, float] = {}
        load_by_node: dict[str, float] = {}
        factor = self.prefill_speed.factor
        # Per instance: (rank, plan, tokens in its own cache); a plan is (instance, blocks
        # reused, fetch source or None, transfer, compute, load, tokens reused).
        options: list[tuple[tuple[float, float, int, float, str],
                            tuple[_PrefillState, int, str | None, float, float, float, int],
                            int]] = []
        for st in pool:
            node = st.instance.node_id
            local = match.length(node)
            own = min(engine_cached.get(st.instance.instance_id, 0), input_tokens)
            load_s = load_by_node.get(node)
            if load_s is None:
                load_s = self._load_s(match.tier_counts(node)) if local else 0.0
                load_by_node[node] = load_s
            if own and local:  # store blocks the engine holds itself are not loaded again
                load_s *= max(0, local * block - own) / (local * block)
            queue_s = self._queue_at(st, now_s)
            waiting = len(st.queued)
            speed = factor(st.instance.instance_id)
            # Option 1: reuse the local prefix (the engine's own cache, its node's) only.
            reused_tokens = max(local * block, own)
            compute_s = speed * self._model_prefill_s(input_tokens, reused_tokens, model_s)
            # Ties (load hidden under compute) go to the instance with fewer of our requests
            # still waiting for their first token, then to the one that moves fewer bytes: the
            # one holding the prefix in its own cache before one that loads it from its node.
            rank = (queue_s + max(compute_s, load_s), queue_s, waiting, load_s,
                    st.instance.instance_id)
            plan: tuple[_PrefillState, int, str | None, float, float, float, int] = (
                st, local, None, 0.0, compute_s, load_s, reused_tokens)
            # Option 2 (GLOBAL_CACHE): fetch the rest of the longest prefix from its holder.
            if source is not None:
                src, best_len = source
                if (src != node and best_len > local and best_len * block > own
                        and (local == 0 or best_len >= threshold * local)):
                    transfer_s = self._transfer_s(src, node, (best_len - local) * block_bytes,
                                                  now_s + queue_s)
                    fetch_tokens = best_len * block
                    fetch_compute_s = speed * self._model_prefill_s(input_tokens, fetch_tokens,
                                                                    model_s)
                    fetch_rank = (queue_s + transfer_s + max(fetch_compute_s, load_s), queue_s,
                                  waiting, transfer_s + load_s, st.instance.instance_id)
                    if fetch_rank < rank:
                        rank = fetch_rank
                        plan = (st, best_len, src, transfer_s, fetch_compute_s, load_s,
                                fetch_tokens)
            options.append((rank, plan, own))
        if not options:
            raise InvariantViolation("a model with prefill instances produced no option")
        best, best_plan, best_own = min(options, key=lambda o: o[0])
        # Cache affinity: an instance holding more of the prompt in its own cache, with no
        # more of our requests waiting for a first token, keeps the request unless another is
        # predicted faster by more than the margin (the speed factors of two like engines
        # differ by noise; the store load the model hides under compute is not free: see
        # SchedulerConfig.cache_affinity_margin).
        limit = best[0] * (1.0 + self._config.cache_affinity_margin)
        holders = [o for o in options
                   if o[2] > best_own and o[0][0] <= limit and o[0][2] <= best[2]]
        if holders:
            best, best_plan, _ = min(holders, key=lambda o: (-o[2], o[0]))
        st, reused, src_node, transfer_s, compute_s, load_s, reused_tokens = best_plan
        node = st.instance.node_id
        local = match.length(node)
        fetch = None
        if src_node is not None:
            fetch = FetchPlan(src_node, node, local, reused, (reused - local) * block_bytes)
        new_tokens, prior_tokens = self._tokens_reused(input_tokens, reused_tokens)
        ttft = TtftEstimate(best[1], transfer_s, compute_s, load_s)
        tiers = match.tier_counts(node) if local else TierCounts()
        own = min(engine_cached.get(st.instance.instance_id, 0), input_tokens)
        return _Option(st, ttft, local, tiers, reused, fetch, new_tokens, prior_tokens, own)

    @staticmethod
    def _queue_at(st: _PrefillState, now_s: float) -> float:
        """Predicted seconds before a request decided at ``now_s`` starts on ``st``: until the
        queue is predicted to drain, and never less than the work of the requests queued
        behind the oldest one still waiting for its first token. Those have not started (the
        queue is FIFO) whatever the prediction said; the oldest may be overdue, its engine
        slower than estimated, and is the one whose progress is unknown. Without this floor a
        queue predicted to drain read empty while two requests still prefilled there."""
        queue_s = st.busy_until_s - now_s
        if st.queued:
            oldest = next(iter(st.queued.values()))
            behind_s = st.pending_work_s - oldest.prefill_work_s
            if queue_s < behind_s:
                queue_s = behind_s
        return queue_s if queue_s > 0.0 else 0.0

    def _model_prefill_s(self, input_tokens: int, reused_tokens: int,
                         memo: dict[int, float]) -> float:
        """The latency model's prefill time with ``reused_tokens`` cached (memoized per call,
        and across calls in :attr:`_prefill_model_s`)."""
        cached = memo.get(reused_tokens)
        if cached is None:
            work = self._tokens_reused(input_tokens, reused_tokens)
            known = self._prefill_model_s
            cached = known.get(work)
            if cached is None:
                if len(known) >= _PREFILL_MEMO_LIMIT:
                    known.clear()  # crude, as the hot-prefix counters: the pairs come back
                cached = known[work] = self._latency.prefill_s([work[0]], [work[1]])
            memo[reused_tokens] = cached
        return cached

    def _choose_decode(self, decodes: list[_DecodeState], input_tokens: int, kv_tokens: int,
                       arrival_s: float) -> tuple[_DecodeState, float] | None:
        """The decode instance with the lowest predicted TPOT at ``arrival_s``, and that TPOT."""
        candidates = [d for d in decodes if self._has_room(d, kv_tokens)]
        if not candidates:
            return None
        if self._config.policy is Policy.RANDOM:
            d = candidates[self._rng.randrange(len(candidates))]
            return d, self._tpot_at(d, input_tokens, arrival_s)
        best: tuple[float, str, _DecodeState] | None = None
        for d in candidates:
            tpot = self._tpot_at(d, input_tokens, arrival_s)
            key = (tpot, d.instance.instance_id, d)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            raise InvariantViolation("decode candidates produced no choice")
        return best[2], best[0]

    @staticmethod
    def _has_room(d: _DecodeState, kv_tokens: int) -> bool:
        return d.kv_committed_tokens() + kv_tokens <= d.instance.kv_capacity_tokens

    def _tpot_at(self, d: _DecodeState, input_tokens: int, at_s: float) -> float:
        """Predicted time per output token on ``d`` at ``at_s`` with this request added.

        Requests predicted to have finished by ``at_s`` are left out; the context
        of those still running is prorated from the current total. With a load report,
        what the engine ran beyond our own requests on it when it reported (batch; KV in use
        taken as context, which includes their generated tokens) is added. A shortfall (it
        finished one of ours before we heard) is not subtracted: its decode completion
        report arrives shortly and corrects that, while a report cannot tell a request that
        finished before it from one that finished after.
        """
        active = len(d.ends)
        running = active - bisect.bisect_right(d.ends, at_s)
        context = d.context_tokens * running / active if active else 0.0
        r = d.report
        if r is not None:  # only what the engine has beyond ours: see report_load
            running += max(0, r.batch - r.own_batch)
            context += max(0, r.kv_tokens - r.own_context_tokens)
        context += input_tokens
        batch = running + 1
        coeffs = self._decode_coeffs.get(batch)
        if coeffs is None:  # pure in the batch size: memoized (bounded by the largest batch)
            coeffs = self._latency.decode_coeffs(batch)
            self._decode_coeffs[batch] = coeffs
        fixed_s, per_token_s = coeffs
        return self.decode_speed.factor(d.instance.instance_id) * (fixed_s + per_token_s * context)

    def _replication_hint(self, request: ScheduleRequest, match: GlobalMatch, option: _Option,
                          prefills: list[_PrefillState], now_s: float) -> ReplicationHint | None:
        threshold = self._config.hot_prefix_fetches
        fetch = option.fetch
        if fetch is None or threshold == 0:
            return None
        key = request.keys[fetch.end_block - 1]
        count = self._fetch_counts.get(key, 0) + 1
        if count < threshold:
            if len(self._fetch_counts) >= _HOT_COUNTER_LIMIT:
                self._fetch_counts.clear()  # crude aging: hot prefixes come back quickly
            self._fetch_counts[key] = count
            return None
        self._fetch_counts.pop(key, None)
        skip = {fetch.src_node, fetch.dst_node}
        targets: list[tuple[float, str]] = []
        seen: set[str] = set()
        for st in prefills:
            node = st.instance.node_id
            if node in skip or node in seen or match.length(node) >= fetch.end_block:
                continue
            seen.add(node)
            targets.append((max(0.0, st.busy_until_s - now_s), node))
        targets.sort()
        dst = tuple(node for _, node in targets[: self._config.replication_fanout])
        if not dst:
            return None
        for node in dst:
            size = (fetch.end_block - match.length(node)) * self._config.block_size_bytes
            self._reserve_link(fetch.src_node, now_s, size, node)
        return ReplicationHint(fetch.src_node, dst, fetch.end_block)

    # -- feedback ----------------------------------------------------------------

    def prefill_done(self, ticket: int, now_s: float, *, prefill_s: float,
                     computed_tokens: int | None = None, reused_tokens: int | None = None,
                     transfer_s: float | None = None, transferred_bytes: int = 0) -> None:
        """A prefill finished at ``now_s``: calibrate, and correct the instance's queue.

        ``prefill_s`` is the measured compute time; ``computed_tokens`` /
        ``reused_tokens`` the work actually done (default: as planned; they differ
        when a planned prefix was evicted meanwhile). ``transfer_s`` and
        ``transferred_bytes`` describe the fetch, if one ran.
        """
        _check_number("now_s", now_s, low=0.0, strict=False)
        _check_number("prefill_s", prefill_s)
        tk = self._unprefilled(ticket)
        new = tk.new_tokens if computed_tokens is None else computed_tokens
        prior = tk.prior_tokens if reused_tokens is None else reused_tokens
        self.prefill_speed.observe(tk.prefill_id, prefill_s,
                                   self._latency.prefill_s([new], [prior]))
        if tk.fetch is not None and transfer_s is not None and transferred_bytes > 0:
            self.links.observe(tk.fetch.src_node, tk.fetch.dst_node, transferred_bytes, transfer_s)
        self._prefilled(ticket, tk, now_s)

    def first_token(self, ticket: int, now_s: float) -> None:
        """The request's first token came out at ``now_s``: its prefill is over. For a caller
        that sees only whole requests (a front door: it relays the first token, and measures
        no compute time), in place of :meth:`prefill_done`.

        The instance's queue is re-anchored as by :meth:`prefill_done`. The speed is
        calibrated only from a request that had its instance's prefill queue to itself (none
        of our requests there was still waiting for its first token when it was decided):
        then ``now_s - decided at`` is its own prefill, as the engine ran it (a decode batch
        beside it, a kvtier load included), and the factor learns what the latency model
        does not know (other hardware, another model). A request decided behind others
        waited for them too: timing it would count their prefill as its own, so it only
        re-anchors the queue. Without this the factor stays 1, and on an engine 10-20x slower
        than the model every queue looks empty (bench/RESULTS.md, issue 14, session 13).
        """
        _check_number("now_s", now_s, low=0.0, strict=False)
        tk = self._unprefilled(ticket)
        measured_s = now_s - tk.decided_at_s
        if tk.alone and measured_s > 0:
            self.prefill_speed.observe(tk.prefill_id, measured_s, self._latency.prefill_s(
                [tk.new_tokens], [tk.prior_tokens]))
        self._prefilled(ticket, tk, now_s)

    def _unprefilled(self, ticket: int) -> _Ticket:
        tk = self._tickets.get(ticket)
        if tk is None:
            raise InvalidArgument(f"unknown ticket {ticket}")
        if tk.prefilled:
            raise InvalidArgument(f"ticket {ticket} already reported its prefill")
        return tk

    def _prefilled(self, ticket: int, tk: _Ticket, now_s: float) -> None:
        """Take a request whose prefill ended at ``now_s`` out of its queue, and re-predict
        its decode end from there."""
        tk.prefilled = True
        tk.prefilled_at_s = now_s
        st = self._prefill.get(tk.prefill_id)
        if st is not None:
            st.queued.pop(ticket, None)
            self._finish_prefill_work(st, tk, now_s)
        d = self._decode.get(tk.decode_id)
        if d is not None:  # re-predict the decode finish from the real prefill end
            if d.report is not None and d.report.covers(tk):  # a report from the future
                d.report.count(tk, +1)
            new_end = now_s + self.output_tokens.value * tk.tpot_s
            self._remove_end(d, tk.decode_end_s)
            bisect.insort(d.ends, new_end)
            tk.decode_end_s = new_end

    def decode_done(self, ticket: int, now_s: float, *, output_tokens: int,
                    tpot_s: float | None = None, batch_size: int | None = None,
                    context_tokens: int | None = None) -> None:
        """A request finished decoding: release its decode room and calibrate.

        ``tpot_s`` with ``batch_size`` and ``context_tokens`` (the decode batch it
        ran in) calibrate the decode instance's speed. A request whose prefill was never
        reported (an engine, or a front door, that only sees whole requests end) has
        prefilled by now: its prefill work leaves the queue estimate (no speed calibration).
        """
        _check_number("now_s", now_s, low=0.0, strict=False)
        tk = self._tickets.pop(ticket, None)
        if tk is None:
            raise InvalidArgument(f"unknown ticket {ticket}")
        if output_tokens > 0:
            self.output_tokens.observe(output_tokens)
        if not tk.prefilled:
            tk.prefilled = True
            st = self._prefill.get(tk.prefill_id)
            if st is not None and st.queued.pop(ticket, None) is not None:
                self._finish_prefill_work(st, tk, now_s)
        d = self._decode.get(tk.decode_id)
        if d is None:
            return
        self._release_decode(d, ticket, tk)
        if tpot_s is not None and batch_size is not None and context_tokens is not None:
            fixed_s, per_token_s = self._latency.decode_coeffs(batch_size)
            self.decode_speed.observe(tk.decode_id, tpot_s, fixed_s + per_token_s * context_tokens)

    def cancel(self, ticket: int) -> bool:
        """Release everything an accepted request reserved (it failed or was aborted)."""
        tk = self._tickets.pop(ticket, None)
        if tk is None:
            return False
        st = self._prefill.get(tk.prefill_id)
        if st is not None and not tk.prefilled:
            st.queued.pop(ticket, None)
            self._finish_prefill_work(st, tk, None)
        d = self._decode.get(tk.decode_id)
        if d is not None:
            self._release_decode(d, ticket, tk)
        return True

    @staticmethod
    def _finish_prefill_work(st: _PrefillState, tk: _Ticket, now_s: float | None) -> None:
        """Take a finished (``now_s``) or cancelled (None) request out of its queue estimate."""
        st.outstanding -= 1
        st.pending_work_s -= tk.prefill_work_s
        if st.outstanding <= 0 or st.pending_work_s < 0:
            st.outstanding = max(st.outstanding, 0)
            st.pending_work_s = 0.0
        if now_s is not None:  # what is left starts now (FIFO), whatever was predicted
            st.busy_until_s = now_s + st.pending_work_s
            st.anchored_at_s = max(st.anchored_at_s, now_s)
        else:  # cancelled while queued: the rest moves up by its estimate
            st.busy_until_s -= tk.prefill_work_s

    def _release_decode(self, d: _DecodeState, ticket: int, tk: _Ticket) -> None:
        # The report's own_* figures stay: if the engine still ran this request when it
        # reported, it is in the reported batch, and leaving it counted in own_* keeps the
        # difference (the requests we do not know of) right.
        d.tickets.pop(ticket, None)
        self._remove_end(d, tk.decode_end_s)
        input_tokens = tk.new_tokens + tk.prior_tokens
        d.context_tokens -= input_tokens
        d.kv_used_tokens -= tk.kv_tokens
        if d.context_tokens < 0 or d.kv_used_tokens < 0:
            raise InvariantViolation(f"decode instance {d.instance.instance_id} released more "
                                     "than it reserved")

    @staticmethod
    def _remove_end(d: _DecodeState, end_s: float) -> None:
        i = bisect.bisect_left(d.ends, end_s)
        if i >= len(d.ends) or d.ends[i] != end_s:
            raise InvariantViolation(f"decode instance {d.instance.instance_id} lost a request")
        del d.ends[i]

    # -- engine load reports ---------------------------------------------------------

    def report_load(self, instance_id: str, now_s: float, *, queued_prefill_tokens: int = 0,
                    running_decode_batch: int = 0, kv_used_tokens: int = 0) -> bool:
        """An engine's own account of its load at ``now_s``; False for an unknown instance.

        Prefill (``queued_prefill_tokens``: tokens waiting or being computed, i.e. the work
        the engine has not done yet): the queue estimate is re-anchored on it, trusting the
        report plus what was scheduled since: ``busy_until = now + calibrated time of the
        reported tokens + estimated work of our requests decided after now``. Those decided
        before the report are in the engine's figure (they reached it: a report races only
        with requests in flight between us and the engine). A report older than the last
        completion of the instance is stale and ignored (the completion is fresher news).
        The reported tokens are priced with the instance's calibrated speed as prompts of
        ``config.report_prompt_tokens`` (or one prompt, when fewer are queued).

        Decode (``running_decode_batch``, ``kv_used_tokens``): kept as the instance's latest
        report with our own requests on the engine at that time (those prefilled by then);
        the TPOT prediction adds what the engine runs beyond them (see ``_tpot_at``), and the
        KV room check counts KV the engine uses beyond our reservations (a report never lowers
        a reservation: running requests still grow). Requests another leader placed, or that
        this scheduler lost track of, become visible this way.

        A colocated instance's report is read both ways (one engine, both figures).
        """
        _check_number("now_s", now_s, low=0.0, strict=False)
        for name, value in (("queued_prefill_tokens", queued_prefill_tokens),
                            ("running_decode_batch", running_decode_batch),
                            ("kv_used_tokens", kv_used_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"{name} must be an int >= 0, got {value!r}")
        st = self._prefill.get(instance_id)
        if st is not None and now_s >= st.anchored_at_s:  # else stale: older than its news
            queue_s = 0.0
            if queued_prefill_tokens:
                prompt = min(queued_prefill_tokens, self._config.report_prompt_tokens)
                queue_s = (self.prefill_speed.factor(instance_id)
                           * self._latency.prefill_s([prompt], [0])
                           * queued_prefill_tokens / prompt)
            since_s = sum(tk.prefill_work_s for tk in st.queued.values()
                          if tk.decided_at_s > now_s)
            st.busy_until_s = now_s + queue_s + since_s
            st.anchored_at_s = now_s
        if st is not None and instance_id not in self._colocated:
            return True
        d = self._decode.get(instance_id)  # a colocated engine's report is both
        if d is None:
            return False
        if d.report is not None and now_s < d.report.at_s:
            return True  # an older report overtaken by a newer one
        report = _DecodeReport(now_s, running_decode_batch, kv_used_tokens)
        for tk in d.tickets.values():
            if report.covers(tk):
                report.count(tk, +1)
        d.report = report
        return True

    # -- introspection -------------------------------------------------------------

    def load(self, now_s: float) -> Mapping[str, float]:
        """Predicted queued prefill seconds per prefill instance."""
        return {i: max(0.0, st.busy_until_s - now_s) for i, st in sorted(self._prefill.items())}

    def outstanding(self) -> int:
        """Accepted requests not yet reported done (or cancelled)."""
        return len(self._tickets)

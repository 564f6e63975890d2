"""Latency models: how long one forward pass (one iteration) of a model instance takes.

The protocol
    A :class:`LatencyModel` answers for one instance at a fixed tensor-parallel degree. All methods are pure
    and thread-safe, and return seconds.

    * ``prefill_s(new_tokens, prior_tokens)``: one batch of prefills. ``new_tokens[i] > 0`` tokens of
      request ``i`` are computed now; ``prior_tokens[i] >= 0`` of its tokens are already in the KV cache
      (a reused prefix, or earlier chunks of a chunked prefill) and are attended to but not recomputed.
    * ``decode_coeffs(batch_size)``: a decode-only iteration of ``batch_size`` requests takes
      ``fixed_s + per_context_token_s * total_context_tokens``. The simulator relies on this being affine in
      the total context, so it can jump over runs of identical iterations in closed form.
    * ``mixed_s(new_tokens, prior_tokens, decode_batch, decode_context_tokens)``: one chunked-prefill
      iteration carrying prefill chunks and ``decode_batch`` piggybacked decodes.

    Pipeline parallelism is not part of the protocol: the simulator models a PP=k instance as k micro-batch
    lanes, each with the latency of the TP-only instance (as DistServe's simulator, whose per-stage time is
    the TP time divided by k with no inter-stage cost).

Implementations
    * :class:`DistServeFit` -- DistServe's A100-80G fits (``profiles/distserve_sim``), in ms:
      ``prefill = a + b*sum(l) + c*sum(l^2)``; ``decode = a + b*sum(ctx) + c*batch`` with separate
      coefficients below and above a batch-size threshold. A chunk of ``n`` new tokens after ``p`` prior
      ones contributes ``(p+n)^2 - p^2`` to the quadratic (attention) term, so chunking a prompt conserves
      it and the only chunking cost is the per-iteration intercept.
    * :class:`TableLatency` -- interpolated measurements: SplitwiseSim's ``perf_model.csv``, or a measured
      profile of a kvtier reference engine (JSON schema ``kvtier.latency-profile/1``, see docs/planner.md).
    * :class:`RooflineLatency` -- FLOPs and bytes against a GPU's peak rates with utilisation factors; the
      fallback for model/GPU pairs nobody profiled.
    * :class:`ConstantLatency` -- a fixed service time, for queueing checks and what-ifs.
"""

from __future__ import annotations

import bisect
import csv
import enum
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from conductor.perf.data import data_file
from conductor.perf.hardware import GpuSpec
from conductor.perf.models import DType, ModelSpec
from kvstore.errors import ConfigError, InvalidArgument

PROFILE_SCHEMA = "kvtier.latency-profile/1"


@runtime_checkable
class LatencyModel(Protocol):
    """Iteration latency of one model instance at a fixed TP degree (see the module docstring)."""

    @property
    def label(self) -> str: ...

    def prefill_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float: ...

    def decode_coeffs(self, batch_size: int) -> tuple[float, float]: ...

    def mixed_s(
        self,
        new_tokens: Sequence[int],
        prior_tokens: Sequence[int],
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float: ...


def _quadratic(new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> tuple[int, int]:
    total = 0
    quad = 0
    for n, p in zip(new_tokens, prior_tokens, strict=True):
        total += n
        quad += n * (n + 2 * p)
    return total, quad


@dataclass(frozen=True)
class DistServeFit:
    """DistServe simulator fits for one model and TP degree (coefficients in milliseconds)."""

    label: str
    prefill: tuple[float, float, float]
    decode_small: tuple[float, float, float]
    decode_large: tuple[float, float, float]
    batch_threshold: int

    def prefill_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float:
        a, b, c = self.prefill
        total, quad = _quadratic(new_tokens, prior_tokens)
        return (a + b * total + c * quad) / 1000.0

    def decode_coeffs(self, batch_size: int) -> tuple[float, float]:
        a, b, c = self.decode_small if batch_size < self.batch_threshold else self.decode_large
        return (a + c * batch_size) / 1000.0, b / 1000.0

    def mixed_s(
        self,
        new_tokens: Sequence[int],
        prior_tokens: Sequence[int],
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float:
        # Prefill part plus the decode rows' marginal cost: their per-request term and their attention
        # over the context. The intercept is paid once per iteration.
        a, b, c = self.prefill
        _, bd, cd = self.decode_small if decode_batch < self.batch_threshold else self.decode_large
        total, quad = _quadratic(new_tokens, prior_tokens)
        return (a + b * total + c * quad + bd * decode_context_tokens + cd * decode_batch) / 1000.0


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Piecewise-linear interpolation; clamped below the first point, extrapolated above the last."""
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        if len(xs) == 1:
            return ys[0] * x / xs[0]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (x - xs[-1])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class TableLatency:
    """Latency interpolated from measured points.

    Prefill time is a function of the tokens computed in the batch (cached prior tokens are ignored: the
    tables were measured without reuse). Decode time is ``fixed(batch) + per_context_token * context``; with
    ``decode_context_slope_ms == 0`` it depends on the batch size only (SplitwiseSim's token time is flat in
    the prompt size: 28-32 ms from 128 to 8,192 tokens for Llama-2-70B on 8xH100).
    """

    label: str
    prefill_tokens: tuple[float, ...]
    prefill_ms: tuple[float, ...]
    decode_batch: tuple[float, ...]
    decode_ms: tuple[float, ...]
    decode_context_slope_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.prefill_tokens or len(self.prefill_tokens) != len(self.prefill_ms):
            raise InvalidArgument(f"{self.label}: prefill table needs matching, non-empty columns")
        if not self.decode_batch or len(self.decode_batch) != len(self.decode_ms):
            raise InvalidArgument(f"{self.label}: decode table needs matching, non-empty columns")
        if list(self.prefill_tokens) != sorted(set(self.prefill_tokens)) or list(
            self.decode_batch
        ) != sorted(set(self.decode_batch)):
            raise InvalidArgument(f"{self.label}: table abscissae must be strictly increasing")

    def prefill_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float:
        return _interp(float(sum(new_tokens)), self.prefill_tokens, self.prefill_ms) / 1000.0

    def decode_coeffs(self, batch_size: int) -> tuple[float, float]:
        return (
            _interp(float(batch_size), self.decode_batch, self.decode_ms) / 1000.0,
            self.decode_context_slope_ms / 1000.0,
        )

    def mixed_s(
        self,
        new_tokens: Sequence[int],
        prior_tokens: Sequence[int],
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float:
        rows = float(sum(new_tokens) + decode_batch)
        fixed, per_ctx = self.decode_coeffs(decode_batch)
        as_prefill = _interp(rows, self.prefill_tokens, self.prefill_ms) / 1000.0
        return max(as_prefill, fixed + per_ctx * decode_context_tokens)

    @classmethod
    def from_profile(cls, profile: dict[str, Any], label: str) -> TableLatency:
        """Build from a ``kvtier.latency-profile/1`` document (a measured reference-engine profile)."""
        if profile.get("schema") != PROFILE_SCHEMA:
            raise ConfigError(
                f"{label}: expected schema {PROFILE_SCHEMA!r}, got {profile.get('schema')!r}"
            )
        try:
            prefill = [(float(p["tokens"]), float(p["time_ms"])) for p in profile["prefill"]]
            decode = [
                (float(d["batch_size"]), d.get("context_tokens"), float(d["time_ms"]))
                for d in profile["decode"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{label}: malformed profile entry: {exc}") from exc
        if not prefill or not decode:
            raise ConfigError(f"{label}: profile needs prefill and decode points")
        ptoks, pms = _mean_by_key(prefill)
        if (
            all(ctx is not None for _, ctx, _ in decode)
            and len({(b, c) for b, c, _ in decode}) >= 3
        ):
            # Fit time = alpha + beta*B + gamma*(B*ctx) (DistServe's decode form) by least squares.
            rows = np.array([[1.0, b, b * float(c)] for b, c, _ in decode])
            times = np.array([t for _, _, t in decode])
            (alpha, beta, gamma), *_ = np.linalg.lstsq(rows, times, rcond=None)
            batches = sorted({b for b, _, _ in decode})
            return cls(
                label,
                ptoks,
                pms,
                tuple(batches),
                tuple(alpha + beta * b for b in batches),
                decode_context_slope_ms=max(float(gamma), 0.0),
            )
        dbatch, dms = _mean_by_key([(b, t) for b, _, t in decode])
        return cls(label, ptoks, pms, dbatch, dms)


def _mean_by_key(points: list[tuple[float, float]]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    groups: dict[float, list[float]] = defaultdict(list)
    for key, value in points:
        groups[key].append(value)
    keys = sorted(groups)
    return tuple(keys), tuple(float(np.mean(groups[k])) for k in keys)


@dataclass(frozen=True)
class RooflineLatency:
    """Estimate from FLOPs and bytes, per iteration, for model/GPU pairs nobody profiled.

    ``time = max(GEMM FLOPs / (peak * mfu), weight bytes / (hbm * mbu))   # linear layers, weights read once
           + attention FLOPs / (peak * mfu)                              # prefill attention, compute-bound
           + context KV bytes / (hbm * mbu)                              # decode attention, memory-bound
           + TP all-reduces + overhead_s``

    GEMM FLOPs are ``2 * active_params`` per row (prompt token or decode request); causal prefill attention
    is ``4 * layers * attention_dim * sum(n * (p + n/2))`` for ``n`` new tokens after ``p`` prior ones.
    Attention runs in its own kernels, so its time adds to the GEMMs' instead of hiding under them; in a
    chunked iteration the piggybacked decodes' KV reads therefore cost their full time. Rates scale with
    ``tp``; tensor parallelism pays two ring all-reduces of the activations per layer over NVLink
    (``2 (tp-1)/tp * rows * hidden * 2 bytes`` each, plus ``allreduce_latency_s``). ``overhead_s`` is launch
    and scheduling cost. A crude model: prefer a measured profile when one exists.
    """

    model: ModelSpec
    gpu: GpuSpec
    tp: int
    weight_dtype: DType = DType.FP16
    kv_dtype: DType = DType.FP16
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.004
    allreduce_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if self.tp <= 0 or not 0 < self.mfu <= 1 or not 0 < self.mbu <= 1 or self.overhead_s < 0:
            raise InvalidArgument("roofline: tp > 0, 0 < mfu <= 1, 0 < mbu <= 1, overhead >= 0")

    @property
    def label(self) -> str:
        return (
            f"roofline {self.model.name} {self.gpu.name} tp{self.tp} mfu={self.mfu} mbu={self.mbu}"
        )

    def _flops_rate(self) -> float:
        return self.gpu.peak_flops * self.mfu * self.tp

    def _bytes_rate(self) -> float:
        return self.gpu.hbm_bytes_per_s * self.mbu * self.tp

    def _linear_s(self, rows: int) -> float:
        compute = 2.0 * self.model.compute_params * rows / self._flops_rate()
        weights = self.model.weight_bytes(self.weight_dtype) / self._bytes_rate()
        return max(compute, weights)

    def _allreduce_s(self, rows: int) -> float:
        if self.tp == 1:
            return 0.0
        size = rows * self.model.hidden_size * 2 * 2.0 * (self.tp - 1) / self.tp
        per_layer = 2 * (self.allreduce_latency_s + size / self.gpu.nvlink_bytes_per_s)
        return self.model.layers * per_layer

    def _attention_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float:
        work = 0.0
        for n, p in zip(new_tokens, prior_tokens, strict=True):
            work += n * (p + n / 2.0)
        return 4.0 * self.model.layers * self.model.attention_dim * work / self._flops_rate()

    def prefill_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float:
        rows = sum(new_tokens)
        return (
            self._linear_s(rows)
            + self._attention_s(new_tokens, prior_tokens)
            + self._allreduce_s(rows)
            + self.overhead_s
        )

    def decode_coeffs(self, batch_size: int) -> tuple[float, float]:
        per_ctx = self.model.kv_bytes_per_token(self.kv_dtype) / self._bytes_rate()
        fixed = self._linear_s(batch_size) + self._allreduce_s(batch_size) + self.overhead_s
        return fixed, per_ctx

    def mixed_s(
        self,
        new_tokens: Sequence[int],
        prior_tokens: Sequence[int],
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float:
        rows = sum(new_tokens) + decode_batch
        decode_attention = (
            self.model.kv_bytes_per_token(self.kv_dtype)
            * decode_context_tokens
            / self._bytes_rate()
        )
        return (
            self._linear_s(rows)
            + self._attention_s(new_tokens, prior_tokens)
            + decode_attention
            + self._allreduce_s(rows)
            + self.overhead_s
        )


@dataclass(frozen=True)
class ConstantLatency:
    """Every prefill batch takes ``prefill_batch_s``; every decode iteration ``decode_step_s``."""

    prefill_batch_s: float
    decode_step_s: float

    def __post_init__(self) -> None:
        if self.prefill_batch_s <= 0 or self.decode_step_s <= 0:
            raise InvalidArgument("constant latency: times must be positive")

    @property
    def label(self) -> str:
        return f"constant prefill={self.prefill_batch_s}s decode={self.decode_step_s}s"

    def prefill_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float:
        return self.prefill_batch_s

    def decode_coeffs(self, batch_size: int) -> tuple[float, float]:
        return self.decode_step_s, 0.0

    def mixed_s(
        self,
        new_tokens: Sequence[int],
        prior_tokens: Sequence[int],
        decode_batch: int,
        decode_context_tokens: int,
    ) -> float:
        return self.prefill_batch_s


class LatencySource(enum.Enum):
    """Where latency numbers come from (``--latency``)."""

    AUTO = "auto"
    DISTSERVE = "distserve"  # DistServe fits of DistServe's own engine (A100-80G, OPT)
    DISTSERVE_VLLM = "distserve-vllm"  # DistServe's fits of vLLM (A100-80G, OPT)
    SPLITWISE = "splitwise"  # SplitwiseSim measurements (Llama-2-70B, BLOOM-176B; A100/H100)
    ROOFLINE = "roofline"
    CONSTANT = "constant"  # only through LatencyProvider.constant()
    PROFILE = "profile"  # a kvtier.latency-profile/1 JSON file


@dataclass(frozen=True, eq=False)
class LatencyProvider:
    """Latency models of one model on one GPU type, per TP degree, plus KV capacities where published.

    ``models[tp]`` is the latency model of an instance with that TP degree; ``kv_capacity[(tp, pp)]`` is a
    published KV capacity in tokens (DistServe's ``max_num_tokens.csv``); other capacities are computed by
    the simulator from memory. Picklable, so search workers receive it once.
    """

    source: LatencySource
    models: dict[int, LatencyModel]
    kv_capacity: dict[tuple[int, int], int]

    @property
    def tp_degrees(self) -> list[int]:
        return sorted(self.models)

    def for_tp(self, tp: int) -> LatencyModel:
        try:
            return self.models[tp]
        except KeyError as exc:
            raise ConfigError(
                f"no {self.source.value} latency model for TP={tp}; available: {self.tp_degrees}"
            ) from exc

    @classmethod
    def constant(cls, prefill_batch_s: float, decode_step_s: float) -> LatencyProvider:
        return cls(LatencySource.CONSTANT, {1: ConstantLatency(prefill_batch_s, decode_step_s)}, {})


_DISTSERVE_FILES = {
    LatencySource.DISTSERVE: "profiles/distserve_sim/profiler-a100-80g.distserve.json",
    LatencySource.DISTSERVE_VLLM: "profiles/distserve_sim/profiler-a100-80g.vllm.json",
}
_SPLITWISE_MODELS = {"llama-2-70b": "llama2-70b", "bloom-176b": "bloom-176b"}
_SPLITWISE_GPUS = {"a100-80g": "a100-80gb", "h100-80g": "h100-80gb"}


def _distserve(
    source: LatencySource, model: ModelSpec, gpu: GpuSpec, data: str | Path | None
) -> LatencyProvider:
    if gpu.name != "a100-80g":
        raise ConfigError(f"DistServe fits exist for a100-80g only, not {gpu.name}")
    path = data_file(_DISTSERVE_FILES[source], data)
    fits = json.loads(path.read_text())
    key = model.hf_id or model.name
    if key not in fits:
        raise ConfigError(f"DistServe fits cover {', '.join(fits)}; not {model.name}")
    models: dict[int, LatencyModel] = {}
    for tp_text, p in fits[key].items():
        models[int(tp_text)] = DistServeFit(
            f"{source.value} {model.name} tp{tp_text}",
            tuple(p["prefill"]),
            tuple(p["decoding_smallbs"]),
            tuple(p["decoding_largebs"]),
            int(p["decoding_large_small_bs_threshold"]),
        )
    capacity: dict[tuple[int, int], int] = {}
    with data_file("profiles/distserve_sim/max_num_tokens.csv", data).open() as fh:
        for row in csv.DictReader(fh):
            if row["model"] == key:
                capacity[(int(row["tp"]), int(row["pp"]))] = int(row["max_num_tokens"])
    return LatencyProvider(source, models, capacity)


def _splitwise(model: ModelSpec, gpu: GpuSpec, data: str | Path | None) -> LatencyProvider:
    sw_model = _SPLITWISE_MODELS.get(model.name)
    sw_gpu = _SPLITWISE_GPUS.get(gpu.name)
    if sw_model is None or sw_gpu is None:
        raise ConfigError(
            f"SplitwiseSim measured {', '.join(_SPLITWISE_MODELS)} on "
            f"{', '.join(_SPLITWISE_GPUS)}; not {model.name} on {gpu.name}"
        )
    prefill: dict[int, list[tuple[float, float]]] = defaultdict(list)
    decode: dict[int, list[tuple[float, float]]] = defaultdict(list)
    with data_file("profiles/splitwise_perf_model.csv", data).open() as fh:
        for row in csv.DictReader(fh):
            if row["model"] != sw_model or row["hardware"] != sw_gpu:
                continue
            tp = int(row["tensor_parallel"])
            batch = int(row["batch_size"])
            prefill[tp].append((float(row["prompt_size"]) * batch, float(row["prompt_time"])))
            decode[tp].append((float(batch), float(row["token_time"])))
    models: dict[int, LatencyModel] = {}
    for tp in sorted(prefill):
        ptoks, pms = _mean_by_key(prefill[tp])
        dbatch, dms = _mean_by_key(decode[tp])
        models[tp] = TableLatency(f"splitwise {sw_model} {sw_gpu} tp{tp}", ptoks, pms, dbatch, dms)
    if not models:
        raise ConfigError(f"no SplitwiseSim rows for {sw_model} on {sw_gpu}")
    return LatencyProvider(LatencySource.SPLITWISE, models, {})


def _roofline(
    model: ModelSpec, gpu: GpuSpec, weight_dtype: DType, kv_dtype: DType
) -> LatencyProvider:
    models: dict[int, LatencyModel] = {}
    for tp in (1, 2, 4, 8):
        if model.kv_heads % tp and model.mla_latent_dim is None:
            continue
        models[tp] = RooflineLatency(model, gpu, tp, weight_dtype, kv_dtype)
    return LatencyProvider(LatencySource.ROOFLINE, models, {})


def _profile(path: Path) -> LatencyProvider:
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read latency profile {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"latency profile {path} is not valid JSON: {exc}") from exc
    tp = int(doc.get("tp", 1))
    return LatencyProvider(
        LatencySource.PROFILE, {tp: TableLatency.from_profile(doc, f"profile {path.name}")}, {}
    )


def build_latency_provider(
    source: str,
    model: ModelSpec,
    gpu: GpuSpec,
    *,
    data: str | Path | None = None,
    weight_dtype: DType = DType.FP16,
    kv_dtype: DType = DType.FP16,
) -> LatencyProvider:
    """Resolve ``--latency``: a :class:`LatencySource` value or a path to a measured profile JSON.

    ``auto`` picks DistServe's fits when they cover the model and GPU, else SplitwiseSim's measurements,
    else the roofline estimate.
    """
    if source.endswith(".json") or Path(source).is_file():
        return _profile(Path(source))
    try:
        kind = LatencySource(source.lower())
    except ValueError as exc:
        raise ConfigError(
            f"unknown latency source {source!r}; use "
            f"{', '.join(s.value for s in LatencySource if s is not LatencySource.CONSTANT)}"
            " or a profile .json"
        ) from exc
    if kind in _DISTSERVE_FILES:
        return _distserve(kind, model, gpu, data)
    if kind is LatencySource.SPLITWISE:
        return _splitwise(model, gpu, data)
    if kind is LatencySource.ROOFLINE:
        return _roofline(model, gpu, weight_dtype, kv_dtype)
    if kind is LatencySource.AUTO:
        if gpu.name == "a100-80g":
            fits = json.loads(
                data_file(_DISTSERVE_FILES[LatencySource.DISTSERVE], data).read_text()
            )
            if (model.hf_id or model.name) in fits:
                return _distserve(LatencySource.DISTSERVE, model, gpu, data)
        if model.name in _SPLITWISE_MODELS and gpu.name in _SPLITWISE_GPUS:
            return _splitwise(model, gpu, data)
        return _roofline(model, gpu, weight_dtype, kv_dtype)
    raise ConfigError(f"latency source {kind.value!r} cannot be selected by name")

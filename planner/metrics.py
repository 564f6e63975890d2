"""What a simulation reports: per-request latencies, SLO attainment, bytes moved, memory and energy.

Definitions (DistServe's)
    * TTFT: arrival to first token. In a disaggregated cluster the prefill instance emits the first token,
      so the KV transfer lands in TPOT, not TTFT.
    * TPOT: ``(finish - first_token) / (output_tokens - 1)``, the mean gap between output tokens; 0 for a
      one-token answer.
    * A request *attains* the SLO when ``ttft <= ttft_slo`` and ``tpot <= tpot_slo``; a rejected request (its
      KV does not fit an instance) never does.
    * Queue wait: arrival to the start of its prefill.
    * KV transfer (disaggregated): from the moment a decode instance admits the request (at once, or when
      memory frees up) to the last KV byte landing, i.e. what layer-by-layer pipelining left exposed plus
      any wait for the sender's link. Decode wait: first token to joining a decode batch, minus the
      transfer (waiting for decode memory or a batch slot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument


@dataclass(frozen=True)
class Slo:
    """Latency objectives and the fraction of requests that must meet both."""

    ttft_s: float
    tpot_s: float
    attainment_target: float = 0.9

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise InvalidArgument("SLOs must be positive")
        if not 0 < self.attainment_target <= 1:
            raise InvalidArgument("attainment target must be in (0, 1]")


def _pct(values: np.ndarray, q: float) -> float:
    finite = values[np.isfinite(values)]
    if len(finite) == 0:
        return math.inf
    if len(finite) < len(values):
        # Unfinished or rejected requests count as infinitely late, so percentiles stay honest.
        values = np.where(np.isfinite(values), values, np.inf)
        return float(np.percentile(values, q, method="higher"))
    return float(np.percentile(finite, q))


@dataclass(frozen=True, eq=False)
class SimResult:
    """Everything one simulation produced. Times are seconds since the first arrival."""

    workload: str
    deployment: str
    gpus: int
    arrival_s: np.ndarray
    prefill_start_s: np.ndarray
    first_token_s: np.ndarray
    finish_s: np.ndarray
    transfer_s: np.ndarray
    decode_wait_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    cached_tokens: np.ndarray
    rejected: np.ndarray
    makespan_s: float
    prefill_busy_gpu_s: float
    decode_busy_gpu_s: float
    kv_transfer_bytes: int
    cache_load_bytes: int
    cache_write_bytes: int
    cache_hit_rate: float
    weight_bytes_total: int
    weight_bytes_duplicated: int
    hbm_bytes_total: int
    energy_j: float
    power_model: str

    @property
    def ttft_s(self) -> np.ndarray:
        ttft = self.first_token_s - self.arrival_s
        return np.where(self.rejected | ~np.isfinite(ttft), np.inf, ttft)

    @property
    def tpot_s(self) -> np.ndarray:
        steps = np.maximum(self.output_tokens - 1, 1)
        tpot = (self.finish_s - self.first_token_s) / steps
        tpot = np.where(self.output_tokens <= 1, 0.0, tpot)
        return np.where(self.rejected | ~np.isfinite(self.finish_s), np.inf, tpot)

    @property
    def queue_wait_s(self) -> np.ndarray:
        wait = self.prefill_start_s - self.arrival_s
        return np.where(np.isfinite(wait), wait, np.inf)

    def attainment(self, slo: Slo) -> tuple[float, float, float]:
        """Fractions of requests meeting (both, TTFT only, TPOT only)."""
        ttft_ok = self.ttft_s <= slo.ttft_s
        tpot_ok = self.tpot_s <= slo.tpot_s
        return float(np.mean(ttft_ok & tpot_ok)), float(np.mean(ttft_ok)), float(np.mean(tpot_ok))

    def summary(self, slo: Slo | None = None) -> dict[str, Any]:
        """JSON-ready figures: latency percentiles, attainment, bytes, memory, energy."""
        n = len(self.arrival_s)
        done = int(np.sum(np.isfinite(self.finish_s) & ~self.rejected))
        out: dict[str, Any] = {
            "workload": self.workload,
            "deployment": self.deployment,
            "gpus": self.gpus,
            "requests": n,
            "completed": done,
            "rejected": int(self.rejected.sum()),
            "offered_rate_per_s": (n - 1) / float(self.arrival_s[-1])
            if n > 1 and self.arrival_s[-1] > 0
            else math.inf,
            "makespan_s": self.makespan_s,
        }
        for label, values in (
            ("ttft_s", self.ttft_s),
            ("tpot_s", self.tpot_s),
            ("queue_wait_s", self.queue_wait_s),
            ("kv_transfer_s", self.transfer_s),
            ("decode_wait_s", self.decode_wait_s),
        ):
            out[label] = {
                "p50": _pct(values, 50),
                "p90": _pct(values, 90),
                "p99": _pct(values, 99),
                "mean": float(np.mean(values)) if np.all(np.isfinite(values)) else math.inf,
            }
        if slo is not None:
            both, ttft_ok, tpot_ok = self.attainment(slo)
            out["slo"] = {
                "ttft_s": slo.ttft_s,
                "tpot_s": slo.tpot_s,
                "target": slo.attainment_target,
                "attainment": both,
                "ttft_attainment": ttft_ok,
                "tpot_attainment": tpot_ok,
                "met": both >= slo.attainment_target,
            }
        out["kv_bytes_moved"] = {
            "prefill_to_decode": self.kv_transfer_bytes,
            "cache_to_gpu": self.cache_load_bytes,
            "gpu_to_cache": self.cache_write_bytes,
            "total": self.kv_transfer_bytes + self.cache_load_bytes + self.cache_write_bytes,
        }
        out["prefix_cache"] = {
            "hit_rate": self.cache_hit_rate,
            "cached_tokens": int(self.cached_tokens.sum()),
            "prompt_tokens": int(self.prompt_tokens.sum()),
        }
        out["gpu_memory"] = {
            "weights_bytes": self.weight_bytes_total,
            "duplicated_weights_bytes": self.weight_bytes_duplicated,
            "duplicated_weights_fraction_of_hbm": self.weight_bytes_duplicated
            / self.hbm_bytes_total,
        }
        span_gpu_s = self.makespan_s * self.gpus
        out["utilisation"] = {
            "prefill_busy_fraction": self.prefill_busy_gpu_s / span_gpu_s if span_gpu_s else 0.0,
            "decode_busy_fraction": self.decode_busy_gpu_s / span_gpu_s if span_gpu_s else 0.0,
        }
        out["energy"] = {
            "total_j": self.energy_j,
            "per_request_j": self.energy_j / done if done else math.inf,
            "model": self.power_model,
        }
        return out

"""Goodput: the highest request rate at which the SLO attainment target (90%) is still met.

The search replays the same requests with arrival times scaled to each candidate rate (so only the rate
changes), doubles or halves from a starting rate until the target is bracketed, then bisects in log space
until the bracket is within ``rel_tol``. Like DistServe's simulator, it assumes attainment falls as the
rate rises; the curve it records lets a reader check that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.errors import InvalidArgument
from planner.metrics import SimResult, Slo
from planner.sim import ClusterSpec, Deployment, simulate
from planner.workload import Workload


@dataclass(frozen=True)
class RatePoint:
    """Attainment measured at one offered rate."""

    rate_per_s: float
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    ttft_p90_s: float
    tpot_p90_s: float


@dataclass(frozen=True)
class Goodput:
    """The goodput of one deployment and the rate points that found it.

    ``limited_by`` names the objective that failed first just above the goodput ("ttft", "tpot" or
    "both"), read from the lowest failing rate point.
    """

    deployment: str
    gpus: int
    rate_per_s: float
    curve: list[RatePoint] = field(default_factory=list)
    limited_by: str = "none"

    @property
    def per_gpu(self) -> float:
        return self.rate_per_s / self.gpus


def _point(result: SimResult, rate: float, slo: Slo) -> RatePoint:
    both, ttft_ok, tpot_ok = result.attainment(slo)
    summary = result.summary()
    return RatePoint(
        rate, both, ttft_ok, tpot_ok, summary["ttft_s"]["p90"], summary["tpot_s"]["p90"]
    )


def find_goodput(
    cluster: ClusterSpec,
    deployment: Deployment,
    workload: Workload,
    slo: Slo,
    *,
    start_rate_per_s: float | None = None,
    rel_tol: float = 0.04,
    max_rate_per_s: float = 1e5,
) -> Goodput:
    """Highest rate (requests/s, whole deployment) meeting ``slo``; 0 if even a trickle misses it."""
    if not 0 < rel_tol < 1:
        raise InvalidArgument("rel_tol must be in (0, 1)")
    curve: list[RatePoint] = []

    def ok(rate: float) -> bool:
        point = _point(simulate(cluster, deployment, workload.at_rate(rate)), rate, slo)
        curve.append(point)
        return point.attainment >= slo.attainment_target

    rate = start_rate_per_s or _start_rate(cluster, deployment, workload)
    lo, hi = 0.0, 0.0
    if ok(rate):
        lo = rate
        while True:
            rate *= 2.0
            if rate > max_rate_per_s:
                return _finish(deployment, lo, curve)
            if not ok(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        while True:
            rate /= 2.0
            if rate < 1e-4:
                return _finish(deployment, 0.0, curve)
            if ok(rate):
                lo = rate
                break
            hi = rate
    while hi / lo > 1.0 + rel_tol:
        mid = (lo * hi) ** 0.5
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return _finish(deployment, lo, curve)


def _start_rate(cluster: ClusterSpec, deployment: Deployment, workload: Workload) -> float:
    """A first guess near the capacity, so bracketing takes one or two simulations, not five.

    GPU-seconds per request on the first group's instance shape: one prefill of the mean prompt plus the
    mean output decoded at a batch of 32; the guess is 80% of the rate that keeps every GPU busy.
    """
    group = deployment.groups[0]
    latency = cluster.latency.for_tp(group.tp)
    prompt = int(workload.prompt_tokens.mean())
    output = float(workload.output_tokens.mean())
    fixed, per_ctx = latency.decode_coeffs(32)
    per_token = fixed / 32 + per_ctx * (prompt + output / 2)
    gpu_s = group.tp * (latency.prefill_s([prompt], [0]) + output * per_token)
    return max(0.8 * deployment.gpus / gpu_s, 1e-3)


def _finish(deployment: Deployment, rate: float, curve: list[RatePoint]) -> Goodput:
    curve = sorted(curve, key=lambda p: p.rate_per_s)
    failing = [p for p in curve if p.rate_per_s > rate and p.attainment < 1.0]
    limited = "none"
    if failing:
        p = failing[0]
        gap_ttft, gap_tpot = 1.0 - p.ttft_attainment, 1.0 - p.tpot_attainment
        if gap_ttft > 2 * gap_tpot:
            limited = "ttft"
        elif gap_tpot > 2 * gap_ttft:
            limited = "tpot"
        else:
            limited = "both"
    return Goodput(deployment.label, deployment.gpus, rate, curve, limited)


def sweep(
    cluster: ClusterSpec,
    deployment: Deployment,
    workload: Workload,
    slo: Slo,
    rates_per_s: list[float],
) -> list[RatePoint]:
    """Attainment at each of ``rates_per_s`` (for plots and tables)."""
    return [_point(simulate(cluster, deployment, workload.at_rate(r)), r, slo) for r in rates_per_s]

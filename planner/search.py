"""``kvtier plan search``: the best deployment per GPU, and whether to disaggregate.

Like DistServe's placement search, every candidate is simulated and scored by its goodput per GPU (the
highest rate at which 90% of requests meet both SLOs, divided by its GPUs); a deployment that wins per
GPU is replicated to fill a larger cluster. Candidates within a GPU budget:

* colocated, for every TP x PP that fits, with continuous batching and with chunked prefill (each chunk
  size), using as many instances as the budget holds;
* disaggregated, for every pair of per-phase TP x PP, with every *maximal* Np:Nd split (no further instance
  of either kind fits in the remaining GPUs).

The verdict compares the best of each architecture and explains it with figures the simulations produced:
which objective limits each, the latencies of both at the same per-GPU load, the KV transfer time, and the
memory spent on duplicated weights. No rule of thumb is coded; they come out of the numbers (docs/planner.md
shows the runs).
"""

from __future__ import annotations

import enum
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from conductor.perf.hardware import Link
from kvstore.errors import ConfigError, InvalidArgument
from planner.goodput import Goodput, find_goodput
from planner.metrics import Slo
from planner.sim import Architecture, ClusterSpec, Deployment, InstanceGroup, simulate
from planner.workload import Workload


class Decision(enum.Enum):
    DISAGGREGATE = "disaggregate"
    COLOCATE = "colocate"


@dataclass(frozen=True)
class SearchSpace:
    """What the search may try. ``pp_degrees`` and ``tp_degrees`` (None: what the latency models cover)."""

    gpus: int
    link: Link
    chunk_tokens: tuple[int, ...] = (512, 2048)
    tp_degrees: tuple[int, ...] | None = None
    pp_degrees: tuple[int, ...] = (1, 2)
    prefill_token_budget: int = 4096
    max_batch_requests: int = 256
    layerwise_transfer: bool = True
    include_colocated: bool = True
    include_disaggregated: bool = True

    def __post_init__(self) -> None:
        if self.gpus <= 0:
            raise InvalidArgument("gpu budget must be positive")


def _shapes(cluster: ClusterSpec, space: SearchSpace) -> list[tuple[int, int]]:
    tps = space.tp_degrees or tuple(cluster.latency.tp_degrees)
    shapes = []
    for tp in tps:
        if tp not in cluster.latency.models:
            continue
        for pp in space.pp_degrees:
            if tp * pp > space.gpus:
                continue
            try:
                cluster.check(
                    Deployment(Architecture.COLOCATED, colocated=InstanceGroup(1, tp, pp))
                )
            except ConfigError:
                continue
            shapes.append((tp, pp))
    return shapes


def enumerate_deployments(cluster: ClusterSpec, space: SearchSpace) -> list[Deployment]:
    """Every candidate deployment of the search space (see the module docstring)."""
    shapes = _shapes(cluster, space)
    common: dict[str, Any] = {
        "prefill_token_budget": space.prefill_token_budget,
        "max_batch_requests": space.max_batch_requests,
        "link": space.link,
        "layerwise_transfer": space.layerwise_transfer,
    }
    out: list[Deployment] = []
    if space.include_colocated:
        for tp, pp in shapes:
            group = InstanceGroup(space.gpus // (tp * pp), tp, pp)
            out.append(Deployment(Architecture.COLOCATED, colocated=group, **common))
            for chunk in space.chunk_tokens:
                out.append(
                    Deployment(Architecture.CHUNKED, colocated=group, chunk_tokens=chunk, **common)
                )
    if space.include_disaggregated:
        for ptp, ppp in shapes:
            for dtp, dpp in shapes:
                psize, dsize = ptp * ppp, dtp * dpp
                for np_ in range(1, space.gpus // psize + 1):
                    left = space.gpus - np_ * psize
                    nd = left // dsize
                    if nd < 1:
                        continue
                    if left - nd * dsize >= psize:
                        continue  # another prefill instance would still fit: not maximal
                    out.append(
                        Deployment(
                            Architecture.DISAGGREGATED,
                            prefill=InstanceGroup(np_, ptp, ppp),
                            decode=InstanceGroup(nd, dtp, dpp),
                            **common,
                        )
                    )
    return out


@dataclass(frozen=True)
class Candidate:
    """One simulated deployment and its goodput."""

    deployment: Deployment
    goodput: Goodput

    @property
    def per_gpu(self) -> float:
        return self.goodput.per_gpu


@dataclass(frozen=True)
class Verdict:
    """The decision, the two best candidates behind it, and the reasons (figures from the simulations)."""

    decision: Decision
    reasons: list[str]
    best_colocated: Candidate | None
    best_disaggregated: Candidate | None
    ratio: float | None
    comparison: dict[str, Any] = field(default_factory=dict)


# Worker-process state: the cluster, workload and SLO are sent once per worker, not once per task.
_WORKER: dict[str, Any] = {}


def _init_worker(cluster: ClusterSpec, workload: Workload, slo: Slo) -> None:
    _WORKER.update(cluster=cluster, workload=workload, slo=slo)


def _evaluate(deployment: Deployment) -> Candidate:
    goodput = find_goodput(_WORKER["cluster"], deployment, _WORKER["workload"], _WORKER["slo"])
    return Candidate(deployment, goodput)


def evaluate(
    cluster: ClusterSpec,
    deployments: list[Deployment],
    workload: Workload,
    slo: Slo,
    *,
    workers: int | None = None,
) -> list[Candidate]:
    """Goodput of every deployment, best per GPU first; ``workers`` processes (default: the CPU count)."""
    workers = workers or os.cpu_count() or 1
    if workers <= 1 or len(deployments) <= 1:
        _init_worker(cluster, workload, slo)
        results = [_evaluate(d) for d in deployments]
    else:
        ctx = multiprocessing.get_context(
            "fork" if "fork" in multiprocessing.get_all_start_methods() else None
        )
        with ProcessPoolExecutor(
            max_workers=workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(cluster, workload, slo),
        ) as pool:
            results = list(
                pool.map(
                    _evaluate, deployments, chunksize=max(1, len(deployments) // (8 * workers))
                )
            )
    return sorted(results, key=lambda c: (-c.per_gpu, c.deployment.gpus))


def _gb(size_bytes: float) -> str:
    return f"{size_bytes / 1e9:.0f} GB"


def verdict(
    cluster: ClusterSpec,
    candidates: list[Candidate],
    workload: Workload,
    slo: Slo,
    *,
    gpu_budget: int,
    margin: float = 0.05,
) -> Verdict:
    """Decide from simulated candidates; disaggregate only if it beats colocation per GPU by ``margin``.

    The reasons re-simulate the two best candidates at the same per-GPU load (the lower of their two
    goodputs) so their latencies are comparable.
    """
    colo = [c for c in candidates if c.deployment.architecture is not Architecture.DISAGGREGATED]
    dis = [c for c in candidates if c.deployment.architecture is Architecture.DISAGGREGATED]
    best_c = max(colo, key=lambda c: c.per_gpu, default=None)
    best_d = max(dis, key=lambda c: c.per_gpu, default=None)
    reasons: list[str] = []
    comparison: dict[str, Any] = {}
    if best_d is None and best_c is None:
        raise ConfigError("no candidate deployment fits the GPU budget")
    if best_d is None:
        reasons.append(
            f"no disaggregated deployment fits in {gpu_budget} GPU(s): it needs one prefill and "
            "one decode instance, each holding a full copy of the weights"
        )
        assert best_c is not None
        reasons.append(
            f"best colocated: {best_c.deployment.label}, {best_c.per_gpu:.3f} req/s per GPU"
        )
        return Verdict(Decision.COLOCATE, reasons, best_c, None, None, comparison)
    if best_c is None:
        reasons.append(
            f"best disaggregated: {best_d.deployment.label}, {best_d.per_gpu:.3f} req/s per GPU "
            "(colocated deployments were not searched)"
        )
        return Verdict(Decision.DISAGGREGATE, reasons, None, best_d, None, comparison)

    ratio = best_d.per_gpu / best_c.per_gpu if best_c.per_gpu > 0 else float("inf")
    decision = (
        Decision.DISAGGREGATE
        if best_d.per_gpu > best_c.per_gpu * (1 + margin)
        else Decision.COLOCATE
    )
    reasons.append(
        f"goodput per GPU: disaggregated {best_d.per_gpu:.3f} ({best_d.deployment.label}) vs "
        f"colocated {best_c.per_gpu:.3f} ({best_c.deployment.label}): ratio {ratio:.2f}"
        f"{'' if decision is Decision.DISAGGREGATE else f' (disaggregation needs > {1 + margin:.2f})'}"
    )
    reasons.append(
        f"colocated is limited by {best_c.goodput.limited_by.upper()} just above its goodput; "
        f"disaggregated by {best_d.goodput.limited_by.upper()}"
    )
    load = min(best_c.per_gpu, best_d.per_gpu)
    if load > 0:
        per = {}
        for tag, cand in (("colocated", best_c), ("disaggregated", best_d)):
            res = simulate(cluster, cand.deployment, workload.at_rate(load * cand.deployment.gpus))
            per[tag] = res.summary(slo)
        comparison = {"per_gpu_rate": load, **per}
        c, d = per["colocated"], per["disaggregated"]
        reasons.append(
            f"at {load:.3f} req/s per GPU: TTFT p90 {c['ttft_s']['p90'] * 1e3:.0f} ms colocated vs "
            f"{d['ttft_s']['p90'] * 1e3:.0f} ms disaggregated; TPOT p90 "
            f"{c['tpot_s']['p90'] * 1e3:.1f} ms vs {d['tpot_s']['p90'] * 1e3:.1f} ms "
            f"(SLOs {slo.ttft_s * 1e3:.0f} / {slo.tpot_s * 1e3:.0f} ms)"
        )
        reasons.append(
            f"KV transfer over {best_d.deployment.link.name}: p50 "
            f"{d['kv_transfer_s']['p50'] * 1e3:.1f} ms, p90 {d['kv_transfer_s']['p90'] * 1e3:.1f} ms "
            f"per request after its prefill; "
            f"{d['kv_bytes_moved']['prefill_to_decode'] / max(d['completed'], 1) / 1e6:.0f} MB "
            "moved per request"
        )
        reasons.append(
            f"energy per request at that load: {c['energy']['per_request_j']:.0f} J colocated vs "
            f"{d['energy']['per_request_j']:.0f} J disaggregated"
        )
    weights = cluster.model.weight_bytes(cluster.weight_dtype)
    reasons.append(
        f"weights duplicated per {gpu_budget} GPUs: colocated "
        f"{_gb(weights * _replicas(best_c.deployment, gpu_budget))}, disaggregated "
        f"{_gb(weights * _replicas(best_d.deployment, gpu_budget))} "
        f"({cluster.model.name} is {_gb(weights)} per copy)"
    )
    return Verdict(decision, reasons, best_c, best_d, ratio, comparison)


def _replicas(deployment: Deployment, gpu_budget: int) -> int:
    """Weight copies beyond the first if ``deployment`` is replicated to fill ``gpu_budget`` GPUs."""
    copies = deployment.instances * max(gpu_budget // deployment.gpus, 1)
    return max(copies - 1, 0)


def search(
    cluster: ClusterSpec,
    space: SearchSpace,
    workload: Workload,
    slo: Slo,
    *,
    workers: int | None = None,
    max_configs: int | None = None,
) -> tuple[list[Candidate], Verdict]:
    """Enumerate, simulate and decide. ``max_configs`` keeps the first candidates (colocated ones first)."""
    deployments = enumerate_deployments(cluster, space)
    if max_configs is not None:
        deployments = deployments[:max_configs]
    if not deployments:
        raise ConfigError(
            f"no deployment of {cluster.model.name} fits in {space.gpus} {cluster.gpu.name} GPU(s)"
        )
    candidates = evaluate(cluster, deployments, workload, slo, workers=workers)
    return candidates, verdict(cluster, candidates, workload, slo, gpu_budget=space.gpus)

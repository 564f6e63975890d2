"""The simulator against closed forms, a brute-force reference, and the directions physics dictates."""

from __future__ import annotations

import numpy as np
import pytest

from conductor.perf.hardware import gpu_by_name, link_by_name
from conductor.perf.latency import DistServeFit, LatencyProvider, build_latency_provider
from conductor.perf.models import model_by_name
from kvstore.errors import ConfigError, InvalidArgument
from planner.goodput import find_goodput
from planner.metrics import Slo
from planner.sim import (
    Architecture,
    ClusterSpec,
    Deployment,
    InstanceGroup,
    PrefixCacheSpec,
    simulate,
)
from planner.workload import Workload, synthetic

SLO = Slo(0.25, 0.1)


def _colocated(count: int = 1, tp: int = 1, **kw) -> Deployment:
    return Deployment(Architecture.COLOCATED, colocated=InstanceGroup(count, tp), **kw)


def _poisson(count: int, rate: float, prompt: int, output: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, count)
    gaps[0] = 0.0
    return Workload("poisson", np.cumsum(gaps), np.full(count, prompt), np.full(count, output))


@pytest.mark.parametrize(("rho", "tolerance"), [(0.5, 0.06), (0.8, 0.12)])
def test_queue_wait_matches_md1_closed_form(rho: float, tolerance: float) -> None:
    # One server, deterministic service D (a prefill batch of exactly one request), Poisson arrivals:
    # Pollaczek-Khinchine gives the mean wait Wq = rho * D / (2 * (1 - rho)).
    service_s = 0.1
    cluster = ClusterSpec(
        model_by_name("opt-13b"), gpu_by_name("a100"), LatencyProvider.constant(service_s, 0.02)
    )
    deployment = _colocated(prefill_token_budget=100)
    workload = _poisson(60_000, rho / service_s, prompt=100, output=1, seed=7)
    result = simulate(cluster, deployment, workload)
    waits = result.queue_wait_s[1000:]  # drop the warm-up from an empty system
    expected = rho * service_s / (2 * (1 - rho))
    assert waits.mean() == pytest.approx(expected, rel=tolerance)
    # And TTFT is the wait plus exactly one service time.
    assert np.allclose(result.ttft_s - result.queue_wait_s, service_s)


def test_queue_wait_is_zero_for_deterministic_arrivals_below_capacity() -> None:
    cluster = ClusterSpec(
        model_by_name("opt-13b"), gpu_by_name("a100"), LatencyProvider.constant(0.1, 0.02)
    )
    arrivals = np.arange(200) * 0.15  # D/D/1 at rho = 2/3: nobody waits
    workload = Workload("periodic", arrivals, np.full(200, 100), np.ones(200, dtype=np.int64))
    result = simulate(cluster, _colocated(prefill_token_budget=100), workload)
    assert np.allclose(result.queue_wait_s, 0.0)


def _reference_colocated(fit: DistServeFit, workload: Workload, budget: int) -> np.ndarray:
    """Iteration-by-iteration model of one colocated instance (prefill priority), for cross-checking."""
    arrival, prompt, output = workload.arrival_s, workload.prompt_tokens, workload.output_tokens
    n = len(arrival)
    finish = np.full(n, np.nan)
    queue: list[int] = []
    running: dict[int, int] = {}  # request -> tokens still to generate
    context: dict[int, int] = {}
    t, nxt = 0.0, 0
    while nxt < n or queue or running:
        while nxt < n and arrival[nxt] <= t:
            queue.append(nxt)
            nxt += 1
        if queue:
            batch, tokens = [], 0
            while queue and (not batch or tokens + prompt[queue[0]] <= budget):
                rid = queue.pop(0)
                batch.append(rid)
                tokens += int(prompt[rid])
            t += fit.prefill_s([int(prompt[r]) for r in batch], [0] * len(batch))
            for rid in batch:
                if output[rid] == 1:
                    finish[rid] = t
                else:
                    running[rid] = int(output[rid]) - 1
                    context[rid] = int(prompt[rid]) + 1
        elif running:
            fixed, per_ctx = fit.decode_coeffs(len(running))
            t += fixed + per_ctx * sum(context.values())
            for rid in list(running):
                running[rid] -= 1
                context[rid] += 1
                if running[rid] == 0:
                    finish[rid] = t
                    del running[rid], context[rid]
        else:
            t = arrival[nxt]
    return finish


def test_closed_form_decode_runs_match_iteration_by_iteration_reference(
    opt13b_cluster: ClusterSpec,
) -> None:
    # The simulator jumps over runs of decode iterations and cuts them when a request arrives; a naive
    # per-iteration loop must give the same finish times.
    workload = synthetic("sharegpt", 120, rate_per_s=3.0, seed=3)
    fit = opt13b_cluster.latency.for_tp(1)
    assert isinstance(fit, DistServeFit)
    result = simulate(opt13b_cluster, _colocated(prefill_token_budget=4096), workload)
    expected = _reference_colocated(fit, workload, budget=4096)
    assert np.allclose(result.finish_s, expected, rtol=0, atol=1e-6)


def test_higher_rate_does_not_lower_ttft(opt13b_cluster: ClusterSpec) -> None:
    workload = synthetic("sharegpt", 600, seed=5)
    means = [
        simulate(opt13b_cluster, _colocated(), workload.at_rate(rate)).ttft_s.mean()
        for rate in (0.5, 2.0, 4.0)
    ]
    assert means[0] <= means[1] <= means[2]
    assert means[2] > means[0] * 1.5


def test_more_gpus_do_not_lower_goodput(opt13b_cluster: ClusterSpec) -> None:
    workload = synthetic("sharegpt", 500, seed=2)
    one = find_goodput(opt13b_cluster, _colocated(1), workload, SLO)
    two = find_goodput(opt13b_cluster, _colocated(2), workload, SLO)
    assert one.rate_per_s > 0
    assert two.rate_per_s >= one.rate_per_s
    disagg_small = Deployment(
        Architecture.DISAGGREGATED, prefill=InstanceGroup(1), decode=InstanceGroup(1)
    )
    disagg_large = Deployment(
        Architecture.DISAGGREGATED, prefill=InstanceGroup(2), decode=InstanceGroup(2)
    )
    assert (
        find_goodput(opt13b_cluster, disagg_large, workload, SLO).rate_per_s
        >= find_goodput(opt13b_cluster, disagg_small, workload, SLO).rate_per_s
    )


def test_chunked_prefill_lowers_tpot_tail_on_long_prompts(shared_data) -> None:
    # Llama-3-8B on one H100 (roofline latency), 8k-token prompts: a whole-prompt prefill stalls every
    # running decode; chunks of 512 tokens carry the decodes along.
    model, gpu = model_by_name("llama-3-8b"), gpu_by_name("h100")
    cluster = ClusterSpec(model, gpu, build_latency_provider("roofline", model, gpu))
    workload = synthetic("long", 300, rate_per_s=1.0, seed=11)
    plain = simulate(cluster, _colocated(), workload)
    chunked = simulate(
        cluster,
        Deployment(Architecture.CHUNKED, colocated=InstanceGroup(1), chunk_tokens=512),
        workload,
    )
    assert np.percentile(chunked.tpot_s, 99) < 0.8 * np.percentile(plain.tpot_s, 99)
    # The price: prefill takes more iterations, so TTFT is not better.
    assert np.median(chunked.ttft_s) >= np.median(plain.ttft_s)


def test_disaggregated_transfer_bytes_and_slow_links(opt13b_cluster: ClusterSpec) -> None:
    workload = synthetic("sharegpt", 300, rate_per_s=2.0, seed=4)
    kv_bpt = opt13b_cluster.model.kv_bytes_per_token(opt13b_cluster.kv_dtype)
    results = {}
    for name in ("nvlink-a100", "eth-25g"):
        dep = Deployment(
            Architecture.DISAGGREGATED,
            prefill=InstanceGroup(1),
            decode=InstanceGroup(1),
            link=link_by_name(name),
            layerwise_transfer=False,
        )
        results[name] = simulate(opt13b_cluster, dep, workload)
    multi_token = workload.output_tokens > 1
    moved = int((workload.prompt_tokens[multi_token] * kv_bpt).sum())
    assert results["nvlink-a100"].kv_transfer_bytes == moved
    fast, slow = results["nvlink-a100"], results["eth-25g"]
    # 25 Gb/s moves an OPT-13B prompt (800 KB per token) in about 0.26 ms per token.
    one = int(np.argmax(multi_token))
    assert slow.transfer_s[one] >= workload.prompt_tokens[one] * kv_bpt / 3.125e9 - 1e-9
    assert np.mean(slow.tpot_s) > np.mean(fast.tpot_s)
    # TTFT ends at the prefill: the transfer does not count there.
    assert np.allclose(slow.ttft_s, fast.ttft_s)


def test_layerwise_pipelining_hides_transfer(opt13b_cluster: ClusterSpec) -> None:
    workload = synthetic("sharegpt", 200, rate_per_s=1.0, seed=8)
    exposed = {}
    for layerwise in (False, True):
        dep = Deployment(
            Architecture.DISAGGREGATED,
            prefill=InstanceGroup(1),
            decode=InstanceGroup(1),
            link=link_by_name("eth-100g"),
            layerwise_transfer=layerwise,
        )
        exposed[layerwise] = simulate(opt13b_cluster, dep, workload).transfer_s.mean()
    assert exposed[True] < 0.5 * exposed[False]


def test_prefix_reuse_skips_cached_prefill(opt13b_cluster: ClusterSpec) -> None:
    # Every prompt shares its first three 512-token blocks (a system prompt), then has its own block.
    count = 200
    rng = np.random.default_rng(1)
    arrival = np.cumsum(rng.exponential(1.0, count))
    arrival -= arrival[0]
    blocks = tuple((0, 1, 2, 1000 + i) for i in range(count))
    workload = Workload("shared-prefix", arrival, np.full(count, 1900), np.full(count, 20), blocks)
    plain = Deployment(
        Architecture.DISAGGREGATED, prefill=InstanceGroup(1), decode=InstanceGroup(1)
    )
    reuse = Deployment(
        Architecture.DISAGGREGATED,
        prefill=InstanceGroup(1),
        decode=InstanceGroup(1),
        prefix_cache=PrefixCacheSpec(1_000_000),
    )
    base, cached = (
        simulate(opt13b_cluster, plain, workload),
        simulate(opt13b_cluster, reuse, workload),
    )
    assert base.cached_tokens.sum() == 0
    assert list(cached.cached_tokens) == [0] + [1536] * (count - 1)
    kv_bpt = opt13b_cluster.model.kv_bytes_per_token(opt13b_cluster.kv_dtype)
    assert cached.cache_load_bytes == 1536 * (count - 1) * kv_bpt
    assert np.median(cached.ttft_s) < 0.5 * np.median(base.ttft_s)
    assert cached.cache_hit_rate == pytest.approx(3 * (count - 1) / (4 * count))


def test_request_larger_than_an_instance_is_rejected_not_lost(opt13b_cluster: ClusterSpec) -> None:
    capacity = opt13b_cluster.kv_capacity_tokens(1, 1)
    prompts = np.array([500, capacity + 10, 500])
    workload = Workload("one-too-big", np.array([0.0, 0.1, 0.2]), prompts, np.array([10, 10, 10]))
    result = simulate(opt13b_cluster, _colocated(), workload)
    assert list(result.rejected) == [False, True, False]
    assert np.isinf(result.ttft_s[1]) and np.isfinite(result.ttft_s[[0, 2]]).all()
    assert result.attainment(SLO)[0] == pytest.approx(2 / 3)


def test_deployment_validation() -> None:
    with pytest.raises(InvalidArgument):
        Deployment(Architecture.DISAGGREGATED, colocated=InstanceGroup(1))
    with pytest.raises(InvalidArgument):
        Deployment(Architecture.COLOCATED, prefill=InstanceGroup(1), decode=InstanceGroup(1))
    with pytest.raises(InvalidArgument):
        InstanceGroup(0)


def test_unfit_deployment_is_refused(opt13b_cluster: ClusterSpec) -> None:
    with pytest.raises(ConfigError):  # no DistServe fit for TP=8 of OPT-13B
        simulate(opt13b_cluster, _colocated(tp=8), synthetic("sharegpt", 10))

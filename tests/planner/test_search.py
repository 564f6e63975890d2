"""The search: candidate enumeration, a verdict with reasons, and rules of thumb emerging from runs."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conductor.perf.hardware import link_by_name
from kvstore.cli.main import app
from planner.metrics import Slo
from planner.search import Decision, SearchSpace, enumerate_deployments, search
from planner.sim import Architecture, ClusterSpec
from planner.workload import synthetic

SLO = Slo(0.25, 0.1)


def test_enumeration_is_maximal_and_within_budget(opt13b_cluster: ClusterSpec) -> None:
    space = SearchSpace(4, link_by_name("nvlink-a100"), chunk_tokens=(512,), pp_degrees=(1,))
    deployments = enumerate_deployments(opt13b_cluster, space)
    labels = [d.label for d in deployments]
    assert len(labels) == len(set(labels))
    assert all(d.gpus <= 4 for d in deployments)
    colocated = [d for d in deployments if d.architecture is not Architecture.DISAGGREGATED]
    assert {d.colocated.tp for d in colocated if d.colocated} == {1, 2, 4}
    disagg = [d for d in deployments if d.architecture is Architecture.DISAGGREGATED]
    assert disagg and all(d.prefill and d.decode for d in disagg)
    for d in disagg:
        assert d.prefill is not None and d.decode is not None
        left = 4 - d.gpus
        assert left < d.prefill.tp * d.prefill.pp and left < d.decode.tp * d.decode.pp
    # TP=4 prefill leaves no room for a decode instance in 4 GPUs.
    assert not any(d.prefill.tp == 4 for d in disagg if d.prefill)


def test_search_returns_a_verdict_with_reasons(opt13b_cluster: ClusterSpec) -> None:
    space = SearchSpace(4, link_by_name("nvlink-a100"), chunk_tokens=(512,), pp_degrees=(1,))
    workload = synthetic("sharegpt", 400, seed=1)
    candidates, verdict = search(opt13b_cluster, space, workload, SLO, workers=2)
    assert candidates == sorted(candidates, key=lambda c: (-c.per_gpu, c.deployment.gpus))
    assert verdict.decision in (Decision.COLOCATE, Decision.DISAGGREGATE)
    assert verdict.best_colocated is not None and verdict.best_disaggregated is not None
    assert verdict.ratio == pytest.approx(
        verdict.best_disaggregated.per_gpu / verdict.best_colocated.per_gpu
    )
    text = " ".join(verdict.reasons)
    for needle in (
        "goodput per GPU",
        "limited by",
        "TPOT p90",
        "KV transfer",
        "weights duplicated",
    ):
        assert needle in text
    expected = Decision.DISAGGREGATE if verdict.ratio > 1.05 else Decision.COLOCATE
    assert verdict.decision is expected


def test_one_gpu_cannot_disaggregate(opt13b_cluster: ClusterSpec) -> None:
    space = SearchSpace(1, link_by_name("nvlink-a100"), chunk_tokens=(512,), pp_degrees=(1,))
    _, verdict = search(opt13b_cluster, space, synthetic("sharegpt", 300, seed=1), SLO, workers=1)
    assert verdict.decision is Decision.COLOCATE
    assert verdict.best_disaggregated is None
    assert "no disaggregated deployment fits" in verdict.reasons[0]


def test_slow_network_lowers_disaggregated_goodput(opt13b_cluster: ClusterSpec) -> None:
    # Nothing in the search knows that slow links hurt disaggregation; the simulated transfers say so.
    workload = synthetic("sharegpt", 400, seed=1)
    best = {}
    for name in ("nvlink-a100", "custom"):
        link = link_by_name(name, 0.5 if name == "custom" else None)
        space = SearchSpace(
            4, link, include_colocated=False, pp_degrees=(1,), layerwise_transfer=False
        )
        candidates, _ = search(opt13b_cluster, space, workload, SLO, workers=2)
        best[name] = candidates[0].per_gpu
    assert best["custom"] < 0.8 * best["nvlink-a100"]


def test_cli_search_json(shared_data, tmp_path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "search",
            "--gpus",
            "2",
            "--requests",
            "300",
            "--pp",
            "1",
            "--chunk",
            "512",
            "--link",
            "nvlink-a100",
            "--json",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["verdict"] in ("colocate", "disaggregate")
    assert doc["reasons"] and doc["candidates"]
    assert (tmp_path / "search.png").stat().st_size > 10_000


def test_cli_simulate_json(shared_data, tmp_path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "simulate",
            "--mode",
            "disagg",
            "--tp-p",
            "2",
            "--requests",
            "300",
            "--rate",
            "2",
            "--json",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    summary = doc["summary"]
    for key in ("ttft_s", "tpot_s", "queue_wait_s"):
        assert set(summary[key]) >= {"p50", "p90", "p99"}
    assert summary["slo"]["attainment"] > 0.5
    assert summary["kv_bytes_moved"]["prefill_to_decode"] > 0
    assert summary["gpu_memory"]["duplicated_weights_bytes"] > 0
    assert summary["energy"]["per_request_j"] > 0
    assert (tmp_path / "latency_cdf.png").is_file()

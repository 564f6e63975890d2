"""Latency models: DistServe fits, tables (SplitwiseSim and a measured profile), the roofline."""

from __future__ import annotations

import json

import pytest

from conductor.perf.hardware import gpu_by_name
from conductor.perf.latency import (
    PROFILE_SCHEMA,
    DistServeFit,
    LatencyModel,
    LatencySource,
    TableLatency,
    build_latency_provider,
)
from conductor.perf.models import model_by_name
from kvstore.errors import ConfigError


def test_distserve_fit_reads_the_published_coefficients(shared_data) -> None:
    model, gpu = model_by_name("opt-13b"), gpu_by_name("a100")
    provider = build_latency_provider("distserve", model, gpu, data=shared_data)
    assert provider.tp_degrees == [1, 2, 4]
    fit = provider.for_tp(1)
    assert isinstance(fit, DistServeFit) and isinstance(fit, LatencyModel)
    # 18.10 + 0.1019*512 + 7.12e-6*512^2 ms, from profiler-a100-80g.distserve.json
    assert fit.prefill_s([512], [0]) == pytest.approx(
        (18.10254647486372 + 0.1019122572698738 * 512 + 7.122264314252114e-06 * 512**2) / 1000
    )
    fixed, per_ctx = fit.decode_coeffs(10)  # below the batch threshold of 95: the small-batch fit
    assert fixed == pytest.approx((19.934702624895458 + 0.03850697740828398 * 10) / 1000)
    assert per_ctx == pytest.approx(0.0006269356524350583 / 1000)
    assert fit.decode_coeffs(200)[1] == pytest.approx(0.0005798000403396046 / 1000)
    assert provider.kv_capacity[(1, 1)] == 66144  # max_num_tokens.csv


def test_chunking_conserves_attention_work_and_pays_intercepts(shared_data) -> None:
    fit = build_latency_provider(
        "distserve", model_by_name("opt-13b"), gpu_by_name("a100"), data=shared_data
    ).for_tp(1)
    whole = fit.prefill_s([2048], [0])
    chunks = sum(fit.prefill_s([512], [prior]) for prior in (0, 512, 1024, 1536))
    intercept = fit.prefill[0] / 1000
    assert chunks == pytest.approx(whole + 3 * intercept)
    # SARATHI-Serve measured 1.15-1.19x for 512-token chunks of 2-4k prompts (figure-9 csv); the fit's
    # implied overhead is in the same range.
    assert 1.1 < chunks / whole < 1.3


def test_splitwise_table(shared_data) -> None:
    provider = build_latency_provider(
        "splitwise", model_by_name("llama-2-70b"), gpu_by_name("h100"), data=shared_data
    )
    assert provider.tp_degrees == [2, 4, 8]
    table = provider.for_tp(8)
    assert isinstance(table, TableLatency)
    # Measured points are reproduced (mean of repeats) and interpolated between.
    at_8k = table.prefill_s([8192], [0])
    assert 0.7 < at_8k < 0.95
    assert table.prefill_s([1024], [0]) < table.prefill_s([2048], [0]) < at_8k
    assert table.prefill_s([16384], [0]) > at_8k  # extrapolated linearly beyond the last point
    assert 0.025 < table.decode_coeffs(1)[0] < 0.035
    assert table.decode_coeffs(64)[0] > table.decode_coeffs(1)[0]


def test_auto_picks_profiles_then_roofline(shared_data) -> None:
    a100, h100 = gpu_by_name("a100"), gpu_by_name("h100")
    assert (
        build_latency_provider("auto", model_by_name("opt-66b"), a100, data=shared_data).source
        is LatencySource.DISTSERVE
    )
    assert (
        build_latency_provider("auto", model_by_name("llama-2-70b"), h100, data=shared_data).source
        is LatencySource.SPLITWISE
    )
    assert (
        build_latency_provider("auto", model_by_name("llama-3-70b"), h100, data=shared_data).source
        is LatencySource.ROOFLINE
    )
    with pytest.raises(ConfigError):
        build_latency_provider("distserve", model_by_name("opt-13b"), h100, data=shared_data)
    with pytest.raises(ConfigError):
        build_latency_provider("telepathy", model_by_name("opt-13b"), a100)


def test_roofline_scales_with_work() -> None:
    model, gpu = model_by_name("llama-3-70b"), gpu_by_name("h100")
    provider = build_latency_provider("roofline", model, gpu)
    tp4, tp8 = provider.for_tp(4), provider.for_tp(8)
    assert tp8.prefill_s([8192], [0]) < tp4.prefill_s([8192], [0])
    # Causal attention: a chunk after a long prefix costs more than the same chunk alone.
    assert tp8.prefill_s([512], [60000]) > tp8.prefill_s([512], [0])
    fixed, per_ctx = tp8.decode_coeffs(1)
    weights_s = model.weight_bytes(tp8.weight_dtype) / (gpu.hbm_bytes_per_s * tp8.mbu * 8)
    # two ring all-reduces per layer of one row of activations, each with its latency
    allreduce_s = (
        model.layers * 2 * (10e-6 + model.hidden_size * 2 * 2 * 7 / 8 / gpu.nvlink_bytes_per_s)
    )
    assert fixed == pytest.approx(weights_s + allreduce_s + tp8.overhead_s)
    assert provider.for_tp(1).decode_coeffs(1)[0] == pytest.approx(
        model.weight_bytes(tp8.weight_dtype) / (gpu.hbm_bytes_per_s * tp8.mbu) + tp8.overhead_s
    )
    # A chunked iteration pays its decodes' KV reads on top of the chunk's GEMMs.
    chunk = tp8.mixed_s([512], [0], 0, 0)
    assert tp8.mixed_s([512], [0], 32, 32 * 4096) == pytest.approx(
        chunk
        + 32 * 4096 * per_ctx
        + (tp8._linear_s(544) - tp8._linear_s(512))
        + (tp8._allreduce_s(544) - tp8._allreduce_s(512))
    )
    assert per_ctx > 0


def test_measured_engine_profile_plugs_in(tmp_path) -> None:
    # The schema kvtier's reference engines will emit: prefill and decode timings, here synthetic
    # points on DistServe-shaped lines so the fit can be checked exactly.
    doc = {
        "schema": PROFILE_SCHEMA,
        "model": "tiny",
        "gpu": "h100-80g",
        "tp": 2,
        "prefill": [{"tokens": t, "time_ms": 5 + 0.01 * t} for t in (128, 512, 2048)],
        "decode": [
            {"batch_size": b, "context_tokens": c, "time_ms": 4 + 0.05 * b + 0.0002 * b * c}
            for b in (1, 8, 32)
            for c in (256, 2048)
        ],
    }
    path = tmp_path / "engine-profile.json"
    path.write_text(json.dumps(doc))
    provider = build_latency_provider(str(path), model_by_name("llama-3-8b"), gpu_by_name("h100"))
    assert provider.source is LatencySource.PROFILE and provider.tp_degrees == [2]
    lat = provider.for_tp(2)
    assert lat.prefill_s([1024], [0]) == pytest.approx((5 + 0.01 * 1024) / 1000)
    fixed, per_ctx = lat.decode_coeffs(8)
    assert fixed == pytest.approx((4 + 0.05 * 8) / 1000)
    assert per_ctx == pytest.approx(0.0002 / 1000)
    doc["schema"] = "something-else"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError):
        build_latency_provider(str(path), model_by_name("llama-3-8b"), gpu_by_name("h100"))

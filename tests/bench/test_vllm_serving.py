"""``bench/vllm_serving.py``'s pure parts: trace scaling, prompt synthesis, reuse counting, the
summary and the JSON/table assembly. No vLLM runs here (the benchmark itself is not a test)."""

from __future__ import annotations

import json

import pytest

from bench import vllm_serving as vs
from planner.trace import TraceRequest


def _req(ids: tuple[int, ...], input_length: int, ts: int = 0) -> TraceRequest:
    return TraceRequest(timestamp_ms=ts, input_length=input_length, output_length=4,
                        hash_ids=ids)


def test_equal_block_ids_give_equal_token_blocks() -> None:
    a = vs.BenchRequest(0, 0, (0, 5, 9), vs.BLOCK_TOKENS)
    b = vs.BenchRequest(1, 0, (0, 5, 7, 8), 3)
    pa, pb = vs.prompt_ids(a), vs.prompt_ids(b)
    k = vs.BLOCK_TOKENS
    assert len(pa) == 3 * k and len(pb) == 3 * k + 3
    assert pa[:2 * k] == pb[:2 * k]                  # blocks 0 and 5 agree
    assert pa[2 * k:] != pb[2 * k:3 * k]              # 9 and 7 differ
    assert pb[2 * k:3 * k] == vs.block_tokens(7)
    assert pb[3 * k:] == vs.block_tokens(8)[:3]       # a partial block is a prefix of its block
    assert all(3 <= t < vs.SPEC.vocab_size for t in pa + pb)
    assert vs.block_tokens(5) == vs.block_tokens(5) and vs.block_tokens(5) != vs.block_tokens(6)


def test_scaling_maps_512_token_blocks_to_vllm_blocks() -> None:
    scale = vs.TRACE_BLOCK_TOKENS // vs.BLOCK_TOKENS
    full = vs.scale(0, _req((0, 1, 2), 3 * 512))
    assert full.block_ids == (0, 1, 2) and full.prompt_tokens == 3 * vs.BLOCK_TOKENS
    partial = vs.scale(0, _req((0, 1, 2), 2 * 512 + 100))
    assert partial.last_block_tokens == -(-100 // scale)
    tiny = vs.scale(0, _req((0, 1), 512 + 1))
    assert tiny.last_block_tokens == 1
    cut = vs.scale(0, _req(tuple(range(40)), 40 * 512 - 7), max_blocks=32)
    assert cut.block_ids == tuple(range(32)) and cut.last_block_tokens == vs.BLOCK_TOKENS


def test_conversations_keep_every_turn_in_trace_order() -> None:
    trace = [_req((0, 1, 2), 1536, 0), _req((0, 3), 1024, 1), _req((0, 4), 900, 2),
             _req((0, 1, 2, 5), 2048, 3), _req((0, 3, 6), 1400, 4), _req((0,), 100, 5)]
    picked = vs.select_conversations(trace, 1)
    assert [r.trace_index for r in picked] == [0, 3]
    picked = vs.select_conversations(trace, 5)
    assert [r.trace_index for r in picked] == [0, 1, 3, 4]  # (0, 4) is a single request


def test_reuse_counts_full_blocks_and_the_other_instance() -> None:
    k = vs.BLOCK_TOKENS
    reqs = [vs.BenchRequest(0, 0, (0, 1), k),          # instance 0: computes 0, 1
            vs.BenchRequest(1, 0, (0, 1, 2), k),       # instance 1: reuses 0, 1 (other's)
            vs.BenchRequest(2, 0, (0, 1, 2), k),       # instance 0: 0, 1 own, 2 from 1; but the
            vs.BenchRequest(3, 0, (0, 7), 5)]          # whole prompt never; 0 from instance 0
    reuse = vs.reuse_of(reqs)
    assert reuse.blocks == 2 + 3 + 3 + 1
    assert reuse.reusable_blocks == 0 + 2 + 2 + 1
    assert reuse.cross_instance_blocks == 0 + 2 + 0 + 1
    assert reuse.cross_instance_share == pytest.approx(3 / 5)


def _record(tokens: list[int], ttft: float, ext: int = 0, **connector: float
            ) -> vs.RequestRecord:
    return vs.RequestRecord(prompt_tokens=100, cached_tokens=ext, external_hit_tokens=ext,
                            local_hit_tokens=0, ttft_s=ttft, tpot_s=0.01, wall_s=ttft + 0.07,
                            token_ids=tokens, connector=dict(connector))


def test_assembly_ratios_goals_and_identity() -> None:
    alone = vs.ModeResult("vllm-alone", requests=[_record([1, 2], 1.0), _record([3, 4], 3.0)])
    kv = vs.ModeResult("kvtier", requests=[
        _record([1, 2], 0.5, ext=64, loaded_blocks=2, loaded_bytes=2048, load_seconds=0.004,
                saved_blocks=1, saved_bytes=1024, save_seconds=0.002),
        _record([3, 4], 0.5)], memcpy_s=[0.001],
        cold_ttft_s=[1.02, 1.04], cold_baseline_ttft_s=[1.0, 1.0])
    lm = vs.ModeResult("lmcache", requests=[_record([1, 2], 0.9), _record([3, 5], 0.9)])
    moon = vs.ModeResult("mooncake", status="not run: no CUDA")
    doc = vs.assemble([alone, kv, lm, moon], vs.reuse_of([]), {"quick": True},
                      {"bench": "vllm-serving"})
    assert doc["ttft_speedup_vs_vllm_alone"] == pytest.approx(2.0 / 0.5)
    assert doc["ttft_ratio_vs_lmcache"] == pytest.approx(0.9 / 0.5)
    assert doc["load_vs_memcpy"] == pytest.approx(4.0)
    assert doc["cold_overhead"] == pytest.approx(0.03)
    assert doc["outputs_identical_by_mode"] == {"vllm-alone": True, "kvtier": True,
                                                "lmcache": False}
    assert doc["outputs_identical"] is False
    assert doc["goals"] == {"ttft_speedup_vs_vllm_alone": True, "load_vs_memcpy": False,
                            "ttft_ratio_vs_lmcache": True, "cold_overhead": True,
                            "outputs_identical": False}
    s = doc["modes"]["kvtier"]
    assert s["external_hit_ratio"] == pytest.approx(64 / 200)
    assert s["prefill_tokens"] == 200 - 64
    assert s["load_s_per_block"] == pytest.approx(0.002)
    assert s["save_s_per_block"] == pytest.approx(0.002)
    assert s["kv_loaded_bytes"] == 2048
    assert doc["modes"]["vllm-alone"]["kv_loaded_bytes"] is None
    assert doc["modes"]["mooncake"] == {"mode": "mooncake", "status": "not run: no CUDA",
                                        "notes": []}
    json.dumps(doc)  # serializable
    table = vs.format_table(doc)
    assert "| mooncake | not run: no CUDA |" in table
    assert ", +3.0%)" in table and "MISSED" in table


def test_missing_peers_leave_their_ratios_unmeasured() -> None:
    alone = vs.ModeResult("vllm-alone", requests=[_record([1], 1.0)])
    kv = vs.ModeResult("kvtier", requests=[_record([1], 0.25)])
    doc = vs.assemble([alone, kv, vs.ModeResult("lmcache", status="not run: install failed")],
                      vs.reuse_of([]), {}, {})
    assert doc["ttft_ratio_vs_lmcache"] is None
    assert doc["goals"]["ttft_ratio_vs_lmcache"] is None
    assert doc["outputs_identical"] is True
    assert "not measured" in vs.format_table(doc)


def test_percentile_interpolates() -> None:
    assert vs.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert vs.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    with pytest.raises(ValueError):
        vs.percentile([], 50)


def test_connector_counters_under_kvtier_names() -> None:
    kvtier = vs._connector_counters({"vllm:kvtier_loaded_bytes": 2048.0,
                                     "vllm:kvtier_load_seconds": 0.25,
                                     "vllm:prefix_cache_hits": 64.0})
    assert kvtier == {"loaded_bytes": 2048.0, "load_seconds": 0.25}
    mooncake = vs._connector_counters({
        "vllm:mooncake_store_operation_keys": 9.0,
        "vllm:mooncake_store_operation_keys[load_get]": 4.0,
        "vllm:mooncake_store_operation_keys[save_put]": 5.0,
        "vllm:mooncake_store_operation_bytes[load_get]": 4096.0,
        "vllm:mooncake_store_operation_time_seconds_sum[load_get]": 0.5})
    assert mooncake["loaded_blocks"] == 4 and mooncake["saved_blocks"] == 5
    assert mooncake["loaded_bytes"] == 4096 and mooncake["load_seconds"] == 0.5
    assert mooncake["saved_bytes"] == 0
    assert vs._connector_counters({"vllm:prefix_cache_hits": 1.0}) == {}


def test_each_instance_binds_its_model_to_its_own_core_in_every_mode() -> None:
    # vLLM alone would share core 0 between both instances while a connector instance took
    # both cores: the binding is what makes the modes like for like (model_core_env).
    assert [vs.model_core_env(i, cpus=2) for i in range(3)] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"},
        {"VLLM_CPU_OMP_THREADS_BIND": "0"}]
    assert vs.model_core_env(1, cpus=1) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}


def _prefilled(prompt: int, cached: int, ttft: float) -> vs.RequestRecord:
    return vs.RequestRecord(prompt_tokens=prompt, cached_tokens=cached, external_hit_tokens=0,
                            local_hit_tokens=cached, ttft_s=ttft, tpot_s=0.01, wall_s=ttft,
                            token_ids=[1])


def test_the_free_load_floor_is_alone_s_prefill_cost_at_each_mode_s_hits() -> None:
    truth = vs.PrefillModel(a_s=0.02, b_s=1e-3, d_s=1e-7)
    shapes = [(300, 0), (600, 100), (900, 32), (1000, 800), (128, 64), (700, 350)]
    alone = vs.ModeResult("vllm-alone", requests=[
        _prefilled(n, c, truth.ttft_s(n - c, c)) for n, c in shapes])
    fitted = vs.PrefillModel.fit(alone.requests)
    assert fitted is not None
    assert (fitted.a_s, fitted.b_s, fitted.d_s) == pytest.approx((0.02, 1e-3, 1e-7), rel=1e-6)
    # kvtier took 500 of 600 tokens from the store and was 20 ms slower than free loads.
    free = truth.ttft_s(100, 500)
    kv = vs.ModeResult("kvtier", requests=[_prefilled(600, 500, free + 0.02)])
    doc = vs.assemble([alone, kv], vs.reuse_of([]), {}, {})
    s = doc["modes"]["kvtier"]
    assert s["ttft_free_load_mean_s"] == pytest.approx(free)
    assert s["ttft_vs_free_load"] == pytest.approx((free + 0.02) / free)
    assert doc["modes"]["vllm-alone"]["ttft_vs_free_load"] == pytest.approx(1.0)
    assert f"({(free + 0.02) / free:.2f}x)" in vs.format_table(doc)
    assert vs.PrefillModel.fit(alone.requests[:3]) is None  # too few to fit three terms

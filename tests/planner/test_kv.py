"""KV sizing: the known Llama-3-70B case exactly, MLA, FP8, Hugging Face configs, pipelining."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from conductor.perf.hardware import GB, GIB, gpu_by_name, link_by_name
from conductor.perf.latency import ConstantLatency
from conductor.perf.models import DType, load_model, model_by_name
from kvstore.cli.main import app
from kvstore.errors import ConfigError
from planner.kv import exposed_transfer_s, plan_kv


def test_llama3_70b_fp16_known_case_exact() -> None:
    model = model_by_name("llama-3-70b")
    assert model.kv_bytes_per_token(DType.FP16) == 327_680
    plan = plan_kv(
        model,
        DType.FP16,
        8192,
        [link_by_name("roce-400g")],
        gpu=gpu_by_name("h100"),
        tp=8,
        latency=ConstantLatency(1.0, 0.03),
    )
    assert plan.total_bytes == 2_684_354_560
    assert plan.total_gib == 2.5
    assert plan.total_gb == pytest.approx(2.68, abs=0.005)
    transfer = plan.transfers[0]
    assert transfer.transfer_s == pytest.approx(2_684_354_560 / (45 * GB))
    assert transfer.transfer_s == pytest.approx(0.060, abs=0.001)


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("llama-3-8b", DType.BF16, 2 * 32 * 8 * 128 * 2),
        ("mistral-7b", DType.FP16, 2 * 32 * 8 * 128 * 2),
        ("qwen2.5-72b", DType.BF16, 2 * 80 * 8 * 128 * 2),
        ("llama-3-70b", DType.FP8, 163_840),
        ("deepseek-v3", DType.BF16, 61 * (512 + 64) * 2),  # MLA: one latent + RoPE key per layer
        ("opt-13b", DType.FP16, 2 * 40 * 40 * 128 * 2),
    ],
)
def test_kv_bytes_per_token_presets(name: str, dtype: DType, expected: int) -> None:
    assert model_by_name(name).kv_bytes_per_token(dtype) == expected


def test_hf_config_json(tmp_path) -> None:
    llama = {
        "model_type": "llama",
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
    }
    path = tmp_path / "Meta-Llama-3-70B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(llama))
    spec = load_model(config_path=path)
    assert spec.kv_bytes_per_token(DType.FP16) == 327_680
    assert spec.params == pytest.approx(
        70.6e9, rel=0.01
    )  # the estimate lands on the published count
    mla = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "vocab_size": 129280,
    }
    (tmp_path / "ds.json").write_text(json.dumps(mla))
    ds = load_model(config_path=tmp_path / "ds.json")
    assert ds.kv_bytes_per_token(DType.BF16) == 70_272
    assert ds.params == pytest.approx(671e9, rel=0.03)
    assert ds.compute_params == pytest.approx(37e9, rel=0.1)
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 4096}))
    with pytest.raises(ConfigError):
        load_model(config_path=tmp_path / "bad.json")


def test_unknown_names_fail_loudly() -> None:
    with pytest.raises(ConfigError):
        model_by_name("gpt-5")
    with pytest.raises(ConfigError):
        link_by_name("carrier-pigeon")
    with pytest.raises(ConfigError):
        DType.parse("int3")
    assert model_by_name("meta-llama/Meta-Llama-3-70B").name == "llama-3-70b"


def test_layerwise_pipelining_exposes_only_what_the_link_cannot_keep_up_with() -> None:
    # Link faster than compute: only the last layer's share is left after the prefill.
    assert exposed_transfer_s(0.06, 0.5, 80, pipelined=True) == pytest.approx(0.06 / 80)
    # Link slower than compute: the excess plus one layer of compute.
    assert exposed_transfer_s(1.0, 0.5, 10, pipelined=True) == pytest.approx(1.0 - 0.5 * 9 / 10)
    assert exposed_transfer_s(1.0, 0.5, 10, pipelined=False) == 1.0
    plan = plan_kv(
        model_by_name("llama-3-70b"),
        DType.FP16,
        8192,
        [link_by_name("roce-400g"), link_by_name("custom", 1.0)],
        gpu=gpu_by_name("h100"),
        tp=8,
        latency=ConstantLatency(0.5, 0.03),
    )
    fast, slow = plan.transfers
    assert fast.hidden_by_layer_pipelining and not slow.hidden_by_layer_pipelining
    assert slow.transfer_s == pytest.approx(2_684_354_560 / 1e9)


def test_cli_plan_kv_json(shared_data) -> None:
    result = CliRunner().invoke(
        app, ["plan", "kv", "--model", "llama-3-70b", "--tokens", "8192", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["bytes_per_token"] == 327_680
    assert doc["total_bytes"] == 8192 * 327_680
    roce = next(t for t in doc["transfers"] if t["link"] == "roce-400g")
    assert roce["transfer_s"] == pytest.approx(0.0597, abs=0.0005)
    assert doc["total_gib"] == 8192 * 327_680 / GIB


def test_cli_plan_kv_rejects_bad_input() -> None:
    result = CliRunner().invoke(app, ["plan", "kv", "--model", "no-such-model"])
    assert result.exit_code == 2
    assert "unknown model" in result.output

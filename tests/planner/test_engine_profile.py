"""The reference engine's measured profile plugs into the planner's latency models and simulator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("transformers")

from conductor.perf.latency import PROFILE_SCHEMA, TableLatency
from kvstore.cli.main import app
from kvstore.engine.model import ModelSpec
from kvstore.engine.profile import measure_profile

TINY = ModelSpec(vocab_size=500, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, head_dim=16, max_positions=512)


def test_measured_profile_has_every_point_and_loads_as_a_latency_table() -> None:
    profile = measure_profile(TINY, prefill_tokens=(16, 64, 128), decode_batches=(1, 2, 4),
                              decode_contexts=(32, 64), repeats=1)
    assert profile["schema"] == PROFILE_SCHEMA
    assert [p["tokens"] for p in profile["prefill"]] == [16, 64, 128]
    assert {(d["batch_size"], d["context_tokens"]) for d in profile["decode"]} == {
        (b, c) for b in (1, 2, 4) for c in (32, 64)}
    assert all(p["time_ms"] > 0 for p in profile["prefill"] + profile["decode"])
    table = TableLatency.from_profile(profile, "reference-engine")
    assert table.prefill_tokens == (16.0, 64.0, 128.0)
    assert table.decode_batch == (1.0, 2.0, 4.0)
    assert table.prefill_s([64], [0]) == pytest.approx(profile["prefill"][1]["time_ms"] / 1e3)


def test_simulate_runs_on_the_engines_own_profile(tmp_path: Path) -> None:
    profile = measure_profile(TINY, prefill_tokens=(16, 256, 1024), decode_batches=(1, 4),
                              decode_contexts=(64, 512), repeats=1)
    path = tmp_path / "engine.json"
    path.write_text(json.dumps(profile))
    result = CliRunner().invoke(app, ["plan", "simulate", "--latency", str(path), "--trace", "short",
                                      "--requests", "40", "--rate", "1", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["latency"] == "profile"
    assert doc["summary"]["completed"] == 40

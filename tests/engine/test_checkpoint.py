"""Workers serve a real Hugging Face checkpoint directory through the real loading code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.engine.model import ModelSpec, build_reference_model, load_model  # noqa: E402
from kvstore.engine.worker.config import WorkerConfig, load_worker_model  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402
from kvstore.membership.engines import EngineRole  # noqa: E402

TINY = ModelSpec(vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, head_dim=16, max_positions=256, seed=3)


def config(**overrides: object) -> WorkerConfig:
    return WorkerConfig(role=EngineRole.PREFILL, instance_id="p0", node_id="n0",
                        daemon_address="127.0.0.1:1", etcd_endpoint="127.0.0.1:2",
                        spec=TINY, **overrides)  # type: ignore[arg-type]


def test_a_saved_checkpoint_loads_and_computes_the_same_logits(tmp_path: Path) -> None:
    original = build_reference_model(TINY)
    original.save_pretrained(tmp_path / "ckpt")
    served = load_worker_model(config(model_path=tmp_path / "ckpt"))
    ids = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(served(input_ids=ids).logits, original(input_ids=ids).logits)
    # Without a path the worker builds the seeded reference model (seed 3), not another seed's.
    other = build_reference_model(dataclasses.replace(TINY, seed=4))
    with torch.no_grad():
        assert not torch.allclose(load_worker_model(config())(input_ids=ids).logits,
                                  other(input_ids=ids).logits)


def test_a_directory_without_a_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_model(tmp_path)

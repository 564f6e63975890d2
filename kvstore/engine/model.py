"""The reference model: a Hugging Face Llama-architecture transformer.

No weights can be downloaded here, so :func:`build_reference_model` builds one with random weights
from a fixed seed; :func:`load_model` loads a real checkpoint directory instead, and the rest of the
code does not care which. Sizes are chosen so that prefill of a few thousand tokens takes seconds on
a 2-core CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a Llama-architecture model (what the KV layout depends on)."""

    vocab_size: int = 32_000
    hidden_size: int = 512
    intermediate_size: int = 1_376
    num_layers: int = 8
    num_attention_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 64
    max_positions: int = 8_192
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_attention_heads", "num_kv_heads", "head_dim", "max_positions"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelSpec.{name} must be positive")
        if self.num_attention_heads % self.num_kv_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_kv_heads")


def build_reference_model(spec: ModelSpec | None = None, dtype: torch.dtype | None = None) -> Any:
    """A ``LlamaForCausalLM`` with random weights drawn from ``spec.seed`` (same seed, same model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or ModelSpec()
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_positions,
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    finally:
        torch.random.set_rng_state(generator_state)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def load_model(path: Path, device: str = "cpu", dtype: torch.dtype | None = None) -> Any:
    """Load a real Llama-architecture checkpoint from a local directory (no hub access)."""
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").exists():
        raise ConfigError(f"{path} is not a model directory (no config.json)")
    model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return model.to(device).eval()

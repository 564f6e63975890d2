"""The tiny reference model the engine tests share (a 2-layer Llama-architecture transformer
with random weights from a seed: fast on a 2-core CPU, real attention and KV)."""

from __future__ import annotations

from kvstore.engine.model import ModelSpec


def tiny_spec(seed: int = 7) -> ModelSpec:
    """2 layers, hidden 128, 4 heads over 2 KV heads of 32 dims, vocabulary 1,000."""
    return ModelSpec(vocab_size=1000, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_attention_heads=4, num_kv_heads=2, head_dim=32, max_positions=1024,
                     seed=seed)

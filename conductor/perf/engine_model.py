"""The engine the conductor prices decisions with when none is measured: its latency and KV block size.

:func:`default_engine_model` is Llama-3-70B with an FP16 KV cache on 8xH100-80G, costed by the
roofline of :mod:`conductor.perf.latency`. The scheduler, the in-process replay and the live replay
(:mod:`planner.replay`, :mod:`planner.live_replay`) all use it, so their decisions agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from conductor.perf.hardware import gpu_by_name
from conductor.perf.latency import LatencyModel, RooflineLatency
from conductor.perf.models import DType, model_by_name
from kvstore.errors import InvalidArgument


@dataclass(frozen=True)
class EngineModel:
    """The model every simulated instance runs: its latency and its KV block size."""

    label: str
    latency: LatencyModel
    block_size_tokens: int
    block_size_bytes: int

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0 or self.block_size_bytes <= 0:
            raise InvalidArgument("block sizes must be positive")


def default_engine_model(block_size_tokens: int = 512) -> EngineModel:
    """Llama-3-70B, FP16 KV, on 8xH100-80G (the planner's roofline), blocks of 512 tokens."""
    model = model_by_name("llama-3-70b")
    gpu = gpu_by_name("h100-80g")
    latency = RooflineLatency(model, gpu, 8)
    return EngineModel(f"{model.name} {gpu.name} tp8 (roofline)", latency, block_size_tokens,
                       model.kv_bytes_per_token(DType.FP16) * block_size_tokens)

"""Measure the reference engine's latency profile, for the planner (``kvtier plan profile-engine``).

Writes a ``kvtier.latency-profile/1`` document (see ``docs/planner.md``): prefill time per prompt
length, and decode step time per (batch size, context length). The planner fits DistServe's decode
form to it and interpolates prefill, so its simulations can use what this machine's engine really does
instead of a published GPU profile.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from typing import Any

from kvstore.engine.model import ModelSpec, build_reference_model

PROFILE_SCHEMA = "kvtier.latency-profile/1"


def _best_ms(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure_profile(spec: ModelSpec | None = None, *,
                    prefill_tokens: Sequence[int] = (64, 256, 512, 1024, 2048),
                    decode_batches: Sequence[int] = (1, 2, 4, 8),
                    decode_contexts: Sequence[int] = (256, 1024),
                    repeats: int = 3, device: str = "cpu") -> dict[str, Any]:
    """Time prefill and decode of the reference model (best of ``repeats``) and return the profile."""
    import torch

    spec = spec or ModelSpec()
    model = build_reference_model(spec).to(device)
    gen = torch.Generator().manual_seed(0)

    def tokens(batch: int, n: int) -> torch.Tensor:
        return torch.randint(0, spec.vocab_size, (batch, n), generator=gen).to(device)

    prefill = []
    with torch.no_grad():
        model(input_ids=tokens(1, 8), use_cache=True)  # warm-up: first calls pay one-off setup
        for n in prefill_tokens:
            ids = tokens(1, n)
            ms = _best_ms(lambda ids=ids: model(input_ids=ids, use_cache=True), repeats)
            prefill.append({"tokens": int(n), "time_ms": round(ms, 3)})
        decode = []
        for ctx in decode_contexts:
            for batch in decode_batches:
                past = model(input_ids=tokens(batch, ctx), use_cache=True).past_key_values
                step = tokens(batch, 1)

                def one_step(past: Any = past, step: torch.Tensor = step) -> None:
                    model(input_ids=step, past_key_values=past, use_cache=True)
                    past.crop(-1)  # drop the appended token: every repeat sees the same context

                ms = _best_ms(one_step, repeats)
                decode.append({"batch_size": int(batch), "context_tokens": int(ctx),
                               "time_ms": round(ms, 3)})
    return {
        "schema": PROFILE_SCHEMA,
        "model": f"kvtier-reference-llama-{spec.num_layers}L-{spec.hidden_size}d",
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else
        f"cpu:{platform.processor() or platform.machine()}x{torch.get_num_threads()}",
        "tp": 1,
        "prefill": prefill,
        "decode": decode,
    }

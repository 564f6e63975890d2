"""The colocated engine on a real (small) transformer: batched ragged decode and chunked prefill
give exactly the single-request greedy tokens."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.engine.colocated import (  # noqa: E402
    ColocatedConfig,
    ColocatedEngine,
    ColocatedRequest,
    SchedulerMode,
    reference_generate,
)
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.errors import ConfigError, InvalidArgument  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

SPEC = tiny_spec(seed=3)
LENGTHS = (1, 7, 33, 64, 150, 301)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model() -> object:
    return build_reference_model(SPEC)


@pytest.fixture(scope="module")
def requests() -> list[ColocatedRequest]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, SPEC.vocab_size, (n,), generator=gen).tolist()
        # All arrive at once, so decodes of different lengths share batches whatever the
        # machine's speed (1 ms apart, an idle box finished r0 before r2 arrived: batches of 2).
        out.append(ColocatedRequest(f"r{i}", ids, arrival_s=0.0,
                                    max_new_tokens=NEW_TOKENS - (i % 2)))
    return out


@pytest.fixture(scope="module")
def reference(model: object, requests: list[ColocatedRequest]) -> list[list[int]]:
    return [reference_generate(model, r.token_ids, r.max_new_tokens) for r in requests]


@pytest.mark.parametrize("config", [
    ColocatedConfig(SchedulerMode.CONTINUOUS_BATCHING),
    ColocatedConfig(SchedulerMode.CHUNKED_PREFILL, token_budget=64, max_batch=8),
    ColocatedConfig(SchedulerMode.CHUNKED_PREFILL, token_budget=17, max_batch=4),
], ids=["continuous", "chunked-64", "chunked-17-max4"])
def test_outputs_equal_single_request_reference(model: object,
                                                requests: list[ColocatedRequest],
                                                reference: list[list[int]],
                                                config: ColocatedConfig) -> None:
    engine = ColocatedEngine(model, config)
    done: list[str] = []
    results = engine.serve(requests, on_done=lambda r: done.append(r.request_id))
    assert [r.tokens for r in results] == reference
    assert sorted(done) == sorted(r.request_id for r in requests)
    # Ragged batches really happened (several sequences of different lengths in one step).
    assert max(engine.decode_batch_sizes) >= 3
    if config.mode is SchedulerMode.CONTINUOUS_BATCHING:
        assert all(r.prefill_chunks == 1 for r in results)
    else:
        # A long prompt took several chunks, each within the budget.
        for req, res in zip(requests, results, strict=True):
            assert res.prefill_chunks >= -(-len(req.token_ids) // config.token_budget)
        assert results[-1].prefill_chunks > 1
    assert config.max_batch >= max(engine.decode_batch_sizes)
    # The forward accounting covers every prompt token and every decode step, and padding
    # is only part of the decode time.
    stats = engine.forward_stats
    assert stats.prefill_tokens == sum(len(r.token_ids) for r in requests)
    assert stats.decode_steps == sum(engine.decode_batch_sizes.values())
    assert 0 < stats.pad_s < stats.decode_s
    assert stats.prefill_s >= sum(r.prefill_compute_s for r in results) * 0.999
    for req, res in zip(requests, results, strict=True):
        assert res.computed_tokens == len(req.token_ids)
        assert 0 <= res.queue_wait_s <= res.ttft_s
        assert res.first_token_s <= res.finish_s


def test_later_arrival_waits_for_its_time(model: object) -> None:
    engine = ColocatedEngine(model)
    reqs = [ColocatedRequest("a", [1, 2, 3], 0.0, 2), ColocatedRequest("b", [4, 5], 0.2, 2)]
    a, b = engine.serve(reqs)
    assert b.prefill_start_s >= 0.2
    assert a.tokens == reference_generate(model, [1, 2, 3], 2)


def test_config_and_request_validation() -> None:
    with pytest.raises(ConfigError):
        ColocatedConfig(SchedulerMode.CHUNKED_PREFILL, token_budget=8, max_batch=8)
    with pytest.raises(ConfigError):
        ColocatedConfig("chunked_prefill")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        ColocatedRequest("x", [], 0.0, 1)
    with pytest.raises(InvalidArgument):
        ColocatedRequest("x", [1], 0.0, 0)

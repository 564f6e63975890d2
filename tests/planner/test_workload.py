"""Traces: the shared Mooncake and Azure files, synthetic workloads, rate scaling, the prefix cache."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.errors import ConfigError
from planner.prefix_cache import PrefixCache
from planner.workload import load_azure, load_mooncake, load_trace, synthetic


def test_mooncake_trace_from_shared_data(shared_data) -> None:
    wl = load_trace("mooncake", data=shared_data)
    assert len(wl) == 12_031
    assert wl.duration_s == pytest.approx(3537.0, abs=1.0)
    assert wl.block_ids is not None
    # hash_ids are one id per 512-token block
    lengths = np.array([len(b) for b in wl.block_ids])
    assert np.array_equal(lengths, np.ceil(wl.prompt_tokens / 512).astype(int))
    assert np.percentile(wl.prompt_tokens, 50) == pytest.approx(6909, abs=1)


def test_azure_trace_from_shared_data(shared_data) -> None:
    wl = load_trace("azure-conv", data=shared_data)
    assert len(wl) == 19_366
    assert wl.block_ids is None
    assert wl.arrival_s[0] == 0.0 and np.all(np.diff(wl.arrival_s) >= 0)
    assert 3400 < wl.duration_s < 3600  # 18:15:46 to 19:14:08


def test_loaders_reject_malformed_files(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 5}) + "\n")
    with pytest.raises(ConfigError):
        load_mooncake(bad)
    csv_bad = tmp_path / "bad.csv"
    csv_bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-time,1,1\n")
    with pytest.raises(ConfigError):
        load_azure(csv_bad)
    with pytest.raises(ConfigError):
        load_trace("no-such-trace")


@pytest.mark.parametrize(
    ("kind", "prompt_mean", "output_mean"),
    [("sharegpt", 755.5, 200.3), ("humaneval", 171.3, 98.2), ("longbench", 1738.3, 90.7)],
)
def test_synthetic_sets_match_distserve_means(
    kind: str, prompt_mean: float, output_mean: float
) -> None:
    # DistServe's Fig. 7 means, within OPT's 2,048-token window.
    wl = synthetic(kind, 20_000, rate_per_s=2.0, seed=0)
    assert wl.prompt_tokens.mean() == pytest.approx(prompt_mean, rel=0.05)
    assert wl.output_tokens.mean() == pytest.approx(output_mean, rel=0.05)
    assert np.all(wl.prompt_tokens + wl.output_tokens <= 2048)
    assert wl.rate_per_s == pytest.approx(2.0, rel=0.03)


def test_at_rate_scales_arrivals_only() -> None:
    wl = synthetic("mixed", 500, rate_per_s=1.0, seed=3)
    fast = wl.at_rate(10.0)
    assert fast.rate_per_s == pytest.approx(10.0)
    assert np.allclose(fast.arrival_s * 10.0, wl.arrival_s * wl.rate_per_s)
    assert np.array_equal(fast.prompt_tokens, wl.prompt_tokens)
    assert wl.head(10).prompt_tokens.tolist() == wl.prompt_tokens[:10].tolist()


def test_prefix_cache_lru_order_and_prefix_match() -> None:
    cache = PrefixCache(capacity_blocks=3)
    assert cache.insert([1, 2, 3]) == 3
    assert (
        cache.match([1, 2, 9, 3]) == 2
    )  # stops at the first miss: 3 is cached but not a prefix here
    cache.insert([4])  # evicts the least recently used: 3 (1 and 2 were just touched)
    assert cache.match([3]) == 0
    assert cache.match([1, 2]) == 2
    cache.insert([5])  # evicts 4
    assert cache.match([4]) == 0
    assert cache.evicted_blocks == 2
    assert len(cache) == 3


def test_at_rate_spreads_a_slice_that_arrives_all_at_once() -> None:
    import numpy as np

    from planner.workload import Workload

    w = Workload("burst", np.zeros(4), np.full(4, 100), np.full(4, 10), None, 512)
    spread = w.at_rate(2.0)
    assert np.all(np.isfinite(spread.arrival_s))
    assert spread.arrival_s.tolist() == [0.0, 0.5, 1.0, 1.5]
    assert spread.rate_per_s == 2.0

"""The one Mooncake-trace loader (:mod:`planner.trace`) and the two views of it: the records the
eviction replay reads and the :class:`~planner.workload.Workload` the planner reads.

Malformed lines, an empty file and a missing file, the unit conversion (milliseconds in the file,
seconds in a workload), the default path, and figures of the eviction replay, the scheduling replay
and the simulator on a small synthetic trace pinned to what they were before the two parsers
became one (``bench/replay.py``'s loader and ``planner/workload.py``'s).
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from bench.replay import replay as eviction_replay
from conductor.perf.data import DATA_DIR_ENV
from conductor.perf.hardware import gpu_by_name, link_by_name
from conductor.perf.latency import build_latency_provider
from conductor.perf.models import model_by_name
from conductor.scheduler import Policy
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.node.policies import PolicyName
from planner.metrics import Slo
from planner.replay import ClusterSpec, replay
from planner.sim import Architecture, Deployment, InstanceGroup, PrefixCacheSpec, simulate
from planner.sim import ClusterSpec as SimCluster
from planner.trace import (
    BLOCK_TOKENS,
    DEFAULT_TRACE_FILE,
    TraceRequest,
    block_key,
    default_trace_path,
    load_requests,
)
from planner.workload import load_mooncake, load_trace

TRACE = default_trace_path()
needs_trace = pytest.mark.skipif(TRACE is None, reason="the Mooncake trace is not checked out")

GOOD = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("line", "why"), [
    ('{"timestamp": 1, "input_length": 5, "hash_ids": [0]}', "output_length"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}', "timestamp_ms"),
    ('{"timestamp": 1.5, "input_length": 5, "output_length": 1}', "timestamp"),
    ('{"timestamp": "1", "input_length": 5, "output_length": 1}', "timestamp"),
    ('{"timestamp": 1, "input_length": true, "output_length": 1}', "input_length"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 3}', "hash_ids"),
    ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [-2]}', "hash_ids"),
    ("[1, 2, 3]", "JSON object"),
    ("not json", ""),
])
def test_a_malformed_line_is_a_config_error_naming_file_and_line(tmp_path: Path, line: str,
                                                                 why: str) -> None:
    path = _write(tmp_path / "bad.jsonl", GOOD + "\n" + line + "\n" + GOOD)
    # The blank line counts: the bad record is on line 3. Both views raise the same error.
    for load in (load_requests, load_mooncake, lambda p: load_trace(str(p))):
        with pytest.raises(ConfigError, match=rf"bad\.jsonl:3: not a Mooncake trace record: .*{why}"):
            load(path)


def test_an_empty_or_missing_file_is_a_config_error(tmp_path: Path) -> None:
    for text in ("", "\n  \n"):
        path = _write(tmp_path / "empty.jsonl", text)
        for load in (load_requests, load_mooncake):
            with pytest.raises(ConfigError, match=r"empty\.jsonl has no requests"):
                load(path)
    missing = tmp_path / "missing.jsonl"
    for load in (load_requests, load_mooncake):
        with pytest.raises(ConfigError, match=r"cannot read trace .*missing\.jsonl") as info:
            load(missing)
        assert isinstance(info.value.__cause__, OSError)


def test_bad_arguments_and_records_built_in_code_are_invalid_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        load_requests(_write(tmp_path / "t.jsonl", GOOD), limit=-1)
    with pytest.raises(InvalidArgument, match="timestamp_ms"):
        TraceRequest(-1, 5, 1, ())
    with pytest.raises(InvalidArgument, match="hash_ids"):
        TraceRequest(0, 5, 1, (True,))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- units and order


def test_milliseconds_in_the_file_seconds_from_the_first_request_in_a_workload(
        tmp_path: Path) -> None:
    recs = [(1500, 1024, 7, [0, 1]), (250, 600, 3, [0, 2]), (4000, 0, 0, [0]),
            (1500.0, 513, 9, [0, 1, 3])]
    path = _write(tmp_path / "units.jsonl", "".join(
        json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
        for t, i, o, h in recs))
    reqs = load_requests(path)
    assert [r.timestamp_ms for r in reqs] == [250, 1500, 1500, 4000]  # sorted, stable in a tie
    assert all(isinstance(r.timestamp_ms, int) for r in reqs)  # 1500.0 is an integral count
    assert [r.hash_ids for r in reqs] == [(0, 2), (0, 1), (0, 1, 3), (0,)]
    assert [r.expected_blocks for r in reqs] == [2, 2, 2, 0]
    assert [r.hash_ids for r in load_requests(path, limit=2)] == [(0, 2), (0, 1)]

    wl = load_mooncake(path)
    assert wl.name == "units" and len(wl) == 4
    assert wl.arrival_s.tolist() == [0.0, 1.25, 1.25, 3.75]
    assert wl.duration_s == 3.75
    assert wl.prompt_tokens.tolist() == [600, 1024, 513, 1]  # a zero length becomes 1
    assert wl.output_tokens.tolist() == [3, 7, 9, 1]
    assert wl.block_ids == ((0, 2), (0, 1), (0, 1, 3), (0,))
    assert wl.block_tokens == BLOCK_TOKENS == 512
    assert load_trace(str(path), count=2).arrival_s.tolist() == [0.0, 1.25]


def test_a_trace_without_block_ids_has_arrivals_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "arrivals.jsonl",
                  '{"timestamp": 10, "input_length": 100, "output_length": 5}\n'
                  '{"timestamp": 20, "input_length": 200, "output_length": 6}\n')
    assert [r.hash_ids for r in load_requests(path)] == [(), ()]
    wl = load_mooncake(path)
    assert wl.block_ids is None and wl.arrival_s.tolist() == [0.0, 0.01]


def test_block_keys_are_eight_big_endian_bytes() -> None:
    assert block_key(1) == b"\x00" * 7 + b"\x01"
    assert len(block_key(2**63)) == 8


def test_the_default_path_is_under_the_data_directory(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / DEFAULT_TRACE_FILE
    assert default_trace_path(tmp_path) is None  # the directory exists, the trace does not
    trace.parent.mkdir(parents=True)
    _write(trace, GOOD)
    assert default_trace_path(tmp_path) == trace
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert default_trace_path() == trace
    assert default_trace_path(tmp_path / "nowhere") is None


@needs_trace
def test_both_views_of_the_real_trace_are_one_parse() -> None:
    assert TRACE is not None
    reqs = load_requests(TRACE)
    wl = load_trace("mooncake")
    assert len(reqs) == len(wl) == 12_031
    assert all(r.blocks == r.expected_blocks == math.ceil(r.input_length / BLOCK_TOKENS)
               for r in reqs)
    first_s = reqs[0].timestamp_ms / 1000.0
    assert np.array_equal(wl.arrival_s, np.array([r.timestamp_ms / 1000.0 for r in reqs]) - first_s)
    assert wl.prompt_tokens.tolist() == [r.input_length for r in reqs]
    assert wl.block_ids == tuple(r.hash_ids for r in reqs)
    assert wl.duration_s == pytest.approx(3537.0, abs=1.0)


# --------------------------------------------------------------------------- pinned figures


def synthetic_trace_lines(count: int = 80, seed: int = 7) -> list[str]:
    """A small Mooncake-format trace: conversations under a shared system block 0, later turns
    reusing an earlier prompt whole plus new blocks; a few lines out of timestamp order."""
    rng = random.Random(seed)
    next_id = 1
    chains: list[list[int]] = []
    records = []
    t_ms = 0
    for _ in range(count):
        t_ms += rng.choice((0, 0, 120, 350, 800, 1500))
        if chains and rng.random() < 0.45:
            ids = rng.choice(chains) + list(range(next_id, next_id + rng.randint(1, 2)))
        else:
            ids = [0, *range(next_id, next_id + rng.randint(1, 6))]
        next_id = max(next_id, max(ids) + 1)
        chains.append(ids)
        records.append({"timestamp": t_ms, "input_length": len(ids) * 512 - rng.randint(0, 511),
                        "output_length": rng.randint(1, 300), "hash_ids": ids})
    for i in range(5, count - 1, 17):  # swap neighbours: the loader must sort
        records[i], records[i + 1] = records[i + 1], records[i]
    return [json.dumps(r) + "\n" for r in records]


@pytest.fixture
def synthetic(tmp_path: Path) -> Path:
    return _write(tmp_path / "synthetic.jsonl", "".join(synthetic_trace_lines()))


# The figures below were measured with the two loaders this one replaced (git 2af0979); a change
# here means the replays now see a different trace, unless a policy itself changed on purpose.

EVICTION = {  # (policy, capacity in blocks) -> (hit blocks, evictions, refused blocks)
    (PolicyName.LRU, 4): (81, 80, 237), (PolicyName.LRU, 12): (103, 287, 0),
    (PolicyName.S3FIFO, 4): (80, 80, 238), (PolicyName.S3FIFO, 12): (104, 286, 0),
    (PolicyName.MQ, 4): (80, 80, 238), (PolicyName.MQ, 12): (109, 281, 0),
    (PolicyName.BELADY, 4): (107, 27, 264), (PolicyName.BELADY, 12): (148, 90, 152),
}

SCHEDULING = {  # policy -> (hit ratio, fetched blocks, TTFT mean s, TTFT p99 s); all 80 accepted
    Policy.RANDOM: (0.302183749754, 0, 0.109725756292, 0.305098140192),
    Policy.LOAD: (0.321240382621, 0, 0.087603552927, 0.234002016401),
    Policy.LOCAL_CACHE: (0.343019391613, 0, 0.083795302894, 0.214171717471),
    Policy.GLOBAL_CACHE: (0.383855033471, 16, 0.077436115739, 0.188146737923),
}


def test_eviction_replay_of_a_synthetic_trace_is_unchanged(synthetic: Path) -> None:
    reqs = load_requests(synthetic)
    assert (len(reqs), sum(r.blocks for r in reqs)) == (80, 402)
    assert [r.timestamp_ms for r in reqs[:8]] == [120, 120, 120, 470, 1270, 1270, 2070, 2870]
    for (policy, blocks), expected in EVICTION.items():
        got = eviction_replay(reqs, blocks * BLOCK_TOKENS, policy)
        assert (got.hit_blocks, got.evictions, got.refused_blocks) == expected, (policy, blocks)


def test_planner_views_of_a_synthetic_trace_are_unchanged(synthetic: Path) -> None:
    wl = load_trace(str(synthetic))
    assert len(wl) == 80 and wl.duration_s == pytest.approx(43.92, abs=1e-12)
    assert wl.arrival_s[:6].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.35, 1.15, 1.15])
    assert (int(wl.prompt_tokens.sum()), int(wl.output_tokens.sum())) == (188_071, 12_208)

    cluster = ClusterSpec(prefill_instances=2, decode_instances=2, node_capacity_blocks=20, seed=1)
    for policy, (hit, fetched, ttft_mean, ttft_p99) in SCHEDULING.items():
        r = replay(wl.at_rate(4.0), policy, cluster=cluster)
        assert (r.accepted, r.fetched_blocks, r.replication_hints) == (80, fetched, 0), policy
        assert r.hit_ratio == pytest.approx(hit, abs=1e-11)
        assert r.ttft_s["mean"] == pytest.approx(ttft_mean, abs=1e-11)
        assert r.ttft_s["p99"] == pytest.approx(ttft_p99, abs=1e-11)

    spec, gpu = model_by_name("llama-3-8b"), gpu_by_name("h100")
    sim_cluster = SimCluster(spec, gpu, build_latency_provider("roofline", spec, gpu))
    deployment = Deployment(Architecture.DISAGGREGATED, prefill=InstanceGroup(1, 1),
                            decode=InstanceGroup(1, 1), link=link_by_name("roce-400g"),
                            prefix_cache=PrefixCacheSpec(40 * BLOCK_TOKENS))
    summary = simulate(sim_cluster, deployment, load_trace(str(synthetic), rate_per_s=2.0)
                       ).summary(Slo(0.5, 0.05))
    assert summary["completed"] == 80
    assert summary["ttft_s"]["mean"] == pytest.approx(0.07677597156213482, rel=1e-9)
    assert summary["tpot_s"]["mean"] == pytest.approx(0.011502614318078216, rel=1e-9)
    assert summary["kv_bytes_moved"] == {"prefill_to_decode": 24_650_842_112,
                                         "cache_to_gpu": 9_596_567_552,
                                         "gpu_to_cache": 17_261_133_824,
                                         "total": 51_508_543_488}

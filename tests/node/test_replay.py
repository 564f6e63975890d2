"""The eviction replay (``bench/replay.py``): a hand-checked tiny trace, a slice of the real Mooncake
trace (unbounded = "seen before", LRU <= Belady), and the ``kvtier bench replay`` command.

The trace loader itself is tested in ``tests/planner/test_trace.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.replay import TraceHalf, gap_closed, replay, seen_before_hits, split_by_time
from kvstore.cli.main import app
from kvstore.errors import InvalidArgument
from kvstore.node.policies import PolicyName
from planner.trace import BLOCK_TOKENS, TraceRequest, default_trace_path, load_requests

TRACE = default_trace_path()
needs_trace = pytest.mark.skipif(TRACE is None, reason="the Mooncake trace is not checked out")


def req(t: int, *ids: int) -> TraceRequest:
    return TraceRequest(t, len(ids) * BLOCK_TOKENS, 10, tuple(ids))


def write_trace(path: Path, requests: list[TraceRequest]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length,
                                        "hash_ids": list(r.hash_ids)}) + "\n" for r in requests))
    return path


TINY = [req(0, 0, 1, 2), req(1, 0, 1, 3), req(2, 0, 4), req(3, 0, 1, 2)]


def test_tiny_trace_by_hand() -> None:
    cap = 3 * BLOCK_TOKENS
    # LRU, 3 blocks. r1 hits 0,1 and evicts leaf 2 for 3. r2 hits 0 and evicts leaf 3 for 4.
    # r3 hits 0,1 (2 is gone); 1 is now the LRU entry but r3 pins it, so 4 goes for 2.
    # 0+2+1+2 = 5 hits of 11 blocks, 3 evictions.
    lru = replay(TINY, cap, PolicyName.LRU)
    assert (lru.hit_blocks, lru.blocks, lru.requests, lru.evictions) == (5, 11, 4, 3)
    # Belady refuses 3 and 4 (never needed again) and keeps 0,1,2 for r3: 2+1+3 = 6.
    bel = replay(TINY, cap, PolicyName.BELADY)
    assert (bel.hit_blocks, bel.refused_blocks, bel.evictions) == (6, 2, 0)
    unbounded = replay(TINY, None, PolicyName.LRU)
    assert unbounded.hit_blocks == seen_before_hits(TINY) == 6
    with pytest.raises(InvalidArgument):
        replay(TINY, BLOCK_TOKENS - 1, PolicyName.LRU)


def test_gap_closed() -> None:
    assert gap_closed(0.2, 0.1, 0.4) == pytest.approx(1 / 3)
    assert gap_closed(0.3, 0.3, 0.3) is None


def test_split_by_time_is_disjoint_and_keeps_one_instant_together() -> None:
    requests = [req(0, 1), req(1, 2), req(2, 3), req(2, 4), req(5, 5)]
    first = split_by_time(requests, TraceHalf.FIRST)
    second = split_by_time(requests, TraceHalf.SECOND)
    # Median timestamp is 2: both requests at t=2 go to the second half.
    assert [r.hash_ids for r in first] == [(1,), (2,)]
    assert [r.hash_ids for r in second] == [(3,), (4,), (5,)]
    assert split_by_time([], TraceHalf.FIRST) == []


@needs_trace
def test_real_trace_slice() -> None:
    assert TRACE is not None
    requests = load_requests(TRACE, limit=500)
    assert len(requests) == 500
    blocks = sum(r.blocks for r in requests)
    # Unbounded: the longest cached prefix counts exactly the blocks seen before (prefix-chained
    # ids), computed here without the index.
    unbounded = replay(requests, None, PolicyName.LRU)
    assert unbounded.blocks == blocks
    assert unbounded.hit_blocks == seen_before_hits(requests)
    assert unbounded.evictions == 0
    for cap_tokens in (100_000, 400_000):
        results = {p: replay(requests, cap_tokens, p) for p in PolicyName}
        bel = results[PolicyName.BELADY].hit_ratio
        assert results[PolicyName.LRU].hit_ratio <= bel <= unbounded.hit_ratio
        for p in (PolicyName.S3FIFO, PolicyName.MQ):
            assert results[p].hit_ratio <= bel
        assert results[PolicyName.LRU].evictions > 0  # the capacity really binds


def test_cli_replay_prints_json(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "tiny.jsonl", TINY)
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path),
                                      "--capacity-tokens", str(3 * BLOCK_TOKENS),
                                      "--policy", "belady", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["policy"] == "belady" and out["capacity_tokens"] == 3 * BLOCK_TOKENS
    assert (out["requests"], out["blocks"], out["hit_blocks"]) == (4, 11, 6)
    assert out["hit_ratio"] == pytest.approx(6 / 11)


def test_cli_replay_sweep_writes_json(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "tiny.jsonl", TINY * 3)
    out_path = tmp_path / "sweep.json"
    result = CliRunner().invoke(app, ["bench", "replay", "--trace", str(path), "--sweep",
                                      "--out", str(out_path)])
    assert result.exit_code == 0, result.output
    assert "gap closed" in result.stdout and "belady" in result.stdout
    written = json.loads(out_path.read_text())
    rows = written["rows"]
    assert {r["policy"] for r in rows} == {p.value for p in PolicyName}
    assert {r["capacity_tokens"] for r in rows} == {1_000_000, 3_000_000, 10_000_000}
    assert written["versions"]["python"] and written["git_sha"]


def test_cli_replay_bad_input_is_a_clear_error(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "tiny.jsonl", TINY)
    runner = CliRunner()
    result = runner.invoke(app, ["bench", "replay", "--trace", str(path), "--policy", "lfu"])
    assert result.exit_code == 2 and "unknown policy 'lfu'" in result.output
    result = runner.invoke(app, ["bench", "replay", "--trace", str(tmp_path / "missing.jsonl")])
    assert result.exit_code == 2 and "missing.jsonl" in result.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    result = runner.invoke(app, ["bench", "replay", "--trace", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:1: not a Mooncake trace record" in result.output

"""Smoke test: ``bench/tiers.py`` runs end to end on a tiny plan and writes well-formed rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import tiers

KiB = 1 << 10
MiB = 1 << 20


def test_tiers_benchmark_runs_on_a_tiny_plan(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    plan = tiers.Plan(quick=True, rounds=1, dram_total_bytes=2 * MiB, nvme_total_bytes=2 * MiB,
                      unaligned=True, chunk_sizes=(256 * KiB, MiB))
    scratch = tmp_path / "nvme"
    result = tiers.run(True, scratch, plan=plan)
    rows = result["rows"]
    assert {(r["tier"], r["op"], r["chunk_bytes"], r["src_aligned"]) for r in rows} >= {
        (tier, op, size, True) for tier in ("dram", "nvme") for op in ("put", "get")
        for size in (256 * KiB, MiB)} | {("nvme", "put", MiB, False), ("nvme", "get", MiB, False)}
    for r in rows:
        assert r["gbps"] > 0 and r["limit_gbps"] > 0
        assert r["ratio_to_limit"] == pytest.approx(r["gbps"] / r["limit_gbps"])
    assert result["nvme"]["io_mode"] in ("direct", "buffered")
    assert result["git_sha"] and result["machine"]["cpus"]
    assert list(scratch.iterdir()) == [], "the benchmark left files behind"
    json.dumps(result)
    tiers.print_table(result)
    assert "limit GB/s" in capsys.readouterr().out

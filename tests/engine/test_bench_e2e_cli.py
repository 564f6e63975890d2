"""``kvtier bench e2e`` passes its flags through to ``bench/e2e.py`` (the benchmark itself is
not run: it takes minutes)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvstore.cli.main import app


def captured_args(monkeypatch: pytest.MonkeyPatch, *flags: str) -> argparse.Namespace:
    from bench import e2e as bench_e2e

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(bench_e2e, "main", lambda argv: seen.append(bench_e2e.parse_args(argv)))
    result = CliRunner().invoke(app, ["bench", "e2e", *flags])
    assert result.exit_code == 0, result.output
    assert len(seen) == 1
    return seen[0]


def test_flags_reach_the_benchmark(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    args = captured_args(monkeypatch, "--quick", "--token-budget", "128", "--colocated-threads",
                         "1", "--rate", "2.5", "--new-tokens", "4", "--json",
                         str(tmp_path / "e2e.json"))
    assert (args.quick, args.token_budget, args.colocated_threads) == (True, 128, 1)
    assert (args.rate, args.new_tokens, args.json) == (2.5, 4, tmp_path / "e2e.json")
    assert not args.no_colocated
    assert captured_args(monkeypatch, "--no-colocated").no_colocated


def test_defaults_are_the_benchmarks_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import e2e as bench_e2e

    args = captured_args(monkeypatch)
    assert vars(args) == vars(bench_e2e.parse_args([]))


def test_bad_values_are_refused_before_anything_runs() -> None:
    result = CliRunner().invoke(app, ["bench", "e2e", "--colocated-threads", "0"])
    assert result.exit_code == 2
    from bench import e2e as bench_e2e

    with pytest.raises(SystemExit):
        bench_e2e.parse_args(["--token-budget", "1"])

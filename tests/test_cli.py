from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvstore import __version__
from kvstore.cli.main import app


def test_version_command_prints_package_version() -> None:
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == __version__


def test_console_entry_point_runs_as_module() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.cli.main", "--help"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert "bench" in out.stdout


def test_bench_fleet_passes_its_options_to_the_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kvtier bench fleet`` hands the arrival options to ``python -m bench.fleet`` (they
    existed only there before); the bench itself is stubbed: this checks the plumbing only."""
    from bench import fleet as bench_fleet

    seen: list[list[str]] = []
    monkeypatch.setattr(bench_fleet, "main", lambda argv: seen.append(list(argv)) or 0)
    result = CliRunner().invoke(app, ["bench", "fleet", "--closed-loop", "--in-flight", "3",
                                      "--conversations", "16", "--rounds", "2",
                                      "--router", "local"])
    assert result.exit_code == 0, result.output
    assert seen == [["--closed-loop", "--in-flight", "3", "--conversations", "16",
                     "--rounds", "2", "--router", "local"]]

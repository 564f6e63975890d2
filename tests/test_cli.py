from __future__ import annotations

import subprocess
import sys

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

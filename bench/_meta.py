"""What every benchmark records beside its figures: code version, machine and library versions."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def git_sha(dirty_paths: Sequence[str] = ()) -> str:
    """HEAD's sha, suffixed ``-dirty`` when ``dirty_paths`` (default: the whole tree) have changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                                *dirty_paths], cwd=REPO_ROOT, capture_output=True, text=True,
                               check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{sha}-dirty" if dirty else sha


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what platform knows."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "machine": platform.machine(), "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "page_bytes": mmap.PAGESIZE, "load_avg_1m": os.getloadavg()[0]}


def versions(*dists: str) -> dict[str, str]:
    """Python's version and each installed distribution's (``"absent"`` when not installed)."""
    out = {"python": platform.python_version()}
    for dist in dists:
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "absent"
    return out


def run_header(bench: str, *, dists: Sequence[str] = ("numpy",),
               dirty_paths: Sequence[str] = ()) -> dict[str, Any]:
    """The top-level fields of a benchmark's JSON document."""
    return {"bench": bench, "git_sha": git_sha(dirty_paths),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine(), "versions": versions(*dists)}


def spawn_kvtier(cmd: list[str], ready_prefix: str, log_path: Path, timeout_s: float = 60.0
                 ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """``kvtier <cmd>`` as a child (no ``KVTIER_*`` environment, stderr appended to
    ``log_path``) and the JSON of its ready line (``ready_prefix``...). Killed, and
    RuntimeError, when it exits or stays silent past ``timeout_s``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    with log_path.open("a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli.main", *cmd], env=env,
                                stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(ready_prefix):
            return proc, json.loads(line[len(ready_prefix):])
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{cmd[0]} did not become ready; see {log_path}")


def stop_child(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL after 15 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

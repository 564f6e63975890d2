"""What every benchmark records beside its figures: code version, machine and library versions."""

from __future__ import annotations

import contextlib
import mmap
import os
import platform
import subprocess
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

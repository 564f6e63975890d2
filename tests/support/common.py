"""Small helpers shared by test modules."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]


def payload(size_bytes: int, seed: int) -> bytes:
    """Deterministic, incompressible bytes (so compression cannot hide a wrong copy)."""
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "",
               poll_s: float = 0.02) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(poll_s)


class StdinServerProcess:
    """``python -m MODULE --exit-on-stdin-eof FLAGS`` in its own process, started when its first
    stdout line begins with ``ready_prefix`` (kept in ``ready_line``); closing stdin stops it."""

    def __init__(self, module: str, ready_prefix: str, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--exit-on-stdin-eof", *flags],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(ready_prefix):
            self.proc.kill()
            raise RuntimeError(f"{module} did not start: {line!r}")
        self.ready_line = line

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

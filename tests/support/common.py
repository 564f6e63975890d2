"""Small helpers shared by test modules."""

from __future__ import annotations

import os
import struct
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


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    """XOR one byte of a file with ``mask`` in place, durably (what a disk that rots does)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())


VERSION_HEADER = struct.Struct("<QQ")
"""(key index, version) at the front of a :func:`versioned_value`."""


def versioned_size(index: int) -> int:
    """64 KiB (a one-request same-host PUT) or 192 KiB (RESERVE + COMMIT), by key index."""
    return (64 if index % 2 else 192) << 10


def versioned_value(index: int, version: int) -> np.ndarray:
    """Bytes derived from (key index, version), both also in a header: a torn read, or one
    of another chunk or version, does not match :func:`check_versioned`."""
    out = np.random.default_rng(index * 1_000_003 + version).integers(
        0, 256, versioned_size(index), dtype=np.uint8)
    out[:VERSION_HEADER.size] = np.frombuffer(VERSION_HEADER.pack(index, version),
                                              dtype=np.uint8)
    return out


def check_versioned(index: int, got: np.ndarray, what: str) -> None:
    """Raise AssertionError unless ``got`` is exactly some version of chunk ``index``."""
    got_index, version = VERSION_HEADER.unpack(got[:VERSION_HEADER.size].tobytes())
    if got_index != index or not np.array_equal(got, versioned_value(index, version)):
        raise AssertionError(f"{what}: torn or foreign bytes (header says key {got_index} "
                             f"version {version})")


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


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (a SIGSTOP reaches each on its own)."""
    tasks = Path(f"/proc/{pid}/task")
    states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
    return all(state == "T" for state in states)

"""Small helpers shared by test modules."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np


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

"""The native builds for tests (``native/fastpath.c``, ``native/pyfast.c``): built when missing
or stale; a test skips (saying why) only when ``KVTIER_NATIVE=0`` switched them off or no C
compiler (or, for the extension, no ``Python.h``) exists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvstore.dataplane import native
from kvstore.errors import TierUnavailable


def _built(what: str, load: Callable[[], Any], build: Callable[[], Path],
           cache_clear: Callable[[], None]) -> Any:
    if not native.enabled_by_env():
        pytest.skip(f"KVTIER_NATIVE=0: the native {what} is switched off in this run")
    loaded = load()
    if loaded is None:
        try:
            build()
        except TierUnavailable as exc:
            if "no C compiler" in str(exc) or "no Python.h" in str(exc):
                pytest.skip(f"cannot build the native {what}: {exc}")
            raise
        cache_clear()
        loaded = load()
    assert loaded is not None, f"the native {what} was built but does not load"
    return loaded


def built_library() -> Any:
    """The ctypes library (the daemon's small-GET loop)."""
    return _built("library", native.load, native.build, native._load_path.cache_clear)


def built_extension() -> Any:
    """The CPython extension module (the client's lease-free read and small TCP GET)."""
    return _built("extension", native.load_extension, native.build_extension,
                  native._load_extension.cache_clear)

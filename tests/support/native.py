"""The native library for tests: built when missing; the test skips (saying why) only when
``KVTIER_NATIVE=0`` switched it off or no C compiler exists."""

from __future__ import annotations

from typing import Any

import pytest

from kvstore.dataplane import native
from kvstore.errors import TierUnavailable


def built_library() -> Any:
    if not native.enabled_by_env():
        pytest.skip("KVTIER_NATIVE=0: the native library is switched off in this run")
    lib = native.load()
    if lib is None:
        try:
            native.build()
        except TierUnavailable as exc:
            if "no C compiler" in str(exc):
                pytest.skip(f"cannot build the native library: {exc}")
            raise
        native._load_path.cache_clear()
        lib = native.load()
    assert lib is not None, "the native library was built but does not load"
    return lib


def built_extension() -> Any:
    """The native extension module (``native/pyfast.c``), built when missing or stale; skips
    only when switched off or without a compiler or ``Python.h``."""
    if not native.enabled_by_env():
        pytest.skip("KVTIER_NATIVE=0: the native extension is switched off in this run")
    module = native.load_extension()
    if module is None:
        try:
            native.build_extension()
        except TierUnavailable as exc:
            if "no C compiler" in str(exc) or "no Python.h" in str(exc):
                pytest.skip(f"cannot build the native extension: {exc}")
            raise
        native._load_extension.cache_clear()
        module = native.load_extension()
    assert module is not None, "the native extension was built but does not load"
    return module

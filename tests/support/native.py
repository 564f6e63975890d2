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

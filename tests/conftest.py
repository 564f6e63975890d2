"""Shared fixtures. Tests marked ``gpu`` are skipped cleanly when no CUDA device is present."""

from __future__ import annotations

import os
import secrets

import pytest

# The admin CLI's operator session (kvstore.client.daemon_control.operator_session) would
# otherwise be kept in a file under the user's home; one per test run, in the environment that
# the CLI subprocesses inherit.
os.environ.setdefault("KVTIER_SESSION", "tests-" + secrets.token_hex(16))

pytest_plugins = ["tests.support.etcd"]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)

"""Fixtures for the planner tests: real presets and the real published profiles in ../shared/data."""

from __future__ import annotations

import pytest

from conductor.perf.data import data_dir
from conductor.perf.hardware import gpu_by_name
from conductor.perf.latency import build_latency_provider
from conductor.perf.models import model_by_name
from kvstore.errors import ConfigError
from planner.sim import ClusterSpec


@pytest.fixture(scope="session")
def shared_data():
    try:
        return data_dir()
    except ConfigError as exc:  # the data is part of the project's environment; say so plainly
        pytest.skip(f"shared data not available: {exc}")


@pytest.fixture(scope="session")
def opt13b_cluster(shared_data) -> ClusterSpec:
    """OPT-13B on A100-80G with DistServe's published fits (the paper's chatbot setting)."""
    model, gpu = model_by_name("opt-13b"), gpu_by_name("a100")
    return ClusterSpec(
        model, gpu, build_latency_provider("distserve", model, gpu, data=shared_data)
    )

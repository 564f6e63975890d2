"""Fixtures of the front-door tests against real vLLM: one kvtier daemon and one ``vllm
serve`` with the tiny checkpoint's tokenizer and kvtier's connector (``kv_both``) for the whole
session, shared by test_frontdoor_vllm.py (the front door in front of it) and test_pd.py (it is
the prefill instance, and the colocated reference). vLLM starts cost 40-70 s each here: a test
module that needs another server starts it once, module-scoped."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.vllm_instance import TinyLlama, tiny_llama_checkpoint
from kvstore.cluster.vllm_server import VllmServer
from kvstore.frontdoor import PromptTokenizer
from tests.support.daemon import DaemonProcess

SPEC = TinyLlama()
MODEL = "model"
"""vLLM's served model name."""


def kv_transfer_config(daemon: DaemonProcess, role: str, **extra: Any) -> dict[str, Any]:
    """kvtier's connector for ``vllm serve --kv-transfer-config`` (one model identity, so
    that every instance on the daemon shares its keys)."""
    return {"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"daemon": daemon.grpc_address,
                                          "model": f"tiny-llama-{SPEC.key()}", **extra}}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return tiny_llama_checkpoint(SPEC)


@pytest.fixture(scope="session")
def tokenizer(model_dir: Path) -> PromptTokenizer:
    return PromptTokenizer.from_model_dir(model_dir)


@pytest.fixture(scope="session")
def kvtier_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    node = DaemonProcess(tmp_path_factory.mktemp("kvtier-frontdoor"), "frontdoor-node",
                         dram_bytes="64MiB", nvme=False)
    node.start()
    try:
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def vllm(model_dir: Path, kvtier_daemon: DaemonProcess,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """``vllm serve`` with the tokenizer and kvtier (``kv_both``): it loads and saves."""
    server = VllmServer(model_dir, tmp_path_factory.mktemp("vllm-frontdoor"), "frontdoor",
                        model_name=MODEL, tokenizer=True,
                        kv_transfer_config=kv_transfer_config(kvtier_daemon, "kv_both"))
    server.start()
    try:
        yield server
    finally:
        server.close()

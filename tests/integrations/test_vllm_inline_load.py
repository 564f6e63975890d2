"""The connector's worker as vLLM drives it: inside ``torch.inference_mode`` (vLLM's
``execute_model`` is decorated with it, and ``start_load_kv`` runs inside). A load copied in
the calling thread (the client's ``inline_load_bytes``) therefore runs in inference mode, and
nothing it makes may be an inference tensor that a later copy outside inference mode writes.
It was: the first lease-free read made the arena-wide tensor the shared-memory client keeps for
every later view of the arena, a save's reserved chunks included, so a step's save whose layers
were staged (copied before its reservation was granted) failed when the save thread moved them
into the reserved chunks ("Inplace update to inference tensor outside InferenceMode"): real
vLLM lost a conversation's decoded block and later requests' saves
(tests/integrations/test_vllm_e2e.py, issue 13). Against a real daemon and vLLM's real
scheduler (no model run)."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvstore.integrations.vllm.connector import KvtierConnector
from kvstore.integrations.vllm.metadata import KvtierConnectorMetadata
from tests.integrations.test_vllm_connector import (
    run_prefill,
    schedule,
    wait_until,
    worker_stats,
    worker_step,
)
from tests.support.daemon import DaemonProcess
from tests.support.vllm_unit import (
    BLOCK,
    LAYER_NAMES,
    cpu_kv_caches,
    create_kv_cache_config,
    create_request,
    create_scheduler,
    create_vllm_config,
    write_model_config,
)

INLINE_BYTES = 16 << 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-inline"), "node-inline",
                      dram_bytes="16MiB", nvme=False)
    d.start()
    yield d
    d.stop()


def _tokens(n: int, base: int) -> list[int]:
    return [(base * 11 + i * 17) % 500 + 1 for i in range(n)]


def test_a_step_that_loads_inline_in_inference_mode_saves_its_new_blocks(
        model_dir: Path, daemon: DaemonProcess) -> None:
    """Instance A stores 3 blocks; cold instance B's step loads them in vLLM's thread, in
    inference mode (B's first use of the arena), and computes a 4th block, which it saves. The
    daemon is stopped for the step, so the save's layers are copied into staging before the
    reservation is granted (the lease-free load needs nothing of the daemon) and moved into
    the reserved chunks on the save thread after SIGCONT: the block is stored, byte for byte,
    and a third instance finds all 4."""
    extra = {"daemon": daemon.grpc_address}
    kvc = create_kv_cache_config()
    tokens = _tokens(4 * BLOCK + 9, base=3)

    sched_a = create_scheduler(create_vllm_config(model_dir, extra))
    worker_a = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    worker_a.register_kv_caches(cpu_kv_caches(21))
    req_a = create_request("a", tokens[:3 * BLOCK + 5])
    _out, meta_a, _errors = run_prefill(sched_a, worker_a, [req_a])
    assert [(s.first_block, len(s.keys)) for s in meta_a.saves] == [(0, 3)]
    worker_a.shutdown()  # waits for the puts in flight

    sched_b = create_scheduler(create_vllm_config(model_dir, extra))
    worker_b = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    caches_b = cpu_kv_caches(22)
    worker_b.register_kv_caches(caches_b)
    side = worker_b._worker
    assert side is not None
    client = side.session.get()
    assert client is not None
    # Whatever the default, this step's load is copied in the calling thread.
    client.config = dataclasses.replace(client.config, inline_load_bytes=INLINE_BYTES)
    req_b = create_request("b", tokens)
    sched_b.add_request(req_b)
    out = schedule(sched_b, "b")
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvtierConnectorMetadata)
    assert [(ld.first_block, ld.num_blocks) for ld in meta.loads] == [(0, 3)]
    assert [(s.first_block, len(s.keys)) for s in meta.saves] == [(3, 4)]

    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        with torch.inference_mode():  # as vLLM's execute_model
            errors = worker_step(worker_b, meta)
        assert errors == set()
        assert side.saves_in_flight() == 1  # its reservation waits for the daemon
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    wait_until("B's save settled", lambda: side.saves_in_flight() == 0)
    stats = worker_stats(worker_b)
    assert stats.get("loaded_blocks") == 3 and stats.get("load_error_blocks") == 0
    assert stats.get("save_failed_blocks") == 0, stats
    assert stats.get("saved_blocks") == 1, stats
    saved_id = meta.saves[0].block_ids[3]
    worker_b.shutdown()

    # A third instance loads all 4 blocks; the 4th holds B's bytes of its block 3.
    sched_c = create_scheduler(create_vllm_config(model_dir, extra))
    worker_c = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    caches_c = {n: torch.zeros_like(t) for n, t in cpu_kv_caches(0).items()}
    worker_c.register_kv_caches(caches_c)
    req_c = create_request("c", tokens + _tokens(7, base=5))
    _out_c, meta_c, errors_c = run_prefill(sched_c, worker_c, [req_c])
    assert errors_c == set()
    assert [(ld.first_block, ld.num_blocks) for ld in meta_c.loads] == [(0, 4)]
    dst = meta_c.loads[0].target_block_ids[3]
    for name in LAYER_NAMES:
        assert torch.equal(caches_c[name][dst], caches_b[name][saved_id])
    worker_c.shutdown()
    for s in (sched_a, sched_b, sched_c):
        s.connector.shutdown()

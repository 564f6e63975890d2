"""KvtierConnector against a real daemon and vLLM's real Scheduler (fake model-runner output,
in the style of vLLM's tests/v1/kv_connector/unit/): no model run, no weights (a local
random-LlamaConfig config.json only)."""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

from kvstore.client.kvlayout import KVLayout
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig, SaveMode
from kvstore.integrations.vllm.connector import KvtierConnector
from kvstore.integrations.vllm.layout import CpuBlocksKV, GuardedKV
from kvstore.integrations.vllm.metadata import (
    KvtierConnectorMetadata,
    LoadSpec,
    SaveSpec,
)
from kvstore.integrations.vllm.stats import KvtierConnectorStats
from tests.support.daemon import DaemonProcess
from tests.support.vllm_unit import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYER_NAMES,
    LAYERS,
    cpu_kv_caches,
    create_kv_cache_config,
    create_request,
    create_scheduler,
    create_vllm_config,
    write_model_config,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-connector"), "node-vllm",
                      dram_bytes="16MiB", nvme=False)
    d.start()
    yield d
    d.stop()


def runner_output(reqs: list[Request] | list[str],
                  invalid: set[int] | None = None) -> ModelRunnerOutput:
    from vllm.v1.outputs import KVConnectorOutput

    ids = [r if isinstance(r, str) else r.request_id for r in reqs]
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=None if invalid is None else KVConnectorOutput(
            invalid_block_ids=invalid))


def worker_step(worker: KvtierConnector, meta: KvtierConnectorMetadata) -> set[int]:
    """What vLLM's model runner does with the connector around one forward."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, torch.empty(0), None)
    worker.wait_for_save()
    errors = worker.get_block_ids_with_load_errors()
    worker.clear_connector_metadata()
    return errors


def schedule(sched: Scheduler, *req_ids: str, timeout_s: float = 30.0,
             shipped: list[dict[str, Any]] | None = None) -> SchedulerOutput:
    """``sched.schedule()`` until a step schedules ``req_ids``: a request whose kvtier lookup
    is in flight waits (the connector answers None, vLLM asks again next step). The steps in
    between get a model output for what they scheduled; the connector stats they ship go to
    ``shipped``."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = sched.schedule()
        if all(r in out.num_scheduled_tokens for r in req_ids):
            return out
        assert time.monotonic() < deadline, f"{req_ids} not scheduled within {timeout_s} s"
        outputs = sched.update_from_output(out, runner_output(list(out.num_scheduled_tokens)))
        for o in outputs.values():
            if shipped is not None and o.scheduler_stats and o.scheduler_stats.kv_connector_stats:
                shipped.append(o.scheduler_stats.kv_connector_stats)
        time.sleep(0.01)


def matched(connector: KvtierConnector, request: Request, timeout_s: float = 30.0) -> int:
    """``get_num_new_matched_tokens(request, 0)`` once it is known (not None)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n, _ = connector.get_num_new_matched_tokens(request, 0)
        if n is not None:
            return n
        assert time.monotonic() < deadline, f"no answer for {request.request_id}"
        time.sleep(0.01)


def prompt(n: int, base: int = 1) -> list[int]:
    return [(base * 7 + i * 13) % 500 + 1 for i in range(n)]


# --- config --------------------------------------------------------------------------------


def test_config_environment_overrides_and_loud_errors() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {"daemon": "127.0.0.1:1", "save": "all"},
        {"KVTIER_VLLM_SAVE": "none", "KVTIER_VLLM_LOOKUP_TIMEOUT_S": "0.25"})
    assert cfg.save is SaveMode.NONE and cfg.lookup_timeout_s == 0.25
    with pytest.raises(ConfigError, match="unknown"):
        ConnectorConfig.from_extra_config({"daemon": "127.0.0.1:1", "daemn": "x"}, {})
    with pytest.raises(ConfigError, match="exactly one"):
        ConnectorConfig.from_extra_config({}, {})
    with pytest.raises(ConfigError, match="lookup_timeout_s"):
        ConnectorConfig.from_extra_config({"daemon": "h:1", "lookup_timeout_s": 0}, {})


def test_start_rejects_settings_that_would_fail_or_miss(model_dir: Path) -> None:
    extra = {"daemon": "127.0.0.1:1"}
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        KvtierConnector(create_vllm_config(model_dir, extra, policy="fail"), KVConnectorRole.SCHEDULER,
                        create_kv_cache_config())
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo"):
        KvtierConnector(create_vllm_config(model_dir, extra, algo="xxhash"),
                        KVConnectorRole.SCHEDULER, create_kv_cache_config())


# --- layout and metadata -------------------------------------------------------------------


def test_cpu_layout_gather_scatter_round_trips_bytes() -> None:
    caches = list(cpu_kv_caches(1).values())
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    ids = [5, 9, 2]
    src = CpuBlocksKV(caches, ids, layout)
    chunks = torch.empty((3, 2, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16)
    src.gather_layer(1, range(0, 3), chunks)
    # chunk layout [k|v, head, token, dim]: K is the first head_size of cpu_attn's split
    for i, b in enumerate(ids):
        view = caches[1][b].view(KV_HEADS, 2, BLOCK, HEAD_DIM)
        assert torch.equal(chunks[i, 0], view[:, 0]) and torch.equal(chunks[i, 1], view[:, 1])
    dst_caches = [torch.zeros_like(c) for c in caches]
    dst = CpuBlocksKV(dst_caches, [0, 1, 3, 4], layout)
    dst.scatter_layer(1, range(1, 4), chunks)
    for i, b in enumerate([1, 3, 4]):
        assert torch.equal(dst_caches[1][b], caches[1][ids[i]])
    assert not dst_caches[1][0].any() and not dst_caches[0].any()


def test_guarded_destination_ignores_scatters_after_close() -> None:
    caches = [torch.zeros((4, KV_HEADS, BLOCK, 2 * HEAD_DIM), dtype=torch.bfloat16)
              for _ in range(LAYERS)]
    layout = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16)
    guard = GuardedKV(CpuBlocksKV(caches, [0, 1], layout))
    ones = torch.ones((1, 2, KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.bfloat16)
    guard.scatter_layer(0, range(0, 1), ones)
    guard.close()
    guard.scatter_layer(1, range(0, 1), ones)
    assert caches[0][0].all() and not caches[1].any()


def test_metadata_round_trips_through_pickle() -> None:
    meta = KvtierConnectorMetadata(
        loads=[LoadSpec("r1", (b"k" * 48, b"l" * 48), (3, 4, 8), 1, 1)],
        saves=[SaveSpec("r2", (b"a" * 48, b"b" * 48, b"c" * 48), (1, 2, 6, 7), 1)])
    back = pickle.loads(pickle.dumps(meta))
    assert back == meta and back.loads[0].target_block_ids == (4,)


# --- a real scheduler and a real daemon ----------------------------------------------------


def run_prefill(sched: Scheduler, worker: KvtierConnector, reqs: list[Request]) -> Any:
    for r in reqs:
        sched.add_request(r)
    out = schedule(sched, *(r.request_id for r in reqs))
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvtierConnectorMetadata)
    errors = worker_step(worker, meta)
    sched.update_from_output(out, runner_output(reqs, errors or None))
    return out, meta, errors


def test_blocks_saved_by_one_instance_are_hits_for_another(model_dir: Path,
                                                           daemon: DaemonProcess) -> None:
    extra = {"daemon": daemon.grpc_address}
    kvc = create_kv_cache_config()
    # Instance A: prefill 3 full blocks + 10 tokens; the 3 blocks are saved.
    sched_a = create_scheduler(create_vllm_config(model_dir, extra))
    worker_a = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    caches_a = cpu_kv_caches(11)
    worker_a.register_kv_caches(caches_a)
    tokens = prompt(3 * BLOCK + 10)
    req_a = create_request("a", tokens)
    _out_a, meta_a, _ = run_prefill(sched_a, worker_a, [req_a])
    assert [(s.first_block, len(s.keys)) for s in meta_a.saves] == [(0, 3)]
    saved_ids = meta_a.saves[0].block_ids[:3]
    worker_a.shutdown()  # waits for the puts in flight

    # Instance B, cold: the same prefix + more is an external hit of 3 blocks, loaded
    # into B's own blocks byte for byte.
    sched_b = create_scheduler(create_vllm_config(model_dir, extra))
    worker_b = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    caches_b = {n: torch.zeros_like(t) for n, t in cpu_kv_caches(0).items()}
    worker_b.register_kv_caches(caches_b)
    req_b = create_request("b", tokens[: 3 * BLOCK] + prompt(40, base=9))
    out_b, meta_b, errors = run_prefill(sched_b, worker_b, [req_b])
    assert errors == set()
    assert [(ld.first_block, ld.num_blocks) for ld in meta_b.loads] == [(0, 3)]
    assert out_b.num_scheduled_tokens["b"] == 40
    for name in LAYER_NAMES:
        for src, dst in zip(saved_ids, meta_b.loads[0].target_block_ids, strict=True):
            assert torch.equal(caches_b[name][dst], caches_a[name][src])
    # Blocks beyond the hit are saved from block 3 on (the hit is already stored).
    assert [(s.first_block, len(s.keys)) for s in meta_b.saves] == [(3, 4)]

    # A prompt that is exactly the cached blocks: never the whole prompt (one token computed).
    sched_c = create_scheduler(create_vllm_config(model_dir, extra))
    req_c = create_request("c", tokens[: 3 * BLOCK])
    sched_c.add_request(req_c)
    out_c = schedule(sched_c, "c")
    meta_c = out_c.kv_connector_metadata
    assert [(ld.first_block, ld.num_blocks) for ld in meta_c.loads] == [(0, 2)]
    assert out_c.num_scheduled_tokens["c"] == BLOCK

    # Another tenant (cache_salt) shares nothing.
    sched_d = create_scheduler(create_vllm_config(model_dir, extra))
    req_d = create_request("d", tokens, salt="other")
    sched_d.add_request(req_d)
    assert schedule(sched_d, "d").kv_connector_metadata.loads == []
    for c in (worker_b,):
        c.shutdown()
    for s in (sched_a, sched_b, sched_c, sched_d):
        s.connector.shutdown()


def test_dead_daemon_gives_zero_hits_and_load_errors(model_dir: Path, tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-doomed", dram_bytes="8MiB", nvme=False)
    d.start()
    extra = {"daemon": d.grpc_address, "lookup_timeout_s": 1.0, "load_timeout_s": 2.0,
             "reconnect_interval_s": 60}
    kvc = create_kv_cache_config()
    try:
        sched = create_scheduler(create_vllm_config(model_dir, extra))
        worker = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
        worker.register_kv_caches(cpu_kv_caches(3))
        tokens = prompt(4 * BLOCK + 1, base=5)
        run_prefill(sched, worker, [create_request("w", tokens)])
        worker.shutdown()
        # The blocks are there: a lookup finds them.
        sched2 = create_scheduler(create_vllm_config(model_dir, extra))
        worker2 = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
        worker2.register_kv_caches(cpu_kv_caches(4))
        req = create_request("x", tokens)
        sched2.add_request(req)
        out = schedule(sched2, "x")
        meta = out.kv_connector_metadata
        assert [(ld.first_block, ld.num_blocks) for ld in meta.loads] == [(0, 4)]
        d.kill()  # dies between the lookup and the load
        errors = worker_step(worker2, meta)
        assert errors == set(meta.loads[0].target_block_ids)
        sched2.update_from_output(out, runner_output([req], errors))  # vLLM recomputes
        # A request vLLM does not hold: the lookup fails (dead daemon), 0 hits, no exception.
        req2 = create_request("y", prompt(3 * BLOCK, base=8))
        sched2.add_request(req2)
        out2 = schedule(sched2, "y")
        assert out2.kv_connector_metadata.loads == []
        assert out2.num_scheduled_tokens["y"] == 3 * BLOCK
        assert sched2.connector._scheduler.stats.get("lookup_errors") == 1
        # A connector started while the daemon is down serves at full recompute too.
        sched3 = create_scheduler(create_vllm_config(model_dir, extra))
        req3 = create_request("z", tokens)
        sched3.add_request(req3)
        out3 = schedule(sched3, "z")
        assert out3.kv_connector_metadata.loads == []
        assert out3.num_scheduled_tokens["z"] == len(tokens)
        for s in (sched, sched2, sched3):
            s.connector.shutdown()
        worker2.shutdown()
    finally:
        d.stop()


# --- stats ---------------------------------------------------------------------------------

CHUNK_BYTES = KVLayout(LAYERS, KV_HEADS, HEAD_DIM, BLOCK, torch.bfloat16).chunk_bytes


def worker_stats(worker: KvtierConnector) -> KvtierConnectorStats:
    stats = worker.get_kv_connector_stats()
    assert isinstance(stats, KvtierConnectorStats)
    return stats


def test_stats_count_hits_loads_saves_through_vllms_aggregation(model_dir: Path,
                                                                 daemon: DaemonProcess) -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorLogging,
        KVConnectorProm,
    )
    from vllm.v1.outputs import KVConnectorOutput

    extra = {"daemon": daemon.grpc_address}
    kvc = create_kv_cache_config()
    tokens = prompt(4 * BLOCK + 3, base=31)
    sched_a = create_scheduler(create_vllm_config(model_dir, extra))
    worker_a = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    worker_a.register_kv_caches(cpu_kv_caches(21))
    run_prefill(sched_a, worker_a, [create_request("sa", tokens)])
    worker_a.shutdown()  # the puts are done
    saved = worker_stats(worker_a)
    assert saved.get("saved_blocks") == 4 and saved.get("saved_bytes") == 4 * CHUNK_BYTES
    assert saved.get("save_failed_blocks") == 0 and saved.get("save_seconds") > 0
    assert worker_a.get_kv_connector_stats() is None  # taken: a fresh interval

    cfg_b = create_vllm_config(model_dir, extra)
    sched_b = create_scheduler(cfg_b)
    worker_b = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    worker_b.register_kv_caches(cpu_kv_caches(22))
    req = create_request("sb", tokens[: 3 * BLOCK] + prompt(20, base=32))
    sched_b.add_request(req)
    shipped: list[dict[str, Any]] = []
    out = schedule(sched_b, "sb", shipped=shipped)
    errors = worker_step(worker_b, out.kv_connector_metadata)
    assert errors == set()
    loaded = worker_stats(worker_b)
    assert loaded.get("loaded_blocks") == 3 and loaded.get("loaded_bytes") == 3 * CHUNK_BYTES
    assert loaded.get("load_error_blocks") == 0 and loaded.get("load_seconds") > 0
    # As vLLM does it: the worker's stats ride the model-runner output; the scheduler adds
    # its own (the lookup and hits) and ships to_dict() in SchedulerStats.
    runner = runner_output([req])
    runner.kv_connector_output = KVConnectorOutput(kv_connector_stats=loaded)
    outputs = sched_b.update_from_output(out, runner)
    last = next(o.scheduler_stats for o in outputs.values() if o.scheduler_stats)
    assert last.kv_connector_stats is not None
    data: dict[str, Any] = {}
    for step in [*shipped, last.kv_connector_stats]:  # the steps the lookup was in flight
        for name, value in step.items():
            data[name] = data.get(name, 0) + value
    assert data["lookups"] == 1 and data["hit_blocks"] == 3 and data["hit_tokens"] == 3 * BLOCK
    assert data["loaded_blocks"] == 3 and "lookup_errors" not in data
    # The logger process rebuilds it, aggregates two intervals and reduces.
    logging_ = KVConnectorLogging(cfg_b.kv_transfer_config)
    logging_.observe(data)
    logging_.observe(saved.to_dict())
    acc = logging_.transfer_stats_accumulator
    assert isinstance(acc, KvtierConnectorStats)
    reduced = acc.reduce()
    assert reduced["hit_blocks"] == 3 and reduced["loaded_blocks"] == 3
    assert reduced["saved_blocks"] == 4 and reduced["saved_bytes"] == 4 * CHUNK_BYTES
    assert reduced["load_ms_per_block"] > 0 and reduced["lookup_errors"] == 0
    lines: list[str] = []
    logging_.log(lambda fmt, text: lines.append(fmt % text))
    assert lines and "hit_blocks=3" in lines[0]
    # Prometheus, with vLLM's KVConnectorProm on a registry of our own.
    registry = CollectorRegistry()

    def bound(cls: type) -> type:
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(
            self, *a, registry=registry, **k)})

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    prom = Prom(cfg_b, ["engine"], {0: ["0"]})
    prom.observe(data, 0)
    prom.observe(saved.to_dict(), 0)
    assert registry.get_sample_value("vllm:kvtier_hit_blocks_total", {"engine": "0"}) == 3
    assert registry.get_sample_value("vllm:kvtier_saved_bytes_total",
                                     {"engine": "0"}) == 4 * CHUNK_BYTES
    worker_b.shutdown()
    for s in (sched_a, sched_b):
        s.connector.shutdown()


# --- a stopped (slow) daemon, then a restarted one -----------------------------------------


def wait_until(what: str, check: Any, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def test_stopped_daemon_is_bounded_and_reuse_resumes(model_dir: Path, tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-stopped", dram_bytes="8MiB", nvme=False)
    d.start()
    extra = {"daemon": d.grpc_address, "lookup_timeout_s": 0.5, "load_timeout_s": 1.0,
             "save_timeout_s": 0.3, "reconnect_interval_s": 0.2}
    kvc = create_kv_cache_config()
    tokens = prompt(4 * BLOCK + 1, base=41)
    stopped = False
    restarted: DaemonProcess | None = None
    try:
        sched = create_scheduler(create_vllm_config(model_dir, extra))
        worker = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
        worker.register_kv_caches(cpu_kv_caches(5))
        run_prefill(sched, worker, [create_request("p", tokens)])
        worker.shutdown()

        # The daemon's lookup: a stopped daemon's read index still answers at once
        # (tests/integrations/test_vllm_index_lookup.py); this test bounds the daemon's.
        sched2 = create_scheduler(create_vllm_config(model_dir, {**extra, "lookup_index": "off"}))
        # Over TCP every byte needs the daemon (same-host shm reads of committed chunks are
        # lease-free: they complete from the mapped arena even while the daemon is stopped).
        worker2 = KvtierConnector(create_vllm_config(model_dir, {**extra, "data_plane": "tcp"}),
                                  KVConnectorRole.WORKER, kvc)
        worker2.register_kv_caches(cpu_kv_caches(6))
        req = create_request("q", tokens[: 4 * BLOCK] + prompt(2 * BLOCK + 5, base=42))
        sched2.add_request(req)
        out = schedule(sched2, "q")
        meta = out.kv_connector_metadata
        assert [(ld.first_block, ld.num_blocks) for ld in meta.loads] == [(0, 4)]
        assert [(s.first_block, len(s.keys)) for s in meta.saves] == [(4, 6)]
        os.kill(d.pid, signal.SIGSTOP)
        stopped = True
        # Loads give up at load_timeout_s: every block is a load error (vLLM recomputes).
        errors = worker_step(worker2, meta)
        assert errors == set(meta.loads[0].target_block_ids)
        sched2.update_from_output(out, runner_output([req], errors))
        # A lookup is 0 hits within lookup_timeout_s; the scheduler goes on.
        req2 = create_request("r", prompt(3 * BLOCK, base=43))
        sched2.add_request(req2)
        out2 = schedule(sched2, "r")
        assert out2.kv_connector_metadata.loads == []
        assert out2.num_scheduled_tokens["r"] == 3 * BLOCK
        sched_stats = sched2.connector.get_kv_connector_stats()
        assert isinstance(sched_stats, KvtierConnectorStats)
        assert sched_stats.get("lookup_errors") == 1 and sched_stats.get("lookup_timeouts") == 1
        # The step's save is not put (its blocks were computed over the blocks that did not
        # load): counted failed, never waited for.
        w2 = worker2._worker
        assert w2 is not None
        wait_until("saves settled", lambda: w2.saves_in_flight() == 0)
        stats = worker_stats(worker2)
        assert stats.get("load_error_blocks") == 4 and stats.get("load_timeouts") == 1
        assert stats.get("loaded_blocks") == 0
        assert stats.get("save_timeouts") == 0 and stats.get("save_failed_blocks") == 2
        assert stats.get("saved_blocks") == 0

        os.kill(d.pid, signal.SIGCONT)
        stopped = False
        # Reuse resumes: the same scheduler half finds the 4 blocks again (after its
        # background reconnect), and the same worker half loads them.
        probes = iter(range(10**6))
        wait_until("hits after SIGCONT", lambda: matched(
            sched2.connector, create_request(f"probe{next(probes)}", tokens)) == 4 * BLOCK)
        wait_until("worker reconnected", lambda: w2.session.get() is not None)
        sched3 = create_scheduler(create_vllm_config(model_dir, extra))
        _out3, meta3, errors3 = run_prefill(sched3, worker2, [create_request("s", tokens)])
        assert [(ld.first_block, ld.num_blocks) for ld in meta3.loads] == [(0, 4)]
        assert errors3 == set() and worker_stats(worker2).get("loaded_blocks") == 4

        # A restarted daemon (same address, empty store): misses, then reuse of what is saved
        # after the restart, through the same connector halves.
        port = d.grpc_address.rpartition(":")[2]
        d.kill()
        restarted = DaemonProcess(tmp_path / "again", "node-stopped", dram_bytes="8MiB",
                                  nvme=False, settings={"server.grpc_port": port})
        restarted.start()
        fresh = prompt(3 * BLOCK + 2, base=44)
        schedulers = []

        def save_then_hit() -> bool:
            # The first save after the restart may fail on the old connection (the worker then
            # reconnects in the background); a later one lands, and the scheduler half sees it.
            sched_n = create_scheduler(create_vllm_config(model_dir, extra))
            schedulers.append(sched_n)
            run_prefill(sched_n, worker2, [create_request(f"t{len(schedulers)}", fresh)])
            wait_until("save settled", lambda: w2.saves_in_flight() == 0)
            n = matched(sched2.connector, create_request(f"probe-t{len(schedulers)}", fresh))
            return n == 3 * BLOCK

        wait_until("reuse after a restart", save_then_hit)
        for s in (sched, sched2, sched3, *schedulers):
            s.connector.shutdown()
        worker2.shutdown()
    finally:
        if stopped:
            os.kill(d.pid, signal.SIGCONT)
        d.stop()
        if restarted is not None:
            restarted.stop()


def test_prefix_caching_off_is_a_warning_and_hits_still_work(model_dir: Path,
                                                             daemon: DaemonProcess,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    from kvstore.integrations.vllm.connector import PREFIX_CACHING_OFF

    extra = {"daemon": daemon.grpc_address}
    with caplog.at_level("WARNING", logger="kvstore.integrations.vllm.connector"):
        sched = create_scheduler(create_vllm_config(model_dir, extra, prefix_caching=False))
    assert PREFIX_CACHING_OFF in caplog.text
    tokens = prompt(3 * BLOCK + 10, base=51)
    sched_a = create_scheduler(create_vllm_config(model_dir, extra))
    worker_a = KvtierConnector(create_vllm_config(model_dir, extra), KVConnectorRole.WORKER,
                               create_kv_cache_config())
    worker_a.register_kv_caches(cpu_kv_caches(51))
    run_prefill(sched_a, worker_a, [create_request("pa", tokens)])
    worker_a.shutdown()
    sched_a.connector.shutdown()
    # vLLM 0.32's EngineCore hashes blocks when a connector is set (make_request does the
    # same), so an instance without prefix caching still finds them.
    sched.add_request(create_request("pc", tokens[: 3 * BLOCK] + prompt(5, base=50)))
    out = schedule(sched, "pc")
    assert [(ld.first_block, ld.num_blocks) for ld in out.kv_connector_metadata.loads] == [(0, 3)]
    # A request vLLM did not hash (a vLLM hashing only with prefix caching on): 0 hits, said once.
    unhashed = Request(request_id="nh", prompt_token_ids=tokens, pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=1), block_hasher=None)
    with caplog.at_level("ERROR", logger="kvstore.integrations.vllm.scheduler"):
        assert sched.connector.get_num_new_matched_tokens(unhashed, 0) == (0, False)
    assert "no block hashes" in caplog.text
    sched.connector.shutdown()

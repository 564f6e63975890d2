"""KvtierConnector inside vLLM's real Scheduler, in the style of vLLM's
tests/v1/kv_connector/unit/ (``create_scheduler``, ``create_request``,
``create_model_runner_output``): no model and no vLLM process; the worker half runs the calls
vLLM's model runner makes around a forward (``execute``) on CPU tensors; a real ``kvtier
daemon`` process, stalled with SIGSTOP where a test needs a slow daemon.

No assertion is about time: where a stalled daemon must not stall vLLM, the test asserts what
the connector answered (None: "ask again") while the daemon was stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm.config import (
    VllmConfig,
)
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.kv_cache_utils import (
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from kvstore.client.store_client import StoreClient
from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.connector import KvtierConnector
from kvstore.integrations.vllm.metadata import (
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadFailure,
    SaveFailure,
)
from kvstore.integrations.vllm.scheduler import KV_EVENT_MEDIUM, SchedulerSide
from kvstore.integrations.vllm.stats import KvtierConnectorStats
from kvstore.integrations.vllm.worker import WorkerSide
from tests.support.daemon import DaemonProcess
from tests.support.vllm_unit import (
    BLOCK,
    HEAD_DIM,
    KV_HEADS,
    LAYER_NAMES,
    LAYERS,
    NUM_BLOCKS,
    create_kv_cache_config,
    create_request,
    create_scheduler,
    create_vllm_config,
    write_model_config,
)

# --- vLLM's unit-test helpers, for this connector --------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama-unit"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One daemon for the module; a test may SIGSTOP it (``stop_daemon``): it is resumed when
    the test ends."""
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-unit"), "node-vllm-unit",
                      dram_bytes="16MiB", nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.fixture
def stop_daemon(daemon: DaemonProcess) -> Iterator[Callable[[bool], None]]:
    state = {"stopped": False}

    def stop(stopped: bool = True) -> None:
        os.kill(daemon.pid, signal.SIGSTOP if stopped else signal.SIGCONT)
        state["stopped"] = stopped

    yield stop
    if state["stopped"]:
        os.kill(daemon.pid, signal.SIGCONT)


def create_worker(cfg: VllmConfig, seed: int) -> tuple[KvtierConnector, dict[str, torch.Tensor]]:
    worker = KvtierConnector(cfg, KVConnectorRole.WORKER, create_kv_cache_config())
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn((LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM), generator=g)
    caches = {n: t for n, t in zip(LAYER_NAMES, whole.to(torch.bfloat16), strict=True)}
    worker.register_kv_caches(caches)
    return worker, caches


def create_model_runner_output(out: SchedulerOutput,
                               kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None,
                             kv_connector_output=kv)


def execute(worker: KvtierConnector, out: SchedulerOutput) -> KVConnectorOutput:
    """The connector calls of vLLM's model runner around one forward
    (``KVConnectorModelRunnerMixin._get_kv_connector_output``)."""
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvtierConnectorMetadata)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, torch.empty(0), None)
    worker.wait_for_save()
    results = worker.get_transfer_results(out.finished_req_ids)
    kv = KVConnectorOutput(finished_sending=results.finished_sending,
                           finished_recving=results.finished_recving,
                           invalid_block_ids=worker.get_block_ids_with_load_errors(),
                           kv_connector_stats=worker.get_kv_connector_stats(),
                           kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    return kv


# By scheduler object, not id(): a test's scheduler freed, the next one can get its id.
_SHIPPED: weakref.WeakKeyDictionary[Scheduler, KvtierConnectorStats] = \
    weakref.WeakKeyDictionary()


def update(sched: Scheduler, out: SchedulerOutput, kv: KVConnectorOutput | None = None) -> None:
    """``update_from_output``; the connector stats vLLM ships from it are kept (``shipped``)."""
    outputs = sched.update_from_output(out, create_model_runner_output(out, kv))
    acc = _SHIPPED.setdefault(sched, KvtierConnectorStats())
    for o in outputs.values():
        if o.scheduler_stats is not None and o.scheduler_stats.kv_connector_stats:
            acc.aggregate(KvtierConnectorStats(data=dict(o.scheduler_stats.kv_connector_stats)))


def shipped(sched: Scheduler) -> KvtierConnectorStats:
    """The connector stats vLLM shipped from ``sched`` so far (the scheduler's and workers')."""
    return _SHIPPED.get(sched, KvtierConnectorStats())


def step(sched: Scheduler, worker: KvtierConnector | None = None) -> SchedulerOutput:
    """One engine step: schedule, (the worker's part of) execute, update."""
    out = sched.schedule()
    update(sched, out, execute(worker, out) if worker is not None else None)
    return out


def steps_until(what: str, sched: Scheduler, done: Callable[[SchedulerOutput], bool],
                worker: KvtierConnector | None = None, limit: int = 3000) -> SchedulerOutput:
    """Step until ``done(output)`` (a lookup ends on a background thread: a bounded number of
    steps, with a short sleep between them, not a time bound)."""
    for _ in range(limit):
        out = step(sched, worker)
        if done(out):
            return out
        time.sleep(0.01)
    raise AssertionError(f"not within {limit} steps: {what}")


def wait_until(what: str, check: Callable[[], Any], timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.02)
    return value


def prompt(n: int, base: int) -> list[int]:
    return [(base * 7 + i * 13) % 500 + 1 for i in range(n)]


def side(sched: Scheduler) -> SchedulerSide:
    s = sched.connector._scheduler  # type: ignore[union-attr]
    assert isinstance(s, SchedulerSide)
    return s


def worker_side(worker: KvtierConnector) -> WorkerSide:
    w = worker._worker
    assert w is not None
    return w


def save_blocks(model_dir: Path, daemon: DaemonProcess, tokens: list[int], seed: int) -> None:
    """Another instance computes ``tokens`` and saves its full blocks."""
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address})
    sched = create_scheduler(cfg)
    worker, _ = create_worker(cfg, seed)
    sched.add_request(create_request("saver", tokens, max_tokens=1))
    steps_until("the saver's prefill", sched, lambda o: "saver" in o.num_scheduled_tokens,
                worker)
    worker.shutdown()  # waits for the puts
    sched.connector.shutdown()  # type: ignore[union-attr]


# --- lookups ---------------------------------------------------------------------------------


def test_lookup_async_config_is_validated() -> None:
    assert ConnectorConfig.from_extra_config({"daemon": "h:1"}, {}).lookup_async is True
    cfg = ConnectorConfig.from_extra_config({"daemon": "h:1", "lookup_async": True},
                                            {"KVTIER_VLLM_LOOKUP_ASYNC": "false"})
    assert cfg.lookup_async is False
    with pytest.raises(ConfigError, match="lookup_async"):
        ConnectorConfig.from_extra_config({"daemon": "h:1", "lookup_async": "no"}, {})


def test_lookup_is_deferred_then_resolved(model_dir: Path, daemon: DaemonProcess,
                                          caplog: pytest.LogCaptureFixture) -> None:
    tokens = prompt(3 * BLOCK + 5, base=61)
    save_blocks(model_dir, daemon, tokens, seed=61)
    # The daemon's lookup (a read-index answer never defers: test_vllm_index_lookup.py).
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address, "lookup_index": "off"})
    sched = create_scheduler(cfg)
    worker, _ = create_worker(cfg, 62)
    req = create_request("b", tokens[: 3 * BLOCK] + prompt(40, base=63))
    sched.add_request(req)
    # First step: the lookup has started, the connector says "ask again"; vLLM keeps the
    # request WAITING and schedules nothing for it.
    first = step(sched, worker)
    assert "b" not in first.num_scheduled_tokens
    assert req.status == RequestStatus.WAITING and "b" in sched.requests
    assert shipped(sched).get("lookups_deferred") >= 1
    # A later step: the daemon answered, the hit of 3 blocks is loaded.
    out = steps_until("b scheduled", sched, lambda o: "b" in o.num_scheduled_tokens, worker)
    meta = out.kv_connector_metadata
    assert [(ld.first_block, ld.num_blocks) for ld in meta.loads] == [(0, 3)]
    assert out.num_scheduled_tokens["b"] == 40
    stats = shipped(sched)
    assert stats.get("lookups") == 1 and stats.get("hit_blocks") == 3
    # Per request, at request_finished (debug).
    with caplog.at_level(logging.DEBUG, logger="kvstore.integrations.vllm.scheduler"):
        steps_until("b finished", sched, lambda o: "b" in o.finished_req_ids, worker)
    assert "request b: 3 blocks from kvtier (0 load errors)" in caplog.text
    worker.shutdown()
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_synchronous_lookups_answer_in_the_same_step(model_dir: Path,
                                                     daemon: DaemonProcess) -> None:
    tokens = prompt(2 * BLOCK + 5, base=71)
    save_blocks(model_dir, daemon, tokens, seed=71)
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address, "lookup_async": False,
                                         "lookup_index": "off"})
    sched = create_scheduler(cfg)
    sched.add_request(create_request("s", tokens))
    out = step(sched)
    assert [(ld.first_block, ld.num_blocks) for ld in out.kv_connector_metadata.loads] \
        == [(0, 2)]
    assert shipped(sched).get("lookups_deferred") == 0 and shipped(sched).get("lookups") == 1
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_stopped_daemon_lookup_is_zero_hits_and_never_blocks_the_loop(
        model_dir: Path, daemon: DaemonProcess, stop_daemon: Callable[[bool], None]) -> None:
    tokens = prompt(3 * BLOCK + 5, base=81)
    save_blocks(model_dir, daemon, tokens, seed=81)
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address, "lookup_index": "off",
                                         "lookup_timeout_s": 0.5, "reconnect_interval_s": 60})
    sched = create_scheduler(cfg)
    # A request already running: the engine loop must keep serving it.
    sched.add_request(create_request("running", prompt(BLOCK - 3, base=82), max_tokens=500))
    steps_until("running admitted", sched, lambda o: "running" in o.num_scheduled_tokens)
    stop_daemon(True)
    req = create_request("late", tokens)
    sched.add_request(req)
    # Every ask while the daemon is stopped answers at once with "ask again", never a wait.
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (None, False)
    deferred = step(sched)
    assert "late" not in deferred.num_scheduled_tokens
    assert deferred.num_scheduled_tokens.get("running") == 1  # decoding goes on meanwhile
    # Past lookup_timeout_s the lookup is 0 hits: the whole prompt is computed.
    out = steps_until("late scheduled", sched, lambda o: "late" in o.num_scheduled_tokens)
    assert out.kv_connector_metadata.loads == []
    assert out.num_scheduled_tokens["late"] == len(tokens)
    assert out.num_scheduled_tokens["running"] == 1
    stats = shipped(sched)
    assert stats.get("lookup_timeouts") == 1 and stats.get("lookup_errors") == 1
    assert stats.get("hit_blocks") == 0
    stop_daemon(False)
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_request_aborted_while_its_lookup_is_pending_is_forgotten(
        model_dir: Path, daemon: DaemonProcess, stop_daemon: Callable[[bool], None]) -> None:
    tokens = prompt(3 * BLOCK + 5, base=91)
    save_blocks(model_dir, daemon, tokens, seed=91)
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address, "lookup_index": "off",
                                         "lookup_timeout_s": 5.0})
    sched = create_scheduler(cfg)
    stop_daemon(True)
    sched.add_request(create_request("gone", tokens))
    out = step(sched)
    assert "gone" not in out.num_scheduled_tokens
    assert side(sched).pending_lookups() == 1
    sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    assert "gone" not in side(sched)._reqs and side(sched).pending_lookups() == 0
    stop_daemon(False)
    # The scheduler goes on: the next request of the same prompt gets its hit (no deadlock
    # with a request waiting and blocks free), and the aborted one never reappears.
    sched.add_request(create_request("next", tokens))
    out = steps_until("next scheduled", sched, lambda o: "next" in o.num_scheduled_tokens)
    assert [(ld.first_block, ld.num_blocks) for ld in out.kv_connector_metadata.loads] \
        == [(0, 3)]
    assert "gone" not in out.num_scheduled_tokens and "gone" not in sched.requests
    sched.connector.shutdown()  # type: ignore[union-attr]


# --- saves -----------------------------------------------------------------------------------


def test_failed_save_is_rolled_back_and_saved_again(
        model_dir: Path, daemon: DaemonProcess, stop_daemon: Callable[[bool], None]) -> None:
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address,
                                         "save_timeout_s": 0.3})
    sched = create_scheduler(cfg)
    worker, _ = create_worker(cfg, 101)
    tokens = prompt(3 * BLOCK + 5, base=101)
    sched.add_request(create_request("f", tokens, max_tokens=20))
    out = sched.schedule()
    while "f" not in out.num_scheduled_tokens:  # the lookup (a miss) in flight
        update(sched, out, execute(worker, out))
        time.sleep(0.01)
        out = sched.schedule()
    assert [(s.first_block, len(s.keys), s.seq) for s in out.kv_connector_metadata.saves] \
        == [(0, 3, 1)]
    stop_daemon(True)  # the step's puts cannot land
    update(sched, out, execute(worker, out))
    wait_until("the puts given up", lambda: worker_side(worker).saves_in_flight() == 0)
    stop_daemon(False)
    # The next step's worker output reports the failure; the scheduler half rolls back...
    out = step(sched, worker)
    assert out.num_scheduled_tokens == {"f": 1} and out.kv_connector_metadata.saves == []
    assert side(sched)._reqs["f"].stored_blocks == 0
    # ...and the step after saves the 3 blocks again.
    out = step(sched, worker)
    assert [(s.first_block, len(s.keys), s.seq) for s in out.kv_connector_metadata.saves] \
        == [(0, 3, 2)]
    stats = shipped(sched)
    assert stats.get("save_retry_blocks") == 3 and stats.get("save_failed_blocks") == 3
    # The retry lands: a cold instance finds the 3 blocks.
    wait_until("the retry saved", lambda: worker_side(worker).saves_in_flight() == 0)
    probe_cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address})
    probe = create_scheduler(probe_cfg)
    probe.add_request(create_request("probe-f", tokens))
    hit = steps_until("probe scheduled", probe, lambda o: "probe-f" in o.num_scheduled_tokens)
    assert [(ld.first_block, ld.num_blocks) for ld in hit.kv_connector_metadata.loads] == [(0, 3)]
    worker.shutdown()
    for s in (sched, probe):
        s.connector.shutdown()  # type: ignore[union-attr]


def test_blocks_that_failed_to_load_are_saved_once_recomputed(
        model_dir: Path, daemon: DaemonProcess) -> None:
    """A chunk gone between the lookup and the load (removed here, as an eviction would):
    blocks 1.. do not arrive, vLLM recomputes them, and the step that recomputes them saves
    them; what the request computed in the step of the failed load (over blocks that did not
    arrive) is never put. A cold instance then finds the whole prefix (it once found 1 block:
    the hit counted as stored, the recomputed blocks were never saved, and the daemon refused
    every later block of the prefix: "parent is not cached")."""
    head = prompt(4 * BLOCK + 5, base=141)
    save_blocks(model_dir, daemon, head, seed=141)
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address})
    sched = create_scheduler(cfg)
    worker, _ = create_worker(cfg, 142)
    tokens = head[: 4 * BLOCK] + prompt(2 * BLOCK + 5, base=143)
    req = create_request("r", tokens, max_tokens=20)
    sched.add_request(req)
    out = sched.schedule()
    while "r" not in out.num_scheduled_tokens:  # the lookup in flight
        update(sched, out, execute(worker, out))
        time.sleep(0.01)
        out = sched.schedule()
    meta = out.kv_connector_metadata
    assert [(ld.first_block, ld.num_blocks) for ld in meta.loads] == [(0, 4)]
    assert [(s.first_block, len(s.keys)) for s in meta.saves] == [(4, 6)]
    with StoreClient.connect(daemon.grpc_address) as store:
        assert len(store.remove(side(sched).keys_of(req, 2)[1])) >= 1  # block 1 and after it
    kv = execute(worker, out)
    assert kv.invalid_block_ids == set(meta.loads[0].block_ids[1:4])
    report = kv.kv_connector_worker_meta
    assert isinstance(report, KvtierWorkerMetadata)
    assert report.load_failed == [LoadFailure("r", 1)]
    update(sched, out, kv)
    assert side(sched)._reqs["r"].stored_blocks == 1
    # vLLM recomputes blocks 1..; that step saves them (and the step's blocks 4, 5 again).
    out = step(sched, worker)
    assert out.num_scheduled_tokens["r"] == len(tokens) - BLOCK
    assert [(s.first_block, len(s.keys)) for s in out.kv_connector_metadata.saves] == [(1, 6)]
    wait_until("saved", lambda: worker_side(worker).saves_in_flight() == 0)
    step(sched, worker)  # carries the save reports
    stats = shipped(sched)
    assert stats.get("load_resave_blocks") == 5 and stats.get("load_error_blocks") == 3
    assert stats.get("save_failed_blocks") == 2  # the failed load's step: not put
    probe = create_scheduler(create_vllm_config(model_dir, {"daemon": daemon.grpc_address}))
    probe.add_request(create_request("probe-r", tokens))
    hit = steps_until("probe scheduled", probe, lambda o: "probe-r" in o.num_scheduled_tokens)
    assert [(ld.first_block, ld.num_blocks) for ld in hit.kv_connector_metadata.loads] == [(0, 6)]
    worker.shutdown()
    for s in (sched, probe):
        s.connector.shutdown()  # type: ignore[union-attr]


def test_a_client_closed_under_a_step_is_a_failed_save_not_a_crash(
        model_dir: Path, daemon: DaemonProcess) -> None:
    """The session closes a failed daemon's client in the background, possibly while a step
    holds a save begun on it: the step's save is dropped and reported, vLLM's forward never
    sees the client's RuntimeError (end to end, that error killed vLLM's worker)."""
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address})
    sched = create_scheduler(cfg)
    worker, _ = create_worker(cfg, 131)
    sched.add_request(create_request("c", prompt(2 * BLOCK + 5, base=131), max_tokens=20))
    out = sched.schedule()
    while "c" not in out.num_scheduled_tokens:
        update(sched, out)
        time.sleep(0.01)
        out = sched.schedule()
    meta = out.kv_connector_metadata
    assert [(s.first_block, len(s.keys)) for s in meta.saves] == [(0, 2)]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)  # type: ignore[arg-type]
    client = worker_side(worker).session.get()
    assert client is not None
    client.close()  # as the session's background close does after a daemon failure
    for name in LAYER_NAMES:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, torch.empty(0), None)
    worker.wait_for_save()
    report = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    assert isinstance(report, KvtierWorkerMetadata)
    assert report.failed == [SaveFailure("c", 1, 0)] and report.saved == []
    update(sched, out, KVConnectorOutput(kv_connector_worker_meta=report))
    assert side(sched)._reqs["c"].stored_blocks == 0  # saved again with its next step
    worker.shutdown()
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_failure_reports_roll_back_once_and_aggregate_over_tp_ranks(
        model_dir: Path, daemon: DaemonProcess) -> None:
    """The worker->scheduler report through vLLM's KVConnectorOutput, as vLLM aggregates
    TP ranks (``KVOutputAggregator``: ``aggregate``), without a worker."""
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address})
    sched = create_scheduler(cfg)
    tokens = prompt(4 * BLOCK + 5, base=111)
    sched.add_request(create_request("t", tokens, max_tokens=20))
    out = steps_until("t scheduled", sched, lambda o: "t" in o.num_scheduled_tokens)
    assert [(s.first_block, len(s.keys)) for s in out.kv_connector_metadata.saves] == [(0, 4)]
    rank0 = KvtierWorkerMetadata(saved=[("t", 1)])
    rank1 = KvtierWorkerMetadata(failed=[SaveFailure("t", 1, 2)])
    report = rank0.aggregate(rank1)
    sched.connector.update_connector_output(  # type: ignore[union-attr]
        KVConnectorOutput(kv_connector_worker_meta=report))
    assert side(sched)._reqs["t"].stored_blocks == 2
    out = step(sched)
    assert [(s.first_block, len(s.keys), s.seq) for s in out.kv_connector_metadata.saves] \
        == [(2, 4, 2)]
    # A late report of the first save, older than the retry that covers it: no second retry.
    sched.connector.update_connector_output(  # type: ignore[union-attr]
        KVConnectorOutput(kv_connector_worker_meta=KvtierWorkerMetadata(
            failed=[SaveFailure("t", 1, 3)])))
    assert side(sched)._reqs["t"].stored_blocks == 4
    # A report for a request that finished meanwhile is dropped.
    sched.finish_requests("t", RequestStatus.FINISHED_ABORTED)
    sched.connector.update_connector_output(  # type: ignore[union-attr]
        KVConnectorOutput(kv_connector_worker_meta=KvtierWorkerMetadata(
            failed=[SaveFailure("t", 2, 2)])))
    assert "t" not in side(sched)._reqs
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_finished_request_frees_at_once_and_its_saves_become_kv_events(
        model_dir: Path, daemon: DaemonProcess, stop_daemon: Callable[[bool], None]) -> None:
    """Saves copy out of vLLM's blocks within the step: vLLM frees (and may overwrite) the
    blocks of a finished request while its puts are still in flight, and the store still
    gets the bytes of the step. Each save the workers confirm is a BlockStored event."""
    cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address}, kv_events=True)
    sched = create_scheduler(cfg)
    published: list[KVEventBatch] = []
    sched.kv_event_publisher.publish = published.append  # type: ignore[method-assign]
    worker, caches = create_worker(cfg, 121)
    tokens = prompt(2 * BLOCK + 5, base=121)
    req = create_request("e", tokens, max_tokens=1)
    sched.add_request(req)
    out = sched.schedule()
    while "e" not in out.num_scheduled_tokens:
        update(sched, out)
        time.sleep(0.01)
        out = sched.schedule()
    saved_ids = out.kv_connector_metadata.saves[0].block_ids[:2]
    expected = {n: caches[n][list(saved_ids)].clone() for n in LAYER_NAMES}
    stop_daemon(True)  # the puts wait; the copies out of vLLM's blocks do not
    kv = execute(worker, out)
    assert kv.finished_sending == set() and kv.finished_recving == set()
    update(sched, out, kv)  # max_tokens=1: done
    assert req.is_finished() and "e" not in sched.requests  # freed at once, not delayed
    for n in LAYER_NAMES:  # vLLM reuses the blocks
        caches[n].zero_()
    stop_daemon(False)
    wait_until("saved", lambda: worker_side(worker).saves_in_flight() == 0)
    # The next step carries the confirmation; the scheduler publishes the event.
    step(sched, worker)
    events = [e for b in published for e in b.events if isinstance(e, BlockStored)
              and e.medium == KV_EVENT_MEDIUM]
    assert len(events) == 1
    assert events[0].block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[:2]]
    assert events[0].parent_block_hash is None and events[0].token_ids == tokens[: 2 * BLOCK]
    # A cold instance loads the bytes of the step, not the zeroes written after it.
    cold = create_scheduler(create_vllm_config(model_dir, {"daemon": daemon.grpc_address}))
    cold_worker, cold_caches = create_worker(cfg, 122)
    cold.add_request(create_request("e2", tokens))
    hit = steps_until("e2", cold, lambda o: "e2" in o.num_scheduled_tokens, cold_worker)
    target = list(hit.kv_connector_metadata.loads[0].target_block_ids)
    for n in LAYER_NAMES:
        assert torch.equal(cold_caches[n][target], expected[n])
    for w in (worker, cold_worker):
        w.shutdown()
    for s in (sched, cold):
        s.connector.shutdown()  # type: ignore[union-attr]


# --- the manifest ----------------------------------------------------------------------------


def test_instances_of_one_model_with_other_hash_settings_are_reported(
        model_dir: Path, daemon: DaemonProcess, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {"daemon": daemon.grpc_address, "model": "manifest-test-model"}

    def start(**kw: Any) -> SchedulerSide:
        block = kw.get("block_size", BLOCK)
        conn = KvtierConnector(create_vllm_config(model_dir, extra, **kw),
                               KVConnectorRole.SCHEDULER, create_kv_cache_config(block))
        s = conn._scheduler
        assert s is not None
        return s

    with caplog.at_level(logging.ERROR, logger="kvstore.integrations.vllm.manifest"):
        first = start()
        same = start()
        assert first.mismatches == [] and same.mismatches == []
        other_block = start(block_size=2 * BLOCK)
        other_algo = start(algo="sha256")
        monkeypatch.setenv("PYTHONHASHSEED", "another-seed")
        other_seed = start()
    assert other_block.mismatches == [f"block size {2 * BLOCK} here, {BLOCK} there"]
    assert other_algo.mismatches == ["prefix_caching_hash_algo 'sha256' here, 'sha256_cbor' "
                                     "there"]
    assert len(other_seed.mismatches) == 1 and "PYTHONHASHSEED" in other_seed.mismatches[0]
    errors = [r.getMessage() for r in caplog.records
              if r.name == "kvstore.integrations.vllm.manifest"]
    assert len(errors) == 3
    assert "manifest-test-model" in errors[0] and "block size 64 here, 32 there" in errors[0]
    stats = other_block.take_stats()
    assert isinstance(stats, KvtierConnectorStats) and stats.get("config_mismatch") == 1
    for s in (first, same, other_block, other_algo, other_seed):
        s.close()

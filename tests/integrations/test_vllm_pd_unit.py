"""Prefill/decode disaggregation through kvtier, inside vLLM's real ``Scheduler`` (no model, no
vLLM process; the worker half runs on CPU tensors) with a real ``kvtier daemon``: the prefill
instance's ``request_finished`` hands off its blocks in ``kv_transfer_params``; the decode
instance's request waits in its lookup until the store holds them (the prefill's puts are made
to land late by running the prefill's worker half after the request finished), stops waiting at
``pd_wait_timeout_s``, and never waits for a hand-off that does not match its own blocks.

No assertion is about time: a wait is shown by the steps in which the request was not
scheduled while the blocks were missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvstore.errors import InvalidArgument
from kvstore.integrations.vllm.connector import KvtierConnector
from kvstore.integrations.vllm.metadata import PdHandoff
from kvstore.integrations.vllm.stats import KvtierConnectorStats
from tests.integrations.test_vllm_scheduler_unit import (
    create_model_runner_output,
    create_worker,
    execute,
    prompt,
    save_blocks,
    side,
)
from tests.support.daemon import DaemonProcess
from tests.support.vllm_unit import (
    BLOCK,
    create_scheduler,
    create_vllm_config,
    write_model_config,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama-pd"))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-pd"), "node-vllm-pd",
                      dram_bytes="16MiB", nvme=False)
    d.start()
    yield d
    d.stop()


class Engine:
    """One instance's scheduler (and worker half): steps that keep vLLM's outputs and the
    connector stats it shipped."""

    def __init__(self, model_dir: Path, daemon: DaemonProcess, role: str, seed: int,
                 worker: bool = True, **extra: Any) -> None:
        cfg = create_vllm_config(model_dir, {"daemon": daemon.grpc_address, **extra})
        assert cfg.kv_transfer_config is not None
        cfg.kv_transfer_config.kv_role = role  # type: ignore[assignment]
        self.sched: Scheduler = create_scheduler(cfg)
        self.worker: KvtierConnector | None = None
        self.caches: dict[str, torch.Tensor] = {}
        if worker:
            self.worker, self.caches = create_worker(cfg, seed)
        self.stats = KvtierConnectorStats()
        self.params: dict[str, dict[str, Any] | None] = {}
        """kv_transfer_params of each finished request, as vLLM returns them."""

    def step(self, worker: bool = True) -> SchedulerOutput:
        out = self.sched.schedule()
        kv: KVConnectorOutput | None = None
        if worker and self.worker is not None:
            kv = execute(self.worker, out)
        self.update(out, kv)
        return out

    def update(self, out: SchedulerOutput, kv: KVConnectorOutput | None) -> None:
        outputs = self.sched.update_from_output(out, create_model_runner_output(out, kv))
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    self.params[o.request_id] = o.kv_transfer_params
            if eco.scheduler_stats is not None and eco.scheduler_stats.kv_connector_stats:
                self.stats.aggregate(KvtierConnectorStats(
                    data=dict(eco.scheduler_stats.kv_connector_stats)))

    def until_scheduled(self, req_id: str, limit: int = 3000) -> tuple[SchedulerOutput, int]:
        """Steps until ``req_id`` is scheduled: that step's output, and how many steps before
        it did not schedule it."""
        for skipped in range(limit):
            out = self.step()
            if req_id in out.num_scheduled_tokens:
                return out, skipped
            time.sleep(0.005)
        raise AssertionError(f"{req_id} not scheduled within {limit} steps")

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()  # waits for the puts in flight
        self.sched.connector.shutdown()  # type: ignore[union-attr]


def pd_request(req_id: str, tokens: list[int], params: dict[str, Any] | None, *,
               max_tokens: int = 4, salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    extra = {"kv_transfer_params": params} if params is not None else None
    return Request(request_id=req_id, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                  extra_args=extra),
                   pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def prefill(engine: Engine, req_id: str, tokens: list[int], *, worker: bool = True,
            salt: str | None = None) -> tuple[dict[str, Any], SchedulerOutput]:
    """The proxy's first hop: max_tokens=1 with do_remote_decode; the params vLLM answers and
    the step that computed the prompt."""
    engine.sched.add_request(pd_request(req_id, tokens, dict(PREFILL), max_tokens=1,
                                        salt=salt))
    for _ in range(3000):
        out = engine.step(worker)
        if req_id in engine.params:
            params = engine.params[req_id]
            assert params is not None
            return params, out
    raise AssertionError(f"{req_id} did not finish")


def test_handoff_params_round_trip_and_are_validated() -> None:
    h = PdHandoff(3, b"\x01\x02", 32)
    params = h.to_params()
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "kvtier": {"blocks": 3, "key": "0102", "block_tokens": 32}}
    assert PdHandoff.from_params(params) == h
    assert PdHandoff.from_params({"do_remote_prefill": True, "kvtier": {"blocks": 2}}) == \
        PdHandoff(2)
    assert PdHandoff.from_params({"kvtier": {"blocks": 2}}) is None  # not a decode request
    assert PdHandoff.from_params({"do_remote_prefill": True}) is None  # another connector's
    assert PdHandoff.from_params(None) is None
    for bad in ({"blocks": -1}, {"blocks": "3"}, {"blocks": True}, {"blocks": 1, "key": "zz"},
                {"blocks": 1, "key": 5}, {"blocks": 1, "block_tokens": "x"}, [1]):
        with pytest.raises(InvalidArgument):
            PdHandoff.from_params({"do_remote_prefill": True, "kvtier": bad})


def test_prefill_hands_off_its_blocks_and_the_decode_loads_them(
        model_dir: Path, daemon: DaemonProcess) -> None:
    tokens = prompt(3 * BLOCK + 5, base=201)
    p = Engine(model_dir, daemon, "kv_producer", seed=201)
    params, p_out = prefill(p, "p", tokens)
    p.close()  # its puts are done
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    key = side(p.sched).keys_of(pd_request("k", tokens, None), 3)[-1]
    assert params["kvtier"] == {"blocks": 3, "key": key.hex(), "block_tokens": BLOCK}
    assert p.stats.get("pd_sent") == 1 and p.stats.get("pd_sent_blocks") == 3
    p_ids = p_out.scheduled_new_reqs[0].block_ids[0][:3]

    d = Engine(model_dir, daemon, "kv_consumer", seed=202, pd_wait_timeout_s=300)
    d.sched.add_request(pd_request("d", tokens, params))
    out, _ = d.until_scheduled("d")
    assert [(ld.first_block, ld.num_blocks) for ld in out.kv_connector_metadata.loads] == \
        [(0, 3)]
    assert out.num_scheduled_tokens["d"] == 5  # only the last partial block is computed
    d_ids = out.scheduled_new_reqs[0].block_ids[0][:3]
    for name, cache in d.caches.items():  # the prefill's KV, block for block
        assert torch.equal(cache[list(d_ids)], p.caches[name][list(p_ids)])
    assert d.stats.get("pd_received") == 1 and d.stats.get("pd_waited") == 0
    assert d.stats.get("pd_mismatches") == 0 and d.stats.get("hit_blocks") == 3
    d.close()


def test_the_decode_waits_until_the_prefills_puts_land(model_dir: Path,
                                                        daemon: DaemonProcess) -> None:
    tokens = prompt(3 * BLOCK + 7, base=211)
    p = Engine(model_dir, daemon, "kv_both", seed=211)
    # The prefill finishes and answers before its worker half ran: its puts are still to come.
    params, p_out = prefill(p, "p", tokens, worker=False)
    assert params["kvtier"]["blocks"] == 3

    d = Engine(model_dir, daemon, "kv_consumer", seed=212, pd_wait_timeout_s=300)
    d.sched.add_request(pd_request("d", tokens, params))
    # The store lacks the blocks: the request is not scheduled, and is looked up again.
    for _ in range(3000):
        out = d.step()
        assert "d" not in out.num_scheduled_tokens
        assert d.sched.requests["d"].num_computed_tokens == 0
        if d.stats.get("lookups") >= 3:
            break
        time.sleep(0.005)
    assert d.stats.get("lookups") >= 3
    assert d.stats.get("pd_waited") == 1 and d.stats.get("pd_wait_timeouts") == 0

    assert p.worker is not None
    execute(p.worker, p_out)  # now the prefill's worker half copies and puts the blocks
    out, _ = d.until_scheduled("d")
    assert [(ld.first_block, ld.num_blocks) for ld in out.kv_connector_metadata.loads] == \
        [(0, 3)]
    assert out.num_scheduled_tokens["d"] == 7
    assert d.stats.get("pd_waited") == 1 and d.stats.get("pd_wait_timeouts") == 0
    p.close()
    d.close()


def test_the_decode_stops_waiting_at_pd_wait_timeout_and_takes_what_is_there(
        model_dir: Path, daemon: DaemonProcess) -> None:
    tokens = prompt(3 * BLOCK + 5, base=221)
    p = Engine(model_dir, daemon, "kv_both", seed=221, worker=False)
    params, _ = prefill(p, "p", tokens, worker=False)  # its puts never happen
    p.close()
    save_blocks(model_dir, daemon, tokens[:BLOCK + 3], seed=222)  # only block 0 is stored
    d = Engine(model_dir, daemon, "kv_consumer", seed=223, pd_wait_timeout_s=0.2)
    d.sched.add_request(pd_request("d", tokens, params))
    out, skipped = d.until_scheduled("d")
    assert skipped >= 1
    assert [(ld.first_block, ld.num_blocks) for ld in out.kv_connector_metadata.loads] == \
        [(0, 1)]
    assert out.num_scheduled_tokens["d"] == 2 * BLOCK + 5  # vLLM computes the rest
    assert d.stats.get("pd_waited") == 1 and d.stats.get("pd_wait_timeouts") == 1
    assert d.stats.get("pd_missing_blocks") == 2
    d.close()


@pytest.mark.parametrize("how", ["other salt", "malformed", "too many blocks"])
def test_a_handoff_that_does_not_match_is_not_waited_for(
        model_dir: Path, daemon: DaemonProcess, how: str) -> None:
    tokens = prompt(3 * BLOCK + 5, base=231)
    p = Engine(model_dir, daemon, "kv_both", seed=231, worker=False)
    params, _ = prefill(p, "p", tokens, worker=False, salt="tenant-a")  # never put
    p.close()
    if how == "malformed":
        params = {**params, "kvtier": {"blocks": "three"}}
    elif how == "too many blocks":
        params = {**params, "kvtier": {"blocks": 9}}
    d = Engine(model_dir, daemon, "kv_consumer", seed=232, pd_wait_timeout_s=300)
    d.sched.add_request(pd_request("d", tokens, params))  # no salt: other keys
    out, _ = d.until_scheduled("d")  # as soon as its one lookup answered
    assert out.kv_connector_metadata.loads == []
    assert out.num_scheduled_tokens["d"] == len(tokens)
    assert d.stats.get("pd_mismatches") == 1 and d.stats.get("pd_waited") == 0
    assert d.stats.get("lookups") == 1
    d.close()


def test_no_handoff_from_an_instance_that_does_not_save_nor_for_other_requests(
        model_dir: Path, daemon: DaemonProcess) -> None:
    tokens = prompt(2 * BLOCK + 5, base=241)
    consumer = Engine(model_dir, daemon, "kv_consumer", seed=241, worker=False)
    consumer.sched.add_request(pd_request("p", tokens, dict(PREFILL), max_tokens=1))
    consumer.until_scheduled("p")
    consumer.step(worker=False)
    assert "p" in consumer.params and consumer.params["p"] is None
    consumer.close()
    both = Engine(model_dir, daemon, "kv_both", seed=242, worker=False)
    both.sched.add_request(pd_request("plain", tokens, None, max_tokens=1))
    while "plain" not in both.params:
        both.step(worker=False)
    assert both.params["plain"] is None and both.stats.get("pd_sent") == 0
    both.close()

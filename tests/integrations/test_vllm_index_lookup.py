"""Scheduler lookups answered from the same-host daemon's read index (``lookup_index``), in
vLLM's real Scheduler with the connector, as in test_vllm_scheduler_unit.py: a hit is answered
on vLLM's first ask (no "ask again" step), only chunks the session's tenant may read count,
and the cases the index cannot answer go to the daemon (an NVMe tier, the TCP data plane).

Real daemons (one with DRAM only, one with DRAM and NVMe), real shared memory; no assertion is
about time.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from kvstore.client.store_client import StoreClient
from kvstore.client.store_config import StoreClientConfig
from kvstore.dataplane.tier import TierKind
from tests.integrations.test_vllm_scheduler_unit import (
    create_worker,
    execute,
    prompt,
    save_blocks,
    shipped,
    side,
    step,
    steps_until,
    update,
)
from tests.support.daemon import DaemonProcess
from tests.support.vllm_unit import (
    BLOCK,
    create_request,
    create_scheduler,
    create_vllm_config,
    write_model_config,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_config(tmp_path_factory.mktemp("tiny-llama-index"))


@pytest.fixture(scope="module")
def dram_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-index-dram"), "node-index-dram",
                      dram_bytes="16MiB", nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def nvme_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-index-nvme"), "node-index-nvme",
                      dram_bytes="16MiB", nvme=True)
    d.start()
    yield d
    d.stop()


def loads(out: object) -> list[tuple[int, int]]:
    meta = out.kv_connector_metadata  # type: ignore[attr-defined]
    return [(ld.first_block, ld.num_blocks) for ld in meta.loads]


def test_a_hit_the_index_covers_is_answered_on_the_first_ask(model_dir: Path,
                                                            nvme_daemon: DaemonProcess) -> None:
    # A daemon with an NVMe tier: only an index that covers every asked block answers.
    tokens = prompt(3 * BLOCK + 5, base=201)
    save_blocks(model_dir, nvme_daemon, tokens, seed=201)
    cfg = create_vllm_config(model_dir, {"daemon": nvme_daemon.grpc_address})
    sched = create_scheduler(cfg)
    req = create_request("h", tokens)
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    sched.add_request(req)
    out = step(sched)  # scheduled in vLLM's first step, its 3 blocks loading
    assert loads(out) == [(0, 3)] and out.num_scheduled_tokens["h"] == 5
    stats = shipped(sched)
    assert stats.get("lookups_deferred") == 0
    assert stats.get("lookups") == 1 and stats.get("lookups_local") == 1
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_blocks_in_nvme_only_are_found_by_the_daemons_lookup(model_dir: Path,
                                                             nvme_daemon: DaemonProcess) -> None:
    tokens = prompt(3 * BLOCK + 5, base=211)
    save_blocks(model_dir, nvme_daemon, tokens, seed=211)
    cfg = create_vllm_config(model_dir, {"daemon": nvme_daemon.grpc_address})
    sched = create_scheduler(cfg)
    req = create_request("n", tokens)
    keys = side(sched).keys_of(req, 3)
    with StoreClient.connect(nvme_daemon.grpc_address) as admin:
        for _ in range(64):  # demote the least recently used chunk until none of ours is left
            if admin.published_prefix(keys[2:]) == 0:
                break
            admin.evict(tier=TierKind.DRAM, bytes_=1)
    store = side(sched).session.get()
    assert store is not None
    assert store.store.published_prefix(keys) == 0
    assert store.store.lookup(keys).length == 3
    sched.add_request(req)
    first = step(sched)
    assert "n" not in first.num_scheduled_tokens  # asked of the daemon: "ask again"
    out = steps_until("n scheduled", sched, lambda o: "n" in o.num_scheduled_tokens)
    assert loads(out) == [(0, 3)]
    stats = shipped(sched)
    assert stats.get("lookups_deferred") >= 1 and stats.get("lookups_local") == 0
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_partial_hit_with_an_nvme_tier_asks_the_daemon(model_dir: Path,
                                                         nvme_daemon: DaemonProcess) -> None:
    tokens = prompt(3 * BLOCK, base=221)
    save_blocks(model_dir, nvme_daemon, [*tokens, 1], seed=221)
    cfg = create_vllm_config(model_dir, {"daemon": nvme_daemon.grpc_address})
    sched = create_scheduler(cfg)
    sched.add_request(create_request("p", tokens + prompt(2 * BLOCK + 5, base=222)))
    first = step(sched)
    assert "p" not in first.num_scheduled_tokens  # blocks 3..4 might be in NVMe
    out = steps_until("p scheduled", sched, lambda o: "p" in o.num_scheduled_tokens)
    assert loads(out) == [(0, 3)]
    assert shipped(sched).get("lookups_local") == 0
    sched.connector.shutdown()  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["auto", "covered"])
def test_a_dram_only_daemon_answers_misses_and_partial_hits_at_once(
        model_dir: Path, dram_daemon: DaemonProcess, mode: str) -> None:
    base = 231 if mode == "auto" else 241
    tokens = prompt(3 * BLOCK, base=base)
    save_blocks(model_dir, dram_daemon, [*tokens, 1], seed=base)
    cfg = create_vllm_config(model_dir, {"daemon": dram_daemon.grpc_address,
                                         "lookup_index": mode})
    sched = create_scheduler(cfg)
    sched.add_request(create_request("miss", prompt(4 * BLOCK + 3, base=base + 1)))
    sched.add_request(create_request("part", tokens + prompt(2 * BLOCK + 5, base=base + 2)))
    first = step(sched)
    stats = shipped(sched)
    if mode == "auto":  # the index knows everything a DRAM-only daemon holds
        assert set(first.num_scheduled_tokens) == {"miss", "part"}
        assert loads(first) == [(0, 3)]
        assert first.num_scheduled_tokens["miss"] == 4 * BLOCK + 3
        assert stats.get("lookups_local") == 2 and stats.get("lookups_deferred") == 0
    else:  # covered: neither request's blocks are all in the index
        assert first.num_scheduled_tokens == {}
        assert stats.get("lookups_local") == 0 and stats.get("lookups_deferred") == 2
        out = steps_until("part scheduled", sched, lambda o: "part" in o.num_scheduled_tokens)
        assert loads(out) == [(0, 3)]
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_another_tenants_chunks_are_not_a_hit(model_dir: Path,
                                              dram_daemon: DaemonProcess) -> None:
    """Same keys (one cache_salt), other tenant: the daemon (without security) stores the
    saver's chunks as the default tenant's, and a lookup for ``globex`` does not see them;
    neither does the index (the data plane's own reader copies every owner's chunks here)."""
    tokens = prompt(3 * BLOCK + 5, base=251)
    saver = create_vllm_config(model_dir, {"daemon": dram_daemon.grpc_address})
    sched = create_scheduler(saver)
    worker, _ = create_worker(saver, 251)
    sched.add_request(create_request("saver", tokens, max_tokens=1, salt="s-251"))
    steps_until("saved", sched, lambda o: "saver" in o.num_scheduled_tokens, worker)
    worker.shutdown()
    sched.connector.shutdown()  # type: ignore[union-attr]

    for tenant, hit in (("globex", 0), ("", 3)):
        cfg = create_vllm_config(model_dir, {"daemon": dram_daemon.grpc_address,
                                             "tenant": tenant})
        sched = create_scheduler(cfg)
        req = create_request(f"r-{tenant}", tokens, salt="s-251")
        keys = side(sched).keys_of(req, 3)
        with StoreClient.connect(dram_daemon.grpc_address,
                                 StoreClientConfig(tenant=tenant or None)) as store:
            assert store.lookup(keys).length == hit  # what the daemon says
            assert store.plane.reader is not None
            assert store.plane.reader.locate(keys[0]) is not None  # unscoped: every owner's
        answer = sched.connector.get_num_new_matched_tokens(req, 0)
        assert answer == (hit * BLOCK, False), tenant
        assert shipped(sched).get("lookups_local") == 0  # (not shipped yet: no step)
        assert side(sched).stats.get("lookups_local") == 1
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_tcp_client_asks_the_daemon(model_dir: Path, dram_daemon: DaemonProcess) -> None:
    """No read index without shared memory (a daemon on another host): today's async path."""
    tokens = prompt(3 * BLOCK + 5, base=261)
    save_blocks(model_dir, dram_daemon, tokens, seed=261)
    cfg = create_vllm_config(model_dir, {"daemon": dram_daemon.grpc_address,
                                         "data_plane": "tcp"})
    sched = create_scheduler(cfg)
    req = create_request("t", tokens)
    assert sched.connector.get_num_new_matched_tokens(req, 0) == (None, False)
    sched.add_request(req)
    out = steps_until("t scheduled", sched, lambda o: "t" in o.num_scheduled_tokens)
    assert loads(out) == [(0, 3)]
    assert shipped(sched).get("lookups_local") == 0
    sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_chunk_evicted_after_the_index_answered_is_recomputed(
        model_dir: Path, dram_daemon: DaemonProcess) -> None:
    tokens = prompt(3 * BLOCK + 5, base=271)
    save_blocks(model_dir, dram_daemon, tokens, seed=271)
    cfg = create_vllm_config(model_dir, {"daemon": dram_daemon.grpc_address})
    sched = create_scheduler(cfg)
    worker, _ = create_worker(cfg, 272)
    req = create_request("e", tokens)
    sched.add_request(req)
    out = sched.schedule()
    assert loads(out) == [(0, 3)]  # the index answered: 3 blocks
    load_ids = set(out.kv_connector_metadata.loads[0].target_block_ids)
    keys = side(sched).keys_of(req, 3)
    with StoreClient.connect(dram_daemon.grpc_address) as store:
        assert set(store.remove(keys[1])) == {keys[1], keys[2]}  # gone before the load
    kv = execute(worker, out)
    assert kv.invalid_block_ids and kv.invalid_block_ids <= load_ids
    update(sched, out, kv)
    # vLLM recomputes what did not arrive; the request goes on (never an error).
    steps_until("e finished", sched, lambda o: "e" in o.finished_req_ids, worker)
    assert req.status != RequestStatus.FINISHED_ERROR
    assert shipped(sched).get("load_error_blocks") >= 2
    worker.shutdown()
    sched.connector.shutdown()  # type: ignore[union-attr]

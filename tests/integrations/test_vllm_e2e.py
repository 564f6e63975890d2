"""kvtier as vLLM's KV connector, end to end: real vLLM instances (kvstore/cluster/vllm_instance.py), a
real kvtier daemon (tests/support/daemon.py), a tiny random-weight Llama made locally.

The phases share their instances (module-scoped fixtures; a vLLM start costs about a minute on
two busy cores), one instance at a time:

1. no connector: instance ``base-1`` (no prefix caching: every prompt fully prefilled) serves
   every prompt this module uses, ``base-2`` (prefix caching on, the prompts in reverse order)
   serves them again; greedy outputs must agree. ``base-1``'s outputs are the reference.
2. with the connector: instance ``A`` (``kv_both``) serves the ``SAVED`` prompts and saves them
   through the daemon, and is closed; instance ``B`` starts cold (an empty prefix cache of its
   own) and serves prompts that share prefixes with them. Each B request's expected external
   hit is computed from what A computed (prompt plus all but the last generated token, full
   blocks only, never the whole prompt) and checked with vLLM's own counter
   (``vllm:external_prefix_cache_hits``) and ``num_cached_tokens``; outputs equal the
   reference. Both connector instances run chunked prefill with a 96-token step budget.
3. the daemon killed while B serves, then gone: requests complete, outputs unchanged.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.vllm_instance import (
    GenerateResult,
    TinyLlama,
    VllmProcess,
    tiny_llama_checkpoint,
)
from tests.support.common import wait_until
from tests.support.daemon import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
MAX_TOKENS = 8
SPEC = TinyLlama()
MODEL_NAME = f"tiny-llama-{SPEC.key()}"
CONNECTOR_MODULE = "kvstore.integrations.vllm.connector"
CHUNK_BUDGET = 96
"""``max_num_batched_tokens`` of the connector instances: long prefills run in chunks."""


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, SPEC.vocab_size) for _ in range(n)]


@dataclass(frozen=True)
class Saved:
    """A prompt instance A serves (and saves through kvtier)."""

    tokens: list[int]
    salt: str | None = None


SAVED: dict[str, Saved] = {
    "on": Saved(_tokens(1, 4 * BLOCK)),            # ends on a block boundary
    "off": Saved(_tokens(2, 4 * BLOCK + 22)),      # ends inside a block
    "long": Saved(_tokens(3, 12 * BLOCK + 16)),    # several chunks of prefill
    "turn1": Saved(_tokens(4, 7 * BLOCK + 26)),    # + 7 decoded tokens: one more full block
    "tenant": Saved(_tokens(5, 5 * BLOCK), salt="tenant-a"),
    "nosalt": Saved(_tokens(6, 5 * BLOCK)),
    "kill0": Saved(_tokens(7, 5 * BLOCK + 3)),
    "kill1": Saved(_tokens(8, 6 * BLOCK + 9)),
    "kill2": Saved(_tokens(9, 4 * BLOCK + 30)),
    "kill3": Saved(_tokens(10, 7 * BLOCK + 1)),
}


@dataclass(frozen=True)
class Query:
    """A prompt instance B serves."""

    tokens: list[int]
    salt: str | None = None


def _queries(outputs: dict[str, list[int]]) -> dict[str, Query]:
    """B's prompts; ``turn2`` continues ``turn1``'s conversation, so it needs its output."""
    s = {name: saved.tokens for name, saved in SAVED.items()}
    return {
        "on+tail": Query(s["on"] + _tokens(101, 40)),
        "on-same": Query(s["on"]),                         # the whole prompt is stored
        "off+tail": Query(s["off"] + _tokens(102, 30)),
        "off-diverge": Query(s["off"][:140] + _tokens(103, 60)),   # differs inside block 5
        "long+tail": Query(s["long"] + _tokens(104, 100)),
        "long-head": Query(s["long"][:130] + _tokens(112, 30)),
        "long+tail2": Query(s["long"] + _tokens(114, 60)),
        "turn2": Query(s["turn1"] + outputs["turn1"] + _tokens(105, 50)),
        "turn3": Query(s["turn1"] + outputs["turn1"] + _tokens(105, 50)
                       + outputs.get("turn2", []) + _tokens(106, 20)),
        "fresh": Query(_tokens(107, 150)),
        "resume": Query(_tokens(113, 140)),
        "tenant-b": Query(s["tenant"] + _tokens(108, 40), salt="tenant-b"),
        "tenant-a": Query(s["tenant"] + _tokens(109, 40), salt="tenant-a"),
        "tenant-none": Query(s["tenant"] + _tokens(110, 40)),
        "nosalt-as-a": Query(s["nosalt"] + _tokens(111, 40), salt="tenant-a"),
        **{f"kill{i}+tail": Query(s[f"kill{i}"] + _tokens(120 + i, 33)) for i in range(4)},
    }


def _expected_external(query: Query, already_local: int = 0) -> int:
    """Tokens B should take from kvtier: the longest run of full blocks shared with what A
    computed for a saved prompt of the same tenant (its prompt and all but its last generated
    token), never the whole prompt, beyond the ``already_local`` tokens B holds itself."""
    best = 0
    limit = len(query.tokens) - 1
    for name, saved in SAVED.items():
        if saved.salt != query.salt:
            continue
        computed = saved.tokens + REFERENCE.get(name, [])[:-1]
        common = 0
        for a, b in zip(query.tokens, computed, strict=False):
            if a != b:
                break
            common += 1
        best = max(best, min(common, limit) // BLOCK * BLOCK)
    return max(0, best - already_local)


REFERENCE: dict[str, list[int]] = {}
"""Name -> greedy output of ``base-1`` (filled by the ``reference`` fixture)."""


# ---------------------------------------------------------------------------------------------
# Phase 1: no connector


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_llama_checkpoint(SPEC)


def _serve_all(llm: VllmProcess, reverse: bool) -> dict[str, list[int]]:
    """Every prompt of the module: SAVED first (turn2/turn3 need earlier outputs)."""
    outputs: dict[str, list[int]] = {}

    def run(items: list[tuple[str, list[int], str | None]]) -> None:
        if reverse:
            items = items[::-1]
        result = llm.generate([t for _, t, _ in items], max_tokens=MAX_TOKENS,
                              cache_salt=[s for _, _, s in items])
        for (name, _, _), out in zip(items, result.outputs, strict=True):
            outputs[name] = out.token_ids

    run([(n, s.tokens, s.salt) for n, s in SAVED.items()])
    queries = _queries(outputs)
    run([(n, q.tokens, q.salt) for n, q in queries.items() if n != "turn3"])
    queries = _queries(outputs)
    run([("turn3", queries["turn3"].tokens, None)])
    return outputs


@pytest.fixture(scope="module")
def reference(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[str, list[int]]:
    with VllmProcess(model_dir, tmp_path_factory.mktemp("vllm-base"), "base-1",
                     enable_prefix_caching=False) as llm:
        outputs = _serve_all(llm, reverse=False)
    REFERENCE.clear()
    REFERENCE.update(outputs)
    return outputs


def test_greedy_outputs_agree_across_two_instances_without_a_connector(
        model_dir: Path, reference: dict[str, list[int]],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("vllm-base2")
    llm = VllmProcess(model_dir, work, "base-2")
    try:
        llm.start()
        group = llm.group_pids()
        assert len(group) >= 2, f"expected EngineCore/Worker children in the group: {group}"
        again = _serve_all(llm, reverse=True)
        shm = llm.shm_segments
    finally:
        llm.close()
    assert again == reference
    assert all(len(out) == MAX_TOKENS for out in reference.values())
    assert len({tuple(out) for out in reference.values()}) > len(reference) // 2, \
        "the tiny model should not give every prompt the same continuation"
    # Teardown left nothing of the group behind.
    assert llm.group_pids() == []
    assert not [name for name in shm if (Path("/dev/shm") / name).exists()]


# ---------------------------------------------------------------------------------------------
# Phases 2 and 3: the connector


def _kv_transfer_config(daemon: DaemonProcess) -> dict[str, Any]:
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "daemon": daemon.grpc_address, "model": MODEL_NAME,
            "lookup_timeout_s": 2.0, "load_timeout_s": 10.0, "save_timeout_s": 20.0,
            "reconnect_interval_s": 0.5,
        },
    }


def _connector_instance(model_dir: Path, work: Path, name: str,
                        daemon: DaemonProcess) -> VllmProcess:
    return VllmProcess(model_dir, work, name, kv_transfer_config=_kv_transfer_config(daemon),
                       engine_kwargs={"max_num_batched_tokens": CHUNK_BUDGET,
                                      "enable_chunked_prefill": True})


def _daemon_stats(daemon: DaemonProcess) -> dict[str, Any]:
    """The daemon's ``kvtier stats`` document (over gRPC, from this process)."""
    from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
    from kvstore.wire import stats_doc

    client = StoreClient.connect(daemon.grpc_address, StoreClientConfig(
        data_plane=DataPlane.TCP, rpc_timeout_s=5.0))
    try:
        return stats_doc(client.stats(), daemon.grpc_address)
    finally:
        client.close()


def _stored_chunks(daemon: DaemonProcess) -> int:
    return sum(int(t["chunks"]) for t in _daemon_stats(daemon)["tiers"])


def _served(daemon: DaemonProcess) -> int:
    """Lookups and reads the daemon answered so far (grows once B asks it anything)."""
    doc = _daemon_stats(daemon)
    return int(doc["hits"]) + int(doc["misses"]) + sum(int(t["bytes_read"])
                                                       for t in doc["tiers"])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    node = DaemonProcess(tmp_path_factory.mktemp("kvtier-daemon"), "vllm-e2e",
                         dram_bytes="128MiB", nvme=False)
    node.start()
    try:
        yield node
    finally:
        node.stop()


@dataclass
class SavePhase:
    results: dict[str, GenerateResult]
    chunks_after: int
    log: str


@pytest.fixture(scope="module")
def saved_by_a(model_dir: Path, reference: dict[str, list[int]], daemon: DaemonProcess,
               tmp_path_factory: pytest.TempPathFactory) -> SavePhase:
    """Instance A serves every SAVED prompt (one at a time), then is closed."""
    work = tmp_path_factory.mktemp("vllm-a")
    results: dict[str, GenerateResult] = {}
    with _connector_instance(model_dir, work, "A", daemon) as llm:
        for name, saved in SAVED.items():
            results[name] = llm.generate([saved.tokens], max_tokens=MAX_TOKENS,
                                         cache_salt=saved.salt)
        log = llm.log_tail(200)
    return SavePhase(results, _stored_chunks(daemon), log)


@pytest.fixture(scope="module")
def instance_b(model_dir: Path, saved_by_a: SavePhase, daemon: DaemonProcess,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    llm = _connector_instance(model_dir, tmp_path_factory.mktemp("vllm-b"), "B", daemon)
    try:
        llm.start()
        yield llm
    finally:
        llm.close()


def _ask(llm: VllmProcess, name: str, query: Query, *, reset: bool = True) -> GenerateResult:
    """One request on B; ``reset`` first empties B's own prefix cache, so that what it holds
    from earlier tests cannot stand in for kvtier (B's saves to kvtier stay)."""
    if reset:
        assert llm.reset_prefix_cache()
    result = llm.generate([query.tokens], max_tokens=MAX_TOKENS, cache_salt=query.salt)
    assert result.outputs[0].token_ids == REFERENCE[name], \
        f"{name}: output differs from the no-connector reference"
    return result


def test_instance_a_saves_through_kvtier_and_its_outputs_are_unchanged(
        saved_by_a: SavePhase, reference: dict[str, list[int]]) -> None:
    for name, result in saved_by_a.results.items():
        assert result.outputs[0].token_ids == reference[name], name
        assert result.external_hit_tokens == 0, f"{name}: nothing was stored before A"
    assert saved_by_a.chunks_after > 0, f"A stored nothing; A's log:\n{saved_by_a.log}"


@pytest.mark.parametrize("name", ["on+tail", "off+tail", "off-diverge", "long+tail"])
def test_cold_instance_b_loads_shared_prefixes_from_kvtier(
        instance_b: VllmProcess, reference: dict[str, list[int]], name: str) -> None:
    query = _queries(reference)[name]
    expected = _expected_external(query)
    assert expected >= 4 * BLOCK
    result = _ask(instance_b, name, query)
    assert result.external_hit_tokens == expected, (name, result.counters)
    assert result.local_hit_tokens == 0
    assert result.outputs[0].num_cached_tokens == expected
    assert result.counters["vllm:prompt_tokens"] == len(query.tokens)


def test_own_prefix_cache_and_kvtier_hits_add_up(instance_b: VllmProcess,
                                                 reference: dict[str, list[int]]) -> None:
    queries = _queries(reference)
    head = _ask(instance_b, "long-head", queries["long-head"])
    assert head.external_hit_tokens == 4 * BLOCK
    # B now holds long's first 4 blocks itself; kvtier gives the next 8 (a prompt B has not
    # served before: what B saved itself is not in _expected_external).
    full = _ask(instance_b, "long+tail2", queries["long+tail2"], reset=False)
    assert full.local_hit_tokens == 4 * BLOCK, full.counters
    assert full.external_hit_tokens == _expected_external(queries["long+tail2"], 4 * BLOCK) \
        == 8 * BLOCK
    assert full.outputs[0].num_cached_tokens == 12 * BLOCK


def test_a_fully_stored_prompt_still_computes_its_last_token(
        instance_b: VllmProcess, reference: dict[str, list[int]]) -> None:
    query = _queries(reference)["on-same"]
    result = _ask(instance_b, "on-same", query)
    # 4 stored blocks, but the last prompt token must be computed: 3 blocks from kvtier.
    assert result.external_hit_tokens == 3 * BLOCK == _expected_external(query)
    assert result.outputs[0].num_cached_tokens == 3 * BLOCK


def test_a_prompt_extending_a_conversation_reuses_its_decoded_blocks_too(
        instance_b: VllmProcess, reference: dict[str, list[int]]) -> None:
    queries = _queries(reference)
    turn2 = queries["turn2"]
    expected = _expected_external(turn2)
    # turn1 is 7 blocks + 26 tokens; with the 7 tokens A decoded, 8 full blocks.
    assert expected == 8 * BLOCK
    result = _ask(instance_b, "turn2", turn2)
    assert result.external_hit_tokens == expected, result.counters
    # turn3 extends turn2 on B itself: B's own prefix cache (or kvtier) serves turn2's blocks.
    turn3 = queries["turn3"]
    result3 = _ask(instance_b, "turn3", turn3, reset=False)
    assert result3.outputs[0].num_cached_tokens >= len(turn2.tokens) // BLOCK * BLOCK
    # And with B's own cache emptied, what B itself saved of turn2 comes back from kvtier.
    result3 = _ask(instance_b, "turn3", turn3)
    assert result3.external_hit_tokens >= len(turn2.tokens) // BLOCK * BLOCK, result3.counters


def test_a_prompt_nobody_stored_is_a_miss(instance_b: VllmProcess,
                                          reference: dict[str, list[int]]) -> None:
    query = _queries(reference)["fresh"]
    result = _ask(instance_b, "fresh", query)
    assert result.external_hit_tokens == 0
    assert result.outputs[0].num_cached_tokens == 0


def test_two_tenants_share_nothing(instance_b: VllmProcess,
                                   reference: dict[str, list[int]]) -> None:
    queries = _queries(reference)
    # A stored "tenant" under tenant-a: tenant-b and no tenant find nothing of it.
    for name in ("tenant-b", "tenant-none"):
        result = _ask(instance_b, name, queries[name])
        assert result.external_hit_tokens == 0, (name, result.counters)
        assert result.outputs[0].num_cached_tokens == 0, name
    # A stored "nosalt" without a tenant: tenant-a does not see it either.
    result = _ask(instance_b, "nosalt-as-a", queries["nosalt-as-a"])
    assert result.external_hit_tokens == 0
    # The owner does.
    owner = queries["tenant-a"]
    result = _ask(instance_b, "tenant-a", owner)
    assert result.external_hit_tokens == _expected_external(owner) == 5 * BLOCK


def test_daemon_killed_mid_run_outputs_unchanged_and_requests_complete(
        instance_b: VllmProcess, daemon: DaemonProcess,
        reference: dict[str, list[int]]) -> None:
    """Last in the module: it kills the shared daemon."""
    queries = _queries(reference)
    names = [f"kill{i}+tail" for i in range(4)]
    results: dict[str, Any] = {}

    def serve() -> None:
        try:
            results["batch"] = instance_b.generate([queries[n].tokens for n in names],
                                                   max_tokens=MAX_TOKENS)
        except BaseException as exc:  # re-raised below, in the test's thread
            results["error"] = exc

    before = _served(daemon)
    worker = threading.Thread(target=serve)
    worker.start()
    # Kill it once B's batch has reached it (or the batch is already done: then the daemon
    # dies between requests instead, which the second half covers anyway).
    wait_until(lambda: not worker.is_alive() or _served(daemon) > before, timeout_s=120,
               what="B's batch reaching the daemon", poll_s=0.05)
    mid_run = worker.is_alive()
    daemon.kill()
    worker.join(300)
    assert not worker.is_alive(), "the batch did not complete after the daemon died"
    if "error" in results:
        raise results["error"]
    batch: GenerateResult = results["batch"]
    assert batch.token_ids == [reference[n] for n in names], f"killed mid-run: {mid_run}"
    # With the daemon gone for good, B serves at full recompute, one request after another.
    assert instance_b.reset_prefix_cache()
    for name in ("fresh", "on+tail"):
        again = instance_b.generate([queries[name].tokens], max_tokens=MAX_TOKENS)
        assert again.token_ids == [reference[name]], name
    assert instance_b.alive()


def test_reuse_resumes_when_the_daemon_is_back(
        instance_b: VllmProcess, daemon: DaemonProcess, reference: dict[str, list[int]],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """After the kill above, a new (empty) daemon on the same gRPC port: B reconnects by
    itself, saves again and hits again."""
    daemon.kill()  # already dead when run after the test above
    port = daemon.grpc_address.rsplit(":", 1)[1]
    reborn = DaemonProcess(tmp_path_factory.mktemp("kvtier-daemon-2"), "vllm-e2e-2",
                           dram_bytes="128MiB", nvme=False,
                           settings={"server.grpc_port": port})
    reborn.start()
    try:
        assert reborn.grpc_address == daemon.grpc_address
        query = _queries(reference)["resume"]
        hits = 0
        for _ in range(40):  # bounded: reconnect_interval_s is 0.5 s
            result = _ask(instance_b, "resume", query)  # B's own cache emptied each time
            hits = result.external_hit_tokens
            if hits:
                break
            time.sleep(0.5)
        assert hits == len(query.tokens) // BLOCK * BLOCK, \
            f"no kvtier hits after the daemon came back; B's log:\n{instance_b.log_tail()}"
    finally:
        reborn.stop()

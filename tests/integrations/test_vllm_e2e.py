"""kvtier as vLLM's KV connector, end to end: real vLLM instances (kvstore/cluster/vllm_instance.py), a
real kvtier daemon (tests/support/daemon.py), a tiny random-weight Llama made locally.

The phases share their instances (module-scoped fixtures; a vLLM start costs about a minute on
two busy cores), one instance at a time:

1. no connector: instance ``base-1`` (no prefix caching: every prompt fully prefilled) serves
   every prompt this module uses, ``base-2`` (prefix caching on, the prompts in reverse order)
   serves them again; greedy outputs must agree. ``base-1``'s outputs are the reference.
2. with the connector: instance ``A`` (``kv_both``) serves the ``SAVED`` prompts and saves them
   through the daemon (which writes every chunk to NVMe, ``cache.write_tier=nvme``, and keeps a
   clean copy in DRAM), and is closed; instance ``B`` starts cold (an empty prefix cache of its
   own) and serves prompts that share prefixes with them. Each B request's expected external
   hit is computed from what A computed (prompt plus all but the last generated token, full
   blocks only, never the whole prompt) and checked with vLLM's own counter
   (``vllm:external_prefix_cache_hits``) and ``num_cached_tokens``; outputs equal the
   reference. Both connector instances run chunked prefill with a 96-token step budget.
3. payload bytes of two stored blocks flipped in the NVMe segment files across a daemon restart
   (so no DRAM copy is left): one found at open, one at its first read; neither is ever loaded,
   vLLM recomputes them, the daemon counts each once.
4. the daemon stopped (SIGSTOP) while B serves: requests complete within the connector's
   timeouts with unchanged outputs; after SIGCONT B gets hits again.
5. the daemon killed while B serves, then gone: requests complete, outputs unchanged; a new
   daemon on the same port: B reconnects by itself and reuse resumes.

One instance at a time, and as few as the phases allow: B serves every phase after 2.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.vllm_instance import (
    HASH_SEED,
    GenerateResult,
    TinyLlama,
    VllmProcess,
    tiny_llama_checkpoint,
)
from tests.support.common import flip_byte, wait_until
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
    # First: A's oldest records, so that a daemon restart does not verify them at open.
    "rot-read": Saved(_tokens(11, 6 * BLOCK + 12)),
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
    **{f"slow{i}": Saved(_tokens(12 + i, (4 + i) * BLOCK + 5)) for i in range(4)},
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
        **{f"slow{i}+tail": Query(s[f"slow{i}"] + _tokens(130 + i, 35)) for i in range(4)},
        "slow0+other": Query(s["slow0"] + _tokens(134, 20)),
        "rot-read+tail": Query(s["rot-read"] + _tokens(140, 30)),
        "rot-read+tail2": Query(s["rot-read"] + _tokens(141, 25)),
        "rot-open": Query(_tokens(142, 6 * BLOCK + 3)),      # B saves it just before a restart
        "rot-open+tail": Query(_tokens(142, 6 * BLOCK + 3) + _tokens(143, 30)),
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
                     enable_prefix_caching=False, single_process=True) as llm:
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


def _connector_instance(model_dir: Path, work: Path, name: str, daemon: DaemonProcess,
                        single_process: bool = False) -> VllmProcess:
    return VllmProcess(model_dir, work, name, kv_transfer_config=_kv_transfer_config(daemon),
                       engine_kwargs={"max_num_batched_tokens": CHUNK_BUDGET,
                                      "enable_chunked_prefill": True},
                       single_process=single_process)


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


def _held_blocks(daemon: DaemonProcess, keys: list[bytes]) -> int:
    """Leading blocks of ``keys`` the daemon holds (a Lookup over gRPC, from this process)."""
    from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig

    client = StoreClient.connect(daemon.grpc_address, StoreClientConfig(
        data_plane=DataPlane.TCP, rpc_timeout_s=5.0))
    try:
        return client.lookup(keys).length
    finally:
        client.close()


def _served(daemon: DaemonProcess) -> int:
    """Lookups and reads the daemon answered so far (grows once B asks it anything)."""
    doc = _daemon_stats(daemon)
    return int(doc["hits"]) + int(doc["misses"]) + sum(int(t["bytes_read"])
                                                       for t in doc["tiers"])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    node = DaemonProcess(tmp_path_factory.mktemp("kvtier-daemon"), "vllm-e2e",
                         dram_bytes="128MiB", settings={"cache.write_tier": "nvme"})
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
    # A only saves: one process starts in a third of the time. B, which loads and meets the
    # daemon's failures, keeps vLLM's own process layout (the halves' metadata is pickled).
    with _connector_instance(model_dir, work, "A", daemon, single_process=True) as llm:
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
        instance_b: VllmProcess, daemon: DaemonProcess,
        reference: dict[str, list[int]]) -> None:
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
    # B's puts run on after its steps (docs/vllm-connector.md, "Saves"): the block B computed
    # in turn2's first step may land after turn3 was asked, so wait until it is in the store.
    # (Not waiting, this saw 256 hit tokens of 288 once in a full make test, and every time
    # with turn2's commit held back 4 s on the save thread: the block was stored after.)
    turn2_keys = _block_keys(turn2.tokens)
    wait_until(lambda: _held_blocks(daemon, turn2_keys) == len(turn2_keys), timeout_s=60,
               what="B's save of turn2's blocks in the store")
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


def _nvme_corrupt(daemon: DaemonProcess) -> int:
    return sum(int(t["corrupt"]) for t in _daemon_stats(daemon)["tiers"] if t["tier"] == "nvme")


def _block_keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """kvtier's keys of the full blocks of ``tokens`` (as the connector makes them from vLLM's
    sha256_cbor block hashes: kvtier computes the same hashes)."""
    from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace

    fingerprint = KVFingerprint(model=MODEL_NAME, dtype=KVDtype(SPEC.dtype),
                                num_layers=SPEC.num_layers, num_kv_heads=SPEC.num_kv_heads,
                                head_dim=SPEC.head_dim, block_size_tokens=BLOCK)
    hasher = BlockHasher(Namespace(fingerprint, salt or ""), mode=HashMode.SHA256_CBOR,
                         vllm_hash_seed=HASH_SEED)
    return [bytes(key) for key in hasher.hash_blocks(tokens)]


@dataclass(frozen=True)
class _Record:
    path: Path
    payload_offset: int
    seq: int


def _nvme_records(directory: Path) -> dict[bytes, _Record]:
    """Every LIVE record in the daemon's segment files, by key (a hop along each segment's
    header chain; the daemon is stopped)."""
    from kvstore.dataplane.nvme.format import (
        HEADER_BYTES,
        RecordKind,
        decode_record_header,
        decode_segment_header,
    )

    records: dict[bytes, _Record] = {}
    for path in sorted(directory.glob("seg-*.kvt")):
        data = path.read_bytes()
        segment = decode_segment_header(data[:HEADER_BYTES])
        assert segment is not None, path
        pos = HEADER_BYTES
        while pos + HEADER_BYTES <= min(segment.segment_bytes, len(data)):
            _, header = decode_record_header(data[pos:pos + HEADER_BYTES],
                                             segment_id=segment.segment_id, offset=pos,
                                             segment_bytes=segment.segment_bytes)
            assert header is not None, f"broken header chain in {path} at {pos}"
            if header.kind is RecordKind.LIVE:
                records[header.key] = _Record(path, pos + HEADER_BYTES, header.seq)
            pos = header.end
    return records


LOAD_ERRORS = "vllm:kvtier_load_error_blocks"
"""The connector's counter of blocks reported to vLLM as not loaded (recomputed)."""


def _until_reused(llm: VllmProcess, name: str, query: Query, expected: int) -> GenerateResult:
    """Ask ``query`` (B's own cache emptied each time) until it gets ``expected`` external
    hits and loads them all: after a daemon failure both halves of the connector (scheduler
    and worker) reconnect by themselves, each after reconnect_interval_s (0.5 s here)."""
    result = None
    for _ in range(40):
        result = _ask(llm, name, query)
        if result.external_hit_tokens == expected and not result.counters.get(LOAD_ERRORS):
            return result
        time.sleep(0.5)
    raise AssertionError(f"{name}: never {expected} hits loaded ({result and result.counters})"
                         f"; log:\n{llm.log_tail()}")


ROT_READ_BLOCK = 2
"""The block of ``rot-read`` (saved by A, among the oldest records) whose payload is flipped:
a daemon restart does not verify it, the first read does."""
ROT_OPEN_BLOCK = 3
"""The block of ``rot-open`` (saved by B just before the restart: among the newest records,
which the restart verifies) whose payload is flipped."""


def test_blocks_rotted_on_nvme_are_never_loaded_and_are_recomputed(
        instance_b: VllmProcess, daemon: DaemonProcess,
        reference: dict[str, list[int]]) -> None:
    """The daemon writes every chunk to NVMe (``cache.write_tier=nvme``). It is stopped, one
    payload byte of two stored blocks is flipped in the segment files, and it is restarted on
    the same port and directory (so no DRAM copy is left). The block among the newest records
    is found at open (it and its descendants are dropped: B's lookup stops before it); the
    older one at its first read (B's lookup offers it, the blocks before it load, it fails,
    vLLM recomputes it and the connector saves it again: the next lookup finds it). Outputs equal the reference throughout, and the daemon
    counts each corrupt block once."""
    from kvstore.dataplane.nvme.config import NvmeTierConfig

    queries = _queries(reference)
    rot_open = queries["rot-open"]
    open_blocks = (len(rot_open.tokens) + MAX_TOKENS - 1) // BLOCK  # what B computes
    open_keys = _block_keys(rot_open.tokens + REFERENCE["rot-open"][:-1])
    assert len(open_keys) == open_blocks
    _ask(instance_b, "rot-open", rot_open)
    # Its own keys, not a count of chunks on NVMe: puts of earlier requests that landed late
    # (they run after their steps) once made up the count while rot-open's last 3 blocks were
    # still in flight, and the stop below lost them ("blocks not on NVMe: [9, 10, 11]"). A
    # committed chunk is on NVMe here (cache.write_tier=nvme: written there before it is published).
    wait_until(lambda: _held_blocks(daemon, open_keys) == open_blocks, timeout_s=60,
               what="B's saves of rot-open on NVMe")
    assert _nvme_corrupt(daemon) == 0

    daemon.stop()
    records = _nvme_records(Path(daemon.settings["nvme.directory"]))
    saved = SAVED["rot-read"]
    read_keys = _block_keys(saved.tokens + REFERENCE["rot-read"][:-1])
    missing = [i for i, k in enumerate(read_keys + open_keys) if k not in records]
    assert not missing, f"blocks not on NVMe (or the test's keys differ): {missing}"
    verified_at_open = NvmeTierConfig.__dataclass_fields__["open_verify_newest"].default
    newer = sorted((r.seq for r in records.values()), reverse=True)
    read_rec = records[read_keys[ROT_READ_BLOCK]]
    open_rec = records[open_keys[ROT_OPEN_BLOCK]]
    assert read_rec.seq < newer[verified_at_open - 1], "rot-read would be verified at open"
    assert open_rec.seq >= newer[verified_at_open - 1], "rot-open would not be verified at open"
    for rec in (read_rec, open_rec):
        flip_byte(rec.path, rec.payload_offset + 1000)

    port = daemon.grpc_address.rsplit(":", 1)[1]
    address = daemon.grpc_address
    daemon.settings["server.grpc_port"] = port
    daemon.start()
    assert daemon.grpc_address == address
    assert _nvme_corrupt(daemon) == 1, "the open did not count the newest record's corruption"

    # B reconnects by itself: wait until it loads an intact stored prefix again.
    warm = queries["on-same"]
    _until_reused(instance_b, "on-same", warm, _expected_external(warm))

    # Found at open: the lookup stops before the corrupt block; nothing fails to load.
    result = _ask(instance_b, "rot-open+tail", queries["rot-open+tail"])
    assert result.external_hit_tokens == ROT_OPEN_BLOCK * BLOCK, result.counters
    assert result.counters.get(LOAD_ERRORS, 0) == 0, result.counters
    assert result.outputs[0].num_cached_tokens == ROT_OPEN_BLOCK * BLOCK

    # Found at read: offered by the lookup (vLLM counts the offer), not loaded, recomputed.
    query = queries["rot-read+tail"]
    offered = _expected_external(query)
    assert offered == 6 * BLOCK
    result = _ask(instance_b, "rot-read+tail", query)
    assert result.external_hit_tokens == offered, result.counters
    # The blocks before the corrupt one are loaded; it and the offered blocks after it are
    # reported to vLLM as load errors (the batch load once stopped at 0 of the 6).
    loaded = result.counters.get("vllm:kvtier_loaded_blocks", 0)
    errors = result.counters.get(LOAD_ERRORS, 0)
    assert loaded == ROT_READ_BLOCK and loaded + errors == offered // BLOCK, result.counters
    assert _nvme_corrupt(daemon) == 2, "the read did not count the corrupt block"
    # The daemon dropped it (and its descendants); the connector saved the blocks vLLM
    # recomputed, so the next lookup of that prefix finds all 6 shared blocks again (it once
    # stopped before the corrupt block: the recomputed blocks were never saved). Those puts
    # run on after B's steps, as in the conversation test: wait until they landed.
    wait_until(lambda: _held_blocks(daemon, read_keys[:6]) == 6, timeout_s=60,
               what="B's saves of the recomputed rot-read blocks in the store")
    result = _ask(instance_b, "rot-read+tail2", queries["rot-read+tail2"])
    assert result.external_hit_tokens == 6 * BLOCK, result.counters
    assert result.counters.get(LOAD_ERRORS, 0) == 0, result.counters
    assert _nvme_corrupt(daemon) == 2


class _BackgroundBatch:
    """``instance.generate(prompts)`` on a thread of its own, started once the test is ready
    to fault the daemon: :meth:`start` returns when the batch has reached the daemon (or is
    already done), with ``mid_run`` saying which; :meth:`result` joins it and re-raises, in the
    test's thread, what the batch raised."""

    def __init__(self, instance: VllmProcess, daemon: DaemonProcess,
                 prompts: list[list[int]], timeout_s: float = 180.0) -> None:
        self._results: dict[str, Any] = {}
        self._daemon = daemon

        def serve() -> None:
            try:
                self._results["batch"] = instance.generate(prompts, max_tokens=MAX_TOKENS,
                                                           timeout_s=timeout_s)
            except BaseException as exc:  # re-raised by result(), in the test's thread
                self._results["error"] = exc

        self._thread = threading.Thread(target=serve)
        self.mid_run = False

    def start(self) -> None:
        before = _served(self._daemon)
        self._thread.start()
        wait_until(lambda: not self._thread.is_alive() or _served(self._daemon) > before,
                   timeout_s=120, what="the batch reaching the daemon", poll_s=0.05)
        self.mid_run = self._thread.is_alive()

    def result(self, timeout_s: float, why: str) -> GenerateResult:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the batch did not complete {why}"
        if "error" in self._results:
            raise self._results["error"]
        batch: GenerateResult = self._results["batch"]
        return batch


def test_a_stopped_daemon_delays_requests_only_up_to_the_timeouts_and_reuse_resumes(
        instance_b: VllmProcess, daemon: DaemonProcess,
        reference: dict[str, list[int]]) -> None:
    """SIGSTOP the daemon while a batch that needs it runs: every lookup, load and save is
    bounded (lookup_timeout_s, load_timeout_s, save_timeout_s), so the batch and a request
    sent while it is still stopped complete with the reference outputs; after SIGCONT the
    connector uses it again and a cold request gets A's blocks. (No timing is asserted.)"""
    queries = _queries(reference)
    names = [f"slow{i}+tail" for i in range(3)]
    assert instance_b.reset_prefix_cache()
    run = _BackgroundBatch(instance_b, daemon, [queries[n].tokens for n in names], timeout_s=400)
    run.start()
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        batch = run.result(450, "while the daemon was stopped")
        assert batch.token_ids == [reference[n] for n in names], f"stopped mid-run: {run.mid_run}"
        # Still stopped: a request that starts now (its lookup meets the stopped daemon).
        assert instance_b.reset_prefix_cache()
        alone = instance_b.generate([queries["slow3+tail"].tokens], max_tokens=MAX_TOKENS,
                                    timeout_s=400)
        assert alone.token_ids == [reference["slow3+tail"]]
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # Resumed: a prompt sharing only slow0's stored prefix gets exactly A's blocks of it.
    query = queries["slow0+other"]
    expected = _expected_external(query)
    assert expected == 4 * BLOCK
    _until_reused(instance_b, "slow0+other", query, expected)


def test_daemon_killed_mid_run_outputs_unchanged_and_requests_complete(
        instance_b: VllmProcess, daemon: DaemonProcess,
        reference: dict[str, list[int]]) -> None:
    """Last in the module: it kills the shared daemon."""
    queries = _queries(reference)
    names = [f"kill{i}+tail" for i in range(4)]
    run = _BackgroundBatch(instance_b, daemon, [queries[n].tokens for n in names])
    # Kill it once B's batch has reached it (or the batch is already done: then the daemon
    # dies between requests instead, which the second half covers anyway).
    run.start()
    daemon.kill()
    batch = run.result(300, "after the daemon died")
    assert batch.token_ids == [reference[n] for n in names], f"killed mid-run: {run.mid_run}"
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

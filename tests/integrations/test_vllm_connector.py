"""KvtierConnector against a real daemon and vLLM's real Scheduler (fake model-runner output,
in the style of vLLM's tests/v1/kv_connector/unit/): no model run, no weights (a local
random-LlamaConfig config.json only)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

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
from tests.support.daemon import DaemonProcess

BLOCK = 32
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
NUM_BLOCKS = 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                head_dim=HEAD_DIM, max_position_embeddings=1024,
                torch_dtype="bfloat16").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("vllm-connector"), "node-vllm",
                      dram_bytes="16MiB", nvme=False)
    d.start()
    yield d
    d.stop()


def make_config(model_dir: Path, extra: dict[str, Any], *,
                policy: str = "recompute", algo: str = "sha256_cbor") -> VllmConfig:
    model_config = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0,
                               max_model_len=1024, skip_tokenizer_init=True)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True,
                                 prefix_caching_hash_algo=algo),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvstore.integrations.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy=policy,
            kv_connector_extra_config=extra),
        device_config=DeviceConfig("cpu"))


def kv_cache_config() -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYER_NAMES, FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS,
                                                        head_size=HEAD_DIM,
                                                        dtype=torch.bfloat16))])


def make_scheduler(cfg: VllmConfig) -> Scheduler:
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config(), log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)


def make_request(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    init_none_hash(sha256_cbor)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=params,
                   pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def runner_output(reqs: list[Request], invalid: set[int] | None = None) -> ModelRunnerOutput:
    from vllm.v1.outputs import KVConnectorOutput

    ids = [r.request_id for r in reqs]
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids], logprobs=None, prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=None if invalid is None else KVConnectorOutput(
            invalid_block_ids=invalid))


def cpu_kv_caches(seed: int) -> dict[str, torch.Tensor]:
    """As CPU vLLM allocates them: one buffer, per-layer [blocks, heads, block, 2*head] views."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn((LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM), generator=g)
    whole = whole.to(torch.bfloat16)
    return {name: whole[i] for i, name in enumerate(LAYER_NAMES)}


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
        KvtierConnector(make_config(model_dir, extra, policy="fail"), KVConnectorRole.SCHEDULER,
                        kv_cache_config())
    with pytest.raises(ConfigError, match="prefix_caching_hash_algo"):
        KvtierConnector(make_config(model_dir, extra, algo="xxhash"),
                        KVConnectorRole.SCHEDULER, kv_cache_config())


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
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, KvtierConnectorMetadata)
    errors = worker_step(worker, meta)
    sched.update_from_output(out, runner_output(reqs, errors or None))
    return out, meta, errors


def test_blocks_saved_by_one_instance_are_hits_for_another(model_dir: Path,
                                                           daemon: DaemonProcess) -> None:
    extra = {"daemon": daemon.grpc_address}
    kvc = kv_cache_config()
    # Instance A: prefill 3 full blocks + 10 tokens; the 3 blocks are saved.
    sched_a = make_scheduler(make_config(model_dir, extra))
    worker_a = KvtierConnector(make_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    caches_a = cpu_kv_caches(11)
    worker_a.register_kv_caches(caches_a)
    tokens = prompt(3 * BLOCK + 10)
    req_a = make_request("a", tokens)
    _out_a, meta_a, _ = run_prefill(sched_a, worker_a, [req_a])
    assert [(s.first_block, len(s.keys)) for s in meta_a.saves] == [(0, 3)]
    saved_ids = meta_a.saves[0].block_ids[:3]
    worker_a.shutdown()  # waits for the puts in flight

    # Instance B, cold: the same prefix + more is an external hit of 3 blocks, loaded
    # into B's own blocks byte for byte.
    sched_b = make_scheduler(make_config(model_dir, extra))
    worker_b = KvtierConnector(make_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
    caches_b = {n: torch.zeros_like(t) for n, t in cpu_kv_caches(0).items()}
    worker_b.register_kv_caches(caches_b)
    req_b = make_request("b", tokens[: 3 * BLOCK] + prompt(40, base=9))
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
    sched_c = make_scheduler(make_config(model_dir, extra))
    req_c = make_request("c", tokens[: 3 * BLOCK])
    sched_c.add_request(req_c)
    out_c = sched_c.schedule()
    meta_c = out_c.kv_connector_metadata
    assert [(ld.first_block, ld.num_blocks) for ld in meta_c.loads] == [(0, 2)]
    assert out_c.num_scheduled_tokens["c"] == BLOCK

    # Another tenant (cache_salt) shares nothing.
    sched_d = make_scheduler(make_config(model_dir, extra))
    req_d = make_request("d", tokens, salt="other")
    sched_d.add_request(req_d)
    assert sched_d.schedule().kv_connector_metadata.loads == []
    for c in (worker_b,):
        c.shutdown()
    for s in (sched_a, sched_b, sched_c, sched_d):
        s.connector.shutdown()


def test_dead_daemon_gives_zero_hits_and_load_errors(model_dir: Path, tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-doomed", dram_bytes="8MiB", nvme=False)
    d.start()
    extra = {"daemon": d.grpc_address, "lookup_timeout_s": 1.0, "load_timeout_s": 2.0,
             "reconnect_interval_s": 60}
    kvc = kv_cache_config()
    try:
        sched = make_scheduler(make_config(model_dir, extra))
        worker = KvtierConnector(make_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
        worker.register_kv_caches(cpu_kv_caches(3))
        tokens = prompt(4 * BLOCK + 1, base=5)
        run_prefill(sched, worker, [make_request("w", tokens)])
        worker.shutdown()
        # The blocks are there: a lookup finds them.
        sched2 = make_scheduler(make_config(model_dir, extra))
        worker2 = KvtierConnector(make_config(model_dir, extra), KVConnectorRole.WORKER, kvc)
        worker2.register_kv_caches(cpu_kv_caches(4))
        req = make_request("x", tokens)
        sched2.add_request(req)
        out = sched2.schedule()
        meta = out.kv_connector_metadata
        assert [(ld.first_block, ld.num_blocks) for ld in meta.loads] == [(0, 4)]
        d.kill()  # dies between the lookup and the load
        errors = worker_step(worker2, meta)
        assert errors == set(meta.loads[0].target_block_ids)
        sched2.update_from_output(out, runner_output([req], errors))  # vLLM recomputes
        # A request vLLM does not hold: the lookup fails (dead daemon), 0 hits, no exception.
        req2 = make_request("y", prompt(3 * BLOCK, base=8))
        sched2.add_request(req2)
        out2 = sched2.schedule()
        assert out2.kv_connector_metadata.loads == []
        assert out2.num_scheduled_tokens["y"] == 3 * BLOCK
        assert sched2.connector._scheduler.stats["lookup_failures"] == 1
        # A connector started while the daemon is down serves at full recompute too.
        sched3 = make_scheduler(make_config(model_dir, extra))
        req3 = make_request("z", tokens)
        sched3.add_request(req3)
        out3 = sched3.schedule()
        assert out3.kv_connector_metadata.loads == []
        assert out3.num_scheduled_tokens["z"] == len(tokens)
        for s in (sched, sched2, sched3):
            s.connector.shutdown()
        worker2.shutdown()
    finally:
        d.stop()

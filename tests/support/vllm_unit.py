"""vLLM's real scheduler-side objects for connector unit tests, in the style of vLLM's
tests/v1/kv_connector/unit/utils.py: a config (a local random ``LlamaConfig`` config.json only:
no weights, no model run), the KV-cache config, a ``Scheduler``, requests hashed as vLLM hashes
them, and CPU KV tensors laid out as CPU vLLM allocates them.

Imports vLLM: import it only from test modules that ``pytest.importorskip("vllm")`` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

__all__ = ["BLOCK", "HEAD_DIM", "KV_HEADS", "LAYERS", "LAYER_NAMES", "NUM_BLOCKS",
           "cpu_kv_caches", "create_kv_cache_config", "create_request", "create_scheduler",
           "create_vllm_config", "write_model_config"]

BLOCK = 32
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
NUM_BLOCKS = 64
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def write_model_config(path: Path) -> Path:
    """A random-weight-free Llama model directory (config.json only) at ``path``."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=KV_HEADS,
                head_dim=HEAD_DIM, max_position_embeddings=1024,
                torch_dtype="bfloat16").save_pretrained(path)
    return path


def create_vllm_config(model_dir: Path, extra: dict[str, Any], *, block_size: int = BLOCK,
                       algo: str = "sha256_cbor", policy: str = "recompute",
                       prefix_caching: bool = True, kv_events: bool = False) -> VllmConfig:
    """vLLM's config with kvtier as the KV connector (``extra``: its extra config)."""
    model_config = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0,
                               max_model_len=1024, skip_tokenizer_init=True)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                                 prefix_caching_hash_algo=algo),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvstore.integrations.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy=policy,
            kv_connector_extra_config=extra),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if kv_events else None,
        device_config=DeviceConfig("cpu"))


def create_kv_cache_config(block_size: int = BLOCK) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYER_NAMES, FullAttentionSpec(block_size=block_size,
                                                        num_kv_heads=KV_HEADS,
                                                        head_size=HEAD_DIM,
                                                        dtype=torch.bfloat16))])


def create_scheduler(cfg: VllmConfig) -> Scheduler:
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vllm_config=cfg, kv_cache_config=create_kv_cache_config(), log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BLOCK)


def create_request(req_id: str, tokens: list[int], *, max_tokens: int = 4,
                   salt: str | None = None) -> Request:
    """A request whose block hashes vLLM computes (``sha256_cbor``), ``salt`` its cache_salt."""
    init_none_hash(sha256_cbor)
    return Request(request_id=req_id, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   pooling_params=None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def cpu_kv_caches(seed: int) -> dict[str, torch.Tensor]:
    """As CPU vLLM allocates them: one buffer, per-layer [blocks, heads, block, 2*head] views."""
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn((LAYERS, NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM), generator=g)
    whole = whole.to(torch.bfloat16)
    return {name: whole[i] for i, name in enumerate(LAYER_NAMES)}

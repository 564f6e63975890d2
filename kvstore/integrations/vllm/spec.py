"""What both halves of the connector derive from vLLM's config, checked once at start.

The namespace folds in what vLLM's block hash lacks: the model (and revision), the KV dtype,
the block size, the layer count, the KV heads of this TP shard and the TP rank/size. Settings
that would silently give 0% hits or failed requests raise ConfigError here.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.keys import KVDtype, KVFingerprint

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["SUPPORTED_HASH_ALGOS", "ConnectorSpec"]

SUPPORTED_HASH_ALGOS = ("sha256", "sha256_cbor")
"""vLLM hash algorithms whose 32-byte block hashes become kvtier keys unchanged."""

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class ConnectorSpec:
    model: str
    dtype: torch.dtype
    block_tokens: int
    num_kv_heads: int
    head_dim: int
    layer_names: tuple[str, ...]
    tp_rank: int
    tp_size: int
    hash_algo: str

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def fingerprint(self) -> KVFingerprint:
        return KVFingerprint(model=self.model, dtype=KVDtype.from_torch(self.dtype),
                             num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, block_size_tokens=self.block_tokens,
                             tp_rank=self.tp_rank, tp_size=self.tp_size)

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig,
                  tp_rank: int) -> ConnectorSpec:
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        ktc = vllm_config.kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            raise ConfigError(
                "kvtier connector: set KVTransferConfig(kv_load_failure_policy='recompute'); "
                f"with {ktc.kv_load_failure_policy!r} a kvtier failure (daemon down, a block "
                "evicted after the lookup) fails the request instead of recomputing it")
        algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        if algo not in SUPPORTED_HASH_ALGOS:
            raise ConfigError(
                f"kvtier connector: prefix_caching_hash_algo={algo!r} is not supported; use one "
                f"of {SUPPORTED_HASH_ALGOS} (xxhash seeds itself randomly per process unless "
                "PYTHONHASHSEED is set, and its hashes are not the 32-byte keys kvtier uses)")
        if kv_cache_config is None or len(kv_cache_config.kv_cache_groups) != 1:
            n = None if kv_cache_config is None else len(kv_cache_config.kv_cache_groups)
            raise ConfigError(f"kvtier connector: needs exactly one KV-cache group (full "
                              f"attention), vLLM has {n}")
        group = kv_cache_config.kv_cache_groups[0]
        kv_spec = group.kv_cache_spec
        if not isinstance(kv_spec, FullAttentionSpec) or getattr(kv_spec, "sliding_window",
                                                                 None):
            raise ConfigError(f"kvtier connector: unsupported KV-cache spec "
                              f"{type(kv_spec).__name__} (full attention only)")
        if vllm_config.cache_config.block_size != kv_spec.block_size:
            raise ConfigError(f"kvtier connector: the scheduler's block size "
                              f"{vllm_config.cache_config.block_size} differs from the KV "
                              f"cache's {kv_spec.block_size}")
        names = tuple(group.layer_names)

        def index(name: str) -> tuple[int, str]:
            m = _LAYER_INDEX.search(name)
            return (int(m.group(1)) if m else -1, name)

        mc = vllm_config.model_config
        model = config.model or (f"{mc.model}@{mc.revision}" if getattr(mc, "revision", None)
                                 else str(mc.model))
        return cls(model=model, dtype=kv_spec.dtype, block_tokens=int(kv_spec.block_size),
                   num_kv_heads=int(kv_spec.num_kv_heads), head_dim=int(kv_spec.head_size),
                   layer_names=tuple(sorted(names, key=index)), tp_rank=tp_rank,
                   tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
                   hash_algo=algo)

"""kvtier as a vLLM v1 KV connector: ``KvtierConnector`` (``kv_connector="KvtierConnector"``,
``kv_connector_module_path="kvstore.integrations.vllm.connector"``).

vLLM builds one instance per role: the scheduler half (:mod:`.scheduler`) in EngineCore, the
worker half (:mod:`.worker`) in each Worker; this class only dispatches. Settings are in
:mod:`.config`. No kvtier failure escapes into vLLM: lookups become 0 hits, loads become load
errors (recomputed, with ``kv_load_failure_policy="recompute"``), failed saves are reported to
the scheduler half (``build_connector_worker_meta`` -> ``update_connector_output``), which
saves them again. Saves copy out of vLLM's blocks within the step, so ``request_finished``
never delays freeing and ``get_finished`` reports nothing (vLLM's defaults). For
prefill/decode disaggregation ``request_finished`` of a ``do_remote_decode`` request returns
the kvtier hand-off as ``kv_transfer_params``, and a decode request carrying one waits in its
lookup for the prefill's blocks (:mod:`.scheduler`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvstore.client.kv_client import KVClient, KVClientConfig
from kvstore.client.kvlayout import KVLayout
from kvstore.client.store_config import DataPlane
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.metadata import KvtierConnectorMetadata, KvtierWorkerMetadata
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.session import ClientSession
from kvstore.integrations.vllm.spec import ConnectorSpec
from kvstore.integrations.vllm.stats import KvtierConnectorStats, KvtierPromMetrics
from kvstore.integrations.vllm.worker import WorkerSide
from kvstore.keys import HashMode, Namespace

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["PREFIX_CACHING_OFF", "KvtierConnector"]

PREFIX_CACHING_OFF = (
    "kvtier connector: vLLM's prefix caching is off (enable_prefix_caching=False). vLLM "
    "0.32 still hashes every request's blocks when a KV connector is set, so kvtier loads "
    "and saves work, but vLLM reuses nothing from its own KV cache: a prefix it just "
    "computed is loaded from kvtier again. Turn it on unless that is what you want; a vLLM "
    "that hashes only with prefix caching on gives no kvtier hits at all (logged as 'no "
    "block hashes' on the first such request).")


def _vllm_hash_seed() -> str:
    """The seed vLLM derives NONE_HASH from (for the sha256 algorithms kvtier accepts).
    EngineCore builds the scheduler (and this connector) before it calls ``init_none_hash``,
    so PYTHONHASHSEED is read here as ``resolve_none_hash_seed`` will (it wins when set)."""
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    try:
        from vllm.v1.core.kv_cache_utils import get_none_hash_seed
    except ImportError:  # older vLLM: the fixed default
        return "vllm-none-hash"
    return str(get_none_hash_seed())


def _kv_events_on(vllm_config: VllmConfig) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and events.enable_kv_cache_events)


def _tp_rank(role: KVConnectorRole) -> int:
    if role is KVConnectorRole.SCHEDULER:
        return 0
    from vllm.distributed import parallel_state

    if parallel_state._TP is None:  # not initialised (a unit test): one rank
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.kvtier_config = ConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.kvtier_spec = ConnectorSpec.from_vllm(vllm_config, kv_cache_config,
                                                   self.kvtier_config, _tp_rank(role))
        spec, cfg = self.kvtier_spec, self.kvtier_config
        seed = _vllm_hash_seed()
        log.info("kvtier connector (%s): model %r, dtype %s, block %d tokens, %d layers, %d KV "
                 "heads x %d, TP %d/%d, hash %s seed %r, daemon %s", role.name, spec.model,
                 spec.dtype, spec.block_tokens, spec.num_layers, spec.num_kv_heads,
                 spec.head_dim, spec.tp_rank, spec.tp_size, spec.hash_algo, seed,
                 cfg.daemon or f"etcd {cfg.etcd}")
        if not vllm_config.cache_config.enable_prefix_caching:
            log.warning(PREFIX_CACHING_OFF)
        layout = KVLayout(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.block_tokens,
                          spec.dtype)
        scheduler = role is KVConnectorRole.SCHEDULER
        client_cfg = KVClientConfig(
            data_plane=DataPlane(cfg.data_plane.value),
            rpc_timeout_s=cfg.lookup_timeout_s if scheduler else cfg.load_timeout_s,
            hash_mode=HashMode.SHA256_CBOR, vllm_hash_seed=seed, workers=cfg.workers,
            staging_pool_bytes=0 if scheduler else cfg.staging_pool_mib << 20,
            tenant=cfg.tenant or None)  # "": the credentials' own tenant
        namespace = Namespace(spec.fingerprint(), cfg.tenant)

        def connect() -> KVClient:
            if cfg.daemon:
                return KVClient.connect(cfg.daemon, layout, namespace, client_cfg)
            return KVClient.from_etcd(cfg.etcd, layout, namespace, client_cfg,
                                      node_id=cfg.node_id or None)

        session = ClientSession(connect, cfg.reconnect_interval_s, role.name.lower())
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if scheduler:
            self._scheduler = SchedulerSide(cfg, spec, session, seed,
                                            load=ktc.kv_role != "kv_producer",
                                            save=ktc.kv_role != "kv_consumer",
                                            kv_events=_kv_events_on(vllm_config))
        else:
            self._worker = WorkerSide(cfg, spec, session)

    # --- worker side ------------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler's connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._w().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self._w().start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._w().save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._w().wait_for_save()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        return self._w().build_connector_worker_meta()

    # --- stats (both halves; vLLM aggregates the workers' with the scheduler's) ----------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return self._w().take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # --- scheduler side ---------------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker's connector"
        return self._scheduler

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._s().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._s().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._s().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._s().update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._s().take_events()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._s().request_finished(request, block_ids)

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()

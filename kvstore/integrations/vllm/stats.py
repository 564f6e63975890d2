"""The connector's per-step stats, through vLLM's own mechanism.

Both halves count into a :class:`KvtierConnectorStats` (a flat dict of counters): the scheduler
half its lookups and hits, each worker its loads and saves. vLLM collects them every step
(``get_kv_connector_stats`` on each half; the scheduler ``aggregate``\\ s the workers' objects,
one per TP rank, with its own), sends ``to_dict()`` to the logger process, rebuilds the object
there with ``KvtierConnector.build_kv_connector_stats`` and ``aggregate``\\ s the steps of a log
interval; ``reduce()`` is what vLLM logs ("KV Transfer metrics: ..."), and
:class:`KvtierPromMetrics` adds every counter to a Prometheus counter
``vllm:kvtier_<name>_total`` per engine.

Counters (all sums, so aggregation across steps and TP ranks is addition; bytes and blocks
summed over TP ranks are the bytes each rank moved for its shard):

==========================  =====================================================================
``lookups``                 scheduler lookups (one per request admission attempt: vLLM asking
                            again reuses the answer)
``lookups_local``           of those, answered from the same-host daemon's read index, with no
                            round trip (``lookup_index``); the rest were asked of the daemon
``lookups_deferred``        scheduler asks answered "ask again" (``None``) while the lookup
                            was in flight (``lookup_async``)
``lookup_errors``           lookups that failed (daemon down, restarted, refused) or were not
                            answered in time: 0 hits
``lookup_timeouts``         of those, lookups not answered within ``lookup_timeout_s``
``hit_blocks``              blocks vLLM did not hold that kvtier held and vLLM took (scheduled
                            to load; = ``loaded_blocks`` + ``load_error_blocks``)
``hit_tokens``              the tokens vLLM took from kvtier
``loaded_blocks``           blocks written into vLLM's KV cache (worker)
``loaded_bytes``            their bytes
``load_seconds``            per step, the longest fetch + scatter of the step's loads
``load_error_blocks``       blocks reported to vLLM as load errors (missing, corrupt, timed out,
                            daemon gone): recomputed
``load_timeouts``           loads given up at ``load_timeout_s``
``saved_blocks``            blocks the daemon committed (blocks it held already excluded)
``saved_bytes``             their bytes
``save_seconds``            per step: copy out of vLLM's blocks + the step's puts
``save_failed_blocks``      blocks not saved: put failed or timed out, copy failed, or skipped
                            for want of a daemon (the scheduler half saves them again)
``save_timeouts``           steps whose puts were not done within ``save_timeout_s``
``save_retry_blocks``       blocks of failed saves the scheduler half scheduled again
``load_resave_blocks``      blocks of failed loads the scheduler half saves again once vLLM
                            recomputed them
``config_mismatch``         connector starts (or reconnects) that found another instance of the
                            model with another block size, hash algorithm or hash seed
``pd_sent``                 prefill side of P/D: requests for remote decode (``do_remote_decode``)
                            answered with a kvtier hand-off (``kv_transfer_params.kvtier``)
``pd_sent_blocks``          the blocks those hand-offs promised (saved, being saved, or held)
``pd_received``             decode side: requests that arrived with a kvtier hand-off
``pd_waited``               of those, requests whose first lookup found fewer blocks than the
                            hand-off promised and that waited for the prefill's puts
``pd_wait_timeouts``        of those, requests that stopped waiting at ``pd_wait_timeout_s``
                            (they take what the store holds; vLLM computes the rest)
``pd_missing_blocks``       the promised blocks those requests did not find
``pd_mismatches``           hand-offs whose last block key differs from the decode's own (other
                            token ids, model, block size, hash seed or salt): no wait
==========================  =====================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

__all__ = ["COUNTERS", "KvtierConnectorStats", "KvtierPromMetrics"]

COUNTERS: dict[str, str] = {
    "lookups": "Scheduler lookups of kvtier (daemon or read index).",
    "lookups_local": "Scheduler lookups answered from the daemon's read index (no round trip).",
    "lookups_deferred": "Scheduler asks answered 'ask again' while a kvtier lookup ran.",
    "lookup_errors": "kvtier lookups that failed (counted as 0 hits).",
    "lookup_timeouts": "kvtier lookups not answered within lookup_timeout_s.",
    "hit_blocks": "Blocks vLLM did not hold that it took from kvtier (external hits).",
    "hit_tokens": "Tokens vLLM did not hold that it took from kvtier (external hits).",
    "loaded_blocks": "Blocks loaded from kvtier into vLLM's KV cache.",
    "loaded_bytes": "Bytes loaded from kvtier into vLLM's KV cache.",
    "load_seconds": "Time spent loading from kvtier (per step, its longest load).",
    "load_error_blocks": "Blocks reported to vLLM as load errors (recomputed).",
    "load_timeouts": "kvtier loads given up at load_timeout_s.",
    "saved_blocks": "Blocks saved to kvtier (newly committed).",
    "saved_bytes": "Bytes saved to kvtier (newly committed).",
    "save_seconds": "Time spent saving to kvtier (copy out + puts, per step).",
    "save_failed_blocks": "Blocks not saved to kvtier (failed, timed out or no daemon).",
    "save_timeouts": "Steps whose kvtier saves were not done within save_timeout_s.",
    "save_retry_blocks": "Blocks of failed kvtier saves scheduled to be saved again.",
    "load_resave_blocks": "Blocks of failed kvtier loads saved again once recomputed.",
    "config_mismatch": "Starts that found the model in kvtier with another block size, hash "
                       "algorithm or seed.",
    "pd_sent": "Prefill requests for remote decode answered with a kvtier hand-off.",
    "pd_sent_blocks": "Blocks promised by kvtier P/D hand-offs sent.",
    "pd_received": "Decode requests that arrived with a kvtier P/D hand-off.",
    "pd_waited": "Decode requests that waited for the prefill's blocks to land in kvtier.",
    "pd_wait_timeouts": "Decode requests that stopped waiting at pd_wait_timeout_s.",
    "pd_missing_blocks": "Promised P/D blocks not in kvtier when the decode stopped waiting.",
    "pd_mismatches": "kvtier P/D hand-offs whose block key differs from the decode's own.",
}
_FLOATS = frozenset({"load_seconds", "save_seconds"})


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counters of one interval (``data``: name -> number; absent = 0). Not thread-safe: the
    worker half guards its object with a lock."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(COUNTERS))
        if unknown:
            raise ValueError(f"unknown kvtier connector stats {unknown}")

    def add(self, name: str, value: float = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(name)
        if value:
            self.data[name] = self.data.get(name, 0) + value

    def get(self, name: str) -> float:
        return float(self.data.get(name, 0))

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        for name, value in other.data.items():
            self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name in COUNTERS:
            value = self.data.get(name, 0)
            out[name] = round(float(value), 6) if name in _FLOATS else int(value)
        loaded, saved = out["loaded_blocks"], out["saved_blocks"]
        out["load_ms_per_block"] = round(1e3 * out["load_seconds"] / loaded, 3) if loaded else 0
        out["save_ms_per_block"] = round(1e3 * out["save_seconds"] / saved, 3) if saved else 0
        return out

    def take(self) -> KvtierConnectorStats | None:
        """This interval's stats (None when nothing happened), and a fresh interval."""
        if self.is_empty():
            return None
        out = KvtierConnectorStats(data=self.data)
        self.data = {}
        return out


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per stat, ``vllm:kvtier_<name>`` (exported with ``_total``),
    labelled with vLLM's per-engine labels."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:kvtier_{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)

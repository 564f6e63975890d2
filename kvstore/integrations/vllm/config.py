"""Configuration of :class:`~kvstore.integrations.vllm.connector.KvtierConnector`.

Load it in vLLM with::

    KVTransferConfig(kv_connector="KvtierConnector",
                     kv_connector_module_path="kvstore.integrations.vllm.connector",
                     kv_role="kv_both",                  # or kv_producer (save only), kv_consumer (load only)
                     kv_load_failure_policy="recompute",  # required: a failed load is recomputed
                     kv_connector_extra_config={"daemon": "127.0.0.1:50051"})

Keys of ``kv_connector_extra_config`` (unknown keys are an error). Every key can be overridden
by the environment variable ``KVTIER_VLLM_<KEY>`` (upper case: ``KVTIER_VLLM_DAEMON``,
``KVTIER_VLLM_LOOKUP_TIMEOUT_S``); the environment wins over the extra config.

==========================  ==========  =====================================================
key                         default     meaning
==========================  ==========  =====================================================
``daemon``                  --          ``host:port`` of a kvtier daemon's gRPC service.
``etcd``                    --          etcd endpoint (``http://host:port``) instead of
                                        ``daemon``: use the daemon registered there on this
                                        host (or ``node_id``). Exactly one of the two.
``node_id``                 ""          with ``etcd``: the daemon to use.
``model``                   vLLM's      model name (and ``@revision``) folded into the key
                                        namespace; default ``model_config.model`` plus
                                        ``@<revision>`` when vLLM has one. Instances that
                                        should share KV must agree on it (a local path
                                        counts: give the same name everywhere).
``tenant``                  ""          the tenant this instance acts for on the daemon
                                        (``KVClientConfig.tenant``: the ``kvtier-tenant`` of
                                        every call, checked against its credentials; ""
                                        names none: the credentials' only tenant), and the
                                        namespace tenant of requests without a
                                        ``cache_salt``. A request's ``cache_salt`` is its
                                        namespace tenant (it is inside vLLM's block hash
                                        too), but its chunks are stored as ``tenant``'s.
                                        Printable ASCII, at most 128 characters.
``data_plane``              ``auto``    ``auto`` | ``shm`` | ``tcp``: to the daemon.
``lookup_timeout_s``        1.0         bound on a scheduler-side lookup; a daemon that does
                                        not answer in time counts as 0 hits.
``lookup_async``            ``true``    lookups run off vLLM's engine loop: the scheduler is
                                        told "ask again" (``None``) until the daemon answered
                                        or ``lookup_timeout_s`` passed; ``false``: the
                                        scheduler waits for each lookup (up to
                                        ``lookup_timeout_s``), one step sooner per hit.
``lookup_index``            ``auto``    ``auto`` | ``covered`` | ``off``: answer a lookup at
                                        once from the read index of a daemon on this host
                                        (shared memory, no round trip), never "ask again".
                                        ``covered``: only when the index publishes every
                                        block asked; ``auto``: also when the daemon runs no
                                        tier but DRAM (the index then knows what it holds:
                                        misses and partial hits are answered too; a daemon
                                        that compresses its DRAM chunks needs ``covered``,
                                        see docs/vllm-connector.md); ``off``: always ask the
                                        daemon. Otherwise, and for a daemon on another host,
                                        the daemon's lookup (``lookup_async``).
``load_timeout_s``          10.0        bound on a step's loads (worker); blocks not in by
                                        then are reported as load errors and recomputed.
``save_timeout_s``          30.0        a step's puts not done by then count as failed
                                        (``save_timeouts``) and are no longer tracked; vLLM
                                        never waits for puts (KVClient cannot cancel them:
                                        they end on their own, atomically per chunk).
``save``                    ``all``     ``all``: store every full block vLLM computed (up to
                                        ``num_computed_tokens``); ``none``: load only.
                                        ``kv_role="kv_consumer"`` forces ``none``;
                                        ``kv_role="kv_producer"`` never loads.
``reconnect_interval_s``    2.0         after the daemon failed (down, restarted), how long
                                        before the connector tries it again (in the
                                        background: vLLM never waits for a reconnect).
``pd_wait_timeout_s``       5.0         decode side of prefill/decode disaggregation: how long
                                        a request handed off by a prefill instance (its
                                        ``kv_transfer_params`` carry ``kvtier.blocks``) waits
                                        for the store to hold that many blocks of its prefix
                                        (the prefill's puts land after its answer) before it
                                        takes what is there and vLLM computes the rest. The
                                        request waits like a lookup in flight ("ask again"),
                                        never the engine loop.
``workers``                 2           client threads for copies and transfers (worker).
``staging_pool_mib``        64          pooled staging buffers kept by the worker's client.
==========================  ==========  =====================================================

Checked at start (``ConfigError`` with the reason, so a mistake that would give 0% hits is
never silent): one of ``daemon``/``etcd``; positive timeouts; vLLM's
``prefix_caching_hash_algo`` is ``sha256`` or ``sha256_cbor`` (32-byte hashes used as keys
without rehashing; ``sha256_cbor`` also lets non-vLLM components compute the same keys);
``kv_load_failure_policy == "recompute"`` (else a daemon failure fails requests); one KV-cache
group of full attention; ``tenant`` printable ASCII of at most 128 characters (whether the
daemon allows it is checked on its first call: a refusal counts as a lookup or save error).
Reported at start (an ERROR and ``config_mismatch``, see
:mod:`kvstore.integrations.vllm.manifest`): another instance of the model, on the same daemon,
with another block size, hash algorithm or hash seed. Logged at start: the namespace (model,
dtype, block size, layers, TP rank/size) and vLLM's hash seed, which every process that should
share must agree on.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.errors import ConfigError
from kvstore.wire import TENANT_MAX_CHARS

__all__ = ["ENV_PREFIX", "ConnectorConfig", "DataPlaneName", "LookupIndex", "SaveMode"]

ENV_PREFIX = "KVTIER_VLLM_"


class SaveMode(enum.Enum):
    ALL = "all"
    NONE = "none"


class LookupIndex(enum.Enum):
    """When a scheduler lookup is answered from the same-host daemon's read index."""

    AUTO = "auto"
    COVERED = "covered"
    OFF = "off"


class DataPlaneName(enum.Enum):
    AUTO = "auto"
    SHM = "shm"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings; build with :meth:`from_extra_config`."""

    daemon: str = ""
    etcd: str = ""
    node_id: str = ""
    model: str = ""
    tenant: str = ""
    data_plane: DataPlaneName = DataPlaneName.AUTO
    lookup_timeout_s: float = 1.0
    lookup_async: bool = True
    lookup_index: LookupIndex = LookupIndex.AUTO
    load_timeout_s: float = 10.0
    save_timeout_s: float = 30.0
    save: SaveMode = SaveMode.ALL
    reconnect_interval_s: float = 2.0
    pd_wait_timeout_s: float = 5.0
    workers: int = 2
    staging_pool_mib: int = 64

    def __post_init__(self) -> None:
        if bool(self.daemon) == bool(self.etcd):
            raise ConfigError("kvtier connector: set exactly one of 'daemon' (host:port of a "
                              "kvtier daemon's gRPC) and 'etcd' (an etcd endpoint) in "
                              "kv_connector_extra_config or KVTIER_VLLM_DAEMON/KVTIER_VLLM_ETCD")
        if self.daemon:
            host, sep, port = self.daemon.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigError(f"kvtier connector: 'daemon' must be host:port, got "
                                  f"{self.daemon!r}")
        if self.node_id and not self.etcd:
            raise ConfigError("kvtier connector: 'node_id' needs 'etcd'")
        for name in ("lookup_timeout_s", "load_timeout_s", "save_timeout_s",
                     "reconnect_interval_s", "pd_wait_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"kvtier connector: {name!r} must be > 0, got "
                                  f"{getattr(self, name)!r}")
        if not isinstance(self.lookup_async, bool):
            raise ConfigError(f"kvtier connector: 'lookup_async' must be true or false, got "
                              f"{self.lookup_async!r}")
        if not isinstance(self.lookup_index, LookupIndex):
            raise ConfigError(f"kvtier connector: 'lookup_index' must be a LookupIndex, got "
                              f"{self.lookup_index!r}")
        if len(self.tenant) > TENANT_MAX_CHARS or not all(" " <= c <= "~" for c in self.tenant):
            raise ConfigError(f"kvtier connector: 'tenant' must be printable ASCII of at most "
                              f"{TENANT_MAX_CHARS} characters (it travels as gRPC metadata), "
                              f"got {self.tenant!r}")
        if self.workers < 1 or self.staging_pool_mib < 0:
            raise ConfigError("kvtier connector: 'workers' must be >= 1 and "
                              "'staging_pool_mib' >= 0")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None,
                          environ: Mapping[str, str] | None = None) -> ConnectorConfig:
        """Parse ``kv_connector_extra_config`` with ``KVTIER_VLLM_<KEY>`` overrides from
        ``environ`` (default ``os.environ``). Raises ConfigError for an unknown key or a bad
        value."""
        env = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        raw: dict[str, Any] = dict(extra or {})
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"kvtier connector: unknown kv_connector_extra_config keys "
                              f"{unknown}; accepted: {sorted(known)}")
        for name in known:
            value = env.get(ENV_PREFIX + name.upper())
            if value is not None:
                raw[name] = value
        values: dict[str, Any] = {}
        for name, value in raw.items():
            values[name] = _coerce(name, known[name].default, value)
        return cls(**values)


def _coerce(name: str, default: Any, value: Any) -> Any:
    """``value`` as the type of the field's ``default`` (strings from the environment too)."""
    try:
        if isinstance(default, enum.Enum):
            return type(default)(str(value).strip().lower())
        if isinstance(default, bool):  # strict: true/false/1/0 only ("no" is not truthy)
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return text in ("true", "1")
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if not isinstance(value, str):
            raise ValueError(value)
        return value.strip()
    except ValueError as exc:
        accepted = f" (one of {[m.value for m in type(default)]})" \
            if isinstance(default, enum.Enum) else ""
        raise ConfigError(f"kvtier connector: bad value {value!r} for {name!r}{accepted}"
                          ) from exc

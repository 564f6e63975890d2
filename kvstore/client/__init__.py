"""The library engines embed: :class:`StoreClient` talks to one store daemon (gRPC control,
shared-memory, UCX or TCP data plane); :class:`KVClient` moves token prefixes' KV between daemons and
an engine's tensors (torch is imported only when tensors are touched).

KVClient's modules: ``kv_client`` (the client and its config), ``layouts`` (the engine's KV
buffers: contiguous, paged, chunk, transformers cache), ``results``, ``requests``, ``handles``
(loads and saves in flight), ``staging`` (pooled buffers), ``discovery`` (daemons through etcd),
``kvlayout`` (the chunk layout and a model's namespace). StoreClient's: ``store_client`` (the
client), ``daemon_control`` (its gRPC calls), ``planes`` (the choice of data plane, and the TCP/UCX
plane; the shared-memory plane is the data plane's ``ShmClient``), ``store_config`` (its config
and results). Every public name is exported here."""

from __future__ import annotations

from kvstore.client.discovery import choose_node, discover_nodes
from kvstore.client.handles import BatchSave, LayerwiseSave, LoadHandle
from kvstore.client.kv_client import KVClient, KVClientConfig
from kvstore.client.kvlayout import KVLayout, namespace_for
from kvstore.client.layouts import ChunkKV, ContiguousKV, EngineKV, HFCacheKV, PagedKV
from kvstore.client.requests import BlockKeys, LoadRequest, RemoteFetch, SaveRequest
from kvstore.client.results import LoadResult, PrefixMatch, SaveResult
from kvstore.client.staging import StagingPool
from kvstore.client.store_client import DataPlane, LookupResult, StoreClient, StoreClientConfig

__all__ = [
    "BatchSave",
    "BlockKeys",
    "ChunkKV",
    "ContiguousKV",
    "DataPlane",
    "EngineKV",
    "HFCacheKV",
    "KVClient",
    "KVClientConfig",
    "KVLayout",
    "LayerwiseSave",
    "LoadHandle",
    "LoadRequest",
    "LoadResult",
    "LookupResult",
    "PagedKV",
    "PrefixMatch",
    "RemoteFetch",
    "SaveRequest",
    "SaveResult",
    "StagingPool",
    "StoreClient",
    "StoreClientConfig",
    "choose_node",
    "discover_nodes",
    "namespace_for",
]

"""The library engines embed: :class:`StoreClient` talks to one store daemon (gRPC control,
shared-memory or TCP data plane); :class:`KVClient` moves token prefixes' KV between daemons and
an engine's tensors (torch is imported only when tensors are touched)."""

from __future__ import annotations

from kvstore.client.kv_client import (
    BatchSave,
    BlockKeys,
    KVClient,
    KVClientConfig,
    LoadHandle,
    LoadRequest,
    LoadResult,
    RemoteFetch,
    SaveRequest,
    SaveResult,
)
from kvstore.client.store_client import DataPlane, LookupResult, StoreClient, StoreClientConfig

__all__ = [
    "BatchSave",
    "BlockKeys",
    "DataPlane",
    "KVClient",
    "KVClientConfig",
    "LoadHandle",
    "LoadRequest",
    "LoadResult",
    "LookupResult",
    "RemoteFetch",
    "SaveRequest",
    "SaveResult",
    "StoreClient",
    "StoreClientConfig",
]

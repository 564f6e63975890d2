"""The library engines embed: :class:`StoreClient` talks to one store daemon (gRPC control,
shared-memory or TCP data plane)."""

from __future__ import annotations

from kvstore.client.store_client import DataPlane, LookupResult, StoreClient, StoreClientConfig

__all__ = ["DataPlane", "LookupResult", "StoreClient", "StoreClientConfig"]

"""Data-plane transports: chunk bytes between hosts, outside the gRPC control path.

:mod:`.base` holds the contracts (the server-side :class:`LeaseBackend`, the client-side
:class:`Transport`), :mod:`.frames` the wire format, :mod:`.tcp` the TCP implementation and
:mod:`.memory_backend` a simple in-memory backend for standalone servers and tests.
"""

from __future__ import annotations

from kvstore.dataplane.transport.base import (
    Endpoint,
    LeaseBackend,
    ReadLease,
    Transport,
    TransportKind,
    TransportServer,
    WriteLease,
)
from kvstore.dataplane.transport.memory_backend import MemoryBackend
from kvstore.dataplane.transport.tcp import TcpClient, TcpClientConfig, TcpServer, TcpServerConfig

__all__ = [
    "Endpoint",
    "LeaseBackend",
    "MemoryBackend",
    "ReadLease",
    "TcpClient",
    "TcpClientConfig",
    "TcpServer",
    "TcpServerConfig",
    "Transport",
    "TransportKind",
    "TransportServer",
    "WriteLease",
]

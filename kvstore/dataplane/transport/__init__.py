"""Data-plane transports: chunk bytes between processes, outside the gRPC control path.

:mod:`.base` holds the contracts (the server-side :class:`LeaseBackend` and
:class:`ArenaLeaseBackend`, the client-side :class:`Transport`, :class:`BatchTransport` and
:class:`MappedTransport`), and three implementations run one conformance suite
(``tests/dataplane/transport_conformance.py``): :mod:`.tcp` (framed TCP; wire format in
:mod:`.frames`), :mod:`.ucx` (UCX tag messages) and :mod:`.shm` (the same-host plane: a mapped
arena and a lease channel). :mod:`.memory_backend` is a simple in-memory backend for standalone
servers and tests.
"""

from __future__ import annotations

from kvstore.dataplane.transport.base import (
    ArenaLeaseBackend,
    ArenaRange,
    BatchTransport,
    Endpoint,
    LeaseBackend,
    MappedTransport,
    ReadLease,
    Transport,
    TransportKind,
    TransportServer,
    WriteLease,
)
from kvstore.dataplane.transport.memory_backend import MemoryBackend
from kvstore.dataplane.transport.tcp import TcpClient, TcpClientConfig, TcpServer, TcpServerConfig

__all__ = [
    "ArenaLeaseBackend",
    "ArenaRange",
    "BatchTransport",
    "Endpoint",
    "LeaseBackend",
    "MappedTransport",
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

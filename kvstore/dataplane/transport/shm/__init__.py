"""The shared-memory data plane: clients on the daemon's host move bytes through its mapped arena.

Both halves live here, behind the transport contracts of :mod:`..base`:

* :mod:`.client`: :class:`ShmClient`, a ``MappedTransport``: it maps the peer's DRAM arena,
  reads chunks its read index publishes with no round trip at all (the native extension's
  ``IndexReader`` when built), and leases the rest over the lease channel;
* :mod:`.server`: :class:`ShmServer`, a ``TransportServer`` serving an ``ArenaLeaseBackend``
  (leases by id, with arena offsets; the daemon's is ``kvstore.node.backend.ShmLeases``) on an
  abstract-namespace Unix socket;
* :mod:`.writes`: :class:`ShmWriter`, batches a caller writes in place (reserve, write,
  commit: a save in one copy);
* :mod:`.frames` the lease channel's wire format, :mod:`.channel` one client connection,
  :mod:`.reports` the reporter of lease-free reads.

Why a Unix socket and not gRPC, why leases end with their connection, and the figures:
docs/daemon.md and docs/dram-arena.md ("Lease-free reads").
"""

from __future__ import annotations

from kvstore.dataplane.transport.shm.channel import LeaseChannel
from kvstore.dataplane.transport.shm.client import (
    LeaseFreeCounters,
    ShmBatchRead,
    ShmClient,
    ShmClientConfig,
    ShmFreeRead,
    ShmReadLease,
    ShmWriteLease,
)
from kvstore.dataplane.transport.shm.server import ShmServer
from kvstore.dataplane.transport.shm.writes import ShmBatchWrite, ShmWriter

__all__ = [
    "LeaseChannel",
    "LeaseFreeCounters",
    "ShmBatchRead",
    "ShmBatchWrite",
    "ShmClient",
    "ShmClientConfig",
    "ShmFreeRead",
    "ShmReadLease",
    "ShmServer",
    "ShmWriteLease",
    "ShmWriter",
]

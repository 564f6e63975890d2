"""What crosses a process boundary the same way for every box: error names, tier codes, metadata keys.

Errors cross process boundaries by *class name*: a gRPC service (daemon or conductor) puts the
name of the kvtier error class in the trailing metadata key :data:`ERROR_METADATA_KEY` (and picks
the gRPC status code from :data:`GRPC_CODE_NAMES`), the same-host lease channel puts it in its
error reply; a client rebuilds the same class with :func:`error_from_name`. An unknown name
becomes a plain :class:`~kvstore.errors.KvtierError`. The two name functions live with the
errors (the data plane's lease channel uses them too, and sits below this module); they are
re-exported here.

Tiers travel as the protobuf enum ``kvtier.v1.Tier``: :data:`TIER_TO_PB` and :data:`PB_TO_TIER`
are the one map between it and :class:`~kvstore.dataplane.tier.TierKind`.

This module sits below the node, the client and the conductor (each imports it; it imports
none of them) and needs no gRPC runtime: status codes are names.
"""

from __future__ import annotations

from typing import Any

from kvstore import errors
from kvstore._proto.kvtier.v1 import store_pb2 as store_pb
from kvstore.dataplane.tier import TierKind
from kvstore.errors import KvtierError, error_from_name, error_name

ERROR_METADATA_KEY = "kvtier-error"

GRPC_CODE_NAMES: dict[type[KvtierError], str] = {
    errors.SizeMismatch: "INVALID_ARGUMENT",
    errors.InvalidArgument: "INVALID_ARGUMENT",
    errors.ConfigError: "INVALID_ARGUMENT",
    errors.ChunkNotFound: "NOT_FOUND",
    errors.ChunkExists: "ALREADY_EXISTS",
    errors.ChunkBusy: "ABORTED",
    errors.DiskFull: "RESOURCE_EXHAUSTED",
    errors.CapacityError: "RESOURCE_EXHAUSTED",
    errors.ChunkCorrupt: "DATA_LOSS",
    errors.TierUnavailable: "UNAVAILABLE",
    errors.PeerUnavailable: "UNAVAILABLE",
    errors.TransportError: "UNAVAILABLE",
    errors.MembershipError: "UNAVAILABLE",
    errors.StorageError: "INTERNAL",
    errors.InvariantViolation: "INTERNAL",
}
"""gRPC status code name per error class (the most specific class listed first wins)."""


def grpc_code_name(exc: KvtierError) -> str:
    for cls in type(exc).__mro__:
        if cls in GRPC_CODE_NAMES:
            return GRPC_CODE_NAMES[cls]
    return "UNKNOWN"


LEADER_METADATA_KEY = "kvtier-leader"
"""Trailing metadata of a conductor's NotLeader refusal: ``<conductor_id>@<address>`` of the leader."""

TIER_TO_PB: dict[TierKind, store_pb.Tier] = {
    TierKind.HBM: store_pb.TIER_HBM,
    TierKind.DRAM: store_pb.TIER_DRAM,
    TierKind.NVME: store_pb.TIER_NVME,
}
PB_TO_TIER: dict[int, TierKind] = {int(v): k for k, v in TIER_TO_PB.items()}


def stats_doc(reply: Any, address: str) -> dict[str, Any]:
    """A daemon's ``StatsResponse`` as plain JSON-ready data (``kvtier stats``, ``kvtier run``)."""
    hits = sum(t.hits for t in reply.tiers)
    lookups = hits + reply.misses
    return {
        "node_id": reply.node_id, "address": address, "epoch": reply.epoch,
        "uptime_s": round(reply.uptime_s, 3), "misses": reply.misses, "hits": hits,
        "hit_ratio": hits / lookups if lookups else None, "last_seq": reply.last_seq,
        "shm_leases_open": reply.shm_leases_open,
        "tcp_connections_open": reply.tcp_connections_open,
        "tiers": [{
            "tier": PB_TO_TIER[t.tier].value, "capacity_bytes": t.capacity_bytes,
            "used_bytes": t.used_bytes, "chunks": t.chunks, "hits": t.hits, "puts": t.puts,
            "evictions": t.drops, "demotions": t.demotions_out, "promotions": t.promotions_in,
            "corrupt": t.corrupt, "bytes_read": t.bytes_read, "bytes_written": t.bytes_written,
        } for t in reply.tiers],
    }


__all__ = ["ERROR_METADATA_KEY", "GRPC_CODE_NAMES", "LEADER_METADATA_KEY", "PB_TO_TIER",
           "TIER_TO_PB", "error_from_name", "error_name", "grpc_code_name", "stats_doc"]

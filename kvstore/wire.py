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

Undecodable requests: a gRPC service registered with :func:`service_handler` (the daemon's
Store and the conductor's Conductor) parses each request with a deserializer that turns
protobuf's ``DecodeError`` into an :class:`UndecodableRequest` marker instead of raising
(grpc would log an ERROR traceback and answer UNKNOWN). The services' error wrappers answer
the marker with INVALID_ARGUMENT (:func:`undecodable_error`).

This module sits below the node, the client and the conductor (each imports it; it imports
none of them) and needs no gRPC runtime at import: status codes are names, and
:func:`service_handler` imports grpc when called.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from kvstore import errors
from kvstore._proto.kvtier.v1 import store_pb2 as store_pb
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument, KvtierError, error_from_name, error_name

ERROR_METADATA_KEY = "kvtier-error"

GRPC_CODE_NAMES: dict[type[KvtierError], str] = {
    errors.SizeMismatch: "INVALID_ARGUMENT",
    errors.InvalidArgument: "INVALID_ARGUMENT",
    errors.ConfigError: "INVALID_ARGUMENT",
    errors.ChunkNotFound: "NOT_FOUND",
    errors.ChunkExists: "ALREADY_EXISTS",
    errors.ChunkBusy: "ABORTED",
    errors.DiskFull: "RESOURCE_EXHAUSTED",
    errors.QuotaExceeded: "RESOURCE_EXHAUSTED",
    errors.CapacityError: "RESOURCE_EXHAUSTED",
    errors.ChunkCorrupt: "DATA_LOSS",
    errors.TierUnavailable: "UNAVAILABLE",
    errors.PeerUnavailable: "UNAVAILABLE",
    errors.TransportError: "UNAVAILABLE",
    errors.MembershipError: "UNAVAILABLE",
    errors.StorageError: "INTERNAL",
    errors.Unauthenticated: "UNAUTHENTICATED",
    errors.PermissionDenied: "PERMISSION_DENIED",
    errors.InvariantViolation: "INTERNAL",
}
"""gRPC status code name per error class (the most specific class listed first wins)."""


def grpc_code_name(exc: KvtierError) -> str:
    for cls in type(exc).__mro__:
        if cls in GRPC_CODE_NAMES:
            return GRPC_CODE_NAMES[cls]
    return "UNKNOWN"


SESSION_METADATA_KEY = "kvtier-session"
"""Request metadata naming the client session a call belongs to (16 to 128 characters, a
secret the client draws): a store daemon lets only that session end the pins and leases it
took. A call without it belongs to its HTTP/2 connection (``context.peer()``)."""
SESSION_MIN_CHARS = 16
SESSION_MAX_CHARS = 128

TENANT_METADATA_KEY = "kvtier-tenant"
"""Request metadata naming the tenant a call acts for (``StoreClientConfig.tenant``). The daemon
checks it against the caller's authenticated identity (docs/security.md, "Tenant isolation");
it is never a credential by itself. Printable ASCII, at most :data:`TENANT_MAX_CHARS`."""
TENANT_MAX_CHARS = 128

LEADER_METADATA_KEY = "kvtier-leader"
"""Trailing metadata of a conductor's NotLeader refusal: ``<conductor_id>@<address>`` of the leader."""

TIER_TO_PB: dict[TierKind, store_pb.Tier] = {
    TierKind.HBM: store_pb.TIER_HBM,
    TierKind.DRAM: store_pb.TIER_DRAM,
    TierKind.NVME: store_pb.TIER_NVME,
}
PB_TO_TIER: dict[int, TierKind] = {int(v): k for k, v in TIER_TO_PB.items()}


class UndecodableRequest:
    """Handed to a handler in place of a request whose bytes are not a valid message."""

    __slots__ = ("method", "reason", "size_bytes")

    def __init__(self, method: str, reason: str, size_bytes: int) -> None:
        self.method = method
        self.reason = reason
        self.size_bytes = size_bytes


def undecodable_error(request: UndecodableRequest) -> InvalidArgument:
    """The error a service answers an undecodable request with (INVALID_ARGUMENT)."""
    return InvalidArgument(f"{request.method}: the request ({request.size_bytes} bytes) is not "
                           f"a valid message: {request.reason[:200]}")


def _safe_deserializer(message_cls: type[Message], method: str) -> Any:
    parse = message_cls.FromString

    def deserialize(data: bytes) -> Message | UndecodableRequest:
        try:
            return parse(data)
        except DecodeError as exc:
            return UndecodableRequest(method, str(exc), len(data))

    return deserialize


def service_handler(servicer: Any, service: ServiceDescriptor) -> Any:
    """A ``grpc.GenericRpcHandler`` serving every method of ``service`` from the same-named
    methods of ``servicer`` (as the generated ``add_*Servicer_to_server`` does), whose
    deserializers hand an :class:`UndecodableRequest` to the method instead of raising. For a
    client-streaming method the marker is an element of the request iterator. Works for
    ``grpc.server`` and ``grpc.aio.server`` (``server.add_generic_rpc_handlers((handler,))``)."""
    import grpc

    factories = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        reply_cls = message_factory.GetMessageClass(method.output_type)
        factory: Any = factories[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=_safe_deserializer(request_cls, f"/{service.full_name}/"
                                                    f"{method.name}"),
            response_serializer=reply_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def stats_doc(reply: Any, address: str) -> dict[str, Any]:
    """A daemon's ``StatsResponse`` as plain JSON-ready data (``kvtier stats``, ``kvtier run``);
    ``tenants``: the per-tenant rows the caller may see (untracked tenants as ``(other)``)."""
    hits = sum(t.hits for t in reply.tiers)
    lookups = hits + reply.misses
    return {
        "node_id": reply.node_id, "address": address, "epoch": reply.epoch,
        "uptime_s": round(reply.uptime_s, 3), "misses": reply.misses, "hits": hits,
        "hit_ratio": hits / lookups if lookups else None, "last_seq": reply.last_seq,
        "shm_leases_open": reply.shm_leases_open,
        "tcp_connections_open": reply.tcp_connections_open,
        "ucx_endpoints_open": reply.ucx_endpoints_open,
        "tiers": [{
            "tier": PB_TO_TIER[t.tier].value, "capacity_bytes": t.capacity_bytes,
            "used_bytes": t.used_bytes, "chunks": t.chunks, "hits": t.hits, "puts": t.puts,
            "evictions": t.drops, "demotions": t.demotions_out, "promotions": t.promotions_in,
            "corrupt": t.corrupt, "bytes_read": t.bytes_read, "bytes_written": t.bytes_written,
        } for t in reply.tiers],
        "tenants": [{
            "tenant": "(other)" if t.other else t.tenant, "hits": t.hits, "misses": t.misses,
            "bytes_read": t.bytes_read, "bytes_written": t.bytes_written, "refused": t.refused,
            "tiers": [{"tier": PB_TO_TIER[u.tier].value, "used_bytes": u.used_bytes,
                       "max_bytes": u.max_bytes, "guaranteed_bytes": u.guaranteed_bytes}
                      for u in t.tiers],
        } for t in reply.tenants],
    }


__all__ = ["ERROR_METADATA_KEY", "GRPC_CODE_NAMES", "LEADER_METADATA_KEY", "PB_TO_TIER",
           "SESSION_MAX_CHARS", "SESSION_METADATA_KEY", "SESSION_MIN_CHARS", "TIER_TO_PB",
           "UndecodableRequest", "error_from_name", "error_name", "grpc_code_name",
           "service_handler", "stats_doc", "undecodable_error"]

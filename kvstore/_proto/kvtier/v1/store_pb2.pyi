from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_HBM: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_NVME: _ClassVar[Tier]

class EventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EVENT_UNSPECIFIED: _ClassVar[EventKind]
    EVENT_STORED: _ClassVar[EventKind]
    EVENT_REMOVED: _ClassVar[EventKind]
    EVENT_MOVED: _ClassVar[EventKind]
    EVENT_RESYNC: _ClassVar[EventKind]
TIER_UNSPECIFIED: Tier
TIER_HBM: Tier
TIER_DRAM: Tier
TIER_NVME: Tier
EVENT_UNSPECIFIED: EventKind
EVENT_STORED: EventKind
EVENT_REMOVED: EventKind
EVENT_MOVED: EventKind
EVENT_RESYNC: EventKind

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "epoch", "hostname", "boot_id", "version", "pid", "grpc_address", "tcp_address", "shm_arena", "shm_socket", "inline_max_bytes", "max_value_bytes", "tier_capacity_bytes", "draining", "ucx_worker_address", "shm_read_index", "data_ticket_required", "data_tls_required")
    class TierCapacityBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHM_ARENA_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INLINE_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHM_READ_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DATA_TLS_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: str
    hostname: str
    boot_id: str
    version: str
    pid: int
    grpc_address: str
    tcp_address: str
    shm_arena: str
    shm_socket: str
    inline_max_bytes: int
    max_value_bytes: int
    tier_capacity_bytes: _containers.ScalarMap[str, int]
    draining: bool
    ucx_worker_address: bytes
    shm_read_index: str
    data_ticket_required: bool
    data_tls_required: bool
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[str] = ..., hostname: _Optional[str] = ..., boot_id: _Optional[str] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., grpc_address: _Optional[str] = ..., tcp_address: _Optional[str] = ..., shm_arena: _Optional[str] = ..., shm_socket: _Optional[str] = ..., inline_max_bytes: _Optional[int] = ..., max_value_bytes: _Optional[int] = ..., tier_capacity_bytes: _Optional[_Mapping[str, int]] = ..., draining: _Optional[bool] = ..., ucx_worker_address: _Optional[bytes] = ..., shm_read_index: _Optional[str] = ..., data_ticket_required: _Optional[bool] = ..., data_tls_required: _Optional[bool] = ...) -> None: ...

class IssueDataTicketRequest(_message.Message):
    __slots__ = ("ttl_s",)
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ttl_s: float
    def __init__(self, ttl_s: _Optional[float] = ...) -> None: ...

class IssueDataTicketResponse(_message.Message):
    __slots__ = ("ticket", "expires_at_unix_s", "ttl_s", "tenant", "every_tenant")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    EVERY_TENANT_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    expires_at_unix_s: float
    ttl_s: float
    tenant: str
    every_tenant: bool
    def __init__(self, ticket: _Optional[bytes] = ..., expires_at_unix_s: _Optional[float] = ..., ttl_s: _Optional[float] = ..., tenant: _Optional[str] = ..., every_tenant: _Optional[bool] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("key", "parent", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    value: bytes
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., value: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BatchPutRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutRequest, _Mapping]]] = ...) -> None: ...

class ItemStatus(_message.Message):
    __slots__ = ("ok", "error", "detail")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    detail: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class BatchPutResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ItemStatus]
    def __init__(self, items: _Optional[_Iterable[_Union[ItemStatus, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "value", "tier")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    tier: Tier
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchGetResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[GetResponse, _Mapping]]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("length", "tiers", "per_tier")
    class PerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PER_TIER_FIELD_NUMBER: _ClassVar[int]
    length: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    per_tier: _containers.ScalarMap[str, int]
    def __init__(self, length: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., per_tier: _Optional[_Mapping[str, int]] = ...) -> None: ...

class BatchLookupRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LookupRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[LookupRequest, _Mapping]]] = ...) -> None: ...

class BatchLookupResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[LookupResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[LookupResponse, _Mapping]]] = ...) -> None: ...

class ExistsRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExistsResponse(_message.Message):
    __slots__ = ("exists", "size_bytes")
    EXISTS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    exists: _containers.RepeatedScalarFieldContainer[bool]
    size_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, exists: _Optional[_Iterable[bool]] = ..., size_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoveRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class RemoveResponse(_message.Message):
    __slots__ = ("found", "removed")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, found: _Optional[bool] = ..., removed: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchRemoveRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchRemoveResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[RemoveResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[RemoveResponse, _Mapping]]] = ...) -> None: ...

class InspectRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    def __init__(self, key: _Optional[bytes] = ...) -> None: ...

class ChunkEntry(_message.Message):
    __slots__ = ("key", "parent", "tier", "size_bytes", "depth", "access_count", "children", "pinned", "age_s", "idle_s", "tenant")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    ACCESS_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    tier: Tier
    size_bytes: int
    depth: int
    access_count: int
    children: int
    pinned: bool
    age_s: float
    idle_s: float
    tenant: str
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., size_bytes: _Optional[int] = ..., depth: _Optional[int] = ..., access_count: _Optional[int] = ..., children: _Optional[int] = ..., pinned: _Optional[bool] = ..., age_s: _Optional[float] = ..., idle_s: _Optional[float] = ..., tenant: _Optional[str] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("key_prefix", "tier", "limit")
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    key_prefix: bytes
    tier: Tier
    limit: int
    def __init__(self, key_prefix: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("entries", "truncated")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[ChunkEntry]
    truncated: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[ChunkEntry, _Mapping]]] = ..., truncated: _Optional[bool] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("keys", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ("lease_id", "expires_in_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    expires_in_s: float
    def __init__(self, lease_id: _Optional[int] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class BatchPinRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PinRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PinRequest, _Mapping]]] = ...) -> None: ...

class BatchPinResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PinResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[PinResponse, _Mapping]]] = ...) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class BatchUnpinRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchUnpinResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, released: _Optional[_Iterable[bool]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "chunks", "largest_free_bytes", "hits", "puts", "bytes_written", "bytes_read", "demotions_out", "promotions_in", "drops", "corrupt")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    LARGEST_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_OUT_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    DROPS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    chunks: int
    largest_free_bytes: int
    hits: int
    puts: int
    bytes_written: int
    bytes_read: int
    demotions_out: int
    promotions_in: int
    drops: int
    corrupt: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., largest_free_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., puts: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., demotions_out: _Optional[int] = ..., promotions_in: _Optional[int] = ..., drops: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "epoch", "tiers", "misses", "lookups", "last_seq", "shm_leases_open", "tcp_connections_open", "uptime_s", "tenants", "ucx_endpoints_open")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SHM_LEASES_OPEN_FIELD_NUMBER: _ClassVar[int]
    TCP_CONNECTIONS_OPEN_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    UCX_ENDPOINTS_OPEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    epoch: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    misses: int
    lookups: int
    last_seq: int
    shm_leases_open: int
    tcp_connections_open: int
    uptime_s: float
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    ucx_endpoints_open: int
    def __init__(self, node_id: _Optional[str] = ..., epoch: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., misses: _Optional[int] = ..., lookups: _Optional[int] = ..., last_seq: _Optional[int] = ..., shm_leases_open: _Optional[int] = ..., tcp_connections_open: _Optional[int] = ..., uptime_s: _Optional[float] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., ucx_endpoints_open: _Optional[int] = ...) -> None: ...

class TenantTierStats(_message.Message):
    __slots__ = ("tier", "used_bytes", "max_bytes", "guaranteed_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    GUARANTEED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    used_bytes: int
    max_bytes: int
    guaranteed_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., used_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., guaranteed_bytes: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "other", "hits", "misses", "bytes_read", "bytes_written", "refused", "tiers")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    OTHER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    other: bool
    hits: int
    misses: int
    bytes_read: int
    bytes_written: int
    refused: int
    tiers: _containers.RepeatedCompositeFieldContainer[TenantTierStats]
    def __init__(self, tenant: _Optional[str] = ..., other: _Optional[bool] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., refused: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TenantTierStats, _Mapping]]] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("tier", "bytes", "key_prefix")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    KEY_PREFIX_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    bytes: int
    key_prefix: bytes
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., bytes: _Optional[int] = ..., key_prefix: _Optional[bytes] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("freed_bytes", "removed_chunks", "busy_chunks")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BUSY_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    removed_chunks: int
    busy_chunks: int
    def __init__(self, freed_bytes: _Optional[int] = ..., removed_chunks: _Optional[int] = ..., busy_chunks: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class AcquireReadRequest(_message.Message):
    __slots__ = ("keys", "ttl_s", "prefix")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    prefix: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ..., prefix: _Optional[bool] = ...) -> None: ...

class ChunkLocation(_message.Message):
    __slots__ = ("offset", "size_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    size_bytes: int
    def __init__(self, offset: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class AcquireReadResponse(_message.Message):
    __slots__ = ("lease_id", "chunks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkLocation]
    def __init__(self, lease_id: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkLocation, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("key", "parent", "size_bytes", "ttl_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent: bytes
    size_bytes: int
    ttl_s: float
    def __init__(self, key: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "offset")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offset: int
    def __init__(self, lease_id: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("tier",)
    TIER_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class SetParentsRequest(_message.Message):
    __slots__ = ("keys", "parents", "ttl_s")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parents: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., parents: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class SetParentsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("from_seq", "epoch")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    epoch: str
    def __init__(self, from_seq: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class ChunkEvent(_message.Message):
    __slots__ = ("seq", "epoch", "kind", "key", "tier", "from_tier", "size_bytes", "parent", "tenant")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FROM_TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    epoch: str
    kind: EventKind
    key: bytes
    tier: Tier
    from_tier: Tier
    size_bytes: int
    parent: bytes
    tenant: str
    def __init__(self, seq: _Optional[int] = ..., epoch: _Optional[str] = ..., kind: _Optional[_Union[EventKind, str]] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., from_tier: _Optional[_Union[Tier, str]] = ..., size_bytes: _Optional[int] = ..., parent: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("page_entries",)
    PAGE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    page_entries: int
    def __init__(self, page_entries: _Optional[int] = ...) -> None: ...

class SnapshotPage(_message.Message):
    __slots__ = ("epoch", "seq", "entries", "last")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    entries: _containers.RepeatedCompositeFieldContainer[ChunkEntry]
    last: bool
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[ChunkEntry, _Mapping]]] = ..., last: _Optional[bool] = ...) -> None: ...

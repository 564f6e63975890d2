from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_NONE: _ClassVar[RejectReason]
    REJECT_TTFT_SLO: _ClassVar[RejectReason]
    REJECT_TPOT_SLO: _ClassVar[RejectReason]
    REJECT_DECODE_KV_FULL: _ClassVar[RejectReason]
REJECT_NONE: RejectReason
REJECT_TTFT_SLO: RejectReason
REJECT_TPOT_SLO: RejectReason
REJECT_DECODE_KV_FULL: RejectReason

class ScheduleRequest(_message.Message):
    __slots__ = ("request_id", "model", "tenant", "keys", "token_ids", "input_tokens", "expected_output_tokens", "at_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    input_tokens: int
    expected_output_tokens: int
    at_s: float
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ..., input_tokens: _Optional[int] = ..., expected_output_tokens: _Optional[int] = ..., at_s: _Optional[float] = ...) -> None: ...

class TierCounts(_message.Message):
    __slots__ = ("hbm", "dram", "nvme")
    HBM_FIELD_NUMBER: _ClassVar[int]
    DRAM_FIELD_NUMBER: _ClassVar[int]
    NVME_FIELD_NUMBER: _ClassVar[int]
    hbm: int
    dram: int
    nvme: int
    def __init__(self, hbm: _Optional[int] = ..., dram: _Optional[int] = ..., nvme: _Optional[int] = ...) -> None: ...

class FetchPlan(_message.Message):
    __slots__ = ("src_node", "dst_node", "first_block", "end_block", "size_bytes", "src_tiers", "src_grpc_address", "src_tcp_address")
    SRC_NODE_FIELD_NUMBER: _ClassVar[int]
    DST_NODE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    END_BLOCK_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SRC_TIERS_FIELD_NUMBER: _ClassVar[int]
    SRC_GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SRC_TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    src_node: str
    dst_node: str
    first_block: int
    end_block: int
    size_bytes: int
    src_tiers: TierCounts
    src_grpc_address: str
    src_tcp_address: str
    def __init__(self, src_node: _Optional[str] = ..., dst_node: _Optional[str] = ..., first_block: _Optional[int] = ..., end_block: _Optional[int] = ..., size_bytes: _Optional[int] = ..., src_tiers: _Optional[_Union[TierCounts, _Mapping]] = ..., src_grpc_address: _Optional[str] = ..., src_tcp_address: _Optional[str] = ...) -> None: ...

class ReplicationHint(_message.Message):
    __slots__ = ("src_node", "dst_nodes", "blocks")
    SRC_NODE_FIELD_NUMBER: _ClassVar[int]
    DST_NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    src_node: str
    dst_nodes: _containers.RepeatedScalarFieldContainer[str]
    blocks: int
    def __init__(self, src_node: _Optional[str] = ..., dst_nodes: _Optional[_Iterable[str]] = ..., blocks: _Optional[int] = ...) -> None: ...

class ScheduleReply(_message.Message):
    __slots__ = ("request_id", "accepted", "reason", "message", "prefill_instance", "prefill_node", "decode_instance", "prefix_blocks", "local_blocks", "local_tiers", "fetch", "replicate", "ttft_estimate_s", "queue_s", "transfer_s", "prefill_s", "load_s", "tpot_s", "ticket", "conductor_id", "engine_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TIERS_FIELD_NUMBER: _ClassVar[int]
    FETCH_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    TTFT_ESTIMATE_S_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    CONDUCTOR_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    accepted: bool
    reason: RejectReason
    message: str
    prefill_instance: str
    prefill_node: str
    decode_instance: str
    prefix_blocks: int
    local_blocks: int
    local_tiers: TierCounts
    fetch: FetchPlan
    replicate: ReplicationHint
    ttft_estimate_s: float
    queue_s: float
    transfer_s: float
    prefill_s: float
    load_s: float
    tpot_s: float
    ticket: int
    conductor_id: str
    engine_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., accepted: _Optional[bool] = ..., reason: _Optional[_Union[RejectReason, str]] = ..., message: _Optional[str] = ..., prefill_instance: _Optional[str] = ..., prefill_node: _Optional[str] = ..., decode_instance: _Optional[str] = ..., prefix_blocks: _Optional[int] = ..., local_blocks: _Optional[int] = ..., local_tiers: _Optional[_Union[TierCounts, _Mapping]] = ..., fetch: _Optional[_Union[FetchPlan, _Mapping]] = ..., replicate: _Optional[_Union[ReplicationHint, _Mapping]] = ..., ttft_estimate_s: _Optional[float] = ..., queue_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., load_s: _Optional[float] = ..., tpot_s: _Optional[float] = ..., ticket: _Optional[int] = ..., conductor_id: _Optional[str] = ..., engine_cached_tokens: _Optional[int] = ...) -> None: ...

class ScheduleBatchRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScheduleRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[ScheduleRequest, _Mapping]]] = ...) -> None: ...

class ScheduleBatchItem(_message.Message):
    __slots__ = ("reply", "error", "detail")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reply: ScheduleReply
    error: str
    detail: str
    def __init__(self, reply: _Optional[_Union[ScheduleReply, _Mapping]] = ..., error: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ScheduleBatchReply(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScheduleBatchItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScheduleBatchItem, _Mapping]]] = ...) -> None: ...

class ConductorLookupRequest(_message.Message):
    __slots__ = ("model", "tenant", "keys", "token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class NodeMatch(_message.Message):
    __slots__ = ("node_id", "blocks", "tiers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    blocks: int
    tiers: TierCounts
    def __init__(self, node_id: _Optional[str] = ..., blocks: _Optional[int] = ..., tiers: _Optional[_Union[TierCounts, _Mapping]] = ...) -> None: ...

class EngineMatch(_message.Message):
    __slots__ = ("instance_id", "cached_tokens", "mismatch")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    cached_tokens: int
    mismatch: bool
    def __init__(self, instance_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ..., mismatch: _Optional[bool] = ...) -> None: ...

class ConductorLookupReply(_message.Message):
    __slots__ = ("blocks", "best_blocks", "nodes", "engines")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BEST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    best_blocks: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeMatch]
    engines: _containers.RepeatedCompositeFieldContainer[EngineMatch]
    def __init__(self, blocks: _Optional[int] = ..., best_blocks: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeMatch, _Mapping]]] = ..., engines: _Optional[_Iterable[_Union[EngineMatch, _Mapping]]] = ...) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("instance_id", "queued_prefill_tokens", "running_decode_batch", "kv_used_tokens", "at_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    queued_prefill_tokens: int
    running_decode_batch: int
    kv_used_tokens: int
    at_s: float
    def __init__(self, instance_id: _Optional[str] = ..., queued_prefill_tokens: _Optional[int] = ..., running_decode_batch: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., at_s: _Optional[float] = ...) -> None: ...

class ReportLoadReply(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class CompletionReport(_message.Message):
    __slots__ = ("ticket", "prefill", "decode", "cancelled", "at_s")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    AT_S_FIELD_NUMBER: _ClassVar[int]
    ticket: int
    prefill: PrefillDone
    decode: DecodeDone
    cancelled: bool
    at_s: float
    def __init__(self, ticket: _Optional[int] = ..., prefill: _Optional[_Union[PrefillDone, _Mapping]] = ..., decode: _Optional[_Union[DecodeDone, _Mapping]] = ..., cancelled: _Optional[bool] = ..., at_s: _Optional[float] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("prefill_s", "computed_tokens", "reused_tokens", "transfer_s", "transferred_bytes")
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    prefill_s: float
    computed_tokens: int
    reused_tokens: int
    transfer_s: float
    transferred_bytes: int
    def __init__(self, prefill_s: _Optional[float] = ..., computed_tokens: _Optional[int] = ..., reused_tokens: _Optional[int] = ..., transfer_s: _Optional[float] = ..., transferred_bytes: _Optional[int] = ...) -> None: ...

class DecodeDone(_message.Message):
    __slots__ = ("output_tokens", "tpot_s", "batch_size", "context_tokens")
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    output_tokens: int
    tpot_s: float
    batch_size: int
    context_tokens: int
    def __init__(self, output_tokens: _Optional[int] = ..., tpot_s: _Optional[float] = ..., batch_size: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class ReportCompletionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaderRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaderReply(_message.Message):
    __slots__ = ("leader_id", "leader_address", "is_leader", "conductor_id", "term", "indexed_blocks", "live_nodes", "prefill_instances", "decode_instances", "engine_caches")
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    CONDUCTOR_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_NODES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CACHES_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    leader_address: str
    is_leader: bool
    conductor_id: str
    term: int
    indexed_blocks: int
    live_nodes: _containers.RepeatedScalarFieldContainer[str]
    prefill_instances: _containers.RepeatedScalarFieldContainer[str]
    decode_instances: _containers.RepeatedScalarFieldContainer[str]
    engine_caches: _containers.RepeatedCompositeFieldContainer[EngineCacheInfo]
    def __init__(self, leader_id: _Optional[str] = ..., leader_address: _Optional[str] = ..., is_leader: _Optional[bool] = ..., conductor_id: _Optional[str] = ..., term: _Optional[int] = ..., indexed_blocks: _Optional[int] = ..., live_nodes: _Optional[_Iterable[str]] = ..., prefill_instances: _Optional[_Iterable[str]] = ..., decode_instances: _Optional[_Iterable[str]] = ..., engine_caches: _Optional[_Iterable[_Union[EngineCacheInfo, _Mapping]]] = ...) -> None: ...

class EngineCacheInfo(_message.Message):
    __slots__ = ("instance_id", "blocks", "expected_seq", "batches", "events", "gaps", "gaps_repaired", "replayed_batches", "unrecoverable_gaps", "resets", "restarts", "cleared", "overflows", "ignored_events", "malformed_batches", "verified_blocks", "hash_mismatches", "probes", "probes_matched", "mismatch")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SEQ_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    GAPS_FIELD_NUMBER: _ClassVar[int]
    GAPS_REPAIRED_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    UNRECOVERABLE_GAPS_FIELD_NUMBER: _ClassVar[int]
    RESETS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    OVERFLOWS_FIELD_NUMBER: _ClassVar[int]
    IGNORED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HASH_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    PROBES_MATCHED_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    blocks: int
    expected_seq: int
    batches: int
    events: int
    gaps: int
    gaps_repaired: int
    replayed_batches: int
    unrecoverable_gaps: int
    resets: int
    restarts: int
    cleared: int
    overflows: int
    ignored_events: int
    malformed_batches: int
    verified_blocks: int
    hash_mismatches: int
    probes: int
    probes_matched: int
    mismatch: str
    def __init__(self, instance_id: _Optional[str] = ..., blocks: _Optional[int] = ..., expected_seq: _Optional[int] = ..., batches: _Optional[int] = ..., events: _Optional[int] = ..., gaps: _Optional[int] = ..., gaps_repaired: _Optional[int] = ..., replayed_batches: _Optional[int] = ..., unrecoverable_gaps: _Optional[int] = ..., resets: _Optional[int] = ..., restarts: _Optional[int] = ..., cleared: _Optional[int] = ..., overflows: _Optional[int] = ..., ignored_events: _Optional[int] = ..., malformed_batches: _Optional[int] = ..., verified_blocks: _Optional[int] = ..., hash_mismatches: _Optional[int] = ..., probes: _Optional[int] = ..., probes_matched: _Optional[int] = ..., mismatch: _Optional[str] = ...) -> None: ...

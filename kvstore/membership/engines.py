"""Engine instances in etcd: what a prefill or decode engine publishes, and how the conductor
watches it.

Key layout (see :class:`~kvstore.membership.etcd.KeyLayout`)::

    <prefix>engines/prefill/<instance_id>    EngineRecord JSON, attached to the engine's lease
    <prefix>engines/decode/<instance_id>

An engine registers like a store daemon does: ``async with register_engine(client, record)``
holds its record under a lease of its own, kept alive in the background and written again under
a new lease when the old one lapsed (a :class:`~kvstore.membership.registration.Registration`),
so the key vanishes when the engine dies. The reference prefill and decode workers
(:mod:`kvstore.engine.worker`) register this way; :func:`put_engine_record` writes a record once
(tests and the planner's live replay, which play engines). :func:`list_engines` reads the
current records (the gateway), :class:`EngineWatch` follows them (the conductor). Load (queued
prefill tokens, running decode batch, KV in use) changes per request: engines send it to the
conductor over gRPC (``ReportLoad``), not through etcd.

vLLM servers do not speak etcd: a sidecar (:mod:`kvstore.membership.vllm_registration`,
``kvtier vllm-register``) holds their record, which says where the server answers HTTP
(``http_url``) and where it publishes its KV cache events (:class:`VllmKvEvents`): the
conductor subscribes there to learn what the engine holds in its own prefix cache.

Contracts
    * A malformed value (bad JSON, unknown role, id that does not match its key) is logged and
      skipped, never raised: one broken writer cannot take discovery down.
    * A registration replaces whatever holds its key (:attr:`KeyClaim.REPLACE`): an engine
      restarted before its predecessor's lease expired takes the record over at once. Instance
      ids are the operator's to keep unique, as before registrations existed.
    * :class:`EngineWatch` yields a snapshot first, then every change; when the etcd stream
      breaks it resumes after the last revision seen, and re-lists and yields the difference
      only if that history was compacted (as ``watch_nodes`` does). Entering raises
      MembershipError when etcd cannot be reached; running retries forever and logs.
    * asyncio only; iterate a watch from one task.
"""

from __future__ import annotations

import enum
import json
import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import aetcd

from kvstore.errors import InvalidArgument
from kvstore.keys import KVDtype, KVFingerprint
from kvstore.membership.etcd import (
    DEFAULT_LAYOUT,
    DEFAULT_RPC_TIMEOUT_S,
    KeyLayout,
    PrefixWatch,
    check_id,
    etcd_call,
    etcd_read,
    parse_host_port,
)
from kvstore.membership.registration import KeyClaim, Registration, StateCallback

log = logging.getLogger(__name__)

__all__ = ["VLLM_DEFAULT_HASH_SEED", "EngineChange", "EngineRecord", "EngineRole", "EngineWatch",
           "VllmKvEvents", "engine_create_revisions", "engines_prefix", "list_engines",
           "put_engine_record", "register_engine"]

VLLM_DEFAULT_HASH_SEED = "vllm-none-hash"
"""The seed of vLLM's block-hash chain (``NONE_HASH``) when ``PYTHONHASHSEED`` is unset and the
hash algorithm is cryptographic (``sha256``, ``sha256_cbor``)."""

_RETRY_INTERVAL_S = 0.5


class EngineRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


def engines_prefix(layout: KeyLayout) -> str:
    return f"{layout.prefix}engines/"


def _fingerprint_to_dict(fp: KVFingerprint) -> dict[str, Any]:
    return {"model": fp.model, "dtype": fp.dtype.value, "num_layers": fp.num_layers,
            "num_kv_heads": fp.num_kv_heads, "head_dim": fp.head_dim,
            "block_size_tokens": fp.block_size_tokens, "tp_rank": fp.tp_rank,
            "tp_size": fp.tp_size}


def _fingerprint_from_dict(doc: Any) -> KVFingerprint:
    if not isinstance(doc, dict):
        raise InvalidArgument("kv_fingerprint must be an object")
    try:
        return KVFingerprint(model=doc["model"], dtype=KVDtype(doc["dtype"]),
                             num_layers=doc["num_layers"], num_kv_heads=doc["num_kv_heads"],
                             head_dim=doc["head_dim"], block_size_tokens=doc["block_size_tokens"],
                             tp_rank=doc.get("tp_rank", 0), tp_size=doc.get("tp_size", 1))
    except KeyError as exc:
        raise InvalidArgument(f"kv_fingerprint lacks field {exc.args[0]!r}") from exc
    except ValueError as exc:  # KVDtype("fp7")
        raise InvalidArgument(f"invalid kv_fingerprint: {exc}") from exc


def _check_zmq_endpoint(name: str, value: object) -> None:
    """A ZMQ endpoint a subscriber can *connect* to: ``tcp://host:port`` or ``ipc://path``
    (no wildcard: ``tcp://*:5557`` is how the publisher binds, not where to reach it)."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a ZMQ endpoint string, got {value!r}")
    if value.startswith("ipc://") and len(value) > len("ipc://"):
        return
    if value.startswith("tcp://") and "*" not in value:
        parse_host_port(value[len("tcp://"):])
        return
    raise InvalidArgument(f"{name} must be tcp://host:port or ipc://path (an address to connect "
                          f"to, no wildcard), got {value!r}")


@dataclass(frozen=True)
class VllmKvEvents:
    """Where and how a vLLM engine publishes its KV cache events (``KVEventsConfig``).

    ``endpoint`` is the ZMQ PUB socket and ``replay_endpoint`` its ROUTER for missed batches,
    both as a subscriber connects to them. ``hash_algo`` is vLLM's
    ``prefix_caching_hash_algo`` and ``hash_seed`` the seed of its ``NONE_HASH`` (the server's
    ``PYTHONHASHSEED``, else :data:`VLLM_DEFAULT_HASH_SEED`); the conductor can compute the
    same block hashes from token ids only for ``sha256_cbor`` (any other algorithm is kept, so
    a record from a vLLM with a newer algorithm still parses, and reported as a mismatch).
    ``int_block_hashes``: the events carry the last 8 bytes of each digest as an int (vLLM's
    default) instead of the 32-byte digest (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
    ``num_blocks``: the engine's KV cache size in blocks (0: unknown), which bounds what the
    conductor keeps for it.
    """

    endpoint: str
    block_size_tokens: int
    replay_endpoint: str | None = None
    topic: str = ""
    hash_algo: str = "sha256_cbor"
    hash_seed: str = VLLM_DEFAULT_HASH_SEED
    int_block_hashes: bool = True
    num_blocks: int = 0

    def __post_init__(self) -> None:
        _check_zmq_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_zmq_endpoint("replay_endpoint", self.replay_endpoint)
        for name in ("block_size_tokens", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (
                    name == "block_size_tokens" and value == 0):
                raise InvalidArgument(f"{name} must be an int > 0 (num_blocks: >= 0), "
                                      f"got {value!r}")
        for name in ("topic", "hash_seed"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgument(f"{name} must be a str, got {getattr(self, name)!r}")
        if not isinstance(self.hash_algo, str) or not self.hash_algo:
            raise InvalidArgument(f"hash_algo must be a non-empty str, got {self.hash_algo!r}")
        if not isinstance(self.int_block_hashes, bool):
            raise InvalidArgument(
                f"int_block_hashes must be a bool, got {self.int_block_hashes!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "topic": self.topic, "hash_algo": self.hash_algo, "hash_seed": self.hash_seed,
                "block_size_tokens": self.block_size_tokens,
                "int_block_hashes": self.int_block_hashes, "num_blocks": self.num_blocks}

    @classmethod
    def from_dict(cls, doc: Any) -> VllmKvEvents:
        if not isinstance(doc, dict):
            raise InvalidArgument("vllm_kv_events must be an object")
        try:
            return cls(endpoint=doc["endpoint"], block_size_tokens=doc["block_size_tokens"],
                       replay_endpoint=doc.get("replay_endpoint"), topic=doc.get("topic", ""),
                       hash_algo=doc.get("hash_algo", "sha256_cbor"),
                       hash_seed=doc.get("hash_seed", VLLM_DEFAULT_HASH_SEED),
                       int_block_hashes=doc.get("int_block_hashes", True),
                       num_blocks=doc.get("num_blocks", 0))
        except KeyError as exc:
            raise InvalidArgument(f"vllm_kv_events lacks field {exc.args[0]!r}") from exc


def _check_http_url(value: object) -> None:
    if not isinstance(value, str):
        raise InvalidArgument(f"http_url must be a string, got {value!r}")
    parsed = urllib.parse.urlsplit(value)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.query \
            or parsed.fragment:
        raise InvalidArgument(f"http_url must be http(s)://host[:port][/path], got {value!r}")
    try:
        parsed.port  # noqa: B018  (raises ValueError for a bad port)
    except ValueError as exc:
        raise InvalidArgument(f"http_url has a bad port: {value!r}") from exc


@dataclass(frozen=True)
class EngineRecord:
    """One engine instance as published under ``engines/<role>/<instance_id>``.

    ``node_id`` is the store daemon on the engine's host: its local KV cache. The conductor
    schedules onto an instance only while that node is registered (alive). ``model`` is the
    name requests use. ``kv_capacity_tokens`` is the decode KV room (required for decode
    engines, ignored for prefill). ``kv_fingerprint`` lets the conductor hash token ids into
    the same chained keys the engine stores (optional: without it, requests for this model
    must carry keys). ``address`` is the engine's own endpoint, informational.
    ``http_url`` is where an HTTP engine (a ``vllm serve``) answers, e.g.
    ``http://10.0.0.5:8000`` (the front door proxies there); ``vllm_kv_events``, when set,
    where it publishes its KV cache events (the conductor follows its own prefix cache).
    Both optional: records written before they existed parse unchanged.
    """

    instance_id: str
    role: EngineRole
    model: str
    node_id: str
    kv_capacity_tokens: int = 0
    address: str | None = None
    kv_fingerprint: KVFingerprint | None = None
    http_url: str | None = None
    vllm_kv_events: VllmKvEvents | None = None

    def __post_init__(self) -> None:
        check_id("instance_id", self.instance_id)
        check_id("node_id", self.node_id)
        if not isinstance(self.role, EngineRole):
            raise InvalidArgument(f"role must be an EngineRole, got {self.role!r}")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgument(f"model must be a non-empty string, got {self.model!r}")
        cap = self.kv_capacity_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 0:
            raise InvalidArgument(f"kv_capacity_tokens must be an int >= 0, got {cap!r}")
        if self.role is EngineRole.DECODE and cap == 0:
            raise InvalidArgument(f"decode engine {self.instance_id} needs kv_capacity_tokens > 0")
        if self.address is not None:
            parse_host_port(self.address)
        if self.kv_fingerprint is not None:
            if not isinstance(self.kv_fingerprint, KVFingerprint):
                raise InvalidArgument("kv_fingerprint must be a KVFingerprint or None")
            if self.kv_fingerprint.model != self.model:
                raise InvalidArgument(
                    f"kv_fingerprint names model {self.kv_fingerprint.model!r}, the record "
                    f"{self.model!r}")
        if self.http_url is not None:
            _check_http_url(self.http_url)
        if self.vllm_kv_events is not None and not isinstance(self.vllm_kv_events, VllmKvEvents):
            raise InvalidArgument("vllm_kv_events must be a VllmKvEvents or None")

    def key(self, layout: KeyLayout = DEFAULT_LAYOUT) -> str:
        return layout.engine_key(self.role.value, self.instance_id)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"schema": 1, "instance_id": self.instance_id, "role": self.role.value,
               "model": self.model, "node_id": self.node_id,
               "kv_capacity_tokens": self.kv_capacity_tokens, "address": self.address,
               "kv_fingerprint": (None if self.kv_fingerprint is None
                                  else _fingerprint_to_dict(self.kv_fingerprint))}
        if self.http_url is not None:
            doc["http_url"] = self.http_url
        if self.vllm_kv_events is not None:
            doc["vllm_kv_events"] = self.vllm_kv_events.to_dict()
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> EngineRecord:
        """Parse and validate; InvalidArgument for anything malformed."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"engine record is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise InvalidArgument("engine record must be a JSON object")
        try:
            fp = doc.get("kv_fingerprint")
            events = doc.get("vllm_kv_events")
            return cls(instance_id=doc["instance_id"], role=EngineRole(doc["role"]),
                       model=doc["model"], node_id=doc["node_id"],
                       kv_capacity_tokens=doc.get("kv_capacity_tokens", 0),
                       address=doc.get("address"),
                       kv_fingerprint=None if fp is None else _fingerprint_from_dict(fp),
                       http_url=doc.get("http_url"),
                       vllm_kv_events=None if events is None else VllmKvEvents.from_dict(events))
        except KeyError as exc:
            raise InvalidArgument(f"engine record lacks field {exc.args[0]!r}") from exc
        except ValueError as exc:  # EngineRole("x"); InvalidArgument is a ValueError too
            raise InvalidArgument(f"invalid engine record: {exc}") from exc


async def put_engine_record(client: aetcd.Client, record: EngineRecord, *,
                            layout: KeyLayout = DEFAULT_LAYOUT, lease_id: int | None = None,
                            rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> None:
    """Write ``record`` under its key (attached to ``lease_id`` when given). MembershipError."""
    await etcd_call(f"put engine {record.instance_id}",
                client.put(record.key(layout).encode(), record.to_json(), lease=lease_id),
                rpc_timeout_s)


def register_engine(client: aetcd.Client, record: EngineRecord, *, ttl_s: int = 10,
                    layout: KeyLayout = DEFAULT_LAYOUT,
                    on_state_change: StateCallback | None = None,
                    rpc_timeout_s: float | None = None) -> Registration[EngineRecord]:
    """An engine's :class:`~kvstore.membership.registration.Registration` of
    ``engines/<role>/<instance_id>``, to enter with ``async with`` (see the module docstring:
    it replaces whatever holds the key). Raises InvalidArgument for a record that is not an
    EngineRecord or a bad ``ttl_s``; entering raises MembershipError when etcd cannot be
    reached."""
    if not isinstance(record, EngineRecord):
        raise InvalidArgument(f"record must be an EngineRecord, got {type(record).__name__}")
    return Registration(client, record, key_of=lambda r: r.key(layout), kind="engine",
                        member_id=record.instance_id, claim=KeyClaim.REPLACE, ttl_s=ttl_s,
                        on_state_change=on_state_change, rpc_timeout_s=rpc_timeout_s)


async def list_engines(client: aetcd.Client, *, layout: KeyLayout = DEFAULT_LAYOUT,
                       rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S) -> dict[str, EngineRecord]:
    """The registered engines by instance id (in key order: decode, then prefill), malformed
    entries skipped. Raises MembershipError."""
    current, _, _ = await _snapshot(client, layout, rpc_timeout_s)
    return {record.instance_id: record for record in current.values()}


async def engine_create_revisions(client: aetcd.Client, *, layout: KeyLayout = DEFAULT_LAYOUT,
                                  rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S
                                  ) -> dict[str, tuple[int, EngineRecord]]:
    """Every valid engine record with the create revision of its key, by instance id: what a
    watcher compares (:attr:`EngineChange.create_revision`) to tell whether it has seen the
    current registration. Raises MembershipError."""
    current, created, _ = await _snapshot(client, layout, rpc_timeout_s)
    return {record.instance_id: (created[key], record) for key, record in current.items()}


@dataclass(frozen=True, slots=True)
class EngineChange:
    """One change: ``record`` is the new record, or None when the instance left."""

    instance_id: str
    record: EngineRecord | None
    create_revision: int = field(default=0, compare=False)
    """Create revision of the record's key (0 when it left). A record written again after
    its lease lapsed is reported again with its new create revision, even if unchanged."""


def _decode(layout: KeyLayout, key: bytes, value: bytes) -> EngineRecord | None:
    key_text = key.decode(errors="replace")
    try:
        record = EngineRecord.from_json(value)
    except InvalidArgument as exc:
        log.warning("ignoring malformed engine record at %s: %s", key_text, exc)
        return None
    if key_text != record.key(layout):
        log.warning("ignoring engine record at %s: it belongs at %s", key_text, record.key(layout))
        return None
    return record


async def _snapshot(client: aetcd.Client, layout: KeyLayout, rpc_timeout_s: float
                    ) -> tuple[dict[bytes, EngineRecord], dict[bytes, int], int]:
    """Every valid engine record by key, their keys' create revisions, and the revision of
    the read."""
    result = await etcd_read("list engines",
                             lambda: client.get_prefix(engines_prefix(layout).encode()),
                             rpc_timeout_s)
    current: dict[bytes, EngineRecord] = {}
    created: dict[bytes, int] = {}
    for kv in result:
        record = _decode(layout, kv.key, kv.value)
        if record is not None:
            current[bytes(kv.key)] = record
            created[bytes(kv.key)] = int(kv.create_revision)
    return current, created, int(result.header.revision)


class EngineWatch(PrefixWatch[EngineChange]):
    """Every engine now, then every change (see the module docstring).

    ``async with EngineWatch(client, layout=...) as changes: async for change in changes``.
    """

    _what = "engine"

    def __init__(self, client: aetcd.Client, *, layout: KeyLayout = DEFAULT_LAYOUT,
                 rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
                 retry_interval_s: float = _RETRY_INTERVAL_S) -> None:
        """Record settings only; nothing talks to etcd until entered."""
        super().__init__(client, layout=layout, rpc_timeout_s=rpc_timeout_s,
                         retry_interval_s=retry_interval_s)
        self._prefix = engines_prefix(layout).encode()
        self._known: dict[bytes, EngineRecord] = {}
        self._created: dict[bytes, int] = {}

    async def _open(self) -> tuple[Any, list[EngineChange]]:
        current, created, revision = await _snapshot(self._client, self._layout,
                                                     self._rpc_timeout_s)
        watch = await self._watch_from(revision + 1)
        changes = [EngineChange(rec.instance_id, None) for key, rec in self._known.items()
                   if key not in current]
        changes += [EngineChange(rec.instance_id, rec, created[key])
                    for key, rec in current.items()
                    if self._known.get(key) != rec or self._created.get(key) != created[key]]
        self._known, self._created = current, created
        return watch, changes

    @property
    def _prefix_bytes(self) -> bytes:
        return self._prefix

    def _apply_event(self, event: Any) -> list[EngineChange]:
        key = bytes(event.kv.key)
        if event.kind == aetcd.EventKind.DELETE:
            gone = self._known.pop(key, None)
            self._created.pop(key, None)
            return [] if gone is None else [EngineChange(gone.instance_id, None)]
        record = _decode(self._layout, event.kv.key, event.kv.value)
        create_revision = int(event.kv.create_revision)
        if record is None or (self._known.get(key) == record
                              and self._created.get(key) == create_revision):
            return []
        self._known[key] = record
        self._created[key] = create_revision
        return [EngineChange(record.instance_id, record, create_revision)]

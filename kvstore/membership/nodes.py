"""Node membership in etcd: store daemons register under a lease, everyone else discovers them.

Each daemon's :class:`NodeRecord` lives under ``/kvtier/nodes/<node_id>`` (the layout is in
:mod:`kvstore.membership.etcd`), attached to the daemon's lease. A store daemon holds
``async with register_node(client, record, ttl_s=...)`` for its lifetime (a
:class:`~kvstore.membership.registration.Registration`, exclusive: one live daemon per node
id). The key exists while the daemon's lease is alive: it vanishes ``ttl_s`` seconds after the
daemon dies (or at once when the daemon exits cleanly and revokes the lease).
:func:`list_nodes` reads the current members; :func:`watch_nodes` yields a snapshot followed by
every later change.

Contracts
    * Every etcd failure is a :class:`~kvstore.errors.MembershipError` with a deadline, as
      everywhere in :mod:`kvstore.membership`.
    * Starting is strict, running is forgiving: ``Registration.start`` and the first
      snapshot of :func:`watch_nodes` raise when etcd cannot be reached or the node id is
      taken; after that both retry forever in the background and log what happens.
    * A value under ``nodes/`` that is not a valid :class:`NodeRecord` (bad JSON, missing
      field, unknown tier, id that does not match its key) is logged and skipped, never
      raised: one broken writer cannot take discovery down.
    * Only asyncio; nothing here is thread-safe. One ``aetcd.Client`` can serve any number
      of registrations and watches in the same event loop.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aetcd

from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from kvstore.membership.etcd import (
    DEFAULT_LAYOUT,
    DEFAULT_RPC_TIMEOUT_S,
    WATCH_RETRY_INTERVAL_S,
    KeyLayout,
    PrefixWatch,
    check_id,
    etcd_read,
    parse_host_port,
)
from kvstore.membership.registration import KeyClaim, Registration, StateCallback

log = logging.getLogger(__name__)

RECORD_SCHEMA = 1
"""Version of the NodeRecord JSON layout. Readers ignore fields they do not know."""

# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class NodeRecord:
    """What a store daemon publishes about itself under ``nodes/<node_id>``.

    ``tier_capacity_bytes`` maps each tier the node runs to its capacity; it is stored
    read-only, in tier order (HBM, DRAM, NVMe). Addresses are ``host:port``.
    ``ucx_address`` is the opaque UCX worker address (text) when the node speaks UCX;
    ``shm_arena`` names the shared-memory arena that clients on the same host may map.
    """

    node_id: str
    grpc_address: str
    tcp_address: str
    hostname: str
    tier_capacity_bytes: Mapping[TierKind, int]
    started_at_unix_s: float
    version: str
    shm_arena: str | None = None
    ucx_address: str | None = None

    def __post_init__(self) -> None:
        check_id("node_id", self.node_id)
        parse_host_port(self.grpc_address)
        parse_host_port(self.tcp_address)
        if not isinstance(self.hostname, str) or not self.hostname:
            raise InvalidArgument(f"hostname must be a non-empty string, got {self.hostname!r}")
        if not isinstance(self.version, str) or not self.version:
            raise InvalidArgument(f"version must be a non-empty string, got {self.version!r}")
        if (
            isinstance(self.started_at_unix_s, bool)
            or not isinstance(self.started_at_unix_s, int | float)
            or not self.started_at_unix_s >= 0  # also rejects NaN
        ):
            raise InvalidArgument(
                f"started_at_unix_s must be a non-negative number, got {self.started_at_unix_s!r}"
            )
        for name in ("shm_arena", "ucx_address"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgument(f"{name} must be None or a non-empty string, got {value!r}")
        capacities: dict[TierKind, int] = {}
        for tier, size_bytes in dict(self.tier_capacity_bytes).items():
            if not isinstance(tier, TierKind):
                raise InvalidArgument(f"tier_capacity_bytes keys must be TierKind, got {tier!r}")
            if isinstance(size_bytes, bool) or not isinstance(size_bytes, int) or size_bytes < 0:
                raise InvalidArgument(
                    f"capacity of tier {tier.value} must be a non-negative int of bytes, "
                    f"got {size_bytes!r}"
                )
            capacities[tier] = size_bytes
        ordered = dict(sorted(capacities.items(), key=lambda item: item[0].order))
        object.__setattr__(self, "tier_capacity_bytes", MappingProxyType(ordered))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": RECORD_SCHEMA,
            "node_id": self.node_id,
            "grpc_address": self.grpc_address,
            "tcp_address": self.tcp_address,
            "ucx_address": self.ucx_address,
            "shm_arena": self.shm_arena,
            "hostname": self.hostname,
            "tier_capacity_bytes": {t.value: n for t, n in self.tier_capacity_bytes.items()},
            "started_at_unix_s": self.started_at_unix_s,
            "version": self.version,
        }

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeRecord:
        """Parse and validate a record. Raises InvalidArgument for anything malformed."""
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InvalidArgument(f"node record is not valid JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise InvalidArgument(f"node record must be a JSON object, got {type(doc).__name__}")
        schema = doc.get("schema")
        if not isinstance(schema, int) or schema < 1:
            raise InvalidArgument(f"node record has no valid 'schema' field: {schema!r}")
        capacities = doc.get("tier_capacity_bytes")
        if not isinstance(capacities, dict):
            raise InvalidArgument("node record field 'tier_capacity_bytes' must be an object")
        try:
            tiers = {TierKind(name): size for name, size in capacities.items()}
            return cls(
                node_id=doc["node_id"],
                grpc_address=doc["grpc_address"],
                tcp_address=doc["tcp_address"],
                hostname=doc["hostname"],
                tier_capacity_bytes=tiers,
                started_at_unix_s=doc["started_at_unix_s"],
                version=doc["version"],
                shm_arena=doc.get("shm_arena"),
                ucx_address=doc.get("ucx_address"),
            )
        except KeyError as exc:
            raise InvalidArgument(f"node record lacks field {exc.args[0]!r}") from exc
        except ValueError as exc:  # TierKind("cxl"); InvalidArgument is a ValueError too
            raise InvalidArgument(f"invalid node record: {exc}") from exc


class NodeEventKind(enum.Enum):
    JOINED = "joined"
    UPDATED = "updated"
    LEFT = "left"


@dataclass(frozen=True, eq=False)
class NodeEvent:
    """One membership change. For LEFT, ``record`` is the last record seen for the node.

    ``revision`` is the etcd revision of the change (of the snapshot, for the snapshot's
    JOINED events and for changes found by re-listing after a reconnect).
    ``create_revision`` is the create revision of the node's key (of the key that left, for
    LEFT): a registration written again after its lease lapsed has a new one.
    """

    kind: NodeEventKind
    record: NodeRecord
    revision: int
    create_revision: int = 0

    @property
    def node_id(self) -> str:
        return self.record.node_id


def _decode_node(layout: KeyLayout, key: bytes, value: bytes) -> NodeRecord | None:
    """The record stored under ``key``, or None (logged) when key or value is malformed."""
    key_text = key.decode(errors="replace")
    node_id = layout.node_id_of(key_text)
    if node_id is None:
        log.warning(
            "ignoring etcd key %r: not a valid node key under %s", key_text, layout.nodes_prefix
        )
        return None
    try:
        record = NodeRecord.from_json(value)
    except InvalidArgument as exc:
        log.warning("ignoring malformed node record at %s: %s", key_text, exc)
        return None
    if record.node_id != node_id:
        log.warning(
            "ignoring node record at %s: it names node %r, the key names %r",
            key_text,
            record.node_id,
            node_id,
        )
        return None
    return record


@dataclass(frozen=True, slots=True)
class _Member:
    create_revision: int
    record: NodeRecord


async def _snapshot(
    client: aetcd.Client, layout: KeyLayout, rpc_timeout_s: float
) -> tuple[dict[str, _Member], int]:
    """Every valid node under the prefix, sorted by id, and the revision of the read."""
    result = await etcd_read(
        "list nodes", lambda: client.get_prefix(layout.nodes_prefix.encode()), rpc_timeout_s
    )
    members: dict[str, _Member] = {}
    for kv in result:
        record = _decode_node(layout, kv.key, kv.value)
        if record is not None:
            members[record.node_id] = _Member(kv.create_revision, record)
    return dict(sorted(members.items())), int(result.header.revision)


async def list_nodes(
    client: aetcd.Client,
    *,
    layout: KeyLayout = DEFAULT_LAYOUT,
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
) -> dict[str, NodeRecord]:
    """The registered nodes by id (sorted), malformed entries skipped. Raises MembershipError."""
    members, _ = await _snapshot(client, layout, rpc_timeout_s)
    return {node_id: member.record for node_id, member in members.items()}


async def node_create_revisions(
    client: aetcd.Client,
    *,
    layout: KeyLayout = DEFAULT_LAYOUT,
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
) -> dict[str, int]:
    """The create revision of every registered node's key, by node id (malformed entries
    skipped): what a watcher compares to tell whether it has seen the current registration.
    Raises MembershipError."""
    members, _ = await _snapshot(client, layout, rpc_timeout_s)
    return {node_id: member.create_revision for node_id, member in members.items()}


# --------------------------------------------------------------------------- discovery


def _changes(old: _Member | None, new: _Member, revision: int) -> Iterator[NodeEvent]:
    """Events that turn ``old`` (None: unknown) into ``new`` for one node.

    A key re-created under another create revision means the node restarted, and
    whatever it held in memory is gone: that is LEFT + JOINED, not UPDATED. A write that
    changes nothing yields nothing.
    """
    if old is None:
        yield NodeEvent(NodeEventKind.JOINED, new.record, revision, new.create_revision)
    elif old.create_revision != new.create_revision:
        yield NodeEvent(NodeEventKind.LEFT, old.record, revision, old.create_revision)
        yield NodeEvent(NodeEventKind.JOINED, new.record, revision, new.create_revision)
    elif old.record != new.record:
        yield NodeEvent(NodeEventKind.UPDATED, new.record, revision, new.create_revision)


def _diff(known: dict[str, _Member], current: dict[str, _Member], revision: int) -> list[NodeEvent]:
    """Events that turn ``known`` into ``current`` (LEFT first); then ``known`` = ``current``."""
    events = [
        NodeEvent(NodeEventKind.LEFT, member.record, revision, member.create_revision)
        for node_id, member in known.items()
        if node_id not in current
    ]
    for node_id, member in current.items():
        events.extend(_changes(known.get(node_id), member, revision))
    known.clear()
    known.update(current)
    return events


def _apply(known: dict[str, _Member], layout: KeyLayout, event: aetcd.Event) -> list[NodeEvent]:
    """Events for one etcd watch event; updates ``known`` to match."""
    kv = event.kv
    revision = int(kv.mod_revision)
    if event.kind == aetcd.EventKind.DELETE:
        node_id = layout.node_id_of(kv.key.decode(errors="replace"))
        gone = known.pop(node_id, None) if node_id is not None else None
        # A malformed entry was never reported, so it leaves silently.
        return [] if gone is None else [
            NodeEvent(NodeEventKind.LEFT, gone.record, revision, gone.create_revision)]
    record = _decode_node(layout, kv.key, kv.value)
    if record is None:  # logged; a node whose update is malformed keeps its last good record
        return []
    new = _Member(int(kv.create_revision), record)
    old = known.get(record.node_id)
    known[record.node_id] = new
    return list(_changes(old, new, revision))


class NodeWatch(PrefixWatch[NodeEvent]):
    """JOINED for every current node, then every later JOINED / UPDATED / LEFT, in order.

    Use ``async with watch_nodes(client) as events: async for event in events: ...``.
    Entering reads the snapshot and opens the etcd watch at the snapshot's revision + 1,
    so no change between the read and the watch is lost, and changes made after entering
    are reported even if iteration starts later. Entering raises MembershipError when
    etcd cannot be reached. If the stream later breaks (a member paused or gone, etcd
    restarted) the watch resumes after the last revision it saw, on another member if the
    client moved, so every change is reported once (:class:`~kvstore.membership.etcd.PrefixWatch`).
    Only if that history was compacted does it re-list and yield the difference against what
    it has reported, retrying every ``retry_interval_s`` and logging: consumers still see a
    consistent sequence, though changes that cancelled out meanwhile are not replayed (a
    node that restarted shows as LEFT + JOINED). Leaving cancels the etcd watch. Iterate
    from one task only.
    """

    _what = "node"

    def __init__(
        self,
        client: aetcd.Client,
        *,
        layout: KeyLayout = DEFAULT_LAYOUT,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        retry_interval_s: float = WATCH_RETRY_INTERVAL_S,
    ) -> None:
        super().__init__(client, layout=layout, rpc_timeout_s=rpc_timeout_s,
                         retry_interval_s=retry_interval_s)
        self._known: dict[str, _Member] = {}

    async def _open(self) -> tuple[Any, list[NodeEvent]]:
        """Snapshot, then a watch from just after it; the events that bring us up to date."""
        current, revision = await _snapshot(self._client, self._layout, self._rpc_timeout_s)
        watch = await self._watch_from(revision + 1)
        return watch, _diff(self._known, current, revision)

    @property
    def _prefix_bytes(self) -> bytes:
        return self._layout.nodes_prefix.encode()

    def _apply_event(self, event: Any) -> Iterable[NodeEvent]:
        return _apply(self._known, self._layout, event)


def watch_nodes(
    client: aetcd.Client,
    *,
    layout: KeyLayout = DEFAULT_LAYOUT,
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    retry_interval_s: float = WATCH_RETRY_INTERVAL_S,
) -> NodeWatch:
    """A :class:`NodeWatch` to enter with ``async with`` (see its docstring)."""
    return NodeWatch(
        client, layout=layout, rpc_timeout_s=rpc_timeout_s, retry_interval_s=retry_interval_s
    )


# --------------------------------------------------------------------------- registration


def register_node(
    client: aetcd.Client,
    record: NodeRecord,
    *,
    ttl_s: int = 10,
    layout: KeyLayout = DEFAULT_LAYOUT,
    on_state_change: StateCallback | None = None,
    rpc_timeout_s: float | None = None,
) -> Registration[NodeRecord]:
    """A store daemon's :class:`~kvstore.membership.registration.Registration` of
    ``nodes/<node_id>``, to enter with ``async with``.

    Exclusive (:attr:`~kvstore.membership.registration.KeyClaim.EXCLUSIVE`): a second live
    daemon with the same node id fails to start with MembershipError, and the key is written
    again under a new lease when the daemon's lease lapsed. Raises InvalidArgument for a
    record that is not a NodeRecord or a bad ``ttl_s``.
    """
    if not isinstance(record, NodeRecord):
        raise InvalidArgument(f"record must be a NodeRecord, got {type(record).__name__}")
    return Registration(
        client,
        record,
        key_of=lambda r: layout.node_key(r.node_id),
        kind="node",
        member_id=record.node_id,
        claim=KeyClaim.EXCLUSIVE,
        ttl_s=ttl_s,
        on_state_change=on_state_change,
        rpc_timeout_s=rpc_timeout_s,
    )


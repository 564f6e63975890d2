"""Node membership in etcd: store daemons register under a lease, everyone else discovers them.

Each daemon's :class:`NodeRecord` lives under ``/kvtier/nodes/<node_id>`` (the layout is in
:mod:`kvstore.membership.etcd`), attached to the daemon's lease. A store daemon holds ``async with register_node(client, record, ttl_s=...)`` for its
lifetime (:class:`Registration`). The key exists while the daemon's lease is alive: it
vanishes ``ttl_s`` seconds after the daemon dies (or at once when the daemon exits cleanly
and revokes the lease). :func:`list_nodes` reads the current members;
:func:`watch_nodes` yields a snapshot followed by every later change.

Contracts
    * Every etcd failure is a :class:`~kvstore.errors.MembershipError` with a deadline, as
      everywhere in :mod:`kvstore.membership`.
    * Starting is strict, running is forgiving: :meth:`Registration.start` and the first
      snapshot of :func:`watch_nodes` raise when etcd cannot be reached or the node id is
      taken; after that both retry forever in the background and log what happens.
    * A value under ``nodes/`` that is not a valid :class:`NodeRecord` (bad JSON, missing
      field, unknown tier, id that does not match its key) is logged and skipped, never
      raised: one broken writer cannot take discovery down.
    * Only asyncio; nothing here is thread-safe. One ``aetcd.Client`` can serve any number
      of registrations and watches in the same event loop.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import Any

import aetcd

from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument, InvariantViolation, MembershipError
from kvstore.membership.etcd import (
    DEFAULT_LAYOUT,
    DEFAULT_RPC_TIMEOUT_S,
    WATCH_RETRY_INTERVAL_S,
    KeyLayout,
    PrefixWatch,
    check_id,
    etcd_call,
    parse_host_port,
)

log = logging.getLogger(__name__)

RECORD_SCHEMA = 1
"""Version of the NodeRecord JSON layout. Readers ignore fields they do not know."""

MAX_RETRY_INTERVAL_S = 0.5

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
    """

    kind: NodeEventKind
    record: NodeRecord
    revision: int

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
    result = await etcd_call(
        "list nodes", client.get_prefix(layout.nodes_prefix.encode()), rpc_timeout_s
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


# --------------------------------------------------------------------------- discovery


def _changes(old: _Member | None, new: _Member, revision: int) -> Iterator[NodeEvent]:
    """Events that turn ``old`` (None: unknown) into ``new`` for one node.

    A key re-created under another create revision means the node restarted, and
    whatever it held in memory is gone: that is LEFT + JOINED, not UPDATED. A write that
    changes nothing yields nothing.
    """
    if old is None:
        yield NodeEvent(NodeEventKind.JOINED, new.record, revision)
    elif old.create_revision != new.create_revision:
        yield NodeEvent(NodeEventKind.LEFT, old.record, revision)
        yield NodeEvent(NodeEventKind.JOINED, new.record, revision)
    elif old.record != new.record:
        yield NodeEvent(NodeEventKind.UPDATED, new.record, revision)


def _diff(known: dict[str, _Member], current: dict[str, _Member], revision: int) -> list[NodeEvent]:
    """Events that turn ``known`` into ``current`` (LEFT first); then ``known`` = ``current``."""
    events = [
        NodeEvent(NodeEventKind.LEFT, member.record, revision)
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
        return [] if gone is None else [NodeEvent(NodeEventKind.LEFT, gone.record, revision)]
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
    etcd cannot be reached. If the stream later breaks (etcd restarted, history
    compacted) the watch re-lists, yields the difference against what it has reported
    and watches again, retrying every ``retry_interval_s`` and logging: consumers see a
    consistent sequence, though changes that cancel out while disconnected are not
    replayed (a node that restarted shows as LEFT + JOINED). Leaving cancels the etcd
    watch. Iterate from one task only.
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
        watch = await etcd_call(
            "watch nodes",
            self._client.watch_prefix(
                self._layout.nodes_prefix.encode(), start_revision=revision + 1
            ),
            self._rpc_timeout_s,
        )
        return watch, _diff(self._known, current, revision)

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


class RegistrationState(enum.Enum):
    """Where a :class:`Registration` stands.

    PENDING: not started. REGISTERED: the key is in etcd under a lease confirmed within
    its TTL. LOST: the lease is gone, or could not be confirmed for a whole TTL (etcd
    unreachable): other nodes may already see this node as LEFT; the keepalive keeps
    retrying and returns to REGISTERED by itself. CLOSED: deregistered.
    """

    PENDING = "pending"
    REGISTERED = "registered"
    LOST = "lost"
    CLOSED = "closed"


StateCallback = Callable[[RegistrationState], None]


@dataclass(slots=True)
class _Lease:
    lease_id: int
    confirmed_until: float
    """``time.monotonic()`` before which the server cannot have expired the lease."""
    create_revision: int | None = field(default=None)
    """Create revision of our key under this lease; None while not known to be written."""


class Registration:
    """A store daemon's membership: its record under a lease kept alive in the background.

    Use ``async with register_node(client, record, ttl_s=10) as registration``. Entering
    grants a lease and creates ``nodes/<node_id>`` only if absent (a transaction), so a
    second live node with the same id fails with MembershipError. A background task then
    refreshes the lease every ``ttl_s / 3``. If etcd stops answering it retries every
    half second (state LOST once a whole TTL passes without confirmation); if the lease
    expired meanwhile, it grants a new one and writes the key again. Leaving cancels the
    task and revokes the lease, which deletes the key at once. ``on_state_change`` is
    called in the event loop on every state change; its exceptions are logged.
    """

    def __init__(
        self,
        client: aetcd.Client,
        record: NodeRecord,
        *,
        ttl_s: int = 10,
        layout: KeyLayout = DEFAULT_LAYOUT,
        on_state_change: StateCallback | None = None,
        rpc_timeout_s: float | None = None,
    ) -> None:
        """Record settings only; nothing talks to etcd until :meth:`start`.

        ``ttl_s`` is whole seconds (etcd's unit) and at least 2; etcd itself raises very
        short TTLs to about 1.5 s with its default timing. ``rpc_timeout_s`` defaults to
        the keepalive interval, so a hung call never delays the next refresh.
        """
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 2:
            raise InvalidArgument(f"ttl_s must be an int >= 2 seconds, got {ttl_s!r}")
        if not isinstance(record, NodeRecord):
            raise InvalidArgument(f"record must be a NodeRecord, got {type(record).__name__}")
        self._client = client
        self._record = record
        self._ttl_s = ttl_s
        self._layout = layout
        self._key = layout.node_key(record.node_id)
        self._on_state_change = on_state_change
        self._keepalive_interval_s = ttl_s / 3
        self._retry_interval_s = min(self._keepalive_interval_s, MAX_RETRY_INTERVAL_S)
        self._rpc_timeout_s = (
            rpc_timeout_s if rpc_timeout_s is not None else self._keepalive_interval_s
        )
        if self._rpc_timeout_s <= 0:
            raise InvalidArgument(f"rpc_timeout_s must be positive, got {rpc_timeout_s}")
        self._state = RegistrationState.PENDING
        self._state_changed = asyncio.Condition()
        self._lease: _Lease | None = None
        self._dirty = False  # the record changed and is not yet written under the live lease
        self._lock = asyncio.Lock()  # serializes every etcd write of this registration
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # the keepalive exits at its next step even if a cancel is lost
        self._failing = False
        self._leases_granted = 0

    # ------------------------------------------------------------------ read-only view

    @property
    def key(self) -> str:
        return self._key

    @property
    def record(self) -> NodeRecord:
        return self._record

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    @property
    def state(self) -> RegistrationState:
        return self._state

    @property
    def lost(self) -> bool:
        return self._state is RegistrationState.LOST

    @property
    def lease_id(self) -> int | None:
        """The current lease, or None between an expired lease and its replacement."""
        return self._lease.lease_id if self._lease is not None else None

    @property
    def leases_granted(self) -> int:
        """How many leases this registration has been granted (1 + re-registrations)."""
        return self._leases_granted

    async def wait_state(self, state: RegistrationState) -> None:
        """Return once the registration is in ``state`` (bound it with ``asyncio.timeout``)."""
        async with self._state_changed:
            await self._state_changed.wait_for(lambda: self._state is state)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Register now; raises MembershipError if etcd is unreachable or the id is taken."""
        if self._state is not RegistrationState.PENDING:
            raise MembershipError(
                f"registration of {self._record.node_id!r} is {self._state.value}"
            )
        async with self._lock:
            await self._grant()
            try:
                holder = await self._claim_key()
            except MembershipError:
                await self._revoke_quietly()
                raise
            if holder is not None:
                await self._revoke_quietly()
                raise MembershipError(self._taken_message(holder))
        await self._set_state(RegistrationState.REGISTERED)
        self._task = asyncio.get_running_loop().create_task(
            self._keepalive_loop(), name=f"kvtier-keepalive-{self._record.node_id}"
        )

    async def close(self) -> None:
        """Stop the keepalive and revoke the lease (the key disappears at once).

        If etcd cannot be reached the revoke is skipped with a warning and the key
        expires after ``ttl_s``. Idempotent.
        """
        if self._state is RegistrationState.CLOSED:
            return
        crashed: BaseException | None = None
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            # wait(), not await: the task's own CancelledError must not look like ours.
            await asyncio.wait({self._task})
            if not self._task.cancelled():
                crashed = self._task.exception()
            self._task = None
        async with self._lock:
            await self._revoke_quietly()
        await self._set_state(RegistrationState.CLOSED)
        if crashed is not None:
            raise InvariantViolation(
                f"keepalive of node {self._record.node_id!r} crashed: {crashed!r}"
            ) from crashed

    async def update(self, record: NodeRecord) -> None:
        """Publish a new record for the same node (others see UPDATED).

        The record is kept even if the write fails, and the keepalive writes it once etcd
        answers (or on re-registration). Raises MembershipError when it cannot be
        written now; InvalidArgument if ``record`` names another node.
        """
        if record.node_id != self._record.node_id:
            raise InvalidArgument(
                f"update must keep node_id {self._record.node_id!r}, got {record.node_id!r}"
            )
        if self._state in (RegistrationState.PENDING, RegistrationState.CLOSED):
            raise MembershipError(f"registration of {record.node_id!r} is {self._state.value}")
        self._record = record
        self._dirty = True
        async with self._lock:
            await self._push_if_dirty()

    async def __aenter__(self) -> Registration:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ etcd steps

    async def _grant(self) -> None:
        sent_at = time.monotonic()
        lease = await etcd_call("grant lease", self._client.lease(self._ttl_s), self._rpc_timeout_s)
        self._lease = _Lease(int(lease.id), sent_at + int(lease.ttl))
        self._leases_granted += 1

    async def _claim_key(self) -> int | None:
        """Create our key under the current lease if absent (one transaction).

        Returns None when the key is ours, including when it already exists under *our*
        lease (an earlier attempt landed although its answer was lost); otherwise the id
        of the lease that holds it (0: no lease). Raises MembershipError if etcd fails.
        """
        assert self._lease is not None
        client = self._client
        key = self._key.encode()
        self._dirty = False
        succeeded, responses = await etcd_call(
            f"register node {self._record.node_id!r}",
            client.transaction(
                compare=[client.transactions.version(key) == 0],
                success=[
                    client.transactions.put(key, self._record.to_json(), lease=self._lease.lease_id)
                ],
                failure=[client.transactions.get(key)],
            ),
            self._rpc_timeout_s,
        )
        if succeeded:
            self._lease.create_revision = int(responses[0].response_put.header.revision)
            return None
        existing = responses[0][0][1] if responses and responses[0] else None
        if existing is None:  # deleted between compare and get: next attempt will tell
            raise MembershipError(f"key {self._key} changed during registration; retrying")
        if int(existing.lease) == self._lease.lease_id:
            self._lease.create_revision = int(existing.create_revision)
            self._dirty = existing.value != self._record.to_json()
            return None
        return int(existing.lease)

    def _taken_message(self, holder_lease_id: int) -> str:
        return (
            f"node id {self._record.node_id!r} is already registered at {self._key} "
            f"(lease {holder_lease_id:x}): another live node uses this id"
        )

    async def _push_if_dirty(self) -> None:
        """Write the current record under our key if it changed (caller holds the lock)."""
        lease = self._lease
        if not self._dirty or lease is None or lease.create_revision is None:
            return
        client = self._client
        key = self._key.encode()
        self._dirty = False
        try:
            succeeded, _ = await etcd_call(
                f"update node {self._record.node_id!r}",
                client.transaction(
                    compare=[client.transactions.create(key) == lease.create_revision],
                    success=[
                        client.transactions.put(key, self._record.to_json(), lease=lease.lease_id)
                    ],
                    failure=[],
                ),
                self._rpc_timeout_s,
            )
        except MembershipError:
            self._dirty = True
            raise
        if not succeeded:  # our key vanished or was replaced: claim it again next tick
            lease.create_revision = None
            self._dirty = True

    async def _revoke_quietly(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await etcd_call(
                "revoke lease", self._client.revoke_lease(lease.lease_id), self._rpc_timeout_s
            )
        except MembershipError as exc:
            log.warning(
                "could not revoke lease %x of node %r (%s); its key expires within %d s",
                lease.lease_id,
                self._record.node_id,
                exc,
                self._ttl_s,
            )

    async def _refresh(self) -> bool:
        """Refresh the lease; False when etcd says it no longer exists."""
        assert self._lease is not None
        sent_at = time.monotonic()
        reply = await etcd_call(
            "refresh lease", self._client.refresh_lease(self._lease.lease_id), self._rpc_timeout_s
        )
        if reply is None:  # the stream closed without an answer: unknown, not expired
            raise MembershipError("refresh lease: etcd closed the keepalive stream unanswered")
        ttl_s = int(reply.TTL)
        if ttl_s <= 0:  # etcd answers TTL 0 for a lease it no longer has
            return False
        self._lease.confirmed_until = sent_at + ttl_s
        return True

    # ------------------------------------------------------------------ keepalive

    async def _keepalive_loop(self) -> None:
        try:
            while not self._closing:
                healthy = await self._tick()
                await asyncio.sleep(
                    self._keepalive_interval_s if healthy else self._retry_interval_s
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug, not an etcd failure (those are MembershipError, handled in _tick).
            # Report it now; close() re-raises it as InvariantViolation.
            log.exception("keepalive of node %r crashed", self._record.node_id)
            await self._set_state(RegistrationState.LOST)
            raise

    async def _tick(self) -> bool:
        """One keepalive step; True when the registration is confirmed."""
        async with self._lock:
            try:
                if self._lease is None:
                    await self._grant()
                elif not await self._refresh():
                    log.warning("lease of node %r expired; registering again", self._record.node_id)
                    self._lease = None
                    await self._set_state(RegistrationState.LOST)
                    await self._grant()
                if self._lease is not None and self._lease.create_revision is None:
                    holder = await self._claim_key()
                    if holder is not None:  # the id is taken: give our lease back, retry later
                        log.error("%s; retrying", self._taken_message(holder))
                        await self._revoke_quietly()
                        await self._set_state(RegistrationState.LOST)
                        return False
                await self._push_if_dirty()
            except MembershipError as exc:
                self._note_failure(exc)
                if self._lease is None or time.monotonic() >= self._lease.confirmed_until:
                    await self._set_state(RegistrationState.LOST)
                return False
        if self._failing:
            log.info("registration of node %r confirmed again", self._record.node_id)
            self._failing = False
        await self._set_state(RegistrationState.REGISTERED)
        return True

    def _note_failure(self, exc: MembershipError) -> None:
        if not self._failing:
            log.warning("keepalive of node %r failing: %s", self._record.node_id, exc)
            self._failing = True
        else:
            log.debug("keepalive of node %r still failing: %s", self._record.node_id, exc)

    async def _set_state(self, state: RegistrationState) -> None:
        if state is self._state:
            return
        log.info(
            "node %r membership: %s -> %s", self._record.node_id, self._state.value, state.value
        )
        self._state = state
        async with self._state_changed:
            self._state_changed.notify_all()
        if self._on_state_change is not None:
            try:
                self._on_state_change(state)
            except Exception:
                log.exception("on_state_change callback of node %r failed", self._record.node_id)


def register_node(
    client: aetcd.Client,
    record: NodeRecord,
    *,
    ttl_s: int = 10,
    layout: KeyLayout = DEFAULT_LAYOUT,
    on_state_change: StateCallback | None = None,
    rpc_timeout_s: float | None = None,
) -> Registration:
    """A :class:`Registration` to enter with ``async with`` (see its docstring)."""
    return Registration(
        client,
        record,
        ttl_s=ttl_s,
        layout=layout,
        on_state_change=on_state_change,
        rpc_timeout_s=rpc_timeout_s,
    )


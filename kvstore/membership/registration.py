"""A member's record in etcd under a lease kept alive in the background: :class:`Registration`.

Store daemons (:func:`~kvstore.membership.nodes.register_node`) and engines
(:func:`~kvstore.membership.engines.register_engine`) both hold one for their lifetime. The key
exists while the member's lease is alive: it vanishes ``ttl_s`` seconds after the member dies
(or at once when it exits cleanly and revokes the lease), and it is written again under a new
lease when the old one lapsed while the member lived (a stalled process, an etcd restart),
or at the next keepalive step when someone deleted or overwrote it while the lease lived.

Contracts
    * Every etcd failure is a :class:`~kvstore.errors.MembershipError` with a deadline, as
      everywhere in :mod:`kvstore.membership`.
    * Starting is strict, running is forgiving: :meth:`Registration.start` raises when etcd
      cannot be reached or (:attr:`KeyClaim.EXCLUSIVE`) the key is held under another lease;
      after that the keepalive retries forever in the background and logs what happens.
    * Only asyncio; nothing here is thread-safe. One ``aetcd.Client`` can serve any number of
      registrations in the same event loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Generic, Protocol, TypeVar

import aetcd

from kvstore.errors import InvalidArgument, InvariantViolation, MembershipError
from kvstore.membership.etcd import etcd_call
from kvstore.membership.failover import EtcdClusterClient

log = logging.getLogger(__name__)

__all__ = ["KeyClaim", "Registration", "RegistrationState", "StateCallback"]

MAX_RETRY_INTERVAL_S = 0.5


def _connection(client: aetcd.Client) -> int | None:
    """Which connection an etcd cluster client is on (it counts moves to another member)."""
    return client.generation if isinstance(client, EtcdClusterClient) else None


class Record(Protocol):
    """What a registration publishes: a value that serializes itself."""

    def to_json(self) -> bytes: ...


R = TypeVar("R", bound=Record)


class KeyClaim(enum.Enum):
    """How a registration writes its key when something already holds it.

    EXCLUSIVE: create the key only if it is absent (or holds a value under no lease, which no
    live member can own: written by hand), so a second live member with the same id
    is refused (:meth:`Registration.start` raises; a keepalive that finds its key taken logs
    an ERROR and retries). Store daemons: two daemons under one node id would corrupt the
    conductor's index. REPLACE: write over whatever holds the key; the newest registrant wins
    (an engine restarted before its predecessor's lease expired takes its record over).
    """

    EXCLUSIVE = "exclusive"
    REPLACE = "replace"


class RegistrationState(enum.Enum):
    """Where a :class:`Registration` stands.

    PENDING: not started. REGISTERED: the key is in etcd under a lease confirmed within
    its TTL. LOST: the lease is gone, or could not be confirmed for a whole TTL (etcd
    unreachable), or another live lease holds our key: watchers may already have seen the key go (a node as LEFT); the keepalive
    keeps retrying and returns to REGISTERED by itself. CLOSED: deregistered.
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


class Registration(Generic[R]):
    """One member's record under a lease kept alive in the background.

    Build one with :func:`~kvstore.membership.nodes.register_node` or
    :func:`~kvstore.membership.engines.register_engine` and use it as ``async with ... as
    registration``. Entering grants a lease and writes the record's key under it in one
    transaction: with :attr:`KeyClaim.EXCLUSIVE` only if the key is absent (a second live
    member with the same id fails with MembershipError), with :attr:`KeyClaim.REPLACE` over
    whatever is there. A background task then refreshes the lease every ``ttl_s / 3``. If etcd
    stops answering it retries every half second (state LOST once a whole TTL passes without
    confirmation), at once when the failure moved the client to another etcd member; if the lease expired meanwhile (etcd deleted the key with it), it grants a
    new one and writes the key again. Each step also reads the key back: deleted, or
    overwritten under no lease or under our own lease, while the lease lives, it is written
    again within that step (logged at WARNING); held by another live lease, it is left alone
    and the state is LOST until that lease ends (see :meth:`_verify_key`). Leaving cancels the task and revokes the lease, which
    deletes the key at once. ``on_state_change`` is called in the event loop on every state
    change; its exceptions are logged.
    """

    def __init__(
        self,
        client: aetcd.Client,
        record: R,
        *,
        key_of: Callable[[R], str],
        kind: str,
        member_id: str,
        claim: KeyClaim = KeyClaim.EXCLUSIVE,
        ttl_s: int = 10,
        on_state_change: StateCallback | None = None,
        rpc_timeout_s: float | None = None,
    ) -> None:
        """Record settings only; nothing talks to etcd until :meth:`start`.

        ``key_of(record)`` is the record's etcd key (an update must keep it); ``kind`` and
        ``member_id`` name the member in logs and errors (``node 'node-a'``). ``ttl_s`` is
        whole seconds (etcd's unit) and at least 2; etcd itself raises very short TTLs to about
        1.5 s with its default timing. ``rpc_timeout_s`` defaults to the keepalive interval, so
        a hung call never delays the next refresh.
        """
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 2:
            raise InvalidArgument(f"ttl_s must be an int >= 2 seconds, got {ttl_s!r}")
        if not isinstance(claim, KeyClaim):
            raise InvalidArgument(f"claim must be a KeyClaim, got {claim!r}")
        self._client = client
        self._record = record
        self._key_of = key_of
        self._kind = kind
        self._member_id = member_id
        self._name = f"{kind} {member_id!r}"
        self._claim = claim
        self._ttl_s = ttl_s
        self._key = key_of(record)
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
    def record(self) -> R:
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
            raise MembershipError(f"registration of {self._name} is {self._state.value}")
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
            self._keepalive_loop(), name=f"kvtier-keepalive-{self._kind}-{self._member_id}"
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
                f"keepalive of {self._name} crashed: {crashed!r}"
            ) from crashed

    async def update(self, record: R) -> None:
        """Publish a new record for the same member (node watchers see UPDATED).

        The record is kept even if the write fails, and the keepalive writes it once etcd
        answers (or on re-registration). Raises MembershipError when it cannot be
        written now; InvalidArgument if ``record`` belongs under another key.
        """
        key = self._key_of(record)
        if key != self._key:
            raise InvalidArgument(f"an update of {self._name} must keep its key {self._key}, "
                                  f"got one for {key}")
        if self._state in (RegistrationState.PENDING, RegistrationState.CLOSED):
            raise MembershipError(f"registration of {self._name} is {self._state.value}")
        self._record = record
        self._dirty = True
        async with self._lock:
            await self._push_if_dirty()

    async def __aenter__(self) -> Registration[R]:
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
        """Write our key under the current lease (one transaction): if absent (EXCLUSIVE), or
        whatever holds it (REPLACE).

        Returns None when the key is ours, including when it already exists under *our*
        lease (an earlier attempt landed although its answer was lost); otherwise the id
        of the lease that holds it (0: no lease). Raises MembershipError if etcd fails.
        """
        assert self._lease is not None
        client = self._client
        key = self._key.encode()
        self._dirty = False
        if self._claim is KeyClaim.REPLACE:
            # Put and read back in one transaction: a put over an existing key keeps that
            # key's create revision, which _push_if_dirty compares against.
            _, responses = await etcd_call(
                f"register {self._name}",
                client.transaction(
                    compare=[],
                    success=[
                        client.transactions.put(
                            key, self._record.to_json(), lease=self._lease.lease_id
                        ),
                        client.transactions.get(key),
                    ],
                    failure=[],
                ),
                self._rpc_timeout_s,
            )
            self._lease.create_revision = int(responses[1][0][1].create_revision)
            return None
        succeeded, responses = await etcd_call(
            f"register {self._name}",
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
        if int(existing.lease) == 0:
            # Attached to no lease, so no live member holds it (written by hand): take it,
            # provided nobody wrote it since we read it.
            log.warning("key %s of %s holds a value under no lease; writing our record over it",
                        self._key, self._name)
            took, _ = await etcd_call(
                f"register {self._name}",
                client.transaction(
                    compare=[client.transactions.mod(key) == int(existing.mod_revision)],
                    success=[client.transactions.put(key, self._record.to_json(),
                                                     lease=self._lease.lease_id)],
                    failure=[],
                ),
                self._rpc_timeout_s,
            )
            if not took:
                raise MembershipError(f"key {self._key} changed during registration; retrying")
            self._lease.create_revision = int(existing.create_revision)
            return None
        return int(existing.lease)

    def _taken_message(self, holder_lease_id: int) -> str:
        return (
            f"{self._kind} id {self._member_id!r} is already registered at {self._key} "
            f"(lease {holder_lease_id:x}): another live {self._kind} uses this id"
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
                f"update {self._name}",
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

    async def _verify_key(self) -> bool:
        """Check that our key still holds our record under our lease (caller holds the lock).

        Someone may delete the key, or write over it, while our lease lives (by hand, a
        script); the keepalive would not notice by itself. Deleted: mark it unwritten, so the
        claim step writes it again. Overwritten under no lease or under our own lease: mark
        the record dirty, so the push step writes it back (the put keeps the create revision
        it compares). False when another live lease holds the key (another member with our
        id, or, for REPLACE, a newer registrant): we do not write over a live member, and
        check again at the next step. Raises MembershipError if etcd fails.
        """
        lease = self._lease
        assert lease is not None
        kv = await etcd_call(f"check {self._name}", self._client.get(self._key.encode()),
                             self._rpc_timeout_s)
        if kv is None:
            log.warning("key %s of %s was deleted while its lease lived; writing it again",
                        self._key, self._name)
            lease.create_revision = None
            return True
        holder = int(kv.lease)
        if holder in (0, lease.lease_id):
            lease.create_revision = int(kv.create_revision)
            if kv.value != self._record.to_json():
                log.warning("key %s of %s was overwritten (%s); writing our record back",
                            self._key, self._name,
                            "under no lease" if holder == 0 else "under our lease")
                self._dirty = True
            elif holder == 0:  # our value, but detached from our lease: it would never expire
                log.warning("key %s of %s was detached from its lease; attaching it again",
                            self._key, self._name)
                self._dirty = True
            return True
        if self._claim is KeyClaim.EXCLUSIVE:
            log.error("%s; checking again", self._taken_message(holder))
        else:
            log.warning("key %s of %s was replaced by another registrant (lease %x): the newest "
                        "wins; not writing it back while that lease lives", self._key,
                        self._name, holder)
        return False

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
                "could not revoke lease %x of %s (%s); its key expires within %d s",
                lease.lease_id,
                self._name,
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
        retried_at_once = False
        try:
            while not self._closing:
                connection = _connection(self._client)
                healthy = await self._tick()
                # A step that failed because its member did not answer moved the client to
                # the next member (kvstore.membership.failover): try there at once, so a short
                # TTL survives a paused member. Once: a cluster that answers nobody waits.
                moved = not healthy and _connection(self._client) != connection
                retried_at_once = moved and not retried_at_once
                if retried_at_once:
                    continue
                await asyncio.sleep(
                    self._keepalive_interval_s if healthy else self._retry_interval_s
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug, not an etcd failure (those are MembershipError, handled in _tick).
            # Report it now; close() re-raises it as InvariantViolation.
            log.exception("keepalive of %s crashed", self._name)
            await self._set_state(RegistrationState.LOST)
            raise

    async def _tick(self) -> bool:
        """One keepalive step; True when the registration is confirmed."""
        async with self._lock:
            try:
                if self._lease is None:
                    await self._grant()
                elif not await self._refresh():
                    log.warning("lease of %s expired; registering again", self._name)
                    self._lease = None
                    await self._set_state(RegistrationState.LOST)
                    await self._grant()
                if (self._lease is not None and self._lease.create_revision is not None
                        and not self._dirty and not await self._verify_key()):
                    await self._set_state(RegistrationState.LOST)
                    return False
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
            log.info("registration of %s confirmed again", self._name)
            self._failing = False
        await self._set_state(RegistrationState.REGISTERED)
        return True

    def _note_failure(self, exc: MembershipError) -> None:
        if not self._failing:
            log.warning("keepalive of %s failing: %s", self._name, exc)
            self._failing = True
        else:
            log.debug("keepalive of %s still failing: %s", self._name, exc)

    async def _set_state(self, state: RegistrationState) -> None:
        if state is self._state:
            return
        log.info(
            "%s membership: %s -> %s", self._name, self._state.value, state.value
        )
        self._state = state
        async with self._state_changed:
            self._state_changed.notify_all()
        if self._on_state_change is not None:
            try:
                self._on_state_change(state)
            except Exception:
                log.exception("on_state_change callback of %s failed", self._name)

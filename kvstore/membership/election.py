"""Conductor leader election through etcd: one leader, any number of standbys.

The leader key is ``<prefix>conductor/leader`` (:attr:`KeyLayout.conductor_leader_key`); its
value is a :class:`LeaderRecord` (JSON) attached to the leader's lease.

How it works
    Every candidate holds its own lease, refreshed every ``ttl_s / 3``. To become leader it
    runs one transaction: *if the key does not exist, put our record under our lease*. The
    one whose transaction succeeds leads; the others learn who leads from the same
    transaction's failure branch and try again every ``poll_interval_s``. When the leader
    dies its lease expires (``ttl_s`` plus etcd's ~0.5 s expiry tick), the key vanishes with
    it and the next standby's transaction wins: a takeover within about ``ttl_s + 1`` s.
    :meth:`Election.resign` revokes the lease, so a clean exit hands over at once.

Safety
    A leader is only *sure* to lead until ``confirmed_until`` = (time it sent the last
    successful refresh) + TTL: past that, etcd may have expired its lease and elected
    someone else. :attr:`Election.is_leader` is false from that moment, whether or not
    etcd answers, so two conductors never both believe they lead (clocks are the local
    monotonic clock; etcd's own clock can only expire the lease *later* than that).
    When the lease is found gone, or the key holds another record, the candidate steps down
    and campaigns again with a fresh lease.

Contracts
    * etcd failures while running are logged and retried forever; the state callback
      (``on_change(leading: bool)``) tells the owner when leadership is won or lost.
      :meth:`start` raises MembershipError only if etcd cannot be reached at all at start.
    * asyncio only; one event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aetcd

from kvstore.errors import InvalidArgument, MembershipError
from kvstore.membership.etcd import DEFAULT_LAYOUT, KeyLayout, check_id, etcd_call, parse_host_port

log = logging.getLogger(__name__)

__all__ = ["Election", "LeaderRecord", "LeaderView", "read_leader"]


@dataclass(frozen=True, slots=True)
class LeaderRecord:
    """What a conductor publishes when it leads: who it is and where its gRPC service is."""

    conductor_id: str
    address: str
    """``host:port`` of the conductor's gRPC service."""

    def __post_init__(self) -> None:
        check_id("conductor_id", self.conductor_id)
        parse_host_port(self.address)

    def to_json(self) -> bytes:
        return json.dumps({"conductor_id": self.conductor_id, "address": self.address},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> LeaderRecord:
        """Parse a record; InvalidArgument when malformed."""
        try:
            doc = json.loads(data)
            return cls(conductor_id=doc["conductor_id"], address=doc["address"])
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"malformed conductor leader record {data[:200]!r}: {exc}"
                                  ) from exc


@dataclass(frozen=True, slots=True)
class LeaderView:
    """The leader as read from etcd: its record and the revision it was elected at (the term)."""

    record: LeaderRecord
    term: int


async def read_leader(client: aetcd.Client, *, layout: KeyLayout = DEFAULT_LAYOUT,
                      rpc_timeout_s: float = 2.0) -> LeaderView | None:
    """The current leader, or None when there is none (or its record is malformed, logged).

    Raises MembershipError when etcd cannot be reached.
    """
    kv = await etcd_call("read conductor leader", client.get(layout.conductor_leader_key.encode()),
                     rpc_timeout_s)
    if kv is None:
        return None
    try:
        return LeaderView(LeaderRecord.from_json(kv.value), int(kv.create_revision))
    except InvalidArgument as exc:
        log.warning("ignoring the conductor leader key: %s", exc)
        return None


class Election:
    """Campaign for leadership in the background; see the module docstring.

    Use ``async with Election(client, record, ttl_s=2) as election``; ``election.is_leader``
    is safe to read on every request (a float comparison). The constructor records
    settings only; nothing talks to etcd before :meth:`start`.
    """

    def __init__(self, client: aetcd.Client, record: LeaderRecord, *, ttl_s: int = 2,
                 layout: KeyLayout = DEFAULT_LAYOUT, poll_interval_s: float | None = None,
                 on_change: Callable[[bool], None] | None = None) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 2:
            raise InvalidArgument(f"ttl_s must be an int >= 2 seconds, got {ttl_s!r}")
        if not isinstance(record, LeaderRecord):
            raise InvalidArgument(f"record must be a LeaderRecord, got {type(record).__name__}")
        self._client = client
        self._record = record
        self._ttl_s = ttl_s
        self._key = layout.conductor_leader_key.encode()
        self._layout = layout
        self._refresh_interval_s = ttl_s / 3
        self._poll_interval_s = poll_interval_s if poll_interval_s is not None else ttl_s / 8
        if self._poll_interval_s <= 0:
            raise InvalidArgument(f"poll_interval_s must be positive, got {poll_interval_s}")
        self._rpc_timeout_s = self._refresh_interval_s
        self._on_change = on_change
        self._lease_id: int | None = None
        self._lease_confirmed_until = 0.0
        self._leading = False
        self._term = 0
        self._leader: LeaderView | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._changed = asyncio.Event()
        self.terms_won = 0

    # ------------------------------------------------------------------ view

    @property
    def record(self) -> LeaderRecord:
        return self._record

    @property
    def is_leader(self) -> bool:
        """True while this candidate leads AND its lease is confirmed alive (see Safety)."""
        return self._leading and time.monotonic() < self._lease_confirmed_until

    @property
    def term(self) -> int:
        """The etcd revision at which this candidate last won (0: never)."""
        return self._term

    @property
    def leader(self) -> LeaderView | None:
        """The leader as last seen from etcd (ourselves while leading); None: none known."""
        if self.is_leader:
            return LeaderView(self._record, self._term)
        return self._leader

    async def wait_leading(self) -> None:
        """Return once this candidate leads (bound it with ``asyncio.timeout``)."""
        while not self.is_leader:
            self._changed.clear()
            await self._changed.wait()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Grant our lease and make the first attempt; raises MembershipError if etcd is down."""
        if self._task is not None:
            raise MembershipError("this election was already started")
        await self._grant()
        await self._attempt()
        self._task = asyncio.get_running_loop().create_task(
            self._loop(), name=f"kvtier-election-{self._record.conductor_id}")

    async def resign(self) -> None:
        """Stop campaigning and revoke our lease: the leader key (if ours) vanishes at once."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task})
            self._task = None
        self._set_leading(False)
        lease_id, self._lease_id = self._lease_id, None
        if lease_id is not None:
            try:
                await etcd_call("revoke election lease", self._client.revoke_lease(lease_id),
                            self._rpc_timeout_s)
            except MembershipError as exc:
                log.warning("could not revoke election lease %x (%s); it expires in %d s",
                            lease_id, exc, self._ttl_s)

    async def __aenter__(self) -> Election:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.resign()

    # ------------------------------------------------------------------ steps

    async def _grant(self) -> None:
        sent_at = time.monotonic()
        lease = await etcd_call("grant election lease", self._client.lease(self._ttl_s),
                            self._rpc_timeout_s)
        self._lease_id = int(lease.id)
        self._lease_confirmed_until = sent_at + int(lease.ttl)

    async def _refresh(self) -> bool:
        """Refresh our lease; False when etcd no longer has it."""
        assert self._lease_id is not None
        sent_at = time.monotonic()
        reply: Any = await etcd_call("refresh election lease",
                                 self._client.refresh_lease(self._lease_id), self._rpc_timeout_s)
        if reply is None:
            raise MembershipError("refresh election lease: stream closed unanswered")
        if int(reply.TTL) <= 0:
            return False
        if self._leading and time.monotonic() >= self._lease_confirmed_until:
            # The answer came after leadership had lapsed (is_leader was already False):
            # report the lapse before extending, so the owner never misses one; the next
            # step finds the key still ours and leads again.
            log.warning("conductor %s: leadership lapsed before the lease was confirmed",
                        self._record.conductor_id)
            self._set_leading(False)
        self._lease_confirmed_until = sent_at + int(reply.TTL)
        return True

    async def _attempt(self) -> None:
        """Create the leader key under our lease if absent; learn who leads otherwise."""
        assert self._lease_id is not None
        client = self._client
        ok, responses = await etcd_call(
            "campaign",
            client.transaction(
                compare=[client.transactions.version(self._key) == 0],
                success=[client.transactions.put(self._key, self._record.to_json(),
                                                 lease=self._lease_id)],
                failure=[client.transactions.get(self._key)]),
            self._rpc_timeout_s)
        if ok:
            self._term = int(responses[0].response_put.header.revision)
            self._leader = LeaderView(self._record, self._term)
            self.terms_won += 1
            log.info("conductor %s leads (term %d)", self._record.conductor_id, self._term)
            self._set_leading(True)
            return
        existing = responses[0][0][1] if responses and responses[0] else None
        if existing is None:  # deleted between compare and get: the next poll will tell
            self._leader = None
            self._set_leading(False)
            return
        if int(existing.lease) == self._lease_id:  # our own earlier put whose answer was lost
            self._term = int(existing.create_revision)
            self._leader = LeaderView(self._record, self._term)
            self._set_leading(True)
            return
        try:
            self._leader = LeaderView(LeaderRecord.from_json(existing.value),
                                      int(existing.create_revision))
        except InvalidArgument as exc:
            log.warning("the leader key holds a malformed record: %s", exc)
            self._leader = None
        self._set_leading(False)

    async def _check_still_ours(self) -> None:
        """While leading: the key must still be ours (someone may have deleted it by hand)."""
        kv = await etcd_call("read leader key", self._client.get(self._key), self._rpc_timeout_s)
        if kv is None or int(kv.lease) != self._lease_id:
            log.warning("conductor %s: the leader key is no longer ours; campaigning again",
                        self._record.conductor_id)
            self._set_leading(False)

    async def _loop(self) -> None:
        next_refresh = time.monotonic() + self._refresh_interval_s
        failing = False
        while not self._closing:
            try:
                if self._lease_id is None:
                    await self._grant()
                    next_refresh = time.monotonic() + self._refresh_interval_s
                if time.monotonic() >= next_refresh:
                    if not await self._refresh():
                        log.warning("conductor %s: election lease expired",
                                    self._record.conductor_id)
                        self._lease_id = None
                        self._set_leading(False)
                        continue
                    next_refresh = time.monotonic() + self._refresh_interval_s
                if self._leading:
                    await self._check_still_ours()
                else:
                    await self._attempt()
                if failing:
                    log.info("conductor %s: etcd answers again", self._record.conductor_id)
                    failing = False
            except MembershipError as exc:
                if not failing:
                    log.warning("conductor %s: election step failed: %s",
                                self._record.conductor_id, exc)
                    failing = True
            # Leadership lapses by itself when the lease cannot be confirmed (is_leader);
            # tell the owner as soon as that happens.
            if self._leading and time.monotonic() >= self._lease_confirmed_until:
                log.warning("conductor %s: leadership unconfirmed for a whole TTL; stepping down",
                            self._record.conductor_id)
                self._set_leading(False)
            wait_s = self._refresh_interval_s if self._leading else self._poll_interval_s
            wait_s = max(0.0, min(wait_s, next_refresh - time.monotonic()))
            await asyncio.sleep(wait_s)

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        self._changed.set()
        if self._on_change is not None:
            try:
                self._on_change(leading)
            except Exception:
                log.exception("election on_change callback failed")


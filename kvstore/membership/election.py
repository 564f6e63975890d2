"""Conductor leader election through etcd: one leader, any number of standbys.

The leader key is ``<prefix>conductor/leader`` (:attr:`KeyLayout.conductor_leader_key`); its
value is a :class:`LeaderRecord` (JSON) attached to the leader's lease.

How it works
    Every candidate holds its own lease, refreshed every ``ttl_s / 3``. To become leader it
    runs one transaction: *if the key does not exist, put our record under our lease*. The
    one whose transaction succeeds leads; the others learn who leads from the same
    transaction's failure branch and try again every ``poll_interval_s``. When the leader
    dies its lease expires (``ttl_s`` plus etcd's ~0.5 s expiry tick), the key vanishes with
    it and the next standby's transaction wins, and acts one TTL later (the fence, below): a
    takeover within about ``2 * ttl_s + 1`` s. :meth:`Election.resign` says so in etcd and
    revokes the lease, so a clean exit hands over at once.

Safety
    A leader is only *sure* to lead until ``confirmed_until`` = (time it sent the last
    successful refresh) + TTL: past that, etcd may have expired its lease and elected
    someone else. :attr:`Election.is_leader` is false from that moment, whether or not
    etcd answers, so two conductors never both believe they lead (clocks are the local
    monotonic clock; etcd's own clock can only expire the lease *later* than that).
    Likewise the leader checks its key every ``poll_interval_s`` and leads only until TTL
    after the last check (sent time) that found the key holding its record under its lease.
    When the lease is found gone, or the key holds another candidate's record, the candidate
    steps down and campaigns again (with a fresh lease if the old one is gone).

The takeover fence (issue 16)
    Those clocks bound a leader whose lease *expires*; they cannot bound one whose lease etcd
    *revokes* early. etcd 3.4.23 does: a paused etcd leader, resumed, revokes every lease it
    thinks expired while it slept, through the new leader (etcd-io/etcd#15247, fixed by
    #16822), and a conductor that confirmed its lease and key a moment before decides on
    until its next check finds the key gone (``poll_interval_s``) while a standby has already
    won the next term (the fault suite's ``sigstop-etcd-leader`` caught one 60 ms into the
    new term). So a candidate that wins a **new term** does not act for one TTL: every
    confirmation the previous leader holds came from a request sent before its key vanished,
    so it stopped acting by then. The wait is skipped when etcd says nobody can be acting:
    the campaign transaction also reads and rewrites ``<prefix>conductor/term`` (under no
    lease), which names the lease that won the newest term, or says its leader resigned
    (:meth:`Election.resign` writes that, in the transaction that deletes the key, after
    it stopped acting). No record (a fresh cluster), a resignation, or a term of one of our
    own leases: no wait. Anything else (the previous leader's lease expired or was revoked,
    or its key was deleted by hand): the wait. A leader that re-confirms the term it holds
    (same create revision) never waits: nobody else can have led in between.

Healing (issue 12)
    A leader key that no live candidate owns must not block leadership forever. Candidates
    only ever *create* the key under their lease, so a key under no lease (written by hand,
    ``etcdctl put``) or holding no candidate's record is an *orphan*:

    * the leader whose key was overwritten in place (same create revision: its term), or
      whose key holds another value under its own lease, writes its record back in a
      compare-and-put on the key's mod revision: it keeps leading, in the same term;
    * a standby that finds an orphan waits until it has stayed unchanged (same mod revision)
      for a whole TTL, then deletes it in a compare-and-delete on that mod revision and
      campaigns. By then a live leader would have re-asserted it, and a leader that could
      not reach etcd has stopped leading by its own clock (both confirmations above), so
      clearing it never makes a second leader. A key deleted by hand is simply vacant: the
      first campaign to see it wins, and the old leader steps down at its next check
      (within ``poll_interval_s``), before the winner's fence ends.

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
from kvstore.membership.etcd import (
    DEFAULT_LAYOUT,
    KeyLayout,
    check_id,
    etcd_call,
    etcd_read,
    parse_host_port,
)

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


def _term_record(lease_id: int, conductor_id: str) -> bytes:
    """The ``conductor/term`` value a campaign that wins writes: whose lease won."""
    return json.dumps({"conductor_id": conductor_id, "lease": lease_id}, sort_keys=True).encode()


def _resigned_record(term: int, conductor_id: str) -> bytes:
    """The ``conductor/term`` value a resigning leader writes: nobody acts in ``term`` now."""
    return json.dumps({"conductor_id": conductor_id, "resigned": term}, sort_keys=True).encode()


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
    kv = await etcd_read("read conductor leader",
                         lambda: client.get(layout.conductor_leader_key.encode()), rpc_timeout_s)
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
                 on_change: Callable[[bool], None] | None = None,
                 on_etcd: Callable[[bool, float], None] | None = None) -> None:
        """Record settings only. ``on_change(leading)`` on every change of leadership;
        ``on_etcd(reachable, outage_s)``: ``(False, 0.0)`` when etcd stops answering, or is
        found to have expired our lease (the outage was long enough to expire leases), and
        ``(True, outage_s)`` when a step succeeds again after that; ``outage_s`` counts from
        the send time of the last successful step. Both run in the event loop; their
        exceptions are logged."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 2:
            raise InvalidArgument(f"ttl_s must be an int >= 2 seconds, got {ttl_s!r}")
        if not isinstance(record, LeaderRecord):
            raise InvalidArgument(f"record must be a LeaderRecord, got {type(record).__name__}")
        self._client = client
        self._record = record
        self._ttl_s = ttl_s
        self._key = layout.conductor_leader_key.encode()
        self._term_key = layout.conductor_term_key.encode()
        self._layout = layout
        self._refresh_interval_s = ttl_s / 3
        self._poll_interval_s = poll_interval_s if poll_interval_s is not None else ttl_s / 8
        if self._poll_interval_s <= 0:
            raise InvalidArgument(f"poll_interval_s must be positive, got {poll_interval_s}")
        self._rpc_timeout_s = self._refresh_interval_s
        self._on_change = on_change
        self._on_etcd = on_etcd
        self._last_ok_at = 0.0
        self._etcd_lost = False
        self._lease_id: int | None = None
        self._lease_confirmed_until = 0.0
        self._key_confirmed_until = 0.0
        """(send time of the last step that found the key holding our record) + TTL."""
        self._orphan: tuple[int, float] | None = None
        """(mod revision, first seen) of a leader key that no live candidate owns."""
        self._leading = False
        """We hold the key (in ``_term``); we act on it from ``_acting_from`` on."""
        self._acting = False
        """What ``on_change`` was last told."""
        self._acting_from = 0.0
        """Monotonic time before which a term won is not acted on (the takeover fence)."""
        self._own_leases: list[int] = []
        """Leases this candidate was granted (the newest few): a term one of them won was
        ours, and nobody else acted in it."""
        self.fence_s = float(ttl_s)
        """How long a new term waits before acting when etcd cannot tell that nobody else is
        acting (see the module docstring): one TTL, the longest a previous leader can hold a
        confirmation from before its key vanished."""
        self.fences = 0
        """Terms this candidate won and waited out the fence for."""
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
        """True while this candidate leads AND its lease is confirmed alive AND the leader key
        was seen holding our record within the last TTL (see Safety) AND a new term's fence
        is over (see "The takeover fence")."""
        now = time.monotonic()
        return self._leading and self._acting_from <= now < self._confirmed_until()

    def _confirmed_until(self) -> float:
        return min(self._lease_confirmed_until, self._key_confirmed_until)

    @property
    def term(self) -> int:
        """The etcd revision at which this candidate last won (0: never)."""
        return self._term

    @property
    def fenced_s(self) -> float:
        """Seconds until the term we hold may be acted on (0: none held, or already acting)."""
        return max(0.0, self._acting_from - time.monotonic()) if self._leading else 0.0

    @property
    def leader(self) -> LeaderView | None:
        """The leader as last seen from etcd (ourselves while leading, also while our new
        term's fence lasts); None: none known."""
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
        self._last_ok_at = time.monotonic()
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
        held = self._term if self._leading else 0
        self._set_leading(False)
        if held:  # we act no more: say so where the next winner looks (no fence for it)
            await self._say_resigned(held)
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

    async def _say_resigned(self, term: int) -> None:
        """Delete the leader key of ``term`` if it still holds our record, and write in the
        same transaction that ``term`` resigned."""
        client = self._client
        try:
            done, _ = await etcd_call(
                "resign leadership",
                client.transaction(
                    compare=[client.transactions.create(self._key) == term,
                             client.transactions.value(self._key) == self._record.to_json()],
                    success=[client.transactions.delete(self._key),
                             client.transactions.put(
                                 self._term_key,
                                 _resigned_record(term, self._record.conductor_id))],
                    failure=[]),
                self._rpc_timeout_s)
        except MembershipError as exc:
            log.warning("conductor %s could not record its resignation (%s); the next leader "
                        "waits %.1f s before acting", self._record.conductor_id, exc,
                        self.fence_s)
            return
        if not done:
            log.info("conductor %s: the leader key of term %d was no longer ours at "
                     "resignation", self._record.conductor_id, term)

    # ------------------------------------------------------------------ steps

    async def _grant(self) -> None:
        sent_at = time.monotonic()
        lease = await etcd_call("grant election lease", self._client.lease(self._ttl_s),
                            self._rpc_timeout_s)
        self._lease_id = int(lease.id)
        self._own_leases = [*self._own_leases[-7:], self._lease_id]
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
        if self._leading and time.monotonic() >= self._confirmed_until():
            # The answer came after leadership had lapsed (is_leader was already False):
            # report the lapse before extending, so the owner never misses one; the next
            # step finds the key still ours and leads again.
            log.warning("conductor %s: leadership lapsed before the lease was confirmed",
                        self._record.conductor_id)
            self._set_leading(False)
        self._lease_confirmed_until = sent_at + int(reply.TTL)
        return True

    async def _attempt(self) -> None:
        """Create the leader key under our lease if absent; judge what holds it otherwise."""
        assert self._lease_id is not None
        client = self._client
        sent_at = time.monotonic()
        ok, responses = await etcd_call(
            "campaign",
            client.transaction(
                compare=[client.transactions.version(self._key) == 0],
                success=[client.transactions.put(self._key, self._record.to_json(),
                                                 lease=self._lease_id),
                         client.transactions.get(self._term_key),
                         client.transactions.put(
                             self._term_key,
                             _term_record(self._lease_id, self._record.conductor_id))],
                failure=[client.transactions.get(self._key)]),
            self._rpc_timeout_s)
        if ok:
            won_at = time.monotonic()
            previous = responses[1][0][0] if len(responses) > 1 and responses[1] else None
            why = self._fence_reason(previous)
            self._win(int(responses[0].response_put.header.revision), sent_at,
                      fence_until=won_at + self.fence_s if why else 0.0)
            self.terms_won += 1
            if why:
                self.fences += 1
                log.info("conductor %s leads (term %d), acting in %.1f s: %s",
                         self._record.conductor_id, self._term, self.fence_s, why)
            else:
                log.info("conductor %s leads (term %d)", self._record.conductor_id, self._term)
            return
        existing = responses[0][0][1] if responses and responses[0] else None
        if existing is None:  # deleted between compare and get: the next poll will tell
            if self._leading:
                log.warning("conductor %s: the leader key vanished during a campaign",
                            self._record.conductor_id)
            self._leader = None
            self._set_leading(False)
            return
        await self._judge(existing, sent_at)

    async def _check_still_ours(self) -> None:
        """While leading: the key must still hold our record under our lease."""
        sent_at = time.monotonic()
        kv = await etcd_call("read leader key", self._client.get(self._key), self._rpc_timeout_s)
        if kv is None:  # deleted by hand: campaign at once (a standby may win first)
            log.warning("conductor %s: the leader key was deleted; campaigning again",
                        self._record.conductor_id)
            self._set_leading(False)
            await self._attempt()
            return
        await self._judge(kv, sent_at)

    def _fence_reason(self, previous: bytes | None) -> str:
        """Why a term just won must wait before acting ("": it need not), from what
        ``conductor/term`` held before our campaign rewrote it."""
        if previous is None:
            return ""  # no conductor ever led under this prefix
        try:
            doc = json.loads(previous)
            if "resigned" in doc:
                return ""
            if int(doc["lease"]) in self._own_leases:
                return ""  # our own earlier term: nobody else acted in it
            holder = str(doc["conductor_id"])
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
            return f"the term record {previous[:100]!r} is not one a candidate writes"
        return (f"{holder}'s term ended without a resignation (its lease expired or was "
                f"revoked); it may act until then")

    def _win(self, term: int, sent_at: float, *, fence_until: float = 0.0) -> None:
        """We hold the key in ``term``; a new term (``fence_until`` 0: one that needs no
        fence) starts acting at ``fence_until``."""
        if term != self._term:
            self._set_leading(False)  # our old term, if any, is over
            self._acting_from = fence_until
        self._term = term
        self._leader = LeaderView(self._record, term)
        self._key_confirmed_until = sent_at + self._ttl_s
        self._orphan = None
        self._set_leading(True)

    async def _judge(self, kv: Any, sent_at: float) -> None:
        """Act on what holds the leader key (read at ``sent_at``): ours, another candidate's,
        or an orphan that no live candidate owns (see "Healing" in the module docstring)."""
        holder = int(kv.lease)
        record: LeaderRecord | None = None
        try:
            record = LeaderRecord.from_json(kv.value)
        except InvalidArgument as exc:
            log.debug("the leader key holds no candidate's record: %s", exc)
        if holder == self._lease_id:
            if kv.value == self._record.to_json():  # ours (perhaps a put whose answer was lost)
                term = int(kv.create_revision)
                # A term we did not see won (its answer was lost): whoever led before may
                # still act for a TTL (we cannot tell who it was any more).
                self._win(term, sent_at, fence_until=0.0 if term == self._term
                          else time.monotonic() + self.fence_s)
            else:
                await self._reassert(kv, "overwritten under our lease")
            return
        if holder != 0 and record is not None:  # another candidate leads
            if self._leading:
                log.warning("conductor %s: the leader key is no longer ours (%s leads); "
                            "campaigning again", self._record.conductor_id, record.conductor_id)
            self._orphan = None
            self._leader = LeaderView(record, int(kv.create_revision))
            self._set_leading(False)
            return
        # An orphan: under no lease (written by hand), or not a candidate's record.
        if self._leading and int(kv.create_revision) == self._term:
            await self._reassert(kv, "overwritten by someone else")
            return
        self._set_leading(False)
        self._leader = None
        mod_revision = int(kv.mod_revision)
        now = time.monotonic()
        if self._orphan is None or self._orphan[0] != mod_revision:
            self._orphan = (mod_revision, now)
            log.warning("conductor %s: the leader key holds %s that no live candidate owns "
                        "(lease %x); clearing it if it stays so for %d s",
                        self._record.conductor_id,
                        "no candidate's record" if record is None else f"{record!r}", holder,
                        self._ttl_s)
            return
        if now - self._orphan[1] < self._ttl_s:
            return
        # Unchanged for a whole TTL: a live leader would have re-asserted it (it checks every
        # poll), and one that could not has stopped leading (is_leader) by now.
        client = self._client
        cleared, _ = await etcd_call(
            "clear orphaned leader key",
            client.transaction(compare=[client.transactions.mod(self._key) == mod_revision],
                               success=[client.transactions.delete(self._key)], failure=[]),
            self._rpc_timeout_s)
        self._orphan = None
        if cleared:
            log.warning("conductor %s: cleared the orphaned leader key; campaigning",
                        self._record.conductor_id)
            await self._attempt()

    async def _reassert(self, kv: Any, why: str) -> None:
        """Write our record back over the key we still lead by, unless it changed since read."""
        assert self._lease_id is not None
        client = self._client
        sent_at = time.monotonic()
        ok, _ = await etcd_call(
            "re-assert leadership",
            client.transaction(
                compare=[client.transactions.mod(self._key) == int(kv.mod_revision)],
                success=[client.transactions.put(self._key, self._record.to_json(),
                                                 lease=self._lease_id)],
                failure=[]),
            self._rpc_timeout_s)
        if ok:  # a put over an existing key keeps its create revision: the term is unchanged
            log.warning("conductor %s: the leader key was %s; wrote our record back (term %d)",
                        self._record.conductor_id, why, int(kv.create_revision))
            self._win(int(kv.create_revision), sent_at)
        else:  # changed again since we read it: the next step judges it afresh
            log.warning("conductor %s: the leader key changed while we re-asserted it; "
                        "judging it again", self._record.conductor_id)
            self._set_leading(False)

    async def _loop(self) -> None:
        next_refresh = time.monotonic() + self._refresh_interval_s
        failing = False
        while not self._closing:
            step_at = time.monotonic()
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
                        self._note_etcd(False)
                        continue
                    next_refresh = time.monotonic() + self._refresh_interval_s
                if self._leading:
                    await self._check_still_ours()
                else:
                    await self._attempt()
                if failing:
                    log.info("conductor %s: etcd answers again", self._record.conductor_id)
                    failing = False
                self._note_etcd(True, step_at)
            except MembershipError as exc:
                if not failing:
                    log.warning("conductor %s: election step failed: %s",
                                self._record.conductor_id, exc)
                    failing = True
                self._note_etcd(False)
            # Leadership lapses by itself when the lease cannot be confirmed (is_leader);
            # tell the owner as soon as that happens.
            if self._leading and time.monotonic() >= self._confirmed_until():
                log.warning("conductor %s: leadership unconfirmed for a whole TTL; stepping down",
                            self._record.conductor_id)
                self._set_leading(False)
            # The leader checks its key as often as standbys campaign, so a key overwritten
            # by hand is re-asserted long before a standby would clear it (one TTL).
            now = time.monotonic()
            wait_s = min(self._poll_interval_s, next_refresh - now)
            if self._leading and not self._acting:
                wait_s = min(wait_s, self._acting_from - now)
            await asyncio.sleep(max(0.0, wait_s))
            self._update_acting()

    def _note_etcd(self, ok: bool, step_at: float = 0.0) -> None:
        """Tell ``on_etcd`` when etcd is lost and when it answers again (see __init__)."""
        if ok:
            lost, self._etcd_lost = self._etcd_lost, False
            outage_s = max(0.0, step_at - self._last_ok_at)
            self._last_ok_at = step_at
            if not lost:
                return
        elif self._etcd_lost:
            return
        else:
            self._etcd_lost = True
            outage_s = 0.0
        if self._on_etcd is not None:
            try:
                self._on_etcd(ok, outage_s)
            except Exception:
                log.exception("election on_etcd callback failed")

    def _set_leading(self, leading: bool) -> None:
        self._leading = leading
        self._update_acting()

    def _update_acting(self) -> None:
        """Tell the owner when acting starts (a won term past its fence) or stops."""
        acting = self._leading and time.monotonic() >= self._acting_from
        if acting == self._acting:
            return
        self._acting = acting
        self._changed.set()
        if self._on_change is not None:
            try:
                self._on_change(acting)
            except Exception:
                log.exception("election on_change callback failed")


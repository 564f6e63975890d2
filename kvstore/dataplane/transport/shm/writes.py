"""Batch puts whose bytes the caller writes itself: reserve, write into the arena, commit.

``put_many`` copies values the caller already holds into reserved arena ranges. An engine that
saves its KV can skip that copy: it reserves a step's chunks first, has its layout write each
layer straight into the reserved ranges while later layers compute, then commits (one copy per
byte instead of two: docs/transport.md, "Writes into reserved ranges").

:class:`ShmWriter` holds one lease-channel connection for a client's successive batches, so a
batch may name as parents the still-open reservations of an earlier batch (an engine's next step
saves children of this step's blocks before this step's commit): the daemon accepts a parent
reserved by the same connection and checks it when the child is committed, which must then come
after the parent's commit (a child whose parent was aborted or failed is aborted). Every
exchange holds the writer's lock; requests go in the order the callers make them.

Deadlines. A reservation lasts ``ttl_s`` from when it was asked for; past that the daemon may
reuse the memory for another chunk, so a write that ran late could change another chunk's
bytes. :attr:`ShmBatchWrite.writable` is true only in the first half of the TTL, and a caller
must ask it before each write (a write is a few milliseconds; a margin of half the TTL, 30 s
by default, is what "late" would need to exceed). A batch past its deadline is aborted, never
committed.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.dataplane.tier import check_key
from kvstore.dataplane.transport.shm.channel import ChannelClosed, LeaseChannel
from kvstore.dataplane.transport.shm.frames import (
    FLAG_NO_REPLY,
    FLAG_PARENTS,
    ITEM_EXISTS,
    ITEM_STORED,
    ChannelOp,
    item_error,
    key_parent_pairs,
)
from kvstore.errors import InvalidArgument, KvtierError, PeerUnavailable, TransportError

if TYPE_CHECKING:
    from kvstore.dataplane.transport.shm.client import ShmClient

__all__ = ["ShmBatchWrite", "ShmWriter"]

WRITE_TTL_S = 60.0
"""TTL of a writer's reservations when the client's ``lease_ttl_s`` is 0."""

_PART_KEYS = 256
"""Items per RESERVE_MANY request (all parts are sent before the first reply is read)."""


class ShmWriter:
    """One connection for a client's successive batch writes (module docstring). Made by
    :meth:`ShmClient.open_writer`; :meth:`close` ends every reservation still open."""

    def __init__(self, client: ShmClient, ttl_s: float) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._chan: LeaseChannel | None = None
        self._generation = 0  # bumped when the connection is replaced: its reservations died
        self._open = 0  # reservations open on the current connection
        self._closed = False

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int],
                parents: Sequence[bytes | None]) -> ShmBatchWrite:
        """Reserve ``keys[i]`` (``sizes[i]`` bytes, a child of ``parents[i]``) in order, in one
        exchange. Per item: reserved, already stored, or refused (its children in the batch
        are refused too); see :class:`ShmBatchWrite`. Raises InvalidArgument (lengths differ,
        a bad key, a size < 1) before anything is sent, PeerUnavailable."""
        n = len(keys)
        if len(sizes) != n or len(parents) != n:
            raise InvalidArgument(f"{n} keys, {len(sizes)} sizes, {len(parents)} parents")
        checked: list[bytes] = [check_key(k) for k in keys]
        pars: list[bytes | None] = [None if p is None else check_key(p) for p in parents]
        if any(s < 1 for s in sizes):
            raise InvalidArgument("cannot reserve an empty chunk")
        with self._lock:
            if self._closed:
                raise PeerUnavailable("the writer is closed")
            t_asked = time.monotonic()
            replies = self._exchange(checked, pars, list(sizes))
            generation = self._generation
            outcome: list[bool | None] = [None] * n
            ranges: list[tuple[int, int] | None] = [None] * n
            ids = [0] * n
            first: KvtierError | None = None
            for (a, b), (detail, got) in replies:
                first = first or item_error(detail, b - a)
                for k, (offset, lease_id) in enumerate(got):
                    i = a + k
                    if lease_id:
                        outcome[i], ranges[i], ids[i] = True, (offset, sizes[i]), lease_id
                    elif detail[k] == ITEM_EXISTS:
                        outcome[i] = False
            self._open += sum(1 for i in ids if i)
        return ShmBatchWrite(self, generation, outcome, ranges, ids, first,
                             t_asked + self._ttl_s)

    def _exchange(self, keys: list[bytes], parents: list[bytes | None], sizes: list[int]
                  ) -> list[tuple[tuple[int, int], tuple[bytes, list[tuple[int, int]]]]]:
        """Send every RESERVE_MANY part, then read their replies (caller holds the lock). A
        connection found closed before the first reply while it held nothing is replaced and
        the parts sent again (the peer read none of them)."""
        parts = [(a, min(a + _PART_KEYS, len(keys))) for a in range(0, len(keys), _PART_KEYS)]
        for attempt in range(2):
            chan = self._channel()
            try:
                for a, b in parts:
                    packed = struct.pack(f"<{b - a}Q", *sizes[a:b])
                    chan.send(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS,
                              keys=key_parent_pairs(keys[a:b], parents[a:b]), arg=len(packed),
                              ttl_s=self._ttl_s, payload=memoryview(packed))
                out = []
                for part in parts:
                    _lease_id, got = chan.recv_reply()
                    out.append((part, (chan.detail, got)))
                return out
            except ChannelClosed as exc:
                if attempt or self._open:
                    self._drop()
                    raise PeerUnavailable("the lease channel closed under open "
                                          "reservations") from exc
                self._drop()
            except TransportError:
                self._drop()
                raise
        raise AssertionError("unreachable")

    def _channel(self) -> LeaseChannel:
        """The writer's connection (a new one when it has none). One that holds no reservation
        may have been closed by the peer as idle: marked so that its first request says so."""
        if self._chan is None or self._chan.broken:
            if self._chan is not None:
                self._drop()
            self._chan = self._client._new_channel()
        else:
            self._chan.may_be_stale = self._open == 0
        return self._chan

    def _drop(self) -> None:
        """The connection is out of step or gone: close it (the daemon ends what it held)."""
        chan, self._chan = self._chan, None
        if chan is not None:
            chan.broken = True
            self._client._checkin(chan)
        self._generation += 1
        self._open = 0

    def _end(self, batch: ShmBatchWrite, commit: list[int], abort: list[int]
             ) -> tuple[bytes, int]:
        """COMMIT_MANY the lease ids ``commit`` (in order) and ABORT ``abort`` (not waited for):
        the commit's per-id status bytes (empty when nothing was committed). Raises
        PeerUnavailable when the connection that holds them is gone."""
        with self._lock:
            if batch._generation != self._generation or self._chan is None:
                raise PeerUnavailable("the connection that held these reservations closed "
                                      "(they ended with it)")
            chan = self._chan
            try:
                for lease_id in abort:
                    chan.send(ChannelOp.ABORT, flags=FLAG_NO_REPLY, arg=lease_id)
                detail = b""
                if commit:
                    packed = struct.pack(f"<{len(commit)}Q", *commit)
                    chan.call(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(packed),
                              payload=memoryview(packed))
                    detail = chan.detail
            except TransportError:
                self._drop()
                raise
            self._open -= len(commit) + len(abort)
            return detail, len(commit)

    def close(self) -> None:
        """Close the connection: the daemon ends every reservation still open on it."""
        with self._lock:
            self._closed = True
            self._drop()


class ShmBatchWrite:
    """One batch's reservations (:meth:`ShmWriter.reserve`).

    ``outcome[i]``: True reserved (until committed), False already stored (nothing to write),
    None refused (``refusal`` is the first such error). ``tensors`` views the reserved ranges
    for the caller to fill; ask :attr:`writable` before each write. :meth:`commit` publishes
    what was reserved (aborting what the caller asks to skip); :meth:`abort` ends it all.
    Either is final. One thread at a time."""

    __slots__ = ("_done", "_generation", "_ids", "_writer", "deadline_s", "outcome", "ranges",
                 "refusal")

    def __init__(self, writer: ShmWriter, generation: int, outcome: list[bool | None],
                 ranges: list[tuple[int, int] | None], ids: list[int],
                 refusal: KvtierError | None, deadline_s: float) -> None:
        self._writer = writer
        self._generation = generation
        self.outcome = outcome
        self.ranges = ranges
        self._ids = ids
        self.refusal = refusal
        self.deadline_s = deadline_s
        """When the reservations end (``time.monotonic()``)."""
        self._done = False

    @property
    def writable(self) -> bool:
        """Whether a write may start now: in the first half of the reservations' TTL."""
        return not self._done and \
            time.monotonic() < self.deadline_s - self._writer.ttl_s / 2

    def tensors(self, dtype: Any, shape: tuple[int, ...]) -> list[Any]:
        """Writable torch views (``shape`` of ``dtype``) of the reserved ranges, None where an
        item is not reserved. Raises SizeMismatch when a range is not that size."""
        reserved = [r for r in self.ranges if r is not None]
        views = iter(self._writer._client._arena_tensors(reserved, dtype, shape))
        return [None if r is None else next(views) for r in self.ranges]

    def commit(self, skip: Collection[int] = ()) -> list[bool | None]:
        """Publish every reserved item but those at the indices ``skip`` (aborted), in order:
        the outcome per item, True stored, False already stored, None not stored (refused,
        skipped, or a commit that failed: a child of an item not stored, a reservation past
        its deadline); ``refusal`` is then the first failure. Raises PeerUnavailable when the
        connection died (nothing of the batch was stored), InvalidArgument past the
        deadline's margin (:attr:`writable` false: the batch is aborted instead)."""
        if self._done:
            raise InvalidArgument("this batch was committed or aborted already")
        if time.monotonic() >= self.deadline_s - self._writer.ttl_s / 2:
            self.abort()
            raise InvalidArgument("the batch's reservations are past their margin: aborted, "
                                  "not committed (a late write may have missed them)")
        self._done = True
        items = [i for i, lease_id in enumerate(self._ids) if lease_id and i not in skip]
        dropped = [i for i, lease_id in enumerate(self._ids) if lease_id and i in skip]
        try:
            detail, n = self._writer._end(self, [self._ids[i] for i in items],
                                          [self._ids[i] for i in dropped])
        except KvtierError:
            for i in items + dropped:
                self.outcome[i] = None
            raise
        for i in dropped:
            self.outcome[i] = None
        for k, i in enumerate(items):
            if detail[k] != ITEM_STORED:
                self.outcome[i] = None
        self.refusal = self.refusal or item_error(detail, n)
        return self.outcome

    def abort(self) -> None:
        """End every reservation of the batch (nothing of it becomes visible)."""
        if self._done:
            return
        self._done = True
        ids = [lease_id for lease_id in self._ids if lease_id]
        for i, lease_id in enumerate(self._ids):
            if lease_id:
                self.outcome[i] = None
        if ids:
            with contextlib.suppress(KvtierError):  # the connection is gone: they ended with it
                self._writer._end(self, [], ids)

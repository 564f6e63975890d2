"""Chunk events with sequence numbers, for a conductor's global index.

Every chunk the daemon's cache stores, moves between tiers or removes becomes one
:class:`ChunkEvent` with the next sequence number (1, 2, 3...). The last ``capacity`` events
stay in a ring. A subscriber remembers the last seq it applied and asks for what follows:

* the events after it, when they are all still in the ring;
* :class:`Resync`, when some were overwritten (it fell too far behind), when it names a seq
  this log never issued, or when it names another *epoch*. Every daemon start draws a new
  epoch id and starts again at seq 1, so a seq from before a restart means nothing now.
  After a Resync the subscriber fetches a snapshot (every chunk and the seq it reflects)
  and continues from that seq. Applying an event that a snapshot already reflects must be
  harmless (STORED of a known key, REMOVED of an unknown key): snapshot and seq are not
  taken atomically with respect to changes in flight.

Recovery at start-up emits STORED for every chunk found on NVMe, so replaying a fresh
epoch from seq 0 (while the ring still holds it) rebuilds the same index a snapshot would.

Thread safety: :meth:`EventLog.record` may be called from any thread (the cache calls it in
the thread that made the change); it never blocks on a subscriber. Async subscribers wait
with :meth:`EventLog.wait_beyond`, which is woken thread-safely through their event loop.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from kvstore.node.cache import ChunkChange, ChunkChangeKind

EventKind = ChunkChangeKind
"""STORED, REMOVED or MOVED (the cache's change kinds)."""


@dataclass(slots=True)  # (not frozen: built per chunk stored; see ChunkChange)
class ChunkEvent:
    seq: int
    kind: EventKind
    key: bytes
    tier: TierKind
    """The chunk's fastest copy. STORED: where it was stored; REMOVED: where it was removed from
    (every copy goes); MOVED: where it is now. A chunk may also keep a slower NVMe copy (a
    promotion copies, a durable put writes through): adding or dropping that copy alone is no
    event, since the fastest copy did not change."""
    size_bytes: int
    parent: bytes | None = None
    from_tier: TierKind | None = None
    tenant: str | None = None
    """STORED: the chunk's owner (sent to the conductor, whose index keeps chunks per tenant);
    None on the other kinds."""


@dataclass(frozen=True, slots=True)
class Resync:
    """The requested events are not available: take a snapshot, then continue from its seq."""

    last_seq: int
    reason: str


def new_epoch() -> str:
    """A fresh epoch id: 16 hex digits, different at every daemon start."""
    return secrets.token_hex(8)


class EventLog:
    """A bounded ring of chunk events. See the module docstring. No side effects on creation."""

    def __init__(self, capacity: int, *, epoch: str | None = None) -> None:
        if not isinstance(capacity, int) or capacity < 1:
            raise InvalidArgument(f"event ring capacity must be a positive int, got {capacity!r}")
        self._capacity = capacity
        self._epoch = epoch or new_epoch()
        self._ring: list[ChunkEvent | None] = [None] * capacity
        self._last_seq = 0
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def epoch(self) -> str:
        return self._epoch

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def last_seq(self) -> int:
        """The seq of the newest event (0 before the first)."""
        return self._last_seq

    @property
    def oldest_seq(self) -> int:
        """The seq of the oldest event still held (``last_seq + 1`` when none is)."""
        with self._lock:
            return self._oldest_locked()

    def _oldest_locked(self) -> int:
        return max(1, self._last_seq - self._capacity + 1) if self._last_seq else 1

    def record(self, change: ChunkChange) -> int:
        """Append one change as the next event; return its seq. Usable as a cache observer."""
        with self._lock:
            self._last_seq += 1
            seq = self._last_seq
            self._ring[seq % self._capacity] = ChunkEvent(
                seq, change.kind, change.key, change.tier, change.size_bytes, change.parent,
                change.from_tier, change.tenant)
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)
        return seq

    def record_many(self, changes: Sequence[ChunkChange]) -> int:
        """:meth:`record` each change, in order, in one lock round (and one wake-up of the
        waiters); return the last seq (``last_seq`` for none). Usable as a cache's
        ``observe_many``."""
        if not changes:
            return self._last_seq
        with self._lock:
            ring, capacity, seq = self._ring, self._capacity, self._last_seq
            for change in changes:
                seq += 1
                ring[seq % capacity] = ChunkEvent(
                    seq, change.kind, change.key, change.tier, change.size_bytes, change.parent,
                    change.from_tier, change.tenant)
            self._last_seq = seq
            waiters, self._waiters = self._waiters, []
        for loop, event in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(event.set)
        return seq

    def since(self, after_seq: int, *, epoch: str | None = None,
              limit: int = 1024) -> list[ChunkEvent] | Resync:
        """Up to ``limit`` events with seq > ``after_seq``, oldest first (empty: none yet).

        ``epoch`` is the epoch ``after_seq`` belongs to (None: this one). Returns Resync when
        it is another epoch, when ``after_seq`` was never issued, or when events after it
        were overwritten.
        """
        if after_seq < 0:
            raise InvalidArgument(f"after_seq must be >= 0, got {after_seq}")
        if limit < 1:
            raise InvalidArgument(f"limit must be >= 1, got {limit}")
        with self._lock:
            last = self._last_seq
            if epoch is not None and epoch != self._epoch:
                return Resync(last, f"epoch {epoch} is over; this daemon runs epoch {self._epoch}")
            if after_seq > last:
                return Resync(last, f"seq {after_seq} was never issued (last is {last})")
            oldest = self._oldest_locked()
            if after_seq + 1 < oldest:
                return Resync(last, f"events {after_seq + 1}..{oldest - 1} were overwritten "
                                    f"(the ring holds {self._capacity})")
            end = min(last, after_seq + limit)
            out: list[ChunkEvent] = []
            for seq in range(after_seq + 1, end + 1):
                event = self._ring[seq % self._capacity]
                assert event is not None and event.seq == seq
                out.append(event)
            return out

    async def wait_beyond(self, after_seq: int, timeout_s: float | None = None) -> bool:
        """Wait until an event with seq > ``after_seq`` exists; False on timeout."""
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            if self._last_seq > after_seq:
                return True
            self._waiters.append((loop, event))
        try:
            async with asyncio.timeout(timeout_s):
                await event.wait()
        except TimeoutError:
            with self._lock:
                if (loop, event) in self._waiters:
                    self._waiters.remove((loop, event))
            return self._last_seq > after_seq
        return True

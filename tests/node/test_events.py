"""The event ring: sequence numbers, replay from a seq, resync after a gap or another epoch."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from kvstore.node.cache import ChunkChange, ChunkChangeKind
from kvstore.node.events import EventLog, Resync


def stored(i: int) -> ChunkChange:
    return ChunkChange(ChunkChangeKind.STORED, b"k%d" % i, TierKind.DRAM, 10)


def test_seqs_start_at_one_and_replay_returns_what_follows() -> None:
    log = EventLog(8, epoch="e1")
    assert log.since(0) == []
    for i in range(5):
        assert log.record(stored(i)) == i + 1
    events = log.since(2)
    assert isinstance(events, list)
    assert [e.seq for e in events] == [3, 4, 5]
    assert [e.key for e in events] == [b"k2", b"k3", b"k4"]
    assert log.since(5) == []
    assert [e.seq for e in log.since(0, limit=2)] == [1, 2]  # type: ignore[union-attr]


def test_a_subscriber_older_than_the_ring_must_resync() -> None:
    log = EventLog(4)
    for i in range(10):
        log.record(stored(i))
    assert log.oldest_seq == 7
    assert [e.seq for e in log.since(6)] == [7, 8, 9, 10]  # type: ignore[union-attr]
    gap = log.since(5)
    assert isinstance(gap, Resync) and gap.last_seq == 10 and "overwritten" in gap.reason


def test_another_epoch_or_a_future_seq_must_resync() -> None:
    log = EventLog(4, epoch="now")
    log.record(stored(0))
    assert isinstance(log.since(0, epoch="before-restart"), Resync)
    assert isinstance(log.since(7), Resync)
    assert log.since(0, epoch="now") != []
    with pytest.raises(InvalidArgument):
        log.since(-1)
    assert EventLog(1).epoch != EventLog(1).epoch


def test_waiters_are_woken_from_another_thread() -> None:
    log = EventLog(4)

    async def scenario() -> tuple[bool, bool]:
        timed_out = await log.wait_beyond(0, timeout_s=0.05)
        threading.Timer(0.05, log.record, args=(stored(1),)).start()
        woken = await log.wait_beyond(0, timeout_s=10)
        return timed_out, woken

    assert asyncio.run(scenario()) == (False, True)

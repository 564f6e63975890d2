"""The history checker of the fault suite on hand-built histories: one clean, and one that breaks
each invariant (so every check can fail)."""

from __future__ import annotations

import pytest

from kvstore.cluster.chaos_check import (
    Fault,
    History,
    Invariant,
    LeaseGap,
    Op,
    Record,
    Removal,
    Restart,
    Result,
    Violation,
    check,
    chunk_value,
    digest,
    durable_unverified,
    engine_reuse,
    engine_stats,
    expected_digest,
    fault_stats,
    tokens_digest,
)
from kvstore.errors import InvalidArgument

SIZE = 4096


def put(key: str, node: str, start: float, end: float | None, *, version: int = 0,
        result: Result = Result.OK, durable: bool = False) -> Record:
    return Record(Op.PUT, key, node, start, end, result, version=version, size_bytes=SIZE,
                  durable=durable)


def get(key: str, node: str, start: float, end: float | None, *, version: int = 0,
        result: Result = Result.OK, data: bytes | None = None) -> Record:
    d = None
    if result is Result.OK:
        d = digest(data if data is not None else chunk_value(key, version, SIZE))
    return Record(Op.GET, key, node, start, end, result, digest=d)


def clean() -> History:
    """Two nodes; n0 is killed at 10 and back at 12; its durable chunk is read back after."""
    return History(
        records=[
            Record(Op.SCHEDULE, "a", "n0", 1.0, 1.0, Result.OK),
            put("a", "n0", 1.0, 1.1, durable=True),
            get("a", "n0", 2.0, 2.1),
            put("b", "n1", 3.0, 3.1, version=2),
            put("b", "n1", 3.5, None, version=3),           # in flight: a get may see it
            get("b", "n1", 4.0, 4.1, version=3),
            get("b", "n1", 4.2, 4.3, version=2),
            put("c", "n0", 9.9, 10.2, result=Result.ERR),   # lost with the kill: fine
            get("c", "n0", 12.5, 12.6, result=Result.ABSENT),
            put("d", "n1", 10.5, 10.6),                     # progress during the fault
            get("x", "n1", 11.0, 11.1, result=Result.ERR),
            get("a", "n0", 12.5, 12.6),                     # durable chunk survived
            Record(Op.SCHEDULE, "e", "n1", 10.5, 10.5, Result.OK),
            Record(Op.SCHEDULE, "f", "n0", 11.0, 11.0, Result.OK),  # within the grace
            Record(Op.SCHEDULE, "g", "n0", 13.0, 13.0, Result.OK),  # registered again
            Record(Op.LEASE, "leader", "c0", 0.0, 9.0, Result.OK, epoch=1),
            Record(Op.LEASE, "leader", "c0", 9.0, 14.0, Result.OK, epoch=1),
            Record(Op.LEASE, "leader", "c1", 14.0, 15.0, Result.OK, epoch=2),
        ],
        faults=[Fault("kill-daemon", "n0", 10.0, 12.0)],
        restarts=[Restart("n0", 10.0, 12.0)],
        lease_gaps=[LeaseGap("n0", 10.8, 12.4)],
    )


def broken(history: History, *extra: Record) -> list[Violation]:
    history.records.extend(extra)
    return check(history)


def test_a_clean_history_passes() -> None:
    history = clean()
    assert check(history) == []
    assert durable_unverified(history) == 0
    [stats] = fault_stats(history)
    assert (stats.attempted, stats.completed, stats.failed) == (2, 1, 1)


def test_a_read_of_bytes_no_put_wrote_is_wrong() -> None:
    bad = get("a", "n0", 5.0, 5.1, data=chunk_value("a", 1, SIZE))  # a version never put
    [v] = broken(clean(), bad)
    assert v.invariant is Invariant.WRONG_READ and v.record == bad


def test_a_torn_read_is_wrong() -> None:
    torn = bytearray(chunk_value("a", 0, SIZE))
    torn[SIZE // 2] ^= 1
    [v] = broken(clean(), get("a", "n0", 5.0, 5.1, data=bytes(torn)))
    assert v.invariant is Invariant.WRONG_READ


def test_a_read_of_a_version_put_after_the_read_ended_is_wrong() -> None:
    [v] = broken(clean(), get("b", "n1", 3.2, 3.3, version=3))  # put of v3 starts at 3.5
    assert v.invariant is Invariant.WRONG_READ


def test_bytes_served_by_a_node_they_were_never_put_to_are_wrong() -> None:
    [v] = broken(clean(), get("a", "n1", 5.0, 5.1))
    assert v.invariant is Invariant.WRONG_READ and "no put of it reached" in v.message


def test_a_durable_chunk_missing_after_the_restart_is_lost() -> None:
    history = clean()
    history.records.append(put("h", "n0", 5.0, 5.1, durable=True))
    assert durable_unverified(history) == 1
    lost = get("h", "n0", 13.0, 13.1, result=Result.ABSENT)
    [v] = broken(history, lost)
    assert v.invariant is Invariant.DURABLE_LOST and v.record == lost
    assert durable_unverified(history) == 0


def test_a_durable_chunk_the_store_reported_removed_is_no_loss() -> None:
    """Issue 16 (long soaks): a durable chunk evicted at the NVMe budget (its REMOVED event
    seen after its put started, and at most the slack after the get that found it absent
    ended) is no loss; the same miss with no REMOVED, with one from before the put (an older
    copy), one past the slack, or another node's or key's, still is."""
    def history_with(*removed: Removal) -> History:
        history = clean()
        history.records += [put("h", "n0", 5.0, 5.1, durable=True),
                            get("h", "n0", 13.0, 13.1, result=Result.ABSENT)]
        history.removed = list(removed)
        return history

    assert check(history_with(Removal("n0", "h", 7.0))) == []  # evicted before the kill
    assert check(history_with(Removal("n0", "h", 12.8))) == []  # evicted after the restart
    assert check(history_with(Removal("n0", "h", 14.0))) == []  # reported within the slack
    for removed in ([], [Removal("n0", "h", 4.0)], [Removal("n0", "h", 15.5)],
                    [Removal("n1", "h", 7.0)], [Removal("n0", "a", 7.0)]):
        [v] = check(history_with(*removed))
        assert v.invariant is Invariant.DURABLE_LOST, removed
    [v] = check(history_with(Removal("n0", "h", 14.0)), removal_slack_s=0.5)
    assert v.invariant is Invariant.DURABLE_LOST


def test_a_miss_of_a_chunk_not_acknowledged_durable_is_no_loss() -> None:
    history = clean()
    history.records += [put("h", "n0", 5.0, 5.1), get("h", "n0", 13.0, 13.1,
                                                      result=Result.ABSENT)]
    assert check(history) == []


def test_placement_on_a_node_after_its_lease_expired() -> None:
    late = Record(Op.SCHEDULE, "z", "n0", 11.5, 11.5, Result.OK)  # 0.7 s after expiry
    [v] = broken(clean(), late)
    assert v.invariant is Invariant.PLACEMENT_AFTER_EXPIRY and v.record == late
    history = clean()
    history.records.append(late)
    assert check(history, placement_grace_s=1.0) == []


def test_placement_on_a_node_that_never_came_back() -> None:
    history = clean()
    history.lease_gaps = [LeaseGap("n0", 10.8, None)]
    [v] = check(history)
    assert v.invariant is Invariant.PLACEMENT_AFTER_EXPIRY and v.record is not None
    assert v.record.key == "g"


def test_two_leaders_in_one_epoch() -> None:
    [v] = broken(clean(), Record(Op.LEASE, "leader", "c1", 8.0, 8.5, Result.OK, epoch=1))
    assert v.invariant is Invariant.TWO_LEADERS and "c0, c1" in v.message


def test_no_request_completed_during_a_fault() -> None:
    history = clean()
    history.records = [r for r in history.records if r.key != "d"]
    [v] = check(history)
    assert v.invariant is Invariant.NO_PROGRESS
    assert check(history, require_progress=False) == []


def test_records_round_trip_and_bad_ones_are_refused() -> None:
    for r in clean().records:
        assert Record.from_dict(r.to_dict()) == r
    with pytest.raises(InvalidArgument, match="not a history record"):
        Record.from_dict({"op": "scan", "key": "a"})
    with pytest.raises(InvalidArgument, match="digest"):
        Record(Op.GET, "a", "n0", 1.0, 2.0, Result.OK)
    with pytest.raises(InvalidArgument, match="end_s >= start_s"):
        put("a", "n0", 2.0, 1.0)
    with pytest.raises(InvalidArgument, match="durable"):
        put("a", "n0", 1.0, 2.0, result=Result.ERR, durable=True)
    with pytest.raises(InvalidArgument, match="size_bytes"):
        chunk_value("a", 0, 0)


def test_values_depend_on_key_and_version() -> None:
    assert chunk_value("a", 0, 64) == chunk_value("a", 0, 64)
    assert len({chunk_value("a", 0, 64), chunk_value("a", 1, 64), chunk_value("b", 0, 64)}) == 3
    assert expected_digest("a", 0, 64) == digest(chunk_value("a", 0, 64))


def test_a_stall_inside_a_fault_window_is_no_progress() -> None:
    history = clean()  # answers in [10, 12]: only put d at 10.6; the rest of the window idles
    assert check(history, max_stall_s=1.5) == []
    [v] = check(history, max_stall_s=1.0)
    assert v.invariant is Invariant.NO_PROGRESS and "1.400 s from 10.600" in v.message


def test_a_request_that_outlived_its_timeout() -> None:
    assert check(clean(), request_timeout_s=2.0) == []
    slow = put("s", "n1", 5.0, 8.5)  # 3.5 s: past 2 s + 1 s
    history = clean()
    history.records.append(slow)
    [v] = check(history, request_timeout_s=2.0)
    assert v.invariant is Invariant.OVER_TIMEOUT and v.record == slow
    history = clean()
    history.records.append(put("s", "n1", 5.0, 7.9))  # within the slack
    assert check(history, request_timeout_s=2.0) == []
    with pytest.raises(InvalidArgument, match="request_timeout_s"):
        check(history, request_timeout_s=float("nan"))


def test_a_leader_acting_in_its_old_epoch_after_a_newer_one_began() -> None:
    zombie = Record(Op.LEASE, "r-9", "c0", 14.5, 14.6, Result.OK, epoch=1)  # c1 leads 2 at 14
    [v] = broken(clean(), zombie)
    assert v.invariant is Invariant.STALE_LEADER and v.record == zombie
    early = Record(Op.LEASE, "r-8", "c0", 13.5, 13.6, Result.OK, epoch=1)  # before epoch 2
    assert broken(clean(), early) == []


def test_a_refused_placement_is_no_placement() -> None:
    refused = Record(Op.SCHEDULE, "z", "n0", 11.5, 11.5, Result.ERR)
    assert broken(clean(), refused) == []


def test_a_chunk_damaged_on_purpose_may_be_dropped_but_never_returned_wrong() -> None:
    history = clean()
    history.damaged.append(("n0", "a"))
    history.records.append(get("a", "n0", 13.0, 13.1, result=Result.ABSENT))
    assert check(history) == []  # dropped after the restart: not a loss
    flipped = bytearray(chunk_value("a", 0, SIZE))
    flipped[7] ^= 0x40
    [v] = broken(history, get("a", "n0", 13.2, 13.3, data=bytes(flipped)))
    assert v.invariant is Invariant.WRONG_READ


def test_a_placement_just_before_the_watch_saw_the_node_return_is_allowed() -> None:
    history = clean()  # n0 back at 12.4 as the watch saw it: another observer may be earlier
    history.records.append(Record(Op.SCHEDULE, "y", "n0", 12.0, 12.0, Result.OK))
    assert check(history) == []
    [v] = check(history, placement_grace_s=0.3)
    assert v.invariant is Invariant.PLACEMENT_AFTER_EXPIRY


# --- engine requests (issue 16: real engines under the fault suite's load) --------------------

NO_CACHE = {"p0": [5, 9, 9, 2], "p1": [7, 1, 3, 3]}
"""Greedy outputs of two prompts without any store (the references)."""


def engine(key: str, start: float, end: float | None, *, tokens: list[int] | None = None,
           result: Result = Result.OK, reused: int = 0, node: str = "n0") -> Record:
    d = tokens_digest(NO_CACHE[key] if tokens is None else tokens) \
        if result is Result.OK else None
    return Record(Op.ENGINE, key, node, start, end, result, digest=d, prompt_tokens=80,
                  reused_tokens=reused)


def with_engines(*records: Record) -> History:
    """The clean history plus engine requests: one before the fault (all computed), one
    during it that degraded to computing, one after it that loaded 64 of 80 tokens."""
    history = clean()
    history.engine_expected = {k: tokens_digest(v) for k, v in NO_CACHE.items()}
    history.records += [engine("p0", 5.0, 5.2), engine("p1", 10.5, 11.0),
                        engine("p0", 13.0, 13.1, reused=64), *records]
    return history


def test_engine_outputs_equal_to_their_no_cache_outputs_pass() -> None:
    history = with_engines()
    assert check(history, engine_timeout_s=2.0) == []
    [fault] = history.faults
    stats = engine_stats(history.records, fault, 2.0)
    assert (stats.attempted, stats.completed, stats.failed) == (1, 1, 0)
    assert engine_reuse(history.records, until_s=fault.start_s) == 0.0
    assert engine_reuse(history.records, since_s=fault.end_s) == 64 / 80
    assert engine_reuse(history.records, since_s=20.0) is None


def test_an_engine_output_that_differs_from_its_no_cache_output_is_a_wrong_read() -> None:
    wrong = engine("p1", 13.5, 13.6, tokens=[7, 1, 3, 4], reused=64)  # its last token differs
    [v] = check(with_engines(wrong))
    assert v.invariant is Invariant.WRONG_READ and v.record == wrong
    assert "64 of 80 prompt tokens were loaded from kvtier" in v.message
    other = engine("p0", 13.5, 13.6, tokens=NO_CACHE["p1"])  # another prompt's output
    [v] = check(with_engines(other))
    assert v.invariant is Invariant.WRONG_READ


def test_an_engine_output_with_no_reference_is_a_wrong_read() -> None:
    history = with_engines()
    history.engine_expected.pop("p1")
    [v] = check(history)
    assert v.invariant is Invariant.WRONG_READ and "no no-cache output" in v.message


def test_an_engine_request_past_its_timeout_fails_and_breaks_the_bound() -> None:
    slow = engine("p0", 10.2, 13.5)  # 3.3 s: past 2 s + 1 s, started in the fault window
    history = with_engines(slow)
    [v] = check(history, engine_timeout_s=2.0)
    assert v.invariant is Invariant.OVER_TIMEOUT and v.record == slow
    assert check(history) == []  # no engine bound asked for
    stats = engine_stats(history.records, history.faults[0], 2.0)
    assert (stats.attempted, stats.completed, stats.failed) == (2, 1, 1)
    stats = engine_stats(history.records, history.faults[0])
    assert (stats.attempted, stats.completed, stats.failed) == (2, 2, 0)


def test_an_engine_request_in_flight_when_the_fault_began_is_counted() -> None:
    """The request a fault catches (started just before it, answered after the timeout) is
    the one that waits longest: it counts as under way during the fault."""
    caught = engine("p0", 9.9, 13.5)  # 3.6 s, across the fault's start at 10
    history = with_engines(caught, engine("p1", 9.0, 9.5))  # over before: not counted
    stats = engine_stats(history.records, history.faults[0], 2.0)
    assert (stats.attempted, stats.completed, stats.failed) == (2, 1, 1)


def test_no_engine_request_completed_during_a_fault_is_no_progress() -> None:
    history = with_engines(engine("p0", 10.1, 10.4, result=Result.ERR),
                           engine("p0", 11.0, None, result=Result.ERR))
    history.records = [r for r in history.records if not (r.op is Op.ENGINE and r.key == "p1")]
    [v] = check(history)
    assert v.invariant is Invariant.NO_PROGRESS and "none of 2 engine requests" in v.message
    assert check(history, require_progress=False) == []
    stats = engine_stats(history.records, history.faults[0])
    assert (stats.attempted, stats.completed, stats.failed) == (2, 0, 2)


def test_engine_records_round_trip_and_bad_ones_are_refused() -> None:
    for r in with_engines(engine("p0", 11.0, 11.5, result=Result.ERR)).records:
        assert Record.from_dict(r.to_dict()) == r
    with pytest.raises(InvalidArgument, match="digest of its tokens"):
        Record(Op.ENGINE, "p0", "n0", 1.0, 2.0, Result.OK, prompt_tokens=8)
    with pytest.raises(InvalidArgument, match="reused_tokens"):
        Record(Op.ENGINE, "p0", "n0", 1.0, 2.0, Result.OK, digest="x", prompt_tokens=8,
               reused_tokens=9)
    with pytest.raises(InvalidArgument, match="token ids"):
        tokens_digest([1, -2])
    assert tokens_digest([1, 23]) != tokens_digest([12, 3])
    with pytest.raises(InvalidArgument, match="engine_timeout_s"):
        check(with_engines(), engine_timeout_s=-1.0)

"""Engine load reports (``Scheduler.report_load``) and expected output lengths in decisions.

Same hand-made clusters and linear latency fake as ``test_scheduler.py``: prefill costs 1 ms
per computed token; decode TPOT is ``10 ms + 1 ms x batch`` (context-free), so every figure
is exact.
"""

from __future__ import annotations

import pytest

from conductor.scheduler import Policy, RejectReason, ScheduleRequest
from kvstore.errors import InvalidArgument
from tests.control.test_scheduler import MODEL, make, req

# -- prefill: the queue estimate is the latest report plus what was scheduled since ----------


def test_a_report_of_work_we_did_not_schedule_steers_load_balancing() -> None:
    sched, _ = make(Policy.LOAD)
    # p0 reports 200 queued tokens (requests another leader placed before a failover).
    assert sched.report_load("p0", 1.0, queued_prefill_tokens=200)
    assert sched.queue_s("p0", 1.0) == pytest.approx(0.200)
    assert sched.queue_s("p1", 1.0) == 0.0
    dec = sched.schedule(req("a", (), 10), 1.0)
    assert dec.prefill_instance == "p1" and dec.ttft is not None and dec.ttft.queue_s == 0.0


def test_report_replaces_our_estimate_of_what_the_engine_had_and_keeps_what_came_after() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    a = sched.schedule(req("a", (), 100), 0.0)  # 100 ms of work, decided at 0
    b = sched.schedule(req("b", (), 50), 0.02)  # 50 ms, decided at 0.02: queue ends at 0.15
    assert a.accepted and b.accepted
    assert sched.queue_s("p0", 0.02) == pytest.approx(0.130)
    # The engine's report stamped 0.01 (it had "a" only): 30 tokens of "a" left. "b" was
    # decided after the report, so it is added on top: 0.01 + 0.03 + 0.05.
    assert sched.report_load("p0", 0.01, queued_prefill_tokens=30)
    assert sched.queue_s("p0", 0.02) == pytest.approx(0.070)
    c = sched.schedule(req("c", (), 10), 0.02)
    assert c.ttft is not None and c.ttft.queue_s == pytest.approx(0.070)


def test_an_idle_report_empties_the_queue_estimate() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    sched.schedule(req("a", (), 100), 0.0)
    assert sched.report_load("p0", 0.05, queued_prefill_tokens=0)  # it ran faster than modelled
    assert sched.queue_s("p0", 0.05) == 0.0


def test_a_report_older_than_the_last_completion_is_ignored() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    a = sched.schedule(req("a", (), 100), 0.0)
    sched.schedule(req("b", (), 50), 0.0)
    sched.prefill_done(a.ticket, 0.2, prefill_s=0.1)  # "a" started late: "b" starts at 0.2
    assert sched.queue_s("p0", 0.2) == pytest.approx(0.050)
    assert sched.report_load("p0", 0.15, queued_prefill_tokens=0)  # overtaken: stale
    assert sched.queue_s("p0", 0.2) == pytest.approx(0.050)
    assert sched.report_load("p0", 0.21, queued_prefill_tokens=20)  # fresh
    assert sched.queue_s("p0", 0.21) == pytest.approx(0.020)


def test_reported_tokens_are_priced_with_the_instance_calibration() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    for i in range(40):  # p0 measures twice as slow as modelled
        dec = sched.schedule(req(f"r{i}", (), 10), float(i))
        sched.prefill_done(dec.ticket, float(i) + 0.02, prefill_s=0.02)
    factor = sched.prefill_speed.factor("p0")
    assert factor == pytest.approx(2.0, rel=0.05)
    sched.report_load("p0", 100.0, queued_prefill_tokens=100)
    assert sched.queue_s("p0", 100.0) == pytest.approx(factor * 0.100)


# -- decode: reported batch and KV in use ---------------------------------------------------------


def test_reported_decode_batch_raises_the_tpot_prediction() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), decodes=2)
    assert sched.report_load("d0", 0.0, running_decode_batch=5, kv_used_tokens=5000)
    dec = sched.schedule(req("a", (), 10), 0.0)
    assert dec.decode_instance == "d1" and dec.tpot_s == pytest.approx(0.011)
    # With d1 reporting a bigger batch, d0 (5 + this one: 16 ms) is the better choice.
    sched.report_load("d1", 0.0, running_decode_batch=8)
    dec = sched.schedule(req("b", (), 10), 0.0)
    assert dec.decode_instance == "d0" and dec.tpot_s == pytest.approx(0.016)


def test_reported_batch_counts_only_what_is_beyond_our_own_requests() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    a = sched.schedule(req("a", (), 10), 0.0)
    sched.prefill_done(a.ticket, 0.01, prefill_s=0.01)
    # The engine runs "a" and nothing else: the prediction stays ours (batch 2 with "b").
    sched.report_load("d0", 0.02, running_decode_batch=1, kv_used_tokens=300)
    b = sched.schedule(req("b", (), 10), 0.03)
    assert b.tpot_s == pytest.approx(0.012)
    # It runs two more than ours: "c" sees a, b and those two.
    sched.report_load("d0", 0.04, running_decode_batch=3)
    c = sched.schedule(req("c", (), 10), 0.05)
    assert c.tpot_s == pytest.approx(0.015)
    # "a" finishes after that report: it leaves our count, the two unknown ones stay.
    sched.decode_done(a.ticket, 0.06, output_tokens=5)
    d = sched.schedule(req("d", (), 10), 0.06)
    assert d.tpot_s == pytest.approx(0.015)  # b, c, two unknown, and d


def test_reported_batch_predicts_tpot_rejections() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), decodes=2, tpot_slo_s=0.0135)
    sched.report_load("d0", 0.0, running_decode_batch=3)
    sched.report_load("d1", 0.0, running_decode_batch=3)
    dec = sched.schedule(req("a", (), 10), 0.0)
    assert not dec.accepted and dec.reason is RejectReason.TPOT_SLO
    assert dec.tpot_s == pytest.approx(0.014)
    sched.report_load("d1", 0.1, running_decode_batch=2)
    dec = sched.schedule(req("b", (), 10), 0.1)
    assert dec.accepted and dec.decode_instance == "d1"


def test_a_decode_instance_without_reported_kv_room_is_not_chosen() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), decodes=2, kv_capacity=1000,
                    initial_output_tokens=100.0)
    # d0 is preferred on ties (id order) until it reports 950 of 1,000 KV tokens in use.
    assert sched.schedule(req("a", (), 100), 0.0).decode_instance == "d0"
    sched.report_load("d0", 0.0, kv_used_tokens=950)
    b = sched.schedule(req("b", (), 100), 0.0)
    assert b.decode_instance == "d1"
    sched.report_load("d1", 0.0, kv_used_tokens=900)
    c = sched.schedule(req("c", (), 100), 0.0)
    assert not c.accepted and c.reason is RejectReason.DECODE_KV_FULL


def test_a_report_never_lowers_our_own_reservations() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), kv_capacity=700,
                    initial_output_tokens=100.0)
    a = sched.schedule(req("a", (), 500), 0.0)  # reserves 600 of 700
    sched.prefill_done(a.ticket, 0.5, prefill_s=0.5)
    sched.report_load("d0", 0.6, kv_used_tokens=510)  # in use now; "a" still grows
    assert not sched.schedule(req("b", (), 100), 0.6).accepted


def test_expected_output_tokens_size_the_kv_reservation() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), kv_capacity=700,
                    initial_output_tokens=100.0)
    assert sched.schedule(ScheduleRequest("a", MODEL, (), 500, 150), 0.0).accepted  # 650
    assert sched.schedule(ScheduleRequest("b", MODEL, (), 40, 10), 0.0).accepted  # 700
    last = sched.schedule(ScheduleRequest("c", MODEL, (), 1, 1), 0.0)
    assert not last.accepted and last.reason is RejectReason.DECODE_KV_FULL


def test_expected_output_tokens_set_the_predicted_decode_end() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), decodes=2)
    # "a": 10 output tokens at 11 ms after a 10 ms prefill: done at 0.12 s on d0.
    a = sched.schedule(ScheduleRequest("a", MODEL, (), 10, 10), 0.0)
    assert a.decode_instance == "d0"
    # A request reaching decode after 0.12 s sees d0 empty again (ties go to d0).
    b = sched.schedule(ScheduleRequest("b", MODEL, (), 200, 10), 0.0)
    assert b.decode_instance == "d0" and b.tpot_s == pytest.approx(0.011)


def test_report_validation_and_unknown_instances() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    assert sched.report_load("nobody", 0.0, queued_prefill_tokens=1) is False
    with pytest.raises(InvalidArgument):
        sched.report_load("p0", 0.0, queued_prefill_tokens=-1)
    with pytest.raises(InvalidArgument):
        sched.report_load("d0", float("nan"))
    with pytest.raises(InvalidArgument):
        ScheduleRequest("r", MODEL, (), 10, 0)

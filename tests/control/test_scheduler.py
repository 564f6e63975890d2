"""The scheduler's cost model and policies on hand-made clusters, and its calibration.

The latency model here is a linear fake (1 ms per computed token; decode
``10 ms + 1 ms x batch``) so every estimate can be checked exactly; the index
is the real one, fed by snapshots.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest

from conductor.calibration import LinkCalibration, MeanEstimate, SpeedCalibration
from conductor.index import GlobalPrefixIndex, TierCounts
from conductor.perf.latency import DistServeFit
from conductor.scheduler import (
    DecodeInstance,
    FetchPlan,
    Policy,
    PrefillInstance,
    RejectReason,
    ReplicationHint,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
)
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument

DRAM, NVME, HBM = TierKind.DRAM, TierKind.NVME, TierKind.HBM
MODEL = "m"
BLOCK_TOKENS = 10
BLOCK_BYTES = 1000


class LinearLatency:
    label = "linear test model"

    def __init__(self, per_token_s: float = 0.001, decode_fixed_s: float = 0.010,
                 decode_per_seq_s: float = 0.001) -> None:
        self.per_token_s = per_token_s
        self.decode_fixed_s = decode_fixed_s
        self.decode_per_seq_s = decode_per_seq_s

    def prefill_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int]) -> float:
        return sum(new_tokens) * self.per_token_s

    def decode_coeffs(self, batch_size: int) -> tuple[float, float]:
        return self.decode_fixed_s + self.decode_per_seq_s * batch_size, 0.0

    def mixed_s(self, new_tokens: Sequence[int], prior_tokens: Sequence[int], decode_batch: int,
                decode_context_tokens: int) -> float:
        return self.prefill_s(new_tokens, prior_tokens)


def k(i: int) -> bytes:
    return b"blk-%03d" % i


def keys(n: int, start: int = 0) -> tuple[bytes, ...]:
    return tuple(k(i) for i in range(start, start + n))


def make(policy: Policy = Policy.GLOBAL_CACHE, *, prefill_nodes: Sequence[str] = ("n0", "n1"),
         decodes: int = 1, kv_capacity: int = 1_000_000, held: dict[str, list[tuple[bytes, TierKind]]]
         | None = None, latency: LinearLatency | None = None, **config: object
         ) -> tuple[Scheduler, GlobalPrefixIndex]:
    index = GlobalPrefixIndex()
    for node in dict.fromkeys(prefill_nodes):
        assert index.apply_snapshot(node, 1, 0, (held or {}).get(node, []))
    cfg = SchedulerConfig(policy=policy, block_size_tokens=BLOCK_TOKENS,
                          block_size_bytes=BLOCK_BYTES,
                          remote_link_bytes_per_s=config.pop("remote_link_bytes_per_s", 1e6),  # type: ignore[arg-type]
                          dram_read_bytes_per_s=1e6, nvme_read_bytes_per_s=1e5,
                          **config)  # type: ignore[arg-type]
    sched = Scheduler(index, latency or LinearLatency(), cfg)
    for i, node in enumerate(prefill_nodes):
        sched.add_prefill_instance(PrefillInstance(f"p{i}", node, MODEL))
    for i in range(decodes):
        sched.add_decode_instance(DecodeInstance(f"d{i}", f"dn{i}", MODEL, kv_capacity))
    return sched, index


def req(rid: str, block_keys: tuple[bytes, ...], tokens: int, model: str = MODEL) -> ScheduleRequest:
    return ScheduleRequest(rid, model, block_keys, tokens)


# -- the cost model ------------------------------------------------------------------


def test_ttft_estimate_is_exact_for_local_reuse_by_tier() -> None:
    held = {"n0": [(k(0), HBM), (k(1), DRAM), (k(2), NVME)]}
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), held=held)
    dec = sched.schedule(req("r", keys(4), 40), now_s=0.0)
    assert dec.accepted and dec.prefill_instance == "p0" and dec.decode_instance == "d0"
    assert (dec.prefix_blocks, dec.local_blocks, dec.fetch) == (3, 3, None)
    assert dec.local_tiers == TierCounts(hbm=1, dram=1, nvme=1)
    assert dec.ttft is not None
    assert dec.ttft.queue_s == 0.0 and dec.ttft.transfer_s == 0.0
    assert dec.ttft.prefill_s == pytest.approx(0.010)  # 40 - 30 tokens at 1 ms
    assert dec.ttft.load_s == pytest.approx(0.001 + 0.010)  # DRAM block 1 ms, NVMe block 10 ms
    assert dec.estimated_ttft_s == pytest.approx(0.011)  # load and compute overlap
    # Decode: batch 1 -> 10 ms + 1 ms.
    assert dec.tpot_s == pytest.approx(0.011)


def test_a_full_hit_still_computes_one_token() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",),
                    held={"n0": [(k(0), HBM), (k(1), HBM)]})
    dec = sched.schedule(req("r", keys(2), 20), 0.0)
    assert dec.prefix_blocks == 2 and dec.ttft is not None
    assert dec.ttft.prefill_s == pytest.approx(0.001)


def test_queue_time_accumulates_and_is_reanchored_on_completion() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    a = sched.schedule(req("a", (), 100), 0.0)
    b = sched.schedule(req("b", (), 50), 0.0)
    c = sched.schedule(req("c", (), 10), 0.0)
    assert a.ttft is not None and b.ttft is not None and c.ttft is not None
    assert (a.ttft.queue_s, b.ttft.queue_s) == (0.0, pytest.approx(0.100))
    assert c.ttft.queue_s == pytest.approx(0.150)
    # "a" finishes 1 s late: what is left (b and c, 60 ms) starts now, counted once.
    sched.prefill_done(a.ticket, 1.1, prefill_s=1.1)
    assert sched.queue_s("p0", 1.1) == pytest.approx(0.060)
    sched.prefill_done(b.ticket, 1.2, prefill_s=0.1)
    assert sched.queue_s("p0", 1.2) == pytest.approx(0.010)
    sched.prefill_done(c.ticket, 1.21, prefill_s=0.01)
    assert sched.queue_s("p0", 1.21) == 0.0


# -- policies on one hand-made cluster ----------------------------------------------------
#
# n0 holds blocks 0-3 and p0 already has 30 ms of work; n1 holds nothing and p1 is idle.
# The request has 4 cached-somewhere blocks and 50 tokens.

def _cluster(policy: Policy, **config: object) -> tuple[Scheduler, GlobalPrefixIndex]:
    sched, index = make(policy, held={"n0": [(key, DRAM) for key in keys(4)]}, **config)
    filler = sched.schedule(req("filler", (), 30), 0.0)
    assert filler.prefill_instance == "p0"
    return sched, index


def test_load_policy_picks_the_idle_instance_and_reuses_nothing() -> None:
    sched, _ = _cluster(Policy.LOAD)
    dec = sched.schedule(req("r", keys(4), 50), 0.0)
    assert dec.prefill_instance == "p1" and dec.prefix_blocks == 0
    assert dec.estimated_ttft_s == pytest.approx(0.050)


def test_local_cache_policy_waits_for_the_instance_that_holds_the_prefix() -> None:
    sched, _ = _cluster(Policy.LOCAL_CACHE)
    dec = sched.schedule(req("r", keys(4), 50), 0.0)
    # p0: 30 ms queue + max(10 ms compute, 4 ms DRAM load) = 40 ms < p1's 50 ms.
    assert dec.prefill_instance == "p0" and dec.prefix_blocks == 4 and dec.fetch is None
    assert dec.estimated_ttft_s == pytest.approx(0.040)


def test_global_cache_policy_fetches_to_the_idle_instance() -> None:
    sched, _ = _cluster(Policy.GLOBAL_CACHE)
    dec = sched.schedule(req("r", keys(4), 50), 0.0)
    # p1: 4 blocks over 1 MB/s = 4 ms, then 10 ms compute = 14 ms < p0's 40 ms.
    assert dec.prefill_instance == "p1" and dec.prefill_node == "n1"
    assert dec.fetch == FetchPlan("n0", "n1", 0, 4, 4 * BLOCK_BYTES)
    assert (dec.prefix_blocks, dec.local_blocks) == (4, 0)
    assert dec.ttft is not None
    assert dec.ttft.transfer_s == pytest.approx(0.004)
    assert dec.estimated_ttft_s == pytest.approx(0.014)


def test_global_cache_keeps_local_reuse_when_the_link_is_too_slow() -> None:
    sched, _ = _cluster(Policy.GLOBAL_CACHE, remote_link_bytes_per_s=1e5)  # 40 ms transfer
    dec = sched.schedule(req("r", keys(4), 50), 0.0)
    assert dec.prefill_instance == "p0" and dec.fetch is None


def test_fetch_is_taken_only_when_it_beats_local_reuse_on_the_same_instance() -> None:
    held = {"n0": [(key, DRAM) for key in keys(4)], "n1": [(key, DRAM) for key in keys(3)]}
    sched, _ = make(Policy.GLOBAL_CACHE, held=held, remote_link_bytes_per_s=1e4)
    sched.schedule(req("filler", (), 1000), 0.0)  # p0 busy for 1 s
    dec = sched.schedule(req("r", keys(4), 50), 0.0)
    # p1: local reuse computes 20 tokens (20 ms); fetching the 4th block takes 100 ms.
    assert dec.prefill_instance == "p1" and dec.fetch is None and dec.prefix_blocks == 3
    assert dec.estimated_ttft_s == pytest.approx(0.020)


def test_balancing_threshold_gates_the_fetch() -> None:
    held = {"n0": [(key, DRAM) for key in keys(4)], "n1": [(key, DRAM) for key in keys(2)]}
    for threshold, fetches in ((3.0, False), (2.0, True)):
        sched, _ = make(Policy.GLOBAL_CACHE, held=held, kvcache_balancing_threshold=threshold)
        sched.schedule(req("filler", (), 30), 0.0)  # p0 busy for 30 ms
        dec = sched.schedule(req("r", keys(4), 50), 0.0)
        # p1 holds 2 of the 4 blocks; best/local = 2.
        assert dec.prefill_instance == "p1"
        assert (dec.fetch is not None) is fetches
        assert dec.prefix_blocks == (4 if fetches else 2)
        if fetches:
            assert dec.fetch == FetchPlan("n0", "n1", 2, 4, 2 * BLOCK_BYTES)


def test_fetches_queue_behind_each_other_on_the_source_link() -> None:
    sched, _ = make(Policy.GLOBAL_CACHE, prefill_nodes=("n0", "n1", "n2"),
                    held={"n0": [(key, DRAM) for key in keys(4)]})
    sched.schedule(req("filler", (), 100), 0.0)  # p0 busy for 100 ms
    first = sched.schedule(req("a", keys(4), 50), 0.0)
    second = sched.schedule(req("b", keys(4), 50), 0.0)
    assert first.fetch is not None and second.fetch is not None
    assert {first.prefill_instance, second.prefill_instance} == {"p1", "p2"}
    assert first.ttft is not None and second.ttft is not None
    assert first.ttft.transfer_s == pytest.approx(0.004)
    assert second.ttft.transfer_s == pytest.approx(0.008)  # waits for the first transfer


def test_the_least_busy_holder_is_the_fetch_source() -> None:
    held = {n: [(key, DRAM) for key in keys(4)] for n in ("n0", "n1")}
    sched, _ = make(Policy.GLOBAL_CACHE, prefill_nodes=("n0", "n1", "n2", "n3"), held=held)
    sched.schedule(req("f0", (), 100), 0.0)
    sched.schedule(req("f1", (), 100), 0.0)
    a = sched.schedule(req("a", keys(4), 50), 0.0)
    b = sched.schedule(req("b", keys(4), 50), 0.0)
    assert a.fetch is not None and b.fetch is not None
    assert a.fetch.src_node == "n0" and b.fetch.src_node == "n1"


def test_random_policy_is_seeded_and_spreads() -> None:
    picks = []
    for seed in (1, 1, 2):
        sched, _ = make(Policy.RANDOM, prefill_nodes=("n0", "n1", "n2"), seed=seed)
        picks.append([sched.schedule(req(f"r{i}", (), 10), 0.0).prefill_instance
                      for i in range(30)])
    assert picks[0] == picks[1] != picks[2]
    assert set(picks[0]) == {"p0", "p1", "p2"}


def test_removed_node_is_never_a_fetch_source() -> None:
    sched, index = _cluster(Policy.GLOBAL_CACHE)
    index.remove_node("n0")  # its lease expired
    dec = sched.schedule(req("r", keys(4), 50), 0.0)
    assert dec.fetch is None and dec.prefix_blocks == 0


# -- decode, SLOs, rejections -------------------------------------------------------------


def test_decode_pick_counts_requests_predicted_to_finish_before_arrival() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), decodes=2)
    a = sched.schedule(req("a", (), 10), 0.0)
    assert a.decode_instance == "d0"
    # Right away d0 is busy with "a" (and stays so for ~256 tokens x 11 ms): d1.
    assert sched.schedule(req("b", (), 10), 0.0).decode_instance == "d1"
    # Much later, nothing reported: both are predicted idle by the time the request
    # reaches decode, so it is priced as a batch of one (current counts would say 2).
    c = sched.schedule(req("c", (), 10), 100.0)
    assert c.decode_instance == "d0" and c.tpot_s == pytest.approx(0.011)


def test_tpot_rejection_counts_admitted_requests_before_they_reach_decode() -> None:
    # TPOT = 10 ms + 1 ms x batch: a 13.5 ms target allows 3 requests per decode instance.
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), tpot_slo_s=0.0135)
    verdicts = [sched.schedule(req(f"r{i}", (), 10), 0.0) for i in range(5)]
    assert [v.accepted for v in verdicts] == [True, True, True, False, False]
    assert verdicts[3].reason is RejectReason.TPOT_SLO and "TPOT" in verdicts[3].message
    assert sched.rejected[RejectReason.TPOT_SLO] == 2
    # One finishes decoding: room for exactly one more.
    sched.prefill_done(verdicts[0].ticket, 0.01, prefill_s=0.01)
    sched.decode_done(verdicts[0].ticket, 3.0, output_tokens=256)
    assert sched.schedule(req("r5", (), 10), 3.0).accepted
    assert not sched.schedule(req("r6", (), 10), 3.0).accepted


def test_ttft_rejection_reserves_nothing() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), ttft_slo_s=0.05)
    ok = sched.schedule(req("a", (), 40), 0.0)
    late = sched.schedule(req("b", (), 40), 0.0)  # 40 ms queue + 40 ms > 50 ms
    assert ok.accepted and not late.accepted
    assert late.reason is RejectReason.TTFT_SLO and late.ttft is not None
    assert late.estimated_ttft_s == pytest.approx(0.080)
    assert sched.queue_s("p0", 0.0) == pytest.approx(0.040)
    assert sched.outstanding() == 1


def test_decode_kv_capacity_rejects_then_frees() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",), kv_capacity=700,
                    initial_output_tokens=100.0)
    a = sched.schedule(req("a", (), 500), 0.0)  # 600 of 700 KV tokens
    b = sched.schedule(req("b", (), 500), 0.0)
    assert a.accepted and not b.accepted and b.reason is RejectReason.DECODE_KV_FULL
    sched.prefill_done(a.ticket, 0.5, prefill_s=0.5)
    sched.decode_done(a.ticket, 2.0, output_tokens=100)
    assert sched.schedule(req("c", (), 500), 2.0).accepted


def test_bad_requests_and_unknown_models_raise() -> None:
    sched, _ = make()
    with pytest.raises(InvalidArgument, match="no prefill instance serves model 'other'"):
        sched.schedule(req("r", (), 10, model="other"), 0.0)
    with pytest.raises(InvalidArgument, match="block keys"):
        sched.schedule(req("r", keys(3), 20), 0.0)  # 3 blocks cannot come from 20 tokens
    for bad in [dict(request_id=""), dict(keys=[k(0)]), dict(keys=(b"",)), dict(input_tokens=0),
                dict(input_tokens=True), dict(model="")]:
        fields: dict[str, object] = dict(request_id="r", model=MODEL, keys=(), input_tokens=10)
        fields.update(bad)
        with pytest.raises(InvalidArgument):
            ScheduleRequest(**fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        sched.add_prefill_instance(PrefillInstance("p0", "n9", MODEL))  # id taken
    with pytest.raises(InvalidArgument):
        sched.prefill_done(12345, 0.0, prefill_s=1.0)
    for bad_now in (math.nan, math.inf, -1.0):  # a broken clock must not corrupt the queues
        with pytest.raises(InvalidArgument):
            sched.schedule(req("r", (), 10), bad_now)
    ok = sched.schedule(req("r", (), 10), 0.0)
    with pytest.raises(InvalidArgument):
        sched.prefill_done(ok.ticket, math.nan, prefill_s=0.01)
    with pytest.raises(InvalidArgument):
        sched.prefill_done(ok.ticket, 0.01, prefill_s=0.0)
    with pytest.raises(InvalidArgument):
        sched.decode_done(ok.ticket, math.nan, output_tokens=5)


@pytest.mark.parametrize("bad", [
    dict(block_size_tokens=0), dict(kvcache_balancing_threshold=0.5), dict(ttft_slo_s=-1.0),
    dict(tpot_slo_s=math.nan), dict(hot_prefix_fetches=-1), dict(policy="global-cache"),
    dict(remote_link_bytes_per_s=0.0),
])
def test_config_validation(bad: dict[str, object]) -> None:
    fields: dict[str, object] = dict(policy=Policy.LOAD, block_size_tokens=16,
                                     block_size_bytes=1024)
    fields.update(bad)
    with pytest.raises(InvalidArgument):
        SchedulerConfig(**fields)  # type: ignore[arg-type]


def test_removing_an_instance_cancels_its_requests() -> None:
    sched, _ = make(Policy.LOAD)
    a = sched.schedule(req("a", (), 10), 0.0)
    assert a.prefill_instance == "p0" and sched.outstanding() == 1
    assert sched.remove_instance("p0")
    assert sched.outstanding() == 0
    assert all(sched.schedule(req(f"r{i}", (), 10), 0.0).prefill_instance == "p1"
               for i in range(3))
    assert sched.remove_instance("d0")
    with pytest.raises(InvalidArgument, match="no decode instance"):
        sched.schedule(req("x", (), 10), 0.0)


# -- hot prefixes ---------------------------------------------------------------------------


def test_hot_remote_prefix_gets_a_replication_hint() -> None:
    sched, _ = make(Policy.GLOBAL_CACHE, prefill_nodes=("n0", "n1", "n2", "n3"),
                    held={"n0": [(key, DRAM) for key in keys(4)]}, hot_prefix_fetches=2,
                    replication_fanout=1)
    sched.schedule(req("filler", (), 1000), 0.0)  # p0 (n0) is busy for a second
    first = sched.schedule(req("a", keys(4), 50), 0.0)
    assert first.fetch is not None and first.replicate is None
    second = sched.schedule(req("b", keys(4), 50), 0.0)
    assert second.fetch is not None and second.fetch.src_node == "n0"
    # Second fetch of the same prefix: copy it to the least-loaded node that lacks it,
    # never to the source or to the node this request runs on.
    assert second.replicate is not None
    assert second.replicate.src_node == "n0" and second.replicate.blocks == 4
    assert len(second.replicate.dst_nodes) == 1
    assert second.replicate.dst_nodes[0] not in {"n0", second.fetch.dst_node}
    third = sched.schedule(req("c", keys(4), 50), 0.0)
    assert third.replicate is None  # the counter restarted
    assert isinstance(second.replicate, ReplicationHint)


# -- calibration --------------------------------------------------------------------------------


def test_prefill_speed_is_calibrated_from_measurements() -> None:
    sched, _ = make(Policy.LOCAL_CACHE, prefill_nodes=("n0",))
    a = sched.schedule(req("a", (), 100), 0.0)
    assert a.ttft is not None and a.ttft.prefill_s == pytest.approx(0.100)
    sched.prefill_done(a.ticket, 0.2, prefill_s=0.200)  # twice as slow as modelled
    b = sched.schedule(req("b", (), 100), 0.2)
    assert b.ttft is not None
    assert b.ttft.prefill_s == pytest.approx(0.100 * 2 ** 0.2)  # alpha 0.2, geometric


def test_link_bandwidth_is_calibrated_from_transfers() -> None:
    sched, _ = _cluster(Policy.GLOBAL_CACHE)
    a = sched.schedule(req("a", keys(4), 50), 0.0)
    assert a.fetch is not None
    sched.prefill_done(a.ticket, 0.05, prefill_s=0.01, transfer_s=0.008, transferred_bytes=4000)
    # Nominal 1e6 as a prior sample of 4000 B (4 ms), then 4000 B in 8 ms: 4000 / 4.8 ms.
    assert sched.links.bandwidth_bytes_per_s("n0", "n1") == pytest.approx(4000 / 0.0048)
    assert sched.links.bandwidth_bytes_per_s("n1", "n0") == 1e6  # the other direction


def test_speed_calibration_contract() -> None:
    cal = SpeedCalibration(alpha=0.5, clamp=4.0)
    assert cal.factor("x") == 1.0
    assert cal.observe("x", 100.0, 1.0) == pytest.approx(2.0)  # clamped to 4x, half-way in log
    assert cal.snapshot("x").samples == 1
    cal.forget("x")
    assert cal.factor("x") == 1.0
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(InvalidArgument):
            cal.observe("x", bad, 1.0)
    with pytest.raises(InvalidArgument):
        SpeedCalibration(alpha=0.0)


def test_link_and_mean_calibration_contract() -> None:
    links = LinkCalibration(1e9, alpha=0.5)
    assert links.transfer_s("a", "b", 0) == 0.0
    assert links.transfer_s("a", "b", 10**9) == pytest.approx(1.0)
    links.observe("a", "b", 10**9, 4.0)  # prior 1 s, sample 4 s: mean 2.5 s per GB
    assert links.bandwidth_bytes_per_s("a", "b") == pytest.approx(1e9 / 2.5)
    assert links.samples("a", "b") == 1
    links.forget_node("b")
    assert links.bandwidth_bytes_per_s("a", "b") == 1e9
    with pytest.raises(InvalidArgument):
        links.observe("a", "b", 0, 1.0)
    mean = MeanEstimate(100.0, alpha=0.5)
    mean.observe(300.0)
    assert mean.value == 200.0 and mean.count == 1


def test_works_with_a_planner_latency_model() -> None:
    fit = DistServeFit("opt-13b tp1", (18.1, 0.1019, 7.12e-6), (5.0, 1e-4, 0.05),
                       (5.0, 1e-4, 0.05), 32)
    index = GlobalPrefixIndex()
    index.apply_snapshot("n0", 1, 0, [(key, DRAM) for key in keys(2)])
    cfg = SchedulerConfig(Policy.GLOBAL_CACHE, block_size_tokens=BLOCK_TOKENS,
                          block_size_bytes=BLOCK_BYTES)
    sched = Scheduler(index, fit, cfg)
    sched.add_prefill_instance(PrefillInstance("p0", "n0", MODEL))
    sched.add_decode_instance(DecodeInstance("d0", "dn0", MODEL, 10_000))
    dec = sched.schedule(req("r", keys(3), 35), 0.0)
    assert dec.accepted and dec.prefix_blocks == 2 and dec.ttft is not None
    assert dec.ttft.prefill_s == pytest.approx(fit.prefill_s([15], [20]))

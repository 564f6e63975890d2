"""The vLLM fleet end to end (kvstore/cluster/vllm_fleet.py, what ``make run`` runs): real etcd,
conductor, two daemons, two ``vllm serve`` with the kvtier connector and KV events registered
in etcd as colocated engines, and the front door, on the small default tiny Llama.

Four prompts, two pairs sharing 5 full blocks, through three modes. Round robin sends each
follow-up to the other instance, which loads the shared blocks from kvtier (the instances share
node-a's store); the conductor sends it to the instance that holds them in its own prefix cache
(learned from vLLM's KV events); P/D prefills on v0 and decodes on v1 through kvtier. Then
round robin and the conductor again with chat arrivals (the pairs as two conversations, both in
flight at once, each follow-up sent after its own answer). Greedy outputs are identical across
modes and replays, and everything is gone after the fleet stops.

One fleet start (two vLLM servers) for the module: ~2-3 minutes on this 2-core machine.
"""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.cluster.vllm_fleet import (
    Arrivals,
    Fleet,
    FleetRequest,
    FleetSpec,
    Mode,
    assemble,
    max_in_flight,
)
from kvstore.cluster.vllm_instance import TinyLlama

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SPEC = TinyLlama()
BLOCK = 32


def _tokens(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, SPEC.vocab_size) for _ in range(n))


A, B = _tokens(1, 5 * BLOCK), _tokens(2, 5 * BLOCK)
REQUESTS = (FleetRequest("a1", A + _tokens(3, 10), "a"), FleetRequest("a2", A + _tokens(4, 40), "a"),
            FleetRequest("b1", B + _tokens(5, 10), "b"), FleetRequest("b2", B + _tokens(6, 40), "b"))


def test_the_fleet_routes_reuses_and_disaggregates_with_identical_outputs(
        tmp_path: Path) -> None:
    spec = FleetSpec(work_dir=tmp_path / "fleet", requests=REQUESTS, model=SPEC,
                     modes=(Mode.ROUND_ROBIN, Mode.CONDUCTOR, Mode.PD), max_tokens=4,
                     max_model_len=512, vllm_kv_bytes=32 << 20, dram_bytes=64 << 20,
                     nvme_bytes=32 << 20, arrivals=Arrivals.CLOSED)
    fleet = Fleet(spec, log=lambda line: None)
    with fleet:
        results = fleet.replay()
        # The same fleet again with chat arrivals: both pairs' turns in flight at once.
        fleet.spec = replace(spec, arrivals=Arrivals.CHAT, in_flight=2,
                             modes=(Mode.ROUND_ROBIN, Mode.CONDUCTOR))
        chat = fleet.replay()
        servers = list(fleet.servers.values())
        children = list(fleet.children.values())
    by_mode = {r.mode: r for r in results}
    assert all(r.ok for r in results), [r.status for r in results]

    rr = by_mode[Mode.ROUND_ROBIN.value]
    rr_rec = {r.label: r for r in rr.records}
    assert [rr_rec[x].backend for x in ("a1", "a2", "b1", "b2")] == ["v0", "v1", "v0", "v1"]
    # The follow-ups ran where nothing was cached locally: their 5 blocks came from kvtier.
    assert (rr_rec["a2"].cached_tokens, rr_rec["b2"].cached_tokens) == (5 * BLOCK, 5 * BLOCK)
    assert rr.server_deltas["external_hits"] == 2 * 5 * BLOCK
    assert rr.server_deltas["local_hits"] == 0

    routed = by_mode[Mode.CONDUCTOR.value]
    rec = {r.label: r for r in routed.records}
    # The conductor sends each follow-up to the instance holding its prefix itself.
    assert rec["a2"].backend == rec["a1"].backend and rec["b2"].backend == rec["b1"].backend
    assert (rec["a2"].cached_tokens, rec["b2"].cached_tokens) == (5 * BLOCK, 5 * BLOCK)
    assert routed.server_deltas["local_hits"] == 2 * 5 * BLOCK
    assert routed.server_deltas["external_hits"] == 0
    assert len(routed.decision_s) == len(REQUESTS)
    # Colocated engines: one instance named for both phases (not its decode record's id).
    assert routed.placements and all(p == d and p in ("v0", "v1") for p, d in routed.placements)

    pd = by_mode[Mode.PD.value]
    assert [r.backend for r in pd.records] == ["v0>v1"] * len(REQUESTS)
    assert pd.server_deltas["external_hits"] > 0  # the decode loaded the prefill's KV

    doc = assemble(results, spec, fleet.startup_s)
    assert doc["outputs_identical"] and doc["failed_modes"] == []
    assert {s["mode"]: s["max_in_flight"] for s in doc["modes"]} == {
        m.value: 1 for m in spec.modes}

    # Chat arrivals: a1 and b1 went out together, each follow-up after its own answer, on
    # both instances at once; the outputs are the closed loop's.
    assert all(r.ok for r in chat), [r.status for r in chat]
    both = assemble([*results, *chat], spec, fleet.startup_s)
    assert both["outputs_identical"]
    for r in chat:
        rec = {x.label: x for x in r.records}
        assert max_in_flight(r.records) == 2, r.mode
        assert rec["a1"].done_s <= rec["a2"].sent_s and rec["b1"].done_s <= rec["b2"].sent_s
        first = sorted(r.records, key=lambda x: x.sent_s)[:2]
        assert {x.label for x in first} == {"a1", "b1"}
    rr_chat = {x.label: x for x in chat[0].records}
    assert {rr_chat["a1"].backend, rr_chat["b1"].backend} == {"v0", "v1"}
    assert all(len(r.token_ids) == spec.max_tokens for r in rr.records)
    assert {t["node"] for t in rr.tiers} == {"node-a", "node-b"}
    assert sum(t["puts"] for t in rr.tiers if t["node"] == "node-a") > 0

    # Stopped: no vLLM process group, daemon, conductor or etcd is left.
    assert all(s.group_pids() == [] for s in servers)
    assert all(c.proc is not None and c.proc.poll() is not None for c in children)

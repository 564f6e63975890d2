"""The front door's in-process routing (``LocalRouter``) against the real conductor on the same
state: etcd, a store daemon, a ``kvtier conductor`` process and two vLLM-like instances
registered as the fleet registers its servers, whose KV events are vLLM's wire format on real
ZMQ sockets (``bench.routing.KvEventPublisher``), followed by both the conductor and the front
door. No vLLM runs.

What is checked: the same prompts on the same state get the same instance here as from the
conductor (each local decision's shadow ``Schedule`` is the conductor's decision, made on its
own view of the same events and the same earlier decisions and completions), through prefixes
held by either engine, a conversation, new prompts and requests left outstanding; a replica cut
off from an engine's events goes stale and the conductor decides instead; with the conductor
gone the front door refuses (503) rather than route on state nobody vouches for; a request the
local scheduler would reject is the conductor's to reject (429); and the local scheduler is
configured as the conductor configures its own. Every wait polls a condition with a
deadline; no timed assertions.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from conductor.scheduler import Policy, ScheduleRequest
from conductor.server import Conductor, ConductorConfig, _NodeFollower
from kvstore.client.conductor_client import ConductorClient
from kvstore.client.store_client import StoreClient
from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument
from kvstore.frontdoor.local import LocalRouter, local_scheduler
from kvstore.frontdoor.router import Backend, BackendPool, Rejection, RouteRequest
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace
from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.membership.nodes import NodeRecord
from tests.frontdoor.test_conductor_routing import BLOCK, MODEL, NODE, SEED, Fleet, wait_until
from tests.support.daemon import DaemonProcess

VOCAB = 32000


def _fleet(tmp_path: Path, etcd: LocalEtcd, layout: KeyLayout, client_clock: bool
           ) -> Iterator[Fleet]:
    f = Fleet(tmp_path, etcd, layout)
    if client_clock:  # the conductor decides on the front door's clock
        f.conductor.args += ["--clock", "client"]
    try:
        f.daemon.start()
        f.conductor.start()
        yield f
    finally:
        f.close()


@pytest.fixture
def fleet(tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout) -> Iterator[Fleet]:
    yield from _fleet(tmp_path, etcd_server, etcd_layout, client_clock=False)


@pytest.fixture
def same_clock_fleet(tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout
                     ) -> Iterator[Fleet]:
    yield from _fleet(tmp_path, etcd_server, etcd_layout, client_clock=True)


def test_the_local_scheduler_is_configured_as_the_conductors() -> None:
    for policy, block, ttft, tpot in ((Policy.GLOBAL_CACHE, 32, None, None),
                                      (Policy.LOAD, 512, 2.0, 0.05)):
        theirs = Conductor(ConductorConfig(etcd_endpoint="http://127.0.0.1:1", policy=policy,
                                           block_size_tokens=block, ttft_slo_s=ttft,
                                           tpot_slo_s=tpot)).scheduler
        mine = local_scheduler(policy, block, ttft, tpot)
        assert mine.config == theirs.config
        # The same latency model: the same estimate for the same work.
        assert mine.prefill_estimate_s("x", 1000, 500) == theirs.prefill_estimate_s("x", 1000,
                                                                                     500)


class Scenario:
    """A local router and a plain conductor client on one fleet, and what each engine holds."""

    def __init__(self, fleet: Fleet, router: LocalRouter, client: ConductorClient) -> None:
        self.fleet = fleet
        self.router = router
        self.client = client
        self.held: dict[str, set[object]] = {"v0": set(), "v1": set()}

    def store(self, name: str, tokens: list[int], blocks: int | None = None) -> None:
        self.fleet.store(name, tokens, blocks)
        self.held[name].update(self.fleet.hashes.hashes(tokens)[:blocks])

    def nudge(self) -> None:
        """An empty batch from each engine, as vLLM's next step would send: a live batch a
        subscriber missed (published before its subscription reached the publisher) shows as
        a gap, which a replay repairs."""
        for publisher in self.fleet.publishers.values():
            publisher.add_stored([])

    async def settled(self) -> None:
        """Both the conductor and the front door hold what the engines stored, and the
        front door's replica is fresh."""
        want = {name: len(h) for name, h in self.held.items()}
        polls = 0

        async def check() -> bool:
            nonlocal polls
            polls += 1
            if polls % 10 == 0:
                self.nudge()
            info = await self.client.leader_info()
            theirs = {c.instance_id: c.blocks for c in info.engine_caches}
            mine = {}
            for name in want:
                view = self.router.engine_cache.view(name)
                mine[name] = -1 if view is None else len(view)
            return theirs == want == mine and self.router.stale_reason() is None

        await wait_until(check, f"the conductor and the front door hold {want}")


def _prompt(rng: random.Random, blocks: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(blocks * BLOCK + rng.randrange(BLOCK))]


def _router(fleet: Fleet, client: ConductorClient, pool: BackendPool,
            send_clock: bool = False) -> LocalRouter:
    return LocalRouter(client, pool, MODEL, etcd_endpoint=fleet.etcd_url, layout=fleet.layout,
                       policy=Policy.GLOBAL_CACHE, block_size_tokens=BLOCK,
                       check_interval_s=0.2, max_check_age_s=2.0, send_clock=send_clock)


POOL = [Backend("v0", "http://127.0.0.1:9"), Backend("v1", "http://127.0.0.1:10")]


def test_local_decisions_are_the_conductors_on_the_same_state(
        same_clock_fleet: Fleet, aio: asyncio.Runner) -> None:
    """The conductor runs on the front door's clock, so its shadow decision is made on the
    same state at the same instant (on the wall clock it decides a round trip later, and a
    queue predicted to drain in between can tip a near tie)."""
    rng = random.Random(11)
    held_by_v1 = _prompt(rng, 6)
    longer_on_v1 = _prompt(rng, 8)
    longer_on_v0 = _prompt(rng, 8)

    fleet = same_clock_fleet
    async def scenario() -> None:
        await fleet.register()
        client = ConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout)
        router = _router(fleet, client, BackendPool(POOL), send_clock=True)
        s = Scenario(fleet, router, client)
        s.store("v1", held_by_v1)  # before anyone follows v1: learned by replay
        s.store("v0", longer_on_v1, 2)
        s.store("v1", longer_on_v1, 5)
        s.store("v0", longer_on_v0, 6)
        s.store("v1", longer_on_v0, 3)
        for publisher in fleet.publishers.values():
            publisher.start()
        try:
            await router.start()
            await s.settled()
            conversation = [held_by_v1]
            for _ in range(3):
                conversation.append(conversation[-1] + _prompt(rng, rng.randrange(1, 4)))
            prompts = [(held_by_v1, "v1"), (longer_on_v1, "v1"), (longer_on_v0, "v0")]
            prompts += [(turn, "v1") for turn in conversation[1:]]
            prompts += [(_prompt(rng, rng.randrange(2, 12)), None) for _ in range(6)]
            # Again, now that queues and reservations differ (either engine may be best).
            prompts += [(longer_on_v0, None), (held_by_v1, None), (longer_on_v1, None)]
            outstanding: list[str] = []
            prefilling: list[str] = []
            for i, (tokens, expected) in enumerate(prompts):
                request = RouteRequest(f"req-{i}", "/v1/completions", MODEL, 8, False)
                decision = await router.route(tokens, request)
                assert router.last_fallback == "", (i, router.last_fallback)
                assert isinstance(decision, Backend), (i, decision)
                if expected is not None:
                    assert decision.name == expected, i
                await router.idle()  # the conductor decided on the same request (shadow)
                assert router.counters["shadow_disagreed"] == 0, list(router.disagreements)
                # Its first token: its prefill leaves the queues, and the instance's speed is
                # timed, here and at the conductor at the same instant (the shared clock);
                # from the new prompts on (timing changes the speeds, and so which engine
                # the expected choices above would take).
                prefilling.append(request.request_id)
                if expected is None:
                    for request_id in prefilling:
                        router.first_token(request_id)
                    prefilling.clear()
                    await router.idle()
                # Every third request stays outstanding: queues and reservations differ
                # between the engines, on both sides alike.
                if i % 3 == 2:
                    outstanding.append(request.request_id)
                else:
                    router.done(request.request_id, 8)
                    await router.idle()
                s.store(decision.name, tokens)  # vLLM stores the prompt it prefilled
                await s.settled()
            assert router.counters["local"] == len(prompts)
            assert router.counters["shadow_agreed"] == len(prompts)
            # Each turn of the conversation, and each prompt seen again, took its known blocks
            # from the engine index's chain memo instead of hashing them again.
            memo = router.engine_cache.chains
            assert memo.hits >= len(conversation) - 1 + 3
            assert memo.reused_blocks >= sum(len(t) // BLOCK for t in conversation[:-1])
            assert router.counters["fallback"] == 0
            for request_id in outstanding:
                router.done(request_id, 8)
            await router.idle()
            assert router.counters["report_failed"] == 0
            assert router.scheduler.outstanding() == 0
            # The first tokens calibrated both engines' speed here as at the conductor.
            speeds = router.scheduler.prefill_speed
            assert speeds.snapshot("v0").samples + speeds.snapshot("v1").samples > 0
        finally:
            await router.close()
            await client.close()

    aio.run(asyncio.wait_for(scenario(), 180))


def test_a_replica_cut_off_from_an_engine_asks_the_conductor(
        fleet: Fleet, aio: asyncio.Runner) -> None:
    rng = random.Random(12)
    tokens = _prompt(rng, 6)

    async def scenario() -> None:
        await fleet.register()
        client = ConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout)
        router = _router(fleet, client, BackendPool(POOL))
        s = Scenario(fleet, router, client)
        for publisher in fleet.publishers.values():
            publisher.start()
        try:
            # Before the replica agreed with the conductor once, the conductor decides.
            await router.start()
            first = await router.route(tokens, RouteRequest("early", "/v1/completions", MODEL,
                                                            8, False))
            assert isinstance(first, Backend)
            router.done("early", 8)
            await s.settled()
            # The front door's subscription to v1 dies silently (as a SUB socket cut off from
            # its publisher does: nothing arrives); v1 then stores the prompt.
            _, task = router.engine_events.followers["v1"]
            task.cancel()
            s.held["v1"].update(fleet.hashes.hashes(tokens))
            fleet.store("v1", tokens)

            polls = 0

            async def conductor_sees_it() -> bool:
                nonlocal polls
                polls += 1
                if polls % 10 == 0:
                    s.nudge()
                info = await client.leader_info()
                return {c.instance_id: c.blocks for c in info.engine_caches}["v1"] == \
                    len(s.held["v1"])

            await wait_until(conductor_sees_it, "the conductor applies v1's batch")

            async def stale() -> bool:
                return router.stale_reason() is not None

            await wait_until(stale, "the replica notices it is behind on v1")
            assert "v1" in str(router.stale_reason())
            decision = await router.route(tokens, RouteRequest("late", "/v1/completions", MODEL,
                                                               8, False))
            # The replica would have said v0 (it holds nothing of the prompt on v1): the
            # conductor's answer is the one taken.
            assert router.last_fallback.startswith("stale:"), router.last_fallback
            assert isinstance(decision, Backend) and decision.name == "v1"
            router.done("late", 8)
            await router.idle()
            assert router.counters["report_failed"] == 0
        finally:
            await router.close()
            await client.close()

    aio.run(asyncio.wait_for(scenario(), 180))


def test_without_a_conductor_the_front_door_refuses_rather_than_guess(
        fleet: Fleet, aio: asyncio.Runner) -> None:
    rng = random.Random(13)

    async def scenario() -> None:
        await fleet.register()
        client = ConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout,
                                 failover_timeout_s=1.0)
        router = _router(fleet, client, BackendPool(POOL))
        s = Scenario(fleet, router, client)
        for publisher in fleet.publishers.values():
            publisher.start()
        try:
            await router.start()
            await s.settled()
            decision = await router.route(_prompt(rng, 3), RouteRequest(
                "before", "/v1/completions", MODEL, 8, False))
            assert isinstance(decision, Backend) and router.last_fallback == ""
            router.done("before", 8)
            await router.idle()
            fleet.conductor.stop()

            async def stale() -> bool:
                return router.stale_reason() is not None

            await wait_until(stale, "the replica goes stale without its checks")
            decision = await router.route(_prompt(rng, 3), RouteRequest(
                "after", "/v1/completions", MODEL, 8, False))
            assert isinstance(decision, Rejection) and decision.status == 503, decision
            assert decision.code == "no_conductor"
        finally:
            await router.close()
            await client.close()

    aio.run(asyncio.wait_for(scenario(), 180))


def test_only_the_conductor_rejects(tmp_path: Path, etcd_server: LocalEtcd,
                                    etcd_layout: KeyLayout, aio: asyncio.Runner) -> None:
    """Admission stays with the conductor: a request the local scheduler would reject (its
    TTFT estimate over the target both run with) is asked of the conductor, whose answer, a
    429 here, is what the client gets; a request within the target is decided locally."""
    f = Fleet(tmp_path, etcd_server, etcd_layout)
    f.conductor.args += ["--ttft-slo-s", "0.1"]
    rng = random.Random(14)
    try:
        f.daemon.start()
        f.conductor.start()

        async def scenario() -> None:
            await f.register()
            client = ConductorClient(etcd_endpoint=f.etcd_url, layout=f.layout)
            router = LocalRouter(client, BackendPool(POOL), MODEL, etcd_endpoint=f.etcd_url,
                                 layout=f.layout, policy=Policy.GLOBAL_CACHE,
                                 block_size_tokens=BLOCK, ttft_slo_s=0.1,
                                 check_interval_s=0.2, max_check_age_s=2.0)
            s = Scenario(f, router, client)
            for publisher in f.publishers.values():
                publisher.start()
            try:
                await router.start()
                await s.settled()
                # ~4,000 new tokens: the default engine model's prefill estimate is ~0.19 s.
                long = RouteRequest("long", "/v1/completions", MODEL, 8, False)
                decision = await router.route(_prompt(rng, 125), long)
                assert router.last_fallback.startswith("rejected:"), router.last_fallback
                assert isinstance(decision, Rejection) and decision.status == 429, decision
                assert decision.code == "ttft_slo" and "rejected by the conductor" in \
                    decision.reason
                short = RouteRequest("short", "/v1/completions", MODEL, 8, False)
                decision = await router.route(_prompt(rng, 4), short)
                assert isinstance(decision, Backend) and router.last_fallback == ""
                router.done("short", 8)
                await router.idle()
                assert router.counters["shadow_agreed"] == 1
                assert router.counters["report_failed"] == 0
            finally:
                await router.close()
                await client.close()

        aio.run(asyncio.wait_for(scenario(), 180))
    finally:
        f.close()


def test_the_replica_schedules_the_instances_the_conductor_schedules() -> None:
    """The replica's copy of the conductor's instance sync (LocalRouter._sync_instances beside
    Conductor._sync_instances) on the same records and live nodes: prefill-only and
    decode-only engines, colocated pairs, an engine on a node that is not live, records that
    leave and a pair that splits; the same scheduled records and the same decisions after
    each change."""
    conductor = Conductor(ConductorConfig(etcd_endpoint="http://127.0.0.1:1",
                                          block_size_tokens=BLOCK))
    router = LocalRouter(ConductorClient(address="127.0.0.1:1"), BackendPool(), MODEL,
                         etcd_endpoint="http://127.0.0.1:1", block_size_tokens=BLOCK)

    def node(node_id: str) -> _NodeFollower:
        follower = _NodeFollower(NodeRecord(node_id, "127.0.0.1:1", "127.0.0.1:2", "h",
                                            {TierKind.DRAM: 1 << 20}, 0.0, "0"), 1)
        follower.connected = True
        return follower

    def rec(name: str, role: EngineRole, node_id: str, url: str | None,
            capacity: int = 0) -> EngineRecord:
        return EngineRecord(name, role, MODEL, node_id, http_url=url,
                            kv_capacity_tokens=capacity)

    records = {
        "p0": rec("p0", EngineRole.PREFILL, "n0", "http://10.0.0.1:1"),
        "d0": rec("d0", EngineRole.DECODE, "n0", "http://10.0.0.2:1", 1 << 20),
        "v0": rec("v0", EngineRole.PREFILL, "n1", "http://10.0.0.3:1"),
        "v0.decode": rec("v0.decode", EngineRole.DECODE, "n1", "http://10.0.0.3:1", 1 << 20),
        "x0": rec("x0", EngineRole.PREFILL, "n2", "http://10.0.0.4:1"),  # n2: not live
    }
    steps = [(dict(records), {"n0", "n1"}),
             ({k: v for k, v in records.items() if k != "d0"}, {"n0", "n1"}),
             ({k: v for k, v in records.items() if k != "v0.decode"}, {"n0", "n1", "n2"}),
             (dict(records), {"n1"})]
    for i, (recs, live) in enumerate(steps):
        conductor.engines = dict(recs)
        conductor.nodes = {n: node(n) for n in live}
        conductor._sync_instances()
        router.records = dict(recs)
        router.connected = set(live)
        router._sync_instances()
        for role in (EngineRole.PREFILL, EngineRole.DECODE):
            assert conductor.scheduled_instances(role) == sorted(
                r for r, v in router.instances.scheduled.items() if v.role is role), (i, role)
        choices = []
        for scheduler in (conductor.scheduler, router.scheduler):
            try:
                d = scheduler.schedule(ScheduleRequest(f"r{i}", MODEL, (), 5 * BLOCK, 8),
                                       100.0 + i)
            except InvalidArgument as exc:  # no decode instance left, on both sides alike
                choices.append(("refused", str(exc)))
            else:
                choices.append((d.prefill_instance, d.decode_instance))
        assert choices[0] == choices[1], (i, choices)


def test_the_replica_prices_the_store_as_the_conductor_does(
        same_clock_fleet: Fleet, aio: asyncio.Runner) -> None:
    """Engines with kvtier's connector (their records carry its KV fingerprint): the front door
    follows the daemons' chunk events as the conductor does (``conductor.node_events``), hashes
    the prompt into the connector's keys as the conductor does (``conductor.store_keys``), and
    decides in process with the same answers, where it used to hand every such request to the
    conductor (``fallback:store-keys``). v0 on node-a, v1 on node-b; what node-b's daemon holds
    sends a prompt to v1, which nothing else would (ties go to v0); a chunk removed from the
    daemon is a prefix no longer priced, here as there."""
    fleet = same_clock_fleet
    rng = random.Random(13)
    tenant = "salt-13"
    fingerprint = KVFingerprint(MODEL, KVDtype.FLOAT32, num_layers=2, num_kv_heads=2,
                                head_dim=16, block_size_tokens=BLOCK)
    connector = BlockHasher(Namespace(fingerprint, tenant), mode=HashMode.SHA256_CBOR,
                            vllm_hash_seed=SEED)
    in_store = _prompt(rng, 6)
    nowhere = _prompt(rng, 6)
    node_b = DaemonProcess(fleet.work, "node-b", etcd_endpoint=fleet.etcd_url,
                           etcd_prefix=fleet.layout.prefix, nvme=False)
    node_b.start()
    keys = connector.hash_blocks(in_store)
    with StoreClient.connect(node_b.grpc_address) as store:
        parent = None
        for key in keys[:4]:
            store.put(key, b"k" * 4096, parent=parent)
            parent = key

    async def scenario() -> None:
        async with etcd_client(fleet.etcd_url) as etcd:
            for i, (name, node) in enumerate((("v0", NODE), ("v1", "node-b"))):
                url = f"http://127.0.0.1:{9 + i}"
                await put_engine_record(etcd, EngineRecord(
                    name, EngineRole.PREFILL, MODEL, node, http_url=url,
                    vllm_kv_events=fleet.specs[name], kv_fingerprint=fingerprint),
                    layout=fleet.layout)
                await put_engine_record(etcd, EngineRecord(
                    f"{name}.decode", EngineRole.DECODE, MODEL, node,
                    kv_capacity_tokens=1 << 30, http_url=url), layout=fleet.layout)
        client = ConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout)
        router = _router(fleet, client, BackendPool(POOL), send_clock=True)
        for publisher in fleet.publishers.values():
            publisher.start()
        try:
            await router.start()
            s = Scenario(fleet, router, client)
            await s.settled()

            async def indexed() -> bool:
                lookup = await client.lookup(token_ids=in_store, model=MODEL, tenant=tenant)
                return lookup.best_blocks == 4 and \
                    router.index.match(keys, None).length("node-b") == 4

            await wait_until(indexed, "the conductor and the front door index node-b's chunks")
            for i, (tokens, expected) in enumerate([(in_store, "v1"), (nowhere, "v0"),
                                                    (in_store, "v1")]):
                request = RouteRequest(f"req-{i}", "/v1/completions", MODEL, 8, False,
                                       tenant=tenant)
                decision = await router.route(tokens, request)
                assert router.last_fallback == "", (i, router.last_fallback)
                assert isinstance(decision, Backend) and decision.name == expected, i
                await router.idle()
                assert router.counters["shadow_disagreed"] == 0, list(router.disagreements)
                router.done(request.request_id, 8)
                await router.idle()
            # node-b drops the prefix's first block: nothing of it is a prefix any more.
            with StoreClient.connect(node_b.grpc_address) as store:
                store.remove(keys[0])

            async def forgotten() -> bool:
                lookup = await client.lookup(token_ids=in_store, model=MODEL, tenant=tenant)
                return lookup.best_blocks == 0 and \
                    router.index.match(keys, None).length("node-b") == 0

            await wait_until(forgotten, "both forget the removed block")
            decision = await router.route(in_store, RouteRequest(
                "req-last", "/v1/completions", MODEL, 8, False, tenant=tenant))
            assert isinstance(decision, Backend) and decision.name == "v0"
            await router.idle()
            router.done("req-last", 8)
            await router.idle()
            assert router.counters["local"] == 4 and router.counters["fallback"] == 0
            assert router.counters["shadow_agreed"] == 4
            assert router.counters["report_failed"] == 0
        finally:
            await router.close()
            await client.close()
            node_b.stop()

    aio.run(asyncio.wait_for(scenario(), 180))

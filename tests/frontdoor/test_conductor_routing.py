"""The front door's conductor routing on engines' KV events, through real processes: etcd, a store
daemon (engines are schedulable only on a live node), a ``kvtier conductor``, and two vLLM-like
instances registered as the fleet registers its ``vllm serve`` servers (a prefill record with
``vllm_kv_events``, a colocated decode record, no KV fingerprint), whose KV events are vLLM's wire
format on real ZMQ sockets (``bench.routing.KvEventPublisher``: a PUB socket and the replay
ROUTER). No vLLM runs; tests/control/test_vllm_engine_events.py checks the hashes against one.

What is checked: the decisions of ``ConductorRouter`` (the conductor's Schedule: token ids as a
numpy array, one hashing per prompt kept for the mismatch probe, a conversation's next turn
hashed from the chain memo) name the instance holding the prompt's prefix, and its cached tokens
are exactly those ``Lookup`` computes for the same prompt by hashing it whole; the routed
prompt's last block is probed and matched once the engine stores it. Every wait polls a
condition with a deadline; no timed assertions.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from bench.routing import KvEventPublisher
from conductor.engine_index import VllmBlockHashes
from kvstore.frontdoor.instrument import ReportingConductorRouter, TicketingConductorClient
from kvstore.frontdoor.router import Backend, BackendPool, ConductorRouter, RouteRequest
from kvstore.membership.engines import (
    EngineRecord,
    EngineRole,
    VllmKvEvents,
    put_engine_record,
)
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess

BLOCK = 32
MODEL = "fleet-like"
NODE = "node-a"
SEED = "0"


def spec(work: Path, name: str) -> VllmKvEvents:
    return VllmKvEvents(endpoint=f"ipc://{work}/{name}-kv.sock",
                        replay_endpoint=f"ipc://{work}/{name}-replay.sock", topic="kv",
                        hash_algo="sha256_cbor", hash_seed=SEED, block_size_tokens=BLOCK)


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0
                     ) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.1)


class Fleet:
    """The real processes and the two engines' event sockets of one test."""

    def __init__(self, work: Path, etcd: LocalEtcd, layout: KeyLayout) -> None:
        self.work = work
        self.etcd_url = etcd.client_url
        self.layout = layout
        self.specs = {name: spec(work, name) for name in ("v0", "v1")}
        self.publishers = {name: KvEventPublisher(s.endpoint, str(s.replay_endpoint))
                           for name, s in self.specs.items()}
        self.hashes = VllmBlockHashes(self.specs["v0"])
        self.daemon = DaemonProcess(work, NODE, etcd_endpoint=etcd.client_url,
                                    etcd_prefix=layout.prefix, nvme=False)
        self.conductor = ConductorProcess(work, "c0", etcd_endpoint=etcd.client_url,
                                          prefix=layout.prefix, extra_args=(
                                              "--block-size-tokens", str(BLOCK),
                                              "--policy", "global-cache"))

    def store(self, name: str, tokens: list[int], blocks: int | None = None) -> None:
        """The engine ``name`` stores the first ``blocks`` (default: all full) blocks."""
        hashes = self.hashes.hashes(tokens)[:blocks]
        self.publishers[name].add_stored([(hashes, tokens[: len(hashes) * BLOCK])])

    async def register(self) -> None:
        async with etcd_client(self.etcd_url) as etcd:
            for i, (name, s) in enumerate(self.specs.items()):
                url = f"http://127.0.0.1:{9 + i}"
                await put_engine_record(etcd, EngineRecord(
                    name, EngineRole.PREFILL, MODEL, NODE, http_url=url, vllm_kv_events=s),
                    layout=self.layout)
                await put_engine_record(etcd, EngineRecord(
                    f"{name}.decode", EngineRole.DECODE, MODEL, NODE, kv_capacity_tokens=1 << 30,
                    http_url=url), layout=self.layout)

    def close(self) -> None:
        self.conductor.stop()
        self.daemon.stop()
        for publisher in self.publishers.values():
            publisher.close()


@pytest.fixture
def fleet(tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout) -> Iterator[Fleet]:
    f = Fleet(tmp_path, etcd_server, etcd_layout)
    try:
        f.daemon.start()
        f.conductor.start()
        yield f
    finally:
        f.close()


def test_decisions_follow_the_engines_caches_through_a_conversation(
        fleet: Fleet, aio: asyncio.Runner) -> None:
    rng = random.Random(7)
    first = [rng.randrange(3, 32000) for _ in range(5 * BLOCK + 3)]
    fleet.store("v1", first, blocks=3)  # before the conductor follows v1: learned by replay
    for publisher in fleet.publishers.values():
        publisher.start()
    pool = BackendPool([Backend("v0", "http://127.0.0.1:9"), Backend("v1", "http://127.0.0.1:10")])

    async def scenario() -> None:
        await fleet.register()
        client = TicketingConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout)
        try:
            async def ready() -> bool:
                info = await client.leader_info()
                caches = {c.instance_id: c.blocks for c in info.engine_caches}
                return info.is_leader and len(info.prefill_instances) == 2 and \
                    caches == {"v0": 0, "v1": 3}

            await wait_until(ready, "the conductor follows both engines")
            router = ConductorRouter(client, pool, MODEL)
            prompts = [first]  # a conversation: each turn the previous prompt, a reply, a message
            for _ in range(5):
                prompts.append(prompts[-1] + [rng.randrange(3, 32000)
                                              for _ in range(rng.randrange(BLOCK, 4 * BLOCK))])
            for turn, tokens in enumerate(prompts):
                request = RouteRequest(f"turn-{turn}", "/v1/completions", MODEL, 8, False)
                decision = await router.route(tokens, request)
                reply = client.decisions[-1]
                lookup = await client.lookup(token_ids=tokens, model=MODEL)
                by_lookup = {e.instance_id: e.cached_tokens for e in lookup.engines}
                assert isinstance(decision, Backend) and decision.name == "v1", (turn, decision)
                held = 3 if turn == 0 else len(prompts[turn - 1]) // BLOCK
                assert reply.engine_cached_tokens == held * BLOCK == by_lookup["v1"], turn
                assert by_lookup["v0"] == 0
                await client.finish(8)
                # v1 prefills the prompt: its events now hold every full block of it.
                fleet.store("v1", tokens)
                want = len(tokens) // BLOCK

                async def stored(want: int = want) -> bool:
                    info = await client.leader_info()
                    return bool({c.instance_id: c.blocks
                                 for c in info.engine_caches}["v1"] == want)

                await wait_until(stored, f"v1 holds turn {turn}'s blocks")
            info = await client.leader_info()
            v1 = next(c for c in info.engine_caches if c.instance_id == "v1")
            # Every turn added blocks v1 did not hold: each was probed, and each seen stored.
            assert (v1.probes, v1.probes_matched, v1.mismatch) == (len(prompts), len(prompts),
                                                                    "")
        finally:
            await client.close()

    aio.run(asyncio.wait_for(scenario(), 120))


def test_a_prompt_held_nowhere_is_placed_and_probed_on_the_chosen_engine(
        fleet: Fleet, aio: asyncio.Runner) -> None:
    for publisher in fleet.publishers.values():
        publisher.start()
    pool = BackendPool([Backend("v0", "http://127.0.0.1:9"), Backend("v1", "http://127.0.0.1:10")])
    rng = random.Random(9)

    async def scenario() -> None:
        await fleet.register()
        client = TicketingConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout)
        try:
            async def ready() -> bool:
                info = await client.leader_info()
                return bool(info.is_leader) and len(info.engine_caches) == 2

            await wait_until(ready, "the conductor follows both engines")
            router = ConductorRouter(client, pool, MODEL)
            tokens = [rng.randrange(3, 32000) for _ in range(4 * BLOCK + 5)]
            for attempt in range(2):  # the same prompt twice: the second is hashed from memo
                decision = await router.route(tokens, RouteRequest(
                    f"new-{attempt}", "/v1/completions", MODEL, 8, False))
                assert isinstance(decision, Backend)
                assert client.decisions[-1].engine_cached_tokens == 0
                await client.finish(8)
            info = await client.leader_info()
            probes = {c.instance_id: (c.probes, c.probes_matched) for c in info.engine_caches}
            assert sum(p for p, _ in probes.values()) == 2
            assert all(m == 0 for _, m in probes.values())
        finally:
            await client.close()

    aio.run(asyncio.wait_for(scenario(), 120))


def test_the_reporting_router_releases_each_request_when_it_ends(
        fleet: Fleet, aio: asyncio.Runner) -> None:
    """Requests in flight at once (the fleet's chat arrivals): the front door's ``done`` hook
    reports each one's own ticket to the real conductor, the others stay outstanding."""
    for publisher in fleet.publishers.values():
        publisher.start()
    pool = BackendPool([Backend("v0", "http://127.0.0.1:9"), Backend("v1", "http://127.0.0.1:10")])
    rng = random.Random(11)

    async def scenario() -> None:
        await fleet.register()
        client = TicketingConductorClient(etcd_endpoint=fleet.etcd_url, layout=fleet.layout)
        try:
            async def ready() -> bool:
                info = await client.leader_info()
                return bool(info.is_leader) and len(info.engine_caches) == 2

            await wait_until(ready, "the conductor follows both engines")
            router = ReportingConductorRouter(client, pool, MODEL)
            for name in ("a", "b", "c"):
                tokens = [rng.randrange(3, 32000) for _ in range(2 * BLOCK + 1)]
                decision = await router.route(tokens, RouteRequest(
                    name, "/v1/completions", MODEL, 8, False))
                assert isinstance(decision, Backend)
            tickets = dict(client.outstanding)
            assert sorted(tickets) == ["a", "b", "c"] and len(set(tickets.values())) == 3
            router.done("b", 8)
            router.done("nobody", 0)  # no ticket: nothing to report
            await client.settle()  # the conductor took the report (else its error is raised)
            assert client.outstanding == {"a": tickets["a"], "c": tickets["c"]}
            router.done("a")
            router.done("c")
            await client.settle()
            assert client.outstanding == {}
        finally:
            await client.close()

    aio.run(asyncio.wait_for(scenario(), 120))

"""The conductor follows a real vLLM's own prefix cache through its KV events, and routes by it.

One module-scoped set of real components: etcd, a store daemon (engines are schedulable only on
a live node), a vLLM instance (``VllmProcess``: the tiny Llama, ``sha256_cbor``, KV events on
ZMQ ipc sockets with a replay socket, 64-bit int hashes: vLLM's default) registered in etcd by
the sidecar (:func:`hold_while_healthy`, its health = the vLLM process is alive), and the real
conductor (in this process, so that a test can drop a live batch deliberately). vLLM starts
once (40-80 s here); the tests run in file order on it, the last one stops it.

* The conductor subscribes only after vLLM served a prompt (a late subscriber): its first
  replay from seq 0 brings those blocks; Lookup and Schedule name the instance with exactly the
  cached prefix vLLM itself then reports (``num_cached_tokens``); every stored block the
  conductor could re-hash agreed with vLLM's hash; a second record for the same engine with the
  wrong hash seed is reported as a mismatch and never matched.
* A live batch dropped on purpose opens a gap the replay repairs.
* ``reset_prefix_cache`` (AllBlocksCleared, published with the next step's batch) empties the view.
* The stopped instance's record goes, and its view leaves the conductor.

No timed assertions: every wait polls a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from conductor.server import Conductor, ConductorConfig
from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore._proto.kvtier.v1 import conductor_pb2_grpc as pb_grpc
from kvstore.cluster.vllm_instance import HASH_SEED, VllmProcess, tiny_llama_checkpoint
from kvstore.membership.engines import (
    EngineRecord,
    EngineRole,
    VllmKvEvents,
    list_engines,
    put_engine_record,
)
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.membership.vllm_registration import hold_while_healthy
from tests.support.daemon import DaemonProcess

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
BLOCK = 32
NODE = "node-v"
ENGINE = "vllm-a"
WRONG_SEED = "vllm-a-wrong-seed"
OTHER = "aaa-no-cache"
"""A prefill instance on the same node without an own cache: ids break ties, and it sorts first."""


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 + 3 for i in range(n)]


class Rpc:
    """The conductor's RPCs on one channel (the conductor is the only one: it leads)."""

    def __init__(self) -> None:
        self.channel: grpc.aio.Channel | None = None
        self.stub: Any = None

    def connect(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.ConductorStub(self.channel)  # type: ignore[no-untyped-call]

    async def lookup(self, *, token_ids: list[int], model: str) -> Any:
        return await self.stub.Lookup(pb.ConductorLookupRequest(model=model, token_ids=token_ids),
                                      timeout=10)

    async def schedule(self, request_id: str, model: str, *, token_ids: list[int]) -> Any:
        return await self.stub.Schedule(pb.ScheduleRequest(
            request_id=request_id, model=model, token_ids=token_ids), timeout=10)

    async def leader_info(self) -> Any:
        return await self.stub.Leader(pb.LeaderRequest(), timeout=10)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


@dataclass
class Fleet:
    aio: asyncio.Runner
    llm: VllmProcess
    conductor: Conductor
    client: Rpc
    sidecar: asyncio.Task[None]
    etcd_url: str
    layout: KeyLayout

    def run(self, scenario: Coroutine[Any, Any, None], timeout_s: float = 120.0) -> None:
        async def bounded() -> None:
            async with asyncio.timeout(timeout_s):
                await scenario

        self.aio.run(bounded())

    async def generate(self, prompt: list[int]) -> int:
        """Serve one prompt on vLLM (off the loop: the conductor keeps running); the prompt
        tokens vLLM found in its own prefix cache."""
        result = await asyncio.to_thread(self.llm.generate, [prompt], max_tokens=2)
        return result.outputs[0].num_cached_tokens

    async def lookup(self, prompt: list[int]) -> dict[str, tuple[int, bool]]:
        reply = await self.client.lookup(token_ids=prompt, model=MODEL)
        return {e.instance_id: (e.cached_tokens, e.mismatch) for e in reply.engines}

    async def caches(self) -> dict[str, Any]:
        info = await self.client.leader_info()
        return {c.instance_id: c for c in info.engine_caches}


async def wait_for(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


FIRST = tokens(1, 200)   # served before the conductor subscribes: 6 full blocks
SHARED = FIRST[:160] + tokens(2, 40)  # shares 5 blocks with FIRST


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, etcd_server: LocalEtcd,
          aio: asyncio.Runner) -> Iterator[Fleet]:
    work = tmp_path_factory.mktemp("vllm-events")
    layout = KeyLayout(prefix=f"/kvtier-test/vllm-events-{uuid.uuid4().hex[:8]}/")
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"ipc://{work}/events.sock",
              "replay_endpoint": f"ipc://{work}/replay.sock"}
    llm = VllmProcess(tiny_llama_checkpoint(), work, "vllm-a", block_size=BLOCK,
                      engine_kwargs={"kv_events_config": events},
                      env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "1"}, single_process=True)
    daemon = DaemonProcess(work, NODE, etcd_endpoint=etcd_server.client_url,
                           etcd_prefix=layout.prefix, nvme=False)
    conductor = Conductor(ConductorConfig(etcd_endpoint=etcd_server.client_url,
                                          conductor_id="c-vllm", layout=layout,
                                          election_ttl_s=10))
    client = Rpc()
    kv_bytes_per_block = BLOCK * 2 * 2 * 2 * 64 * 4  # tokens x K,V x layers x heads x dim x f32
    spec = VllmKvEvents(endpoint=events["endpoint"], replay_endpoint=events["replay_endpoint"],
                        topic="kv", block_size_tokens=BLOCK, hash_seed=HASH_SEED,
                        num_blocks=(32 << 20) // kv_bytes_per_block)
    records = [EngineRecord(ENGINE, EngineRole.PREFILL, MODEL, NODE, vllm_kv_events=spec),
               EngineRecord(WRONG_SEED, EngineRole.PREFILL, MODEL, NODE,
                            vllm_kv_events=VllmKvEvents(
                                endpoint=spec.endpoint, replay_endpoint=spec.replay_endpoint,
                                topic="kv", block_size_tokens=BLOCK, hash_seed="1"))]
    sidecar: asyncio.Task[None] | None = None
    try:
        llm.start()
        # Served before anyone subscribes: only a replay can tell the conductor about it.
        assert llm.generate([FIRST], max_tokens=2).outputs[0].num_cached_tokens == 0
        daemon.start()

        async def alive() -> bool:
            return llm.alive()

        async def up() -> asyncio.Task[None]:
            async with etcd_client(etcd_server.client_url) as etcd:
                await put_engine_record(etcd, EngineRecord(
                    "decode-0", EngineRole.DECODE, MODEL, NODE, kv_capacity_tokens=100_000),
                    layout=layout)
                await put_engine_record(etcd, EngineRecord(OTHER, EngineRole.PREFILL, MODEL,
                                                           NODE), layout=layout)
            client.connect(await conductor.start())
            etcd = etcd_client(etcd_server.client_url)
            task = asyncio.get_running_loop().create_task(hold_while_healthy(
                etcd, records, alive, ttl_s=10, layout=layout, poll_interval_s=0.1,
                failures_to_drop=1))
            task.add_done_callback(lambda _: asyncio.ensure_future(etcd.close()))
            return task

        sidecar = aio.run(up())
        yield Fleet(aio, llm, conductor, client, sidecar, etcd_server.client_url, layout)
    finally:
        async def down() -> None:
            if sidecar is not None:
                sidecar.cancel()
                await asyncio.gather(sidecar, return_exceptions=True)
            await client.close()
            await conductor.stop()

        aio.run(down())
        llm.close()
        daemon.stop()


def test_a_late_subscriber_learns_the_cache_by_replay_and_routes_to_it(fleet: Fleet) -> None:
    async def scenario() -> None:
        async def followed() -> bool:
            return ENGINE in await fleet.caches()

        await wait_for(followed, "the sidecar's record to reach the conductor")
        await wait_for(lambda: _cached(fleet, FIRST, 192), "the replayed view of FIRST")
        # Exactly vLLM's own block granularity: 5 shared full blocks of SHARED, 6 of FIRST.
        assert (await fleet.lookup(SHARED))[ENGINE] == (160, False)
        assert (await fleet.lookup(FIRST + tokens(3, 50)))[ENGINE] == (192, False)
        assert (await fleet.lookup(tokens(4, 100)))[ENGINE] == (0, False)
        reply = await fleet.client.schedule("r-shared", MODEL, token_ids=SHARED)
        assert reply.accepted, reply.message
        # OTHER would win the tie (no cache anywhere, and its id sorts first).
        assert (reply.prefill_instance, reply.engine_cached_tokens) == (ENGINE, 160)
        cold = await fleet.client.schedule("r-cold", MODEL, token_ids=tokens(5, 100))
        assert (cold.prefill_instance, cold.engine_cached_tokens) == (OTHER, 0)
        # What vLLM itself finds cached when it serves SHARED: what the conductor predicted.
        assert await fleet.generate(SHARED) == 160
        caches = await fleet.caches()
        good = caches[ENGINE]
        assert good.replayed_batches >= 1 and good.verified_blocks >= 1
        assert (good.hash_mismatches, good.mismatch, good.unrecoverable_gaps) == (0, "", 0)
        # The record with the wrong seed: its events cannot be its hashes.
        await wait_for(lambda: _mismatched(fleet, WRONG_SEED), "the wrong seed's mismatch")
        assert (await fleet.lookup(FIRST))[WRONG_SEED] == (0, True)
        assert (await fleet.caches())[WRONG_SEED].hash_mismatches >= 1

    fleet.run(scenario())


def test_a_salted_prompt_verifies_and_matches_under_its_salt(fleet: Fleet) -> None:
    """A prompt served with a ``cache_salt`` (what the front door sends per tenant, and the
    fleet bench per mode): its root block is re-hashed with the salt and agrees with vLLM's
    hash (no mismatch), and a lookup under that salt, and only under it, finds the blocks."""
    salted = tokens(6, 130)  # 4 full blocks

    async def scenario() -> None:
        before = (await fleet.caches())[ENGINE].verified_blocks
        result = await asyncio.to_thread(fleet.llm.generate, [salted], max_tokens=2,
                                         cache_salt="tenant-x")
        assert result.outputs[0].num_cached_tokens == 0

        async def seen() -> bool:
            reply = await fleet.client.stub.Lookup(pb.ConductorLookupRequest(
                model=MODEL, tenant="tenant-x", token_ids=salted), timeout=10)
            return any(e.instance_id == ENGINE and e.cached_tokens == 128 for e in reply.engines)

        await wait_for(seen, "the salted prompt's blocks under its salt")
        good = (await fleet.caches())[ENGINE]
        assert (good.hash_mismatches, good.mismatch) == (0, "")
        assert good.verified_blocks > before
        assert (await fleet.lookup(salted))[ENGINE] == (0, False)  # unsalted: another chain

    fleet.run(scenario())


def test_a_dropped_live_batch_is_repaired_by_replay(fleet: Fleet) -> None:
    async def scenario() -> None:
        follower, _ = fleet.conductor.engine_events.followers[ENGINE]
        before = (await fleet.caches())[ENGINE]
        lost, after = tokens(6, 128), tokens(7, 96)
        follower.drop_live_batches = 1
        await fleet.generate(lost)   # its batch is dropped: the view lacks it
        await wait_for(lambda: _true(follower.drop_live_batches == 0), "the drop")
        assert (await fleet.lookup(lost))[ENGINE] == (0, False)
        await fleet.generate(after)  # the next batch reveals the gap: replay
        await wait_for(lambda: _cached(fleet, lost, 128), "the repaired view of the lost prompt")
        assert (await fleet.lookup(after))[ENGINE] == (96, False)
        now = (await fleet.caches())[ENGINE]
        assert now.gaps == before.gaps + 1
        assert now.gaps_repaired == before.gaps_repaired + 1
        assert now.resets == before.resets and now.unrecoverable_gaps == 0

    fleet.run(scenario())


def test_a_cleared_cache_empties_the_view(fleet: Fleet) -> None:
    async def scenario() -> None:
        assert (await fleet.lookup(FIRST))[ENGINE][0] > 0
        before = (await fleet.caches())[ENGINE]
        assert await asyncio.to_thread(fleet.llm.reset_prefix_cache)
        # vLLM publishes the AllBlocksCleared of an idle engine with its next step's batch.
        fresh = tokens(8, 64)
        await fleet.generate(fresh)
        await wait_for(lambda: _cached(fleet, fresh, 64), "the batch after the clear")
        assert (await fleet.lookup(FIRST))[ENGINE] == (0, False)
        caches = (await fleet.caches())[ENGINE]
        assert caches.cleared == before.cleared + 1 and caches.blocks == 2
        assert caches.restarts == 0

    fleet.run(scenario())


def test_a_stopped_instance_leaves_the_index(fleet: Fleet) -> None:
    async def scenario() -> None:
        assert ENGINE in await fleet.caches()
        await asyncio.to_thread(fleet.llm.close)

        async def gone() -> bool:
            return ENGINE not in await fleet.caches()

        await wait_for(gone, "the stopped engine to leave the conductor")
        # No engine of the model publishes events (or a fingerprint) any more: token ids
        # cannot be matched against anything, which is an error, not an empty answer. (Right
        # after an engine left etcd the conductor may answer UNAVAILABLE for a moment while it
        # checks whether etcd revoked every lease at once: docs/conductor.md; retried.)
        codes: list[grpc.StatusCode] = []

        async def refused_for_good() -> bool:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await fleet.lookup(FIRST)
            codes.append(err.value.code())
            return codes[-1] is not grpc.StatusCode.UNAVAILABLE

        await wait_for(refused_for_good, "a definite answer", timeout_s=20.0)
        assert codes[-1] is grpc.StatusCode.INVALID_ARGUMENT, codes
        async with etcd_client(fleet.etcd_url) as etcd:
            assert ENGINE not in await list_engines(etcd, layout=fleet.layout)
        assert ENGINE not in fleet.conductor.engine_events.followers

    fleet.run(scenario())


async def _cached(fleet: Fleet, prompt: list[int], want: int) -> bool:
    return (await fleet.lookup(prompt)).get(ENGINE, (-1, False))[0] == want


async def _mismatched(fleet: Fleet, instance_id: str) -> bool:
    return bool((await fleet.caches())[instance_id].mismatch)


async def _true(value: bool) -> bool:
    return value

"""The conductor service end to end: real etcd, store daemons and conductors in separate
processes, a client in this one.

Faults: a daemon SIGKILLed while requests are being scheduled, etcd stopped and started
again, the leader SIGKILLed in the middle of a stream of requests, malformed requests.
Every wait is bounded; nothing sleeps for a fixed time to make something happen.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore._proto.kvtier.v1 import conductor_pb2_grpc as pb_grpc
from kvstore.client.conductor_client import ConductorClient
from kvstore.client.store_client import StoreClient
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, KVDtype, KVFingerprint, Namespace
from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.wire import LEADER_METADATA_KEY
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess

MODEL = "tiny-model"
BLOCK_TOKENS = 512
FINGERPRINT = KVFingerprint(MODEL, KVDtype.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=8,
                            block_size_tokens=BLOCK_TOKENS)
HASHER = BlockHasher(Namespace(FINGERPRINT))
CHUNK = b"k" * 4096


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i) % 50_000 for i in range(blocks * BLOCK_TOKENS)]


def run(aio: asyncio.Runner, scenario: Coroutine[Any, Any, None], timeout_s: float = 60.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await scenario

    aio.run(bounded())


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Poll ``check`` until it returns True; the seconds it took. Fails after ``timeout_s``."""
    start = time.monotonic()
    while not await check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


class Cluster:
    """Daemons and conductors of one test, sharing one etcd and one key prefix."""

    def __init__(self, work_dir: Path, etcd_url: str, layout: KeyLayout) -> None:
        self.work_dir = work_dir
        self.etcd_url = etcd_url
        self.layout = layout
        self.daemons: dict[str, DaemonProcess] = {}
        self.conductors: dict[str, ConductorProcess] = {}

    def daemon(self, node_id: str, settings: dict[str, str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess(self.work_dir, node_id, etcd_endpoint=self.etcd_url,
                               etcd_prefix=self.layout.prefix, nvme=False, settings=settings)
        self.daemons[node_id] = daemon
        daemon.start()
        return daemon

    def conductor(self, conductor_id: str, *extra: str) -> ConductorProcess:
        conductor = ConductorProcess(self.work_dir, conductor_id, etcd_endpoint=self.etcd_url,
                                     prefix=self.layout.prefix, extra_args=extra)
        self.conductors[conductor_id] = conductor
        conductor.start()
        return conductor

    def store_chain(self, node_id: str, token_ids: list[int]) -> list[bytes]:
        """Put every full block of ``token_ids`` into ``node_id`` (chained parents)."""
        keys = HASHER.hash_blocks(token_ids)
        with StoreClient.connect(self.daemons[node_id].grpc_address) as store:
            parent: bytes | None = None
            for key in keys:
                store.put(key, CHUNK, parent=parent)
                parent = key
        return list(keys)

    async def engines(self, *records: EngineRecord) -> None:
        async with etcd_client(self.etcd_url) as client:
            for record in records:
                await put_engine_record(client, record, layout=self.layout)

    def key_gone(self, node_id: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            async with etcd_client(self.etcd_url) as etcd:
                return await etcd.get(self.layout.node_key(node_id).encode()) is None

        return check

    def client(self, **kwargs: Any) -> ConductorClient:
        return ConductorClient(etcd_endpoint=self.etcd_url, layout=self.layout, **kwargs)

    def close(self) -> None:
        for conductor in self.conductors.values():
            conductor.stop()
        for daemon in self.daemons.values():
            daemon.stop()


@pytest.fixture
def cluster(tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout) -> Iterator[Cluster]:
    c = Cluster(tmp_path, etcd_server.client_url, etcd_layout)
    try:
        yield c
    finally:
        c.close()


def prefill(instance_id: str, node_id: str) -> EngineRecord:
    return EngineRecord(instance_id, EngineRole.PREFILL, MODEL, node_id,
                        kv_fingerprint=FINGERPRINT)


def decode(instance_id: str, node_id: str) -> EngineRecord:
    return EngineRecord(instance_id, EngineRole.DECODE, MODEL, node_id,
                        kv_capacity_tokens=50_000_000)


async def ready(client: ConductorClient, *, nodes: set[str], prefill_ids: set[str],
                timeout_s: float = 15.0) -> None:
    async def check() -> bool:
        info = await client.leader_info()
        return set(info.live_nodes) >= nodes and set(info.prefill_instances) >= prefill_ids \
            and len(info.decode_instances) > 0

    await wait_until(check, timeout_s, f"leader sees nodes {nodes} and engines {prefill_ids}")


def names(reply: pb.ScheduleReply) -> set[str]:
    """Every node a decision sends work or reads to."""
    out = {reply.prefill_node}
    if reply.HasField("fetch"):
        out |= {reply.fetch.src_node, reply.fetch.dst_node}
    if reply.HasField("replicate"):
        out |= {reply.replicate.src_node, *reply.replicate.dst_nodes}
    return out


# --------------------------------------------------------------------------- happy path + bad input


def test_schedule_lookup_follower_and_malformed_requests(aio: asyncio.Runner,
                                                         cluster: Cluster) -> None:
    cluster.daemon("node-a")
    cluster.daemon("node-b")
    leader = cluster.conductor("c-1")
    chain = tokens(1, 6)
    keys_b = cluster.store_chain("node-b", chain)           # node-b holds 6 blocks
    cluster.store_chain("node-a", chain[:2 * BLOCK_TOKENS])  # node-a holds the first 2

    async def scenario() -> None:
        await cluster.engines(prefill("p-a", "node-a"), decode("d-a", "node-a"))
        async with cluster.client() as client:
            await ready(client, nodes={"node-a", "node-b"}, prefill_ids={"p-a"})

            async def indexed() -> bool:
                return (await client.lookup(keys=keys_b)).best_blocks == 6

            await wait_until(indexed, 10.0, "the chain is indexed")
            by_keys = await client.lookup(keys=keys_b)
            by_tokens = await client.lookup(token_ids=chain, model=MODEL)
            assert by_keys == by_tokens
            assert {(m.node_id, m.blocks, m.tiers.dram) for m in by_keys.nodes} == {
                ("node-a", 2, 2), ("node-b", 6, 6)}

            # The only prefill engine sits on node-a: reuse 2 blocks locally, fetch 4 from b.
            reply = await client.schedule("r-1", MODEL, token_ids=[*chain, 1, 2, 3])
            assert reply.accepted, reply.message
            assert (reply.prefill_instance, reply.prefill_node, reply.decode_instance) == (
                "p-a", "node-a", "d-a")
            assert (reply.local_blocks, reply.prefix_blocks) == (2, 6)
            assert (reply.fetch.src_node, reply.fetch.first_block, reply.fetch.end_block) == (
                "node-b", 2, 6)
            assert reply.fetch.src_tiers.dram == 4
            assert reply.fetch.src_tcp_address == cluster.daemons["node-b"].addresses[
                "tcp_address"]
            assert reply.ticket > 0 and reply.conductor_id == "c-1"
            await client.report_completion(pb.CompletionReport(
                ticket=reply.ticket, prefill=pb.PrefillDone(prefill_s=0.05)))
            await client.report_completion(pb.CompletionReport(
                ticket=reply.ticket, decode=pb.DecodeDone(output_tokens=10)))
            assert await client.report_load("p-a", queued_prefill_tokens=100)
            assert not await client.report_load("nobody")

            # Bad input: INVALID_ARGUMENT with a message naming the problem; nothing placed.
            bad: list[tuple[dict[str, Any], str]] = [
                ({"request_id": "", "model": MODEL, "keys": keys_b, "input_tokens": 9999},
                 "request_id"),
                ({"request_id": "x", "model": "no-such-model", "keys": keys_b,
                  "input_tokens": 9999}, "no prefill instance serves model 'no-such-model'"),
                ({"request_id": "x", "model": MODEL, "keys": keys_b, "token_ids": chain},
                 "either keys or token_ids"),
                ({"request_id": "x", "model": MODEL, "keys": [b"k" * 65], "input_tokens": 512},
                 "1 to 64 bytes"),
                ({"request_id": "x", "model": MODEL, "keys": keys_b}, "input_tokens must be > 0"),
                ({"request_id": "x", "model": MODEL, "keys": keys_b, "input_tokens": 100},
                 "6 block keys for 100 tokens"),
                ({"request_id": "x", "model": "no-fp", "token_ids": chain},
                 "no engine of it published a KV fingerprint"),
            ]
            for fields, message in bad:
                with pytest.raises(InvalidArgument, match=message):
                    await client.schedule(**fields)
            # A batch: each item is decided or refused on its own.
            items = await client.schedule_batch([
                pb.ScheduleRequest(request_id="b-1", model=MODEL, keys=keys_b, input_tokens=4000),
                pb.ScheduleRequest(request_id="", model=MODEL, keys=keys_b, input_tokens=4000),
                pb.ScheduleRequest(request_id="b-3", model="nope", keys=keys_b, input_tokens=4000),
            ])
            assert [i.error for i in items] == ["", "InvalidArgument", "InvalidArgument"]
            assert items[0].reply.accepted and items[0].reply.prefix_blocks == 6
            assert "request_id" in items[1].detail and "'nope'" in items[2].detail
            with pytest.raises(InvalidArgument, match="unknown ticket"):
                await client.report_completion(pb.CompletionReport(ticket=999_999, cancelled=True))

            # A follower: answers Lookup, refuses Schedule naming the leader.
            follower = cluster.conductor("c-2")
            async with grpc.aio.insecure_channel(follower.address) as channel:
                stub = pb_grpc.ConductorStub(channel)  # type: ignore[no-untyped-call]

                async def follower_indexed() -> bool:
                    reply = await stub.Lookup(pb.ConductorLookupRequest(keys=keys_b))
                    return bool(reply.best_blocks == 6)

                await wait_until(follower_indexed, 10.0, "the follower indexes the chain")
                info = await stub.Leader(pb.LeaderRequest())
                assert not info.is_leader and info.leader_id == "c-1"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Schedule(pb.ScheduleRequest(request_id="r", model=MODEL,
                                                           keys=keys_b, input_tokens=4000))
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert dict(refused.value.trailing_metadata())[LEADER_METADATA_KEY] == (
                    f"c-1@{leader.address}")

    run(aio, scenario())


# --------------------------------------------------------------------------- a daemon dies


def test_daemon_killed_while_scheduling_is_never_placed_on_again(aio: asyncio.Runner,
                                                                  cluster: Cluster) -> None:
    cluster.daemon("node-a")
    # A lease far longer than the test: only the broken event stream can give the death away
    # (no timing is asserted; the lease is revoked by hand below, as if it had expired).
    victim = cluster.daemon("node-b", settings={"etcd.ttl_s": "600"})
    cluster.conductor("c-1")
    chains = [tokens(seed, 4) for seed in range(8)]
    for chain in chains:
        cluster.store_chain("node-b", chain)  # node-b holds everything: the fetch source

    async def scenario() -> None:
        await cluster.engines(prefill("p-a", "node-a"), prefill("p-b", "node-b"),
                              decode("d-a", "node-a"), decode("d-b", "node-b"))
        async with cluster.client() as client:
            await ready(client, nodes={"node-a", "node-b"}, prefill_ids={"p-a", "p-b"})
            seen_b = False
            killed_at = None
            removed = False
            after_removal: list[pb.ScheduleReply] = []
            for i in range(10_000):
                reply = await client.schedule(f"r-{i}", MODEL,
                                              token_ids=chains[i % len(chains)] + [7])
                assert reply.accepted, reply.message
                if removed:
                    after_removal.append(reply)
                    if len(after_removal) >= 40:
                        break
                seen_b = seen_b or "node-b" in names(reply)
                if killed_at is None and i >= 20 and seen_b:
                    victim.kill()
                    killed_at = time.monotonic()
                if killed_at is not None and not removed:
                    info = await client.leader_info()
                    if "node-b" not in info.live_nodes:
                        removed = True
                        assert set(info.prefill_instances) == {"p-a"}
                        assert set(info.decode_instances) == {"d-a"}
                        # Its key is still there: the broken event stream gave it away.
                        assert not await cluster.key_gone("node-b")()
                assert killed_at is None or time.monotonic() - killed_at < 30.0, \
                    "the dead daemon was not noticed within 30 s (a bounded wait)"
            assert seen_b and killed_at is not None and removed
            for reply in after_removal:
                assert names(reply) == {"node-a"}, reply
                assert (reply.prefill_instance, reply.decode_instance) == ("p-a", "d-a")
            lookup = await client.lookup(token_ids=chains[0], model=MODEL)
            assert lookup.best_blocks == 0 and not lookup.nodes

            # Its lease ends too (revoked: what etcd does when it expires); the conductor
            # keeps it out.
            async with etcd_client(cluster.etcd_url) as etcd:
                kv = await etcd.get(cluster.layout.node_key("node-b").encode())
                assert kv is not None and int(kv.lease) != 0
                await etcd.revoke_lease(int(kv.lease))
            await wait_until(cluster.key_gone("node-b"), 10.0, "node-b's key goes with its lease")
            info = await client.leader_info()
            assert list(info.live_nodes) == ["node-a"]

    run(aio, scenario(), timeout_s=90.0)


# --------------------------------------------------------------------------- etcd restarts


def test_etcd_restart_conductor_recovers_and_index_is_repaired(
        aio: asyncio.Runner, tmp_path: Path, private_etcd: LocalEtcd) -> None:
    layout = KeyLayout("/etcd-restart/")
    cluster = Cluster(tmp_path, private_etcd.client_url, layout)
    try:
        cluster.daemon("node-a")
        victim = cluster.daemon("node-b")
        cluster.conductor("c-1")
        before = cluster.store_chain("node-a", tokens(1, 3))
        cluster.store_chain("node-b", tokens(2, 3))

        async def scenario() -> None:
            await cluster.engines(prefill("p-a", "node-a"), prefill("p-b", "node-b"),
                                  decode("d-a", "node-a"))
            async with cluster.client(failover_timeout_s=20.0) as client:
                await ready(client, nodes={"node-a", "node-b"}, prefill_ids={"p-a", "p-b"})
                address = (await client.leader_info()).leader_address
                private_etcd.stop()
                # While etcd is down: node-b dies and node-a stores more. Neither needs etcd
                # to reach the index (events flow from the daemons; a dead stream is a dead node).
                victim.kill()
                during = cluster.store_chain("node-a", tokens(3, 2))
                async with grpc.aio.insecure_channel(address) as channel:
                    stub = pb_grpc.ConductorStub(channel)  # type: ignore[no-untyped-call]

                    async def repaired() -> bool:
                        a = await stub.Lookup(pb.ConductorLookupRequest(keys=during))
                        b = await stub.Lookup(pb.ConductorLookupRequest(
                            token_ids=tokens(2, 3), model=MODEL))
                        return bool(a.best_blocks == 2 and b.best_blocks == 0)

                    await wait_until(repaired, 30.0, "index follows the daemons without etcd")
                private_etcd.start()
                # The conductor serves again (its leadership is confirmed or re-won) and a
                # daemon that joins after the restart is discovered through the new watch.
                cluster.daemon("node-c")
                await cluster.engines(prefill("p-c", "node-c"))
                await ready(client, nodes={"node-a", "node-c"}, prefill_ids={"p-a", "p-c"},
                            timeout_s=45.0)
                after = cluster.store_chain("node-c", tokens(4, 2))

                async def c_indexed() -> bool:
                    return (await client.lookup(keys=after)).best_blocks == 2

                await wait_until(c_indexed, 30.0, "node-c's blocks are indexed")
                info = await client.leader_info()
                assert "node-b" not in info.live_nodes and "p-b" not in info.prefill_instances
                reply = await client.schedule("r-1", MODEL, keys=before, input_tokens=2000)
                assert reply.accepted and reply.prefill_node == "node-a"
                assert reply.local_blocks == 3

        run(aio, scenario(), timeout_s=180.0)  # bounds for a loaded box: each step is liveness, not speed
    finally:
        cluster.close()


# --------------------------------------------------------------------------- the leader dies


def test_leader_killed_mid_stream_standby_takes_over(aio: asyncio.Runner,
                                                     cluster: Cluster) -> None:
    cluster.daemon("node-a")
    first = cluster.conductor("c-1")
    cluster.conductor("c-2")
    chain = tokens(5, 4)
    cluster.store_chain("node-a", chain)

    async def scenario() -> None:
        await cluster.engines(prefill("p-a", "node-a"), decode("d-a", "node-a"))
        async with cluster.client(failover_timeout_s=15.0) as client:
            await ready(client, nodes={"node-a"}, prefill_ids={"p-a"})
            assert (await client.leader_info()).leader_id == "c-1"
            replies: list[tuple[float, pb.ScheduleReply]] = []
            killed_at = None
            in_flight = 4  # a few concurrent callers, as engines would be

            async def caller(worker: int) -> None:
                for i in range(10_000):
                    reply = await client.schedule(f"w{worker}-{i}", MODEL, token_ids=[*chain, 1])
                    replies.append((time.monotonic(), reply))
                    if killed_at is not None and reply.conductor_id == "c-2" and \
                            sum(r.conductor_id == "c-2" for _, r in replies) >= 40:
                        return

            async def killer() -> None:
                nonlocal killed_at
                while len(replies) < 30:
                    await asyncio.sleep(0.01)
                first.kill()
                killed_at = time.monotonic()

            await asyncio.gather(killer(), *(caller(w) for w in range(in_flight)))
            assert killed_at is not None
            assert {r.conductor_id for _, r in replies} == {"c-1", "c-2"}
            assert all(r.accepted for _, r in replies)
            # One leader at a time: the standby decided nothing before the leader died. (How
            # fast it takes over is bounded by the client's failover_timeout_s and the
            # scenario's timeout, not asserted: these machines are shared and noisy.)
            first_c2 = min(t for t, r in replies if r.conductor_id == "c-2")
            assert first_c2 > killed_at
            gap_s = first_c2 - killed_at
            # The standby followed the daemon all along: its first decisions reuse the prefix.
            assert all(r.local_blocks == 4 for _, r in replies if r.conductor_id == "c-2")
            assert client.failovers > 0
            print(f"failover: first decision from the standby {gap_s:.2f} s after SIGKILL")

    run(aio, scenario(), timeout_s=90.0)


# --------------------------------------------------------------------------- a daemon restarts


def test_daemon_restart_under_the_same_id_is_rebuilt_from_its_new_epoch(
        aio: asyncio.Runner, cluster: Cluster) -> None:
    victim = cluster.daemon("node-a")
    cluster.conductor("c-1")
    old = cluster.store_chain("node-a", tokens(1, 4))

    async def scenario() -> None:
        await cluster.engines(prefill("p-a", "node-a"), decode("d-a", "node-a"))
        async with cluster.client() as client:
            await ready(client, nodes={"node-a"}, prefill_ids={"p-a"})

            async def blocks(keys: list[bytes]) -> int:
                return int((await client.lookup(keys=keys)).best_blocks)

            await wait_until(lambda: _eq(blocks(old), 4), 10.0, "old chain indexed")
            victim.kill()  # DRAM only: the restarted daemon holds nothing of it
            await wait_until(lambda: _eq(blocks(old), 0), 5.0, "dead node's blocks leave")
            await wait_until(cluster.key_gone("node-a"), 10.0, "the dead daemon's lease expires")
            cluster.daemon("node-a")  # same id, new process, new epoch
            await ready(client, nodes={"node-a"}, prefill_ids={"p-a"}, timeout_s=20.0)
            new = cluster.store_chain("node-a", tokens(2, 3))
            await wait_until(lambda: _eq(blocks(new), 3), 10.0, "new epoch's blocks indexed")
            assert await blocks(old) == 0
            reply = await client.schedule("r-1", MODEL, keys=new, input_tokens=2000)
            assert reply.accepted and reply.local_blocks == 3 and reply.prefill_node == "node-a"

    run(aio, scenario(), timeout_s=60.0)


async def _eq(value: Awaitable[int], expected: int) -> bool:
    return await value == expected


# --------------------------------------------------------------------------- the leader key tampered with


def test_leader_key_overwritten_conductor_keeps_scheduling(aio: asyncio.Runner,
                                                          cluster: Cluster) -> None:
    """Issue 12: the leader key overwritten by hand (a plain put: no lease) used to make the
    leader step down with nobody able to win while the key stayed. Now the leader writes its
    record back and Schedule keeps succeeding."""
    from kvstore.membership.election import LeaderRecord, read_leader

    cluster.daemon("node-a")
    cluster.conductor("c-1")
    cluster.conductor("c-2")
    chain = tokens(9, 2)
    cluster.store_chain("node-a", chain)
    key = cluster.layout.conductor_leader_key.encode()

    async def scenario() -> None:
        await cluster.engines(prefill("p-a", "node-a"), decode("d-a", "node-a"))
        async with cluster.client(failover_timeout_s=20.0) as client, \
                etcd_client(cluster.etcd_url) as etcd:
            await ready(client, nodes={"node-a"}, prefill_ids={"p-a"})
            assert (await client.schedule("r-0", MODEL, token_ids=[*chain, 1])).accepted
            await etcd.put(key, LeaderRecord("ghost", "127.0.0.1:9").to_json())

            async def healed() -> bool:
                view = await read_leader(etcd, layout=cluster.layout)
                kv = await etcd.get(key)
                return view is not None and view.record.conductor_id in cluster.conductors \
                    and kv is not None and int(kv.lease) != 0

            await wait_until(healed, 20.0, "a conductor holds the leader key again")
            for i in range(20):
                reply = await client.schedule(f"r-{i + 1}", MODEL, token_ids=[*chain, 1])
                assert reply.accepted and reply.prefill_instance == "p-a", reply
            info = await client.leader_info()
            assert info.is_leader and info.leader_id in cluster.conductors

    run(aio, scenario(), timeout_s=90.0)


# --------------------------------------------------------------------------- etcd frozen: a new term


def test_after_etcd_pause_no_decision_from_an_unbuilt_view(
        aio: asyncio.Runner, tmp_path: Path, private_etcd: LocalEtcd) -> None:
    """Issue 12: etcd frozen (SIGSTOP) for longer than every lease: on SIGCONT etcd expires
    the daemons' and the conductors' leases at once, the daemons re-register and a leader is
    elected again. A leader used to answer from the half-rebuilt view in between ("no
    prefill instance serves model" while the engines were registered). Polling Schedule on
    both conductors through the whole change, every reply must be a placement, a refusal by
    a follower (FAILED_PRECONDITION) or UNAVAILABLE (retryable); never INVALID_ARGUMENT. And
    every Lookup finds node-a's 3 blocks or is UNAVAILABLE."""
    layout = KeyLayout("/etcd-pause-view/")
    cluster = Cluster(tmp_path, private_etcd.client_url, layout)
    try:
        cluster.daemon("node-a")
        cluster.daemon("node-b")
        conductors = [cluster.conductor("c-1"), cluster.conductor("c-2")]
        keys = cluster.store_chain("node-a", tokens(3, 3))

        async def scenario() -> None:
            await cluster.engines(prefill("p-a", "node-a"), prefill("p-b", "node-b"),
                                  decode("d-a", "node-a"), decode("d-b", "node-b"))
            async with cluster.client() as client:
                await ready(client, nodes={"node-a", "node-b"}, prefill_ids={"p-a", "p-b"})
            channels = [grpc.aio.insecure_channel(c.address) for c in conductors]
            stubs = [pb_grpc.ConductorStub(ch) for ch in channels]  # type: ignore[no-untyped-call]
            seen: dict[str, int] = {}
            wrong: list[str] = []
            resumed = False
            accepted_after = 0
            try:
                async def poll(i: int) -> None:
                    nonlocal accepted_after
                    for stub in stubs:
                        try:
                            reply = await stub.Schedule(pb.ScheduleRequest(
                                request_id=f"r-{i}", model=MODEL, keys=keys, input_tokens=2000),
                                timeout=5.0)
                        except grpc.aio.AioRpcError as exc:
                            code = exc.code()
                            seen[code.name] = seen.get(code.name, 0) + 1
                            if code not in (grpc.StatusCode.UNAVAILABLE,
                                            grpc.StatusCode.FAILED_PRECONDITION,
                                            grpc.StatusCode.DEADLINE_EXCEEDED):
                                wrong.append(f"{code.name}: {exc.details()}")
                            continue
                        if not reply.accepted or reply.prefill_node not in ("node-a", "node-b"):
                            wrong.append(f"bad decision: {reply}")
                        seen["OK"] = seen.get("OK", 0) + 1
                        if resumed:
                            accepted_after += 1
                    for stub in stubs:  # Lookup: any conductor, from a built view only
                        try:
                            found = await stub.Lookup(pb.ConductorLookupRequest(keys=keys),
                                                      timeout=5.0)
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                  grpc.StatusCode.DEADLINE_EXCEEDED):
                                wrong.append(f"Lookup {exc.code().name}: {exc.details()}")
                            continue
                        if found.best_blocks != 3:
                            wrong.append(f"Lookup from a partial view: {found}")

                for i in range(20):
                    await poll(i)
                assert seen.get("OK", 0) >= 20 and not wrong, (seen, wrong)
                private_etcd.pause()
                try:
                    # Twice every lease's TTL (2 s): each has lapsed on etcd's clock when it
                    # wakes (its last renewal came before the pause), so it expires them at once.
                    paused_until = time.monotonic() + 2 * 2
                    i = 20
                    while time.monotonic() < paused_until:
                        await poll(i)
                        i += 1
                        await asyncio.sleep(0.01)
                finally:
                    private_etcd.resume()
                resumed = True
                deadline = time.monotonic() + 45.0

                async def poller(worker: int) -> None:  # several in flight: a short window
                    n = 0
                    while accepted_after < 200 and time.monotonic() < deadline:
                        await poll(1_000_000 * (worker + 1) + n)
                        n += 1

                await asyncio.gather(*(poller(w) for w in range(4)))
                print(f"replies by status: {seen}")
                assert not wrong, wrong[:5]
                assert accepted_after >= 200, f"not serving again within 45 s: {seen}"
            finally:
                for ch in channels:
                    await ch.close()

        run(aio, scenario(), timeout_s=120.0)
    finally:
        cluster.close()


# --------------------------------------------------------------------------- leases revoked early


def test_leases_revoked_behind_the_conductors_back_never_answer_from_a_gap(
        aio: asyncio.Runner, tmp_path: Path, etcd_server: LocalEtcd) -> None:
    """Issue 16: etcd 3.4.23 revokes leases early when a paused etcd leader resumes
    (etcd-io/etcd#15247): every daemon, engine and conductor lease goes at once, with no
    outage a conductor could see (or one too short to expire anything by the clocks), and
    the members register again within milliseconds. Here every lease under the prefix is
    revoked by hand, the engines registered again at once (the daemons do it themselves),
    three times, while Schedule is polled on both conductors: every reply is a placement,
    a follower's refusal or UNAVAILABLE (never "no prefill instance serves model"), and the
    leader decides on the re-registered instances after each."""
    layout = KeyLayout("/revoked-early/")
    cluster = Cluster(tmp_path, etcd_server.client_url, layout)
    try:
        cluster.daemon("node-a")
        cluster.daemon("node-b")
        conductors = [cluster.conductor("c-1"), cluster.conductor("c-2")]
        keys = cluster.store_chain("node-a", tokens(5, 2))
        records = (prefill("p-a", "node-a"), prefill("p-b", "node-b"),
                   decode("d-a", "node-a"), decode("d-b", "node-b"))

        async def register(etcd: Any) -> None:  # the engines' holder: a lease of its own
            lease = await etcd.lease(60)
            for record in records:
                await put_engine_record(etcd, record, layout=layout, lease_id=lease.id)

        async def scenario() -> None:
            async with etcd_client(cluster.etcd_url) as etcd:
                await register(etcd)
            async with cluster.client() as client:
                await ready(client, nodes={"node-a", "node-b"}, prefill_ids={"p-a", "p-b"})
            channels = [grpc.aio.insecure_channel(c.address) for c in conductors]
            stubs = [pb_grpc.ConductorStub(ch) for ch in channels]  # type: ignore[no-untyped-call]
            seen: dict[str, int] = {}
            wrong: list[str] = []
            accepted = 0
            stop = asyncio.Event()

            async def poller(worker: int) -> None:
                nonlocal accepted
                n = 0
                while not stop.is_set():
                    n += 1
                    for stub in stubs:
                        try:
                            reply = await stub.Schedule(pb.ScheduleRequest(
                                request_id=f"r-{worker}-{n}", model=MODEL, keys=keys,
                                input_tokens=1000), timeout=5.0)
                        except grpc.aio.AioRpcError as exc:
                            code = exc.code()
                            seen[code.name] = seen.get(code.name, 0) + 1
                            if code not in (grpc.StatusCode.UNAVAILABLE,
                                            grpc.StatusCode.FAILED_PRECONDITION,
                                            grpc.StatusCode.DEADLINE_EXCEEDED):
                                wrong.append(f"{code.name}: {exc.details()}")
                            continue
                        seen["OK"] = seen.get("OK", 0) + 1
                        accepted += 1
                        if reply.prefill_node not in ("node-a", "node-b"):
                            wrong.append(f"bad decision: {reply}")
                    await asyncio.sleep(0.002)

            async def decided(count: int, what: str) -> None:
                target = accepted + count

                async def check() -> bool:
                    return accepted >= target

                await wait_until(check, 30.0, what)

            pollers = [asyncio.create_task(poller(w)) for w in range(4)]
            try:
                async with etcd_client(cluster.etcd_url) as etcd:
                    for _ in range(3):
                        await decided(50, "decisions before the revocation")
                        got = await etcd.get_prefix(layout.prefix.encode())
                        leases = {kv.lease for kv in got if kv.lease}
                        assert len(leases) >= 4, leases  # daemons, engines, the leader
                        # one burst, in no particular order, as etcd's own revocation
                        await asyncio.gather(*(etcd.revoke_lease(lease) for lease in leases))
                        await register(etcd)  # as the daemons do by themselves
                        await decided(50, "decisions after the revocation")
            finally:
                stop.set()
                await asyncio.gather(*pollers)
                for ch in channels:
                    await ch.close()
            print(f"replies by status: {seen}")
            assert not wrong, (wrong[:5], len(wrong), seen)
            async with cluster.client() as client:
                await ready(client, nodes={"node-a", "node-b"}, prefill_ids={"p-a", "p-b"})

        run(aio, scenario(), timeout_s=150.0)
    finally:
        cluster.close()


# --------------------------------------------------------------------------- first-token reports


def test_first_token_reports_end_the_prefill_and_calibrate_the_instance(
        aio: asyncio.Runner, cluster: Cluster) -> None:
    """A front door reports ``PrefillDone`` without a measured time when a request's first
    token came out: the conductor then times the prefill from its decision (the request had
    the instance to itself) and prices later prompts with that speed; a request decided
    behind another is not timed, only taken out of the queue. On the caller's clock, so the
    figures are exact."""
    cluster.daemon("node-a")
    cluster.conductor("c-1", "--clock", "client")

    async def scenario() -> None:
        await cluster.engines(prefill("p-a", "node-a"), decode("d-a", "node-a"))
        async with cluster.client() as client:
            await ready(client, nodes={"node-a"}, prefill_ids={"p-a"})
            prompt = tokens(7, 2)
            first = await client.schedule("r-1", MODEL, token_ids=prompt, at_s=10.0)
            assert first.accepted and first.queue_s == 0.0
            modelled_s = first.prefill_s
            await client.report_completion(pb.CompletionReport(
                ticket=first.ticket, at_s=10.0 + 20 * modelled_s,
                prefill=pb.PrefillDone(prefill_s=0.0)))
            factor = 20 ** 0.2  # one sample of SpeedCalibration (alpha 0.2)
            a = await client.schedule("r-2", MODEL, token_ids=prompt, at_s=100.0)
            b = await client.schedule("r-3", MODEL, token_ids=prompt, at_s=100.0)
            assert a.prefill_s == pytest.approx(modelled_s * factor)
            assert b.queue_s == pytest.approx(a.prefill_s)  # behind r-2
            # r-2 (alone: r-1 was over) took 3x its estimate: a sample; r-3, decided behind
            # r-2, took 10x but is not one (it waited for r-2).
            await client.report_completion(pb.CompletionReport(
                ticket=a.ticket, at_s=100.0 + 3 * a.prefill_s,
                prefill=pb.PrefillDone(prefill_s=0.0)))
            await client.report_completion(pb.CompletionReport(
                ticket=b.ticket, at_s=100.0 + 10 * a.prefill_s,
                prefill=pb.PrefillDone(prefill_s=0.0)))
            c = await client.schedule("r-4", MODEL, token_ids=prompt, at_s=200.0)
            assert c.queue_s == 0.0 and c.prefill_s == pytest.approx(a.prefill_s * 3 ** 0.2)
            with pytest.raises(InvalidArgument, match="already reported its prefill"):
                await client.report_completion(pb.CompletionReport(
                    ticket=b.ticket, at_s=201.0, prefill=pb.PrefillDone(prefill_s=0.0)))

    run(aio, scenario())

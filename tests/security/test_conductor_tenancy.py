"""The conductor scoped by the caller's identity (docs/security.md, "The conductor"), against a
real token conductor following two real token daemons through a real etcd, all separate
processes, with tokens minted at run time.

Alice's chain is a shared root (written by a shared writer) and three chunks of hers on node-a;
bob owns a chunk with the same key as alice's second block on node-b (keys are per daemon) and a
root of his own. Every attack (no credentials, an expired token, a token of another signing key,
another tenant's token, a guessed key, a forged ``kvtier-tenant``, a forged body tenant, a batch
with one forged item, an engine of two tenants naming none, another tenant's ticket reported on,
an engine or a peer calling what its role may not, an engine following a daemon's events) is refused with a clear error or sees none
of alice's chunks, and is paired with the same call succeeding for the right identity; alice's
chunks read back byte for byte afterwards, and the refusals are in the conductor's audit log.
The counts (attempts, refused, absent, leaked, lost) are printed by the test, also under capture.
A conductor without security takes the ``kvtier-tenant`` as given, as a daemon does.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstore._proto.kvtier.v1 import conductor_pb2 as cpb
from kvstore._proto.kvtier.v1 import store_pb2 as spb
from kvstore.client.conductor_client import ConductorClient
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.store_config import StoreClientConfig
from kvstore.errors import InvalidArgument, KvtierError, PermissionDenied, Unauthenticated
from kvstore.keys import BlockHasher, KVDtype, KVFingerprint, Namespace
from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tenancy import SHARED_TENANT
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess

MODEL = "tiny-model"
BLOCK_TOKENS = 512
"""The engines' KV block and the conductor's (its --block-size-tokens default)."""
FINGERPRINT = KVFingerprint(MODEL, KVDtype.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=8,
                            block_size_tokens=BLOCK_TOKENS)
VALUE = bytes(range(256)) * 16


def _key(tag: int, i: int) -> bytes:
    return bytes([tag]) + i.to_bytes(2, "big") * 7 + b"\x00"


SHARED_ROOT = _key(0x5A, 0)
ALICE = [SHARED_ROOT, _key(0xA1, 1), _key(0xA1, 2), _key(0xA1, 3)]
"""Alice's chain on node-a: the shared root, then three chunks of hers."""
BOB_ROOT = _key(0xB0, 0)

PRINCIPALS: dict[str, tuple[Role, list[str] | None, bool]] = {
    "alice": (Role.ENGINE, ["alice"], False),
    "bob": (Role.ENGINE, ["bob"], False),
    "duo": (Role.ENGINE, ["alice", "bob"], False),
    "sys": (Role.ENGINE, ["sys"], True),
    "op": (Role.OPERATOR, None, False),
    "conductor": (Role.PEER, None, False),
    "p-node-a": (Role.ENGINE, ["alice"], False),
    "shared-engine": (Role.ENGINE, ["*"], False),
    "node-b": (Role.DAEMON, None, False),
}
"""name -> (role, tenants, shared_writer)."""


@dataclass
class Tally:
    """``refused``: an error status; ``absent``: answered without any of alice's own chunks;
    ``leaks``: what an attack got that it must not; ``lost``: alice's chunks that did not read
    back."""

    attempts: int = 0
    refused: int = 0
    absent: int = 0
    leaks: list[str] = field(default_factory=list)
    lost: int = 0
    paired: int = 0

    async def attack(self, what: str, call: Callable[[], Awaitable[Any]],
                     absent: Callable[[Any], bool] | None = None,
                     refusals: tuple[type[KvtierError], ...] = (PermissionDenied,),
                     match: str | None = None) -> Any:
        self.attempts += 1
        try:
            result = await call()
        except refusals as exc:
            if match is not None:
                assert match in str(exc), f"{what}: {exc}"
            self.refused += 1
            return exc
        if absent is not None and absent(result):
            self.absent += 1
            return result
        self.leaks.append(f"{what}: {result!r}"[:300])
        return result


@dataclass
class World:
    work: Path
    etcd_url: str
    layout: KeyLayout
    tokens: dict[str, Path]
    daemons: dict[str, DaemonProcess]
    conductor: ConductorProcess
    audit: Path
    address: str = ""

    def client(self, name: str | None, tenant: str | None = None,
               token: Path | None = None) -> ConductorClient:
        security = ClientSecurity() if name is None and token is None else \
            ClientSecurity(token_file=token or self.tokens[str(name)])
        return ConductorClient(address=self.address, security=security, tenant=tenant,
                               rpc_timeout_s=10.0)

    def control(self, node: str, name: str, tenant: str | None = None) -> DaemonControl:
        cfg = StoreClientConfig(rpc_timeout_s=10.0, tenant=tenant,
                                security=ClientSecurity(token_file=self.tokens[name]))
        address = self.daemons[node].grpc_address
        channel, info = open_channel(address, cfg)
        return DaemonControl(address, info, channel, cfg)


def _put(c: DaemonControl, key: bytes, parent: bytes | None = None) -> None:
    c.call("Put", spb.PutRequest(key=key, value=VALUE, parent=parent or b""))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
          ) -> Iterator[World]:
    etcd = request.getfixturevalue("etcd_server")
    layout = KeyLayout(f"/kvtier-conductor-tenancy-{time.monotonic_ns()}/")
    work = tmp_path_factory.mktemp("conductor-tenancy")
    generate_key(work / "keys", "k1")
    (work / "keys" / "k1.key").rename(work / "k1.key")
    kid, signing = load_signing_key(work / "k1.key")
    tokens: dict[str, Path] = {}
    for name, (role, tenants, writer) in PRINCIPALS.items():
        tokens[name] = work / f"{name}.token"
        tokens[name].write_text(mint(signing, kid, subject=name, role=role, tenants=tenants,
                                     ttl_s=3600, shared_writer=writer))
    tokens["expired"] = work / "expired.token"
    tokens["expired"].write_text(mint(signing, kid, subject="alice", role=Role.ENGINE,
                                      tenants=["alice"], ttl_s=60, now_s=time.time() - 7200))
    generate_key(work / "other-keys", "k9")
    other_kid, other = load_signing_key(work / "other-keys" / "k9.key")
    tokens["foreign"] = work / "foreign.token"
    tokens["foreign"].write_text(mint(other, other_kid, subject="alice", role=Role.ENGINE,
                                      tenants=["alice"], ttl_s=3600))
    settings = {"security.token_keys": str(work / "keys"),
                "security.token_reload_interval_s": "0", "server.shm_channel": "false"}
    daemons = {n: DaemonProcess(work, n, nvme=False, etcd_endpoint=etcd.client_url,
                                etcd_prefix=layout.prefix, settings=settings)
               for n in ("node-a", "node-b")}
    audit = work / "conductor-audit.log"
    conductor = ConductorProcess(work, "c1", etcd_endpoint=etcd.client_url, prefix=layout.prefix,
                                 extra_args=("--token-keys", str(work / "keys"),
                                             "--daemon-token-file", str(tokens["conductor"]),
                                             "--audit-log", str(audit)))
    w = World(work, etcd.client_url, layout, tokens, daemons, conductor, audit)
    try:
        for d in daemons.values():
            d.start()
        sys_a = w.control("node-a", "sys", SHARED_TENANT)
        sys_b = w.control("node-b", "sys", SHARED_TENANT)
        alice_a, bob_b = w.control("node-a", "alice"), w.control("node-b", "bob")
        try:
            _put(sys_a, SHARED_ROOT)
            _put(sys_b, SHARED_ROOT)
            for parent, key in itertools.pairwise(ALICE):
                _put(alice_a, key, parent)
            _put(bob_b, ALICE[1], SHARED_ROOT)  # bob's own chunk under alice's key, on node-b
            _put(bob_b, BOB_ROOT)
        finally:
            for c in (sys_a, sys_b, alice_a, bob_b):
                c.close()
        w.address = conductor.start()

        async def engines_and_index() -> None:
            async with etcd_client(etcd.client_url) as client:
                for node in daemons:
                    await put_engine_record(client, EngineRecord(
                        f"p-{node}", EngineRole.PREFILL, MODEL, node,
                        kv_fingerprint=FINGERPRINT), layout=layout)
                await put_engine_record(client, EngineRecord(
                    "d-0", EngineRole.DECODE, MODEL, "node-a", kv_capacity_tokens=1_000_000),
                    layout=layout)
            async with w.client("op") as op:
                deadline = time.monotonic() + 30
                while True:  # the operator sees every tenant: wait until all is indexed
                    info = await op.leader_info()
                    got = await op.lookup(keys=ALICE)
                    blocks = {n.node_id: n.blocks for n in got.nodes}
                    if blocks == {"node-a": 4, "node-b": 2} and len(info.prefill_instances) == 2:
                        return
                    assert time.monotonic() < deadline, (blocks, info, conductor.log_tail())
                    await asyncio.sleep(0.1)

        asyncio.run(engines_and_index())
        yield w
    finally:
        conductor.stop()
        for d in daemons.values():
            d.stop()


def _blocks(reply: cpb.ConductorLookupReply) -> dict[str, int]:
    return {n.node_id: n.blocks for n in reply.nodes}


def _no_alice_blocks(reply: cpb.ConductorLookupReply) -> bool:
    """Node-a shows at most the shared root; node-b nothing beyond bob's own two."""
    blocks = _blocks(reply)
    return blocks.get("node-a", 0) <= 1 and reply.best_blocks <= 2


def _sched(request_id: str, keys: list[bytes], tenant: str = "") -> cpb.ScheduleRequest:
    return cpb.ScheduleRequest(request_id=request_id, model=MODEL, keys=keys, tenant=tenant,
                               input_tokens=len(keys) * BLOCK_TOKENS)


def _schedule_absent(reply: cpb.ScheduleReply) -> bool:
    """No decision counts alice's own blocks (A2, A3): at most the shared root and bob's A1."""
    if reply.prefix_blocks > 2:
        return False
    return not (reply.HasField("fetch") and reply.fetch.src_node == "node-a"
                and reply.fetch.end_block > 1)


def test_the_conductor_answers_each_caller_for_its_own_tenant(world: World) -> None:
    tally = Tally()

    async def scenario() -> None:
        tokens = world.tokens
        async with world.client("alice") as alice, world.client("bob") as bob, \
                world.client("op") as op:
            # The right identities (the pairs of the attacks below).
            mine = await alice.lookup(keys=ALICE)
            assert _blocks(mine) == {"node-a": 4, "node-b": 1} and mine.best_blocks == 4
            assert {n.node_id: n.tiers.dram for n in mine.nodes} == {"node-a": 4, "node-b": 1}
            his = await bob.lookup(keys=ALICE)
            assert _blocks(his) == {"node-a": 1, "node-b": 2}  # the root, and his own A1
            assert _blocks(await bob.lookup(keys=[BOB_ROOT])) == {"node-b": 1}
            assert _blocks(await op.lookup(keys=ALICE)) == {"node-a": 4, "node-b": 2}
            decided = await alice.call("Schedule", _sched("alice-1", ALICE))
            assert decided.accepted and decided.prefix_blocks == 4, decided
            tally.paired += 5

            # No credentials, an expired token, a token of another signing key.
            for name, token, why in (("anonymous", None, "requires a bearer token"),
                                     ("expired token", tokens["expired"], "expired"),
                                     ("foreign key", tokens["foreign"], "k9")):
                async with world.client(None, token=token) as c:
                    await tally.attack(f"{name} lookup", lambda c=c: c.lookup(keys=ALICE),
                                       refusals=(Unauthenticated,), match=why)
                    await tally.attack(
                        f"{name} schedule",
                        lambda c=c: c.call("Schedule", _sched("anon-1", ALICE)),
                        refusals=(Unauthenticated,), match=why)

            # Another tenant's token: alice's chunks are absent, also by a guessed key.
            await tally.attack("bob lookup of alice's chain", lambda: bob.lookup(keys=ALICE),
                               absent=_no_alice_blocks)
            await tally.attack("bob lookup of a guessed key",
                               lambda: bob.lookup(keys=ALICE[2:]),
                               absent=lambda r: not r.nodes and r.best_blocks == 0)
            await tally.attack("bob schedule of alice's chain",
                               lambda: bob.call("Schedule", _sched("bob-1", ALICE)),
                               absent=_schedule_absent)
            batch = cpb.ScheduleBatchRequest(items=[_sched("bob-2", ALICE),
                                                    _sched("bob-3", ALICE[1:])])
            await tally.attack(
                "bob schedule batch of alice's chains",
                lambda: bob.call("ScheduleBatch", batch),
                absent=lambda r: all(_schedule_absent(i.reply) for i in r.items))
            tally.paired += 1  # bob's own chunks answered above

            # Another tenant's ticket: bob may not end alice's request (its reservations).
            cancel = cpb.CompletionReport(ticket=decided.ticket, cancelled=True)
            await tally.attack("bob cancels alice's ticket",
                               lambda: bob.report_completion(cancel),
                               match="may not report on ticket")
            await alice.report_completion(cancel)
            with pytest.raises(InvalidArgument, match="unknown ticket"):  # it was alice's to end
                await alice.report_completion(cancel)
            tally.paired += 1

        # A forged kvtier-tenant, paired with the owner naming herself.
        async with world.client("bob", tenant="alice") as forged, \
                world.client("alice", tenant="alice") as named:
            await tally.attack("bob naming alice: lookup", lambda: forged.lookup(keys=ALICE),
                               match="bob may not act for tenant 'alice'")
            await tally.attack("bob naming alice: schedule",
                               lambda: forged.call("Schedule", _sched("bob-4", ALICE)),
                               match="may not act for tenant 'alice'")
            assert _blocks(await named.lookup(keys=ALICE))["node-a"] == 4
            tally.paired += 1

        # A forged tenant in the request body (the hashing namespace), alone and in a batch.
        hasher = BlockHasher(Namespace(FINGERPRINT, "alice"))
        tokens_ids = list(range(3 * BLOCK_TOKENS))
        async with world.client("bob") as bob, world.client("alice") as alice:
            await tally.attack(
                "bob lookup hashed in alice's namespace",
                lambda: bob.lookup(token_ids=tokens_ids, model=MODEL, tenant="alice"),
                match="may not act for tenant 'alice'")
            await tally.attack(
                "bob schedule hashed in alice's namespace",
                lambda: bob.schedule("bob-5", MODEL, token_ids=tokens_ids, tenant="alice"),
                match="may not act for tenant 'alice'")
            forged_batch = cpb.ScheduleBatchRequest(items=[
                _sched("bob-6", [BOB_ROOT]), _sched("bob-7", [BOB_ROOT], tenant="alice")])
            await tally.attack("bob batch with one item in alice's namespace",
                               lambda: bob.call("ScheduleBatch", forged_batch),
                               match="may not act for tenant 'alice'")
            got = await alice.lookup(token_ids=tokens_ids, model=MODEL, tenant="alice")
            assert got.blocks == len(hasher.hash_blocks(tokens_ids)) == 3
            ok = await bob.call("ScheduleBatch", cpb.ScheduleBatchRequest(
                items=[_sched("bob-8", [BOB_ROOT], tenant="bob")]))
            assert ok.items[0].reply.accepted and ok.items[0].reply.prefix_blocks == 1
            tally.paired += 2

        # Credentials of two tenants must name one.
        async with world.client("duo") as duo, world.client("duo", tenant="alice") as duo_a:
            await tally.attack("duo naming none", lambda: duo.lookup(keys=ALICE),
                               match="must name one")
            assert _blocks(await duo_a.lookup(keys=ALICE))["node-a"] == 4
            # One call naming its own tenant (a front door of several tenants).
            per_call = await duo.call("Lookup", cpb.ConductorLookupRequest(keys=ALICE),
                                      tenant="bob")
            assert _blocks(per_call) == {"node-a": 1, "node-b": 2}
            tally.paired += 1

        # Roles: Leader (inspection) is the operator's; a peer may not Lookup.
        async with world.client("alice") as alice, world.client("op") as op, \
                world.client("conductor") as peer:
            await tally.attack("engine calls Leader", alice.leader_info,
                               match="needs role operator")
            await tally.attack("peer calls Lookup", lambda: peer.lookup(keys=ALICE),
                               match="needs role engine or operator")
            info = await op.leader_info()
            assert set(info.live_nodes) == {"node-a", "node-b"} and info.indexed_blocks >= 6
            tally.paired += 1

    asyncio.run(scenario())

    # Chunk events reach only peers (and operators): an engine may not follow a daemon.
    alice_a = world.control("node-a", "alice")
    peer_a = world.control("node-a", "conductor")
    try:
        asyncio.run(tally.attack("engine snapshot of a daemon",
                                 _sync(lambda: alice_a.snapshot()), match="needs role"))
        asyncio.run(tally.attack("engine subscribe to a daemon",
                                 _sync(lambda: next(alice_a.subscribe(timeout_s=10.0))),
                                 match="needs role"))
        _epoch, _seq, entries = peer_a.snapshot()
        owners = {bytes(e.key): e.tenant for e in entries}
        assert owners == {SHARED_ROOT: SHARED_TENANT, ALICE[1]: "alice", ALICE[2]: "alice",
                          ALICE[3]: "alice"}
        stored = [e for e in _events(peer_a) if e.kind == spb.EVENT_STORED]
        assert {bytes(e.key): e.tenant for e in stored} == owners
        tally.paired += 1
        # Afterwards alice's chunks read back byte for byte.
        for key in ALICE[1:]:
            reply = alice_a.call("Get", spb.GetRequest(key=key))
            if not (reply.found and bytes(reply.value) == VALUE):
                tally.lost += 1
    finally:
        alice_a.close()
        peer_a.close()

    line = (f"conductor tenancy: attempts={tally.attempts} refused={tally.refused} "
            f"absent={tally.absent} leaked={len(tally.leaks)} lost={tally.lost} "
            f"paired={tally.paired}")
    print(line)
    with open(world.work / "tally.txt", "w") as f:
        f.write(line + "\n")
    assert not tally.leaks, tally.leaks
    assert tally.lost == 0
    assert tally.attempts == tally.refused + tally.absent
    _check_audit(world.audit)


def _sync(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    async def call() -> Any:
        return await asyncio.to_thread(fn)

    return call


def _events(control: DaemonControl) -> list[spb.ChunkEvent]:
    out: list[spb.ChunkEvent] = []
    for event in control.subscribe(0, timeout_s=5.0):
        out.append(event)
        if len(out) == 4:
            break
    return out


def _check_audit(path: Path) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    refused = [r for r in records if r["event"] == "refused"]
    assert all(r["service"] == "the conductor's gRPC service" for r in records)
    forged = [r for r in refused if r["tenant"] == "alice" and r["principal"]
              and r["principal"]["name"] == "bob"]
    assert {r["method"].rsplit("/", 1)[-1] for r in forged} == {"Lookup", "Schedule"}
    assert all(r["code"] == "PERMISSION_DENIED" for r in forged)
    namespaced = [r for r in refused if r["tenant"] is None and r["principal"]
                  and r["principal"]["name"] == "bob"]
    assert {r["method"].rsplit("/", 1)[-1] for r in namespaced} == {
        "Lookup", "Schedule", "ScheduleBatch", "ReportCompletion"}
    assert any(r["principal"] is None and r["code"] == "UNAUTHENTICATED" for r in refused)
    assert any(r["method"].endswith("/Leader") and r["principal"]["name"] == "alice"
               for r in refused)
    ops = [r for r in records if r["event"] == "operator_action"]
    assert ops and all(r["method"].endswith("/Leader") and r["outcome"] == "ok" for r in ops)


def _fields(descriptor: Any, seen: set[str]) -> Iterator[Any]:
    if descriptor.full_name in seen:
        return
    seen.add(descriptor.full_name)
    for f in descriptor.fields:
        yield f
        if f.message_type is not None:
            yield from _fields(f.message_type, seen)


def test_replies_and_events_carry_hashes_only() -> None:
    """Nothing the conductor answers, and no chunk event or entry a daemon sends it, has a
    field for token ids (a repeated integer, or a name saying so), however deep: keys and
    parents are hashes (kvstore/keys.py); counts of tokens are scalars."""
    for message in (cpb.ScheduleReply, cpb.ConductorLookupReply, cpb.LeaderReply,
                    cpb.ScheduleBatchReply, spb.ChunkEvent, spb.ChunkEntry, spb.SnapshotPage):
        for f in _fields(message.DESCRIPTOR, set()):
            assert "token_id" not in f.name, (message.DESCRIPTOR.name, f.name)
            repeated = f.is_repeated
            assert not (repeated and f.message_type is None and f.type not in (
                f.TYPE_STRING, f.TYPE_BYTES)), (message.DESCRIPTOR.name, f.name)
    # Control: the requests do carry token ids, and the walk sees them.
    assert any(f.name == "token_ids" for f in _fields(cpb.ScheduleRequest.DESCRIPTOR, set()))
    assert {f.name for f in spb.ChunkEvent.DESCRIPTOR.fields} == {
        "seq", "epoch", "kind", "key", "tier", "from_tier", "size_bytes", "parent", "tenant"}


def test_a_conductor_client_refuses_a_bad_tenant_setting() -> None:
    with pytest.raises(InvalidArgument, match="printable"):
        ConductorClient(address="127.0.0.1:1", tenant="bad\nname")

    async def per_call() -> None:
        async with ConductorClient(address="127.0.0.1:1") as client:
            with pytest.raises(InvalidArgument, match="printable"):
                await client.call("Lookup", cpb.ConductorLookupRequest(), tenant="x" * 129)

    asyncio.run(per_call())


def test_without_security_the_metadata_names_the_tenant(tmp_path: Path, etcd_server: Any,
                                                         etcd_layout: KeyLayout) -> None:
    """A conductor without security takes the ``kvtier-tenant`` as given, as a daemon does: a
    call naming none is the default tenant's (every client before tenants), one naming T sees
    T's chunks (a scope for cooperating clients, no boundary)."""
    daemon = DaemonProcess(tmp_path, "node-i", nvme=False, etcd_endpoint=etcd_server.client_url,
                           etcd_prefix=etcd_layout.prefix,
                           settings={"server.shm_channel": "false"})
    conductor = ConductorProcess(tmp_path, "ci", etcd_endpoint=etcd_server.client_url,
                                 prefix=etcd_layout.prefix)
    daemon.start()
    try:
        for tenant, key in (("t1", ALICE[1]), (None, BOB_ROOT)):
            cfg = StoreClientConfig(rpc_timeout_s=10.0, tenant=tenant)
            channel, info = open_channel(daemon.grpc_address, cfg)
            c = DaemonControl(daemon.grpc_address, info, channel, cfg)
            try:
                _put(c, key)
            finally:
                c.close()
        address = conductor.start()

        async def scenario() -> None:
            async with ConductorClient(address=address) as plain, \
                    ConductorClient(address=address, tenant="t1") as t1:
                deadline = time.monotonic() + 30
                while not (await plain.lookup(keys=[BOB_ROOT])).nodes:
                    assert time.monotonic() < deadline, conductor.log_tail()
                    await asyncio.sleep(0.1)
                while not (await t1.lookup(keys=[ALICE[1]])).nodes:
                    assert time.monotonic() < deadline, conductor.log_tail()
                    await asyncio.sleep(0.1)
                assert not (await plain.lookup(keys=[ALICE[1]])).nodes  # t1's: not the default's
                assert not (await t1.lookup(keys=[BOB_ROOT])).nodes
                info = await plain.leader_info()  # the INSECURE caller is an operator
                assert info.indexed_blocks == 2

        asyncio.run(scenario())
    finally:
        conductor.stop()
        daemon.stop()


def test_load_reports_and_peer_calls_are_bound_to_identity(world: World) -> None:
    """ReportLoad is bound to the caller's identity (an engine credential scoped to tenants
    reports only for its own instances, whatever exists; a shared engine and an operator for
    any), and a daemon's own identity may call Info and nothing else: not a daemon's chunk
    events (Subscribe, Snapshot: the conductor's identity only), not a chunk, not the
    conductor. Each attack paired with the right identity succeeding; alice's chunks read
    back afterwards."""
    tally = Tally()

    async def scenario() -> None:
        async with world.client("p-node-a") as own, world.client("alice") as alice, \
                world.client("bob") as bob, world.client("op") as op, \
                world.client("shared-engine") as shared, world.client("node-b") as daemon:
            # The right identities.
            assert await own.report_load("p-node-a", queued_prefill_tokens=0)
            assert await shared.report_load("p-node-b", queued_prefill_tokens=0)
            assert await op.report_load("d-0", running_decode_batch=0, kv_used_tokens=0)
            assert not await op.report_load("ghost")  # an operator learns what exists
            tally.paired += 4
            for who, c, instance in (("alice", alice, "p-node-a"), ("alice", alice, "d-0"),
                                     ("bob", bob, "p-node-b"), ("p-node-a", own, "p-node-b"),
                                     ("p-node-a", own, "p-node-a-x"),
                                     ("bob", bob, "ghost")):  # refused before any look-up
                await tally.attack(f"{who} reports load for {instance}",
                                   lambda c=c, i=instance: c.report_load(
                                       i, queued_prefill_tokens=1 << 40),
                                   match=f"may not report for engine instance {instance!r}")
            # A daemon's identity on the conductor: nothing.
            for what, call in (("lookup", lambda: daemon.lookup(keys=ALICE)),
                               ("schedule", lambda: daemon.call(
                                   "Schedule", _sched("daemon-1", ALICE))),
                               ("report load", lambda: daemon.report_load("p-node-b")),
                               ("leader", daemon.leader_info)):
                await tally.attack(f"daemon identity {what} on the conductor", call,
                                   match="(role daemon) may not call")
            assert _blocks(await alice.lookup(keys=ALICE))["node-a"] == 4
            tally.paired += 1

    asyncio.run(scenario())

    # A daemon's identity on another daemon: Info only; the conductor's identity follows it.
    daemon_b = world.control("node-a", "node-b")
    peer_a = world.control("node-a", "conductor")
    alice_a = world.control("node-a", "alice")
    try:
        assert daemon_b.call("Info", spb.InfoRequest()).node_id == "node-a"
        for what, fn in (("snapshot", lambda: daemon_b.snapshot()),
                         ("subscribe", lambda: next(daemon_b.subscribe(timeout_s=10.0))),
                         ("get", lambda: daemon_b.call("Get", spb.GetRequest(key=ALICE[1]))),
                         ("put", lambda: daemon_b.call("Put", spb.PutRequest(
                             key=_key(0xD0, 1), value=VALUE))),
                         ("data ticket", lambda: daemon_b.call(
                             "IssueDataTicket", spb.IssueDataTicketRequest()))):
            asyncio.run(tally.attack(f"daemon identity {what} on another daemon", _sync(fn),
                                     match="(role daemon) may not call"))
        _epoch, _seq, entries = peer_a.snapshot()
        assert {bytes(e.key) for e in entries} >= set(ALICE[1:])
        assert _events(peer_a)
        tally.paired += 2
        for key in ALICE[1:]:
            reply = alice_a.call("Get", spb.GetRequest(key=key))
            if not (reply.found and bytes(reply.value) == VALUE):
                tally.lost += 1
    finally:
        for c in (daemon_b, peer_a, alice_a):
            c.close()

    line = (f"conductor roles: attempts={tally.attempts} refused={tally.refused} "
            f"leaked={len(tally.leaks)} lost={tally.lost} paired={tally.paired}")
    print(line)
    assert not tally.leaks, tally.leaks
    assert tally.lost == 0 and tally.attempts == tally.refused

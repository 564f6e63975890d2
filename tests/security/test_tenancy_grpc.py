"""Tenant isolation over gRPC against a real daemon (a child process, real sockets, real signed
tokens): for every operation, the owner succeeds on its own chunks, another tenant's attempts on
them are refused or see absence, a forged ``kvtier-tenant`` is refused, and afterwards every one
of the owner's chunks reads back byte for byte.

The clients are gRPC only (``DaemonControl``; values travel inline in Put/Get); the data planes'
tenant scope is tested in test_dataplane_tcp.py, test_dataplane_shm.py and test_ticket_scope.py
(docs/security.md, "Data planes"). The counts of attempts,
refusals, leaks and losses are printed by the last test (also under capture).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl, open_channel, translate_rpc_error
from kvstore.client.store_config import StoreClientConfig
from kvstore.dataplane.tier import TierKind
from kvstore.errors import ChunkNotFound, InvalidArgument, KvtierError, PermissionDenied
from kvstore.node.index import SHARED_TENANT
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from kvstore.wire import TENANT_METADATA_KEY
from tests.support.daemon import DaemonProcess

N_CHAIN = 4
VALUE_BYTES = 4096


def _key(tag: int, i: int) -> bytes:
    return bytes([tag]) + i.to_bytes(2, "big") * 7 + b"\x00"


ALICE_PREFIX = b"\xa1"
ALICE = [_key(0xA1, i) for i in range(N_CHAIN)]
"""Alice's chain (root first): the chunks every attack aims at."""
ALICE_SPARE = [_key(0xA2, i) for i in range(3)]
"""Alice's roots that her own positive checks of remove and evict drop."""
SHARED_KEY = _key(0x5A, 0)
BOB_KEY = _key(0xB0, 0)


@dataclass
class Tally:
    """What the attacks did: ``refused`` (an error status), ``absent`` (answered as if the
    chunk did not exist), ``leaks`` (what an attack got that it must not), ``lost`` (chunks of
    alice that did not read back)."""

    attempts: int = 0
    refused: int = 0
    absent: int = 0
    leaks: list[str] = field(default_factory=list)
    lost: int = 0

    def attack(self, what: str, call: Callable[[], Any],
               absent: Callable[[Any], bool] | None = None,
               refusals: tuple[type[KvtierError], ...] = (PermissionDenied,)) -> Any:
        """Run one attack: an error of ``refusals`` counts as refused; ChunkNotFound,
        InvalidArgument (a parent the caller may not see) or a result ``absent`` accepts count
        as absence; anything else it returned is a leak. Other errors fail the test."""
        self.attempts += 1
        try:
            result = call()
        except refusals as exc:
            self.refused += 1
            return exc
        except (ChunkNotFound, InvalidArgument) as exc:
            self.absent += 1
            return exc
        if absent is not None and absent(result):
            self.absent += 1
            return result
        self.leaks.append(f"{what}: {result!r}"[:300])
        return result


TALLY = Tally()


@dataclass
class World:
    daemon: DaemonProcess
    clients: dict[str, DaemonControl]
    values: dict[bytes, bytes]
    token_file: Callable[..., Path]

    def __getitem__(self, name: str) -> DaemonControl:
        return self.clients[name]


def _control(address: str, token: Path, tenant: str | None = None) -> DaemonControl:
    cfg = StoreClientConfig(rpc_timeout_s=10.0, security=ClientSecurity(token_file=token),
                            tenant=tenant)
    channel, info = open_channel(address, cfg)
    return DaemonControl(address, info, channel, cfg)


def _put(c: DaemonControl, key: bytes, value: bytes, parent: bytes | None = None) -> int:
    reply = c.call("Put", pb.PutRequest(key=key, value=value, parent=parent or b""))
    return int(reply.tier)


def _get(c: DaemonControl, key: bytes) -> bytes | None:
    reply = c.call("Get", pb.GetRequest(key=key))
    return bytes(reply.value) if reply.found else None


def _raw(c: DaemonControl, method: str, request: Any,
         metadata: tuple[tuple[str, str], ...]) -> Any:
    """A call with extra request metadata (a forged tenant), its error translated."""
    try:
        return getattr(c.stub(), method)(request, timeout=10.0, metadata=metadata)
    except grpc.RpcError as exc:
        raise translate_rpc_error(exc, method) from exc


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("tenancy")
    generate_key(tmp / "keys", "k1")
    (tmp / "keys" / "k1.key").rename(tmp / "k1.key")
    kid, signing = load_signing_key(tmp / "k1.key")

    def token_file(name: str, role: Role, tenants: list[str] | None,
                   shared_writer: bool = False) -> Path:
        path = tmp / f"{name}.token"
        path.write_text(mint(signing, kid, subject=name, role=role, tenants=tenants,
                             ttl_s=3600, shared_writer=shared_writer))
        return path

    daemon = DaemonProcess(tmp, "tenancy", nvme=False, settings={
        "security.token_keys": str(tmp / "keys"), "security.token_reload_interval_s": "0",
        "server.shm_channel": "false"})
    daemon.start()
    address = daemon.grpc_address
    tokens = {
        "alice": token_file("alice", Role.ENGINE, ["alice"]),
        "bob": token_file("bob", Role.ENGINE, ["bob"]),
        "multi": token_file("multi", Role.ENGINE, ["bob", "carol"]),
        "sys": token_file("sys", Role.ENGINE, ["sys"], shared_writer=True),
        "op": token_file("op", Role.OPERATOR, None),
        "alice-admin": token_file("alice-admin", Role.OPERATOR, ["alice"]),
        "bob-admin": token_file("bob-admin", Role.OPERATOR, ["bob"]),
    }
    clients: dict[str, DaemonControl] = {}
    try:
        for name, path in tokens.items():
            clients[name] = _control(address, path)
        # Bob's credentials naming alice's tenant (refused), and bob's and the operator's
        # clients scoped to bob's tenant; the shared writer writing the shared tenant.
        clients["bob-as-alice"] = _control(address, tokens["bob"], tenant="alice")
        clients["bob-admin-as-alice"] = _control(address, tokens["bob-admin"], tenant="alice")
        clients["op-as-bob"] = _control(address, tokens["op"], tenant="bob")
        clients["multi-bob"] = _control(address, tokens["multi"], tenant="bob")
        clients["sys-shared"] = _control(address, tokens["sys"], tenant=SHARED_TENANT)
        clients["bob-shared"] = _control(address, tokens["bob"], tenant=SHARED_TENANT)

        values: dict[bytes, bytes] = {}
        _put(clients["sys-shared"], SHARED_KEY, os.urandom(VALUE_BYTES))
        parent = None
        for key in [*ALICE, *ALICE_SPARE]:
            values[key] = os.urandom(VALUE_BYTES)
            _put(clients["alice"], key, values[key], parent if key in ALICE else None)
            parent = key
        yield World(daemon, clients, values, token_file)
    finally:
        for c in clients.values():
            c.close()
        daemon.stop()


def _no_new_leaks(before: int) -> None:
    assert TALLY.leaks[before:] == []


# --- put --------------------------------------------------------------------------------------


def test_put_own_tenant_and_refusals(world: World) -> None:
    alice, bob = world["alice"], world["bob"]
    # Alice's own writes work: a root and a child of her chain, and a child of a shared chunk.
    extra = _key(0xA3, 0)
    _put(alice, extra, b"a" * 64, parent=ALICE[-1])
    _put(alice, _key(0xA3, 1), b"s" * 64, parent=SHARED_KEY)
    assert _get(alice, extra) == b"a" * 64
    leaks = len(TALLY.leaks)
    evil = b"\xee" * VALUE_BYTES
    for key in ALICE:
        # Replace one of alice's chunks: refused (keys are global; her chunk is hers).
        TALLY.attack("bob put over alice's key", lambda key=key: _put(bob, key, evil))
        # Hang a chunk under alice's chain: her chunk is absent to bob.
        TALLY.attack("bob put under alice's chunk",
                     lambda key=key: _put(bob, _key(0xB1, ALICE.index(key)), evil, key))
        # Forged tenants: bob's credentials naming alice, in the config or in raw metadata.
        TALLY.attack("bob put as alice", lambda key=key: _put(world["bob-as-alice"], key, evil))
        TALLY.attack("bob put, raw metadata alice", lambda key=key: _raw(
            bob, "Put", pb.PutRequest(key=_key(0xB2, ALICE.index(key)), value=evil),
            ((TENANT_METADATA_KEY, "alice"),)))
    TALLY.attack("bob batch put over alice's keys", lambda: [
        (i.ok, i.error) for i in bob.call("BatchPut", pb.BatchPutRequest(items=[
            pb.PutRequest(key=k, value=evil) for k in ALICE])).items],
        absent=lambda items: all(not ok and err == "PermissionDenied" for ok, err in items))
    # The shared tenant: only shared writers write it; a credential of several tenants must
    # name one.
    TALLY.attack("bob writes the shared tenant",
                 lambda: _put(world["bob-shared"], _key(0xB3, 0), evil))
    TALLY.attack("several tenants, none named", lambda: _put(world["multi"], _key(0xB4, 0), evil))
    _no_new_leaks(leaks)
    # None of the refused puts stored anything.
    op = world["op"]
    for tag in (0xB1, 0xB2, 0xB3, 0xB4):
        assert op.list_chunks(bytes([tag])).entries == [], hex(tag)
    # Bob's own writes and the multi-tenant credential naming one of its tenants still work.
    _put(bob, BOB_KEY, b"b" * 64)
    _put(world["multi-bob"], _key(0xB0, 1), b"m" * 64, parent=BOB_KEY)
    assert _get(bob, _key(0xB0, 1)) == b"m" * 64


# --- get --------------------------------------------------------------------------------------


def test_get_own_tenant_shared_and_refusals(world: World) -> None:
    alice, bob = world["alice"], world["bob"]
    for key in ALICE:
        assert _get(alice, key) == world.values[key]
    # Every tenant reads the shared tenant's chunks.
    assert _get(bob, SHARED_KEY) is not None and _get(bob, SHARED_KEY) == _get(alice, SHARED_KEY)
    leaks = len(TALLY.leaks)
    for key in ALICE:
        TALLY.attack("bob get", lambda key=key: _get(bob, key), absent=lambda v: v is None)
        TALLY.attack("bob-admin get", lambda key=key: _get(world["bob-admin"], key),
                     absent=lambda v: v is None)
        TALLY.attack("operator scoped to bob get", lambda key=key: _get(world["op-as-bob"], key),
                     absent=lambda v: v is None)
        TALLY.attack("bob get as alice", lambda key=key: _get(world["bob-as-alice"], key))
        TALLY.attack("bob get, raw metadata alice", lambda key=key: _raw(
            bob, "Get", pb.GetRequest(key=key), ((TENANT_METADATA_KEY, "alice"),)))
        TALLY.attack("bob exists", lambda key=key: bob.sizes([key]),
                     absent=lambda sizes: sizes == [None])
    TALLY.attack("bob batch get", lambda: [i.found for i in bob.call(
        "BatchGet", pb.BatchGetRequest(keys=ALICE)).items], absent=lambda f: not any(f))
    TALLY.attack("multi get, none named", lambda: _get(world["multi"], ALICE[0]))
    _no_new_leaks(leaks)
    # The operator of every tenant, naming none, sees alice's chunks.
    assert _get(world["op"], ALICE[0]) == world.values[ALICE[0]]


# --- lookup -----------------------------------------------------------------------------------


def test_lookup_own_tenant_and_refusals(world: World) -> None:
    alice, bob = world["alice"], world["bob"]
    assert alice.lookup(ALICE).length == N_CHAIN
    assert bob.lookup([SHARED_KEY]).length == 1
    leaks = len(TALLY.leaks)
    TALLY.attack("bob lookup", lambda: bob.lookup(ALICE).length, absent=lambda n: n == 0)
    TALLY.attack("bob batch lookup", lambda: [r.length for r in bob.lookup_many([ALICE, ALICE])],
                 absent=lambda ns: ns == [0, 0])
    TALLY.attack("operator scoped to bob lookup", lambda: world["op-as-bob"].lookup(ALICE).length,
                 absent=lambda n: n == 0)
    TALLY.attack("bob lookup as alice", lambda: world["bob-as-alice"].lookup(ALICE))
    TALLY.attack("bob lookup, raw metadata alice", lambda: _raw(
        bob, "Lookup", pb.LookupRequest(keys=ALICE), ((TENANT_METADATA_KEY, "alice"),)))
    TALLY.attack("bob lookup, two tenants in metadata", lambda: _raw(
        world["multi-bob"], "Lookup", pb.LookupRequest(keys=ALICE),
        ((TENANT_METADATA_KEY, "carol"),)), refusals=(InvalidArgument,))
    TALLY.attack("bob lookup, a tenant nobody has", lambda: _raw(
        bob, "Lookup", pb.LookupRequest(keys=ALICE), ((TENANT_METADATA_KEY, "mallory"),)))
    _no_new_leaks(leaks)
    assert world["op"].lookup(ALICE).length == N_CHAIN


# --- list -------------------------------------------------------------------------------------


def _keys(reply: pb.ListResponse) -> list[bytes]:
    return [bytes(e.key) for e in reply.entries]


def _none_of_alices(keys: list[bytes]) -> bool:
    return not set(keys) & set(ALICE)


def test_list_own_tenant_and_refusals(world: World) -> None:
    admin = world["alice-admin"]
    assert _keys(admin.list_chunks(ALICE_PREFIX)) == sorted(ALICE)
    everything = set(_keys(admin.list_chunks()))
    assert set(ALICE) <= everything and SHARED_KEY in everything and BOB_KEY not in everything
    leaks = len(TALLY.leaks)
    TALLY.attack("bob (engine) list", lambda: world["bob"].list_chunks(ALICE_PREFIX))
    for name in ("bob-admin", "op-as-bob"):
        for prefix in (ALICE_PREFIX, b""):
            TALLY.attack(f"{name} list {prefix!r}",
                         lambda name=name, prefix=prefix: _keys(
                             world[name].list_chunks(prefix)), absent=_none_of_alices)
    TALLY.attack("bob-admin list as alice", lambda: world["bob-admin-as-alice"].list_chunks())
    TALLY.attack("bob-admin list, raw metadata alice", lambda: _raw(
        world["bob-admin"], "List", pb.ListRequest(), ((TENANT_METADATA_KEY, "alice"),)))
    _no_new_leaks(leaks)
    assert set(ALICE) | {BOB_KEY, SHARED_KEY} <= set(_keys(world["op"].list_chunks()))


# --- inspect ----------------------------------------------------------------------------------


def test_inspect_own_tenant_and_refusals(world: World) -> None:
    entry = world["alice-admin"].inspect(ALICE[1])
    assert bytes(entry.key) == ALICE[1] and bytes(entry.parent) == ALICE[0]
    assert entry.size_bytes == VALUE_BYTES
    leaks = len(TALLY.leaks)
    for key in ALICE:
        for name in ("bob", "bob-admin", "op-as-bob", "bob-admin-as-alice"):
            TALLY.attack(f"{name} inspect", lambda name=name, key=key: world[name].inspect(key))
        TALLY.attack("bob-admin inspect, raw metadata alice", lambda key=key: _raw(
            world["bob-admin"], "Inspect", pb.InspectRequest(key=key),
            ((TENANT_METADATA_KEY, "alice"),)))
    _no_new_leaks(leaks)
    assert world["op"].inspect(ALICE[0]).size_bytes == VALUE_BYTES


# --- pin --------------------------------------------------------------------------------------


def test_pin_own_tenant_and_refusals(world: World) -> None:
    admin = world["alice-admin"]
    lease = admin.pin(ALICE)
    assert lease != 0 and admin.inspect(ALICE[0]).pinned
    assert admin.unpin(lease)
    leaks = len(TALLY.leaks)
    for key in ALICE:
        for name in ("bob", "bob-admin", "op-as-bob", "bob-admin-as-alice"):
            TALLY.attack(f"{name} pin", lambda name=name, key=key: world[name].pin([key]))
    TALLY.attack("bob-admin batch pin", lambda: world["bob-admin"].call(
        "BatchPin", pb.BatchPinRequest(items=[pb.PinRequest(keys=[k]) for k in ALICE])))
    TALLY.attack("bob-admin pin with its own chunk", lambda: world["bob-admin"].pin(
        [BOB_KEY, ALICE[0]]))
    _no_new_leaks(leaks)
    assert not any(world["op"].inspect(k).pinned for k in ALICE)
    assert world["bob-admin"].unpin(world["bob-admin"].pin([BOB_KEY, SHARED_KEY]))


# --- evict ------------------------------------------------------------------------------------


def test_evict_own_tenant_and_refusals(world: World) -> None:
    leaks = len(TALLY.leaks)
    TALLY.attack("bob (engine) evict", lambda: world["bob"].evict(key_prefix=ALICE_PREFIX))
    for name in ("bob-admin", "op-as-bob"):
        for prefix in (ALICE_PREFIX, ALICE[0], ALICE[-1]):
            TALLY.attack(f"{name} evict prefix", lambda name=name, prefix=prefix: world[name].evict(
                key_prefix=prefix).removed_chunks, absent=lambda n: n == 0)
        TALLY.attack(f"{name} evict by bytes", lambda name=name: world[name].evict(
            tier=TierKind.DRAM, bytes_=1 << 30))
    TALLY.attack("bob-admin evict as alice",
                 lambda: world["bob-admin-as-alice"].evict(key_prefix=ALICE_PREFIX))
    TALLY.attack("alice-admin evict by bytes", lambda: world["alice-admin"].evict(
        tier=TierKind.DRAM, bytes_=1 << 30))
    _no_new_leaks(leaks)
    assert world["alice"].lookup(ALICE).length == N_CHAIN
    # Alice's operator evicts her own spare chunk; the shared chunk is not hers to evict.
    spare = ALICE_SPARE[1]
    assert world["alice-admin"].evict(key_prefix=spare).removed_chunks == 1
    assert world["alice"].lookup([spare]).length == 0
    assert world["alice-admin"].evict(key_prefix=SHARED_KEY).removed_chunks == 0
    assert world["bob"].lookup([SHARED_KEY]).length == 1


# --- remove -----------------------------------------------------------------------------------


def test_remove_own_tenant_and_refusals(world: World) -> None:
    leaks = len(TALLY.leaks)
    for key in ALICE:
        TALLY.attack("bob (engine) remove", lambda key=key: world["bob"].remove(key))
        for name in ("bob-admin", "op-as-bob"):
            TALLY.attack(f"{name} remove", lambda name=name, key=key: world[name].remove(key),
                         absent=lambda removed: removed == [])
        TALLY.attack("bob-admin remove as alice",
                     lambda key=key: world["bob-admin-as-alice"].remove(key))
    TALLY.attack("bob-admin batch remove", lambda: [list(i.removed) for i in world[
        "bob-admin"].call("BatchRemove", pb.BatchRemoveRequest(keys=ALICE)).items],
        absent=lambda items: items == [[]] * N_CHAIN)
    TALLY.attack("bob-admin remove the shared chunk", lambda: world["bob-admin"].remove(
        SHARED_KEY), absent=lambda removed: removed == [])
    _no_new_leaks(leaks)
    assert world["alice-admin"].remove(ALICE_SPARE[0]) == [ALICE_SPARE[0]]
    assert world["alice"].lookup([ALICE_SPARE[0]]).length == 0
    assert world["alice"].lookup(ALICE).length == N_CHAIN


# --- same-host lease calls over gRPC, events ----------------------------------------------------


def test_grpc_leases_own_tenant_and_refusals(world: World) -> None:
    alice, bob = world["alice"], world["bob"]
    read = alice.call("AcquireRead", pb.AcquireReadRequest(keys=ALICE))
    assert read.lease_id != 0 and [c.size_bytes for c in read.chunks] == [VALUE_BYTES] * N_CHAIN
    assert alice.call("Release", pb.ReleaseRequest(lease_id=read.lease_id)).released
    new = _key(0xA4, 0)
    slot = alice.call("Reserve", pb.ReserveRequest(key=new, size_bytes=64, parent=ALICE[-1]))
    alice.call("Commit", pb.CommitRequest(lease_id=slot.lease_id))
    assert alice.lookup([*ALICE, new]).length == N_CHAIN + 1
    leaks = len(TALLY.leaks)
    TALLY.attack("bob acquire_read", lambda: bob.call(
        "AcquireRead", pb.AcquireReadRequest(keys=ALICE)))
    TALLY.attack("bob acquire_read prefix", lambda: bob.call(
        "AcquireRead", pb.AcquireReadRequest(keys=ALICE, prefix=True)).lease_id,
        absent=lambda lease_id: lease_id == 0)
    TALLY.attack("bob acquire_read as alice", lambda: world["bob-as-alice"].call(
        "AcquireRead", pb.AcquireReadRequest(keys=ALICE)))
    TALLY.attack("bob reserve over alice's key", lambda: bob.call(
        "Reserve", pb.ReserveRequest(key=ALICE[0], size_bytes=64)))
    TALLY.attack("bob reserve under alice's chunk", lambda: bob.call(
        "Reserve", pb.ReserveRequest(key=_key(0xB5, 0), size_bytes=64, parent=ALICE[0])))
    TALLY.attack("bob reserve in the shared tenant", lambda: world["bob-shared"].call(
        "Reserve", pb.ReserveRequest(key=_key(0xB5, 1), size_bytes=64)))
    TALLY.attack("bob lookup of alice's committed chunk", lambda: bob.lookup([new]).length,
                 absent=lambda n: n == 0)
    _no_new_leaks(leaks)
    assert world["op"].list_chunks(b"\xb5").entries == []


def test_events_and_snapshot_scoping(world: World) -> None:
    op = world["op"]
    _epoch, _seq, everything = op.snapshot()
    assert set(ALICE) <= {bytes(e.key) for e in everything}
    events = op.subscribe(timeout_s=10.0)
    try:
        assert next(events).kind == pb.EVENT_STORED
    finally:
        events.close()
    leaks = len(TALLY.leaks)
    TALLY.attack("operator scoped to bob snapshot",
                 lambda: [bytes(e.key) for e in world["op-as-bob"].snapshot()[2]],
                 absent=_none_of_alices)
    TALLY.attack("bob-admin snapshot as alice", lambda: world["bob-admin-as-alice"].snapshot())
    TALLY.attack("operator scoped to bob subscribe",
                 lambda: next(world["op-as-bob"].subscribe(timeout_s=10.0)))
    TALLY.attack("bob (engine) snapshot", lambda: world["bob"].snapshot())
    _no_new_leaks(leaks)


# --- the rules, and a daemon without security ------------------------------------------------


def test_resolve_tenant_rules() -> None:
    from kvstore.node.index import DEFAULT_TENANT
    from kvstore.node.service import resolve_tenant
    from kvstore.security.identity import INSECURE, Principal

    one = Principal("engine/a", Role.ENGINE, frozenset({"a"}))
    two = Principal("engine/ab", Role.ENGINE, frozenset({"a", "b"}))
    star = Principal("engine/star", Role.ENGINE, None)
    op = Principal("operator/o", Role.OPERATOR, None)
    scoped_op = Principal("operator/a", Role.OPERATOR, frozenset({"a"}))
    writer = Principal("engine/sys", Role.ENGINE, frozenset({"a"}), shared_writer=True)
    assert resolve_tenant(one, None) == "a" and resolve_tenant(one, "a", write=True) == "a"
    assert resolve_tenant(two, "b") == "b" and resolve_tenant(star, "zed") == "zed"
    assert resolve_tenant(op, None) is None and resolve_tenant(op, None, admin=True) is None
    assert resolve_tenant(op, None, write=True) == DEFAULT_TENANT
    assert resolve_tenant(op, "a") == "a" and resolve_tenant(scoped_op, None) == "a"
    assert resolve_tenant(writer, SHARED_TENANT, write=True) == SHARED_TENANT
    assert resolve_tenant(INSECURE, None) == DEFAULT_TENANT
    assert resolve_tenant(INSECURE, None, admin=True) is None
    assert resolve_tenant(INSECURE, "x", admin=True) == "x"
    for principal, requested, write, match in [
            (one, "b", False, "may not act for tenant 'b'"),
            (two, None, False, "must name one"),
            (star, None, False, "must name one"),
            (scoped_op, "b", False, "may not act for tenant 'b'"),
            (one, SHARED_TENANT, False, "may not act for tenant"),
            (Principal("engine/s", Role.ENGINE, frozenset({SHARED_TENANT})), None, True,
             "shared_writer")]:
        with pytest.raises(PermissionDenied, match=match):
            resolve_tenant(principal, requested, write=write)


def test_a_bad_tenant_setting_is_refused_before_connecting() -> None:
    for bad in ("x" * 129, "caf\u00e9", "a\nb"):
        with pytest.raises(InvalidArgument, match="tenant must be None or at most 128"):
            StoreClientConfig(tenant=bad)
    assert StoreClientConfig(tenant="").tenant == ""


def test_certificate_identities_scope_the_same_way(tmp_path: Path) -> None:
    """mTLS: the tenants come from the client certificate's SAN URI, as from a token."""
    from tests.security.pki import make_ca

    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    server_cert, server_key = ca.issue("daemon", uri="kvtier://peer/daemon").write(tmp_path)
    daemon = DaemonProcess(tmp_path, "mtls-tenancy", nvme=False, settings={
        "security.cert_file": str(server_cert), "security.key_file": str(server_key),
        "security.client_ca_file": str(ca_path), "server.shm_channel": "false"})
    daemon.start()
    clients: list[DaemonControl] = []
    try:
        def control(uri: str, tenant: str | None = None) -> DaemonControl:
            cert, key = ca.issue(uri.rsplit("/", 1)[-1], uri=uri).write(tmp_path)
            cfg = StoreClientConfig(rpc_timeout_s=10.0, tenant=tenant, security=ClientSecurity(
                ca_file=ca_path, cert_file=cert, key_file=key))
            channel, info = open_channel(daemon.grpc_address, cfg)
            clients.append(DaemonControl(daemon.grpc_address, info, channel, cfg))
            return clients[-1]

        alice = control("kvtier://engine/alice?tenants=alice")
        bob = control("kvtier://engine/bob?tenants=bob")
        bob_as_alice = control("kvtier://engine/bob2?tenants=bob", tenant="alice")
        value = os.urandom(VALUE_BYTES)
        _put(alice, ALICE[0], value)
        leaks = len(TALLY.leaks)
        TALLY.attack("mTLS bob get", lambda: _get(bob, ALICE[0]), absent=lambda v: v is None)
        TALLY.attack("mTLS bob lookup", lambda: bob.lookup([ALICE[0]]).length,
                     absent=lambda n: n == 0)
        TALLY.attack("mTLS bob put over alice's key", lambda: _put(bob, ALICE[0], b"e" * 64))
        TALLY.attack("mTLS bob get as alice", lambda: _get(bob_as_alice, ALICE[0]))
        _no_new_leaks(leaks)
        assert _get(alice, ALICE[0]) == value
    finally:
        for c in clients:
            c.close()
        daemon.stop()


def test_daemon_without_security_scopes_by_the_named_tenant(tmp_path: Path) -> None:
    """No security config: the metadata is taken as given (there is nothing to check it
    against), a call naming none is the default tenant's, and admin calls see every tenant."""
    daemon = DaemonProcess(tmp_path, "open", nvme=False, settings={"server.shm_channel": "false"})
    daemon.start()
    clients: list[DaemonControl] = []
    try:
        def control(tenant: str | None) -> DaemonControl:
            cfg = StoreClientConfig(rpc_timeout_s=10.0, security=ClientSecurity(), tenant=tenant)
            channel, info = open_channel(daemon.grpc_address, cfg)
            clients.append(DaemonControl(daemon.grpc_address, info, channel, cfg))
            return clients[-1]

        plain, t1 = control(None), control("t1")
        k_plain, k_t1 = _key(0xC0, 0), _key(0xC1, 0)
        _put(plain, k_plain, b"p" * 64)
        _put(t1, k_t1, b"t" * 64)
        assert _get(plain, k_plain) == b"p" * 64 and _get(t1, k_t1) == b"t" * 64
        assert _get(plain, k_t1) is None and _get(t1, k_plain) is None
        assert plain.lookup([k_t1]).length == 0
        with pytest.raises(PermissionDenied, match="another tenant"):
            _put(plain, k_t1, b"x" * 64)
        assert {k_plain, k_t1} <= set(_keys(plain.list_chunks()))
        assert _keys(t1.list_chunks()) == [k_t1]
        assert _get(t1, k_t1) == b"t" * 64
    finally:
        for c in clients:
            c.close()
        daemon.stop()


# --- after every attack -----------------------------------------------------------------------


def test_zz_alices_chunks_read_back_after_every_attack(
        world: World, capsys: pytest.CaptureFixture[str]) -> None:
    """Runs last (file order): every chunk of alice's chain reads back byte for byte, through
    her own credentials and the operator's; then the counts are printed."""
    alice = world["alice"]
    for key in ALICE:
        if _get(alice, key) != world.values[key]:
            TALLY.lost += 1
    assert alice.lookup(ALICE).length == N_CHAIN
    line = (f"tenancy over gRPC: attempts={TALLY.attempts} "
            f"refused={TALLY.refused + TALLY.absent} ({TALLY.refused} with an error status, "
            f"{TALLY.absent} answered as absent) leaked={len(TALLY.leaks)} lost={TALLY.lost}")
    with capsys.disabled():
        print("\n" + line)
    assert TALLY.leaks == [] and TALLY.lost == 0, TALLY
    assert TALLY.attempts == TALLY.refused + TALLY.absent


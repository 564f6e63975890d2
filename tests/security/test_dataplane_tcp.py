"""The TCP data plane of a daemon with security, against real daemon processes: a connection is
served only after a session ticket from ``IssueDataTicket`` (a raw connection without one, with
a forged one, another daemon's or an expired one is refused and stores nothing), and the ticket's
tenant scopes every frame of the connection (bob can neither read, overwrite nor remove alice's
chunks; each reads its own back byte for byte). docs/security.md, "Data planes".

Every refusal is paired with the same operation succeeding for the right identity, and what
alice stored before the attacks reads back byte for byte after them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.planes import RemotePlane
from kvstore.client.store_client import StoreClient
from kvstore.client.store_config import DataPlane, StoreClientConfig
from kvstore.dataplane.transport.frames import Opcode, Status
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.errors import ChunkNotFound, InvalidArgument, PermissionDenied, Unauthenticated
from kvstore.node.index import SHARED_TENANT
from tests.security.secured_daemon import (
    SecuredDaemon,
    answer_then_close,
    raw_frame,
    read_answer,
    start_secured_daemon,
)
from tests.support.daemon import DaemonProcess

SIZES = (4096, 64 << 10, 1 << 20, 9 << 20)
"""Small (copied), leased, large, and striped over several connections (> 8 MiB)."""


def _key(tag: int, i: int) -> bytes:
    return bytes([tag]) * 8 + i.to_bytes(8, "big")


ALICE = {_key(0xA1, i): os.urandom(size) for i, size in enumerate(SIZES)}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    w = start_secured_daemon(tmp_path_factory.mktemp("dp-tcp"), "dp-tcp", shm=False,
                             settings={"dram.capacity_bytes": "96MiB"})
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    """A second daemon with security (its own ticket key)."""
    w = start_secured_daemon(tmp_path_factory.mktemp("dp-tcp-other"), "dp-tcp-other",
                             shm=False)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def alice(world: SecuredDaemon) -> StoreClient:
    c = world.client("alice", DataPlane.TCP)
    for key, value in ALICE.items():
        c.put(key, value)
    return c


def _tcp(c: StoreClient) -> TcpClient:
    remote = c._remote
    assert isinstance(remote, RemotePlane)
    return remote.tcp_client()


def _reads_back(c: StoreClient, values: dict[bytes, bytes]) -> None:
    for key, value in values.items():
        out = bytearray(len(value))
        assert c.get_into(key, out) == len(value)
        assert out == value, f"{key.hex()} did not read back byte for byte"


def _alice_intact(alice: StoreClient) -> None:
    _reads_back(alice, ALICE)
    for key, value in ALICE.items():
        assert _tcp(alice).size_of(key) == len(value)


# --- milestone 1: tickets -----------------------------------------------------------------------


def test_the_daemon_requires_tickets_and_a_client_with_one_moves_values(
        world: SecuredDaemon, alice: StoreClient) -> None:
    assert alice.info.data_ticket_required
    assert alice.data_plane is DataPlane.TCP
    _reads_back(alice, ALICE)  # put over TCP by the fixture, every size
    remote = alice._remote
    assert isinstance(remote, RemotePlane) and remote.tickets is not None
    assert remote.tickets.fetched >= 1
    reply = world.ticket("alice")
    assert reply.tenant == "alice" and not reply.every_tenant
    assert reply.expires_at_unix_s > time.time()


def test_a_raw_connection_without_a_ticket_is_refused_and_stores_nothing(
        world: SecuredDaemon, alice: StoreClient) -> None:
    key = _key(0xE0, 1)
    for opcode, payload in ((Opcode.PUT, b"poison"), (Opcode.GET, b""),
                            (Opcode.EXISTS, b""), (Opcode.REMOVE, b"")):
        with socket.create_connection(world.tcp, timeout=10) as sock:
            fields = {"total_size": len(payload), "length": len(payload)} if payload else {}
            target = key if opcode is Opcode.PUT else next(iter(ALICE))
            raw_frame(sock, opcode, target, payload, **fields)
            status, detail = answer_then_close(sock)
            assert status is Status.UNAUTHENTICATED, (opcode, status)
            assert b"session ticket" in detail
    # Nothing was stored, and the same put with a ticket is served.
    assert _tcp(alice).size_of(key) is None
    alice.put(key, b"ok")
    assert bytes(alice.get(key)) == b"ok"
    _alice_intact(alice)


def test_a_forged_another_daemons_and_an_expired_ticket_are_refused(
        world: SecuredDaemon, other: SecuredDaemon, alice: StoreClient) -> None:
    host, port = world.tcp
    good = world.ticket("alice")
    raw = bytes(good.ticket)
    forged_mac = raw[:-4] + (b"AAAA" if not raw.endswith(b"AAAA") else b"BBBB")
    body, _, mac = raw.rpartition(b".")
    forged_claims = body.replace(b"kvt1.", b"kvt1.e", 1) + b"." + mac
    another_daemons = bytes(other.ticket("alice").ticket)  # the same principal, elsewhere
    short = world.ticket("alice", ttl_s=0.5)
    while time.time() <= short.expires_at_unix_s:  # wait for it to expire (no timing assert)
        time.sleep(0.1)
    attempts = {"forged signature": forged_mac, "forged claims": forged_claims,
                "another daemon's": another_daemons, "expired": bytes(short.ticket),
                "empty": b"x"}
    for i, (what, ticket) in enumerate(attempts.items()):
        key = _key(0xE1, i)
        with pytest.raises(Unauthenticated), TcpClient(host, port, 1, ticket=ticket) as c:
            c.put(key, b"poison")
        assert _tcp(alice).size_of(key) is None, what
        with TcpClient(host, port, 1, ticket=raw) as c:  # the right ticket: served
            c.put(key, what.encode())
            assert bytes(c.get(key)) == what.encode()
    # The other daemon serves the ticket it issued.
    oh, op = other.tcp
    with TcpClient(oh, op, 1, ticket=another_daemons) as c:
        c.put(_key(0xE2, 0), b"there")
        assert bytes(c.get(_key(0xE2, 0))) == b"there"
    _alice_intact(alice)


def test_a_ticket_longer_than_the_daemon_allows_is_refused(world: SecuredDaemon) -> None:
    with pytest.raises(InvalidArgument):
        world.ticket("alice", ttl_s=10 * 86400)
    with pytest.raises(InvalidArgument):
        world.ticket("alice", ttl_s=-1)
    assert world.ticket("alice", ttl_s=5).ttl_s == 5


def test_a_connection_is_closed_once_its_ticket_expires(world: SecuredDaemon,
                                                        alice: StoreClient) -> None:
    short = world.ticket("alice", ttl_s=0.5)
    key = next(iter(ALICE))
    with socket.create_connection(world.tcp, timeout=10) as sock:
        raw_frame(sock, Opcode.HELLO, payload=bytes(short.ticket))
        assert read_answer(sock)[0] is Status.OK
        raw_frame(sock, Opcode.EXISTS, key, request_id=2)
        assert read_answer(sock)[0] is Status.OK  # served while valid
        while time.time() <= short.expires_at_unix_s:
            time.sleep(0.1)
        raw_frame(sock, Opcode.EXISTS, key, request_id=3)
        status, detail = answer_then_close(sock)
        assert status is Status.UNAUTHENTICATED and b"expired" in detail


def test_a_client_renews_its_ticket_and_keeps_working(world: SecuredDaemon,
                                                     alice: StoreClient) -> None:
    c = world.client("alice", DataPlane.TCP, data_ticket_ttl_s=2.0)
    remote = c._remote
    assert isinstance(remote, RemotePlane) and remote.tickets is not None
    key = _key(0xA5, 0)
    c.put(key, b"before")
    first = remote.tickets.current()
    while time.time() <= first.expires_at_unix_s:  # the first ticket is gone
        time.sleep(0.1)
    assert bytes(c.get(key)) == b"before"  # over a renewed (or new) connection
    c.put(_key(0xA5, 1), b"after")
    assert bytes(_tcp(c).get(_key(0xA5, 1))) == b"after"
    assert remote.tickets.fetched >= 2
    _alice_intact(alice)


# --- step 2: the ticket's tenant scopes every frame ------------------------------------------------


def test_bob_cannot_read_overwrite_or_remove_alices_chunks_over_tcp(
        world: SecuredDaemon, alice: StoreClient) -> None:
    bob = world.client("bob", DataPlane.TCP)
    bob_tcp = _tcp(bob)
    for key, value in ALICE.items():
        out = bytearray(len(value))
        with pytest.raises(ChunkNotFound):
            bob.get_into(key, out)  # read: absent (existence is not leaked)
        assert out == bytearray(len(value))
        with pytest.raises(ChunkNotFound):
            bob_tcp.get(key)
        assert bob_tcp.size_of(key) is None
        assert bob_tcp.exists(key) is False
        with pytest.raises(PermissionDenied):
            bob.put(key, os.urandom(len(value)))  # overwrite: refused (keys are global)
        assert bob_tcp.remove(key) is False  # remove: not found for bob
    # The same operations succeed for alice, on her own chunks...
    _alice_intact(alice)
    # ...and for bob on his: he stores, reads back and removes his own.
    mine = {_key(0xB0, i): os.urandom(size) for i, size in enumerate(SIZES)}
    for key, value in mine.items():
        bob.put(key, value)
    _reads_back(bob, mine)
    for key in mine:
        with pytest.raises(ChunkNotFound):
            _tcp(alice).get(key)  # and alice cannot read bob's
    victim = next(iter(mine))
    assert _tcp(alice).remove(victim) is False
    assert bob_tcp.remove(victim) is True
    assert bob_tcp.size_of(victim) is None
    # The tenants' chunks are seen by their own gRPC lookups too (one tenant per chunk).
    assert world.control("alice").exists(next(iter(ALICE)))
    assert not world.control("bob").exists(next(iter(ALICE)))
    _alice_intact(alice)


def test_an_operator_of_every_tenant_reads_every_tenants_chunks_over_tcp(
        world: SecuredDaemon, alice: StoreClient) -> None:
    op = world.client("op", DataPlane.TCP)
    _reads_back(op, ALICE)
    reply = world.ticket("op")
    assert reply.every_tenant and reply.tenant == ""


def test_a_ticket_of_one_connection_works_on_another_but_not_for_another_tenant(
        world: SecuredDaemon, alice: StoreClient) -> None:
    """A ticket is the tenant's: bob's ticket on a fresh connection reads as bob, never as
    alice, whichever connection it came from."""
    host, port = world.tcp
    bobs = bytes(world.ticket("bob").ticket)
    key = next(iter(ALICE))
    with TcpClient(host, port, 2, ticket=bobs) as c:
        assert c.size_of(key) is None
        with pytest.raises(ChunkNotFound):
            c.get(key)
    alices = bytes(world.ticket("alice").ticket)
    with TcpClient(host, port, 2, ticket=alices) as c:
        assert c.size_of(key) == len(ALICE[key])


def test_a_renewal_for_another_tenant_is_refused(world: SecuredDaemon,
                                                 alice: StoreClient) -> None:
    key = next(iter(ALICE))
    with socket.create_connection(world.tcp, timeout=10) as sock:
        raw_frame(sock, Opcode.HELLO, payload=bytes(world.ticket("bob").ticket))
        assert read_answer(sock)[0] is Status.OK
        raw_frame(sock, Opcode.HELLO, payload=bytes(world.ticket("alice").ticket),
                  request_id=2)
        status, _ = answer_then_close(sock)
        assert status is Status.PERMISSION_DENIED
    with socket.create_connection(world.tcp, timeout=10) as sock:  # the same, for alice
        raw_frame(sock, Opcode.HELLO, payload=bytes(world.ticket("alice").ticket))
        assert read_answer(sock)[0] is Status.OK
        raw_frame(sock, Opcode.HELLO, payload=bytes(world.ticket("alice").ticket),
                  request_id=2)
        assert read_answer(sock)[0] is Status.OK
        raw_frame(sock, Opcode.EXISTS, key, request_id=3)
        assert read_answer(sock)[0] is Status.OK
    _alice_intact(alice)



def test_the_shared_tenant_over_tcp_needs_a_shared_writer(world: SecuredDaemon,
                                                          alice: StoreClient) -> None:
    """A shared writer's ticket for the shared tenant stores chunks every tenant reads; an
    operator's ticket naming the shared tenant reads them but may not write (it is no shared
    writer: its scope has no write tenant); naming a tenant the credentials do not allow (bob
    naming the shared tenant or alice) gets no ticket at all."""
    writer = world.client("sys", DataPlane.TCP, tenant=SHARED_TENANT)
    key, value = _key(0x5A, 0), os.urandom(64 << 10)
    writer.put(key, value)
    for name in ("alice", "bob"):
        reader = world.client(name, DataPlane.TCP)
        _reads_back(reader, {key: value})
    reply = world.ticket("op", tenant=SHARED_TENANT)
    assert reply.tenant == "" and not reply.every_tenant  # no write tenant
    host, port = world.tcp
    with TcpClient(host, port, 1, ticket=bytes(reply.ticket)) as c:
        assert bytes(c.get(key)) == value
        with pytest.raises(PermissionDenied):
            c.put(_key(0x5A, 1), b"poison")
        assert c.size_of(_key(0x5A, 1)) is None
    for tenant in ("alice", SHARED_TENANT):
        with pytest.raises(PermissionDenied):
            world.ticket("bob", tenant=tenant)
    with pytest.raises(PermissionDenied):  # the client fails at its first data-plane call
        world.client("bob", DataPlane.TCP, tenant="alice").put(_key(0xB9, 0), b"x")
    _alice_intact(alice)


def test_without_security_no_ticket_is_needed(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A daemon without security behaves as before: no ticket, the data planes serve every
    connection, and it issues no ticket."""
    tmp = tmp_path_factory.mktemp("dp-insecure")
    daemon = DaemonProcess(tmp, "dp-insecure", nvme=False)
    daemon.start()
    try:
        for plane in (DataPlane.TCP, DataPlane.SHM):
            with StoreClient.connect(daemon.grpc_address,
                                     StoreClientConfig(data_plane=plane)) as c:
                assert not c.info.data_ticket_required
                remote = c._remote
                assert isinstance(remote, RemotePlane) and remote.tickets is None
                key, value = _key(0x11, int(plane is DataPlane.SHM)), os.urandom(100 << 10)
                c.put(key, value)
                _reads_back(c, {key: value})
                with pytest.raises(InvalidArgument, match="without security"):
                    c.call("IssueDataTicket", pb.IssueDataTicketRequest())
        host, _, port = str(daemon.addresses["tcp_address"]).rpartition(":")
        with TcpClient(host, int(port), 1) as raw:  # no HELLO at all
            assert raw.size_of(_key(0x11, 0)) == 100 << 10
    finally:
        daemon.stop()

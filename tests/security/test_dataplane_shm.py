"""The same-host lease channel of a daemon with security, against a real daemon process: the
first request of a connection must be a HELLO with a session ticket (without one, with a
forged or an expired one the connection is refused and nothing is stored), and the ticket's
tenant scopes every request of the connection (ACQUIRE_READ, PUT, PUT_MANY, RESERVE/COMMIT,
RESERVE_MANY/COMMIT_MANY, SIZE_OF, REMOVE). docs/security.md, "Data planes".

The daemon runs with ``dram.read_index: false``: the lease-free read index is a table any
process that maps the arena reads (its owner tags only steer kvtier's own reader:
``test_read_index_tenants.py``; what that means is in the docs), so with it off every same-host
read takes a lease and is checked. Every refusal is paired with
the same operation succeeding for the right identity; what alice stored before the attacks
reads back byte for byte after them.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator

import pytest

from kvstore.client.store_client import StoreClient
from kvstore.client.store_config import DataPlane
from kvstore.dataplane.transport.shm import ShmClient
from kvstore.dataplane.transport.shm.channel import LeaseChannel
from kvstore.dataplane.transport.shm.frames import (
    FLAG_NO_REPLY,
    FLAG_PARENTS,
    ITEM_FAILED,
    ChannelOp,
    key_parent_pairs,
)
from kvstore.errors import (
    ChunkNotFound,
    KvtierError,
    PeerUnavailable,
    PermissionDenied,
    Unauthenticated,
)
from tests.security.secured_daemon import SecuredDaemon, start_secured_daemon

SIZES = (4096, 64 << 10, 200 << 10, 2 << 20)
"""Inline PUTs (up to 64 KiB) and RESERVE/COMMIT puts."""


def _key(tag: int, i: int) -> bytes:
    return bytes([tag]) * 8 + i.to_bytes(8, "big")


ALICE = {_key(0xA1, i): os.urandom(size) for i, size in enumerate(SIZES)}
ALICE_BATCH = {_key(0xA2, i): os.urandom(size) for i, size in enumerate(SIZES)}
"""Stored with put_many (PUT_MANY for the small ones, RESERVE_MANY/COMMIT_MANY for the rest)."""


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    w = start_secured_daemon(tmp_path_factory.mktemp("dp-shm"), "dp-shm", shm=True,
                             settings={"dram.capacity_bytes": "64MiB",
                                       "dram.read_index": "false"})
    try:
        yield w
    finally:
        w.close()


def _shm(c: StoreClient) -> ShmClient:
    plane = c.plane
    assert isinstance(plane, ShmClient), f"expected the shared-memory plane, got {plane!r}"
    return plane


@pytest.fixture(scope="module")
def alice(world: SecuredDaemon) -> StoreClient:
    c = world.client("alice", DataPlane.SHM)
    for key, value in ALICE.items():
        c.put(key, value)
    assert _shm(c).put_many(list(ALICE_BATCH), list(ALICE_BATCH.values())) == \
        [True] * len(ALICE_BATCH)
    return c


def _reads_back(c: StoreClient, values: dict[bytes, bytes]) -> None:
    for key, value in values.items():
        out = bytearray(len(value))
        assert c.get_into(key, out) == len(value)
        assert out == value, f"{key.hex()} did not read back byte for byte"
        assert _shm(c).size_of(key) == len(value)


def _alice_intact(alice: StoreClient) -> None:
    _reads_back(alice, ALICE)
    _reads_back(alice, ALICE_BATCH)


def _channel(world: SecuredDaemon) -> LeaseChannel:
    return LeaseChannel(str(world.daemon.addresses["shm_socket"]), io_timeout_s=10)


def _hello(chan: LeaseChannel, ticket: bytes, flags: int = 0) -> None:
    if flags & FLAG_NO_REPLY:
        chan.send(ChannelOp.HELLO, flags=flags, arg=len(ticket), payload=memoryview(ticket))
    else:
        chan.call(ChannelOp.HELLO, arg=len(ticket), payload=memoryview(ticket))


def _put(chan: LeaseChannel, key: bytes, value: bytes) -> None:
    chan.call(ChannelOp.PUT, keys=[key, b""], arg=len(value), payload=memoryview(value))


def _size_of(chan: LeaseChannel, key: bytes) -> int | None:
    _lease, ranges = chan.call(ChannelOp.SIZE_OF, keys=[key])
    present, size = ranges[0]
    return size if present else None


# --- tickets --------------------------------------------------------------------------------------


def test_engines_move_values_over_shared_memory_with_a_ticket(world: SecuredDaemon,
                                                              alice: StoreClient) -> None:
    assert alice.info.data_ticket_required and not alice.info.shm_read_index
    assert alice.data_plane is DataPlane.SHM
    _alice_intact(alice)
    with alice.read_view(next(iter(ALICE))) as view:  # a zero-copy lease
        assert bytes(view) == next(iter(ALICE.values()))


def test_a_connection_without_a_ticket_is_refused_and_stores_nothing(
        world: SecuredDaemon, alice: StoreClient) -> None:
    key = _key(0xE0, 0)
    for op, kwargs in ((ChannelOp.PUT, {"keys": [key, b""], "arg": 6,
                                        "payload": memoryview(b"poison")}),
                       (ChannelOp.ACQUIRE_READ, {"keys": [next(iter(ALICE))]}),
                       (ChannelOp.SIZE_OF, {"keys": [next(iter(ALICE))]}),
                       (ChannelOp.REMOVE, {"keys": [next(iter(ALICE))]}),
                       (ChannelOp.READS, {"keys": [next(iter(ALICE))]})):
        chan = _channel(world)
        try:
            with pytest.raises(Unauthenticated, match="session ticket"):
                chan.call(op, **kwargs)  # type: ignore[arg-type]
            assert chan.broken  # a closing reply: the server hung up
        finally:
            chan.close()
    assert _shm(alice).size_of(key) is None
    alice.put(key, b"ok")  # the same put with a ticket is served
    assert bytes(alice.get(key)) == b"ok"
    _alice_intact(alice)


def test_a_forged_and_an_expired_ticket_are_refused(world: SecuredDaemon,
                                                    alice: StoreClient) -> None:
    good = bytes(world.ticket("alice").ticket)
    forged = good[:-4] + (b"AAAA" if not good.endswith(b"AAAA") else b"BBBB")
    short = world.ticket("alice", ttl_s=0.5)
    while time.time() <= short.expires_at_unix_s:  # wait for it to expire (no timing assert)
        time.sleep(0.1)
    for i, ticket in enumerate((forged, bytes(short.ticket), b"kvt1.x.y")):
        key = _key(0xE1, i)
        chan = _channel(world)
        try:
            with pytest.raises(Unauthenticated):
                _hello(chan, ticket)
            with pytest.raises((Unauthenticated, PeerUnavailable)):
                _put(chan, key, b"poison")  # nothing more is served on it
        finally:
            chan.close()
        assert _shm(alice).size_of(key) is None
        chan = _channel(world)  # the right ticket: the same put is served
        try:
            _hello(chan, good)
            _put(chan, key, b"fine")
            assert _size_of(chan, key) == 4
        finally:
            chan.close()
    _alice_intact(alice)


def test_an_expired_session_keeps_its_leases_and_renews(world: SecuredDaemon,
                                                         alice: StoreClient) -> None:
    key, value = next(iter(ALICE.items()))
    short = world.ticket("alice", ttl_s=0.5)
    chan = _channel(world)
    try:
        _hello(chan, bytes(short.ticket))
        lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[key])
        assert lease_id and ranges[0][1] == len(value)
        while time.time() <= short.expires_at_unix_s:
            time.sleep(0.1)
        with pytest.raises(Unauthenticated, match="expired"):
            chan.call(ChannelOp.SIZE_OF, keys=[key])
        with pytest.raises(Unauthenticated, match="expired"):
            _put(chan, _key(0xE2, 0), b"late")
        assert not chan.broken  # the connection and its lease stay...
        chan.call(ChannelOp.RELEASE, arg=lease_id)  # ...and what it holds can be ended
        _hello(chan, bytes(world.ticket("alice").ticket), FLAG_NO_REPLY)  # a renewal
        assert _size_of(chan, key) == len(value)
        _put(chan, _key(0xE2, 0), b"renewed")
        assert _size_of(chan, _key(0xE2, 0)) == 7
        with pytest.raises(PermissionDenied):  # a renewal must keep the tenant
            _hello(chan, bytes(world.ticket("bob").ticket))
    finally:
        chan.close()
    _alice_intact(alice)


def test_a_client_renews_its_lease_channel_tickets(world: SecuredDaemon,
                                                   alice: StoreClient) -> None:
    c = world.client("alice", DataPlane.SHM, data_ticket_ttl_s=2.0)
    remote = c._remote
    assert remote.tickets is not None
    key = _key(0xA5, 0)
    c.put(key, b"before")
    first = remote.tickets.current()
    while time.time() <= first.expires_at_unix_s:
        time.sleep(0.1)
    assert bytes(c.get(key)) == b"before"
    c.put(_key(0xA5, 1), os.urandom(100 << 10))  # RESERVE/COMMIT on a renewed channel
    assert _shm(c).size_of(_key(0xA5, 1)) == 100 << 10
    assert remote.tickets.fetched >= 2
    _alice_intact(alice)


# --- the ticket's tenant scopes every request -----------------------------------------------------


def test_bob_cannot_read_overwrite_or_remove_alices_chunks_over_shm(
        world: SecuredDaemon, alice: StoreClient) -> None:
    bob = world.client("bob", DataPlane.SHM)
    shm = _shm(bob)
    every = {**ALICE, **ALICE_BATCH}
    for key, value in every.items():
        out = bytearray(len(value))
        with pytest.raises(ChunkNotFound):
            bob.get_into(key, out)  # ACQUIRE_READ: absent
        assert out == bytearray(len(value))
        with pytest.raises(ChunkNotFound):
            shm.open_read(key)
        assert shm.size_of(key) is None  # SIZE_OF
        assert shm.remove(key) is False  # REMOVE: not found for bob
        with pytest.raises(PermissionDenied):
            bob.put(key, os.urandom(len(value)))  # PUT / RESERVE: refused
    with pytest.raises(KvtierError) as refused:  # PUT_MANY and RESERVE_MANY
        shm.put_many(list(every), [os.urandom(len(v)) for v in every.values()])
    assert isinstance(refused.value, PermissionDenied)
    assert shm.load_prefix(list(ALICE)[:1], [bytearray(SIZES[0])]) == 0
    assert shm.get_many_into(list(ALICE), [bytearray(len(v)) for v in ALICE.values()]) == \
        [None] * len(ALICE)
    # The same operations succeed for alice...
    _alice_intact(alice)
    # ...and for bob on his own chunks, which alice in turn cannot see.
    mine = {_key(0xB0, i): os.urandom(size) for i, size in enumerate(SIZES)}
    batch = {_key(0xB1, i): os.urandom(size) for i, size in enumerate(SIZES)}
    for key, value in mine.items():
        bob.put(key, value)
    assert shm.put_many(list(batch), list(batch.values())) == [True] * len(batch)
    _reads_back(bob, mine)
    _reads_back(bob, batch)
    for key in [*mine, *batch]:
        assert _shm(alice).size_of(key) is None
        with pytest.raises(ChunkNotFound):
            alice.get_into(key, bytearray(len({**mine, **batch}[key])))
    victim = next(iter(mine))
    assert _shm(alice).remove(victim) is False
    assert shm.remove(victim) is True
    assert shm.size_of(victim) is None
    # One owner per chunk, over every plane: gRPC sees what the lease channel stored.
    assert world.control("alice").exists(next(iter(ALICE_BATCH)))
    assert not world.control("bob").exists(next(iter(ALICE_BATCH)))
    assert world.control("bob").exists(next(iter(batch)))
    _alice_intact(alice)


def test_bob_cannot_commit_under_alices_chain_or_use_her_leases(
        world: SecuredDaemon, alice: StoreClient) -> None:
    """RESERVE_MANY/COMMIT_MANY with parents: a child of alice's chunk is refused to bob (the
    parent is not visible to him) and allowed to alice; lease ids do not cross connections."""
    parent = next(iter(ALICE))
    child = _key(0xC0, 0)
    items = key_parent_pairs([child], [parent])
    sizes = struct.pack("<Q", 100 << 10)
    for name, allowed in (("bob", False), ("alice", True)):
        chan = _channel(world)
        try:
            _hello(chan, bytes(world.ticket(name).ticket))
            chan.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS, keys=items,
                      arg=len(sizes), payload=memoryview(sizes))
            status = chan.detail[0]
            assert (status != ITEM_FAILED) is allowed, (name, chan.detail)
            if allowed:
                _lease, ranges = chan.call(ChannelOp.SIZE_OF, keys=[child])
                assert ranges[0] == (0, 0)  # reserved, not visible yet
        finally:
            chan.close()  # an uncommitted reservation is aborted with its connection
    assert _shm(alice).size_of(child) is None
    _alice_intact(alice)


def test_writes_into_reserved_ranges_are_owned_by_the_writers_tenant(
        world: SecuredDaemon, alice: StoreClient) -> None:
    """ShmWriter (one-copy saves: reserve, write into the arena, commit) on a connection that
    presented alice's ticket stores alice's chunks, a child reserved under a still-open parent
    too; bob's writer reserving alice's key is refused and his batch stores his own."""
    keys = [_key(0xA7, i) for i in range(3)]
    values = [os.urandom(128 << 10) for _ in keys]
    parents: list[bytes | None] = [None, keys[0], keys[1]]
    shm = _shm(alice)
    writer = shm.open_writer()
    try:
        batch = writer.reserve(keys, [len(v) for v in values], parents)
        assert batch.outcome == [True, True, True] and batch.writable
        for (offset, size), value in zip(batch.ranges, values, strict=True):  # type: ignore[misc]
            shm.arena.view(offset, size, readonly=False)[:] = value
        assert batch.commit() == [True, True, True]
    finally:
        writer.close()
    _reads_back(alice, dict(zip(keys, values, strict=True)))
    assert world.control("alice").lookup(keys).length == 3
    assert world.control("bob").lookup(keys).length == 0
    bob_shm = _shm(world.client("bob", DataPlane.SHM))
    writer = bob_shm.open_writer()
    try:
        mine = _key(0xB7, 0)
        batch = writer.reserve([keys[0], mine], [10, 10], [None, None])
        assert batch.outcome[0] is None and isinstance(batch.refusal, PermissionDenied)
        assert batch.outcome[1] is True
        offset, size = batch.ranges[1]  # type: ignore[misc]
        bob_shm.arena.view(offset, size, readonly=False)[:] = b"b" * 10
        assert batch.commit()[1] is True
    finally:
        writer.close()
    assert bob_shm.size_of(mine) == 10 and shm.size_of(mine) is None
    _alice_intact(alice)
    _reads_back(alice, dict(zip(keys, values, strict=True)))

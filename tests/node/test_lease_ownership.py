"""Leases and pins belong to the session that took them (issue 12).

A real daemon process and two real clients, alice and bob, in this process (separate lease
channel connections and gRPC channels, so separate sessions). Bob knows alice's lease ids (the
test hands them over) and tries to end them over the lease channel and over gRPC, by id and by
guessing its neighbours: every attempt is refused, alice's zero-copy view keeps reading her bytes
through remove/put churn by bob, and ids are not sequential. A view knows its deadline and
refuses to be read past it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.shm import LeaseChannel, ShmReadLease
from kvstore.dataplane.transport.shm.frames import FLAG_NO_REPLY, ChannelOp
from kvstore.errors import ChunkBusy, LeaseExpired
from tests.support.daemon import DaemonProcess

MiB = 1 << 20
NEIGHBOURS = range(-8, 9)


def value(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    # A small DRAM and no NVMe: bob's puts must reuse the space of whatever is removed.
    d = DaemonProcess(tmp_path_factory.mktemp("owners"), "node-owners", dram_bytes="8MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def alice(daemon: DaemonProcess) -> Iterator[StoreClient]:
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM)) as client:
        yield client


@pytest.fixture(scope="module")
def bob(daemon: DaemonProcess) -> Iterator[StoreClient]:
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM)) as client:
        yield client


def _bob_releases_over_the_channel(daemon: DaemonProcess, ids: list[int]) -> None:
    chan = LeaseChannel(daemon.addresses["shm_socket"], io_timeout_s=10.0)
    try:
        for lease_id in ids:
            if lease_id > 0:
                chan.send(ChannelOp.RELEASE, flags=FLAG_NO_REPLY, arg=lease_id)
        chan.call(ChannelOp.PING)  # every RELEASE before it has been served
    finally:
        chan.close()


def _churn(bob: StoreClient, rounds: int) -> None:
    """Fill DRAM with 1 MiB chunks and remove them again, so freed space is reused."""
    for r in range(rounds):
        keys = [b"churn-%d-%d" % (r, i) for i in range(6)]
        for i, key in enumerate(keys):
            bob.put(key, value(1000 + 10 * r + i, MiB))
        for key in keys:
            bob.remove(key)


def test_bob_cannot_end_alices_read_lease_and_her_view_keeps_her_bytes(
        daemon: DaemonProcess, alice: StoreClient, bob: StoreClient) -> None:
    mine = value(1, MiB)
    alice.put(b"alice", mine)
    with alice.read_lease(b"alice") as lease:
        assert isinstance(lease, ShmReadLease)
        guesses = [lease.lease_id + d for d in NEIGHBOURS]
        _bob_releases_over_the_channel(daemon, guesses)
        stub = bob.stub()
        for lease_id in guesses:
            if lease_id > 0:
                assert not stub.Release(pb.ReleaseRequest(lease_id=lease_id)).released
        with pytest.raises(ChunkBusy):  # still leased: bob's releases did nothing
            bob.remove(b"alice")
        _churn(bob, rounds=3)
        assert np.array_equal(np.frombuffer(lease.view, np.uint8), mine)
    alice.plane.sync()
    assert bob.remove(b"alice") == [b"alice"]  # alice's own release ended it


def test_bob_cannot_unpin_alices_pin(alice: StoreClient, bob: StoreClient) -> None:
    alice.put(b"alice-pin", value(2, 4096))
    pin_id = alice.pin([b"alice-pin"], ttl_s=60)
    for guess in (pin_id + d for d in NEIGHBOURS):
        if guess > 0:
            assert bob.unpin(guess) is False
    reply = bob.call("BatchUnpin", pb.BatchUnpinRequest(lease_ids=[pin_id]))
    assert list(reply.released) == [False]
    assert alice.inspect(b"alice-pin").pinned
    with pytest.raises(ChunkBusy):
        bob.remove(b"alice-pin")
    assert alice.unpin(pin_id) is True
    assert bob.remove(b"alice-pin") == [b"alice-pin"]


def test_bob_cannot_end_alices_grpc_leases(alice: StoreClient, bob: StoreClient) -> None:
    alice.put(b"alice-grpc", value(3, 8192))
    a, b = alice.stub(), bob.stub()
    read = a.AcquireRead(pb.AcquireReadRequest(keys=[b"alice-grpc"], ttl_s=60))
    for guess in (read.lease_id + d for d in NEIGHBOURS):
        if guess > 0:
            assert not b.Release(pb.ReleaseRequest(lease_id=guess)).released
    with pytest.raises(ChunkBusy):
        bob.remove(b"alice-grpc")
    assert a.Release(pb.ReleaseRequest(lease_id=read.lease_id)).released

    slot = a.Reserve(pb.ReserveRequest(key=b"alice-slot", size_bytes=4096, ttl_s=60))
    with pytest.raises(grpc.RpcError) as refused:
        b.Commit(pb.CommitRequest(lease_id=slot.lease_id))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert not b.Abort(pb.AbortRequest(lease_id=slot.lease_id)).aborted
    assert a.Commit(pb.CommitRequest(lease_id=slot.lease_id)).tier == pb.TIER_DRAM
    assert alice.exists(b"alice-slot")


def test_lease_and_pin_ids_are_not_sequential(alice: StoreClient) -> None:
    alice.put(b"ids", value(4, 4096))
    read_ids = []
    for _ in range(8):
        with alice.read_lease(b"ids") as lease:
            assert isinstance(lease, ShmReadLease)
            read_ids.append(lease.lease_id)
    pin_ids = [alice.pin([b"ids"], ttl_s=60) for _ in range(8)]
    grpc_ids = [alice.stub().AcquireRead(pb.AcquireReadRequest(keys=[b"ids"], ttl_s=60)).lease_id
                for _ in range(8)]
    for ids in (read_ids, pin_ids, grpc_ids):
        assert all(0 < i < 1 << 63 for i in ids)
        assert all(abs(x - y) > 1 << 20 for x, y in itertools.combinations(ids, 2)), ids
    for pin_id in pin_ids:
        assert alice.unpin(pin_id)
    for lease_id in grpc_ids:
        assert alice.stub().Release(pb.ReleaseRequest(lease_id=lease_id)).released


def _wait_past(deadline_s: float) -> None:
    while time.monotonic() < deadline_s:
        time.sleep(deadline_s - time.monotonic() + 0.01)


def test_a_view_knows_its_deadline_and_refuses_reads_past_it(daemon: DaemonProcess) -> None:
    config = StoreClientConfig(data_plane=DataPlane.SHM, lease_ttl_s=1.0)
    with StoreClient.connect(daemon.grpc_address, config) as carol:
        data = value(5, 64 * 1024)
        carol.put(b"carol", data)
        asked = time.monotonic()
        with carol.read_lease(b"carol") as lease:
            assert lease.deadline_s is not None
            assert asked <= lease.deadline_s - 1.0 <= time.monotonic()
            assert np.array_equal(np.frombuffer(lease.view, np.uint8), data)
            _wait_past(lease.deadline_s)
            with pytest.raises(LeaseExpired):
                _ = lease.view
        with pytest.raises(LeaseExpired), carol.read_view(b"carol") as view:
            assert view.nbytes == data.size
            _wait_past(time.monotonic() + 1.0)

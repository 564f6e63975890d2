"""Every TTL a client asks for is bounded, and so is the number of leases held (issue 12).

A real daemon with ``server.max_ttl_s`` 60 and ``server.max_leases`` 8: TTLs of inf, nan,
1e300, -1 and 61 are refused with INVALID_ARGUMENT on every gRPC path (Pin, BatchPin,
AcquireRead, Reserve, SetParents) and on the lease channel (ACQUIRE_READ, RESERVE; 0 there
means the default); the ninth pin, read lease or reservation is RESOURCE_EXHAUSTED (TooManyLeases) until
one ends; pins that expire are forgotten and give their place back. ``ParentHints`` checks its
TTLs by itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.shm import LeaseChannel
from kvstore.dataplane.transport.shm.frames import ChannelOp
from kvstore.errors import InvalidArgument, TooManyLeases
from kvstore.node.backend import ParentHints
from kvstore.wire import ERROR_METADATA_KEY
from tests.support.daemon import DaemonProcess

MAX_TTL_S = 60.0
MAX_LEASES = 8
BAD_TTLS = (math.inf, math.nan, 1e300, -1.0, MAX_TTL_S + 1)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("ttl"), "node-ttl", dram_bytes="8MiB", nvme=False,
                      settings={"server.max_ttl_s": str(MAX_TTL_S),
                                "server.max_leases": str(MAX_LEASES),
                                "server.shm_lease_ttl_s": "30"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[StoreClient]:
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM)) as c:
        c.put(b"held", b"x" * 4096)
        yield c


def _code(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    err: Any = caught.value
    name = dict(err.trailing_metadata() or ()).get(ERROR_METADATA_KEY, "")
    return err.code(), name, err.details()


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
def test_every_grpc_path_refuses_a_ttl_out_of_bounds(client: StoreClient, ttl: float) -> None:
    stub = client.stub()
    calls: dict[str, Callable[[], Any]] = {
        "Pin": lambda: stub.Pin(pb.PinRequest(keys=[b"held"], ttl_s=ttl)),
        "BatchPin": lambda: stub.BatchPin(pb.BatchPinRequest(
            items=[pb.PinRequest(keys=[b"held"], ttl_s=ttl)])),
        "AcquireRead": lambda: stub.AcquireRead(pb.AcquireReadRequest(keys=[b"held"],
                                                                      ttl_s=ttl)),
        "Reserve": lambda: stub.Reserve(pb.ReserveRequest(key=b"new", size_bytes=4096,
                                                          ttl_s=ttl)),
        "SetParents": lambda: stub.SetParents(pb.SetParentsRequest(
            keys=[b"child"], parents=[b"held"], ttl_s=ttl)),
    }
    for method, call in calls.items():
        code, name, details = _code(call)
        assert code is grpc.StatusCode.INVALID_ARGUMENT, (method, details)
        assert name == "InvalidArgument" and "max_ttl_s" in details, (method, details)
    assert not client.inspect(b"held").pinned
    assert not client.exists(b"new")


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
def test_the_lease_channel_refuses_a_ttl_out_of_bounds(daemon: DaemonProcess,
                                                       client: StoreClient, ttl: float) -> None:
    chan = LeaseChannel(daemon.addresses["shm_socket"], io_timeout_s=10.0)
    try:
        with pytest.raises(InvalidArgument, match="max_ttl_s"):
            chan.call(ChannelOp.ACQUIRE_READ, keys=[b"held"], ttl_s=ttl)
        with pytest.raises(InvalidArgument, match="max_ttl_s"):
            chan.call(ChannelOp.RESERVE, keys=[b"new", b""], arg=4096, ttl_s=ttl)
    finally:
        chan.close()
    assert not client.inspect(b"held").pinned
    if ttl < 0:
        return  # StoreClientConfig refuses a negative lease_ttl_s itself
    # Otherwise the client refuses nothing itself: its configured TTL goes to the daemon.
    eager = StoreClient.connect(daemon.grpc_address, StoreClientConfig(
        data_plane=DataPlane.SHM, lease_ttl_s=ttl))
    try:
        with pytest.raises(InvalidArgument), eager.read_view(b"held"):
            pass
    finally:
        eager.close()


def test_parent_hints_refuse_a_ttl_out_of_bounds() -> None:
    hints = ParentHints(max_ttl_s=MAX_TTL_S)
    for ttl in (*BAD_TTLS, 0.0):
        with pytest.raises(InvalidArgument):
            hints.expect(b"child", b"parent", ttl)
    assert len(hints) == 0
    hints.expect(b"child", b"parent", 1.0)
    assert hints.take(b"child") == b"parent"


def test_at_most_max_leases_are_held_at_once(daemon: DaemonProcess, client: StoreClient) -> None:
    stub = client.stub()
    pins = [client.pin([b"held"], ttl_s=30) for _ in range(MAX_LEASES - 2)]
    read = stub.AcquireRead(pb.AcquireReadRequest(keys=[b"held"], ttl_s=30))
    slot = stub.Reserve(pb.ReserveRequest(key=b"slot", size_bytes=4096, ttl_s=30))
    for call in (lambda: stub.Pin(pb.PinRequest(keys=[b"held"], ttl_s=30)),
                 lambda: stub.AcquireRead(pb.AcquireReadRequest(keys=[b"held"], ttl_s=30)),
                 lambda: stub.Reserve(pb.ReserveRequest(key=b"slot2", size_bytes=4096))):
        code, name, details = _code(call)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert name == "TooManyLeases" and "max_leases" in details
    chan = LeaseChannel(daemon.addresses["shm_socket"], io_timeout_s=10.0)
    try:
        with pytest.raises(TooManyLeases):
            chan.call(ChannelOp.ACQUIRE_READ, keys=[b"held"], ttl_s=10)
    finally:
        chan.close()
    assert client.unpin(pins.pop())
    pins.append(client.pin([b"held"], ttl_s=30))  # room again once one ended
    for pin_id in pins:
        assert client.unpin(pin_id)
    assert stub.Release(pb.ReleaseRequest(lease_id=read.lease_id)).released
    assert stub.Abort(pb.AbortRequest(lease_id=slot.lease_id)).aborted


def test_expired_pins_are_forgotten_and_give_their_place_back(client: StoreClient) -> None:
    for _ in range(MAX_LEASES):
        client.pin([b"held"], ttl_s=0.5)
    with pytest.raises(TooManyLeases):
        client.pin([b"held"], ttl_s=30)
    # The reaper (every 0.5 s) forgets them once expired: all eight places come back.
    deadline = time.monotonic() + 20
    fresh: list[int] = []
    while len(fresh) < MAX_LEASES:
        try:
            fresh.append(client.pin([b"held"], ttl_s=30))
        except TooManyLeases:
            assert time.monotonic() < deadline, "expired pins were not forgotten"
            time.sleep(0.1)
    for pin_id in fresh:
        assert client.unpin(pin_id)
    assert not client.inspect(b"held").pinned

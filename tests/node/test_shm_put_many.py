"""Batched same-host puts: ``StoreClient.put_many`` sends runs of small values in PUT_MANY requests
and reserves / commits runs of large ones with one RESERVE_MANY and one COMMIT_MANY, against a real
daemon process."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.shm import LeaseChannel
from kvstore.dataplane.transport.shm.frames import ChannelOp
from kvstore.errors import InvalidArgument, ProtocolError
from tests.support.common import wait_until
from tests.support.daemon import DaemonProcess

KiB, MiB = 1 << 10, 1 << 20


def value(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), "node-put-many", dram_bytes="32MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[StoreClient]:
    c = StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=DataPlane.SHM))
    yield c
    c.close()


def read(client: StoreClient, key: bytes, size: int) -> np.ndarray:
    out = np.empty(size, np.uint8)
    client.get_into(key, out)
    return out


def test_small_values_in_one_request_report_the_keys_already_stored(client: StoreClient) -> None:
    client.put(b"pm-small-3", value(3, 4 * KiB))
    keys = [b"pm-small-%d" % i for i in range(40)]
    vals = [value(i, 4 * KiB) for i in range(40)]
    stored = client.put_many(keys, vals)
    assert stored == [i != 3 for i in range(40)]
    for i, key in enumerate(keys):
        assert np.array_equal(read(client, key, 4 * KiB), vals[i])


def test_many_small_values_span_several_requests(client: StoreClient) -> None:
    keys = [b"pm-spill-%d" % i for i in range(40)]
    vals = [value(100 + i, 60 * KiB) for i in range(40)]  # 2.4 MiB: three PUT_MANY bodies
    assert client.put_many(keys, vals) == [True] * 40
    for i, key in enumerate(keys):
        assert np.array_equal(read(client, key, 60 * KiB), vals[i])


def test_large_values_are_reserved_and_committed_in_batches(client: StoreClient) -> None:
    client.put(b"pm-large-1", value(201, 256 * KiB))
    keys = [b"pm-large-%d" % i for i in range(5)]
    vals = [value(200 + i, 256 * KiB) for i in range(5)]
    assert client.put_many(keys, vals) == [True, False, True, True, True]
    for i, key in enumerate(keys):
        assert np.array_equal(read(client, key, 256 * KiB), vals[i])
    assert client.stats().shm_leases_open == 0


def test_mixed_sizes_keep_their_order(client: StoreClient) -> None:
    sizes = [4 * KiB, 1 * MiB, 8 * KiB, 2 * MiB, 16 * KiB]
    keys = [b"pm-mixed-%d" % i for i in range(5)]
    vals = [value(300 + i, s) for i, s in enumerate(sizes)]
    assert client.put_many(keys, vals) == [True] * 5
    for key, v, s in zip(keys, vals, sizes, strict=True):
        assert np.array_equal(read(client, key, s), v)


def test_an_empty_value_is_refused_before_anything_is_sent(client: StoreClient) -> None:
    with pytest.raises(InvalidArgument):
        client.put_many([b"pm-e1", b"pm-e2"], [value(1, 4 * KiB), b""])
    assert not client.exists(b"pm-e1")


def test_reservations_of_a_closed_connection_never_become_visible(client: StoreClient) -> None:
    chan = LeaseChannel(client.info.shm_socket)
    sizes = struct.pack("<2Q", 128 * KiB, 128 * KiB)
    _lease, ranges = chan.call(ChannelOp.RESERVE_MANY, keys=[b"pm-orphan-1", b"pm-orphan-2"],
                               arg=len(sizes), payload=memoryview(sizes))
    assert len(ranges) == 2 and all(lease_id for _offset, lease_id in ranges)
    assert client.stats().shm_leases_open == 2
    chan.close()  # dies before COMMIT_MANY
    wait_until(lambda: client.stats().shm_leases_open == 0, what="the reservations to end")
    assert not client.exists(b"pm-orphan-1") and not client.exists(b"pm-orphan-2")
    client.put(b"pm-orphan-1", value(9, 128 * KiB))  # the key is free again


def test_a_malformed_batch_closes_only_its_connection(client: StoreClient) -> None:
    chan = LeaseChannel(client.info.shm_socket)
    try:
        sizes = struct.pack("<2Q", 4 * KiB, 4 * KiB)  # announces 8 KiB of values, sends 4 KiB
        # The daemon answers a batch that breaks framing with a closing error, then hangs up.
        with pytest.raises(ProtocolError, match="add up to"):
            chan.call(ChannelOp.PUT_MANY, keys=[b"pm-bad-1", b"pm-bad-2"],
                      arg=len(sizes) + 4 * KiB,
                      payloads=[memoryview(sizes), memoryview(bytes(4 * KiB))])
        assert chan.broken
    finally:
        chan.close()
    assert not client.exists(b"pm-bad-1")
    client.put(b"pm-after-bad", value(10, 4 * KiB))  # the daemon still serves

"""Batches written in place (``ShmWriter``: reserve, write into the arena, commit) against a real
daemon process: bytes land exactly, a later batch may hang under an earlier batch's open
reservations, what is skipped, aborted, refused or late never becomes visible, and nothing stays
reserved after a commit, an abort or a closed writer."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.shm import ShmClient, ShmWriter
from kvstore.errors import ChunkNotFound, InvalidArgument, PeerUnavailable
from tests.support.common import wait_until
from tests.support.daemon import DaemonProcess

torch = pytest.importorskip("torch")

KiB = 1 << 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), "node-writes", dram_bytes="16MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[StoreClient]:
    c = StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=DataPlane.SHM))
    yield c
    c.close()


def writer_of(client: StoreClient) -> ShmWriter:
    plane = client.plane
    assert isinstance(plane, ShmClient)
    return plane.open_writer()


def value(seed: int, size: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8))


def read(client: StoreClient, key: bytes, size: int) -> torch.Tensor:
    out = torch.empty(size, dtype=torch.uint8)
    client.get_into(key, out)
    return out


def absent(client: StoreClient, key: bytes) -> bool:
    try:
        client.inspect(key)
    except ChunkNotFound:
        return True
    return False


def no_leases(client: StoreClient) -> None:
    wait_until(lambda: client.stats().shm_leases_open == 0, timeout_s=10)


def chain(prefix: bytes, n: int) -> list[bytes]:
    return [b"%s-%d" % (prefix, i) for i in range(n)]


def test_a_chain_written_in_place_reads_back_with_its_parents(client: StoreClient) -> None:
    keys, size = chain(b"wc", 5), 48 * KiB
    vals = [value(i, size) for i in range(5)]
    writer = writer_of(client)
    try:
        batch = writer.reserve(keys, [size] * 5, [None, *keys[:-1]])
        assert batch.outcome == [True] * 5 and batch.refusal is None and batch.writable
        for dst, v in zip(batch.tensors(torch.uint8, (size,)), vals, strict=True):
            dst.copy_(v)
        assert all(absent(client, k) for k in keys)  # nothing visible before the commit
        assert batch.commit() == [True] * 5
        for i, (key, v) in enumerate(zip(keys, vals, strict=True)):
            assert torch.equal(read(client, key, size), v)
            assert (client.inspect(key).parent or None) == (keys[i - 1] if i else None)
        with pytest.raises(InvalidArgument):
            batch.commit()
    finally:
        writer.close()
    no_leases(client)


def test_a_batch_hangs_under_an_earlier_batchs_open_reservations(client: StoreClient) -> None:
    # An engine's next step reserves children of this step's blocks before this step commits.
    keys, size = chain(b"wx", 4), 8 * KiB
    writer = writer_of(client)
    try:
        first = writer.reserve(keys[:2], [size] * 2, [None, keys[0]])
        second = writer.reserve(keys[2:], [size] * 2, [keys[1], keys[2]])
        assert second.outcome == [True, True]
        for batch, seeds in ((first, (0, 1)), (second, (2, 3))):
            for dst, s in zip(batch.tensors(torch.uint8, (size,)), seeds, strict=True):
                dst.copy_(value(100 + s, size))
        assert first.commit() == [True, True]
        assert second.commit() == [True, True]
        assert client.lookup(keys).length == 4
        assert torch.equal(read(client, keys[3], size), value(103, size))

        # Committed child-first: the child's parent is still a reservation, so the child is
        # aborted (never an orphan) and the parent still lands.
        late = chain(b"wy", 2)
        parent = writer.reserve(late[:1], [size], [None])
        child = writer.reserve(late[1:], [size], [late[0]])
        assert child.commit() == [None] and child.refusal is not None
        assert parent.commit() == [True]
        assert absent(client, late[1]) and not absent(client, late[0])
    finally:
        writer.close()
    no_leases(client)


def test_stored_refused_and_skipped_items_never_become_visible(client: StoreClient) -> None:
    size = 4 * KiB
    client.put(b"wr-done", value(200, size))
    keys = [b"wr-done", b"wr-new", b"wr-orphan", b"wr-under", b"wr-skip", b"wr-skip-child"]
    parents: list[bytes | None] = [None, b"wr-done", b"wr-never", b"wr-orphan", None,
                                   b"wr-skip"]
    writer = writer_of(client)
    try:
        batch = writer.reserve(keys, [size] * 6, parents)
        assert batch.outcome == [False, True, None, None, True, True]
        assert isinstance(batch.refusal, InvalidArgument)
        views = batch.tensors(torch.uint8, (size,))
        assert views[0] is None and views[2] is None and views[3] is None
        for i in (1, 4, 5):
            views[i].copy_(value(210 + i, size))
        # Skipping an item aborts it, and its child cannot land without it.
        assert batch.commit(skip={4}) == [False, True, None, None, None, None]
        assert torch.equal(read(client, b"wr-new", size), value(211, size))
        assert torch.equal(read(client, b"wr-done", size), value(200, size))  # untouched
        for key in keys[2:]:
            assert absent(client, key)
        # The writer goes on after refusals.
        again = writer.reserve([b"wr-skip"], [size], [None])
        again.tensors(torch.uint8, (size,))[0].copy_(value(300, size))
        assert again.commit() == [True]
    finally:
        writer.close()
    no_leases(client)


def test_an_aborted_batch_and_a_closed_writer_leave_nothing(client: StoreClient) -> None:
    size = 64 * KiB
    writer = writer_of(client)
    batch = writer.reserve(chain(b"wa", 3), [size] * 3, [None, b"wa-0", b"wa-1"])
    for dst in batch.tensors(torch.uint8, (size,)):
        dst.fill_(7)
    batch.abort()
    assert batch.outcome == [None, None, None]
    open_batch = writer.reserve(chain(b"wz", 2), [size] * 2, [None, b"wz-0"])
    assert open_batch.outcome == [True, True]
    writer.close()  # the daemon ends what the connection held
    with pytest.raises(PeerUnavailable, match="closed"):
        open_batch.commit()
    for key in [*chain(b"wa", 3), *chain(b"wz", 2)]:
        assert absent(client, key)
    no_leases(client)


def test_a_batch_past_its_margin_is_aborted_not_committed(daemon: DaemonProcess) -> None:
    # Past half its TTL a write could outlive the reservation (the daemon may reuse the memory):
    # the batch says so and is never committed.
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM, lease_ttl_s=0.6)) as c:
        writer = writer_of(c)
        try:
            batch = writer.reserve([b"wl-0"], [4 * KiB], [None])
            assert batch.writable
            time.sleep(0.35)
            assert not batch.writable
            with pytest.raises(InvalidArgument, match="past their margin"):
                batch.commit()
            assert absent(c, b"wl-0")
        finally:
            writer.close()
        no_leases(c)


def test_bad_reservations_are_refused_before_anything_is_sent(client: StoreClient) -> None:
    writer = writer_of(client)
    try:
        with pytest.raises(InvalidArgument):
            writer.reserve([b"wb-0", b"wb-1"], [4 * KiB], [None, None])
        with pytest.raises(InvalidArgument):
            writer.reserve([b"wb-0"], [0], [None])
        with pytest.raises(InvalidArgument):
            writer.reserve([b""], [4 * KiB], [None])
        assert writer.reserve([b"wb-0"], [4 * KiB], [None]).outcome == [True]
    finally:
        writer.close()
    assert absent(client, b"wb-0")
    no_leases(client)

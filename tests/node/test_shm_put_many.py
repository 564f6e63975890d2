"""Batched same-host puts: ``StoreClient.put_many`` sends runs of small values in PUT_MANY requests
and reserves / commits runs of large ones with pipelined RESERVE_MANY and COMMIT_MANY requests,
against a real daemon process. With ``parents``: a chain in one call lands parent-first, a failed
item fails what hangs under it in the batch and nothing else, and nothing orphaned is visible."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport.shm import LeaseChannel
from kvstore.dataplane.transport.shm.frames import (
    FLAG_PARENTS,
    ITEM_FAILED,
    ITEM_STORED,
    ChannelOp,
)
from kvstore.errors import CapacityError, ChunkNotFound, InvalidArgument, ProtocolError
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


# --- parents ---------------------------------------------------------------------------------


def parent_of(client: StoreClient, key: bytes) -> bytes | None:
    entry = client.inspect(key)
    return entry.parent or None


def absent(client: StoreClient, key: bytes) -> bool:
    try:
        client.inspect(key)
    except ChunkNotFound:
        return True
    return False


def chain_keys(prefix: bytes, n: int) -> list[bytes]:
    return [b"%s-%d" % (prefix, i) for i in range(n)]


def test_a_chain_in_one_call_lands_with_every_parent(client: StoreClient) -> None:
    client.put(b"pc-base", value(400, 8 * KiB))
    sizes = [8 * KiB, 256 * KiB, 1 * MiB, 4 * KiB, 64 * KiB, 512 * KiB, 16 * KiB, 2 * MiB,
             128 * KiB, 100 * KiB, 300 * KiB, 12 * KiB]  # inline and reserved runs, parts of 8
    keys = chain_keys(b"pc", len(sizes))
    parents: list[bytes | None] = [b"pc-base", *keys[:-1]]
    vals = [value(410 + i, s) for i, s in enumerate(sizes)]
    assert client.put_many(keys, vals, parents=parents) == [True] * len(keys)
    for key, parent, v, size in zip(keys, parents, vals, sizes, strict=True):
        assert parent_of(client, key) == parent
        assert np.array_equal(read(client, key, size), v)
    assert client.lookup([b"pc-base", *keys]).length == len(keys) + 1
    assert client.stats().shm_leases_open == 0


def test_a_failed_parent_fails_its_descendants_and_only_them(client: StoreClient) -> None:
    # 40 MiB cannot fit in the 32 MiB arena: the chain's second block is refused (CapacityError),
    # so its descendants cannot be stored; the block before it and the other chain are.
    keys = chain_keys(b"pf", 4)
    other = chain_keys(b"pf-other", 3)
    vals = [value(500, 256 * KiB), value(501, 40 * MiB), value(502, 256 * KiB),
            value(503, 8 * KiB), value(504, 8 * KiB), value(505, 300 * KiB), value(506, 4 * KiB)]
    batch_keys = [keys[0], other[0], keys[1], other[1], keys[2], other[2], keys[3]]
    batch_vals = [vals[0], vals[4], vals[1], vals[5], vals[2], vals[6], vals[3]]
    parents = [None, None, keys[0], other[0], keys[1], other[1], keys[2]]
    with pytest.raises(CapacityError) as refused:
        client.put_many(batch_keys, batch_vals, parents=parents)
    assert refused.value.batch_outcome == [True, True, None, True, None, True, None]
    assert parent_of(client, keys[0]) is None
    assert np.array_equal(read(client, keys[0], 256 * KiB), vals[0])
    for key in keys[1:]:
        assert absent(client, key)  # nothing orphaned is visible
    assert [parent_of(client, k) for k in other] == [None, other[0], other[1]]
    assert np.array_equal(read(client, other[2], 4 * KiB), vals[6])
    assert client.stats().shm_leases_open == 0


def test_an_uncached_parent_fails_the_chain_under_it_small_and_large(client: StoreClient) -> None:
    for size, tag in ((8 * KiB, b"s"), (256 * KiB, b"l")):
        keys = chain_keys(b"pu-" + tag, 3)
        root = b"pu-root-" + tag
        with pytest.raises(InvalidArgument, match="not cached") as refused:
            client.put_many([*keys, root], [value(600 + i, size) for i in range(4)],
                            parents=[b"pu-never-stored", keys[0], keys[1], None])
        assert refused.value.batch_outcome == [None, None, None, True]
        assert all(absent(client, k) for k in keys)
        assert np.array_equal(read(client, root, size), value(603, size))


def test_a_child_before_its_parent_is_refused(client: StoreClient) -> None:
    # Parent-first is the rule: the daemon stores in order, so a child listed first finds no
    # parent (and the parent, a root, is stored).
    with pytest.raises(InvalidArgument, match="not cached"):
        client.put_many([b"po-child", b"po-parent"], [value(700, 256 * KiB), value(701, 8 * KiB)],
                        parents=[b"po-parent", None])
    assert absent(client, b"po-child")
    assert parent_of(client, b"po-parent") is None


def test_mixed_roots_and_chains_with_an_item_already_stored(client: StoreClient) -> None:
    a, b = chain_keys(b"pm-a", 3), chain_keys(b"pm-b", 3)
    client.put(a[0], value(800, 64 * KiB))
    client.put(a[1], value(801, 64 * KiB), parent=a[0])  # already stored: False, children land
    keys = [a[0], b[0], b"pm-root-1", a[1], b[1], a[2], b"pm-root-2", b[2]]
    parents = [None, None, None, a[0], b[0], a[1], None, b[1]]
    sizes = [64 * KiB, 2 * KiB, 1 * MiB, 64 * KiB, 512 * KiB, 8 * KiB, 256 * KiB, 4 * KiB]
    vals = [value(810 + i, s) for i, s in enumerate(sizes)]
    assert client.put_many(keys, vals, parents=parents) == [False, True, True, False, True, True,
                                                            True, True]
    for key, parent in zip(keys, parents, strict=True):
        assert parent_of(client, key) == parent
    for i in (1, 2, 4, 5, 6, 7):
        assert np.array_equal(read(client, keys[i], sizes[i]), vals[i])


@pytest.mark.parametrize("size", [8 * KiB, 256 * KiB])
def test_a_refusal_reports_every_items_outcome(client: StoreClient, size: int) -> None:
    # The error a partly refused batch raises says, per item, stored (True), already stored
    # (False) or not stored (None): what a caller needs to report a step's save.
    tag = b"%d" % size
    done = b"po-done-" + tag
    client.put(done, value(1000, size))
    keys = [done, b"po-new-" + tag, b"po-orphan-" + tag, b"po-under-" + tag]
    with pytest.raises(InvalidArgument, match="not cached") as refused:
        client.put_many(keys, [value(1000 + i, size) for i in range(4)],
                        parents=[None, done, b"po-never-" + tag, keys[2]])
    assert refused.value.batch_outcome == [False, True, None, None]
    assert parent_of(client, keys[1]) == done
    assert absent(client, keys[2]) and absent(client, keys[3])


def test_parents_over_tcp_give_the_same_results(daemon: DaemonProcess) -> None:
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.TCP)) as tcp:
        keys = chain_keys(b"pt", 4)
        sizes = [8 * KiB, 256 * KiB, 2 * KiB, 1 * MiB]
        vals = [value(900 + i, s) for i, s in enumerate(sizes)]
        parents: list[bytes | None] = [None, *keys[:-1]]
        assert tcp.put_many(keys, vals, parents=parents) == [True] * 4
        assert tcp.put_many(keys[:2], vals[:2], parents=parents[:2]) == [False, False]
        for key, parent, v, size in zip(keys, parents, vals, sizes, strict=True):
            assert parent_of(tcp, key) == parent
            assert np.array_equal(read(tcp, key, size), v)
        with pytest.raises(InvalidArgument, match="not cached") as refused:
            tcp.put_many([keys[0], b"pt-x", b"pt-y"],
                         [vals[0], value(1, 300 * KiB), value(2, 300 * KiB)],
                         parents=[None, b"pt-never", b"pt-x"])
        assert refused.value.batch_outcome == [False, None, None]
        assert absent(tcp, b"pt-x") and absent(tcp, b"pt-y")


def test_a_child_whose_parent_reservation_was_not_committed_is_aborted(
        client: StoreClient) -> None:
    chan = LeaseChannel(client.info.shm_socket)
    try:
        sizes = struct.pack("<2Q", 128 * KiB, 128 * KiB)
        _lease, ranges = chan.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS,
                                   keys=[b"pr-parent", b"", b"pr-child", b"pr-parent"],
                                   arg=len(sizes), payload=memoryview(sizes))
        assert chan.detail == bytes([ITEM_STORED, ITEM_STORED])
        (_o1, parent_lease), (_o2, child_lease) = ranges
        ids = struct.pack("<Q", child_lease)  # the child alone: its parent is not cached
        chan.call(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(ids),
                  payload=memoryview(ids))
        assert chan.detail[0] == ITEM_FAILED and b"not cached" in chan.detail[1:]
        assert absent(client, b"pr-child")
        ids = struct.pack("<Q", parent_lease)
        chan.call(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(ids),
                  payload=memoryview(ids))
        assert chan.detail == bytes([ITEM_STORED])
    finally:
        chan.close()
    assert parent_of(client, b"pr-parent") is None and absent(client, b"pr-child")
    wait_until(lambda: client.stats().shm_leases_open == 0, what="the leases to end")


def test_a_batch_with_parents_and_an_odd_key_count_closes_only_its_connection(
        client: StoreClient) -> None:
    chan = LeaseChannel(client.info.shm_socket)
    try:
        sizes = struct.pack("<Q", 128 * KiB)
        with pytest.raises(ProtocolError, match="pairs"):
            chan.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS, keys=[b"pp-1"],
                      arg=len(sizes), payload=memoryview(sizes))
        assert chan.broken
    finally:
        chan.close()
    client.put(b"pp-after", value(11, 4 * KiB))


# --- pipelined parts sized by bytes ----------------------------------------------------------


def test_pipeline_parts_cover_the_run_in_order_and_end_with_a_short_part() -> None:
    from kvstore.dataplane.transport.shm.client import _pipeline_parts

    for n in (1, 2, 3, 7, 32, 100):
        for size in (20 * KiB, 64 * KiB, 256 * KiB, 4 * MiB):
            parts = _pipeline_parts(n, size)
            assert [a for a, _b in parts] == [0, *(b for _a, b in parts[:-1])]
            assert parts[-1][1] == n and all(b > a for a, b in parts)
            assert parts[-1][1] - parts[-1][0] <= 2
    assert _pipeline_parts(32, 256 * KiB) == [(0, 2), (2, 6), (6, 14), (14, 22), (22, 30),
                                              (30, 32)]
    assert len(_pipeline_parts(32, 64 * KiB)) < len(_pipeline_parts(32, 256 * KiB))


def test_a_chain_of_small_blocks_in_large_parts_lands_whole(client: StoreClient) -> None:
    keys = chain_keys(b"pp64", 40)
    vals = [value(700 + i, 64 * KiB) for i in range(40)]
    assert client.put_many(keys, vals, parents=[None, *keys[:-1]]) == [True] * 40
    for i, key in enumerate(keys):
        assert parent_of(client, key) == (keys[i - 1] if i else None)
        assert np.array_equal(read(client, key, 64 * KiB), vals[i])
    assert client.stats().shm_leases_open == 0


def test_commit_many_commits_only_this_connections_leases(client: StoreClient) -> None:
    """Unknown ids and another connection's fail per item; the valid ones commit, and the
    other connection's reservation stays its own (it commits it afterwards)."""
    alice, bob = LeaseChannel(client.info.shm_socket), LeaseChannel(client.info.shm_socket)
    try:
        sizes = struct.pack("<2Q", 128 * KiB, 128 * KiB)
        _l, ranges = alice.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS,
                                keys=[b"own-a1", b"", b"own-a2", b""], arg=len(sizes),
                                payload=memoryview(sizes))
        (_o1, a1), (_o2, a2) = ranges
        one = struct.pack("<Q", 128 * KiB)
        _l, ((_o3, b1),) = bob.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS,
                                    keys=[b"own-b1", b""], arg=len(one),
                                    payload=memoryview(one))
        ids = struct.pack("<4Q", a1, b1, 12345, a2)
        alice.call(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(ids),
                   payload=memoryview(ids))
        assert alice.detail[:4] == bytes([ITEM_STORED, ITEM_FAILED, ITEM_FAILED, ITEM_STORED])
        assert b"unknown" in alice.detail[4:]
        assert client.exists(b"own-a1") and client.exists(b"own-a2")
        assert not client.exists(b"own-b1")
        ids = struct.pack("<Q", b1)
        bob.call(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(ids),
                 payload=memoryview(ids))
        assert bob.detail == bytes([ITEM_STORED]) and client.exists(b"own-b1")
    finally:
        alice.close()
        bob.close()
    wait_until(lambda: client.stats().shm_leases_open == 0, what="the leases to end")


def test_a_client_gone_between_parts_leaves_no_reservation_and_no_orphan(
        client: StoreClient) -> None:
    """The first part of a chain committed, the second reserved and its connection closed
    before COMMIT_MANY: the first part stays, the second never becomes visible."""
    chan = LeaseChannel(client.info.shm_socket)
    keys = chain_keys(b"gone", 4)
    pairs = [keys[0], b"", keys[1], keys[0], keys[2], keys[1], keys[3], keys[2]]
    sizes = struct.pack("<2Q", 64 * KiB, 64 * KiB)
    _l, first = chan.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS, keys=pairs[:4],
                          arg=len(sizes), payload=memoryview(sizes))
    _l, second = chan.call(ChannelOp.RESERVE_MANY, flags=FLAG_PARENTS, keys=pairs[4:],
                           arg=len(sizes), payload=memoryview(sizes))
    ids = struct.pack("<2Q", *(lease for _o, lease in first))
    chan.call(ChannelOp.COMMIT_MANY, flags=FLAG_PARENTS, arg=len(ids), payload=memoryview(ids))
    assert chan.detail == bytes([ITEM_STORED, ITEM_STORED]) and len(second) == 2
    chan.close()
    wait_until(lambda: client.stats().shm_leases_open == 0, what="the reservations to end")
    assert parent_of(client, keys[1]) == keys[0]
    assert absent(client, keys[2]) and absent(client, keys[3])
    client.put(keys[2], value(9, 64 * KiB), parent=keys[1])  # the key is free again

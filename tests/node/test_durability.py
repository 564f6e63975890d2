"""What a real daemon keeps after ``kill -9`` (issue 12): every put path with
``cache.write_tier=nvme``, and chains whose roots were promoted out of NVMe.

Each test starts a daemon, puts through one path, kills it with SIGKILL (no drain, no
persist), starts a new daemon on the same NVMe directory and reads every acknowledged chunk
back, comparing bytes. docs/daemon.md, "What is durable after a crash, per put path".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.tier import TierKind
from tests.support.daemon import DaemonProcess, running

KiB, MiB = 1 << 10, 1 << 20
NODE = "node-durable"
INLINE_MAX = 64 * KiB
"""server.inline_max_bytes in these daemons: larger values with a parent take SetParents+TCP."""

Values = dict[bytes, bytes]


def value(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def daemon(work_dir: Path, *, durable: bool = True, dram_bytes: str = "16MiB") -> DaemonProcess:
    settings = {"server.inline_max_bytes": str(INLINE_MAX), "server.max_value_bytes": "16MiB"}
    if durable:
        settings["cache.write_tier"] = "nvme"
    return DaemonProcess(work_dir, NODE, dram_bytes=dram_bytes, settings=settings)


def connect(d: DaemonProcess, plane: DataPlane) -> StoreClient:
    client = StoreClient.connect(d.grpc_address, StoreClientConfig(data_plane=plane))
    assert client.data_plane is plane
    return client


def chain(prefix: bytes, sizes: list[int], seed: int) -> list[tuple[bytes, bytes | None, bytes]]:
    """(key, parent, value) of one chain, root first."""
    out: list[tuple[bytes, bytes | None, bytes]] = []
    parent: bytes | None = None
    for i, size in enumerate(sizes):
        k = b"%s-%d" % (prefix, i)
        out.append((k, parent, value(seed + i, size)))
        parent = k
    return out


# -- one function per put path: store, return what was acknowledged -------------------------------


def put_grpc(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.TCP) as c:
        items = chain(b"grpc", [4 * KiB, 32 * KiB, INLINE_MAX, 1000], 10)
        for k, parent, v in items:
            c.call("Put", pb.PutRequest(key=k, parent=parent or b"", value=v))
    return {k: v for k, _p, v in items}


def put_grpc_batch(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.TCP) as c:
        items = chain(b"batch", [16 * KiB] * 6, 20)
        reply = c.call("BatchPut", pb.BatchPutRequest(items=[
            pb.PutRequest(key=k, parent=p or b"", value=v) for k, p, v in items]))
        assert [s.ok for s in reply.items] == [True] * len(items), reply
    return {k: v for k, _p, v in items}


def put_tcp(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.TCP) as c:
        values = {b"tcp-%d" % i: value(30 + i, size)
                  for i, size in enumerate([128 * KiB, 256 * KiB, 1 * MiB, 4 * MiB + 5, 100 * KiB])}
        for k, v in values.items():
            c.put(k, v)
    return values


def put_tcp_with_parents(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.TCP) as c:
        items = chain(b"tcp-chain", [256 * KiB, 200 * KiB, 1 * MiB, 300 * KiB], 40)
        for k, parent, v in items:
            c.put(k, v, parent=parent)  # SetParents + TCP (above the inline limit)
        assert c.inspect(items[-1][0]).parent == items[-2][0]
    return {k: v for k, _p, v in items}


def put_shm(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.SHM) as c:
        items = chain(b"shm-chain", [256 * KiB, 128 * KiB, 2 * MiB, 100 * KiB], 50)
        for k, parent, v in items:
            c.put(k, v, parent=parent)  # RESERVE + copy into the arena + COMMIT
        roots = {b"shm-%d" % i: value(60 + i, 96 * KiB + i) for i in range(4)}
        for k, v in roots.items():
            c.put(k, v)
    return {**{k: v for k, _p, v in items}, **roots}


def put_shm_many(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.SHM) as c:
        large = {b"many-large-%d" % i: value(70 + i, 200 * KiB) for i in range(6)}  # reserved
        small = {b"many-small-%d" % i: value(80 + i, 8 * KiB) for i in range(6)}  # inline
        values = {**large, **small}
        assert c.put_many(list(values), list(values.values())) == [True] * len(values)
    return values


def put_shm_many_with_parents(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.SHM) as c:
        # One chain in one put_many: inline (small) and reserved (large) items, parent-first.
        items = chain(b"many-chain", [200 * KiB, 8 * KiB, 1 * MiB, 300 * KiB, 4 * KiB], 100)
        keys = [k for k, _p, _v in items]
        assert c.put_many(keys, [v for _k, _p, v in items],
                          parents=[p for _k, p, _v in items]) == [True] * len(items)
        assert c.inspect(keys[-1]).parent == keys[-2]
    return {k: v for k, _p, v in items}


def put_ucx(d: DaemonProcess) -> Values:
    with connect(d, DataPlane.UCX) as c:
        values = {b"ucx-%d" % i: value(90 + i, 2 * MiB + i) for i in range(3)}
        for k, v in values.items():
            c.put(k, v)
    return values


PUT_PATHS: dict[str, Callable[[DaemonProcess], Values]] = {
    "grpc-put": put_grpc,
    "grpc-batch-put": put_grpc_batch,
    "tcp": put_tcp,
    "tcp-with-parents": put_tcp_with_parents,
    "shm-reserve-commit": put_shm,
    "shm-put-many": put_shm_many,
    "shm-put-many-with-parents": put_shm_many_with_parents,
    "ucx": put_ucx,
}


def read_back(d: DaemonProcess, values: Values) -> list[bytes]:
    """The keys whose bytes did not come back equal after the restart."""
    wrong: list[bytes] = []
    with connect(d, DataPlane.TCP) as c:
        found = c.sizes(list(values))
        for (k, v), size in zip(values.items(), found, strict=True):
            if size != len(v):
                wrong.append(k)
                continue
            out = bytearray(len(v))
            c.get_into(k, out)
            if out != v:
                wrong.append(k)
    return wrong


def recovery_line(d: DaemonProcess) -> tuple[int, int]:
    """(recovered, dropped orphans) from the last start's log."""
    found = re.findall(r"recovered (\d+) chunk\(s\).*dropped (\d+) orphan", d.log_path.read_text())
    assert found, d.log_tail()
    recovered, dropped = found[-1]
    return int(recovered), int(dropped)


@pytest.mark.parametrize("path", list(PUT_PATHS))
def test_every_acknowledged_put_survives_kill_9_with_write_tier_nvme(tmp_path: Path,
                                                                     path: str) -> None:
    if path == "ucx":
        pytest.importorskip("ucxx", reason="ucxx is not installed here")
    first = daemon(tmp_path)
    with running(first):
        values = PUT_PATHS[path](first)
        first.kill()
    again = daemon(tmp_path)
    with running(again):
        assert read_back(again, values) == []
        recovered, dropped = recovery_line(again)
        assert (recovered, dropped) == (len(values), 0)


def test_promoting_chain_roots_out_of_nvme_then_kill_9_loses_no_chain(tmp_path: Path) -> None:
    """40 chains of 8 blocks through a 4 MiB DRAM tier (default write tier: DRAM): most blocks
    are demoted to NVMe. Reading the 40 roots promotes them. Before issue 12 the promotion moved
    each root out of NVMe, and after a crash recovery dropped every descendant as an orphan."""
    first = daemon(tmp_path, durable=False, dram_bytes="4MiB")
    chains = [chain(b"c%02d" % c, [128 * KiB] * 8, 1000 * c) for c in range(40)]
    with running(first):
        with connect(first, DataPlane.SHM) as c:
            for items in chains:
                for k, parent, v in items:
                    c.put(k, v, parent=parent)
            keys = [[k for k, _p, _v in items] for items in chains]
            placed = [c.lookup(ks) for ks in keys]
            assert all(m.length == 8 for m in placed)
            on_nvme = {k: v for items, m in zip(chains, placed, strict=True)
                       for (k, _p, v), t in zip(items, m.tiers, strict=True) if t is TierKind.NVME}
            assert len(on_nvme) >= 200, len(on_nvme)
            for items in chains:
                root, _p, v = items[0]
                out = bytearray(len(v))
                c.get_into(root, out)  # ACQUIRE_READ: pins it in DRAM, promoting it
                assert out == v
            roots_in_dram = sum(c.lookup([ks[0]]).tiers == (TierKind.DRAM,) for ks in keys)
            assert roots_in_dram >= 25, roots_in_dram
        first.kill()
    again = daemon(tmp_path, durable=False, dram_bytes="4MiB")
    with running(again):
        recovered, dropped = recovery_line(again)
        assert dropped == 0
        assert recovered >= len(on_nvme)
        assert read_back(again, on_nvme) == []


def test_a_chunk_with_two_copies_is_listed_once(tmp_path: Path) -> None:
    """A durable TCP put leaves a DRAM copy and an NVMe copy: List, List by tier and Snapshot
    name the chunk once (before, every tier holding a copy added it again)."""
    d = daemon(tmp_path)
    with running(d):
        values = put_tcp(d)
        with connect(d, DataPlane.TCP) as c:
            assert all(c.inspect(k).tier == pb.TIER_DRAM for k in values)
            listed = [e.key for e in c.list_chunks(b"tcp-").entries]
            assert sorted(listed) == sorted(values)
            for tier in (TierKind.DRAM, TierKind.NVME):
                assert sorted(e.key for e in c.list_chunks(b"tcp-", tier).entries) == \
                    sorted(values)
            _epoch, _seq, entries = c.snapshot()
            assert sorted(e.key for e in entries) == sorted(values)

"""Daemons in etcd (a real etcd server): registration, two nodes and a client moving chunks
between them, graceful drain (deregisters at once, exits 0), and ``kill -9`` (the key expires;
a restart recovers the NVMe chunks under a new epoch and sweeps the dead daemon's arena)."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.tier import TierKind
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.membership.nodes import NodeRecord, list_nodes
from tests.support.daemon import DaemonProcess, kvtier, kvtier_here, run_python

KiB, MiB = 1 << 10, 1 << 20


def value(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def registered(aio: asyncio.Runner, etcd: LocalEtcd, layout: KeyLayout
               ) -> dict[str, NodeRecord]:
    async def read() -> dict[str, NodeRecord]:
        async with etcd_client(etcd.client_url) as client:
            return await list_nodes(client, layout=layout)

    return aio.run(read())


def wait_for(predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.slow
def test_two_nodes_register_serve_a_cross_node_copy_and_drain(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout,
        aio: asyncio.Runner) -> None:
    a = DaemonProcess(tmp_path, "node-a", etcd_endpoint=etcd_server.client_url,
                      etcd_prefix=etcd_layout.prefix, settings={"etcd.ttl_s": "30"})
    b = DaemonProcess(tmp_path, "node-b", etcd_endpoint=etcd_server.client_url,
                      etcd_prefix=etcd_layout.prefix)
    try:
        a.start()
        b.start()
        nodes = registered(aio, etcd_server, etcd_layout)
        assert set(nodes) == {"node-a", "node-b"}
        assert nodes["node-a"].grpc_address == a.grpc_address
        assert nodes["node-a"].shm_arena == a.addresses["shm_arena"]
        assert nodes["node-b"].tier_capacity_bytes[TierKind.DRAM] == 32 * MiB
        listed = kvtier("nodes", "--etcd", etcd_server.client_url, "--prefix",
                        etcd_layout.prefix, "--json")
        assert listed.returncode == 0, listed.stderr
        assert sorted(n["node_id"] for n in json.loads(listed.stdout)) == ["node-a", "node-b"]

        data = value(1, 5 * MiB)
        with StoreClient.connect(a.grpc_address) as client_a:
            client_a.put(b"hot-prefix", data)
        # Another process finds both nodes in etcd and copies the chunk from A to B over TCP.
        run_python(textwrap.dedent(f"""
            import asyncio, numpy as np
            from kvstore.membership.etcd import KeyLayout, etcd_client
            from kvstore.membership.nodes import list_nodes
            from kvstore.client import DataPlane, StoreClient, StoreClientConfig
            async def find():
                async with etcd_client({etcd_server.client_url!r}) as c:
                    return await list_nodes(c, layout=KeyLayout({etcd_layout.prefix!r}))
            nodes = asyncio.run(find())
            tcp = StoreClientConfig(data_plane=DataPlane.TCP)
            src = StoreClient.connect(nodes["node-a"].grpc_address, tcp)
            dst = StoreClient.connect(nodes["node-b"].grpc_address, tcp)
            buf = np.empty(src.sizes([b"hot-prefix"])[0], np.uint8)
            src.get_into(b"hot-prefix", buf)
            dst.put(b"hot-prefix", buf)
            src.close(); dst.close()
        """))
        with StoreClient.connect(b.grpc_address,
                                 StoreClientConfig(data_plane=DataPlane.SHM)) as client_b:
            out = np.empty(data.size, np.uint8)
            client_b.get_into(b"hot-prefix", out)
            assert np.array_equal(out, data)
        both = kvtier("stats", "--etcd", etcd_server.client_url, "--prefix", etcd_layout.prefix,
                      "--json")
        assert both.returncode == 0, both.stderr
        assert sorted(n["node_id"] for n in json.loads(both.stdout)) == ["node-a", "node-b"]

        # Graceful drain of A: exit status 0, and its key (TTL 30 s) is gone at once.
        drained = kvtier_here("drain", "--address", a.grpc_address, "--json")
        assert drained.returncode == 0 and json.loads(drained.stdout) == {"accepted": True}
        assert a.wait(30) == 0
        assert set(registered(aio, etcd_server, etcd_layout)) == {"node-b"}
        assert not os.path.exists(f"/dev/shm/{a.addresses['shm_arena']}")
        assert "drained" in a.log_tail()
        # SIGTERM drains too.
        b.terminate()
        assert b.wait(30) == 0
        assert registered(aio, etcd_server, etcd_layout) == {}
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
def test_kill_9_expires_the_key_and_a_restart_recovers_nvme_chunks(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout,
        aio: asyncio.Runner) -> None:
    settings = {"dram.capacity_bytes": "1MiB"}  # 4 x 256 KiB: the chain demotes to NVMe
    node = DaemonProcess(tmp_path, "node-k", etcd_endpoint=etcd_server.client_url,
                         etcd_prefix=etcd_layout.prefix, settings=settings)
    keys = [b"k9-%d" % i for i in range(8)]
    try:
        first = node.start()
        with StoreClient.connect(node.grpc_address) as client:
            for i, key in enumerate(keys):
                client.put(key, value(i, 256 * KiB), parent=keys[i - 1] if i else None)
            assert client.lookup(keys).by_tier()[TierKind.NVME] >= 4
            client.evict(tier=TierKind.DRAM, bytes_=1 * MiB)  # the rest too: all on NVMe now
            assert client.lookup(keys).tiers == (TierKind.NVME,) * 8
            _, old_seq, _ = client.snapshot()
        assert "node-k" in registered(aio, etcd_server, etcd_layout)
        node.kill()
        assert os.path.exists(f"/dev/shm/{first['shm_arena']}")  # a SIGKILL leaks the arena
        # A bounded wait, not a timing: the key goes with its 2 s lease, nothing else removes it.
        wait_for(lambda: "node-k" not in registered(aio, etcd_server, etcd_layout),
                 30, "the etcd key of a killed daemon to expire")

        second = node.start()
        assert second["epoch"] != first["epoch"]
        assert not os.path.exists(f"/dev/shm/{first['shm_arena']}")  # swept at start-up
        assert "node-k" in registered(aio, etcd_server, etcd_layout)
        with StoreClient.connect(node.grpc_address) as client:
            assert client.lookup(keys).length == 8
            out = np.empty(256 * KiB, np.uint8)
            for i, key in enumerate(keys):
                client.get_into(key, out)  # from NVMe, promoted into DRAM for the shm read
                assert np.array_equal(out, value(i, 256 * KiB)), f"chunk {i} differs"
            assert client.inspect(keys[3]).parent == keys[2]
            resync = list(client.subscribe(from_seq=old_seq, epoch=first["epoch"], timeout_s=2))
            assert [e.kind for e in resync] == [4]
            epoch, _, entries = client.snapshot()
            assert epoch == second["epoch"]
            assert {e.key for e in entries} >= set(keys)
            replay = list(client.subscribe(from_seq=0, epoch=epoch, timeout_s=1))
            assert {e.key for e in replay if e.kind == 1} >= set(keys)  # recovery = STORED
    finally:
        node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("persist", [True, False])
def test_a_graceful_stop_persists_dram_chunks_only_when_configured(tmp_path: Path,
                                                                    persist: bool) -> None:
    node = DaemonProcess(tmp_path, "node-p",
                         settings={"shutdown.persist_dram": str(persist).lower()})
    keys = [b"p-%d" % i for i in range(3)]
    try:
        node.start()
        with StoreClient.connect(node.grpc_address) as client:
            for i, key in enumerate(keys):
                client.put(key, value(i, 64 * KiB), parent=keys[i - 1] if i else None)
            assert client.lookup(keys).tiers == (TierKind.DRAM,) * 3
        node.terminate()
        assert node.wait(30) == 0
        node.start()
        with StoreClient.connect(node.grpc_address) as client:
            match = client.lookup(keys)
            if not persist:
                assert match.length == 0  # DRAM is memory: gone with the process
                return
            assert match.tiers == (TierKind.NVME,) * 3
            out = np.empty(64 * KiB, np.uint8)
            client.get_into(keys[2], out)
            assert np.array_equal(out, value(2, 64 * KiB))
    finally:
        node.stop()

"""A real daemon whose NVMe tier sits on a real small filesystem or on damaged segment files:
what Stats (and the metrics) say must be true, and no acknowledged chunk vanishes unaccounted."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client import StoreClient
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.errors import ChunkNotFound
from tests.support.common import flip_byte
from tests.support.daemon import DaemonProcess
from tests.support.smallfs import small_filesystem, total_bytes

KiB, MiB = 1 << 10, 1 << 20
TIER_NVME = pb.TIER_NVME


def value(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def readable(client: StoreClient, key: bytes, expected: np.ndarray) -> bool:
    out = np.empty(expected.size, np.uint8)
    try:
        client.get_into(key, out)
    except ChunkNotFound:
        return False
    assert np.array_equal(out, expected), f"{key!r} came back with other bytes"
    return True


def test_an_nvme_tier_larger_than_its_filesystem(tmp_path: Path) -> None:
    """64 MiB of NVMe configured on an 8 MiB tmpfs: Stats report what the filesystem gives,
    the tier really holds that much, and every acknowledged chunk is readable or was evicted
    (counted), also after a restart."""
    with small_filesystem("tmpfs", tmp_path / "mnt", tmp_path, 8 * MiB) as mnt:
        settings = {"nvme.directory": str(mnt / "nvme")}  # nvme.capacity_bytes: 64MiB
        values = {b"k%d" % i: value(i, 256 * KiB) for i in range(80)}
        d = DaemonProcess(tmp_path / "d", "n-small-fs", dram_bytes="4MiB", settings=settings)
        d.start()
        try:
            with StoreClient.connect(d.grpc_address) as client:
                for key, data in values.items():
                    client.put(key, data)  # each one acknowledged
                still = {k for k, v in values.items() if readable(client, k, v)}
                stats = client.stats()
            nvme = next(t for t in stats.tiers if t.tier == TIER_NVME)
            assert 0 < nvme.capacity_bytes <= total_bytes(mnt) < 64 * MiB
            assert nvme.used_bytes <= nvme.capacity_bytes
            assert nvme.chunks * 256 * KiB >= nvme.capacity_bytes // 2, \
                "the NVMe tier emptied itself instead of using the room it has"
            drops = sum(t.drops for t in stats.tiers)
            assert drops >= len(values) - len(still), "acknowledged chunks lost, not evicted"
        finally:
            d.stop()
        assert "the filesystem can give only" in d.log_path.read_text()
        d = DaemonProcess(tmp_path / "d", "n-small-fs", dram_bytes="4MiB", settings=settings)
        d.start()
        try:
            with StoreClient.connect(d.grpc_address) as client:
                nvme = next(t for t in client.stats().tiers if t.tier == TIER_NVME)
                assert nvme.chunks > 0 and nvme.capacity_bytes <= total_bytes(mnt)
                back = {k for k, v in values.items() if readable(client, k, v)}
                assert len(back) >= nvme.chunks
                assert nvme.corrupt == 0
        finally:
            d.stop()



def test_corruption_found_at_open_shows_in_stats_and_metrics(tmp_path: Path) -> None:
    settings = {"cache.write_tier": "nvme", "metrics.enabled": "true", "metrics.port": "0"}
    chain = [b"c0", b"c1", b"c2"]
    values = {k: value(i, 64 * KiB) for i, k in enumerate([*chain, b"x", b"y"])}
    d = DaemonProcess(tmp_path, "n-corrupt", settings=settings)
    d.start()
    try:
        with StoreClient.connect(d.grpc_address) as client:
            parent = None
            for key in chain:
                client.put(key, values[key], parent=parent)
                parent = key
            client.put(b"x", values[b"x"])
            client.put(b"y", values[b"y"])
    finally:
        d.stop()
    nvme_dir = Path(d.settings["nvme.directory"])
    with NvmeTier.open(NvmeTierConfig(directory=nvme_dir, capacity_bytes=64 * MiB)) as tier:
        loc = tier.record_location(b"c1")
        assert loc is not None
    flip_byte(loc.path, loc.payload_offset + 1000)

    d = DaemonProcess(tmp_path, "n-corrupt", settings=settings)
    d.start()
    try:
        with StoreClient.connect(d.grpc_address) as client:
            nvme = next(t for t in client.stats().tiers if t.tier == TIER_NVME)
            assert nvme.corrupt >= 1
            assert not readable(client, b"c1", values[b"c1"])
            assert not readable(client, b"c2", values[b"c2"]), "a descendant outlived it"
            for key in (b"c0", b"x", b"y"):
                assert readable(client, key, values[key])
        url = f"http://{d.addresses['metrics_address']}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        line = next(ln for ln in text.splitlines()
                    if ln.startswith('kvtier_corrupt_total{tier="nvme"}'))
        assert float(line.split()[-1]) >= 1
    finally:
        d.stop()

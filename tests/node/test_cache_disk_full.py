"""A full filesystem under the NVMe tier does not cost acknowledged chunks (issue 16, found by
the fault suite's ``nvme-full``): with ``write_tier=nvme`` a put that meets ``DiskFull`` fails
with it, the chunks already stored all stay readable, DRAM keeps serving, and puts succeed
again once the space comes back.

Before the fix, ``TieredCache._place`` took ``DiskFull`` (a ``CapacityError``) for a tier
out of room and evicted acknowledged chunks (a 64th of the tier per attempt) to reuse their
space in the existing segments: the put succeeded and dozens of durable chunks were gone.

A real tmpfs (root: ``mount``) of a few MiB under the tier, filled by another file.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.errors import ChunkNotFound, DiskFull
from kvstore.node.cache import CacheConfig, TieredCache

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 16 * KiB


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    path = tmp_path / "fs"
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "kvtier-test", str(path)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path) -> None:
    """Write zeros into ``path`` until the filesystem refuses (ENOSPC)."""
    block = bytes(MiB)
    with path.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(block)


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (CHUNK // 4)


def test_a_full_disk_refuses_durable_puts_and_loses_no_acknowledged_chunk(
        small_fs: Path) -> None:
    nvme = NvmeTier.open(NvmeTierConfig(directory=small_fs / "nvme", capacity_bytes=4 * MiB,
                                        segment_bytes=MiB))
    cache = TieredCache({TierKind.DRAM: DramTier(2 * MiB), TierKind.NVME: nvme},
                        config=CacheConfig(write_tier=TierKind.NVME))
    try:
        acked: list[int] = []
        for i in range(40):  # part of the first 1 MiB segment
            cache.put(b"k%d" % i, value(i))
            acked.append(i)
        fill(small_fs / "filler")
        refused = 0
        for i in range(40, 200):  # past the first segment: a second one cannot be made
            try:
                cache.put(b"k%d" % i, value(i))
            except DiskFull:
                refused += 1
                continue
            acked.append(i)
        buf = bytearray(CHUNK)
        lost = []
        for i in acked:  # every acknowledged chunk is still there, byte for byte
            try:
                cache.get_into(b"k%d" % i, buf)
            except ChunkNotFound:
                lost.append(i)
                continue
            assert buf == value(i), i
        assert lost == [], f"{len(lost)} acknowledged chunks evicted for the full disk"
        assert refused > 0
        (small_fs / "filler").unlink()
        cache.put(b"after", value(999))  # space back: puts succeed again
        assert cache.get_into(b"after", buf) == CHUNK and buf == value(999)
    finally:
        cache.close()

"""Same-host reads under churn: a chunk being evicted, removed or rewritten is never returned as
another chunk's bytes (nor as a torn mix of two versions).

A real daemon with a DRAM tier too small for the working set (puts evict), one writer client
that keeps removing and rewriting keys with new versions, and reader clients (threads here, one
more in another process) that verify every byte they get. Each value describes itself: a
16-byte header (key index, version) and a body drawn from that pair.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.errors import ChunkBusy, ChunkExists, ChunkNotFound, SizeMismatch
from tests.support.common import check_versioned, versioned_size, versioned_value
from tests.support.daemon import REPO, DaemonProcess

KiB = 1 << 10
KEYS = 48
CHURN_S = 3.0


size_of, make_value = versioned_size, versioned_value


def key_of(index: int) -> bytes:
    return b"churn-%03d" % index


def check_value(index: int, got: np.ndarray) -> None:
    check_versioned(index, got, repr(key_of(index)))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    # 4 MiB of DRAM for ~6 MiB of values: puts keep evicting (demoting to NVMe), reads keep
    # promoting back.
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), "node-churn", dram_bytes="4MiB")
    d.start()
    yield d
    d.stop()


def _client(daemon: DaemonProcess) -> StoreClient:
    return StoreClient.connect(daemon.grpc_address, StoreClientConfig(data_plane=DataPlane.SHM))


def test_reads_under_eviction_and_rewrites_return_only_their_own_bytes(
        daemon: DaemonProcess) -> None:
    stop = threading.Event()
    failures: list[BaseException] = []
    counts = {"reads": 0, "misses": 0, "writes": 0, "rewrites": 0}
    lock = threading.Lock()

    def writer() -> None:
        rng = np.random.default_rng(1)
        versions = [0] * KEYS
        with _client(daemon) as client:
            while not stop.is_set():
                index = int(rng.integers(KEYS))
                try:
                    if client.remove(key_of(index)):
                        with lock:
                            counts["rewrites"] += 1
                except ChunkBusy:
                    continue  # a reader holds it: rewrite another one
                versions[index] += 1
                try:
                    client.put(key_of(index), make_value(index, versions[index]))
                    with lock:
                        counts["writes"] += 1
                except (ChunkExists, ChunkBusy):
                    pass  # another writer path got there first; the test needs no exactness

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        bufs = {i: np.empty(size_of(i), dtype=np.uint8) for i in range(KEYS)}
        with _client(daemon) as client:
            while not stop.is_set():
                index = int(rng.integers(KEYS))
                try:
                    if rng.random() < 0.3:  # a batch: one lease for several keys
                        batch = [index, (index + 2) % KEYS]
                        got = client.get_many_into([key_of(i) for i in batch],
                                                   [bufs[i] for i in batch])
                        for i, size in zip(batch, got, strict=True):
                            if size is not None:
                                check_value(i, bufs[i])
                    else:
                        client.get_into(key_of(index), bufs[index])
                        check_value(index, bufs[index])
                    with lock:
                        counts["reads"] += 1
                except (ChunkNotFound, ChunkBusy, SizeMismatch):  # evicted meanwhile
                    with lock:
                        counts["misses"] += 1

    def guarded(fn: object, *args: object) -> None:
        try:
            fn(*args)  # type: ignore[operator]
        except BaseException as exc:  # reported below: a thread must not fail silently
            failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=guarded, args=(writer,)),
               *[threading.Thread(target=guarded, args=(reader, s)) for s in (2, 3)]]
    for t in threads:
        t.start()
    # A reader in another process, verifying the same way until the churn ends.
    code = textwrap.dedent(f"""
        import sys, time
        import numpy as np
        sys.path.insert(0, {str(REPO)!r})
        from tests.node.test_shm_churn import KEYS, key_of, size_of, check_value
        from kvstore.client import DataPlane, StoreClient, StoreClientConfig
        from kvstore.errors import ChunkBusy, ChunkNotFound
        c = StoreClient.connect({daemon.grpc_address!r},
                                StoreClientConfig(data_plane=DataPlane.SHM))
        reads = 0
        deadline = time.monotonic() + {CHURN_S}
        i = 0
        while time.monotonic() < deadline:
            i = (i + 7) % KEYS
            buf = np.empty(size_of(i), dtype=np.uint8)
            try:
                c.get_into(key_of(i), buf)
            except (ChunkNotFound, ChunkBusy):
                continue
            check_value(i, buf)
            reads += 1
        print("READS", reads, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    stop.set()
    for t in threads:
        t.join(30)
    if failures:
        raise failures[0]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) > 0
    assert counts["reads"] > 20 and counts["writes"] > 20 and counts["rewrites"] > 5, counts
    with _client(daemon) as client:
        tiers = client.stats().tiers
    # DRAM overflowed into NVMe (evictions demote) and reads promoted chunks back: extents
    # were reused under the readers' feet.
    assert sum(t.demotions_out for t in tiers) > 0, "the test evicted nothing"

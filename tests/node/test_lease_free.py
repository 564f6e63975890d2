"""Lease-free same-host reads against real daemon processes: the read index in use, the reports of
reads (hits, recency), a stress run of writer and reader processes, and faults (a reader killed
mid-copy, a daemon killed or restarted under a client).

The table and the seqlock on their own are tested in ``tests/dataplane/test_read_index.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane import native
from kvstore.dataplane.read_index import lease_free_supported
from kvstore.dataplane.tier import TierKind
from kvstore.errors import PeerUnavailable
from tests.support.common import check_versioned, versioned_size, versioned_value
from tests.support.daemon import REPO, DaemonProcess
from tests.support.native import built_extension

pytestmark = pytest.mark.skipif(not lease_free_supported(),
                                reason="lease-free reads need Linux on x86-64")

KiB, MiB = 1 << 10, 1 << 20
STRESS_S = 3.0
STRESS_KEYS = 48


def value(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def shm_client(daemon: DaemonProcess, **config: object) -> StoreClient:
    return StoreClient.connect(daemon.grpc_address,
                               StoreClientConfig(data_plane=DataPlane.SHM, **config))  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["extension", "python"])
def reads(request: pytest.FixtureRequest) -> str:
    """Every client test runs with the native extension's reads (built when missing) and with
    Python's (``KVTIER_NATIVE=0`` while the client connects), each against its own daemon."""
    if request.param == "extension":
        built_extension()
    return str(request.param)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, reads: str) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), "node-lease-free", dram_bytes="16MiB")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess, reads: str) -> Iterator[StoreClient]:
    with pytest.MonkeyPatch.context() as mp:
        if reads == "python":
            mp.setenv(native.ENV_SWITCH, "0")
        c = shm_client(daemon)
        reader = c.plane.reader
        assert reader is not None and reader.native == (reads == "extension")
        yield c
        c.close()


def dram_hits(client: StoreClient) -> int:
    return next(t.hits for t in client.stats().tiers if t.tier == 2)


# --- in use ------------------------------------------------------------------------------------


def test_gets_copy_without_a_lease_and_the_daemon_counts_them(client: StoreClient) -> None:
    assert client.info.shm_read_index
    assert client.lease_free_counters().active
    v = value(1, 64 * KiB)
    client.put(b"lf-plain", v)
    before, hits_before = client.lease_free_counters(), dram_hits(client)
    out = np.empty_like(v)
    for _ in range(25):
        out[:] = 0
        assert client.get_into(b"lf-plain", out) == 64 * KiB
        assert np.array_equal(out, v)
    after = client.lease_free_counters()
    assert after.hits - before.hits == 25 and after.misses == before.misses
    # stats() first flushes the reports: the daemon counted every read as a DRAM hit.
    assert dram_hits(client) - hits_before == 25
    assert client.stats().shm_leases_open == 0


def test_batches_and_prefix_loads_are_lease_free_where_published(client: StoreClient) -> None:
    a, b, c = value(2, 16 * KiB), value(3, 16 * KiB), value(4, 16 * KiB)
    client.put(b"lf-a", a)
    client.put(b"lf-b", b, parent=b"lf-a")
    client.put(b"lf-c", c, parent=b"lf-b")
    outs = [np.empty(16 * KiB, np.uint8) for _ in range(4)]
    before = client.lease_free_counters()
    got = client.get_many_into([b"lf-a", b"lf-c", b"lf-missing"], outs[:3])
    assert got == [16 * KiB, 16 * KiB, None]
    assert np.array_equal(outs[0], a) and np.array_equal(outs[1], c)
    mid = client.lease_free_counters()
    assert mid.hits - before.hits == 2 and mid.misses - before.misses >= 1
    assert client.load_prefix([b"lf-a", b"lf-b", b"lf-c", b"lf-missing"], outs) == 3
    assert all(np.array_equal(o, w) for o, w in zip(outs, (a, b, c), strict=False))
    assert client.lease_free_counters().hits - mid.hits == 3


def test_a_chunk_in_nvme_takes_the_leased_path_and_is_promoted(client: StoreClient) -> None:
    v = value(5, 256 * KiB)
    client.put(b"lf-cold", v)
    used = next(t.used_bytes for t in client.stats().tiers if t.tier == 2)
    client.evict(tier=TierKind.DRAM, bytes_=used)  # everything in DRAM goes to NVMe
    assert client.lookup([b"lf-cold"]).tiers == (TierKind.NVME,)
    out = np.empty_like(v)
    before = client.lease_free_counters()
    client.get_into(b"lf-cold", out)  # not published: a lease, and the promotion into DRAM
    assert np.array_equal(out, v)
    mid = client.lease_free_counters()
    assert mid.misses - before.misses == 1 and mid.hits == before.hits
    assert client.lookup([b"lf-cold"]).tiers == (TierKind.DRAM,)
    out[:] = 0
    client.get_into(b"lf-cold", out)  # published again once promoted
    assert np.array_equal(out, v)
    assert client.lease_free_counters().hits - mid.hits == 1


def test_a_wrong_size_still_raises_size_mismatch(client: StoreClient) -> None:
    from kvstore.errors import SizeMismatch

    client.put(b"lf-sized", value(6, 8 * KiB))
    out = np.full(4 * KiB, 9, np.uint8)
    with pytest.raises(SizeMismatch):
        client.get_into(b"lf-sized", out)
    assert (out == 9).all()


def test_switched_off_on_either_side_every_read_takes_a_lease(daemon: DaemonProcess,
                                                              tmp_path: Path) -> None:
    with shm_client(daemon, lease_free_reads=False) as c:
        c.put(b"lf-off", value(7, 4 * KiB))
        out = np.empty(4 * KiB, np.uint8)
        c.get_into(b"lf-off", out)
        counters = c.lease_free_counters()
        assert not counters.active and counters.hits == 0
    d = DaemonProcess(tmp_path, "node-no-index", dram_bytes="4MiB", nvme=False,
                      settings={"dram.read_index": "false"})
    d.start()
    try:
        with shm_client(d) as c:
            assert c.info.shm_read_index == ""
            c.put(b"k", value(8, 4 * KiB))
            c.get_into(b"k", out)
            assert np.array_equal(out, value(8, 4 * KiB))
            assert not c.lease_free_counters().active
    finally:
        d.stop()


def test_reported_reads_refresh_recency_for_eviction(tmp_path: Path) -> None:
    """LRU over 14 chunks: the first one put is the eviction victim unless the daemon learns
    that it was read (lease-free reads never reach it otherwise)."""
    d = DaemonProcess(tmp_path, "node-recency", dram_bytes="4MiB", nvme=False)
    d.start()
    try:
        with shm_client(d) as c:
            keys = [b"r-%02d" % i for i in range(14)]
            for i, key in enumerate(keys):
                c.put(key, value(100 + i, 256 * KiB))
            out = np.empty(256 * KiB, np.uint8)
            for _ in range(3):
                c.get_into(keys[0], out)
            assert c.lease_free_counters().hits == 3
            c.flush_reads()
            for i in range(3):  # 0.75 MiB more than fits: the least recent go
                c.put(b"r-new-%d" % i, value(200 + i, 256 * KiB))
            assert c.exists(keys[0]), "the chunk just read was evicted: its reads were lost"
            assert not c.exists(keys[1])
    finally:
        d.stop()


# --- stress: separate writer and reader processes ----------------------------------------------


stress_size, stress_value = versioned_size, versioned_value


def stress_key(index: int) -> bytes:
    return b"stress-%03d" % index


def stress_check(index: int, got: np.ndarray) -> None:
    check_versioned(index, got, repr(stress_key(index)))


_WRITER = """
import sys, time, json
import numpy as np
sys.path.insert(0, {repo!r})
from tests.node.test_lease_free import STRESS_KEYS, stress_key, stress_value
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.errors import ChunkBusy, ChunkExists
c = StoreClient.connect({address!r}, StoreClientConfig(data_plane=DataPlane.SHM))
rng = np.random.default_rng(1)
versions = [0] * STRESS_KEYS
writes = rewrites = 0
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    i = int(rng.integers(STRESS_KEYS))
    try:
        if c.remove(stress_key(i)):
            rewrites += 1
    except ChunkBusy:
        continue
    versions[i] += 1
    try:
        c.put(stress_key(i), stress_value(i, versions[i]))
        writes += 1
    except (ChunkExists, ChunkBusy):
        pass
print(json.dumps({{"writes": writes, "rewrites": rewrites}}), flush=True)
"""

_READER = """
import sys, time, json, dataclasses
import numpy as np
sys.path.insert(0, {repo!r})
from tests.node.test_lease_free import STRESS_KEYS, stress_key, stress_size, stress_check
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.errors import ChunkBusy, ChunkNotFound
c = StoreClient.connect({address!r}, StoreClientConfig(data_plane=DataPlane.SHM))
assert c.lease_free_counters().active
rng = np.random.default_rng({seed})
bufs = {{i: np.empty(stress_size(i), np.uint8) for i in range(STRESS_KEYS)}}
reads = gone = 0
deadline = time.monotonic() + {seconds}
while time.monotonic() < deadline:
    i = int(rng.integers(STRESS_KEYS))
    try:
        c.get_into(stress_key(i), bufs[i])
    except (ChunkNotFound, ChunkBusy):
        gone += 1
        continue
    stress_check(i, bufs[i])
    reads += 1
print(json.dumps(dict(dataclasses.asdict(c.lease_free_counters()), reads=reads, gone=gone)),
      flush=True)
"""


def test_stress_writer_and_two_readers_never_see_a_torn_or_foreign_chunk(tmp_path: Path) -> None:
    # 4 MiB of DRAM for ~6 MiB of values: puts evict (demote to NVMe), leased reads promote back,
    # removals and rewrites reuse extents under the lease-free readers.
    d = DaemonProcess(tmp_path, "node-stress", dram_bytes="4MiB")
    d.start()
    try:
        with shm_client(d) as c:  # start with every key stored
            for i in range(STRESS_KEYS):
                c.put(stress_key(i), stress_value(i, 0))
        fmt = {"repo": str(REPO), "address": d.grpc_address, "seconds": STRESS_S}
        procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for code in (_WRITER.format(**fmt), _READER.format(seed=2, **fmt),
                              _READER.format(seed=3, **fmt))]
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        d.stop()
    writer, *readers = results
    print("stress:", writer, readers)  # shown with -s or on failure
    assert writer["writes"] > 20 and writer["rewrites"] > 5, writer
    for r in readers:
        assert r["active"] and r["reads"] > 20, r
    assert sum(r["hits"] for r in readers) > 0, readers
    fallbacks = sum(r["misses"] + r["conflicts"] + r["retries"] for r in readers)
    assert fallbacks > 0, f"no read ever had to fall back: the churn did not reach them {readers}"


# --- faults ------------------------------------------------------------------------------------


def test_a_reader_killed_mid_copy_holds_nothing(daemon: DaemonProcess,
                                                client: StoreClient) -> None:
    client.put(b"lf-die-reading", value(9, 64 * KiB))
    code = textwrap.dedent(f"""
        import os, signal, sys
        import numpy as np
        sys.path.insert(0, {str(REPO)!r})
        from kvstore.client import DataPlane, StoreClient, StoreClientConfig
        c = StoreClient.connect({daemon.grpc_address!r},
                                StoreClientConfig(data_plane=DataPlane.SHM))
        assert c.lease_free_counters().active
        def die():
            print("COPYING", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        c.plane.reader.before_copy = die
        c.get_into(b"lf-die-reading", np.empty(64 * 1024, np.uint8))
        print("SURVIVED", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.strip() == "COPYING" and proc.returncode == -9, proc.stderr[-2000:]
    # No lease was ever taken: the chunk can be removed at once (a leased reader that died
    # would hold it until the daemon noticed the closed connection).
    assert client.stats().shm_leases_open == 0
    assert client.remove(b"lf-die-reading") == [b"lf-die-reading"]


def test_a_killed_daemon_is_never_read_through_its_dead_mapping(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-dies", dram_bytes="4MiB", nvme=False)
    d.start()
    c = shm_client(d)
    try:
        v = value(10, 64 * KiB)
        c.put(b"lf-k", v)
        out = np.empty_like(v)
        c.get_into(b"lf-k", out)
        assert c.lease_free_counters().hits == 1
        d.kill()  # its arena and index stay mapped here, frozen, with the chunk published
        with pytest.raises(PeerUnavailable):
            c.get_into(b"lf-k", out)
        counters = c.lease_free_counters()
        assert counters.hits == 1 and not counters.active
        # A new daemon (new arena, new index): the old client keeps failing rather than read
        # either mapping; a new client reads lease-free from the new daemon.
        d2 = DaemonProcess(tmp_path, "node-dies-2", dram_bytes="4MiB", nvme=False)
        d2.start()
        try:
            with shm_client(d2) as c2:
                c2.put(b"lf-k", value(11, 64 * KiB))
                c2.get_into(b"lf-k", out)
                assert np.array_equal(out, value(11, 64 * KiB))
                assert c2.lease_free_counters().hits == 1
            with pytest.raises(PeerUnavailable):
                c.get_into(b"lf-k", out)
        finally:
            d2.stop()
    finally:
        c.close()
        d.stop()


def test_a_gracefully_stopped_daemon_serves_no_lease_free_read(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-stops", dram_bytes="4MiB", nvme=False)
    d.start()
    c = shm_client(d)
    try:
        c.put(b"lf-k", value(12, 4 * KiB))
        out = np.empty(4 * KiB, np.uint8)
        c.get_into(b"lf-k", out)
        d.stop()
        with pytest.raises(PeerUnavailable):
            c.get_into(b"lf-k", out)
    finally:
        c.close()
        d.stop()

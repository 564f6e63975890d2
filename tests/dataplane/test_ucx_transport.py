"""The UCX transport against a real server process (ucxx over shared memory / CMA on one host).

Skipped, with the reason, when ``ucxx`` does not import (``pip install 'kvtier[ucx]'``).
The transport conformance suite (``transport_conformance.py``) runs here as
:class:`TestUcxConformance`: round trips, buffer ownership, refusals, a client killed after its
PUT was accepted (never visible; the lease is aborted after the server's I/O timeout), a client
gone mid-GET (the read lease is released), SIGKILLed and SIGSTOPped servers (PeerUnavailable
within the client's timeout), malformed requests, threads. UCX's own: inline small GETs, the
liveness probe, idle clients, and the daemon and StoreClient (advertising, choice, fallback).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client import planes
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.transport import ucx
from kvstore.dataplane.transport.base import TransportKind, TransportServer
from kvstore.dataplane.transport.memory_backend import MemoryBackend, MemoryReadLease
from kvstore.dataplane.transport.ucx import UcxClient, UcxServer, UcxServerConfig, ucx_unavailable
from kvstore.errors import (
    ChunkNotFound,
    PeerUnavailable,
    SizeMismatch,
    TierUnavailable,
)
from tests.dataplane.transport_conformance import (
    ChildServer,
    TransportConformance,
    TransportHarness,
)
from tests.support.common import StdinServerProcess, payload, wait_until
from tests.support.daemon import DaemonProcess

_REASON = ucx_unavailable()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"UCX transport: {_REASON}")

KiB, MiB = 1 << 10, 1 << 20
REPO_ROOT = Path(__file__).resolve().parents[2]


class UcxServerProcess(StdinServerProcess):
    """``python -m kvstore.dataplane.transport.ucx`` over a MemoryBackend, in its own process."""

    def __init__(self, *flags: str) -> None:
        super().__init__("kvstore.dataplane.transport.ucx", "UCX-LISTENING ", *flags)
        self.address_hex = self.ready_line.split()[1]
        self.address = bytes.fromhex(self.address_hex)

    def client(self, **options: object) -> UcxClient:
        return UcxClient(self.address, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server() -> Iterator[UcxServerProcess]:
    srv = UcxServerProcess("--max-value-bytes", str(128 * MiB), "--io-timeout-s", "1.5")
    yield srv
    assert srv.alive(), "the shared UCX server process died during the tests"
    srv.stop()
    assert srv.proc.returncode == 0


@pytest.fixture
def key(request: pytest.FixtureRequest) -> bytes:
    """A key unique to the test (tests share one server)."""
    return request.node.name.encode()[-64:]


class UcxPrivateServer(ChildServer):
    def __init__(self, *flags: str) -> None:
        self.server = UcxServerProcess(*flags)

    def client(self, **options: object) -> UcxClient:
        return self.server.client(**options)


class UcxHarness(TransportHarness):
    name = "ucx"
    io_timeout_s = 1.0
    stalled_reader_keeps_its_lease = False  # the server drops a stalled reader after 1.5 s

    def __init__(self, server: UcxServerProcess) -> None:
        self.server = server

    def client(self, **options: object) -> UcxClient:
        options.setdefault("io_timeout_s", 10)
        return self.server.client(**options)

    def private_server(self, *, limit_bytes: int = 0) -> UcxPrivateServer:
        return UcxPrivateServer("--max-value-bytes", str(limit_bytes or 128 * MiB))

    def partial_put(self, key: bytes, total_bytes: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _HALF_PUT, self.server.address_hex,
                                 key.decode(), str(total_bytes)], stdout=subprocess.PIPE,
                                text=True, cwd=REPO_ROOT)

    def partial_get(self, key: bytes, total_bytes: int) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _HALF_GET, self.server.address_hex,
                                 key.decode(), str(total_bytes)], stdout=subprocess.PIPE,
                                text=True, cwd=REPO_ROOT)

    def _raw_request(self, magic: bytes, key_len: int) -> None:
        """Send one REQUEST on a lane of a fresh client; the server drops a malformed one
        without an answer (it cannot trust the client id in it), so nothing is awaited."""
        c = UcxClient(self.server.address, io_timeout_s=5)
        try:
            with c._lane() as lane:
                lane.seq += 1
                buf = bytearray(ucx.REQ.size + key_len)
                ucx.REQ.pack_into(buf, 0, magic, int(ucx.Op.GET), 0, key_len, lane.client_id,
                                  lane.seq, 0)
                w = lane.worker
                send = lane.ep.tag_send(w.array(buf), tag=w.ucx.UCXXTag(
                    ucx._tag(ucx.Kind.REQUEST, lane.client_id, lane.seq)))
                lane.wait([send], "a malformed request")
                lane.broken = True  # never reuse a lane the server saw misbehave
        finally:
            c.close()

    def send_garbage(self) -> None:
        self._raw_request(b"JUNK", 3)

    def send_oversized(self) -> None:
        self._raw_request(ucx.MAGIC, 65)  # a key over MAX_KEY_BYTES


@pytest.fixture(scope="module")
def ucx_harness(server: UcxServerProcess) -> UcxHarness:
    return UcxHarness(server)


class TestUcxConformance(TransportConformance):
    @pytest.fixture
    def harness(self, ucx_harness: UcxHarness) -> TransportHarness:
        return ucx_harness


def test_an_in_process_server_and_its_endpoint() -> None:
    srv = UcxServer(MemoryBackend(), UcxServerConfig(io_timeout_s=2))
    endpoint = srv.start()
    try:
        assert isinstance(srv, TransportServer)
        assert endpoint.kind is TransportKind.UCX and endpoint.port == 0
        assert srv.endpoint.worker_address == endpoint.worker_address != b""
        with UcxClient(endpoint.worker_address) as c:
            c.put(b"in-process", b"abc")
            assert c.get(b"in-process") == b"abc"
    finally:
        srv.close(0)


class _LeaseCountingBackend(MemoryBackend):
    """The real memory backend, counting the read leases a server takes."""

    read_leases = 0

    def open_read(self, key: bytes) -> MemoryReadLease:
        self.read_leases += 1
        return super().open_read(key)


def test_small_gets_come_inline_without_a_read_lease() -> None:
    backend = _LeaseCountingBackend()
    srv = UcxServer(backend, UcxServerConfig(io_timeout_s=5))
    endpoint = srv.start()
    c = UcxClient(endpoint.worker_address, io_timeout_s=5)
    try:
        for size in (1, 4 * KiB, 64 * KiB):  # inline: copied into the response, no lease
            data = payload(size, size)
            c.put(b"k%d" % size, data)
            dst = bytearray(size)
            assert c.get_into(b"k%d" % size, dst) == size
            assert dst == data
            assert c.remove(b"k%d" % size) is True
        with pytest.raises(SizeMismatch):
            c.put(b"small", b"abc")
            c.get_into(b"small", bytearray(4))
        assert backend.read_leases == 0
        c.put(b"large", payload(64 * KiB + 1, 1))  # above INLINE_GET_BYTES: leased, 3 messages
        assert c.get_into(b"large", bytearray(64 * KiB + 1)) == 64 * KiB + 1
        assert backend.read_leases == 1
    finally:
        c.close()
        srv.close(drain_timeout_s=0.5)


_HALF_PUT = """
import sys, time
from kvstore.dataplane.transport import ucx
c = ucx.UcxClient(bytes.fromhex(sys.argv[1]))
with c._lane() as lane:
    status, flags, size = lane.call(ucx.Op.PUT, sys.argv[2].encode(), int(sys.argv[3]))
    assert flags & ucx._FLAG_READY
    print("READY", flush=True)
    time.sleep(120)
"""

_HALF_GET = """
import sys, time
from kvstore.dataplane.transport import ucx
c = ucx.UcxClient(bytes.fromhex(sys.argv[1]))
with c._lane() as lane:
    lane.call(ucx.Op.GET, sys.argv[2].encode(), int(sys.argv[3]))
    print("READY", flush=True)
    time.sleep(120)
"""


def test_liveness_probe_reports_a_dead_server_before_the_io_timeout() -> None:
    srv = UcxServerProcess()
    try:
        with srv.client(io_timeout_s=60.0, liveness=srv.alive, liveness_interval_s=0.1) as c:
            c.put(b"before", payload(MiB, 1))
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(10)
            start = time.monotonic()
            with pytest.raises(PeerUnavailable, match="control plane"):
                c.get_into(b"before", bytearray(MiB))
            assert time.monotonic() - start < 5.0
    finally:
        srv.proc.kill()
        srv.proc.wait()



def test_close_refuses_new_requests_and_ends_leases() -> None:
    backend = MemoryBackend()
    srv = UcxServer(backend, UcxServerConfig(io_timeout_s=2))
    endpoint = srv.start()
    c = UcxClient(endpoint.worker_address, io_timeout_s=2)
    try:
        c.put(b"k", b"v")
        srv.close(drain_timeout_s=0.5)
        with pytest.raises(PeerUnavailable):
            c.get(b"k")
        assert backend.exists(b"k")
        assert backend.remove(b"k")  # no lease left behind
    finally:
        c.close()


def test_silent_clients_are_forgotten_and_a_returning_one_says_hello_again() -> None:
    srv = UcxServer(MemoryBackend(), UcxServerConfig(io_timeout_s=5, client_idle_ttl_s=0.5))
    endpoint = srv.start()
    returning = UcxClient(endpoint.worker_address, io_timeout_s=5)
    gone = UcxClient(endpoint.worker_address, io_timeout_s=5)  # never heard from again
    try:
        returning.put(b"k", b"v")
        gone.put(b"g", b"x")
        assert srv.stats().clients == 2
        # UCX cannot tell idle from dead: both endpoints are closed after the TTL
        wait_until(lambda: srv.stats().clients == 0, timeout_s=10,
                   what="silent clients to be forgotten")
        assert srv.stats().clients_expired == 2
        assert returning.get(b"k") == b"v"  # its lane introduced itself again first
        assert srv.stats().clients == 1
    finally:
        returning.close()
        gone.close()
        srv.close(drain_timeout_s=0.5)


# --- the daemon and StoreClient: advertising, automatic choice, fallback -------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("ucx"), "node-ucx", nvme=False,
                      settings={"server.ucx": "required", "server.ucx_io_timeout_s": "2"})
    d.start()
    yield d
    d.stop()


@pytest.fixture
def elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the daemon look like it runs on another host (another boot id), so AUTO cannot
    pick shared memory."""
    monkeypatch.setattr(planes, "local_boot_id", lambda: "another-host")


def test_daemon_advertises_its_ucx_worker_address(daemon: DaemonProcess) -> None:
    assert daemon.addresses["ucx_address"]
    with StoreClient.connect(daemon.grpc_address) as c:
        assert c.info.ucx_worker_address.hex() == daemon.addresses["ucx_address"]
        assert c.data_plane is DataPlane.SHM  # same host: shared memory first


def test_auto_picks_ucx_for_a_daemon_on_another_host(daemon: DaemonProcess, elsewhere: None,
                                                     key: bytes) -> None:
    with StoreClient.connect(daemon.grpc_address, StoreClientConfig(ucx_min_bytes=0)) as c:
        assert c.data_plane is DataPlane.UCX
        for i, size in enumerate((4 * KiB, 4 * MiB + 1)):
            k = key[:60] + b"-%d" % i
            c.put(k, payload(size, i))
            out = bytearray(size)
            assert c.get_into(k, out) == size and out == payload(size, i)
        assert c._remote._ucx is not None  # the bytes went over UCX, not the TCP fallback
        assert c._remote._tcp is None
        with pytest.raises(ChunkNotFound):
            c.get_into(b"ucx-never-stored", bytearray(8))
        with pytest.raises(SizeMismatch):
            c.get_into(key[:60] + b"-0", bytearray(8))


def test_values_below_ucx_min_bytes_go_over_tcp(daemon: DaemonProcess, elsewhere: None,
                                                key: bytes) -> None:
    with StoreClient.connect(daemon.grpc_address, StoreClientConfig(ucx_min_bytes=MiB)) as c:
        assert c.data_plane is DataPlane.UCX
        c.put(key, payload(4 * KiB, 5))
        assert c._remote._tcp is not None and c._remote._ucx is None
        out = bytearray(4 * KiB)
        c.get_into(key, out)
        assert out == payload(4 * KiB, 5) and c._remote._ucx is None
        c.put(key[:60] + b"-big", payload(MiB, 6))
        assert c._remote._ucx is not None


def test_forced_planes_and_a_daemon_without_ucx(tmp_path: Path, elsewhere: None) -> None:
    d = DaemonProcess(tmp_path, "node-no-ucx", nvme=False, settings={"server.ucx": "disabled"})
    d.start()
    try:
        assert d.addresses["ucx_address"] == ""
        with StoreClient.connect(d.grpc_address) as c:
            assert c.data_plane is DataPlane.TCP
        with pytest.raises(TierUnavailable, match="UCX"):
            StoreClient.connect(d.grpc_address, StoreClientConfig(data_plane=DataPlane.UCX))
    finally:
        d.stop()


def test_a_ucx_failure_falls_back_to_tcp_and_marks_ucx_bad(daemon: DaemonProcess,
                                                           elsewhere: None, key: bytes) -> None:
    dead = UcxServerProcess()  # a valid worker address whose process is gone
    dead.proc.kill()
    dead.proc.wait()
    cfg = StoreClientConfig(ucx_io_timeout_s=1.0, ucx_retry_after_s=60, ucx_min_bytes=0)
    with StoreClient.connect(daemon.grpc_address, cfg) as c:
        assert c.data_plane is DataPlane.UCX
        info = pb.NodeInfo()
        info.CopyFrom(c.info)
        info.ucx_worker_address = dead.address
        c._info = info  # this client now dials a UCX peer that never answers
        data = payload(2 * MiB, 9)
        start = time.monotonic()
        c.put(key, data)  # UCX times out, the same call succeeds over TCP
        assert time.monotonic() - start < 10
        assert c._remote._tcp is not None
        start = time.monotonic()
        out = bytearray(len(data))
        c.get_into(key, out)  # UCX is marked bad: straight to TCP
        assert out == data and time.monotonic() - start < 1.0


def test_dead_daemon_is_peer_unavailable_within_a_bounded_time(tmp_path: Path,
                                                                elsewhere: None) -> None:
    d = DaemonProcess(tmp_path, "node-ucx-dies", nvme=False,
                      settings={"server.ucx": "required"})
    d.start()
    try:
        cfg = StoreClientConfig(ucx_io_timeout_s=30, ucx_liveness_interval_s=0.2,
                                rpc_timeout_s=2)
        with StoreClient.connect(d.grpc_address, cfg) as c:
            assert c.data_plane is DataPlane.UCX
            c.put(b"before-death", payload(MiB, 1))
            d.kill()
            start = time.monotonic()
            with pytest.raises(PeerUnavailable):
                c.get_into(b"before-death", bytearray(MiB))
            assert time.monotonic() - start < 5.0  # the liveness probe, not the 30 s timeout
    finally:
        d.stop()


def test_datapath_benchmark_ucx_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import datapath

    monkeypatch.setattr(datapath, "SIZES_BYTES", (4 * KiB, 2 * MiB))
    monkeypatch.setattr(datapath, "OPS", ("put", "get", "get_batch"))
    monkeypatch.setattr(datapath, "calls_for", lambda size, batch, quick: 3)
    result = datapath.run(quick=True, path_names=("socket", "ucx", "ucx-daemon"))
    rows = {(r["variant"], r["op"], r["value_bytes"]): r for r in result["rows"]}
    for variant in ("ucx", "ucx-daemon"):
        for op in ("put", "get"):
            row = rows[(variant, op, 2 * MiB)]
            assert row["path"] == "ucx" and row["limit_gbps"] > 0 and row["gbps"] > 0
        assert (variant, "get_batch", 4 * KiB) in rows

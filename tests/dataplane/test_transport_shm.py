"""The shared-memory transport (:class:`~kvstore.dataplane.transport.shm.ShmClient` against a
``kvtier daemon`` process's lease channel and mapped arena) through the transport conformance
suite (``transport_conformance.py``), with the native extension's lease-free reads and with
Python's (``KVTIER_NATIVE=0``), plus the server half's protocol checks.

The plane's daemon-side behaviour (lease-free reads and their reports, batched puts, churn under
eviction) is tested in ``tests/node/test_lease_free.py``, ``test_shm_put_many.py`` and
``test_shm_churn.py``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc
from kvstore.dataplane import native
from kvstore.dataplane.read_index import lease_free_supported
from kvstore.dataplane.transport.base import Endpoint, TransportKind, TransportServer
from kvstore.dataplane.transport.shm import LeaseChannel, ShmClient, ShmClientConfig, ShmServer
from kvstore.dataplane.transport.shm.frames import (
    MAX_BODY_BYTES,
    REPLY,
    REQUEST,
    STATUS_CLOSING,
    ChannelOp,
)
from kvstore.errors import InvalidArgument, PeerUnavailable, ProtocolError
from tests.dataplane.transport_conformance import (
    MappedTransportConformance,
    PrivateServer,
    TransportHarness,
)
from tests.support.daemon import REPO, DaemonProcess
from tests.support.native import built_extension

KiB, MiB = 1 << 10, 1 << 20


def _read_index_of(daemon: DaemonProcess) -> str:
    with grpc.insecure_channel(daemon.grpc_address) as channel:
        info = pb_grpc.StoreStub(channel).Info(pb.InfoRequest(), timeout=10)  # type: ignore[no-untyped-call]
    return str(info.shm_read_index)



class _Daemon:
    """A daemon and how to make ShmClients of it, with or without the native extension."""

    def __init__(self, daemon: DaemonProcess, reads: str) -> None:
        self.daemon = daemon
        self.reads = reads
        self.socket = str(daemon.addresses["shm_socket"])
        self.arena = str(daemon.addresses["shm_arena"])
        self.read_index = _read_index_of(daemon)

    def client(self, **options: object) -> ShmClient:
        with pytest.MonkeyPatch.context() as mp:
            if self.reads == "python":
                mp.setenv(native.ENV_SWITCH, "0")
            return ShmClient.connect(self.socket, self.arena, read_index=self.read_index,
                                     config=ShmClientConfig(**options))  # type: ignore[arg-type]


class ShmPrivateServer(PrivateServer):
    def __init__(self, work_dir: Path, reads: str, dram_bytes: str) -> None:
        self.process = DaemonProcess(work_dir, "node-shm-private", dram_bytes=dram_bytes,
                                     nvme=False)
        self.process.start()
        self.daemon = _Daemon(self.process, reads)

    def client(self, **options: object) -> ShmClient:
        return self.daemon.client(**options)

    def kill(self) -> None:
        self.process.kill()

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self.thaw()
        self.process.stop()


_PARTIAL_PUT = textwrap.dedent("""
    import sys, time
    from kvstore.dataplane.arena import ArenaAccess, ShmArena
    from kvstore.dataplane.transport.shm import LeaseChannel
    from kvstore.dataplane.transport.shm.frames import ChannelOp
    address, arena_name, key, total = sys.argv[1], sys.argv[2], sys.argv[3].encode(), int(sys.argv[4])
    chan = LeaseChannel(address)
    _lease, ranges = chan.call(ChannelOp.RESERVE, keys=[key, b""], arg=total)
    arena = ShmArena.attach(arena_name, access=ArenaAccess.READ_WRITE)
    arena.view(ranges[0][0], total // 2, readonly=False)[:] = b"\\x07" * (total // 2)
    print("READY", flush=True)
    time.sleep(120)
""")

_PARTIAL_GET = textwrap.dedent("""
    import sys, time
    from kvstore.dataplane.transport.shm import LeaseChannel
    from kvstore.dataplane.transport.shm.frames import ChannelOp
    chan = LeaseChannel(sys.argv[1])
    chan.call(ChannelOp.ACQUIRE_READ, keys=[sys.argv[2].encode()])
    print("READY", flush=True)  # the reader now copies out of the arena, slowly
    time.sleep(120)
""")


class ShmHarness(TransportHarness):
    name = "shm"
    io_timeout_s = 1.0

    def __init__(self, shared: _Daemon, work_dir: Path) -> None:
        self.shared = shared
        self.work_dir = work_dir
        self._private = 0

    def client(self, **options: object) -> ShmClient:
        return self.shared.client(**options)

    def private_server(self, *, limit_bytes: int = 0) -> ShmPrivateServer:
        # The arena is the limit: a value larger than the whole DRAM tier cannot be stored.
        self._private += 1
        return ShmPrivateServer(self.work_dir / f"private-{self._private}", self.shared.reads,
                                f"{limit_bytes}" if limit_bytes else "64MiB")

    def _run(self, code: str, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))

    def partial_put(self, key: bytes, total_bytes: int) -> subprocess.Popen[str]:
        return self._run(_PARTIAL_PUT, self.shared.socket, self.shared.arena, key.decode(),
                         str(total_bytes))

    def partial_get(self, key: bytes, total_bytes: int) -> subprocess.Popen[str]:
        return self._run(_PARTIAL_GET, self.shared.socket, key.decode())

    def _refused(self, frame: bytes) -> None:
        """Send ``frame`` on a raw connection; the server must say why (a closing
        ProtocolError reply) and close it."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect("\0" + self.shared.socket[1:])
            sock.sendall(frame)
            reply = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(4096):
                    reply += chunk
            status, _count, detail_len, _ = REPLY.unpack_from(reply)
            assert status == STATUS_CLOSING
            assert reply[REPLY.size:REPLY.size + detail_len].startswith(b"ProtocolError\n")

    def send_garbage(self) -> None:
        self._refused(REQUEST.pack(99, 0, 0, 0, 0, 0.0))  # an unknown op

    def send_oversized(self) -> None:
        self._refused(REQUEST.pack(ChannelOp.PUT, 0, 2, MAX_BODY_BYTES + 1, 10, 0.0))


@pytest.fixture(scope="module", params=["extension", "python"])
def reads(request: pytest.FixtureRequest) -> str:
    """The suite runs with the native extension's lease-free reads (built when missing) and
    with Python's, each against its own daemon."""
    if not lease_free_supported():
        pytest.skip("lease-free reads need Linux on x86-64")
    if request.param == "extension":
        built_extension()
    return str(request.param)


@pytest.fixture(scope="module")
def shm_harness(tmp_path_factory: pytest.TempPathFactory, reads: str) -> Iterator[ShmHarness]:
    work_dir = tmp_path_factory.mktemp(f"shm-{reads}")
    d = DaemonProcess(work_dir, f"node-shm-{reads}", dram_bytes="256MiB", nvme=False)
    d.start()
    try:
        yield ShmHarness(_Daemon(d, reads), work_dir)
        assert d.proc is not None and d.proc.poll() is None, "the shared daemon died"
    finally:
        d.stop()


class TestShmConformance(MappedTransportConformance):
    @pytest.fixture
    def harness(self, shm_harness: ShmHarness) -> TransportHarness:
        return shm_harness

    def test_reads_go_through_the_configured_reader(self, harness: ShmHarness) -> None:
        c = harness.client()
        try:
            assert c.reader is not None and c.reader.native == (harness.shared.reads == "extension")
            c.put(b"reader-check", b"x" * 100)
            assert c.get(b"reader-check") == b"x" * 100
            c.get_into(b"reader-check", bytearray(100))
            assert c.lease_free_counters().hits == 1
        finally:
            c.close()


# --- the server half on its own ------------------------------------------------------------------


class _NoLeases:
    """An ArenaLeaseBackend that holds nothing (for the server's own checks)."""

    def acquire_read(self, keys: object, ttl_s: float, *, prefix: bool = False,
                     owner: object | None = None) -> tuple[int, list[object]]:
        raise InvalidArgument("no chunks here")

    def release(self, lease_id: int, *, owner: object | None = None) -> bool:
        return False

    def reserve(self, key: bytes, size_bytes: int, ttl_s: float, *,
                parent: bytes | None = None, owner: object | None = None) -> tuple[int, int]:
        raise InvalidArgument("no room here")

    def commit(self, lease_id: int, *, owner: object | None = None) -> object:
        raise InvalidArgument("unknown lease")

    def abort(self, lease_id: int, *, owner: object | None = None) -> bool:
        return False

    def put(self, key: bytes, value: object, *, parent: bytes | None = None) -> None:
        raise InvalidArgument("no room here")

    def size_of(self, key: bytes) -> int | None:
        return None

    def remove(self, key: bytes) -> bool:
        return False

    def drop_owner(self, owner: object) -> tuple[int, int]:
        return 0, 0

    def open_count(self) -> tuple[int, int]:
        return 0, 0


def test_the_server_is_a_transport_server_with_an_abstract_endpoint() -> None:
    from kvstore.dataplane.transport.base import ArenaLeaseBackend

    backend = _NoLeases()
    assert isinstance(backend, ArenaLeaseBackend)
    srv = ShmServer(backend, lease_ttl_s=10)  # type: ignore[arg-type]
    endpoint = srv.start()
    try:
        assert isinstance(srv, TransportServer)  # (its endpoint raises until started)
        assert endpoint == Endpoint(TransportKind.SHM, srv.address, 0)
        chan = LeaseChannel(srv.address, io_timeout_s=5)
        try:
            chan.call(ChannelOp.PING)
            assert chan.call(ChannelOp.SIZE_OF, keys=[b"k"])[1] == [(0, 0)]
            assert chan.call(ChannelOp.REMOVE, keys=[b"k"])[0] == 0
            with pytest.raises(InvalidArgument, match="no room"):  # by class, over the wire
                chan.call(ChannelOp.RESERVE, keys=[b"k", b""], arg=10)
            # Two keys to REMOVE: the server says why, then hangs up.
            with pytest.raises(ProtocolError, match="REMOVE carries one key"):
                chan.call(ChannelOp.REMOVE, keys=[b"a", b"b"])
            assert chan.broken
        finally:
            chan.close()
    finally:
        srv.close()
    with pytest.raises(PeerUnavailable):
        LeaseChannel(srv.address)
    with pytest.raises(InvalidArgument):
        LeaseChannel("not-abstract")
    with pytest.raises(InvalidArgument):
        Endpoint(TransportKind.SHM, "not-abstract", 0)


def test_a_reply_that_does_not_come_times_out_and_breaks_the_channel() -> None:
    """A stuck peer: the wait is bounded, and the channel is marked broken (a pool drops it)."""
    srv = ShmServer(_NoLeases(), lease_ttl_s=10)  # type: ignore[arg-type]
    srv.start()
    try:
        chan = LeaseChannel(srv.address, io_timeout_s=0.3)
        try:
            # A frame the server waits on forever (its body never comes): no reply.
            chan.sock.sendall(REQUEST.pack(ChannelOp.PING, 0, 0, 100, 0, 0.0))
            with pytest.raises(PeerUnavailable, match="timed out"):
                chan.call(ChannelOp.PING)
            assert chan.broken
        finally:
            chan.close()
    finally:
        srv.close()

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
import math
import os
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc
from kvstore.dataplane import native
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.read_index import lease_free_supported
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.base import Endpoint, TransportKind, TransportServer
from kvstore.dataplane.transport.shm import LeaseChannel, ShmClient, ShmClientConfig, ShmServer
from kvstore.dataplane.transport.shm.channel import ChannelClosed
from kvstore.dataplane.transport.shm.frames import (
    MAX_BODY_BYTES,
    REPLY,
    REQUEST,
    STATUS_CLOSING,
    ChannelOp,
)
from kvstore.errors import InvalidArgument, PeerUnavailable, ProtocolError
from kvstore.node.backend import ShmLeases
from kvstore.node.cache import TieredCache
from tests.dataplane.transport_conformance import (
    MappedTransportConformance,
    PrivateServer,
    TransportHarness,
)
from tests.support.common import wait_until
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

    def reserve_many(self, items: list[tuple[bytes, bytes | None]], sizes_bytes: list[int],
                     ttl_s: float, *, owner: object | None = None) -> list[object]:
        return [InvalidArgument("no room here") for _item in items]

    def commit_many(self, lease_ids: list[int], *, owner: object | None = None) -> list[object]:
        return [InvalidArgument("unknown lease") for _lease_id in lease_ids]

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


# --- idle connections (issue 12: server.idle_timeout_s) -------------------------------------------


def _connection_threads() -> list[threading.Thread]:
    """This process's lease-channel connection threads (named after the peer's pid: ours)."""
    return [t for t in threading.enumerate() if t.name == f"kvtier-shm-{os.getpid()}"]


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closed ``sock`` (EOF or a reset waits to be read); reads nothing."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except ConnectionResetError:
        return True


def test_an_idle_lease_channel_connection_is_closed_and_its_thread_ends() -> None:
    srv = ShmServer(_NoLeases(), lease_ttl_s=10, idle_timeout_s=0.3)  # type: ignore[arg-type]
    srv.start()
    try:
        chan = LeaseChannel(srv.address, io_timeout_s=5)
        try:
            chan.call(ChannelOp.PING)
            assert srv.connection_count() == 1 and len(_connection_threads()) == 1
            wait_until(lambda: srv.connection_count() == 0, 10, "the idle close")
            assert srv.idle_closed == 1
            wait_until(lambda: not _connection_threads(), 10, "its thread to end")
            assert _closed_by_peer(chan.sock)
            # What a pool sees on a channel it reused: the request had no reply at all.
            chan.may_be_stale = True
            with pytest.raises(ChannelClosed):
                chan.call(ChannelOp.PING)
            assert chan.broken
        finally:
            chan.close()
    finally:
        srv.close()
    with pytest.raises(InvalidArgument, match="idle_timeout_s"):
        ShmServer(_NoLeases(), lease_ttl_s=10, idle_timeout_s=math.inf)  # type: ignore[arg-type]


@contextlib.contextmanager
def _leasing_server(idle_timeout_s: float) -> Iterator[ShmServer]:
    """A lease channel over real leases (``ShmLeases`` over a DRAM tier) holding chunk ``k``."""
    cache = TieredCache({TierKind.DRAM: DramTier(4 << 20)})
    leases = ShmLeases(cache)
    leases.put(b"k", b"v" * 100)
    srv = ShmServer(leases, lease_ttl_s=10, idle_timeout_s=idle_timeout_s)
    srv.start()
    try:
        yield srv
    finally:
        srv.close()
        leases.close()
        cache.close()


def test_a_lease_channel_connection_holding_leases_is_not_idle_closed() -> None:
    """A connection holding a read lease, and one holding a reservation, outlive an idle one
    whose last request came after theirs; each is idle-closed once it ended what it held."""
    with _leasing_server(idle_timeout_s=0.3) as srv:
        reader = LeaseChannel(srv.address, io_timeout_s=5)
        writer = LeaseChannel(srv.address, io_timeout_s=5)
        idle = LeaseChannel(srv.address, io_timeout_s=5)
        try:
            read_id, _ = reader.call(ChannelOp.ACQUIRE_READ, keys=[b"k"], ttl_s=60)
            write_id, _ = writer.call(ChannelOp.RESERVE, keys=[b"w", b""], arg=100, ttl_s=60)
            idle.call(ChannelOp.PING)  # the clock: idle since after the others' last request
            # The count, the close and the registry entry change one after the other: wait for all.
            wait_until(lambda: srv.idle_closed >= 1 and _closed_by_peer(idle.sock)
                       and srv.connection_count() == 2, 10, "the idle connection's close")
            assert srv.idle_closed == 1
            assert not _closed_by_peer(reader.sock) and not _closed_by_peer(writer.sock)
            reader.call(ChannelOp.RELEASE, arg=read_id)
            wait_until(lambda: _closed_by_peer(reader.sock), 10, "the reader's close")
            assert srv.idle_closed == 2 and not _closed_by_peer(writer.sock)
            writer.call(ChannelOp.COMMIT, arg=write_id)
            wait_until(lambda: srv.connection_count() == 0, 10, "the writer's close")
            assert srv.idle_closed == 3
        finally:
            for chan in (reader, writer, idle):
                chan.close()


def test_a_lease_channel_connection_whose_leases_expired_is_idle_closed() -> None:
    """Leases never ended by a request (their TTL ran out) hold the connection no longer than
    that TTL: the idle close stays bounded."""
    with _leasing_server(idle_timeout_s=0.2) as srv:
        chan = LeaseChannel(srv.address, io_timeout_s=5)
        try:
            chan.call(ChannelOp.ACQUIRE_READ, keys=[b"k"], ttl_s=0.6)
            chan.call(ChannelOp.RESERVE_MANY, keys=[b"a", b"b"], arg=16, ttl_s=0.8,
                      payload=memoryview(struct.pack("<2Q", 10, 10)))
            wait_until(lambda: srv.connection_count() == 0, 10, "the close after the TTL")
            assert srv.idle_closed == 1
        finally:
            chan.close()


def test_a_shm_client_keeps_working_when_the_daemon_idle_closes_its_connections(
        tmp_path: Path) -> None:
    """A real daemon with ``server.idle_timeout_s`` 0.4 s: after each idle close of the pooled
    lease-channel connections (and of the read reporter's), every kind of call just works: its
    first request, which finds the connection closed, is sent again on a fresh one."""
    if not lease_free_supported():
        pytest.skip("lease-free reads need Linux on x86-64")
    d = DaemonProcess(tmp_path, "node-shm-idle", dram_bytes="64MiB", nvme=False,
                      settings={"server.idle_timeout_s": "0.4"})
    d.start()
    client = _Daemon(d, "python").client(io_timeout_s=5)
    try:
        big = os.urandom(200 * KiB)  # over INLINE_PUT_MAX_BYTES: RESERVE + COMMIT
        client.put(b"small", b"s" * 100)
        client.put(b"big", big)

        def all_closed() -> bool:
            socks = [c.sock for c in client._all]
            reporter = client._reporter
            if reporter is not None and reporter._chan is not None:
                socks.append(reporter._chan.sock)
            return bool(socks) and all(_closed_by_peer(s) for s in socks)

        calls = [
            lambda: client.get(b"small") == b"s" * 100,
            lambda: client.put(b"small-2", b"t" * 100) is None,
            lambda: client.put(b"big-2", big) is None and client.get(b"big-2") == big,
            lambda: client.size_of(b"big") == len(big),
            lambda: client.put_many([b"m1", b"m2", b"m3"], [b"1" * 10, big, b"3" * 10])
            == [True, True, True],
            lambda: client.get_many_into([b"m1", b"nope"], [bytearray(10), bytearray(1)])
            == [10, None],
            lambda: client.remove(b"m3"),
        ]
        for call in calls:
            wait_until(all_closed, 10, "the daemon to idle-close the client's connections")
            assert call()
        wait_until(all_closed, 10, "the next idle close")
        lease = client.open_read(b"big")
        try:
            assert bytes(lease.view) == big
        finally:
            lease.release()
        # The read reporter: its connection was closed too; a report reconnects.
        with grpc.insecure_channel(d.grpc_address) as channel:
            stub = pb_grpc.StoreStub(channel)

            def dram_hits() -> int:
                stats = stub.Stats(pb.StatsRequest(), timeout=10)  # type: ignore[no-untyped-call]
                return next(int(t.hits) for t in stats.tiers if t.tier == pb.TIER_DRAM)

            client.get_into(b"small", bytearray(100))  # lease-free: its report starts the reporter
            client.flush_reads()
            wait_until(all_closed, 10, "the reporter's idle close")
            hits = dram_hits()
            out = bytearray(100)
            assert client.get_into(b"small", out) == 100 and bytes(out) == b"s" * 100
            client.flush_reads()
            assert dram_hits() == hits + 1, "the report after the idle close was lost"
    finally:
        client.close()
        d.stop()

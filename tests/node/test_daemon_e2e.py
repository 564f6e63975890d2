"""A real daemon process served to clients in this and other processes: shared memory and TCP
data planes, the gRPC service, faults from clients, events, metrics and the admin CLI."""

from __future__ import annotations

import json
import socket
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.frames import HEADER_BYTES, Opcode, pack_header
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.errors import (
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    PeerUnavailable,
    ProtocolError,
    SizeMismatch,
)
from tests.support.daemon import DaemonProcess, kvtier, kvtier_here, run_python

KiB, MiB = 1 << 10, 1 << 20


def value(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("daemon"), "node-e2e", dram_bytes="48MiB",
                      settings={"metrics.enabled": "true", "metrics.port": "0",
                                "server.max_value_bytes": "16MiB",
                                "server.inline_max_bytes": "64KiB",
                                "events.ring_capacity": "64"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def shm(daemon: DaemonProcess) -> Iterator[StoreClient]:
    client = StoreClient.connect(daemon.grpc_address,
                                 StoreClientConfig(data_plane=DataPlane.SHM))
    yield client
    client.close()


@pytest.fixture(scope="module")
def tcp(daemon: DaemonProcess) -> Iterator[StoreClient]:
    client = StoreClient.connect(daemon.grpc_address,
                                 StoreClientConfig(data_plane=DataPlane.TCP))
    yield client
    client.close()


def test_auto_picks_shared_memory_on_the_same_host(daemon: DaemonProcess) -> None:
    with StoreClient.connect(daemon.grpc_address) as client:
        assert client.data_plane is DataPlane.SHM
        assert client.info.node_id == "node-e2e"
        assert client.info.shm_arena == daemon.addresses["shm_arena"]


@pytest.mark.parametrize("size", [1, 4 * KiB, 3 * MiB + 7])
def test_put_and_get_through_shm_and_tcp_cross_over(shm: StoreClient, tcp: StoreClient,
                                                     size: int) -> None:
    a, b = value(size, size), value(size + 1, size)
    shm.put(b"x-shm-%d" % size, a)
    tcp.put(b"x-tcp-%d" % size, b)
    for client in (shm, tcp):
        out = np.empty(size, np.uint8)
        assert client.get_into(b"x-shm-%d" % size, out) == size
        assert np.array_equal(out, a)
        assert client.get_into(b"x-tcp-%d" % size, out) == size
        assert np.array_equal(out, b)
    assert bytes(shm.get(b"x-tcp-%d" % size)) == b.tobytes()


def test_a_client_in_another_process_reads_what_this_one_wrote(daemon: DaemonProcess,
                                                               shm: StoreClient) -> None:
    data = value(7, 256 * KiB)
    shm.put(b"other-proc", data)
    result = run_python(textwrap.dedent(f"""
        import hashlib, numpy as np
        from kvstore.client import StoreClient
        c = StoreClient.connect({daemon.grpc_address!r})
        out = np.empty({data.size}, np.uint8)
        c.get_into(b"other-proc", out)
        c.put(b"from-other-proc", out[:1000], parent=b"other-proc")
        print(c.data_plane.value, hashlib.sha256(out).hexdigest())
        c.close()
    """))
    plane, digest = result.stdout.split()
    assert plane == "shm"
    import hashlib

    assert digest == hashlib.sha256(data).hexdigest()
    assert shm.inspect(b"from-other-proc").parent == b"other-proc"


def test_lookup_returns_the_longest_cached_prefix_with_tiers(shm: StoreClient,
                                                             tcp: StoreClient) -> None:
    keys = [b"chain-%d" % i for i in range(4)]
    shm.put(keys[0], value(0, 8 * KiB))
    tcp.put(keys[1], value(1, 8 * KiB), parent=keys[0])  # inline gRPC (small, with a parent)
    tcp.put(keys[2], value(2, 128 * KiB), parent=keys[1])  # SetParents + TCP
    match = shm.lookup(keys)
    assert match.length == 3
    assert match.tiers == (TierKind.DRAM,) * 3
    assert tcp.lookup([b"nope", *keys]).length == 0
    assert shm.inspect(keys[2]).parent == keys[1]
    assert shm.inspect(keys[2]).depth == 2
    with pytest.raises(InvalidArgument, match="not cached"):
        shm.put(b"orphan", value(3, 100), parent=b"missing-parent")
    dsts = [np.empty(8 * KiB, np.uint8), np.empty(8 * KiB, np.uint8),
            np.empty(128 * KiB, np.uint8), np.empty(10, np.uint8)]
    for client in (shm, tcp):
        assert client.load_prefix(keys, dsts) == 3
        assert np.array_equal(dsts[2], value(2, 128 * KiB))


def test_unknown_keys_and_existing_keys(shm: StoreClient, tcp: StoreClient) -> None:
    for client in (shm, tcp):
        with pytest.raises(ChunkNotFound):
            client.get_into(b"never-stored", bytearray(10))
        assert client.exists(b"never-stored") is False
        assert client.sizes([b"never-stored"]) == [None]
        assert client.remove(b"never-stored") == []
        with pytest.raises(ChunkNotFound):
            client.inspect(b"never-stored")
    shm.put(b"once", b"abc")
    with pytest.raises(ChunkExists):
        shm.put(b"once", b"abc")
    with pytest.raises(ChunkExists):
        tcp.put(b"once", b"abc")


def test_wrong_sizes_are_refused_before_any_byte_moves(shm: StoreClient,
                                                       tcp: StoreClient) -> None:
    shm.put(b"sized", value(5, 4096))
    for client in (shm, tcp):
        dst = bytearray(b"\xee" * 4000)
        with pytest.raises(SizeMismatch):
            client.get_into(b"sized", dst)
        assert dst == b"\xee" * 4000
    import grpc

    from kvstore._proto.kvtier.v1 import store_pb2 as pb

    with pytest.raises(grpc.RpcError) as caught:  # the raw service refuses a big inline value
        tcp.stub().Put(pb.PutRequest(key=b"too-big-inline", value=bytes(65 * KiB)))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert ("kvtier-error", "InvalidArgument") in caught.value.trailing_metadata()  # type: ignore[attr-defined]
    tcp.put(b"big-with-parent", value(1, 65 * KiB), parent=b"sized")  # the client uses TCP
    assert tcp.inspect(b"big-with-parent").parent == b"sized"
    with pytest.raises(InvalidArgument):
        shm.put(b"empty", b"")
    with pytest.raises(InvalidArgument):
        shm.put(b"k" * 65, b"x")


def test_oversized_and_truncated_frames_leave_the_daemon_serving(daemon: DaemonProcess,
                                                                 tcp: StoreClient) -> None:
    host, port = daemon.addresses["tcp_address"].rsplit(":", 1)
    raw = TcpClient(host, int(port), connections=1)
    try:
        with pytest.raises(ProtocolError, match="exceeds"):  # over server.max_value_bytes
            raw.put(b"oversized", np.zeros(17 * MiB, np.uint8))
    finally:
        raw.close()
    # A PUT header announcing 1 MiB, then half of it, then the connection drops.
    header = bytearray(HEADER_BYTES)
    pack_header(header, Opcode.PUT, request_id=1, key_len=9, length=MiB, total_size=MiB,
                payload_len=MiB)
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(bytes(header) + b"truncated" + bytes(MiB // 2))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and tcp.stats().tcp_connections_open > 1:
        time.sleep(0.05)
    assert not tcp.exists(b"oversized")
    assert not tcp.exists(b"truncated")
    tcp.put(b"truncated", value(9, MiB))  # the key is free and the daemon still serves
    assert tcp.exists(b"truncated")


def _dram_used(client: StoreClient) -> int:
    return next(t.used_bytes for t in client.stats().tiers if t.tier == 2)


def test_a_writer_killed_mid_put_leaves_nothing_visible(daemon: DaemonProcess,
                                                        shm: StoreClient) -> None:
    used_before = _dram_used(shm)
    run_python(textwrap.dedent(f"""
        import os, signal
        from kvstore.client.store_client import StoreClient
        from kvstore.dataplane.arena import ArenaAccess, ShmArena
        from kvstore.dataplane.transport.shm import LeaseChannel
        from kvstore.dataplane.transport.shm.frames import ChannelOp
        c = StoreClient.connect({daemon.grpc_address!r})
        chan = LeaseChannel(c.info.shm_socket)
        lease, ranges = chan.call(ChannelOp.RESERVE, keys=[b"half-written", b""], arg=1 << 20)
        arena = ShmArena.attach(c.info.shm_arena, access=ArenaAccess.READ_WRITE)
        arena.view(ranges[0][0], 1 << 19, readonly=False)[:] = b"\\x01" * (1 << 19)
        os.kill(os.getpid(), signal.SIGKILL)
    """), check=False)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _dram_used(shm) != used_before:
        time.sleep(0.05)
    assert _dram_used(shm) == used_before
    assert not shm.exists(b"half-written")
    assert shm.stats().shm_leases_open == 0
    shm.put(b"half-written", value(4, MiB))  # the key was never taken
    out = np.empty(MiB, np.uint8)
    shm.get_into(b"half-written", out)
    assert np.array_equal(out, value(4, MiB))


def test_a_reader_killed_mid_get_releases_its_pin(daemon: DaemonProcess,
                                                  shm: StoreClient) -> None:
    shm.put(b"read-then-die", value(8, 64 * KiB))
    proc_code = textwrap.dedent(f"""
        import os, signal, sys
        from kvstore.client.store_client import StoreClient
        from kvstore.dataplane.transport.shm import LeaseChannel
        from kvstore.dataplane.transport.shm.frames import ChannelOp
        c = StoreClient.connect({daemon.grpc_address!r})
        chan = LeaseChannel(c.info.shm_socket)
        chan.call(ChannelOp.ACQUIRE_READ, keys=[b"read-then-die"])
        print("ACQUIRED", flush=True)
        sys.stdin.read()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    import subprocess
    import sys

    from tests.support.daemon import REPO

    proc = subprocess.Popen([sys.executable, "-c", proc_code], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ACQUIRED"
        with pytest.raises(ChunkBusy):
            shm.remove(b"read-then-die")
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while True:
        try:
            assert shm.remove(b"read-then-die") == [b"read-then-die"]
            break
        except ChunkBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_events_replay_from_a_seq_and_resync_after_a_gap(shm: StoreClient) -> None:
    epoch, seq, entries = shm.snapshot()
    assert seq >= 1 and len(entries) >= 1
    keys = [b"ev-%d" % i for i in range(5)]
    for i, k in enumerate(keys):
        shm.put(k, value(i, 1000), parent=keys[i - 1] if i else None)
    events = list(shm.subscribe(from_seq=seq, epoch=epoch, timeout_s=2))
    stored = [(e.seq, e.key) for e in events if e.kind == 1]
    assert stored == [(seq + 1 + i, k) for i, k in enumerate(keys)]
    assert events[1].parent == keys[0] and events[1].epoch == epoch
    shm.remove(keys[3])  # and keys[4]
    after = list(shm.subscribe(from_seq=seq + 5, epoch=epoch, timeout_s=1))
    assert [(e.kind, e.key) for e in after] == [(2, keys[4]), (2, keys[3])]
    # The ring holds 64 events: fall further behind than that and the server says RESYNC.
    for i in range(70):
        shm.put(b"filler-%d" % i, b"f")
    gap = list(shm.subscribe(from_seq=seq, epoch=epoch, timeout_s=2))
    assert len(gap) == 1 and gap[0].kind == 4
    stale = list(shm.subscribe(from_seq=1, epoch="an-old-epoch", timeout_s=2))
    assert [e.kind for e in stale] == [4]
    epoch2, seq2, entries2 = shm.snapshot()
    assert epoch2 == epoch and seq2 >= seq + 77
    have = {e.key for e in entries2}
    assert set(keys[:3]) <= have and not {keys[3], keys[4]} & have
    assert b"filler-69" in have


def test_a_subscriber_sees_new_events_as_they_happen(shm: StoreClient) -> None:
    _, seq, _ = shm.snapshot()
    stream = shm.subscribe(from_seq=seq, timeout_s=10)
    import threading

    threading.Timer(0.3, shm.put, args=(b"live-event", b"z")).start()
    first = next(stream)
    assert first.key == b"live-event" and first.seq == seq + 1
    stream.close()


def test_metrics_endpoint_serves_real_numbers(daemon: DaemonProcess, shm: StoreClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    shm.put(b"metered", value(11, 100 * KiB))
    out = np.empty(100 * KiB, np.uint8)
    for _ in range(3):
        shm.get_into(b"metered", out)
    with pytest.raises(ChunkNotFound):
        shm.get_into(b"not-metered", out)
    url = f"http://{daemon.addresses['metrics_address']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    stats = shm.stats()
    dram = next(t for t in stats.tiers if t.tier == 2)
    assert samples[("kvtier_tier_used_bytes", (("tier", "dram"),))] > 100 * KiB
    assert samples[("kvtier_tier_capacity_bytes", (("tier", "dram"),))] == 48 * MiB
    assert samples[("kvtier_hits_total", (("tier", "dram"),))] >= 3
    assert samples[("kvtier_misses_total", ())] >= 1
    assert samples[("kvtier_bytes_moved_total", (("direction", "read"), ("path", "shm")))] \
        >= 3 * 100 * KiB
    assert samples[("kvtier_tier_chunks", (("tier", "dram"),))] == dram.chunks
    assert samples[("kvtier_events_last_seq", ())] >= 1
    assert samples[("kvtier_rpc_seconds_count", (("code", "OK"), ("method", "Stats")))] >= 1


def test_admin_cli_against_a_live_daemon(daemon: DaemonProcess, shm: StoreClient) -> None:
    addr = daemon.grpc_address
    shm.put(b"\xc1\x01", value(1, 2048))
    shm.put(b"\xc1\x02", value(2, 2048), parent=b"\xc1\x01")
    shm.put(b"\xc1\x03", value(3, 2048))

    # Every command in this process: an interpreter per command cost about 20 s in all.
    def run(*args: str) -> object:
        result = kvtier_here(*args, "--address", addr, "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    stats = run("stats")
    assert isinstance(stats, dict) and stats["node_id"] == "node-e2e"
    assert {t["tier"] for t in stats["tiers"]} == {"dram", "nvme"}
    listing = run("ls", "--prefix", "c1")
    assert isinstance(listing, dict)
    assert [e["key"] for e in listing["entries"]] == ["c101", "c102", "c103"]
    info = run("inspect", "c102")
    assert isinstance(info, dict) and info["parent"] == "c101" and info["size_bytes"] == 2048
    lease = run("pin", "c103", "--ttl", "30")
    assert isinstance(lease, dict)
    assert run("inspect", "c103")["pinned"] is True  # type: ignore[index]
    evicted = run("evict", "--prefix", "c1")
    assert evicted == {"freed_bytes": 4096, "removed_chunks": 2, "busy_chunks": 1}
    assert run("unpin", str(lease["lease_id"])) == {"released": True}
    assert run("unpin", str(lease["lease_id"])) == {"released": False}
    assert run("evict", "--prefix", "c1")["removed_chunks"] == 1  # type: ignore[index]
    demoted = run("evict", "--tier", "dram", "--bytes", "4096")
    assert isinstance(demoted, dict) and demoted["freed_bytes"] >= 4096
    table = kvtier_here("stats", "--address", addr)
    assert table.returncode == 0 and "dram" in table.stdout and "node-e2e" in table.stdout
    bad = kvtier_here("inspect", "zz", "--address", addr)
    assert bad.returncode == 2
    missing = kvtier_here("inspect", "abcdef", "--address", addr)
    assert missing.returncode == 1 and "ChunkNotFound" in missing.stderr


def test_an_unreachable_daemon_is_peer_unavailable(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PeerUnavailable):
        StoreClient.connect(f"127.0.0.1:{port}", StoreClientConfig(rpc_timeout_s=1.0))
    result = kvtier("stats", "--address", f"127.0.0.1:{port}")
    assert result.returncode == 1 and "PeerUnavailable" in result.stderr


def test_health_checking_and_reflection_are_served(daemon: DaemonProcess) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(daemon.grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvtier.v1.Store"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(iter(stub.ServerReflectionInfo(iter([request]), timeout=10)))
        names = {s.name for s in reply.list_services_response.service}
        assert {"kvtier.v1.Store", "grpc.health.v1.Health"} <= names


def test_a_zero_copy_view_holds_a_lease_until_the_block_ends(shm: StoreClient,
                                                             tcp: StoreClient) -> None:
    data = value(21, 200 * KiB)
    shm.put(b"viewed", data)
    with shm.read_view(b"viewed") as view:
        assert view.readonly and view.nbytes == data.size
        assert np.array_equal(np.frombuffer(view, np.uint8), data)
        with pytest.raises(ChunkBusy):
            tcp.remove(b"viewed")
    assert shm.remove(b"viewed") == [b"viewed"]
    with pytest.raises(ChunkNotFound), shm.read_view(b"viewed"):
        pass
    from kvstore.errors import TierUnavailable

    with pytest.raises(TierUnavailable), tcp.read_view(b"viewed"):
        pass


def test_grpc_shared_memory_lease_calls(daemon: DaemonProcess, shm: StoreClient) -> None:
    import grpc

    from kvstore._proto.kvtier.v1 import store_pb2 as pb
    from kvstore.dataplane.arena import ArenaAccess, ShmArena

    stub = shm.stub()
    arena = ShmArena.attach(daemon.addresses["shm_arena"], access=ArenaAccess.READ_WRITE)
    try:
        data = value(31, 300 * KiB)
        res = stub.Reserve(pb.ReserveRequest(key=b"grpc-lease", size_bytes=data.size, ttl_s=30))
        arena.view(res.offset, data.size, readonly=False)[:] = data.tobytes()
        assert not shm.exists(b"grpc-lease")
        assert stub.Commit(pb.CommitRequest(lease_id=res.lease_id)).tier == pb.TIER_DRAM
        acq = stub.AcquireRead(pb.AcquireReadRequest(keys=[b"grpc-lease", b"nope"],
                                                     prefix=True))
        assert len(acq.chunks) == 1 and acq.chunks[0].size_bytes == data.size
        got = np.frombuffer(arena.view(acq.chunks[0].offset, data.size), np.uint8)
        assert np.array_equal(got, data)
        with pytest.raises(ChunkBusy):
            shm.remove(b"grpc-lease")
        assert stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id)).released
        assert not stub.Release(pb.ReleaseRequest(lease_id=acq.lease_id)).released
        # An uncommitted reservation is aborted by the reaper after its TTL.
        short = stub.Reserve(pb.ReserveRequest(key=b"grpc-expire", size_bytes=4096, ttl_s=0.2))
        time.sleep(1.5)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Commit(pb.CommitRequest(lease_id=short.lease_id))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert not shm.exists(b"grpc-expire")
        aborted = stub.Reserve(pb.ReserveRequest(key=b"grpc-abort", size_bytes=4096))
        assert stub.Abort(pb.AbortRequest(lease_id=aborted.lease_id)).aborted
        assert not shm.exists(b"grpc-abort")
    finally:
        arena.close()


def test_batch_calls(shm: StoreClient) -> None:
    from kvstore._proto.kvtier.v1 import store_pb2 as pb

    stub = shm.stub()
    put = stub.BatchPut(pb.BatchPutRequest(items=[
        pb.PutRequest(key=b"b0", value=b"zero"),
        pb.PutRequest(key=b"b1", parent=b"b0", value=b"one"),
        pb.PutRequest(key=b"b2", parent=b"missing", value=b"two"),
        pb.PutRequest(key=b"b0", value=b"again")]))
    assert [(i.ok, i.error) for i in put.items] == [
        (True, ""), (True, ""), (False, "InvalidArgument"), (False, "ChunkExists")]
    got = stub.BatchGet(pb.BatchGetRequest(keys=[b"b0", b"b1", b"b2"]))
    assert [(i.found, i.value) for i in got.items] == [(True, b"zero"), (True, b"one"),
                                                       (False, b"")]
    looked = stub.BatchLookup(pb.BatchLookupRequest(items=[
        pb.LookupRequest(keys=[b"b0", b"b1"]), pb.LookupRequest(keys=[b"zz", b"b1"])]))
    assert [i.length for i in looked.items] == [2, 0]
    assert dict(looked.items[0].per_tier) == {"dram": 2}
    pins = stub.BatchPin(pb.BatchPinRequest(items=[pb.PinRequest(keys=[b"b1"])]))
    with pytest.raises(ChunkBusy):
        shm.remove(b"b0")
    assert list(stub.BatchUnpin(pb.BatchUnpinRequest(
        lease_ids=[pins.items[0].lease_id, 12345])).released) == [True, False]
    removed = stub.BatchRemove(pb.BatchRemoveRequest(keys=[b"b0", b"b0"]))
    assert [(r.found, list(r.removed)) for r in removed.items] == [
        (True, [b"b1", b"b0"]), (False, [])]

"""Arenas per tenant group (``dram.arena_groups``, issue 15) against a real daemon process with
token security: alice's tenant group has an arena and a lease channel of its own, bob's another.

What is shown: each engine is told (Info) its own group's arena, read index and lease channel;
the segments carry their group's gid and mode; alice's chunks lie in her group's arena only and
read back byte for byte; a process of bob's uid (65534, a real child process) cannot open
alice's arena or read index (EACCES), is refused by alice's lease channel (SO_PEERCRED), and
through its own channel with its own ticket gets no lease on alice's chunk; a ticket of one
group is refused on the other group's channel (the daemon: "not in this arena's group"). Each
refusal is paired with the same operation succeeding for the right identity. docs/dram-arena.md,
"Arenas per tenant group"; docs/security.md, "Same host".
"""

from __future__ import annotations

import os
import stat
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.store_client import StoreClient
from kvstore.client.store_config import DataPlane
from kvstore.dataplane.arena import SHM_DIR, ArenaAccess, ShmArena
from kvstore.dataplane.transport.shm import ShmClient
from kvstore.dataplane.transport.shm.channel import LeaseChannel
from kvstore.dataplane.transport.shm.frames import ChannelOp
from kvstore.errors import CapacityError, ChunkNotFound, PermissionDenied
from tests.security.secured_daemon import SecuredDaemon, start_secured_daemon
from tests.security.test_samehost import NOBODY, as_nobody

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to run a child as uid 65534")

GID_A = 4242
"""Alice's group's gid: one uid 65534 is not in."""
GROUPS = (f"team-a:tenants=alice;group={GID_A};capacity=8MiB,"
          f"team-b:tenants=bob;group={NOBODY};users={NOBODY};capacity=8MiB")

ALICE = {bytes([0xA1]) * 8 + i.to_bytes(8, "big"): os.urandom(size)
         for i, size in enumerate((4096, 64 << 10, 300 << 10))}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    w = start_secured_daemon(tmp_path_factory.mktemp("arena-groups"), "arena-groups",
                             settings={"dram.arena_groups": GROUPS, "metrics.enabled": "true",
                                       "metrics.port": "0"})
    try:
        yield w
    finally:
        w.close()


@dataclass
class Tally:
    """The attempts of another group's engine (for bench/RESULTS.md, "Security and tenant
    isolation"): ``refused`` with an error, ``absent`` answered as if the chunk did not exist;
    ``lost``: chunks of alice that did not read back at the end."""

    attempts: int = 0
    refused: int = 0
    absent: int = 0
    lost: int = 0

    def count(self, refused: int = 0, absent: int = 0) -> None:
        self.attempts += refused + absent
        self.refused += refused
        self.absent += absent


TALLY = Tally()


def _info(world: SecuredDaemon, name: str) -> pb.NodeInfo:
    return world.control(name).info


@pytest.fixture(scope="module")
def alice(world: SecuredDaemon) -> StoreClient:
    c = world.client("alice", DataPlane.SHM)
    for key, value in ALICE.items():
        c.put(key, value)
    return c


def _alice_intact(alice: StoreClient) -> None:
    for key, value in ALICE.items():
        out = bytearray(len(value))
        assert alice.get_into(key, out) == len(value)
        assert out == value, f"{key.hex()} did not read back byte for byte"


def _hello(chan: LeaseChannel, ticket: bytes) -> None:
    chan.call(ChannelOp.HELLO, arg=len(ticket), payload=memoryview(ticket))


def test_each_engine_is_told_its_own_groups_arena_read_index_and_lease_channel(
        world: SecuredDaemon) -> None:
    a, b, default = _info(world, "alice"), _info(world, "bob"), _info(world, "op")
    assert len({a.shm_arena, b.shm_arena, default.shm_arena}) == 3
    assert len({a.shm_socket, b.shm_socket, default.shm_socket}) == 3
    assert len({a.shm_read_index, b.shm_read_index, default.shm_read_index}) == 3
    assert default.shm_arena == world.daemon.addresses["shm_arena"]
    modes = {}
    for info, gid in ((a, GID_A), (b, NOBODY), (default, 0)):
        arena = os.stat(os.path.join(SHM_DIR, info.shm_arena))
        index = os.stat(os.path.join(SHM_DIR, info.shm_read_index))
        modes[info.shm_arena] = stat.S_IMODE(arena.st_mode)
        assert arena.st_gid == index.st_gid == gid
        assert stat.S_IMODE(index.st_mode) == (0o640 if gid else 0o600)
    assert modes == {a.shm_arena: 0o660, b.shm_arena: 0o660, default.shm_arena: 0o600}
    # The tiers' capacities: the groups' 8 MiB each come out of the 32 MiB tier.
    assert a.tier_capacity_bytes["dram"] == 32 << 20


def test_alice_reads_back_byte_for_byte_and_her_chunks_lie_in_her_arena_only(
        world: SecuredDaemon, alice: StoreClient) -> None:
    assert isinstance(alice.plane, ShmClient)
    a, b, default = _info(world, "alice"), _info(world, "bob"), _info(world, "op")
    assert alice.plane.arena.name == a.shm_arena
    _alice_intact(alice)
    for name, expected in ((a.shm_arena, True), (b.shm_arena, False),
                           (default.shm_arena, False)):
        arena = ShmArena.attach(name, access=ArenaAccess.READ_ONLY)
        try:
            content = bytes(arena.view(0, arena.size_bytes))
        finally:
            arena.close()
        for key, value in ALICE.items():
            assert (content.find(value) >= 0) is expected, \
                f"alice's {key.hex()} {'missing from' if expected else 'found in'} {name}"


NOBODY_ATTEMPTS = """
import errno
from kvstore.errors import KvtierError
out = {}
for label, name in (("a_arena", a_arena), ("a_index", a_index), ("b_arena", b_arena)):
    try:
        os.close(os.open("/dev/shm/" + name, os.O_RDONLY))
        out[label] = "opened"
    except OSError as exc:
        out[label] = errno.errorcode[exc.errno]
try:
    ShmArena.attach(a_arena).close()
    out["attach_a"] = "mapped"
except KvtierError as exc:
    out["attach_a"] = type(exc).__name__
for label, address in (("a_channel", a_socket), ("b_channel", b_socket)):
    chan = LeaseChannel(address, io_timeout_s=10)
    try:
        chan.call(ChannelOp.HELLO, arg=len(bytes.fromhex(ticket)),
                  payload=memoryview(bytes.fromhex(ticket)))
        try:
            chan.call(ChannelOp.ACQUIRE_READ, keys=[bytes.fromhex(key)])
            out[label] = "leased"
        except KvtierError as exc:
            out[label] = "after hello: " + type(exc).__name__
        _lease, ranges = chan.call(ChannelOp.SIZE_OF, keys=[bytes.fromhex(key)])
        out[label + "_size"] = ranges[0][0]
        chan.call(ChannelOp.PUT, keys=[b"bob-own", b""], arg=3, payload=memoryview(b"bob"))
        lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[b"bob-own"])
        out[label + "_own"] = ranges[0][1]
    except KvtierError as exc:
        out[label] = type(exc).__name__ + ": " + str(exc)
    finally:
        chan.close()
# Bob's engine writes in place in its own arena: RESERVE, copy into the mapping, COMMIT.
from kvstore.dataplane.arena import ArenaAccess
payload = bytes(range(256)) * 256
arena = ShmArena.attach(b_arena, access=ArenaAccess.READ_WRITE)
chan = LeaseChannel(b_socket, io_timeout_s=10)
try:
    chan.call(ChannelOp.HELLO, arg=len(bytes.fromhex(ticket)),
              payload=memoryview(bytes.fromhex(ticket)))
    lease_id, ranges = chan.call(ChannelOp.RESERVE, keys=[b"bob-in-place", b""],
                                 arg=len(payload))
    offset = ranges[0][0]
    view = arena.view(offset, len(payload), readonly=False)
    view[:] = payload
    view.release()
    chan.call(ChannelOp.COMMIT, arg=lease_id)
    out["in_place"] = "committed"
except KvtierError as exc:
    out["in_place"] = type(exc).__name__ + ": " + str(exc)
finally:
    chan.close()
    arena.close()
return json.dumps(out)
"""


def test_bobs_engine_cannot_map_alices_arena_nor_lease_her_chunk(
        world: SecuredDaemon, alice: StoreClient) -> None:
    import json

    a, b = _info(world, "alice"), _info(world, "bob")
    key = next(iter(ALICE))
    ticket = world.ticket("bob").ticket
    out = json.loads(as_nobody(NOBODY_ATTEMPTS, a_arena=a.shm_arena, a_index=a.shm_read_index,
                               b_arena=b.shm_arena, a_socket=a.shm_socket,
                               b_socket=b.shm_socket, ticket=ticket.hex(), key=key.hex()))
    # The filesystem: alice's arena and read index do not open for uid 65534; bob's arena does.
    assert out["a_arena"] == out["a_index"] == "EACCES", out
    assert out["attach_a"] == "StorageError", out
    assert out["b_arena"] == "opened", out
    # Alice's lease channel refuses the peer before any frame (SO_PEERCRED).
    assert out["a_channel"].startswith("PermissionDenied:") and f"uid {NOBODY}" in \
        out["a_channel"], out
    # Bob's own channel serves bob (his own chunk, leased) but not alice's chunk.
    assert out["b_channel"] == "after hello: ChunkNotFound", out
    assert out["b_channel_size"] == 0, out
    assert out["b_channel_own"] == 3, out
    TALLY.count(refused=4, absent=2)  # two files, one attach, one channel; lease and size
    # What bob's engine wrote in place in its arena reads back for bob, from bob's arena.
    assert out["in_place"] == "committed", out
    bob = world.client("bob", DataPlane.SHM)
    payload = bytes(range(256)) * 256
    got = bytearray(len(payload))
    assert bob.get_into(b"bob-in-place", got) == len(payload) and got == payload
    arena = ShmArena.attach(b.shm_arena, access=ArenaAccess.READ_ONLY)
    try:
        assert bytes(arena.view(0, arena.size_bytes)).find(payload) >= 0
    finally:
        arena.close()
    _alice_intact(alice)


def test_a_ticket_of_one_group_is_refused_on_the_other_groups_lease_channel(
        world: SecuredDaemon, alice: StoreClient) -> None:
    a, b, default = _info(world, "alice"), _info(world, "bob"), _info(world, "op")
    refusals = 0
    for ticket_of, address in (("bob", a.shm_socket), ("alice", b.shm_socket),
                               ("alice", default.shm_socket), ("bob", default.shm_socket)):
        chan = LeaseChannel(address, io_timeout_s=10)
        try:
            with pytest.raises(PermissionDenied, match="not in this arena's group"):
                _hello(chan, world.ticket(ticket_of).ticket)
            refusals += 1
        finally:
            chan.close()
    assert refusals == 4
    TALLY.count(refused=refusals)
    # The same ticket on its own group's channel is served.
    chan = LeaseChannel(a.shm_socket, io_timeout_s=10)
    try:
        _hello(chan, world.ticket("alice").ticket)
        lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[next(iter(ALICE))])
        assert lease_id and ranges[0][1] == len(next(iter(ALICE.values())))
        # The daemon's Stats count the leases of every arena's table.
        stats = world.control("op").call("Stats", pb.StatsRequest())
        assert stats.shm_leases_open >= 1
        chan.call(ChannelOp.RELEASE, arg=lease_id)
    finally:
        chan.close()
    _alice_intact(alice)


def test_a_shared_chunk_in_the_default_arena_reads_back_for_a_group_engine(
        world: SecuredDaemon, alice: StoreClient) -> None:
    """The shared tenant lives in the default arena, which alice's group does not map: her
    lease channel refuses the lease (read it over TCP), and her client reads it over TCP,
    where the tenant check lets her read the shared tenant."""
    value = os.urandom(96 << 10)
    writer = world.client("sys", DataPlane.TCP, tenant="kvtier.shared")
    writer.put(b"shared-prompt", value)
    out = bytearray(len(value))
    assert alice.get_into(b"shared-prompt", out) == len(value) and out == value
    chan = LeaseChannel(_info(world, "alice").shm_socket, io_timeout_s=10)
    try:
        _hello(chan, world.ticket("alice").ticket)
        with pytest.raises(CapacityError, match="lies in another arena"):
            chan.call(ChannelOp.ACQUIRE_READ, keys=[b"shared-prompt"])
    finally:
        chan.close()
    _alice_intact(alice)


def test_alices_chunks_in_her_groups_arena_read_back_over_tcp_too(
        world: SecuredDaemon, alice: StoreClient) -> None:
    """The TCP data plane serves chunks of every arena (tenant-checked): alice's over TCP, and
    a TCP put of hers lands in her group's arena, where her shared-memory client reads it."""
    tcp = world.client("alice", DataPlane.TCP)
    for key, value in ALICE.items():
        out = bytearray(len(value))
        assert tcp.get_into(key, out) == len(value) and out == value
    value = os.urandom(200 << 10)
    tcp.put(b"alice-over-tcp", value)
    out = bytearray(len(value))
    assert alice.get_into(b"alice-over-tcp", out) == len(value) and out == value
    arena = ShmArena.attach(_info(world, "alice").shm_arena, access=ArenaAccess.READ_ONLY)
    try:
        assert bytes(arena.view(0, arena.size_bytes)).find(value) >= 0
    finally:
        arena.close()
    bob = world.client("bob", DataPlane.TCP)
    for key, value in ALICE.items():
        with pytest.raises(ChunkNotFound):
            bob.get_into(key, bytearray(len(value)))
        TALLY.count(absent=1)


def test_metrics_show_each_arenas_capacity_and_use(world: SecuredDaemon,
                                                  alice: StoreClient) -> None:
    url = f"http://{world.daemon.addresses['metrics_address']}/metrics"
    operator = {"Authorization": f"Bearer {world.tokens['op'].read_text().strip()}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=operator),
                                timeout=10) as reply:
        text = reply.read().decode()
    gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("kvtier_dram_arena_")}
    assert gauges['kvtier_dram_arena_capacity_bytes{arena="team-a"}'] == 8 << 20
    assert gauges['kvtier_dram_arena_capacity_bytes{arena="(default)"}'] == 16 << 20
    assert gauges['kvtier_dram_arena_used_bytes{arena="team-a"}'] >= sum(map(len, ALICE.values()))
    assert gauges['kvtier_dram_arena_chunks{arena="team-a"}'] >= len(ALICE)


def test_bob_over_the_shared_memory_plane_gets_none_of_alices_chunks(
        world: SecuredDaemon, alice: StoreClient) -> None:
    bob = world.client("bob", DataPlane.SHM)
    assert isinstance(bob.plane, ShmClient)
    assert bob.plane.arena.name == _info(world, "bob").shm_arena
    for key, value in ALICE.items():
        with pytest.raises(ChunkNotFound):
            bob.get_into(key, bytearray(len(value)))
        TALLY.count(absent=1)
    value = os.urandom(64 << 10)
    bob.put(b"bob-chunk-1", value)
    out = bytearray(len(value))
    assert bob.get_into(b"bob-chunk-1", out) == len(value) and out == value
    _alice_intact(alice)


def test_zz_the_tally(world: SecuredDaemon, alice: StoreClient,
                      capsys: pytest.CaptureFixture[str]) -> None:
    """Runs last (file order): alice's chunks read back byte for byte; the counts printed."""
    for key, value in ALICE.items():
        out = bytearray(len(value))
        if alice.get_into(key, out) != len(value) or out != value:
            TALLY.lost += 1
    line = (f"arena groups, same host: attempts={TALLY.attempts} refused={TALLY.attempts} "
            f"({TALLY.refused} with an error, {TALLY.absent} answered as absent) leaked=0 "
            f"lost={TALLY.lost}")
    with capsys.disabled():
        print("\n" + line)
    assert TALLY.attempts == TALLY.refused + TALLY.absent > 0 and TALLY.lost == 0

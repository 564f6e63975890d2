"""Same-host security: who may use the lease channel, map the arena, open the NVMe files, and
which addresses the UCX worker listens on (issue 15).

A process of another user is real here: the test runs a child interpreter as uid/gid 65534
(``nobody``; the tests run as root) that tries the real socket, shared-memory segment or file.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.dataplane.arena import ArenaAccess, ShmArena
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.auth import PeerAllowlist, PeerCredentials
from kvstore.dataplane.transport.shm import LeaseChannel, ShmServer
from kvstore.dataplane.transport.shm.frames import ChannelOp
from kvstore.dataplane.transport.ucx import net_devices_for, ucx_unavailable
from kvstore.errors import ConfigError, InvalidArgument, PermissionDenied
from kvstore.node.backend import ShmLeases
from kvstore.node.cache import TieredCache
from tests.support.common import REPO_ROOT

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root to run a child as uid 65534")


_PRELUDE = f"""\
import json, os, sys
from kvstore.dataplane.arena import ShmArena
from kvstore.dataplane.transport.shm import LeaseChannel
from kvstore.dataplane.transport.shm.frames import ChannelOp
os.setgroups([])
os.setgid({NOBODY})
os.setuid({NOBODY})
"""

_RUN = """
try:
    out = action(**json.loads(sys.argv[1]))
except BaseException as exc:  # reported to the parent, which asserts on it
    out = f"{type(exc).__name__}: {exc}"
sys.stdout.write(out)
"""


def as_nobody(body: str, **args: object) -> str:
    """Run ``body`` (a function body over ``args`` that returns a str) as uid/gid 65534 with no
    supplementary groups; return what it returned, or ``"<ExceptionClass>: message"`` for
    what it raised. In a fresh interpreter that imports what it needs and then drops to 65534
    itself (this machine's interpreter lives under a 0700 /root, so 65534 could not exec it),
    not in a fork of this process: a fork of a process running gRPC threads crashed now and
    then."""
    script = _PRELUDE + f"def action({', '.join(args)}):\n" \
        + textwrap.indent(textwrap.dedent(body).strip("\n"), "    ") + "\n" + _RUN
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(args)], cwd="/", env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, f"the uid-{NOBODY} child failed: {proc.stderr}"
    return proc.stdout


# --- the lease channel: SO_PEERCRED against an allowlist -------------------------------------


@pytest.fixture
def leasing() -> Iterator[tuple[TieredCache, ShmLeases]]:
    """Real leases over a real DRAM tier (shared memory) holding chunk ``k``."""
    cache = TieredCache({TierKind.DRAM: DramTier(4 << 20)})
    leases = ShmLeases(cache)
    leases.put(b"k", b"v" * 100)
    try:
        yield cache, leases
    finally:
        leases.close()
        cache.close()


TRY_CHANNEL = """
chan = LeaseChannel(address, io_timeout_s=5)
try:
    chan.call(ChannelOp.PUT, keys=[b"intruder", b""], arg=5, payload=memoryview(b"hello"))
    lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[b"k"])
    return f"served: lease {lease_id}, ranges {ranges}"
finally:
    chan.close()
"""


def test_the_lease_channel_refuses_another_uid_before_serving_any_frame(
        leasing: tuple[TieredCache, ShmLeases], caplog: pytest.LogCaptureFixture) -> None:
    _, leases = leasing
    srv = ShmServer(leases, lease_ttl_s=10)  # default allowlist: this process's uid only
    srv.start()
    try:
        outcome = as_nobody(TRY_CHANNEL, address=srv.address)
        assert outcome.startswith("PermissionDenied:"), outcome
        assert f"uid {NOBODY}" in outcome and f"uids {os.getuid()}" in outcome
        assert srv.denied == 1
        assert srv.requests == 0  # not one frame was served
        assert leases.size_of(b"intruder") is None
        assert "refusing pid" in caplog.text and f"uid {NOBODY}" in caplog.text
        # The same-uid client still works, on the same server.
        chan = LeaseChannel(srv.address, io_timeout_s=5)
        try:
            lease_id, ranges = chan.call(ChannelOp.ACQUIRE_READ, keys=[b"k"])
            assert lease_id and len(ranges) == 1 and ranges[0][1] == 100
            chan.call(ChannelOp.RELEASE, arg=lease_id)
        finally:
            chan.close()
    finally:
        srv.close()


def test_an_allowed_uid_or_gid_is_served(leasing: tuple[TieredCache, ShmLeases]) -> None:
    _, leases = leasing
    for allow in (PeerAllowlist.of(uids=[NOBODY]), PeerAllowlist.of(gids=[NOBODY])):
        srv = ShmServer(leases, lease_ttl_s=10, allowed_peers=allow)
        srv.start()
        try:
            outcome = as_nobody(TRY_CHANNEL, address=srv.address)
            assert outcome.startswith("served: lease"), outcome
            assert srv.denied == 0
        finally:
            srv.close()
        leases.remove(b"intruder")


def test_authorize_peer_hook_can_refuse_an_allowed_peer(
        leasing: tuple[TieredCache, ShmLeases]) -> None:
    _, leases = leasing
    seen: list[PeerCredentials] = []

    def only_pid_zero(peer: PeerCredentials) -> None:
        seen.append(peer)
        raise PermissionDenied(f"{peer} is not the engine this daemon serves")

    srv = ShmServer(leases, lease_ttl_s=10, authorize_peer=only_pid_zero)
    srv.start()
    try:
        chan = LeaseChannel(srv.address, io_timeout_s=5)
        try:
            with pytest.raises(PermissionDenied, match="is not the engine"):
                chan.call(ChannelOp.PING)
        finally:
            chan.close()
        assert seen and seen[0].pid == os.getpid() and seen[0].uid == os.getuid()
    finally:
        srv.close()


def test_peer_allowlist_rejects_bad_ids() -> None:
    with pytest.raises(InvalidArgument):
        PeerAllowlist(frozenset({-1}))
    with pytest.raises(InvalidArgument):
        PeerAllowlist(frozenset({True}))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        PeerAllowlist({0})  # type: ignore[arg-type]
    allow = PeerAllowlist.of(uids=[7], gids=[9], include_self=False)
    assert allow.allows(PeerCredentials(1, 7, 1)) and allow.allows(PeerCredentials(1, 1, 9))
    assert not allow.allows(PeerCredentials(1, os.getuid(), 1))


# --- the shared-memory arena -------------------------------------------------------------------


OPEN = """
os.close(os.open(path, flags))
return "opened"
"""
LIST = "return ','.join(sorted(os.listdir(path)))"


def test_an_arena_is_0600_and_another_uid_cannot_map_it() -> None:
    arena = ShmArena.create(1 << 20, prefault=False)
    try:
        path = f"/dev/shm/{arena.name}"
        assert os.stat(path).st_mode & 0o7777 == 0o600
        outcome = as_nobody(OPEN, path=path, flags=os.O_RDONLY)
        assert outcome.startswith("PermissionError:"), outcome

        attach = "ShmArena.attach(name).close()\nreturn 'mapped'"
        assert as_nobody(attach, name=arena.name).startswith("StorageError: cannot open"), \
            "attach must fail"
    finally:
        arena.close()


def test_the_dram_tier_and_its_read_index_are_0600() -> None:
    tier = DramTier(1 << 20, read_index_slots=64)
    try:
        names = [tier.arena_name, tier.read_index_name]
        for name in names:
            assert name and os.stat(f"/dev/shm/{name}").st_mode & 0o7777 == 0o600, name
    finally:
        tier.close()


@pytest.mark.parametrize(("access", "mode", "flags", "allowed"), [
    (ArenaAccess.READ_WRITE, 0o660, os.O_RDWR, True),
    (ArenaAccess.READ_ONLY, 0o640, os.O_RDONLY, True),
    (ArenaAccess.READ_ONLY, 0o640, os.O_RDWR, False),
])
def test_an_arena_given_to_a_group_opens_for_that_group_only(
        access: ArenaAccess, mode: int, flags: int, allowed: bool) -> None:
    arena = ShmArena.create(1 << 20, prefault=False, group=NOBODY, group_access=access)
    try:
        path = f"/dev/shm/{arena.name}"
        st = os.stat(path)
        assert (st.st_mode & 0o7777, st.st_gid) == (mode, NOBODY)
        outcome = as_nobody(OPEN, path=path, flags=flags)
        assert (outcome == "opened") is allowed, outcome
    finally:
        arena.close()
    with pytest.raises(InvalidArgument, match="gid"):
        ShmArena.create(1 << 20, prefault=False, group=-3)


# --- the NVMe tier's directory and files -------------------------------------------------------


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A directory every user may traverse (pytest's own temp root is 0700, which would hide
    the tier's files from uid 65534 whatever their modes)."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-samehost-", dir="/tmp"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _nvme(directory: Path, group: int | None = None) -> NvmeTier:
    return NvmeTier.open(NvmeTierConfig(directory=directory, capacity_bytes=8 << 20,
                                        segment_bytes=1 << 20, group=group))


def _modes(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o7777 for p in directory.iterdir()}


def test_nvme_directory_is_0700_and_another_uid_cannot_open_a_segment(
        open_parent: Path) -> None:
    directory = open_parent / "nvme"
    tier = _nvme(directory)
    try:
        tier.put(b"chunk-1", b"x" * 10000)
        assert directory.stat().st_mode & 0o7777 == 0o700
        segments = sorted(directory.glob("seg-*.kvt"))
        assert segments
        assert as_nobody(LIST, path=str(open_parent)) == "nvme"  # reachable
        outcome = as_nobody(OPEN, path=str(segments[0]), flags=os.O_RDONLY)
        assert outcome.startswith("PermissionError:"), outcome
        outcome = as_nobody(LIST, path=str(directory))
        assert outcome.startswith("PermissionError:"), outcome
    finally:
        tier.close()


def test_nvme_tier_tightens_an_existing_directory_and_files(tmp_path: Path) -> None:
    directory = tmp_path / "nvme"
    tier = _nvme(directory)
    tier.put(b"chunk-1", b"x" * 10000)
    tier.close()
    # As an older version left them: a 0755 directory, 0644 files.
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)
    tier = _nvme(directory)
    try:
        out = bytearray(10000)
        assert tier.get_into(b"chunk-1", out) == 10000 and out == b"x" * 10000
        assert directory.stat().st_mode & 0o7777 == 0o700
        for name, mode in _modes(directory).items():
            assert mode & 0o077 == 0, (name, oct(mode))
    finally:
        tier.close()


def test_nvme_tier_with_a_group_is_0750_and_the_group_may_read(open_parent: Path) -> None:
    directory = open_parent / "nvme"
    tier = _nvme(directory, group=NOBODY)
    try:
        tier.put(b"chunk-1", b"x" * 10000)
        st = directory.stat()
        assert (st.st_mode & 0o7777, st.st_gid) == (0o750, NOBODY)
        outcome = as_nobody(LIST, path=str(directory))
        assert "seg-" in outcome, outcome
    finally:
        tier.close()


def test_nvme_tier_refuses_a_world_writable_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ConfigError, match="world-writable"):
        _nvme(shared)
    with pytest.raises(ConfigError, match="gid"):
        NvmeTierConfig(directory=tmp_path / "x", capacity_bytes=8 << 20, group=-1)


# --- UCX: loopback stays loopback --------------------------------------------------------------


def test_net_devices_for_loopback_hosts() -> None:
    for host in ("127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost"):
        assert net_devices_for(host) == "lo", host
    for host in ("0.0.0.0", "::", "10.0.0.5", "gpu-05.example"):
        assert net_devices_for(host) is None, host


_LISTENERS = textwrap.dedent("""
    import os, subprocess, sys
    from kvstore.dataplane.transport.memory_backend import MemoryBackend
    from kvstore.dataplane.transport.ucx import UcxServer, UcxServerConfig
    srv = UcxServer(MemoryBackend(), UcxServerConfig(host=sys.argv[1]))
    srv.start()
    out = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=True).stdout
    mine = [line.split()[3] for line in out.splitlines() if f"pid={os.getpid()}," in line]
    srv.close()
    print("LISTEN", " ".join(mine))
""")


def _ucx_listeners(host: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", _LISTENERS, host], capture_output=True,
                          text=True, timeout=120, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("LISTEN"))
    return line.split()[1:]


def _non_loopback_ipv4() -> str | None:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                         capture_output=True, text=True).stdout
    for line in out.split("\n"):
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


@pytest.mark.skipif(ucx_unavailable() is not None, reason=f"ucxx: {ucx_unavailable()}")
def test_a_loopback_ucx_server_listens_on_loopback_only() -> None:
    """A UCX worker's tcp transport listens on every network device's address unless told
    otherwise; a server for 127.0.0.1 must not listen on the host's external address."""
    if _non_loopback_ipv4() is None:
        pytest.skip("no non-loopback IPv4 address here: nothing to leak onto")
    listeners = _ucx_listeners("127.0.0.1")
    assert listeners, "expected UCX's loopback tcp listener"
    assert all(addr.startswith(("127.", "[::1]")) for addr in listeners), listeners
    # And the wildcard keeps UCX's default: every device (the external address too).
    external = _non_loopback_ipv4()
    assert any(addr.startswith(f"{external}:") for addr in _ucx_listeners("0.0.0.0"))


def test_lease_channel_is_abstract_so_no_file_mode_applies() -> None:
    """Documents why the lease channel's guard is SO_PEERCRED, not a file mode: an abstract
    Unix socket has no inode, so nothing on disk to chmod (the server's docstring)."""
    srv = ShmServer(_NoLeasesStub(), lease_ttl_s=10)  # type: ignore[arg-type]
    srv.start()
    try:
        assert srv.address.startswith("@")
        assert not os.path.exists(srv.address[1:])
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect("\0" + srv.address[1:])
        probe.close()
    finally:
        srv.close()


class _NoLeasesStub:
    def drop_owner(self, owner: object) -> tuple[int, int]:
        return 0, 0

    def open_count(self) -> tuple[int, int]:
        return 0, 0

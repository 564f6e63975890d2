"""The local etcd launcher against the real binary: start, restart, pause, kill, clean-up."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from kvstore.errors import InvalidArgument, MembershipError
from kvstore.membership.etcd import etcd_client
from kvstore.membership.launcher import LocalEtcd
from tests.support.etcd import require_etcd


async def _put(url: str, key: bytes, value: bytes) -> None:
    async with etcd_client(url, rpc_timeout_s=5.0) as client:
        await client.put(key, value)


async def _get(url: str, key: bytes) -> bytes | None:
    async with etcd_client(url, rpc_timeout_s=5.0) as client:
        result = await client.get(key)
        return None if result is None else bytes(result.value)


def test_constructor_has_no_side_effects(tmp_path: Path) -> None:
    work_dir = tmp_path / "never-created"
    server = LocalEtcd(work_dir=work_dir)
    assert not work_dir.exists()
    assert not server.running and server.pid is None
    assert server.stop() is None  # stopping a server never started is a no-op
    with pytest.raises(MembershipError, match="not been started"):
        _ = server.client_url
    with pytest.raises(InvalidArgument):
        LocalEtcd(name="a=b")


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = LocalEtcd(work_dir=tmp_path / "etcd", binary="/nonexistent/etcd")
    with pytest.raises(MembershipError, match="not found"):
        server.start()
    assert not server.running


def test_restart_keeps_ports_and_data_and_close_cleans_up(aio: asyncio.Runner) -> None:
    require_etcd()
    server = LocalEtcd()
    try:
        server.start()
        assert server.is_healthy()
        url, pid = server.client_url, server.pid
        work_dir = server.work_dir
        assert server.data_dir.is_dir() and server.log_path.is_file()
        aio.run(_put(url, b"/launcher/k", b"v1"))
        server.restart()  # SIGTERM, then start on the same ports and data directory
        assert server.client_url == url and server.pid != pid
        assert aio.run(_get(url, b"/launcher/k")) == b"v1"
        # A crash (SIGKILL) keeps the data too.
        assert server.kill() == -9
        assert not server.running and not server.is_healthy()
        server.start()
        assert aio.run(_get(url, b"/launcher/k")) == b"v1"
    finally:
        server.close()
    assert not server.running
    assert not work_dir.exists()  # the temporary work directory was ours to delete


def test_pause_makes_server_unresponsive_until_resumed(tmp_path: Path) -> None:
    require_etcd()
    with LocalEtcd(work_dir=tmp_path / "etcd") as server:
        server.pause()
        assert server.paused and server.running
        assert not server.is_healthy()
        with pytest.raises(MembershipError):
            server.wait_healthy(timeout_s=0.5)
        server.resume()
        server.wait_healthy(timeout_s=10)
        server.pause()
        # A paused server is continued first, so SIGTERM (not SIGKILL) ends it; etcd
        # re-raises SIGTERM after its clean shutdown.
        assert server.stop(timeout_s=5) == -signal.SIGTERM
    assert (tmp_path / "etcd" / "data").is_dir()  # a given work directory is kept


def test_two_servers_get_distinct_ports(tmp_path: Path) -> None:
    require_etcd()
    with (
        LocalEtcd(work_dir=tmp_path / "a") as first,
        LocalEtcd(work_dir=tmp_path / "b") as second,
    ):
        ports = {first.client_port, first.peer_port, second.client_port, second.peer_port}
        assert len(ports) == 4
        assert first.is_healthy() and second.is_healthy()

"""A StoreClient's TCP plane gives up on a stopped daemon after ``tcp_io_timeout_s`` (found by
the fault suite, docs/chaos.md: before, a request to a SIGSTOPped or partitioned daemon waited
for TcpClient's fixed 30 s, whatever the client was configured with, and stalled its caller
until the daemon came back)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.errors import InvalidArgument, PeerUnavailable
from tests.support.daemon import DaemonProcess

CONTINUE_AFTER_S = 15.0
"""The stopped daemon is continued by a timer after this long, so a get that ignored its
0.5 s timeout returns the chunk (and the test fails) instead of raising."""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path, "node-timeout", nvme=False)
    d.start()
    try:
        yield d
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_a_get_from_a_stopped_daemon_fails_within_the_tcp_timeout(
        daemon: DaemonProcess) -> None:
    cfg = StoreClientConfig(data_plane=DataPlane.TCP, tcp_io_timeout_s=0.5, tcp_connections=1)
    with StoreClient.connect(daemon.grpc_address, cfg) as client:
        client.put(b"k", b"v" * 4096)
        dst = bytearray(4096)
        assert client.get_into(b"k", dst) == 4096  # the connection is open and in use
        os.kill(daemon.pid, signal.SIGSTOP)
        wake = threading.Timer(CONTINUE_AFTER_S, os.kill, (daemon.pid, signal.SIGCONT))
        wake.start()
        try:
            with pytest.raises(PeerUnavailable):
                client.get_into(b"k", dst)
        finally:
            wake.cancel()
            os.kill(daemon.pid, signal.SIGCONT)
        assert client.get_into(b"k", dst) == 4096 and bytes(dst) == b"v" * 4096  # reconnects


def test_a_tcp_timeout_must_be_positive() -> None:
    with pytest.raises(InvalidArgument, match="tcp_io_timeout_s"):
        StoreClientConfig(tcp_io_timeout_s=0)

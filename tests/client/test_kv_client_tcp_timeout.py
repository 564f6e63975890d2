"""A KVClient's TCP plane is bounded by its own timeouts (found by the engines under the fault
suite, docs/chaos.md: the decode worker's load over TCP from a SIGSTOPped daemon waited out
TcpClient's 30 s default, whatever ``rpc_timeout_s`` said, because KVClientConfig passed no TCP
timeout to its StoreClients)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.errors import InvalidArgument, PeerUnavailable  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
CONTINUE_AFTER_S = 15.0
"""The stopped daemon is continued by a timer after this long, so a get that ignored its
0.5 s bound returns the chunk (and the test fails) instead of raising."""


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path, "node-kv-timeout", nvme=False)
    d.start()
    try:
        yield d
    finally:
        os.kill(d.pid, signal.SIGCONT)
        d.stop()


def test_a_tcp_request_to_a_stopped_daemon_fails_within_rpc_timeout(
        daemon: DaemonProcess) -> None:
    cfg = KVClientConfig(data_plane=DataPlane.TCP, remote_data_plane=DataPlane.TCP,
                         rpc_timeout_s=0.5)
    with KVClient.connect(daemon.grpc_address, LAYOUT, namespace_for(LAYOUT, "m", "t"),
                          cfg) as client:
        store = client.store  # another node's daemon is connected with the same settings
        store.put(b"k", b"v" * 4096)
        dst = bytearray(4096)
        assert store.get_into(b"k", dst) == 4096  # the TCP connection is open and in use
        os.kill(daemon.pid, signal.SIGSTOP)
        wake = threading.Timer(CONTINUE_AFTER_S, os.kill, (daemon.pid, signal.SIGCONT))
        wake.start()
        try:
            with pytest.raises(PeerUnavailable):
                store.get_into(b"k", dst)
        finally:
            wake.cancel()
            os.kill(daemon.pid, signal.SIGCONT)


def test_an_explicit_tcp_timeout_wins_and_must_be_positive() -> None:
    cfg = KVClientConfig(rpc_timeout_s=3.0, tcp_io_timeout_s=7.0)
    assert cfg.store_config(DataPlane.TCP).tcp_io_timeout_s == 7.0
    assert KVClientConfig(rpc_timeout_s=3.0).store_config(DataPlane.TCP).tcp_io_timeout_s == 3.0
    with pytest.raises(InvalidArgument, match="tcp_io_timeout_s"):
        KVClientConfig(tcp_io_timeout_s=0)

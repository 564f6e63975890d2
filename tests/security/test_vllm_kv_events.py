"""vLLM's KV event publisher authenticates nobody, so kvtier keeps it off the network and away
from other users (docs/security.md, "vLLM's KV events"; kvstore/membership/vllm_registration.py).

A ``tcp://`` endpoint to another host or a wildcard is refused without ``insecure`` (the
registration sidecar and ``kvtier vllm-register``), before anything is registered; loopback and
``ipc://`` pass. :func:`kv_events_endpoints` puts the sockets in a ``0700`` directory: a real ZMQ
publisher bound there under a umask of 0 (its socket file ``0777``) is out of reach of a real
process of another user (uid 65534), while the same socket one directory up is not (so the
directory is what keeps it out), and the owner connects (paired)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvstore.errors import ConfigError
from kvstore.membership.engines import EngineRecord, EngineRole, VllmKvEvents
from kvstore.membership.vllm_registration import (
    KV_EVENTS_DIR_NAME,
    check_kv_events_endpoint,
    hold_while_healthy,
    kv_events_endpoints,
)
from tests.security.test_samehost import as_nobody

NETWORK = ("tcp://10.0.0.5:5557", "tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557",
           "tcp://vllm-0.internal:5557", "tcp://eth0:5557")
LOCAL = ("tcp://127.0.0.1:5557", "tcp://127.8.9.1:5557", "tcp://[::1]:5557",
         "tcp://localhost:5557", "ipc:///nonexistent-dir/kv.sock")


@pytest.mark.parametrize("endpoint", NETWORK)
def test_a_network_endpoint_is_refused_without_insecure(
        endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(ConfigError, match=r"authenticates nobody.*--insecure"):
        check_kv_events_endpoint(endpoint)
    with caplog.at_level(logging.WARNING):
        check_kv_events_endpoint(endpoint, insecure=True)  # paired: the explicit opt-in
    assert "WITHOUT AUTHENTICATION" in caplog.text


@pytest.mark.parametrize("endpoint", LOCAL)
def test_loopback_and_ipc_endpoints_pass(endpoint: str) -> None:
    check_kv_events_endpoint(endpoint)


def test_the_sidecar_registers_nothing_for_a_network_endpoint() -> None:
    record = EngineRecord("vllm-0", EngineRole.PREFILL, "m", "node-a",
                          http_url="http://127.0.0.1:8000", vllm_kv_events=VllmKvEvents(
                              endpoint="tcp://10.0.0.5:5557", block_size_tokens=32))

    async def never() -> bool:
        raise AssertionError("the sidecar went on to the health check (and then to etcd)")

    with pytest.raises(ConfigError, match="vllm-0's KV event endpoint"):
        # Refused before the etcd client is touched, so none is needed.
        asyncio.run(hold_while_healthy(None, [record], never))  # type: ignore[arg-type]


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A directory every user may enter (0755), under /tmp (pytest's own are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="kvtier-kv-events-"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        for path in sorted(base.rglob("*"), reverse=True):
            path.unlink() if not path.is_dir() else path.rmdir()
        base.rmdir()


def test_kv_events_endpoints_makes_a_private_directory(open_base: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    endpoint, replay = kv_events_endpoints(open_base, "srv")
    where = open_base / KV_EVENTS_DIR_NAME
    assert endpoint == f"ipc://{where}/srv-kv.sock" and replay == f"ipc://{where}/srv-replay.sock"
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o700
    os.chmod(where, 0o777)  # loosened by someone: tightened again
    kv_events_endpoints(open_base, "srv", group=True)
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o750
    with caplog.at_level(logging.WARNING):
        check_kv_events_endpoint(endpoint)
        assert not caplog.text
        check_kv_events_endpoint(f"ipc://{open_base}/loose.sock")
    assert "is mode 0755" in caplog.text
    with pytest.raises(ConfigError, match="AF_UNIX"):
        kv_events_endpoints(open_base, "x" * 120)


TRY_CONNECT = """
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(path)
    return "connected"
finally:
    s.close()
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as uid 65534")
def test_another_user_cannot_reach_the_publisher_in_the_private_directory(
        open_base: Path) -> None:
    endpoint, _ = kv_events_endpoints(open_base, "srv")
    ctx = zmq.Context()
    old = os.umask(0)  # the worst case: the socket file itself lets everyone connect
    try:
        private, exposed = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
        private.bind(endpoint)
        exposed.bind(f"ipc://{open_base}/exposed.sock")  # the same, one directory up
    finally:
        os.umask(old)
    try:
        private_path = endpoint[len("ipc://"):]
        assert stat.S_IMODE(os.stat(private_path).st_mode) & 0o002
        refused = as_nobody(TRY_CONNECT, path=private_path)
        assert refused.startswith("PermissionError"), refused
        # Without the private directory another user connects: the directory keeps it out.
        assert as_nobody(TRY_CONNECT, path=str(open_base / "exposed.sock")) == "connected"
        # Paired: the engine's own user connects.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as own:
            own.connect(private_path)
    finally:
        private.close(linger=0)
        exposed.close(linger=0)
        ctx.term()

"""The isolation suite's UCX and ``/metrics`` cells (docs/security.md, "Data planes", "Same
host, data planes, metrics and etcd"), against real daemon processes.

* **UCX** checks no session ticket and carries no tenant, so a daemon with security serves no
  UCX plane at all: with ``server.ucx: auto`` it says so and publishes no worker address (a
  client can only use the ticketed planes), with ``required`` it does not start. Paired: the
  same machine's daemon without security serves UCX (``ucxx`` imports here).
* **``/metrics``** has no authentication: it binds loopback by default and exposes figures
  (per tier, per tenant), never a chunk's key or bytes: a scrape after tenants stored chunks
  holds none of their keys (hex) nor value bytes, and is paired with the per-tenant series
  being there (so the scrape is the real one).
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client.store_config import DataPlane
from kvstore.dataplane.transport.ucx import ucx_unavailable
from tests.security.secured_daemon import SecuredDaemon, start_secured_daemon
from tests.support.daemon import DaemonProcess

needs_ucx = pytest.mark.skipif(ucx_unavailable() is not None,
                               reason=f"ucxx: {ucx_unavailable()}")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    w = start_secured_daemon(tmp_path_factory.mktemp("ucx-metrics"), "ucx-metrics", shm=False,
                             settings={"server.ucx": "auto", "metrics.enabled": "true",
                                       "metrics.port": "0"})
    try:
        yield w
    finally:
        w.close()


@needs_ucx
def test_a_daemon_with_security_serves_no_ucx_plane(world: SecuredDaemon,
                                                    tmp_path: Path) -> None:
    alice = world.client("alice", DataPlane.TCP)
    assert alice.info.data_ticket_required and not alice.info.ucx_worker_address
    assert not world.daemon.addresses.get("ucx_address")
    assert "it checks no session ticket" in world.daemon.log_path.read_text()
    required = DaemonProcess(tmp_path, "ucx-required", nvme=False, settings={
        "security.token_keys": str(world.daemon.work_dir / "keys"),
        "server.ucx": "required"})
    with pytest.raises(RuntimeError, match="checks no session ticket"):
        required.start(timeout_s=30)
    # Paired: without security the same machine serves UCX.
    plain = DaemonProcess(tmp_path, "ucx-plain", nvme=False, settings={"server.ucx": "auto"})
    plain.start()
    try:
        assert plain.addresses.get("ucx_address")
    finally:
        plain.stop()


def test_metrics_bind_loopback_and_show_no_key_or_value(world: SecuredDaemon) -> None:
    address = str(world.daemon.addresses["metrics_address"])
    assert address.startswith("127.0.0.1:")
    values = {}
    for name in ("alice", "bob"):
        c = world.client(name, DataPlane.TCP)
        key, value = os.urandom(16), os.urandom(4096)
        c.put(key, value)
        values[key] = value
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read()
    assert b'kvtier_tenant_bytes_written_total{tenant="alice"}' in text  # the real scrape
    for key, value in values.items():
        assert key.hex().encode() not in text and key not in text
        assert value[:64] not in text

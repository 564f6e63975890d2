"""The isolation suite's UCX and ``/metrics`` cells (docs/security.md, "Data planes", "Same
host, data planes, metrics and etcd"), against real daemon processes.

* **UCX** serves a lane only after a HELLO with a session ticket, scoped to its tenant, as TCP
  does (the attacks: ``test_dataplane_ucx.py``): with ``server.ucx: required`` a daemon with
  security publishes its worker address, and a lane without a ticket is refused there; with
  ``auto`` (the default) it serves no UCX at all. Paired:
  the same client with its ticket moves a value.
* **``/metrics``** is behind the daemon's security (:mod:`kvstore.security.http`): with tokens
  a scrape without one is 401, an engine's is 403, an operator's is served; it binds loopback by
  default and exposes figures (per tier, per tenant), never a chunk's key or bytes: a scrape
  after tenants stored chunks holds none of their keys (hex) nor value bytes, and is paired with
  the per-tenant series being there (so the scrape is the real one). Without security a
  non-loopback ``metrics.host`` needs ``security.insecure``, as the gRPC port does.
"""

from __future__ import annotations

import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.client.store_config import DataPlane
from kvstore.dataplane.transport.ucx import UcxClient, ucx_unavailable
from kvstore.errors import Unauthenticated
from tests.security.pki import make_ca
from tests.security.secured_daemon import SecuredDaemon, start_secured_daemon
from tests.support.daemon import DaemonProcess

needs_ucx = pytest.mark.skipif(ucx_unavailable() is not None,
                               reason=f"ucxx: {ucx_unavailable()}")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    w = start_secured_daemon(tmp_path_factory.mktemp("ucx-metrics"), "ucx-metrics", shm=False,
                             settings={"server.ucx": "required", "metrics.enabled": "true",
                                       "metrics.port": "0"})
    try:
        yield w
    finally:
        w.close()


@needs_ucx
def test_a_daemon_with_security_serves_ucx_only_with_a_ticket(world: SecuredDaemon) -> None:
    alice = world.client("alice", DataPlane.UCX, ucx_min_bytes=0)
    assert alice.info.data_ticket_required and alice.info.ucx_worker_address
    address = bytes.fromhex(str(world.daemon.addresses["ucx_address"]))
    key, value = os.urandom(16), os.urandom(4096)
    with UcxClient(address, lanes=1) as anonymous, pytest.raises(Unauthenticated,
                                                                 match="no session ticket"):
        anonymous.put(key, value)
    assert not world.control("alice").exists(key)  # nothing stored
    alice.put(key, value)  # paired: with its ticket, over UCX
    assert bytes(alice.get(key)) == value


@needs_ucx
def test_a_daemon_with_security_and_ucx_auto_serves_no_ucx(tmp_path: Path) -> None:
    """Secure by default: a ticketed UCX lane is bound only by its unauthenticated 32-bit id,
    so under security UCX is served only when ``server.ucx: required`` asks for it. Paired:
    the same daemon serves its TCP plane."""
    w = start_secured_daemon(tmp_path, "ucx-auto", shm=False, settings={"server.ucx": "auto"})
    try:
        alice = w.client("alice", DataPlane.TCP)
        assert alice.info.data_ticket_required and not alice.info.ucx_worker_address
        assert not w.daemon.addresses.get("ucx_address")
        key, value = os.urandom(16), os.urandom(4096)
        alice.put(key, value)
        assert bytes(alice.get(key)) == value
    finally:
        w.close()


def test_metrics_bind_loopback_and_show_no_key_or_value(world: SecuredDaemon) -> None:
    address = str(world.daemon.addresses["metrics_address"])
    assert address.startswith("127.0.0.1:")
    values = {}
    for name in ("alice", "bob"):
        c = world.client(name, DataPlane.TCP)
        key, value = os.urandom(16), os.urandom(4096)
        c.put(key, value)
        values[key] = value
    url = f"http://{address}/metrics"
    for who, code in ((None, 401), ("alice", 403)):
        headers = {} if who is None else {
            "Authorization": f"Bearer {world.tokens[who].read_text().strip()}"}
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10)
        assert refused.value.code == code
        body = refused.value.read()
        assert b"kvtier_" not in body, body
    operator = {"Authorization": f"Bearer {world.tokens['op'].read_text().strip()}"}
    with urllib.request.urlopen(urllib.request.Request(url, headers=operator),
                                timeout=10) as reply:
        text = reply.read()
    assert b'kvtier_tenant_bytes_written_total{tenant="alice"}' in text  # the real scrape
    for key, value in values.items():
        assert key.hex().encode() not in text and key not in text
        assert value[:64] not in text


def test_metrics_on_a_public_address_need_security_or_insecure(tmp_path: Path) -> None:
    """The metrics port follows the gRPC port's binding rule: no security config and a
    non-loopback ``metrics.host`` is refused at start, naming the fix; with
    ``security.insecure`` the daemon starts (and warns)."""
    settings = {"metrics.enabled": "true", "metrics.port": "0", "metrics.host": "0.0.0.0"}
    refused = DaemonProcess(tmp_path, "metrics-public", nvme=False, settings=settings)
    with pytest.raises(RuntimeError, match="did not become ready"):
        refused.start(timeout_s=120)
    log = refused.log_path.read_text()
    assert "metrics endpoint would listen on '0.0.0.0' without authentication" in log, log
    allowed = DaemonProcess(tmp_path, "metrics-insecure", nvme=False,
                            settings={**settings, "security.insecure": "true",
                                      "server.host": "127.0.0.1"})
    allowed.start()
    try:
        port = str(allowed.addresses["metrics_address"]).rsplit(":", 1)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            assert b"kvtier_" in reply.read()
        assert "metrics endpoint listens on 0.0.0.0 WITHOUT AUTHENTICATION" in \
            allowed.log_path.read_text()
    finally:
        allowed.stop()


def test_metrics_over_mtls_need_an_operator_certificate(tmp_path: Path) -> None:
    """With mTLS the scrape is HTTPS with the daemon's certificate: no client certificate and
    the handshake is refused; an engine's certificate of the same CA is 403; an operator's is
    served (paired, the real scrape)."""
    ca = make_ca()
    ca_file = ca.write(tmp_path / "ca.crt")
    cert, key = ca.issue("daemon", uri="kvtier://peer/daemon").write(tmp_path, "daemon")
    daemon = DaemonProcess(tmp_path, "metrics-mtls", nvme=False, settings={
        "security.cert_file": str(cert), "security.key_file": str(key),
        "security.client_ca_file": str(ca_file), "server.shm_channel": "false",
        "metrics.enabled": "true", "metrics.port": "0"})
    daemon.start()
    try:
        url = f"https://{daemon.addresses['metrics_address']}/metrics"

        def scrape(leaf_name: str | None, uri: str = "") -> int:
            ctx = ssl.create_default_context(cafile=str(ca_file))
            if leaf_name is not None:
                ctx.load_cert_chain(*ca.issue(leaf_name, uri=uri).write(tmp_path, leaf_name))
            try:
                with urllib.request.urlopen(url, timeout=10, context=ctx) as reply:
                    assert b"kvtier_" in reply.read()
                    return int(reply.status)
            except urllib.error.HTTPError as exc:
                assert b"kvtier_" not in exc.read()
                return exc.code

        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            scrape(None)
        assert scrape("alice", "kvtier://engine/alice?tenants=alice") == 403
        assert scrape("ops", "kvtier://operator/ops") == 200
    finally:
        daemon.stop()

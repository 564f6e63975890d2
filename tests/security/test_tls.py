"""TLS on a real daemon: rotated certificate files are served to new connections without a
restart; a broken rotation keeps the previous certificate; bad server credentials fail the start."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from cryptography import x509

from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.security.pki import make_ca
from tests.support.daemon import DaemonProcess, kvtier


def _served_serial(address: str, ca_path: Path) -> int:
    host, _, port = address.rpartition(":")
    ctx = ssl.create_default_context(cafile=str(ca_path))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, int(port)), timeout=10) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_rotated_server_certificate_is_served_without_restart(tmp_path: Path) -> None:
    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    first = ca.issue("daemon", uri="kvtier://peer/daemon")
    cert, key = first.write(tmp_path, "server")
    generate_key(tmp_path / "keys", "k1")
    kid, signing = load_signing_key(tmp_path / "keys" / "k1.key")
    (tmp_path / "keys" / "k1.key").unlink()
    token = tmp_path / "op.token"
    token.write_text(mint(signing, kid, subject="op", role=Role.OPERATOR, tenants=None,
                          ttl_s=600))
    daemon = DaemonProcess(tmp_path, "tls", nvme=False, settings={
        "security.cert_file": str(cert), "security.key_file": str(key),
        "security.token_keys": str(tmp_path / "keys"), "server.shm_channel": "false"})
    daemon.start()
    try:
        address = f"127.0.0.1:{daemon.grpc_address.rpartition(':')[2]}"
        assert _served_serial(address, ca_path) == first.serial
        security = ClientSecurity(ca_file=ca_path, token_file=token)
        client = StoreClient.connect(address, StoreClientConfig(
            data_plane=DataPlane.TCP, security=security))
        try:
            second = ca.issue("daemon", uri="kvtier://peer/daemon")
            second.write(tmp_path, "server")  # replaced in place, as a secret mount does
            assert _served_serial(address, ca_path) == second.serial
            assert client.stats().node_id == "tls"  # the open connection keeps working
        finally:
            client.close()
        cert.write_text("-----BEGIN CERTIFICATE-----\nbroken\n")  # a half-written rotation
        assert _served_serial(address, ca_path) == second.serial
        assert "rotated certificate files not taken" in daemon.log_path.read_text()
        ok = kvtier("stats", "--json", "--address", address, "--ca", str(ca_path),
                    "--token-file", str(token))
        assert ok.returncode == 0, ok.stderr
    finally:
        daemon.stop()


def test_expired_server_certificate_fails_the_start(tmp_path: Path) -> None:
    ca = make_ca()
    ca.write(tmp_path / "ca.crt")
    cert, key = ca.issue("old", valid_from_s=-7200, valid_for_s=3600).write(tmp_path)
    result = kvtier("daemon", "--set", f"security.cert_file={cert}",
                    "--set", f"security.key_file={key}",
                    "--set", f"security.client_ca_file={tmp_path / 'ca.crt'}",
                    "--set", "dram.capacity_bytes=1MiB", "--set", "dram.prefault=false")
    assert result.returncode == 2 and "expired" in result.stderr, result.stderr

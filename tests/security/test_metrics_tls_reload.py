"""``/metrics`` over HTTPS takes rotated certificate files as the gRPC port does
(tests/security/test_tls.py), against a real daemon process and a real ``ssl`` client: a rotated
server certificate is presented from the next handshake, a half-written one is not taken (the
previous one is kept), a rotated client CA refuses the old CA's operator certificate in the
handshake and serves the new CA's, and a rotated CRL refuses a revoked operator certificate
(401 naming its serial) while a sibling it does not list is served (the CRL is the gRPC port's,
one list for the daemon)."""

from __future__ import annotations

import http.client
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from tests.security.pki import Ca, make_ca
from tests.support.daemon import DaemonProcess


def _replace(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (a new inode, as a secret mount's swap)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


class _Scraper:
    def __init__(self, address: str, server_ca: Path, tmp: Path) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port, self.server_ca, self.tmp = host, int(port), server_ca, tmp

    def operator(self, ca: Ca, name: str) -> tuple[Path, Path, int]:
        leaf = ca.issue(name, uri=f"kvtier://operator/{name}")
        cert, key = leaf.write(self.tmp, name)
        return cert, key, leaf.serial

    def scrape(self, client: tuple[Path, Path, int]) -> tuple[int, int, bytes]:
        """(status, the serial of the certificate the daemon presented, body)."""
        ctx = ssl.create_default_context(cafile=str(self.server_ca))
        ctx.load_cert_chain(client[0], client[1])
        conn = http.client.HTTPSConnection(self.host, self.port, timeout=10, context=ctx)
        try:
            conn.connect()
            assert isinstance(conn.sock, ssl.SSLSocket)
            der = conn.sock.getpeercert(binary_form=True)
            assert der is not None
            conn.request("GET", "/metrics")
            reply = conn.getresponse()
            return reply.status, x509.load_der_x509_certificate(der).serial_number, reply.read()
        finally:
            conn.close()


def test_metrics_https_serves_rotated_certificates_ca_and_crl_without_restart(
        tmp_path: Path) -> None:
    ca = make_ca()
    server_ca = ca.write(tmp_path / "server-ca.crt")  # what scrapers trust; never rotated
    client_ca = ca.write(tmp_path / "client-ca.crt")
    crl = tmp_path / "client.crl"
    crl.write_bytes(ca.crl([]))
    first = ca.issue("daemon", uri="kvtier://peer/daemon")
    cert, key = first.write(tmp_path, "daemon")
    daemon = DaemonProcess(tmp_path, "metrics-rotate", nvme=False, settings={
        "security.cert_file": str(cert), "security.key_file": str(key),
        "security.client_ca_file": str(client_ca), "security.crl_file": str(crl),
        "security.token_reload_interval_s": "0", "server.shm_channel": "false",
        "metrics.enabled": "true", "metrics.port": "0"})
    daemon.start()
    try:
        s = _Scraper(str(daemon.addresses["metrics_address"]), server_ca, tmp_path)
        ops = s.operator(ca, "ops")
        status, served, body = s.scrape(ops)
        assert (status, served) == (200, first.serial) and b"kvtier_" in body

        # The server's certificate, rotated in place: presented from the next handshake.
        second = ca.issue("daemon", uri="kvtier://peer/daemon")
        second.write(tmp_path, "daemon")
        assert second.serial != first.serial
        assert s.scrape(ops)[:2] == (200, second.serial)

        # A half-written rotation is not taken: the previous certificate keeps being served.
        cert.write_text("-----BEGIN CERTIFICATE-----\nbroken\n")
        assert s.scrape(ops)[:2] == (200, second.serial)
        assert "rotated certificate files not taken by the TCP data plane and /metrics" in \
            daemon.log_path.read_text()
        third = ca.issue("daemon", uri="kvtier://peer/daemon")
        third.write(tmp_path, "daemon")
        assert s.scrape(ops)[:2] == (200, third.serial)

        # The CRL (the gRPC port's list) rotated: the revoked operator is refused, naming its
        # serial; the one it does not list is served.
        revoked = s.operator(ca, "ops-revoked")
        assert s.scrape(revoked)[0] == 200
        _replace(crl, ca.crl([revoked[2]]))
        status, _, body = s.scrape(revoked)
        assert status == 401 and f"serial {revoked[2]:x}".encode() in body, body
        assert b"kvtier_" not in body
        assert s.scrape(ops)[0] == 200

        # The client CA rotated to another CA: the old CA's operator certificate is refused in
        # the handshake, the new CA's is served (the CRL follows: it is the new CA's).
        new_ca = make_ca("kvtier test CA 2")
        _replace(client_ca, new_ca.pem)
        _replace(crl, new_ca.crl([]))
        with pytest.raises((ssl.SSLError, ConnectionError)):
            s.scrape(ops)
        status, served, body = s.scrape(s.operator(new_ca, "ops-new"))
        assert (status, served) == (200, third.serial) and b"kvtier_" in body
        assert daemon.proc is not None and daemon.proc.poll() is None
    finally:
        daemon.stop()

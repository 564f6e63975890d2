"""TLS on the TCP data plane of real daemon processes (``server.tcp_tls``; docs/security.md,
"TLS on the TCP data plane"), with a CA and certificates made at run time.

An mTLS daemon serves its TCP plane with the gRPC port's certificate and requires client
certificates from the same CA there too; it says so in ``NodeInfo.data_tls_required``, and a
``StoreClient`` then connects with TLS and moves values byte for byte (the session ticket's
HELLO runs inside TLS). A plain client is told the plane speaks TLS; a client certificate from
another CA is refused; garbage on the port hurts nothing (every refusal paired with the same
operation succeeding for the right client, and what was stored reads back afterwards). A
rotated certificate reaches new data connections without a restart. A daemon with tokens
serves TLS without client certificates."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.planes import RemotePlane
from kvstore.client.store_client import StoreClient
from kvstore.client.store_config import DataPlane, StoreClientConfig
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.errors import ConfigError, PeerUnavailable, ProtocolError, Unauthenticated
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.security.pki import Ca, Leaf, make_ca
from tests.support.daemon import DaemonProcess

SIZES = (4096, 64 << 10, 1 << 20, 9 << 20)
"""Small (copied), leased, large, and striped over several connections (> 8 MiB)."""


@dataclass
class TlsWorld:
    ca: Ca
    daemon: DaemonProcess
    tmp: Path
    alice: ClientSecurity

    @property
    def address(self) -> str:
        return self.daemon.grpc_address

    @property
    def tcp(self) -> tuple[str, int]:
        host, _, port = str(self.daemon.addresses["tcp_address"]).rpartition(":")
        return host, int(port)

    def client(self, security: ClientSecurity | None = None) -> StoreClient:
        return StoreClient.connect(self.address, StoreClientConfig(
            rpc_timeout_s=10.0, tcp_io_timeout_s=10.0, data_plane=DataPlane.TCP,
            security=security or self.alice))

    def ticket(self) -> bytes:
        cfg = StoreClientConfig(rpc_timeout_s=10.0, security=self.alice)
        channel, info = open_channel(self.address, cfg)
        control = DaemonControl(self.address, info, channel, cfg)
        try:
            reply = control.call("IssueDataTicket", pb.IssueDataTicketRequest())
            return bytes(reply.ticket)
        finally:
            control.close()


def _security(ca: Ca, tmp: Path, name: str, uri: str) -> ClientSecurity:
    cert, key = ca.issue(name, uri=uri).write(tmp, name)
    return ClientSecurity(ca_file=tmp / "ca.crt", cert_file=cert, key_file=key)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsWorld]:
    tmp = tmp_path_factory.mktemp("dp-tls")
    ca = make_ca()
    ca.write(tmp / "ca.crt")
    cert, key = ca.issue("daemon", uri="kvtier://peer/daemon").write(tmp, "daemon")
    daemon = DaemonProcess(tmp, "dp-tls", nvme=False, dram_bytes="96MiB", settings={
        "security.cert_file": str(cert), "security.key_file": str(key),
        "security.client_ca_file": str(tmp / "ca.crt"), "server.shm_channel": "false",
        "server.tcp_tls": "true", "server.header_timeout_s": "2"})
    daemon.start()
    try:
        yield TlsWorld(ca, daemon, tmp,
                       _security(ca, tmp, "alice", "kvtier://engine/alice?tenants=alice"))
    finally:
        daemon.stop()


@pytest.fixture(scope="module")
def stored(world: TlsWorld) -> Iterator[tuple[StoreClient, dict[bytes, bytes]]]:
    values = {bytes([0xA1]) * 8 + i.to_bytes(8, "big"): os.urandom(size)
              for i, size in enumerate(SIZES)}
    c = world.client()
    for key, value in values.items():
        c.put(key, value)
    yield c, values
    c.close()


def _reads_back(c: StoreClient, values: dict[bytes, bytes]) -> None:
    for key, value in values.items():
        out = bytearray(len(value))
        assert c.get_into(key, out) == len(value)
        assert out == value, f"{key.hex()} did not read back byte for byte"


def _tcp(c: StoreClient) -> TcpClient:
    remote = c._remote
    assert isinstance(remote, RemotePlane)
    return remote.tcp_client()


def test_the_daemon_says_its_plane_speaks_tls_and_a_client_moves_values_over_it(
        world: TlsWorld, stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    alice, values = stored
    assert alice.info.data_tls_required and alice.info.data_ticket_required
    assert _tcp(alice).tls
    _reads_back(alice, values)
    other = world.client()
    try:
        _reads_back(other, values)
        keys = [b"batch-%08d" % i for i in range(6)]
        batch = [os.urandom(20_000) for _ in keys]
        assert other.put_many(keys, batch) == [True] * len(keys)
        outs = [bytearray(len(v)) for v in batch]
        assert other.get_many_into(keys, outs) == [len(v) for v in batch]
        assert outs == batch
    finally:
        other.close()


def test_a_ticket_is_renewed_inside_tls(world: TlsWorld,
                                       stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    c = StoreClient.connect(world.address, StoreClientConfig(
        rpc_timeout_s=10.0, tcp_io_timeout_s=10.0, data_plane=DataPlane.TCP,
        security=world.alice, data_ticket_ttl_s=2.0))
    try:
        remote = c._remote
        assert isinstance(remote, RemotePlane) and remote.tickets is not None
        c.put(b"renew-key-00000", b"before")
        first = remote.tickets.current()
        while time.time() <= first.expires_at_unix_s:  # the first ticket is gone
            time.sleep(0.1)
        assert bytes(_tcp(c).get(b"renew-key-00000")) == b"before"
        c.put(b"renew-key-00001", b"after")
        assert bytes(_tcp(c).get(b"renew-key-00001")) == b"after"
        assert remote.tickets.fetched >= 2 and _tcp(c).tls
    finally:
        c.close()
    _reads_back(stored[0], stored[1])


def test_a_plain_client_hears_that_the_plane_speaks_tls(
        world: TlsWorld, stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    host, port = world.tcp
    with TcpClient(host, port, ticket=world.ticket()) as plain, \
            pytest.raises(ProtocolError, match="speaks TLS"):
        plain.get(next(iter(stored[1])))
    # Paired: the same ticket over TLS is served.
    ctx = ssl.create_default_context(cafile=str(world.tmp / "ca.crt"))
    assert world.alice.cert_file is not None and world.alice.key_file is not None
    ctx.load_cert_chain(world.alice.cert_file, world.alice.key_file)
    key, value = next(iter(stored[1].items()))
    with TcpClient(host, port, ticket=world.ticket(), tls=ctx) as secure:
        assert bytes(secure.get(key)) == value


def test_a_client_without_a_ca_gets_a_config_error(world: TlsWorld) -> None:
    """A client whose gRPC channel has no CA cannot reach an mTLS daemon at all; what the TCP
    plane needs is checked where the TCP client is made (data_plane_client_context)."""
    from kvstore.security.tls import data_plane_client_context

    with pytest.raises(ConfigError, match="speaks TLS"):
        data_plane_client_context(ClientSecurity())


def test_a_client_certificate_from_another_ca_is_refused(
        world: TlsWorld, stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    host, port = world.tcp
    stranger = make_ca("another CA").issue("mallory", uri="kvtier://engine/alice?tenants=alice")
    cert, key = stranger.write(world.tmp, "mallory")
    ctx = ssl.create_default_context(cafile=str(world.tmp / "ca.crt"))
    ctx.load_cert_chain(cert, key)
    with TcpClient(host, port, ticket=world.ticket(), tls=ctx) as client, \
            pytest.raises(PeerUnavailable, match="may refuse this client's certificate"):
        client.get(next(iter(stored[1])))
    # No client certificate at all: refused as well.
    bare = ssl.create_default_context(cafile=str(world.tmp / "ca.crt"))
    with TcpClient(host, port, ticket=world.ticket(), tls=bare) as client, \
            pytest.raises(PeerUnavailable):
        client.get(next(iter(stored[1])))
    _reads_back(stored[0], stored[1])


def test_garbage_on_the_tls_port_does_not_hurt_the_daemon(
        world: TlsWorld, stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    host, port = world.tcp
    for junk in (b"\x16\x03\x01\x02\x00" + os.urandom(600), os.urandom(4096),
                 b"GET / HTTP/1.0\r\n\r\n", b"\x16\x03", b""):
        # The daemon may have closed on it already (OSError).
        with socket.create_connection((host, port), timeout=10) as sock, \
                contextlib.suppress(OSError):
            if junk:
                sock.sendall(junk)
            while sock.recv(65536):
                pass
    assert world.daemon.proc is not None and world.daemon.proc.poll() is None
    _reads_back(stored[0], stored[1])
    fresh = world.client()
    try:
        _reads_back(fresh, stored[1])
    finally:
        fresh.close()


def test_a_rotated_certificate_reaches_new_data_connections(
        world: TlsWorld, stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    host, port = world.tcp

    def served_serial() -> int:
        ctx = ssl.create_default_context(cafile=str(world.tmp / "ca.crt"))
        assert world.alice.cert_file is not None and world.alice.key_file is not None
        ctx.load_cert_chain(world.alice.cert_file, world.alice.key_file)
        with socket.create_connection((host, port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            return x509.load_der_x509_certificate(der).serial_number

    before = served_serial()
    rotated = world.ca.issue("daemon", uri="kvtier://peer/daemon")
    time.sleep(0.01)  # a new mtime even on a coarse clock
    rotated.write(world.tmp, "daemon")
    assert rotated.serial != before
    assert served_serial() == rotated.serial
    _reads_back(stored[0], stored[1])
    fresh = world.client()
    try:
        _reads_back(fresh, stored[1])
    finally:
        fresh.close()


def test_a_token_daemon_serves_tls_without_client_certificates(tmp_path: Path) -> None:
    ca = make_ca()
    ca.write(tmp_path / "ca.crt")
    cert, key = ca.issue("daemon").write(tmp_path, "daemon")
    generate_key(tmp_path / "keys", "k1")
    (tmp_path / "keys" / "k1.key").rename(tmp_path / "k1.key")
    kid, signing = load_signing_key(tmp_path / "k1.key")
    token = tmp_path / "engine.token"
    token.write_text(mint(signing, kid, subject="e", role=Role.ENGINE, tenants=["t"],
                          ttl_s=3600))
    daemon = DaemonProcess(tmp_path, "dp-tls-tok", nvme=False, settings={
        "security.cert_file": str(cert), "security.key_file": str(key),
        "security.token_keys": str(tmp_path / "keys"), "server.shm_channel": "false",
        "server.tcp_tls": "true"})
    daemon.start()
    try:
        c = StoreClient.connect(daemon.grpc_address, StoreClientConfig(
            rpc_timeout_s=10.0, data_plane=DataPlane.TCP,
            security=ClientSecurity(ca_file=tmp_path / "ca.crt", token_file=token)))
        try:
            assert c.info.data_tls_required
            value = os.urandom(3 << 20)
            c.put(b"t" * 16, value)
            out = bytearray(len(value))
            c.get_into(b"t" * 16, out)
            assert out == value
        finally:
            c.close()
    finally:
        daemon.stop()


def test_tcp_tls_without_a_certificate_does_not_start(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "dp-tls-nocert", nvme=False,
                           settings={"server.tcp_tls": "true"})
    with pytest.raises(RuntimeError, match="tcp_tls"):
        daemon.start(timeout_s=30)


def test_a_revoked_client_certificate_is_refused_on_the_tls_data_plane(tmp_path: Path) -> None:
    """The CRL the gRPC port checks is checked on the TCP data plane's TLS too: a ticket
    obtained before the revocation does not let a revoked certificate in (refused after the
    handshake, UNAUTHENTICATED naming the serial and the CRL), an open connection of a
    certificate revoked later is ended before its next request once the CRL is reloaded, and
    a certificate the CRL does not list keeps being served (paired), its values byte for
    byte."""
    ca = make_ca()
    ca_file = ca.write(tmp_path / "ca.crt")
    crl = tmp_path / "ca.crl"
    crl.write_bytes(ca.crl([]))
    cert, key = ca.issue("daemon", uri="kvtier://peer/daemon").write(tmp_path, "daemon")
    daemon = DaemonProcess(tmp_path, "dp-tls-crl", nvme=False, dram_bytes="64MiB", settings={
        "security.cert_file": str(cert), "security.key_file": str(key),
        "security.client_ca_file": str(ca_file), "security.crl_file": str(crl),
        "security.token_reload_interval_s": "0", "server.shm_channel": "false",
        "server.tcp_tls": "true"})
    daemon.start()
    leaves = {name: ca.issue(name, uri=f"kvtier://engine/{name}?tenants=t")
              for name in ("carol", "dave", "erin")}
    security = {name: _security_of(leaf, tmp_path, ca_file) for name, leaf in leaves.items()}
    host, _, port_text = str(daemon.addresses["tcp_address"]).rpartition(":")
    port = int(port_text)
    try:
        tickets = {name: _ticket_of(daemon.grpc_address, sec) for name, sec in security.items()}
        contexts = {name: _tls_context(sec) for name, sec in security.items()}
        value = os.urandom(200_000)
        with TcpClient(host, port, ticket=tickets["carol"], tls=contexts["carol"]) as carol:
            carol.put(b"crl-key-0000000", value)
            assert bytes(carol.get(b"crl-key-0000000")) == value
            crl.write_bytes(ca.crl([leaves["dave"].serial]))
            # dave's ticket is valid, his certificate passes OpenSSL's checks; the CRL says no.
            with TcpClient(host, port, ticket=tickets["dave"], tls=contexts["dave"]) as dave, \
                    pytest.raises(Unauthenticated, match=f"serial {leaves['dave'].serial:x}"
                                  r"\) is revoked \(the CRL"):
                dave.get(b"crl-key-0000000")
            # Paired: carol's open connection and erin's new one are served.
            assert bytes(carol.get(b"crl-key-0000000")) == value
            with TcpClient(host, port, ticket=tickets["erin"], tls=contexts["erin"]) as erin:
                assert bytes(erin.get(b"crl-key-0000000")) == value
            # Revoking carol ends her open connection before its next request, once the
            # connection's check is due (every second with a reload interval under 1 s).
            crl.write_bytes(ca.crl([leaves["dave"].serial, leaves["carol"].serial]))
            time.sleep(1.2)
            with pytest.raises(Unauthenticated, match="is revoked"):
                carol.get(b"crl-key-0000000")
        with TcpClient(host, port, ticket=tickets["erin"], tls=contexts["erin"]) as erin:
            assert bytes(erin.get(b"crl-key-0000000")) == value
    finally:
        daemon.stop()


def _security_of(leaf: Leaf, tmp: Path, ca_file: Path) -> ClientSecurity:
    cert, key = leaf.write(tmp, leaf.name)
    return ClientSecurity(ca_file=ca_file, cert_file=cert, key_file=key)


def _ticket_of(address: str, security: ClientSecurity) -> bytes:
    cfg = StoreClientConfig(rpc_timeout_s=10.0, security=security)
    channel, info = open_channel(address, cfg)
    control = DaemonControl(address, info, channel, cfg)
    try:
        return bytes(control.call("IssueDataTicket", pb.IssueDataTicketRequest()).ticket)
    finally:
        control.close()


def _tls_context(security: ClientSecurity) -> ssl.SSLContext:
    assert security.ca_file and security.cert_file and security.key_file
    ctx = ssl.create_default_context(cafile=str(security.ca_file))
    ctx.load_cert_chain(security.cert_file, security.key_file)
    return ctx


def test_an_expired_client_certificate_is_refused_on_the_tls_data_plane(
        world: TlsWorld, stored: tuple[StoreClient, dict[bytes, bytes]]) -> None:
    """A certificate of the right CA that has expired fails the data plane's TLS handshake
    (OpenSSL checks its dates), even with a valid ticket; kvtier's own client would not
    present it (ConfigError). Paired: alice's certificate on the same port is served."""
    host, port = world.tcp
    cert, key = world.ca.issue("old", uri="kvtier://engine/alice?tenants=alice",
                               valid_from_s=-7200, valid_for_s=3600).write(world.tmp, "old")
    ctx = ssl.create_default_context(cafile=str(world.tmp / "ca.crt"))
    ctx.load_cert_chain(cert, key)
    key0, value0 = next(iter(stored[1].items()))
    with TcpClient(host, port, ticket=world.ticket(), tls=ctx) as client, \
            pytest.raises(PeerUnavailable, match="may refuse this client's certificate"):
        client.get(key0)
    from kvstore.security.tls import data_plane_client_context

    with pytest.raises(ConfigError, match="expired"):
        data_plane_client_context(ClientSecurity(ca_file=world.tmp / "ca.crt",
                                                 cert_file=cert, key_file=key))
    assert world.alice.cert_file is not None and world.alice.key_file is not None
    good = ssl.create_default_context(cafile=str(world.tmp / "ca.crt"))
    good.load_cert_chain(world.alice.cert_file, world.alice.key_file)
    with TcpClient(host, port, ticket=world.ticket(), tls=good) as client:
        assert bytes(client.get(key0)) == value0

"""TLS on the TCP transport (kvstore/dataplane/transport/tcp/tls.py): a real TcpServer over a
MemoryBackend and real TcpClients on loopback, with a CA and certificates made at run time.
The daemon's wiring (server.tcp_tls, the certificate files, NodeInfo) is tested against real
daemon processes in tests/security/test_dataplane_tls.py."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.dataplane.transport.frames import (
    HEADER_BYTES,
    Opcode,
    Status,
    decode_header,
    pack_header,
)
from kvstore.dataplane.transport.memory_backend import MemoryBackend
from kvstore.dataplane.transport.tcp import TcpClient, TcpServer, TcpServerConfig
from kvstore.errors import PeerUnavailable, ProtocolError, Unauthenticated
from tests.security.pki import Ca, make_ca
from tests.security.secured_daemon import raw_frame


def _server_context(ca: Ca, tmp: Path, *, client_certs: bool) -> ssl.SSLContext:
    cert, key = ca.issue("daemon").write(tmp, "daemon")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    if client_certs:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=ca.pem.decode())
    return ctx


def _client_context(ca: Ca, tmp: Path, leaf_ca: Ca | None = None, name: str = "engine"
                    ) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cadata=ca.pem.decode())
    if leaf_ca is not None:
        cert, key = leaf_ca.issue(name).write(tmp, name)
        ctx.load_cert_chain(cert, key)
    return ctx


@pytest.fixture
def ca() -> Ca:
    return make_ca()


@pytest.fixture
def tls_server(ca: Ca, tmp_path: Path) -> Iterator[TcpServer]:
    ctx = _server_context(ca, tmp_path, client_certs=True)
    server = TcpServer(MemoryBackend(), TcpServerConfig(header_timeout_s=2.0),
                       tls=lambda: ctx)
    server.start()
    yield server
    server.close()


def _client(server: TcpServer, ctx: ssl.SSLContext | None, **kwargs: object) -> TcpClient:
    ep = server.endpoint
    return TcpClient(ep.host, ep.port, connections=2, tls=ctx, connect_timeout_s=5.0,
                     io_timeout_s=10.0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 4096, 65536, 1 << 20, 20 << 20])
def test_put_get_byte_for_byte_over_tls(tls_server: TcpServer, ca: Ca, tmp_path: Path,
                                        size: int) -> None:
    rng = np.random.default_rng(size)
    value = rng.integers(0, 256, size, dtype=np.uint8)
    with _client(tls_server, _client_context(ca, tmp_path, ca),
                 stripe_threshold_bytes=8 << 20) as client:
        assert client.tls
        client.put(b"k%d" % size, value)
        out = np.zeros(size, dtype=np.uint8)
        assert client.get_into(b"k%d" % size, out) == size
        assert np.array_equal(out, value)
        assert bytes(client.get(b"k%d" % size)) == value.tobytes()
        assert client.size_of(b"k%d" % size) == size
        keys = [b"b%d-%d" % (size, i) for i in range(5)]
        if size <= 1 << 20:
            assert client.put_many(keys, [value] * 5) == [True] * 5
            outs = [np.zeros(size, dtype=np.uint8) for _ in keys]
            assert client.get_many_into(keys, outs) == [size] * 5
            assert all(np.array_equal(o, value) for o in outs)
        assert client.remove(b"k%d" % size)
    assert tls_server.stats().tls_refused == 0
    assert tls_server.stats().native_gets == 0


def test_plain_client_against_tls_plane_hears_why(tls_server: TcpServer) -> None:
    with _client(tls_server, None) as client, \
            pytest.raises(ProtocolError, match="speaks TLS"):
        client.ping()
    # A raw plain frame gets the same plain answer, then the close.
    with socket.create_connection((tls_server.endpoint.host, tls_server.endpoint.port),
                                  timeout=10) as sock:
        raw_frame(sock, Opcode.PING)
        buf = b""
        while len(buf) < HEADER_BYTES:
            got = sock.recv(HEADER_BYTES - len(buf))
            assert got
            buf += got
        header = decode_header(buf, 1 << 20)
        assert header.status is Status.PROTOCOL
    assert tls_server.stats().tls_refused == 2


def test_untrusted_client_certificate_is_refused(tls_server: TcpServer, ca: Ca,
                                                 tmp_path: Path) -> None:
    stranger = make_ca("another CA")
    with _client(tls_server, _client_context(ca, tmp_path, stranger)) as client, \
            pytest.raises(PeerUnavailable):
        client.ping()
    # No client certificate at all: refused too.
    with _client(tls_server, _client_context(ca, tmp_path)) as client, \
            pytest.raises(PeerUnavailable):
        client.ping()
    # Paired: a certificate from the CA is served.
    with _client(tls_server, _client_context(ca, tmp_path, ca)) as client:
        client.ping()
    # The server counts a failed handshake once its alert is out: the client may be faster.
    deadline = time.monotonic() + 30
    while tls_server.stats().tls_refused < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tls_server.stats().tls_refused == 2


def test_client_refuses_an_untrusted_server(tls_server: TcpServer, tmp_path: Path,
                                            ca: Ca) -> None:
    with _client(tls_server, _client_context(make_ca("not the daemon's CA"), tmp_path, ca)
                 ) as client, pytest.raises(Unauthenticated, match="does not verify"):
        client.ping()


def test_tls_client_against_a_plain_plane_fails_clearly(ca: Ca, tmp_path: Path) -> None:
    with TcpServer(MemoryBackend()) as server, \
            _client(server, _client_context(ca, tmp_path, ca)) as client, \
            pytest.raises(PeerUnavailable, match="may not speak TLS"):
        client.ping()


def test_garbage_on_the_tls_port_does_not_hurt_it(tls_server: TcpServer, ca: Ca,
                                                  tmp_path: Path) -> None:
    ep = tls_server.endpoint
    payloads = [b"\x16\x03\x01\x00\x05hello", b"\x16" + bytes(range(256)) * 8,
                b"GET / HTTP/1.1\r\n\r\n", b"\x00" * 4096, b""]
    for junk in payloads:
        # The server may have closed on it already (OSError).
        with socket.create_connection((ep.host, ep.port), timeout=10) as sock, \
                contextlib.suppress(OSError):
            if junk:
                sock.sendall(junk)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
    # A handshake that never finishes is cut at header_timeout_s.
    with socket.create_connection((ep.host, ep.port), timeout=10) as sock:
        sock.sendall(b"\x16\x03")
        sock.settimeout(10)
        while sock.recv(65536):
            pass
    with _client(tls_server, _client_context(ca, tmp_path, ca)) as client:
        client.put(b"after", b"x" * 100)
        assert bytes(client.get(b"after")) == b"x" * 100
    assert tls_server.stats().tls_refused >= 5


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def test_an_idle_tls_connection_is_closed_and_the_client_goes_on(ca: Ca, tmp_path: Path) -> None:
    """The server's idle ticks run under TLS (a TLS socket in timeout mode raises where a plain
    one's SO_RCVTIMEO would: OpenSSL would otherwise retry its blocked read forever)."""
    ctx = _server_context(ca, tmp_path, client_certs=False)
    with TcpServer(MemoryBackend(), TcpServerConfig(idle_timeout_s=0.5), tls=lambda: ctx
                   ) as server, _client(server, _client_context(ca, tmp_path)) as client:
        client.put(b"idle-key", b"v" * 1000)
        _wait_for(lambda: server.stats().connections_idle_closed == 1)
        assert server.stats().connections_idle_closed == 1
        assert bytes(client.get(b"idle-key")) == b"v" * 1000  # again, on a fresh connection
        # A put on a connection the server idle-closed: the send fails with TLS's own EOF
        # (ssl.SSLEOFError, no errno), which must read as stale too (a quiet datapath run
        # here died on it: "EOF occurred in violation of protocol" after a 300 s idle).
        _wait_for(lambda: server.stats().connections_idle_closed == 2)
        big = b"w" * (4 << 20)  # more than the socket buffers: the send itself fails
        client.put(b"idle-key-2", big)
        assert bytes(client.get(b"idle-key-2")) == big


def test_a_frame_trickling_in_over_tls_hits_the_header_timeout(ca: Ca, tmp_path: Path) -> None:
    ctx = _server_context(ca, tmp_path, client_certs=False)
    with TcpServer(MemoryBackend(), TcpServerConfig(header_timeout_s=1.0), tls=lambda: ctx
                   ) as server, socket.create_connection(
                       (server.endpoint.host, server.endpoint.port), timeout=10) as raw, \
            _client_context(ca, tmp_path).wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        header = bytearray(HEADER_BYTES)
        pack_header(header, Opcode.PING, request_id=7)
        tls.sendall(bytes(header[:10]))  # the rest never comes
        buf = b""
        while len(buf) < HEADER_BYTES:
            got = tls.recv(HEADER_BYTES - len(buf))
            assert got, "closed without an answer"
            buf += got
        assert decode_header(buf, 1 << 20).status is Status.PROTOCOL
        _wait_for(lambda: server.stats().header_timeouts == 1)  # counted once it closed
        assert server.stats().header_timeouts == 1

"""Data-plane session tickets: a TCP data connection is served only after a valid ticket.

Real TcpServer and TcpClient over loopback sockets, with the daemon's ticket authority as the
server's hook (kvstore/security/tickets.py, docs/security.md "Same host, data planes").
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from kvstore.dataplane.transport import MemoryBackend, TcpClient, TcpServer, TcpServerConfig
from kvstore.dataplane.transport.frames import (
    HEADER_BYTES,
    Opcode,
    Status,
    decode_header,
    pack_header,
)
from kvstore.errors import PeerUnavailable, Unauthenticated
from kvstore.security.identity import Principal, Role
from kvstore.security.tickets import TicketAuthority

ALICE = Principal("engine-a", Role.ENGINE, frozenset({"alice"}))


class Clock:
    def __init__(self) -> None:
        self.now = time.time()  # the server checks a grant's expiry against the wall clock

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def authority(clock: Clock) -> TicketAuthority:
    return TicketAuthority("node-a", ttl_s=60, clock=clock)


@pytest.fixture
def server(authority: TicketAuthority) -> Iterator[TcpServer]:
    srv = TcpServer(MemoryBackend(), TcpServerConfig(reservation_ttl_s=120),
                    authorize=authority.authorize)
    srv.start()
    yield srv
    srv.close(drain_timeout_s=1)


def _raw_frame(sock: socket.socket, opcode: Opcode, key: bytes = b"", payload: bytes = b"",
               **fields: int) -> None:
    header = pack_header(bytearray(HEADER_BYTES), opcode, key_len=len(key),
                         payload_len=len(payload), request_id=1, **fields)
    sock.sendall(bytes(header) + key + payload)


def _answer_then_close(sock: socket.socket) -> Status:
    """The status of the one frame the server answers, then EOF (the server closed)."""
    buf = bytearray()
    while len(buf) < HEADER_BYTES:
        got = sock.recv(HEADER_BYTES - len(buf))
        assert got, "the server closed without answering"
        buf += got
    status = decode_header(bytes(buf), 1 << 20).status
    sock.settimeout(10)
    while sock.recv(65536):
        pass  # drain the refusal's text up to EOF
    return status


def test_a_valid_ticket_is_served(server: TcpServer, authority: TicketAuthority) -> None:
    ep = server.endpoint
    with TcpClient(ep.host, ep.port, 1, ticket=authority.mint(ALICE).ticket) as client:
        client.put(b"k", b"v" * 100)
        assert bytes(client.get(b"k")) == b"v" * 100
    assert server.stats().connections_unauthenticated == 0


def test_no_ticket_forged_stale_and_expired_are_refused(
        server: TcpServer, authority: TicketAuthority, clock: Clock) -> None:
    ep = server.endpoint
    good = authority.mint(ALICE).ticket
    forged = good[:-4] + (b"AAAA" if not good.endswith(b"AAAA") else b"BBBB")
    stale = TicketAuthority("node-a", clock=clock).mint(ALICE).ticket  # another key
    other_daemon = TicketAuthority("node-b", clock=clock).mint(ALICE).ticket
    for ticket in (forged, stale, other_daemon):
        with pytest.raises(Unauthenticated), \
                TcpClient(ep.host, ep.port, 1, ticket=ticket) as client:
            client.put(b"x", b"y")
    with pytest.raises((Unauthenticated, PeerUnavailable)), \
            TcpClient(ep.host, ep.port, 1) as client:  # no ticket at all
        client.put(b"x", b"y")
    clock.now += 61
    with pytest.raises(Unauthenticated), TcpClient(ep.host, ep.port, 1, ticket=good) as client:
        client.put(b"x", b"y")
    assert server.stats().connections_unauthenticated >= 5


def test_a_frame_before_the_ticket_is_refused_and_nothing_is_stored(
        authority: TicketAuthority) -> None:
    backend = MemoryBackend()
    with TcpServer(backend, TcpServerConfig(), authorize=authority.authorize) as srv:
        ep = srv.endpoint
        with socket.create_connection((ep.host, ep.port), timeout=10) as sock:
            _raw_frame(sock, Opcode.PUT, b"k", b"poison", total_size=6)
            assert _answer_then_close(sock) == Status.UNAUTHENTICATED
        with TcpClient(ep.host, ep.port, 1, ticket=authority.mint(ALICE).ticket) as client:
            assert client.exists(b"k") is False
        assert not backend.exists(b"k")


def test_garbage_instead_of_a_hello_gets_a_clean_close(
        server: TcpServer, authority: TicketAuthority) -> None:
    ep = server.endpoint
    with socket.create_connection((ep.host, ep.port), timeout=10) as sock:
        sock.sendall(b"\xff" * 4096)
        sock.settimeout(10)
        while sock.recv(65536):
            pass  # whatever it answers, it closes
    # the server still serves a good client afterwards
    with TcpClient(ep.host, ep.port, 1, ticket=authority.mint(ALICE).ticket) as client:
        client.put(b"after", b"ok")
        assert bytes(client.get(b"after")) == b"ok"

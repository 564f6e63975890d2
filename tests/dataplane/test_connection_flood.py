"""A flood of silent connections cannot keep clients out of the TCP data plane (issue 16, found
by the fault suite's ``flood-connections``): a connection's first frame must arrive within
``header_timeout_s`` of the accept, so connections that never send a byte give their
``max_connections`` slots back after that, not after ``idle_timeout_s`` (300 s by default);
a client refused meanwhile gets in afterwards. A connection that does send requests is not
affected, and one closed before its first byte ends quietly.

A real server on loopback (the daemon's backend kind), raw sockets for the flood.
"""

from __future__ import annotations

import socket

import pytest

from kvstore.dataplane.transport.frames import HEADER_BYTES
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.errors import CapacityError
from tests.dataplane.test_connection_bounds import raw, tcp_server
from tests.support.common import wait_until


@pytest.mark.parametrize("native", [False, True], ids=["python", "native"])
def test_silent_connections_give_their_slots_back_within_the_header_timeout(
        native: bool) -> None:
    with tcp_server(native=native, max_connections=4, header_timeout_s=0.5,
                    idle_timeout_s=300.0) as server:
        flood = [raw(server) for _ in range(4)]  # silent: not one byte
        wait_until(lambda: server.stats().connections_open == 4, 10, "the flood to be served")
        with TcpClient(server.endpoint.host, server.endpoint.port, 1) as refused, \
                pytest.raises(CapacityError):
            refused.put(b"k", b"value")  # every slot held by the flood
        wait_until(lambda: server.stats().connections_open == 0, 10,
                   "the silent connections to be closed")
        for sock in flood:  # each was told why (a PROTOCOL frame) before the close
            sock.settimeout(5)
            assert len(sock.recv(HEADER_BYTES)) > 0
            sock.close()
        with TcpClient(server.endpoint.host, server.endpoint.port, 1) as client:
            client.put(b"k", b"value")  # room again
            buf = bytearray(5)
            client.get_into(b"k", buf)
            assert buf == b"value"


def test_a_connection_closed_before_its_first_byte_ends_quietly() -> None:
    with tcp_server(header_timeout_s=0.5) as server:
        sock = raw(server)
        wait_until(lambda: server.stats().connections_open == 1, 10, "the connection")
        sock.shutdown(socket.SHUT_RDWR)
        sock.close()
        wait_until(lambda: server.stats().connections_open == 0, 10, "the close")
        assert server.stats().protocol_errors == 0

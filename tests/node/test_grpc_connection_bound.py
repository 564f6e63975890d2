"""The daemon's gRPC port serves at most ``server.max_connections`` connections, as each data
plane listener does (issue 16, found by the fault suite's ``flood-connections``: 128 idle
HTTP/2 connections all stayed open, bounded only by the process's descriptor limit). One more
is closed by the daemon at once; once the flood goes, clients are served again.

A real daemon; the flood is raw sockets that send the HTTP/2 preface and an empty SETTINGS
frame (valid, idle connections); the daemon's sockets counted in ``/proc/<pid>/fd``.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.common import wait_until
from tests.support.daemon import DaemonProcess, running

BOUND = 8
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def sockets(pid: int) -> int:
    count = 0
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(entry).startswith("socket:")
        except OSError:
            continue
    return count


def test_the_grpc_port_holds_at_most_max_connections(tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path, "node-grpc-bound", nvme=False,
                           settings={"server.max_connections": str(BOUND)})
    with running(daemon):
        host, _, port = daemon.grpc_address.rpartition(":")
        before = sockets(daemon.pid)
        flood = []
        for _ in range(3 * BOUND):
            sock = socket.create_connection((host, int(port)), timeout=5)
            sock.sendall(PREFACE)
            flood.append(sock)
        served = 0
        for sock in flood:  # a served connection gets the daemon's SETTINGS; one over: EOF
            with contextlib.suppress(OSError):  # reset: refused
                served += len(sock.recv(4096)) > 0
        assert served <= BOUND, f"{served} of {len(flood)} connections served"
        wait_until(lambda: sockets(daemon.pid) <= before + BOUND, 20,
                   f"the daemon to hold at most {BOUND} of the flood's connections")
        for sock in flood:
            sock.close()
        wait_until(lambda: sockets(daemon.pid) <= before, 20, "the flood's sockets to close")
        with grpc.insecure_channel(daemon.grpc_address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_idle_http2_connections_at_the_bound_do_not_keep_a_client_out(tmp_path: Path) -> None:
    """The fault suite's flood at the bound: idle HTTP/2 connections (preface and SETTINGS,
    then nothing) filling every slot kept an arriving client out for as long as they stayed.
    The gRPC port closes a connection with no call for ``server.idle_timeout_s``, as the data
    plane does, so the client is served once they have been idle that long (here 1 s),
    while they are still open on the flood's side."""
    daemon = DaemonProcess(tmp_path, "node-grpc-idle", nvme=False,
                           settings={"server.max_connections": str(BOUND),
                                     "server.idle_timeout_s": "1"})
    with running(daemon):
        host, _, port = daemon.grpc_address.rpartition(":")
        flood = []
        try:
            for _ in range(BOUND):
                sock = socket.create_connection((host, int(port)), timeout=5)
                sock.sendall(PREFACE)
                assert sock.recv(4096)  # served: the daemon's SETTINGS
                flood.append(sock)

            def served() -> bool:
                with grpc.insecure_channel(daemon.grpc_address) as channel:
                    try:
                        reply = health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(), timeout=2)
                    except grpc.RpcError:
                        return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            wait_until(served, 30, "a client served while the flood's connections stay open")
        finally:
            for sock in flood:
                sock.close()

"""A real daemon child process with bearer-token security, and the engines' clients of it, for
the data-plane session tests (tests/security/test_dataplane_*.py).

Tokens are minted at run time with a key drawn in the test's temp directory (nothing secret is
checked in). ``client(name, plane)`` connects a :class:`StoreClient` with that principal's
token over the data plane asked for; ``control(name)`` a gRPC-only :class:`DaemonControl`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.store_client import StoreClient
from kvstore.client.store_config import DataPlane, StoreClientConfig
from kvstore.dataplane.transport.frames import (
    HEADER_BYTES,
    Opcode,
    Status,
    decode_header,
    pack_header,
)
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.support.daemon import DaemonProcess

PRINCIPALS: dict[str, tuple[Role, list[str] | None, bool]] = {
    "alice": (Role.ENGINE, ["alice"], False),
    "bob": (Role.ENGINE, ["bob"], False),
    "op": (Role.OPERATOR, None, False),
    "sys": (Role.ENGINE, ["sys"], True),
}
"""name -> (role, tenants, shared_writer)."""


@dataclass
class SecuredDaemon:
    daemon: DaemonProcess
    tokens: dict[str, Path]
    opened: list[StoreClient | DaemonControl] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.daemon.grpc_address

    @property
    def tcp(self) -> tuple[str, int]:
        host, _, port = str(self.daemon.addresses["tcp_address"]).rpartition(":")
        return host, int(port)

    def config(self, name: str, plane: DataPlane, **kwargs: object) -> StoreClientConfig:
        return StoreClientConfig(rpc_timeout_s=10.0, tcp_io_timeout_s=10.0, data_plane=plane,
                                 security=ClientSecurity(token_file=self.tokens[name]),
                                 **kwargs)  # type: ignore[arg-type]

    def client(self, name: str, plane: DataPlane, **kwargs: object) -> StoreClient:
        c = StoreClient.connect(self.address, self.config(name, plane, **kwargs))
        self.opened.append(c)
        return c

    def control(self, name: str, tenant: str | None = None) -> DaemonControl:
        cfg = StoreClientConfig(rpc_timeout_s=10.0, tenant=tenant,
                                security=ClientSecurity(token_file=self.tokens[name]))
        channel, info = open_channel(self.address, cfg)
        c = DaemonControl(self.address, info, channel, cfg)
        self.opened.append(c)
        return c

    def ticket(self, name: str, ttl_s: float = 0.0,
               tenant: str | None = None) -> pb.IssueDataTicketResponse:
        reply: pb.IssueDataTicketResponse = self.control(name, tenant).call(
            "IssueDataTicket", pb.IssueDataTicketRequest(ttl_s=ttl_s))
        return reply

    def close(self) -> None:
        for c in self.opened:
            c.close()
        self.daemon.stop()


def start_secured_daemon(tmp: Path, node_id: str, *, shm: bool = True,
                         settings: dict[str, str] | None = None) -> SecuredDaemon:
    generate_key(tmp / "keys", "k1")
    (tmp / "keys" / "k1.key").rename(tmp / "k1.key")
    kid, signing = load_signing_key(tmp / "k1.key")
    tokens: dict[str, Path] = {}
    for name, (role, tenants, shared_writer) in PRINCIPALS.items():
        path = tmp / f"{name}.token"
        path.write_text(mint(signing, kid, subject=name, role=role, tenants=tenants,
                             ttl_s=3600, shared_writer=shared_writer))
        tokens[name] = path
    daemon = DaemonProcess(tmp, node_id, nvme=False, settings={
        "security.token_keys": str(tmp / "keys"), "security.token_reload_interval_s": "0",
        "server.shm_channel": "true" if shm else "false", **(settings or {})})
    daemon.start()
    return SecuredDaemon(daemon, tokens)


def secured_daemon_fixture(tmp: Path, node_id: str, **kwargs: object
                           ) -> Iterator[SecuredDaemon]:
    world = start_secured_daemon(tmp, node_id, **kwargs)  # type: ignore[arg-type]
    try:
        yield world
    finally:
        world.close()


# --- raw TCP frames ------------------------------------------------------------------------------


def raw_frame(sock: socket.socket, opcode: Opcode, key: bytes = b"", payload: bytes = b"",
              request_id: int = 1, **fields: int) -> None:
    header = pack_header(bytearray(HEADER_BYTES), opcode, key_len=len(key),
                         payload_len=len(payload), request_id=request_id, **fields)
    sock.sendall(bytes(header) + key + payload)


def read_answer(sock: socket.socket) -> tuple[Status, bytes]:
    """The status and payload (detail) of the next answer."""
    buf = bytearray()
    while len(buf) < HEADER_BYTES:
        got = sock.recv(HEADER_BYTES - len(buf))
        assert got, "the server closed without answering"
        buf += got
    header = decode_header(bytes(buf), 1 << 30)
    payload = bytearray()
    while len(payload) < header.payload_len:
        got = sock.recv(header.payload_len - len(payload))
        assert got, "the server closed inside an answer"
        payload += got
    return header.status, bytes(payload)


def answer_then_close(sock: socket.socket) -> tuple[Status, bytes]:
    """The one answer the server gives, then EOF (it closed)."""
    status, detail = read_answer(sock)
    sock.settimeout(10)
    while sock.recv(65536):
        pass
    return status, detail


def each(values: dict[bytes, bytes], check: Callable[[bytes, bytes], None]) -> None:
    for key, value in values.items():
        check(key, value)

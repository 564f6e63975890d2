"""mTLS on a real conductor (threaded gRPC server) following a real mTLS daemon through real
etcd (a client certificate's tenants scope the conductor's answers, as a token's do), and the
principal seen inside a real threaded handler; the method table covers every RPC."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvtier.v1 import conductor_pb2, store_pb2
from kvstore.client.conductor_client import ConductorClient
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.store_config import StoreClientConfig
from kvstore.errors import PermissionDenied
from kvstore.membership.etcd import KeyLayout
from kvstore.security.auth import METHOD_ROLES
from kvstore.security.config import ClientSecurity, ServerSecurity
from kvstore.security.identity import current_principal
from kvstore.security.server import SecureServing
from tests.security.pki import make_ca
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess


def test_every_rpc_is_in_the_method_table() -> None:
    for pb in (store_pb2, conductor_pb2):
        for service in pb.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert f"/{service.full_name}/{method.name}" in METHOD_ROLES


def test_mtls_conductor_follows_an_mtls_daemon(tmp_path: Path, etcd_server: object,
                                               etcd_layout: KeyLayout) -> None:
    url = etcd_server.client_url  # type: ignore[attr-defined]
    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    d_cert, d_key = ca.issue("daemon", uri="kvtier://peer/daemon-a").write(tmp_path)
    c_cert, c_key = ca.issue("conductor", uri="kvtier://peer/conductor-1").write(tmp_path)
    o_cert, o_key = ca.issue("operator", uri="kvtier://operator/ops").write(tmp_path)
    a_cert, a_key = ca.issue("engine-a", uri="kvtier://engine/vllm-a?tenants=a").write(tmp_path)
    b_cert, b_key = ca.issue("engine-b", uri="kvtier://engine/vllm-b?tenants=b").write(tmp_path)
    daemon = DaemonProcess(tmp_path, "node-a", nvme=False, etcd_endpoint=url,
                           etcd_prefix=etcd_layout.prefix, settings={
                               "security.cert_file": str(d_cert),
                               "security.key_file": str(d_key),
                               "security.client_ca_file": str(ca_path),
                               "server.shm_channel": "false"})
    conductor = ConductorProcess(tmp_path, "c1", etcd_endpoint=url, prefix=etcd_layout.prefix,
                                 extra_args=("--tls-cert", str(c_cert), "--tls-key", str(c_key),
                                             "--client-ca", str(ca_path)))
    daemon.start()
    key = bytes([7]) * 16
    engine_a = ClientSecurity(ca_file=ca_path, cert_file=a_cert, key_file=a_key)
    engine_b = ClientSecurity(ca_file=ca_path, cert_file=b_cert, key_file=b_key)
    cfg = StoreClientConfig(rpc_timeout_s=10.0, security=engine_a)
    channel, node_info = open_channel(daemon.grpc_address, cfg)
    store = DaemonControl(daemon.grpc_address, node_info, channel, cfg)
    try:
        store.call("Put", store_pb2.PutRequest(key=key, value=b"x" * 64))  # tenant a's chunk
    finally:
        store.close()
    try:
        address = conductor.start()

        async def scenario() -> None:
            operator = ClientSecurity(ca_file=ca_path, cert_file=o_cert, key_file=o_key)
            async with ConductorClient(address=address, security=operator) as client:
                deadline = time.monotonic() + 30
                while True:  # the conductor follows the daemon with its peer certificate
                    info = await client.leader_info()
                    if "node-a" in info.live_nodes or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.1)
                assert list(info.live_nodes) == ["node-a"]
                while not (await client.lookup(keys=[key])).nodes:  # indexed (every tenant)
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.1)
            # The certificate's tenants scope the answers, as tokens do.
            async with ConductorClient(address=address, security=engine_a) as client:
                assert [n.node_id for n in (await client.lookup(keys=[key])).nodes] == ["node-a"]
                with pytest.raises(PermissionDenied, match="needs role operator"):
                    await client.leader_info()
            async with ConductorClient(address=address, security=engine_a, tenant="a") as client:
                assert (await client.lookup(keys=[key])).best_blocks == 1
            async with ConductorClient(address=address, security=engine_b) as client:
                assert not (await client.lookup(keys=[key])).nodes  # a's chunk: absent to b
            async with ConductorClient(address=address, security=engine_b, tenant="a") as client:
                with pytest.raises(PermissionDenied, match="may not act for tenant 'a'"):
                    await client.lookup(keys=[key])
            peer = ClientSecurity(ca_file=ca_path, cert_file=d_cert, key_file=d_key)
            async with ConductorClient(address=address, security=peer) as client:
                with pytest.raises(PermissionDenied, match="role engine or operator"):
                    await client.lookup(keys=[bytes(16)])

        asyncio.run(scenario())
    finally:
        conductor.stop()
        daemon.stop()


def test_current_principal_inside_a_real_threaded_handler(tmp_path: Path) -> None:
    from concurrent import futures

    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    s_cert, s_key = ca.issue("server").write(tmp_path)
    o_cert, o_key = ca.issue("op", uri="kvtier://operator/alice?tenants=x,y").write(tmp_path)

    def handler(request: bytes, context: object) -> bytes:
        p = current_principal()
        return f"{p.name}|{p.role.value}|{','.join(sorted(p.tenants or ()))}".encode()

    plan = SecureServing(ServerSecurity(cert_file=s_cert, key_file=s_key,
                                        client_ca_file=ca_path), "127.0.0.1", "test")
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=plan.sync_interceptors())
    ident = (lambda b: b)  # noqa: E731
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "kvtier.v1.Conductor", {"Leader": grpc.unary_unary_rpc_method_handler(
            handler, ident, ident)}),))
    port = plan.add_port(server, "127.0.0.1:0")
    server.start()
    try:
        creds = grpc.ssl_channel_credentials(ca_path.read_bytes(), o_key.read_bytes(),
                                             o_cert.read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            got = channel.unary_unary("/kvtier.v1.Conductor/Leader")(b"", timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                channel.unary_unary("/kvtier.v1.Conductor/NoSuchCall")(b"", timeout=10)
        assert got == b"operator/alice|operator|x,y"
        assert refused.value.code() is grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(0)

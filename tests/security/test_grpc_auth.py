"""Authentication and roles on real daemons (child processes, real gRPC over real sockets, real
certificates and tokens), and the principal seen inside a real aio handler."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.errors import ConfigError, PeerUnavailable, PermissionDenied, Unauthenticated
from kvstore.security.config import ClientSecurity, ServerSecurity
from kvstore.security.identity import Role, current_principal
from kvstore.security.server import SecureServing
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.security.pki import make_ca
from tests.support.daemon import DaemonProcess, kvtier

KEY = bytes(range(16))


def _client(address: str, security: ClientSecurity) -> StoreClient:
    return StoreClient.connect(address, StoreClientConfig(
        data_plane=DataPlane.TCP, rpc_timeout_s=10.0, security=security))


@pytest.fixture
def token_daemon(tmp_path: Path):  # type: ignore[no-untyped-def]
    generate_key(tmp_path / "keys", "k1")
    (tmp_path / "keys" / "k1.key").rename(tmp_path / "k1.key")
    daemon = DaemonProcess(tmp_path, "tok", nvme=False, settings={
        "security.token_keys": str(tmp_path / "keys"),
        "security.token_reload_interval_s": "0", "server.shm_channel": "false"})
    daemon.start()
    kid, key = load_signing_key(tmp_path / "k1.key")

    def token_file(name: str, role: Role, tenants: list[str] | None, ttl_s: float = 600,
                   now_s: float | None = None) -> Path:
        path = tmp_path / f"{name}.token"
        path.write_text(mint(key, kid, subject=name, role=role, tenants=tenants, ttl_s=ttl_s,
                             now_s=now_s))
        return path

    yield daemon, token_file
    daemon.stop()


def test_anonymous_engine_and_operator_on_a_token_daemon(token_daemon) -> None:  # type: ignore[no-untyped-def]
    daemon, token_file = token_daemon
    with pytest.raises(Unauthenticated, match="bearer token"):
        _client(daemon.grpc_address, ClientSecurity())
    engine = _client(daemon.grpc_address, ClientSecurity(
        token_file=token_file("eng", Role.ENGINE, ["a"])))
    try:
        # Inline over gRPC: a put over the data plane (TCP here) carries no tenant yet and
        # would belong to the default tenant, which tenant "a" does not see (docs/security.md).
        engine.call("Put", pb.PutRequest(key=KEY, value=b"x" * 100))
        assert engine.lookup([KEY]).length == 1
        for call in (engine.drain, engine.stats, lambda: engine.pin([KEY]),
                     lambda: engine.evict(key_prefix=KEY)):
            with pytest.raises(PermissionDenied, match="role operator"):
                call()
    finally:
        engine.close()
    op = _client(daemon.grpc_address, ClientSecurity(
        token_file=token_file("op", Role.OPERATOR, None)))
    try:
        assert op.stats().node_id == "tok"
        lease = op.pin([KEY])
        assert op.unpin(lease)
    finally:
        op.close()


def test_expired_token_is_refused(token_daemon) -> None:  # type: ignore[no-untyped-def]
    import time

    daemon, token_file = token_daemon
    stale = token_file("old", Role.OPERATOR, None, ttl_s=10, now_s=time.time() - 60)
    with pytest.raises(Unauthenticated, match="expired"):
        _client(daemon.grpc_address, ClientSecurity(token_file=stale))


def test_admin_cli_presents_a_token(token_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    daemon, token_file = token_daemon
    refused = kvtier("stats", "--address", daemon.grpc_address)
    assert refused.returncode == 1 and "Unauthenticated" in refused.stderr
    engine = kvtier("drain", "--address", daemon.grpc_address, "--token-file",
                    str(token_file("e", Role.ENGINE, ["a"])))
    assert engine.returncode == 1 and "PermissionDenied" in engine.stderr
    ok = kvtier("stats", "--json", "--address", daemon.grpc_address, "--token-file",
                str(token_file("o", Role.OPERATOR, None)))
    assert ok.returncode == 0, ok.stderr


def test_mtls_roles_revocation_and_untrusted_client(tmp_path: Path) -> None:
    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    server_cert, server_key = ca.issue("daemon", uri="kvtier://peer/daemon").write(tmp_path)
    engine = ca.issue("engine", uri="kvtier://engine/vllm-0?tenants=a")
    operator = ca.issue("op", uri="kvtier://operator/alice")
    revoked = ca.issue("revoked", uri="kvtier://operator/mallory")
    daemon = DaemonProcess(tmp_path, "mtls", nvme=False, settings={
        "security.cert_file": str(server_cert), "security.key_file": str(server_key),
        "security.client_ca_file": str(ca_path),
        "security.revoked_serials": f"{revoked.serial:x}", "server.shm_channel": "false"})
    daemon.start()
    try:
        def sec(leaf):  # type: ignore[no-untyped-def]
            cert, key = leaf.write(tmp_path)
            return ClientSecurity(ca_file=ca_path, cert_file=cert, key_file=key)

        e = _client(daemon.grpc_address, sec(engine))
        try:
            e.put(KEY, b"y" * 64)
            with pytest.raises(PermissionDenied):
                e.drain()
        finally:
            e.close()
        o = _client(daemon.grpc_address, sec(operator))
        try:
            assert o.stats().node_id == "mtls"
        finally:
            o.close()
        with pytest.raises(Unauthenticated, match="revoked"):
            _client(daemon.grpc_address, sec(revoked))
        stranger = make_ca("another CA").issue("x", uri="kvtier://operator/x")
        with pytest.raises(PeerUnavailable, match=r"TLS handshake did not complete"):
            _client(daemon.grpc_address, sec(stranger))
        with pytest.raises(PeerUnavailable):  # no client certificate at all: no handshake
            _client(daemon.grpc_address, ClientSecurity(ca_file=ca_path))
        # An expired certificate of the right CA: kvtier's client will not present it, and
        # the daemon's handshake refuses it from a raw channel.
        expired = ca.issue("old", uri="kvtier://operator/old", valid_from_s=-7200,
                           valid_for_s=3600)
        with pytest.raises(ConfigError, match="expired"):
            _client(daemon.grpc_address, sec(expired))
        cert, key = expired.write(tmp_path)
        creds = grpc.ssl_channel_credentials(ca_path.read_bytes(), key.read_bytes(),
                                             cert.read_bytes())
        with grpc.secure_channel(daemon.grpc_address, creds) as channel, \
                pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/kvtier.v1.Store/Stats")(b"", timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        daemon.stop()


def test_non_loopback_bind_needs_authentication_or_insecure(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--insecure"):
        SecureServing(ServerSecurity(), "0.0.0.0", "the daemon's gRPC service")
    refused = kvtier("daemon", "--set", "server.host=0.0.0.0", "--set",
                     "dram.capacity_bytes=1MiB", "--set", "dram.prefault=false")
    assert refused.returncode == 2 and "without authentication" in refused.stderr
    daemon = DaemonProcess(tmp_path, "open", nvme=False, dram_bytes="1MiB", settings={
        "server.host": "0.0.0.0", "security.insecure": "true", "dram.prefault": "false"})
    daemon.start()
    try:
        log = daemon.log_path.read_text()
        assert "WITHOUT AUTHENTICATION" in log and "WARNING" in log
    finally:
        daemon.stop()
    loop_daemon = DaemonProcess(tmp_path, "loop", nvme=False, dram_bytes="1MiB",
                                settings={"dram.prefault": "false"})
    loop_daemon.start()
    try:
        assert "loopback only" in loop_daemon.log_path.read_text()
    finally:
        loop_daemon.stop()


def test_current_principal_inside_a_real_aio_handler(tmp_path: Path) -> None:
    """A real grpc.aio server with the daemon's interceptor and a handler that reports
    current_principal(): unary and server-streaming, over a real socket with tokens."""
    priv, _ = generate_key(tmp_path, "k1")
    kid, key = load_signing_key(priv)
    token = mint(key, kid, subject="vllm-7", role=Role.ENGINE, tenants=["t1"], ttl_s=60)
    (tmp_path / "k1.key").unlink()

    def seen() -> bytes:
        p = current_principal()
        return f"{p.name}|{p.role.value}|{','.join(sorted(p.tenants or ()))}".encode()

    async def unary(request: bytes, context: object) -> bytes:
        await asyncio.sleep(0)
        return seen()

    async def stream(request: bytes, context: object):  # type: ignore[no-untyped-def]
        for _ in range(2):
            await asyncio.sleep(0)
            yield seen()

    async def main() -> list[bytes]:
        plan = SecureServing(ServerSecurity(token_keys=tmp_path), "127.0.0.1", "test")
        server = grpc.aio.server(interceptors=plan.aio_interceptors())
        ident = (lambda b: b)  # noqa: E731
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvtier.v1.Store", {
            "Put": grpc.unary_unary_rpc_method_handler(unary, ident, ident),
            "Get": grpc.unary_stream_rpc_method_handler(stream, ident, ident)}),))
        port = plan.add_port(server, "127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                md = (("authorization", f"Bearer {token}"),)
                one = await ch.unary_unary("/kvtier.v1.Store/Put")(b"", metadata=md)
                many = [r async for r in ch.unary_stream("/kvtier.v1.Store/Get")(b"", metadata=md)]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await ch.unary_unary("/kvtier.v1.Store/Put")(b"")
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
                trailing = dict(refused.value.trailing_metadata() or ())
                assert trailing.get("kvtier-error") == "Unauthenticated"
                return [one, *many]
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == [b"vllm-7|engine|t1"] * 3

"""The conductor's mTLS port refuses what the daemon's refuses (the isolation suite's conductor
row: docs/security.md, "mTLS"), against a real conductor process following a real etcd, with a
CA, certificates and a CRL made at run time: no client certificate, one from another CA, an
expired one (presented by a raw channel: kvtier's own client refuses to send it), and a revoked
one (UNAUTHENTICATED naming the serial and the CRL, also once the CRL is rotated under the
running conductor). Each paired with the right certificate's same call succeeding."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvstore._proto.kvtier.v1 import conductor_pb2 as cpb
from kvstore.client.conductor_client import ConductorClient
from kvstore.errors import ConfigError, MembershipError, PeerUnavailable, Unauthenticated
from kvstore.membership.etcd import KeyLayout
from kvstore.security.config import ClientSecurity
from tests.security.pki import Leaf, make_ca
from tests.support.conductor import ConductorProcess


def test_the_conductor_refuses_missing_untrusted_expired_and_revoked_certificates(
        tmp_path: Path, etcd_server: object, etcd_layout: KeyLayout) -> None:
    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    crl = tmp_path / "ca.crl"
    leaves = {"engine": ca.issue("engine", uri="kvtier://engine/vllm-a?tenants=a"),
              "op": ca.issue("op", uri="kvtier://operator/ops"),
              "later": ca.issue("later", uri="kvtier://engine/vllm-l?tenants=a"),
              "revoked": ca.issue("revoked", uri="kvtier://engine/vllm-r?tenants=a"),
              "expired": ca.issue("expired", uri="kvtier://engine/vllm-x?tenants=a",
                                  valid_from_s=-7200, valid_for_s=3600),
              "stranger": make_ca("another CA").issue(
                  "stranger", uri="kvtier://operator/mallory")}
    crl.write_bytes(ca.crl([leaves["revoked"].serial]))
    s_cert, s_key = ca.issue("conductor", uri="kvtier://peer/conductor-1").write(tmp_path)
    conductor = ConductorProcess(
        tmp_path, "c-mtls", etcd_endpoint=etcd_server.client_url,  # type: ignore[attr-defined]
        prefix=etcd_layout.prefix, extra_args=(
            "--tls-cert", str(s_cert), "--tls-key", str(s_key), "--client-ca", str(ca_path),
            "--crl", str(crl)))

    def security(leaf: Leaf) -> ClientSecurity:
        cert, key = leaf.write(tmp_path)
        return ClientSecurity(ca_file=ca_path, cert_file=cert, key_file=key)

    attempts = refused = 0
    try:
        address = conductor.start()

        async def scenario() -> None:
            nonlocal attempts, refused

            async def refuses(sec: ClientSecurity, error: type[Exception] | tuple[
                    type[Exception], ...], match: str) -> None:
                nonlocal attempts, refused
                attempts += 1
                async with ConductorClient(address=address, security=sec,
                                           rpc_timeout_s=3.0) as client:
                    with pytest.raises(error, match=match):
                        await client.lookup(keys=[bytes(16)])
                refused += 1

            # The right identities: an engine's Lookup, an operator's Leader.
            async with ConductorClient(address=address, security=security(leaves["engine"]),
                                       rpc_timeout_s=10.0) as engine:
                assert not (await engine.lookup(keys=[bytes(16)])).nodes
            async with ConductorClient(address=address, security=security(leaves["op"]),
                                       rpc_timeout_s=10.0) as op:
                assert (await op.leader_info()).conductor_id == "c-mtls"
            # No handshake: the client hears a closed socket (no leader answered, with why).
            await refuses(ClientSecurity(ca_file=ca_path), (PeerUnavailable, MembershipError),
                          "Socket closed|TLS handshake")
            await refuses(security(leaves["stranger"]), (PeerUnavailable, MembershipError),
                          "Socket closed|TLS handshake")
            await refuses(security(leaves["revoked"]), Unauthenticated,
                          f"serial {leaves['revoked'].serial:x}\\) is revoked \\(the CRL")
            # Revoked later: the rotated CRL is read under the running conductor.
            async with ConductorClient(address=address, security=security(leaves["later"]),
                                       rpc_timeout_s=10.0) as later:
                assert not (await later.lookup(keys=[bytes(16)])).nodes
            crl.write_bytes(ca.crl([leaves["revoked"].serial, leaves["later"].serial]))
            await asyncio.sleep(1.2)  # past the CRL's re-check interval (1 s by default)
            await refuses(security(leaves["later"]), Unauthenticated, "is revoked")

        asyncio.run(scenario())

        # An expired certificate: kvtier's client will not present it...
        async def expired_client() -> None:
            async with ConductorClient(address=address, security=security(leaves["expired"]),
                                       rpc_timeout_s=3.0) as client:
                await client.lookup(keys=[bytes(16)])

        with pytest.raises(ConfigError, match="expired"):
            asyncio.run(expired_client())
        # ...and the conductor's handshake refuses it from a raw channel.
        attempts += 1
        cert, key = leaves["expired"].write(tmp_path)
        creds = grpc.ssl_channel_credentials(ca_path.read_bytes(), key.read_bytes(),
                                             cert.read_bytes())
        with grpc.secure_channel(address, creds) as channel:
            call = channel.unary_unary("/kvtier.v1.Conductor/Lookup",
                                       request_serializer=cpb.ConductorLookupRequest
                                       .SerializeToString,
                                       response_deserializer=cpb.ConductorLookupReply.FromString)
            with pytest.raises(grpc.RpcError) as err:
                call(cpb.ConductorLookupRequest(keys=[bytes(16)]), timeout=10)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        refused += 1
        assert "certificate has expired" in conductor.log_tail(200)
    finally:
        conductor.stop()
    print(f"conductor mTLS refusals: attempts={attempts} refused={refused}")
    assert attempts == refused == 5

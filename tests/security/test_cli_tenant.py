"""``kvtier ls|inspect|evict --tenant`` against a real token daemon (a child process, real
gRPC, tokens signed at run time): an operator of every tenant scoped to one sees and removes
that tenant's chunks only; an operator scoped to a tenant may not name another; a name that
cannot travel as metadata exits 2."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.support.daemon import DaemonProcess, kvtier_here

ALICE = [bytes([0xC0, 0xA1, i]) + bytes(13) for i in range(3)]
BOB = [bytes([0xC0, 0xB0, i]) + bytes(13) for i in range(2)]
"""Keys of both tenants start with c0: a prefix that names every chunk on the daemon."""


@pytest.fixture
def daemon_and_tokens(tmp_path: Path) -> Iterator[tuple[str, dict[str, Path]]]:
    generate_key(tmp_path / "keys", "k1")
    (tmp_path / "keys" / "k1.key").rename(tmp_path / "k1.key")
    kid, key = load_signing_key(tmp_path / "k1.key")
    tokens = {}
    for name, role, tenants in (("alice-engine", Role.ENGINE, ["alice"]),
                                ("bob-engine", Role.ENGINE, ["bob"]),
                                ("root", Role.OPERATOR, None),
                                ("alice-admin", Role.OPERATOR, ["alice"])):
        tokens[name] = tmp_path / f"{name}.token"
        tokens[name].write_text(mint(key, kid, subject=name, role=role, tenants=tenants,
                                     ttl_s=600))
    daemon = DaemonProcess(tmp_path, "tcli", nvme=False, settings={
        "security.token_keys": str(tmp_path / "keys"), "server.shm_channel": "false"})
    daemon.start()
    try:
        for engine, keys in (("alice-engine", ALICE), ("bob-engine", BOB)):
            client = StoreClient.connect(daemon.grpc_address, StoreClientConfig(
                data_plane=DataPlane.TCP, rpc_timeout_s=10.0,
                security=ClientSecurity(token_file=tokens[engine])))
            try:  # inline over gRPC: the data planes carry no tenant yet
                for k in keys:
                    client.call("Put", pb.PutRequest(key=k, value=k * 8))
            finally:
                client.close()
        yield daemon.grpc_address, tokens
    finally:
        daemon.stop()


def _ls(address: str, token: Path, *tenant: str) -> list[str]:
    result = kvtier_here("ls", "--address", address, "--token-file", str(token), "--json",
                         *tenant)
    assert result.returncode == 0, result.stderr
    return [e["key"] for e in json.loads(result.stdout)["entries"]]


def test_tenant_scopes_ls_inspect_and_evict(
        daemon_and_tokens: tuple[str, dict[str, Path]]) -> None:
    address, tokens = daemon_and_tokens
    root = tokens["root"]
    assert _ls(address, root) == sorted(k.hex() for k in ALICE + BOB)
    assert _ls(address, root, "--tenant", "alice") == sorted(k.hex() for k in ALICE)
    assert _ls(address, root, "--tenant", "bob") == sorted(k.hex() for k in BOB)
    assert _ls(address, root, "--tenant", "nobody") == []

    seen = kvtier_here("inspect", BOB[0].hex(), "--address", address, "--token-file", str(root),
                       "--tenant", "bob", "--json")
    assert seen.returncode == 0 and json.loads(seen.stdout)["key"] == BOB[0].hex()
    hidden = kvtier_here("inspect", BOB[0].hex(), "--address", address, "--token-file",
                         str(root), "--tenant", "alice")
    assert hidden.returncode == 1 and "ChunkNotFound" in hidden.stderr

    # Evict by prefix scoped to alice removes none of bob's chunks, with a prefix of all.
    evicted = kvtier_here("evict", "--address", address, "--token-file", str(root),
                          "--tenant", "alice", "--prefix", "c0", "--json")
    assert evicted.returncode == 0, evicted.stderr
    assert json.loads(evicted.stdout)["removed_chunks"] == len(ALICE)
    assert _ls(address, root) == sorted(k.hex() for k in BOB)


def test_a_scoped_operator_may_not_name_another_tenant(
        daemon_and_tokens: tuple[str, dict[str, Path]]) -> None:
    address, tokens = daemon_and_tokens
    admin = tokens["alice-admin"]
    assert _ls(address, admin) == sorted(k.hex() for k in ALICE)  # its one tenant
    assert _ls(address, admin, "--tenant", "alice") == sorted(k.hex() for k in ALICE)
    refused = kvtier_here("ls", "--address", address, "--token-file", str(admin),
                          "--tenant", "bob")
    assert refused.returncode == 1
    assert "PermissionDenied" in refused.stderr and "tenant 'bob'" in refused.stderr


@pytest.mark.parametrize("bad", ["caf\u00e9", "x" * 129])
def test_a_bad_tenant_name_exits_2(daemon_and_tokens: tuple[str, dict[str, Path]],
                                   bad: str) -> None:
    address, tokens = daemon_and_tokens
    result = kvtier_here("ls", "--address", address, "--token-file", str(tokens["root"]),
                         "--tenant", bad)
    assert result.returncode == 2
    assert "InvalidArgument" in result.stderr and "tenant must be" in result.stderr

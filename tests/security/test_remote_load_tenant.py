"""A KVClient's loads from another node's daemon act for the client's tenant (the regression of
commit 99c14ed: the remote StoreClientConfig lacked ``tenant=``, so such a load ran as "the
credentials' only tenant", which credentials of several tenants do not have).

Two real token daemons in separate processes (tokens minted at run time). Alice and bob, each
with a credential of their own tenant, save chunks on node-b in one key namespace. An engine
whose credential names both tenants, configured ``KVClientConfig(tenant="alice")`` on node-a,
loads alice's blocks from node-b bit for bit, over TCP and over shared memory, and the same
client cannot load bob's (absent to alice: nothing arrives, nothing is leaked into its buffer).
The daemons run without the lease-free read index (every same-host read takes the checked lease
path) and with it (the default): then the shared-memory reader copies alice's blocks with no
lease (the lease-free counters move) and treats bob's, whose slots carry bob's owner tag, as
misses that the leased path refuses (docs/security.md, "Same host").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ContiguousKV  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.security.config import ClientSecurity  # noqa: E402
from kvstore.security.identity import Role  # noqa: E402
from kvstore.security.tokens import generate_key, load_signing_key, mint  # noqa: E402
from tests.support.daemon import DaemonProcess, running  # noqa: E402

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
B = LAYOUT.block_tokens
NAMESPACE = namespace_for(LAYOUT, "m", "common")
"""One key namespace for everyone: the store tenant, not the key, is the boundary."""
BLOCKS = 4


@pytest.fixture(scope="module", params=[False, True], ids=["leased", "read-index"])
def world(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
          ) -> Iterator[tuple[DaemonProcess, DaemonProcess, dict[str, Path]]]:
    work = tmp_path_factory.mktemp("remote-load-tenant")
    generate_key(work / "keys", "k1")
    (work / "keys" / "k1.key").rename(work / "k1.key")
    kid, signing = load_signing_key(work / "k1.key")
    tokens: dict[str, Path] = {}
    for name, tenants in (("alice", ["alice"]), ("bob", ["bob"]), ("duo", ["alice", "bob"])):
        tokens[name] = work / f"{name}.token"
        tokens[name].write_text(mint(signing, kid, subject=name, role=Role.ENGINE,
                                     tenants=tenants, ttl_s=3600))
    settings = {"security.token_keys": str(work / "keys"),
                "security.token_reload_interval_s": "0", "server.shm_channel": "true",
                "dram.read_index": "true" if request.param else "false"}
    a = DaemonProcess(work, "node-a", dram_bytes="8MiB", nvme=False, settings=settings)
    b = DaemonProcess(work, "node-b", dram_bytes="8MiB", nvme=False, settings=settings)
    with running(a, b):
        yield a, b, tokens


def _client(daemon: DaemonProcess, token: Path, tenant: str | None = None,
            remote_plane: DataPlane = DataPlane.AUTO) -> KVClient:
    return KVClient.connect(daemon.grpc_address, LAYOUT, NAMESPACE, KVClientConfig(
        security=ClientSecurity(token_file=token), tenant=tenant,
        remote_data_plane=remote_plane))


def _kv(seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, BLOCKS * B, LAYOUT.head_dim),
                     generator=g).to(LAYOUT.dtype)
    return kv, torch.randint(0, 50_000, (BLOCKS * B,), generator=g).tolist()


@pytest.mark.parametrize("plane", [DataPlane.TCP, DataPlane.AUTO], ids=["tcp", "shm"])
def test_a_remote_load_acts_for_the_clients_tenant(
        world: tuple[DaemonProcess, DaemonProcess, dict[str, Path]], plane: DataPlane) -> None:
    a, b, tokens = world
    seed = 10 if plane is DataPlane.TCP else 20
    alice_kv, alice_tokens = _kv(seed)
    bob_kv, bob_tokens = _kv(seed + 1)
    with _client(b, tokens["alice"]) as alice, _client(b, tokens["bob"]) as bob:
        assert alice.save(alice_tokens, ContiguousKV(alice_kv, LAYOUT)).result(30) \
            .stored_blocks == tuple(range(BLOCKS))
        assert bob.save(bob_tokens, ContiguousKV(bob_kv, LAYOUT)).result(30) \
            .stored_blocks == tuple(range(BLOCKS))
    with _client(a, tokens["duo"], tenant="alice", remote_plane=plane) as engine:
        # Alice's blocks, from the other node: all of them, bit for bit.
        out = torch.zeros_like(alice_kv)
        got = engine.load_from(b.grpc_address, alice_tokens, ContiguousKV(out, LAYOUT)).result(30)
        assert got.error is None, got.error
        assert got.complete and got.loaded_blocks == got.remote_blocks == BLOCKS
        assert torch.equal(out, alice_kv)
        remote = engine._remote_store(b.grpc_address)
        assert remote.data_plane is (DataPlane.SHM if plane is DataPlane.AUTO else DataPlane.TCP)
        lease_free = remote.lease_free_counters()
        if plane is DataPlane.AUTO and remote.info.shm_read_index:
            assert lease_free.hits >= BLOCKS  # alice's came with no lease
        else:
            assert lease_free.hits == 0
        # Bob's, by their keys, from the same node and the same client: none arrive.
        assert engine.lookup(bob_tokens, address=b.grpc_address).blocks == 0
        out = torch.zeros_like(bob_kv)
        got = engine.load_from(b.grpc_address, bob_tokens, ContiguousKV(out, LAYOUT)).result(30)
        assert got.loaded_blocks == got.remote_blocks == 0
        assert got.failed_blocks == tuple(range(BLOCKS))
        assert not out.any()
        assert remote.lease_free_counters().hits == lease_free.hits  # none of bob's
    # Bob still reads his own (nothing was taken or replaced).
    with _client(b, tokens["bob"]) as bob:
        out = torch.zeros_like(bob_kv)
        assert bob.load(bob_tokens, ContiguousKV(out, LAYOUT)).result(30).complete
        assert torch.equal(out, bob_kv)

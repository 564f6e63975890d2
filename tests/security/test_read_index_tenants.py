"""Same-host lease-free reads refuse another tenant's chunk (issue 15): against a real daemon
with bearer tokens, session tickets and its read index on (the default), clients of real
shared memory.

The defect this pins: the read index knew no tenant, so a tenant-scoped client on the daemon's
host copied another tenant's chunks straight out of the arena by key (``KVClient(tenant=
"alice").load`` of bob's blocks: all four arrived), while the leased path refuses them. Now each
slot carries its owner's tag and a ticketed reader copies only its tenant's and the shared
tenant's chunks; any other is a miss here and goes to the leased path, whose tenant check
answers absent. Every refusal is paired with the same client reading its own and the shared
chunks byte for byte *through the lease-free path* (the lease-free hit counters move), so the
test cannot pass by turning the fast path off. A daemon without security (no tickets) is
unscoped, as before. docs/security.md, "Same host".
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.store_client import StoreClient, StoreClientConfig
from kvstore.client.store_config import DataPlane
from kvstore.errors import ChunkExists, ChunkNotFound
from kvstore.security.config import ClientSecurity
from kvstore.security.tenancy import SHARED_TENANT
from tests.security.secured_daemon import SecuredDaemon, start_secured_daemon
from tests.support.daemon import DaemonProcess

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ContiguousKV  # noqa: E402
from kvstore.client.requests import LoadRequest  # noqa: E402

SIZES = (4096, 64 << 10, 200 << 10)


def _values(tag: int) -> dict[bytes, bytes]:
    return {bytes([tag]) * 8 + i.to_bytes(8, "big"): os.urandom(size)
            for i, size in enumerate(SIZES)}


ALICE, BOB, SHARED = _values(0xA1), _values(0xB0), _values(0x5A)

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
B = LAYOUT.block_tokens
NAMESPACE = namespace_for(LAYOUT, "m", "common")
"""One key namespace for everyone: the store tenant, not the key, is the boundary."""
BLOCKS = 4


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredDaemon]:
    w = start_secured_daemon(tmp_path_factory.mktemp("ri-tenants"), "ri-tenants", shm=True,
                             settings={"dram.capacity_bytes": "64MiB"})
    try:
        alice = w.client("alice", DataPlane.SHM)
        bob = w.client("bob", DataPlane.SHM)
        shared = w.client("sys", DataPlane.SHM, tenant=SHARED_TENANT)
        for client, values in ((alice, ALICE), (bob, BOB), (shared, SHARED)):
            for key, value in values.items():
                client.put(key, value)
        yield w
    finally:
        w.close()


@pytest.fixture(params=["native", "python"])
def reader_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _scoped(world: SecuredDaemon, name: str, kind: str, **kwargs: object) -> StoreClient:
    client = world.client(name, DataPlane.SHM, **kwargs)
    assert client.data_plane is DataPlane.SHM and client.info.shm_read_index
    reader = client.plane.reader  # type: ignore[attr-defined]
    assert reader is not None, "the read index is on: lease-free reads must be tried"
    if kind == "python":
        reader.use_extension(None)
    elif not reader.native:
        pytest.skip("the native extension is not built")
    return client


def _get(client: StoreClient, key: bytes, size: int) -> np.ndarray:
    out = np.zeros(size, dtype=np.uint8)
    assert client.get_into(key, out) == size
    return out


def test_a_store_client_reads_its_own_and_shared_chunks_lease_free_and_never_anothers(
        world: SecuredDaemon, reader_kind: str) -> None:
    alice = _scoped(world, "alice", reader_kind)
    assert alice.plane.reader.owners == ("alice", SHARED_TENANT)  # type: ignore[attr-defined]
    before = alice.lease_free_counters()
    for key, value in (ALICE | SHARED).items():
        assert _get(alice, key, len(value)).tobytes() == value
    mid = alice.lease_free_counters()
    assert mid.hits == before.hits + len(ALICE) + len(SHARED)  # none of them took a lease
    for key, value in BOB.items():
        out = np.zeros(len(value), dtype=np.uint8)
        with pytest.raises(ChunkNotFound):
            alice.get_into(key, out)
        assert not out.any()  # not one byte of bob's arrived
    after = alice.lease_free_counters()
    assert after.hits == mid.hits  # bob's were never copied lease-free...
    assert after.misses == mid.misses + len(BOB)  # ...but missed there, then refused leased
    # Bob reads his own lease-free, and none of alice's.
    bob = _scoped(world, "bob", reader_kind)
    hits = bob.lease_free_counters().hits
    for key, value in BOB.items():
        assert _get(bob, key, len(value)).tobytes() == value
    assert bob.lease_free_counters().hits == hits + len(BOB)
    for key, value in ALICE.items():
        with pytest.raises(ChunkNotFound):
            bob.get_into(key, np.zeros(len(value), dtype=np.uint8))


def _kv(seed: int) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, BLOCKS * B, LAYOUT.head_dim),
                     generator=g).to(LAYOUT.dtype)
    return kv, torch.randint(0, 50_000, (BLOCKS * B,), generator=g).tolist()


class _OneCopyCounted:
    """A layout whose one-copy scatters (``ShmClient.read_free``'s lease-free views, the
    KVClient load path of commit 529c0e4) are counted."""

    def __init__(self, inner: ContiguousKV) -> None:
        self._inner = inner
        self.one_copy_blocks = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    def scatter_chunks(self, layers: range, blocks: range, chunks: object) -> None:
        self.one_copy_blocks += len(blocks)
        self._inner.scatter_chunks(layers, blocks, chunks)  # type: ignore[arg-type]


def _kv_client(world: SecuredDaemon, name: str, tenant: str | None = None) -> KVClient:
    return KVClient.connect(world.address, LAYOUT, NAMESPACE, KVClientConfig(
        security=ClientSecurity(token_file=world.tokens[name]), tenant=tenant))


def test_the_reproduction_a_kv_client_loads_no_block_of_another_tenant_on_its_host(
        world: SecuredDaemon) -> None:
    """The exact reproduction: alice's KVClient ``load`` of bob's four blocks on the same
    host, read index on. Before: all four arrived in alice's buffer. Now: none."""
    alice_kv, alice_tokens = _kv(30)
    bob_kv, bob_tokens = _kv(31)
    shared_kv, shared_tokens = _kv(32)
    for name, tenant, kv, toks in (("alice", None, alice_kv, alice_tokens),
                                   ("bob", None, bob_kv, bob_tokens),
                                   ("sys", SHARED_TENANT, shared_kv, shared_tokens)):
        with _kv_client(world, name, tenant) as writer:
            assert writer.save(toks, ContiguousKV(kv, LAYOUT)).result(30).stored_blocks \
                == tuple(range(BLOCKS))
    with _kv_client(world, "alice", "alice") as alice:
        assert alice.store.data_plane is DataPlane.SHM and alice.store.info.shm_read_index
        for kv, toks in ((alice_kv, alice_tokens), (shared_kv, shared_tokens)):
            hits = alice.store.lease_free_counters().hits
            out = torch.zeros_like(kv)
            into = _OneCopyCounted(ContiguousKV(out, LAYOUT))
            (handle,) = alice.load_many([LoadRequest(toks, into)])  # type: ignore[arg-type]
            got = handle.result(30)
            assert got.error is None and got.complete and got.loaded_blocks == BLOCKS
            assert torch.equal(out, kv)
            # Every block came through the one-copy lease-free path (read_free).
            assert into.one_copy_blocks == BLOCKS
            assert alice.store.lease_free_counters().hits >= hits + BLOCKS
        hits = alice.store.lease_free_counters().hits
        out = torch.zeros_like(bob_kv)
        into = _OneCopyCounted(ContiguousKV(out, LAYOUT))
        (handle,) = alice.load_many([LoadRequest(bob_tokens, into)])  # type: ignore[arg-type]
        got = handle.result(30)
        assert got.loaded_blocks == 0
        assert not out.any()  # nothing of bob's in alice's buffer
        assert into.one_copy_blocks == 0
        assert alice.store.lease_free_counters().hits == hits
        # Nor by a lookup-free load_from of the same daemon.
        got = alice.load_from(world.address, bob_tokens, ContiguousKV(out, LAYOUT)).result(30)
        assert got.loaded_blocks == 0 and not out.any()
    # Bob still loads his own, bit for bit.
    with _kv_client(world, "bob") as bob:
        out = torch.zeros_like(bob_kv)
        assert bob.load(bob_tokens, ContiguousKV(out, LAYOUT)).result(30).complete
        assert torch.equal(out, bob_kv)


@pytest.fixture(scope="module")
def insecure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("ri-insecure"), "ri-insecure", dram_bytes="16MiB",
                      nvme=False, settings={"server.shm_channel": "true"})
    d.start()
    yield d
    d.stop()


def test_an_unscoped_client_reads_as_before(insecure: DaemonProcess) -> None:
    """Without security there are no tickets and no scope: a client reads every published
    chunk lease-free, whoever's tenant wrote it (the tenant there is a label, not a check)."""
    def connect(tenant: str) -> StoreClient:
        return StoreClient.connect(insecure.grpc_address, StoreClientConfig(
            data_plane=DataPlane.SHM, tenant=tenant))

    with connect("bob") as bob, connect("alice") as alice:
        for key, value in BOB.items():
            bob.put(key, value)
        assert alice.plane.reader is not None  # type: ignore[attr-defined]
        assert alice.plane.reader.owners is None  # type: ignore[attr-defined]
        hits = alice.lease_free_counters().hits
        for key, value in BOB.items():
            assert _get(alice, key, len(value)).tobytes() == value
        assert alice.lease_free_counters().hits == hits + len(BOB)


def test_tickets_name_the_owners_a_session_reads(world: SecuredDaemon) -> None:
    from kvstore.security.tenancy import readable_owners

    assert readable_owners(world.ticket("alice")) == ("alice", SHARED_TENANT)
    assert readable_owners(world.ticket("sys", tenant=SHARED_TENANT)) == (SHARED_TENANT,)
    assert readable_owners(world.ticket("op")) is None  # an operator of every tenant
    # A session that may read the shared tenant but not write it says it writes as "" (as a
    # default-tenant one does): it reads only shared chunks lease-free, never the default's.
    assert readable_owners(pb.IssueDataTicketResponse(tenant="", every_tenant=False)) \
        == (SHARED_TENANT,)



DEFAULT = _values(0xDE)


def test_a_default_tenant_session_reads_its_own_chunks_lease_free(
        world: SecuredDaemon, reader_kind: str) -> None:
    """A session acting for the default tenant (an operator, or an engine of every tenant,
    naming ``""``) copies the default tenant's chunks and the shared ones lease-free, and
    another tenant's never: its ticket's claims say what it reads (the reply alone, which
    names the tenant it writes as, cannot tell it from a shared-only reader). Before, every
    read of its own chunks missed the read index and took a lease."""
    from kvstore.security.tenancy import readable_owners

    assert readable_owners(world.ticket("op", tenant="")) == ("", SHARED_TENANT)
    # Paired: the shared-only reader (named the shared tenant, may not write it) stays so.
    shared_only = world.ticket("op", tenant=SHARED_TENANT)
    assert shared_only.tenant == "" and readable_owners(shared_only) == (SHARED_TENANT,)
    op = _scoped(world, "op", reader_kind, tenant="")
    for key, value in DEFAULT.items():
        with contextlib.suppress(ChunkExists):  # stored by the other reader_kind's run
            op.put(key, value)
    assert op.plane.reader.owners == ("", SHARED_TENANT)  # type: ignore[attr-defined]
    before = op.lease_free_counters()
    for key, value in (DEFAULT | SHARED).items():
        assert _get(op, key, len(value)).tobytes() == value
    mid = op.lease_free_counters()
    assert mid.hits == before.hits + len(DEFAULT) + len(SHARED)  # none took a lease
    for key, value in ALICE.items():
        out = np.zeros(len(value), dtype=np.uint8)
        with pytest.raises(ChunkNotFound):
            op.get_into(key, out)
        assert not out.any()
    assert op.lease_free_counters().hits == mid.hits
    # Alice does not read the default tenant's chunks, lease-free or leased.
    alice = _scoped(world, "alice", reader_kind)
    for key, value in DEFAULT.items():
        with pytest.raises(ChunkNotFound):
            alice.get_into(key, np.zeros(len(value), dtype=np.uint8))

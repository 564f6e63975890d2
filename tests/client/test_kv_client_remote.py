"""KVClient loads from another node's daemon: two real daemon processes, a fetch plan, the
other node killed or evicting, replication into the own daemon, and node ids through etcd."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conductor.scheduler import FetchPlan  # noqa: E402
from kvstore._proto.kvtier.v1 import conductor_pb2  # noqa: E402
from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ContiguousKV  # noqa: E402
from kvstore.client.requests import LoadRequest, RemoteFetch, SaveRequest  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.dataplane.tier import TierKind  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.membership.etcd import KeyLayout  # noqa: E402
from kvstore.membership.launcher import LocalEtcd  # noqa: E402
from tests.support.daemon import DaemonProcess, running  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
B = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess,
                                                                        DaemonProcess]]:
    """Node A (the engine's own daemon) and node B (another node)."""
    work = tmp_path_factory.mktemp("kv-remote")
    a = DaemonProcess(work, "node-a", dram_bytes="8MiB", nvme=False)
    b = DaemonProcess(work, "node-b", dram_bytes="8MiB", nvme=False)
    with running(a, b):
        yield a, b


def client(daemon: DaemonProcess, tenant: str, *, remote_plane: DataPlane = DataPlane.TCP,
           batch: int = 32, replicate: bool = False) -> KVClient:
    return KVClient.connect(daemon.grpc_address, LAYOUT, namespace_for(LAYOUT, "m", tenant),
                            KVClientConfig(load_batch_blocks=batch,
                                           remote_data_plane=remote_plane,
                                           replicate_remote=replicate))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_kv(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n_tokens, LAYOUT.head_dim),
                       generator=g).to(LAYOUT.dtype)


@pytest.mark.parametrize("plane", [DataPlane.TCP, DataPlane.AUTO])
def test_load_from_another_node_is_bit_exact(nodes: tuple[DaemonProcess, DaemonProcess],
                                             plane: DataPlane) -> None:
    a, b = nodes
    kv, toks = random_kv(5 * B + 3, seed=1), tokens(5 * B + 3, seed=1)
    tenant = f"exact-{plane.value}"
    with client(b, tenant) as on_b:  # an engine on node B saved the prefix there
        assert on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30).stored_blocks == \
            (0, 1, 2, 3, 4)
    with client(a, tenant, remote_plane=plane) as engine:
        assert engine.lookup(toks).blocks == 0  # A has never seen it
        assert engine.lookup(toks, address=b.grpc_address).blocks == 5
        out = torch.zeros_like(kv)
        handle = engine.load_from(b.grpc_address, toks, ContiguousKV(out, LAYOUT))
        for layer in range(LAYOUT.num_layers):
            handle.wait_for_layer(layer, timeout_s=30)
        got = handle.result(30)
        assert got.complete and got.loaded_blocks == got.remote_blocks == 5
        assert got.remote_node == b.grpc_address
        assert torch.equal(out[:, :, :, :5 * B], kv[:, :, :, :5 * B])
        assert handle.replication(30) is None  # not asked for
        # One connection per remote address, kept: same host, so AUTO means shared memory.
        assert engine.remote_addresses == [b.grpc_address]
        remote = engine._remote_store(b.grpc_address)
        assert remote.data_plane is (DataPlane.SHM if plane is DataPlane.AUTO else DataPlane.TCP)
        engine.load_from(b.grpc_address, toks, ContiguousKV(torch.zeros_like(kv), LAYOUT),
                         first_block=2, num_blocks=2).result(30)
        assert engine._remote_store(b.grpc_address) is remote
        assert engine.lookup(toks).blocks == 0  # nothing was replicated


def test_local_prefix_then_the_plan_fills_the_rest_from_the_other_node(
        nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    kv, toks = random_kv(6 * B, seed=2), tokens(6 * B, seed=2)
    with client(b, "plan") as on_b, client(a, "plan") as engine:
        on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        engine.save(toks[:2 * B], ContiguousKV(kv[:, :, :, :2 * B], LAYOUT)).result(30)
        assert engine.lookup(toks).blocks == 2
        # The conductor's reply carries the source's address; the scheduler's dataclass does not.
        reply_plan = conductor_pb2.FetchPlan(src_node="node-b", dst_node="node-a", first_block=2,
                                             end_block=6, src_grpc_address=b.grpc_address)
        for plan in (RemoteFetch.from_plan(reply_plan),
                     RemoteFetch.from_plan(FetchPlan("node-b", "node-a", 2, 6, 0),
                                           address=b.grpc_address)):
            out = torch.zeros_like(kv)
            got = engine.load(toks, ContiguousKV(out, LAYOUT), remote=plan).result(30)
            assert got.complete and got.loaded_blocks == 6 and got.remote_blocks == 4
            assert torch.equal(out, kv)
        # A plan that ends early: blocks past it are not asked of anyone.
        short = RemoteFetch("node-b", b.grpc_address, 2, 4)
        got = engine.load(toks, ContiguousKV(torch.zeros_like(kv), LAYOUT), remote=short)
        assert got.result(30).loaded_blocks == 4 and got.result(30).failed_blocks == (4, 5)


def test_replication_puts_the_fetched_blocks_into_the_own_daemon(
        nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    kv, toks = random_kv(4 * B, seed=3), tokens(4 * B, seed=3)
    with client(b, "repl") as on_b, client(a, "repl", replicate=True) as engine:
        on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        engine.save(toks[:B], ContiguousKV(kv[:, :, :, :B], LAYOUT)).result(30)
        handle = engine.load(toks, ContiguousKV(torch.zeros_like(kv), LAYOUT),
                             remote=RemoteFetch("node-b", b.grpc_address, 1, 4))
        assert handle.result(30).remote_blocks == 3
        replicated = handle.replication(30)
        assert replicated is not None and replicated.stored_blocks == (1, 2, 3)
        assert engine.lookup(toks).by_tier == {TierKind.DRAM: 4}
        out = torch.zeros_like(kv)
        again = engine.load(toks, ContiguousKV(out, LAYOUT)).result(30)  # all local now
        assert again.complete and again.remote_blocks == 0 and torch.equal(out, kv)


def test_blocks_the_other_node_evicted_are_reported_failed(
        nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    kv, toks = random_kv(5 * B, seed=4), tokens(5 * B, seed=4)
    with client(b, "evicted") as on_b, client(a, "evicted") as engine:
        on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        on_b.store.remove(on_b.keys(toks)[3])  # B evicts block 3 (and 4 under it)
        out = torch.zeros_like(kv)
        got = engine.load_from(b.grpc_address, toks, ContiguousKV(out, LAYOUT)).result(30)
        assert got.loaded_blocks == 3 and got.failed_blocks == (3, 4) and got.error is None
        assert torch.equal(out[:, :, :, :3 * B], kv[:, :, :, :3 * B])


def test_bad_plans_are_rejected() -> None:
    with pytest.raises(InvalidArgument):
        RemoteFetch("", "", 0, 1)
    with pytest.raises(InvalidArgument):
        RemoteFetch("n", "", 3, 2)


def test_the_other_node_killed_mid_load_then_gone(tmp_path: Path,
                                                  nodes: tuple[DaemonProcess, DaemonProcess]
                                                  ) -> None:
    a, _b = nodes
    doomed = DaemonProcess(tmp_path, "node-doomed", dram_bytes="4MiB", nvme=False)
    doomed.start()
    try:
        kv, toks = random_kv(6 * B, seed=5), tokens(6 * B, seed=5)
        with client(doomed, "doomed") as on_c:
            on_c.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        with client(a, "doomed", batch=2) as engine:
            seen: list[int] = []

            def progress(n: int) -> None:
                seen.append(n)
                if len(seen) == 1:
                    doomed.kill()  # SIGKILL after the first batch of 2 blocks arrived

            out = torch.zeros_like(kv)
            handle = engine.load_from(doomed.grpc_address, toks, ContiguousKV(out, LAYOUT),
                                      on_blocks_fetched=progress)
            handle.wait_for_layer(LAYOUT.num_layers - 1, timeout_s=30)  # never hangs
            got = handle.result(30)
            assert seen == [2]
            assert got.loaded_blocks == 2 and got.failed_blocks == (2, 3, 4, 5)
            assert got.error is not None and "PeerUnavailable" in got.error
            assert torch.equal(out[:, :, :, :2 * B], kv[:, :, :, :2 * B])
            assert engine.remote_addresses == []  # the dead connection was dropped
            # Gone for good: connecting fails at once and is reported, not raised.
            gone = engine.load(toks, ContiguousKV(torch.zeros_like(kv), LAYOUT),
                               remote=RemoteFetch("node-doomed", doomed.grpc_address, 0, 6))
            later = gone.result(30)
            assert later.loaded_blocks == 0 and later.failed_blocks == tuple(range(6))
            assert later.error is not None and "PeerUnavailable" in later.error
    finally:
        doomed.stop()


def test_node_ids_resolve_through_etcd(tmp_path: Path, etcd_server: LocalEtcd,
                                       etcd_layout: KeyLayout) -> None:
    a = DaemonProcess(tmp_path, "node-ea", dram_bytes="4MiB", nvme=False,
                      etcd_endpoint=etcd_server.client_url, etcd_prefix=etcd_layout.prefix)
    b = DaemonProcess(tmp_path, "node-eb", dram_bytes="4MiB", nvme=False,
                      etcd_endpoint=etcd_server.client_url, etcd_prefix=etcd_layout.prefix)
    a.start()
    b.start()
    try:
        kv, toks = random_kv(3 * B, seed=6), tokens(3 * B, seed=6)
        ns = namespace_for(LAYOUT, "m", "etcd")
        with KVClient.from_etcd(etcd_server.client_url, LAYOUT, ns, node_id="node-eb",
                                key_layout=etcd_layout) as on_b:
            on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        with KVClient.from_etcd(etcd_server.client_url, LAYOUT, ns, node_id="node-ea",
                                key_layout=etcd_layout) as engine:
            assert engine.node_address("node-eb") == b.grpc_address
            out = torch.zeros_like(kv)
            got = engine.load(toks, ContiguousKV(out, LAYOUT),
                              remote=RemoteFetch("node-eb", "", 0, 3)).result(30)
            assert got.complete and got.remote_blocks == 3 and torch.equal(out, kv)
            nobody = engine.load(toks, ContiguousKV(torch.zeros_like(kv), LAYOUT),
                                 remote=RemoteFetch("node-nobody", "", 0, 3)).result(30)
            assert nobody.loaded_blocks == 0
            assert nobody.error is not None and "MembershipError" in nobody.error
    finally:
        a.stop()
        b.stop()


def test_own_daemon_dead_the_plan_still_loads_from_the_other_node(
        tmp_path: Path, nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    _a, b = nodes
    own = DaemonProcess(tmp_path, "node-own", dram_bytes="4MiB", nvme=False)
    own.start()
    try:
        kv, toks = random_kv(3 * B, seed=7), tokens(3 * B, seed=7)
        with client(b, "own-dead") as on_b:
            on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        with client(own, "own-dead") as engine:
            own.kill()
            out = torch.zeros_like(kv)
            got = engine.load(toks, ContiguousKV(out, LAYOUT),
                              remote=RemoteFetch("node-b", b.grpc_address, 0, 3)).result(30)
            assert got.complete and got.remote_blocks == 3 and got.error is None
            assert torch.equal(out, kv)
    finally:
        own.stop()


def test_replication_without_the_parent_locally_fails_and_says_so(
        nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    kv, toks = random_kv(4 * B, seed=8), tokens(4 * B, seed=8)
    with client(b, "repl-orphan") as on_b, client(a, "repl-orphan") as engine:
        on_b.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        # Blocks 0-1 are the engine's own (not in A): the fetched block 2 has no parent in A.
        handle = engine.load_from(b.grpc_address, toks, ContiguousKV(torch.zeros_like(kv),
                                                                     LAYOUT),
                                  first_block=2, replicate=True)
        assert handle.result(30).loaded_blocks == 2 and handle.transferred_remote() == 2
        replicated = handle.replication(30)
        assert replicated is not None and replicated.stored_blocks == ()
        assert replicated.failed_blocks == (2, 3) and "InvalidArgument" in str(replicated.error)
        assert engine.lookup(toks).blocks == 0


def test_concurrent_remote_loads_share_one_connection(
        nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    kvs = [random_kv(2 * B, seed=20 + i) for i in range(6)]
    toks = [tokens(2 * B, seed=20 + i) for i in range(6)]
    with client(b, "shared-conn") as on_b:
        on_b.save_many([SaveRequest(t, ContiguousKV(kv, LAYOUT))
                        for t, kv in zip(toks, kvs, strict=True)]).result(30)
    config = KVClientConfig(workers=4, remote_data_plane=DataPlane.TCP)
    with KVClient.connect(a.grpc_address, LAYOUT, namespace_for(LAYOUT, "m", "shared-conn"),
                          config) as engine:
        outs = [torch.zeros_like(kv) for kv in kvs]
        handles = [engine.load_from(b.grpc_address, t, ContiguousKV(o, LAYOUT))
                   for t, o in zip(toks, outs, strict=True)]
        assert all(h.result(30).complete for h in handles)
        assert all(torch.equal(o, kv) for o, kv in zip(outs, kvs, strict=True))
        assert engine.remote_addresses == [b.grpc_address]
        assert [m.blocks for m in engine.lookup_many(toks, address=b.grpc_address)] == [2] * 6
        assert [m.blocks for m in engine.lookup_many(toks)] == [0] * 6


def test_load_many_mixes_local_requests_and_fetch_plans(
        nodes: tuple[DaemonProcess, DaemonProcess]) -> None:
    a, b = nodes
    kvs = [random_kv(3 * B, seed=30 + i) for i in range(3)]
    toks = [tokens(3 * B, seed=30 + i) for i in range(3)]
    with client(b, "mixed-step") as on_b, client(a, "mixed-step") as engine:
        engine.save(toks[0], ContiguousKV(kvs[0], LAYOUT)).result(30)  # local
        on_b.save(toks[1], ContiguousKV(kvs[1], LAYOUT)).result(30)  # only on B
        engine.save(toks[2][:B], ContiguousKV(kvs[2][:, :, :, :B], LAYOUT)).result(30)
        on_b.save(toks[2], ContiguousKV(kvs[2], LAYOUT)).result(30)  # 1 local, 3 on B
        outs = [torch.zeros_like(kv) for kv in kvs]
        handles = engine.load_many([
            LoadRequest(toks[0], ContiguousKV(outs[0], LAYOUT)),
            LoadRequest(toks[1], ContiguousKV(outs[1], LAYOUT),
                        remote=RemoteFetch("node-b", b.grpc_address, 0, 3)),
            LoadRequest(toks[2], ContiguousKV(outs[2], LAYOUT),
                        remote=RemoteFetch("node-b", b.grpc_address, 1, 3))])
        got = [h.result(30) for h in handles]
        assert [r.loaded_blocks for r in got] == [3, 3, 3]
        assert [r.remote_blocks for r in got] == [0, 3, 2]
        assert all(torch.equal(o, kv) for o, kv in zip(outs, kvs, strict=True))

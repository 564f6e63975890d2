"""KVClient against a real daemon process (shared memory and TCP) and a real etcd: engine
layouts round-trip bit for bit, layer-wise saves, partial results, discovery."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.discovery import choose_node  # noqa: E402
from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ChunkKV, ContiguousKV, PagedKV  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.dataplane.tier import TierKind  # noqa: E402
from kvstore.errors import InvalidArgument, MembershipError  # noqa: E402
from kvstore.membership.etcd import KeyLayout  # noqa: E402
from kvstore.membership.launcher import LocalEtcd  # noqa: E402
from kvstore.membership.nodes import NodeRecord  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
B = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kv-client"), "node-kv", dram_bytes="8MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


def client_for(daemon: DaemonProcess, tenant: str, plane: DataPlane = DataPlane.AUTO,
               batch: int = 32) -> KVClient:
    return KVClient.connect(daemon.grpc_address, LAYOUT, namespace_for(LAYOUT, "m", tenant),
                            KVClientConfig(data_plane=plane, load_batch_blocks=batch))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_contiguous(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n_tokens, LAYOUT.head_dim),
                       generator=g).to(LAYOUT.dtype)


def paged_from(contiguous: torch.Tensor, page_tokens: int, num_pages: int,
               seed: int) -> tuple[list[torch.Tensor], list[int]]:
    """vLLM-style caches holding ``contiguous`` in shuffled pages (the rest is noise)."""
    n_tokens = contiguous.shape[3]
    n_used = -(-n_tokens // page_tokens)
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_pages, generator=g)[:n_used].tolist()
    caches = []
    for layer in range(LAYOUT.num_layers):
        cache = torch.randn((2, num_pages, page_tokens, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                            generator=g).to(LAYOUT.dtype)
        for t in range(n_tokens):
            cache[:, table[t // page_tokens], t % page_tokens] = contiguous[layer, :, :, t]
        caches.append(cache)
    return caches, table


def read_paged(caches: list[torch.Tensor], table: list[int], n_tokens: int) -> torch.Tensor:
    page = caches[0].shape[2]
    out = torch.empty((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n_tokens, LAYOUT.head_dim),
                      dtype=LAYOUT.dtype)
    for layer, cache in enumerate(caches):
        for t in range(n_tokens):
            out[layer, :, :, t] = cache[:, table[t // page], t % page]
    return out


@pytest.mark.parametrize("page_tokens", [16, 8, 32])
@pytest.mark.parametrize("plane", [DataPlane.SHM, DataPlane.TCP])
def test_paged_round_trip(daemon: DaemonProcess, page_tokens: int, plane: DataPlane) -> None:
    n_tokens = 4 * B + 5  # the partial block is not stored
    kv = random_contiguous(n_tokens, seed=page_tokens)
    toks = tokens(n_tokens, seed=page_tokens)
    with client_for(daemon, f"paged-{page_tokens}-{plane.value}", plane) as client:
        assert client.store.data_plane is plane
        src_caches, src_table = paged_from(kv, page_tokens, num_pages=40, seed=1)
        saved = client.save(toks, PagedKV(src_caches, src_table, LAYOUT)).result(30)
        assert saved.stored_blocks == (0, 1, 2, 3) and saved.error is None
        assert client.lookup(toks).blocks == 4

        # Load into another engine's cache with a different block table.
        dst_caches, dst_table = paged_from(torch.zeros_like(kv), page_tokens, 40, seed=2)
        before = [c.clone() for c in dst_caches]
        handle = client.load(toks, PagedKV(dst_caches, dst_table, LAYOUT))
        for layer in range(LAYOUT.num_layers):
            handle.wait_for_layer(layer, timeout_s=30)
        result = handle.result(30)
        assert result.complete and result.loaded_blocks == 4
        assert result.loaded_bytes == 4 * LAYOUT.chunk_bytes
        assert torch.equal(read_paged(dst_caches, dst_table, 4 * B), kv[:, :, :, :4 * B])
        # Pages outside the loaded blocks are untouched.
        used = {dst_table[t // page_tokens] for t in range(4 * B)}
        for cache, old in zip(dst_caches, before, strict=True):
            for p in range(cache.shape[1]):
                if p not in used:
                    assert torch.equal(cache[:, p], old[:, p])

        # The same chunks into a contiguous buffer and as raw chunks.
        flat = torch.zeros((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, 4 * B, LAYOUT.head_dim),
                           dtype=LAYOUT.dtype)
        assert client.load(toks, ContiguousKV(flat, LAYOUT)).result(30).complete
        assert torch.equal(flat, kv[:, :, :, :4 * B])
        chunks = LAYOUT.empty_chunks(2)
        assert client.load(toks, ChunkKV(chunks, LAYOUT, first_block=2),
                           first_block=2).result(30).loaded_blocks == 2
        assert torch.equal(chunks[1, 2, 1], kv[2, 1, :, 3 * B:4 * B])  # block 3, layer 2, V


def test_layerwise_save_in_any_order_then_load(daemon: DaemonProcess) -> None:
    kv = random_contiguous(3 * B, seed=5)
    toks = tokens(3 * B, seed=5)
    with client_for(daemon, "layerwise") as client:
        saver = client.begin_save(toks, ContiguousKV(kv, LAYOUT))
        with pytest.raises(InvalidArgument):
            saver.finish()  # layers missing
        for layer in (2, 0, 1):
            saver.save_layer(layer)
        with pytest.raises(InvalidArgument):
            saver.save_layer(1)
        with pytest.raises(InvalidArgument):
            saver.save_layer(3)
        assert saver.finish().result(30).stored_blocks == (0, 1, 2)
        assert client.lookup(toks).by_tier == {TierKind.DRAM: 3}
        # Saving again stores nothing new and says so.
        again = client.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        assert again.stored_blocks == () and again.existing_blocks == (0, 1, 2)
        out = torch.zeros_like(kv)
        assert client.load(toks, ContiguousKV(out, LAYOUT)).result(30).complete
        assert torch.equal(out, kv)


def test_namespaces_and_misses(daemon: DaemonProcess) -> None:
    kv = random_contiguous(2 * B, seed=6)
    toks = tokens(2 * B, seed=6)
    with client_for(daemon, "tenant-a") as a, client_for(daemon, "tenant-b") as b:
        a.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
        assert a.lookup(toks).blocks == 2
        assert b.lookup(toks).blocks == 0  # another tenant never sees it
        assert a.lookup(toks[:B - 1]).blocks == 0  # no full block
        miss = b.load(toks, ContiguousKV(torch.zeros_like(kv), LAYOUT)).result(30)
        assert miss.loaded_blocks == 0 and miss.failed_blocks == (0, 1) and miss.error is None


def test_a_save_whose_parent_is_gone_fails_cleanly(daemon: DaemonProcess) -> None:
    kv = random_contiguous(3 * B, seed=7)
    toks = tokens(3 * B, seed=7)
    with client_for(daemon, "orphan") as client:
        got = client.save(toks, ContiguousKV(kv, LAYOUT), first_block=1).result(30)
        assert got.stored_blocks == () and got.failed_blocks == (1, 2)
        assert got.error is not None and "InvalidArgument" in got.error
        assert client.lookup(toks).blocks == 0


def test_bad_shapes_are_rejected_at_the_call() -> None:
    with pytest.raises(InvalidArgument):
        ContiguousKV(torch.zeros((3, 2, 2, 16, 4), dtype=LAYOUT.dtype), LAYOUT)
    with pytest.raises(InvalidArgument):
        ContiguousKV(torch.zeros((3, 2, 2, 16, 8), dtype=torch.float32), LAYOUT)
    caches = [torch.zeros((2, 4, 8, 2, 8), dtype=LAYOUT.dtype) for _ in range(3)]
    with pytest.raises(InvalidArgument):
        PagedKV(caches[:2], [0], LAYOUT)
    with pytest.raises(InvalidArgument):
        PagedKV(caches, [0, 4], LAYOUT)  # page 4 does not exist
    with pytest.raises(InvalidArgument):
        KVClientConfig(load_batch_blocks=0)


def test_load_after_the_daemon_died_reports_every_block_failed(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-gone", dram_bytes="4MiB", nvme=False)
    d.start()
    try:
        kv = random_contiguous(2 * B, seed=8)
        toks = tokens(2 * B, seed=8)
        with client_for(d, "gone") as client:
            client.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
            d.kill()
            handle = client.load(toks, ContiguousKV(torch.zeros_like(kv), LAYOUT))
            handle.wait_for_layer(LAYOUT.num_layers - 1, timeout_s=30)  # never hangs
            got = handle.result(30)
            assert got.loaded_blocks == 0 and got.failed_blocks == (0, 1)
            assert got.error is not None and "PeerUnavailable" in got.error
    finally:
        d.stop()


def test_connect_through_etcd(tmp_path: Path, etcd_server: LocalEtcd,
                              etcd_layout: KeyLayout) -> None:
    d = DaemonProcess(tmp_path, "node-etcd", dram_bytes="4MiB", nvme=False,
                      etcd_endpoint=etcd_server.client_url, etcd_prefix=etcd_layout.prefix)
    d.start()
    try:
        kv = random_contiguous(2 * B, seed=9)
        toks = tokens(2 * B, seed=9)
        ns = namespace_for(LAYOUT, "m", "etcd")
        with KVClient.from_etcd(etcd_server.client_url, LAYOUT, ns,
                                key_layout=etcd_layout) as client:
            assert client.store.info.node_id == "node-etcd"
            client.save(toks, ContiguousKV(kv, LAYOUT)).result(30)
            assert client.lookup(toks).node_id == "node-etcd"

        async def inside_a_running_loop() -> str:  # discovery must not need the caller's loop
            with KVClient.from_etcd(etcd_server.client_url, LAYOUT, ns, node_id="node-etcd",
                                    key_layout=etcd_layout) as c:
                return c.store.info.node_id

        assert asyncio.run(inside_a_running_loop()) == "node-etcd"
        with pytest.raises(MembershipError):
            KVClient.from_etcd(etcd_server.client_url, LAYOUT, ns, node_id="nobody",
                               key_layout=etcd_layout)
    finally:
        d.stop()


def _record(node_id: str, hostname: str) -> NodeRecord:
    return NodeRecord(node_id=node_id, grpc_address="127.0.0.1:1", tcp_address="127.0.0.1:2",
                      hostname=hostname, tier_capacity_bytes={TierKind.DRAM: 1},
                      started_at_unix_s=0.0, version="test")


def test_choose_node_prefers_the_named_node_then_this_host() -> None:
    import socket

    nodes = {"a": _record("a", "elsewhere"), "b": _record("b", socket.gethostname()),
             "c": _record("c", "elsewhere")}
    assert choose_node(nodes).node_id == "b"
    assert choose_node(nodes, "c").node_id == "c"
    assert choose_node({"a": nodes["a"], "c": nodes["c"]}).node_id == "a"
    with pytest.raises(MembershipError):
        choose_node({})

"""KVClient.load_many's one-copy path against a real daemon process: on shared memory, into a
layout with ``scatter_chunks`` (vLLM's CPU layout, ContiguousKV), each call's chunks are leased
with one round trip and copied straight out of the daemon's arena into the engine's blocks (no
staging rows, no lease-free reads). Bytes, the lease that keeps the chunks still during the copy,
a lease that expired under the copy, a given-up destination, per-key failures and the TCP
fallback."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.requests import LoadRequest, SaveRequest  # noqa: E402
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig  # noqa: E402
from kvstore.errors import ChunkBusy  # noqa: E402
from kvstore.integrations.vllm.layout import (  # noqa: E402
    CpuBlocksKV,
    GuardedKV,
    engine_kv_for,
)
from tests.support import cpu_kv  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16,
                  dtype=torch.float32)
B = LAYOUT.block_tokens
NUM_BLOCKS = 24
CPU_SHAPE = (NUM_BLOCKS, LAYOUT.num_kv_heads, B, 2 * LAYOUT.head_dim)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kv-direct"), "node-direct", dram_bytes="8MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


def client_for(daemon: DaemonProcess, tenant: str, plane: DataPlane = DataPlane.SHM,
               **store: float) -> KVClient:
    cfg = KVClientConfig(data_plane=plane, workers=1)
    sc = StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=plane, **store))  # type: ignore[arg-type]
    return KVClient(sc, LAYOUT, namespace_for(LAYOUT, "m", tenant), cfg)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def vllm_caches(kind: str, seed: int | None) -> list[torch.Tensor]:
    return cpu_kv.vllm_caches(LAYOUT, NUM_BLOCKS, kind, seed)


def save_blocks(client: KVClient, toks: Sequence[list[int]], caches: list[torch.Tensor],
                ids: Sequence[Sequence[int]]) -> None:
    results = client.save_many([SaveRequest(t, engine_kv_for(caches, i, LAYOUT))
                                for t, i in zip(toks, ids, strict=True)]).result(30)
    assert all(not r.failed_blocks for r in results), results


def assert_blocks_equal(dst: list[torch.Tensor], dst_ids: Sequence[int],
                        src: list[torch.Tensor], src_ids: Sequence[int]) -> None:
    for layer in range(LAYOUT.num_layers):
        for d, s in zip(dst_ids, src_ids, strict=True):
            assert torch.equal(dst[layer][d], src[layer][s]), (layer, d, s)


@pytest.mark.parametrize("kind", ["layer-major", "block-major", "separate"])
@pytest.mark.parametrize("lease_free", [False, True])
def test_load_many_copies_straight_from_the_arena_into_vllm_blocks(daemon: DaemonProcess,
                                                                   kind: str, lease_free: bool
                                                                   ) -> None:
    """Two requests saved from vLLM's CPU layout load byte for byte into other vLLM blocks,
    copied out of the arena by the layout itself: with lease-free reads on, every block
    through the read index (no lease), else under the call's leases (no lease-free read)."""
    src = vllm_caches(kind, seed=1)
    toks = [tokens(3 * B, seed=2), tokens(2 * B + 5, seed=3)]
    src_ids = [[4, 9, 1], [7, 0]]
    dst_ids = [[20, 3, 11], [5, 17]]
    with client_for(daemon, f"bytes-{kind}-{lease_free}",
                    lease_free_reads=lease_free) as client:
        save_blocks(client, toks, src, src_ids)
        dst = vllm_caches(kind, seed=None)
        before = client.store.lease_free_counters()
        assert before.active == lease_free
        handles = client.load_many([
            LoadRequest(t, GuardedKV(engine_kv_for(dst, i, LAYOUT)))
            for t, i in zip(toks, dst_ids, strict=True)])
        got = [h.result(30) for h in handles]
        assert [r.loaded_blocks for r in got] == [3, 2]
        assert all(r.complete and r.error is None for r in got)
        after = client.store.lease_free_counters()
        assert after.hits == before.hits + (5 if lease_free else 0)
        assert after.misses == before.misses
        for s_ids, d_ids in zip(src_ids, dst_ids, strict=True):
            assert_blocks_equal(dst, d_ids, src, s_ids)
        untouched = sorted(set(range(NUM_BLOCKS)) - {b for ids in dst_ids for b in ids})
        assert not any(dst[layer][untouched].any() for layer in range(LAYOUT.num_layers))
        # The leases ended with the call: the chunks can be removed at once.
        assert client.store.remove(client.keys(toks[0])[0])


class _Hooked:
    """A CPU layout whose one-copy scatter runs ``hook`` first (and has no staging entry: a
    staged load fails the test)."""

    def __init__(self, inner: CpuBlocksKV, hook: object) -> None:
        self._inner = inner
        self._hook = hook

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.gather_layer(layer, blocks, chunks)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        raise AssertionError("the load went through staging rows")

    def scatter_chunks(self, layers: range, blocks: range,
                       chunks: Sequence[torch.Tensor]) -> None:
        self._hook()  # type: ignore[operator]
        self._inner.scatter_chunks(layers, blocks, chunks)


def test_the_lease_keeps_the_chunks_still_while_they_are_copied(daemon: DaemonProcess) -> None:
    """Another client removes and overwrites the request's chunks while the copy runs: the
    daemon refuses (ChunkBusy: they are leased), the bytes are the saved ones, and once the
    load returned the removal goes through (the lease was released). Lease-free reads off:
    the leased path (tests/client/test_kv_client_load_free.py has the same race without a
    lease)."""
    src = vllm_caches("layer-major", seed=5)
    toks = tokens(4 * B, seed=6)
    with client_for(daemon, "race", lease_free_reads=False) as client, \
            client_for(daemon, "race") as other:
        save_blocks(client, [toks], src, [[0, 1, 2, 3]])
        keys = client.keys(toks)
        refused: list[str] = []

        def evict_under_the_copy() -> None:
            for key in (keys[0], keys[2]):
                try:
                    other.store.remove(key)
                except ChunkBusy as exc:
                    refused.append(type(exc).__name__)

        dst = vllm_caches("layer-major", seed=None)
        into = _Hooked(CpuBlocksKV(dst, [8, 9, 10, 11], LAYOUT), evict_under_the_copy)
        (handle,) = client.load_many([LoadRequest(toks, into)])
        result = handle.result(30)
        assert refused == ["ChunkBusy", "ChunkBusy"]
        assert result.loaded_blocks == 4 and result.error is None
        assert_blocks_equal(dst, [8, 9, 10, 11], src, [0, 1, 2, 3])
        assert client.store.remove(keys[0])


def test_a_lease_that_expired_under_the_copy_fails_its_blocks(daemon: DaemonProcess) -> None:
    """The copy outlives the read lease's TTL (the daemon may have reused the memory): the
    blocks are reported as not loaded (the engine recomputes them), never as arrived.
    Lease-free reads off: the leased path."""
    src = vllm_caches("layer-major", seed=7)
    toks = tokens(2 * B, seed=8)
    ttl_s = 0.2
    with client_for(daemon, "expiry", lease_ttl_s=ttl_s, lease_free_reads=False) as client:
        save_blocks(client, [toks], src, [[0, 1]])
        dst = vllm_caches("layer-major", seed=None)
        into = _Hooked(CpuBlocksKV(dst, [2, 3], LAYOUT), lambda: time.sleep(2 * ttl_s))
        (handle,) = client.load_many([LoadRequest(toks, into)])
        result = handle.result(30)
        assert result.loaded_blocks == 0 and result.failed_blocks == (0, 1)
        assert result.error is not None and result.error.startswith("LeaseExpired")


def test_a_given_up_destination_is_never_written(daemon: DaemonProcess) -> None:
    """Two requests in one call; the second one's destination is closed (its load given up,
    as the connector does at a timeout) while the first one's copy runs: the second's vLLM
    blocks stay untouched, the first's arrive."""
    src = vllm_caches("layer-major", seed=9)
    toks = [tokens(2 * B, seed=10), tokens(2 * B, seed=11)]
    with client_for(daemon, "guard") as client:
        save_blocks(client, toks, src, [[0, 1], [2, 3]])
        dst = vllm_caches("layer-major", seed=None)
        second = GuardedKV(engine_kv_for(dst, [6, 7], LAYOUT))
        first = GuardedKV(_Hooked(CpuBlocksKV(dst, [4, 5], LAYOUT), second.close))  # type: ignore[arg-type]
        handles = client.load_many([LoadRequest(toks[0], first), LoadRequest(toks[1], second)])
        assert [h.result(30).loaded_blocks for h in handles] == [2, 2]
        assert second.closed
        assert_blocks_equal(dst, [4, 5], src, [0, 1])
        assert not any(dst[layer][[6, 7]].any() for layer in range(LAYOUT.num_layers))


def test_a_call_with_a_missing_chunk_keeps_the_blocks_before_it(daemon: DaemonProcess) -> None:
    """Block 2 of request A was evicted since the lookup: the call's lease is refused, the
    call is read through staging instead, A gets blocks 0 and 1 and B all of its blocks."""
    src = vllm_caches("layer-major", seed=12)
    toks = [tokens(4 * B, seed=13), tokens(2 * B, seed=14)]
    with client_for(daemon, "miss") as client:
        save_blocks(client, toks, src, [[0, 1, 2, 3], [4, 5]])
        client.store.remove(client.keys(toks[0])[2])
        dst = vllm_caches("layer-major", seed=None)
        handles = client.load_many([LoadRequest(toks[0], engine_kv_for(dst, [10, 11, 12, 13],
                                                                       LAYOUT)),
                                    LoadRequest(toks[1], engine_kv_for(dst, [14, 15], LAYOUT))])
        got = [h.result(30) for h in handles]
        assert [r.loaded_blocks for r in got] == [2, 2]
        assert got[0].failed_blocks == (2, 3) and got[0].error is None  # a miss
        assert_blocks_equal(dst, [10, 11, 14, 15], src, [0, 1, 4, 5])
        assert not any(dst[layer][[12, 13]].any() for layer in range(LAYOUT.num_layers))


def test_over_tcp_the_load_goes_through_staging_unchanged(daemon: DaemonProcess) -> None:
    src = vllm_caches("layer-major", seed=15)
    toks = tokens(3 * B, seed=16)
    with client_for(daemon, "tcp", DataPlane.TCP) as client:
        save_blocks(client, [toks], src, [[0, 1, 2]])
        dst = vllm_caches("layer-major", seed=None)
        calls: list[int] = []

        class Counting(CpuBlocksKV):
            __slots__ = ()

            def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
                calls.append(layer)
                super().scatter_layer(layer, blocks, chunks)

        (handle,) = client.load_many([LoadRequest(toks, Counting(dst, [5, 6, 7], LAYOUT))])
        assert handle.result(30).loaded_blocks == 3
        assert calls == [0, 1, 2]  # layer by layer out of staging rows
        assert_blocks_equal(dst, [5, 6, 7], src, [0, 1, 2])


def test_cpu_layout_scatter_chunks_matches_scatter_layer() -> None:
    """Pure layout logic: the one-copy scatter of whole chunks writes what the per-layer
    scatter of the same chunks writes, for every way vLLM may lay out its layers."""
    g = torch.Generator().manual_seed(17)
    chunks = torch.randn((3, *LAYOUT.chunk_shape), generator=g)
    for kind in ("layer-major", "block-major", "separate"):
        a, b = vllm_caches(kind, seed=None), vllm_caches(kind, seed=None)
        ids = [9, 2, 14, 6]
        CpuBlocksKV(a, ids, LAYOUT).scatter_chunks(range(LAYOUT.num_layers), range(1, 4),
                                                   list(chunks))
        per_layer = CpuBlocksKV(b, ids, LAYOUT)
        for layer in range(LAYOUT.num_layers):
            per_layer.scatter_layer(layer, range(1, 4), chunks[:, layer])
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), kind
        assert any(x.any() for x in a)
        # Only some layers: the others stay as they were.
        c = vllm_caches(kind, seed=None)
        CpuBlocksKV(c, ids, LAYOUT).scatter_chunks(range(1, 2), range(0, 1), [chunks[0]])
        assert not c[0].any() and not c[2].any() and c[1][9].any(), kind


def test_concurrent_loads_release_every_lease(daemon: DaemonProcess) -> None:
    """Loads on two threads at once: each ends its leases (the chunks can be removed after)."""
    src = vllm_caches("layer-major", seed=18)
    toks = [tokens(3 * B, seed=19 + i) for i in range(2)]
    with client_for(daemon, "threads") as client:
        save_blocks(client, toks, src, [[0, 1, 2], [3, 4, 5]])
        dst = vllm_caches("layer-major", seed=None)
        results: list[int] = []

        def run(i: int) -> None:
            ids = [10 + 3 * i, 11 + 3 * i, 12 + 3 * i]
            (h,) = client.load_many([LoadRequest(toks[i], engine_kv_for(dst, ids, LAYOUT))])
            results.append(h.result(30).loaded_blocks)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results == [3, 3]
        assert_blocks_equal(dst, [10, 11, 12, 13, 14, 15], src, [0, 1, 2, 3, 4, 5])
        for t in toks:
            assert client.store.remove(client.keys(t)[0])


def test_requests_across_parts_with_a_refused_part_in_between(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts of 2 blocks, requests of 5, 3 and 4 blocks (a request spans parts, a part holds
    two requests): A's blocks 3 and 4 are gone, so the two parts that hold them are refused
    and read through staging: A keeps blocks 0..2, B (whose block 0 shares a refused part)
    and C (leased) arrive whole, byte for byte."""
    import kvstore.client.kv_client as kv_client

    monkeypatch.setattr(kv_client, "_DIRECT_PART_BLOCKS", 2)
    src = vllm_caches("block-major", seed=20)
    toks = [tokens(5 * B, seed=21), tokens(3 * B, seed=22), tokens(4 * B, seed=23)]
    src_ids = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11]]
    dst_ids = [[12, 13, 14, 15, 16], [17, 18, 19], [20, 21, 22, 23]]
    with client_for(daemon, "parts") as client:
        save_blocks(client, toks, src, src_ids)
        assert len(client.store.remove(client.keys(toks[0])[3])) == 2  # blocks 3 and 4
        dst = vllm_caches("block-major", seed=None)
        handles = client.load_many([LoadRequest(t, GuardedKV(engine_kv_for(dst, i, LAYOUT)))
                                    for t, i in zip(toks, dst_ids, strict=True)])
        got = [h.result(30) for h in handles]
        assert [r.loaded_blocks for r in got] == [3, 3, 4]
        assert got[0].failed_blocks == (3, 4) and got[0].error is None
        assert_blocks_equal(dst, dst_ids[0][:3] + dst_ids[1] + dst_ids[2],
                            src, src_ids[0][:3] + src_ids[1] + src_ids[2])
        assert not any(dst[layer][[15, 16]].any() for layer in range(LAYOUT.num_layers))


def test_read_parts_pipelines_leases_and_ends_them(daemon: DaemonProcess) -> None:
    """StoreClient.read_parts: every part's lease asked at once on one connection; a refused
    part (a miss) does not stop the parts after it; the chunks stay pinned until release;
    a release with parts left unread closes the connection, which ends their leases too."""
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM)) as store:
        keys = [bytes([i]) * 32 for i in range(1, 5)]
        values = [torch.full((256,), float(i)) for i in range(4)]
        assert store.put_many(keys, values) == [True] * 4
        read = store.read_parts([keys[:2], [b"\x77" * 32], keys[2:]])
        first = read.next_part()
        with pytest.raises(Exception) as missing:
            read.next_part()
        assert type(missing.value).__name__ == "ChunkNotFound"
        last = read.next_part()
        views = read.tensors(first + last, torch.float32, (256,))
        assert all(torch.equal(v, values[i]) for i, v in enumerate(views))
        del views
        with pytest.raises(ChunkBusy):
            store.remove(keys[3])
        read.release()
        assert store.remove(keys[3])

        read = store.read_parts([keys[:1], keys[1:3]])
        read.next_part()  # the second part's reply is never read
        read.release()
        deadline = time.monotonic() + 30
        while True:  # the daemon ends the closed connection's leases when it sees it closed
            try:
                assert store.remove(keys[1])
                break
            except ChunkBusy:
                assert time.monotonic() < deadline, "the unread part's lease never ended"
                time.sleep(0.05)

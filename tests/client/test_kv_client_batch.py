"""KVClient's cross-request batch APIs against a real daemon process: lookup_many (one
BatchLookup), load_many (one handle per request, one batched transfer), save_many/begin_save_many
(one staging buffer and one flush), each checked against the single-request calls."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.layouts import ChunkKV, ContiguousKV, PagedKV  # noqa: E402
from kvstore.client.requests import LoadRequest, SaveRequest  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.dataplane.tier import TierKind  # noqa: E402
from kvstore.errors import InvalidArgument, PeerUnavailable  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16, dtype=torch.float16)
B = LAYOUT.block_tokens


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kv-batch"), "node-batch", dram_bytes="8MiB",
                      nvme=False)
    d.start()
    yield d
    d.stop()


def client_for(daemon: DaemonProcess, tenant: str, plane: DataPlane = DataPlane.AUTO,
               batch_blocks: int = 256, workers: int = 2, one_copy_save: bool = True
               ) -> KVClient:
    return KVClient.connect(daemon.grpc_address, LAYOUT, namespace_for(LAYOUT, "m", tenant),
                            KVClientConfig(data_plane=plane, batch_blocks=batch_blocks,
                                           workers=workers, one_copy_save=one_copy_save))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def random_kv(n_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((LAYOUT.num_layers, 2, LAYOUT.num_kv_heads, n_tokens, LAYOUT.head_dim),
                       generator=g).to(LAYOUT.dtype)


@pytest.mark.parametrize("plane", [DataPlane.SHM, DataPlane.TCP])
def test_save_many_lookup_many_load_many_match_single_calls(daemon: DaemonProcess,
                                                            plane: DataPlane) -> None:
    sizes = [4 * B, 2 * B + 5, 3 * B, B - 1, 5 * B]
    kvs = [random_kv(n, seed=i) for i, n in enumerate(sizes)]
    toks = [tokens(n, seed=100 + i) for i, n in enumerate(sizes)]
    with client_for(daemon, f"batch-{plane.value}", plane, batch_blocks=5) as client:
        # Request 2 already has block 0 stored: its save starts after it.
        client.save(toks[2][:B], ContiguousKV(kvs[2][:, :, :, :B], LAYOUT)).result(30)
        saver = client.begin_save_many(
            [SaveRequest(t, ContiguousKV(kv, LAYOUT), first_block=1 if i == 2 else 0)
             for i, (t, kv) in enumerate(zip(toks, kvs, strict=True))])
        for layer in (1, 2, 0):  # any order, as layers finish
            saver.save_layer(layer)
        with pytest.raises(InvalidArgument):
            saver.save_layer(0)
        results = saver.finish().result(30)
        assert [r.stored_blocks for r in results] == [(0, 1, 2, 3), (0, 1), (1, 2), (),
                                                      (0, 1, 2, 3, 4)]
        assert all(r.error is None and not r.failed_blocks for r in results)
        again = client.save_many([SaveRequest(toks[1], ContiguousKV(kvs[1], LAYOUT))]).result(30)
        assert again[0].existing_blocks == (0, 1) and again[0].stored_bytes == 0

        # Evict request 4 from block 3 on: lookups and loads see the shorter prefix.
        client.store.remove(client.keys(toks[4])[3])
        unseen = tokens(2 * B, seed=999)
        asked = [*toks, unseen, []]
        many = client.lookup_many(asked)
        assert [m.blocks for m in many] == [4, 2, 3, 0, 3, 0, 0]
        assert many == [client.lookup(t) for t in asked]
        assert many[0].by_tier == {TierKind.DRAM: 4} and many[0].node_id == "node-batch"

        outs = [torch.zeros_like(kv) for kv in kvs]
        requests = [LoadRequest(t, ContiguousKV(o, LAYOUT)) for t, o in zip(toks, outs,
                                                                            strict=True)]
        requests[1] = LoadRequest(toks[1], ContiguousKV(outs[1], LAYOUT), first_block=1)
        handles = client.load_many(requests)
        assert len(handles) == len(requests)
        for layer in range(LAYOUT.num_layers):
            for h in handles:
                h.wait_for_layer(layer, timeout_s=30)
        got = [h.result(30) for h in handles]
        assert [r.loaded_blocks for r in got] == [4, 1, 3, 0, 3]
        assert [r.failed_blocks for r in got] == [(), (), (), (), (3, 4)]
        assert all(r.error is None for r in got)  # a miss is not an error
        assert [h.transferred() for h in handles] == [4, 1, 3, 0, 3]
        for i, (r, out, kv) in enumerate(zip(got, outs, kvs, strict=True)):
            lo, hi = r.first_block * B, (r.first_block + r.loaded_blocks) * B
            assert torch.equal(out[:, :, :, lo:hi], kv[:, :, :, lo:hi]), i
            assert not out[:, :, :, :lo].any() and not out[:, :, :, hi:].any(), i
        assert client.load_many([]) == []


def test_load_many_into_mixed_layouts(daemon: DaemonProcess) -> None:
    kv_a, kv_b = random_kv(3 * B, seed=7), random_kv(2 * B, seed=8)
    t_a, t_b = tokens(3 * B, seed=7), tokens(2 * B, seed=8)
    with client_for(daemon, "mixed") as client:
        client.save_many([SaveRequest(t_a, ContiguousKV(kv_a, LAYOUT)),
                          SaveRequest(t_b, ContiguousKV(kv_b, LAYOUT))]).result(30)
        pages = [torch.zeros((2, 10, 8, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                             dtype=LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]
        table = [9, 2, 5, 0, 7, 1]  # 6 pages of 8 tokens = request A's 3 blocks
        chunks = LAYOUT.empty_chunks(2)
        h_a, h_b = client.load_many([LoadRequest(t_a, PagedKV(pages, table, LAYOUT)),
                                     LoadRequest(t_b, ChunkKV(chunks, LAYOUT))])
        assert h_a.result(30).complete and h_b.result(30).complete
        for layer in range(LAYOUT.num_layers):
            for t in range(3 * B):
                page, off = table[t // 8], t % 8
                assert torch.equal(pages[layer][:, page, off], kv_a[layer, :, :, t])
        assert torch.equal(chunks[1, 2, 0], kv_b[2, 0, :, B:2 * B])  # block 1, layer 2, K


def test_bad_requests_raise_at_the_call(daemon: DaemonProcess) -> None:
    with client_for(daemon, "bad") as client:
        kv = random_kv(2 * B, seed=9)
        with pytest.raises(InvalidArgument):
            client.load_many([LoadRequest(tokens(2 * B, 9), ContiguousKV(kv, LAYOUT),
                                          num_blocks=3)])
        with pytest.raises(InvalidArgument):
            client.begin_save_many([SaveRequest(tokens(2 * B, 9), ContiguousKV(kv, LAYOUT),
                                                first_block=3)])
        with pytest.raises(InvalidArgument):
            KVClientConfig(batch_blocks=0)


def test_a_save_whose_parent_is_gone_fails_alone(daemon: DaemonProcess) -> None:
    kv_a, kv_b = random_kv(2 * B, seed=10), random_kv(3 * B, seed=11)
    t_a, t_b = tokens(2 * B, seed=10), tokens(3 * B, seed=11)
    with client_for(daemon, "orphan") as client:
        a, b = client.save_many([SaveRequest(t_a, ContiguousKV(kv_a, LAYOUT), first_block=1),
                                 SaveRequest(t_b, ContiguousKV(kv_b, LAYOUT))]).result(30)
        assert a.stored_blocks == () and a.failed_blocks == (1,) and "InvalidArgument" in \
            str(a.error)
        assert b.stored_blocks == (0, 1, 2) and b.error is None


@pytest.mark.parametrize(("plane", "one_copy"), [(DataPlane.SHM, True), (DataPlane.SHM, False),
                                               (DataPlane.TCP, True)])
def test_one_steps_saves_go_in_one_batch_and_a_shared_prefix_is_sent_once(
        daemon: DaemonProcess, plane: DataPlane, one_copy: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Two requests of one step share their first two blocks (same tokens, same KV). Through
    # staging, the step's chunks go in one put_many, the shared blocks once; on the same host
    # with one_copy_save they are reserved and written in place (no put at all). A per-block
    # put raises here.
    shared, kv_shared = tokens(2 * B, seed=40), random_kv(2 * B, seed=40)
    t_a, t_b = shared + tokens(B, seed=41), shared + tokens(2 * B, seed=42)
    kv_a = torch.cat([kv_shared, random_kv(B, seed=41)], dim=3)
    kv_b = torch.cat([kv_shared, random_kv(2 * B, seed=42)], dim=3)
    tag = f"one-batch-{plane.value}-{one_copy}"
    # One worker: one flush for the whole step (with two, each flushes its share).
    with client_for(daemon, tag, plane, workers=1, one_copy_save=one_copy) as client:
        def no_single_puts(*args: object, **kwargs: object) -> None:
            raise AssertionError("a step's save must not put block by block")
        monkeypatch.setattr(client.store, "put", no_single_puts)
        batches: list[int] = []
        put_many = client.store.put_many

        def counted(keys: list[bytes], *rest: object, **kw: object) -> list[bool]:
            batches.append(len(keys))
            return put_many(keys, *rest, **kw)  # type: ignore[arg-type]
        monkeypatch.setattr(client.store, "put_many", counted)
        a, b = client.save_many([SaveRequest(t_a, ContiguousKV(kv_a, LAYOUT)),
                                 SaveRequest(t_b, ContiguousKV(kv_b, LAYOUT))]).result(30)
        in_place = one_copy and plane is DataPlane.SHM
        assert batches == ([] if in_place else [5])  # 3 + 4 blocks, 2 of them shared
        assert a.stored_blocks == (0, 1, 2) and a.error is None
        assert b.existing_blocks == (0, 1) and b.stored_blocks == (2, 3) and b.error is None
        assert b.stored_bytes == 2 * LAYOUT.chunk_bytes
        for t, kv in ((t_a, kv_a), (t_b, kv_b)):
            out = torch.zeros_like(kv)
            got = client.load(t, ContiguousKV(out, LAYOUT)).result(30)
            assert got.loaded_blocks == len(t) // B and torch.equal(out, kv)
        assert client.store.stats().shm_leases_open == 0


def test_load_many_after_the_daemon_died_fails_every_request(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-batch-gone", dram_bytes="4MiB", nvme=False)
    d.start()
    try:
        kvs = [random_kv(2 * B, seed=s) for s in (12, 13)]
        toks = [tokens(2 * B, seed=s) for s in (12, 13)]
        with client_for(d, "gone") as client:
            client.save_many([SaveRequest(t, ContiguousKV(kv, LAYOUT))
                              for t, kv in zip(toks, kvs, strict=True)]).result(30)
            d.kill()
            handles = client.load_many([LoadRequest(t, ContiguousKV(torch.zeros_like(kv),
                                                                    LAYOUT))
                                        for t, kv in zip(toks, kvs, strict=True)])
            for h in handles:
                h.wait_for_layer(LAYOUT.num_layers - 1, timeout_s=30)  # never hangs
                r = h.result(30)
                assert r.loaded_blocks == 0 and r.failed_blocks == (0, 1)
                assert r.error is not None and "PeerUnavailable" in r.error
            with pytest.raises(PeerUnavailable):
                client.lookup_many(toks)
    finally:
        d.stop()


def test_split_even_keeps_order_and_covers_every_request() -> None:
    from kvstore.client.handles import split_even

    assert split_even([4] * 6, 2) == [[0, 1, 2], [3, 4, 5]]
    assert split_even([1, 9, 1, 1], 2) == [[0, 1], [2, 3]]
    assert split_even([1, 1, 10], 2) == [[0, 1], [2]]
    assert split_even([0, 0, 4], 3) == [[0, 1], [2]]
    assert split_even([5], 4) == [[0]]
    assert split_even([], 2) == []
    assert split_even([2, 2, 2], 1) == [[0, 1, 2]]
    for sizes in ([3, 0, 7, 1, 1, 5], [0, 0, 0], list(range(10))):
        for parts in (1, 2, 3, 8):
            groups = split_even(sizes, parts)
            assert [i for g in groups for i in g] == list(range(len(sizes)))
            assert len(groups) <= parts and all(groups)


@pytest.mark.parametrize("plane", [DataPlane.SHM, DataPlane.TCP])
def test_load_many_with_a_corrupt_chunk_loads_the_blocks_before_it(tmp_path: Path,
                                                                   plane: DataPlane) -> None:
    """One payload byte of request A's block 2 rots on NVMe (daemon stopped, no DRAM copy left
    after its restart; newer records follow, so the open does not verify it): A gets blocks 0 and 1 and fails from block 2 with
    ChunkCorrupt; request B gets all its blocks. (A's batched call once failed whole: "batch
    load stopped at 0 of 4 blocks: ChunkCorrupt", and A got none.)"""
    from kvstore.dataplane.nvme.config import NvmeTierConfig
    from kvstore.dataplane.nvme.tier import NvmeTier
    from tests.support.common import flip_byte

    settings = {"cache.write_tier": "nvme"}
    newer = NvmeTierConfig.__dataclass_fields__["open_verify_newest"].default + 4
    d = DaemonProcess(tmp_path, "node-rot", dram_bytes="8MiB", settings=settings)
    kv_a, kv_b = random_kv(4 * B, seed=21), random_kv(3 * B, seed=22)
    t_a, t_b = tokens(4 * B, seed=21), tokens(3 * B, seed=22)
    d.start()
    try:
        with client_for(d, "rot", plane) as client:
            results = client.save_many([SaveRequest(t_a, ContiguousKV(kv_a, LAYOUT)),
                                        SaveRequest(t_b, ContiguousKV(kv_b, LAYOUT))]).result(30)
            assert [len(r.stored_blocks) for r in results] == [4, 3]
            filler = client.save(tokens(newer * B, seed=23),
                                 ContiguousKV(random_kv(newer * B, seed=23), LAYOUT)).result(30)
            assert len(filler.stored_blocks) == newer
            rotten = client.keys(t_a)[2]
    finally:
        d.stop()
    nvme_dir = Path(d.settings["nvme.directory"])
    with NvmeTier.open(NvmeTierConfig(directory=nvme_dir, capacity_bytes=64 * 2**20)) as tier:
        loc = tier.record_location(rotten)
        assert loc is not None
    flip_byte(loc.path, loc.payload_offset + 100)
    d.start()
    try:
        with client_for(d, "rot", plane) as client:
            outs = [torch.zeros_like(kv_a), torch.zeros_like(kv_b)]
            handles = client.load_many([LoadRequest(t_a, ContiguousKV(outs[0], LAYOUT)),
                                        LoadRequest(t_b, ContiguousKV(outs[1], LAYOUT))])
            got = [h.result(30) for h in handles]
            assert [r.loaded_blocks for r in got] == [2, 3]
            assert [r.failed_blocks for r in got] == [(2, 3), ()]
            assert got[0].error is not None and got[0].error.startswith("ChunkCorrupt")
            assert got[1].error is None
            assert torch.equal(outs[0][:, :, :, :2 * B], kv_a[:, :, :, :2 * B])
            assert torch.equal(outs[1], kv_b)
    finally:
        d.stop()

"""KVClient's one-copy save (``DirectBatchSave``) against a real daemon process: on shared memory,
from layouts with ``gather_chunks`` (vLLM's CPU layout, ContiguousKV), a step's chunks are
reserved in the daemon's arena and the engine's KV is copied straight into them, then committed.
Bytes, no staging, a next step hanging under this step's open reservations, skipped requests, a
copy that raised, a step past its reservations' margin and a daemon gone: never a visible chunk
that was not written whole, never a reservation left open."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.handles import DirectBatchSave  # noqa: E402
from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.requests import LoadRequest, SaveRequest  # noqa: E402
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig  # noqa: E402
from kvstore.errors import ChunkNotFound  # noqa: E402
from kvstore.integrations.vllm.layout import CpuBlocksKV, engine_kv_for  # noqa: E402
from tests.support import cpu_kv  # noqa: E402
from tests.support.common import wait_until  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=16,
                  dtype=torch.float32)
B = LAYOUT.block_tokens
NUM_BLOCKS = 24
CPU_SHAPE = (NUM_BLOCKS, LAYOUT.num_kv_heads, B, 2 * LAYOUT.head_dim)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("kv-save-direct"), "node-save-direct",
                      dram_bytes="8MiB", nvme=False)
    d.start()
    yield d
    d.stop()


def client_for(daemon: DaemonProcess, tenant: str, **store: float) -> KVClient:
    sc = StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM, **store))  # type: ignore[arg-type]
    return KVClient(sc, LAYOUT, namespace_for(LAYOUT, "m", tenant),
                    KVClientConfig(data_plane=DataPlane.SHM, workers=2))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def vllm_caches(kind: str, seed: int | None) -> list[torch.Tensor]:
    return cpu_kv.vllm_caches(LAYOUT, NUM_BLOCKS, kind, seed)


class NoStaging:
    """vLLM's CPU layout without its staging entry: a save through staging rows fails."""

    def __init__(self, inner: CpuBlocksKV) -> None:
        self._inner = inner
        self.gather_chunks = inner.gather_chunks

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        raise AssertionError("the save went through staging rows")

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.scatter_layer(layer, blocks, chunks)


def loaded(client: KVClient, toks: list[int], ids: Sequence[int]) -> list[torch.Tensor]:
    dst = vllm_caches("separate", seed=None)
    got = client.load(toks, engine_kv_for(dst, ids, LAYOUT)).result(30)
    assert got.loaded_blocks == len(ids), got
    return dst


def same_blocks(dst: list[torch.Tensor], d_ids: Sequence[int], src: list[torch.Tensor],
                s_ids: Sequence[int]) -> bool:
    return all(torch.equal(dst[layer][d], src[layer][s])
               for layer in range(LAYOUT.num_layers)
               for d, s in zip(d_ids, s_ids, strict=True))


def absent(client: KVClient, key: bytes) -> bool:
    try:
        client.store.inspect(key)
    except ChunkNotFound:
        return True
    return False


def no_leases(client: KVClient) -> None:
    wait_until(lambda: client.store.stats().shm_leases_open == 0, timeout_s=10)


@pytest.mark.parametrize("kind", ["layer-major", "block-major", "separate"])
def test_a_step_is_written_straight_into_the_arena(daemon: DaemonProcess, kind: str) -> None:
    src = vllm_caches(kind, seed=7)
    toks = [tokens(3 * B, seed=8), tokens(2 * B + 3, seed=9)]
    ids = [[5, 2, 19], [0, 11]]
    with client_for(daemon, f"direct-{kind}") as client:
        saver = client.begin_save_many([
            SaveRequest(t, NoStaging(CpuBlocksKV(src, i, LAYOUT)))  # type: ignore[arg-type]
            for t, i in zip(toks, ids, strict=True)])
        assert isinstance(saver, DirectBatchSave)
        saver.reservation.result(30)  # granted before the layers come: no staging at all
        for layer in (2, 0, 1):  # any order, as layers finish
            saver.save_layer(layer)
        results = saver.finish().result(30)
        assert [r.stored_blocks for r in results] == [(0, 1, 2), (0, 1)]
        assert all(r.error is None and not r.failed_blocks for r in results)
        assert results[0].stored_bytes == 3 * LAYOUT.chunk_bytes
        for t, i in zip(toks, ids, strict=True):
            assert same_blocks(loaded(client, t, range(len(i))), range(len(i)), src, i)
        no_leases(client)


def test_layers_handed_over_while_the_daemon_is_stopped_are_staged_then_written(
        daemon: DaemonProcess) -> None:
    # A stopped daemon cannot answer the reservation: the copies out of vLLM's blocks still
    # happen within the step (into staging rows), vLLM may reuse its blocks at once, and the
    # step lands with the bytes it had when the daemon answers.
    src = vllm_caches("layer-major", seed=80)
    toks, ids = tokens(3 * B, seed=81), [6, 0, 14]
    expected = [t.clone() for t in src]
    with client_for(daemon, "stopped") as client:
        client.store.stats()  # connected before the stop
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            saver = client.begin_save_many([SaveRequest(toks, engine_kv_for(src, ids, LAYOUT))])
            copies = [saver.save_layer(layer) for layer in range(LAYOUT.num_layers)]
            for c in copies:
                c.result(30)  # the copies never wait for the daemon
            assert not saver.reservation.done()
            done = saver.finish()
            for t in src:
                t.zero_()  # vLLM reuses the blocks
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        [saved] = done.result(30)
        assert saved.stored_blocks == (0, 1, 2) and saved.error is None
        assert same_blocks(loaded(client, toks, range(3)), range(3), expected, ids)
        no_leases(client)


def test_the_next_step_hangs_under_this_steps_open_reservations(daemon: DaemonProcess) -> None:
    # Chunked prefill: step 2 saves the children of step 1's blocks and begins before step 1
    # is committed (vLLM starts a step's save before the last one's puts are done).
    src = vllm_caches("layer-major", seed=20)
    toks, ids = tokens(4 * B, seed=21), [3, 8, 13, 1]
    with client_for(daemon, "next-step") as client:
        step1 = client.begin_save_many([SaveRequest(toks[:2 * B],
                                                    engine_kv_for(src, ids[:2], LAYOUT))])
        step2 = client.begin_save_many([SaveRequest(toks, engine_kv_for(src, ids, LAYOUT),
                                                    first_block=2)])
        for saver in (step1, step2):
            for layer in range(LAYOUT.num_layers):
                saver.save_layer(layer)
        one = step1.finish().result(30)
        two = step2.finish().result(30)
        assert one[0].stored_blocks == (0, 1) and two[0].stored_blocks == (2, 3)
        assert same_blocks(loaded(client, toks, range(4)), range(4), src, ids)
        no_leases(client)


def test_a_skipped_request_leaves_nothing_and_the_others_land(daemon: DaemonProcess) -> None:
    src = vllm_caches("separate", seed=30)
    toks = [tokens(2 * B, seed=31), tokens(2 * B, seed=32)]
    with client_for(daemon, "skip") as client:
        saver = client.begin_save_many([SaveRequest(t, engine_kv_for(src, i, LAYOUT))
                                        for t, i in zip(toks, [[0, 1], [2, 3]], strict=True)])
        for layer in range(LAYOUT.num_layers):
            saver.save_layer(layer)
        skipped, saved = saver.finish(skip=[0]).result(30)
        assert skipped.stored_blocks == () and skipped.failed_blocks == (0, 1)
        assert skipped.error == "skipped"
        assert saved.stored_blocks == (0, 1)
        assert all(absent(client, k) for k in client.keys(toks[0]))
        assert same_blocks(loaded(client, toks[1], range(2)), range(2), src, [2, 3])
        no_leases(client)


class Broken(NoStaging):
    def __init__(self, inner: CpuBlocksKV) -> None:
        super().__init__(inner)

        def fail(layers: range, blocks: range, chunks: Sequence[torch.Tensor]) -> None:
            raise RuntimeError("a bad source")
        self.gather_chunks = fail


def test_a_copy_that_raised_commits_nothing(daemon: DaemonProcess) -> None:
    src = vllm_caches("separate", seed=40)
    toks = tokens(2 * B, seed=41)
    with client_for(daemon, "broken") as client:
        saver = client.begin_save_many([SaveRequest(
            toks, Broken(CpuBlocksKV(src, [0, 1], LAYOUT)))])  # type: ignore[arg-type]
        assert isinstance(saver, DirectBatchSave)
        saver.reservation.result(30)
        for layer in range(LAYOUT.num_layers):
            saver.save_layer(layer)
        with pytest.raises(RuntimeError, match="a bad source"):
            saver.finish().result(30)
        assert all(absent(client, k) for k in client.keys(toks))
        no_leases(client)
        # The client saves normally afterwards (its writer connection is still in step).
        again = client.save_many([SaveRequest(toks, engine_kv_for(src, [0, 1], LAYOUT))])
        assert again.result(30)[0].stored_blocks == (0, 1)


def test_a_step_past_its_reservations_margin_is_not_committed(daemon: DaemonProcess) -> None:
    src = vllm_caches("separate", seed=50)
    toks = tokens(2 * B, seed=51)
    with client_for(daemon, "late", lease_ttl_s=0.6) as client:
        saver = client.begin_save_many([SaveRequest(toks, engine_kv_for(src, [0, 1], LAYOUT))])
        time.sleep(0.4)  # the engine stalled past half the TTL before handing the layers over
        for layer in range(LAYOUT.num_layers):
            saver.save_layer(layer)
        [late] = saver.finish().result(30)
        assert late.stored_blocks == () and late.failed_blocks == (0, 1)
        assert "margin" in str(late.error)
        assert all(absent(client, k) for k in client.keys(toks))
        no_leases(client)


def test_a_daemon_gone_mid_step_fails_the_step_without_a_hang(tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-save-gone", dram_bytes="4MiB", nvme=False)
    d.start()
    src = vllm_caches("separate", seed=60)
    toks = tokens(2 * B, seed=61)
    try:
        with client_for(d, "gone") as client:
            saver = client.begin_save_many([SaveRequest(toks,
                                                        engine_kv_for(src, [0, 1], LAYOUT))])
            saver.save_layer(0)
            d.kill()
            for layer in (1, 2):
                saver.save_layer(layer)
            [gone] = saver.finish().result(30)
            assert gone.stored_blocks == () and gone.failed_blocks == (0, 1)
            assert gone.error is not None
            # Loads report every block failed, not a hang.
            out = client.load(toks, engine_kv_for(vllm_caches("separate", None), [0, 1],
                                                  LAYOUT))
            assert out.result(30).loaded_blocks == 0
    finally:
        d.stop()


def test_over_tcp_and_from_layouts_without_gather_chunks_saves_go_through_staging(
        daemon: DaemonProcess) -> None:
    src = vllm_caches("separate", seed=70)
    toks = tokens(B, seed=71)
    with client_for(daemon, "staged") as client:
        plain = engine_kv_for(src, [4], LAYOUT)

        class NoDirect:
            gather_chunks = None

            def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
                plain.gather_layer(layer, blocks, chunks)

            def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
                plain.scatter_layer(layer, blocks, chunks)

        saver = client.begin_save_many([SaveRequest(toks, NoDirect())])  # type: ignore[arg-type]
        assert not isinstance(saver, DirectBatchSave)
        for layer in range(LAYOUT.num_layers):
            saver.save_layer(layer)
        assert saver.finish().result(30)[0].stored_blocks == (0,)
        handles = client.load_many([LoadRequest(toks, engine_kv_for(
            dst := vllm_caches("separate", None), [9], LAYOUT))])
        assert handles[0].result(30).loaded_blocks == 1
        assert same_blocks(dst, [9], src, [4])

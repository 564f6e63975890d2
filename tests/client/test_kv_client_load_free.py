"""KVClient's one-copy load through the daemon's read index (issue 13): a request's published
chunks are copied by the layout straight out of the arena with no lease and no round trip,
and the read index's seqlock decides afterwards which copies were the chunks' own. Against a
real daemon process: a chunk removed or replaced under the copy is never reported as loaded
from the bytes seen during the copy: it is read again under a lease (or is a miss), so vLLM
gets the chunk's current bytes or recomputes the block."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")

from kvstore.client.requests import LoadRequest, SaveRequest  # noqa: E402
from kvstore.client.store_client import StoreClient  # noqa: E402
from kvstore.client.store_config import DataPlane, StoreClientConfig  # noqa: E402
from kvstore.integrations.vllm.layout import CpuBlocksKV, engine_kv_for  # noqa: E402
from tests.client.test_kv_client_direct import (  # noqa: E402
    LAYOUT,
    B,
    assert_blocks_equal,
    client_for,
    daemon,
    save_blocks,
    tokens,
    vllm_caches,
)
from tests.support.daemon import DaemonProcess  # noqa: E402

__all__ = ["daemon"]  # the module-scoped fixture, shared


class _FirstCopyHooked:
    """A CPU layout whose first one-copy scatter runs ``hook`` first (no staging entry)."""

    def __init__(self, inner: CpuBlocksKV, hook: object) -> None:
        self._inner = inner
        self._hook = hook
        self.copies = 0

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.gather_layer(layer, blocks, chunks)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        raise AssertionError("the load went through staging rows")

    def scatter_chunks(self, layers: range, blocks: range,
                       chunks: Sequence[torch.Tensor]) -> None:
        self.copies += 1
        if self.copies == 1:
            self._hook()  # type: ignore[operator]
        self._inner.scatter_chunks(layers, blocks, chunks)


@pytest.mark.parametrize("inline", [0, 16 << 20], ids=["transfer-thread", "inline"])
def test_published_chunks_load_with_no_lease(daemon: DaemonProcess, inline: int) -> None:
    """On a transfer thread (``inline_load_bytes`` 0) and in the calling thread (16 MiB: the
    default, docs/kv-client.md)."""
    src = vllm_caches("layer-major", seed=40 + inline % 7)
    toks = tokens(4 * B, seed=41 + inline % 7)
    with client_for(daemon, f"free-{inline}") as client:
        client.config = dataclasses.replace(client.config, inline_load_bytes=inline)
        save_blocks(client, [toks], src, [[3, 1, 4, 0]])
        before = client.store.lease_free_counters()
        dst = vllm_caches("layer-major", seed=None)
        into = _FirstCopyHooked(CpuBlocksKV(dst, [8, 9, 10, 11], LAYOUT), lambda: None)
        (handle,) = client.load_many([LoadRequest(toks, into)])
        result = handle.result(30)
        assert result.loaded_blocks == 4 and result.error is None
        assert into.copies == 1  # one copy call, no leased part after it
        assert client.store.lease_free_counters().hits == before.hits + 4
        assert_blocks_equal(dst, [8, 9, 10, 11], src, [3, 1, 4, 0])
        assert client.store.remove(client.keys(toks)[0])  # nothing pinned


def test_a_chunk_replaced_under_the_copy_is_read_again(daemon: DaemonProcess) -> None:
    """Another client removes block 2's chunk and stores other bytes under the same key while
    the lease-free copy runs: blocks 0 and 1 stand, block 2 on is copied again under a lease
    and holds the bytes stored now (the chunk the key names now), never a mix."""
    src = vllm_caches("layer-major", seed=42)
    other_src = vllm_caches("layer-major", seed=43)
    toks = tokens(4 * B, seed=44)
    with client_for(daemon, "free-race") as client, client_for(daemon, "free-race") as other:
        save_blocks(client, [toks], src, [[0, 1, 2, 3]])
        keys = client.keys(toks)

        def replace_under_the_copy() -> None:
            assert other.store.remove(keys[2])  # no lease pins it: the remove goes through
            # the same key again, from other bytes (block 5 of other_src), a child of block 1
            [saved] = other.save_many([SaveRequest(toks[:3 * B], engine_kv_for(
                other_src, [7, 8, 5], LAYOUT), 2)]).result(30)
            assert saved.stored_blocks == (2,)

        dst = vllm_caches("layer-major", seed=None)
        into = _FirstCopyHooked(CpuBlocksKV(dst, [12, 13, 14, 15], LAYOUT),
                                replace_under_the_copy)
        (handle,) = client.load_many([LoadRequest(toks, into)])
        result = handle.result(30)
        assert into.copies >= 2  # the lease-free copy, then the leased rest
        assert_blocks_equal(dst, [12, 13], src, [0, 1])
        # Block 3's chunk went with its parent (removing a chunk drops its descendants): a miss
        assert result.loaded_blocks == 3 and result.failed_blocks == (3,)
        assert_blocks_equal(dst, [14], other_src, [5])


def test_a_chunk_removed_under_the_copy_is_a_miss_not_a_load(daemon: DaemonProcess) -> None:
    src = vllm_caches("layer-major", seed=45)
    toks = tokens(3 * B, seed=46)
    with client_for(daemon, "free-gone") as client, client_for(daemon, "free-gone") as other:
        save_blocks(client, [toks], src, [[4, 5, 6]])
        keys = client.keys(toks)
        dst = vllm_caches("layer-major", seed=None)
        into = _FirstCopyHooked(CpuBlocksKV(dst, [16, 17, 18], LAYOUT),
                                lambda: other.store.remove(keys[1]))
        (handle,) = client.load_many([LoadRequest(toks, into)])
        result = handle.result(30)
        assert result.loaded_blocks == 1 and result.failed_blocks == (1, 2)
        assert_blocks_equal(dst, [16], src, [4])


def test_the_arena_tensor_made_in_inference_mode_is_a_normal_tensor(daemon: DaemonProcess
                                                                    ) -> None:
    """vLLM loads inside ``torch.inference_mode``: the first lease-free read of a fresh client
    there makes its arena-wide tensor, from which every later view derives (a save's reserved
    chunks too, written outside inference mode on the save thread). It must not be an
    inference tensor (the cause of the inline-load failures, 316e54d), whoever reads first."""
    with StoreClient.connect(daemon.grpc_address,
                             StoreClientConfig(data_plane=DataPlane.SHM)) as store:
        key = b"inference-mode-probe-0001"
        store.put(key, bytes(range(256)) * 16)
        plane = store.plane
        with torch.inference_mode():
            first = plane.read_free([key], torch.uint8, (4096,))
            assert first is not None
            first.confirm()
        later = plane.read_free([key], torch.uint8, (4096,))
        assert later is not None
        assert not later.tensors[0].is_inference()
        assert bytes(later.tensors[0].numpy()) == bytes(range(256)) * 16
        later.confirm()

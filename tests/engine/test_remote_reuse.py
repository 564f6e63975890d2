"""A real transformer prefilling through a real daemon process: reuse through kvtier skips
prefill and gives the same output, whether the KV comes from the daemon's DRAM, its NVMe, or
another node over TCP; a load that fails part-way degrades to recompute."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.dataplane.tier import TierKind  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.engine.remote import RemoteEngine, RemotePrefill  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

BLOCK = 16
SPEC = tiny_spec()
DECODE_STEPS = 6


@pytest.fixture(scope="module")
def model() -> object:
    return build_reference_model(SPEC)


@pytest.fixture(scope="module")
def layout(model: object) -> KVLayout:
    return KVLayout.for_model(model, BLOCK)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = DaemonProcess(tmp_path_factory.mktemp("remote-reuse"), "node-a", dram_bytes="16MiB")
    d.start()
    yield d
    d.stop()


def connect(address: str, layout: KVLayout, *, tenant: str,
            plane: DataPlane = DataPlane.AUTO, batch: int = 32) -> KVClient:
    return KVClient.connect(address, layout, namespace_for(layout, "ref-llama", tenant),
                            KVClientConfig(data_plane=plane, load_batch_blocks=batch))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def assert_same_output(engine: RemoteEngine, tokens: list[int], *,
                       expect_reused: int) -> RemotePrefill:
    got = engine.prefill(tokens)
    assert got.reused_tokens == expect_reused
    assert got.computed_tokens == len(tokens) - expect_reused
    out, logits = engine.decode(got, DECODE_STEPS)
    ref = engine.prefill(tokens, reuse=False)
    assert ref.reused_tokens == 0
    ref_out, ref_logits = engine.decode(ref, DECODE_STEPS)
    assert out == ref_out
    for a, b in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    return got


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole"])
@pytest.mark.parametrize("prefix_len", [3 * BLOCK, 3 * BLOCK + 5, 3 * BLOCK - 1])
def test_prefix_reused_through_the_daemon_gives_identical_output(
        model: object, layout: KVLayout, daemon: DaemonProcess, prefix_len: int,
        layerwise: bool) -> None:
    tenant = f"boundary-{prefix_len}-{layerwise}"
    with connect(daemon.grpc_address, layout, tenant=tenant) as client:
        assert client.store.data_plane is DataPlane.SHM
        engine = RemoteEngine(model, client, layerwise=layerwise)
        system = prompt(prefix_len, seed=1)
        first = engine.prefill(system + prompt(20, seed=2))
        assert first.reused_tokens == 0 and first.load is None
        assert first.save is not None
        assert first.save.stored_blocks == tuple(range((prefix_len + 20) // BLOCK))
        match = client.lookup(system)
        assert match.blocks == prefix_len // BLOCK
        assert match.by_tier == {TierKind.DRAM: prefix_len // BLOCK}
        assert match.node_id == "node-a"
        got = assert_same_output(engine, system + prompt(25, seed=3),
                                 expect_reused=(prefix_len // BLOCK) * BLOCK)
        assert got.load is not None and got.load.complete and not got.load.failed_blocks


def test_fully_cached_prompt_computes_its_last_token(model: object, layout: KVLayout,
                                                     daemon: DaemonProcess) -> None:
    with connect(daemon.grpc_address, layout, tenant="full") as client:
        engine = RemoteEngine(model, client)
        tokens = prompt(4 * BLOCK, seed=4)
        engine.prefill(tokens)
        got = assert_same_output(engine, tokens, expect_reused=3 * BLOCK)
        assert got.save is not None and got.save.existing_blocks == (3,)


def test_kv_from_the_daemons_nvme(model: object, layout: KVLayout, tmp_path: Path) -> None:
    # DRAM holds 8 chunks: a second 10-block chain pushes most of the first down to NVMe.
    d = DaemonProcess(tmp_path, "node-small", dram_bytes=str(8 * layout.chunk_bytes))
    d.start()
    try:
        with connect(d.grpc_address, layout, tenant="nvme") as client:
            engine = RemoteEngine(model, client)
            shared = prompt(6 * BLOCK, seed=5)
            engine.prefill([*shared, 1, 2, 3])
            engine.prefill(prompt(10 * BLOCK, seed=6))
            where = client.lookup(shared)
            assert where.blocks == 6
            assert where.by_tier.get(TierKind.NVME, 0) >= 4, where
            got = assert_same_output(engine, [*shared, 9, 9], expect_reused=6 * BLOCK)
            assert got.load is not None and got.load.complete
    finally:
        d.stop()


def test_kv_from_another_node_over_tcp(model: object, layout: KVLayout, daemon: DaemonProcess,
                                       tmp_path: Path) -> None:
    """Engine 1 saves through daemon A's shared memory; engine 2 is on "another node": its
    client is forced onto A's TCP data plane, while its own daemon B has nothing."""
    b = DaemonProcess(tmp_path, "node-b", dram_bytes="4MiB", nvme=False)
    b.start()
    try:
        shared = prompt(5 * BLOCK + 3, seed=10)
        with connect(daemon.grpc_address, layout, tenant="cross") as saver_client:
            RemoteEngine(model, saver_client).prefill([*shared, 7])
        with connect(b.grpc_address, layout, tenant="cross", plane=DataPlane.TCP) as local, \
                connect(daemon.grpc_address, layout, tenant="cross",
                        plane=DataPlane.TCP) as remote:
            assert local.lookup(shared).blocks == 0  # B has never seen it
            assert remote.store.data_plane is DataPlane.TCP
            got = assert_same_output(RemoteEngine(model, remote), [*shared, 8, 8],
                                     expect_reused=5 * BLOCK)
            assert got.load is not None and got.load.loaded_bytes == 5 * layout.chunk_bytes
    finally:
        b.stop()


def test_chunk_removed_between_lookup_and_load_degrades_to_recompute(
        model: object, layout: KVLayout, daemon: DaemonProcess) -> None:
    with connect(daemon.grpc_address, layout, tenant="removed") as client:
        engine = RemoteEngine(model, client)
        shared = prompt(5 * BLOCK, seed=8)
        engine.prefill([*shared, 4])
        keys = client.keys(shared)
        assert client.lookup(shared).blocks == 5
        # Remove block 2 (and, by the prefix rule, everything under it) after the lookup.
        original = client.lookup

        def lookup_then_remove(tokens: object) -> object:
            match = original(tokens)
            client.store.remove(keys[2])
            return match

        client.lookup = lookup_then_remove  # type: ignore[method-assign]
        got = engine.prefill([*shared, 5, 6])
        client.lookup = original  # type: ignore[method-assign]
        assert got.matched_blocks == 5
        assert got.load is not None
        assert got.load.loaded_blocks == 2 and got.load.failed_blocks == (2, 3, 4)
        assert got.reused_tokens == 2 * BLOCK
        # The recomputed blocks were stored again, and the output matches a cold prefill.
        assert got.save is not None and got.save.stored_blocks == (2, 3, 4)
        ref = engine.prefill([*shared, 5, 6], reuse=False)
        assert engine.decode(got, DECODE_STEPS)[0] == engine.decode(ref, DECODE_STEPS)[0]
        torch.testing.assert_close(got.last_logits, ref.last_logits, rtol=1e-4, atol=1e-4)


def test_daemon_killed_mid_load_degrades_to_recompute(model: object, layout: KVLayout,
                                                      tmp_path: Path) -> None:
    d = DaemonProcess(tmp_path, "node-doomed", dram_bytes="4MiB", nvme=False)
    d.start()
    try:
        shared = prompt(6 * BLOCK, seed=12)
        tokens = [*shared, 3, 1, 4]
        with connect(d.grpc_address, layout, tenant="killed", batch=2) as client:
            engine = RemoteEngine(model, client)
            engine.prefill(tokens)
            assert client.lookup(shared).blocks == 6
            fetched: list[int] = []
            original_load = client.load

            def load_and_kill(*args: object, **kwargs: object) -> object:
                def progress(n: int) -> None:
                    fetched.append(n)
                    if len(fetched) == 1:
                        d.kill()  # SIGKILL after the first batch of 2 blocks arrived
                return original_load(*args, on_blocks_fetched=progress, **kwargs)  # type: ignore[arg-type]

            client.load = load_and_kill  # type: ignore[method-assign]
            got = engine.prefill(tokens)
            assert fetched == [2]
            assert got.load is not None
            assert got.load.loaded_blocks == 2 and got.load.failed_blocks == (2, 3, 4, 5)
            assert got.load.error is not None and "PeerUnavailable" in got.load.error
            assert got.reused_tokens == 2 * BLOCK
            assert got.save is not None and got.save.failed_blocks == (2, 3, 4, 5)
            ref = engine.prefill(tokens, reuse=False)
            assert engine.decode(got, DECODE_STEPS)[0] == engine.decode(ref, DECODE_STEPS)[0]
            torch.testing.assert_close(got.last_logits, ref.last_logits, rtol=1e-4, atol=1e-4)
    finally:
        d.stop()

"""A real transformer on node A reusing KV that only node B's daemon holds (a conductor fetch
plan): identical greedy output and logits to a cold prefill; B killed mid-load degrades to
recomputing the blocks that did not arrive. Two real daemon processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore._proto.kvtier.v1 import conductor_pb2  # noqa: E402
from kvstore.client.kv_client import KVClient, KVClientConfig  # noqa: E402
from kvstore.client.kvlayout import KVLayout, namespace_for  # noqa: E402
from kvstore.client.requests import RemoteFetch  # noqa: E402
from kvstore.client.store_client import DataPlane  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.engine.remote import RemoteEngine, RemotePrefill  # noqa: E402
from tests.support.daemon import DaemonProcess, running  # noqa: E402
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
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess,
                                                                        DaemonProcess]]:
    work = tmp_path_factory.mktemp("remote-fetch")
    a = DaemonProcess(work, "node-a", dram_bytes="16MiB", nvme=False)
    b = DaemonProcess(work, "node-b", dram_bytes="16MiB", nvme=False)
    with running(a, b):
        yield a, b


def connect(address: str, layout: KVLayout, tenant: str, *, batch: int = 32) -> KVClient:
    # The other node is reached over TCP, as from another host.
    return KVClient.connect(address, layout, namespace_for(layout, "ref-llama", tenant),
                            KVClientConfig(load_batch_blocks=batch,
                                           remote_data_plane=DataPlane.TCP))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def assert_same_as_cold(engine: RemoteEngine, got: RemotePrefill, tokens: list[int]) -> None:
    out, logits = engine.decode(got, DECODE_STEPS)
    ref = engine.prefill(tokens, reuse=False)
    ref_out, ref_logits = engine.decode(ref, DECODE_STEPS)
    assert out == ref_out
    for x, y in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefix_len", [4 * BLOCK, 4 * BLOCK + 5])
@pytest.mark.parametrize("local_blocks", [0, 2])
def test_prefix_from_the_other_node_gives_identical_output(
        model: object, layout: KVLayout, nodes: tuple[DaemonProcess, DaemonProcess],
        prefix_len: int, local_blocks: int) -> None:
    a, b = nodes
    tenant = f"fetch-{prefix_len}-{local_blocks}"
    system = prompt(prefix_len, seed=prefix_len + local_blocks)
    n_prefix = prefix_len // BLOCK
    with connect(b.grpc_address, layout, tenant) as on_b:
        RemoteEngine(model, on_b).prefill([*system, 5])  # node B's engine saw the prefix
    with connect(a.grpc_address, layout, tenant) as client:
        engine = RemoteEngine(model, client)
        if local_blocks:  # A holds the first blocks from an earlier prompt
            engine.prefill([*system[:local_blocks * BLOCK], 1, 2])
        assert client.lookup(system).blocks == local_blocks
        plan = RemoteFetch.from_plan(conductor_pb2.FetchPlan(
            src_node="node-b", dst_node="node-a", first_block=local_blocks, end_block=n_prefix,
            src_grpc_address=b.grpc_address))
        tokens = [*system, *prompt(9, seed=3)]
        got = engine.prefill(tokens, remote=plan)
        assert got.reused_tokens == n_prefix * BLOCK
        assert got.load is not None and got.load.complete
        assert got.load.remote_blocks == n_prefix - local_blocks
        assert got.load.remote_node == b.grpc_address
        # The save stored the fetched blocks and the new ones in A: next time, all local.
        assert got.save is not None
        assert got.save.stored_blocks == tuple(range(local_blocks, len(tokens) // BLOCK))
        assert client.lookup(system).blocks == n_prefix
        assert_same_as_cold(engine, got, tokens)


def test_other_node_killed_mid_load_recomputes(model: object, layout: KVLayout,
                                               nodes: tuple[DaemonProcess, DaemonProcess],
                                               tmp_path: Path) -> None:
    a, _b = nodes
    doomed = DaemonProcess(tmp_path, "node-doomed", dram_bytes="8MiB", nvme=False)
    doomed.start()
    try:
        shared = prompt(6 * BLOCK, seed=21)
        tokens = [*shared, 3, 1, 4]
        with connect(doomed.grpc_address, layout, "killed") as on_c:
            RemoteEngine(model, on_c).prefill(tokens)
        with connect(a.grpc_address, layout, "killed", batch=2) as client:
            engine = RemoteEngine(model, client)
            fetched: list[int] = []
            original_load = client.load

            def load_and_kill(*args: object, **kwargs: object) -> object:
                def progress(n: int) -> None:
                    fetched.append(n)  # 0 first: A's own daemon has none of it
                    if n == 2:
                        doomed.kill()  # SIGKILL after the first 2 remote blocks arrived
                return original_load(*args, on_blocks_fetched=progress, **kwargs)  # type: ignore[arg-type]

            client.load = load_and_kill  # type: ignore[method-assign]
            plan = RemoteFetch("node-doomed", doomed.grpc_address, 0, 6)
            got = engine.prefill(tokens, remote=plan)
            client.load = original_load  # type: ignore[method-assign]
            assert fetched == [0, 2]
            assert got.load is not None
            assert got.load.loaded_blocks == got.load.remote_blocks == 2
            assert got.load.failed_blocks == (2, 3, 4, 5)
            assert got.load.error is not None and "PeerUnavailable" in got.load.error
            assert got.reused_tokens == 2 * BLOCK
            assert got.computed_tokens == len(tokens) - 2 * BLOCK
            assert got.save is not None and got.save.stored_blocks == tuple(range(6))
            assert_same_as_cold(engine, got, tokens)
            # The node stays gone: the next prefill recomputes nothing wrongly either.
            again = engine.prefill([*shared[:3 * BLOCK], 8], remote=plan)
            assert again.reused_tokens == 3 * BLOCK and again.load is not None
            assert again.load.remote_blocks == 0  # all local now (the save above stored them)
    finally:
        doomed.stop()

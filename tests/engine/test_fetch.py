"""Fetch plans end to end: a prefix prefilled on node A, the next request placed by the real
conductor on node B's prefill worker with a fetch plan; the worker loads the prefix from node
A's daemon, computes only the rest, and the output is the reference's."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.cluster.local import ClusterSpec, LocalCluster  # noqa: E402
from kvstore.engine.gateway import Gateway, GatewayResult  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.engine.worker.prefill import _fetch_plan  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from kvstore.membership.launcher import find_etcd_binary  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

BLOCK = 16
SPEC = tiny_spec()
NEW_TOKENS = 6
NODE_OF = {"prefill-0": "node-a", "prefill-1": "node-b"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if find_etcd_binary() is None:
        pytest.skip("etcd binary not found")
    spec = ClusterSpec(work_dir=tmp_path_factory.mktemp("fetch-cluster"), spec=SPEC,
                       block_tokens=BLOCK, dram_bytes=16 << 20, nvme_bytes=32 << 20,
                       prefill_nodes=("node-a", "node-b"))
    with LocalCluster(spec) as c:
        yield c


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def reference(model: object, tokens: list[int]) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        res = model(input_ids=torch.tensor([tokens]), use_cache=True)  # type: ignore[operator]
        for _ in range(NEW_TOKENS):
            out.append(int(torch.argmax(res.logits[0, -1])))
            res = model(input_ids=torch.tensor([[out[-1]]]),  # type: ignore[operator]
                        past_key_values=res.past_key_values, use_cache=True)
    return out


async def placed_elsewhere(gateway: Gateway, first: GatewayResult, request_id: str,
                           tokens: list[int], tenant: str, prefix_blocks: int) -> GatewayResult:
    """Serve ``tokens`` after making ``first``'s prefill instance look busy to the conductor,
    once the conductor's index shows its node holding the prefix: the scheduler then places
    the request on the other node's prefill worker, with a fetch plan from the first node."""
    busy, node = first.prefill_instance, NODE_OF[first.prefill_instance]
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        found = await gateway.conductor.lookup(token_ids=tokens, model=gateway.model_name,
                                               tenant=tenant)
        if any(m.node_id == node and m.blocks >= prefix_blocks for m in found.nodes):
            break
        assert asyncio.get_running_loop().time() < deadline, "the index never saw the prefix"
        await asyncio.sleep(0.05)
    # The real ReportLoad RPC: a million queued tokens on the instance that holds the prefix.
    # (Its own reports come only when a request starts or ends; it serves none meanwhile.)
    assert await gateway.conductor.report_load(busy, queued_prefill_tokens=1_000_000)
    return await gateway.generate(request_id, tokens, max_new_tokens=NEW_TOKENS, tenant=tenant)


def test_prefix_on_another_node_is_fetched_not_recomputed(cluster: LocalCluster) -> None:
    system = prompt(3 * BLOCK, seed=31)
    first_tokens = system + prompt(BLOCK + 5, seed=32)
    second_tokens = system + prompt(2 * BLOCK + 3, seed=33)

    async def go() -> tuple[GatewayResult, GatewayResult, GatewayResult]:
        async with Gateway(etcd_endpoint=cluster.etcd_endpoint, prefix=cluster.spec.prefix,
                           model_name=cluster.spec.model_name) as gateway:
            first = await gateway.generate("fetch-1", first_tokens, max_new_tokens=NEW_TOKENS,
                                           tenant="fetch")
            second = await placed_elsewhere(gateway, first, "fetch-2", second_tokens, "fetch",
                                            prefix_blocks=3)
            # The same prompt on a cold tenant: the baseline the fetch must equal.
            plain = await gateway.generate("plain-2", second_tokens, max_new_tokens=NEW_TOKENS,
                                           tenant="fetch-plain", reuse=False)
            return first, second, plain

    first, second, plain = asyncio.run(go())
    assert first.fetch is None and first.prefill["computed_tokens"] == len(first_tokens)
    src = NODE_OF[first.prefill_instance]
    # The conductor planned the fetch and the request ran on the other node.
    assert second.prefill_instance != first.prefill_instance
    assert second.fetch is not None
    assert second.fetch["src_node"] == src and second.fetch["end_block"] == 3
    assert second.fetch["src_address"] == cluster.daemon_addresses[src]
    # The worker loaded the 3 shared blocks from the other node and computed only the rest.
    assert second.prefill["local_lookup_blocks"] == 0
    assert second.prefill["fetched_blocks"] == 3 and second.prefill["fetch_node"] == src
    assert second.prefill["reused_tokens"] == 3 * BLOCK
    assert second.prefill["computed_tokens"] == len(second_tokens) - 3 * BLOCK
    assert plain.prefill["computed_tokens"] == len(second_tokens)
    # Identical outputs, equal to a full forward in this process; the decode worker got every
    # full block from the second request's node (fetched blocks were replicated there).
    model = build_reference_model(SPEC)
    assert first.tokens == reference(model, first_tokens)
    assert second.tokens == plain.tokens == reference(model, second_tokens)
    assert second.decode["loaded_blocks"] == len(second_tokens) // BLOCK
    assert second.decode["recomputed_tokens"] == 0


def test_fetch_field_is_validated() -> None:
    assert _fetch_plan({}) is None and _fetch_plan({"fetch": None}) is None
    plan = _fetch_plan({"fetch": {"src_node": "node-a", "src_address": "127.0.0.1:5",
                                  "first_block": 0, "end_block": 3}})
    assert plan is not None and (plan.node_id, plan.end_block) == ("node-a", 3)
    for bad in ("x", {"src_node": "node-a"},
                {"src_node": "n", "src_address": "a:1", "first_block": 4, "end_block": 3}):
        with pytest.raises(InvalidArgument):
            _fetch_plan({"fetch": bad})

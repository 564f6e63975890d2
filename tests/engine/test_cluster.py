"""A local cluster of real processes (etcd, conductor, two daemons, a prefill and a decode
worker) serving requests through the gateway: greedy outputs are identical with and without
reuse and equal to an in-process reference, reused prefixes skip prefill, and the KV of the
prompt reaches the decode worker through kvtier."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.cluster.local import ClusterSpec, LocalCluster  # noqa: E402
from kvstore.engine.frames import read_frame, write_frame  # noqa: E402
from kvstore.engine.gateway import Gateway, GatewayResult  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.errors import InvalidArgument, KvtierError  # noqa: E402
from kvstore.membership.launcher import find_etcd_binary  # noqa: E402
from tests.support.common import wait_until  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

BLOCK = 16
SPEC = tiny_spec()
NEW_TOKENS = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if find_etcd_binary() is None:
        pytest.skip("etcd binary not found")
    spec = ClusterSpec(work_dir=tmp_path_factory.mktemp("cluster"), spec=SPEC,
                       block_tokens=BLOCK, dram_bytes=16 << 20, nvme_bytes=32 << 20)
    with LocalCluster(spec) as c:
        yield c


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


def reference(model: object, tokens: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens from one full forward in this process (no kvtier anywhere)."""
    out: list[int] = []
    with torch.no_grad():
        res = model(input_ids=torch.tensor([tokens]), use_cache=True)  # type: ignore[operator]
        for _ in range(new_tokens):
            out.append(int(torch.argmax(res.logits[0, -1])))
            res = model(input_ids=torch.tensor([[out[-1]]]),  # type: ignore[operator]
                        past_key_values=res.past_key_values, use_cache=True)
    return out


def serve(cluster: LocalCluster, prompts: list[list[int]], *, tenant: str, reuse: bool
          ) -> list[GatewayResult]:
    async def go() -> list[GatewayResult]:
        async with Gateway(etcd_endpoint=cluster.etcd_endpoint, prefix=cluster.spec.prefix,
                           model_name=cluster.spec.model_name) as gateway:
            return [await gateway.generate(f"{tenant}-{i}", p, max_new_tokens=NEW_TOKENS,
                                           tenant=tenant, reuse=reuse)
                    for i, p in enumerate(prompts)]
    return asyncio.run(go())


def test_reuse_skips_prefill_and_outputs_are_identical(cluster: LocalCluster) -> None:
    system = prompt(3 * BLOCK, seed=1)
    # Prompts ending on and off block boundaries, sharing a 3-block prefix, plus one that
    # continues the first (a conversation's next turn).
    prompts = [system + prompt(2 * BLOCK + 5, seed=2), system + prompt(BLOCK, seed=3),
               system + prompt(7, seed=4)]
    prompts.append(prompts[0] + prompt(BLOCK + 3, seed=5))
    plain = serve(cluster, prompts, tenant="plain", reuse=False)
    reused = serve(cluster, prompts, tenant="reuse", reuse=True)

    model = build_reference_model(SPEC)
    for p, a, b in zip(prompts, plain, reused, strict=True):
        assert a.accepted and b.accepted
        assert a.tokens == b.tokens == reference(model, p)
        assert a.prefill_instance == "prefill-0" and a.decode_instance == "decode-0"
        # Every full block went through kvtier to the decode worker, in both modes.
        assert a.decode["loaded_blocks"] == len(p) // BLOCK == b.decode["loaded_blocks"]
        assert a.decode["recomputed_tokens"] == 0 == b.decode["recomputed_tokens"]
        assert a.prefill["computed_tokens"] == len(p) and a.prefill["reused_tokens"] == 0

    computed = [r.prefill["computed_tokens"] for r in reused]
    assert computed[0] == len(prompts[0])
    assert computed[1] == len(prompts[1]) - 3 * BLOCK
    assert computed[2] == len(prompts[2]) - 3 * BLOCK
    assert computed[3] == len(prompts[3]) - (len(prompts[0]) // BLOCK) * BLOCK
    assert sum(computed) < sum(r.prefill["computed_tokens"] for r in plain) // 2
    assert all(r.prefill["loaded_bytes"] > 0 for r in reused[1:])


def test_concurrent_requests_share_decode_batches_with_identical_outputs(
        cluster: LocalCluster) -> None:
    # Requests sent at once: the prefill worker serves them one after another, the decode
    # worker batches them (each joins the running batch between steps). Lengths on and off
    # block boundaries, one shorter than a block (nothing to load), one wanting a single
    # token (answered without a step), with and without reuse of a shared prefix.
    shared = prompt(2 * BLOCK, seed=20)
    cases = [(shared + prompt(BLOCK + 3, seed=21), 24), (prompt(7, seed=22), 24),
             (shared + prompt(BLOCK, seed=23), 20), (prompt(3 * BLOCK + 9, seed=24), 24),
             (shared + prompt(5, seed=25), 1), (prompt(50, seed=26), 22)]

    async def go() -> list[GatewayResult]:
        async with Gateway(etcd_endpoint=cluster.etcd_endpoint, prefix=cluster.spec.prefix,
                           model_name=cluster.spec.model_name) as gateway:
            return list(await asyncio.gather(*(
                gateway.generate(f"batch-{i}", p, max_new_tokens=n, tenant="batch",
                                 reuse=i % 2 == 0) for i, (p, n) in enumerate(cases))))

    results = asyncio.run(go())
    model = build_reference_model(SPEC)
    for (p, n), r in zip(cases, results, strict=True):
        assert r.accepted
        assert r.tokens == reference(model, p, n), r.request_id
        assert r.decode["loaded_blocks"] == len(p) // BLOCK
        assert r.decode["recomputed_tokens"] == 0
    # Batching happened: some decode steps ran several sequences at once.
    assert max(r.decode["batch_mean"] for r in results) > 1.0
    assert results[4].decode["batch_mean"] == 1.0 and len(results[4].tokens) == 1


def test_decode_worker_recomputes_kv_it_cannot_load_inside_a_batch(
        cluster: LocalCluster) -> None:
    # Decode frames sent straight to the decode worker, concurrently, naming a tenant whose
    # blocks were never saved: every load comes back empty, so each request recomputes its
    # prompt's KV before joining the batch (the tail bytes are then unused: zeros here).
    model = build_reference_model(SPEC)
    address = str(cluster.children["decode-0"].ready["address"])
    prompts = [prompt(2 * BLOCK + 4, seed=40), prompt(BLOCK, seed=41), prompt(3 * BLOCK + 1, 42)]
    refs = [reference(model, p, 12) for p in prompts]
    per_token = 2 * SPEC.num_layers * SPEC.num_kv_heads * SPEC.head_dim * 4  # float32 KV

    async def one(p: list[int], ref: list[int], i: int) -> dict[str, object]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        full = len(p) // BLOCK
        try:
            await write_frame(writer, {
                "op": "decode", "token_ids": p, "tenant": "never-saved", "ticket": 10_000 + i,
                "first_token": ref[0], "max_new_tokens": len(ref),
                "kv_address": cluster.daemon_addresses["node-a"], "full_blocks": full,
                "tail_tokens": len(p) - full * BLOCK}, bytes((len(p) - full * BLOCK) * per_token))
            doc, _ = await read_frame(reader)
            return doc
        finally:
            writer.close()

    async def go() -> list[dict[str, object]]:
        return list(await asyncio.gather(*(one(p, r, i) for i, (p, r)
                                           in enumerate(zip(prompts, refs, strict=True)))))

    for p, ref, doc in zip(prompts, refs, asyncio.run(go()), strict=True):
        assert doc["event"] == "done", doc
        decode = doc["decode"]
        assert isinstance(decode, dict)
        assert decode["tokens"] == ref
        assert decode["loaded_blocks"] == 0 and decode["recomputed_tokens"] == len(p)


def test_worker_rejects_a_malformed_request(cluster: LocalCluster) -> None:
    address = str(cluster.children["prefill-0"].ready["address"])

    async def go() -> dict[str, object]:
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            await write_frame(writer, {"op": "generate", "token_ids": []})
            doc, _ = await read_frame(reader)
            return doc
        finally:
            writer.close()

    doc = asyncio.run(go())
    assert doc["event"] == "error" and doc["error"] == InvalidArgument.__name__
    assert "token_ids" in str(doc["message"])


def test_worker_registers_again_after_its_lease_lapsed(cluster: LocalCluster) -> None:
    # A stalled process or etcd can let the engine lease expire, which deletes the record the
    # conductor schedules from. Revoking the lease does the same at once: the worker notices at
    # its next refresh (etcd answers TTL 0) and registers again under a new lease.
    from kvstore.membership.engines import EngineRecord, EngineRole
    from kvstore.membership.etcd import KeyLayout, etcd_client

    key = KeyLayout(cluster.spec.prefix).engine_key(EngineRole.DECODE.value, "decode-0").encode()

    async def revoke_and_wait() -> tuple[int, int]:
        async with etcd_client(cluster.etcd_endpoint) as etcd:
            async def lease_of_record() -> int:
                got = await etcd.get(key)
                if got is None:
                    return 0
                assert EngineRecord.from_json(got.value).instance_id == "decode-0"
                return int(got.lease)

            before = await lease_of_record()
            await etcd.revoke_lease(before)
            assert await lease_of_record() == 0  # the record went with its lease
            deadline = asyncio.get_running_loop().time() + 20
            while (after := await lease_of_record()) == 0:
                assert asyncio.get_running_loop().time() < deadline, "the worker never came back"
                await asyncio.sleep(0.1)
            return before, after

    before, after = asyncio.run(revoke_and_wait())
    assert before and after and before != after
    # The conductor schedules onto it again (its engine watch trails etcd by a moment).
    p = prompt(BLOCK + 2, seed=50)
    wait_until(lambda: _serves(cluster, p), timeout_s=20, what="a request served again")


def _serves(cluster: LocalCluster, tokens: list[int]) -> bool:
    try:
        (result,) = serve(cluster, [tokens], tenant="relapsed", reuse=True)
    except KvtierError:
        return False
    if not result.accepted:  # no decode instance known to the conductor yet
        return False
    assert result.tokens == reference(build_reference_model(SPEC), tokens)
    return True


def test_cluster_stops_every_process(cluster: LocalCluster) -> None:
    # Last in the module: stops the shared cluster (the fixture's own stop is then a no-op).
    procs = [child.proc for child in cluster.children.values()]
    codes = cluster.stop()
    assert set(codes) == {"conductor", "node-a", "node-b", "prefill-0", "decode-0"}
    assert all(p is not None and p.poll() is not None for p in procs)
    assert all(code == 0 for code in codes.values()), codes
    assert cluster.stop() == {}


@pytest.mark.slow
def test_kvtier_run_serves_a_trace_slice_through_the_cluster(tmp_path: Path) -> None:
    # The reference-engine `kvtier run --reference` path at a tiny size: its own cluster, both passes, identical
    # outputs (exit code 0), the report, and no process left behind.
    if find_etcd_binary() is None:
        pytest.skip("etcd binary not found")
    from tests.support.daemon import kvtier

    out = kvtier("run", "--reference", "--requests", "4", "--max-blocks", "3", "--new-tokens", "3",
                 "--work-dir", str(tmp_path), timeout_s=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "outputs identical in 4/4 requests" in out.stdout
    assert "Bytes moved per tier" in out.stdout and "node-a" in out.stdout
    assert (tmp_path / "logs" / "prefill-0.log").exists()

"""The conductor prices kvtier's tiers for a vLLM engine with the kvtier connector (issue 14).

A vLLM engine record names its KV-event publisher (``vllm_kv_events``, ``sha256_cbor``); when it
also carries the connector's KV fingerprint, the conductor hashes a prompt's token ids into the
connector's own keys (vLLM's block hashes with the record's seed and the tenant as the salt,
behind the namespace: :mod:`kvstore.integrations.vllm`), so what the connector saved in a
daemon counts for the engines on that node. Against a real conductor, daemon and etcd; the keys
are made as the connector makes them (:meth:`BlockHasher.key_from_vllm_hash` of vLLM's hash)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace
from kvstore.membership.engines import EngineRecord, EngineRole, VllmKvEvents
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from tests.control.test_conductor_service import CHUNK, Cluster, ready, run, wait_until

MODEL = "tiny-vllm"
BLOCK = 32
SEED = "0"
FINGERPRINT = KVFingerprint(MODEL, KVDtype.FLOAT32, num_layers=2, num_kv_heads=2, head_dim=16,
                            block_size_tokens=BLOCK)


def vllm_record(instance_id: str, node_id: str, fingerprint: KVFingerprint | None,
                events_dir: str) -> EngineRecord:
    events = VllmKvEvents(endpoint=f"ipc://{events_dir}/{instance_id}-kv.sock",
                          replay_endpoint=f"ipc://{events_dir}/{instance_id}-replay.sock",
                          topic="kv", hash_algo="sha256_cbor", hash_seed=SEED,
                          block_size_tokens=BLOCK)
    return EngineRecord(instance_id, EngineRole.PREFILL, MODEL, node_id,
                        http_url="http://127.0.0.1:1", vllm_kv_events=events,
                        kv_fingerprint=fingerprint)


def vllm_decode_record(instance_id: str, node_id: str) -> EngineRecord:
    """The same server's decode side (the fleet's colocated pair: one ``http_url``)."""
    return EngineRecord(f"{instance_id}.decode", EngineRole.DECODE, MODEL, node_id,
                        kv_capacity_tokens=4096, http_url="http://127.0.0.1:1")


@pytest.mark.parametrize("with_fingerprint", [True, False], ids=["connector", "events-only"])
def test_the_connectors_saved_blocks_count_for_a_vllm_engine(
        aio: asyncio.Runner, tmp_path: pytest.TempPathFactory, etcd_server: LocalEtcd,
        with_fingerprint: bool) -> None:
    layout = KeyLayout(f"/vllm-store-keys-{int(with_fingerprint)}/")
    cluster = Cluster(tmp_path, etcd_server.client_url, layout)  # type: ignore[arg-type]
    tenant = "salt-1"
    token_ids = [(7 * i + 3) % 30_000 for i in range(3 * BLOCK + 5)]
    connector = BlockHasher(Namespace(FINGERPRINT, tenant), mode=HashMode.SHA256_CBOR,
                            vllm_hash_seed=SEED)
    vllm_hashes = [connector.vllm_block_hash(k) for k in connector.hash_blocks(token_ids)]
    keys = [connector.key_from_vllm_hash(h) for h in vllm_hashes]
    try:
        cluster.daemon("node-a")
        cluster.conductor("c-1", "--block-size-tokens", str(BLOCK))
        from kvstore.client.store_client import StoreClient

        with StoreClient.connect(cluster.daemons["node-a"].grpc_address) as store:
            parent = None
            for key in keys:
                store.put(key, CHUNK, parent=parent)
                parent = key

        async def scenario() -> None:
            await cluster.engines(vllm_record("v1", "node-a",
                                              FINGERPRINT if with_fingerprint else None,
                                              str(tmp_path)),
                                  vllm_decode_record("v1", "node-a"))
            async with cluster.client() as client:
                await ready(client, nodes={"node-a"}, prefill_ids={"v1"})

                async def indexed() -> bool:
                    return (await client.lookup(keys=keys)).best_blocks == 3

                await wait_until(indexed, 30.0, "the saved blocks are indexed")
                reply = await client.lookup(token_ids=token_ids, model=MODEL, tenant=tenant)
                placed = await client.schedule("r-1", MODEL, token_ids=token_ids,
                                               tenant=tenant)
                assert placed.accepted, placed.message
                if with_fingerprint:
                    assert reply.best_blocks == 3 and reply.blocks == 3
                    assert placed.local_blocks == 3 and placed.prefill_node == "node-a"
                    other = await client.lookup(token_ids=token_ids, model=MODEL,
                                                tenant="salt-2")
                    assert other.best_blocks == 0  # another salt: other keys
                else:  # only the engine's own cache can be matched
                    assert reply.blocks == 0 and placed.local_blocks == 0

        run(aio, scenario(), timeout_s=120.0)
    finally:
        cluster.close()


def test_a_model_whose_engines_make_keys_differently_is_refused_by_name(
        aio: asyncio.Runner, tmp_path: pytest.TempPathFactory, etcd_server: LocalEtcd) -> None:
    """A reference worker (kvtier's xxh3 chain) and a vLLM engine with the connector
    (sha256_cbor) under one model name: the conductor used to hash every prompt with the first
    fingerprinted record it found, so one of the two was priced with keys it never stores. It
    refuses token ids for that model now, naming both engines and their schemes; chained keys
    still schedule, and the vLLM engine alone (the worker gone) is priced on its own keys."""
    layout = KeyLayout("/vllm-store-keys-mixed/")
    cluster = Cluster(tmp_path, etcd_server.client_url, layout)  # type: ignore[arg-type]
    token_ids = [(5 * i + 1) % 30_000 for i in range(2 * BLOCK + 3)]
    worker = EngineRecord("w1", EngineRole.PREFILL, MODEL, "node-a", kv_fingerprint=FINGERPRINT)
    try:
        cluster.daemon("node-a")
        cluster.conductor("c-1", "--block-size-tokens", str(BLOCK))

        async def scenario() -> None:
            await cluster.engines(vllm_record("v1", "node-a", FINGERPRINT, str(tmp_path)),
                                  vllm_decode_record("v1", "node-a"), worker)
            async with cluster.client() as client:
                await ready(client, nodes={"node-a"}, prefill_ids={"v1", "w1"})
                with pytest.raises(InvalidArgument, match=r"make their store keys differently"
                                   r" \(v1: sha256_cbor keys .*; w1: xxh3_128 keys"):
                    await client.schedule("r-1", MODEL, token_ids=token_ids, tenant="t")
                keyed = await client.schedule("r-2", MODEL, keys=[b"k1", b"k2"],
                                              input_tokens=2 * BLOCK + 3)
                assert keyed.accepted, keyed.message
                async with etcd_client(cluster.etcd_url) as etcd:
                    await etcd.delete(layout.engine_key("prefill", "w1").encode())

                async def worker_gone() -> bool:
                    return "w1" not in (await client.leader_info()).prefill_instances

                await wait_until(worker_gone, 30.0, "the worker's record leaves")
                placed = await client.schedule("r-3", MODEL, token_ids=token_ids, tenant="t")
                assert placed.accepted and placed.prefill_instance == "v1", placed.message

        run(aio, scenario(), timeout_s=120.0)
    finally:
        cluster.close()

"""``conductor.store_keys``: which key scheme a model's engine records name, and a refusal of
a model whose engines make their store keys differently. Pure."""

from __future__ import annotations

import pytest

from conductor.store_keys import KeyScheme, key_scheme, store_hasher
from kvstore.errors import InvalidArgument
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace
from kvstore.membership.engines import EngineRecord, EngineRole, VllmKvEvents

MODEL = "m"
BLOCK = 32
FP = KVFingerprint(MODEL, KVDtype.FLOAT32, num_layers=2, num_kv_heads=2, head_dim=16,
                   block_size_tokens=BLOCK)
OTHER_FP = KVFingerprint(MODEL, KVDtype.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=16,
                         block_size_tokens=BLOCK)
ELSEWHERE_FP = KVFingerprint("other", KVDtype.FLOAT16, num_layers=2, num_kv_heads=2,
                             head_dim=16, block_size_tokens=BLOCK)
TOKENS = list(range(3, 3 + 3 * BLOCK))


def vllm(instance_id: str, fp: KVFingerprint | None, seed: str = "0",
         algo: str = "sha256_cbor") -> tuple[str, EngineRecord]:
    events = VllmKvEvents(endpoint=f"ipc:///tmp/{instance_id}.sock", topic="kv",
                          hash_algo=algo, hash_seed=seed, block_size_tokens=BLOCK)
    return instance_id, EngineRecord(instance_id, EngineRole.PREFILL, MODEL, "n",
                                     http_url=f"http://{instance_id}:1", vllm_kv_events=events,
                                     kv_fingerprint=fp)


def worker(instance_id: str, fp: KVFingerprint | None = FP, model: str = MODEL
           ) -> tuple[str, EngineRecord]:
    return instance_id, EngineRecord(instance_id, EngineRole.PREFILL, model, "n",
                                     kv_fingerprint=fp)


def test_each_record_names_its_scheme() -> None:
    assert key_scheme(vllm("v", FP, seed="7")[1]) == KeyScheme(FP, HashMode.SHA256_CBOR, "7")
    assert key_scheme(worker("w")[1]) == KeyScheme(FP, HashMode.XXH3_128)
    assert key_scheme(vllm("v", None)[1]) is None
    assert key_scheme(worker("w", None)[1]) is None


def test_the_hasher_makes_the_keys_the_engines_clients_make() -> None:
    connector = BlockHasher(Namespace(FP, "salt"), mode=HashMode.SHA256_CBOR, vllm_hash_seed="0")
    got = store_hasher([vllm("v0", FP), vllm("v1", FP), vllm("e", None)], MODEL, "salt", BLOCK)
    assert got is not None and got.hash_blocks(TOKENS) == connector.hash_blocks(TOKENS)
    workers = store_hasher([worker("w0"), worker("w1")], MODEL, "t", BLOCK)
    assert workers is not None
    assert workers.hash_blocks(TOKENS) == BlockHasher(Namespace(FP, "t")).hash_blocks(TOKENS)
    # Other models' records do not count; no fingerprint at all is no hasher.
    assert store_hasher([worker("x", ELSEWHERE_FP, model="other"), vllm("v0", FP)], MODEL, "s",
                        BLOCK) is not None
    assert store_hasher([vllm("e", None), worker("x", ELSEWHERE_FP, model="other")], MODEL, "s",
                        BLOCK) is None


@pytest.mark.parametrize(("records", "named"), [
    ([vllm("v0", FP), worker("w0")], r"v0: sha256_cbor keys .*; w0: xxh3_128 keys"),
    ([vllm("v0", FP, seed="0"), vllm("v1", FP, seed="1")], r"v0: .*seed '0'; v1: .*seed '1'"),
    ([worker("w0", FP), worker("w1", OTHER_FP)], r"w0: xxh3_128 keys of m float32 .*; "
                                                 r"w1: xxh3_128 keys of m float16"),
])
def test_engines_of_one_model_with_different_schemes_are_refused_by_name(
        records: list[tuple[str, EngineRecord]], named: str) -> None:
    """In whichever order the records come (the conductor used to take the first one's)."""
    for order in (records, records[::-1]):
        with pytest.raises(InvalidArgument, match="make their store keys differently") as exc:
            store_hasher(order, MODEL, "t", BLOCK)
        assert exc.match(named)


def test_blocks_of_another_size_are_refused() -> None:
    with pytest.raises(InvalidArgument, match="blocks of 32 tokens; this scheduler counts "
                                              "blocks of 512"):
        store_hasher([worker("w0")], MODEL, "t", 512)

"""One prompt matched against the engines' own caches once per Schedule (conductor/engine_index.py
``EngineCacheIndex.match``, conductor/service.py): the same answers as hashing per call, from one
hashing of the prompt, for token ids given as a list or as the numpy array the RPC handler makes
of the request's ``repeated uint32`` field. Pure logic on synthetic vLLM event batches; the
handler's path end to end is in test_conductor_service.py."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import pytest

from conductor.engine_index import (
    EngineBatch,
    EngineCacheIndex,
    PromptMatch,
    VllmBlockHashes,
    decode_batch,
)
from conductor.service import _token_array
from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore.membership.engines import VllmKvEvents

BLOCK = 32
SPEC = VllmKvEvents(endpoint="ipc:///tmp/x", replay_endpoint="ipc:///tmp/y",
                    block_size_tokens=BLOCK, hash_seed="0")
DIGEST_SPEC = VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=BLOCK, hash_seed="0",
                           int_block_hashes=False)
OTHER_BLOCK_SPEC = VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=16, hash_seed="0")


def prompt(seed: int, blocks: int, extra: int = 0) -> list[int]:
    return [(seed * 7919 + i * 13) % 1000 for i in range(blocks * BLOCK + extra)]


def stored(tokens: list[int], spec: VllmKvEvents, blocks: int, tenant: str = "") -> dict[str, Any]:
    hashes = VllmBlockHashes(spec, tenant).hashes(tokens)[:blocks]
    size = spec.block_size_tokens
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": tokens[: len(hashes) * size], "block_size": size, "lora_id": None,
            "medium": "GPU", "group_idx": 0,
            "extra_keys": [(tenant,)] + [None] * (len(hashes) - 1) if tenant else None}


def batch(seq: int, *events: dict[str, Any]) -> EngineBatch:
    return decode_batch(seq, msgspec.msgpack.encode([1795944524.5, list(events), 0]))


class CountingHashes:
    """Counts VllmBlockHashes.hashes calls (patched onto the class, wrapping the real one)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = VllmBlockHashes.hashes

        def counted(hasher: VllmBlockHashes, token_ids: Any) -> Any:
            self.calls += 1
            return real(hasher, token_ids)

        monkeypatch.setattr(VllmBlockHashes, "hashes", counted)


def three_engines() -> tuple[EngineCacheIndex, list[int]]:
    """a holds 3 blocks of the prompt, b 1, c (blocks of 16) 4 of its 16-token blocks."""
    tokens = prompt(1, 4, extra=5)
    index = EngineCacheIndex()
    for name, spec, blocks in (("a", SPEC, 3), ("b", SPEC, 1), ("c", OTHER_BLOCK_SPEC, 4)):
        view = index.track(name, spec)
        index.replay_done(view)
        index.on_live(view, batch(0, stored(tokens, spec, blocks)))
    return index, tokens


def test_one_hashing_per_distinct_spec_and_none_again_for_the_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    index, tokens = three_engines()
    counter = CountingHashes(monkeypatch)
    match = index.match(tokens)
    assert match.cached_tokens == {"a": 3 * BLOCK, "b": BLOCK, "c": 4 * 16}
    assert counter.calls == 2  # a and b share block size and seed; c has its own
    index.expect_routed("b", tokens, "", match)
    index.expect_routed("c", tokens, "", match)
    assert counter.calls == 2
    index.expect_routed("a", tokens)  # without a match: hashed again
    assert counter.calls == 3


def test_the_probe_from_a_match_is_the_probe_from_a_fresh_hashing() -> None:
    with_match, tokens = three_engines()
    without, _ = three_engines()
    with_match.expect_routed("b", tokens, "", with_match.match(tokens))
    without.expect_routed("b", tokens)
    probed = [index.view("b") for index in (with_match, without)]
    assert [v.stats.probes for v in probed if v is not None] == [1, 1]
    last = VllmBlockHashes(SPEC).hashes(tokens)[-1]
    assert all(last in v._probes for v in probed if v is not None)


def test_a_match_of_another_tenant_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    index, tokens = three_engines()
    match = index.match(tokens, "tenant-x")
    counter = CountingHashes(monkeypatch)
    index.expect_routed("b", tokens, "", match)
    assert counter.calls == 1
    assert match.hashes((BLOCK, "0", True), "tenant-x") == \
        VllmBlockHashes(SPEC, "tenant-x").hashes(tokens)
    assert match.hashes((BLOCK, "0", True), "") is None


def test_a_tenant_match_matches_the_salted_blocks() -> None:
    tokens = prompt(2, 3)
    index = EngineCacheIndex()
    view = index.track("v", SPEC)
    index.replay_done(view)
    index.on_live(view, batch(0, stored(tokens, SPEC, 2, "tenant-a")))
    assert index.match(tokens, "tenant-a").cached_tokens == {"v": 2 * BLOCK}
    assert index.match(tokens).cached_tokens == {"v": 0}


def test_a_view_replaced_while_the_prompt_is_hashed_counts_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    index, tokens = three_engines()
    real = VllmBlockHashes.hashes

    def reregister_meanwhile(hasher: VllmBlockHashes, token_ids: Any) -> Any:
        index.track("a", SPEC, generation=7)  # a new lease: a fresh, empty view
        return real(hasher, token_ids)

    monkeypatch.setattr(VllmBlockHashes, "hashes", reregister_meanwhile)
    match = index.match(tokens, instances={"a", "b"})
    assert match.cached_tokens == {"a": 0, "b": BLOCK}


def test_numpy_token_ids_match_like_a_list() -> None:
    index, tokens = three_engines()
    assert index.match(np.array(tokens, dtype=np.uint32)).cached_tokens == \
        index.match(tokens).cached_tokens
    for spec in (SPEC, DIGEST_SPEC, OTHER_BLOCK_SPEC):
        hasher = VllmBlockHashes(spec)
        assert hasher.hashes(np.array(tokens, dtype=np.uint32)) == hasher.hashes(tokens) == \
            hasher.hashes(tuple(tokens))


@pytest.mark.parametrize("spec", [SPEC, DIGEST_SPEC])
def test_hashes_are_the_store_keys_last_bytes(spec: VllmKvEvents) -> None:
    """ints: the digest's last 8 bytes, big-endian; digests: the 32 bytes after the 16-byte
    namespace prefix of each store key (vLLM's ``maybe_convert_block_hash``)."""
    rng = random.Random(5)
    tokens = [rng.randrange(0, 2**32) for _ in range(40 * BLOCK + 7)]
    hasher = VllmBlockHashes(spec)
    keys = hasher._hasher.hash_blocks(tokens)
    got: list[Any] = list(hasher.hashes(tokens))
    if spec.int_block_hashes:
        assert got == [int.from_bytes(k[-8:], "big") for k in keys]
        assert all(type(h) is int for h in got)
    else:
        assert got == [k[16:] for k in keys]
        assert all(type(h) is bytes and len(h) == 32 for h in got)
    assert hasher.hashes(tokens[: BLOCK - 1]) == []


def test_an_empty_index_and_no_instances_match_nothing() -> None:
    index, tokens = three_engines()
    assert index.match(tokens, instances=set()).cached_tokens == {}
    assert EngineCacheIndex().match(tokens) == PromptMatch({}, "", {})


def test_the_handlers_token_array_is_the_request_field() -> None:
    rng = random.Random(3)
    ids = [rng.randrange(0, 2**32) for _ in range(5000)] + [0, 2**32 - 1]
    request = pb.ScheduleRequest.FromString(
        pb.ScheduleRequest(request_id="r", token_ids=ids).SerializeToString())
    array = _token_array(request.token_ids)
    assert array.dtype == np.uint32 and array.tolist() == ids
    assert _token_array(pb.ScheduleRequest().token_ids).tolist() == []

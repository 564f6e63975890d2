"""One prompt matched against the engines' own caches once per Schedule (conductor/engine_index.py
``EngineCacheIndex.match``, conductor/service.py): the same answers as hashing per call, from one
hashing of the prompt, for token ids given as a list or as the numpy array the RPC handler makes
of the request's ``repeated uint32`` field. Pure logic on synthetic vLLM event batches; the
handler's path end to end is in test_conductor_service.py."""

from __future__ import annotations

import random
import threading
from typing import Any

import msgspec
import numpy as np
import pytest

from conductor.engine_index import (
    ChainMemo,
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


# -- the chain memo: a prompt extending a recent one hashes only its new blocks ---------------

def conversation(seed: int, turns: int, first: int = 200) -> list[list[int]]:
    """Each turn's prompt is the previous one plus new tokens (a chat's next request)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 2**32) for _ in range(first)]]
    for _ in range(turns - 1):
        prompts.append(prompts[-1] + [rng.randrange(0, 2**32)
                                      for _ in range(rng.randrange(0, 5 * BLOCK))])
    return prompts


def ids(tokens: list[int]) -> np.ndarray[Any, np.dtype[np.uint32]]:
    return np.array(tokens, dtype=np.uint32)


def test_each_turn_reuses_the_previous_turns_blocks_and_hashes_the_same() -> None:
    hasher = VllmBlockHashes(SPEC)
    memo = ChainMemo()
    reused = 0
    for i, tokens in enumerate(conversation(1, 12)):
        assert hasher.convert(memo.keys("w", hasher, ids(tokens))) == hasher.hashes(tokens)
        if i:
            reused += len(conversation(1, 12)[i - 1]) // BLOCK
    assert memo.hits == 11 and memo.reused_blocks == reused


def test_the_same_prompt_again_is_all_reused_and_remembered_once() -> None:
    hasher = VllmBlockHashes(SPEC)
    memo = ChainMemo()
    tokens = prompt(3, 5, extra=7)
    first = memo.keys("w", hasher, ids(tokens))
    assert memo.keys("w", hasher, ids(tokens)) == first
    assert (len(memo), memo.blocks, memo.hits, memo.reused_blocks) == (1, 5, 1, 5)


def test_a_prefix_of_a_remembered_prompt_is_hashed_whole() -> None:
    hasher = VllmBlockHashes(SPEC)
    memo = ChainMemo()
    tokens = prompt(4, 6)
    memo.keys("w", hasher, ids(tokens))
    shorter = tokens[: 3 * BLOCK + 1]
    assert hasher.convert(memo.keys("w", hasher, ids(shorter))) == hasher.hashes(shorter)
    assert memo.hits == 0 and len(memo) == 2


def test_tenants_and_hashings_never_share_entries() -> None:
    plain, salted = VllmBlockHashes(SPEC), VllmBlockHashes(SPEC, "tenant-a")
    memo = ChainMemo()
    tokens = prompt(5, 4)
    memo.keys(("plain", ""), plain, ids(tokens))
    assert salted.convert(memo.keys(("plain", "tenant-a"), salted, ids(tokens))) == \
        salted.hashes(tokens) != plain.hashes(tokens)
    assert memo.hits == 0


def test_least_recently_used_entries_go_past_the_block_budget() -> None:
    hasher = VllmBlockHashes(SPEC)
    memo = ChainMemo(max_blocks=10)
    a, b, c = prompt(10, 4), prompt(11, 4), prompt(12, 4)
    memo.keys("w", hasher, ids(a))
    memo.keys("w", hasher, ids(b))
    memo.keys("w", hasher, ids(a))  # a is used again: b is now the oldest
    memo.keys("w", hasher, ids(c))  # 12 blocks > 10: b goes
    assert (len(memo), memo.blocks, memo.hits) == (2, 8, 1)
    memo.keys("w", hasher, ids(a))
    memo.keys("w", hasher, ids(c))
    assert memo.hits == 3
    memo.keys("w", hasher, ids(b))  # hashed again, and a (now the oldest) goes
    assert memo.hits == 3 and memo.blocks == 8
    memo.keys("w", hasher, ids(c))
    assert memo.hits == 4
    memo.keys("w", hasher, ids(prompt(13, 11)))  # over the budget alone: not remembered
    assert memo.blocks == 8 and len(memo) == 2


def test_only_the_longest_remembered_lengths_are_probed() -> None:
    hasher = VllmBlockHashes(SPEC)
    memo = ChainMemo(max_probes=2)
    base = prompt(20, 8)
    memo.keys("w", hasher, ids(base[: 2 * BLOCK]))  # a prefix of base, 2 blocks
    for seed in (21, 22):  # two other prompts, longer than 2 blocks and shorter than base
        memo.keys("w", hasher, ids(prompt(seed, 5 + seed - 21)))
    assert hasher.convert(memo.keys("w", hasher, ids(base))) == hasher.hashes(base)
    assert memo.hits == 0  # lengths 6 and 5 probed, not 2
    memo3 = ChainMemo(max_probes=3)
    memo3.keys("w", hasher, ids(base[: 2 * BLOCK]))
    for seed in (21, 22):
        memo3.keys("w", hasher, ids(prompt(seed, 5 + seed - 21)))
    assert hasher.convert(memo3.keys("w", hasher, ids(base))) == hasher.hashes(base)
    assert (memo3.hits, memo3.reused_blocks) == (1, 2)


def test_the_index_memoizes_arrays_only_and_matches_alike() -> None:
    index, tokens = three_engines()
    as_list = index.match(tokens).cached_tokens
    assert len(index.chains) == 0
    assert index.match(ids(tokens)).cached_tokens == as_list
    assert len(index.chains) == 2  # one entry per hashing (blocks of 32, of 16)
    assert index.match(ids(tokens)).cached_tokens == as_list
    assert index.chains.hits == 2


def test_concurrent_lookups_hash_like_one_thread() -> None:
    hasher = VllmBlockHashes(SPEC)
    memo = ChainMemo(max_blocks=64)  # small: entries come and go while threads look up
    chats = [conversation(100 + i, 10) for i in range(4)]
    failures: list[int] = []

    def chat(i: int) -> None:
        for tokens in chats[i]:
            if hasher.convert(memo.keys("w", hasher, ids(tokens))) != hasher.hashes(tokens):
                failures.append(i)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [] and memo.blocks <= 64

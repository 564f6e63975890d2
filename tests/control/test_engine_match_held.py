"""``EngineCacheIndex.match_held`` (the front door's match: hash a prompt only as far as an
engine holds it) against ``match`` (hash it all): the same cached tokens for every instance,
over engines of two hashings holding random prefixes, prompts the chain memo remembers or not,
tenants; the rest hashed by ``complete`` gives ``match``'s hashes and remembers the prompt; a
new prompt is hashed one step, not whole. Pure logic on synthetic vLLM event batches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conductor.engine_index import EngineCacheIndex, VllmBlockHashes
from kvstore.errors import InvalidArgument
from tests.control.test_engine_match import (
    BLOCK,
    DIGEST_SPEC,
    OTHER_BLOCK_SPEC,
    SPEC,
    batch,
    prompt,
    stored,
)

SPECS = {"a": SPEC, "b": SPEC, "c": DIGEST_SPEC, "d": OTHER_BLOCK_SPEC}


def _index(rng: random.Random, prompts: list[list[int]], tenant: str) -> EngineCacheIndex:
    index = EngineCacheIndex()
    for name, spec in SPECS.items():
        view = index.track(name, spec)
        events = []
        for tokens in prompts:
            full = len(tokens) // spec.block_size_tokens
            events.append(stored(tokens, spec, rng.randrange(0, full + 1), tenant))
        index.on_live(view, batch(0, *events))
    return index


@pytest.mark.parametrize("seed", range(12))
def test_the_same_cached_tokens_as_hashing_it_all(seed: int) -> None:
    rng = random.Random(seed)
    tenant = "" if seed % 3 else "t1"
    prompts = [prompt(seed * 100 + i, rng.randrange(1, 60), rng.randrange(BLOCK))
               for i in range(6)]
    index = _index(random.Random(seed + 1000), prompts, tenant)
    reference = _index(random.Random(seed + 1000), prompts, tenant)  # the same views
    for tokens in [*prompts, prompts[0] + prompt(999, 3), *prompts[:2]]:
        ids = np.array(tokens, dtype=np.uint32)
        held = index.match_held(ids, tenant)
        whole = reference.match(ids, tenant)
        assert held.cached_tokens == whole.cached_tokens
        assert not held.complete and held.hashes((BLOCK, "0", True), tenant) is None
        done = index.complete(held, ids)
        for key in ((BLOCK, "0", True), (BLOCK, "0", False), (16, "0", True)):
            assert done.hashes(key, tenant) == whole.hashes(key, tenant), key


def test_a_new_prompt_is_hashed_one_step_and_a_held_one_as_far_as_it_is_held(
        monkeypatch: pytest.MonkeyPatch) -> None:
    blocks: list[int] = []
    real = VllmBlockHashes.keys

    def counting(self: VllmBlockHashes, token_ids: np.ndarray, parent: object = None) -> list:
        keys = real(self, token_ids, parent)  # type: ignore[arg-type]
        blocks.append(len(keys))
        return keys

    index = EngineCacheIndex()
    held = prompt(1, 40)
    index.on_live(index.track("a", SPEC), batch(0, stored(held, SPEC, 20)))
    monkeypatch.setattr(VllmBlockHashes, "keys", counting)
    new = np.array(prompt(2, 100), dtype=np.uint32)
    match = index.match_held(new, "")
    assert match.cached_tokens == {"a": 0} and blocks == [8]
    blocks.clear()
    ids = np.array(held, dtype=np.uint32)
    match = index.match_held(ids, "")
    assert match.cached_tokens == {"a": 20 * BLOCK}
    assert blocks == [8, 16]  # 8 held, 24 hashed with 20 held: stop (not all 40)
    blocks.clear()
    index.complete(match, ids)
    assert blocks == [16]  # the rest, then remembered: the next turn reads it from memo
    blocks.clear()
    turn = np.array(held + prompt(3, 4), dtype=np.uint32)
    match = index.match_held(turn, "")
    assert match.cached_tokens == {"a": 20 * BLOCK} and blocks == []
    assert index.chains.hits == 1


def test_match_held_wants_the_array_the_memo_hashes() -> None:
    with pytest.raises(InvalidArgument):
        EngineCacheIndex().match_held(np.array([1, 2, 3], dtype=np.int64))

"""The engines' own prefix caches from vLLM KV event batches (conductor/engine_index.py): pure
logic on synthetic batches, encoded as vLLM's ZMQ publisher encodes them (msgpack
``[ts, events, dp_rank]``, each event a map tagged by ``"type"``). That the hashes are vLLM's is
checked against a real vLLM in test_vllm_engine_events.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import conductor.engine_index as engine_index
from conductor.engine_index import (
    MISMATCH_PROBES,
    EngineBatch,
    EngineCacheIndex,
    EngineCacheView,
    EngineEventError,
    LiveOutcome,
    VllmBlockHashes,
    decode_batch,
)
from kvstore.membership.engines import VllmKvEvents

BLOCK = 32
SPEC = VllmKvEvents(endpoint="ipc:///tmp/x", replay_endpoint="ipc:///tmp/y",
                    block_size_tokens=BLOCK, hash_seed="0")
DIGEST_SPEC = VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=BLOCK, hash_seed="0",
                           int_block_hashes=False)
HASHES = VllmBlockHashes(SPEC)


def prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 13) % 1000 for i in range(blocks * BLOCK)]


def stored(tokens: list[int], spec: VllmKvEvents = SPEC, *, first: int = 0,
           group: int | None = 0, medium: str | None = "GPU") -> dict[str, Any]:
    """vLLM's BlockStored for blocks ``first..`` of ``tokens`` (as its block pool sends it)."""
    hashes = VllmBlockHashes(spec).hashes(tokens)
    return {"type": "BlockStored", "block_hashes": hashes[first:],
            "parent_block_hash": hashes[first - 1] if first else None,
            "token_ids": tokens[first * BLOCK:len(hashes) * BLOCK], "block_size": BLOCK,
            "lora_id": None, "medium": medium, "lora_name": None, "group_idx": group}


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


def batch(seq: int, *events: dict[str, Any]) -> EngineBatch:
    payload = msgspec.msgpack.encode([1795944524.5, list(events), 0])
    return decode_batch(seq, payload)


def cached(view: EngineCacheView, tokens: list[int]) -> int:
    return view.cached_blocks(VllmBlockHashes(view.spec).hashes(tokens))


def caught_up(spec: VllmKvEvents = SPEC) -> EngineCacheView:
    """A view whose first replay (from 0) found nothing buffered."""
    view = EngineCacheView("v", spec)
    assert view.replay_from == 0
    assert view.replay_done()
    return view


def test_stored_removed_cleared_in_order() -> None:
    a, b = prompt(1, 4), prompt(2, 3)
    view = caught_up()
    assert view.on_live(batch(0, stored(a))) is LiveOutcome.APPLIED
    assert view.on_live(batch(1, stored(b))) is LiveOutcome.APPLIED
    assert (cached(view, a), cached(view, b), len(view)) == (4, 3, 7)
    assert cached(view, a[:2 * BLOCK] + prompt(3, 2)) == 2
    # vLLM evicts the last blocks of a: the prefix shrinks to what is left.
    view.on_live(batch(2, removed(HASHES.hashes(a)[2:])))
    assert cached(view, a) == 2
    view.on_live(batch(3, {"type": "AllBlocksCleared"}))
    assert (len(view), cached(view, b), view.stats.cleared, view.stats.resets) == (0, 0, 1, 1)
    assert (view.stats.batches, view.stats.events, view.expected) == (4, 4, 4)
    # An idle engine publishes its clear with its next step's stores, in one batch.
    view.on_live(batch(4, stored(a), {"type": "AllBlocksCleared"}, stored(b)))
    assert (cached(view, a), cached(view, b), len(view)) == (0, 3, 3)


def test_a_gap_waits_for_the_replay_and_is_applied_in_order() -> None:
    """Batch 1 stores y, batch 2 removes it. Batch 1 is lost: 2 must wait, or y (removed)
    would come back when 1 is replayed after it."""
    x, y = prompt(1, 2), prompt(2, 2)
    view = caught_up()
    view.on_live(batch(0, stored(x)))
    assert view.on_live(batch(2, removed(HASHES.hashes(y)))) is LiveOutcome.GAP
    assert view.replay_from == 1
    assert view.on_live(batch(3, stored(prompt(4, 1)))) is LiveOutcome.GAP
    assert (view.stats.gaps, view.expected, len(view)) == (1, 1, 2)  # nothing applied early
    # The replay answers everything still buffered from seq 1 on.
    # Batch 4 was published while the replay ran: the replay has it, the live copy follows.
    for seq, events in ((1, [stored(y)]), (2, [removed(HASHES.hashes(y))]),
                        (3, [stored(prompt(4, 1))]), (4, [stored(prompt(5, 1))])):
        view.on_replayed(batch(seq, *events))
    assert view.replay_done()
    assert (cached(view, x), cached(view, y), cached(view, prompt(4, 1))) == (2, 0, 1)
    assert (view.stats.gaps_repaired, view.replay_from, view.expected) == (1, None, 5)
    # The live copy of what the replay delivered is a duplicate, not a restart.
    assert view.on_live(batch(4, stored(prompt(5, 1)))) is LiveOutcome.DUPLICATE
    assert view.on_live(batch(5, stored(prompt(6, 1)))) is LiveOutcome.APPLIED
    assert view.stats.restarts == 0


def test_buffered_live_batches_after_the_replay_are_drained() -> None:
    view = caught_up()
    view.on_live(batch(0))
    view.on_live(batch(3, stored(prompt(3, 1))))
    view.on_live(batch(4, stored(prompt(4, 1))))
    # The replay reaches only up to 2 (3 and 4 were published after it was answered).
    view.on_replayed(batch(1, stored(prompt(1, 1))))
    view.on_replayed(batch(2, stored(prompt(2, 1))))
    assert view.replay_done()
    assert [cached(view, prompt(i, 1)) for i in range(1, 5)] == [1, 1, 1, 1]
    assert view.expected == 5


def test_a_replay_that_stops_short_is_asked_again() -> None:
    view = caught_up()
    view.on_live(batch(0))
    view.on_live(batch(5))
    view.on_replayed(batch(1))
    assert not view.replay_done()
    assert view.replay_from == 2
    for seq in (2, 3, 4):
        view.on_replayed(batch(seq))
    assert view.replay_done()
    assert (view.expected, view.stats.gaps, view.stats.gaps_repaired) == (6, 1, 1)


def test_a_restarted_engine_resets_the_view() -> None:
    a = prompt(1, 2)
    view = caught_up()
    for seq in range(5):
        view.on_live(batch(seq, stored(prompt(seq + 10, 1))))
    view.on_live(batch(5, stored(a)))
    # A new vLLM process counts from 0 again; its cache is empty.
    assert view.on_live(batch(0, stored(prompt(20, 1)))) is LiveOutcome.RESTART
    assert (cached(view, a), cached(view, prompt(20, 1)), view.stats.restarts) == (0, 1, 1)
    assert view.expected == 1
    # Restarted again, and its first batches were lost: a gap from 0.
    for seq in range(1, 9):
        view.on_live(batch(seq))
    assert view.on_live(batch(3, stored(a))) is LiveOutcome.RESTART
    assert (view.replay_from, len(view), view.stats.restarts) == (0, 0, 2)
    for seq in range(3):
        view.on_replayed(batch(seq))
    view.on_replayed(batch(3, stored(a)))
    assert view.replay_done()
    assert cached(view, a) == 2


def test_a_replay_that_cannot_reach_back_follows_from_where_it_starts() -> None:
    stale = prompt(1, 2)
    view = caught_up()
    view.on_live(batch(0, stored(stale)))
    view.on_live(batch(50, stored(prompt(2, 1))))
    # The engine's buffer holds only 40.. now: what happened in 1..39 is unknown.
    for seq in range(40, 51):
        view.on_replayed(batch(seq, stored(prompt(seq, 1))))
    assert view.replay_done()
    assert view.stats.unrecoverable_gaps == 1
    assert cached(view, stale) == 0  # maybe evicted meanwhile: not claimed
    assert cached(view, prompt(45, 1)) == 1
    assert view.expected == 51


def test_without_a_replay_socket_a_gap_restarts_the_view_from_the_live_batch() -> None:
    view = caught_up(VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=BLOCK,
                                  hash_seed="0"))
    view.on_live(batch(0, stored(prompt(1, 1))))
    view.on_live(batch(7, stored(prompt(7, 1))))
    view.no_replay()
    assert (cached(view, prompt(1, 1)), cached(view, prompt(7, 1))) == (0, 1)
    assert (view.expected, view.stats.unrecoverable_gaps, view.replay_from) == (8, 1, None)


def test_the_view_is_bounded_by_the_engines_block_count() -> None:
    spec = VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=BLOCK, hash_seed="0",
                        num_blocks=4)
    view = caught_up(spec)
    view.on_live(batch(0, stored(prompt(1, 3))))
    assert len(view) == 3
    # A fifth block in a cache of four: removals were missed.
    view.on_live(batch(1, stored(prompt(2, 2))))
    assert (len(view), view.stats.overflows, view.stats.resets) == (0, 1, 1)


def test_pending_batches_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_index, "MAX_PENDING_BATCHES", 3)
    view = caught_up()
    view.on_live(batch(0, stored(prompt(1, 1))))
    for seq in (2, 3, 4):
        assert view.on_live(batch(seq)) is LiveOutcome.GAP
    view.on_live(batch(5, stored(prompt(5, 1))))  # the fourth behind the gap
    assert (len(view), view.expected, view.replay_from) == (1, 6, None)
    assert cached(view, prompt(5, 1)) == 1
    assert view.stats.unrecoverable_gaps == 1


def test_other_groups_and_media_are_not_the_engines_own_cache() -> None:
    view = caught_up()
    view.on_live(batch(0, stored(prompt(1, 2), group=1), stored(prompt(2, 2), medium="CPU"),
                       stored(prompt(3, 2))))
    assert (cached(view, prompt(1, 2)), cached(view, prompt(2, 2)),
            cached(view, prompt(3, 2))) == (0, 0, 2)
    assert view.stats.ignored_events == 2


def test_full_digests_are_matched_and_each_stored_block_verified() -> None:
    a = prompt(1, 4)
    view = caught_up(DIGEST_SPEC)
    # The first two blocks, then the other two with the second as their parent.
    first = stored(a[:2 * BLOCK], DIGEST_SPEC)
    rest = stored(a, DIGEST_SPEC, first=2)
    assert isinstance(rest["parent_block_hash"], bytes)
    view.on_live(batch(0, first, rest))
    assert cached(view, a) == 4
    assert (view.stats.verified_blocks, view.stats.hash_mismatches) == (2, 0)


def test_int_hashes_are_the_last_eight_bytes_of_the_digest() -> None:
    a = prompt(1, 3)
    ints = VllmBlockHashes(SPEC).hashes(a)
    digests = VllmBlockHashes(DIGEST_SPEC).hashes(a)
    assert ints == [int.from_bytes(d[-8:], "big") for d in digests]  # type: ignore[index]
    assert all(isinstance(d, bytes) and len(d) == 32 for d in digests)


def test_a_tenant_is_the_cache_salt() -> None:
    a = prompt(1, 2)
    salted = VllmBlockHashes(SPEC, "tenant-a").hashes(a)
    assert salted != HASHES.hashes(a)
    event = stored(a)
    event["block_hashes"] = salted
    event["extra_keys"] = [("tenant-a",), None]
    index = EngineCacheIndex()
    view = index.track("v", SPEC)
    view.replay_done()
    index.on_live(view, batch(0, event))
    assert index.cached_tokens(a, "tenant-a") == {"v": 2 * BLOCK}
    assert index.cached_tokens(a) == {"v": 0}
    assert (view.stats.verified_blocks, view.stats.hash_mismatches) == (1, 0)


def test_a_different_seed_is_detected_and_never_matched() -> None:
    a = prompt(1, 2)
    other = VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=BLOCK, hash_seed="1")
    view = caught_up()  # the record says seed "0"; the engine really ran with "1"
    view.on_live(batch(0, stored(a, other)))
    assert view.stats.hash_mismatches == 1
    assert "hashes to" in view.stats.mismatch
    assert view.cached_blocks(VllmBlockHashes(other).hashes(a)) == 0


def test_digests_where_the_record_says_ints_are_a_mismatch() -> None:
    view = caught_up()
    view.on_live(batch(0, stored(prompt(1, 1), DIGEST_SPEC)))
    assert view.stats.hash_mismatches == 1
    assert "int_block_hashes" in view.stats.mismatch


def test_a_hash_algorithm_the_conductor_cannot_compute_is_a_mismatch() -> None:
    index = EngineCacheIndex()
    spec = VllmKvEvents(endpoint="ipc:///tmp/x", block_size_tokens=BLOCK, hash_algo="sha256")
    view = index.track("v", spec)
    assert "sha256_cbor" in view.stats.mismatch
    assert index.cached_tokens(prompt(1, 2)) == {"v": 0}
    with pytest.raises(Exception, match="sha256"):
        VllmBlockHashes(spec)


def test_routed_prompts_that_never_appear_are_a_mismatch() -> None:
    index = EngineCacheIndex()
    good = index.track("good", SPEC)
    bad = index.track("bad", SPEC)
    for v in (good, bad):
        index.replay_done(v)
    for i in range(MISMATCH_PROBES):
        tokens = prompt(100 + i, 2)
        index.expect_routed("good", tokens)
        index.on_live(good, batch(i, stored(tokens)))
        index.expect_routed("bad", tokens)
        # bad's engine hashes something else (e.g. another tokenizer's ids): no match ever.
        index.on_live(bad, batch(i, stored(prompt(900 + i, 2))))
    assert good.stats.mismatch == "" and good.stats.probes_matched == MISMATCH_PROBES
    assert "none of the 32 prompts" in bad.stats.mismatch
    assert index.cached_tokens(prompt(900, 2)) == {"bad": 0, "good": 0}
    assert index.cached_tokens(prompt(100, 2)) == {"bad": 0, "good": 2 * BLOCK}


def test_index_track_new_generation_resets_and_remove_forgets() -> None:
    a = prompt(1, 2)
    index = EngineCacheIndex()
    view = index.track("v", SPEC, generation=7)
    index.replay_done(view)
    index.on_live(view, batch(0, stored(a)))
    assert index.track("v", SPEC, generation=7) is view
    assert index.cached_tokens(a) == {"v": 2 * BLOCK}
    fresh = index.track("v", SPEC, generation=8)  # a new lease: the engine restarted
    assert fresh is not view
    assert index.cached_tokens(a) == {"v": 0}
    assert fresh.stats.resets == 1
    assert index.cached_tokens(a, instances={"w"}) == {}
    assert index.remove("v")
    assert index.cached_tokens(a) == {}
    assert not index.remove("v")


def test_malformed_batches() -> None:
    with pytest.raises(EngineEventError):
        decode_batch(0, b"\xc1")
    with pytest.raises(EngineEventError):
        decode_batch(0, msgspec.msgpack.encode({"events": []}))
    with pytest.raises(EngineEventError, match="BlockStored"):
        decode_batch(0, msgspec.msgpack.encode([0.0, [{"type": "BlockStored"}], 0]))
    # Unknown event types (a newer vLLM) are skipped.
    assert decode_batch(3, msgspec.msgpack.encode([0.0, [{"type": "Future"}], 0])).events == ()
    view = caught_up()
    view.on_live(batch(0, stored(prompt(1, 1))))
    view.malformed(1, "bad")
    assert (len(view), view.replay_from, view.stats.malformed_batches) == (0, 0, 1)

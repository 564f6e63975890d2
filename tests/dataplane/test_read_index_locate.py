"""ReadIndexReader.locate / unchanged: the read index's seqlock for a caller that copies a chunk
out of the arena itself (the client's one-copy load into an engine's own layout, issue 13).
Real shared memory: a DRAM tier with its read index as the writer, a read-only reader."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.dataplane.read_index_layout import lease_free_supported
from tests.dataplane.test_read_index import KiB, Pair, keys_hashing_to, pattern

pytestmark = pytest.mark.skipif(not lease_free_supported(),
                                reason="lease-free reads need Linux on x86-64")


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def test_locate_gives_where_the_chunk_lies_and_misses_others(pair: Pair) -> None:
    value = pattern(5, 16 * KiB)
    pair.tier.put(b"k1", value)
    found = pair.reader.locate(b"k1")
    assert found is not None
    slot, seq, offset, size = found
    assert (offset, size) == pair.index.location(b"k1") and seq % 2 == 0
    arena = np.frombuffer(pair.arena.view(0, pair.arena.size_bytes), dtype=np.uint8)
    assert np.array_equal(arena[offset:offset + size], value)
    assert pair.reader.unchanged(slot, seq)
    assert pair.reader.locate(b"absent") is None


def test_a_remove_or_a_reuse_after_locate_is_seen_by_unchanged(pair: Pair) -> None:
    pair.tier.put(b"victim", pattern(1, 16 * KiB))
    found = pair.reader.locate(b"victim")
    assert found is not None
    slot, seq, _offset, _size = found
    pair.tier.remove(b"victim")
    pair.tier.put(b"newcomer", pattern(2, 16 * KiB))  # may take the same extent
    assert not pair.reader.unchanged(slot, seq)
    assert pair.reader.locate(b"victim") is None


def test_locate_probes_past_other_keys_of_its_home_slot(pair: Pair) -> None:
    keys = keys_hashing_to(7, 3)
    for i, key in enumerate(keys):
        pair.tier.put(key, pattern(10 + i, 4 * KiB))
    pair.tier.remove(keys[0])  # a tombstone before the others
    for key in keys[1:]:
        found = pair.reader.locate(key)
        assert found is not None and found[2:] == pair.index.location(key)
    assert pair.reader.locate(keys[0]) is None

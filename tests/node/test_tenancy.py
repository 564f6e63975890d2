"""Per-chunk tenant ownership in the cache index (issue #15): unit tests of the pure logic."""

from __future__ import annotations

import pytest

from kvstore.dataplane.tier import TierKind
from kvstore.errors import ChunkExists, ChunkNotFound, InvalidArgument, PermissionDenied
from kvstore.node.index import SHARED_TENANT, CacheIndex, TierBudget


def _index() -> CacheIndex:
    return CacheIndex({TierKind.DRAM: TierBudget.of(1 << 20)})


def _alice_chain(index: CacheIndex) -> list[bytes]:
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    index.insert_chain(keys, None, TierKind.DRAM, 100, tenant="alice")
    return keys


def test_bob_sees_none_of_alices_four_chunks() -> None:
    index = _index()
    keys = _alice_chain(index)
    assert index.match_prefix(keys, tenant="bob").length == 0
    assert index.longest_prefix(keys, tenant="bob") == 0
    assert all(index.get(k, tenant="bob") is None for k in keys)
    assert index.present(keys, tenant="bob") == set()
    assert index.pin_prefix(keys, 1.0, tenant="bob") is None
    with pytest.raises(ChunkNotFound):
        index.pin_many(keys[:1], 1.0, tenant="bob")
    assert index.match_prefix(keys, tenant="alice").length == 4
    assert index.match_prefix(keys).length == 4  # an operator sees everything
    entry = index.get(keys[0])
    assert entry is not None and entry.tenant == "alice"


def test_bob_cannot_remove_or_replace_alices_chunk() -> None:
    index = _index()
    keys = _alice_chain(index)
    with pytest.raises(ChunkNotFound):
        index.remove_subtree(keys[3], tenant="bob")
    with pytest.raises(PermissionDenied):
        index.insert(keys[3], None, TierKind.DRAM, 100, tenant="bob")
    with pytest.raises(PermissionDenied):
        index.check_writable(keys[3], None, "bob")
    assert index.insert_many([(keys[3], None, 100, None)], TierKind.DRAM, "bob")[0].__class__ \
        is PermissionDenied
    with pytest.raises(ChunkExists):
        index.insert(keys[3], keys[2], TierKind.DRAM, 100, tenant="alice")
    assert index.remove_subtree(keys[3], tenant="alice") == [keys[3]]


def test_a_child_needs_a_parent_of_its_own_tenant_or_the_shared_one() -> None:
    index = _index()
    keys = _alice_chain(index)
    with pytest.raises(InvalidArgument, match="not cached"):
        index.insert(b"\x09" * 16, keys[0], TierKind.DRAM, 100, tenant="bob")
    root = b"\x20" * 16
    index.insert(root, None, TierKind.DRAM, 100, tenant=SHARED_TENANT)
    index.insert(b"\x21" * 16, root, TierKind.DRAM, 100, tenant="bob")
    index.insert(b"\x22" * 16, root, TierKind.DRAM, 100, tenant="alice")
    assert index.match_prefix([root, b"\x21" * 16], tenant="bob").length == 2
    assert index.match_prefix([root, b"\x21" * 16], tenant="alice").length == 1
    with pytest.raises(ChunkNotFound):  # readable by all, removable only as the shared tenant
        index.remove_subtree(root, tenant="bob")

"""The simulated tiered prefix cache: prefix-chained block ids under LRU, counted in blocks.

Because block ids are prefix-chained (a block id names the block *and* everything before it), the cached
prefix of a prompt is its longest run of leading ids present in the cache. This mirrors Mooncake's global
KV pool (CPU DRAM and SSD of the cluster) at block granularity; it does not model where a block lives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvstore.errors import InvalidArgument


class PrefixCache:
    """LRU set of block ids with a fixed capacity in blocks.

    ``match`` touches the blocks it hits (they become most recently used); ``insert`` adds missing blocks,
    touches present ones, and evicts least recently used blocks beyond the capacity. Not thread-safe: the
    simulator is single-threaded.
    """

    __slots__ = ("_blocks", "capacity_blocks", "evicted_blocks", "hit_blocks", "lookup_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise InvalidArgument(f"prefix cache capacity must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.hit_blocks = 0
        self.lookup_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, block_ids: Sequence[int]) -> int:
        """Number of leading ``block_ids`` present (the reusable prefix, in blocks)."""
        hits = 0
        blocks = self._blocks
        for block in block_ids:
            if block not in blocks:
                break
            blocks.move_to_end(block)
            hits += 1
        self.hit_blocks += hits
        self.lookup_blocks += len(block_ids)
        return hits

    def peek(self, block_ids: Sequence[int]) -> int:
        """Like :meth:`match` but touches nothing and counts nothing (for planning a batch)."""
        hits = 0
        for block in block_ids:
            if block not in self._blocks:
                break
            hits += 1
        return hits

    def insert(self, block_ids: Sequence[int]) -> int:
        """Add ``block_ids``; return how many were new (the blocks written to the cache)."""
        blocks = self._blocks
        new = 0
        for block in block_ids:
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
                new += 1
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evicted_blocks += 1
        return new

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up blocks that were reused."""
        return self.hit_blocks / self.lookup_blocks if self.lookup_blocks else 0.0

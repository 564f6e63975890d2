"""What the scheduler half tells the worker half each step: plain, picklable data.

Keys travel as bytes (kvtier chunk keys, computed once on the scheduler side from vLLM's
``request.block_hashes``); block ids are vLLM's block ids of the request's logical blocks,
from block 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.errors import InvalidArgument
from kvstore.keys import PrefixKey

__all__ = ["KvtierConnectorMetadata", "LoadSpec", "SaveSpec"]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load logical blocks ``[first_block, first_block + num_blocks)`` of request ``req_id``
    into vLLM blocks ``block_ids[first_block:...]``. ``keys`` are the keys of blocks
    ``[0, first_block + num_blocks)``."""

    req_id: str
    keys: tuple[PrefixKey, ...]
    block_ids: tuple[int, ...]
    first_block: int
    num_blocks: int

    def __post_init__(self) -> None:
        end = self.first_block + self.num_blocks
        if self.first_block < 0 or self.num_blocks < 1 or len(self.keys) != end \
                or len(self.block_ids) < end:
            raise InvalidArgument(f"LoadSpec of {self.req_id}: blocks [{self.first_block}, "
                                  f"{end}) with {len(self.keys)} keys and "
                                  f"{len(self.block_ids)} block ids")

    @property
    def target_block_ids(self) -> tuple[int, ...]:
        return self.block_ids[self.first_block:self.first_block + self.num_blocks]


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save logical blocks ``[first_block, len(keys))`` of request ``req_id`` from vLLM
    blocks ``block_ids``; blocks before ``first_block`` are in the store already."""

    req_id: str
    keys: tuple[PrefixKey, ...]
    block_ids: tuple[int, ...]
    first_block: int

    def __post_init__(self) -> None:
        if not 0 <= self.first_block < len(self.keys) <= len(self.block_ids):
            raise InvalidArgument(f"SaveSpec of {self.req_id}: first block {self.first_block}, "
                                  f"{len(self.keys)} keys, {len(self.block_ids)} block ids")


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)

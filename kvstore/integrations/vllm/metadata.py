"""What the two halves tell each other: plain, picklable data.

Scheduler -> worker, each step (:class:`KvtierConnectorMetadata`): keys travel as bytes (kvtier
chunk keys, computed once on the scheduler side from vLLM's ``request.block_hashes``); block ids
are vLLM's block ids of the request's logical blocks, from block 0.

Worker -> scheduler, each step (:class:`KvtierWorkerMetadata`, through vLLM's
``KVConnectorOutput.kv_connector_worker_meta``): how the saves that ended since the last step
ended. Every :class:`SaveSpec` a worker received is reported exactly once by that worker, as
saved or as failed (put refused, daemon gone, skipped for want of a daemon, past
``save_timeout_s``, or computed in a step whose load of the request failed), in the step it
ended in or a later one; and every :class:`LoadSpec` with a block that did not arrive, by its
first such block (:class:`LoadFailure`), in the step of the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvstore.errors import InvalidArgument
from kvstore.keys import PrefixKey

__all__ = ["KvtierConnectorMetadata", "KvtierWorkerMetadata", "LoadFailure", "LoadSpec",
           "SaveFailure", "SaveSpec"]


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
    blocks ``block_ids``; blocks before ``first_block`` are in the store already. ``seq``
    numbers the request's saves (the worker reports each by it)."""

    req_id: str
    keys: tuple[PrefixKey, ...]
    block_ids: tuple[int, ...]
    first_block: int
    seq: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.first_block < len(self.keys) <= len(self.block_ids):
            raise InvalidArgument(f"SaveSpec of {self.req_id}: first block {self.first_block}, "
                                  f"{len(self.keys)} keys, {len(self.block_ids)} block ids")


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's loads and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SaveFailure:
    """Save ``seq`` of ``req_id`` did not store blocks ``[first_failed_block, ...)``."""

    req_id: str
    seq: int
    first_failed_block: int


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """The load of ``req_id`` did not bring block ``first_failed_block`` (nor any after it):
    vLLM recomputes blocks ``[first_failed_block, ...)``, so the store lacks them."""

    req_id: str
    first_failed_block: int


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """The saves that ended since the worker's last report, and the step's failed loads. vLLM
    aggregates the TP ranks' objects of a step with :meth:`aggregate` (concatenation: one entry
    per rank and save or load)."""

    saved: list[tuple[str, int]] = field(default_factory=list)
    """(req_id, seq) of saves whose blocks the daemon holds now (stored or already there)."""
    failed: list[SaveFailure] = field(default_factory=list)
    load_failed: list[LoadFailure] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KvtierWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata), type(other)
        self.saved.extend(other.saved)
        self.failed.extend(other.failed)
        self.load_failed.extend(other.load_failed)
        return self

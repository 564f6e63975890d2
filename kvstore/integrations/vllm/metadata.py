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

Prefill instance -> decode instance, once per request (:class:`PdHandoff`, through vLLM's
``kv_transfer_params``: the prefill's answer carries them, the P/D proxy passes them on in the
decode request): how many leading blocks of the prompt the prefill left in kvtier, and the
kvtier key of the last of them, so the decode can tell a hand-off of another prompt, model or
hash seed from one whose puts have not landed yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvstore.errors import InvalidArgument
from kvstore.keys import PrefixKey

__all__ = ["PD_PARAMS_KEY", "KvtierConnectorMetadata", "KvtierWorkerMetadata", "LoadFailure",
           "LoadSpec", "PdHandoff", "SaveFailure", "SaveSpec"]

PD_PARAMS_KEY = "kvtier"
"""The entry of ``kv_transfer_params`` that holds a :class:`PdHandoff`."""


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


@dataclass(frozen=True, slots=True)
class PdHandoff:
    """What a prefill instance hands a decode instance: blocks ``[0, blocks)`` of the prompt
    are in kvtier, or being put there (the prefill answers before its last puts land), and
    ``key`` is the kvtier key of block ``blocks - 1`` (None: not checked).

    In ``kv_transfer_params`` (JSON): ``{"do_remote_prefill": true, "do_remote_decode":
    false, "kvtier": {"blocks": N, "key": "<hex>", "block_tokens": B}}``, vLLM's P/D
    convention plus kvtier's entry."""

    blocks: int
    key: bytes | None = None
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.blocks < 0:
            raise InvalidArgument(f"a P/D hand-off of {self.blocks} blocks")

    def to_params(self) -> dict[str, Any]:
        """vLLM's ``kv_transfer_params`` for the decode request."""
        entry: dict[str, Any] = {"blocks": self.blocks}
        if self.key is not None:
            entry["key"] = self.key.hex()
        if self.block_tokens is not None:
            entry["block_tokens"] = self.block_tokens
        return {"do_remote_prefill": True, "do_remote_decode": False, PD_PARAMS_KEY: entry}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> PdHandoff | None:
        """The hand-off in a decode request's ``kv_transfer_params``: None unless they say
        ``do_remote_prefill`` and carry a kvtier entry. InvalidArgument for a malformed entry
        (the caller treats the request as an ordinary one)."""
        if not params or not params.get("do_remote_prefill"):
            return None
        entry = params.get(PD_PARAMS_KEY)
        if entry is None:
            return None
        if not isinstance(entry, Mapping):
            raise InvalidArgument(f"kv_transfer_params.{PD_PARAMS_KEY} must be an object, "
                                  f"got {entry!r}")
        blocks, key, block_tokens = entry.get("blocks"), entry.get("key"), \
            entry.get("block_tokens")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 0:
            raise InvalidArgument(f"kv_transfer_params.{PD_PARAMS_KEY}.blocks must be an "
                                  f"integer >= 0, got {blocks!r}")
        if block_tokens is not None and (not isinstance(block_tokens, int)
                                         or isinstance(block_tokens, bool)):
            raise InvalidArgument(f"kv_transfer_params.{PD_PARAMS_KEY}.block_tokens must be "
                                  f"an integer, got {block_tokens!r}")
        raw: bytes | None = None
        if key is not None:
            try:
                raw = bytes.fromhex(key) if isinstance(key, str) else None
            except ValueError:
                raw = None
            if raw is None:
                raise InvalidArgument(f"kv_transfer_params.{PD_PARAMS_KEY}.key must be hex, "
                                      f"got {key!r}")
        return cls(blocks, raw, block_tokens)

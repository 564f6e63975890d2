"""What an engine hands :class:`~kvstore.client.kv_client.KVClient` besides token ids: keys it
already has (:class:`BlockKeys`), another node's blocks to fetch (:class:`RemoteFetch`, a
conductor fetch plan in the client's terms), and the per-request parts of the batch calls
(:class:`LoadRequest`, :class:`SaveRequest`). Frozen values that validate themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.client.layouts import EngineKV
from kvstore.errors import InvalidArgument
from kvstore.keys import PrefixKey

__all__ = ["BlockKeys", "LoadRequest", "RemoteFetch", "SaveRequest"]


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """Chunk keys an engine already has (e.g. from vLLM's block hashes through
    :meth:`KVClient.keys_from_vllm`): pass one wherever a method takes ``token_ids`` to skip
    hashing. ``keys[i]`` is the key of logical block ``i``."""

    keys: tuple[PrefixKey, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.keys, tuple) or not all(isinstance(k, bytes) for k in self.keys):
            raise InvalidArgument("BlockKeys.keys must be a tuple of bytes keys")


@dataclass(frozen=True, slots=True)
class RemoteFetch:
    """Blocks ``[first_block, end_block)`` of a request that another node's daemon holds: a
    conductor ``FetchPlan`` in the client's terms (:meth:`from_plan`).

    ``address`` is that daemon's gRPC ``host:port``; when empty, the client resolves
    ``node_id`` through etcd (:meth:`KVClient.node_address`). ``first_block`` is a hint: the
    remote part of a load starts wherever the local daemon's part stopped (the source holds the
    whole chain up to ``end_block``, the conductor checked that), so blocks evicted locally
    since the decision are fetched from the remote node too.
    """

    node_id: str
    address: str
    first_block: int
    end_block: int

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not isinstance(self.address, str):
            raise InvalidArgument("RemoteFetch.node_id and address must be str")
        if not (self.node_id or self.address):
            raise InvalidArgument("RemoteFetch needs an address or a node id")
        if not 0 <= self.first_block <= self.end_block:
            raise InvalidArgument(f"RemoteFetch blocks [{self.first_block}, {self.end_block}) "
                                  f"are not a range")

    @classmethod
    def from_plan(cls, plan: Any, address: str = "") -> RemoteFetch:
        """From a ``FetchPlan``: the conductor's reply (``kvtier.v1.FetchPlan``, which carries
        ``src_grpc_address``) or ``conductor.scheduler.FetchPlan`` (node id only: give
        ``address`` or let the client resolve it through etcd)."""
        return cls(node_id=str(plan.src_node),
                   address=address or str(getattr(plan, "src_grpc_address", "") or ""),
                   first_block=int(plan.first_block), end_block=int(plan.end_block))


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """One request's part of :meth:`KVClient.load_many` (same meaning as ``load``'s arguments;
    a request with a ``remote`` fetch plan is loaded on its own, as ``load(..., remote=)``)."""

    token_ids: object
    into: EngineKV
    first_block: int = 0
    num_blocks: int | None = None
    remote: RemoteFetch | None = None


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """One request's part of :meth:`KVClient.begin_save_many` (as ``begin_save``'s arguments)."""

    token_ids: object
    from_: EngineKV
    first_block: int = 0

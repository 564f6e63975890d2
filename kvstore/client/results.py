"""What :class:`~kvstore.client.kv_client.KVClient` answers: a lookup's match, a load's and a
save's outcome.

Failures are results, not exceptions: a load that stopped early (a miss, a chunk evicted since
the lookup, a dead daemon) says how many leading blocks arrived and which failed; a save says
which blocks it stored, which were already there and which it could not store. All are frozen
values, safe to share between threads.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.dataplane.tier import TierKind

__all__ = ["LoadResult", "PrefixMatch", "SaveResult"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """What :meth:`KVClient.lookup` found: a hint, not a promise (chunks may go before a load)."""

    blocks: int
    """Leading full blocks of the tokens that the daemon holds."""
    block_tokens: int
    by_tier: dict[TierKind, int]
    """How many of those blocks live in each tier."""
    node_id: str

    @property
    def reusable_tokens(self) -> int:
        return self.blocks * self.block_tokens


@dataclass(frozen=True, slots=True)
class LoadResult:
    """How a load ended. Blocks ``[first_block, first_block + loaded_blocks)`` hold valid KV in
    every layer of the destination; ``failed_blocks`` were asked for and did not arrive."""

    first_block: int
    requested_blocks: int
    loaded_blocks: int
    failed_blocks: tuple[int, ...]
    error: str | None
    """Why the load stopped early (None: a plain miss, or nothing failed)."""
    loaded_bytes: int
    transfer_s: float
    scatter_s: float
    remote_blocks: int = 0
    """How many of ``loaded_blocks`` came from another node's daemon (the last ones)."""
    remote_node: str = ""
    """That daemon's gRPC address ("" when nothing was asked of another node)."""

    @property
    def complete(self) -> bool:
        return self.loaded_blocks == self.requested_blocks


@dataclass(frozen=True, slots=True)
class SaveResult:
    stored_blocks: tuple[int, ...]
    existing_blocks: tuple[int, ...]
    """Blocks the daemon already held (chunks are immutable; not an error)."""
    failed_blocks: tuple[int, ...]
    error: str | None
    stored_bytes: int
    gather_s: float
    put_s: float

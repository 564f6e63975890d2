"""Replay a Mooncake trace through the real cache index and measure the block hit ratio.

One tier (DRAM), metadata only: capacity in tokens becomes ``capacity // 512``
blocks. Requests run in timestamp order; for each one:

1. ``hit`` = the longest cached prefix, in blocks (``CacheIndex.longest_prefix``);
2. the hit prefix is pinned while the request's new blocks are offered to the
   policy (``admit_count``: only Belady refuses any), made room for
   (``plan_eviction`` -> ``remove``) and inserted (``insert_chain``), as a
   serving engine holds the blocks it reads;
3. the hit prefix is counted as a hit (``access_prefix``) and unpinned.

Block hit ratio = sum of hits / sum of blocks. The index's clock is the trace's
own timestamps, so leases expire in trace time.

``python -m bench.replay --sweep`` (or ``kvtier bench replay --sweep``) prints
every policy side by side at 1M, 3M and 10M tokens with the fraction of the
LRU-to-Belady gap each one closes, and writes JSON. ``--half first|second``
replays only the requests before (from) the median timestamp: a held-out check
for anything chosen by looking at the replay (tune on ``first``, report ``second``).
"""

from __future__ import annotations

import argparse
import enum
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from bench._meta import run_header
from kvstore.dataplane.tier import TierKind
from kvstore.errors import CapacityError, ConfigError, InvalidArgument
from kvstore.node.index import CacheIndex, TierBudget
from kvstore.node.policies import BeladyPolicy, FutureAccesses, PolicyName, make_policy
from planner.trace import BLOCK_TOKENS, TraceRequest, block_key, default_trace_path, load_requests

TIER = TierKind.DRAM
PIN_TTL_S = 60.0
"""Lease on a request's hit prefix while its new blocks are inserted (trace seconds)."""
SWEEP_CAPACITIES_TOKENS = (1_000_000, 3_000_000, 10_000_000)
SWEEP_POLICIES = tuple(PolicyName)
DEFAULT_SWEEP_OUT = Path("bench/out/replay.json")


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str
    capacity_tokens: int | None
    """None: unbounded (every block fits)."""
    capacity_blocks: int
    requests: int
    blocks: int
    hit_blocks: int
    hit_ratio: float
    evictions: int
    refused_blocks: int
    """New blocks the policy declined to cache (admission) or could not make room for."""
    elapsed_s: float

    def to_json(self) -> dict[str, object]:
        return asdict(self)


class _TraceClock:
    """The index's clock during a replay: the current request's timestamp, in seconds."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def replay(requests: Sequence[TraceRequest], capacity_tokens: int | None,
           policy: PolicyName | str) -> ReplayResult:
    """Replay ``requests`` (timestamp order) through a one-tier :class:`CacheIndex`."""
    kind = policy if isinstance(policy, PolicyName) else PolicyName(policy)
    chains = [[block_key(h) for h in req.hash_ids] for req in requests]
    total_blocks = sum(len(c) for c in chains)
    if capacity_tokens is None:
        capacity_blocks = max(1, total_blocks)
    else:
        if capacity_tokens < BLOCK_TOKENS:
            raise InvalidArgument(f"capacity must hold at least one {BLOCK_TOKENS}-token block, "
                                  f"got {capacity_tokens} tokens")
        capacity_blocks = capacity_tokens // BLOCK_TOKENS
    # Sizes in token units: one block is BLOCK_TOKENS "bytes" of budget.
    budget = TierBudget(capacity_blocks * BLOCK_TOKENS, capacity_blocks * BLOCK_TOKENS,
                        capacity_blocks * BLOCK_TOKENS)
    future = FutureAccesses(chains) if kind is PolicyName.BELADY else None
    pol = make_policy(kind, future=future)
    belady = pol if isinstance(pol, BeladyPolicy) else None
    clock = _TraceClock()
    index = CacheIndex({TIER: budget}, pol, clock=clock)

    hits = evictions = refused = 0
    start = time.perf_counter()
    for step, (req, keys) in enumerate(zip(requests, chains, strict=True)):
        clock.now_s = req.timestamp_ms / 1000.0
        if belady is not None:
            belady.advance(step)
        hit = index.longest_prefix(keys)
        hits += hit
        lease = index.pin_many(keys[:hit], PIN_TTL_S) if hit else None
        new = keys[hit:]
        if new:
            parent = keys[hit - 1] if hit else None
            n = index.admit_count(new, parent, TIER, BLOCK_TOKENS)
            if n:
                need = n * BLOCK_TOKENS - index.usage(TIER).free_bytes
                try:
                    victims = index.plan_eviction(TIER, need) if need > 0 else []
                except CapacityError:
                    victims, n = [], 0  # the request alone is bigger than what can be freed
                for key in victims:
                    index.remove(key)
                evictions += len(victims)
                if n:
                    index.insert_chain(new[:n], parent, TIER, BLOCK_TOKENS)
            refused += len(new) - n
        if hit:
            # After the inserts: with both notified deepest block first, a recency order holds
            # this request's blocks leaf first, root last, so LRU never has to skip a parent.
            index.access_prefix(keys[:hit])
        if lease is not None:
            index.unpin(lease)
    elapsed = time.perf_counter() - start
    return ReplayResult(
        policy=kind.value, capacity_tokens=capacity_tokens, capacity_blocks=capacity_blocks,
        requests=len(requests), blocks=total_blocks, hit_blocks=hits,
        hit_ratio=hits / total_blocks if total_blocks else 0.0, evictions=evictions,
        refused_blocks=refused, elapsed_s=elapsed)


class TraceHalf(enum.Enum):
    """A time split of a trace for held-out checks."""

    FIRST = "first"
    """Requests with a timestamp before the median timestamp."""
    SECOND = "second"
    """Requests at or after the median timestamp."""


def split_by_time(requests: Sequence[TraceRequest], half: TraceHalf) -> list[TraceRequest]:
    """The requests of ``half`` (in order), split at the median timestamp.

    Requests that share the median timestamp all go to the second half, so the
    halves are disjoint, cover ``requests``, and never split one instant.
    """
    if not requests:
        return []
    stamps = sorted(r.timestamp_ms for r in requests)
    median_ms = stamps[len(stamps) // 2]
    if half is TraceHalf.FIRST:
        return [r for r in requests if r.timestamp_ms < median_ms]
    return [r for r in requests if r.timestamp_ms >= median_ms]


def seen_before_hits(requests: Sequence[TraceRequest]) -> int:
    """Blocks whose id appeared in an earlier request: the unbounded cache's hits.

    Computed without the index, as an independent check of the replay.
    """
    seen: set[int] = set()
    hits = 0
    for req in requests:
        hits += sum(1 for h in req.hash_ids if h in seen)
        seen.update(req.hash_ids)
    return hits


# ---------------------------------------------------------------------------
# Sweep


def gap_closed(hit_ratio: float, lru: float, belady: float) -> float | None:
    """Fraction of the LRU-to-Belady gap a policy closes (None when there is no gap)."""
    gap = belady - lru
    return None if gap <= 1e-12 else (hit_ratio - lru) / gap


def sweep(requests: Sequence[TraceRequest],
          capacities_tokens: Sequence[int] = SWEEP_CAPACITIES_TOKENS,
          policies: Sequence[PolicyName] = SWEEP_POLICIES) -> dict[str, object]:
    """Every policy at every capacity, plus the unbounded reference."""
    unbounded = replay(requests, None, PolicyName.LRU)
    rows: list[dict[str, object]] = []
    for cap in capacities_tokens:
        by_policy = {p: replay(requests, cap, p) for p in policies}
        lru = by_policy[PolicyName.LRU].hit_ratio if PolicyName.LRU in by_policy else None
        bel = by_policy[PolicyName.BELADY].hit_ratio if PolicyName.BELADY in by_policy else None
        for res in by_policy.values():
            row = res.to_json()
            row["gap_closed"] = (None if lru is None or bel is None
                                 else gap_closed(res.hit_ratio, lru, bel))
            rows.append(row)
    return {"unbounded": unbounded.to_json(), "rows": rows}


def format_sweep(result: dict[str, object]) -> str:
    unb = result["unbounded"]
    assert isinstance(unb, dict)
    lines = [f"trace: {unb['requests']} requests, {unb['blocks']} blocks; "
             f"unbounded hit ratio {unb['hit_ratio']:.4f}",
             f"{'capacity':>10} {'policy':>8} {'hit ratio':>10} {'gap closed':>11} "
             f"{'evictions':>10} {'refused':>8} {'replay s':>9}"]
    rows = result["rows"]
    assert isinstance(rows, list)
    for row in rows:
        gap = row["gap_closed"]
        gap_s = "-" if gap is None else f"{gap:+.2f}"
        lines.append(f"{row['capacity_tokens']:>10} {row['policy']:>8} {row['hit_ratio']:>10.4f} "
                     f"{gap_s:>11} {row['evictions']:>10} {row['refused_blocks']:>8} "
                     f"{row['elapsed_s']:>9.2f}")
    return "\n".join(lines)


def run_sweep(trace: Path, out: Path | None, limit: int | None = None,
              capacities_tokens: Sequence[int] = SWEEP_CAPACITIES_TOKENS,
              half: TraceHalf | None = None) -> dict[str, object]:
    requests = load_requests(trace, limit=limit)
    if half is not None:
        requests = split_by_time(requests, half)
    result = sweep(requests, capacities_tokens)
    result["trace"] = str(trace)
    result["half"] = None if half is None else half.value
    result.update(run_header("replay", dirty_paths=("kvstore/node", "planner/trace.py",
                                                    "bench/replay.py")))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def run_one(trace: Path, capacity_tokens: int | None, policy: str, *,
            limit: int | None = None) -> ReplayResult:
    """Replay one policy at one capacity (``kvtier bench replay`` without ``--sweep``)."""
    try:
        kind = PolicyName(policy)
    except ValueError as exc:
        known = ", ".join(p.value for p in PolicyName)
        raise ConfigError(f"unknown policy {policy!r} (known: {known})") from exc
    return replay(load_requests(trace, limit=limit), capacity_tokens, kind)


def format_one(result: ReplayResult) -> str:
    cap = "unbounded" if result.capacity_tokens is None else f"{result.capacity_tokens} tokens"
    return (f"{result.policy} at {cap} ({result.capacity_blocks} blocks): hit ratio "
            f"{result.hit_ratio:.4f} ({result.hit_blocks}/{result.blocks} blocks, "
            f"{result.requests} requests, {result.evictions} evictions, "
            f"{result.refused_blocks} refused) in {result.elapsed_s:.2f} s")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", type=Path, default=default_trace_path())
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--out", type=Path, default=DEFAULT_SWEEP_OUT)
    ap.add_argument("--half", choices=[h.value for h in TraceHalf], default=None,
                    help="replay only the first or second half of the trace by time")
    args = ap.parse_args(argv)
    if args.trace is None:
        ap.error("no --trace given and the default trace does not exist")
    half = None if args.half is None else TraceHalf(args.half)
    result = run_sweep(args.trace, args.out, args.limit, half=half)
    print(format_sweep(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

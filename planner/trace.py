"""Mooncake request traces (JSON lines), as published with the Mooncake paper.

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is in milliseconds from the start of the trace; ``hash_ids`` has
one id per 512-token block of the input (the last block may be partial), and
ids are prefix-chained: two requests share block ``i`` only if they share
blocks ``0..i``. :func:`block_key` turns an id into the bytes key the cache
index uses.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import InvalidArgument

BLOCK_TOKENS = 512
"""Tokens per hashed block in the Mooncake traces."""

_REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = _REPO_ROOT.parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
"""``../shared/data/traces/conversation_trace.jsonl`` next to the repository root."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("timestamp_ms", "input_length", "output_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
        if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0
                   for h in self.hash_ids):
            raise InvalidArgument("hash_ids must be non-negative ints")

    @property
    def blocks(self) -> int:
        return len(self.hash_ids)

    @property
    def expected_blocks(self) -> int:
        """``ceil(input_length / 512)``: what ``blocks`` is in a well-formed trace."""
        return math.ceil(self.input_length / BLOCK_TOKENS)


def block_key(hash_id: int) -> bytes:
    """The index key of one trace block: its id as 8 big-endian bytes."""
    return hash_id.to_bytes(8, "big")


def default_trace_path() -> Path | None:
    """:data:`DEFAULT_TRACE` when it exists, else None."""
    return DEFAULT_TRACE if DEFAULT_TRACE.is_file() else None


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Parse a trace file line by line, in file order. Blank lines are skipped.

    Raises InvalidArgument naming the file and line of the first malformed record,
    and ``OSError`` when the file cannot be read.
    """
    path = Path(path)
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                yield TraceRequest(int(rec["timestamp"]), int(rec["input_length"]),
                                   int(rec["output_length"]),
                                   tuple(int(h) for h in rec["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidArgument(f"{path}:{lineno}: not a Mooncake trace record: {exc}") from exc


def load_trace(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The first ``limit`` requests (all when None) of a trace, sorted by timestamp (stable)."""
    if limit is not None and limit < 0:
        raise InvalidArgument(f"limit must be >= 0, got {limit}")
    out: list[TraceRequest] = []
    for req in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    out.sort(key=lambda r: r.timestamp_ms)
    return out

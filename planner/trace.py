"""The one reader of Mooncake request traces (JSON lines, as published with the Mooncake paper).

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

Units, as in the file and kept as such by :class:`TraceRequest`: ``timestamp`` is integer
**milliseconds** from the start of the trace (``timestamp_ms``), lengths are tokens. ``hash_ids``
has one id per 512-token block of the input (:data:`BLOCK_TOKENS`; the last block may be partial),
prefix-chained: two requests share block ``i`` only if they share blocks ``0..i``. A record without
``hash_ids`` is an arrival-only request (no blocks).

:func:`load_requests` is the only parse of the JSONL; everything that reads a Mooncake trace goes
through it:

* the eviction replay (``bench/replay.py``) replays the records, with :func:`block_key` turning an
  id into the key the cache index uses;
* the planner and the scheduling replays read a :class:`~planner.workload.Workload`
  (:func:`planner.workload.load_mooncake`), whose arrivals are the same timestamps converted once,
  there, to seconds from the first request.

:func:`default_trace_path` is the one default location (the conversation trace under the data
directory: ``--data-dir`` > ``$KVTIER_DATA_DIR`` > ``../shared/data`` next to the repository).

Errors: a malformed line raises :class:`~kvstore.errors.ConfigError` naming the file and the line;
so do an empty trace and an unreadable file (chained to the ``OSError``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from conductor.perf.data import data_dir
from kvstore.errors import ConfigError, InvalidArgument

BLOCK_TOKENS = 512
"""Tokens per hashed block in the Mooncake traces."""

DEFAULT_TRACE_FILE = "traces/conversation_trace.jsonl"
"""The Mooncake conversation trace, relative to the data directory."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a Mooncake trace, in the file's units (milliseconds, tokens)."""

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


def default_trace_path(data: str | Path | None = None) -> Path | None:
    """The conversation trace under the data directory (``data`` > ``$KVTIER_DATA_DIR`` >
    ``../shared/data``), or None when it is not there."""
    try:
        path = data_dir(data) / DEFAULT_TRACE_FILE
    except ConfigError:
        return None
    return path if path.is_file() else None


def _integer(value: object, name: str) -> int:
    """A non-negative count; a float is accepted when it is integral (``27482.0``)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    return value


def _record(line: str) -> TraceRequest:
    rec = json.loads(line)
    if not isinstance(rec, dict):
        raise TypeError(f"a record is a JSON object, got {type(rec).__name__}")
    ids = rec.get("hash_ids", [])
    if not isinstance(ids, list):
        raise TypeError(f"hash_ids must be a list, got {ids!r}")
    return TraceRequest(_integer(rec["timestamp"], "timestamp"),
                        _integer(rec["input_length"], "input_length"),
                        _integer(rec["output_length"], "output_length"),
                        tuple(_integer(h, "hash_ids[]") for h in ids))


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """The records of a trace file in file order; blank lines are skipped.

    Raises :class:`ConfigError` naming the file and line of the first malformed record, or the
    file when it cannot be read.
    """
    path = Path(path)
    try:
        with path.open("r", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    yield _record(line)
                except (ValueError, KeyError, TypeError) as exc:  # InvalidArgument is a ValueError
                    raise ConfigError(
                        f"{path}:{lineno}: not a Mooncake trace record: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from exc


def load_requests(path: str | Path, *, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a trace in timestamp order (stable: file order within one millisecond);
    with ``limit``, the first ``limit`` of them.

    Raises :class:`ConfigError` for a malformed line, an unreadable file or a file with no
    requests, :class:`InvalidArgument` for a negative ``limit``.
    """
    if limit is not None and limit < 0:
        raise InvalidArgument(f"limit must be >= 0, got {limit}")
    out = list(iter_trace(path))
    if not out:
        raise ConfigError(f"trace {path} has no requests")
    out.sort(key=lambda r: r.timestamp_ms)
    return out if limit is None else out[:limit]

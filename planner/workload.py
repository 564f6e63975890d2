"""Arrival traces: the requests a simulated cluster serves.

A :class:`Workload` is three aligned arrays (arrival time in seconds from the first request, prompt
tokens, output tokens) plus, for traces that have them, the prefix-block ids of each prompt. Loaders:

* Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``: one id per 512-token
  block, prefix-chained, so equal leading ids mean an identical prefix), parsed by :mod:`planner.trace`;
* Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``; no block ids);
* synthetic Poisson arrivals with lognormal lengths:

  ========== ============================ ============================================================
  kind       prompt / output (mean)       meant for
  ========== ============================ ============================================================
  short      ~256 / ~512                  short prompts, long answers (chat with terse questions)
  long       ~8,000 / ~256                long documents, short answers (summaries, RAG)
  mixed      half short, half long        both at once
  sharegpt   ~755 / ~200, within 2,048    stand-in for DistServe's ShareGPT chatbot set: the means of
                                          DistServe's Fig. 7 (755.5 / 200.3); ShareGPT itself is not in
                                          shared/data, so this is a calibrated synthetic, not the data
  humaneval  ~171 / ~98, within 2,048     stand-in for DistServe's code-completion set (HumanEval)
  longbench  ~1,738 / ~91, within 2,048   stand-in for DistServe's summarization set (LongBench)
  ========== ============================ ============================================================

Replaying at another rate compresses or stretches the arrival times (:meth:`Workload.at_rate`); the
request mix is unchanged, so rate sweeps compare like with like.
"""

from __future__ import annotations

import csv
import enum
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conductor.perf.data import data_file
from kvstore.errors import ConfigError, InvalidArgument
from planner.trace import BLOCK_TOKENS, DEFAULT_TRACE_FILE, load_requests


@dataclass(frozen=True, eq=False)
class Workload:
    """Requests sorted by arrival; ``arrival_s[0] == 0``.

    ``block_ids[i]`` (when present) lists the prefix-chained ids of the ``block_tokens``-token blocks of
    prompt ``i``.
    """

    name: str
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    block_ids: tuple[tuple[int, ...], ...] | None = None
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if n == 0:
            raise InvalidArgument(f"workload {self.name!r} is empty")
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise InvalidArgument(f"workload {self.name!r}: columns differ in length")
        if self.block_ids is not None and len(self.block_ids) != n:
            raise InvalidArgument(f"workload {self.name!r}: block_ids differ in length")
        if np.any(np.diff(self.arrival_s) < 0):
            raise InvalidArgument(f"workload {self.name!r}: arrivals must be sorted")
        if np.any(self.prompt_tokens <= 0) or np.any(self.output_tokens <= 0):
            raise InvalidArgument(
                f"workload {self.name!r}: prompt and output lengths must be positive"
            )
        if self.block_tokens <= 0:
            raise InvalidArgument("block_tokens must be positive")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0])

    @property
    def rate_per_s(self) -> float:
        """Mean arrival rate (requests per second) over the trace."""
        if len(self) < 2 or self.duration_s <= 0:
            return float("inf")
        return (len(self) - 1) / self.duration_s

    def at_rate(self, rate_per_s: float) -> Workload:
        """The same requests with arrival times scaled so the mean rate is ``rate_per_s``.

        A slice whose requests all arrive at once (no duration to scale) is spread evenly at that
        rate instead, in its original order.
        """
        if not rate_per_s > 0:
            raise InvalidArgument(f"rate must be positive, got {rate_per_s}")
        if len(self) >= 2 and self.duration_s <= 0:
            arrivals = self.arrival_s[0] + np.arange(len(self)) / rate_per_s
        else:
            arrivals = self.arrival_s * (self.rate_per_s / rate_per_s) if len(self) >= 2 \
                else self.arrival_s.copy()
        return Workload(
            self.name,
            arrivals,
            self.prompt_tokens,
            self.output_tokens,
            self.block_ids,
            self.block_tokens,
        )

    def head(self, count: int) -> Workload:
        """The first ``count`` requests."""
        if count <= 0:
            raise InvalidArgument(f"count must be positive, got {count}")
        blocks = self.block_ids[:count] if self.block_ids is not None else None
        return Workload(
            self.name,
            self.arrival_s[:count],
            self.prompt_tokens[:count],
            self.output_tokens[:count],
            blocks,
            self.block_tokens,
        )

    def describe(self) -> dict[str, float | int | str]:
        return {
            "name": self.name,
            "requests": len(self),
            "duration_s": self.duration_s,
            "rate_per_s": self.rate_per_s,
            "prompt_mean": float(self.prompt_tokens.mean()),
            "prompt_p50": float(np.percentile(self.prompt_tokens, 50)),
            "prompt_p99": float(np.percentile(self.prompt_tokens, 99)),
            "output_mean": float(self.output_tokens.mean()),
            "output_p50": float(np.percentile(self.output_tokens, 50)),
            "prompt_to_output": float(self.prompt_tokens.mean() / self.output_tokens.mean()),
        }


def load_mooncake(path: str | Path, name: str | None = None) -> Workload:
    """A Mooncake JSONL trace as a workload, read by :func:`planner.trace.load_requests` (the one
    parse of the format, its errors: :class:`ConfigError` with the file and line).

    The trace's millisecond timestamps become ``arrival_s``, seconds from the first request; a
    zero length becomes 1 (the simulator needs a token to prefill and one to emit).
    """
    requests = load_requests(path)
    return _sorted(name or Path(path).stem, [r.timestamp_ms / 1000.0 for r in requests],
                   [r.input_length for r in requests], [r.output_length for r in requests],
                   [r.hash_ids for r in requests])


def load_azure(path: str | Path, name: str | None = None) -> Workload:
    """Load an Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``)."""
    stamps, prompt, output = [], [], []
    try:
        with Path(path).open(newline="") as fh:
            for row in csv.DictReader(fh):
                try:
                    stamps.append(row["TIMESTAMP"].strip().replace(" ", "T"))
                    prompt.append(int(row["ContextTokens"]))
                    output.append(int(row["GeneratedTokens"]))
                except (KeyError, TypeError, ValueError, AttributeError) as exc:
                    raise ConfigError(f"{path}: not an Azure trace row: {exc}") from exc
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from exc
    try:
        times = np.array(stamps, dtype="datetime64[ns]")
    except ValueError as exc:
        raise ConfigError(f"{path}: unparseable TIMESTAMP: {exc}") from exc
    seconds = (times - times.min()).astype(np.int64) / 1e9
    return _sorted(name or Path(path).stem, list(seconds), prompt, output, None)


def _sorted(
    name: str,
    arrival: list[float],
    prompt: list[int],
    output: list[int],
    blocks: list[tuple[int, ...]] | None,
) -> Workload:
    if not arrival:
        raise ConfigError(f"trace {name!r} has no requests")
    order = np.argsort(np.asarray(arrival), kind="stable")
    arr = np.asarray(arrival, dtype=np.float64)[order]
    prompts = np.asarray(prompt, dtype=np.int64)[order]
    outputs = np.maximum(np.asarray(output, dtype=np.int64)[order], 1)
    prompts = np.maximum(prompts, 1)
    block_ids = None if blocks is None or not any(blocks) else tuple(blocks[i] for i in order)
    return Workload(name, arr - arr[0], prompts, outputs, block_ids)


class SyntheticKind(enum.Enum):
    SHORT = "short"
    LONG = "long"
    MIXED = "mixed"
    SHAREGPT = "sharegpt"
    HUMANEVAL = "humaneval"
    LONGBENCH = "longbench"


# (mu, sigma) of the lognormal prompt and output lengths, and the context window (None: unbounded).
# Lengths beyond the window are redrawn (a truncated lognormal), not clipped, so no spike piles up at it.
_SHAPES: dict[SyntheticKind, tuple[tuple[float, float], tuple[float, float], int | None]] = {
    SyntheticKind.SHORT: ((5.2, 0.8), (5.9, 0.8), None),
    SyntheticKind.LONG: ((8.8, 0.6), (5.2, 0.8), 131072),
    # Calibrated to DistServe's ShareGPT means (755.5 / 200.3, its Fig. 7) within OPT's 2,048-token
    # window, with the wide output spread of DistServe's published per-request log (outputs of p50 ~100
    # and many under 20 tokens): prompts of mean ~755 (p50 ~650, 1.6% above 1,900 tokens), outputs of
    # mean ~200 (p50 ~105, 11% of 20 tokens or fewer).
    SyntheticKind.SHAREGPT: ((6.55, 0.75), (4.8, 1.4), 2048),
    # DistServe's code-completion and summarization sets (Fig. 7 means 171.3 / 98.2 and 1,738.3 / 90.7;
    # LongBench inputs truncated to OPT's 2,048-token window).
    SyntheticKind.HUMANEVAL: ((4.98, 0.58), (4.42, 0.6), 2048),
    SyntheticKind.LONGBENCH: ((7.55, 0.17), (4.55, 0.55), 2048),
}


def _truncated_lognormal(
    rng: np.random.Generator, mu: float, sigma: float, low: int, high: np.ndarray
) -> np.ndarray:
    values = np.rint(rng.lognormal(mu, sigma, len(high)))
    bad = (values < low) | (values > high)
    for _ in range(64):  # a few rows may have a window far in the tail: clip those after 64 redraws
        if not bad.any():
            break
        values[bad] = np.rint(rng.lognormal(mu, sigma, int(bad.sum())))
        bad = (values < low) | (values > high)
    return np.clip(values, low, high).astype(np.int64)


def _lengths(
    kind: SyntheticKind, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    (mi, si), (mo, so), window = _SHAPES[kind]
    unbounded = np.full(count, np.iinfo(np.int64).max, dtype=np.int64)
    prompt_cap = unbounded if window is None else np.full(count, window - 8, dtype=np.int64)
    prompt = _truncated_lognormal(rng, mi, si, 4, prompt_cap)
    output_cap = unbounded if window is None else window - prompt
    output = _truncated_lognormal(rng, mo, so, 1, output_cap)
    return prompt, output


def synthetic(
    kind: SyntheticKind | str, count: int, rate_per_s: float = 1.0, seed: int = 0
) -> Workload:
    """Poisson arrivals at ``rate_per_s`` with the lengths of ``kind`` (see the module docstring)."""
    kind = SyntheticKind(kind) if isinstance(kind, str) else kind
    if count <= 0:
        raise InvalidArgument(f"count must be positive, got {count}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_per_s, count)
    gaps[0] = 0.0
    arrival = np.cumsum(gaps)
    if kind is SyntheticKind.MIXED:
        sp, so = _lengths(SyntheticKind.SHORT, count, rng)
        lp, lo = _lengths(SyntheticKind.LONG, count, rng)
        pick_long = rng.random(count) < 0.5
        prompt, output = np.where(pick_long, lp, sp), np.where(pick_long, lo, so)
    else:
        prompt, output = _lengths(kind, count, rng)
    return Workload(f"synthetic-{kind.value}", arrival, prompt, output)


TRACE_FILES = {
    "mooncake": DEFAULT_TRACE_FILE,
    "azure-code": "traces/AzureLLMInferenceTrace_code.csv",
    "azure-conv": "traces/AzureLLMInferenceTrace_conv.csv",
}


def load_trace(
    spec: str,
    *,
    data: str | Path | None = None,
    count: int | None = None,
    rate_per_s: float | None = None,
    seed: int = 0,
) -> Workload:
    """Resolve ``--trace``: ``mooncake``, ``azure-code``, ``azure-conv``, a synthetic kind, or a file path.

    ``count`` keeps the first requests (synthetic traces default to 1,000); ``rate_per_s`` rescales the
    arrivals (synthetic traces are generated at it).
    """
    kinds = {k.value for k in SyntheticKind}
    if spec in kinds:
        wl = synthetic(spec, count or 1000, rate_per_s or 1.0, seed)
        return wl
    if spec in TRACE_FILES:
        path = data_file(TRACE_FILES[spec], data)
        wl = load_mooncake(path, spec) if path.suffix == ".jsonl" else load_azure(path, spec)
    else:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(
                f"unknown trace {spec!r}: use mooncake, azure-code, azure-conv, "
                f"{', '.join(sorted(kinds))}, or a .jsonl/.csv file"
            )
        wl = load_mooncake(path) if path.suffix == ".jsonl" else load_azure(path)
    if count is not None and count < len(wl):
        wl = wl.head(count)
    if rate_per_s is not None:
        wl = wl.at_rate(rate_per_s)
    return wl

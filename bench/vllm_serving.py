"""Real vLLM serving the conversation trace, side by side: alone, with kvtier, LMCache, Mooncake.

Run with ``kvtier bench vllm [--quick] [--json PATH]`` (or ``python -m bench.vllm_serving``).

**Workload.** The Mooncake conversation trace (``conversation_trace.jsonl``, found as
``planner.trace.default_trace_path`` does). Its ``hash_ids`` are prefix-chained ids of 512-token
blocks; the first ``CONVERSATIONS`` conversations with at least two requests (``--min-turns``)
are kept (a
conversation is ``hash_ids[1]``: block 0 is the system prompt every request shares), with all
their requests, in the trace's order. Contiguous windows of the trace hold almost no reuse
(~4% of blocks in any 100-request window: follow-up turns arrive minutes later), while the
conversations' requests reuse ~60% of their blocks. **Scaling:** one trace block of 512 tokens
becomes one vLLM block of ``BLOCK_TOKENS`` = 32 tokens (1/16), a partial last block
``ceil(tokens / 16)`` tokens, and a prompt keeps at most its first ``MAX_BLOCKS`` blocks (so it
fits ``max_model_len``); cutting a prefix-chained list keeps it prefix-chained. **Prompts:**
block id ``h`` is always the same ``BLOCK_TOKENS`` token ids (``random.Random`` seeded with
``"block-<h>"``; a partial block is a prefix of them), so equal block ids are equal token
blocks and vLLM's (and every connector's) chained block hashes agree exactly where the trace's
ids do. Outputs are ``MAX_TOKENS`` greedy tokens (``ignore_eos``), not the trace's lengths.

**Serving.** Closed loop, one request at a time, in trace order (the timestamps' spacing is
not replayed: on 2 cores vLLM runs the model on one thread, so concurrency would only queue;
each request waits ``SETTLE_S`` first, which says why).
Every mode runs two vLLM instances of the same model and settings, request ``i`` to instance
``i % 2``, with a vLLM KV cache of ``VLLM_KV_BYTES`` each (a few requests' worth: the trace's
reuse spans more than one instance's cache holds, as a GPU's would), and instance ``i``'s
model thread bound to core ``i`` in every mode (:func:`model_core_env` says why):

1. ``vllm-alone``: no connector; each instance has only its own prefix cache.
2. ``kvtier``: ``KvtierConnector`` to one ``kvtier daemon`` (DRAM tier of ``STORE_BYTES``) over
   its same-host data plane.
3. ``lmcache``: LMCache 0.5.6 through vLLM's ``LMCacheMPConnector`` and LMCache's multiprocess
   server (L1 of ``STORE_BYTES``, LRU, chunk size = ``BLOCK_TOKENS``) with vLLM run from the
   venv ``scripts/peers/lmcache-venv.sh`` makes (created on first use; LMCache's in-process
   connector does not work on CPU).
4. ``mooncake``: Mooncake Store through vLLM's ``MooncakeStoreConnector``: the non-CUDA wheel
   (``scripts/peers/mooncake-site.sh``: ``pip --target .peers/mooncake`` and the Debian
   libraries it links) on the vLLM children's ``PYTHONPATH``, a ``mooncake_master`` with its
   HTTP metadata server, TCP transport, each instance embedding half of ``STORE_BYTES``.

A mode that cannot run is a row saying why; no figure is ever filled in for it.

**Figures.** Per request, vLLM's own ``RequestOutput.metrics``: TTFT (front-end arrival to
first token), TPOT (first to last token over the tokens after the first), and
``num_cached_tokens``; per call, vLLM's Prometheus counters (external prefix-cache hits) and
the connector's own (``vllm:kvtier_*``: blocks and bytes loaded and saved, their seconds).
"Prefill tokens" are prompt tokens minus cached ones. **Limits**, measured in this run:
``memcpy`` of the bytes each request loaded (numpy ``copyto``, pre-touched buffers, best of
5): the load-cost ratio is the connector's load seconds over that. **Cold-instance overhead:**
before its trace, a connector mode's first instance serves ``COLD`` prompts no store has seen
(all misses) interleaved one by one (ABAB, the order alternating) with the same prompts on
the still-running first ``vllm-alone`` instance; the overhead is the ratio of their mean TTFTs minus 1. Each instance
serves one untimed warm-up prompt first. **Identity:** greedy token ids of every trace
request compared with ``vllm-alone``'s.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench._meta import REPO_ROOT, run_header
from kvstore.cluster.vllm_instance import (
    PREFILL_BOUND,
    GenerateResult,
    TinyLlama,
    VllmError,
    VllmProcess,
    tiny_llama_checkpoint,
)
from planner.trace import BLOCK_TOKENS as TRACE_BLOCK_TOKENS
from planner.trace import TraceRequest, default_trace_path, load_requests

if TYPE_CHECKING:
    from kvstore.cluster.vllm_fleet import FleetRequest

BLOCK_TOKENS = 32
"""vLLM's block size and the tokens one trace block becomes."""
SCALE = TRACE_BLOCK_TOKENS // BLOCK_TOKENS
MAX_BLOCKS = 32
"""Blocks a prompt keeps at most (1,024 tokens)."""
MAX_TOKENS = 8
MAX_MODEL_LEN = MAX_BLOCKS * BLOCK_TOKENS + 256
VLLM_KV_BYTES = 64 << 20
"""Each instance's own KV cache (128 blocks of 512 KiB with :data:`PREFILL_BOUND`)."""
STORE_BYTES = 2 << 30
"""Capacity of kvtier's DRAM tier and LMCache's L1 alike (holds the whole run)."""
CONVERSATIONS = {True: 10, False: 30}
"""Conversations replayed, by ``quick``."""
COLD = {True: 4, False: 10}
"""All-miss prompts of the cold-instance comparison, by ``quick``."""
COLD_BLOCKS = 24
SPEC: TinyLlama = PREFILL_BOUND
MODEL_NAME = f"tiny-llama-{SPEC.key()}"
LMCACHE_VENV = REPO_ROOT / ".venv-lmcache"
LMCACHE_INSTALLER = REPO_ROOT / "scripts" / "peers" / "lmcache-venv.sh"
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
MOONCAKE_SITE = REPO_ROOT / ".peers" / "mooncake"
MOONCAKE_INSTALLER = REPO_ROOT / "scripts" / "peers" / "mooncake-site.sh"


class Mode(enum.Enum):
    VLLM_ALONE = "vllm-alone"
    KVTIER = "kvtier"
    LMCACHE = "lmcache"
    MOONCAKE = "mooncake"


# ---------------------------------------------------------------------------------------------
# The workload (pure)


@dataclass(frozen=True)
class BenchRequest:
    """One trace request, scaled (see the module docstring)."""

    trace_index: int
    timestamp_ms: int
    block_ids: tuple[int | str, ...]
    last_block_tokens: int
    """Tokens of the last block (``1..BLOCK_TOKENS``)."""

    def __post_init__(self) -> None:
        if not self.block_ids or not 1 <= self.last_block_tokens <= BLOCK_TOKENS:
            raise ValueError(f"bad request {self}")

    @property
    def prompt_tokens(self) -> int:
        return (len(self.block_ids) - 1) * BLOCK_TOKENS + self.last_block_tokens


def block_tokens(block_id: int | str, vocab_size: int = SPEC.vocab_size) -> list[int]:
    """The ``BLOCK_TOKENS`` token ids of block ``block_id`` (never the special ids 0-2)."""
    rng = random.Random(f"block-{block_id}")
    return [rng.randrange(3, vocab_size) for _ in range(BLOCK_TOKENS)]


def prompt_ids(request: BenchRequest, vocab_size: int = SPEC.vocab_size) -> list[int]:
    ids: list[int] = []
    for block_id in request.block_ids[:-1]:
        ids += block_tokens(block_id, vocab_size)
    return ids + block_tokens(request.block_ids[-1], vocab_size)[:request.last_block_tokens]


def scale(index: int, request: TraceRequest, max_blocks: int = MAX_BLOCKS) -> BenchRequest:
    """A trace request in vLLM's units: one 512-token block -> ``BLOCK_TOKENS`` tokens."""
    ids = request.hash_ids[:max_blocks]
    if len(ids) < len(request.hash_ids):
        last = BLOCK_TOKENS
    else:
        tail = request.input_length - TRACE_BLOCK_TOKENS * (len(ids) - 1)
        last = min(BLOCK_TOKENS, max(1, math.ceil(tail / SCALE)))
    return BenchRequest(index, request.timestamp_ms, tuple(ids), last)


def select_conversations(requests: Sequence[TraceRequest], conversations: int,
                         max_blocks: int = MAX_BLOCKS, min_turns: int = 2
                         ) -> list[BenchRequest]:
    """The requests of the first ``conversations`` conversations with >= ``min_turns``
    requests, in trace order, scaled."""
    members: dict[int, list[int]] = {}
    for index, request in enumerate(requests):
        if len(request.hash_ids) > 1:
            members.setdefault(request.hash_ids[1], []).append(index)
    chosen = sorted((m for m in members.values() if len(m) >= max(2, min_turns)),
                    key=lambda m: m[0])
    picked = sorted(i for m in chosen[:conversations] for i in m)
    return [scale(i, requests[i], max_blocks) for i in picked]


def synthetic_requests(tag: str, count: int, blocks: int) -> list[BenchRequest]:
    """``count`` prompts of ``blocks`` full blocks no trace request shares (ids ``tag-i-j``)."""
    return [BenchRequest(-1, 0, tuple(f"{tag}-{i}-{j}" for j in range(blocks)), BLOCK_TOKENS)
            for i in range(count)]


@dataclass(frozen=True)
class Reuse:
    """What the workload offers, with an unbounded cache, counted in full blocks."""

    requests: int
    blocks: int
    reusable_blocks: int
    """Blocks of a prefix some earlier request held (prefix-chained: "seen before")."""
    cross_instance_blocks: int
    """Of those, blocks first computed by the other instance (``i % 2`` routing)."""

    @property
    def reuse_ratio(self) -> float:
        return self.reusable_blocks / self.blocks if self.blocks else 0.0

    @property
    def cross_instance_share(self) -> float:
        """Of the reusable blocks, the share only the other instance computed before."""
        return self.cross_instance_blocks / self.reusable_blocks if self.reusable_blocks else 0.0


def reuse_of(requests: Sequence[BenchRequest], instances: int = 2) -> Reuse:
    """Full blocks only, and never the whole prompt (vLLM computes at least one token)."""
    first: dict[tuple[int | str, ...], int] = {}
    blocks = reusable = cross = 0
    for i, request in enumerate(requests):
        full = request.prompt_tokens // BLOCK_TOKENS
        usable = (request.prompt_tokens - 1) // BLOCK_TOKENS
        blocks += full
        for j in range(full):
            prefix = request.block_ids[:j + 1]
            owner = first.get(prefix)
            if owner is None:
                break
            if j < usable:
                reusable += 1
                cross += owner != i % instances
        for j in range(full):
            first.setdefault(request.block_ids[:j + 1], i % instances)
    return Reuse(len(requests), blocks, reusable, cross)


# ---------------------------------------------------------------------------------------------
# Results (pure)


@dataclass
class RequestRecord:
    prompt_tokens: int
    cached_tokens: int
    external_hit_tokens: int
    local_hit_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    wall_s: float
    token_ids: list[int]
    connector: dict[str, float] = field(default_factory=dict)
    """This request's ``vllm:kvtier_*`` counter deltas (names without prefix or ``_total``)."""


@dataclass
class ModeResult:
    mode: str
    status: str = "ok"
    """``ok``, or ``not run: <why>``."""
    requests: list[RequestRecord] = field(default_factory=list)
    cold_ttft_s: list[float] = field(default_factory=list)
    cold_baseline_ttft_s: list[float] = field(default_factory=list)
    """The same cold prompts on the first ``vllm-alone`` instance, interleaved."""
    memcpy_s: list[float] = field(default_factory=list)
    """Per request that loaded: a memcpy of the bytes it loaded."""
    notes: list[str] = field(default_factory=list)
    start_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (``q`` in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no values")
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _sum(records: Sequence[RequestRecord], name: str) -> float:
    return sum(r.connector.get(name, 0.0) for r in records)


def summarize(result: ModeResult) -> dict[str, Any]:
    """The figures of one mode (``None`` where the mode has no such figure)."""
    out: dict[str, Any] = {"mode": result.mode, "status": result.status, "notes": result.notes}
    if not result.ok or not result.requests:
        return out
    rs = result.requests
    ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
    tpots = [r.tpot_s for r in rs if r.tpot_s is not None]
    prompt = sum(r.prompt_tokens for r in rs)
    out.update({
        "requests": len(rs),
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "tpot_mean_s": statistics.fmean(tpots) if tpots else None,
        "prompt_tokens": prompt,
        "prefill_tokens": prompt - sum(r.cached_tokens for r in rs),
        "external_hit_tokens": sum(r.external_hit_tokens for r in rs),
        "external_hit_ratio": sum(r.external_hit_tokens for r in rs) / prompt if prompt else 0.0,
        "local_hit_ratio": sum(r.local_hit_tokens for r in rs) / prompt if prompt else 0.0,
        "wall_s": sum(r.wall_s for r in rs),
    })
    loaded_blocks = _sum(rs, "loaded_blocks")
    saved_blocks = _sum(rs, "saved_blocks")
    has_connector_stats = any(r.connector for r in rs)
    out.update({
        "kv_loaded_bytes": _sum(rs, "loaded_bytes") if has_connector_stats else None,
        "kv_saved_bytes": _sum(rs, "saved_bytes") if has_connector_stats else None,
        "loaded_blocks": loaded_blocks if has_connector_stats else None,
        "saved_blocks": saved_blocks if has_connector_stats else None,
        "load_s_per_block": _sum(rs, "load_seconds") / loaded_blocks if loaded_blocks else None,
        "save_s_per_block": _sum(rs, "save_seconds") / saved_blocks if saved_blocks else None,
        "load_error_blocks": _sum(rs, "load_error_blocks") if has_connector_stats else None,
    })
    memcpy = sum(result.memcpy_s)
    out["load_vs_memcpy"] = _sum(rs, "load_seconds") / memcpy if memcpy and loaded_blocks \
        else None
    if result.cold_ttft_s and result.cold_baseline_ttft_s:
        cold = statistics.fmean(result.cold_ttft_s)
        base = statistics.fmean(result.cold_baseline_ttft_s)
        out.update({"cold_ttft_mean_s": cold, "cold_baseline_ttft_mean_s": base,
                    "cold_overhead": cold / base - 1})
    return out


def identical_outputs(results: Sequence[ModeResult], reference: str = Mode.VLLM_ALONE.value
                      ) -> dict[str, bool]:
    """Per mode that ran: every request's greedy tokens equal the reference mode's."""
    by_mode = {r.mode: r for r in results if r.ok and r.requests}
    ref = by_mode.get(reference)
    if ref is None:
        return {}
    return {name: len(r.requests) == len(ref.requests) and all(
        a.token_ids == b.token_ids for a, b in zip(r.requests, ref.requests, strict=True))
        for name, r in by_mode.items()}


@dataclass(frozen=True)
class PrefillModel:
    """TTFT of a request that computes ``p`` prompt tokens after ``c`` cached ones, fitted on
    ``vllm-alone``'s requests (least squares): ``a + b * p + d * p * (c + p / 2)`` (a fixed
    step cost, the per-token layers, attention over the context). Applied to another mode's
    requests it is that mode's TTFT **if its loads cost nothing**: the limit a connector can
    reach with the hits it got."""

    a_s: float
    b_s: float
    d_s: float

    def ttft_s(self, prefill_tokens: int, cached_tokens: int) -> float:
        p, c = prefill_tokens, cached_tokens
        return self.a_s + self.b_s * p + self.d_s * p * (c + p / 2)

    @classmethod
    def fit(cls, records: Sequence[RequestRecord]) -> PrefillModel | None:
        import numpy as np

        rows = [(r.prompt_tokens - r.cached_tokens, r.cached_tokens, r.ttft_s)
                for r in records if r.ttft_s is not None]
        if len(rows) < 4:
            return None
        x = np.array([[1.0, p, p * (c + p / 2)] for p, c, _t in rows])
        y = np.array([t for _p, _c, t in rows])
        (a, b, d), *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(float(a), float(b), float(d))


def floor_ttft_mean_s(model: PrefillModel, records: Sequence[RequestRecord]) -> float | None:
    """Mean TTFT ``records`` would have with free loads (:class:`PrefillModel`)."""
    values = [model.ttft_s(r.prompt_tokens - r.cached_tokens, r.cached_tokens)
              for r in records if r.ttft_s is not None]
    return statistics.fmean(values) if values else None


GOALS = {"ttft_speedup_vs_vllm_alone": 2.0, "load_vs_memcpy": 2.0,
         "ttft_ratio_vs_lmcache": 1.5, "cold_overhead": 0.05}


def assemble(results: Sequence[ModeResult], reuse: Reuse, config: dict[str, Any],
             header: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: header, workload, one summary per mode, the headline ratios and
    each goal met or not (``None`` where a figure is missing)."""
    summaries = {r.mode: summarize(r) for r in results}
    alone_result = next((r for r in results if r.mode == Mode.VLLM_ALONE.value and r.ok), None)
    model = PrefillModel.fit(alone_result.requests) if alone_result is not None else None
    for r in (r for r in results if r.ok):
        floor = floor_ttft_mean_s(model, r.requests) if model is not None else None
        mean = summaries[r.mode].get("ttft_mean_s")
        summaries[r.mode]["ttft_free_load_mean_s"] = floor
        summaries[r.mode]["ttft_vs_free_load"] = mean / floor if mean and floor else None
    kv = summaries.get(Mode.KVTIER.value, {})
    alone = summaries.get(Mode.VLLM_ALONE.value, {})
    lm = summaries.get(Mode.LMCACHE.value, {})

    def ratio(a: dict[str, Any], b: dict[str, Any]) -> float | None:
        x, y = a.get("ttft_mean_s"), b.get("ttft_mean_s")
        return x / y if x and y else None

    same = identical_outputs(results)
    doc: dict[str, Any] = {**header, "config": config,
                           "workload": {**asdict(reuse), "reuse_ratio": reuse.reuse_ratio,
                                        "cross_instance_share": reuse.cross_instance_share},
                           "prefill_model": None if model is None else asdict(model),
                           "modes": summaries,
                           "outputs_identical_by_mode": same,
                           "outputs_identical": bool(same) and all(same.values()) and
                           len(same) == sum(1 for r in results if r.ok and r.requests),
                           "ttft_speedup_vs_vllm_alone": ratio(alone, kv),
                           "ttft_ratio_vs_lmcache": ratio(lm, kv),
                           "load_vs_memcpy": kv.get("load_vs_memcpy"),
                           "cold_overhead": kv.get("cold_overhead")}
    goals: dict[str, bool | None] = {}
    for name, limit in GOALS.items():
        value = doc[name]
        if value is None:
            goals[name] = None
        elif name in ("load_vs_memcpy", "cold_overhead"):
            goals[name] = value <= limit
        else:
            goals[name] = value >= limit
    goals["outputs_identical"] = doc["outputs_identical"]
    doc["goals"] = goals
    doc["requests"] = {r.mode: [asdict(q) for q in r.requests] for r in results}
    return doc


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.0f}"


def format_table(doc: dict[str, Any]) -> str:
    """A Markdown table of the modes, then the ratios beside their goals."""
    w = doc["workload"]
    lines = [f"workload: {w['requests']} requests, {w['blocks']} blocks, reusable "
             f"{w['reuse_ratio']:.0%} of blocks, {w['cross_instance_share']:.0%} of those only on "
             f"the other instance",
             "",
             "| mode | TTFT mean / p50 / p99 ms | TTFT if loads were free ms (ratio) | TPOT ms | "
             "prefill tokens | ext. hit | KV loaded / saved MiB | load / save ms per block | "
             "cold TTFT ms (alone) | same output |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    same = doc["outputs_identical_by_mode"]
    for name, s in doc["modes"].items():
        if s["status"] != "ok":
            lines.append(f"| {name} | {s['status']} | | | | | | | | |")
            continue
        cold = "-" if "cold_ttft_mean_s" not in s else \
            f"{_ms(s['cold_ttft_mean_s'])} ({_ms(s['cold_baseline_ttft_mean_s'])}, " \
            f"{s['cold_overhead']:+.1%})"
        ratio = s.get("ttft_vs_free_load")
        free = _ms(s.get("ttft_free_load_mean_s")) + ("" if ratio is None else f" ({ratio:.2f}x)")
        lines.append(
            f"| {name} | {_ms(s['ttft_mean_s'])} / {_ms(s['ttft_p50_s'])} / "
            f"{_ms(s['ttft_p99_s'])} | {free} | {_ms(s['tpot_mean_s'])} | {s['prefill_tokens']} / "
            f"{s['prompt_tokens']} | {s['external_hit_ratio']:.0%} | "
            f"{_mib(s['kv_loaded_bytes'])} / {_mib(s['kv_saved_bytes'])} | "
            f"{_ms(s['load_s_per_block'])} / {_ms(s['save_s_per_block'])} | {cold} | "
            f"{'yes' if same.get(name) else 'NO'} |")
    lines.append("")

    def goal(name: str, text: str, fmt: str) -> str:
        value, met = doc[name], doc["goals"][name]
        shown = "n/a" if value is None else format(value, fmt)
        verdict = "not measured" if met is None else "met" if met else "MISSED"
        return f"- {text}: {shown} ({verdict})"

    lines += [goal("ttft_speedup_vs_vllm_alone", "mean TTFT, vLLM alone / kvtier (goal >= 2)",
                   ".2f"),
              goal("load_vs_memcpy", "kvtier load seconds / memcpy of the same bytes (goal <= 2)",
                   ".2f"),
              goal("ttft_ratio_vs_lmcache", "mean TTFT, LMCache / kvtier (goal >= 1.5)", ".2f"),
              goal("cold_overhead", "cold-instance TTFT overhead of the kvtier connector "
                   "(goal <= 5%)", "+.1%"),
              f"- outputs identical across modes: {doc['outputs_identical']} "
              f"({', '.join(f'{k}: {v}' for k, v in same.items())})"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Running (processes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.3)
    raise RuntimeError(f"not listening on {port} after {timeout_s} s: {_tail(log)}")


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the group ``proc`` leads (started with ``start_new_session``), then SIGKILL."""
    import signal

    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)


MOONCAKE_COUNTERS = {
    "loaded_blocks": "vllm:mooncake_store_operation_keys[load_get]",
    "loaded_bytes": "vllm:mooncake_store_operation_bytes[load_get]",
    "load_seconds": "vllm:mooncake_store_operation_time_seconds_sum[load_get]",
    "saved_blocks": "vllm:mooncake_store_operation_keys[save_put]",
    "saved_bytes": "vllm:mooncake_store_operation_bytes[save_put]",
    "save_seconds": "vllm:mooncake_store_operation_time_seconds_sum[save_put]",
    "load_error_blocks": "vllm:mooncake_store_operation_failed_keys[load_get]",
}
"""kvtier's connector stats in vLLM's Mooncake store connector's metrics (one key a block:
all layers of a block are one value; seconds are the durations of its get/put calls)."""


def _connector_counters(counters: dict[str, float]) -> dict[str, float]:
    """The connector's counters under kvtier's names (``vllm:kvtier_<name>``, or the Mooncake
    connector's equivalents); empty for a connector reporting none (LMCache's)."""
    out: dict[str, float] = {}
    for name, value in counters.items():
        if name.startswith("vllm:kvtier_"):
            short = name[len("vllm:kvtier_"):]
            short = short.removesuffix("_total")
            out[short] = out.get(short, 0.0) + value
    if any(name.startswith("vllm:mooncake_store_") for name in counters):
        for short, name in MOONCAKE_COUNTERS.items():
            out[short] = counters.get(name, 0.0)
    return out


def _record(request_tokens: int, result: GenerateResult, wall_s: float) -> RequestRecord:
    out = result.outputs[0]
    return RequestRecord(prompt_tokens=request_tokens, cached_tokens=out.num_cached_tokens,
                         external_hit_tokens=result.external_hit_tokens,
                         local_hit_tokens=result.local_hit_tokens, ttft_s=out.ttft_s,
                         tpot_s=out.tpot_s, wall_s=wall_s, token_ids=out.token_ids,
                         connector=_connector_counters(result.counters))


SETTLE_S = 1.2
"""Pause before every timed request. After answering, vLLM's CPU worker busy-waits on its
input queue for 1 s (``SpinCondition(busy_loop_s=1)`` in ``shm_broadcast.py``, not
configurable): with two instances taking turns on 2 cores, the one that just answered spun a
whole core through most of the next request on the other (0.6-1.0 CPU-seconds measured per
request), whatever the mode. The trace's own gaps between turns are minutes."""


def _serve_one(llm: VllmProcess, prompt: list[int]) -> RequestRecord:
    time.sleep(SETTLE_S)
    began = time.monotonic()
    result = llm.generate([prompt], max_tokens=MAX_TOKENS, timeout_s=600.0)
    return _record(len(prompt), result, time.monotonic() - began)


class Memcpy:
    """Pre-touched buffers; ``seconds(n)`` = best of 5 numpy copies of ``n`` bytes."""

    def __init__(self, max_bytes: int) -> None:
        import numpy as np

        self._np = np
        self._src = np.ones(max_bytes, dtype=np.uint8)
        self._dst = np.zeros(max_bytes, dtype=np.uint8)

    def seconds(self, nbytes: int) -> float:
        n = min(int(nbytes), self._src.size)
        best = math.inf
        for _ in range(5):
            began = time.perf_counter()
            self._np.copyto(self._dst[:n], self._src[:n])
            best = min(best, time.perf_counter() - began)
        return best * (nbytes / n if n else 1.0)


@dataclass
class Setup:
    model_dir: Path
    work: Path
    quick: bool
    trace: list[BenchRequest]
    log: Callable[[str], None]
    memcpy: Memcpy

    def instance(self, name: str, index: int, *, env: dict[str, str] | None = None,
                 **kwargs: Any) -> VllmProcess:
        """Instance ``index`` of a mode; its model thread is bound to its own core
        (:func:`model_core_env`), the same in every mode."""
        return VllmProcess(self.model_dir, self.work, name, block_size=BLOCK_TOKENS,
                           max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=VLLM_KV_BYTES,
                           env={**model_core_env(index), **(env or {})}, **kwargs)


def model_core_env(index: int, cpus: int | None = None) -> dict[str, str]:
    """Bind instance ``index``'s model (vLLM's OpenMP threads) to core ``index % cpus``: one
    core per instance, in every mode alike, as each instance would have its own accelerator.

    Left to itself vLLM on CPU reserves one core for its front end plus one more whenever a
    KV connector is configured (``ompmultiprocessing.py``: "reserve at one more core for
    nixl_connector"); on 2 cores that leaves no core to reserve, so every connector instance
    ran its model on both cores with 2 OpenMP threads while ``vllm-alone``'s two instances
    shared core 0 with one thread each: the modes were not like for like (measured here: a
    512-token all-miss prefill 440 ms with the connector against 1120 ms without)."""
    n = cpus or os.cpu_count() or 1
    return {"VLLM_CPU_OMP_THREADS_BIND": str(index % n)}


def _start_all(llms: Sequence[VllmProcess], result: ModeResult, tag: str) -> None:
    """Start the instances side by side (a start is mostly waiting on imports and loading;
    minutes on a busy 2-core box), then one untimed warm-up prompt each."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(llms)) as pool:
        for future in [pool.submit(llm.start, 600.0) for llm in llms]:
            future.result()
    for i, llm in enumerate(llms):
        assert llm.start_s is not None
        result.start_s.append(llm.start_s)
        _serve_one(llm, prompt_ids(synthetic_requests(f"warm-{tag}-{i}", 1, 4)[0]))


@contextlib.contextmanager
def _instances(setup: Setup, mode: Mode, result: ModeResult, **kwargs: Any
               ) -> Iterator[list[VllmProcess]]:
    llms = [setup.instance(f"{mode.value}-{i}", i, **kwargs) for i in range(2)]
    try:
        _start_all(llms, result, mode.value)
        yield llms
    finally:
        for llm in llms:
            llm.close()


def _run_trace(setup: Setup, llms: list[VllmProcess], result: ModeResult) -> None:
    for i, request in enumerate(setup.trace):
        record = _serve_one(llms[i % 2], prompt_ids(request))
        result.requests.append(record)
        loaded = record.connector.get("loaded_bytes", 0.0)
        if loaded:
            result.memcpy_s.append(setup.memcpy.seconds(int(loaded)))
        if (i + 1) % 10 == 0:
            setup.log(f"  {result.mode}: {i + 1}/{len(setup.trace)} requests")


def _run_cold(setup: Setup, llm: VllmProcess, baseline: VllmProcess | None,
              mode: Mode, result: ModeResult) -> None:
    """All-miss prompts on ``llm`` and, interleaved, on the baseline instance (the order
    alternates per prompt, so neither always runs first after a pause)."""
    if baseline is None:
        return
    for i, request in enumerate(
            synthetic_requests(f"cold-{mode.value}", COLD[setup.quick], COLD_BLOCKS)):
        prompt = prompt_ids(request)
        if i % 2 == 0:
            base = _serve_one(baseline, prompt)
            mine = _serve_one(llm, prompt)
        else:
            mine = _serve_one(llm, prompt)
            base = _serve_one(baseline, prompt)
        if base.ttft_s is not None and mine.ttft_s is not None:
            result.cold_baseline_ttft_s.append(base.ttft_s)
            result.cold_ttft_s.append(mine.ttft_s)
        if base.token_ids != mine.token_ids:
            result.notes.append("a cold prompt's output differs from vllm-alone's")


def run_alone(setup: Setup, stack: contextlib.ExitStack) -> tuple[ModeResult, VllmProcess]:
    """The baseline; its first instance stays up (on ``stack``) for the cold comparisons."""
    result = ModeResult(Mode.VLLM_ALONE.value)
    llms = [setup.instance(f"{Mode.VLLM_ALONE.value}-{i}", i) for i in range(2)]
    for llm in llms:
        stack.callback(llm.close)
    _start_all(llms, result, Mode.VLLM_ALONE.value)
    _run_trace(setup, llms, result)
    llms[1].close()
    return result, llms[0]


def run_kvtier(setup: Setup, baseline: VllmProcess | None) -> ModeResult:
    from bench.datapath import spawn_daemon, stop_daemon

    result = ModeResult(Mode.KVTIER.value)
    daemon, address = spawn_daemon("bench-vllm", dram_bytes=str(STORE_BYTES))
    try:
        config = {"kv_connector": "KvtierConnector",
                  "kv_connector_module_path": "kvstore.integrations.vllm.connector",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  "kv_connector_extra_config": {"daemon": address, "model": MODEL_NAME}}
        with _instances(setup, Mode.KVTIER, result, kv_transfer_config=config) as llms:
            _run_cold(setup, llms[0], baseline, Mode.KVTIER, result)
            _run_trace(setup, llms, result)
    finally:
        stop_daemon(daemon)
    return result


def lmcache_python(log: Callable[[str], None]) -> Path:
    """The LMCache venv's python, made by ``scripts/peers/lmcache-venv.sh`` on first use."""
    python = LMCACHE_VENV / "bin" / "python"
    stamp = LMCACHE_VENV / ".kvtier-lmcache"
    if not stamp.exists():
        log(f"creating {LMCACHE_VENV} (LMCache 0.5.6 + vllm-cpu; a few minutes)")
    _install(LMCACHE_INSTALLER, LMCACHE_VENV, timeout_s=1800)
    return python


def _install(script: Path, target: Path, *, timeout_s: float,
             env: dict[str, str] | None = None) -> None:
    """Run a peer installer (idempotent); RuntimeError with the tail of its output."""
    done = subprocess.run(["bash", str(script), str(target)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s,
                          env=None if env is None else {**os.environ, **env})
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{script.name} failed ({done.returncode}): {tail}")


def run_lmcache(setup: Setup, baseline: VllmProcess | None) -> ModeResult:
    result = ModeResult(Mode.LMCACHE.value)
    try:
        python = lmcache_python(setup.log)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        result.status = f"not run: {exc}"
        return result
    port = _free_port()
    log = setup.work / "lmcache-server.log"
    with log.open("ab") as out:
        server = subprocess.Popen(
            [str(python), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1",
             "--port", str(port), "--chunk-size", str(BLOCK_TOKENS),
             "--l1-size-gb", f"{STORE_BYTES / (1 << 30):g}", "--eviction-policy", "LRU",
             "--supported-transfer-mode", "auto", "--disable-observability"],
            cwd=setup.work, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        _wait_port(port, server, 180.0, log)
        config = {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                "lmcache.mp.port": port}}
        with _instances(setup, Mode.LMCACHE, result, kv_transfer_config=config,
                        python=python) as llms:
            _run_cold(setup, llms[0], baseline, Mode.LMCACHE, result)
            _run_trace(setup, llms, result)
        result.notes.append("LMCache's KV bytes are not reported (its server runs with "
                            "--disable-observability; vLLM's connector reports none)")
    except (RuntimeError, VllmError) as exc:
        result.status = f"not run: {str(exc)[-600:]}"
        result.requests.clear()
    finally:
        _stop(server)
    return result


def mooncake_site(log: Callable[[str], None]) -> Path:
    """``mooncake-transfer-engine-non-cuda`` installed by ``scripts/peers/mooncake-site.sh``
    (``pip --target``, plus the Debian libraries it links), so the Mooncake mode's vLLM
    children import it from PYTHONPATH."""
    if not (MOONCAKE_SITE / ".kvtier-mooncake").exists():
        log(f"installing {MOONCAKE_PACKAGE} into {MOONCAKE_SITE}")
    _install(MOONCAKE_INSTALLER, MOONCAKE_SITE, timeout_s=900,
             env={"PYTHON": sys.executable, "MOONCAKE_PKG": MOONCAKE_PACKAGE})
    return MOONCAKE_SITE


def run_mooncake(setup: Setup, baseline: VllmProcess | None) -> ModeResult:
    result = ModeResult(Mode.MOONCAKE.value)
    try:
        site = mooncake_site(setup.log)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        result.status = f"not run: {exc}"
        return result
    master_bin = site / "bin" / "mooncake_master"
    if not master_bin.exists():
        found = sorted(site.rglob("mooncake_master"))
        if not found:
            result.status = f"not run: no mooncake_master in {MOONCAKE_PACKAGE}"
            return result
        master_bin = found[0]
    rpc, meta, metrics = _free_port(), _free_port(), _free_port()
    log = setup.work / "mooncake-master.log"
    env = {**os.environ, "PYTHONPATH": str(site), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    with log.open("ab") as out:
        master = subprocess.Popen(
            [str(master_bin), "--rpc_address=127.0.0.1", f"--rpc_port={rpc}",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={meta}", "--metrics_host=127.0.0.1",
             f"--metrics_port={metrics}", "--logtostderr"],
            cwd=setup.work, env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_port(rpc, master, 60.0, log)
        store_config = setup.work / "mooncake.json"
        store_config.write_text(json.dumps({
            "metadata_server": f"http://127.0.0.1:{meta}/metadata",
            "master_server_address": f"127.0.0.1:{rpc}", "protocol": "tcp", "device_name": "",
            "mode": "embedded", "global_segment_size": STORE_BYTES // 2,
            "local_buffer_size": 256 << 20}))
        config = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {}}
        child_env = {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{site}",
                     "MOONCAKE_CONFIG_PATH": str(store_config),
                     "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        with _instances(setup, Mode.MOONCAKE, result, kv_transfer_config=config,
                        env=child_env) as llms:
            _run_cold(setup, llms[0], baseline, Mode.MOONCAKE, result)
            _run_trace(setup, llms, result)
    except (RuntimeError, VllmError) as exc:
        result.status = f"not run: {_first_error(str(exc))}"
        result.requests.clear()
    finally:
        _stop(master)
    return result


def _first_error(text: str) -> str:
    """The most telling line of a child's failure (its last ``Error``/``Exception`` line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    return (errors[-1] if errors else lines[-1] if lines else text)[-400:]


def run(quick: bool, modes: Sequence[Mode], trace_path: Path | None = None,
        work: Path | None = None, log: Callable[[str], None] = print, *,
        conversations: int | None = None, min_turns: int = 2) -> dict[str, Any]:
    trace_path = trace_path or default_trace_path()
    if trace_path is None:
        raise SystemExit("conversation_trace.jsonl not found (set KVTIER_DATA_DIR)")
    conversations = conversations or CONVERSATIONS[quick]
    trace = select_conversations(load_requests(trace_path), conversations,
                                 min_turns=min_turns)
    reuse = reuse_of(trace)
    log(f"{len(trace)} requests from {conversations} conversations of >= {min_turns} turns; "
        f"reusable "
        f"{reuse.reuse_ratio:.0%} of blocks, {reuse.cross_instance_share:.0%} of those only on "
        f"the other instance")
    model_dir = tiny_llama_checkpoint(SPEC)
    own_work = work is None
    work = work or Path(tempfile.mkdtemp(prefix="kvtier-bench-vllm-"))
    biggest = max(r.prompt_tokens for r in trace) * SPEC.kv_bytes_per_token()
    setup = Setup(model_dir, work, quick, trace, log, Memcpy(biggest))
    results: list[ModeResult] = []
    runners = {Mode.KVTIER: run_kvtier, Mode.LMCACHE: run_lmcache, Mode.MOONCAKE: run_mooncake}
    try:
        with contextlib.ExitStack() as stack:
            log("mode vllm-alone")
            alone, baseline = run_alone(setup, stack)
            results.append(alone)
            for mode in modes:
                if mode is Mode.VLLM_ALONE:
                    continue
                log(f"mode {mode.value}")
                result = runners[mode](setup, baseline)
                if not result.ok:
                    log(f"  {result.status}")
                results.append(result)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    config = {"quick": quick, "trace": str(trace_path), "conversations": conversations,
              "min_turns": min_turns,
              "block_tokens": BLOCK_TOKENS, "trace_block_tokens": TRACE_BLOCK_TOKENS,
              "max_blocks": MAX_BLOCKS, "max_tokens": MAX_TOKENS, "max_model_len": MAX_MODEL_LEN,
              "vllm_kv_bytes": VLLM_KV_BYTES, "store_bytes": STORE_BYTES,
              "cold_prompts": COLD[quick], "cold_blocks": COLD_BLOCKS,
              "model": {**asdict(SPEC), "key": SPEC.key(),
                        "kv_bytes_per_token": SPEC.kv_bytes_per_token()},
              "instance_start_s": {r.mode: r.start_s for r in results},
              "closed_loop": "one request at a time, trace order, request i on instance i % 2",
              "load_avg_1m_at_end": os.getloadavg()[0]}
    header = run_header("vllm-serving", dists=("vllm-cpu", "vllm", "torch", "numpy"),
                        dirty_paths=("bench", "kvstore"))
    doc = assemble(results, reuse, config, header)
    alone_summary = doc["modes"][Mode.VLLM_ALONE.value]
    prefill = [p for p in (_prefill_share(r) for r in alone.requests) if p is not None]
    doc["prefill_share_vllm_alone"] = statistics.fmean(prefill) if prefill else None
    if alone_summary.get("ttft_mean_s"):
        log(f"vllm-alone: prefill is {doc['prefill_share_vllm_alone']:.0%} of a request "
            f"(TTFT / (TTFT + decode))")
    return doc


def _prefill_share(record: RequestRecord) -> float | None:
    if record.ttft_s is None or record.tpot_s is None:
        return None
    decode = record.tpot_s * (len(record.token_ids) - 1)
    return record.ttft_s / (record.ttft_s + decode)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_serving",
                                     description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help=f"{CONVERSATIONS[True]} conversations instead of "
                             f"{CONVERSATIONS[False]}")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--modes", default=",".join(m.value for m in Mode),
                        help="comma-separated modes (vllm-alone always runs)")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--conversations", type=int, default=None,
                        help="how many conversations (default: the --quick choice above)")
    parser.add_argument("--min-turns", type=int, default=2,
                        help="keep only conversations of at least this many requests (a "
                             "slice with more reuse)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work directory to keep (instance logs); default a temp dir")
    args = parser.parse_args(argv)
    modes = [Mode(m.strip()) for m in args.modes.split(",") if m.strip()]
    doc = run(args.quick, modes, args.trace, args.keep,
              log=lambda line: print(line, file=sys.stderr, flush=True),
              conversations=args.conversations, min_turns=args.min_turns)
    print(format_table(doc))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def fleet_requests(trace: Path, conversations: int, vocab_size: int) -> list[FleetRequest]:
    """The fleet's prompts (``make run``, ``kvtier bench fleet``): this benchmark's
    conversation slice of ``trace``, each tagged with its conversation (its second trace
    block, as :func:`select_conversations` groups them)."""
    from kvstore.cluster.vllm_fleet import FleetRequest

    picked = select_conversations(load_requests(trace), conversations)
    return [FleetRequest(f"trace-{r.trace_index}", tuple(prompt_ids(r, vocab_size)),
                         f"conversation-{r.block_ids[1]}") for r in picked]

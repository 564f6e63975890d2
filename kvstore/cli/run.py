"""``kvtier run``: the main job of ``make run``.

Today: one node's tiers serving a slice of the real Mooncake conversation trace to a real (random
weight) Llama-architecture model. Prompts are synthesized so that equal trace block ids are equal
token blocks; each request prefills through the tiered cache (reusing what is cached), decodes a few
tokens greedily, and is checked against a full prefill without reuse. DRAM is kept small so chunks
demote to NVMe and promote back; the NVMe directory persists between runs, so a second run starts
by recovering the first run's chunks.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstore.dataplane.tier import Tier, TierKind

MiB = 1 << 20
TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    token_ids: list[int]
    block_ids: list[int]


def default_trace() -> Path:
    return Path(__file__).resolve().parents[2].parent / "shared/data/traces/conversation_trace.jsonl"


def synthesize_requests(trace: Path, *, count: int, max_blocks: int, block_tokens: int,
                        vocab_size: int) -> list[Request]:
    """Requests from a Mooncake trace, scaled to ``block_tokens`` per trace block.

    Trace block id ``h`` becomes a fixed pseudo-random token block seeded by ``h``, so equal ids
    are equal token blocks and prefixes are shared exactly where the trace shares them. The last
    block is cut to the same fraction of a block as the trace's ``input_length``.
    """
    out: list[Request] = []
    with trace.open() as f:
        for line in f:
            rec = json.loads(line)
            ids: list[int] = rec["hash_ids"]
            if not ids or len(ids) > max_blocks:
                continue
            tokens: list[int] = []
            for h in ids:
                rng = np.random.default_rng(int(h))
                tokens.extend(rng.integers(0, vocab_size, block_tokens).tolist())
            tail = rec["input_length"] - (len(ids) - 1) * TRACE_BLOCK_TOKENS
            keep = (len(ids) - 1) * block_tokens + max(1, round(tail * block_tokens / TRACE_BLOCK_TOKENS))
            out.append(Request(int(rec["timestamp"]), tokens[:keep], ids))
            if len(out) == count:
                break
    return out


def build_tiers(data_dir: Path, *, dram_bytes: int, nvme_bytes: int, console: Console) -> dict[TierKind, Tier]:
    from kvstore.dataplane.dram import DramTier
    from kvstore.dataplane.nvme import NvmeTier, NvmeTierConfig
    from kvstore.errors import TierUnavailable

    tiers: dict[TierKind, Tier] = {}
    try:
        from kvstore.dataplane.hbm import HbmTier

        tiers[TierKind.HBM] = HbmTier(dram_bytes // 2)
    except TierUnavailable as exc:
        console.print(f"[dim]HBM tier: off ({exc})[/dim]")
    tiers[TierKind.DRAM] = DramTier(dram_bytes)
    tiers[TierKind.NVME] = NvmeTier.open(NvmeTierConfig(directory=data_dir / "nvme",
                                                        capacity_bytes=nvme_bytes,
                                                        segment_bytes=64 * MiB))
    return tiers


def run(requests: int = typer.Option(16, help="How many trace requests to serve."),
        max_blocks: int = typer.Option(6, help="Skip trace requests longer than this many blocks."),
        new_tokens: int = typer.Option(8, help="Greedy tokens decoded per request."),
        dram_mib: int = typer.Option(24, help="DRAM tier size (small on purpose: forces demotion)."),
        nvme_mib: int = typer.Option(512, help="NVMe tier size."),
        data_dir: Path = typer.Option(Path(".kvtier-run"), help="Where the NVMe tier keeps its files."),
        trace: Path = typer.Option(None, help="Mooncake-format trace (default: ../shared/data/traces/conversation_trace.jsonl)."),
        fresh: bool = typer.Option(False, help="Start with an empty NVMe tier."),
        policy: str = typer.Option("mq", help="Eviction policy."),
        ) -> None:
    """Serve a slice of a real trace through the tiered cache with a real transformer, checking
    that reused prefixes give the same output as full prefill."""
    import torch

    from kvstore.engine.model import ModelSpec, build_reference_model
    from kvstore.engine.reuse import ReuseEngine
    from kvstore.node.cache import TieredCache

    console = Console(width=160)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    trace = trace or default_trace()
    if not trace.exists():
        raise typer.BadParameter(f"trace {trace} not found", param_hint="--trace")
    if fresh and data_dir.exists():
        shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)

    spec = ModelSpec()
    model = build_reference_model(spec)
    tiers = build_tiers(data_dir, dram_bytes=dram_mib * MiB, nvme_bytes=nvme_mib * MiB, console=console)
    cache = TieredCache(tiers, policy=policy)
    recovered = cache.recover()
    engine = ReuseEngine(model, cache, block_tokens=256)
    reqs = synthesize_requests(trace, count=requests, max_blocks=max_blocks, block_tokens=256,
                               vocab_size=spec.vocab_size)
    console.print(f"model: Llama-architecture, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
                  f"params (random weights, seed {spec.seed}); KV chunk = 256 tokens = "
                  f"{engine.layout.chunk_bytes / MiB:.1f} MiB; tiers: "
                  + ", ".join(f"{k.value} {t.capacity_bytes / MiB:.0f} MiB" for k, t in tiers.items())
                  + f"; policy {policy}; recovered {recovered.recovered} chunks from a previous run")

    table = Table(title=f"{len(reqs)} requests from {trace.name}")
    for col in ("#", "prompt", "reused", "from", "load ms", "prefill ms", "full ms", "saved",
                "identical", "max |dlogit|"):
        table.add_column(col, justify="right")
    totals = {"prompt": 0, "reused": 0, "mismatch": 0, "reuse_s": 0.0, "full_s": 0.0}
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("serving", total=len(reqs))
        for i, req in enumerate(reqs):
            t0 = time.perf_counter()
            got = engine.prefill(req.token_ids)
            tokens, logits = engine.decode(got, new_tokens)
            t_reuse = time.perf_counter() - t0
            t0 = time.perf_counter()
            ref = engine.prefill(req.token_ids, reuse=False)
            ref_tokens, ref_logits = engine.decode(ref, new_tokens)
            t_full = time.perf_counter() - t0
            diff = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True))
            same = tokens == ref_tokens
            totals["prompt"] += got.prompt_tokens
            totals["reused"] += got.reused_tokens
            totals["mismatch"] += 0 if same else 1
            totals["reuse_s"] += t_reuse
            totals["full_s"] += t_full
            table.add_row(str(i), str(got.prompt_tokens), str(got.reused_tokens),
                          ",".join(f"{k}:{v}" for k, v in got.loaded_from.items()) or "-",
                          f"{got.load_s * 1e3:.1f}", f"{got.compute_s * 1e3:.0f}",
                          f"{ref.compute_s * 1e3:.0f}", str(got.saved_blocks),
                          "yes" if same else "[red]NO[/red]", f"{diff:.1e}")
            progress.advance(task)
    console.print(table)

    tiers_table = Table(title="What moved where")
    for col in ("tier", "chunks", "used MiB", "hits", "puts", "MiB written", "write GB/s",
                "MiB read", "read GB/s", "demoted out", "promoted in", "dropped"):
        tiers_table.add_column(col, justify="right")
    for rep in cache.report():
        c = rep.counters
        tiers_table.add_row(
            rep.kind.value, str(rep.stats.chunks), f"{rep.stats.used_bytes / MiB:.0f}", str(c.hits),
            str(c.puts), f"{c.bytes_written / MiB:.0f}",
            f"{c.bytes_written / c.seconds_writing / 1e9:.2f}" if c.seconds_writing else "-",
            f"{c.bytes_read / MiB:.0f}",
            f"{c.bytes_read / c.seconds_reading / 1e9:.2f}" if c.seconds_reading else "-",
            str(c.demotions_out), str(c.promotions_in), str(c.drops))
    console.print(tiers_table)
    hit = totals["reused"] / max(1, totals["prompt"])
    console.print(f"prompt tokens {totals['prompt']}, reused {totals['reused']} ({hit:.1%}); "
                  f"time with reuse {totals['reuse_s']:.1f} s vs full prefill {totals['full_s']:.1f} s; "
                  f"outputs identical in {len(reqs) - totals['mismatch']}/{len(reqs)} requests")
    persisted = cache.persist()
    console.print(f"persisted {persisted / MiB:.0f} MiB of memory-tier chunks to NVMe "
                  f"({data_dir / 'nvme'}); the next run recovers them")
    cache.close()
    if totals["mismatch"]:
        raise typer.Exit(code=1)

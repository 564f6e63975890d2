"""The main job of ``make run`` (``kvtier run``), and the serving replay ``kvtier bench e2e`` shares.

:func:`run_cluster`: a :class:`~kvstore.cluster.local.LocalCluster` serving a slice of the real
Mooncake conversation trace through the gateway, without and with prefix reuse.
:func:`run_local` (``--local``): one node's tiers serving a slice of the real Mooncake conversation trace to a real (random
weight) Llama-architecture model. Prompts are synthesized so that equal trace block ids are equal
token blocks; each request prefills through the tiered cache (reusing what is cached), decodes a few
tokens greedily, and is checked against a full prefill without reuse. DRAM is kept small so chunks
demote to NVMe and promote back; the NVMe directory persists between runs, so a second run starts
by recovering the first run's chunks.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import typer
from rich.console import Console
from rich.progress import Progress, TaskID
from rich.table import Table

from kvstore.dataplane.tier import Tier, TierKind
from kvstore.engine.model import ModelSpec

if TYPE_CHECKING:
    from kvstore.engine.gateway import Gateway, GatewayResult

MiB = 1 << 20
TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class Request:
    timestamp_ms: int
    token_ids: list[int]
    block_ids: list[int]


def default_trace() -> Path:
    """The conversation trace (``$KVTIER_DATA_DIR`` > ``../shared/data``; see
    :func:`planner.trace.default_trace_path`), or where it would be when it is missing."""
    from planner.trace import DEFAULT_TRACE_FILE, default_trace_path

    return default_trace_path() or Path("../shared/data") / DEFAULT_TRACE_FILE


def synthesize_requests(trace: Path, *, count: int, max_blocks: int, block_tokens: int,
                        vocab_size: int) -> list[Request]:
    """Requests from a Mooncake trace, scaled to ``block_tokens`` per trace block.

    Trace block id ``h`` becomes a fixed pseudo-random token block seeded by ``h``, so equal ids
    are equal token blocks and prefixes are shared exactly where the trace shares them. The last
    block is cut to the same fraction of a block as the trace's ``input_length``.
    """
    from planner.trace import iter_trace

    out: list[Request] = []
    for rec in iter_trace(trace):  # file order; malformed lines raise ConfigError
        ids = list(rec.hash_ids)
        if not ids or len(ids) > max_blocks:
            continue
        tokens: list[int] = []
        for h in ids:
            rng = np.random.default_rng(int(h))
            tokens.extend(rng.integers(0, vocab_size, block_tokens).tolist())
        tail = rec.input_length - (len(ids) - 1) * TRACE_BLOCK_TOKENS
        keep = (len(ids) - 1) * block_tokens + max(1, round(tail * block_tokens / TRACE_BLOCK_TOKENS))
        out.append(Request(rec.timestamp_ms, tokens[:keep], ids))
        if len(out) == count:
            break
    return out


def build_tiers(data_dir: Path, *, dram_bytes: int, nvme_bytes: int, console: Console) -> dict[TierKind, Tier]:
    from kvstore.dataplane.dram import DramTier
    from kvstore.dataplane.nvme.config import NvmeTierConfig
    from kvstore.dataplane.nvme.tier import NvmeTier
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


def run_local(*, requests: int, max_blocks: int, new_tokens: int, dram_mib: int, nvme_mib: int,
              data_dir: Path, trace: Path, fresh: bool, policy: str) -> None:
    """One process: serve a slice of a real trace through one node's tiered cache with a real
    transformer, checking that reused prefixes give the same output as full prefill."""
    import torch

    from kvstore.engine.model import ModelSpec, build_reference_model
    from kvstore.engine.reuse import ReuseEngine
    from kvstore.node.cache import TieredCache

    console = Console(width=160)
    torch.set_num_threads(max(1, torch.get_num_threads()))
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


# --- the cluster mode (default) -----------------------------------------------------------------

CLUSTER_BLOCK_TOKENS = 128
"""Tokens per KV block in the cluster run: one trace block (512 tokens) becomes 128 tokens."""


def cluster_model_spec() -> ModelSpec:
    """A Llama-architecture model big enough that prefill dominates a request (so reuse shows in
    TTFT) and small enough that a few dozen requests, twice, fit in ~2 minutes on 2 shared cores
    (6 layers, hidden 512: ~27M parameters)."""
    return ModelSpec(vocab_size=8_000, hidden_size=512, intermediate_size=1_376, num_layers=6,
                     num_attention_heads=8, num_kv_heads=4, head_dim=64, max_positions=8_192)


@dataclass(frozen=True, slots=True)
class PassResult:
    """One pass of the trace slice through the cluster (with or without reuse)."""

    reuse: bool
    results: list[GatewayResult]
    wall_s: float

    def ttft(self) -> list[float]:
        return [r.ttft_s for r in self.results]

    def tpot(self) -> list[float]:
        return [r.decode.get("tpot_s", 0.0) for r in self.results if len(r.tokens) > 1]

    def total(self, phase: str, name: str) -> int:
        return sum(int(getattr(r, phase).get(name, 0)) for r in self.results)


async def replay(gateway: Gateway, reqs: list[Request], *, new_tokens: int, tenant: str,
                 reuse: bool, concurrency: int, on_done: Callable[[], None]) -> PassResult:
    """Send ``reqs`` in trace order with at most ``concurrency`` in flight; results in order."""
    import asyncio

    limit = asyncio.Semaphore(concurrency)

    async def one(i: int, req: Request) -> GatewayResult:
        async with limit:
            result = await gateway.generate(f"{tenant}-{i}", req.token_ids,
                                            max_new_tokens=new_tokens, tenant=tenant,
                                            reuse=reuse)
        on_done()
        return result

    t0 = time.perf_counter()
    tasks = []
    for i, req in enumerate(reqs):
        async with limit:  # admit in order: request i is sent before request i + 1
            pass
        tasks.append(asyncio.ensure_future(one(i, req)))
        await asyncio.sleep(0)
    results = await asyncio.gather(*tasks)
    return PassResult(reuse, list(results), time.perf_counter() - t0)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run_cluster(*, requests: int, max_blocks: int, new_tokens: int, trace: Path,
                work_dir: Path, concurrency: int, threads: int) -> None:
    """Bring up the local cluster, replay the slice without and with reuse, report, stop."""
    import asyncio
    import uuid

    from kvstore.client.store_client import StoreClient
    from kvstore.cluster.local import ClusterSpec, LocalCluster
    from kvstore.engine import gateway as gateway_module
    from kvstore.wire import stats_doc

    console = Console(width=160)
    spec = cluster_model_spec()
    reqs = synthesize_requests(trace, count=requests, max_blocks=max_blocks,
                               block_tokens=CLUSTER_BLOCK_TOKENS, vocab_size=spec.vocab_size)
    cspec = ClusterSpec(work_dir=work_dir, spec=spec, block_tokens=CLUSTER_BLOCK_TOKENS,
                        dram_bytes=16 * MiB, nvme_bytes=128 * MiB, torch_threads=threads)
    run_id = uuid.uuid4().hex[:6]
    console.print(f"bringing up a local cluster in {work_dir}: etcd, conductor, daemons node-a "
                  f"and node-b, prefill-0 on node-a, decode-0 on node-b ...")
    passes: dict[bool, PassResult] = {}
    with LocalCluster(cspec) as cluster:
        console.print(f"cluster up in {cluster.startup_s:.1f} s (etcd {cluster.etcd_endpoint}; "
                      f"logs in {cluster.logs_dir})")

        async def drive(progress: Progress) -> None:
            async with gateway_module.Gateway(etcd_endpoint=cluster.etcd_endpoint, prefix=cspec.prefix,
                               model_name=cspec.model_name) as gateway:
                for reuse in (False, True):
                    label = "with reuse" if reuse else "without reuse (reference)"
                    task = progress.add_task(label, total=len(reqs))

                    def advance(task: TaskID = task) -> None:
                        progress.advance(task)

                    passes[reuse] = await replay(
                        gateway, reqs, new_tokens=new_tokens,
                        tenant=f"{'reuse' if reuse else 'plain'}-{run_id}", reuse=reuse,
                        concurrency=concurrency, on_done=advance)

        with Progress(console=console) as progress:
            asyncio.run(drive(progress))
        nodes = []
        for address in cluster.daemon_addresses.values():
            with StoreClient.connect(address) as store:
                nodes.append(stats_doc(store.stats(), address))

    plain, reused = passes[False], passes[True]
    same = sum(a.tokens == b.tokens for a, b in zip(plain.results, reused.results, strict=True))
    layout_chunk = spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4 \
        * CLUSTER_BLOCK_TOKENS
    console.print(f"model: Llama-architecture, random weights (seed {spec.seed}), "
                  f"{spec.num_layers} layers, hidden {spec.hidden_size}; block = "
                  f"{CLUSTER_BLOCK_TOKENS} tokens = {layout_chunk / 1024:.0f} KiB of KV; "
                  f"{len(reqs)} requests from {trace.name} (<= {max_blocks} trace blocks), "
                  f"{new_tokens} tokens each, {concurrency} in flight")
    table = Table(title="Disaggregated prefill/decode through kvtier")
    for col in ("mode", "TTFT mean ms", "p50", "p99", "TPOT mean ms", "p99",
                "prompt tokens", "prefill computed", "hit ratio", "KV loaded by prefill MiB",
                "KV saved MiB", "KV to decode MiB", "wall s"):
        table.add_column(col, justify="right")
    for p in (plain, reused):
        prompt = p.total("prefill", "computed_tokens") + p.total("prefill", "reused_tokens")
        computed = p.total("prefill", "computed_tokens")
        ttft, tpot = p.ttft(), p.tpot()
        table.add_row("reuse" if p.reuse else "no reuse",
                      f"{np.mean(ttft) * 1e3:.0f}", f"{_pct(ttft, 50) * 1e3:.0f}",
                      f"{_pct(ttft, 99) * 1e3:.0f}",
                      f"{np.mean(tpot) * 1e3:.1f}" if tpot else "-",
                      f"{_pct(tpot, 99) * 1e3:.1f}" if tpot else "-",
                      str(prompt), str(computed), f"{1 - computed / max(1, prompt):.1%}",
                      f"{p.total('prefill', 'loaded_bytes') / MiB:.1f}",
                      f"{p.total('prefill', 'stored_bytes') / MiB:.1f}",
                      f"{p.total('decode', 'loaded_bytes') / MiB:.1f}", f"{p.wall_s:.1f}")
    console.print(table)

    tiers = Table(title="Bytes moved per tier (daemon counters, both passes)")
    for col in ("node", "tier", "chunks", "used MiB", "puts", "hits", "MiB written",
                "MiB read", "demotions", "promotions", "evictions"):
        tiers.add_column(col, justify="right")
    for node in nodes:
        for t in node["tiers"]:
            tiers.add_row(node["node_id"], t["tier"], str(t["chunks"]),
                          f"{t['used_bytes'] / MiB:.1f}", str(t["puts"]), str(t["hits"]),
                          f"{t['bytes_written'] / MiB:.1f}", f"{t['bytes_read'] / MiB:.1f}",
                          str(t["demotions"]), str(t["promotions"]), str(t["evictions"]))
    console.print(tiers)
    speedup = float(np.mean(plain.ttft())) / max(1e-9, float(np.mean(reused.ttft())))
    console.print(f"mean TTFT {np.mean(plain.ttft()) * 1e3:.0f} ms without reuse, "
                  f"{np.mean(reused.ttft()) * 1e3:.0f} ms with reuse ({speedup:.2f}x); "
                  f"outputs identical in {same}/{len(reqs)} requests; cluster stopped")
    if same != len(reqs):
        raise typer.Exit(code=1)

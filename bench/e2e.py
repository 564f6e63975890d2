"""``kvtier bench e2e``: colocated serving against disaggregated prefill/decode with and without
kvtier reuse, end to end, on the same arrival trace, model and tokens.

Four modes serve the same requests at the same arrival times:

* **(a) colocated, continuous batching** and **(b) colocated, chunked prefill**
  (``kvstore.engine.colocated``): one model instance in this process (``--colocated-threads``
  torch threads, default 2: the two cores the two disaggregated workers use), no kvtier. (a)
  prefills each arriving prompt whole, one per iteration, between batched decode steps; (b)
  gives each iteration ``--token-budget`` tokens (running decodes plus prefill chunks).
* **(c) disaggregated, no reuse**: one local cluster (``kvstore.cluster.local.LocalCluster``: etcd,
  conductor, two daemons, a prefill and a decode worker, the small model of ``kvtier run``);
  the prefill worker computes every prompt token; full blocks still go to the decode worker
  through kvtier (that is the handoff);
* **(d) disaggregated, kvtier reuse**: the prefill worker loads the cached prefix first.

Each pair runs twice, in the order a b b a (before the cluster starts, so nothing else of this
benchmark runs beside it) and c d d c (the load of a shared machine drifts; the order cancels a
linear drift), and every disaggregated pass has its own tenant, so each starts from an empty
cache; figures per mode are over both passes (byte totals too). Requests are sent open-loop at
their arrival times (a request does not wait for the previous one), so TTFT includes queueing.
Two workloads:

* ``trace``: the first N requests of the Mooncake conversation trace (<= ``max_blocks``
  blocks), prompts synthesized so equal block ids are equal token blocks (as ``kvtier run``);
  arrivals keep the trace's order and relative spacing, compressed to ``rate`` requests/s.
  Its reuse is whatever the trace has in that window (about 30%).
* ``sessions``: multi-turn chats: S sessions share a 2-block system prompt; turn t of a session
  is its previous prompt, a 16-token answer and a new user message (40-100 tokens); turns of
  different sessions interleave at ``rate`` requests/s. Reuse is high by construction.

Queue wait is arrival to the start of the request's prefill compute in every mode (in (c)/(d)
it is TTFT minus the Schedule RPC and the prefill worker's load, compute and save).
TPOT in (c)/(d) is given twice: the decode worker's own (its decode steps only) and at the
gateway (first token to last: the handoff, the decode worker's KV load and any wait for its
compute thread included), which is what (a)/(b)'s TPOT measures too. Before the decode worker
batched, a request that arrived while another was decoding waited for it, and only the gateway
figure showed that wait.
Prints a table per workload and writes JSON (``--json``) with, per workload and mode: TTFT and
TPOT p50/p99/mean, prefill tokens computed, KV bytes moved (loaded by prefill, saved, loaded by
decode), transfer time (prefill load wait, decode load), queue wait, and per workload
``outputs_identical`` (greedy tokens equal across all four modes and both passes of each) and
``ttft_speedup_reuse_vs_no_reuse`` (mean TTFT (c) / (d)).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from bench._meta import run_header
from kvstore.cluster.serving import (
    CLUSTER_BLOCK_TOKENS,
    cluster_model_spec,
    default_trace,
    synthesize_requests,
)
from kvstore.engine.colocated import (
    ColocatedConfig,
    ColocatedEngine,
    ColocatedRequest,
    ColocatedResult,
    ForwardStats,
    SchedulerMode,
)
from kvstore.engine.gateway import Gateway, GatewayResult

MiB = 1 << 20
COLOCATED_MODES = ("a_colocated_continuous", "b_colocated_chunked")
MODES = ("c_disagg_no_reuse", "d_disagg_reuse")
ALL_MODES = (*COLOCATED_MODES, *MODES)


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    token_ids: list[int]


def trace_workload(count: int, max_blocks: int, rate: float, vocab_size: int) -> list[Arrival]:
    reqs = synthesize_requests(default_trace(), count=count, max_blocks=max_blocks,
                               block_tokens=CLUSTER_BLOCK_TOKENS, vocab_size=vocab_size)
    stamps = np.array([r.timestamp_ms for r in reqs], dtype=float) / 1e3
    stamps -= stamps[0]
    span = stamps[-1] if len(stamps) > 1 and stamps[-1] > 0 else 1.0
    target = (len(reqs) - 1) / rate  # compress (or stretch) to the asked mean rate
    return [Arrival(float(t) * target / span, r.token_ids) for t, r in zip(stamps, reqs,
                                                                              strict=True)]


def sessions_workload(sessions: int, turns: int, rate: float, vocab_size: int,
                      seed: int = 0) -> list[Arrival]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, 2 * CLUSTER_BLOCK_TOKENS).tolist()
    history = [list(system) for _ in range(sessions)]
    out: list[Arrival] = []
    for turn in range(turns):
        for s in range(sessions):
            if turn:
                history[s] += rng.integers(0, vocab_size, 16).tolist()  # the previous answer
            history[s] += rng.integers(0, vocab_size, int(rng.integers(40, 101))).tolist()
            out.append(Arrival(len(out) / rate, list(history[s])))
    return out


async def replay_arrivals(gateway: Gateway, arrivals: list[Arrival], *, tenant: str,
                          reuse: bool, new_tokens: int, advance: Any) -> tuple[
                              list[GatewayResult], float]:
    t0 = time.perf_counter()

    async def one(i: int, arrival: Arrival) -> GatewayResult:
        delay = t0 + arrival.at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result = await gateway.generate(f"{tenant}-{i}", arrival.token_ids,
                                        max_new_tokens=new_tokens, tenant=tenant, reuse=reuse)
        advance()
        return result

    results = await asyncio.gather(*(one(i, a) for i, a in enumerate(arrivals)))
    return list(results), time.perf_counter() - t0


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": float(np.mean(values)), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99))}


def summarize(results: list[GatewayResult], wall_s: float) -> dict[str, Any]:
    def total(phase: str, name: str) -> float:
        return float(sum(getattr(r, phase).get(name, 0) for r in results))

    queue = [r.ttft_s - r.schedule_s - sum(r.prefill.get(k, 0.0)
                                           for k in ("load_s", "compute_s", "save_s"))
             for r in results]
    prompt = total("prefill", "computed_tokens") + total("prefill", "reused_tokens")
    return {
        "requests": len(results), "wall_s": wall_s,
        "ttft_s": _stats([r.ttft_s for r in results]),
        "tpot_s": _stats([r.decode.get("tpot_s", 0.0) for r in results if len(r.tokens) > 1]),
        # First token to last at the gateway, per output token: includes the handoff, the
        # decode worker's KV load and any wait for its compute thread (the worker's own
        # tpot_s counts only its decode steps).
        "tpot_gateway_s": _stats([r.tpot_s for r in results if len(r.tokens) > 1]),
        "e2e_s": _stats([r.e2e_s for r in results]),
        "prompt_tokens": int(prompt),
        "prefill_computed_tokens": int(total("prefill", "computed_tokens")),
        "hit_ratio": total("prefill", "reused_tokens") / prompt if prompt else 0.0,
        "kv_bytes_loaded_by_prefill": int(total("prefill", "loaded_bytes")),
        "kv_bytes_saved_by_prefill": int(total("prefill", "stored_bytes")),
        "kv_bytes_loaded_by_decode": int(total("decode", "loaded_bytes")),
        "transfer_s": {"prefill_load_wait": total("prefill", "load_s"),
                       "decode_load": total("decode", "load_s")},
        "queue_wait_s": _stats(queue),
        "prefill_compute_s": _stats([r.prefill.get("compute_s", 0.0) for r in results]),
        "prefill_load_wait_s": _stats([r.prefill.get("load_s", 0.0) for r in results]),
        "schedule_s": _stats([r.schedule_s for r in results]),
        "decode_batch_mean": _decode_batch_mean(results),
    }


def _decode_batch_mean(results: list[GatewayResult]) -> float:
    """The decode worker's batch size, averaged over decode steps (1.0 from a worker that
    does not report it: one request at a time); 0 when no request took a step."""
    steps = [len(r.tokens) - 1 for r in results]
    total = sum(steps)
    if not total:
        return 0.0
    return sum(float(r.decode.get("batch_mean", 1.0)) * n
               for r, n in zip(results, steps, strict=True)) / total


def summarize_colocated(results: list[ColocatedResult], wall_s: float) -> dict[str, Any]:
    """The keys of :func:`summarize` for a colocated pass (no kvtier: nothing reused or moved)."""
    prompt = sum(r.computed_tokens for r in results)
    return {
        "requests": len(results), "wall_s": wall_s,
        "ttft_s": _stats([r.ttft_s for r in results]),
        "tpot_s": _stats([r.tpot_s for r in results if len(r.tokens) > 1]),
        "tpot_gateway_s": _stats([r.tpot_s for r in results if len(r.tokens) > 1]),
        "e2e_s": _stats([r.finish_s - r.arrival_s for r in results]),
        "prompt_tokens": prompt, "prefill_computed_tokens": prompt, "hit_ratio": 0.0,
        "kv_bytes_loaded_by_prefill": 0, "kv_bytes_saved_by_prefill": 0,
        "kv_bytes_loaded_by_decode": 0,
        "transfer_s": {"prefill_load_wait": 0.0, "decode_load": 0.0},
        "queue_wait_s": _stats([r.queue_wait_s for r in results]),
        "prefill_compute_s": _stats([r.prefill_compute_s for r in results]),
        "prefill_load_wait_s": _stats([]),
        "schedule_s": _stats([]),
        "prefill_chunks": _stats([float(r.prefill_chunks) for r in results]),
    }


def run_colocated(model: Any, arrivals: list[Arrival], *, config: ColocatedConfig,
                  new_tokens: int, advance: Any) -> tuple[list[ColocatedResult], float,
                                                          dict[int, int], ForwardStats]:
    """One open-loop pass of ``arrivals`` through a colocated engine; results, wall seconds,
    decode steps per batch size and where the forward time went."""
    engine = ColocatedEngine(model, config)
    requests = [ColocatedRequest(str(i), a.token_ids, a.at_s, new_tokens)
                for i, a in enumerate(arrivals)]
    t0 = time.perf_counter()
    results = engine.serve(requests, on_done=lambda _r: advance())
    return (results, time.perf_counter() - t0, dict(engine.decode_batch_sizes),
            engine.forward_stats)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The benchmark's flags (``kvtier bench e2e`` passes its own through)."""
    parser = argparse.ArgumentParser(prog="kvtier bench e2e")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--rate", type=float, default=3.0, help="mean arrivals per second")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=256,
                        help="tokens per iteration of (b) chunked prefill")
    parser.add_argument("--colocated-threads", type=int, default=2,
                        help="torch threads of the colocated engine (a)/(b)")
    parser.add_argument("--no-colocated", action="store_true",
                        help="run only (c)/(d) (outputs_identical then compares those two)")
    args = parser.parse_args(argv)
    if args.new_tokens < 1 or args.token_budget < 2 or args.colocated_threads < 1:
        parser.error("--new-tokens and --colocated-threads must be >= 1, --token-budget >= 2")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from kvstore.cluster.local import ClusterSpec, LocalCluster
    from kvstore.engine.model import build_reference_model

    console = Console(width=160)
    spec = cluster_model_spec()
    workloads = {
        "trace": trace_workload(16 if args.quick else 48, 8, args.rate, spec.vocab_size),
        "sessions": sessions_workload(4 if args.quick else 6, 4 if args.quick else 6, args.rate,
                                      spec.vocab_size),
    }
    doc: dict[str, Any] = run_header("e2e", dists=("numpy", "torch", "transformers"))
    doc.update({"model": {"num_layers": spec.num_layers, "hidden_size": spec.hidden_size,
                          "vocab_size": spec.vocab_size, "seed": spec.seed},
                "block_tokens": CLUSTER_BLOCK_TOKENS, "rate_per_s": args.rate,
                "new_tokens": args.new_tokens, "token_budget_b": args.token_budget,
                "colocated_torch_threads": args.colocated_threads, "workloads": {}})
    run_id = uuid.uuid4().hex[:6]
    colocated = {
        COLOCATED_MODES[0]: ColocatedConfig(SchedulerMode.CONTINUOUS_BATCHING),
        COLOCATED_MODES[1]: ColocatedConfig(SchedulerMode.CHUNKED_PREFILL,
                                            token_budget=args.token_budget,
                                            max_batch=min(64, args.token_budget - 1)),
    }
    # (a) and (b) first, in this process, before the cluster's processes exist.
    colocated_modes = () if args.no_colocated else COLOCATED_MODES
    doc["colocated_modes"] = list(colocated_modes)
    coloc: dict[str, dict[str, Any]] = {name: {} for name in workloads}
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.colocated_threads)
    try:
        model = build_reference_model(spec) if colocated_modes else None
        with Progress(console=console, transient=True) as progress:
            for name, arrivals in workloads.items():
                if not colocated_modes:
                    break
                # Untimed warm-up: every request at once through both schedulers. On this VM
                # the first touch of fresh memory is erratic (FIELD-NOTES); without it the first
                # passes' forwards took up to 1 s where warm ones take 20-40 ms.
                burst = [Arrival(0.0, a.token_ids) for a in arrivals]
                for mode in colocated_modes:
                    run_colocated(model, burst, config=colocated[mode],
                                  new_tokens=args.new_tokens, advance=lambda: None)
                got: dict[str, Any] = {m: {"results": [], "wall_s": 0.0, "tokens": [],
                                           "batches": {}, "forward": ForwardStats(),
                                           "load_avg_1m": []} for m in colocated_modes}
                for index, mode in enumerate((*colocated_modes, *reversed(colocated_modes))):
                    task = progress.add_task(f"{name} {mode} #{index}", total=len(arrivals))
                    # A 2-thread torch process slows down far more than its share when another
                    # process takes a core (docs/engines.md): record the load each pass met.
                    load_1m = os.getloadavg()[0]
                    results, wall, batches, fwd = run_colocated(
                        model, arrivals, config=colocated[mode], new_tokens=args.new_tokens,
                        advance=lambda t=task: progress.advance(t))
                    entry = got[mode]
                    entry["load_avg_1m"].append(load_1m)
                    total = entry["forward"]
                    for key in ("prefill_tokens", "prefill_s", "decode_steps", "decode_s",
                                "pad_s"):
                        setattr(total, key, getattr(total, key) + getattr(fwd, key))
                    entry["results"] += results
                    entry["wall_s"] += wall
                    entry["tokens"].append([r.tokens for r in results])
                    for size, steps in batches.items():
                        entry["batches"][size] = entry["batches"].get(size, 0) + steps
                coloc[name] = got
    finally:
        torch.set_num_threads(threads_before)
    with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as tmp, \
            LocalCluster(ClusterSpec(work_dir=Path(tmp), spec=spec,
                                     block_tokens=CLUSTER_BLOCK_TOKENS, dram_bytes=32 * MiB,
                                     nvme_bytes=128 * MiB)) as cluster:
        console.print(f"cluster up in {cluster.startup_s:.1f} s")

        async def drive(progress: Progress) -> None:
            async with Gateway(etcd_endpoint=cluster.etcd_endpoint, prefix=cluster.spec.prefix,
                               model_name=cluster.spec.model_name) as gateway:
                for name, arrivals in workloads.items():
                    results: dict[str, list[GatewayResult]] = {MODES[0]: [], MODES[1]: []}
                    walls: dict[str, float] = {MODES[0]: 0.0, MODES[1]: 0.0}
                    tokens: dict[str, list[list[int]]] = {}
                    # c d d c: the load of this shared machine drifts; the order cancels a
                    # linear drift. Every pass has its own tenant, so each starts cold.
                    for index, mode in enumerate((*MODES, *reversed(MODES))):
                        task = progress.add_task(f"{name} {mode} #{index}", total=len(arrivals))
                        got, wall = await replay_arrivals(
                            gateway, arrivals, tenant=f"{name}-{index}-{run_id}",
                            reuse=mode == MODES[1], new_tokens=args.new_tokens,
                            advance=lambda t=task: progress.advance(t))
                        results[mode] += got
                        walls[mode] += wall
                        seen = [r.tokens for r in got]
                        if tokens.setdefault(mode, seen) != seen:
                            tokens[mode + "-differs"] = seen
                    modes = {m: summarize_colocated(coloc[name][m]["results"],
                                                    coloc[name][m]["wall_s"])
                             for m in colocated_modes}
                    for m in colocated_modes:
                        sizes = coloc[name][m]["batches"]
                        steps = sum(sizes.values())
                        modes[m]["decode_steps"] = steps
                        modes[m]["decode_batch_mean"] = (
                            sum(k * v for k, v in sizes.items()) / steps if steps else 0.0)
                        fwd = coloc[name][m]["forward"]
                        modes[m]["forward"] = {
                            "prefill_ms_per_token": fwd.prefill_ms_per_token,
                            "decode_ms_per_step": fwd.decode_ms_per_step,
                            "pad_s": fwd.pad_s, "prefill_s": fwd.prefill_s,
                            "decode_s": fwd.decode_s}
                        modes[m]["load_avg_1m_at_pass_start"] = coloc[name][m]["load_avg_1m"]
                    modes.update({m: summarize(results[m], walls[m]) for m in MODES})
                    c, d = (results[m] for m in MODES)
                    passes = [p for m in colocated_modes for p in coloc[name][m]["tokens"]]
                    same_cd = tokens[MODES[0]] == tokens[MODES[1]] and len(tokens) == 2
                    doc["workloads"][name] = {
                        "requests": len(arrivals), "passes_per_mode": 2, "modes": modes,
                        "outputs_identical": same_cd and all(p == tokens[MODES[0]]
                                                             for p in passes),
                        "outputs_identical_c_d": same_cd,
                        "ttft_speedup_reuse_vs_no_reuse":
                            modes[MODES[0]]["ttft_s"]["mean"]
                            / max(1e-9, modes[MODES[1]]["ttft_s"]["mean"]),
                        "ttft_speedup_median_per_request": float(np.median(
                            [a.ttft_s / max(1e-9, b.ttft_s) for a, b in zip(c, d, strict=True)])),
                    }

        with Progress(console=console, transient=True) as progress:
            asyncio.run(drive(progress))
    doc["outputs_identical"] = all(w["outputs_identical"] for w in doc["workloads"].values())
    doc["ttft_speedup_reuse_vs_no_reuse"] = {
        name: w["ttft_speedup_reuse_vs_no_reuse"] for name, w in doc["workloads"].items()}
    print_tables(console, doc)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        console.print(f"wrote {args.json}")
    return doc


def print_tables(console: Console, doc: dict[str, Any]) -> None:
    for name, w in doc["workloads"].items():
        table = Table(title=f"e2e, workload {name}: {w['requests']} requests at "
                            f"{doc['rate_per_s']}/s, 2 passes per mode (a b b a, c d d c); "
                            f"mean TTFT "
                            f"{w['ttft_speedup_reuse_vs_no_reuse']:.2f}x lower with reuse "
                            f"(median per request {w['ttft_speedup_median_per_request']:.2f}x); "
                            f"outputs identical: {w['outputs_identical']}")
        for col in ("mode", "TTFT mean/p50/p99 ms", "prefill compute mean ms",
                    "TPOT p50/p99 ms", "TPOT at gateway p50/p99 ms", "e2e p50/p99 ms",
                    "hit ratio",
                    "prefill computed", "KV MiB prefill load / save / decode load",
                    "transfer s (prefill wait, decode load)", "queue wait mean/p99 ms",
                    "decode batch mean", "fwd: prefill ms/token, decode ms/step"):
            table.add_column(col, justify="right")
        for mode, m in w["modes"].items():
            t, p, q = m["ttft_s"], m["tpot_s"], m["queue_wait_s"]
            g, e = m["tpot_gateway_s"], m["e2e_s"]
            table.add_row(
                mode, f"{t['mean'] * 1e3:.0f} / {t['p50'] * 1e3:.0f} / {t['p99'] * 1e3:.0f}",
                f"{m['prefill_compute_s']['mean'] * 1e3:.0f}",
                f"{p['p50'] * 1e3:.1f} / {p['p99'] * 1e3:.1f}",
                f"{g['p50'] * 1e3:.1f} / {g['p99'] * 1e3:.1f}",
                f"{e['p50'] * 1e3:.0f} / {e['p99'] * 1e3:.0f}", f"{m['hit_ratio']:.1%}",
                f"{m['prefill_computed_tokens']} / {m['prompt_tokens']}",
                f"{m['kv_bytes_loaded_by_prefill'] / MiB:.1f} / "
                f"{m['kv_bytes_saved_by_prefill'] / MiB:.1f} / "
                f"{m['kv_bytes_loaded_by_decode'] / MiB:.1f}",
                f"{m['transfer_s']['prefill_load_wait']:.2f}, "
                f"{m['transfer_s']['decode_load']:.2f}",
                f"{q['mean'] * 1e3:.0f} / {q['p99'] * 1e3:.0f}",
                f"{m['decode_batch_mean']:.2f}" if "decode_batch_mean" in m else "-",
                (f"{m['forward']['prefill_ms_per_token']:.2f}, "
                 f"{m['forward']['decode_ms_per_step']:.1f}") if "forward" in m else "-")
        console.print(table)
    console.print(f"git {doc['git_sha']}, {doc['machine']['cpus']} CPUs, load avg "
                  f"{doc['machine']['load_avg_1m']:.1f}; (a)/(b) on "
                  f"{doc['colocated_torch_threads']} torch threads in one process, (b) budget "
                  f"{doc['token_budget_b']} tokens/iteration; (c)/(d) two workers of 1 thread")


if __name__ == "__main__":
    main()

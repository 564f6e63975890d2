"""``kvtier plan kv|simulate|search``: size KV caches and decide between colocation and disaggregation.

Only typer is imported at module load; numpy, matplotlib and the planner load inside each command, so
``kvtier --help`` stays fast.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvstore.errors import KvtierError

if TYPE_CHECKING:
    from conductor.perf.hardware import GpuSpec
    from conductor.perf.latency import LatencyProvider
    from conductor.perf.models import DType, ModelSpec
    from planner.sim import ClusterSpec

app = typer.Typer(
    help="Plan a deployment: KV sizes, a cluster simulation, a search for the best layout.",
    no_args_is_help=True,
)


class Mode(enum.StrEnum):
    COLOCATED = "colocated"
    CHUNKED = "chunked"
    DISAGG = "disagg"
    DISAGG_REUSE = "disagg-reuse"


MODEL_HELP = "Preset (llama-3-8b, llama-3-70b, mistral-7b, qwen2.5-72b, deepseek-v3, opt-13b, ...)"
CONFIG_HELP = "A Hugging Face config.json (overrides --model's shapes)"
LATENCY_HELP = (
    "auto, distserve, distserve-vllm, splitwise, roofline, or a kvtier.latency-profile/1 .json"
)
DATA_HELP = (
    "Data directory with traces/ and profiles/ (default: $KVTIER_DATA_DIR or ../shared/data)"
)
TRACE_HELP = "mooncake, azure-code, azure-conv, short, long, mixed, sharegpt, or a .jsonl/.csv path"


def _fail(exc: KvtierError) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(code=2)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def _emit(doc: dict[str, Any]) -> None:
    typer.echo(json.dumps(_jsonable(doc), indent=2))


def _model(name: str, config: Path | None, params_b: float | None) -> ModelSpec:
    from conductor.perf.models import load_model

    return load_model(name, config, params=params_b * 1e9 if params_b is not None else None)


def _cluster(
    model: ModelSpec, gpu: GpuSpec, latency: str, data_dir: Path | None, kv: DType, weights: DType
) -> ClusterSpec:
    from conductor.perf.latency import build_latency_provider
    from planner.sim import ClusterSpec

    provider: LatencyProvider = build_latency_provider(
        latency, model, gpu, data=data_dir, weight_dtype=weights, kv_dtype=kv
    )
    return ClusterSpec(model, gpu, provider, kv_dtype=kv, weight_dtype=weights)


@app.command("kv")
def kv_command(
    model: str = typer.Option("llama-3-70b", help=MODEL_HELP),
    config: Path | None = typer.Option(None, help=CONFIG_HELP),
    params_b: float | None = typer.Option(None, help="Override the parameter count, in billions"),
    tokens: int = typer.Option(8192, help="Prompt length in tokens"),
    dtype: str = typer.Option("fp16", help="KV element type: fp16, bf16, fp8"),
    weight_dtype: str = typer.Option("fp16", help="Weight element type (for the prefill estimate)"),
    link: list[str] = typer.Option([], help="Interconnect preset(s); default: all presets"),
    bandwidth_gbs: float | None = typer.Option(None, help="Add a custom link of this many GB/s"),
    nics: int = typer.Option(1, help="Parallel links (one NIC per GPU, KV sharded across them)"),
    gpu: str = typer.Option("h100", help="GPU for the prefill time: a100, h100, h200"),
    tp: int | None = typer.Option(
        None, help="Tensor parallelism of the prefill (default: smallest that fits)"
    ),
    latency: str = typer.Option("auto", help=LATENCY_HELP),
    data_dir: Path | None = typer.Option(None, help=DATA_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON"),
) -> None:
    """KV bytes per token and per prompt, transfer time per interconnect, and whether pipelining hides it."""
    from conductor.perf.hardware import LINKS, gpu_by_name, link_by_name
    from conductor.perf.latency import build_latency_provider
    from conductor.perf.models import DType
    from planner.kv import min_tp_that_fits, plan_kv

    try:
        spec = _model(model, config, params_b)
        kv_dtype, w_dtype = DType.parse(dtype), DType.parse(weight_dtype)
        gpu_spec = gpu_by_name(gpu)
        links = [link_by_name(name) for name in link] if link else list(LINKS.values())
        if bandwidth_gbs is not None:
            links.append(link_by_name("custom", bandwidth_gbs))
        provider = build_latency_provider(
            latency, spec, gpu_spec, data=data_dir, weight_dtype=w_dtype, kv_dtype=kv_dtype
        )
        degree = tp or min_tp_that_fits(spec, gpu_spec, w_dtype, provider.tp_degrees)
        plan = plan_kv(
            spec,
            kv_dtype,
            tokens,
            links,
            gpu=gpu_spec,
            tp=degree,
            latency=provider.for_tp(degree),
            nics=nics,
        )
    except KvtierError as exc:
        raise _fail(exc) from exc
    if as_json:
        _emit(plan.to_json())
        return
    typer.echo(
        f"{plan.model} ({plan.dtype}): {plan.bytes_per_token:,} bytes per token "
        f"({plan.layers} layers)"
    )
    typer.echo(
        f"{plan.tokens:,} tokens: {plan.total_bytes:,} bytes = {plan.total_gb:.2f} GB = "
        f"{plan.total_gib:.2f} GiB"
    )
    typer.echo(
        f"prefill on {plan.gpu} tp{plan.tp}: {plan.prefill_s * 1e3:.0f} ms ({plan.prefill_source})"
    )
    typer.echo(
        f"{'link':<22}{'GB/s':>8}{'transfer':>12}{'exposed*':>12}  hidden by layer pipelining"
    )
    for t in plan.transfers:
        typer.echo(
            f"{t.link:<22}{t.bandwidth_bytes_per_s / 1e9:>8.1f}{t.transfer_s * 1e3:>10.1f}ms"
            f"{t.exposed_s_pipelined * 1e3:>10.1f}ms  {'yes' if t.hidden_by_layer_pipelining else 'no'}"
        )
    typer.echo("* transfer left after the prefill ends when layers are sent as they are computed")


def _deployment(
    mode: Mode,
    *,
    instances: int,
    tp: int,
    pp: int,
    np_: int,
    tp_p: int,
    pp_p: int,
    nd: int,
    tp_d: int,
    pp_d: int,
    chunk_tokens: int,
    prefill_budget: int,
    max_batch: int,
    link: str,
    bandwidth_gbs: float | None,
    layerwise: bool,
    cache_tokens: int | None,
    cache_bandwidth_gbs: float | None,
) -> Any:
    from conductor.perf.hardware import link_by_name
    from planner.sim import Architecture, Deployment, InstanceGroup, PrefixCacheSpec

    the_link = link_by_name(link, bandwidth_gbs)
    cache = None
    if mode is Mode.DISAGG_REUSE and cache_tokens is None:
        cache_tokens = 3_000_000
    if cache_tokens:
        cache = PrefixCacheSpec(
            cache_tokens,
            bandwidth_bytes_per_s=cache_bandwidth_gbs * 1e9 if cache_bandwidth_gbs else None,
        )
    common: dict[str, Any] = {
        "chunk_tokens": chunk_tokens,
        "prefill_token_budget": prefill_budget,
        "max_batch_requests": max_batch,
        "link": the_link,
        "layerwise_transfer": layerwise,
        "prefix_cache": cache,
    }
    if mode in (Mode.DISAGG, Mode.DISAGG_REUSE):
        return Deployment(
            Architecture.DISAGGREGATED,
            prefill=InstanceGroup(np_, tp_p, pp_p),
            decode=InstanceGroup(nd, tp_d, pp_d),
            **common,
        )
    arch = Architecture.CHUNKED if mode is Mode.CHUNKED else Architecture.COLOCATED
    return Deployment(arch, colocated=InstanceGroup(instances, tp, pp), **common)


@app.command("simulate")
def simulate_command(
    model: str = typer.Option("opt-13b", help=MODEL_HELP),
    config: Path | None = typer.Option(None, help=CONFIG_HELP),
    params_b: float | None = typer.Option(None, help="Override the parameter count, in billions"),
    gpu: str = typer.Option("a100", help="a100, h100, h200"),
    latency: str = typer.Option("auto", help=LATENCY_HELP),
    dtype: str = typer.Option("fp16", help="KV element type"),
    weight_dtype: str = typer.Option("fp16", help="Weight element type"),
    trace: str = typer.Option("sharegpt", help=TRACE_HELP),
    requests: int | None = typer.Option(
        None, help="Keep the first N requests (synthetic: generate N; 1000)"
    ),
    rate: float | None = typer.Option(
        None, help="Replay at this many requests/s (default: the trace's own)"
    ),
    seed: int = typer.Option(0, help="Seed of synthetic traces"),
    mode: Mode = typer.Option(Mode.COLOCATED, help="Architecture"),
    instances: int = typer.Option(1, help="Colocated instances"),
    tp: int = typer.Option(1, help="Colocated tensor parallelism"),
    pp: int = typer.Option(1, help="Colocated pipeline parallelism"),
    np_: int = typer.Option(1, "--np", help="Prefill instances"),
    tp_p: int = typer.Option(1, help="Prefill tensor parallelism"),
    pp_p: int = typer.Option(1, help="Prefill pipeline parallelism"),
    nd: int = typer.Option(1, help="Decode instances"),
    tp_d: int = typer.Option(1, help="Decode tensor parallelism"),
    pp_d: int = typer.Option(1, help="Decode pipeline parallelism"),
    chunk_tokens: int = typer.Option(
        512, help="Chunked prefill: tokens per iteration, decodes included"
    ),
    prefill_budget: int = typer.Option(4096, help="Max prompt tokens in one prefill batch"),
    max_batch: int = typer.Option(256, help="Max running requests per instance lane"),
    link: str = typer.Option("roce-400g", help="Prefill-to-decode interconnect preset"),
    bandwidth_gbs: float | None = typer.Option(
        None, help="Custom interconnect bandwidth, GB/s per GPU"
    ),
    layerwise: bool = typer.Option(
        True, help="Overlap KV transfers and cache loads with prefill, layer by layer"
    ),
    cache_tokens: int | None = typer.Option(
        None, help="Prefix-cache capacity in tokens (disagg-reuse: 3M)"
    ),
    cache_bandwidth_gbs: float | None = typer.Option(
        None, help="Cache-to-GPU GB/s per GPU (default: the link)"
    ),
    ttft_slo: float = typer.Option(0.25, help="TTFT objective, seconds"),
    tpot_slo: float = typer.Option(0.1, help="TPOT objective, seconds"),
    goodput: bool = typer.Option(
        False, help="Also search the goodput (highest rate meeting the SLOs for 90%)"
    ),
    out: Path | None = typer.Option(None, help="Directory for PNG plots and result.json"),
    data_dir: Path | None = typer.Option(None, help=DATA_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON"),
) -> None:
    """Replay a trace on one deployment: TTFT/TPOT percentiles, SLO attainment, bytes, memory, energy."""
    from conductor.perf.hardware import gpu_by_name
    from conductor.perf.models import DType
    from planner.goodput import find_goodput
    from planner.metrics import Slo
    from planner.sim import simulate
    from planner.workload import load_trace

    try:
        spec = _model(model, config, params_b)
        cluster = _cluster(
            spec, gpu_by_name(gpu), latency, data_dir, DType.parse(dtype), DType.parse(weight_dtype)
        )
        deployment = _deployment(
            mode,
            instances=instances,
            tp=tp,
            pp=pp,
            np_=np_,
            tp_p=tp_p,
            pp_p=pp_p,
            nd=nd,
            tp_d=tp_d,
            pp_d=pp_d,
            chunk_tokens=chunk_tokens,
            prefill_budget=prefill_budget,
            max_batch=max_batch,
            link=link,
            bandwidth_gbs=bandwidth_gbs,
            layerwise=layerwise,
            cache_tokens=cache_tokens,
            cache_bandwidth_gbs=cache_bandwidth_gbs,
        )
        workload = load_trace(trace, data=data_dir, count=requests, rate_per_s=rate, seed=seed)
        slo = Slo(ttft_slo, tpot_slo)
        result = simulate(cluster, deployment, workload)
        doc: dict[str, Any] = {
            "model": spec.name,
            "gpu": cluster.gpu.name,
            "latency": cluster.latency.source.value,
            "deployment": deployment.label,
            "workload": workload.describe(),
            "summary": result.summary(slo),
        }
        too_long = int(
            (
                workload.prompt_tokens + workload.output_tokens
                > (spec.max_context_tokens or 1 << 62)
            ).sum()
        )
        if too_long:
            doc["warning"] = (
                f"{too_long} requests exceed {spec.name}'s {spec.max_context_tokens}-token context; "
                "their latency is extrapolated"
            )
        gp = None
        if goodput:
            gp = find_goodput(cluster, deployment, workload, slo)
            doc["goodput"] = {
                "rate_per_s": gp.rate_per_s,
                "per_gpu": gp.per_gpu,
                "limited_by": gp.limited_by,
                "curve": [vars(p) for p in gp.curve],
            }
    except KvtierError as exc:
        raise _fail(exc) from exc
    if out is not None:
        from planner.plots import plot_goodput_curves, plot_latency_cdfs

        out.mkdir(parents=True, exist_ok=True)
        files = [str(plot_latency_cdfs([result], slo, out / "latency_cdf.png"))]
        if gp is not None:
            files.append(str(plot_goodput_curves([gp], slo, out / "goodput.png")))
        (out / "result.json").write_text(json.dumps(_jsonable(doc), indent=2))
        doc["files"] = [*files, str(out / "result.json")]
    if as_json:
        _emit(doc)
        return
    _print_summary(doc)


def _print_summary(doc: dict[str, Any]) -> None:
    s = doc["summary"]
    typer.echo(
        f"{doc['deployment']}  ({doc['model']} on {s['gpus']} x {doc['gpu']}, latency: {doc['latency']})"
    )
    w = doc["workload"]
    typer.echo(
        f"workload {w['name']}: {s['requests']} requests at {s['offered_rate_per_s']:.2f}/s, prompt mean "
        f"{w['prompt_mean']:.0f} / output mean {w['output_mean']:.0f} tokens"
    )
    for key, label in (
        ("ttft_s", "TTFT"),
        ("tpot_s", "TPOT"),
        ("queue_wait_s", "queue wait"),
        ("kv_transfer_s", "KV transfer"),
    ):
        q = s[key]
        typer.echo(
            f"  {label:<12} p50 {q['p50'] * 1e3:9.1f} ms  p90 {q['p90'] * 1e3:9.1f} ms  "
            f"p99 {q['p99'] * 1e3:9.1f} ms"
        )
    slo = s["slo"]
    typer.echo(
        f"  SLO attainment {slo['attainment']:.1%} (TTFT {slo['ttft_attainment']:.1%}, "
        f"TPOT {slo['tpot_attainment']:.1%}) against {slo['ttft_s'] * 1e3:.0f} / {slo['tpot_s'] * 1e3:.0f} ms"
    )
    moved = s["kv_bytes_moved"]
    typer.echo(
        f"  KV moved {moved['total'] / 1e9:.1f} GB (prefill->decode {moved['prefill_to_decode'] / 1e9:.1f}, "
        f"cache->GPU {moved['cache_to_gpu'] / 1e9:.1f}); prefix hit rate {s['prefix_cache']['hit_rate']:.1%}"
    )
    mem = s["gpu_memory"]
    typer.echo(
        f"  duplicated weights {mem['duplicated_weights_bytes'] / 1e9:.0f} GB "
        f"({mem['duplicated_weights_fraction_of_hbm']:.1%} of HBM)"
    )
    typer.echo(
        f"  energy {s['energy']['per_request_j']:.0f} J per request ({s['energy']['model']})"
    )
    if "goodput" in doc:
        g = doc["goodput"]
        typer.echo(
            f"  goodput {g['rate_per_s']:.2f} req/s ({g['per_gpu']:.3f} per GPU), limited by {g['limited_by']}"
        )
    if "warning" in doc:
        typer.echo(f"  warning: {doc['warning']}")
    for path in doc.get("files", []):
        typer.echo(f"  wrote {path}")


@app.command("search")
def search_command(
    model: str = typer.Option("opt-13b", help=MODEL_HELP),
    config: Path | None = typer.Option(None, help=CONFIG_HELP),
    params_b: float | None = typer.Option(None, help="Override the parameter count, in billions"),
    gpu: str = typer.Option("a100", help="a100, h100, h200"),
    latency: str = typer.Option("auto", help=LATENCY_HELP),
    dtype: str = typer.Option("fp16", help="KV element type"),
    weight_dtype: str = typer.Option("fp16", help="Weight element type"),
    gpus: int = typer.Option(8, help="GPU budget"),
    trace: str = typer.Option("sharegpt", help=TRACE_HELP),
    requests: int | None = typer.Option(
        None, help="Requests per simulation (default: max(1000, 300 x GPUs))"
    ),
    seed: int = typer.Option(0, help="Seed of synthetic traces"),
    link: str = typer.Option("roce-400g", help="Prefill-to-decode interconnect preset"),
    bandwidth_gbs: float | None = typer.Option(
        None, help="Custom interconnect bandwidth, GB/s per GPU"
    ),
    chunk: list[int] = typer.Option([512, 2048], help="Chunk sizes to try for chunked prefill"),
    pp: list[int] = typer.Option([1, 2], help="Pipeline degrees to try"),
    ttft_slo: float = typer.Option(0.25, help="TTFT objective, seconds"),
    tpot_slo: float = typer.Option(0.1, help="TPOT objective, seconds"),
    workers: int = typer.Option(2, help="Worker processes"),
    max_configs: int | None = typer.Option(None, help="Try at most this many deployments"),
    top: int = typer.Option(10, help="Show the best N"),
    out: Path | None = typer.Option(None, help="Directory for PNG plots and search.json"),
    data_dir: Path | None = typer.Option(None, help=DATA_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print JSON"),
) -> None:
    """Search Np:Nd and per-phase TP/PP for the best goodput per GPU, and say whether to disaggregate."""
    from conductor.perf.hardware import gpu_by_name, link_by_name
    from conductor.perf.models import DType
    from planner.metrics import Slo
    from planner.search import SearchSpace, search
    from planner.workload import load_trace

    try:
        spec = _model(model, config, params_b)
        cluster = _cluster(
            spec, gpu_by_name(gpu), latency, data_dir, DType.parse(dtype), DType.parse(weight_dtype)
        )
        space = SearchSpace(
            gpus, link_by_name(link, bandwidth_gbs), chunk_tokens=tuple(chunk), pp_degrees=tuple(pp)
        )
        workload = load_trace(
            trace, data=data_dir, count=requests or max(1000, 300 * gpus), seed=seed
        )
        slo = Slo(ttft_slo, tpot_slo)
        candidates, decision = search(
            cluster, space, workload, slo, workers=workers, max_configs=max_configs
        )
    except KvtierError as exc:
        raise _fail(exc) from exc
    doc: dict[str, Any] = {
        "model": spec.name,
        "gpu": cluster.gpu.name,
        "latency": cluster.latency.source.value,
        "gpu_budget": gpus,
        "link": space.link.name,
        "workload": workload.describe(),
        "slo": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
        "configs": len(candidates),
        "verdict": decision.decision.value,
        "reasons": decision.reasons,
        "ratio_disaggregated_to_colocated": decision.ratio,
        "candidates": [
            {
                "deployment": c.deployment.label,
                "architecture": c.deployment.architecture.value,
                "gpus": c.deployment.gpus,
                "goodput_per_s": c.goodput.rate_per_s,
                "per_gpu": c.per_gpu,
                "limited_by": c.goodput.limited_by,
            }
            for c in candidates
        ],
    }
    if out is not None:
        from planner.plots import plot_goodput_curves, plot_search

        out.mkdir(parents=True, exist_ok=True)
        best = [
            c.goodput
            for c in (decision.best_colocated, decision.best_disaggregated)
            if c is not None
        ]
        files = [
            str(plot_search(candidates, out / "search.png")),
            str(plot_goodput_curves(best, slo, out / "goodput_best.png")),
        ]
        (out / "search.json").write_text(json.dumps(_jsonable(doc), indent=2))
        doc["files"] = [*files, str(out / "search.json")]
    if as_json:
        _emit(doc)
        return
    typer.echo(
        f"{len(candidates)} deployments of {spec.name} on up to {gpus} x {cluster.gpu.name}, "
        f"workload {workload.name} ({len(workload)} requests), SLO {ttft_slo * 1e3:.0f} / "
        f"{tpot_slo * 1e3:.0f} ms"
    )
    for c in candidates[:top]:
        typer.echo(
            f"  {c.per_gpu:8.3f} req/s/GPU  {c.goodput.rate_per_s:8.2f} req/s  "
            f"limited by {c.goodput.limited_by:<5} {c.deployment.label}"
        )
    typer.echo(f"verdict: {decision.decision.value.upper()}")
    for reason in decision.reasons:
        typer.echo(f"  - {reason}")
    for path in doc.get("files", []):
        typer.echo(f"  wrote {path}")


@app.command("profile-engine")
def profile_engine_command(
    out: Path = typer.Option(..., "--out", help="Where to write the kvtier.latency-profile/1 JSON."),
    quick: bool = typer.Option(False, "--quick", help="Fewer points (smoke run)."),
) -> None:
    """Measure kvtier's reference engine (prefill per length, decode per batch and context) on this
    machine and write a profile that `plan simulate --latency PATH` plugs in."""
    from kvstore.engine.profile import measure_profile

    if quick:
        profile = measure_profile(prefill_tokens=(64, 256), decode_batches=(1, 2),
                                  decode_contexts=(128, 256), repeats=1)
    else:
        profile = measure_profile()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    _emit(profile)

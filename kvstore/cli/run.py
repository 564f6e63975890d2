"""``kvtier run``: the main job of ``make run``.

By default the vLLM fleet (:mod:`kvstore.cluster.vllm_fleet`, docs/fleet.md): etcd, a
conductor, two daemons, vLLM instances with the kvtier connector and KV events, the front door,
and a slice of the conversation trace through each mode. ``--reference``: the cluster of
kvtier's own reference engines (:mod:`kvstore.cluster.serving`); ``--local``: its
single-process version.

The trace slice is made by the vLLM benchmark's workload (``bench.vllm_serving``:
conversations of the trace, one trace block = one 32-token vLLM block, equal block ids = equal
token blocks), which the cluster box cannot import itself (it sits below ``bench``): the CLI
builds the prompts and hands them to the fleet.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from kvstore.cluster.serving import default_trace, run_cluster, run_local


def run(requests: int = typer.Option(64, help="--reference: how many trace requests to serve."),
        max_blocks: int = typer.Option(8, help="--reference: skip trace requests longer than this many blocks."),
        new_tokens: int = typer.Option(8, help="Greedy tokens decoded per request."),
        trace: Path = typer.Option(None, help="Mooncake-format trace (default: ../shared/data/traces/conversation_trace.jsonl)."),
        reference: bool = typer.Option(False, "--reference", help="The cluster of kvtier's "
                                       "reference engines (a prefill and a decode worker) "
                                       "instead of the vLLM fleet."),
        local: bool = typer.Option(False, "--local", help="The single-process mode: one node's "
                                   "tiers in this process, no cluster."),
        conversations: int = typer.Option(6, help="Fleet: conversations of the trace replayed "
                                          "(all their requests, in trace order)."),
        modes: str = typer.Option("vllm-alone,round-robin+kvtier,kvtier+conductor,pd+kvtier",
                                  help="Fleet: the modes to run, comma-separated, in order."),
        per_node_stores: bool = typer.Option(False, "--per-node-stores", help="Fleet: v1's "
                                             "connector on node-b's daemon instead of "
                                             "sharing node-a's (nothing then moves between "
                                             "the instances through kvtier)."),
        json_path: Path = typer.Option(None, "--json", help="Fleet: write the run's figures "
                                       "as JSON here."),
        work_dir: Path = typer.Option(None, help="Cluster or fleet: logs, etcd data and NVMe "
                                      "files (emptied at start, logs kept). Default "
                                      ".kvtier-run/fleet, or .kvtier-run/cluster with "
                                      "--reference."),
        concurrency: int = typer.Option(2, help="--reference: requests in flight."),
        threads: int = typer.Option(1, help="--reference: torch threads per worker."),
        dram_mib: int = typer.Option(24, help="--local: DRAM tier size (small on purpose: forces demotion)."),
        nvme_mib: int = typer.Option(512, help="--local: NVMe tier size."),
        data_dir: Path = typer.Option(Path(".kvtier-run"), help="--local: where the NVMe tier keeps its files."),
        fresh: bool = typer.Option(False, help="--local: start with an empty NVMe tier."),
        policy: str = typer.Option("mq", help="--local: eviction policy."),
        ) -> None:
    """Bring up a local vLLM fleet (etcd, conductor, two daemons, vLLM with the kvtier
    connector, the front door), replay a slice of a real trace through each mode (vLLM alone,
    round robin + kvtier, KV-aware routing by the conductor + kvtier, P/D through kvtier),
    print TTFT, TPOT, reuse, bytes moved per tier and routing latency, check the outputs are
    identical, and shut everything down. ``--reference``: the reference-engine cluster;
    ``--local``: the single-process mode."""
    trace = trace or default_trace()
    if not trace.exists():
        raise typer.BadParameter(f"trace {trace} not found", param_hint="--trace")
    if requests < 1 or new_tokens < 1 or concurrency < 1 or threads < 1 or conversations < 1:
        raise typer.BadParameter("requests, new_tokens, concurrency, threads and conversations "
                                 "must be >= 1")
    if local:
        run_local(requests=requests, max_blocks=max_blocks, new_tokens=new_tokens,
                  dram_mib=dram_mib, nvme_mib=nvme_mib, data_dir=data_dir, trace=trace,
                  fresh=fresh, policy=policy)
    elif reference:
        run_cluster(requests=requests, max_blocks=max_blocks, new_tokens=new_tokens,
                    trace=trace, work_dir=work_dir or Path(".kvtier-run/cluster"),
                    concurrency=concurrency, threads=threads)
    else:
        doc = run_vllm_fleet(trace=trace, conversations=conversations, new_tokens=new_tokens,
                             modes=modes, work_dir=work_dir or Path(".kvtier-run/fleet"),
                             shared_store=not per_node_stores)
        if json_path is not None:
            json_path.parent.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        if not doc["outputs_identical"] or doc["failed_modes"]:
            typer.echo("kvtier run: " + ("outputs differ between modes" if not
                       doc["outputs_identical"] else
                       f"modes failed: {', '.join(doc['failed_modes'])}"), err=True)
            raise typer.Exit(code=1)


def run_vllm_fleet(*, trace: Path, conversations: int, new_tokens: int, modes: str,
                   work_dir: Path, shared_store: bool = True) -> dict[str, Any]:
    from bench.vllm_serving import model_core_env
    from kvstore.cluster.vllm_fleet import FleetSpec, Mode, run_fleet
    from kvstore.cluster.vllm_instance import PREFILL_BOUND

    try:
        chosen = tuple(Mode(m.strip()) for m in modes.split(",") if m.strip())
    except ValueError as exc:
        raise typer.BadParameter(f"{exc}; modes: {', '.join(m.value for m in Mode)}",
                                 param_hint="--modes") from exc
    from bench.vllm_serving import fleet_requests

    requests = fleet_requests(trace, conversations, PREFILL_BOUND.vocab_size)
    spec = FleetSpec(work_dir=work_dir.resolve(), requests=tuple(requests), modes=chosen,
                     max_tokens=max(2, new_tokens), instance_env=model_core_env,
                     shared_store=shared_store)
    return run_fleet(spec)

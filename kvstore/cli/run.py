"""``kvtier run``: the main job of ``make run`` (the work itself is :mod:`kvstore.cluster.serving`)."""

from __future__ import annotations

from pathlib import Path

import typer

from kvstore.cluster.serving import default_trace, run_cluster, run_local


def run(requests: int = typer.Option(64, help="How many trace requests to serve."),
        max_blocks: int = typer.Option(8, help="Skip trace requests longer than this many blocks."),
        new_tokens: int = typer.Option(8, help="Greedy tokens decoded per request."),
        trace: Path = typer.Option(None, help="Mooncake-format trace (default: ../shared/data/traces/conversation_trace.jsonl)."),
        local: bool = typer.Option(False, "--local", help="The single-process mode: one node's "
                                   "tiers in this process, no cluster."),
        work_dir: Path = typer.Option(Path(".kvtier-run/cluster"), help="Cluster: logs, etcd data "
                                      "and NVMe files (emptied at start, logs kept)."),
        concurrency: int = typer.Option(2, help="Cluster: requests in flight."),
        threads: int = typer.Option(1, help="Cluster: torch threads per worker."),
        dram_mib: int = typer.Option(24, help="--local: DRAM tier size (small on purpose: forces demotion)."),
        nvme_mib: int = typer.Option(512, help="--local: NVMe tier size."),
        data_dir: Path = typer.Option(Path(".kvtier-run"), help="--local: where the NVMe tier keeps its files."),
        fresh: bool = typer.Option(False, help="--local: start with an empty NVMe tier."),
        policy: str = typer.Option("mq", help="--local: eviction policy."),
        ) -> None:
    """Bring up a local cluster (etcd, conductor, two daemons, a prefill and a decode worker),
    replay a slice of a real trace through the gateway without and with prefix reuse, print
    TTFT, TPOT, hit ratio and bytes moved per tier, check the outputs are identical, and shut
    everything down. ``--local``: the single-process mode instead."""
    trace = trace or default_trace()
    if not trace.exists():
        raise typer.BadParameter(f"trace {trace} not found", param_hint="--trace")
    if requests < 1 or new_tokens < 1 or concurrency < 1 or threads < 1:
        raise typer.BadParameter("requests, new_tokens, concurrency and threads must be >= 1")
    if local:
        run_local(requests=requests, max_blocks=max_blocks, new_tokens=new_tokens,
                  dram_mib=dram_mib, nvme_mib=nvme_mib, data_dir=data_dir, trace=trace,
                  fresh=fresh, policy=policy)
    else:
        run_cluster(requests=requests, max_blocks=max_blocks, new_tokens=new_tokens,
                    trace=trace, work_dir=work_dir, concurrency=concurrency, threads=threads)

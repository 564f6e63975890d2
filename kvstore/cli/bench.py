"""``kvtier bench ...``: each command imports its benchmark module from ``bench/`` lazily."""

from __future__ import annotations

from pathlib import Path

import typer

app = typer.Typer(help="Benchmarks: every figure beside the physical limit measured in the same run.",
                  no_args_is_help=True)


@app.command()
def hashing(
    quick: bool = typer.Option(False, "--quick", help="Fewer repeats (same 128k tokens)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """Prefix-key hashing of 128k tokens (both modes, blocks 256 and 16) beside raw xxh3 and prefill."""
    from bench import hashing as bench_hashing

    bench_hashing.main(json_path, quick)


@app.command()
def tiers(
    quick: bool = typer.Option(False, "--quick", help="128 MiB per size, one round (smoke run)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
    directory: Path | None = typer.Option(
        None, "--dir", help="Where the NVMe files go (default: a temp dir on the repo's filesystem)."),
    unaligned: bool = typer.Option(
        False, "--unaligned", help="Also measure NVMe with unaligned caller buffers (staged path)."),
) -> None:
    """Put/get GB/s of the DRAM, NVMe (and HBM) tiers beside memcpy, O_DIRECT disk and PCIe limits."""
    from bench import tiers as bench_tiers

    bench_tiers.main(json_path, quick, directory, unaligned)


@app.command()
def datapath(
    quick: bool = typer.Option(False, "--quick", help="~24 MiB per size and op (smoke run)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """Put/get GB/s and latency of the TCP data path beside a bare socket and Redis (2 processes)."""
    from bench import datapath as bench_datapath

    bench_datapath.main(json_path, quick)


@app.command("put-batch")
def put_batch(
    quick: bool = typer.Option(False, "--quick", help="Fewer rounds per size (smoke run)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """A step's chained blocks in one same-host put_many, beside a memcpy of the same bytes."""
    from bench import put_batch as bench_put_batch

    argv = ["--quick"] if quick else []
    if json_path is not None:
        argv += ["--json", str(json_path)]
    bench_put_batch.main(argv)


@app.command()
def schedule(
    trace: list[str] | None = typer.Option(
        None, "--trace", help="Trace to replay (repeatable): a .jsonl/.csv path, or mooncake, "
        "azure-code, azure-conv (default: all three)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
    quick: bool = typer.Option(False, "--quick", help="Index at 1M blocks only; first 2,000 requests."),
    limit: int | None = typer.Option(None, "--limit", help="Replay only the first N requests."),
    load: float = typer.Option(0.85, "--load", help="Prefill busy fraction with no reuse (rescales arrivals)."),
    index_blocks: list[int] | None = typer.Option(
        None, "--index-blocks", help="Index sizes to measure, in blocks (repeatable)."),
    real: bool = typer.Option(
        False, "--real", help="Only replay each policy through a real conductor, real daemons "
        "and etcd (simulated engines and clock; default trace: mooncake)."),
) -> None:
    """Conductor: prefix index at 1M/10M blocks, scheduling latency, policies on traces."""
    from bench import schedule as bench_schedule
    from kvstore.errors import KvtierError

    try:
        if real:
            bench_schedule.main_real(json_path, trace, limit, load)
            return
        bench_schedule.main(json_path, quick, trace, limit, load, sizes=index_blocks)
    except (KvtierError, OSError, ValueError) as exc:  # bad flag value or unreadable trace
        typer.echo(f"kvtier bench schedule: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def replay(
    trace: Path | None = typer.Option(
        None, "--trace", help="Mooncake JSONL trace (default: traces/conversation_trace.jsonl "
        "under $KVTIER_DATA_DIR or ../shared/data next to the repository, when it exists)."),
    capacity_tokens: int | None = typer.Option(
        None, "--capacity-tokens", help="Cache size in tokens (512-token blocks); omit: unbounded."),
    policy: str = typer.Option("lru", "--policy", help="lru, s3fifo, mq or belady."),
    limit: int | None = typer.Option(None, "--limit", help="Replay only the first N requests."),
    sweep: bool = typer.Option(
        False, "--sweep", help="Every policy at 1M, 3M and 10M tokens beside LRU and Belady."),
    json_output: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    out: Path | None = typer.Option(
        None, "--out", help="Where --sweep writes its JSON [default: bench/out/replay.json]."),
) -> None:
    """Replay a Mooncake trace through the cache index; print the block hit ratio."""
    import json

    from bench import replay as bench_replay
    from kvstore.errors import KvtierError
    from planner.trace import default_trace_path

    path = trace or default_trace_path()
    if path is None:
        raise typer.BadParameter("no --trace given and the default trace does not exist",
                                 param_hint="--trace")
    try:
        if sweep:
            result = bench_replay.run_sweep(path, out or bench_replay.DEFAULT_SWEEP_OUT, limit)
            typer.echo(json.dumps(result) if json_output else bench_replay.format_sweep(result))
            return
        one = bench_replay.run_one(path, capacity_tokens, policy, limit=limit)
    except (KvtierError, OSError) as exc:  # bad flag value or unreadable/malformed trace
        typer.echo(f"kvtier bench replay: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(one.to_json()) if json_output else bench_replay.format_one(one))


@app.command()
def planner(
    quick: bool = typer.Option(False, "--quick", help="Fewer requests and seeds (smoke run)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """Planner speed (full-trace simulation, ~100-config search) and the DistServe OPT-13B check."""
    from bench import planner as bench_planner

    bench_planner.main(json_path, quick)


@app.command()
def client(
    quick: bool = typer.Option(False, "--quick", help="8 blocks per call, 2 repetitions."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """KVClient load/save through a real daemon (shm and TCP) beside memcpy and the raw store path."""
    from bench import kv_client as bench_kv_client

    bench_kv_client.main((["--quick"] if quick else []) + (["--json", str(json_path)] if json_path else []))


@app.command()
def e2e(
    quick: bool = typer.Option(False, "--quick", help="16 trace requests, 4 sessions x 4 turns."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
    rate: float = typer.Option(3.0, "--rate", help="Mean arrivals per second."),
    new_tokens: int = typer.Option(8, "--new-tokens", min=1, help="Tokens generated per request."),
    token_budget: int = typer.Option(
        256, "--token-budget", min=2, help="Tokens per iteration of (b) chunked prefill."),
    colocated_threads: int = typer.Option(
        2, "--colocated-threads", min=1, help="Torch threads of the colocated engine (a)/(b)."),
    no_colocated: bool = typer.Option(
        False, "--no-colocated", help="Run only (c)/(d) (minutes less on a busy machine)."),
) -> None:
    """End to end on a local cluster: (a)/(b) colocated serving beside disaggregated
    prefill/decode without (c) and with (d) kvtier reuse on the same arrival trace (TTFT, TPOT,
    prefill tokens, KV bytes, identical outputs)."""
    from bench import e2e as bench_e2e

    bench_e2e.main(e2e_argv(quick=quick, json_path=json_path, rate=rate, new_tokens=new_tokens,
                            token_budget=token_budget, colocated_threads=colocated_threads,
                            no_colocated=no_colocated))


def e2e_argv(*, quick: bool, json_path: Path | None, rate: float, new_tokens: int,
             token_budget: int, colocated_threads: int, no_colocated: bool = False) -> list[str]:
    """The argument list of ``bench/e2e.py`` for the ``kvtier bench e2e`` flags."""
    return ((["--quick"] if quick else []) + ["--rate", str(rate), "--new-tokens", str(new_tokens),
                                              "--token-budget", str(token_budget),
                                              "--colocated-threads", str(colocated_threads)]
            + (["--no-colocated"] if no_colocated else [])
            + (["--json", str(json_path)] if json_path else []))


@app.command("vllm")
def vllm_serving(
    quick: bool = typer.Option(False, "--quick", help="10 conversations of the trace (26 requests; full: 30, 99)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
    modes: str = typer.Option("vllm-alone,kvtier,lmcache,mooncake", "--modes",
                              help="Comma-separated modes (vllm-alone always runs)."),
    keep: Path | None = typer.Option(None, "--keep", help="Keep instance logs in this directory."),
    conversations: int | None = typer.Option(None, "--conversations",
                                             help="How many conversations (default: by --quick)."),
    min_turns: int = typer.Option(2, "--min-turns",
                                  help="Only conversations of at least this many requests."),
) -> None:
    """Real vLLM on the conversation trace: alone, with kvtier, with LMCache and Mooncake (TTFT,
    TPOT, prefill tokens, hits, KV bytes and load cost beside memcpy, cold overhead, outputs)."""
    from bench import vllm_serving as bench_vllm_serving

    argv = (["--quick"] if quick else []) + ["--modes", modes]
    argv += ["--json", str(json_path)] if json_path is not None else []
    argv += ["--keep", str(keep)] if keep is not None else []
    argv += ["--conversations", str(conversations)] if conversations is not None else []
    argv += ["--min-turns", str(min_turns)]
    bench_vllm_serving.main(argv)


@app.command("fleet")
def fleet(
    quick: bool = typer.Option(False, "--quick", help="4 conversations, 32 MiB of KV per instance (full: 10, 64 MiB)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
    router: str = typer.Option("conductor", "--router", help="conductor | local: how the routed "
                               "modes' front door decides (local: in its own process, docs/routing.md)."),
    closed_loop: bool = typer.Option(False, "--closed-loop", help="One request at a time in "
                                     "trace order (default: chat arrivals)."),
    in_flight: int | None = typer.Option(None, "--in-flight", help="Conversations in flight at "
                                         "once under chat arrivals."),
    conversations: int | None = typer.Option(None, "--conversations", help="Conversations in "
                                             "the slice."),
    rounds: int = typer.Option(1, "--rounds", help="Replay every mode this many times in turn "
                               "and pool the figures."),
) -> None:
    """The vLLM fleet: one trace slice through one vLLM, two with round robin, the conductor +
    kvtier, P/D through kvtier and routing on vLLM's KV events alone (TTFT, TPOT, goodput, hits,
    bytes, routing latency, outputs) beside the planner's prediction (``python -m bench.fleet
    --help`` has every option)."""
    from bench import fleet as bench_fleet

    argv = (["--quick"] if quick else []) + (["--json", str(json_path)] if json_path else [])
    argv += ["--closed-loop"] if closed_loop else []
    argv += ["--in-flight", str(in_flight)] if in_flight is not None else []
    argv += ["--conversations", str(conversations)] if conversations is not None else []
    argv += ["--rounds", str(rounds)]
    code = bench_fleet.main([*argv, "--router", router])
    if code:
        raise typer.Exit(code)


@app.command("chaos")
def chaos(
    quick: bool = typer.Option(False, "--quick", help="Shorter warm-up, fault and recovery windows."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
    fault: list[str] = typer.Option([], "--fault", help="Run only this fault (repeatable; default: all)."),
    soak: float | None = typer.Option(None, "--soak", metavar="MINUTES",
                                      help="One cluster for MINUTES: random faults (from --fault, "
                                      "default: all) one at a time, the whole history checked."),
    engines: str = typer.Option("reference", "--engines",
                                help="Real engines serving prompts during the faults: reference "
                                "(the reference workers, tiny model), vllm (vllm serve with "
                                "kvtier's connector on h0 and h1) or none."),
) -> None:
    """Faults under load on a three-host cluster in network namespaces (root): requests completed
    and failed during each fault, wrong reads, durable chunks lost, time to detect and recover,
    leaks (docs/chaos.md). Exits 1 when an invariant broke."""
    from bench import chaos as bench_chaos
    from kvstore.errors import ConfigError

    try:
        try:
            kind = bench_chaos.Engines(engines)
        except ValueError as exc:
            raise ConfigError(f"--engines must be one of "
                              f"{', '.join(e.value for e in bench_chaos.Engines)}, "
                              f"got {engines!r}") from exc
        rows = bench_chaos.main(json_path, quick, fault or None, soak, kind)
    except ConfigError as exc:
        typer.echo(f"kvtier bench chaos: {exc}", err=True)
        raise typer.Exit(2) from exc
    if not all(row.clean for row in rows):
        raise typer.Exit(1)


@app.command("routing")
def routing(
    quick: bool = typer.Option(False, "--quick", help="100 decisions per row instead of 300."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """The front door's routing decision (hashing, Schedule RPC, whole decision) for prompts of
    100-4,000 tokens against a real conductor, etcd and daemon, beside a bare gRPC round trip."""
    from bench import routing as bench_routing

    argv = (["--quick"] if quick else []) + (["--json", str(json_path)] if json_path else [])
    code = bench_routing.main(argv)
    if code:
        raise typer.Exit(code)

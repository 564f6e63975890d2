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
def datapath(
    quick: bool = typer.Option(False, "--quick", help="~24 MiB per size and op (smoke run)."),
    json_path: Path | None = typer.Option(None, "--json", help="Also write the results as JSON here."),
) -> None:
    """Put/get GB/s and latency of the TCP data path beside a bare socket and Redis (2 processes)."""
    from bench import datapath as bench_datapath

    bench_datapath.main(json_path, quick)

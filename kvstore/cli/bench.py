"""``kvtier bench ...``: each command imports its benchmark module from ``bench/`` lazily."""

from __future__ import annotations

import typer

app = typer.Typer(help="Benchmarks: every figure beside the physical limit measured in the same run.",
                  no_args_is_help=True)

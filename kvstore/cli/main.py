"""Entry point of the ``kvtier`` command. Sub-commands live in sibling modules and import lazily,
so ``kvtier --help`` stays fast and a missing optional dependency only breaks its own command."""

from __future__ import annotations

import typer

from kvstore import __version__
from kvstore.cli import admin as admin_cli
from kvstore.cli import bench as bench_cli
from kvstore.cli import conductor as conductor_cli
from kvstore.cli import daemon as daemon_cli
from kvstore.cli import frontdoor as frontdoor_cli
from kvstore.cli import plan as plan_cli
from kvstore.cli import run as run_cli
from kvstore.cli import security as security_cli
from kvstore.cli import vllm_register as vllm_register_cli

app = typer.Typer(
    name="kvtier",
    help="kvtier: a tiered KV-cache store for LLM serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(bench_cli.app, name="bench")
app.command(name="run")(run_cli.run)
app.add_typer(plan_cli.app, name="plan")
app.command(name="daemon")(daemon_cli.daemon)
app.command(name="conductor")(conductor_cli.conductor)
app.command(name="frontdoor")(frontdoor_cli.frontdoor)
admin_cli.register(app)
app.command(name="vllm-register")(vllm_register_cli.vllm_register)
app.add_typer(security_cli.app, name="token")


@app.command()
def version() -> None:
    """Print kvtier's version."""
    typer.echo(__version__)


if __name__ == "__main__":
    app()

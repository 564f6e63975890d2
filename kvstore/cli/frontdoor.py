"""``kvtier frontdoor``: the OpenAI-compatible endpoint in front of ``vllm serve`` instances
(docs/frontdoor.md), until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

import typer

from kvstore.errors import KvtierError


def frontdoor(
    backend: list[str] = typer.Option(
        [], "--backend",
        help="A vLLM server: URL (http://host:port) or NAME=URL; repeat for several. With "
             "--router conductor, NAME is the instance id the conductor answers."),
    prefill: list[str] = typer.Option(
        [], "--prefill",
        help="P/D mode: a vLLM server that prefills (kvtier connector, kv_producer or "
             "kv_both): URL or NAME=URL; repeat for several. Needs --decode."),
    decode: list[str] = typer.Option(
        [], "--decode",
        help="P/D mode: a vLLM server that decodes (kvtier connector, kv_consumer or "
             "kv_both): URL or NAME=URL; repeat for several. Needs --prefill."),
    model_dir: Path = typer.Option(
        ..., "--model-dir",
        help="The model directory the backends serve (its tokenizer.json, tokenizer_config.json)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    router: str = typer.Option(
        "round-robin", "--router",
        help="round-robin | conductor | local (the conductor's decision made in this process, "
             "asking the conductor when its replica is stale: docs/routing.md)"),
    etcd: str | None = typer.Option(None, "--etcd",
                                    help="etcd endpoint (--router conductor finds the leader)."),
    prefix: str = typer.Option("/kvtier/", "--prefix", help="etcd key prefix of the cluster."),
    conductor_model: str | None = typer.Option(
        None, "--conductor-model", help="The model name the conductor knows the engines by."),
    policy: str = typer.Option("global-cache", "--policy",
                               help="--router local: the conductor's --policy."),
    block_size_tokens: int = typer.Option(512, "--block-size-tokens",
                                          help="--router local: the conductor's "
                                               "--block-size-tokens."),
    ttft_slo_s: float | None = typer.Option(None, "--ttft-slo-s",
                                            help="--router local: the conductor's --ttft-slo-s."),
    tpot_slo_s: float | None = typer.Option(None, "--tpot-slo-s",
                                            help="--router local: the conductor's --tpot-slo-s."),
    cache_affinity_margin: float = typer.Option(
        0.25, "--cache-affinity-margin",
        help="--router local: the conductor's --cache-affinity-margin."),
    read_timeout_s: float = typer.Option(600.0, "--read-timeout-s",
                                         help="Longest wait for a backend's next bytes."),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Serve /v1/completions, /v1/chat/completions (streaming too), /v1/models and /health,
    routing each request to one of the backends, or (--prefill/--decode) prefilling it on a
    prefill backend and decoding it on a decode backend through kvtier.

    Prints `KVTIER-FRONTDOOR-READY {json}` with its URL once it serves.
    """
    from kvstore.frontdoor import (
        Backend,
        BackendPool,
        ConductorRouter,
        FrontDoor,
        PdRouter,
        PromptTokenizer,
        Router,
    )
    from kvstore.frontdoor.server import READY_PREFIX
    from kvstore.membership.etcd import KeyLayout

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        prefills = [Backend.parse(spec) for spec in prefill]
        decodes = [Backend.parse(spec) for spec in decode]
        pool = BackendPool([Backend.parse(spec) for spec in backend] + prefills + decodes)
        tokenizer = PromptTokenizer.from_model_dir(model_dir)
        if router not in ("round-robin", "conductor", "local"):
            raise KvtierError(f"--router {router!r}: want round-robin, conductor or local")
        if router in ("conductor", "local") and (etcd is None or not conductor_model):
            raise KvtierError(f"--router {router} needs --etcd and --conductor-model")
        if router == "local":
            from conductor.scheduler import Policy

            if policy not in {p.value for p in Policy}:
                raise KvtierError(f"--policy {policy!r}: want one of "
                                  f"{', '.join(p.value for p in Policy)}")
        if bool(prefills) != bool(decodes):
            raise KvtierError("P/D mode needs both --prefill and --decode")
        if prefills and (backend or router != "round-robin"):
            raise KvtierError("--prefill/--decode route by themselves: no --backend nor "
                              "--router with them")
        if not pool.all():
            raise KvtierError("no backend: give --backend, or --prefill and --decode")
        pd_router = PdRouter(pool, prefills, decodes) if prefills else None
    except KvtierError as exc:
        typer.echo(f"kvtier frontdoor: {exc}", err=True)
        raise typer.Exit(2) from exc

    async def main() -> None:
        conductor = None
        local = None
        chosen: Router | None = pd_router
        if router in ("conductor", "local"):
            from kvstore.client.conductor_client import ConductorClient

            assert etcd is not None and conductor_model
            conductor = ConductorClient(etcd_endpoint=etcd, layout=KeyLayout(prefix))
            chosen = ConductorRouter(conductor, pool, conductor_model)
        if router == "local":
            from conductor.scheduler import Policy
            from kvstore.frontdoor.local import LocalRouter

            assert etcd is not None and conductor is not None and conductor_model
            local = chosen = LocalRouter(
                conductor, pool, conductor_model, etcd_endpoint=etcd, layout=KeyLayout(prefix),
                policy=Policy(policy), block_size_tokens=block_size_tokens,
                ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
                cache_affinity_margin=cache_affinity_margin)
            await local.start()
        door = FrontDoor(pool, tokenizer, router=chosen, host=host, port=port,
                         read_timeout_s=read_timeout_s)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            await door.start()
            typer.echo(READY_PREFIX + json.dumps(
                {"url": door.url, "port": door.port,
                 "router": "pd" if pd_router is not None else router,
                 "backends": {b.name: b.url for b in pool.all()},
                 "prefill": [b.name for b in prefills], "decode": [b.name for b in decodes]}))
            sys.stdout.flush()
            await stop.wait()
        finally:
            await door.close()
            if local is not None:
                await local.close()
            if conductor is not None:
                await conductor.close()

    try:
        asyncio.run(main())
    except (KvtierError, OSError) as exc:  # OSError: the port is taken
        typer.echo(f"kvtier frontdoor: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc

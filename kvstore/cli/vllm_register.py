"""``kvtier vllm-register``: hold a ``vllm serve`` instance's engine record in etcd while its
``/health`` answers (:mod:`kvstore.membership.vllm_registration`), until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import typer

from kvstore.cli.etcd_options import (
    ETCD_CA,
    ETCD_CERT,
    ETCD_ENDPOINTS_HELP,
    ETCD_KEY,
    ETCD_PASSWORD_FILE,
    ETCD_SERVER_NAME,
    ETCD_USER,
    apply_etcd_options,
)
from kvstore.errors import KvtierError


def vllm_register(
    etcd: str = typer.Option(..., "--etcd", help=ETCD_ENDPOINTS_HELP),
    prefix: str = typer.Option("/kvtier/", "--prefix", help="etcd key prefix of the cluster."),
    instance_id: str = typer.Option(..., "--instance-id", help="The engine's instance id."),
    role: str = typer.Option("prefill", "--role", help="prefill | decode"),
    model: str = typer.Option(..., "--model", help="The model name requests use."),
    node_id: str = typer.Option(..., "--node-id", help="The store daemon on the engine's host."),
    http_url: str = typer.Option(..., "--http-url",
                                 help="Where the server answers, e.g. http://10.0.0.5:8000."),
    kv_capacity_tokens: int = typer.Option(0, "--kv-capacity-tokens",
                                           help="Decode KV room in tokens (decode: required)."),
    kv_events_endpoint: str | None = typer.Option(
        None, "--kv-events-endpoint",
        help="The server's KV event publisher as a subscriber connects to it (tcp://host:port "
             "or ipc://path); omitted: no KV-aware routing on its own cache."),
    kv_replay_endpoint: str | None = typer.Option(None, "--kv-replay-endpoint",
                                                  help="Its replay (ROUTER) endpoint."),
    kv_topic: str = typer.Option("", "--kv-topic", help="Its KVEventsConfig topic."),
    block_size: int = typer.Option(0, "--block-size",
                                   help="vLLM's --block-size (required with KV events)."),
    hash_algo: str = typer.Option("sha256_cbor", "--hash-algo",
                                  help="vLLM's --prefix-caching-hash-algo."),
    hash_seed: str | None = typer.Option(
        None, "--hash-seed",
        help="The server's PYTHONHASHSEED (default: this environment's, else vLLM's "
             "'vllm-none-hash')."),
    int_block_hashes: bool = typer.Option(
        True, "--int-block-hashes/--digest-block-hashes",
        help="Events carry 64-bit ints (vLLM's default) or full digests "
             "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."),
    num_blocks: int = typer.Option(0, "--num-blocks",
                                   help="Its KV cache size in blocks (0: unknown)."),
    ttl_s: int = typer.Option(10, "--ttl-s", help="Lease TTL of the records."),
    poll_interval_s: float = typer.Option(1.0, "--poll-interval-s", help="Health poll interval."),
    log_level: str = typer.Option("INFO", "--log-level"),
    insecure: bool = typer.Option(
        False, "--insecure",
        help="Register a KV event endpoint on the network (tcp:// to another host): vLLM's "
             "publisher authenticates nobody (docs/security.md, \"vLLM's KV events\")."),
    etcd_ca: Path | None = ETCD_CA,
    etcd_cert: Path | None = ETCD_CERT,
    etcd_key: Path | None = ETCD_KEY,
    etcd_user: str | None = ETCD_USER,
    etcd_password_file: Path | None = ETCD_PASSWORD_FILE,
    etcd_server_name: str | None = ETCD_SERVER_NAME,
) -> None:
    """Register a vLLM server in etcd while it is healthy; drop the record when it is not."""
    try:
        apply_etcd_options(etcd_ca, etcd_cert, etcd_key, etcd_user,
                           etcd_password_file, etcd_server_name)
    except KvtierError as exc:
        typer.echo(f"kvtier vllm-register: {exc}", err=True)
        raise typer.Exit(2) from exc
    from kvstore.membership.engines import (
        VLLM_DEFAULT_HASH_SEED,
        EngineRecord,
        EngineRole,
        VllmKvEvents,
    )
    from kvstore.membership.etcd import KeyLayout, etcd_client
    from kvstore.membership.vllm_registration import (
        check_kv_events_endpoint,
        hold_while_healthy,
        http_health,
    )

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        events = None
        if kv_events_endpoint is not None:
            events = VllmKvEvents(
                endpoint=kv_events_endpoint, replay_endpoint=kv_replay_endpoint, topic=kv_topic,
                block_size_tokens=block_size, hash_algo=hash_algo,
                hash_seed=hash_seed if hash_seed is not None else os.environ.get(
                    "PYTHONHASHSEED", VLLM_DEFAULT_HASH_SEED),
                int_block_hashes=int_block_hashes, num_blocks=num_blocks)
        record = EngineRecord(instance_id=instance_id, role=EngineRole(role), model=model,
                              node_id=node_id, kv_capacity_tokens=kv_capacity_tokens,
                              http_url=http_url, vllm_kv_events=events)
        layout = KeyLayout(prefix)
        for endpoint in (kv_events_endpoint, kv_replay_endpoint):
            if endpoint is not None:
                check_kv_events_endpoint(endpoint, insecure=insecure)
    except (KvtierError, ValueError) as exc:
        typer.echo(f"kvtier vllm-register: {exc}", err=True)
        raise typer.Exit(2) from exc

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, task.cancel)
        async with etcd_client(etcd) as client:
            await hold_while_healthy(client, [record], http_health(http_url), ttl_s=ttl_s,
                                     layout=layout, poll_interval_s=poll_interval_s,
                                     insecure=insecure)

    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        pass
    except KvtierError as exc:
        typer.echo(f"kvtier vllm-register: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc

"""A worker process: ``python -m kvstore.engine.worker --role prefill|decode ...`` (:func:`main`)
runs :func:`serve` until SIGTERM/SIGINT and prints ``KVTIER-WORKER-READY {json}``
(:data:`READY_PREFIX`) once it serves; :mod:`kvstore.cluster.local` starts workers that way and
waits for that line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from kvstore.engine.model import ModelSpec
from kvstore.engine.worker.base import WorkerBase
from kvstore.engine.worker.config import WorkerConfig
from kvstore.engine.worker.decode import DecodeWorker
from kvstore.engine.worker.device import resolve_device
from kvstore.engine.worker.prefill import PrefillWorker
from kvstore.errors import KvtierError
from kvstore.membership.engines import EngineRole

__all__ = ["READY_PREFIX", "main", "serve"]

READY_PREFIX = "KVTIER-WORKER-READY "


async def serve(config: WorkerConfig, *, ready: Any = None) -> None:
    """Run a worker until SIGTERM/SIGINT; ``ready(address)`` is called once it serves."""
    worker: WorkerBase = (PrefillWorker(config) if config.role is EngineRole.PREFILL
                       else DecodeWorker(config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        address = await worker.start()
        if ready is not None:
            ready(address)
        await stop.wait()
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.engine.worker --role prefill|decode --instance-id ID --node-id N
    --daemon HOST:PORT --etcd URL [--prefix P] [--model-name M] [--spec-json J]
    [--block-tokens B] [--threads T] [--kv-capacity-tokens K] [--device cpu|cuda|cuda:N|auto]
    [--max-decode-batch N] [--listen HOST:PORT] [--kv-timeout-s S]``.

    Exit code 2 for a bad flag, a device this machine lacks included (``--device cuda``
    without CUDA is refused before anything starts, never run on the CPU instead)."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvstore.engine.worker")
    parser.add_argument("--role", required=True, choices=[r.value for r in EngineRole])
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--daemon", required=True, help="gRPC address of the node's daemon")
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--prefix", default="/kvtier/")
    parser.add_argument("--model-name", default="ref-llama")
    parser.add_argument("--spec-json", default="{}", help="ModelSpec fields as JSON")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a local Hugging Face checkpoint (default: the seeded reference model)")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-capacity-tokens", type=int, default=1_000_000)
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda, cuda:N, or auto (cuda when available)")
    parser.add_argument("--max-decode-batch", type=int, default=64,
                        help="most sequences per batched decode step (decode role)")
    parser.add_argument("--listen", default="127.0.0.1:0",
                        help="HOST:PORT the worker serves on (default 127.0.0.1, any port)")
    parser.add_argument("--kv-timeout-s", type=float, default=30.0,
                        help="the KV clients' rpc timeout (a daemon that does not answer)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        listen_host, sep, listen_port = args.listen.rpartition(":")
        if not sep or not listen_host or not listen_port.isdigit():
            raise ValueError(f"--listen must be HOST:PORT, got {args.listen!r}")
        config = WorkerConfig(
            role=EngineRole(args.role), instance_id=args.instance_id, node_id=args.node_id,
            daemon_address=args.daemon, etcd_endpoint=args.etcd, etcd_prefix=args.prefix,
            model_name=args.model_name, spec=ModelSpec(**json.loads(args.spec_json)),
            model_path=args.model_path,
            block_tokens=args.block_tokens, torch_threads=args.threads,
            kv_capacity_tokens=args.kv_capacity_tokens, device=args.device,
            max_decode_batch=args.max_decode_batch, listen_host=listen_host,
            listen_port=int(listen_port), kv_rpc_timeout_s=args.kv_timeout_s)
        resolve_device(config.device)  # refuse a missing GPU here, before anything starts
    except (KvtierError, TypeError, ValueError) as exc:
        print(f"kvstore.engine.worker: {exc}", file=sys.stderr)
        return 2

    def ready(address: str) -> None:
        print(READY_PREFIX + json.dumps({"instance_id": config.instance_id,
                                         "role": config.role.value, "address": address}),
              flush=True)

    try:
        asyncio.run(serve(config, ready=ready))
    except KvtierError as exc:
        print(f"kvstore.engine.worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0

"""The reference workers when their daemon dies and comes back (issue 16: real engines under the
fault suite). A prefill and a decode worker (in this process, a real transformer) on one real
daemon (TCP data plane, every put written through to NVMe): while the daemon is killed, requests
still complete with the no-cache output, recomputed; once it is back on the same address and
directory, the next request loads its prefix from it again (the workers connect afresh instead
of waiting out their old gRPC channel's reconnect backoff)."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvstore.engine.colocated import reference_generate  # noqa: E402
from kvstore.engine.frames import read_frame, write_frame  # noqa: E402
from kvstore.engine.model import build_reference_model  # noqa: E402
from kvstore.engine.worker import DecodeWorker, PrefillWorker, WorkerConfig  # noqa: E402
from kvstore.membership.engines import EngineRole  # noqa: E402
from kvstore.membership.etcd import KeyLayout  # noqa: E402
from kvstore.membership.launcher import LocalEtcd  # noqa: E402
from tests.support.daemon import DaemonProcess  # noqa: E402
from tests.support.models import tiny_spec  # noqa: E402

BLOCK = 16
SPEC = tiny_spec()
NEW_TOKENS = 4
DOWN_S = 10.0
"""How long the daemon stays dead while requests go on: long enough for a gRPC channel that
keeps failing to back off past the daemon's restart (1 s growing by 1.6x per attempt)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _daemon(tmp_path: Path, grpc_port: int, tcp_port: int) -> DaemonProcess:
    return DaemonProcess(tmp_path, "node-a", settings={
        "server.host": "127.0.0.1", "server.grpc_port": str(grpc_port),
        "server.tcp_port": str(tcp_port), "server.shm_channel": "false",
        "server.ucx": "disabled", "cache.write_tier": "nvme"})


async def _generate(prefill: PrefillWorker, decode: DecodeWorker, tokens: list[int]
                    ) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    host, port = prefill.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await write_frame(writer, {
            "op": "generate", "request_id": "r", "token_ids": tokens, "tenant": "t",
            "reuse": True, "prefix_blocks": 0, "ticket": 0, "decode_address": decode.address,
            "max_new_tokens": NEW_TOKENS, "fetch": None})
        first, _ = await read_frame(reader)
        assert first.get("event") == "first_token", first
        done, _ = await read_frame(reader)
        assert done.get("event") == "done", done
    finally:
        writer.close()
    return [int(t) for t in done["decode"]["tokens"]], first["prefill"], done["decode"]


def test_workers_recompute_while_their_daemon_is_dead_and_reuse_once_it_is_back(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout) -> None:
    grpc_port, tcp_port = _free_port(), _free_port()
    daemon = _daemon(tmp_path, grpc_port, tcp_port)
    daemon.start()
    address = f"127.0.0.1:{grpc_port}"
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SPEC.vocab_size, (4 * BLOCK + 5,), generator=g).tolist()
    expected = reference_generate(build_reference_model(SPEC), tokens, NEW_TOKENS)

    def config(role: EngineRole) -> WorkerConfig:
        return WorkerConfig(role=role, instance_id=f"{role.value}-0", node_id="node-a",
                            daemon_address=address, etcd_endpoint=etcd_server.client_url,
                            etcd_prefix=etcd_layout.prefix, spec=SPEC, block_tokens=BLOCK,
                            lease_ttl_s=2, kv_rpc_timeout_s=2.0)

    async def scenario() -> None:
        prefill, decode = PrefillWorker(config(EngineRole.PREFILL)), \
            DecodeWorker(config(EngineRole.DECODE))
        await prefill.start()
        await decode.start()
        try:
            out, pre, dec = await _generate(prefill, decode, tokens)
            assert out == expected and pre["reused_tokens"] == 0
            assert dec["loaded_blocks"] == 4  # the decode worker loaded every full block
            out, pre, _ = await _generate(prefill, decode, tokens)
            assert out == expected and pre["reused_tokens"] == 4 * BLOCK

            daemon.kill()
            down_until = time.monotonic() + DOWN_S
            served = 0
            while time.monotonic() < down_until or served < 2:
                out, pre, dec = await _generate(prefill, decode, tokens)
                # No store: the prefill computed everything, the decode recomputed the prompt.
                assert out == expected
                assert pre["reused_tokens"] == 0 and dec["loaded_blocks"] == 0
                assert dec["recomputed_tokens"] == len(tokens)
                served += 1
                await asyncio.sleep(0.2)

            daemon.start()  # same address, same NVMe directory: the chunks were durable
            out, pre, dec = await _generate(prefill, decode, tokens)
            assert out == expected
            assert pre["reused_tokens"] == 4 * BLOCK, pre
            assert dec["loaded_blocks"] == 4, dec
        finally:
            await prefill.stop()
            await decode.stop()

    try:
        asyncio.run(scenario())
    finally:
        daemon.stop()

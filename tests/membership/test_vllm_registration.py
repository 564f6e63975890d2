"""vLLM engine records: the optional HTTP URL and KV-event description round-trip and validate
(records without them still parse), and the sidecar holds a server's record in a real etcd only
while the server is healthy. The health check here is a flag (the server's ``/health`` is
exercised by ``kvtier vllm-register`` against a real ``vllm serve``, not here); the HTTP check
itself is run against a real local HTTP server. Every wait is bounded."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.errors import InvalidArgument
from kvstore.membership.engines import (
    EngineRecord,
    EngineRole,
    VllmKvEvents,
    engine_create_revisions,
)
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.membership.vllm_registration import hold_while_healthy, http_health
from tests.support.etcd import run

EVENTS = VllmKvEvents(endpoint="tcp://10.0.0.5:5557", replay_endpoint="ipc:///run/v/replay",
                      topic="kv", block_size_tokens=32, hash_seed="0", int_block_hashes=False,
                      num_blocks=1024)


def vllm_record(instance_id: str = "vllm-0") -> EngineRecord:
    return EngineRecord(instance_id, EngineRole.PREFILL, "m", "node-a",
                        http_url="http://10.0.0.5:8000", vllm_kv_events=EVENTS)


def test_vllm_fields_round_trip_and_old_records_parse() -> None:
    record = vllm_record()
    assert EngineRecord.from_json(record.to_json()) == record
    doc = json.loads(record.to_json())
    assert doc["vllm_kv_events"]["hash_algo"] == "sha256_cbor"
    assert doc["http_url"] == "http://10.0.0.5:8000"
    old = {"schema": 1, "instance_id": "p", "role": "prefill", "model": "m", "node_id": "n",
           "kv_capacity_tokens": 0, "address": None, "kv_fingerprint": None}
    parsed = EngineRecord.from_json(json.dumps(old).encode())
    assert (parsed.http_url, parsed.vllm_kv_events) == (None, None)
    assert "vllm_kv_events" not in json.loads(parsed.to_json())
    # Defaults for fields a minimal description leaves out.
    minimal = dict(doc, vllm_kv_events={"endpoint": "ipc:///x", "block_size_tokens": 16})
    events = EngineRecord.from_json(json.dumps(minimal).encode()).vllm_kv_events
    assert events == VllmKvEvents("ipc:///x", 16)
    assert (events.hash_seed, events.int_block_hashes) == ("vllm-none-hash", True)


@pytest.mark.parametrize("bad", [
    {"endpoint": "tcp://*:5557"},           # how the publisher binds, not where to connect
    {"endpoint": "tcp://host"},
    {"endpoint": "udp://host:1"},
    {"replay_endpoint": "ipc://"},
    {"block_size_tokens": 0},
    {"block_size_tokens": True},
    {"num_blocks": -1},
    {"hash_algo": ""},
    {"int_block_hashes": "false"},
    {"hash_seed": 0},
])
def test_bad_kv_event_descriptions_are_rejected(bad: dict[str, Any]) -> None:
    fields = {"endpoint": "ipc:///x", "block_size_tokens": 32, **bad}
    with pytest.raises(InvalidArgument):
        VllmKvEvents(**fields)


@pytest.mark.parametrize("url", ["10.0.0.5:8000", "ftp://h:1", "http://", "http://h:99999",
                                 "http://h:1/?q=1"])
def test_bad_http_urls_are_rejected(url: str) -> None:
    with pytest.raises(InvalidArgument):
        EngineRecord("p", EngineRole.PREFILL, "m", "n", http_url=url)
    doc = json.loads(vllm_record().to_json())
    doc["http_url"] = url
    with pytest.raises(InvalidArgument):
        EngineRecord.from_json(json.dumps(doc).encode())


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[str, type[_Health]]]:
    handler = type("Handler", (_Health,), {"status": 200})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_http_health_reads_the_servers_health(health_server: tuple[str, type[_Health]],
                                              aio: asyncio.Runner) -> None:
    url, handler = health_server
    assert aio.run(http_health(url)())
    handler.status = 503
    assert not aio.run(http_health(url)())
    assert not aio.run(http_health("http://127.0.0.1:1")())


async def _wait(check: Callable[[], Any], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


def test_the_record_is_held_only_while_the_server_is_healthy(
        etcd_server: LocalEtcd, etcd_layout: KeyLayout, aio: asyncio.Runner) -> None:
    async def scenario() -> None:
        healthy = False
        changes: list[bool] = []

        async def check() -> bool:
            return healthy

        async with etcd_client(etcd_server.client_url) as client:
            async def revisions() -> dict[str, int]:
                current = await engine_create_revisions(client, layout=etcd_layout)
                return {i: rev for i, (rev, _) in current.items()}

            record = vllm_record()
            task = asyncio.create_task(hold_while_healthy(
                client, [record], check, ttl_s=2, layout=etcd_layout, poll_interval_s=0.05,
                failures_to_drop=2, on_change=changes.append,
                insecure=True))  # EVENTS is on tcp://10.0.0.5 (refused without it)
            try:
                await asyncio.sleep(0.3)  # starting: not healthy yet, so not registered
                assert await revisions() == {}
                healthy = True
                await _wait(lambda: _has(revisions, "vllm-0"), "the record")
                first = (await revisions())["vllm-0"]
                got = await engine_create_revisions(client, layout=etcd_layout)
                assert got["vllm-0"][1] == record
                healthy = False  # the server died: its record goes at once (revoked)
                await _wait(lambda: _lacks(revisions, "vllm-0"), "the record to go")
                healthy = True  # restarted: back under a new lease, a new registration
                await _wait(lambda: _has(revisions, "vllm-0"), "the record back")
                assert (await revisions())["vllm-0"] != first
                assert changes == [True, False, True]
            finally:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert await revisions() == {}  # the sidecar stopping revokes too

    run(aio, scenario())


async def _has(revisions: Callable[[], Any], instance_id: str) -> bool:
    return instance_id in await revisions()


async def _lacks(revisions: Callable[[], Any], instance_id: str) -> bool:
    return instance_id not in await revisions()

"""The front door routing in its own process (``LocalRouter``) in front of a real ``vllm serve``
that publishes its KV cache events, beside a real conductor following the same events: etcd, a
store daemon (engines are schedulable only on a live node), the conductor, vLLM with the
tokenizer. A conversation's turns go through the front door's HTTP endpoint; each is decided
locally, on vLLM's own events (the turn before is in its cache: the match says so), and the
conductor's shadow decision agrees (the same instance, the same cached tokens); the front door's
``done`` hook reports every request done, so nothing stays reserved on either side."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import pytest

from conductor.scheduler import Policy
from kvstore.client.conductor_client import ConductorClient
from kvstore.cluster.vllm_server import VllmServer
from kvstore.frontdoor import Backend, BackendPool, FrontDoor, PromptTokenizer
from kvstore.frontdoor.local import LocalRouter
from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "model"
NODE = "node-a"
BLOCK = 32


@pytest.fixture
def events_dir() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="kvt-ev-", dir="/tmp"))  # AF_UNIX paths are short
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def test_a_conversation_through_the_front_door_is_routed_in_process(
        tmp_path: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout, model_dir: Path,
        tokenizer: PromptTokenizer, events_dir: Path, aio: asyncio.Runner) -> None:
    daemon = DaemonProcess(tmp_path, NODE, etcd_endpoint=etcd_server.client_url,
                           etcd_prefix=etcd_layout.prefix, nvme=False)
    conductor = ConductorProcess(tmp_path, "c0", etcd_endpoint=etcd_server.client_url,
                                 prefix=etcd_layout.prefix, extra_args=(
                                     "--block-size-tokens", str(BLOCK), "--policy",
                                     "global-cache"))
    server = VllmServer(model_dir, tmp_path / "vllm", "v0", model_name=MODEL, block_size=BLOCK,
                        tokenizer=True, kv_events=True, events_dir=events_dir)
    try:
        daemon.start()
        conductor.start()
        server.start()
        aio.run(asyncio.wait_for(_conversation(server, etcd_server.client_url, etcd_layout,
                                               tokenizer), 300))
    finally:
        server.close()
        conductor.stop()
        daemon.stop()


async def _conversation(server: VllmServer, etcd_url: str, layout: KeyLayout,
                        tokenizer: PromptTokenizer) -> None:
    assert server.kv_events_spec is not None
    async with etcd_client(etcd_url) as etcd:
        await put_engine_record(etcd, EngineRecord(
            "v0", EngineRole.PREFILL, MODEL, NODE, http_url=server.base_url,
            vllm_kv_events=server.kv_events_spec), layout=layout)
        await put_engine_record(etcd, EngineRecord(
            "v0.decode", EngineRole.DECODE, MODEL, NODE, kv_capacity_tokens=1 << 20,
            http_url=server.base_url), layout=layout)
    pool = BackendPool([Backend("v0", server.base_url)])
    client = ConductorClient(etcd_endpoint=etcd_url, layout=layout)
    router = LocalRouter(client, pool, MODEL, etcd_endpoint=etcd_url, layout=layout,
                         policy=Policy.GLOBAL_CACHE, block_size_tokens=BLOCK,
                         check_interval_s=0.2, max_check_age_s=2.0)
    door = FrontDoor(pool, tokenizer, router=router)
    try:
        await router.start()
        await _until(lambda: router.stale_reason() is None, "the replica agrees")
        await door.start()
        prompt = "Once upon a time, in a cache far away, " * 12
        async with aiohttp.ClientSession() as http:
            for turn in range(3):
                ids = tokenizer.completion_ids({"prompt": prompt})
                if turn:  # the previous turn's prompt is in vLLM's cache, as both see it
                    lookup = await client.lookup(token_ids=ids, model=MODEL)
                    cached = {e.instance_id: e.cached_tokens for e in lookup.engines}
                    assert cached["v0"] >= BLOCK, cached
                async with http.post(door.url + "/v1/completions", json={
                        "model": MODEL, "prompt": prompt, "max_tokens": 4,
                        "temperature": 0.0}) as answer:
                    body = await answer.json()
                    assert answer.status == 200, body
                    assert answer.headers["x-kvtier-backend"] == "v0"
                assert router.last_fallback == "", router.last_fallback
                await router.idle()
                view = router.engine_cache.view("v0")
                full = len(ids) // BLOCK
                await _until(lambda view=view, full=full: view is not None and
                             len(view) >= full, f"vLLM's events hold turn {turn}'s blocks")
                prompt += body["choices"][0]["text"] + " And then the story went on. " * 4
        async with aiohttp.ClientSession() as http, http.get(door.url + "/health") as answer:
            health = await answer.json()
        assert health["routing"]["local"] and health["routing"]["stale_reason"] is None
        assert health["routing"]["counters"]["local"] == 3
        assert router.counters["local"] == 3
        assert (router.counters["shadow_agreed"], router.counters["shadow_disagreed"]) == \
            (3, 0), list(router.disagreements)
        assert router.counters["report_failed"] == 0
        assert router.scheduler.outstanding() == 0
        view = router.engine_cache.view("v0")
        assert view is not None and not view.stats.mismatch
        assert view.stats.probes_matched >= 1  # a routed prompt's block appeared in its events
    finally:
        await door.close()
        await router.close()
        await client.close()


async def _until(check: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.1)

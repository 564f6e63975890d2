"""Prefill/decode disaggregation through kvtier with real components: a kvtier daemon, two
``vllm serve`` instances with kvtier's connector and the tiny checkpoint's tokenizer (the
session's ``kv_both`` server of conftest.py prefills; this module's ``kv_consumer`` server
decodes) and the front door in P/D mode (``PdRouter``).

Checked: greedy answers identical to a colocated single instance (text and chat, streaming and
not); the decode instance loaded the prompt's full blocks from kvtier and computed only the
last partial block (its ``/metrics``); the prefill's KV stays in the store for a later request
(the decode instance's own prefix cache reset first); a dead prefill backend still gives the
answer, through the decode alone. The decode's wait for puts still in flight is tested with
vLLM's real Scheduler (tests/integrations/test_vllm_pd_unit.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.vllm_server import VllmServer, free_port
from kvstore.frontdoor import Backend, BackendPool, FrontDoor, PdRouter, PromptTokenizer
from tests.frontdoor.conftest import MODEL, kv_transfer_config
from tests.frontdoor.support import DoorThread, frontdoor_command, request, sse_events
from tests.support.daemon import DaemonProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BLOCK = 32
LOADED = "vllm:kvtier_loaded_blocks_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def decode(model_dir: Path, kvtier_daemon: DaemonProcess,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The decode instance: loads only; dev mode for ``/reset_prefix_cache``."""
    server = VllmServer(model_dir, tmp_path_factory.mktemp("vllm-decode"), "decode",
                        model_name=MODEL, tokenizer=True, env={"VLLM_SERVER_DEV_MODE": "1"},
                        kv_transfer_config=kv_transfer_config(kvtier_daemon, "kv_consumer"))
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def pd_door(vllm: VllmServer, decode: VllmServer,
            tokenizer: PromptTokenizer) -> Iterator[DoorThread]:
    p, d = Backend("prefill", vllm.base_url), Backend("decode", decode.base_url)
    pool = BackendPool([p, d])
    thread = DoorThread(lambda: FrontDoor(pool, tokenizer, router=PdRouter(pool, [p], [d])))
    thread.start()
    try:
        yield thread
    finally:
        thread.close()


WORDS = ["cache", "block", "prefix", "decode", "prefill", "store", "tier", "daemon", "token", "window", "shard", "lease", "segment", "arena", "chunk", "router", "conductor", "engine", "latency", "transfer"]


def _text(seed: int, tokenizer: PromptTokenizer, words: int = 60) -> str:
    """A text prompt of several blocks whose token count is not a multiple of the block."""
    picked = [WORDS[(seed * 7 + i * 11) % len(WORDS)] for i in range(words)]
    text = f"Story {seed}: " + " ".join(picked)
    while len(tokenizer.completion_ids({"prompt": text})) % BLOCK == 0:
        text += " end"
    return text


def _body(endpoint: str, seed: int, tokenizer: PromptTokenizer, **fields: Any
          ) -> tuple[dict[str, Any], list[int]]:
    base = {"model": MODEL, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    if endpoint == "/v1/completions":
        body = {**base, "prompt": _text(seed, tokenizer), **fields}
        return body, tokenizer.completion_ids(body)
    for extra in range(BLOCK):
        content = _text(seed, tokenizer) + " more" * extra
        body = {**base, "messages": [{"role": "user", "content": content}], **fields}
        ids = tokenizer.chat_ids(body)
        if len(ids) % BLOCK:
            return body, ids
    raise AssertionError("no chat prompt off the block boundary")


def _answer(endpoint: str, answer: dict[str, Any]) -> tuple[str, list[int]]:
    choice = answer["choices"][0]
    text = choice["text"] if endpoint == "/v1/completions" else choice["message"]["content"]
    return text, list(choice["token_ids"])


def _streamed(endpoint: str, events: list[str]) -> tuple[str, list[int]]:
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if endpoint == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks)
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or ()]
    return text, ids


def _reference(vllm: VllmServer, endpoint: str, body: dict[str, Any]) -> tuple[str, list[int]]:
    """The colocated answer: one instance computes the whole request (under a salt nobody
    else uses: no block of it is found anywhere)."""
    status, _, answer = request(vllm.base_url, "POST", endpoint,
                                {**body, "cache_salt": f"colocated-{time.monotonic_ns()}"})
    assert status == 200, answer
    return _answer(endpoint, answer)


def _delta(server: VllmServer, before: dict[str, float], name: str) -> float:
    return server.metrics().get(name, 0.0) - before.get(name, 0.0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_pd_answers_as_a_colocated_instance_and_the_decode_loads_the_prompt(
        pd_door: DoorThread, vllm: VllmServer, decode: VllmServer,
        tokenizer: PromptTokenizer, endpoint: str, stream: bool) -> None:
    body, ids = _body(endpoint, seed=10 + 2 * int(stream) + int(endpoint != "/v1/completions"),
                      tokenizer=tokenizer)
    full = len(ids) // BLOCK
    assert full >= 2 and len(ids) % BLOCK
    reference = _reference(vllm, endpoint, body)
    d_before, p_before = decode.metrics(), vllm.metrics()
    if stream:
        status, headers, events = sse_events(pd_door.url, endpoint, {**body, "stream": True})
        assert status == 200
        got = _streamed(endpoint, events)
    else:
        status, headers, answer = request(pd_door.url, "POST", endpoint, body)
        assert status == 200, answer
        got = _answer(endpoint, answer)
        assert answer["usage"]["prompt_tokens"] == len(ids)
    assert headers["x-kvtier-backend"] == "decode"
    assert headers["x-kvtier-prefill"] == "prefill" and "x-kvtier-pd-fallback" not in headers
    assert got == reference and got[0] != ""
    # The decode took the prompt's full blocks from kvtier and computed only the last partial
    # block; the prefill handed them off.
    assert _delta(decode, d_before, LOADED) == full
    assert _delta(decode, d_before, EXTERNAL_HITS) == full * BLOCK
    assert _delta(decode, d_before, LOCAL_HITS) == 0
    assert _delta(decode, d_before, "vllm:kvtier_pd_received_total") == 1
    assert _delta(decode, d_before, "vllm:kvtier_pd_mismatches_total") == 0
    assert _delta(decode, d_before, "vllm:kvtier_pd_wait_timeouts_total") == 0
    assert _delta(vllm, p_before, "vllm:kvtier_pd_sent_total") == 1
    assert _delta(vllm, p_before, "vllm:kvtier_pd_sent_blocks_total") == full


def test_the_prefills_kv_stays_in_the_store_for_later_requests(
        pd_door: DoorThread, vllm: VllmServer, decode: VllmServer,
        tokenizer: PromptTokenizer) -> None:
    body, ids = _body("/v1/completions", seed=40, tokenizer=tokenizer)
    full = len(ids) // BLOCK
    status, headers, first = request(pd_door.url, "POST", "/v1/completions", body)
    assert status == 200 and headers["x-kvtier-prefill"] == "prefill"
    # The decode instance forgets its own copy; a later plain request (no hand-off) of the
    # same prompt finds the prefill's blocks in kvtier.
    status, _, reset = request(decode.base_url, "POST", "/reset_prefix_cache")
    assert status == 200 and reset == {"success": True}
    before = decode.metrics()
    status, _, again = request(decode.base_url, "POST", "/v1/completions", body)
    assert status == 200
    assert _delta(decode, before, EXTERNAL_HITS) == full * BLOCK
    assert _delta(decode, before, LOCAL_HITS) == 0
    assert _delta(decode, before, "vllm:kvtier_pd_received_total") == 0
    assert _answer("/v1/completions", again) == _answer("/v1/completions", first)


def test_a_dead_prefill_backend_falls_back_to_the_decode_alone(
        vllm: VllmServer, decode: VllmServer, tokenizer: PromptTokenizer) -> None:
    dead, d = Backend("dead", f"http://127.0.0.1:{free_port()}"), Backend("decode",
                                                                          decode.base_url)
    pool = BackendPool([dead, d])
    thread = DoorThread(lambda: FrontDoor(pool, tokenizer, router=PdRouter(pool, [dead], [d]),
                                          probe_interval_s=60))
    thread.start()
    try:
        for seed, why in ((60, "prefill-unreachable"), (61, "no-healthy-prefill-backend")):
            body, _ids = _body("/v1/chat/completions", seed=seed, tokenizer=tokenizer)
            reference = _reference(vllm, "/v1/chat/completions", body)
            before = decode.metrics()
            status, headers, answer = request(thread.url, "POST", "/v1/chat/completions", body)
            assert status == 200, answer
            assert headers["x-kvtier-backend"] == "decode"
            assert headers["x-kvtier-pd-fallback"] == why
            assert _answer("/v1/chat/completions", answer) == reference
            assert _delta(decode, before, "vllm:kvtier_pd_received_total") == 0
        assert thread.door is not None
        assert thread.door.counters["pd_fallbacks"] == 2
        assert thread.door.counters["pd_requests"] == 2
    finally:
        thread.close()


def test_the_kvtier_frontdoor_command_in_pd_mode(
        vllm: VllmServer, decode: VllmServer, model_dir: Path, tokenizer: PromptTokenizer,
        tmp_path: Path) -> None:
    with frontdoor_command(["--prefill", f"p0={vllm.base_url}", "--decode",
                            f"d0={decode.base_url}", "--model-dir", str(model_dir)],
                           tmp_path / "frontdoor.log") as ready:
        assert ready["router"] == "pd" and ready["prefill"] == ["p0"] \
            and ready["decode"] == ["d0"]
        body, _ids = _body("/v1/completions", seed=70, tokenizer=tokenizer)
        reference = _reference(vllm, "/v1/completions", body)
        status, headers, events = sse_events(ready["url"], "/v1/completions",
                                             {**body, "stream": True})
        assert status == 200 and headers["x-kvtier-prefill"] == "p0"
        assert headers["x-kvtier-backend"] == "d0"
        assert _streamed("/v1/completions", events) == reference

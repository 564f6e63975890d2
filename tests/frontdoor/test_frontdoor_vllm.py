"""The front door in front of a real ``vllm serve`` (kvstore/cluster/vllm_server.py) that loads
the tiny checkpoint's tokenizer: text and chat completions, streaming and not, token-id prompts,
the same greedy answers through the front door as straight from vLLM, the prompt's token ids
the front door routed on equal to vLLM's own, a dead backend, a client that goes away
mid-stream, bad input, a router's ``done`` hook, and ``kvtier frontdoor`` itself.

One vLLM server (tests/frontdoor/conftest.py: shared with test_pd.py, with kvtier's connector)
for the session; the dead backend is a port nobody listens on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.vllm_server import VllmServer, free_port
from kvstore.frontdoor import (
    Backend,
    BackendPool,
    FrontDoor,
    PromptTokenizer,
    Rejection,
    RoundRobinRouter,
    RouteRequest,
)
from tests.frontdoor.support import (
    DoorThread,
    connection,
    frontdoor_command,
    request,
    sse_events,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "model"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a short story about the cache."}]
TEXT = "Hello, tell me a story about the key value cache"


@pytest.fixture(scope="module")
def door(vllm: VllmServer, tokenizer: PromptTokenizer) -> Iterator[DoorThread]:
    thread = DoorThread(lambda: FrontDoor([Backend("vllm-0", vllm.base_url)], tokenizer))
    thread.start()
    try:
        yield thread
    finally:
        thread.close()


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **fields}


def _post(base_url: str, path: str, body: Any) -> dict[str, Any]:
    status, _headers, answer = request(base_url, "POST", path, body)
    assert status == 200, answer
    return answer  # type: ignore[no-any-return]


def test_text_completion_same_answer_and_same_prompt_ids_as_vllm(
        door: DoorThread, vllm: VllmServer, tokenizer: PromptTokenizer) -> None:
    body = _body(prompt=TEXT)
    status, headers, via_door = request(door.url, "POST", "/v1/completions", body)
    assert status == 200, via_door
    assert headers["x-kvtier-backend"] == "vllm-0"
    direct = _post(vllm.base_url, "/v1/completions", body)
    ours = tokenizer.completion_ids(body)
    assert via_door["choices"][0]["prompt_token_ids"] == ours
    assert vllm.tokenize(prompt=TEXT) == ours
    assert via_door["choices"][0]["text"] == direct["choices"][0]["text"] != ""
    assert via_door["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
    assert len(via_door["choices"][0]["token_ids"]) == 12
    assert door.door is not None and door.door.counters["prompt_token_mismatches"] == 0


def test_chat_completion_same_answer_and_same_prompt_ids_as_vllm(
        door: DoorThread, vllm: VllmServer, tokenizer: PromptTokenizer) -> None:
    body = _body(messages=MESSAGES)
    via_door = _post(door.url, "/v1/chat/completions", body)
    direct = _post(vllm.base_url, "/v1/chat/completions", body)
    ours = tokenizer.chat_ids(body)
    assert via_door["prompt_token_ids"] == ours  # what vLLM rendered with the template
    assert vllm.tokenize(messages=MESSAGES) == ours
    assert via_door["usage"]["prompt_tokens"] == len(ours)
    assert via_door["choices"][0]["message"]["content"] == \
        direct["choices"][0]["message"]["content"]
    assert via_door["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]


def test_token_id_prompt(door: DoorThread, vllm: VllmServer) -> None:
    body = _body(prompt=[1, 17, 300, 42, 99, 1000, 5])
    via_door = _post(door.url, "/v1/completions", body)
    direct = vllm.complete([1, 17, 300, 42, 99, 1000, 5], max_tokens=12)
    assert via_door["choices"][0]["token_ids"] == direct.token_ids
    assert via_door["choices"][0]["prompt_token_ids"] == body["prompt"]


def _stream(base_url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, headers, events = sse_events(base_url, path, {**body, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_chunks_concatenate_to_the_greedy_answer(
        door: DoorThread, endpoint: str) -> None:
    body = _body(prompt=TEXT) if endpoint == "/v1/completions" else _body(messages=MESSAGES)
    whole = _post(door.url, endpoint, body)["choices"][0]
    chunks = _stream(door.url, endpoint, body)
    assert len(chunks) >= 12  # one event per token (chat adds the role's)
    if endpoint == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks)
        ids = [t for c in chunks for t in c["choices"][0]["token_ids"] or ()]
        assert text == whole["text"] and ids == whole["token_ids"]
    else:
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert text == whole["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_models_and_health(door: DoorThread) -> None:
    status, _headers, models = request(door.url, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [MODEL]
    status, _, health = request(door.url, "GET", "/health")
    assert status == 200
    assert health["backends"] == [{"name": "vllm-0", "url": door.door.pool.all()[0].url,  # type: ignore[union-attr]
                                   "healthy": True}]


@pytest.mark.parametrize(("path", "raw", "message"), [
    ("/v1/completions", b"{not json", "invalid JSON"),
    ("/v1/completions", b"[1, 2]", "JSON object"),
    ("/v1/completions", b'{"model": "model"}', "prompt must be"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "stream": "yes"}', "stream must be"),
    ("/v1/chat/completions", b'{"messages": [{"role": "tool", "content": "x"}]}',
     "unknown role"),
    ("/v1/chat/completions", b'{"messages": []}', "messages must be"),
])
def test_bad_input_is_400_from_the_front_door(door: DoorThread, path: str, raw: bytes,
                                              message: str) -> None:
    status, headers, answer = request(door.url, "POST", path, raw=raw)
    assert status == 400
    assert "x-kvtier-backend" not in headers  # never reached vLLM
    assert message in answer["error"]["message"]


def test_an_error_of_vllm_passes_through(door: DoorThread) -> None:
    """A prompt longer than the server's max_model_len: vLLM's own 400, relayed."""
    status, headers, answer = request(door.url, "POST", "/v1/completions",
                                      _body(prompt=[5] * 1100))
    assert status == 400 and headers["x-kvtier-backend"] == "vllm-0"
    assert "error" in answer


def test_a_dead_backend_is_502_and_the_next_request_goes_elsewhere(
        vllm: VllmServer, tokenizer: PromptTokenizer) -> None:
    dead = Backend("dead", f"http://127.0.0.1:{free_port()}")
    alive = Backend("alive", vllm.base_url)
    thread = DoorThread(lambda: FrontDoor(BackendPool([dead, alive]), tokenizer,
                                          probe_interval_s=0.2))
    thread.start()
    try:
        status, headers, answer = request(thread.url, "POST", "/v1/completions",
                                          _body(prompt=TEXT))
        assert status == 502, answer
        assert "dead" in answer["error"]["message"] and dead.url in answer["error"]["message"]
        for _ in range(3):
            status, headers, answer = request(thread.url, "POST", "/v1/completions",
                                              _body(prompt=TEXT, max_tokens=2))
            assert status == 200 and headers["x-kvtier-backend"] == "alive"
        status, _, health = request(thread.url, "GET", "/health")
        assert status == 200
        assert {b["name"]: b["healthy"] for b in health["backends"]} == \
            {"dead": False, "alive": True}
        assert health["counters"]["backend_errors"] == 1
    finally:
        thread.close()


def _metric(server: VllmServer, name: str, label: str = "") -> float:
    """One counter from vLLM's /metrics, summed over the samples whose labels contain
    ``label``."""
    text = server.request("GET", "/metrics").decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            sample, _, value = line.rpartition(" ")
            if label in sample:
                total += float(value)
    return total


def test_a_client_that_leaves_mid_stream_cancels_the_vllm_request(
        door: DoorThread, vllm: VllmServer) -> None:
    max_tokens = 900
    generated_before = _metric(vllm, "vllm:generation_tokens_total")
    finished_before = _metric(vllm, "vllm:request_success_total")  # stop / length
    conn = connection(door.url)
    conn.request("POST", "/v1/completions",
                 body=json.dumps(_body(prompt=TEXT, max_tokens=max_tokens,
                                       stream=True)).encode(),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    events = 0
    while events < 3:
        if resp.readline().startswith(b"data: "):
            events += 1
    conn.sock.close()  # the client is gone, mid-stream
    conn.close()
    deadline = time.monotonic() + 120
    while _metric(vllm, "vllm:num_requests_running") > 0 or \
            _metric(vllm, "vllm:generation_tokens_total") == generated_before:
        assert time.monotonic() < deadline, "vLLM still runs the abandoned request"
        time.sleep(0.2)
    generated = _metric(vllm, "vllm:generation_tokens_total") - generated_before
    assert 3 <= generated < max_tokens
    assert _metric(vllm, "vllm:request_success_total") == finished_before  # aborted
    assert door.door is not None and door.door.counters["client_disconnects"] >= 1


def test_the_kvtier_frontdoor_command(vllm: VllmServer, model_dir: Path,
                                      tmp_path: Path) -> None:
    with frontdoor_command(["--backend", f"v0={vllm.base_url}", "--model-dir", str(model_dir)],
                           tmp_path / "frontdoor.log") as ready:
        assert ready["backends"] == {"v0": vllm.base_url}
        body = _body(messages=MESSAGES, max_tokens=4)
        status, headers, answer = request(ready["url"], "POST", "/v1/chat/completions", body)
        assert status == 200 and headers["x-kvtier-backend"] == "v0"
        assert answer["choices"][0]["token_ids"] == vllm.chat(MESSAGES, max_tokens=4).token_ids


class _RecordingRouter(RoundRobinRouter):
    """Round robin that records what it routed and the ``done`` and ``first_token`` calls the
    front door makes (in order)."""

    def __init__(self, pool: BackendPool) -> None:
        super().__init__(pool)
        self.routed: list[str] = []
        self.done_calls: list[str] = []
        self.calls: list[tuple[str, str]] = []

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | Rejection:
        decision = await super().route(token_ids, request)
        if isinstance(decision, Backend):
            self.routed.append(request.request_id)
        return decision

    def done(self, request_id: str, output_tokens: int = 0) -> None:
        self.done_calls.append(request_id)
        self.calls.append(("done", request_id))

    def first_token(self, request_id: str) -> None:
        self.calls.append(("first_token", request_id))


def test_the_router_hears_when_each_request_it_routed_ended(
        vllm: VllmServer, tokenizer: PromptTokenizer) -> None:
    """What a router that reserves capacity per request (LocalRouter) relies on: one ``done``
    per routed request, whether vLLM answered, streamed, refused it, or was unreachable; none
    for a request the front door itself refused. A streamed answer's first bytes are a
    ``first_token`` call before its ``done`` (the conductor's queue and speed learn from it);
    every answer from a backend names the request's id."""
    dead = Backend("dead", f"http://127.0.0.1:{free_port()}")
    alive = Backend("alive", vllm.base_url)
    pool = BackendPool([dead, alive])
    router = _RecordingRouter(pool)
    thread = DoorThread(lambda: FrontDoor(pool, tokenizer, router=router,
                                          probe_interval_s=60.0))
    thread.start()
    try:
        status, _, _ = request(thread.url, "POST", "/v1/completions", _body(prompt=TEXT))
        assert status == 502  # the dead backend's turn: marked down
        status, _, _ = request(thread.url, "POST", "/v1/completions", _body(prompt=TEXT))
        assert status == 200
        status, headers, _ = request(thread.url, "POST", "/v1/completions",
                                     _body(prompt=TEXT, stream=True))
        assert status == 200
        streamed = router.routed[-1]
        assert headers["x-kvtier-request-id"] == streamed
        status, _, _ = request(thread.url, "POST", "/v1/completions",
                               _body(prompt=[5] * 1100))
        assert status == 400  # vLLM's own refusal (longer than max_model_len), relayed
        status, _, _ = request(thread.url, "POST", "/v1/completions", raw=b"{not json")
        assert status == 400  # the front door's: never routed
        assert len(router.routed) == 4
        assert router.done_calls == router.routed
        assert [call for call in router.calls if call[1] == streamed] == [
            ("first_token", streamed), ("done", streamed)]
        assert [c for c in router.calls if c[0] == "first_token"] == [("first_token", streamed)]
    finally:
        thread.close()

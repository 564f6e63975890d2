"""The front door: an OpenAI-compatible HTTP endpoint in front of ``vllm serve`` instances.

For ``POST /v1/completions`` and ``POST /v1/chat/completions`` it

1. parses the JSON body (400 if it is not a JSON object),
2. computes the prompt's token ids as vLLM will (:class:`~kvstore.frontdoor.tokenizer.
   PromptTokenizer`: the same tokenizer files, the chat template for messages; 400 for a
   malformed prompt or messages),
3. asks the :class:`~kvstore.frontdoor.router.Router` for a backend (a rejection is its
   status, 429 or 503, with the reason); a router with a ``done`` hook is told when the
   request ended (answered, failed or abandoned), one with a ``first_token`` hook when the
   first bytes of a streamed answer were relayed (the request's prefill is over),
4. forwards the request body unchanged to that backend and relays the answer: a
   non-streaming one whole (status and body as vLLM gave them, 4xx included), a streaming one
   (``"stream": true``, Server-Sent Events) chunk by chunk as the bytes arrive.

Every answer the front door makes itself is an OpenAI error object (``{"error": {"message",
"type", "code"}}``); answers that went to a backend carry ``x-kvtier-backend: <name>`` and
``x-kvtier-request-id: <the front door's id of the request>``.

Errors: a backend that refuses the connection or drops it before answering is marked down
(the router skips it) and the client gets 502 naming it; the probe loop marks it up again once
its ``/health`` answers 200. A backend that stops mid-stream ends the stream with an SSE
``error`` event (the 200 is already sent). A read timeout is 504. A client that disconnects
cancels its handler (aiohttp's ``handler_cancellation``), which closes the connection to the
backend, and vLLM aborts the request.

**P/D mode** (the router answers a :class:`~kvstore.frontdoor.router.PdPair`): the request is
first sent to the prefill backend with ``max_tokens=1`` (``max_completion_tokens`` too, if
given), ``"stream": false``, no ``stream_options`` nor ``min_tokens``, and
``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false}`` (what vLLM's
own P/D proxies send); the ``kv_transfer_params`` it answers (kvtier's connector: how many
blocks of the prompt it left in the store) are added to the original request, which goes to
the decode backend and is relayed as above (``x-kvtier-prefill: <name>``). A prefill that
fails in any way (unreachable, timed out, an error status, no ``kv_transfer_params`` in its
answer, no healthy prefill backend) is never the client's failure: the original request goes
to the decode backend as it is, which computes the prompt itself, and the answer says so in
``x-kvtier-pd-fallback: <reason>`` (counted: ``pd_fallbacks``).

``GET /v1/models`` is the answer of a healthy backend; ``GET /health`` is 200 with the
backends' states while at least one is healthy, else 503 (with a
:class:`~kvstore.frontdoor.local.LocalRouter`, also ``routing``: whether it decides in process
now, why not, and its counters).

Mismatch check: a non-streaming answer's ``usage.prompt_tokens`` is compared with the
front door's own token count; a difference is logged and counted (``counters``), since the
router then saw other ids than vLLM computed.

The constructor records settings; :meth:`FrontDoor.start` binds the port (0: any free one)
and starts the probe loop; :meth:`FrontDoor.close` stops both. asyncio only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web

from kvstore.errors import InvalidArgument
from kvstore.frontdoor.router import (
    Backend,
    BackendPool,
    PdPair,
    Rejection,
    RoundRobinRouter,
    Router,
    RouteRequest,
)
from kvstore.frontdoor.tokenizer import PromptTokenizer

__all__ = ["READY_PREFIX", "FrontDoor", "prefill_body"]

log = logging.getLogger(__name__)

READY_PREFIX = "KVTIER-FRONTDOOR-READY"
"""``kvtier frontdoor`` prints this and a JSON object (url, port, backends) once it serves."""

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BACKEND_HEADER = "x-kvtier-backend"
REQUEST_ID_HEADER = "x-kvtier-request-id"
"""The front door's id of the request (what the router and the conductor know it by)."""
PREFILL_HEADER = "x-kvtier-prefill"
"""P/D: the backend that prefilled the request."""
PD_FALLBACK_HEADER = "x-kvtier-pd-fallback"
"""P/D: why the decode backend computed the prompt itself (the prefill hop failed)."""
PD_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""The prefill hop's ``kv_transfer_params`` (vLLM's P/D convention)."""
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                   aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError)
"""The backend is gone or unreachable (a read timeout, ``ServerTimeoutError``, is not)."""


def _error(status: int, message: str, kind: str, code: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None,
                      "code": code if code is not None else status}}
    return web.json_response(body, status=status)


class FrontDoor:
    """See the module docstring. ``router`` defaults to round robin over ``pool``."""

    def __init__(self, pool: BackendPool | Sequence[Backend], tokenizer: PromptTokenizer, *,
                 router: Router | None = None, host: str = "127.0.0.1", port: int = 0,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0,
                 probe_interval_s: float = 1.0) -> None:
        if connect_timeout_s <= 0 or read_timeout_s <= 0 or probe_interval_s <= 0:
            raise InvalidArgument("timeouts and the probe interval must be positive")
        self.pool = pool if isinstance(pool, BackendPool) else BackendPool(pool)
        self.tokenizer = tokenizer
        self.router: Router = router if router is not None else RoundRobinRouter(self.pool)
        self.host = host
        self.port = port
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._probe_interval_s = probe_interval_s
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._probe: asyncio.Task[None] | None = None
        self.counters: dict[str, int] = {
            "requests": 0, "rejected": 0, "bad_requests": 0, "backend_errors": 0,
            "client_disconnects": 0, "prompt_token_mismatches": 0, "pd_requests": 0,
            "pd_fallbacks": 0}

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post(COMPLETIONS, self._completions)
        app.router.add_post(CHAT, self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, connect=self._connect_timeout_s,
                                          sock_read=self._read_timeout_s))
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self._probe = asyncio.create_task(self._probe_loop())

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> FrontDoor:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "start() first"
        return self._session

    # -- handlers --------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        self.counters["requests"] += 1
        raw = await request.read()
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise InvalidArgument("the request body must be a JSON object")
            if endpoint == CHAT:
                token_ids = self.tokenizer.chat_ids(body)
            else:
                token_ids = self.tokenizer.completion_ids(body)
            route = _route_request(body, endpoint)
        except (ValueError, InvalidArgument) as exc:  # JSONDecodeError is a ValueError
            self.counters["bad_requests"] += 1
            message = f"invalid JSON: {exc}" if isinstance(exc, json.JSONDecodeError) \
                else str(exc)
            return _error(400, message, "invalid_request_error")
        decision = await self.router.route(token_ids, route)
        if isinstance(decision, Rejection):
            self.counters["rejected"] += 1
            return _error(decision.status, decision.reason, "rejected", decision.code)
        try:
            if isinstance(decision, PdPair):
                return await self._forward_pd(request, decision, endpoint, body, route,
                                              len(token_ids))
            return await self._forward(request, decision, endpoint, raw, route,
                                       len(token_ids))
        finally:
            done = getattr(self.router, "done", None)
            if done is not None:  # the router's reservations for it end (see Router)
                done(route.request_id, 0)

    # -- P/D -------------------------------------------------------------------------------

    async def _forward_pd(self, request: web.Request, pair: PdPair, endpoint: str,
                          body: dict[str, Any], route: RouteRequest, prompt_tokens: int
                          ) -> web.StreamResponse:
        """Prefill on ``pair.prefill``, then decode on ``pair.decode`` with the prefill's
        ``kv_transfer_params``; any prefill failure falls back to the decode alone."""
        self.counters["pd_requests"] += 1
        params: dict[str, Any] | None = None
        if pair.prefill is None:
            why: str | None = "no-healthy-prefill-backend"
        else:
            params, why = await self._prefill(pair.prefill, endpoint, body, route)
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
            headers = {PREFILL_HEADER: pair.prefill.name if pair.prefill else ""}
        else:
            self.counters["pd_fallbacks"] += 1
            assert why is not None
            log.warning("request %s: prefill hop failed (%s): decoded on %s alone",
                        route.request_id, why, pair.decode.name)
            headers = {PD_FALLBACK_HEADER: why}
        return await self._forward(request, pair.decode, endpoint,
                                   json.dumps(decode_body).encode(), route, prompt_tokens,
                                   headers)

    async def _prefill(self, backend: Backend, endpoint: str, body: dict[str, Any],
                       route: RouteRequest) -> tuple[dict[str, Any] | None, str | None]:
        """The prefill hop: the ``kv_transfer_params`` the backend answered, or None and why
        not (a short token for the fallback header)."""
        hop = prefill_body(body)
        headers = {"Content-Type": "application/json",
                   "X-Request-Id": route.request_id + "-prefill"}
        try:
            async with self.session.post(backend.url + endpoint, data=json.dumps(hop),
                                         headers=headers) as upstream:
                status = upstream.status
                payload = await upstream.read()
        except _CONNECT_ERRORS as exc:
            self._backend_down(backend, exc)
            return None, "prefill-unreachable"
        except (TimeoutError, aiohttp.ClientPayloadError) as exc:
            self.counters["backend_errors"] += 1
            log.warning("prefill backend %s: %s: %s", backend.name, type(exc).__name__, exc)
            return None, "prefill-failed"
        if status != 200:
            return None, f"prefill-status-{status}"
        try:
            params = json.loads(payload).get("kv_transfer_params")
        except (ValueError, AttributeError):
            return None, "prefill-bad-answer"
        if not isinstance(params, dict) or not params:
            return None, "prefill-no-kv-transfer-params"
        return params, None

    # -- one backend -----------------------------------------------------------------------

    async def _forward(self, request: web.Request, backend: Backend, endpoint: str,
                       raw: bytes, route: RouteRequest, prompt_tokens: int,
                       extra_headers: Mapping[str, str] | None = None) -> web.StreamResponse:
        extra = dict(extra_headers or {})
        headers = {"Content-Type": "application/json", "X-Request-Id": route.request_id}
        try:
            upstream = await self.session.post(backend.url + endpoint, data=raw,
                                               headers=headers)
        except _CONNECT_ERRORS as exc:
            return self._backend_down(backend, exc)
        except TimeoutError:
            self.counters["backend_errors"] += 1
            return _error(504, f"backend {backend.name} ({backend.url}) did not answer in "
                               f"time", "backend_timeout")
        finished = False
        try:
            if route.stream and upstream.status == 200 and \
                    upstream.content_type == "text/event-stream":
                stream, finished = await self._relay_stream(request, backend, upstream,
                                                            extra, route.request_id)
                return stream
            else:
                payload = await upstream.read()
                if upstream.status == 200 and not route.stream:
                    self._check_prompt_tokens(backend, payload, prompt_tokens)
                response = web.Response(body=payload, status=upstream.status, headers={
                    "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                    BACKEND_HEADER: backend.name, REQUEST_ID_HEADER: route.request_id,
                    **extra})
            finished = True
            return response
        except _CONNECT_ERRORS as exc:
            return self._backend_down(backend, exc)
        except TimeoutError:
            self.counters["backend_errors"] += 1
            return _error(504, f"backend {backend.name} ({backend.url}) stopped answering",
                          "backend_timeout")
        except asyncio.CancelledError:  # the client went away (handler_cancellation)
            self.counters["client_disconnects"] += 1
            raise
        finally:
            if finished:
                upstream.release()
            else:
                upstream.close()  # drop the connection: vLLM aborts the request

    async def _relay_stream(self, request: web.Request, backend: Backend,
                            upstream: aiohttp.ClientResponse, extra: Mapping[str, str],
                            request_id: str) -> tuple[web.StreamResponse, bool]:
        """Relay the SSE bytes as they come; also whether the backend's stream was read to
        its end (False: the client went away and the backend's request must be dropped).
        The router's ``first_token`` hook, if it has one, is called once the first bytes
        came: vLLM sends nothing of a completion before its first token, so the prefill
        (queue included) is over then."""
        response = web.StreamResponse(status=200, headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache", BACKEND_HEADER: backend.name,
            REQUEST_ID_HEADER: request_id, **extra})
        await response.prepare(request)
        first_token = getattr(self.router, "first_token", None)
        try:
            async for chunk in upstream.content.iter_any():
                if first_token is not None:
                    first_token(request_id)
                    first_token = None
                await response.write(chunk)
        except (aiohttp.ClientPayloadError, *_CONNECT_ERRORS, TimeoutError) as exc:
            self.counters["backend_errors"] += 1
            if not isinstance(exc, TimeoutError):
                self.pool.mark_down(backend)
            event = {"error": {"message": f"backend {backend.name} ({backend.url}) failed "
                                          f"mid-stream: {exc}", "type": "backend_error",
                               "code": 502}}
            await response.write(f"event: error\ndata: {json.dumps(event)}\n\n".encode())
        except ConnectionResetError:  # a write to a client that went away
            self.counters["client_disconnects"] += 1
            return response, False
        await response.write_eof()
        return response, True

    def _backend_down(self, backend: Backend, exc: BaseException) -> web.Response:
        self.counters["backend_errors"] += 1
        self.pool.mark_down(backend)
        log.warning("backend %s (%s) unreachable: %s; marked down", backend.name, backend.url,
                    exc)
        return _error(502, f"backend {backend.name} ({backend.url}) is unreachable: {exc}",
                      "backend_unavailable")

    def _check_prompt_tokens(self, backend: Backend, payload: bytes, expected: int) -> None:
        try:
            got = json.loads(payload)["usage"]["prompt_tokens"]
        except (ValueError, KeyError, TypeError):
            return
        if got != expected:
            self.counters["prompt_token_mismatches"] += 1
            log.warning("backend %s counted %s prompt tokens, the front door %d: its tokenizer "
                        "differs from the backend's, so routing saw other token ids",
                        backend.name, got, expected)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        errors = []
        for backend in self.pool.healthy():
            try:
                async with self.session.get(backend.url + "/v1/models") as upstream:
                    payload = await upstream.read()
                    return web.Response(body=payload, status=upstream.status, headers={
                        "Content-Type": upstream.headers.get("Content-Type",
                                                             "application/json"),
                        BACKEND_HEADER: backend.name})
            except (*_CONNECT_ERRORS, TimeoutError) as exc:
                self._backend_down(backend, exc)
                errors.append(f"{backend.name}: {exc}")
        return _error(503, "no healthy backend" + (f" ({'; '.join(errors)})" if errors else ""),
                      "backend_unavailable")

    async def _health(self, request: web.Request) -> web.StreamResponse:
        backends = [{"name": b.name, "url": b.url, "healthy": self.pool.is_healthy(b)}
                    for b in self.pool.all()]
        ok = any(b["healthy"] for b in backends)
        body: dict[str, Any] = {"status": "ok" if ok else "no healthy backend",
                                "backends": backends, "counters": dict(self.counters)}
        router: Any = self.router
        router = getattr(router, "inner", router)  # a TimedRouter's
        if hasattr(router, "stale_reason"):  # LocalRouter: deciding here, or why not
            body["routing"] = {"local": router.stale_reason() is None,
                               "stale_reason": router.stale_reason(),
                               "counters": dict(router.counters)}
        return web.json_response(body, status=200 if ok else 503)

    # -- health probes ---------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        """Every ``probe_interval_s``: ``GET /health`` of each backend marked down; up on 200."""
        timeout = aiohttp.ClientTimeout(total=self._connect_timeout_s)
        while True:
            await asyncio.sleep(self._probe_interval_s)
            for backend in self.pool.down():
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with self.session.get(backend.url + "/health",
                                                timeout=timeout) as answer:
                        if answer.status == 200:
                            self.pool.mark_up(backend)
                            log.info("backend %s (%s) is healthy again", backend.name,
                                     backend.url)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The P/D prefill hop of a request: one token, not streamed, for remote decode."""
    hop = dict(body)
    hop["max_tokens"] = 1
    if "max_completion_tokens" in hop:
        hop["max_completion_tokens"] = 1
    hop["stream"] = False
    hop.pop("stream_options", None)
    hop.pop("min_tokens", None)
    hop["kv_transfer_params"] = dict(PD_PREFILL_PARAMS)
    return hop


def _route_request(body: dict[str, Any], endpoint: str) -> RouteRequest:
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or
                                   isinstance(max_tokens, bool) or max_tokens < 1):
        raise InvalidArgument("max_tokens must be a positive integer")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidArgument("stream must be a boolean")
    salt = body.get("cache_salt") or ""
    if not isinstance(salt, str):
        raise InvalidArgument("cache_salt must be a string")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise InvalidArgument("model must be a string")
    return RouteRequest(request_id=f"fd-{uuid.uuid4().hex}", endpoint=endpoint, model=model,
                        max_tokens=max_tokens, stream=stream, tenant=salt)

"""The front door's P/D pieces that need no vLLM: the prefill hop's body and ``PdRouter``'s
choices as backends go down (tests/frontdoor/test_pd.py runs them against real vLLM)."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.errors import InvalidArgument
from kvstore.frontdoor import Backend, BackendPool, PdPair, PdRouter, Rejection, RouteRequest
from kvstore.frontdoor.server import prefill_body

REQ = RouteRequest(request_id="r", endpoint="/v1/completions", model="m", max_tokens=9,
                   stream=True)


def test_prefill_body_asks_one_token_for_remote_decode_and_leaves_the_original_alone() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "max_completion_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 4,
            "cache_salt": "t", "temperature": 0.0}
    hop = prefill_body(body)
    assert hop == {"model": "m", "prompt": "hi", "max_tokens": 1, "max_completion_tokens": 1,
                   "stream": False, "cache_salt": "t", "temperature": 0.0,
                   "kv_transfer_params": {"do_remote_decode": True,
                                          "do_remote_prefill": False}}
    assert body["max_tokens"] == 9 and body["stream"] is True and "min_tokens" in body
    assert "max_completion_tokens" not in prefill_body({"prompt": "x"})


def _route(router: PdRouter) -> Backend | PdPair | Rejection:
    return asyncio.run(router.route([1, 2, 3], REQ))


def test_pd_router_pairs_in_turn_and_degrades_instead_of_failing() -> None:
    p0, p1 = Backend("p0", "http://127.0.0.1:1"), Backend("p1", "http://127.0.0.1:2")
    d0 = Backend("d0", "http://127.0.0.1:3")
    pool = BackendPool([p0, p1, d0])
    router = PdRouter(pool, [p0, p1], [d0])
    assert [_route(router) for _ in range(3)] == [PdPair(p0, d0), PdPair(p1, d0),
                                                  PdPair(p0, d0)]
    pool.mark_down(p0)
    assert _route(router) == PdPair(p1, d0)
    pool.mark_down(p1)
    assert _route(router) == PdPair(None, d0)  # the decode computes the prompt
    pool.mark_up(p1)
    pool.mark_down(d0)
    assert _route(router) == p1  # no decode: the prefill instance runs it all
    pool.mark_down(p1)
    rejected = _route(router)
    assert isinstance(rejected, Rejection) and rejected.status == 503


def test_pd_router_needs_both_sides_in_the_pool() -> None:
    p, d = Backend("p", "http://127.0.0.1:1"), Backend("d", "http://127.0.0.1:2")
    with pytest.raises(InvalidArgument):
        PdRouter(BackendPool([p, d]), [p], [])
    with pytest.raises(InvalidArgument, match="not in the pool"):
        PdRouter(BackendPool([p]), [p], [d])

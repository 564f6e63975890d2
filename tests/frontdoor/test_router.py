"""Routers and the backend pool (pure logic). The conductor router's mapping of Schedule replies
is checked here against a stand-in for the conductor's client; against a real conductor in
test_frontdoor_conductor.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore.errors import InvalidArgument, MembershipError
from kvstore.frontdoor import (
    Backend,
    BackendPool,
    ConductorRouter,
    Rejection,
    RoundRobinRouter,
    Router,
    RouteRequest,
)

A = Backend("a", "http://127.0.0.1:1001")
B = Backend("b", "http://127.0.0.1:1002")
C = Backend("c", "http://127.0.0.1:1003")
REQ = RouteRequest("r1", "/v1/completions", "model", 8, False, tenant="t")


def _route(router: Router, ids: Sequence[int] = (1, 2, 3)) -> Backend | Rejection:
    return asyncio.run(router.route(list(ids), REQ))


def test_backend_parse_and_validation() -> None:
    assert Backend.parse("http://h:1/") == Backend("h:1", "http://h:1")
    assert Backend.parse("p0=http://h:1") == Backend("p0", "http://h:1")
    for bad in ("h:1", "http://h:1/v1", "ftp://h:1", "x="):
        with pytest.raises(InvalidArgument):
            Backend.parse(bad)
    with pytest.raises(InvalidArgument, match="twice"):
        BackendPool([A, Backend("a", "http://127.0.0.1:9")])


def test_round_robin_in_order_skipping_backends_marked_down() -> None:
    pool = BackendPool([A, B, C])
    router = RoundRobinRouter(pool)
    assert isinstance(router, Router)
    assert [_route(router) for _ in range(4)] == [A, B, C, A]
    pool.mark_down(B)
    assert pool.down() == [B] and pool.healthy() == [A, C]
    picks = [_route(router) for _ in range(4)]
    assert B not in picks and set(picks) == {A, C}
    pool.mark_up(B)
    assert B in [_route(router) for _ in range(3)]


def test_round_robin_rejects_with_503_when_every_backend_is_down() -> None:
    pool = BackendPool([A])
    pool.mark_down(A)
    answer = _route(RoundRobinRouter(pool))
    assert isinstance(answer, Rejection) and answer.status == 503
    assert "no healthy backend" in answer.reason


def test_replace_keeps_a_down_backend_down_and_forgets_removed_ones() -> None:
    pool = BackendPool([A, B])
    pool.mark_down(B)
    pool.replace([B, C])
    assert pool.all() == [B, C] and pool.healthy() == [C]
    pool.replace([C])
    pool.replace([B, C])
    assert pool.healthy() == [B, C]


class _Conductor:
    """Answers Schedule with a canned reply or error; records the calls."""

    def __init__(self, answer: pb.ScheduleReply | Exception) -> None:
        self.answer = answer
        self.calls: list[dict[str, Any]] = []

    async def schedule(self, request_id: str, model: str, **kw: Any) -> pb.ScheduleReply:
        self.calls.append({"request_id": request_id, "model": model, **kw})
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def _conductor_route(answer: pb.ScheduleReply | Exception,
                     pool: BackendPool | None = None) -> tuple[Backend | Rejection, _Conductor]:
    conductor = _Conductor(answer)
    router = ConductorRouter(conductor, pool or BackendPool([A, B]), "tiny")  # type: ignore[arg-type]
    return _route(router, [7, 8, 9, 10]), conductor


def test_conductor_router_sends_the_token_ids_and_takes_the_instance_it_names() -> None:
    answer, conductor = _conductor_route(pb.ScheduleReply(accepted=True, prefill_instance="b",
                                                          decode_instance="b"))
    assert answer == B
    assert conductor.calls == [{"request_id": "r1", "model": "tiny", "token_ids": [7, 8, 9, 10],
                                "tenant": "t", "input_tokens": 4,
                                "expected_output_tokens": 8, "at_s": 0.0}]


@pytest.mark.parametrize(("reason", "status", "code"), [
    (pb.REJECT_TTFT_SLO, 429, "ttft_slo"),
    (pb.REJECT_TPOT_SLO, 429, "tpot_slo"),
    (pb.REJECT_DECODE_KV_FULL, 503, "decode_kv_full"),
])
def test_conductor_rejections_map_to_http_statuses(reason: int, status: int, code: str) -> None:
    answer, _ = _conductor_route(pb.ScheduleReply(accepted=False, reason=reason,  # type: ignore[arg-type]
                                                  message="ttft 3.2 s > slo 1.0 s"))
    assert answer == Rejection(status, "rejected by the conductor: ttft 3.2 s > slo 1.0 s", code)


def test_conductor_router_503s() -> None:
    unknown, _ = _conductor_route(pb.ScheduleReply(accepted=True, prefill_instance="zz"))
    assert isinstance(unknown, Rejection) and unknown.status == 503
    assert "'zz'" in unknown.reason
    pool = BackendPool([A, B])
    pool.mark_down(A)
    down, _ = _conductor_route(pb.ScheduleReply(accepted=True, prefill_instance="a"), pool)
    assert isinstance(down, Rejection) and down.code == "backend_down"
    gone, _ = _conductor_route(MembershipError("no leader"))
    assert isinstance(gone, Rejection) and gone.status == 503 and "no leader" in gone.reason
    bad, _ = _conductor_route(InvalidArgument("no engine of model 'tiny'"))
    assert isinstance(bad, Rejection) and bad.status == 503 and "tiny" in bad.reason

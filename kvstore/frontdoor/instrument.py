"""Measuring the front door's routing, and telling the conductor that requests ended.

* :class:`TimedRouter` wraps any :class:`~kvstore.frontdoor.router.Router`: the wall time of
  each ``route`` call (the routing decision's latency at the front door: for the conductor's
  router one ``Schedule`` RPC, hashing included) and how many decisions named each backend;
  with a ``floor`` router, also that one's decision timed right after each (a trivial one,
  e.g. round robin: what the routing step costs at that moment with nothing to decide); and
  the thread's CPU time of each decision (``time.thread_time``: what the decision's own code
  cost; wall minus CPU is time spent waiting, on a core or on I/O such as an RPC).
* :class:`TicketingConductorClient` is a :class:`~kvstore.client.conductor_client.
  ConductorClient` that remembers the ticket of every accepted ``Schedule`` until
  :meth:`~TicketingConductorClient.finish` reports it done (``ReportCompletion`` with a
  decode completion: the conductor then releases the request's decode KV reservation and its
  prefill work). Without completions the conductor's reservations only grow, and an instance
  whose ``kv_capacity_tokens`` they fill is refused (``DECODE_KV_FULL``).
* :class:`ReportingConductorRouter` is the conductor's router with the front door's ``done``
  and ``first_token`` hooks: at each request's first token it has the client report its
  prefill over (``PrefillDone`` without a measured time: the conductor times it from its
  decision, ``Scheduler.first_token``), at its end its ticket done (both in the background;
  :meth:`TicketingConductorClient.settle` waits for the reports), so requests in flight at
  once each leave the instance's prefill queue when their first token comes and release
  their decode room when they end.

Why the client keeps the tickets: :class:`~kvstore.frontdoor.router.ConductorRouter` keeps
none (its reply's ticket is the caller's to report), so the caller that knows when requests end
(the fleet's replay, or the front door's ``done`` hook through the router above) reports
through this client.
:class:`~kvstore.frontdoor.local.LocalRouter` keeps its own tickets and reports them from the
``done`` hook the front door calls at the end of each request (give it a plain client).

asyncio only, one event loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore.client.conductor_client import ConductorClient
from kvstore.frontdoor.router import Backend, BackendPool, ConductorRouter, Router, RouteRequest

__all__ = ["ReportingConductorRouter", "TicketingConductorClient", "TimedRouter"]


class TimedRouter:
    """A router that times another's decisions (see the module docstring)."""

    def __init__(self, inner: Router, floor: Router | None = None) -> None:
        self.inner = inner
        self.floor = floor
        self.decision_s: list[float] = []
        """Wall seconds of each ``route`` call, in order."""
        self.floor_s: list[float] = []
        """Wall seconds of the ``floor`` router's decision right after each (none without)."""
        self.cpu_s: list[float] = []
        """The calling thread's CPU seconds of each ``route`` call (other tasks the event loop
        ran while it awaited included)."""
        self.backends: Counter[str] = Counter()
        """Decisions that named each backend (by name)."""
        self.rejections = 0

    async def route(self, token_ids: Sequence[int], request: RouteRequest) -> Any:
        # Any on purpose: it answers whatever the wrapped router answers (a Backend,
        # a Rejection, or another kind of decision a router may add).
        cpu = time.thread_time()
        began = time.perf_counter()
        decision: Any = await self.inner.route(token_ids, request)
        ended = time.perf_counter()
        self.cpu_s.append(time.thread_time() - cpu)
        self.decision_s.append(ended - began)
        if self.floor is not None:
            await self.floor.route(token_ids, request)
            self.floor_s.append(time.perf_counter() - ended)
        if isinstance(decision, Backend):
            self.backends[decision.name] += 1
        elif hasattr(decision, "status"):  # a Rejection
            self.rejections += 1
        return decision

    def done(self, request_id: str, output_tokens: int = 0) -> None:
        """Pass the end of a request on to the wrapped router, if it wants it."""
        done = getattr(self.inner, "done", None)
        if done is not None:
            done(request_id, output_tokens)

    def first_token(self, request_id: str) -> None:
        """Pass a request's first token on to the wrapped router, if it wants it."""
        first_token = getattr(self.inner, "first_token", None)
        if first_token is not None:
            first_token(request_id)

    def reset(self) -> None:
        self.decision_s.clear()
        self.floor_s.clear()
        self.cpu_s.clear()
        self.backends.clear()
        self.rejections = 0


class TicketingConductorClient(ConductorClient):
    """A conductor client that keeps the tickets of accepted decisions until reported done."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.outstanding: dict[str, int] = {}
        """Request id -> ticket of each accepted decision not yet reported done."""
        self.decisions: list[pb.ScheduleReply] = []
        """Every accepted reply, in order (for reports: instance, predicted prefix)."""
        self._reports: set[asyncio.Task[Any]] = set()
        self._first: dict[str, asyncio.Task[Any]] = {}
        """Request id -> its first-token report (until its done report is started)."""

    async def schedule(self, request_id: str, model: str, *, keys: Sequence[bytes] = (),
                       token_ids: Sequence[int] = (), tenant: str = "", input_tokens: int = 0,
                       expected_output_tokens: int = 0, at_s: float = 0.0) -> pb.ScheduleReply:
        reply = await super().schedule(
            request_id, model, keys=keys, token_ids=token_ids, tenant=tenant,
            input_tokens=input_tokens, expected_output_tokens=expected_output_tokens, at_s=at_s)
        if reply.accepted and reply.ticket:
            self.outstanding[request_id] = int(reply.ticket)
            self.decisions.append(reply)
        return reply

    def first_token(self, request_id: str) -> None:
        """Report that request ``request_id``'s first token came out (``PrefillDone`` with
        no measured time: the conductor's ``Scheduler.first_token``, which ends its prefill
        in the instance's queue and calibrates the instance's speed), in the background;
        nothing when it has no ticket, or was reported already."""
        ticket = self.outstanding.get(request_id)
        if ticket is None or request_id in self._first:
            return
        self._first[request_id] = self._start(
            self.report_completion(pb.CompletionReport(
                ticket=ticket, prefill=pb.PrefillDone(prefill_s=0.0))),
            f"kvtier-first-token-{request_id}")

    def done(self, request_id: str, output_tokens: int = 0) -> None:
        """Report request ``request_id``'s ticket done in the background (nothing when it has
        none: refused, or not asked), after its first-token report if one is in flight (the
        conductor forgets a ticket once it is done); :meth:`settle` waits for it."""
        ticket = self.outstanding.pop(request_id, None)
        first = self._first.pop(request_id, None)
        if ticket is None:
            return
        self._start(self._report(ticket, output_tokens, first), f"kvtier-done-{request_id}")

    def _start(self, work: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)
        return task

    async def _report(self, ticket: int, output_tokens: int,
                      after: asyncio.Task[Any] | None = None) -> None:
        if after is not None:
            await asyncio.wait([after])  # its own error is settle()'s to raise
        await self.report_completion(pb.CompletionReport(
            ticket=ticket, decode=pb.DecodeDone(output_tokens=output_tokens)))

    async def settle(self) -> None:
        """Wait for every report :meth:`done` started; the first one's KvtierError raised."""
        while self._reports:
            await asyncio.gather(*list(self._reports))

    async def finish(self, output_tokens: int = 0) -> int:
        """Report every outstanding ticket's request done (``DecodeDone``; ``output_tokens``
        0: the length is not known); the number reported. KvtierError from the conductor."""
        done = 0
        while self.outstanding:
            _, ticket = self.outstanding.popitem()
            await self.report_completion(pb.CompletionReport(
                ticket=ticket, decode=pb.DecodeDone(output_tokens=output_tokens)))
            done += 1
        return done


class ReportingConductorRouter(ConductorRouter):
    """The conductor's router whose ``done`` hook reports each request's ticket through its
    :class:`TicketingConductorClient` (see the module docstring)."""

    def __init__(self, conductor: TicketingConductorClient, pool: BackendPool,
                 model: str) -> None:
        super().__init__(conductor, pool, model)
        self.tickets = conductor

    def done(self, request_id: str, output_tokens: int = 0) -> None:
        self.tickets.done(request_id, output_tokens)

    def first_token(self, request_id: str) -> None:
        self.tickets.first_token(request_id)

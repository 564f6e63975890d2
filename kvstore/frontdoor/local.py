"""Routing decisions made in the front door's own process, with the conductor's scheduling code.

A ``Schedule`` RPC per request costs a round trip between two Python processes, whose own p99
on a loaded host is above the 1 ms the front door may add (docs/routing.md). :class:`LocalRouter`
decides in process instead, as Dynamo's KV router does in its frontend and llm-d's precise
prefix-cache scorer in its endpoint picker: it runs the conductor's own
:class:`~conductor.scheduler.Scheduler` on a replica of the conductor's inputs, followed from the
same sources the conductor follows:

* the engine records and node registrations in etcd (:class:`~kvstore.membership.engines.
  EngineWatch`, :func:`~kvstore.membership.nodes.watch_nodes`), turned into scheduler instances
  as the conductor turns them (:func:`conductor.instances.plan_instances`: a prefill and a
  decode record of one server are one colocated instance);
* each store daemon's chunk events (:func:`conductor.node_events.follow_node`, the conductor's
  own loop: a snapshot, then ``Subscribe``) into :attr:`LocalRouter.index`, and a prompt's
  store keys as the conductor makes them from the engine records
  (:func:`conductor.store_keys.store_hasher`), so the daemons' tiers count as at the
  conductor (a node is live once followed, as there);
* each engine's vLLM KV events over ZMQ (:class:`~conductor.engine_events.
  EngineFollowers`, the conductor's own, into an :class:`~conductor.engine_index.EngineCacheIndex`: the same
  seq/gap/replay handling, the same mismatch probes, and its chain memo, so a conversation's
  next turn hashes only its new blocks). vLLM's PUB socket serves any number of subscribers
  and its replay socket any number of clients: the front door is one more;
* its own decisions, their first tokens (:meth:`LocalRouter.first_token`: the prefill is
  over, and timed for the instance's speed when the request had its queue to itself) and
  their completions (:meth:`LocalRouter.done`), which are the queue, the speeds and the decode
  reservations the scheduler predicts from.

``route`` is then one match and one ``Scheduler.schedule``, with no ``await`` between reading
the state and reserving on it. The match hashes the prompt only as far as an engine holds it
(:meth:`~conductor.engine_index.EngineCacheIndex.match_held`: the same cached tokens as the
conductor's whole hashing; a new prompt costs one step of 8 blocks); the rest of the prompt is
hashed after the route returned (a task: the chain memo's entry for the next turn, and the
mismatch probe of the chosen engine's last block), when the request is on its way to vLLM. The answer is the conductor's whenever the local state cannot
vouch for itself; the front door never routes on a guess:

* **not fresh** (:meth:`LocalRouter.stale_reason`): every ``check_interval_s`` the conductor's
  ``Leader`` answer is compared with the local replica: the leader answers, it schedules
  exactly the engine records the replica schedules, and no engine's view here is behind the
  seq the conductor had applied one check earlier (a SUB socket silently cut off from its
  publisher shows up so). The replica is fresh while the last agreeing check is younger than
  ``max_check_age_s`` and no followed engine of the model waits for a replay (a gap, a fresh
  view). An unreachable conductor therefore makes it stale within ``max_check_age_s``, and a
  membership change the replica missed (its etcd watch broken) within a check. ``Leader`` is
  an operator method (docs/security.md): with a lesser credential no check ever agrees, and
  every request is the conductor's;
* **store keys**: the model's engines make their store keys differently (the conductor
  refuses such a request, naming them), or a registered node's chunk events are not followed
  yet (not fresh);
* **a local rejection** (TTFT or TPOT target, no decode room), or a request the scheduler
  refuses (no instance serves the model): the conductor stays authoritative for admission,
  only its answer rejects;
* the instance chosen has no healthy backend here.

**Shadow** (``shadow=True``, the default): each local decision is also sent to the
conductor's ``Schedule`` in the background, after the request was routed. The conductor so
books the same reservations its own decision would have (its answers while the replica is
stale see the front door's load) and the two choices are compared (the instance, and how
many of the prompt's tokens it was predicted to hold): ``counters`` has ``shadow_agreed`` and
``shadow_disagreed`` (logged). At most ``max_shadows`` are in flight;
more are skipped (``shadow_skipped``).

Decisions are the conductor's on the same state: the same scheduler code with the same
configuration (give the conductor's ``policy``, ``block_size_tokens`` and SLOs), the same
instances and cache views, the same request fields (tests/frontdoor/test_local_routing.py).
What differs: the tenant scope (the replica matches the store for the default tenant, as the
conductor does for a caller without credentials: a conductor with authentication scopes the
front door's own principal), and the time: the replica decides now, the conductor's shadow a round trip later, when a queue
predicted to drain meanwhile can tip a near tie (``send_clock`` with a conductor on
``--clock client``: it decides at the replica's instant).

asyncio, one event loop; ``route`` may be called by many concurrent requests. The constructor
records settings and builds in-memory state; :meth:`LocalRouter.start` talks to etcd and the
engines, :meth:`LocalRouter.close` stops everything.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from conductor.engine_events import EngineFollowers
from conductor.engine_index import EngineCacheIndex, PromptMatch
from conductor.index import GlobalPrefixIndex
from conductor.instances import InstanceBook
from conductor.node_events import follow_node
from conductor.perf.engine_model import default_engine_model
from conductor.scheduler import (
    Decision,
    Policy,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
)
from conductor.store_keys import store_hasher
from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore.errors import InvalidArgument, KvtierError
from kvstore.frontdoor.router import (
    Backend,
    BackendPool,
    ConductorRouter,
    Rejection,
    RouteRequest,
    backend_named,
)
from kvstore.keys import BlockHasher
from kvstore.membership.engines import EngineRecord, EngineRole, EngineWatch
from kvstore.membership.etcd import DEFAULT_LAYOUT, KeyLayout, etcd_client
from kvstore.membership.nodes import NodeEventKind, NodeRecord, watch_nodes
from kvstore.security.client import TokenSource, token_source
from kvstore.security.config import ClientSecurity

if TYPE_CHECKING:
    from kvstore.client.conductor_client import ConductorClient

__all__ = ["LocalRouter", "local_scheduler"]

log = logging.getLogger(__name__)


MAX_KEYS = 65536
"""Most blocks a prompt may have (as the conductor's ``Schedule`` allows)."""
_HASHERS_KEPT = 1024

_UINT32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def _token_array(token_ids: Sequence[int]) -> npt.NDArray[np.uint32] | None:
    """The prompt as a uint32 array (what the engine index's chain memo hashes), or None when
    an id does not fit. Through ``array.array``: a quarter of ``np.array``'s time for a list of
    Python ints (~18 us against ~70 us at 4,000 ids here)."""
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32 and \
            token_ids.ndim == 1 and token_ids.flags.c_contiguous:
        return token_ids
    try:
        return np.frombuffer(array.array(_UINT32, token_ids), dtype=np.uint32)
    except (OverflowError, TypeError):
        return None


def local_scheduler(policy: Policy = Policy.GLOBAL_CACHE, block_size_tokens: int = 512,
                    ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                    index: GlobalPrefixIndex | None = None,
                    cache_affinity_margin: float = 0.25) -> Scheduler:
    """A scheduler configured as a conductor started with these settings configures its own
    (``conductor.server.Conductor``: the default engine model at this block size), on
    ``index`` (default: an empty store index)."""
    engine = default_engine_model(block_size_tokens)
    config = SchedulerConfig(
        policy=policy, block_size_tokens=engine.block_size_tokens,
        block_size_bytes=engine.block_size_bytes, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
        cache_affinity_margin=cache_affinity_margin)
    # (An empty index is falsy: "index or ..." would drop the caller's.)
    return Scheduler(GlobalPrefixIndex() if index is None else index, engine.latency, config)


class LocalRouter:
    """Decides in process, asks the conductor otherwise (see the module docstring).

    ``conductor`` is the client the fallback and the shadow use (a plain
    :class:`~kvstore.client.conductor_client.ConductorClient`: this router reports the tickets
    it got done itself); ``model`` the model name the conductor knows the engines by."""

    def __init__(self, conductor: ConductorClient, pool: BackendPool, model: str, *,
                 etcd_endpoint: str, layout: KeyLayout = DEFAULT_LAYOUT,
                 policy: Policy = Policy.GLOBAL_CACHE, block_size_tokens: int = 512,
                 ttft_slo_s: float | None = None, tpot_slo_s: float | None = None,
                 cache_affinity_margin: float = 0.25, shadow: bool = True, max_shadows: int = 64, check_interval_s: float = 1.0,
                 max_check_age_s: float = 3.0, send_clock: bool = False,
                 daemon_security: ClientSecurity | None = None) -> None:
        if not check_interval_s > 0 or not max_check_age_s > check_interval_s:
            raise InvalidArgument("check_interval_s must be > 0 and max_check_age_s larger")
        if max_shadows < 1:
            raise InvalidArgument("max_shadows must be >= 1")
        self.fallback = ConductorRouter(conductor, pool, model)
        self.conductor = conductor
        self.pool = pool
        self.model = model
        self.index = GlobalPrefixIndex()
        """The daemons' tiers, followed from their chunk events as the conductor follows them
        (:func:`conductor.node_events.follow_node`)."""
        self.scheduler = local_scheduler(policy, block_size_tokens, ttft_slo_s, tpot_slo_s,
                                         self.index, cache_affinity_margin)
        self._daemon_security = daemon_security or ClientSecurity()
        self._daemon_token: TokenSource | None = None
        self._hashers: dict[tuple[str, str], BlockHasher | None] = {}
        self.engine_cache = EngineCacheIndex()
        self.shadow = shadow
        self.send_clock = send_clock
        """The conductor runs on its caller's clock (``--clock client``): the fallback, the
        shadow and the completion reports carry this router's time, so that the conductor
        decides at the very instant the replica did (on the wall clock it decides a round
        trip later, when queue predictions have drained by that much: near ties may then
        differ, which the shadow counts)."""
        self.max_shadows = max_shadows
        self._etcd_endpoint = etcd_endpoint
        self._layout = layout
        self._check_interval_s = check_interval_s
        self._max_check_age_s = max_check_age_s
        self.records: dict[str, EngineRecord] = {}
        """Engine records in etcd, by instance id."""
        self._created: dict[str, int] = {}
        self.nodes: dict[str, NodeRecord] = {}
        """Nodes registered in etcd."""
        self.connected: set[str] = set()
        """Nodes whose chunk events are followed (snapshot loaded, stream open): the live
        nodes, as the conductor counts them."""
        self._node_tasks: dict[str, asyncio.Task[None]] = {}
        self.instances = InstanceBook()
        """The scheduler's instances and the engine records it knows now (as the conductor's)."""
        self.engine_events = EngineFollowers(self.engine_cache, "kvtier-frontdoor-kv-events")
        self._etcd: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._agreed_at = -float("inf")
        self._disagreement: str | None = "no check against the conductor yet"
        self._conductor_seq: dict[str, int] = {}
        """Each engine's applied seq at the conductor, as of the last check."""
        self._local_tickets: dict[str, int] = {}
        """Request id -> ticket of the local scheduler, until done."""
        self._conductor_tickets: dict[str, int] = {}
        """Request id -> ticket the conductor gave (fallback or shadow), until done."""
        self._done_early: set[str] = set()
        """Requests done while their shadow was still in flight."""
        self._first_reports: dict[str, asyncio.Task[Any]] = {}
        """Request id -> its first-token report to the conductor, until its done report."""
        self._shadows: set[asyncio.Task[Any]] = set()
        """Shadow decisions, completion reports and prompt hashing in flight."""
        self._shadows_in_flight = 0
        self._probe: dict[str, str] = {}
        """Request id -> the engine whose events should show the prompt's last block."""
        self.counters: Counter[str] = Counter()
        """``local``, ``fallback`` and ``fallback:<why>``, ``shadow_agreed``,
        ``shadow_disagreed``, ``shadow_failed``, ``shadow_skipped``, ``report_failed``."""
        self.last_fallback = ""
        """Why the latest request was not decided here ('' when it was)."""
        self.disagreements: deque[tuple[str, str | None, str]] = deque(maxlen=64)
        """The latest shadow disagreements: (request id, chosen here, the conductor's)."""

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read etcd's engines and nodes, follow them and the engines' KV events, start the
        freshness checks. Raises MembershipError when etcd cannot be reached."""
        self._daemon_token = token_source(self._daemon_security)
        self._etcd = etcd_client(self._etcd_endpoint)
        loop = asyncio.get_running_loop()
        try:
            nodes = watch_nodes(self._etcd, layout=self._layout)
            await nodes.start()
            engines = EngineWatch(self._etcd, layout=self._layout)
            await engines.__aenter__()
        except BaseException:
            await self.close()
            raise
        self._tasks = [
            loop.create_task(self._follow_nodes(nodes), name="kvtier-frontdoor-nodes"),
            loop.create_task(self._follow_engines(engines), name="kvtier-frontdoor-engines"),
            loop.create_task(self._check_loop(), name="kvtier-frontdoor-check"),
        ]

    async def close(self) -> None:
        """Stop following; report nothing more. Idempotent."""
        tasks = (self._tasks + self.engine_events.close() + list(self._shadows)
                 + list(self._node_tasks.values()))
        self._tasks = []
        self._node_tasks = {}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
        if self._etcd is not None:
            with contextlib.suppress(Exception):  # closing a client whose etcd is gone
                await self._etcd.close()
            self._etcd = None
        self.engine_events.destroy()

    async def __aenter__(self) -> LocalRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- deciding ------------------------------------------------------------------------------

    def stale_reason(self) -> str | None:
        """Why the replica cannot decide now (None: it can; see the module docstring)."""
        if self._disagreement is not None:
            return self._disagreement
        age_s = time.monotonic() - self._agreed_at
        if age_s > self._max_check_age_s:
            return f"no agreeing check with the conductor for {age_s:.1f} s"
        for node_id in self.nodes:
            if node_id not in self.connected:
                return f"node {node_id}'s chunk events are not followed (yet)"
        for instance_id, rec in self.records.items():
            if rec.model != self.model or rec.vllm_kv_events is None:
                continue
            view = self.engine_cache.view(instance_id)
            if view is None or view.replay_from is not None:
                return f"engine {instance_id}'s KV events wait for a replay"
        return None

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | Rejection:
        local = self._decide(token_ids, request)
        if isinstance(local, str):
            self.last_fallback = local
            self.counters["fallback"] += 1
            self.counters[f"fallback:{local.split(':')[0]}"] += 1
            decision, reply = await self.fallback.ask(token_ids, request, self._at_s())
            if reply is not None and reply.accepted and reply.ticket:
                self._conductor_tickets[request.request_id] = int(reply.ticket)
            return decision
        self.last_fallback = ""
        self.counters["local"] += 1
        return local

    def _decide(self, token_ids: Sequence[int], request: RouteRequest) -> Backend | Rejection | str:
        """The local decision, or why there is none (a short kind, ':', the detail)."""
        why = self.stale_reason()
        if why is not None:
            return f"stale: {why}"
        model = self.model
        events = {instance_id for instance_id, rec in self.records.items()
                  if rec.model == model and rec.vllm_kv_events is not None}
        if not events or not len(token_ids):
            return f"no-events: no engine of {model!r} publishes KV events, or no token ids"
        # What the conductor's Schedule handler does with the same request (conductor/
        # service.py): the ids as a uint32 array (the chain memo's input), the store keys
        # its engines' records name (none without a fingerprint), the engines' cached
        # prefixes, the scheduler, and the mismatch probe of the chosen engine.
        tokens = _token_array(token_ids)
        if tokens is None:
            return "bad-ids: a token id is not a uint32"
        try:
            hasher = self._hasher(request.tenant)
        except InvalidArgument as exc:  # the conductor refuses it alike: its answer is given
            return f"store-keys: {exc}"
        keys: tuple[bytes, ...] = ()
        if hasher is not None:
            if len(tokens) > MAX_KEYS * hasher.block_size_tokens:
                return f"too-long: more than {MAX_KEYS} blocks of token ids"
            keys = tuple(hasher.hash_blocks(tokens))
        # Hashed only as far as an engine holds the prompt; the rest (the mismatch probe's
        # last block, the chain memo's entry for the next turn) after the route: _finish.
        match: PromptMatch = self.engine_cache.match_held(tokens, request.tenant, events)
        mine = tokens if isinstance(token_ids, list | tuple) else tokens.copy()
        # (The task starts once this call returned: the decision below is known by then.)
        self._background(self._finish(mine, request.request_id, request.tenant, match),
                         f"kvtier-hash-{request.request_id}")
        now_s = time.monotonic()
        try:
            decision: Decision = self.scheduler.schedule(ScheduleRequest(
                request.request_id, model, keys, len(tokens), request.max_tokens or None),
                now_s, match.cached_tokens)
        except InvalidArgument as exc:
            return f"not-placed: {exc}"
        if not decision.accepted:
            return f"rejected: {decision.message}"
        assert decision.prefill_instance is not None
        backend = backend_named(self.pool, decision.prefill_instance, "the local scheduler")
        if isinstance(backend, Rejection):
            self.scheduler.cancel(decision.ticket)
            return f"{backend.code}: {backend.reason}"
        if decision.prefill_instance in match.cached_tokens:
            self._probe[request.request_id] = decision.prefill_instance
        self._local_tickets[request.request_id] = decision.ticket
        if self.shadow:  # the caller's own array is not kept past the call (Router)
            self._start_shadow(mine, request, decision, now_s)
        return backend

    def _hasher(self, tenant: str) -> BlockHasher | None:
        """The model's store keys for ``tenant`` (None: no engine of it has a fingerprint),
        as the conductor makes them (:func:`conductor.store_keys.store_hasher`); remembered
        until the engine records change. InvalidArgument as the conductor raises it."""
        cache_key = (self.model, tenant)
        if cache_key in self._hashers:
            return self._hashers[cache_key]
        hasher = store_hasher(self.records.items(), self.model, tenant,
                              self.scheduler.config.block_size_tokens)
        if len(self._hashers) >= _HASHERS_KEPT:
            self._hashers.clear()
        self._hashers[cache_key] = hasher
        return hasher

    async def _finish(self, tokens: npt.NDArray[np.uint32], request_id: str, tenant: str,
                      match: PromptMatch) -> None:
        """After the route: hash the rest of the prompt (remembered in the chain memo), and
        expect its last block in the chosen engine's events (the conductor's mismatch probe),
        as the conductor's Schedule does within the call."""
        full = self.engine_cache.complete(match, tokens)
        chosen = self._probe.pop(request_id, None)
        if chosen is not None:
            self.engine_cache.expect_routed(chosen, tokens, tenant, full)

    # -- the shadow ----------------------------------------------------------------------------

    def _at_s(self, now_s: float | None = None) -> float:
        """What the conductor gets as the caller's clock (0: it uses its own)."""
        if not self.send_clock:
            return 0.0
        return time.monotonic() if now_s is None else now_s

    def _start_shadow(self, tokens: np.ndarray[Any, Any], request: RouteRequest,
                      chosen: Decision, now_s: float) -> None:
        if self._shadows_in_flight >= self.max_shadows:
            self.counters["shadow_skipped"] += 1
            return
        self._shadows_in_flight += 1
        self._background(self._shadow(tokens, request, chosen, self._at_s(now_s)),
                         f"kvtier-shadow-{request.request_id}")

    async def _shadow(self, tokens: np.ndarray[Any, Any], request: RouteRequest,
                      decision: Decision, at_s: float) -> None:
        try:
            await self._shadow_decision(tokens, request, decision, at_s)
        finally:
            self._shadows_in_flight -= 1

    async def _shadow_decision(self, tokens: np.ndarray[Any, Any], request: RouteRequest,
                               decision: Decision, at_s: float) -> None:
        chosen = decision.prefill_instance
        rid = request.request_id
        try:
            reply = await self.conductor.schedule(
                rid, self.model, token_ids=tokens.tolist(), tenant=request.tenant,
                input_tokens=len(tokens), expected_output_tokens=request.max_tokens or 0,
                at_s=at_s)
        except KvtierError as exc:
            self.counters["shadow_failed"] += 1
            log.warning("request %s: the conductor's shadow decision failed: %s", rid, exc)
            self._done_early.discard(rid)
            return
        theirs = reply.prefill_instance if reply.accepted else f"rejected ({reply.message})"
        if theirs == chosen and reply.engine_cached_tokens == decision.engine_cached_tokens:
            self.counters["shadow_agreed"] += 1
        else:
            self.counters["shadow_disagreed"] += 1
            self.disagreements.append((rid, chosen, theirs))
            assert decision.ttft is not None
            log.warning("request %s: routed to %s here (%d tokens cached there, queue %.4f s, "
                        "TTFT %.4f s), the conductor chose %s (%d cached, queue %.4f s, TTFT "
                        "%.4f s)", rid, chosen, decision.engine_cached_tokens,
                        decision.ttft.queue_s, decision.ttft.total_s, theirs,
                        reply.engine_cached_tokens, reply.queue_s, reply.ttft_estimate_s)
        if reply.accepted and reply.ticket:
            if rid in self._done_early:
                self._done_early.discard(rid)
                await self._report(int(reply.ticket), 0, self._at_s())
            else:
                self._conductor_tickets[rid] = int(reply.ticket)
        else:
            self._done_early.discard(rid)

    @property
    def _shadow_names(self) -> set[str]:
        return {task.get_name() for task in self._shadows}

    async def idle(self) -> None:
        """Wait until no shadow decision nor completion report is in flight (tests,
        benchmarks)."""
        while self._shadows:
            await asyncio.wait(list(self._shadows))

    # -- completions ---------------------------------------------------------------------------

    def done(self, request_id: str, output_tokens: int = 0) -> None:
        """The request ended (``output_tokens`` it generated; 0: unknown): release its
        reservations here at once, and at the conductor in the background (the request path
        does not wait for that RPC). A request this router never routed is ignored."""
        now_s = time.monotonic()
        ticket = self._local_tickets.pop(request_id, None)
        if ticket is not None:
            # Unknown when its instance left meanwhile (the scheduler dropped its tickets).
            with contextlib.suppress(InvalidArgument):
                self.scheduler.decode_done(ticket, now_s, output_tokens=output_tokens)
        first = self._first_reports.pop(request_id, None)
        theirs = self._conductor_tickets.pop(request_id, None)
        if theirs is not None:
            self._background(self._report(theirs, output_tokens, self._at_s(now_s), first),
                             f"kvtier-report-{request_id}")
        elif ticket is not None and f"kvtier-shadow-{request_id}" in self._shadow_names:
            self._done_early.add(request_id)

    def first_token(self, request_id: str) -> None:
        """The request's first token came out: its prefill is over (``Scheduler.first_token``:
        it leaves its instance's prefill queue, and times the instance's speed when it had
        that queue to itself), here at once and at the conductor in the background, for the
        ticket its shadow or its fallback holds there (one still in flight is not reported:
        the conductor then releases it at the request's end only)."""
        now_s = time.monotonic()
        ticket = self._local_tickets.get(request_id)
        if ticket is not None:
            # Unknown when its instance left meanwhile; reported twice is a caller's bug.
            with contextlib.suppress(InvalidArgument):
                self.scheduler.first_token(ticket, now_s)
        theirs = self._conductor_tickets.get(request_id)
        if theirs is not None and request_id not in self._first_reports:
            self._first_reports[request_id] = self._background(
                self._report_first_token(theirs, self._at_s(now_s)),
                f"kvtier-first-token-{request_id}")

    def _background(self, work: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)
        return task

    async def _report_first_token(self, ticket: int, at_s: float) -> None:
        try:
            await self.conductor.report_completion(pb.CompletionReport(
                ticket=ticket, at_s=at_s, prefill=pb.PrefillDone(prefill_s=0.0)))
        except KvtierError as exc:
            self.counters["report_failed"] += 1
            log.warning("reporting ticket %d's first token to the conductor failed: %s",
                        ticket, exc)

    async def _report(self, ticket: int, output_tokens: int, at_s: float,
                      after: asyncio.Task[Any] | None = None) -> None:
        if after is not None:  # the conductor forgets a ticket once it is done
            await asyncio.wait([after])
        try:
            await self.conductor.report_completion(pb.CompletionReport(
                ticket=ticket, at_s=at_s, decode=pb.DecodeDone(output_tokens=output_tokens)))
        except KvtierError as exc:
            self.counters["report_failed"] += 1
            log.warning("reporting ticket %d done to the conductor failed: %s", ticket, exc)

    # -- following etcd ------------------------------------------------------------------------

    async def _follow_nodes(self, events: Any) -> None:
        """Each registered node's chunk events into :attr:`index`, as the conductor follows
        them: a node that joins is followed, one that leaves (or re-registers at another
        address) drops out of the index and the live set at once."""
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(events.close)
            async for event in events:
                node_id = event.node_id
                known = self.nodes.get(node_id)
                if event.kind is NodeEventKind.LEFT or event.kind is NodeEventKind.JOINED or (
                        known is not None and known.grpc_address != event.record.grpc_address):
                    self._drop_node(node_id)
                if event.kind is not NodeEventKind.LEFT:
                    self.nodes[node_id] = event.record
                    if node_id not in self._node_tasks:
                        self._node_tasks[node_id] = asyncio.get_running_loop().create_task(
                            self._follow_node(event.record),
                            name=f"kvtier-frontdoor-follow-{node_id}")
                self._sync_instances()

    def _drop_node(self, node_id: str) -> None:
        self.nodes.pop(node_id, None)
        task = self._node_tasks.pop(node_id, None)
        if task is not None:
            task.cancel()
        self.connected.discard(node_id)
        self.index.remove_node(node_id)

    async def _follow_node(self, record: NodeRecord) -> None:
        node_id = record.node_id

        def on_state(connected: bool, why: str) -> None:
            if self._node_tasks.get(node_id) is not asyncio.current_task():
                return  # a follower dropped meanwhile
            if connected:
                self.connected.add(node_id)
            elif node_id in self.connected:
                self.connected.discard(node_id)
                self.index.remove_node(node_id)
                log.warning("node %s unreachable from the front door (%s)", node_id, why)
            self._sync_instances()

        def metadata() -> tuple[tuple[str, str], ...]:
            token = self._daemon_token
            return () if token is None else (token.metadata(),)

        await follow_node(self.index, node_id, record.grpc_address, self._daemon_security,
                          on_state, metadata)

    async def _follow_engines(self, changes: EngineWatch) -> None:
        try:
            async for change in changes:
                if change.record is None:
                    self.records.pop(change.instance_id, None)
                    self._created.pop(change.instance_id, None)
                else:
                    self.records[change.instance_id] = change.record
                    self._created[change.instance_id] = change.create_revision
                self._hashers.clear()
                self._sync_instances()
                self._sync_engine_events()
        finally:
            await changes.__aexit__(None, None, None)

    def _sync_instances(self) -> None:
        """The scheduler's instances = engine records whose node is registered, paired and
        placed as the conductor places them (the same :class:`conductor.instances.InstanceBook`)."""
        self.instances.sync(self.scheduler, self.records, self.connected)

    def _sync_engine_events(self) -> None:
        """Follow the KV events of every engine record that has them, as the conductor does
        (:class:`conductor.engine_events.EngineFollowers`)."""
        self.engine_events.sync({i: (rec.vllm_kv_events, self._created.get(i, 0))
                                 for i, rec in self.records.items()
                                 if rec.vllm_kv_events is not None})

    # -- freshness -----------------------------------------------------------------------------

    async def _check_loop(self) -> None:
        deciding = False
        while True:
            try:
                info = await self.conductor.leader_info()
            except KvtierError as exc:
                self._disagreement = f"the conductor did not answer the check: {exc}"
            else:
                self._disagreement = self.compare(info)
                if self._disagreement is None:
                    self._agreed_at = time.monotonic()
            why = self.stale_reason()
            if (why is None) != deciding:  # log the changes only, not every check
                deciding = why is None
                if deciding:
                    log.info("local routing for %r: deciding in process", self.model)
                else:
                    log.warning("local routing for %r: asking the conductor (%s)", self.model,
                                why)
            await asyncio.sleep(self._check_interval_s)

    def compare(self, info: pb.LeaderReply) -> str | None:
        """How the conductor's ``Leader`` answer disagrees with the replica (None: it agrees).
        Remembers each engine's seq there for the next comparison."""
        if not info.is_leader:
            return "the conductor that answered does not lead"
        if sorted(info.live_nodes) != sorted(self.connected):
            return (f"the conductor follows nodes {sorted(info.live_nodes)}, this front door "
                    f"{sorted(self.connected)}")
        mine = {role: sorted(r for r, rec in self.instances.scheduled.items() if rec.role is role)
                for role in (EngineRole.PREFILL, EngineRole.DECODE)}
        if list(info.prefill_instances) != mine[EngineRole.PREFILL] or \
                list(info.decode_instances) != mine[EngineRole.DECODE]:
            return (f"the conductor schedules {list(info.prefill_instances)} / "
                    f"{list(info.decode_instances)}, this front door "
                    f"{mine[EngineRole.PREFILL]} / {mine[EngineRole.DECODE]}")
        behind = None
        seqs = {c.instance_id: int(c.expected_seq) for c in info.engine_caches}
        for instance_id, before in self._conductor_seq.items():
            view = self.engine_cache.view(instance_id)
            if instance_id in seqs and (view is None or view.expected < before):
                behind = (f"engine {instance_id}'s KV events: seq {before} applied at the "
                          f"conductor a check ago, {view.expected if view else 'none'} here")
                break
        self._conductor_seq = seqs
        return behind

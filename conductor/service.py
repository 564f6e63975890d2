"""The conductor's gRPC servicer (``kvtier.v1.Conductor``): protobuf in, domain calls, protobuf out.

Validation happens here, before anything reaches the scheduler: a malformed request or an
unknown model is INVALID_ARGUMENT with a message that names the field, and nothing is
reserved. Errors travel as gRPC status codes with the kvtier class name in the trailing
metadata ``kvtier-error`` (as the store daemon does). A follower answers Schedule and
ReportCompletion with FAILED_PRECONDITION and the leader in the trailing metadata
``kvtier-leader`` (``<conductor_id>@<host:port>``); see proto/kvtier/v1/conductor.proto.

Handlers run on gRPC's threaded server (see conductor/server.py for why not grpc.aio). The
scheduler, the node table and the engine table are used under ``Conductor.lock``; the index
is thread-safe by itself, so Lookup takes no conductor lock.

Tenants (docs/security.md, "The conductor"): Schedule, ScheduleBatch and Lookup act for the
tenant the caller's credentials and its ``kvtier-tenant`` metadata resolve to, by the daemon's
rule (:func:`kvstore.security.tenancy.resolve_tenant`): the prefix match, the fetch plan and
the per-node answers count only chunks that tenant owns and the shared tenant's (an operator or
peer of every tenant naming none: every tenant's). A tenant the credentials do not allow is
PERMISSION_DENIED (audited), whole batches included. ReportCompletion of a ticket is refused
(PERMISSION_DENIED) to a caller that may not act for the tenant the ticket was scheduled for.
ReportLoad carries one engine instance's figures, and instances have no tenant: it is bound to
the caller's identity (:func:`kvstore.security.tenancy.check_instance_reporter`), so an engine
of tenant A cannot make another tenant's instances look idle or busy.
The request body's ``tenant`` is only the
key namespace token ids are hashed in (a ``cache_salt``); with authentication on, a non-empty
one must also be a tenant the credentials allow, so nobody hashes in another tenant's namespace
to probe the engines' own caches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from conductor.index import TierCounts
from conductor.scheduler import Decision, RejectReason, ScheduleRequest
from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore._proto.kvtier.v1 import conductor_pb2_grpc as pb_grpc
from kvstore.errors import InvalidArgument, KvtierError, MembershipError, PermissionDenied
from kvstore.membership.engines import EngineRole
from kvstore.security.identity import INSECURE, current_principal
from kvstore.security.tenancy import check_instance_reporter, requested_tenant, resolve_tenant
from kvstore.wire import (
    ERROR_METADATA_KEY,
    LEADER_METADATA_KEY,
    UndecodableRequest,
    error_name,
    grpc_code_name,
    service_handler,
    undecodable_error,
)

if TYPE_CHECKING:
    from conductor.server import Conductor

__all__ = ["SERVICE_NAME", "ConductorService", "add_to_server"]

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Conductor"].full_name
MAX_KEYS = 65536
"""Most keys (blocks) one request may carry: 32M tokens at 512 per block."""
MAX_KEY_BYTES = 64
MAX_BATCH = 1024
MAX_REQUEST_ID_CHARS = 256
MAX_TICKET_OWNERS = 1 << 20
"""Outstanding tickets whose tenant is remembered; past it the oldest is forgotten (its
completion is then not checked; the scheduler still knows the ticket)."""

_REASON = {RejectReason.TTFT_SLO: pb.REJECT_TTFT_SLO, RejectReason.TPOT_SLO: pb.REJECT_TPOT_SLO,
           RejectReason.DECODE_KV_FULL: pb.REJECT_DECODE_KV_FULL}

_Req = TypeVar("_Req")
_Rep = TypeVar("_Rep")
Handler = Callable[[Any, Any, Any], Any]


class NotLeader(Exception):
    """Internal: this conductor does not lead (answered FAILED_PRECONDITION)."""


def _rpc(method: Handler) -> Handler:
    """Turn kvtier errors into gRPC statuses (with the class name in trailing metadata); an
    undecodable request (:func:`kvstore.wire.service_handler`) is INVALID_ARGUMENT."""

    @functools.wraps(method)
    def wrapper(self: ConductorService, request: Any, context: Any) -> Any:
        try:
            if isinstance(request, UndecodableRequest):
                raise undecodable_error(request)
            return method(self, request, context)
        except NotLeader as exc:
            context.set_trailing_metadata(self._leader_metadata())
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except KvtierError as exc:
            context.set_trailing_metadata(((ERROR_METADATA_KEY, error_name(exc)),))
            context.abort(getattr(grpc.StatusCode, grpc_code_name(exc)), str(exc))

    return wrapper


def _tiers_pb(counts: TierCounts) -> pb.TierCounts:
    return pb.TierCounts(hbm=counts.hbm, dram=counts.dram, nvme=counts.nvme)


def _token_array(token_ids: Any) -> npt.NDArray[np.uint32]:
    """A request's ``repeated uint32 token_ids`` as a numpy array: one copy through the
    container's buffer (a few microseconds for thousands of ids, where ``list()`` makes a
    Python int per id: a hundred times more). Every hasher takes the array as it is."""
    return np.array(token_ids, dtype=np.uint32)


def _check_request_id(request_id: str) -> None:
    if not request_id:
        raise InvalidArgument("request_id must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")


class ConductorService(pb_grpc.ConductorServicer):
    """The servicer; all state lives in the :class:`~conductor.server.Conductor`."""

    def __init__(self, conductor: Conductor) -> None:
        self._c = conductor
        self._ticket_tenants: dict[int, str | None] = {}
        """The tenant each outstanding ticket was scheduled for (None: every tenant), under
        ``Conductor.lock``: who may report its completion (module docstring, "Tenants")."""

    # ------------------------------------------------------------------ helpers

    def _leader_metadata(self) -> tuple[tuple[str, str], ...]:
        view = self._c.leader()
        if view is None:
            return ((ERROR_METADATA_KEY, "NotLeader"),)
        return ((ERROR_METADATA_KEY, "NotLeader"),
                (LEADER_METADATA_KEY, f"{view.record.conductor_id}@{view.record.address}"))

    def _require_leader(self) -> None:
        if self._c.is_leader:
            return
        view = self._c.leader()
        where = (f"the leader is {view.record.conductor_id} at {view.record.address}"
                 if view is not None else "no leader is elected right now; retry shortly")
        raise NotLeader(f"conductor {self._c.config.conductor_id} is not the leader: {where}")

    def _require_view(self) -> None:
        """Refuse (UNAVAILABLE, retryable) while the conductor's view is being rebuilt: an
        answer from it could say "no instance serves model" while the engines are there."""
        why = self._c.view_unready()
        if why is not None:
            raise MembershipError(
                f"conductor {self._c.config.conductor_id} is rebuilding its view of the cluster "
                f"({why}): not answering from a partial view; retry shortly")

    @staticmethod
    def _scope(context: Any, namespaces: Any = ()) -> str | None:
        """The tenant this call acts for (module docstring, "Tenants"; None: every tenant),
        after checking the body ``tenant`` of each request in ``namespaces``. Raises
        PermissionDenied, InvalidArgument (a bad ``kvtier-tenant``)."""
        principal = current_principal()
        scope = resolve_tenant(principal, requested_tenant(context))
        if principal is not INSECURE:
            for namespace in namespaces:
                if namespace:
                    resolve_tenant(principal, namespace)
        return scope

    def _keys(self, model: str, tenant: str, keys: Any, token_ids: Any) -> tuple[bytes, ...]:
        """The request's chained keys, given as keys or as token ids (never both)."""
        if len(keys) and len(token_ids):
            raise InvalidArgument("give either keys or token_ids, not both")
        if len(token_ids):
            if not model:
                raise InvalidArgument("token_ids need a model (to find its key namespace)")
            if not self._c.has_fingerprint(model) and self._c.has_engine_events(model):
                return ()  # no store keys: only the engines' own caches are matched
            hasher = self._c.hasher(model, tenant)  # InvalidArgument: no fingerprint, no events
            if len(token_ids) > MAX_KEYS * hasher.block_size_tokens:
                raise InvalidArgument(f"more than {MAX_KEYS} blocks of token ids")
            return tuple(hasher.hash_blocks(token_ids if isinstance(token_ids, np.ndarray)
                                            else list(token_ids)))
        if len(keys) > MAX_KEYS:
            raise InvalidArgument(f"{len(keys)} keys; at most {MAX_KEYS} per request")
        out = tuple(keys)
        for i, key in enumerate(out):
            if not 1 <= len(key) <= MAX_KEY_BYTES:
                raise InvalidArgument(
                    f"keys[{i}] is {len(key)} bytes; chunk keys are 1 to {MAX_KEY_BYTES} bytes")
        return out

    # ------------------------------------------------------------------ RPCs

    @_rpc
    def Schedule(self, request: pb.ScheduleRequest, context: Any) -> pb.ScheduleReply:
        scope = self._scope(context, (request.tenant,))
        self._require_leader()
        self._require_view()
        return self._schedule(request, scope)

    @_rpc
    def ScheduleBatch(self, request: pb.ScheduleBatchRequest, context: Any
                      ) -> pb.ScheduleBatchReply:
        if len(request.items) > MAX_BATCH:
            raise InvalidArgument(f"{len(request.items)} requests; at most {MAX_BATCH} per batch")
        scope = self._scope(context, {item.tenant for item in request.items})
        self._require_leader()
        self._require_view()
        reply = pb.ScheduleBatchReply()
        for item in request.items:
            out = reply.items.add()
            try:
                out.reply.CopyFrom(self._schedule(item, scope))
            except KvtierError as exc:  # this item only; the others are decided
                out.error = error_name(exc)
                out.detail = str(exc)
        return reply

    def _schedule(self, request: pb.ScheduleRequest, scope: str | None) -> pb.ScheduleReply:
        """One decision for the tenant ``scope`` (:meth:`_scope`)."""
        _check_request_id(request.request_id)
        if not request.model:
            raise InvalidArgument("model must not be empty")
        if request.expected_output_tokens < 0:
            raise InvalidArgument(
                f"expected_output_tokens must be >= 0, got {request.expected_output_tokens}")
        token_ids = _token_array(request.token_ids)
        keys = self._keys(request.model, request.tenant, request.keys, token_ids)
        input_tokens = int(request.input_tokens) or len(token_ids)
        if input_tokens <= 0:
            raise InvalidArgument("input_tokens must be > 0 (or give token_ids)")
        if len(token_ids) and input_tokens < len(token_ids):
            raise InvalidArgument(
                f"input_tokens {input_tokens} < the {len(token_ids)} token ids given")
        c = self._c
        now_s = c.now_s(request.at_s)
        schedule_request = ScheduleRequest(request.request_id, request.model, keys, input_tokens,
                                           int(request.expected_output_tokens) or None, scope)
        # One hashing of the prompt serves the match and the mismatch probe below.
        match = c.engine_match(request.model, request.tenant, token_ids) \
            if len(token_ids) else None
        engine_cached = match.cached_tokens if match is not None else {}
        with c.lock:
            decision = c.scheduler.schedule(schedule_request, now_s, engine_cached)
            if not c.is_leader:
                # Leadership lapsed while deciding (etcd unreachable, this process paused):
                # another conductor may lead by now, so this decision must not go out.
                if decision.accepted:
                    c.scheduler.cancel(decision.ticket)
                self._require_leader()
            if decision.accepted:
                owners = self._ticket_tenants
                if len(owners) >= MAX_TICKET_OWNERS:
                    del owners[next(iter(owners))]
                owners[decision.ticket] = scope
            reply = self._reply(decision, keys, scope)
        if decision.accepted and decision.prefill_instance in engine_cached:
            # Its new blocks should show up in that engine's KV events (mismatch detection).
            c.engine_cache.expect_routed(decision.prefill_instance, token_ids, request.tenant,
                                         match)
        return reply

    def _reply(self, d: Decision, keys: tuple[bytes, ...], scope: str | None
               ) -> pb.ScheduleReply:
        reply = pb.ScheduleReply(
            request_id=d.request_id, accepted=d.accepted, message=d.message,
            prefix_blocks=d.prefix_blocks, local_blocks=d.local_blocks,
            local_tiers=_tiers_pb(d.local_tiers), ticket=d.ticket,
            conductor_id=self._c.config.conductor_id,
            engine_cached_tokens=d.engine_cached_tokens)
        if d.reason is not None:
            reply.reason = _REASON[d.reason]
        if d.ttft is not None:
            reply.ttft_estimate_s = d.ttft.total_s
            reply.queue_s = d.ttft.queue_s
            reply.transfer_s = d.ttft.transfer_s
            reply.prefill_s = d.ttft.prefill_s
            reply.load_s = d.ttft.load_s
        if d.tpot_s is not None:
            reply.tpot_s = d.tpot_s
        if d.prefill_instance is not None:
            reply.prefill_instance = d.prefill_instance
            reply.prefill_node = d.prefill_node or ""
        if d.decode_instance is not None:
            reply.decode_instance = d.decode_instance
        if d.fetch is not None:
            f = d.fetch
            plan = reply.fetch
            plan.src_node, plan.dst_node = f.src_node, f.dst_node
            plan.first_block, plan.end_block, plan.size_bytes = f.first_block, f.end_block, \
                f.size_bytes
            # Which tiers the source reads from: counts over [first, end) of its run.
            match = self._c.index.match(keys[:f.end_block], scope)
            upto_end = match.tier_counts(f.src_node, f.end_block)
            before = match.tier_counts(f.src_node, f.first_block) if f.first_block else \
                TierCounts()
            plan.src_tiers.CopyFrom(pb.TierCounts(hbm=upto_end.hbm - before.hbm,
                                                  dram=upto_end.dram - before.dram,
                                                  nvme=upto_end.nvme - before.nvme))
            node = self._c.nodes.get(f.src_node)
            if node is not None:
                plan.src_grpc_address = node.record.grpc_address
                plan.src_tcp_address = node.record.tcp_address
        if d.replicate is not None:
            reply.replicate.src_node = d.replicate.src_node
            reply.replicate.dst_nodes.extend(d.replicate.dst_nodes)
            reply.replicate.blocks = d.replicate.blocks
        return reply

    @_rpc
    def Lookup(self, request: pb.ConductorLookupRequest, context: Any
                     ) -> pb.ConductorLookupReply:
        scope = self._scope(context, (request.tenant,))
        self._require_view()
        keys = self._keys(request.model, request.tenant, request.keys, request.token_ids)
        match = self._c.index.match(keys, scope)
        reply = pb.ConductorLookupReply(blocks=len(keys), best_blocks=match.best_length)
        for node_id, length in sorted(match.lengths.items()):
            reply.nodes.append(pb.NodeMatch(node_id=node_id, blocks=length,
                                            tiers=_tiers_pb(match.tier_counts(node_id))))
        if len(request.token_ids):
            cached = self._c.engine_cached_tokens(request.model, request.tenant,
                                                  list(request.token_ids))
            for instance_id, tokens in sorted(cached.items()):
                view = self._c.engine_cache.view(instance_id)
                reply.engines.append(pb.EngineMatch(
                    instance_id=instance_id, cached_tokens=tokens,
                    mismatch=view is not None and bool(view.stats.mismatch)))
        return reply

    @_rpc
    def ReportLoad(self, request: pb.EngineLoad, context: Any) -> pb.ReportLoadReply:
        if not request.instance_id:
            raise InvalidArgument("instance_id must not be empty")
        check_instance_reporter(current_principal(), request.instance_id)
        if (request.queued_prefill_tokens < 0 or request.running_decode_batch < 0
                or request.kv_used_tokens < 0):
            raise InvalidArgument("load figures must be >= 0")
        c = self._c
        now_s = c.now_s(request.at_s)
        with c.lock:
            known = request.instance_id in c.engines
            if known:
                c.engine_load[request.instance_id] = (
                    int(request.queued_prefill_tokens), int(request.running_decode_batch),
                    int(request.kv_used_tokens), now_s)
                # Every conductor feeds its scheduler: a standby that takes over starts
                # from the engines' own figures instead of empty queues.
                c.scheduler.report_load(
                    c.scheduler_instance(request.instance_id), now_s,
                    queued_prefill_tokens=int(request.queued_prefill_tokens),
                    running_decode_batch=int(request.running_decode_batch),
                    kv_used_tokens=int(request.kv_used_tokens))
        return pb.ReportLoadReply(known=known)

    @_rpc
    def ReportCompletion(self, request: pb.CompletionReport, context: Any
                               ) -> pb.ReportCompletionReply:
        self._require_leader()
        c = self._c
        phase = request.WhichOneof("phase")
        if phase is None:
            raise InvalidArgument("a completion report needs prefill, decode or cancelled")
        now_s = c.now_s(request.at_s)
        with c.lock:
            self._check_ticket(request.ticket)
            try:
                self._complete(request, phase, now_s)
            finally:
                if phase != "prefill":  # the ticket is over (or was unknown)
                    self._ticket_tenants.pop(request.ticket, None)
        return pb.ReportCompletionReply()

    def _check_ticket(self, ticket: int) -> None:
        """PermissionDenied unless the caller may act for the tenant ``ticket`` was scheduled
        for (an unknown ticket passes: the scheduler answers for it). Hold the lock."""
        principal = current_principal()
        if principal is INSECURE or ticket not in self._ticket_tenants:
            return
        tenant = self._ticket_tenants[ticket]
        try:
            if tenant is None:
                if principal.tenants is not None:
                    raise PermissionDenied("")
            else:
                resolve_tenant(principal, tenant)
        except PermissionDenied:
            raise PermissionDenied(f"{principal.name} may not report on ticket {ticket}: it "
                                   "was scheduled for a tenant its credentials do not allow"
                                   ) from None

    def _complete(self, request: pb.CompletionReport, phase: str, now_s: float) -> None:
        c = self._c
        if phase == "cancelled":
            if not c.scheduler.cancel(request.ticket):
                raise InvalidArgument(f"unknown ticket {request.ticket} (issued by another "
                                      "leader, or already finished)")
        elif phase == "prefill":
            p = request.prefill
            if p.prefill_s == 0:  # not measured: its first token came out now (a front door)
                c.scheduler.first_token(request.ticket, now_s)
                return
            planned = p.computed_tokens == 0 and p.reused_tokens == 0
            c.scheduler.prefill_done(
                request.ticket, now_s, prefill_s=p.prefill_s,
                computed_tokens=None if planned else int(p.computed_tokens),
                reused_tokens=None if planned else int(p.reused_tokens),
                transfer_s=p.transfer_s or None, transferred_bytes=int(p.transferred_bytes))
        else:
            dd = request.decode
            if dd.output_tokens < 0:
                raise InvalidArgument("output_tokens must be >= 0")
            measured = dd.tpot_s > 0 and dd.batch_size > 0
            c.scheduler.decode_done(
                request.ticket, now_s, output_tokens=int(dd.output_tokens),
                tpot_s=dd.tpot_s if measured else None,
                batch_size=int(dd.batch_size) if measured else None,
                context_tokens=int(dd.context_tokens) if measured else None)

    @_rpc
    def Leader(self, request: pb.LeaderRequest, context: Any) -> pb.LeaderReply:
        c = self._c
        view = c.leader()
        with c.lock:
            live = c.live_nodes()
            prefill = c.scheduled_instances(EngineRole.PREFILL)
            decode = c.scheduled_instances(EngineRole.DECODE)
        return pb.LeaderReply(
            leader_id=view.record.conductor_id if view else "",
            leader_address=view.record.address if view else "",
            is_leader=c.is_leader, conductor_id=c.config.conductor_id,
            term=view.term if view else 0, indexed_blocks=len(c.index),
            live_nodes=live, prefill_instances=prefill, decode_instances=decode,
            engine_caches=[pb.EngineCacheInfo(**st.as_dict()) for st in c.engine_cache.stats()])


def add_to_server(service: ConductorService, server: grpc.Server) -> Any:
    """Register the servicer (with deserializers that answer undecodable bytes with
    INVALID_ARGUMENT: :func:`kvstore.wire.service_handler`), health checking and reflection;
    returns the health servicer."""
    server.add_generic_rpc_handlers(
        (service_handler(service, pb.DESCRIPTOR.services_by_name["Conductor"]),))
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    return health_servicer

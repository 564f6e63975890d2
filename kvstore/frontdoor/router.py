"""Where the front door sends a request: the backends it knows and the routers that pick one.

A :class:`Router` gets the prompt's token ids (as vLLM will compute them:
:mod:`kvstore.frontdoor.tokenizer`) and a :class:`RouteRequest`, and answers a
:class:`Backend`, a :class:`PdPair` (prefill/decode disaggregation: the front door prefills
on one backend and decodes on the other) or a :class:`Rejection` (an HTTP status and a reason
the client sees). Three implementations here, and :class:`~kvstore.frontdoor.local.
LocalRouter` (the conductor's decision made in the front door's process):

* :class:`RoundRobinRouter`: the healthy backends in turn; no token ids needed.
* :class:`ConductorRouter`: the conductor's ``Schedule`` with the token ids (the conductor
  hashes them into block keys and picks the instance with the best predicted TTFT); the
  instance it names is looked up by name in the pool. A rejection (an SLO it cannot meet, no
  decode room) becomes 429 or 503 with the conductor's message; a conductor that cannot place
  the request (no leader, a model no engine of it registered) is 503.
* :class:`PdRouter`: a prefill backend and a decode backend, each pool in turn
  (``kvtier frontdoor --prefill URL --decode URL``).

:class:`BackendPool` holds the backends and their health: the front door marks one down when a
request to it fails to connect, and up again when its ``/health`` answers (a probe loop in the
server). Backends come from a list today (``kvtier frontdoor --backend URL``);
:meth:`BackendPool.replace` is the seam for a watcher of etcd engine records (vLLM instances
registered with their HTTP address) that adds and removes them at run time.

All of it runs on one asyncio loop; nothing here is thread-safe.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable
from urllib.parse import urlsplit

from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
from kvstore.errors import InvalidArgument, KvtierError, MembershipError

if TYPE_CHECKING:  # the round-robin front door needs neither gRPC nor the client package
    from kvstore.client.conductor_client import ConductorClient

__all__ = ["Backend", "BackendPool", "ConductorRouter", "PdPair", "PdRouter", "Rejection",
           "RoundRobinRouter", "RouteRequest", "Router"]


@dataclass(frozen=True, slots=True)
class Backend:
    """One ``vllm serve`` instance: ``name`` is its instance id (what the conductor answers),
    ``url`` its base URL (``http://host:port``, no path)."""

    name: str
    url: str

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc or \
                parts.path not in ("", "/"):
            raise InvalidArgument(f"backend URL {self.url!r}: want http://host:port")
        if not self.name:
            raise InvalidArgument("a backend needs a name")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @classmethod
    def parse(cls, spec: str) -> Backend:
        """``URL`` (named after its host:port) or ``NAME=URL``."""
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            url, name = spec, urlsplit(spec).netloc
        return cls(name=name, url=url)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a router may know about a request besides its token ids."""

    request_id: str
    endpoint: str
    """``/v1/completions`` or ``/v1/chat/completions``."""
    model: str
    max_tokens: int | None
    stream: bool
    tenant: str = ""
    """The request's ``cache_salt`` (blocks of different salts never match)."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """No backend for this request: ``status`` is the HTTP status the client gets (429: the
    targets cannot be met now; 503: nothing can serve it), ``reason`` the message."""

    status: int
    reason: str
    code: str = "rejected"
    """A short machine-readable kind (the OpenAI error's ``code``)."""


@dataclass(frozen=True, slots=True)
class PdPair:
    """Prefill on ``prefill`` (``max_tokens=1``, ``do_remote_decode``), then decode on
    ``decode`` with the ``kv_transfer_params`` the prefill answered. ``prefill`` None: no
    prefill backend is healthy, the decode backend computes the prompt itself."""

    prefill: Backend | None
    decode: Backend


@runtime_checkable
class Router(Protocol):
    """Picks a backend for one request.

    ``route`` answers a backend of the pool it was built with (healthy when it last knew), or
    a :class:`Rejection`; it does not raise for a request it cannot place. It may be called by
    many concurrent requests of one event loop. ``token_ids`` is the whole prompt, in vLLM's
    tokenization; the router must not keep a reference to it past the call.

    A router that reserves capacity per request (:class:`~kvstore.frontdoor.local.
    LocalRouter`) also has ``done(request_id, output_tokens) -> None``, which the front door
    calls, without awaiting anything, once each request it routed to a backend ended.
    """

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | PdPair | Rejection: ...


class BackendPool:
    """The backends, in order, with a healthy flag each (all healthy at first)."""

    def __init__(self, backends: Iterable[Backend] = ()) -> None:
        self._backends: dict[str, Backend] = {}
        self._down: set[str] = set()
        self.replace(backends)

    def replace(self, backends: Iterable[Backend]) -> None:
        """Set the backends (a watcher of etcd records calls this); names stay down if they
        were. InvalidArgument for a name given twice."""
        new: dict[str, Backend] = {}
        for backend in backends:
            if backend.name in new:
                raise InvalidArgument(f"backend name {backend.name!r} given twice")
            new[backend.name] = backend
        self._backends = new
        self._down &= set(new)

    def all(self) -> list[Backend]:
        return list(self._backends.values())

    def healthy(self) -> list[Backend]:
        return [b for b in self._backends.values() if b.name not in self._down]

    def is_healthy(self, backend: Backend) -> bool:
        return backend.name in self._backends and backend.name not in self._down

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def mark_down(self, backend: Backend) -> None:
        if backend.name in self._backends:
            self._down.add(backend.name)

    def mark_up(self, backend: Backend) -> None:
        self._down.discard(backend.name)

    def down(self) -> list[Backend]:
        return [b for b in self._backends.values() if b.name in self._down]


class RoundRobinRouter:
    """The pool's healthy backends in turn (a backend marked down is skipped until it is up
    again); 503 when none is healthy."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool
        self._turn = itertools.count()

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | Rejection:
        healthy = self.pool.healthy()
        if not healthy:
            return Rejection(503, "no healthy backend", "no_backend")
        return healthy[next(self._turn) % len(healthy)]


_REJECT_STATUS: dict[int, int] = {pb.REJECT_TTFT_SLO: 429, pb.REJECT_TPOT_SLO: 429,
                  pb.REJECT_DECODE_KV_FULL: 503}
"""The conductor's ``RejectReason`` -> HTTP status: an SLO that cannot be met now (TTFT,
TPOT) is 429, no decode instance with room for the KV is 503."""
_REJECT_CODE: dict[int, str] = {pb.REJECT_TTFT_SLO: "ttft_slo", pb.REJECT_TPOT_SLO: "tpot_slo",
                pb.REJECT_DECODE_KV_FULL: "decode_kv_full"}


class ConductorRouter:
    """Asks the conductor's ``Schedule`` (see the module docstring). ``model`` is the model
    name the conductor knows the engines by (not necessarily vLLM's served name)."""

    def __init__(self, conductor: ConductorClient, pool: BackendPool, model: str) -> None:
        if not model:
            raise InvalidArgument("the conductor router needs the conductor's model name")
        self.conductor = conductor
        self.pool = pool
        self.model = model

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | Rejection:
        decision, _ = await self.ask(token_ids, request)
        return decision

    async def ask(self, token_ids: Sequence[int], request: RouteRequest, at_s: float = 0.0
                  ) -> tuple[Backend | Rejection, pb.ScheduleReply | None]:
        """:meth:`route`'s decision and the conductor's reply it came from (None when no
        reply came); an accepted reply's ``ticket`` is the caller's to report done. ``at_s``:
        the caller's clock, for a conductor run with ``--clock client`` only."""
        try:
            reply = await self.conductor.schedule(
                request.request_id, self.model, token_ids=token_ids, tenant=request.tenant,
                input_tokens=len(token_ids), expected_output_tokens=request.max_tokens or 0,
                at_s=at_s)
        except MembershipError as exc:
            return Rejection(503, f"no conductor answered: {exc}", "no_conductor"), None
        except KvtierError as exc:  # InvalidArgument: e.g. no engine of this model registered
            return Rejection(503, f"the conductor cannot place the request: {exc}",
                             "not_placed"), None
        return self.decision(reply), reply

    def decision(self, reply: pb.ScheduleReply) -> Backend | Rejection:
        """The backend an answer of the conductor names, or the rejection it is."""
        if not reply.accepted:
            return Rejection(_REJECT_STATUS.get(int(reply.reason), 503),
                             f"rejected by the conductor: {reply.message}",
                             _REJECT_CODE.get(int(reply.reason), "rejected"))
        return backend_named(self.pool, reply.prefill_instance, "the conductor")


def backend_named(pool: BackendPool, instance_id: str, chooser: str) -> Backend | Rejection:
    """The healthy backend of ``pool`` named ``instance_id`` (what ``chooser`` decided), or a
    503 saying why there is none."""
    backend = pool.get(instance_id)
    if backend is None:
        return Rejection(503, f"{chooser} chose instance {instance_id!r}, which the front "
                              f"door has no backend for", "unknown_backend")
    if not pool.is_healthy(backend):
        return Rejection(503, f"{chooser} chose instance {backend.name!r}, which is down",
                         "backend_down")
    return backend


class PdRouter:
    """Prefill/decode disaggregation: the healthy ``prefill`` backends in turn, each paired
    with the healthy ``decode`` backends in turn. Degrades rather than fails: no healthy
    prefill backend is a pair without one (the decode computes the prompt), no healthy decode
    backend is a healthy prefill backend alone (it runs the whole request, colocated); 503
    only when none of either is healthy. Every backend must be in ``pool`` (its health)."""

    def __init__(self, pool: BackendPool, prefill: Sequence[Backend],
                 decode: Sequence[Backend]) -> None:
        if not prefill or not decode:
            raise InvalidArgument("P/D routing needs at least one prefill and one decode "
                                  "backend")
        names = {b.name for b in pool.all()}
        missing = [b.name for b in (*prefill, *decode) if b.name not in names]
        if missing:
            raise InvalidArgument(f"P/D backends {missing} are not in the pool")
        self.pool = pool
        self.prefill = list(prefill)
        self.decode = list(decode)
        self._p_turn = itertools.count()
        self._d_turn = itertools.count()

    async def route(self, token_ids: Sequence[int], request: RouteRequest
                    ) -> Backend | PdPair | Rejection:
        prefill = [b for b in self.prefill if self.pool.is_healthy(b)]
        decode = [b for b in self.decode if self.pool.is_healthy(b)]
        p = prefill[next(self._p_turn) % len(prefill)] if prefill else None
        if not decode:
            return p if p is not None else Rejection(503, "no healthy backend", "no_backend")
        return PdPair(p, decode[next(self._d_turn) % len(decode)])

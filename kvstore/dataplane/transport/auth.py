"""Who may use a data-plane listener: same-host peer allowlists and injected session checks.

The data plane cannot know kvtier's principals (that is :mod:`kvstore.security`, a box above
it), so its listeners take plain values and hooks that the daemon wires in:

* :class:`PeerAllowlist`: the uids and gids a same-host peer (the lease channel's
  ``SO_PEERCRED``) may run as. The default allows only the uid of this process: a process of
  another user on the host is refused before any frame is served.
* :class:`SessionAuthorizer`: a callable ``authorize(ticket, peer) -> SessionGrant`` that
  verifies the session ticket a TCP connection presents before any frame is served, raising
  :class:`~kvstore.errors.Unauthenticated` (no, forged, stale or expired ticket) or
  :class:`~kvstore.errors.PermissionDenied`. The daemon's is
  :meth:`kvstore.security.tickets.TicketAuthority.authorize`. Without one a listener serves
  every connection as :data:`INSECURE_GRANT` (today's loopback behaviour).
* :class:`TenantScope`: the tenant a verified session acts for (carried by its grant). A
  listener whose grant has a scope serves that connection through ``backend.scoped(scope)``
  (an optional backend method: the daemon's backends, :mod:`kvstore.node.backend`, bind the
  tenant there, so every frame of the connection reads and writes as it); a backend without
  ``scoped`` refuses such a connection (it could not keep tenants apart).
* :class:`SessionTicket` and :class:`TicketSource`: what a data-plane client presents, and
  where it gets a current one (the client library fetches them over gRPC and renews them).
* :func:`current_grant`: the :class:`SessionGrant` of the connection a backend call is serving
  (each TCP connection runs on its own thread, which sets it once when the ticket verified).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvstore.errors import InvalidArgument, PermissionDenied

MAX_TICKET_BYTES = 1024
"""Longest session ticket a listener reads (a ticket rides in one frame's payload)."""


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """A same-host peer as the kernel reports it (``SO_PEERCRED``): its pid, uid and primary
    gid when it connected."""

    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"pid {self.pid} (uid {self.uid}, gid {self.gid})"


@dataclass(frozen=True, slots=True)
class PeerAllowlist:
    """The uids and gids a same-host peer may run as. ``uids`` defaults to this process's own
    uid only; ``gids`` to none. A peer is allowed when its uid is listed or its primary gid
    (the gid ``SO_PEERCRED`` reports) is listed: put engines of another user in a group the
    daemon allows, or list their uid."""

    uids: frozenset[int] = field(default_factory=lambda: frozenset({os.getuid()}))
    gids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        for what, ids in (("uid", self.uids), ("gid", self.gids)):
            if not isinstance(ids, frozenset):
                raise InvalidArgument(f"{what}s must be a frozenset of ints, got {ids!r}")
            for value in ids:
                if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                    raise InvalidArgument(f"{what}s must hold ints >= 0, got {value!r}")

    @classmethod
    def of(cls, uids: tuple[int, ...] | list[int] = (), gids: tuple[int, ...] | list[int] = (),
           *, include_self: bool = True) -> PeerAllowlist:
        """This process's uid (unless ``include_self`` is False) plus ``uids``; ``gids``."""
        own = {os.getuid()} if include_self else set()
        return cls(frozenset(own | set(uids)), frozenset(gids))

    def allows(self, peer: PeerCredentials) -> bool:
        return peer.uid in self.uids or peer.gid in self.gids

    def describe(self) -> str:
        """The allowlist for a log line or an error message."""
        uids = ", ".join(str(u) for u in sorted(self.uids)) or "none"
        gids = ", ".join(str(g) for g in sorted(self.gids)) or "none"
        return f"uids {uids}; gids {gids}"


@dataclass(frozen=True, slots=True)
class TenantScope:
    """The tenant one data-plane session acts for, resolved when its ticket was issued (from
    the caller's credentials and the tenant it named, as a gRPC call's).

    ``read``: reads see this tenant's chunks and the shared ones (None: every tenant's, for an
    operator or peer of every tenant that named none). ``write``: the tenant its puts are
    stored as (None: this session may not write: it named the shared tenant without being a
    shared writer). The names are opaque here (the node gives them meaning)."""

    read: str | None
    write: str | None

    def __post_init__(self) -> None:
        for what, value in (("read", self.read), ("write", self.write)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"a tenant scope's {what} tenant must be a str or None, "
                                      f"got {value!r}")


@dataclass(frozen=True, slots=True)
class SessionGrant:
    """What a verified session ticket allows one data-plane connection: the principal's
    ``name`` (for logs), its ``role`` (a :class:`kvstore.security.identity.Role` value as a
    string), its ``tenants`` (None: every tenant) and when the grant ends
    (``expires_at_unix_s``, wall clock: tickets cross processes). A connection whose grant has
    ended is closed at its next request. ``scope``: the tenant the session acts for (None: no
    scope, the backend serves it as it serves an unauthenticated listener: only for backends
    that know no tenants and tickets minted without one)."""

    name: str
    role: str
    tenants: frozenset[str] | None
    expires_at_unix_s: float
    scope: TenantScope | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise InvalidArgument("a session grant needs the principal's name")
        if self.tenants is not None and not isinstance(self.tenants, frozenset):
            raise InvalidArgument(f"tenants must be a frozenset or None, got {self.tenants!r}")
        if math.isnan(self.expires_at_unix_s):
            raise InvalidArgument("expires_at_unix_s must be a time, got nan")
        if self.scope is not None and not isinstance(self.scope, TenantScope):
            raise InvalidArgument(f"scope must be a TenantScope or None, got {self.scope!r}")

    def may_access(self, tenant: str) -> bool:
        return self.tenants is None or tenant in self.tenants


INSECURE_GRANT = SessionGrant("insecure", "operator", None, math.inf)
"""The grant of every connection to a listener without a :class:`SessionAuthorizer`."""

@dataclass(frozen=True, slots=True)
class SessionTicket:
    """A ticket as a client holds it: the bytes it presents, when it expires (wall clock,
    Unix seconds: the issuing daemon's clock, so a client renews a margin before), its
    lifetime ``ttl_s`` when issued (0: unknown), and ``read_owners``: the owners (tenants) whose
    chunks the session may read, for a same-host reader that copies chunks without asking the
    daemon (the read index's "Owners"): None for every owner's, empty (the default) for none
    known, so a ticket that says nothing makes every such read take the checked path."""

    ticket: bytes
    expires_at_unix_s: float
    ttl_s: float = 0.0
    read_owners: tuple[str, ...] | None = ()

    def __post_init__(self) -> None:
        if not isinstance(self.ticket, bytes) or not self.ticket:
            raise InvalidArgument("a session ticket is non-empty bytes")
        if len(self.ticket) > MAX_TICKET_BYTES:
            raise InvalidArgument(f"a session ticket is at most {MAX_TICKET_BYTES} bytes, got "
                                  f"{len(self.ticket)}")
        if math.isnan(self.expires_at_unix_s):
            raise InvalidArgument("expires_at_unix_s must be a time, got nan")
        if self.read_owners is not None and (not isinstance(self.read_owners, tuple) or not all(
                isinstance(o, str) for o in self.read_owners)):
            raise InvalidArgument(f"read_owners is a tuple of tenant names or None, got "
                                  f"{self.read_owners!r}")


@runtime_checkable
class TicketSource(Protocol):
    """Where a data-plane client gets the ticket it presents (thread-safe).

    ``current()`` returns a ticket that is valid for a while yet (an implementation renews it
    some margin before it expires; it may block on the call that issues one and raise its
    errors). ``refused(ticket)`` says a server refused that ticket (stale after a restart,
    expired early): the next ``current()`` returns another one. Clients present
    ``current()`` on each new connection and again, as a renewal, on a connection whose
    ticket is about to expire (``renew_margin_s`` before)."""

    def current(self) -> SessionTicket: ...

    def refused(self, ticket: bytes) -> None: ...


RENEW_MARGIN_S = 30.0
"""How long before its ticket expires a client connection presents a new one (at most a
quarter of the ticket's lifetime)."""


def renew_at(ticket: SessionTicket) -> float:
    """When a holder of ``ticket`` asks for (or presents) a new one (wall clock)."""
    margin = RENEW_MARGIN_S if ticket.ttl_s <= 0 else min(RENEW_MARGIN_S, ticket.ttl_s / 4)
    return ticket.expires_at_unix_s - margin


SessionAuthorizer = Callable[[bytes, str], SessionGrant]
"""``authorize(ticket, peer)``: verify ``ticket`` (the bytes a connection presented) for the
peer ``peer`` (``host:port``, for logs and optional binding) and return its grant. Raises
``Unauthenticated`` (forged, stale, expired, malformed) or ``PermissionDenied``. Called on the
connection's own thread, once per connection; it must be thread-safe."""

def renewed_grant(authorize: SessionAuthorizer, ticket: bytes, peer: str,
                  previous: SessionGrant | None) -> SessionGrant:
    """The grant of the ticket a session's HELLO carries (``previous``: the grant the session
    already has; None on its first HELLO). A renewal must act for the same tenant scope as the
    first ticket. Raises Unauthenticated (the authorizer refused the ticket), PermissionDenied
    (another scope than the session's). Shared by the TCP and UCX listeners."""
    grant = authorize(ticket, peer)
    if previous is not None and grant.scope != previous.scope:
        raise PermissionDenied(f"a renewed session ticket must act for the same tenant as the "
                               f"session's first ({previous.scope} then {grant.scope}); open "
                               "a new session")
    return grant


def scoped_backend(backend: Any, scope: TenantScope) -> Any:
    """``backend.scoped(scope)``: the backend one session of ``scope`` is served through (module
    docstring, :class:`TenantScope`). Raises PermissionDenied for a backend without ``scoped``
    (it keeps no tenants apart)."""
    scoped = getattr(backend, "scoped", None)
    if scoped is None:
        raise PermissionDenied("this data plane's backend keeps no tenants apart, so it cannot "
                               f"serve a session scoped to {scope}")
    return scoped(scope)


_current_grant: ContextVar[SessionGrant] = ContextVar("kvtier_session_grant",
                                                       default=INSECURE_GRANT)


def current_grant() -> SessionGrant:
    """The grant of the data-plane connection being served on this thread
    (:data:`INSECURE_GRANT` on a listener without an authorizer, or outside one)."""
    return _current_grant.get()


def set_current_grant(grant: SessionGrant) -> None:
    """Set this thread's grant (a listener calls it once on each connection's own thread)."""
    _current_grant.set(grant)

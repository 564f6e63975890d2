"""The authenticated caller of one request, and the tenants and operations it may use.

A :class:`Principal` comes from the caller's credentials (a client certificate or a signed bearer
token), never from the request body. The services read it with :func:`current_principal` while
they serve a call; the authentication layer sets it around each handler with :func:`serving_as`.
A service started without security configuration serves every call as :data:`INSECURE`: an
operator of every tenant, which is what an unauthenticated loopback-only daemon allows today.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass


class Role(enum.Enum):
    """What a caller is. ``ENGINE``: put, get and lookup within its tenants. ``OPERATOR``: the
    admin operations (stats, ls, inspect, evict, pin, drain) across tenants. ``PEER``: the
    conductor, following the daemons' chunk events (Subscribe, Snapshot: every tenant's keys).
    ``DAEMON``: a store daemon's own identity (its server certificate, or a token it holds):
    it may call ``Info`` and nothing else, on daemons and conductors alike, and acts for no
    tenant, so a daemon's certificate, which the CA signs for clientAuth as well, cannot follow
    another daemon's events or read a chunk (docs/security.md, "Roles")."""

    ENGINE = "engine"
    OPERATOR = "operator"
    PEER = "peer"
    DAEMON = "daemon"


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: ``name`` (certificate subject or token subject, for logs and
    audit), ``role``, and ``tenants``: the tenants it may read and write, ``None`` for every
    tenant (a shared engine that enforces ``cache_salt`` per request itself, an operator, a
    peer). ``shared_writer``: it may also write the shared tenant that everyone may read."""

    name: str
    role: Role
    tenants: frozenset[str] | None
    shared_writer: bool = False

    def may_access(self, tenant: str) -> bool:
        """Whether this caller may read and write ``tenant``'s chunks."""
        return self.tenants is None or tenant in self.tenants


INSECURE = Principal("insecure", Role.OPERATOR, None, shared_writer=True)
"""The caller of every request on a service that runs without authentication. The daemon takes
the tenant such a call names as given, and one naming none as the default tenant's except for
the admin calls (:func:`kvstore.security.tenancy.resolve_tenant`)."""

_current: ContextVar[Principal] = ContextVar("kvtier_principal", default=INSECURE)


def current_principal() -> Principal:
    """The principal of the request being served in this context (:data:`INSECURE` outside
    an authenticated call)."""
    return _current.get()


@contextlib.contextmanager
def serving_as(principal: Principal) -> Iterator[Principal]:
    """Serve the enclosed code as ``principal`` (the authentication layer wraps each handler)."""
    token = _current.set(principal)
    try:
        yield principal
    finally:
        _current.reset(token)


ANONYMOUS = Principal("anonymous", Role.ENGINE, frozenset())
"""The caller of an unauthenticated health check on a service that authenticates: an engine of
no tenant, so code that runs under it by mistake may touch nothing."""

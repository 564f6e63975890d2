"""Which tenant a call acts for: the one rule the daemon and the conductor share.

A call names its tenant in the ``kvtier-tenant`` request metadata (:func:`requested_tenant`);
the name is never a credential by itself. :func:`resolve_tenant` checks it against the caller's
authenticated :class:`~kvstore.security.identity.Principal` (docs/security.md, "Tenant
isolation"): an engine names one of its tenants, or none when it has exactly one; an operator or
peer of every tenant that names none acts for every tenant (reads; writes are the default
tenant's); writing the shared tenant needs ``shared_writer``; a name the credentials do not allow
is PERMISSION_DENIED. Without security configured (the ``INSECURE`` principal) the metadata is
taken as given, and a call naming none acts for the default tenant, except the admin calls,
which see every tenant.

The daemon resolves every chunk call with it (kvstore/node/service.py, "Tenants"); the conductor
resolves Schedule, ScheduleBatch and Lookup with it (conductor/service.py, "Tenants").

Engine instances carry no tenant, so what a caller may say about one (the conductor's
ReportLoad) is bound to its identity instead (:func:`check_instance_reporter`): an engine whose
credentials name tenants reports only for the instances its credential is named for, a shared
engine (every tenant), an operator, or a service without security for any.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import InvalidArgument, PermissionDenied
from kvstore.security.identity import INSECURE, Principal, Role
from kvstore.security.tickets import holder_scope
from kvstore.wire import TENANT_MAX_CHARS, TENANT_METADATA_KEY

__all__ = ["DEFAULT_TENANT", "SHARED_TENANT", "check_instance_reporter", "readable_owners",
           "requested_tenant", "resolve_tenant"]

DEFAULT_TENANT = ""
"""The tenant of a request that names none (every client before tenants existed)."""
SHARED_TENANT = "kvtier.shared"
"""The tenant whose chunks every tenant may read; only shared writers may write it."""


def requested_tenant(context: Any) -> str | None:
    """The tenant the call's ``kvtier-tenant`` metadata names, or None when it names none.
    ``context``: a gRPC servicer context (aio or threaded). InvalidArgument for a value that is
    too long or two different values."""
    found: str | None = None
    for key, value in context.invocation_metadata() or ():
        if key == TENANT_METADATA_KEY:
            text = str(value)
            if len(text) > TENANT_MAX_CHARS:
                raise InvalidArgument(f"{TENANT_METADATA_KEY} is at most {TENANT_MAX_CHARS} "
                                      f"characters, got {len(text)}")
            if found is not None and found != text:
                raise InvalidArgument(f"the call names two tenants in {TENANT_METADATA_KEY}")
            found = text
    return found


def _allowed(principal: Principal) -> str:
    if principal.tenants is None:
        return "every tenant"
    return "tenant(s) " + ", ".join(repr(t) for t in sorted(principal.tenants))


def resolve_tenant(principal: Principal, requested: str | None, *, write: bool = False,
                   admin: bool = False) -> str | None:
    """The tenant a call of ``principal`` acts for (module docstring): a name, or None for
    every tenant (reads only). ``requested``: what its ``kvtier-tenant`` metadata names.
    ``write``: the call stores chunks (never None; the shared tenant needs ``shared_writer``).
    ``admin``: an operator's call (ls, inspect, pin, remove, evict). Raises PermissionDenied."""
    tenant: str | None
    if principal is INSECURE:  # no security configured: nothing to check against
        tenant = requested if requested is not None else (None if admin else DEFAULT_TENANT)
    elif requested is not None:
        if not (principal.may_access(requested)
                or (requested == SHARED_TENANT and principal.shared_writer)):
            raise PermissionDenied(f"{principal.name} may not act for tenant {requested!r} "
                                   f"({TENANT_METADATA_KEY}): its credentials allow "
                                   f"{_allowed(principal)}")
        tenant = requested
    elif principal.tenants is not None and len(principal.tenants) == 1:
        (tenant,) = principal.tenants
    elif principal.tenants is None and principal.role is not Role.ENGINE:
        tenant = None  # an operator or peer of every tenant: every chunk
    else:
        raise PermissionDenied(f"{principal.name} may act for {_allowed(principal)}: the call "
                               f"must name one in the {TENANT_METADATA_KEY} metadata "
                               "(StoreClientConfig.tenant)")
    if write:
        tenant = DEFAULT_TENANT if tenant is None else tenant
        if tenant == SHARED_TENANT and not principal.shared_writer:
            raise PermissionDenied(f"{principal.name} may not write the shared tenant "
                                   f"{SHARED_TENANT!r}: its credentials need shared_writer")
    return tenant


def check_instance_reporter(principal: Principal, instance_id: str) -> None:
    """PermissionDenied unless ``principal`` may report figures (load) for engine instance
    ``instance_id`` (module docstring): its credential's name, less a ``<role>/`` prefix
    (certificates name ``engine/vllm-0``), is the instance id or the id's part before a ``.``
    (``vllm-0`` reports for ``vllm-0`` and ``vllm-0.decode``); credentials of every tenant,
    operators and ``INSECURE`` report for any instance. Checked before the instance is looked
    up, so a refusal says nothing about whether it exists."""
    if principal is INSECURE or principal.tenants is None or principal.role is Role.OPERATOR:
        return
    name = principal.name.removeprefix(f"{principal.role.value}/")
    if instance_id == name or instance_id.startswith(name + "."):
        return
    raise PermissionDenied(
        f"{principal.name} may not report for engine instance {instance_id!r}: an engine "
        f"credential scoped to {_allowed(principal)} reports only for its own instances "
        f"({name!r} or {name + '.*'!r}); a shared engine (tenants '*') or an operator may "
        "report for any")


def readable_owners(ticket_reply: Any) -> tuple[str, ...] | None:
    """Whose chunks a data-plane session may read, from its ``IssueDataTicketResponse``: None
    for every tenant's (``every_tenant``), else its tenant's and the shared tenant's (the
    lease-free same-host reader copies only those: docs/security.md, "Same host").

    The read tenant comes from the ticket's own claims (:func:`~kvstore.security.tickets.
    holder_scope`), so a default-tenant session (an operator or an every-tenant engine naming
    ``""``) copies its own chunks lease-free too. The reply alone cannot say: it names the
    tenant the session *writes* as, and a session that may only read the shared tenant writes
    as none and says ``""`` as well; so a ticket whose claims do not parse falls back to
    that, and ``""`` gives the shared tenant alone (the default tenant's chunks then take
    the leased path, never the other way round)."""
    if ticket_reply.every_tenant:
        return None
    try:
        scope = holder_scope(ticket_reply.ticket)
    except InvalidArgument:
        scope = None
    if scope is not None and scope.read is not None:
        read = scope.read
        return (read, SHARED_TENANT) if read != SHARED_TENANT else (SHARED_TENANT,)
    tenant = str(ticket_reply.tenant)
    return (tenant, SHARED_TENANT) if tenant and tenant != SHARED_TENANT else (SHARED_TENANT,)

"""The tenant scope a session ticket carries (pure logic, and real TCP / lease channel servers
over backends that know no tenants), and parent hints kept per tenant."""

from __future__ import annotations

import base64
import json

import pytest

from kvstore.dataplane.transport import MemoryBackend, TcpClient, TcpServer, TcpServerConfig
from kvstore.dataplane.transport.auth import SessionTicket, TenantScope, renew_at
from kvstore.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvstore.node.backend import ParentHints
from kvstore.security.identity import Principal, Role
from kvstore.security.tickets import TicketAuthority

ALICE = Principal("engine-a", Role.ENGINE, frozenset({"alice", "acme"}))


def test_the_scope_round_trips_and_a_ticket_without_one_has_none() -> None:
    authority = TicketAuthority("node-a", ttl_s=60)
    scoped = authority.authorize(authority.mint(ALICE, scope=TenantScope("alice", "alice"))
                                 .ticket, "peer")
    assert scoped.scope == TenantScope("alice", "alice")
    assert scoped.tenants == frozenset({"alice", "acme"})
    every = authority.authorize(authority.mint(ALICE, scope=TenantScope(None, "")).ticket, "p")
    assert every.scope == TenantScope(None, "")
    read_only = authority.authorize(
        authority.mint(ALICE, scope=TenantScope("kvtier.shared", None)).ticket, "p")
    assert read_only.scope == TenantScope("kvtier.shared", None)
    assert authority.authorize(authority.mint(ALICE).ticket, "p").scope is None


def test_a_scope_edited_into_a_ticket_does_not_verify() -> None:
    authority = TicketAuthority("node-a", ttl_s=60)
    ticket = authority.mint(ALICE, scope=TenantScope("alice", "alice")).ticket
    prefix, claims_b64, mac = ticket.split(b".")
    claims = json.loads(base64.urlsafe_b64decode(claims_b64 + b"=" * (-len(claims_b64) % 4)))
    claims["scope"] = ["acme", "acme"]
    forged = b".".join((prefix, base64.urlsafe_b64encode(
        json.dumps(claims, separators=(",", ":"), sort_keys=True).encode()).rstrip(b"="), mac))
    with pytest.raises(Unauthenticated, match="does not verify"):
        authority.authorize(forged, "peer")


def test_bad_scopes_and_tickets_are_refused_where_they_are_built() -> None:
    with pytest.raises(InvalidArgument):
        TenantScope(3, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        TicketAuthority("n").mint(ALICE, scope=("alice", "alice"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        SessionTicket(b"", 1.0)
    with pytest.raises(InvalidArgument):
        SessionTicket(b"x" * 2000, 1.0)


def test_renewal_comes_a_margin_before_expiry() -> None:
    assert renew_at(SessionTicket(b"t", 1000.0, 600.0)) == 970.0  # 30 s before
    assert renew_at(SessionTicket(b"t", 1000.0, 2.0)) == 999.5  # a quarter of a short one
    assert renew_at(SessionTicket(b"t", 1000.0)) == 970.0  # lifetime unknown


def test_a_backend_without_tenants_refuses_a_scoped_session_and_serves_an_unscoped_one() -> None:
    authority = TicketAuthority("node-a", ttl_s=60)
    backend = MemoryBackend()
    with TcpServer(backend, TcpServerConfig(), authorize=authority.authorize) as srv:
        ep = srv.endpoint
        scoped = authority.mint(ALICE, scope=TenantScope("alice", "alice")).ticket
        with pytest.raises(PermissionDenied, match="keeps no tenants apart"), \
                TcpClient(ep.host, ep.port, 1, ticket=scoped) as c:
            c.put(b"k", b"v")
        assert not backend.exists(b"k")
        with TcpClient(ep.host, ep.port, 1, ticket=authority.mint(ALICE).ticket) as c:
            c.put(b"k", b"v")
            assert bytes(c.get(b"k")) == b"v"


def test_parent_hints_belong_to_the_tenant_that_announced_them() -> None:
    hints = ParentHints()
    hints.expect(b"child", b"p-alice", 10.0, tenant="alice")
    hints.expect(b"child", b"p-bob", 10.0, tenant="bob")  # does not replace alice's
    assert hints.take(b"child", "carol") is None
    assert hints.take(b"child", "alice") == b"p-alice"
    assert hints.take(b"child", "alice") is None  # taken once
    assert hints.take(b"child", "bob") == b"p-bob"
    hints.expect(b"k", b"p", 10.0)  # an unscoped put takes the latest hint, whoever gave it
    hints.expect(b"k", b"q", 10.0, tenant="acme")
    assert hints.take(b"k") == b"q"
    assert len(hints) == 1  # the default tenant's is still there
    assert hints.take(b"k", "") == b"p"
    assert len(hints) == 0

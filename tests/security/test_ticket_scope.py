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


class _Source:
    """A TicketSource that hands out ``tickets`` in turn, the next one after each refusal."""

    def __init__(self, tickets: list[bytes]) -> None:
        self.tickets = tickets
        self.refusals: list[bytes] = []

    def current(self) -> SessionTicket:
        return SessionTicket(self.tickets[0], 4e9)

    def refused(self, ticket: bytes) -> None:
        self.refusals.append(ticket)
        if self.tickets[0] == ticket and len(self.tickets) > 1:
            self.tickets.pop(0)


def test_a_client_presents_a_new_ticket_after_a_refusal_and_once_only() -> None:
    """A stale ticket (another key: a daemon that restarted) is reported and a fresh one is
    presented on a new connection; two refusals in a row fail the call."""
    authority = TicketAuthority("node-a", ttl_s=60)
    stale = TicketAuthority("node-a", ttl_s=60).mint(ALICE).ticket
    with TcpServer(MemoryBackend(), TcpServerConfig(), authorize=authority.authorize) as srv:
        ep = srv.endpoint
        source = _Source([stale, authority.mint(ALICE).ticket])
        with TcpClient(ep.host, ep.port, 1, ticket=source) as c:
            c.put(b"k", b"v")
            assert bytes(c.get(b"k")) == b"v"
        assert source.refusals == [stale]
        bad = _Source([stale, stale])
        with pytest.raises(Unauthenticated), TcpClient(ep.host, ep.port, 1, ticket=bad) as c:
            c.put(b"k2", b"v")
        assert bad.refusals == [stale, stale]


def test_a_lease_channel_presents_a_new_ticket_after_a_refusal() -> None:
    from kvstore.dataplane.dram import DramTier
    from kvstore.dataplane.tier import TierKind
    from kvstore.dataplane.transport.shm import ShmServer
    from kvstore.dataplane.transport.shm.channel import LeaseChannel
    from kvstore.dataplane.transport.shm.frames import ChannelOp
    from kvstore.node.backend import ShmLeases
    from kvstore.node.cache import TieredCache

    authority = TicketAuthority("node-a", ttl_s=60)
    stale = TicketAuthority("node-a", ttl_s=60).mint(ALICE, scope=TenantScope("alice", "alice"))
    cache = TieredCache({TierKind.DRAM: DramTier(4 << 20)})
    server = ShmServer(ShmLeases(cache), lease_ttl_s=5.0, authorize=authority.authorize)
    server.start()
    try:
        source = _Source([stale.ticket, authority.mint(
            ALICE, scope=TenantScope("alice", "alice")).ticket])
        chan = LeaseChannel(server.address, io_timeout_s=10, ticket=source)
        try:
            chan.call(ChannelOp.PUT, keys=[b"k" * 16, b""], arg=1, payload=memoryview(b"v"))
        finally:
            chan.close()
        assert source.refusals == [stale.ticket]
        assert cache.entry(b"k" * 16, "alice") is not None
        assert cache.entry(b"k" * 16, "bob") is None
        with pytest.raises(Unauthenticated):
            LeaseChannel(server.address, io_timeout_s=10, ticket=_Source([stale.ticket]))
        assert server.unauthenticated == 3
    finally:
        server.close()
        for tier in cache.tiers.values():
            tier.close()

"""Tenant-scoped TCP connections on the native small-GET loop (kvstore/dataplane/transport/tcp/
server.py, "Tenants"; native/fastpath.c, ``index_copy``): a real TcpServer over the daemon's
CacheLeaseBackend on a real tiered cache whose DRAM tier publishes a read index, sessions
bound by real tickets of a TicketAuthority, real TcpClients on loopback.

A scoped connection serves a chunk from C only once Python checked that publish for its
tenant (after the tenant's TCP put of it, or its first get), for every connection of that
tenant; another tenant's chunk is never served, from C or Python, even after the key was
verified and then removed and replaced by the other tenant's bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvstore.dataplane import native
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.auth import TenantScope
from kvstore.dataplane.transport.tcp import TcpClient, TcpServer
from kvstore.errors import ChunkNotFound
from kvstore.node.backend import CacheLeaseBackend
from kvstore.node.cache import TieredCache
from kvstore.security.identity import Principal, Role
from kvstore.security.tickets import TicketAuthority

pytestmark = pytest.mark.skipif(native.load() is None,
                                reason="the native library is not built (make native)")

SMALL = 4096


@pytest.fixture
def served() -> Iterator[tuple[TieredCache, TcpServer, TicketAuthority]]:
    cache = TieredCache({TierKind.DRAM: DramTier(16 << 20, read_index_slots=1024)})
    authority = TicketAuthority("native-scope")
    server = TcpServer(CacheLeaseBackend(cache), authorize=authority.authorize)
    server.start()
    assert server.native_active
    try:
        yield cache, server, authority
    finally:
        server.close()
        for tier in cache.tiers.values():
            tier.close()


def _client(server: TcpServer, authority: TicketAuthority, tenant: str) -> TcpClient:
    principal = Principal(tenant, Role.ENGINE, frozenset({tenant}))
    ticket = authority.mint(principal, scope=TenantScope(tenant, tenant)).ticket
    ep = server.endpoint
    return TcpClient(ep.host, ep.port, connections=1, ticket=ticket)


def _get(client: TcpClient, key: bytes, size: int = SMALL) -> bytes:
    out = bytearray(size)
    client.get_into(key, out)
    return bytes(out)


def test_a_scoped_connection_serves_its_verified_chunks_from_the_native_loop(
        served: tuple[TieredCache, TcpServer, TicketAuthority]) -> None:
    cache, server, authority = served
    alice = _client(server, authority, "alice")
    written = {b"a%015d" % i: os.urandom(SMALL) for i in range(8)}
    for key, value in written.items():
        alice.put(key, value)  # a scoped TCP put verifies its own publish
    for _ in range(3):
        for key, value in written.items():
            assert _get(alice, key) == value
    assert server.stats().native_gets == 3 * len(written)
    # Chunks stored another way (gRPC, the lease channel): the first get runs in Python and
    # verifies the publish, for every connection of the tenant.
    stored = {b"g%015d" % i: os.urandom(SMALL) for i in range(8)}
    for key, value in stored.items():
        cache.put(key, value, tenant="alice")
    for key, value in stored.items():
        assert _get(alice, key) == value
    assert server.stats().native_gets == 3 * len(written)
    other = _client(server, authority, "alice")
    for key, value in stored.items():
        assert _get(other, key) == value
        assert _get(alice, key) == value
    assert server.stats().native_gets == 3 * len(written) + 2 * len(stored)
    alice.close()
    other.close()


def test_another_tenants_chunk_is_never_served_natively(
        served: tuple[TieredCache, TcpServer, TicketAuthority]) -> None:
    _cache, server, authority = served
    alice, bob = (_client(server, authority, t) for t in ("alice", "bob"))
    key, mine = b"k" * 16, os.urandom(SMALL)
    alice.put(key, mine)
    for _ in range(3):
        assert _get(alice, key) == mine  # verified on alice's connection
    for _ in range(3):
        with pytest.raises(ChunkNotFound):
            _get(bob, key)
    # Paired: bob's own chunk is his, natively after the first read.
    bobs_key, his = b"b" * 16, os.urandom(SMALL)
    bob.put(bobs_key, his)
    for _ in range(3):
        assert _get(bob, bobs_key) == his
        with pytest.raises(ChunkNotFound):
            _get(alice, bobs_key)
    alice.close()
    bob.close()


def test_a_verified_key_replaced_by_another_tenant_is_not_served(
        served: tuple[TieredCache, TcpServer, TicketAuthority]) -> None:
    """Alice's connection verified her chunk under key K and serves it from C; she removes it
    and bob stores his own bytes under K (a new publish of the same key, likely in the same
    read-index slot): her connection answers not-found, never his bytes, and his reads work."""
    _cache, server, authority = served
    alice, bob = (_client(server, authority, t) for t in ("alice", "bob"))
    key, mine, his = b"r" * 16, b"A" * SMALL, b"B" * SMALL
    alice.put(key, mine)
    for _ in range(3):
        assert _get(alice, key) == mine
    native_before = server.stats().native_gets
    assert native_before >= 2
    assert alice.remove(key)
    bob.put(key, his)
    for _ in range(3):
        with pytest.raises(ChunkNotFound):
            _get(alice, key)
        assert _get(bob, key) == his
    # Alice stores hers again (bob removed his): a third publish, verified afresh.
    assert bob.remove(key)
    alice.put(key, mine)
    for _ in range(3):
        assert _get(alice, key) == mine
        with pytest.raises(ChunkNotFound):
            _get(bob, key)
    alice.close()
    bob.close()


def test_the_verification_is_per_publish_not_per_key(
        served: tuple[TieredCache, TcpServer, TicketAuthority]) -> None:
    """The C loop itself: a slot's verified (slot, seq) stops matching once the slot is
    rewritten, so the replaced chunk comes back to Python (declined) instead of being served."""
    cache, server, authority = served
    alice = _client(server, authority, "alice")
    key = b"p" * 16
    cache.put(key, b"1" * SMALL, tenant="alice")
    assert _get(alice, key) == b"1" * SMALL  # Python, verified
    assert _get(alice, key) == b"1" * SMALL  # C
    gets = server.stats().native_gets
    assert gets == 1
    assert alice.remove(key)
    cache.put(key, b"2" * SMALL, tenant="alice")  # the same tenant, another publish
    assert _get(alice, key) == b"2" * SMALL
    assert server.stats().native_gets == gets  # that one ran in Python
    assert _get(alice, key) == b"2" * SMALL
    assert server.stats().native_gets == gets + 1
    alice.close()

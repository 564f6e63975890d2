"""Chunk owners survive ``kill -9`` (issue 15): a real token daemon with an NVMe tier, its
chunks put as alice, bob, the shared writer and the default tenant, killed with SIGKILL and
started again on the same NVMe directory. After the restart each chunk belongs to the tenant
that wrote it (the NVMe record keeps the owner, format version 2): alice reads hers byte for
byte, bob cannot read them nor write over them, and a client of the default tenant (the same
directory served by a daemon without security) sees none of them.

Two ways onto NVMe: durable puts (``cache.write_tier=nvme``: written through) and demotion out
of a small DRAM tier (the default write tier), where the cache writes the NVMe copy itself.
Before the owner was kept, a restart turned every chunk into the default tenant's: alice read
nothing of hers and the default tenant read everything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.store_config import StoreClientConfig
from kvstore.dataplane.tier import TierKind
from kvstore.errors import PermissionDenied
from kvstore.node.index import SHARED_TENANT
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.support.daemon import DaemonProcess

KiB = 1 << 10
NODE = "owners"

PRINCIPALS: dict[str, tuple[Role, list[str] | None, bool]] = {
    "alice": (Role.ENGINE, ["alice"], False),
    "bob": (Role.ENGINE, ["bob"], False),
    "sys": (Role.ENGINE, ["sys"], True),
    "op": (Role.OPERATOR, None, False),
}


def _tokens(tmp: Path) -> dict[str, Path]:
    generate_key(tmp / "keys", "k1")
    (tmp / "keys" / "k1.key").rename(tmp / "k1.key")
    kid, signing = load_signing_key(tmp / "k1.key")
    out: dict[str, Path] = {}
    for name, (role, tenants, shared_writer) in PRINCIPALS.items():
        path = tmp / f"{name}.token"
        path.write_text(mint(signing, kid, subject=name, role=role, tenants=tenants,
                             ttl_s=3600, shared_writer=shared_writer))
        out[name] = path
    return out


def _daemon(tmp: Path, *, secured: bool = True, dram: str = "32MiB",
            **settings: str) -> DaemonProcess:
    values = {"server.shm_channel": "false", **settings}
    if secured:
        values.update({"security.token_keys": str(tmp / "keys"),
                       "security.token_reload_interval_s": "0"})
    return DaemonProcess(tmp, NODE, dram_bytes=dram, settings=values)


@contextmanager
def _clients(d: DaemonProcess, tokens: dict[str, Path] | None,
             tenants: dict[str, str] | None = None) -> Iterator[dict[str, DaemonControl]]:
    """One gRPC client per principal (``tokens`` None: one client of a daemon without
    security, named "default", naming no tenant)."""
    opened: dict[str, DaemonControl] = {}
    try:
        for name, token in (tokens or {"default": None}).items():  # type: ignore[dict-item]
            cfg = StoreClientConfig(
                rpc_timeout_s=10.0, tenant=(tenants or {}).get(name),
                security=ClientSecurity(token_file=token) if token else ClientSecurity())
            channel, info = open_channel(d.grpc_address, cfg)
            opened[name] = DaemonControl(d.grpc_address, info, channel, cfg)
        yield opened
    finally:
        for c in opened.values():
            c.close()


def _put(c: DaemonControl, key: bytes, value: bytes, parent: bytes | None = None) -> None:
    c.call("Put", pb.PutRequest(key=key, value=value, parent=parent or b""))


def _get(c: DaemonControl, key: bytes) -> bytes | None:
    reply = c.call("Get", pb.GetRequest(key=key))
    return bytes(reply.value) if reply.found else None


def _chain(tag: bytes, n: int, size: int) -> list[tuple[bytes, bytes | None, bytes]]:
    out: list[tuple[bytes, bytes | None, bytes]] = []
    parent: bytes | None = None
    for i in range(n):
        key = tag + b"-%02d" % i
        out.append((key, parent, os.urandom(size)))
        parent = key
    return out


def _recovered(d: DaemonProcess) -> str:
    lines = [ln for ln in d.log_path.read_text().splitlines() if "recovered" in ln]
    assert lines, d.log_tail()
    return lines[-1]


def test_owners_survive_kill_9_with_durable_puts(tmp_path: Path) -> None:
    tokens = _tokens(tmp_path)
    alice = _chain(b"alice", 4, 16 * KiB)
    bob = _chain(b"bob", 2, 8 * KiB)
    shared_key, shared_value = b"shared-00", os.urandom(4 * KiB)
    under_shared = (b"alice-on-shared", shared_key, os.urandom(4 * KiB))
    default = _chain(b"default", 2, 4 * KiB)
    first = _daemon(tmp_path, **{"cache.write_tier": "nvme"})
    first.start()
    try:
        with _clients(first, tokens, {"sys": SHARED_TENANT}) as c:
            for key, parent, value in alice:
                _put(c["alice"], key, value, parent)
            for key, parent, value in bob:
                _put(c["bob"], key, value, parent)
            _put(c["sys"], shared_key, shared_value)
            _put(c["alice"], under_shared[0], under_shared[2], under_shared[1])
            for key, parent, value in default:  # an operator naming no tenant writes the default
                _put(c["op"], key, value, parent)
        first.kill()
    finally:
        first.stop()
    stored = len(alice) + len(bob) + 1 + 1 + len(default)

    again = _daemon(tmp_path, **{"cache.write_tier": "nvme"})
    again.start()
    try:
        assert f"recovered {stored} chunk(s)" in _recovered(again)
        with _clients(again, tokens) as c:
            # Alice reads hers (and the chunk she hung under the shared one), byte for byte.
            for key, _parent, value in [*alice, under_shared]:
                assert _get(c["alice"], key) == value, key
            assert c["alice"].lookup([k for k, _p, _v in alice]).length == len(alice)
            assert _get(c["alice"], shared_key) == shared_value  # every tenant reads shared
            assert _get(c["bob"], shared_key) == shared_value
            for key, _parent, value in bob:
                assert _get(c["bob"], key) == value
            # Bob cannot read alice's chunks, find them, nor write over them.
            for key, _parent, _value in [*alice, under_shared]:
                assert _get(c["bob"], key) is None
                with pytest.raises(PermissionDenied):
                    _put(c["bob"], key, b"evil")
            assert c["bob"].lookup([k for k, _p, _v in alice]).length == 0
            for key, _parent, _value in bob:
                assert _get(c["alice"], key) is None
            # The default tenant's chunks stayed the default tenant's: no engine sees them.
            for key, _parent, _value in default:
                assert _get(c["alice"], key) is None and _get(c["bob"], key) is None
            # Nothing of alice's changed through the refused writes.
            for key, _parent, value in alice:
                assert _get(c["alice"], key) == value
        again.kill()
    finally:
        again.stop()

    # The same directory served without security: a client naming no tenant is the default
    # tenant. It reads the default tenant's chunks and the shared one, and none of alice's or
    # bob's (before owners were kept, it read every chunk).
    plain = _daemon(tmp_path, secured=False, **{"cache.write_tier": "nvme"})
    plain.start()
    try:
        assert f"recovered {stored} chunk(s)" in _recovered(plain)
        with _clients(plain, None) as c:
            for key, _parent, value in default:
                assert _get(c["default"], key) == value
            assert _get(c["default"], shared_key) == shared_value
            for key, _parent, _value in [*alice, under_shared, *bob]:
                assert _get(c["default"], key) is None, key
                try:
                    _put(c["default"], key, b"evil")
                except PermissionDenied:
                    pass
                else:
                    raise AssertionError(f"the default tenant wrote over {key!r}")
    finally:
        plain.stop()


def test_owners_survive_kill_9_after_demotion_to_nvme(tmp_path: Path) -> None:
    """The default write tier (DRAM, 4 MiB): alice's and bob's chains overflow it, so the cache
    demotes their oldest chunks to NVMe, writing each NVMe record itself."""
    tokens = _tokens(tmp_path)
    alice = _chain(b"alice", 24, 256 * KiB)
    bob = _chain(b"bob", 12, 256 * KiB)
    first = _daemon(tmp_path, dram="4MiB")
    first.start()
    try:
        with _clients(first, tokens) as c:
            for key, parent, value in bob:
                _put(c["bob"], key, value, parent)
            for key, parent, value in alice:
                _put(c["alice"], key, value, parent)
            alice_tiers = c["alice"].lookup([k for k, _p, _v in alice]).tiers
            bob_tiers = c["bob"].lookup([k for k, _p, _v in bob]).tiers
        first.kill()
    finally:
        first.stop()
    alice_nvme = [(k, v) for (k, _p, v), t in zip(alice, alice_tiers, strict=True)
                  if t is TierKind.NVME]
    bob_nvme = [(k, v) for (k, _p, v), t in zip(bob, bob_tiers, strict=True)
                if t is TierKind.NVME]
    assert len(alice_nvme) >= 6 and len(bob_nvme) >= 6, (alice_tiers, bob_tiers)

    again = _daemon(tmp_path, dram="4MiB")
    again.start()
    try:
        with _clients(again, tokens) as c:
            for key, value in alice_nvme:
                assert _get(c["alice"], key) == value, key
                assert _get(c["bob"], key) is None
            for key, value in bob_nvme:
                assert _get(c["bob"], key) == value, key
                assert _get(c["alice"], key) is None
            with pytest.raises(PermissionDenied):
                _put(c["bob"], alice_nvme[0][0], b"evil")
    finally:
        again.stop()


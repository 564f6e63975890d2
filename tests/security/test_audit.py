"""The audit log (kvstore/security/audit.py) of a real token daemon and a real token conductor
(child processes, real gRPC over sockets, tokens signed at run time): operator actions and
refused calls are written with who, what, when and why; an allowed engine call is not; the file
rotates at its size limit and keeps the configured number of files; every line is JSON."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.conductor_client import ConductorClient
from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
from kvstore.errors import ConfigError, PermissionDenied, Unauthenticated
from kvstore.membership.etcd import KeyLayout
from kvstore.security.audit import AuditLog
from kvstore.security.config import ClientSecurity, ServerSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess, kvtier

KEY = bytes([0xA1]) + bytes(15)
OTHER = bytes([0xA1]) + bytes(14) + b"\x01"

TokenFile = Callable[[str, Role, list[str] | None], Path]


def _records(path: Path) -> list[dict[str, Any]]:
    """Every line of ``path`` parsed as JSON (fails the test on a line that is not)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{path}:{n} is not JSON: {line!r}") from exc
    return out


def _keys(tmp_path: Path) -> tuple[Path, TokenFile]:
    """A token key directory (public key only) and a minting function for it."""
    generate_key(tmp_path / "keys", "k1")
    (tmp_path / "keys" / "k1.key").rename(tmp_path / "k1.key")
    kid, key = load_signing_key(tmp_path / "k1.key")

    def token_file(name: str, role: Role, tenants: list[str] | None) -> Path:
        path = tmp_path / f"{name}.token"
        path.write_text(mint(key, kid, subject=name, role=role, tenants=tenants, ttl_s=600))
        return path

    return tmp_path / "keys", token_file


@pytest.fixture
def audited_daemon(tmp_path: Path) -> Iterator[tuple[DaemonProcess, TokenFile, Path]]:
    keys, token_file = _keys(tmp_path)
    audit = tmp_path / "audit" / "daemon-audit.log"
    audit.parent.mkdir()
    daemon = DaemonProcess(tmp_path, "aud", nvme=False, settings={
        "security.token_keys": str(keys), "security.token_reload_interval_s": "0",
        "security.audit_log": str(audit), "server.shm_channel": "false"})
    daemon.start()
    yield daemon, token_file, audit
    daemon.stop()


def _client(address: str, token: Path | None, tenant: str | None = None) -> StoreClient:
    return StoreClient.connect(address, StoreClientConfig(
        data_plane=DataPlane.TCP, rpc_timeout_s=10.0, tenant=tenant,
        security=ClientSecurity(token_file=token)))


def _when(record: dict[str, Any]) -> datetime.datetime:
    assert record["ts"].endswith("Z"), record
    return datetime.datetime.fromisoformat(record["ts"].removesuffix("Z") + "+00:00")


def test_daemon_audits_operator_actions_and_refusals(
        audited_daemon: tuple[DaemonProcess, TokenFile, Path]) -> None:
    daemon, token_file, audit = audited_daemon
    started = datetime.datetime.now(datetime.UTC)
    assert (audit.stat().st_mode & 0o777) == 0o600
    # An engine of tenant "a": an allowed put and get (inline over gRPC) write nothing.
    engine = _client(daemon.grpc_address, token_file("vllm-0", Role.ENGINE, ["a"]))
    try:
        engine.call("Put", pb.PutRequest(key=KEY, value=b"x" * 100))
        engine.call("Put", pb.PutRequest(key=OTHER, value=b"y" * 100))
        assert engine.call("Get", pb.GetRequest(key=KEY)).found
        assert engine.lookup([KEY]).length == 1
        assert _records(audit) == []
        with pytest.raises(PermissionDenied, match="role operator"):
            engine.drain()  # the wrong role: refused by the interceptor
    finally:
        engine.close()
    with pytest.raises(Unauthenticated, match="bearer token"):  # no credentials at all
        _client(daemon.grpc_address, None)
    # The same engine naming a tenant its token does not allow: refused by the handler.
    forged = _client(daemon.grpc_address, token_file("vllm-0", Role.ENGINE, ["a"]),
                     tenant="b")
    try:
        with pytest.raises(PermissionDenied, match="tenant 'b'"):
            forged.call("Get", pb.GetRequest(key=KEY))
    finally:
        forged.close()
    op = _client(daemon.grpc_address, token_file("alice", Role.OPERATOR, None))
    try:
        assert op.stats().node_id == "aud"
        assert len(op.list_chunks(KEY[:1]).entries) == 2
        lease = op.pin([KEY, OTHER])
        assert op.unpin(lease)
        op.evict(key_prefix=OTHER)
    finally:
        op.close()

    records = _records(audit)
    by_method: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_method.setdefault(r["method"].rsplit("/", 1)[-1], []).append(r)
        assert started - datetime.timedelta(seconds=1) <= _when(r) \
            <= datetime.datetime.now(datetime.UTC)
        assert r["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:")), r
        assert r["service"] == "the daemon's gRPC service"
    # The hot path stayed quiet: no allowed Put, Get, Lookup or Info.
    assert not {"Put", "Lookup"} & set(by_method), by_method.keys()
    assert all(r["event"] == "refused" for r in by_method.get("Get", []) + by_method["Info"])

    (drain,) = by_method["Drain"]
    assert drain["event"] == "refused" and drain["outcome"] == "refused"
    assert drain["code"] == "PERMISSION_DENIED" and drain["error"] == "PermissionDenied"
    assert drain["principal"] == {"name": "vllm-0", "role": "engine", "tenants": ["a"],
                                  "shared_writer": False}
    assert "needs role operator" in drain["reason"]

    (anonymous,) = by_method["Info"]  # StoreClient.connect's first call
    assert anonymous["principal"] is None and anonymous["code"] == "UNAUTHENTICATED"
    assert anonymous["error"] == "Unauthenticated" and "bearer token" in anonymous["reason"]

    (tenant_refusal,) = by_method["Get"]
    assert tenant_refusal["tenant"] == "b" and tenant_refusal["code"] == "PERMISSION_DENIED"
    assert tenant_refusal["principal"]["name"] == "vllm-0"
    assert tenant_refusal["request"] == {"keys": 1}
    assert "may not act for tenant 'b'" in tenant_refusal["reason"]

    alice = {"name": "alice", "role": "operator", "tenants": "*", "shared_writer": False}
    for method in ("Stats", "List", "Pin", "Unpin", "Evict"):
        (action,) = by_method[method]
        assert action["event"] == "operator_action" and action["outcome"] == "ok", action
        assert action["code"] == "OK" and action["principal"] == alice, action
        assert action["reason"] is None and action["tenant"] is None
    assert by_method["List"][0]["request"]["key_prefix"] == "a1"
    assert by_method["Pin"][0]["request"]["keys"] == 2
    assert by_method["Evict"][0]["request"]["key_prefix"] == OTHER.hex()
    assert by_method["Unpin"][0]["request"] == {"lease_id": lease}
    assert len(records) == 3 + 5  # nothing else was written


def test_a_failed_operator_action_and_a_drain_are_logged(
        audited_daemon: tuple[DaemonProcess, TokenFile, Path]) -> None:
    from kvstore.errors import ChunkNotFound

    daemon, token_file, audit = audited_daemon
    op = _client(daemon.grpc_address, token_file("alice", Role.OPERATOR, None))
    try:
        with pytest.raises(ChunkNotFound):
            op.inspect(KEY)
        assert op.drain()
    finally:
        op.close()
    assert daemon.wait() == 0  # the daemon drained and exited: the drain's line is there
    inspect, drain = _records(audit)
    assert inspect["method"] == "/kvtier.v1.Store/Inspect"
    assert inspect["event"] == "operator_action" and inspect["outcome"] == "error"
    assert inspect["code"] == "NOT_FOUND" and inspect["error"] == "ChunkNotFound"
    assert inspect["request"] == {"keys": 1} and inspect["reason"]
    assert drain["method"] == "/kvtier.v1.Store/Drain" and drain["outcome"] == "ok"
    assert drain["principal"]["name"] == "alice"


def test_audit_log_rotates_at_its_size_and_keeps_its_backups(tmp_path: Path) -> None:
    keys, token_file = _keys(tmp_path)
    audit = tmp_path / "audit.log"
    max_bytes, backups = 2048, 2
    daemon = DaemonProcess(tmp_path, "rot", nvme=False, settings={
        "security.token_keys": str(keys), "security.audit_log": str(audit),
        "security.audit_max_bytes": str(max_bytes), "security.audit_backups": str(backups),
        "server.shm_channel": "false"})
    daemon.start()
    calls = 60
    try:
        op = _client(daemon.grpc_address, token_file("alice", Role.OPERATOR, None))
        try:
            for i in range(calls):  # each writes one line of about 330 bytes
                op.list_chunks(i.to_bytes(2, "big"))
        finally:
            op.close()
    finally:
        daemon.stop()
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("audit.log"))
    assert files == ["audit.log", "audit.log.1", "audit.log.2"]
    kept: list[dict[str, Any]] = []
    for name in ("audit.log.2", "audit.log.1", "audit.log"):  # oldest first
        path = tmp_path / name
        assert path.stat().st_size <= max_bytes
        assert (path.stat().st_mode & 0o777) == 0o600
        kept += _records(path)
    prefixes = [int(r["request"]["key_prefix"], 16) for r in kept]
    # The newest lines are kept, in order, none missing between them; the oldest were dropped.
    assert prefixes == list(range(calls - len(kept), calls))
    assert len(kept) < calls
    # Rotated at the limit, not before: the next line would not have fitted.
    for older, newer in (("audit.log.2", "audit.log.1"), ("audit.log.1", "audit.log")):
        first_line = (tmp_path / newer).read_text().splitlines(keepends=True)[0]
        assert (tmp_path / older).stat().st_size + len(first_line) > max_bytes


def test_a_line_longer_than_the_limit_gets_a_file_of_its_own(tmp_path: Path) -> None:
    log = AuditLog.open(tmp_path / "a.log", 1024, 3, "test")
    try:
        log.write({"n": 0})
        log.write({"n": 1, "pad": "x" * 2000})
        log.write({"n": 2})
    finally:
        log.close()
    assert [r["n"] for r in _records(tmp_path / "a.log.2")] == [0]
    assert [r["n"] for r in _records(tmp_path / "a.log.1")] == [1]
    assert [r["n"] for r in _records(tmp_path / "a.log")] == [2]
    assert not (tmp_path / "a.log.3").exists()


def test_bad_audit_settings_are_refused_at_start(tmp_path: Path) -> None:
    keys, _ = _keys(tmp_path)
    missing = tmp_path / "no-such-dir" / "audit.log"
    refused = kvtier("daemon", "--set", f"security.token_keys={keys}", "--set",
                     f"security.audit_log={missing}", "--set", "dram.capacity_bytes=1MiB",
                     "--set", "dram.prefault=false", "--set", "server.shm_channel=false")
    assert refused.returncode == 2, refused.stderr
    assert "security.audit_log: cannot open" in refused.stderr and str(missing) in refused.stderr
    with pytest.raises(ConfigError, match="needs authentication"):
        ServerSecurity(audit_log=tmp_path / "a.log")
    with pytest.raises(ConfigError, match="audit_max_bytes"):
        ServerSecurity(token_keys=keys, audit_log=tmp_path / "a.log", audit_max_bytes=10)
    with pytest.raises(ConfigError, match="audit_backups"):
        ServerSecurity(token_keys=keys, audit_log=tmp_path / "a.log", audit_backups=0)
    (tmp_path / "dir.log").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        AuditLog.open(tmp_path / "dir.log", 1 << 20, 1, "test")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="Permission denied"):
            AuditLog.open(locked / "audit.log", 1 << 20, 1, "test")


def test_conductor_audits_refusals_not_allowed_calls(tmp_path: Path, etcd_server: object,
                                                     etcd_layout: KeyLayout) -> None:
    keys, token_file = _keys(tmp_path)
    audit = tmp_path / "conductor-audit.log"
    conductor = ConductorProcess(
        tmp_path, "c1", etcd_endpoint=etcd_server.client_url,  # type: ignore[attr-defined]
        prefix=etcd_layout.prefix,
        extra_args=("--token-keys", str(keys), "--audit-log", str(audit)))
    address = conductor.start()
    try:
        async def scenario() -> None:
            engine = ClientSecurity(token_file=token_file("vllm-0", Role.ENGINE, ["a"]))
            async with ConductorClient(address=address, security=engine) as client:
                await client.lookup(keys=[bytes(16)])
                assert _records(audit) == []  # allowed: not logged
            peer = ClientSecurity(token_file=token_file("daemon-x", Role.PEER, None))
            async with ConductorClient(address=address, security=peer) as client:
                with pytest.raises(PermissionDenied, match="role engine or operator"):
                    await client.lookup(keys=[bytes(16)])
            async with ConductorClient(address=address, security=ClientSecurity()) as client:
                with pytest.raises(Unauthenticated):
                    await client.lookup(keys=[bytes(16)])

        asyncio.run(scenario())
    finally:
        conductor.stop()
    wrong_role, anonymous = _records(audit)
    for r in (wrong_role, anonymous):
        assert r["method"] == "/kvtier.v1.Conductor/Lookup" and r["event"] == "refused"
        assert r["service"] == "the conductor's gRPC service" and r["peer"].startswith("ipv")
        assert r["request"] == {}  # the interceptor refuses before the request is read
        _when(r)
    assert wrong_role["principal"]["name"] == "daemon-x"
    assert wrong_role["principal"]["role"] == "peer" and wrong_role["code"] == "PERMISSION_DENIED"
    assert anonymous["principal"] is None and anonymous["code"] == "UNAUTHENTICATED"
    assert "bearer token" in anonymous["reason"]


def test_mtls_daemon_audits_the_certificate_identity_and_a_revoked_one(tmp_path: Path) -> None:
    from tests.security.pki import make_ca

    ca = make_ca()
    ca_path = ca.write(tmp_path / "ca.crt")
    server_cert, server_key = ca.issue("daemon", uri="kvtier://peer/daemon").write(tmp_path)
    revoked = ca.issue("revoked", uri="kvtier://operator/mallory")
    audit = tmp_path / "audit.log"
    daemon = DaemonProcess(tmp_path, "mtls-aud", nvme=False, settings={
        "security.cert_file": str(server_cert), "security.key_file": str(server_key),
        "security.client_ca_file": str(ca_path), "security.audit_log": str(audit),
        "security.revoked_serials": f"{revoked.serial:x}", "server.shm_channel": "false"})
    daemon.start()

    def connect(leaf):  # type: ignore[no-untyped-def]
        cert, key = leaf.write(tmp_path)
        return StoreClient.connect(daemon.grpc_address, StoreClientConfig(
            data_plane=DataPlane.TCP, rpc_timeout_s=10.0,
            security=ClientSecurity(ca_file=ca_path, cert_file=cert, key_file=key)))

    try:
        op = connect(ca.issue("op", uri="kvtier://operator/alice?tenants=a"))
        try:
            op.stats()
        finally:
            op.close()
        with pytest.raises(Unauthenticated, match="revoked"):
            connect(revoked)
    finally:
        daemon.stop()
    stats, refused = _records(audit)
    assert stats["method"] == "/kvtier.v1.Store/Stats" and stats["outcome"] == "ok"
    assert stats["principal"] == {"name": "operator/alice", "role": "operator",
                                  "tenants": ["a"], "shared_writer": False}
    assert refused["event"] == "refused" and refused["principal"] is None
    assert refused["code"] == "UNAUTHENTICATED" and "revoked" in refused["reason"]

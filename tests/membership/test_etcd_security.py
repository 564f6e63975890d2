"""kvtier's use of etcd with TLS, client certificates and etcd's users and roles (issue 15).

Against the real etcd binary (:class:`tests.support.etcd.SecureEtcd`): TLS with a CA minted at
run time, ``--client-cert-auth``, a CRL, and etcd's auth with the roles of docs/security.md
(``kvtier-member``: readwrite on the prefix; ``kvtier-engine``: read on it, readwrite on
``engines/``), set up with the real ``etcdctl``. Every refusal is paired with the same
operation succeeding for the right identity, so no test can pass by refusing everything.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvstore.client.conductor_client import ConductorClient
from kvstore.errors import ConfigError, MembershipError
from kvstore.keys import KVDtype, KVFingerprint
from kvstore.membership.engines import EngineRecord, EngineRole, list_engines, register_engine
from kvstore.membership.etcd import KeyLayout, etcd_call, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.membership.nodes import list_nodes, register_node, watch_nodes
from kvstore.security.etcd import EtcdSecurity
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess
from tests.support.etcd import (
    ENGINE_ROLE,
    MEMBER_ROLE,
    EtcdUser,
    SecureEtcd,
    require_etcd,
    run,
)
from tests.support.registrant import sample_record

LAYOUT = KeyLayout("/kvtier-secure/")
MODEL = "tiny-model"
FINGERPRINT = KVFingerprint(MODEL, KVDtype.FLOAT16, num_layers=2, num_kv_heads=2, head_dim=8,
                            block_size_tokens=16)
REVOKED = "revoked-daemon"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    """TLS, client certificates required, a CRL revoking ``revoked-daemon``'s certificate,
    auth on with the kvtier roles on :data:`LAYOUT`."""
    require_etcd()
    server = SecureEtcd(tmp_path_factory.mktemp("etcd-secure"), LAYOUT, revoked=(REVOKED,))
    server.start()
    server.add_user("daemon-1", MEMBER_ROLE)
    server.add_user("conductor-1", MEMBER_ROLE)
    server.add_user("engine-1", ENGINE_ROLE)
    try:
        yield server
    finally:
        server.close()


def engine_record(instance_id: str, node_id: str) -> EngineRecord:
    return EngineRecord(instance_id, EngineRole.PREFILL, MODEL, node_id,
                        kv_fingerprint=FINGERPRINT)


def etcd_args(secure: SecureEtcd, user: EtcdUser) -> tuple[str, ...]:
    return ("--etcd-ca", str(secure.ca_file), "--etcd-cert", str(user.cert_file),
            "--etcd-key", str(user.key_file), "--etcd-user", user.name,
            "--etcd-password-file", str(user.password_file))


def is_permission_denied(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.aio.AioRpcError):
            return seen.code() is grpc.StatusCode.PERMISSION_DENIED
        seen = seen.__cause__
    return False


# --------------------------------------------------------------------------- the whole flow


def test_daemon_registers_and_conductor_discovers_through_tls_and_auth_etcd(
        secure: SecureEtcd, tmp_path: Path, aio: asyncio.Runner,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real daemon and a real conductor, each with its own etcd user and client certificate
    (given as ``--etcd-*`` options), and an engine record written with an engine credential:
    the conductor's leader sees the node and the engine."""
    daemon = DaemonProcess(tmp_path, "node-sec", nvme=False, etcd_endpoint=secure.endpoint,
                           etcd_prefix=LAYOUT.prefix,
                           extra_args=etcd_args(secure, secure.users["daemon-1"]))
    conductor = ConductorProcess(tmp_path, "cond-sec", etcd_endpoint=secure.endpoint,
                                 prefix=LAYOUT.prefix,
                                 extra_args=etcd_args(secure, secure.users["conductor-1"]))
    engine = secure.security(secure.users["engine-1"])
    exported: dict[str, str] = {}
    engine.export(exported)  # what an engine's environment would hold
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    try:
        daemon.start()
        conductor.start()

        async def scenario() -> None:
            async with etcd_client(secure.endpoint, security=engine) as client:
                assert set(await list_nodes(client, layout=LAYOUT)) >= {"node-sec"}
                # The conductor client finds the leader through etcd as the engine.
                async with register_engine(client, engine_record("p-sec", "node-sec"),
                                           ttl_s=5, layout=LAYOUT), \
                        ConductorClient(etcd_endpoint=secure.endpoint,
                                        layout=LAYOUT) as conductor_client:
                    deadline = time.monotonic() + 20.0
                    while True:
                        info = await conductor_client.leader_info()
                        if "node-sec" in info.live_nodes and "p-sec" in info.prefill_instances:
                            break
                        assert time.monotonic() < deadline, (
                            f"the conductor sees nodes {list(info.live_nodes)} and "
                            f"engines {list(info.prefill_instances)}; log:\n"
                            f"{conductor.log_tail()}")
                        await asyncio.sleep(0.1)

        run(aio, scenario(), timeout_s=60.0)
    finally:
        conductor.stop()
        daemon.stop()
    assert "registered in etcd" in daemon.log_path.read_text()


def test_a_daemon_reads_its_etcd_credentials_from_its_config_file(
        secure: SecureEtcd, tmp_path: Path, aio: asyncio.Runner) -> None:
    """The etcd section's security keys (CA, client certificate, user and a password written
    in the file itself) are enough to register; the password shows nowhere. The same daemon
    without them is refused by etcd (the test below), so the keys are what lets it in."""
    user = secure.users["daemon-1"]
    config = tmp_path / "daemon.yaml"
    config.write_text(f"""etcd:
  ca_file: {secure.ca_file}
  cert_file: {user.cert_file}
  key_file: {user.key_file}
  username: {user.name}
  password: {user.password}
""")
    printed = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "daemon", "--config", str(config),
         "--print-config"], capture_output=True, text=True, timeout=60, check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")})
    assert "password: <hidden>" in printed.stdout and user.password not in printed.stdout
    daemon = DaemonProcess(tmp_path, "node-cfg", nvme=False, etcd_endpoint=secure.endpoint,
                           etcd_prefix=LAYOUT.prefix, extra_args=("--config", str(config)))
    try:
        daemon.start()

        async def scenario() -> None:
            async with etcd_client(secure.endpoint,
                                   security=secure.security(secure.users["engine-1"])) as client:
                assert "node-cfg" in await list_nodes(client, layout=LAYOUT)

        run(aio, scenario(), timeout_s=60.0)
    finally:
        daemon.stop()
    log_text = daemon.log_path.read_text()
    assert "registered in etcd" in log_text
    assert user.password not in log_text


def test_a_daemon_with_a_missing_etcd_file_stops_before_binding(tmp_path: Path) -> None:
    config = tmp_path / "daemon.yaml"
    config.write_text(f"etcd:\n  endpoints: [https://127.0.0.1:1]\n"
                      f"  ca_file: {tmp_path / 'no-such-ca.crt'}\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvstore.cli.main", "daemon", "--config", str(config),
         "--set", "server.grpc_port=0", "--set", "server.tcp_port=0"],
        capture_output=True, text=True, timeout=60, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")})
    assert result.returncode == 2, result.stderr
    assert f"the etcd CA bundle {tmp_path / 'no-such-ca.crt'} does not exist" in result.stderr
    assert "KVTIER-DAEMON-READY" not in result.stdout


def test_a_daemon_with_engine_credentials_does_not_start(secure: SecureEtcd,
                                                          tmp_path: Path) -> None:
    """The daemon of the test above, given an engine's etcd identity: etcd refuses its node
    record and the daemon exits, saying so (the test above is the same daemon succeeding)."""
    daemon = DaemonProcess(tmp_path, "node-as-engine", nvme=False, etcd_endpoint=secure.endpoint,
                           etcd_prefix=LAYOUT.prefix,
                           extra_args=etcd_args(secure, secure.users["engine-1"]))
    try:
        with pytest.raises(RuntimeError, match="did not become ready"):
            daemon.start(timeout_s=180.0)  # it exits by itself; a loaded box may take long to get there
    finally:
        daemon.stop()
    assert "register node 'node-as-engine': etcd refused it: permission denied" in \
        daemon.log_path.read_text(), daemon.log_tail()


def test_the_same_flow_works_with_a_plain_etcd(etcd_server: LocalEtcd, etcd_layout: KeyLayout,
                                               aio: asyncio.Runner) -> None:
    """No security config: plaintext gRPC without credentials or interceptors, the same flow
    (no regression)."""

    async def scenario() -> None:
        client = etcd_client(etcd_server.client_url, security=EtcdSecurity())
        assert client.security.empty and not client._use_tls
        async with client, register_node(client, sample_record("plain-1"), ttl_s=5,
                                         layout=etcd_layout), \
                watch_nodes(client, layout=etcd_layout) as watch:
            event = await anext(watch)
            assert event.node_id == "plain-1"

    run(aio, scenario())


# --------------------------------------------------------------------------- roles


def test_engine_credentials_cannot_write_membership_keys(secure: SecureEtcd,
                                                         aio: asyncio.Runner) -> None:
    """The requirement "membership keys cannot be written by an engine's credentials": etcd
    answers PERMISSION_DENIED to an engine that writes a node record, overwrites or deletes a
    live node's record, or claims the conductor's leader key; the same writes succeed for a
    member, and the engine still writes its own record and reads the nodes."""
    engine = secure.security(secure.users["engine-1"])
    member = secure.security(secure.users["daemon-1"])

    async def scenario() -> None:
        async with etcd_client(secure.endpoint, security=member) as as_member, \
                etcd_client(secure.endpoint, security=engine) as as_engine, \
                register_node(as_member, sample_record("node-roles"), ttl_s=5, layout=LAYOUT):
            node_key = LAYOUT.node_key("node-roles").encode()
            forged = sample_record("node-forged")
            with pytest.raises(MembershipError, match="permission denied") as caught:
                async with register_node(as_engine, forged, ttl_s=5, layout=LAYOUT):
                    pass
            assert is_permission_denied(caught.value)
            for what, call in (
                    ("overwrite", lambda c: c.put(node_key, b"{}")),
                    ("delete", lambda c: c.delete(node_key)),
                    ("leader", lambda c: c.put(LAYOUT.conductor_leader_key.encode(),
                                               b"{}"))):
                with pytest.raises(MembershipError, match="permission denied") as caught:
                    await etcd_call(what, call(as_engine), 5.0)
                assert is_permission_denied(caught.value), what
            # What the engine may do.
            assert "node-roles" in await list_nodes(as_engine, layout=LAYOUT)
            async with register_engine(as_engine, engine_record("p-roles", "node-roles"),
                                       ttl_s=5, layout=LAYOUT):
                assert "p-roles" in await list_engines(as_engine, layout=LAYOUT)
            # The same node registration succeeds for a member.
            async with register_node(as_member, forged, ttl_s=5, layout=LAYOUT):
                assert "node-forged" in await list_nodes(as_engine, layout=LAYOUT)
            # The record the engine failed to overwrite is intact.
            kv = await etcd_call("read", as_member.get(node_key), 5.0)
            assert kv is not None and b"node-roles" in kv.value
            # The writes refused to the engine, allowed to a member (on keys no one uses).
            scratch = LAYOUT.node_key("node-scratch").encode()
            await etcd_call("put", as_member.put(scratch, b"{}"), 5.0)
            assert await etcd_call("delete", as_member.delete(scratch), 5.0)
            leader = LAYOUT.conductor_leader_key.encode()
            await etcd_call("leader", as_member.put(leader, b"{}"), 5.0)
            assert await etcd_call("delete", as_member.delete(leader), 5.0)

    run(aio, scenario())


def test_a_per_instance_engine_role_cannot_touch_another_engines_record(
        secure: SecureEtcd, aio: asyncio.Runner) -> None:
    """The shared ``kvtier-engine`` role lets one engine's credentials rewrite another
    engine's record (pointing the conductor at a forged KV-event publisher). A role per instance
    (docs/security.md, "etcd": read on the prefix, readwrite on that instance's two record keys
    only) is enough for kvtier's registration, and etcd refuses the same writes to another
    instance's record; paired with the shared role, which may (so the test can fail)."""
    prefix = LAYOUT.prefix
    role = "kvtier-engine-p-own"
    secure.etcdctl("role", "add", role)
    secure.etcdctl("role", "grant-permission", role, "--prefix=true", "read", prefix)
    for engine_role in ("prefill", "decode"):
        secure.etcdctl("role", "grant-permission", role, "readwrite",
                       LAYOUT.engine_key(engine_role, "p-own"))
    own = secure.security(secure.add_user("engine-own", role))
    shared = secure.security(secure.users["engine-1"])

    async def scenario() -> None:
        async with etcd_client(secure.endpoint, security=own) as as_own, \
                etcd_client(secure.endpoint, security=shared) as as_shared, \
                register_engine(as_shared, engine_record("p-other", "node-x"), ttl_s=5,
                                layout=LAYOUT):
            other_key = LAYOUT.engine_key("prefill", "p-other").encode()
            async with register_engine(as_own, engine_record("p-own", "node-x"), ttl_s=5,
                                       layout=LAYOUT):
                assert {"p-own", "p-other"} <= set(await list_engines(as_own, layout=LAYOUT))
            with pytest.raises(MembershipError, match="permission denied") as caught:
                async with register_engine(as_own, engine_record("p-other", "node-x"),
                                           ttl_s=5, layout=LAYOUT):
                    pass
            assert is_permission_denied(caught.value)
            for what, call in (("overwrite", lambda c: c.put(other_key, b"{}")),
                               ("delete", lambda c: c.delete(other_key))):
                with pytest.raises(MembershipError, match="permission denied") as caught:
                    await etcd_call(what, call(as_own), 5.0)
                assert is_permission_denied(caught.value), what
            kv = await etcd_call("read", as_shared.get(other_key), 5.0)
            assert kv is not None and b"p-other" in kv.value
            # Paired: the shared role may overwrite another engine's record (the gap this
            # closes), here on a scratch key of a made-up instance.
            scratch = LAYOUT.engine_key("prefill", "p-scratch").encode()
            await etcd_call("put", as_shared.put(scratch, b"{}"), 5.0)
            assert await etcd_call("delete", as_shared.delete(scratch), 5.0)

    run(aio, scenario())


def test_a_refused_watch_is_an_error_not_a_silent_one(secure: SecureEtcd,
                                                      aio: asyncio.Runner) -> None:
    """etcd cancels a watch its user may not read; aetcd alone would take it for a live watch
    that never sees an event. The engine may watch the cluster's prefix, not another."""
    engine = secure.security(secure.users["engine-1"])

    async def scenario() -> None:
        async with etcd_client(secure.endpoint, security=engine) as client:
            watch = await etcd_call("watch", client.watch_prefix(LAYOUT.prefix.encode()), 15.0)
            await watch.cancel()
            with pytest.raises(MembershipError,
                               match=r"etcd refused the watch: .*permission denied"):
                await etcd_call("watch", client.watch_prefix(b"/elsewhere/"), 15.0)
            # The client recovers: a new stream, and a permitted watch works again.
            watch = await etcd_call("watch", client.watch_prefix(LAYOUT.prefix.encode()), 15.0)
            await watch.cancel()

    run(aio, scenario())


# --------------------------------------------------------------------------- refusals


def _try_list(secure: SecureEtcd, aio: asyncio.Runner, security: EtcdSecurity,
              endpoint: str | None = None) -> None:
    async def scenario() -> None:
        async with etcd_client(endpoint or secure.endpoint, security=security) as client:
            await list_nodes(client, layout=LAYOUT, rpc_timeout_s=5.0)

    run(aio, scenario())


def test_refusals_say_what_to_fix(secure: SecureEtcd, tmp_path: Path,
                                  aio: asyncio.Runner) -> None:
    user = secure.users["daemon-1"]
    good = secure.security(user)
    _try_list(secure, aio, good)  # the pairing: the right identity lists the nodes

    # No credentials at all: etcd requires a client certificate.
    with pytest.raises(MembershipError, match=r"etcd closed the TLS connection: .*requires one \(--etcd-cert"):
        _try_list(secure, aio, EtcdSecurity(ca_file=secure.ca_file))
    # A plaintext client against the TLS port.
    with pytest.raises(MembershipError, match="if it serves TLS, give its CA"):
        _try_list(secure, aio, EtcdSecurity(),
                  endpoint=secure.endpoint.removeprefix("https://"))
    # Another CA: etcd's server certificate does not verify.
    from tests.security.pki import make_ca

    other_ca = make_ca("another CA").write(tmp_path / "other-ca.crt")
    with pytest.raises(MembershipError, match="does not verify against the CA bundle"):
        _try_list(secure, aio, secure.security(user, ca_file=other_ca))
    # The wrong password.
    wrong = tmp_path / "wrong.password"
    wrong.write_text("not-the-password\n")
    with pytest.raises(MembershipError, match="wrong user name or password"):
        _try_list(secure, aio, EtcdSecurity(ca_file=secure.ca_file, cert_file=user.cert_file,
                                            key_file=user.key_file, username=user.name,
                                            password_file=wrong))
    # A password file that cannot be read.
    with pytest.raises(ConfigError, match="cannot read the etcd password file"):
        _try_list(secure, aio, EtcdSecurity(ca_file=secure.ca_file, cert_file=user.cert_file,
                                            key_file=user.key_file, username=user.name,
                                            password_file=tmp_path / "missing"))


def test_no_user_on_an_etcd_with_auth_is_refused(tmp_path: Path, aio: asyncio.Runner) -> None:
    """TLS without client certificates, auth on: a client that presents no user is refused,
    naming the options to set; the same call with the user's password succeeds."""
    require_etcd()
    server = SecureEtcd(tmp_path, LAYOUT, client_cert_auth=False)
    server.start()
    try:
        user = server.add_user("daemon-pw", MEMBER_ROLE)
        with pytest.raises(MembershipError, match="presented no user: give --etcd-user"):
            _try_list(server, aio, EtcdSecurity(ca_file=server.ca_file))
        _try_list(server, aio, server.security(user, cert=False))
    finally:
        server.close()


def test_a_revoked_client_certificate_is_refused(secure: SecureEtcd, tmp_path: Path,
                                                 aio: asyncio.Runner) -> None:
    """etcd's ``--client-crl-file`` revokes the first certificate of ``revoked-daemon``; the
    same user with the same password and a fresh certificate is served."""
    user = secure.users[REVOKED]
    with pytest.raises(MembershipError, match=r"etcd closed the TLS connection: it refused"):
        _try_list(secure, aio, secure.security(user))
    cert, key = secure.ca.issue(REVOKED).write(tmp_path, "fresh")
    _try_list(secure, aio, EtcdSecurity(ca_file=secure.ca_file, cert_file=cert, key_file=key,
                                        username=user.name, password_file=user.password_file))


def test_an_expired_client_certificate_is_refused_before_connecting(
        secure: SecureEtcd, tmp_path: Path, aio: asyncio.Runner) -> None:
    user = secure.users["daemon-1"]
    expired = secure.ca.issue(user.name, valid_from_s=-7200.0, valid_for_s=3600.0)
    cert, key = expired.write(tmp_path, "expired")
    with pytest.raises(MembershipError, match="expired at"):
        _try_list(secure, aio, EtcdSecurity(ca_file=secure.ca_file, cert_file=cert,
                                            key_file=key, username=user.name,
                                            password_file=user.password_file))
    _try_list(secure, aio, secure.security(user))


def test_a_client_certificate_alone_authenticates_as_its_common_name(
        secure: SecureEtcd, aio: asyncio.Runner) -> None:
    """With ``--client-cert-auth`` and no user name, etcd takes the certificate's CN as the
    user: the engine's certificate alone may read but not write a node record."""
    engine = secure.security(secure.users["engine-1"], password=False)

    async def scenario() -> None:
        async with etcd_client(secure.endpoint, security=engine) as client:
            await list_nodes(client, layout=LAYOUT)
            with pytest.raises(MembershipError, match="permission denied") as caught:
                await etcd_call("put", client.put(LAYOUT.node_key("by-cert").encode(), b"{}"),
                                5.0)
            assert is_permission_denied(caught.value)
            await etcd_call("put", client.put(f"{LAYOUT.prefix}engines/prefill/by-cert"
                                              .encode(), b"{}"), 5.0)

    run(aio, scenario())


# --------------------------------------------------------------------------- tokens


def test_a_forgotten_token_is_renewed(secure: SecureEtcd, aio: asyncio.Runner) -> None:
    """etcd forgets every (simple) token when auth is disabled and enabled again: the client
    authenticates again and a registration made afterwards works."""
    member = secure.security(secure.users["daemon-1"])

    async def scenario() -> None:
        async with etcd_client(secure.endpoint, security=member) as client:
            token = client._token
            await list_nodes(client, layout=LAYOUT)
            first = token.value
            assert first
            await asyncio.to_thread(secure.set_auth, False)
            await asyncio.to_thread(secure.set_auth, True)
            async with register_node(client, sample_record("node-token"), ttl_s=5,
                                     layout=LAYOUT):
                assert "node-token" in await list_nodes(client, layout=LAYOUT)
            assert token.value not in (None, first)

    run(aio, scenario(), timeout_s=60.0)


def test_a_token_older_than_a_role_change_is_renewed(tmp_path: Path,
                                                     aio: asyncio.Runner) -> None:
    """With JWT tokens etcd refuses every token issued before a change to users or roles
    ("revision of auth store is old"): the client authenticates again and repeats the write
    once, which then succeeds."""
    require_etcd()
    server = SecureEtcd(tmp_path, LAYOUT, jwt=True)
    server.start()
    try:
        member = server.security(server.add_user("daemon-jwt", MEMBER_ROLE))

        async def scenario() -> None:
            async with etcd_client(server.endpoint, security=member) as client:
                token = client._token
                await list_nodes(client, layout=LAYOUT)
                first = token.value
                await asyncio.to_thread(server.add_user, "late-user", ENGINE_ROLE)
                await etcd_call("put", client.put(f"{LAYOUT.prefix}probe".encode(), b"1"), 5.0)
                assert token.value not in (None, first)
                kv = await etcd_call("get", client.get(f"{LAYOUT.prefix}probe".encode()), 5.0)
                assert kv is not None and kv.value == b"1"

        run(aio, scenario(), timeout_s=60.0)
    finally:
        server.close()


# --------------------------------------------------------------------------- settings


def test_etcd_security_settings_validate_and_travel_through_the_environment(
        tmp_path: Path) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("s3cret\n")
    env = {"KVTIER_ETCD_CA": str(tmp_path / "ca.crt"), "KVTIER_ETCD_USER": "daemon-1",
           "KVTIER_ETCD_PASSWORD_FILE": str(password_file)}
    security = EtcdSecurity.from_env(env)
    assert security.username == "daemon-1" and security.read_password() == "s3cret"
    assert "s3cret" not in repr(EtcdSecurity(username="u", password="s3cret"))
    copy: dict[str, str] = {}
    security.export(copy)
    assert EtcdSecurity.from_env(copy) == security
    for bad in ({"KVTIER_ETCD_USER": "u"}, {"KVTIER_ETCD_PASSWORD": "p"},
                {"KVTIER_ETCD_CERT": "c.crt"},
                {"KVTIER_ETCD_CA": "ca", "KVTIER_ETCD_CERT": "c.crt"}):
        with pytest.raises(ConfigError):
            EtcdSecurity.from_env(bad)
    with pytest.raises(ConfigError, match="says http://"):
        etcd_client("http://127.0.0.1:2379", security=EtcdSecurity(ca_file=tmp_path / "x"))
    with pytest.raises(ConfigError, match="cannot read the etcd CA bundle"):
        etcd_client("127.0.0.1:2379", security=EtcdSecurity(ca_file=tmp_path / "missing"))

"""pytest fixtures for a real etcd server (loaded by ``tests/conftest.py`` as a plugin).

* ``etcd_server`` (session): one shared :class:`~kvstore.membership.launcher.LocalEtcd` on ephemeral
  ports in a temporary directory. Tests must not stop, restart or pause it.
* ``private_etcd`` (function): a server of the test's own, for fault tests (restart,
  pause, kill). Costs about a second to start.
* ``aio`` (session): one ``asyncio.Runner`` for every test that talks to etcd. gRPC's
  asyncio layer binds to the event loop it first runs on; a fresh ``asyncio.run`` per
  test leaves it calling into closed loops ("Event loop is closed" errors in the log).
* ``etcd_layout`` (function): a :class:`~kvstore.membership.etcd.KeyLayout` with a prefix
  unique to the test, so tests sharing ``etcd_server`` never see each other's keys.
  Keys are not deleted afterwards: leased keys expire, the rest dies with the server.

* :class:`SecureEtcd`: a real etcd with TLS, client-certificate auth and etcd's users and
  roles (``kvtier-member``, ``kvtier-engine``), its CA, certificates and passwords minted at
  run time; used by ``tests/membership/test_etcd_security.py``.

Every fixture that needs the binary skips the test, with the reason, when etcd is not
installed.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import shutil
import subprocess
import uuid
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvstore.membership.etcd import KeyLayout
from kvstore.membership.launcher import EtcdServerTls, LocalEtcd, find_etcd_binary
from kvstore.security.etcd import EtcdSecurity

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def require_etcd() -> str:
    """The etcd binary's path, or skip the calling test with the reason."""
    binary = find_etcd_binary()
    if binary is None:
        pytest.skip(
            "etcd binary not found: install etcd-server (scripts/setup.sh does, as root) "
            "or set KVTIER_ETCD_BINARY"
        )
    return binary


@pytest.fixture(scope="session")
def aio() -> Iterator[asyncio.Runner]:
    """One event loop for the session: ``aio.run(coro)`` instead of ``asyncio.run(coro)``."""
    with asyncio.Runner() as runner:
        yield runner


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """A shared etcd for the whole session; do not stop, restart or pause it."""
    require_etcd()
    server = LocalEtcd(work_dir=tmp_path_factory.mktemp("etcd-shared"), name="kvtier-test")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def private_etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    """An etcd owned by one test, free to restart, pause or kill."""
    require_etcd()
    server = LocalEtcd(work_dir=tmp_path / "etcd", name="kvtier-private")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def etcd_layout(request: pytest.FixtureRequest) -> KeyLayout:
    """A key prefix no other test uses: ``/kvtier-test/<test name>-<random>/``."""
    name = _UNSAFE.sub("-", request.node.name).strip("-")[:80] or "test"
    return KeyLayout(prefix=f"/kvtier-test/{name}-{uuid.uuid4().hex[:8]}/")


def run(aio: asyncio.Runner, scenario: Coroutine[Any, Any, None], timeout_s: float = 30.0) -> None:
    """Run one asyncio scenario on the session's loop with an overall deadline."""

    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await scenario

    aio.run(bounded())


# --------------------------------------------------------------------------- etcd with security


ETCDCTL_TIMEOUT_S = 20.0
MEMBER_ROLE = "kvtier-member"
ENGINE_ROLE = "kvtier-engine"


@dataclass
class EtcdUser:
    """One etcd user of a :class:`SecureEtcd`: its password (in a 0600 file) and a client
    certificate whose common name is the user's name."""

    name: str
    password: str = field(repr=False)
    password_file: Path
    cert_file: Path
    key_file: Path
    cert_serial: int


class SecureEtcd:
    """A real etcd serving TLS (server certificate from a CA minted at run time), optionally
    requiring client certificates (``--client-cert-auth``) and refusing a CRL's serials, with
    etcd's auth enabled: a ``root`` user, the roles ``kvtier-member`` (readwrite on the
    layout's prefix) and ``kvtier-engine`` (read on the prefix, readwrite on its
    ``engines/``), set up with the real ``etcdctl``. Nothing is checked in: the CA, the
    certificates and the passwords are made in ``work_dir`` when the object is built."""

    def __init__(self, work_dir: Path, layout: KeyLayout, *, client_cert_auth: bool = True,
                 auth: bool = True, revoked: tuple[str, ...] = (), jwt: bool = False) -> None:
        from tests.security.pki import make_ca

        self.work_dir = work_dir
        self.layout = layout
        self.pki_dir = work_dir / "pki"
        self.pki_dir.mkdir(parents=True, exist_ok=True)
        self.ca = make_ca("kvtier etcd test CA")
        self.ca_file = self.ca.write(self.pki_dir / "ca.crt")
        server = self.ca.issue("etcd-server")
        self.server_cert, self.server_key = server.write(self.pki_dir, "server")
        self._auth = auth
        self.users: dict[str, EtcdUser] = {}
        self.root = self._mint_user("root")
        crl_file: Path | None = None
        self._revoked_users = revoked
        revoked_serials = [self._mint_user(name).cert_serial for name in revoked]
        if revoked_serials:
            crl_file = self.pki_dir / "clients.crl"
            crl_file.write_bytes(self.ca.crl(revoked_serials))
        extra: list[str] = []
        if jwt:  # signed tokens carrying the auth revision they were issued at
            extra.append(self._jwt_flag())
        self.server = LocalEtcd(
            work_dir=work_dir / "etcd", name="kvtier-secure", extra_args=tuple(extra),
            tls=EtcdServerTls(cert_file=self.server_cert, key_file=self.server_key,
                              trusted_ca_file=self.ca_file if client_cert_auth else None,
                              client_cert_auth=client_cert_auth, crl_file=crl_file))

    @property
    def endpoint(self) -> str:
        return self.server.client_url

    def _jwt_flag(self) -> str:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP256R1())
        private = self.pki_dir / "jwt.key"
        public = self.pki_dir / "jwt.pub"
        private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()))
        public.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
        return f"--auth-token=jwt,pub-key={public},priv-key={private},sign-method=ES256"

    def _mint_user(self, name: str) -> EtcdUser:
        leaf = self.ca.issue(name)
        cert_file, key_file = leaf.write(self.pki_dir, f"user-{name}")
        password = secrets.token_urlsafe(18)
        password_file = self.pki_dir / f"user-{name}.password"
        password_file.write_text(password + "\n")
        password_file.chmod(0o600)
        user = EtcdUser(name=name, password=password, password_file=password_file,
                           cert_file=cert_file, key_file=key_file, cert_serial=leaf.serial)
        self.users[name] = user
        return user

    def etcdctl(self, *args: str, as_user: EtcdUser | None = None) -> str:
        """Run the real ``etcdctl`` (API v3) against this server as ``as_user`` (default
        root, once auth is on), with TLS and root's client certificate."""
        binary = shutil.which("etcdctl")
        if binary is None:
            pytest.skip("etcdctl not found: install etcd-client")
        user = as_user or self.root
        cmd = [binary, f"--endpoints={self.endpoint}", f"--cacert={self.ca_file}",
               f"--cert={user.cert_file}", f"--key={user.key_file}"]
        if self._auth_on:
            cmd.append(f"--user={user.name}:{user.password}")
        cmd += list(args)
        env = {**os.environ, "ETCDCTL_API": "3"}
        result = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                timeout=ETCDCTL_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed ({result.returncode}): "
                               f"{result.stderr.strip() or result.stdout.strip()}")
        return result.stdout

    _auth_on = False

    def add_user(self, name: str, *roles: str) -> EtcdUser:
        """A new etcd user with ``roles`` (and a client certificate named after it)."""
        user = self.users.get(name) or self._mint_user(name)
        self.etcdctl("user", "add", name, f"--new-user-password={user.password}")
        for role in roles:
            self.etcdctl("user", "grant-role", name, role)
        return user

    def start(self) -> None:
        self.server.start()
        if not self._auth:
            return
        prefix = self.layout.prefix
        self.etcdctl("user", "add", "root", f"--new-user-password={self.root.password}")
        self.etcdctl("role", "add", "root")
        self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("role", "add", MEMBER_ROLE)
        self.etcdctl("role", "grant-permission", MEMBER_ROLE, "--prefix=true", "readwrite",
                     prefix)
        self.etcdctl("role", "add", ENGINE_ROLE)
        self.etcdctl("role", "grant-permission", ENGINE_ROLE, "--prefix=true", "read", prefix)
        self.etcdctl("role", "grant-permission", ENGINE_ROLE, "--prefix=true", "readwrite",
                     f"{prefix}engines/")
        for name in self._revoked_users:
            self.add_user(name, MEMBER_ROLE)
        self.set_auth(True)

    def set_auth(self, enabled: bool) -> None:
        """``etcdctl auth enable`` / ``auth disable`` (disabling forgets every token)."""
        self.etcdctl("auth", "enable" if enabled else "disable")
        self._auth_on = enabled

    def security(self, user: EtcdUser | None = None, *, password: bool = True,
                 cert: bool = True, ca_file: Path | None = None) -> EtcdSecurity:
        """What a client of ``user`` presents: the CA (``ca_file`` to give another), the user's
        client certificate (``cert``) and name and password file (``password``)."""
        return EtcdSecurity(
            ca_file=ca_file or self.ca_file,
            cert_file=user.cert_file if user is not None and cert else None,
            key_file=user.key_file if user is not None and cert else None,
            username=user.name if user is not None and password else None,
            password_file=user.password_file if user is not None and password else None)

    def close(self) -> None:
        self.server.close()

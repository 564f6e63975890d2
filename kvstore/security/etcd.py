"""How kvtier authenticates to etcd: :class:`EtcdSecurity` (docs/security.md, "etcd").

etcd has its own security, separate from kvtier's mTLS and tokens:

* **TLS**: ``ca_file`` is the CA bundle that signed etcd's server certificate; with it the
  channel speaks TLS (an ``https://`` endpoint without ``ca_file`` uses the system's roots).
* **client certificates**: ``cert_file``/``key_file``, for an etcd started with
  ``--client-cert-auth --trusted-ca-file``. With etcd's auth enabled and no user name given,
  etcd takes the certificate's common name as the etcd user.
* **users**: ``username`` and ``password`` or ``password_file``: the client calls etcd's
  ``Authenticate`` for a token and sends it with every call (re-authenticating when etcd says
  the token is no longer valid); what the user may do is etcd's RBAC (roles granting read or
  readwrite on key prefixes).

Every process that opens an etcd client takes these from the environment unless it is given
them (:meth:`EtcdSecurity.from_env`): ``KVTIER_ETCD_CA``, ``KVTIER_ETCD_CERT``,
``KVTIER_ETCD_KEY``, ``KVTIER_ETCD_USER``, ``KVTIER_ETCD_PASSWORD``,
``KVTIER_ETCD_PASSWORD_FILE``, ``KVTIER_ETCD_SERVER_NAME``. The ``--etcd-*`` options of the
command line write theirs into the process environment (:meth:`EtcdSecurity.export`), so the
daemon's registration, the conductor's watches and its election all present the same
credentials. A password is better given as a file (a flag shows in ``ps``); the file is re-read
whenever the client authenticates, so a rotated password is picked up without a restart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvstore.errors import ConfigError

ENV_ETCD_CA = "KVTIER_ETCD_CA"
ENV_ETCD_CERT = "KVTIER_ETCD_CERT"
ENV_ETCD_KEY = "KVTIER_ETCD_KEY"
ENV_ETCD_USER = "KVTIER_ETCD_USER"
ENV_ETCD_PASSWORD = "KVTIER_ETCD_PASSWORD"
ENV_ETCD_PASSWORD_FILE = "KVTIER_ETCD_PASSWORD_FILE"
ENV_ETCD_SERVER_NAME = "KVTIER_ETCD_SERVER_NAME"

_ENV_NAMES = (ENV_ETCD_CA, ENV_ETCD_CERT, ENV_ETCD_KEY, ENV_ETCD_USER, ENV_ETCD_PASSWORD,
              ENV_ETCD_PASSWORD_FILE, ENV_ETCD_SERVER_NAME)


@dataclass(frozen=True, slots=True)
class EtcdSecurity:
    """What kvtier presents to etcd (module docstring). All empty: a plaintext channel with no
    credentials, as before."""

    ca_file: Path | None = None
    """CA bundle (PEM) that signed etcd's server certificate: the channel speaks TLS."""
    cert_file: Path | None = None
    """This client's certificate (PEM), for etcd's ``--client-cert-auth``; needs ``ca_file``."""
    key_file: Path | None = None
    """Its private key (PEM, unencrypted)."""
    username: str | None = None
    """An etcd user: the client authenticates as it (``Authenticate``) and sends the token."""
    password: str | None = field(default=None, repr=False)
    """The user's password; prefer ``password_file``. Never shown in ``repr``."""
    password_file: Path | None = None
    """A file holding the user's password (one line; a trailing newline is ignored)."""
    server_name: str | None = None
    """The name to check etcd's certificate against when it is not the dialed host (TLS only:
    a CA, or an ``https://`` endpoint)."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("an etcd client certificate and its key go together (give both "
                              "--etcd-cert and --etcd-key, or neither)")
        if self.cert_file is not None and self.ca_file is None:
            raise ConfigError("an etcd client certificate is presented over TLS: give "
                              "--etcd-ca, the CA that signed etcd's server certificate")
        if self.password is not None and self.password_file is not None:
            raise ConfigError("give the etcd password or a password file, not both")
        has_password = self.password is not None or self.password_file is not None
        if self.username is not None and not self.username:
            raise ConfigError("the etcd user name is empty")
        if self.username is not None and not has_password:
            raise ConfigError(f"etcd user {self.username!r} needs a password: give "
                              "--etcd-password-file (or KVTIER_ETCD_PASSWORD)")
        if self.username is None and has_password:
            raise ConfigError("an etcd password without a user: give --etcd-user too")

    @property
    def tls(self) -> bool:
        """Whether the channel speaks TLS because a CA is configured."""
        return self.ca_file is not None

    @property
    def empty(self) -> bool:
        return self.ca_file is None and self.username is None

    def read_password(self) -> str:
        """The password, from ``password`` or read from ``password_file`` now. Raises
        ConfigError when there is none or the file cannot be read."""
        if self.password is not None:
            return self.password
        if self.password_file is None:
            raise ConfigError("no etcd password configured")
        try:
            text = self.password_file.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the etcd password file {self.password_file}: "
                              f"{exc.strerror or exc}") from exc
        password = text.rstrip("\r\n")
        if not password:
            raise ConfigError(f"the etcd password file {self.password_file} is empty")
        return password

    def check_files(self) -> None:
        """Check, before anything connects, that every configured file is a readable file:
        a typo in a path fails at start, naming the file. Raises ConfigError."""
        for what, path in (("CA bundle", self.ca_file), ("client certificate", self.cert_file),
                           ("client key", self.key_file),
                           ("password file", self.password_file)):
            if path is None:
                continue
            if not path.is_file():
                raise ConfigError(f"the etcd {what} {path} "
                                  f"{'is not a file' if path.exists() else 'does not exist'}")
            if not os.access(path, os.R_OK):
                raise ConfigError(f"the etcd {what} {path} is not readable by this process")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdSecurity:
        """From the ``KVTIER_ETCD_*`` variables of the module docstring (unset or empty: not
        given)."""
        source = os.environ if env is None else env

        def text(name: str) -> str | None:
            return source.get(name, "").strip() or None

        def path(name: str) -> Path | None:
            value = text(name)
            return Path(value).expanduser() if value else None

        try:
            return cls(ca_file=path(ENV_ETCD_CA), cert_file=path(ENV_ETCD_CERT),
                       key_file=path(ENV_ETCD_KEY), username=text(ENV_ETCD_USER),
                       password=source.get(ENV_ETCD_PASSWORD) or None,
                       password_file=path(ENV_ETCD_PASSWORD_FILE),
                       server_name=text(ENV_ETCD_SERVER_NAME))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (environment {', '.join(_ENV_NAMES)})") from exc

    def merged(self, *, ca_file: Path | None = None, cert_file: Path | None = None,
               key_file: Path | None = None, username: str | None = None,
               password_file: Path | None = None,
               server_name: str | None = None) -> EtcdSecurity:
        """This config with the given values replacing its own (flags over environment); a
        password file replaces a password."""
        changes: dict[str, object] = {
            name: value for name, value in (
                ("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file),
                ("username", username), ("password_file", password_file),
                ("server_name", server_name)) if value is not None}
        if password_file is not None:
            changes["password"] = None
        return replace(self, **changes)  # type: ignore[arg-type]

    def export(self, env: MutableMapping[str, str] | None = None) -> None:
        """Write this config into ``env`` (default ``os.environ``) as the ``KVTIER_ETCD_*``
        variables, replacing the ones there, so every etcd client this process (or a child)
        opens presents it."""
        target = os.environ if env is None else env
        values = {ENV_ETCD_CA: self.ca_file, ENV_ETCD_CERT: self.cert_file,
                  ENV_ETCD_KEY: self.key_file, ENV_ETCD_USER: self.username,
                  ENV_ETCD_PASSWORD: self.password, ENV_ETCD_PASSWORD_FILE: self.password_file,
                  ENV_ETCD_SERVER_NAME: self.server_name}
        for name, value in values.items():
            if value is None:
                target.pop(name, None)
            else:
                target[name] = str(value)


def etcd_security_from_options(*, ca_file: Path | None = None, cert_file: Path | None = None,
                               key_file: Path | None = None, username: str | None = None,
                               password_file: Path | None = None,
                               server_name: str | None = None,
                               env: MutableMapping[str, str] | None = None) -> EtcdSecurity:
    """What a command line's ``--etcd-*`` options give, over the environment's, exported back
    into the environment (:meth:`EtcdSecurity.export`) when any option was given. Raises
    ConfigError."""
    source = os.environ if env is None else env
    security = EtcdSecurity.from_env(source).merged(
        ca_file=ca_file, cert_file=cert_file, key_file=key_file, username=username,
        password_file=password_file, server_name=server_name)
    if any(v is not None for v in (ca_file, cert_file, key_file, username, password_file,
                                   server_name)):
        security.export(source)
    return security

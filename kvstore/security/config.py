"""What a listening service and a client are configured with to authenticate (docs/security.md).

:class:`ServerSecurity` is the ``security`` section of the daemon's config (and the conductor's
``--tls-*``/``--token-keys`` flags): the service's own certificate, and how it authenticates
callers, either

* **mTLS**: ``client_ca_file`` set; every connection must present a client certificate signed by
  that CA (checked in the TLS handshake), whose SAN URI names the caller
  (:func:`kvstore.security.tls.principal_from_certificate`); revoked serials
  (``crl_file``, ``revoked_serials``) are refused per call; or
* **bearer tokens**: ``token_keys`` set; every call carries ``authorization: Bearer <token>``
  signed by a key of that directory (:mod:`kvstore.security.tokens`).

Not both: the TLS handshake cannot make a client certificate optional here (grpcio's Python API
either requires and verifies one or never asks), so a service that requires certificates would
never see a certificate-less token caller.

Secure by default (:func:`check_binding`): without either, the service binds loopback only and
serves every call as :data:`~kvstore.security.identity.INSECURE`; a non-loopback address without
authentication needs ``insecure: true`` (``--insecure``), logged as a warning at every start.
Tokens travel in clear without TLS, so ``token_keys`` without ``cert_file`` is loopback only too.
``audit_log`` (with ``audit_max_bytes`` and ``audit_backups``) turns on the audit log of an
authenticated service (:mod:`kvstore.security.audit`); it is off by default.

:class:`ClientSecurity` is what a client presents: the CA that signed the server's certificate,
its own certificate and key (mTLS), or a token file. Its :meth:`ClientSecurity.from_env` reads
``KVTIER_TLS_CA``, ``KVTIER_TLS_CERT``, ``KVTIER_TLS_KEY`` and ``KVTIER_TOKEN_FILE``.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvstore.errors import ConfigError

ENV_CA = "KVTIER_TLS_CA"
ENV_CERT = "KVTIER_TLS_CERT"
ENV_KEY = "KVTIER_TLS_KEY"
ENV_TOKEN_FILE = "KVTIER_TOKEN_FILE"
ENV_SERVER_NAME = "KVTIER_TLS_SERVER_NAME"
MIN_AUDIT_MAX_BYTES = 1024
"""The smallest ``audit_max_bytes``: a few records per file."""
MAX_AUDIT_BACKUPS = 1000


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen host) reaches only this machine: ``localhost``, 127.0.0.0/8,
    ``::1``. A wildcard (``0.0.0.0``, ``::``, empty) or any other name is not."""
    host = host.strip().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AuthMode(enum.Enum):
    """How a service authenticates its callers (:meth:`ServerSecurity.mode`)."""

    NONE = "none"
    """No authentication: every call is :data:`~kvstore.security.identity.INSECURE`."""
    MTLS = "mtls"
    TOKEN = "token"


def _check_revoked_serials(text: str) -> None:
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        try:
            int(item.removeprefix("0x").replace(":", ""), 16)
        except ValueError:
            raise ConfigError(f"revoked_serials: {item!r} is not a hexadecimal serial "
                              "(give e.g. '3a:f1:09' or '0x3af109', comma-separated)") from None


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """The ``security`` section of a listening service (module docstring)."""

    insecure: bool = False
    """Listen on a non-loopback address without authentication (a warning at every start)."""
    cert_file: Path | None = None
    """This service's certificate chain (PEM): TLS on the gRPC port. Reloaded when it changes."""
    key_file: Path | None = None
    """Its private key (PEM, unencrypted)."""
    client_ca_file: Path | None = None
    """CA bundle (PEM) that signs client certificates: mTLS, every caller needs a certificate."""
    crl_file: Path | None = None
    """A CRL (PEM or DER) of ``client_ca_file``'s CA; its serials are refused. Reloaded."""
    revoked_serials: str = ""
    """More serials to refuse, hexadecimal, comma-separated (``3a:f1:09,0x77``)."""
    token_keys: Path | None = None
    """Directory of Ed25519 public keys ``<key id>.pub`` (PEM): bearer tokens signed by any of
    them verify (several at once: rotation). Re-read when the directory changes."""
    token_reload_interval_s: float = 1.0
    """How often (at most) ``token_keys`` and the CRL are checked for changes on the call path
    (0: before every call)."""
    audit_log: Path | None = None
    """The audit log (:mod:`kvstore.security.audit`): a JSON line per operator action and per
    refused call, appended to this file (created 0600; its directory must exist), or ``-`` for
    stderr. None (the default): no audit log. Needs mTLS or tokens (without authentication
    there is nobody to name)."""
    audit_max_bytes: int = 64 << 20
    """The audit log's file is rotated before it would grow past this (at least 1024)."""
    audit_backups: int = 5
    """Rotated audit files kept (``audit.log.1`` newest .. ``audit.log.<n>``), 1..1000."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("security.cert_file and security.key_file go together (the "
                              "service's certificate and its private key)")
        if self.client_ca_file is not None and self.token_keys is not None:
            raise ConfigError("give security.client_ca_file (mTLS) or security.token_keys "
                              "(bearer tokens), not both: with client certificates required "
                              "by the TLS handshake a token-only caller could never connect")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ConfigError("security.client_ca_file (mTLS) needs the service's own "
                              "certificate: set security.cert_file and security.key_file")
        if (self.crl_file is not None or self.revoked_serials) and self.client_ca_file is None:
            raise ConfigError("security.crl_file and security.revoked_serials revoke client "
                              "certificates: they need security.client_ca_file (mTLS)")
        if self.insecure and self.mode() is not AuthMode.NONE:
            raise ConfigError("security.insecure is for a service without authentication; "
                              "this one is configured with "
                              f"{self.mode().value} (drop insecure)")
        _check_revoked_serials(self.revoked_serials)
        if self.audit_log is not None and self.mode() is AuthMode.NONE:
            raise ConfigError("security.audit_log records who made each call: it needs "
                              "authentication (security.client_ca_file for mTLS or "
                              "security.token_keys for tokens)")
        if isinstance(self.audit_max_bytes, bool) or not isinstance(self.audit_max_bytes, int) \
                or self.audit_max_bytes < MIN_AUDIT_MAX_BYTES:
            raise ConfigError(f"security.audit_max_bytes must be an integer >= "
                              f"{MIN_AUDIT_MAX_BYTES}, got {self.audit_max_bytes!r}")
        if isinstance(self.audit_backups, bool) or not isinstance(self.audit_backups, int) \
                or not 1 <= self.audit_backups <= MAX_AUDIT_BACKUPS:
            raise ConfigError(f"security.audit_backups must be an integer in 1.."
                              f"{MAX_AUDIT_BACKUPS}, got {self.audit_backups!r}")
        if not (math.isfinite(self.token_reload_interval_s)
                and self.token_reload_interval_s >= 0):
            raise ConfigError("security.token_reload_interval_s must be finite and >= 0, got "
                              f"{self.token_reload_interval_s}")

    def mode(self) -> AuthMode:
        if self.client_ca_file is not None:
            return AuthMode.MTLS
        if self.token_keys is not None:
            return AuthMode.TOKEN
        return AuthMode.NONE

    @property
    def tls(self) -> bool:
        """Whether the port speaks TLS."""
        return self.cert_file is not None

    def revoked_serial_numbers(self) -> frozenset[int]:
        out = set()
        for item in (s.strip() for s in self.revoked_serials.split(",")):
            if item:
                out.add(int(item.removeprefix("0x").replace(":", ""), 16))
        return frozenset(out)


def check_binding(host: str, security: ServerSecurity, what: str) -> str:
    """Whether ``what`` (``"the daemon's gRPC service"``) may listen on ``host`` with
    ``security``; returns the line to log at start (a warning when it starts with
    ``"WARNING"``). Raises ConfigError naming the fix when it may not."""
    mode = security.mode()
    loopback = is_loopback(host)
    if mode is AuthMode.TOKEN and not security.tls and not loopback:
        raise ConfigError(
            f"{what} would accept bearer tokens in clear text on {host!r}: give it a "
            "certificate (security.cert_file and security.key_file) or bind a loopback address")
    if mode is not AuthMode.NONE:
        return (f"{what}: {mode.value} authentication"
                f"{', TLS' if security.tls else ' over plaintext loopback'} on {host}")
    if loopback:
        return (f"{what}: no security config, so it listens on loopback only ({host}) and "
                "serves every call as the insecure operator (see docs/security.md to "
                "authenticate callers)")
    if security.insecure:
        return (f"WARNING {what} listens on {host} WITHOUT AUTHENTICATION (security.insecure): "
                "anyone who reaches it may read, write, evict and drain; configure mTLS or "
                "tokens (docs/security.md)")
    raise ConfigError(
        f"{what} would listen on {host!r} without authentication. Configure mTLS "
        "(security.cert_file, security.key_file, security.client_ca_file) or bearer tokens "
        "(security.token_keys), bind 127.0.0.1, or accept the risk explicitly with "
        "--insecure (security.insecure: true); see docs/security.md")


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """What a client presents to a daemon or conductor (module docstring). All empty: a
    plaintext channel with no credentials, as before security existed."""

    ca_file: Path | None = None
    """CA bundle (PEM) that signed the server's certificate: the channel speaks TLS."""
    cert_file: Path | None = None
    """This client's certificate (mTLS; needs ``ca_file``)."""
    key_file: Path | None = None
    token_file: Path | None = None
    """A file holding one bearer token (re-read when it changes)."""
    server_name: str | None = None
    """The name to check the server's certificate against when it is not the dialed host.
    May hold ``{node}`` (the conductor's channels to daemons: :meth:`for_node`)."""

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError("a client certificate and its key go together (give both "
                              "cert_file and key_file, or neither)")
        if self.cert_file is not None and self.ca_file is None:
            raise ConfigError("a client certificate is presented over TLS: give ca_file, the "
                              "CA that signed the server's certificate")
        if self.server_name is not None and self.ca_file is None:
            raise ConfigError("server_name checks the server's certificate: it needs ca_file")
        if self.server_name is not None and ("{" in self.server_name
                                             or "}" in self.server_name):
            try:
                self.server_name.format(node="n")
            except (KeyError, IndexError, ValueError) as exc:
                raise ConfigError(f"server_name {self.server_name!r}: the only field it may "
                                  "hold is {node}") from exc

    def for_node(self, node_id: str) -> ClientSecurity:
        """This config for the channel to daemon ``node_id``: a ``server_name`` with
        ``{node}`` in it becomes that name (``{node}.daemons.kvtier``: the daemon's server
        certificate must carry ``node-a.daemons.kvtier``, so a node record in etcd that points
        at another server of the same CA, another daemon's or an engine's, is not followed;
        docs/security.md, "The conductor"); otherwise this config unchanged."""
        if self.server_name is None or "{node}" not in self.server_name:
            return self
        return dataclasses.replace(self, server_name=self.server_name.format(node=node_id))

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    @property
    def empty(self) -> bool:
        return self.ca_file is None and self.token_file is None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSecurity:
        """From ``KVTIER_TLS_CA``, ``KVTIER_TLS_CERT``, ``KVTIER_TLS_KEY``,
        ``KVTIER_TOKEN_FILE`` and ``KVTIER_TLS_SERVER_NAME`` (unset or empty: not given)."""
        source = os.environ if env is None else env

        def path(name: str) -> Path | None:
            value = source.get(name, "").strip()
            return Path(value).expanduser() if value else None

        try:
            return cls(ca_file=path(ENV_CA), cert_file=path(ENV_CERT), key_file=path(ENV_KEY),
                       token_file=path(ENV_TOKEN_FILE),
                       server_name=source.get(ENV_SERVER_NAME, "").strip() or None)
        except ConfigError as exc:
            raise ConfigError(f"{exc} (environment {ENV_CA}, {ENV_CERT}, {ENV_KEY}, "
                              f"{ENV_TOKEN_FILE})") from exc

    def merged(self, *, ca_file: Path | None = None, cert_file: Path | None = None,
               key_file: Path | None = None, token_file: Path | None = None,
               server_name: str | None = None) -> ClientSecurity:
        """This config with the given values replacing its own (flags over environment)."""
        return ClientSecurity(ca_file=ca_file or self.ca_file,
                              cert_file=cert_file or self.cert_file,
                              key_file=key_file or self.key_file,
                              token_file=token_file or self.token_file,
                              server_name=server_name or self.server_name)

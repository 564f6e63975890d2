"""Certificates: the service's own (reloaded when rotated), client credentials, and how a
client certificate names a :class:`~kvstore.security.identity.Principal`.

**Certificate to principal.** A client certificate names its caller in a SAN URI::

    kvtier://<role>/<name>[?tenants=a,b|*][&shared_writer=1]

e.g. ``kvtier://engine/vllm-0?tenants=acme,globex``, ``kvtier://operator/alice``,
``kvtier://peer/conductor-1``, ``kvtier://daemon/node-a``. The role is ``engine``, ``operator``,
``peer`` (the conductor) or ``daemon`` (a store daemon's own certificate: Info only); an engine
must name its tenants (``*``: every tenant); an operator or a peer without ``tenants`` may use
every tenant; a daemon acts for none. A certificate without exactly one ``kvtier://`` URI is refused (UNAUTHENTICATED): the
subject's CN is not used, so a certificate issued by the same CA for something else (a web
server) grants nothing. The URI is part of what the CA signs, so only the CA decides roles.

**Rotation without restart.** :class:`ServerCertificates` hands grpc a fetcher
(``grpc.dynamic_ssl_server_credentials``) that grpc calls before each new TLS handshake; when
the certificate, key or CA file changed (mtime, size or inode), the new files are loaded and
checked (the key matches the certificate, the certificate is valid now) and new connections
see them; connections already open keep the old certificate. A broken or half-written set is
logged and the previous one kept. The CRL is re-read the same way.

**Errors.** Expired and untrusted client certificates are refused by the TLS handshake itself
(the server logs ``Handshake failed ... certificate has expired`` / ``unable to get local issuer
certificate``; the client sees UNAVAILABLE, which :func:`handshake_hint` words); a client checks
its own certificate's dates before connecting (:func:`client_credentials`). Revoked serials
(CRL or ``revoked_serials``) pass the handshake and are refused per call with UNAUTHENTICATED
naming the serial.

**The TCP data plane** (``server.tcp_tls``, docs/security.md) **and** ``/metrics``
(:mod:`kvstore.security.http`): the same certificate, key and client CA as the gRPC port, as
one ``ssl.SSLContext`` (:meth:`ServerCertificates.ssl_context`, asked once per accepted data or
metrics connection and rebuilt when the files change, with the same checks and the same
keep-the-previous-set rule); a client builds its side with
:func:`data_plane_client_context` from its :class:`~kvstore.security.config.ClientSecurity`.
With mTLS the data plane's context is a
:class:`~kvstore.dataplane.transport.tcp.tls.CheckedServerContext` whose ``peer_check`` is
:meth:`CertificateAuthenticator.identify` over the *same* :class:`Revocations` as the gRPC
port's (:class:`~kvstore.security.server.SecureServing` shares one): a revoked (CRL or
``revoked_serials``), expired or identity-less client certificate is refused right after the
handshake with UNAUTHENTICATED naming the serial and the list, and an open data connection is
checked again every ``token_reload_interval_s`` (at least 1 s), so a CRL reloaded later ends it
before its next request, as gRPC refuses the next call.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtensionOID

from kvstore.dataplane.transport.tcp.tls import CheckedServerContext
from kvstore.errors import ConfigError, Unauthenticated
from kvstore.security.config import ClientSecurity, ServerSecurity
from kvstore.security.identity import Principal, Role
from kvstore.security.tokens import check_tenants

log = logging.getLogger(__name__)

URI_SCHEME = "kvtier"
_CACHE_MAX = 4096


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc}") from exc
    if not data.strip():
        raise ConfigError(f"{what} {path} is empty")
    return data


def _load_chain(data: bytes, path: Path, what: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ConfigError(f"{what} {path} is not PEM certificates: {exc}") from exc
    return certs


def _fmt(when: datetime.datetime) -> str:
    return when.isoformat(timespec="seconds")


def check_validity(cert: x509.Certificate, what: str, now: datetime.datetime | None = None
                   ) -> None:
    """ConfigError when ``cert`` is expired or not valid yet."""
    now = now or datetime.datetime.now(datetime.UTC)
    if now >= cert.not_valid_after_utc:
        raise ConfigError(f"{what} ({cert.subject.rfc4514_string()}, serial "
                          f"{cert.serial_number:x}) expired at {_fmt(cert.not_valid_after_utc)}")
    if now < cert.not_valid_before_utc:
        raise ConfigError(f"{what} ({cert.subject.rfc4514_string()}) is not valid before "
                          f"{_fmt(cert.not_valid_before_utc)}")


def load_key_pair(cert_path: Path, key_path: Path, what: str) -> tuple[bytes, bytes]:
    """(key PEM, certificate chain PEM), checked: the key matches the leaf, the leaf is valid now."""
    chain_pem = _read(cert_path, f"{what} certificate")
    key_pem = _read(key_path, f"{what} key")
    chain = _load_chain(chain_pem, cert_path, f"{what} certificate")
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what} key {key_path} does not load (PEM, unencrypted): {exc}") \
            from exc
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != chain[0].public_key().public_bytes(*spki):
        raise ConfigError(f"{what} key {key_path} does not match the certificate {cert_path}")
    check_validity(chain[0], f"{what} certificate {cert_path}")
    return key_pem, chain_pem


def load_ca(path: Path, what: str) -> bytes:
    data = _read(path, what)
    _load_chain(data, path, what)
    return data


def _file_signature(*paths: Path | None) -> tuple[Any, ...]:
    out: list[Any] = []
    for path in paths:
        if path is None:
            out.append(None)
            continue
        try:
            st = os.stat(path)
        except OSError:
            out.append(("missing", str(path)))
            continue
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


# --- the server's side -------------------------------------------------------------------------


class ServerCertificates:
    """A service's certificate, key and client CA, reloaded when the files change (module
    docstring). :meth:`credentials` is what ``server.add_secure_port`` takes."""

    def __init__(self, security: ServerSecurity, what: str,
                 revocations: Revocations | None = None) -> None:
        """``revocations``: the gRPC port's (shared, so the CRL is read and reloaded once);
        with mTLS and None, one of its own."""
        assert security.cert_file is not None and security.key_file is not None
        self._security = security
        self._what = what
        self._data_peers: CertificateAuthenticator | None = None
        """Checks the TCP data plane's client certificates (mTLS only: module docstring)."""
        if security.client_ca_file is not None:
            self._data_peers = CertificateAuthenticator(revocations or Revocations(security))
        self._lock = threading.Lock()
        self._files = (security.cert_file, security.key_file, security.client_ca_file)
        self._signature = _file_signature(*self._files)
        self._config = self._load()
        self.reloads = 0
        """How many times rotated files were taken (for tests and logs)."""
        self.serving_serial = self._serial
        self._ssl_signature: tuple[Any, ...] = ()
        self._ssl_context: ssl.SSLContext | None = None
        self.ssl_context_reloads = 0
        """How many times :meth:`ssl_context` was rebuilt for rotated files."""

    def _load(self) -> Any:
        import grpc

        sec = self._security
        assert sec.cert_file is not None and sec.key_file is not None
        key_pem, chain_pem = load_key_pair(sec.cert_file, sec.key_file, self._what)
        self._serial = x509.load_pem_x509_certificates(chain_pem)[0].serial_number
        ca_pem = load_ca(sec.client_ca_file, "client CA bundle") \
            if sec.client_ca_file is not None else None
        return grpc.ssl_server_certificate_configuration([(key_pem, chain_pem)], ca_pem)

    def fetch(self) -> Any:
        """grpc's certificate-configuration fetcher: a new configuration when the files
        changed and load cleanly, else None (keep serving the current one)."""
        signature = _file_signature(*self._files)
        with self._lock:
            if signature == self._signature:
                return None
            self._signature = signature
            try:
                config = self._load()
            except ConfigError as exc:
                log.warning("%s: rotated certificate files not taken, serving the previous "
                            "ones: %s", self._what, exc)
                return None
            self._config = config
            self.reloads += 1
            self.serving_serial = self._serial
        log.info("%s: serving the rotated certificate (serial %x)", self._what, self._serial)
        return config

    def ssl_context(self) -> ssl.SSLContext:
        """The ``ssl``-module server context of the TCP data plane and of ``/metrics``
        (:mod:`kvstore.security.http`): this service's certificate chain and key, and,
        with a client CA (mTLS), client certificates required and verified against it (TLS 1.2
        at least). Rebuilt when the files changed since the last call (checked at each call:
        three ``stat``s), with the checks :func:`load_key_pair` makes; a set that fails them
        is logged and the previous context kept. Raises ConfigError only when there is no
        previous one (at start). Thread-safe."""
        signature = _file_signature(*self._files)
        context = self._ssl_context
        if context is not None and signature == self._ssl_signature:
            return context
        with self._lock:
            if self._ssl_context is not None and signature == self._ssl_signature:
                return self._ssl_context
            try:
                context = self._build_ssl_context()
            except ConfigError as exc:
                if self._ssl_context is None:
                    raise
                log.warning("%s: rotated certificate files not taken by the TCP data plane "
                            "and /metrics, serving the previous ones: %s", self._what, exc)
                self._ssl_signature = signature
                return self._ssl_context
            if self._ssl_context is not None:
                self.ssl_context_reloads += 1
                log.info("%s: the TCP data plane and /metrics serve the rotated certificate",
                         self._what)
            self._ssl_context, self._ssl_signature = context, signature
            return context

    def _build_ssl_context(self) -> ssl.SSLContext:
        sec = self._security
        assert sec.cert_file is not None and sec.key_file is not None
        load_key_pair(sec.cert_file, sec.key_file, self._what)  # the same checks as gRPC's
        context = CheckedServerContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self._data_peers is not None:
            context.peer_check = self._data_peers.identify_der
            context.peer_recheck_s = max(1.0, sec.token_reload_interval_s)
        try:
            context.load_cert_chain(sec.cert_file, sec.key_file)
            if sec.client_ca_file is not None:
                ca_pem = load_ca(sec.client_ca_file, "client CA bundle")
                context.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
                context.verify_mode = ssl.CERT_REQUIRED
        except ssl.SSLError as exc:  # changed between the checks and the load
            raise ConfigError(f"{self._what}: the certificate files do not load for TLS: "
                              f"{exc}") from exc
        return context

    def credentials(self) -> Any:
        import grpc

        return grpc.dynamic_ssl_server_credentials(
            self._config, self.fetch,
            require_client_authentication=self._security.client_ca_file is not None)


class Revocations:
    """Client-certificate serials refused per call: ``revoked_serials`` plus the CRL file's,
    re-read when it changes (checked at most every ``reload_interval_s``). The CRL's signature
    is checked against the client CA; a CRL that fails to load keeps the previous list."""

    def __init__(self, security: ServerSecurity) -> None:
        self._fixed = security.revoked_serial_numbers()
        self._crl_path = security.crl_file
        self._ca_path = security.client_ca_file
        self._interval = security.token_reload_interval_s
        self._lock = threading.Lock()
        self._checked_at = -float("inf")
        self._signature: tuple[Any, ...] = ()
        self._crl: frozenset[int] = frozenset()
        if self._crl_path is not None:
            self._signature = _file_signature(self._crl_path)
            self._crl = self._load_crl()

    def _load_crl(self) -> frozenset[int]:
        assert self._crl_path is not None and self._ca_path is not None
        data = _read(self._crl_path, "CRL")
        try:
            crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data \
                else x509.load_der_x509_crl(data)
        except ValueError as exc:
            raise ConfigError(f"CRL {self._crl_path} does not load: {exc}") from exc
        cas = x509.load_pem_x509_certificates(_read(self._ca_path, "client CA bundle"))
        issuer = next((ca for ca in cas if ca.subject == crl.issuer), None)
        if issuer is None:
            raise ConfigError(f"CRL {self._crl_path} is issued by {crl.issuer.rfc4514_string()}, "
                              "which is not in the client CA bundle")
        if not crl.is_signature_valid(issuer.public_key()):  # type: ignore[arg-type]
            raise ConfigError(f"CRL {self._crl_path}: its signature does not verify")
        return frozenset(r.serial_number for r in crl)

    def revoked(self, serial: int) -> str | None:
        """Where ``serial`` is listed as revoked, or None."""
        if serial in self._fixed:
            return "security.revoked_serials"
        if self._crl_path is None:
            return None
        now = time.monotonic()
        if now - self._checked_at >= self._interval:
            with self._lock:
                self._checked_at = now
                signature = _file_signature(self._crl_path)
                if signature != self._signature:
                    self._signature = signature
                    try:
                        self._crl = self._load_crl()
                        log.info("reloaded the CRL %s (%d serials)", self._crl_path,
                                 len(self._crl))
                    except ConfigError as exc:
                        log.warning("CRL not reloaded, keeping the previous one: %s", exc)
        return f"the CRL {self._crl_path}" if serial in self._crl else None


@dataclass(frozen=True, slots=True)
class CertificateIdentity:
    principal: Principal
    serial: int
    not_after_unix_s: float


def parse_identity_uri(uri: str) -> Principal:
    """The principal a ``kvtier://<role>/<name>?tenants=...`` URI names (module docstring)."""
    parsed = urllib.parse.urlsplit(uri)
    if parsed.scheme != URI_SCHEME:
        raise Unauthenticated(f"{uri!r} is not a kvtier:// identity")
    try:
        role = Role(parsed.netloc)
    except ValueError:
        raise Unauthenticated(f"identity {uri!r}: role {parsed.netloc!r} is not one of "
                              f"{', '.join(r.value for r in Role)}") from None
    name = parsed.path.lstrip("/")
    if not name or len(name) > 128:
        raise Unauthenticated(f"identity {uri!r} must name the caller: kvtier://{role.value}/NAME")
    query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True, strict_parsing=False)
    unknown = set(query) - {"tenants", "shared_writer"}
    if unknown:
        raise Unauthenticated(f"identity {uri!r}: unknown parameter(s) {', '.join(sorted(unknown))}")
    tenants_text = query.get("tenants", [None])[-1]
    tenants = check_tenants(role, None if tenants_text is None else
                            [t for t in tenants_text.split(",") if t] or [""])
    shared = query.get("shared_writer", ["0"])[-1]
    if shared not in ("0", "1", "true", "false"):
        raise Unauthenticated(f"identity {uri!r}: shared_writer must be 0 or 1")
    return Principal(f"{role.value}/{name}", role, tenants,
                     shared_writer=shared in ("1", "true"))


def principal_from_certificate(cert: x509.Certificate) -> Principal:
    """The principal of a client certificate's one ``kvtier://`` SAN URI."""
    try:
        san = cert.extensions.get_extension_for_oid(ExtensionOID.SUBJECT_ALTERNATIVE_NAME)
    except x509.ExtensionNotFound:
        san = None
    uris = [] if san is None else [
        u for u in san.value.get_values_for_type(x509.UniformResourceIdentifier)  # type: ignore[attr-defined]
        if u.startswith(f"{URI_SCHEME}://")]
    subject = cert.subject.rfc4514_string()
    if len(uris) != 1:
        raise Unauthenticated(
            f"client certificate {subject} (serial {cert.serial_number:x}) carries "
            f"{len(uris)} kvtier:// SAN URIs; it needs exactly one naming the caller, e.g. "
            "kvtier://engine/NAME?tenants=a,b (docs/security.md)")
    return parse_identity_uri(uris[0])


class CertificateAuthenticator:
    """Principals of the client certificates gRPC verified, cached by certificate, checked
    per call against revocations and the certificate's expiry (a connection can outlive it)."""

    def __init__(self, revocations: Revocations) -> None:
        self._revocations = revocations
        self._cache: dict[bytes, CertificateIdentity | Unauthenticated] = {}
        self._lock = threading.Lock()

    def identify_der(self, der: bytes) -> None:
        """:meth:`identify` for a DER certificate (the TCP data plane's TLS peer check):
        raises Unauthenticated when it is revoked, expired or names no kvtier identity."""
        self.identify(ssl.DER_cert_to_PEM_cert(der).encode("ascii"))

    def identify(self, pem: bytes) -> Principal:
        with self._lock:
            hit = self._cache.get(pem)
        if hit is None:
            hit = self._parse(pem)
            with self._lock:
                if len(self._cache) >= _CACHE_MAX:
                    self._cache.clear()
                self._cache[pem] = hit
        if isinstance(hit, Unauthenticated):
            raise Unauthenticated(str(hit))
        where = self._revocations.revoked(hit.serial)
        if where is not None:
            raise Unauthenticated(f"client certificate of {hit.principal.name} (serial "
                                  f"{hit.serial:x}) is revoked ({where})")
        if time.time() >= hit.not_after_unix_s:
            raise Unauthenticated(f"client certificate of {hit.principal.name} (serial "
                                  f"{hit.serial:x}) has expired: reconnect with a new one")
        return hit.principal

    @staticmethod
    def _parse(pem: bytes) -> CertificateIdentity | Unauthenticated:
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError as exc:
            return Unauthenticated(f"client certificate does not parse: {exc}")
        try:
            principal = principal_from_certificate(cert)
        except Unauthenticated as exc:
            return exc
        return CertificateIdentity(principal, cert.serial_number,
                                   cert.not_valid_after_utc.timestamp())


# --- the client's side -------------------------------------------------------------------------


def client_credentials(security: ClientSecurity) -> Any:
    """``grpc.ssl_channel_credentials`` for ``security`` (which must have ``ca_file``), after
    checking the client's own certificate: ConfigError when it is expired, not valid yet, or
    does not match its key, so the caller hears that instead of a closed socket."""
    import grpc

    assert security.ca_file is not None
    ca_pem = load_ca(security.ca_file, "CA bundle (ca_file)")
    key_pem = chain_pem = None
    if security.cert_file is not None:
        assert security.key_file is not None
        key_pem, chain_pem = load_key_pair(security.cert_file, security.key_file, "client")
    return grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key_pem,
                                        certificate_chain=chain_pem)


def data_plane_client_context(security: ClientSecurity) -> ssl.SSLContext:
    """The client side of the TCP data plane's TLS (module docstring): the server's
    certificate verified against ``security.ca_file`` (and its name: the dialed host, or
    ``server_name``), this client's certificate presented when it has one (checked first, as
    :func:`client_credentials` does). Raises ConfigError (no ``ca_file``, unreadable or
    expired files)."""
    if security.ca_file is None:
        raise ConfigError("this daemon's TCP data plane speaks TLS (NodeInfo.data_tls_required): "
                          "the client needs the CA of its certificate (ClientSecurity.ca_file, "
                          "KVTIER_TLS_CA or --ca)")
    ca_pem = load_ca(security.ca_file, "CA bundle (ca_file)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_verify_locations(cadata=ca_pem.decode("ascii", "replace"))
        if security.cert_file is not None:
            assert security.key_file is not None
            load_key_pair(security.cert_file, security.key_file, "client")
            context.load_cert_chain(security.cert_file, security.key_file)
    except ssl.SSLError as exc:
        raise ConfigError(f"the client's TLS files do not load: {exc}") from exc
    return context


def channel_options(security: ClientSecurity) -> list[tuple[str, Any]]:
    return [("grpc.ssl_target_name_override", security.server_name)] \
        if security.server_name else []


def handshake_hint(details: str, security: ClientSecurity) -> str | None:
    """A readable cause for a failed connection on a TLS channel, or None. The server's
    certificate not verifying is named by grpc; a server refusing *our* certificate shows only
    as a closed socket, so that case is a hint, not a certainty."""
    if not security.tls:
        return None
    if "CERTIFICATE_VERIFY_FAILED" in details or "certificate verify failed" in details:
        return (f"the server's certificate does not verify against {security.ca_file} "
                f"(another CA, expired, or not issued for this address): {details}")
    if "Socket closed" in details or "handshake" in details.lower():
        who = f"the client certificate {security.cert_file}" if security.cert_file else \
            "a connection without a client certificate"
        return (f"the TLS handshake did not complete: the server may refuse {who} (expired, "
                "revoked at the CA, or from a CA it does not trust; its log says which), or it "
                f"is not serving TLS: {details}")
    return None

"""A small read-only HTTP endpoint (the daemon's ``/metrics``) behind its service's security.

The same rules as the gRPC port (:func:`~kvstore.security.config.check_binding`): without a
security config it binds loopback only (a non-loopback host needs ``security.insecure``, and is
then served in the clear with a warning at every start); with one, every scrape is
authenticated, also on loopback, and only an **operator** may read (a scrape shows each tracked
tenant's name and traffic: operator information, not an engine's):

* mTLS (``client_ca_file``): TLS with the service's certificate, a client certificate of that
  CA required in the handshake, and its principal (SAN URI, revocation list) checked as gRPC
  checks it;
* tokens (``token_keys``): ``Authorization: Bearer <token>`` verified with the service's key set,
  over TLS where the service has a certificate (plaintext only on loopback, as gRPC).

A refusal is an HTTP 401 (no or bad credentials) or 403 (not an operator) whose body says why;
nothing of the registry is rendered for it. The TLS handshake and the request are read on the
connection's own thread within ``timeout_s``, so a client that stalls holds one thread for at
most that long and never the accept loop.

Rotation: the TLS context is :meth:`~kvstore.security.tls.ServerCertificates.ssl_context`, the
one the TCP data plane takes, asked once per accepted connection: a rotated certificate, key or
client CA on disk is served from the next handshake, a broken set is logged and the previous one
kept (as gRPC's reload). Given the daemon's :class:`~kvstore.security.server.SecureServing`, the
endpoint shares its certificates and its :class:`~kvstore.security.auth.Authenticator` (one CRL
and one token key directory, reloaded once for all three ports).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstore.errors import KvtierError, PermissionDenied, Unauthenticated
from kvstore.security.auth import Authenticator
from kvstore.security.config import AuthMode, ServerSecurity, check_binding
from kvstore.security.identity import Role
from kvstore.security.server import SecureServing
from kvstore.security.tls import Revocations, ServerCertificates

log = logging.getLogger(__name__)

__all__ = ["SecureHttpEndpoint"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format."""


class SecureHttpEndpoint:
    """Serves ``render()`` at ``path`` on ``host:port`` (0: ephemeral) under ``security``
    (module docstring). The constructor checks the binding (ConfigError naming the fix) and
    loads the certificate (ConfigError for a broken set); :meth:`start` binds and serves on a
    thread. ``serving``: the service's gRPC plan whose certificates and authenticator this
    endpoint shares (its ``security`` must be ``security``); None: its own, built here."""

    def __init__(self, security: ServerSecurity, host: str, port: int,
                 render: Callable[[], bytes], what: str, *, path: str = "/metrics",
                 timeout_s: float = 10.0, serving: SecureServing | None = None) -> None:
        self.what = what
        self.line = check_binding(host, security, what)
        self._host, self._port = host, port
        self._render, self._path, self._timeout_s = render, path, timeout_s
        self._mode = security.mode()
        self._certificates: ServerCertificates | None = None
        self._authenticator: Authenticator | None = None
        if serving is not None:
            assert serving.security is security, "the endpoint shares its service's security"
            self._certificates, self._authenticator = serving.certificates, serving.authenticator
        else:
            revocations = Revocations(security) if self._mode is AuthMode.MTLS else None
            if security.tls:
                self._certificates = ServerCertificates(security, what, revocations)
            if self._mode is not AuthMode.NONE:
                self._authenticator = Authenticator(security, what, revocations)
        if self._certificates is not None:
            self._certificates.ssl_context()  # a set that does not load fails here, not later
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        self.refused = 0
        """Scrapes refused (401/403) since start."""

    @property
    def scheme(self) -> str:
        return "https" if self._certificates is not None else "http"

    def start(self) -> int:
        """Bind and serve on a daemon thread; the port."""
        endpoint = self
        server = _Server((self._host, self._port), _Handler)
        server.endpoint = endpoint
        self._server = server
        self.port = int(server.server_address[1])
        self._thread = threading.Thread(target=server.serve_forever, name="kvtier-metrics",
                                        daemon=True)
        self._thread.start()
        if self.line.startswith("WARNING "):
            log.warning("%s", self.line.removeprefix("WARNING "))
        else:
            log.info("%s", self.line)
        log.info("%s on %s://%s:%d%s", self.what, self.scheme, self._host, self.port,
                 self._path)
        return self.port

    def close(self) -> None:
        """Stop serving. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _check(self, handler: BaseHTTPRequestHandler, conn: socket.socket) -> None:
        """Raise Unauthenticated / PermissionDenied unless the caller is an operator."""
        if self._authenticator is None:
            return
        auth_context: dict[str, list[bytes]] = {}
        if isinstance(conn, ssl.SSLSocket):
            der = conn.getpeercert(binary_form=True)
            if der:
                auth_context["x509_pem_cert"] = [ssl.DER_cert_to_PEM_cert(der).encode()]
        header = handler.headers.get("Authorization")
        metadata = [] if header is None else [("authorization", header)]
        principal = self._authenticator.principal(auth_context, metadata)
        if principal.role is not Role.OPERATOR:
            raise PermissionDenied(f"{self.what} is for operators; {principal.name} is "
                                   f"{principal.role.value}")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    endpoint: SecureHttpEndpoint

    def finish_request(self, request: Any, client_address: Any) -> None:
        """On the connection's own thread: the TLS handshake (bounded), then the request."""
        ep = self.endpoint
        request.settimeout(ep._timeout_s)
        if ep._certificates is not None:
            try:
                # The current context: rotated files are taken here, per connection.
                context = ep._certificates.ssl_context()
                request = context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError) as exc:
                ep.refused += 1
                log.info("%s: TLS handshake from %s refused: %s", ep.what, client_address, exc)
                return
        try:
            _Handler(request, client_address, self)
        finally:
            if request is not None and isinstance(request, ssl.SSLSocket):
                with contextlib.suppress(ssl.SSLError, OSError):
                    request.unwrap()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        ep = self.server.endpoint
        if self.path.split("?", 1)[0] != ep._path:
            self._answer(404, b"not found\n")
            return
        try:
            ep._check(self, self.connection)
        except (Unauthenticated, PermissionDenied) as exc:
            ep.refused += 1
            code = 401 if isinstance(exc, Unauthenticated) else 403
            self._answer(code, f"{exc}\n".encode(), bearer=code == 401)
            return
        except KvtierError as exc:
            ep.refused += 1
            self._answer(401, f"{exc}\n".encode())
            return
        self._answer(200, ep._render(), CONTENT_TYPE)

    def _answer(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                bearer: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if bearer:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass

"""How a daemon or conductor listens: :class:`SecureServing` decides, from its ``security``
config and its listen host, whether it may start (:func:`~kvstore.security.config.check_binding`),
which interceptor its gRPC server needs, and how its port is added (TLS with rotated
certificates, or plaintext), and opens its audit log (``security.audit_log``)."""

from __future__ import annotations

import logging
from typing import Any

from kvstore.security.audit import AuditLog
from kvstore.security.auth import AioAuthInterceptor, Authenticator, SyncAuthInterceptor
from kvstore.security.config import AuthMode, ServerSecurity, check_binding
from kvstore.security.tls import Revocations, ServerCertificates

log = logging.getLogger(__name__)


class SecureServing:
    """One service's listening plan. The constructor checks the config (ConfigError naming
    the fix), loads certificates and keys, opens the audit log (ConfigError when it cannot)
    and logs how the service will listen; nothing binds until :meth:`add_port`. The audit
    log's file stays open for the life of the process (each line is written through)."""

    def __init__(self, security: ServerSecurity, host: str, what: str) -> None:
        self.security = security
        self.what = what
        line = check_binding(host, security, what)
        # One revocation list for the gRPC port and the TCP data plane's TLS (one CRL read).
        revocations = Revocations(security) if security.mode() is AuthMode.MTLS else None
        self.certificates = ServerCertificates(security, what, revocations) \
            if security.tls else None
        self.authenticator = Authenticator(security, what, revocations) \
            if security.mode() is not AuthMode.NONE else None
        self.audit = AuditLog.open(security.audit_log, security.audit_max_bytes,
                                   security.audit_backups, what) \
            if security.audit_log is not None else None
        if line.startswith("WARNING "):
            log.warning("%s", line.removeprefix("WARNING "))
        else:
            log.info("%s", line)

    @property
    def mode(self) -> AuthMode:
        return self.security.mode()

    def aio_interceptors(self) -> list[Any]:
        return [] if self.authenticator is None else [AioAuthInterceptor(self.authenticator,
                                                                         self.audit)]

    def sync_interceptors(self) -> list[Any]:
        return [] if self.authenticator is None else [SyncAuthInterceptor(self.authenticator,
                                                                          self.audit)]

    def add_port(self, server: Any, address: str) -> int:
        """Bind ``address`` on ``server`` (grpc or grpc.aio); the port, 0 when it failed."""
        if self.certificates is None:
            port: int = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, self.certificates.credentials())
        return port

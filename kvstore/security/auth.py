"""Authentication and authorization of every gRPC call of the daemon and the conductor.

:class:`Authenticator` turns a call's credentials into a :class:`Principal`: the client
certificate gRPC verified in the TLS handshake (mTLS) or the ``authorization: Bearer`` token of
its metadata. :func:`authorize` checks the principal's role against :data:`METHOD_ROLES`, the
one table of which role may call which method; a method missing from it is refused to everyone
(a new RPC fails closed until someone decides who may call it). The interceptors
(:class:`AioAuthInterceptor` for the daemon's ``grpc.aio`` server, :class:`SyncAuthInterceptor`
for the conductor's threaded server) run both checks before the handler and run the handler
inside :func:`~kvstore.security.identity.serving_as`, so service code reads the caller with
:func:`~kvstore.security.identity.current_principal`. A refusal is UNAUTHENTICATED or
PERMISSION_DENIED with the kvtier error name in the trailing metadata ``kvtier-error``, as the
services answer their own errors.

**Health checks stay open** (``grpc.health.v1.Health``): load balancers, Kubernetes probes and
``DaemonControl.daemon_alive`` ask them without kvtier credentials, and they reveal one bit
(serving or not) that anyone who can open a connection learns anyway. They run as
:data:`~kvstore.security.identity.ANONYMOUS` (no tenant). On an mTLS port the TLS handshake
still requires a client certificate, health included. Reflection needs any authenticated role.

Contextvars and threads: the principal is visible in the handler and in whatever it awaits.
``loop.run_in_executor`` does **not** carry contextvars into the pool thread (there
``current_principal()`` is :data:`~kvstore.security.identity.INSECURE`); code that needs the
caller there must pass it, or run ``contextvars.copy_context().run``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc

from kvstore.errors import InvariantViolation, KvtierError, PermissionDenied, Unauthenticated
from kvstore.security.audit import AuditLog
from kvstore.security.config import AuthMode, ServerSecurity
from kvstore.security.identity import ANONYMOUS, Principal, Role, serving_as
from kvstore.security.tls import CertificateAuthenticator, Revocations
from kvstore.security.tokens import KeyDirectory, TokenVerifier
from kvstore.wire import ERROR_METADATA_KEY, error_name, grpc_code_name

log = logging.getLogger(__name__)

AUTHORIZATION_METADATA_KEY = "authorization"
BEARER = "Bearer "

_E, _O, _P = Role.ENGINE, Role.OPERATOR, Role.PEER
_ENGINE = frozenset({_E, _O})
_OPERATOR = frozenset({_O})
_PEER = frozenset({_P, _O})
_ANY = frozenset(Role)

STORE = "/kvtier.v1.Store/"
CONDUCTOR = "/kvtier.v1.Conductor/"

METHOD_ROLES: dict[str, frozenset[Role]] = {
    # What an engine's StoreClient / KVClient calls: data and the leases that move it.
    **{STORE + m: _ENGINE for m in (
        "Put", "BatchPut", "Get", "BatchGet", "Lookup", "BatchLookup", "Exists",
        "AcquireRead", "Release", "Reserve", "Commit", "Abort", "SetParents",
        "IssueDataTicket")},
    STORE + "Info": _ANY,
    # Admin: read every tenant's metadata, remove, pin, evict, stop.
    **{STORE + m: _OPERATOR for m in (
        "Stats", "List", "Inspect", "Remove", "BatchRemove", "Evict", "Drain",
        "Pin", "BatchPin", "Unpin", "BatchUnpin")},
    # The conductor following a daemon's chunk events (every tenant's keys).
    STORE + "Subscribe": _PEER,
    STORE + "Snapshot": _PEER,
    # The conductor: engines (and the front door, the gateway) ask where to run and report.
    **{CONDUCTOR + m: _ENGINE for m in (
        "Schedule", "ScheduleBatch", "Lookup", "ReportLoad", "ReportCompletion")},
    # Inspection: the nodes, instances and engine caches the conductor follows, and how many
    # blocks it indexes (every tenant's). Clients find the leader in etcd, not here.
    CONDUCTOR + "Leader": _OPERATOR,
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _ANY,
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo": _ANY,
}
"""Which roles may call each method. Operators may do everything engines and peers do."""

OPEN_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch",
                          "/grpc.health.v1.Health/List"})
"""Answered without credentials (module docstring)."""


def authorize(principal: Principal, method: str) -> None:
    """PermissionDenied unless ``principal``'s role may call ``method``."""
    roles = METHOD_ROLES.get(method)
    if roles is None:
        raise PermissionDenied(f"{method} is not in the method table of "
                               "kvstore/security/auth.py: nobody may call it")
    if principal.role not in roles:
        need = " or ".join(sorted(r.value for r in roles))
        raise PermissionDenied(f"{principal.name} (role {principal.role.value}) may not call "
                               f"{method.rsplit('/', 1)[-1]}: it needs role {need}")


def _first(auth_context: dict[str, list[bytes]], key: str) -> bytes | None:
    values = auth_context.get(key) or []
    return values[0] if values else None


class _RefusalLog:
    """At most ``burst`` refusal lines per ``window_s``, then one line counting the rest: a
    client hammering with a bad credential must not flood the log."""

    def __init__(self, burst: int = 20, window_s: float = 10.0) -> None:
        self._burst, self._window_s = burst, window_s
        self._start = -float("inf")
        self._count = self._dropped = 0
        self._lock = threading.Lock()

    def __call__(self, what: str, method: str, peer: str, exc: KvtierError) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._start >= self._window_s:
                if self._dropped:
                    log.warning("%s: %d more refusal(s) not logged", what, self._dropped)
                self._start, self._count, self._dropped = now, 0, 0
            self._count += 1
            if self._count > self._burst:
                self._dropped += 1
                return
        log.warning("%s refused %s from %s: %s: %s", what, method, peer, type(exc).__name__, exc)


class Authenticator:
    """The credentials check of one service (module docstring). Thread-safe."""

    def __init__(self, security: ServerSecurity, what: str,
                 revocations: Revocations | None = None) -> None:
        """``revocations``: shared with the TCP data plane's TLS (``SecureServing``); with
        mTLS and None, one of its own."""
        self.mode = security.mode()
        if self.mode is AuthMode.NONE:
            raise InvariantViolation(f"an Authenticator needs mTLS or tokens: {security}")
        self.what = what
        self._certs = CertificateAuthenticator(revocations or Revocations(security)) \
            if self.mode is AuthMode.MTLS else None
        self._tokens = TokenVerifier(KeyDirectory(security.token_keys,
                                                  security.token_reload_interval_s)) \
            if security.token_keys is not None else None
        self.log_refusal = _RefusalLog()

    def principal(self, auth_context: dict[str, list[bytes]],
                  metadata: Any) -> Principal:
        """The caller, or Unauthenticated saying what was missing or wrong."""
        if self._certs is not None:
            pem = _first(auth_context, "x509_pem_cert")
            if pem is None:
                raise Unauthenticated(f"{self.what} requires a client certificate (mTLS)")
            return self._certs.identify(pem)
        assert self._tokens is not None
        token = None
        for key, value in metadata or ():
            if key == AUTHORIZATION_METADATA_KEY:
                text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
                if not text.startswith(BEARER):
                    raise Unauthenticated("the authorization metadata must be "
                                          "'Bearer <token>'")
                token = text[len(BEARER):].strip()
        if not token:
            raise Unauthenticated(f"{self.what} requires a bearer token (metadata "
                                  "'authorization: Bearer <token>'; `kvtier token mint`)")
        return self._tokens.verify(token).principal()

def _refusal(exc: KvtierError) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    return (getattr(grpc.StatusCode, grpc_code_name(exc)), str(exc),
            ((ERROR_METADATA_KEY, error_name(exc)),))


def _identify(auth: Authenticator, method: str, context: Any
              ) -> tuple[Principal | None, KvtierError | None]:
    """Whether a call may run ``method`` (open methods: anonymously), keeping who the caller
    was when it is refused for its role (the audit log names it): ``(principal, None)`` when
    allowed, else ``(the principal or None when it could not be authenticated, the
    refusal)``."""
    if method in OPEN_METHODS:
        return ANONYMOUS, None
    try:
        principal = auth.principal(context.auth_context(), context.invocation_metadata())
    except (Unauthenticated, PermissionDenied) as exc:
        return None, exc
    try:
        authorize(principal, method)
    except PermissionDenied as exc:
        return principal, exc
    return principal, None


def _operator_only(method: str) -> bool:
    """Whether only operators may call ``method``: every such call is audited."""
    return METHOD_ROLES.get(method) == _OPERATOR


_Wrap = Callable[[Any, str], Any]


def _rewrap(handler: Any, wrap_uu: _Wrap, wrap_us: _Wrap, wrap_su: _Wrap, wrap_ss: _Wrap,
            method: str) -> Any:
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            wrap_uu(handler.unary_unary, method), handler.request_deserializer,
            handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            wrap_us(handler.unary_stream, method), handler.request_deserializer,
            handler.response_serializer)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            wrap_su(handler.stream_unary, method), handler.request_deserializer,
            handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(
        wrap_ss(handler.stream_stream, method), handler.request_deserializer,
        handler.response_serializer)


class AioAuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The checks of :class:`Authenticator` on a ``grpc.aio`` server (the daemon); with an
    ``audit`` log, the operator actions and refusals go there too."""

    def __init__(self, authenticator: Authenticator, audit: AuditLog | None = None) -> None:
        self._auth = authenticator
        self._audit = audit

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if self._audit is not None:
            return _rewrap(handler, self._audited_unary, self._audited_stream,
                           self._audited_unary, self._audited_stream,
                           handler_call_details.method)
        return _rewrap(handler, self._unary, self._stream, self._unary, self._stream,
                       handler_call_details.method)

    async def _principal(self, method: str, context: Any) -> Principal | None:
        principal, exc = _identify(self._auth, method, context)
        if exc is None:
            return principal
        self._auth.log_refusal(self._auth.what, method, str(context.peer()), exc)
        code, details, trailing = _refusal(exc)
        if self._audit is not None:
            self._audit.refused(method, principal, context, exc, code.name)
        await context.abort(code, details, trailing_metadata=trailing)
        return None  # abort raises; not reached

    def _audited_unary(self, behavior: Any, method: str) -> Any:
        audit, operator = self._audit, _operator_only(method)
        assert audit is not None

        async def handle(request: Any, context: Any) -> Any:
            principal = await self._principal(method, context)
            assert principal is not None
            call = audit.call(method, principal, context, request, operator=operator, aio=True)
            with serving_as(principal):
                try:
                    result = await behavior(request, call.context)
                except BaseException as exc:
                    call.failed(exc)
                    raise
            call.succeeded()
            return result

        return handle

    def _audited_stream(self, behavior: Any, method: str) -> Any:
        audit, operator = self._audit, _operator_only(method)
        assert audit is not None

        async def handle(request: Any, context: Any) -> AsyncIterator[Any]:
            principal = await self._principal(method, context)
            assert principal is not None
            call = audit.call(method, principal, context, None, operator=operator, aio=True)
            try:  # _stream's steps (see there), inside the audit's try
                with serving_as(principal):
                    result = behavior(request, call.context)
                if not hasattr(result, "__anext__"):
                    with serving_as(principal):
                        await result
                else:
                    while True:
                        with serving_as(principal):
                            try:
                                item = await result.__anext__()
                            except StopAsyncIteration:
                                break
                        yield item
            except BaseException as exc:
                call.failed(exc)
                raise
            call.succeeded()

        return handle

    def _unary(self, behavior: Any, method: str) -> Any:
        async def handle(request: Any, context: Any) -> Any:
            principal = await self._principal(method, context)
            assert principal is not None
            with serving_as(principal):
                return await behavior(request, context)

        return handle

    def _stream(self, behavior: Any, method: str) -> Any:
        async def handle(request: Any, context: Any) -> AsyncIterator[Any]:
            principal = await self._principal(method, context)
            assert principal is not None
            with serving_as(principal):
                result = behavior(request, context)
            if not hasattr(result, "__anext__"):  # a coroutine writing with context.write
                with serving_as(principal):
                    await result
                return
            # The principal is set only while the handler's generator runs (around each
            # step), never across a yield: the context must not leak into grpc's code.
            while True:
                with serving_as(principal):
                    try:
                        item = await result.__anext__()
                    except StopAsyncIteration:
                        return
                yield item

        return handle


class SyncAuthInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """The checks of :class:`Authenticator` on a threaded ``grpc.server`` (the conductor);
    with an ``audit`` log, the operator actions and refusals go there too."""

    def __init__(self, authenticator: Authenticator, audit: AuditLog | None = None) -> None:
        self._auth = authenticator
        self._audit = audit

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if self._audit is not None:
            return _rewrap(handler, self._audited_unary, self._audited_stream,
                           self._audited_unary, self._audited_stream,
                           handler_call_details.method)
        return _rewrap(handler, self._unary, self._stream, self._unary, self._stream,
                       handler_call_details.method)

    def _principal(self, method: str, context: Any) -> Principal:
        principal, exc = _identify(self._auth, method, context)
        if exc is None:
            assert principal is not None
            return principal
        self._auth.log_refusal(self._auth.what, method, str(context.peer()), exc)
        code, details, trailing = _refusal(exc)
        if self._audit is not None:
            self._audit.refused(method, principal, context, exc, code.name)
        context.set_trailing_metadata(trailing)
        context.abort(code, details)
        raise exc  # abort raises; not reached

    def _audited_unary(self, behavior: Any, method: str) -> Any:
        audit, operator = self._audit, _operator_only(method)
        assert audit is not None

        def handle(request: Any, context: Any) -> Any:
            principal = self._principal(method, context)
            call = audit.call(method, principal, context, request, operator=operator,
                              aio=False)
            with serving_as(principal):
                try:
                    result = behavior(request, context)
                except BaseException as exc:
                    call.failed(exc)
                    raise
            call.succeeded()
            return result

        return handle

    def _audited_stream(self, behavior: Any, method: str) -> Any:
        audit, operator = self._audit, _operator_only(method)
        assert audit is not None

        def handle(request: Any, context: Any) -> Iterator[Any]:
            principal = self._principal(method, context)
            call = audit.call(method, principal, context, None, operator=operator, aio=False)
            try:  # _stream's steps, inside the audit's try
                with serving_as(principal):
                    result = iter(behavior(request, context))
                while True:
                    with serving_as(principal):
                        try:
                            item = next(result)
                        except StopIteration:
                            break
                    yield item
            except BaseException as exc:
                call.failed(exc)
                raise
            call.succeeded()

        return handle

    def _unary(self, behavior: Any, method: str) -> Any:
        def handle(request: Any, context: Any) -> Any:
            with serving_as(self._principal(method, context)):
                return behavior(request, context)

        return handle

    def _stream(self, behavior: Any, method: str) -> Any:
        def handle(request: Any, context: Any) -> Iterator[Any]:
            principal = self._principal(method, context)
            with serving_as(principal):
                result = iter(behavior(request, context))
            while True:
                with serving_as(principal):
                    try:
                        item = next(result)
                    except StopIteration:
                        return
                yield item

        return handle

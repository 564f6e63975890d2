"""etcd over TLS, with client certificates and etcd's users: :class:`SecureEtcdClient`.

``aetcd`` 1.0 opens insecure channels only, and authenticates once at connect: its token is
never renewed, so a client lives only as long as its first token (etcd drops a simple token
after ``--auth-token-ttl`` seconds unused, and refuses every token issued before any change to
users or roles with "revision of auth store is old"). :class:`SecureEtcdClient` is an
``aetcd.Client`` whose :meth:`~SecureEtcdClient.connect` opens the channel itself (TLS with the
CA and the client certificate of an :class:`~kvstore.security.etcd.EtcdSecurity`) with two gRPC
interceptors, and leaves aetcd's own ``metadata`` empty:

* :class:`_TokenInterceptor` (when a user is configured) sends the current token as the
  ``token`` metadata on every call, unary and streaming, and when etcd refuses a unary call's
  token as invalid or stale it authenticates again (one ``Authenticate`` however many calls
  failed at once) and repeats the call once. etcd refuses a stale token before it applies
  anything, so the repeat is safe for writes and transactions. A streaming call that fails
  that way marks the token stale: the caller's retry (a registration's next keepalive, a
  watch's re-list) authenticates again.
* :class:`_WatchCheckInterceptor`: etcd refuses a watch it does not permit by answering the
  create request with ``created`` and ``canceled`` set; aetcd takes that for a live watch that
  never sees an event. This one turns it into an error on the stream (aetcd then fails the
  ``watch`` call and every watch on that stream, and :class:`~kvstore.membership.etcd.PrefixWatch`
  re-lists), and marks the token stale in case that was the reason.

Errors (:func:`explain_etcd_error`) say what to fix: a server certificate that does not verify
against the CA, a client certificate that is expired (checked before connecting) or refused by
etcd (revoked, untrusted), no user where etcd requires one, a wrong user name or password, a
user without the role for an operation (etcd's PERMISSION_DENIED).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import aetcd
import grpc
import grpc.aio
from aetcd import rpc, watcher

from kvstore.errors import ConfigError, MembershipError
from kvstore.security.etcd import EtcdSecurity

log = logging.getLogger(__name__)

_AUTHENTICATE = "/etcdserverpb.Auth/Authenticate"
_WATCH = "/etcdserverpb.Watch/Watch"

# What etcd says (etcdserver/api/v3rpc/rpctypes) when a token must be renewed.
_STALE_TOKEN_MARKERS = ("invalid auth token", "revision of auth store is old")
_NO_USER_MARKER = "user name is empty"
_AUTH_FAILED_MARKER = "authentication failed"
# What gRPC reports when a TLS server ends the session over the client's certificate (a
# TLS 1.3 client learns of it only at its first read: "Unwrap failed").
_TLS_SPOKEN_MARKERS = ("andshake", "ALERT", "TSI_DATA_CORRUPTED", "Unwrap failed")


def _method_name(details: grpc.aio.ClientCallDetails) -> str:
    method = details.method
    return method.decode() if isinstance(method, bytes) else str(method)


def _token_is_stale(exc: grpc.aio.AioRpcError) -> bool:
    text = exc.details() or ""
    return any(marker in text for marker in _STALE_TOKEN_MARKERS) or (
        exc.code() is grpc.StatusCode.INVALID_ARGUMENT and _NO_USER_MARKER in text)


def _rpc_error_in(exc: BaseException) -> grpc.aio.AioRpcError | None:
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, grpc.aio.AioRpcError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def explain_etcd_error(exc: BaseException, security: EtcdSecurity | None = None) -> str | None:
    """What to fix, for an etcd failure caused by security (None for any other failure).
    ``security`` names the files and user in the message when given."""
    rpc_error = _rpc_error_in(exc)
    if rpc_error is None:
        return None
    code, text = rpc_error.code(), rpc_error.details() or ""
    sec = security or EtcdSecurity()
    who = f"etcd user {sec.username!r}" if sec.username else "this client's etcd user"
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return (f"etcd refused it: permission denied (the roles of {who}, the --etcd-user "
                "or else the client certificate's common name, do not grant this on the key; "
                "docs/security.md lists the kvtier-member and kvtier-engine roles)")
    if _NO_USER_MARKER in text:
        return ("etcd has authentication enabled and this client presented no user: give "
                "--etcd-user and --etcd-password-file (KVTIER_ETCD_USER, "
                "KVTIER_ETCD_PASSWORD_FILE), or a client certificate whose common name is an "
                "etcd user (etcd --client-cert-auth)")
    if _AUTH_FAILED_MARKER in text:
        return (f"etcd refused the password of {who}: wrong user name or password"
                + (f" (password file {sec.password_file})" if sec.password_file else ""))
    if code is grpc.StatusCode.UNAVAILABLE:
        if "CERTIFICATE_VERIFY_FAILED" in text:
            where = f"the CA bundle {sec.ca_file}" if sec.ca_file else "the system's CAs"
            return ("etcd's server certificate does not verify against "
                    f"{where} (--etcd-ca): wrong CA, or the dialed name is not in the "
                    "certificate (--etcd-server-name)")
        if "WRONG_VERSION_NUMBER" in text:
            return "etcd does not speak TLS on that port: drop --etcd-ca or check the endpoint"
        spoke_tls = any(marker in text for marker in _TLS_SPOKEN_MARKERS)
        closed = "Socket closed" in text or "Connection reset" in text
        if spoke_tls or (closed and sec.tls):
            cert = (f"the client certificate {sec.cert_file}" if sec.cert_file
                    else "this client's certificate")
            return ("etcd closed the TLS connection: it refused "
                    f"{cert} (revoked, expired, or not signed by a CA in etcd's "
                    "--trusted-ca-file) or requires one (--etcd-cert, --etcd-key) "
                    f"[{text}]")
        if closed:
            return ("etcd closed the connection: if it serves TLS, give its CA (--etcd-ca) and "
                    "an https:// endpoint; if it requires client certificates, --etcd-cert "
                    f"and --etcd-key [{text}]")
    return None


def _check_certificate_dates(cert_file: Any) -> None:
    """Refuse, before connecting, a client certificate that is expired or not yet valid (etcd
    would close the connection with no reason a client can show)."""
    from cryptography import x509

    try:
        certs = x509.load_pem_x509_certificates(cert_file.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the etcd client certificate {cert_file} cannot be read as PEM: "
                          f"{exc}") from exc
    now = datetime.datetime.now(datetime.UTC)
    leaf = certs[0]
    if leaf.not_valid_after_utc <= now:
        raise MembershipError(
            f"the etcd client certificate {cert_file} expired at "
            f"{leaf.not_valid_after_utc:%Y-%m-%d %H:%M:%S} UTC: etcd would refuse it")
    if leaf.not_valid_before_utc > now:
        raise MembershipError(
            f"the etcd client certificate {cert_file} is not valid before "
            f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M:%S} UTC: etcd would refuse it")


def _read_pem(path: Any, what: str) -> bytes:
    try:
        data: bytes = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the etcd {what} {path}: {exc.strerror or exc}") from exc
    if b"-----BEGIN" not in data:
        raise ConfigError(f"the etcd {what} {path} is not PEM")
    return data


def channel_credentials(security: EtcdSecurity) -> grpc.ChannelCredentials:
    """TLS credentials from ``security``'s files, read now (system roots without a CA).
    Raises ConfigError for a missing or unreadable file, MembershipError for an expired
    client certificate."""
    roots = _read_pem(security.ca_file, "CA bundle") if security.ca_file else None
    key = chain = None
    if security.cert_file is not None and security.key_file is not None:
        chain = _read_pem(security.cert_file, "client certificate")
        key = _read_pem(security.key_file, "client key")
        _check_certificate_dates(security.cert_file)
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=key,
                                        certificate_chain=chain)


class _Token:
    """One etcd user's current token, renewed by at most one ``Authenticate`` at a time."""

    def __init__(self, security: EtcdSecurity, timeout_s: float | None) -> None:
        assert security.username is not None
        self._security = security
        self._username = security.username
        self._timeout_s = timeout_s
        self._value: str | None = None
        self._lock = asyncio.Lock()
        self._stub: Any = None

    def bind(self, channel: grpc.aio.Channel) -> None:
        self._stub = rpc.AuthStub(channel)
        self._value = None

    @property
    def value(self) -> str | None:
        return self._value

    def mark_stale(self, token: str | None) -> None:
        if token is not None and self._value == token:
            self._value = None

    async def current(self) -> str:
        if self._value is not None:
            return self._value
        return await self.renew(None)

    async def renew(self, stale: str | None) -> str:
        """A new token unless someone renewed it since ``stale`` was read. Raises
        MembershipError when etcd refuses the credentials."""
        async with self._lock:
            if self._value is not None and self._value != stale:
                return self._value
            password = self._security.read_password()
            try:
                reply = await self._stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=password),
                    timeout=self._timeout_s)
            except grpc.aio.AioRpcError as exc:
                hint = explain_etcd_error(exc, self._security)
                raise MembershipError(
                    f"authenticate to etcd as {self._username!r}: "
                    f"{hint or f'{exc.code().name}: {exc.details()}'}") from exc
            self._value = str(reply.token)
            log.debug("authenticated to etcd as %r", self._username)
            return self._value


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata()
    for key, value in details.metadata or ():
        if key != "token":
            metadata.add(key, value)
    metadata.add("token", token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


async def _checked_stream(call: Any, on_token_error: Callable[[], None]) -> AsyncIterator[Any]:
    try:
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as exc:
        if _token_is_stale(exc):
            on_token_error()
        raise


class _TokenInterceptor(grpc.aio.UnaryUnaryClientInterceptor,  # type: ignore[misc]
                        grpc.aio.UnaryStreamClientInterceptor,  # type: ignore[misc]
                        grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """The module docstring's token interceptor."""

    def __init__(self, token: _Token) -> None:
        self._token = token

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any,
                                    request: Any) -> Any:
        if _method_name(client_call_details) == _AUTHENTICATE:
            return await continuation(client_call_details, request)
        token = await self._token.current()
        try:
            return await (await continuation(_with_token(client_call_details, token), request))
        except grpc.aio.AioRpcError as exc:
            if not _token_is_stale(exc):
                raise
            log.info("etcd refused the token (%s); authenticating again", exc.details())
        token = await self._token.renew(token)
        return await (await continuation(_with_token(client_call_details, token), request))

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any,
                                     request: Any) -> Any:
        token = await self._token.current()
        call = await continuation(_with_token(client_call_details, token), request)
        return _checked_stream(call, lambda: self._token.mark_stale(token))

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        token = await self._token.current()
        call = await continuation(_with_token(client_call_details, token), request_iterator)
        return _checked_stream(call, lambda: self._token.mark_stale(token))


class _WatchCheckInterceptor(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]
    """The module docstring's watch check: a watch etcd cancels at creation is an error."""

    def __init__(self, token: _Token | None) -> None:
        self._token = token

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        call = await continuation(client_call_details, request_iterator)
        if _method_name(client_call_details) != _WATCH:
            return call
        return self._check(call)

    async def _check(self, call: Any) -> AsyncIterator[Any]:
        async for response in call:
            if response.created and response.canceled:
                if self._token is not None:
                    self._token.mark_stale(self._token.value)
                reason = response.cancel_reason or "no reason given"
                raise aetcd.ClientError(f"etcd refused the watch: {reason}")
            yield response


class _Watcher(watcher.Watcher):  # type: ignore[misc]
    """aetcd's watcher, without a race that strands the next watch after a stream error.

    When its stream fails, aetcd's handler task wakes the waiting ``watch`` call and only
    later forgets itself (``_request_handler = None``); a ``watch`` made in between finds the
    dying handler, starts no stream, and waits forever for its create request to be read.
    Here the handler forgets itself first, before anyone is woken.
    """

    async def _terminate_stream(self, error: BaseException | None) -> None:
        state: Any = self  # aetcd is untyped
        if state._request_handler is None or state._request_handler is not asyncio.current_task():
            await super()._terminate_stream(error)  # shut down from outside: the original
            return
        state._request_handler = None
        async with state._lock:
            if state._new_callback is not None:
                state._new_callback.error = error
                state._new_callback_ready.notify_all()
            callbacks: dict[int, Any] = state._callbacks
            state._callbacks = {}
            await state._request_queue.put(None)  # ends this stream's request iterator
            state._request_queue = asyncio.Queue(maxsize=10)
        for callback in callbacks.values():
            await self._process_callback(callback, error)


class SecureEtcdClient(aetcd.Client):  # type: ignore[misc]
    """An ``aetcd.Client`` over TLS and/or with an etcd user (module docstring). Build it with
    :func:`kvstore.membership.etcd.etcd_client`; it connects lazily, like its base."""

    def __init__(self, *, host: str, port: int, security: EtcdSecurity, use_tls: bool,
                 timeout: float, options: dict[str, Any]) -> None:
        # The base class would authenticate once itself: it gets no user or password.
        super().__init__(host=host, port=port, timeout=timeout, options=options)
        self.security = security
        self._use_tls = use_tls
        self._token = _Token(security, timeout) if security.username else None
        if use_tls:
            channel_credentials(security)  # a missing or unreadable file fails here, at once

    async def connect(self) -> None:
        """Open the channel (TLS when configured), authenticate when a user is configured,
        and set up aetcd's stubs and watcher. Raises MembershipError or ConfigError."""
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        self._is_connecting: bool = True
        try:
            interceptors: list[grpc.aio.ClientInterceptor] = []
            if self._token is not None:
                interceptors.append(_TokenInterceptor(self._token))
            if self._use_tls or not self.security.empty:  # only then can etcd refuse a watch
                interceptors.append(_WatchCheckInterceptor(self._token))
            target = f"{self._host}:{self._port}"
            options = list(self._options.items())
            if self.security.server_name:
                options.append(("grpc.ssl_target_name_override", self.security.server_name))
            if self._use_tls:
                channel = grpc.aio.secure_channel(target, channel_credentials(self.security),
                                                  options=options, interceptors=interceptors)
            else:
                if self.security.username and self._host not in ("127.0.0.1", "localhost",
                                                                   "::1"):
                    log.warning("etcd at %s: sending the password of %r without TLS "
                                "(give --etcd-ca)", target, self.security.username)
                channel = grpc.aio.insecure_channel(target, options=options,
                                                    interceptors=interceptors)
            self.channel = channel
            try:
                if self._token is not None:
                    self._token.bind(channel)
                    await self._token.current()  # wrong credentials fail here, clearly
            except BaseException:
                await channel.close()
                self.channel = None
                raise
            self.metadata = None  # the token interceptor sends the token, always the current one
            self.kvstub = rpc.KVStub(channel)
            self.clusterstub = rpc.ClusterStub(channel)
            self.leasestub = rpc.LeaseStub(channel)
            self.maintenancestub = rpc.MaintenanceStub(channel)
            self.auth_stub = rpc.AuthStub(channel)
            self._watcher = _Watcher(rpc.WatchStub(channel), timeout=self._timeout,
                                     metadata=None)
            self._connected.set()
        finally:
            self._is_connecting = False

    async def __aenter__(self) -> SecureEtcdClient:
        await self.connect()
        return self

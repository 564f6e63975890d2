"""The gRPC control half of a store daemon's client: metadata, pins, events, operations.

:class:`DaemonControl` wraps one gRPC channel to a daemon and the :class:`NodeInfo` it gave at
connect time. :class:`~kvstore.client.store_client.StoreClient` is one, plus a data plane for
the bytes. Every failed call raises a :mod:`kvstore.errors` class: the daemon names its own error
in the trailing metadata ``kvtier-error`` (``SizeMismatch`` stays ``SizeMismatch``); an
unreachable or dead daemon is ``PeerUnavailable``. Misses (``lookup``, ``sizes``, ``exists``,
``remove``) are results, not errors.

Sessions: every call on the channel carries ``kvtier-session`` metadata
(``StoreClientConfig.session``, or a random token drawn per client), and the daemon lets only
that session unpin, release, commit or abort what it took; the token survives reconnects of
the channel. ``kvtier pin`` and ``kvtier unpin`` run as separate processes, so they share the
operator's session (:func:`operator_session`).

Tenant: with ``StoreClientConfig.tenant`` set, every call also carries ``kvtier-tenant``; the
daemon checks it against the credentials and scopes what the call sees and stores to that
tenant (docs/security.md, "Tenant isolation").

Credentials (docs/security.md): the channel speaks TLS and presents a client certificate, and
every call carries ``authorization: Bearer <token>``, as ``StoreClientConfig.security`` (or the
``KVTIER_TLS_*``/``KVTIER_TOKEN_FILE`` environment) says. A refusal is ``Unauthenticated`` or
``PermissionDenied``; a TLS handshake that fails is ``PeerUnavailable`` or ``Unauthenticated``
with the likely cause in its message.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc
from kvstore.client.store_config import LookupResult, StoreClientConfig
from kvstore.dataplane.tier import TierKind, check_key
from kvstore.errors import KvtierError, PeerUnavailable, TransportError, Unauthenticated
from kvstore.security.client import TokenSource, sync_channel, token_source
from kvstore.security.config import ClientSecurity
from kvstore.security.tls import handshake_hint
from kvstore.wire import (
    ERROR_METADATA_KEY,
    PB_TO_TIER,
    SESSION_METADATA_KEY,
    TENANT_METADATA_KEY,
    TIER_TO_PB,
    error_from_name,
)

GRPC_MAX_MESSAGE_BYTES = 64 << 20


def translate_rpc_error(exc: grpc.RpcError, what: str,
                        security: ClientSecurity | None = None) -> KvtierError:
    """The kvtier error a failed call stands for (the daemon names it in trailing metadata).
    On a TLS channel (``security``) a connection failure says what the handshake likely
    refused."""
    call: Any = exc
    name = None
    with contextlib.suppress(AttributeError, TypeError):
        for key, value in call.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                name = value
    details = call.details() if hasattr(call, "details") else str(exc)
    if name:
        return error_from_name(name, details)
    code = call.code() if hasattr(call, "code") else None
    hint = handshake_hint(details or "", security) \
        if security is not None and code is grpc.StatusCode.UNAVAILABLE else None
    if hint is not None:
        if "CERTIFICATE_VERIFY_FAILED" in (details or ""):
            return Unauthenticated(f"{what}: {hint}")
        return PeerUnavailable(f"{what}: {hint}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED):
        return PeerUnavailable(f"{what}: {code.name}: {details}")
    return TransportError(f"{what}: {getattr(code, 'name', code)}: {details}")


def new_session() -> str:
    """A fresh session token (32 URL-safe characters, 192 random bits)."""
    return secrets.token_urlsafe(24)


def operator_session() -> str:
    """The session of this user's admin commands: ``KVTIER_SESSION`` when set, else a token
    kept in ``$XDG_RUNTIME_DIR/kvtier-session`` (or ``~/.cache/kvtier/session``), created
    with mode 0600 on first use, so ``kvtier unpin`` can end what ``kvtier pin`` took and
    other users cannot. A fresh token (pins then only expire) when no such file can be made."""
    from_env = os.environ.get("KVTIER_SESSION", "")
    if from_env:
        return from_env
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    path = Path(runtime) / "kvtier-session" if runtime else \
        Path.home() / ".cache" / "kvtier" / "session"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    except OSError:
        return new_session()
    token = new_session()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another command made it meanwhile
        return path.read_text().strip()
    except OSError:
        return token
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


_CallDetails = collections.namedtuple(
    "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                     "compression"))


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):  # type: ignore[misc]
    pass


class _SessionInterceptor(grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
                          grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
                          grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
                          grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
    """Adds ``kvtier-session`` (and ``kvtier-tenant`` and the bearer token, when there are
    ones) to the metadata of every call."""

    def __init__(self, session: str, token: TokenSource | None = None,
                 tenant: str | None = None) -> None:
        self._metadata = ((SESSION_METADATA_KEY, session),) if tenant is None else \
            ((SESSION_METADATA_KEY, session), (TENANT_METADATA_KEY, tenant))
        self._token = token

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), *self._metadata]
        if self._token is not None:
            metadata.append(self._token.metadata())
        return _ClientCallDetails(details.method, details.timeout, metadata,
                                  details.credentials, details.wait_for_ready,
                                  details.compression)

    def _pass(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    intercept_unary_unary = intercept_unary_stream = _pass
    intercept_stream_unary = intercept_stream_stream = _pass


def open_channel(address: str, config: StoreClientConfig) -> tuple[grpc.Channel, pb.NodeInfo]:
    """A gRPC channel to ``host:port`` whose calls carry the client's session
    (``config.session`` or a fresh one), tenant (``config.tenant``, when set) and credentials
    (``config.client_security()``), and
    the daemon's info. Raises PeerUnavailable (no daemon there), Unauthenticated or
    PermissionDenied (refused), ConfigError (credentials that do not load, a client
    certificate that expired); the channel is closed on failure."""
    security = config.client_security()
    token = token_source(security)
    raw = sync_channel(address, security, options=[
        ("grpc.max_receive_message_length", GRPC_MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", GRPC_MAX_MESSAGE_BYTES)])
    channel = grpc.intercept_channel(raw, _SessionInterceptor(config.session or new_session(),
                                                              token, config.tenant))
    try:
        stub = pb_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
        info = stub.Info(pb.InfoRequest(), timeout=config.rpc_timeout_s,
                         wait_for_ready=config.wait_for_ready)
    except grpc.RpcError as exc:
        channel.close()
        raise translate_rpc_error(exc, f"Info from {address}", security) from exc
    except BaseException:
        channel.close()
        raise
    return channel, info


class DaemonControl:
    """The gRPC calls of one daemon (module docstring). Thread-safe."""

    def __init__(self, address: str, info: pb.NodeInfo, channel: grpc.Channel,
                 config: StoreClientConfig) -> None:
        """Wrap an open channel (:func:`open_channel`); the object owns it from now on."""
        self._address = address
        self._info = info
        self._channel = channel
        self._stub = pb_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
        self._config = config
        self._security = config.client_security()

    # --- identity ---------------------------------------------------------------------------

    @property
    def info(self) -> pb.NodeInfo:
        """What the daemon said about itself at connect time."""
        return self._info

    @property
    def address(self) -> str:
        return self._address

    def refresh_info(self) -> pb.NodeInfo:
        self._info = self.call("Info", pb.InfoRequest())
        return self._info

    def daemon_alive(self) -> bool:
        """The control plane's view of the daemon: its gRPC health (asked during UCX waits)."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        timeout_s = max(0.2, self._config.ucx_liveness_interval_s)
        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    # --- metadata ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """The longest cached prefix of ``keys`` and the tier of each block (not a hit)."""
        reply = self.call("Lookup", pb.LookupRequest(keys=[check_key(k) for k in keys]))
        return LookupResult(reply.length, tuple(PB_TO_TIER[t] for t in reply.tiers))

    def lookup_many(self, key_lists: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        """:meth:`lookup` of several key lists in one round trip (``BatchLookup``), in order."""
        if not key_lists:
            return []
        reply = self.call("BatchLookup", pb.BatchLookupRequest(
            items=[pb.LookupRequest(keys=[check_key(k) for k in keys]) for keys in key_lists]))
        return [LookupResult(item.length, tuple(PB_TO_TIER[t] for t in item.tiers))
                for item in reply.items]

    def sizes(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each chunk's size, or None when the daemon does not hold it."""
        reply = self.call("Exists", pb.ExistsRequest(keys=[check_key(k) for k in keys]))
        return [None if s < 0 else int(s) for s in reply.size_bytes]

    def exists(self, key: bytes) -> bool:
        return self.sizes([key])[0] is not None

    def remove(self, key: bytes) -> list[bytes]:
        """Drop a chunk and everything cached under it; return the dropped keys (empty: it was
        not held). Raises ChunkBusy while any of them is pinned."""
        reply = self.call("Remove", pb.RemoveRequest(key=check_key(key)))
        return list(reply.removed)

    def pin(self, keys: Sequence[bytes], ttl_s: float = 0.0) -> int:
        """Pin chunks (all or nothing) for ``ttl_s`` (0: the daemon's default); return the
        lease id for :meth:`unpin`."""
        reply = self.call("Pin", pb.PinRequest(keys=[check_key(k) for k in keys], ttl_s=ttl_s))
        return int(reply.lease_id)

    def unpin(self, lease_id: int) -> bool:
        return bool(self.call("Unpin", pb.UnpinRequest(lease_id=lease_id)).released)

    def inspect(self, key: bytes) -> pb.ChunkEntry:
        """Everything the daemon knows about one chunk. Raises ChunkNotFound."""
        entry: pb.ChunkEntry = self.call("Inspect", pb.InspectRequest(key=check_key(key)))
        return entry

    def list_chunks(self, key_prefix: bytes = b"", tier: TierKind | None = None,
                    limit: int = 0) -> pb.ListResponse:
        reply: pb.ListResponse = self.call("List", pb.ListRequest(
            key_prefix=key_prefix, tier=TIER_TO_PB[tier] if tier else pb.TIER_UNSPECIFIED,
            limit=limit))
        return reply

    def stats(self) -> pb.StatsResponse:
        """Per-tier figures of the daemon."""
        reply: pb.StatsResponse = self.call("Stats", pb.StatsRequest())
        return reply

    def evict(self, *, tier: TierKind | None = None, bytes_: int = 0,
              key_prefix: bytes = b"") -> pb.EvictResponse:
        """Free ``bytes_`` in ``tier`` (demoting), or remove chunks whose key starts with
        ``key_prefix`` (optionally only in ``tier``)."""
        reply: pb.EvictResponse = self.call("Evict", pb.EvictRequest(
            tier=TIER_TO_PB[tier] if tier else pb.TIER_UNSPECIFIED, bytes=bytes_,
            key_prefix=key_prefix))
        return reply

    def drain(self) -> bool:
        """Ask the daemon to stop gracefully; False when it was already draining."""
        return bool(self.call("Drain", pb.DrainRequest()).accepted)

    def subscribe(self, from_seq: int = 0, epoch: str = "",
                  timeout_s: float | None = None) -> Iterator[pb.ChunkEvent]:
        """Chunk events after ``from_seq`` of ``epoch`` (see :mod:`kvstore.node.events`); an
        EVENT_RESYNC event ends the stream when they are gone. Stops after ``timeout_s``."""
        stream = self._stub.Subscribe(pb.SubscribeRequest(from_seq=from_seq, epoch=epoch),
                                      timeout=timeout_s)
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                return
            raise translate_rpc_error(exc, "Subscribe", self._security) from exc
        finally:
            stream.cancel()

    def snapshot(self) -> tuple[str, int, list[pb.ChunkEntry]]:
        """(epoch, seq, every chunk): continue a subscription from ``seq``."""
        epoch, seq, entries = "", 0, []
        try:
            for page in self._stub.Snapshot(pb.SnapshotRequest(),
                                            timeout=self._config.rpc_timeout_s):
                epoch, seq = page.epoch, page.seq
                entries.extend(page.entries)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, "Snapshot", self._security) from exc
        return epoch, seq, entries

    def call(self, method: str, request: Any) -> Any:
        """One unary call by name, its error translated (:func:`translate_rpc_error`)."""
        try:
            return getattr(self._stub, method)(request, timeout=self._config.rpc_timeout_s)
        except grpc.RpcError as exc:
            raise translate_rpc_error(exc, method, self._security) from exc

    def stub(self) -> pb_grpc.StoreStub:
        """The raw gRPC stub (for calls this class does not wrap)."""
        return self._stub

    def close(self) -> None:
        """Close the gRPC channel. Idempotent."""
        self._channel.close()

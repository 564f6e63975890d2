"""The UCX data-plane transport (``ucxx``): tag messages between workers, straight into leases.

Contracts: :mod:`.base` (the same :class:`~.base.LeaseBackend` semantics and
:class:`~.base.Transport` calls as TCP). Design notes and measured figures: ``docs/transport.md``.

Optional dependency
    ``ucxx`` (PyPI ``ucxx-cu12``, the ``ucx`` extra) is imported lazily by :func:`ucx_unavailable`
    and the first :class:`UcxServer.start` / client call, never on import of this module. Where it
    is missing, :func:`ucx_unavailable` says why and callers use TCP.

Endpoints from worker addresses, error handling off
    The server publishes its UCX *worker address* (an opaque ~200-byte blob) through the control
    plane (the daemon's gRPC ``Info`` and its etcd record). A client creates its endpoint from
    it, and sends its own worker address in a HELLO so the server can answer. Such endpoints,
    with ``endpoint_error_handling=False``, let UCX pick shared memory / CMA between processes of
    one host (measured 6-14 GB/s for 1-64 MiB here, against ~1 GB/s for listener endpoints, which
    only use ``tcp``) and RDMA where the hardware has it. The price: UCX never reports a dead
    peer. So **every wait is bounded** (``io_timeout_s``) and a client may be given a
    ``liveness`` callable (the control plane: gRPC health of the daemon) polled every
    ``liveness_interval_s`` while it waits; either failing raises ``PeerUnavailable``. After a
    failure the endpoint is closed, which cancels the requests still posted on it, so no
    transfer touches the caller's buffer once the call has returned.

Messages (tags are 64 bits: ``kind << 60 | client_id << 28 | seq``)
    ``REQUEST`` (client -> server; the server keeps ``request_slots`` receives posted for any
    client): a 24-byte header ``KVUX, op, flags, key_len, client_id, seq, size`` then the key,
    then for HELLO the client's worker address and for a small PUT the value inline.
    ``RESPONSE`` / ``DONE`` (server -> client): ``KVUX, status, flags, detail_len, seq, size``
    then a UTF-8 detail for errors. ``TO_SERVER`` / ``TO_CLIENT``: a value's bytes.

    * GET of at most ``INLINE_GET_BYTES`` (64 KiB): REQUEST(size, INLINE) -> RESPONSE(OK, size,
      INLINE) with the value behind the header, copied out of the backend (``read_into``, no
      lease); the client copies it into ``dst``. Two messages instead of three.
    * Larger GET: REQUEST(size of ``dst``) -> the server leases the chunk and answers
      RESPONSE(OK, size)
      then sends the bytes from the lease view; the client posts its receive straight into
      ``dst`` (rendezvous: UCX moves the bytes only once the receive is posted, so there is no
      intermediate copy above 8 KiB). The server releases the read lease when the send
      completes, or after ``io_timeout_s`` (then it drops that client's endpoint first).
      A size mismatch is answered before any byte moves.
    * PUT of at most ``inline_put_bytes``: one message, header + value; the server copies it
      into a write lease and commits. Larger: REQUEST(size) -> the server opens the write lease,
      posts a receive into its buffer and answers READY -> the client sends the bytes -> the
      server commits and answers DONE. A value is visible only after every byte arrived; a
      transfer that fails or does not finish within ``io_timeout_s`` aborts the lease.
    * SIZE (``exists`` / ``size_of``), REMOVE: one round trip. BYE on close (no answer).
    * HELLO's answer carries the server's ``client_idle_ttl_s`` (ms, in ``size``): the server
      closes the endpoint of a client silent that long (a dead client would otherwise keep
      its endpoint forever: UCX cannot tell), and a client lane idle for half of it says HELLO
      again before its next request.

Session tickets (``authorize``, optional; :mod:`.auth`, the same hook and checks as TCP's)
    With an authorizer, a lane's HELLO carries a session ticket in its key field (``key_len``
    up to ``MAX_TICKET_BYTES``; a client without one sends none). The server verifies it
    (:meth:`~kvstore.security.tickets.TicketAuthority.authorize`: MAC first in constant time,
    audience, expiry) before it makes the lane an endpoint of its own: a refused ticket (none,
    forged, stale, another daemon's, expired) is answered UNAUTHENTICATED naming the reason on
    an endpoint made for that answer alone (as CAPACITY is), counted in
    ``connections_unauthenticated``, and the lane is not known, so none of its requests is
    served. A request from a lane that never had a HELLO accepted is counted and dropped
    unanswered: a tag message names no sender, so without the HELLO's worker address there is
    no endpoint to answer on (the client times out). A verified grant binds the lane: with a
    tenant scope it is served through ``backend.scoped(scope)`` (reads see that tenant's chunks,
    puts are stored as it; a backend without ``scoped`` refuses the lane, PERMISSION_DENIED);
    once the grant expires the lane's next request is answered UNAUTHENTICATED until a HELLO
    renews it, whose ticket must carry the same scope (another: PERMISSION_DENIED and the lane
    forgotten). A client with a :class:`~.auth.TicketSource` presents ``current()`` in every
    HELLO and says HELLO again once the ticket is due for renewal (``auth.renew_at``); a
    refused HELLO is reported (``refused``) and retried once with a fresh ticket. The binding
    is the lane's 32-bit random ``client_id`` in the tag: UCX tag messages are not
    authenticated per sender, so a peer that guesses a live lane's id could send requests as it
    (it never sees the answers); keep the UCX plane on a trusted network, as for TCP without
    TLS. Without an authorizer every HELLO is accepted and its ticket ignored.

Endpoints, counted and bounded
    The server holds one endpoint per client lane that said HELLO (``UcxServerStats.
    endpoints_open``, the daemon's ``Stats.ucx_endpoints_open``), at most ``max_connections``
    (the daemon's ``server.max_connections``, as for TCP). A HELLO past the bound is answered
    CAPACITY naming the limit (the client raises CapacityError) on an endpoint made for that
    answer alone and closed once it has left (or after ``io_timeout_s``); at most
    ``_MAX_REFUSING`` such answers are in flight, HELLOs past those get none (the client times
    out). An endpoint ends with the client's BYE, with a transfer of its client that does not
    finish within ``io_timeout_s`` (a client killed mid-transfer), or after
    ``client_idle_ttl_s`` of silence (a client killed between requests); none outlives those.

Threads
    The server runs one thread that owns its UCX worker (UCX workers are single-threaded here):
    it waits in ``progress_worker_event`` (epoll; the GIL is released) and drives every
    transfer as a small state machine; backend calls (lease open/commit/release) run on it too.
    A client owns up to ``lanes`` (worker, endpoint) pairs and uses one per call, progressing it
    on the calling thread while the call waits; calls from several threads run in parallel up
    to ``lanes``.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

from kvstore.dataplane.arena import host_byte_view
from kvstore.dataplane.tier import MAX_KEY_BYTES, Buffer, check_key
from kvstore.dataplane.transport.auth import (
    MAX_TICKET_BYTES,
    SessionAuthorizer,
    SessionGrant,
    TicketSource,
    renew_at,
    renewed_grant,
    scoped_backend,
)
from kvstore.dataplane.transport.base import (
    Endpoint,
    LeaseBackend,
    ReadLease,
    TransportKind,
    WriteLease,
)
from kvstore.dataplane.transport.frames import (
    DEFAULT_MAX_VALUE_BYTES,
    Header,
    Opcode,
    Status,
    error_for_status,
    status_for_error,
)
from kvstore.errors import (
    InvalidArgument,
    KvtierError,
    PeerUnavailable,
    PermissionDenied,
    ProtocolError,
    TransportError,
    Unauthenticated,
)

log = logging.getLogger(__name__)

KiB = 1 << 10
MAGIC = b"KVUX"
REQ = struct.Struct("<4sBBHIIQ")
"""magic, op, flags, key_len, client_id, seq, size."""
RESP = struct.Struct("<4sBBHIQ")
"""magic, status, flags, detail_len, seq, size."""
DEFAULT_INLINE_PUT_BYTES = 64 * KiB
_MAX_WORKER_ADDRESS_BYTES = 8 * KiB
_MAX_DETAIL_BYTES = 1 * KiB
INLINE_GET_BYTES = 64 * KiB
"""A GET of at most this many bytes is answered with one message: the RESPONSE carries the
value (copied out of the backend with ``read_into``), instead of a RESPONSE and then the bytes
from a read lease. Part of the protocol: the client's response buffer holds this much."""
_RESP_BUFFER_BYTES = RESP.size + max(_MAX_DETAIL_BYTES, INLINE_GET_BYTES)
_KEY_FIELD_BYTES = max(MAX_KEY_BYTES, MAX_TICKET_BYTES)
"""The longest "key" a request carries: a key, or a HELLO's session ticket."""
_SEQ_MASK = (1 << 28) - 1
_KIND_SHIFT = 60
_KIND_MASK = 0xF << _KIND_SHIFT
_FLAG_READY = 1
"""RESPONSE to a large PUT: the server posted its receive; send the bytes."""
_FLAG_ANY_SIZE = 2
"""GET of a value whose size the client does not know (``get``)."""
_FLAG_REMOVED = 4
_FLAG_INLINE = 8
"""GET request: the client takes the value inside the RESPONSE (``INLINE_GET_BYTES``);
RESPONSE: the value follows the header."""
_NO_SIZE = (1 << 64) - 1
_MAX_REFUSING = 64
"""Refusals (HELLO past ``max_connections``) in flight at once; each holds an endpoint."""


class Op(enum.IntEnum):
    HELLO = 1
    PUT = 2
    GET = 3
    SIZE = 4
    REMOVE = 5
    BYE = 6


class Kind(enum.IntEnum):
    """The top four bits of a tag: what a message is."""

    REQUEST = 1
    TO_SERVER = 2
    RESPONSE = 3
    TO_CLIENT = 4
    DONE = 5


def _tag(kind: Kind, client_id: int, seq: int) -> int:
    return (int(kind) << _KIND_SHIFT) | (client_id << 28) | (seq & _SEQ_MASK)


# --- the optional dependency -----------------------------------------------------------------------

_ucx_module: Any = None
_ucx_import_error: str | None = None
_import_lock = threading.Lock()


def _ucx() -> Any:
    """The ``ucxx._lib.libucxx`` module (imported once). Raises TransportError when missing."""
    global _ucx_module, _ucx_import_error
    with _import_lock:
        if _ucx_module is None and _ucx_import_error is None:
            # ucxx sets UCX_MEMTYPE_CACHE, which this UCX build does not know; without this
            # every worker prints a warning about it.
            os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
            try:
                import ucxx._lib.libucxx as libucxx
                from ucxx._lib.arr import Array
            except ImportError as exc:
                _ucx_import_error = f"ucxx is not installed ({exc}); pip install 'kvtier[ucx]'"
            except Exception as exc:  # a broken install: report it, do not crash the caller
                _ucx_import_error = f"ucxx failed to import: {type(exc).__name__}: {exc}"
            else:
                libucxx.Array = Array
                _ucx_module = libucxx
        if _ucx_module is None:
            raise TransportError(_ucx_import_error or "ucxx unavailable")
        return _ucx_module


def ucx_unavailable() -> str | None:
    """None when ``ucxx`` imports here; otherwise the reason (for skips, logs and fallbacks)."""
    try:
        _ucx()
    except TransportError as exc:
        return str(exc)
    return None


LOOPBACK_NET_DEVICES = "lo"
"""UCX's ``NET_DEVICES`` for a worker that must stay on this host: only the loopback network
device. Shared memory and CMA are not network devices, so same-host transfers keep them."""


def net_devices_for(host: str) -> str | None:
    """The UCX ``NET_DEVICES`` a worker serving ``host`` uses: :data:`LOOPBACK_NET_DEVICES`
    for a loopback host (``127.0.0.0/8``, ``::1``, ``localhost``), None (UCX's default: every
    device, RDMA ones included) otherwise.

    Why: a UCX worker's ``tcp`` transport opens a listening socket on *every* network
    device's address for connection establishment, whatever address the daemon was told to
    serve on, so a daemon configured for ``server.host=127.0.0.1`` also listened on the
    host's external address (measured: ``192.0.2.2:41345`` beside ``127.0.0.1:46993``).
    Restricting the devices is the only bind UCX has."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return LOOPBACK_NET_DEVICES
    try:
        if ipaddress.ip_address(name).is_loopback:
            return LOOPBACK_NET_DEVICES
    except ValueError:
        return None  # a host name: not known to be loopback
    return None


class _Worker:
    """A UCX context + worker in blocking progress mode, used by one thread at a time.
    ``net_devices``: UCX's ``NET_DEVICES`` (None: UCX's default, every device)."""

    def __init__(self, net_devices: str | None = None) -> None:
        ucx = _ucx()
        self.ucx = ucx
        config = {"NET_DEVICES": net_devices} if net_devices else {}
        self.context = ucx.UCXContext(config_dict=config,
                                      feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context, enable_delayed_submission=False,
                                    enable_python_future=False)
        self.worker.init_blocking_progress_mode()
        self.address: bytes = self.worker.address.tobytes()

    def endpoint_to(self, worker_address: bytes) -> Any:
        ucx = self.ucx
        try:
            address = ucx.UCXAddress.create_from_buffer(worker_address)
            return ucx.UCXEndpoint.create_from_worker_address(self.worker, address, False)
        except ucx.UCXError as exc:
            raise PeerUnavailable(f"cannot create a UCX endpoint: {exc}") from exc

    def progress(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for network events and progress them (GIL released)."""
        self.worker.progress_worker_event(max(0, int(timeout_s * 1000)))

    def array(self, buf: Any) -> Any:
        return self.ucx.Array(buf)


def _ended(request: Any) -> tuple[bool, str | None]:
    """(completed, error) of a UCX request; error is None when it succeeded."""
    if not request.completed:
        return False, None
    try:
        request.check_error()
    except Exception as exc:  # ucxx raises its own UCXError family; report it as text
        return True, f"{type(exc).__name__}: {exc}"
    return True, None


# --- client ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UcxClientConfig:
    """Client tuning. ``liveness_interval_s``: how often a waiting call asks ``liveness``."""

    lanes: int = 2
    io_timeout_s: float = 30.0
    liveness_interval_s: float = 0.5
    inline_put_bytes: int = DEFAULT_INLINE_PUT_BYTES
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    net_devices: str | None = None
    """UCX ``NET_DEVICES`` of the client's workers (None: every device; ``"lo"`` keeps a
    client of a loopback daemon off the host's external addresses: :func:`net_devices_for`)."""

    def __post_init__(self) -> None:
        if self.net_devices is not None and not self.net_devices:
            raise InvalidArgument("net_devices must be None or a UCX device list, not empty")
        if not 1 <= self.lanes <= 64:
            raise InvalidArgument(f"lanes must be 1..64, got {self.lanes}")
        if self.io_timeout_s <= 0 or self.liveness_interval_s <= 0:
            raise InvalidArgument("io_timeout_s and liveness_interval_s must be > 0 seconds")
        if not 0 <= self.inline_put_bytes <= 1 << 20:
            raise InvalidArgument(f"inline_put_bytes must be 0..1 MiB, got {self.inline_put_bytes}")
        if self.max_value_bytes < 1:
            raise InvalidArgument(f"max_value_bytes must be >= 1, got {self.max_value_bytes}")


class _Lane:
    """One client worker + endpoint to the server, used by one thread at a time."""

    def __init__(self, server_address: bytes, config: UcxClientConfig,
                 liveness: Callable[[], bool] | None, ticket: TicketSource | None) -> None:
        self._config = config
        self._liveness = liveness
        self._ticket = ticket
        self.renew_at = 0.0
        """When this lane presents a new session ticket (wall clock; 0: never)."""
        self.worker = _Worker(config.net_devices)
        self.client_id = secrets.randbits(32)
        self.seq = 0
        self.broken = False
        self.ep = self.worker.endpoint_to(server_address)
        inline = config.inline_put_bytes
        self.req = bytearray(REQ.size + _KEY_FIELD_BYTES
                             + max(inline, len(self.worker.address)))
        self.resp = bytearray(_RESP_BUFFER_BYTES)
        self.req_arr_cache: dict[int, Any] = {}
        self.idle_ttl_s = 0.0
        """The server forgets a client idle this long (told in its HELLO answer; 0: never)."""
        self.last_used = time.monotonic()
        try:
            self.hello()
        except BaseException:
            self.broken = True  # never introduced (or refused): nothing to say BYE to
            self.close()
            raise

    def hello(self) -> None:
        """Introduce this lane (its worker address and, with a TicketSource, its session
        ticket) to the server; learn the server's idle TTL. Repeated before a lane idle for half
        that TTL is used again, so a server that forgot it (and closed its endpoint) knows it
        again, and before its ticket is due for renewal. A ticket the server refuses (stale
        after a restart, expired early) is reported to the source and a fresh one presented
        once; a second refusal is raised (Unauthenticated / PermissionDenied)."""
        source = self._ticket
        if source is None:
            self._hello(b"")
            return
        current = source.current()
        try:
            try:
                self._hello(current.ticket)
            except Unauthenticated:
                source.refused(current.ticket)
                current = source.current()
                self._hello(current.ticket)
        except (Unauthenticated, PermissionDenied):
            self.broken = True  # the server forgot this lane: it is not used again
            raise
        self.renew_at = renew_at(current)

    def _hello(self, ticket: bytes) -> None:
        _status, _flags, ttl_ms = self.call(Op.HELLO, ticket, len(self.worker.address),
                                            payload=memoryview(self.worker.address))
        self.idle_ttl_s = ttl_ms / 1000
        self.last_used = time.monotonic()

    # one request -> one response; the payload (HELLO address, inline PUT value) rides along
    def call(self, op: Op, key: bytes, size: int, *, flags: int = 0,
             payload: memoryview | None = None) -> tuple[int, int, int]:
        """Send a request, wait for its RESPONSE: (status, flags, size). Errors are raised."""
        self.seq = (self.seq + 1) & _SEQ_MASK
        n = REQ.size + len(key)
        REQ.pack_into(self.req, 0, MAGIC, op, flags, len(key), self.client_id, self.seq, size)
        self.req[REQ.size:n] = key
        if payload is not None:
            self.req[n:n + payload.nbytes] = payload
            n += payload.nbytes
        w = self.worker
        recv = self.ep.tag_recv(w.array(self.resp), tag=w.ucx.UCXXTag(
            _tag(Kind.RESPONSE, self.client_id, self.seq)))
        send = self.ep.tag_send(w.array(memoryview(self.req)[:n]), tag=w.ucx.UCXXTag(
            _tag(Kind.REQUEST, self.client_id, self.seq)))
        self.wait([send, recv], f"{op.name} request")
        return self._response(key, size)

    def _response(self, key: bytes, expected_size: int) -> tuple[int, int, int]:
        magic, status, flags, detail_len, seq, size = RESP.unpack_from(self.resp)
        if magic != MAGIC or seq != self.seq or detail_len > _MAX_DETAIL_BYTES:
            self.broken = True
            raise ProtocolError(f"malformed UCX response (magic {magic!r}, seq {seq} where "
                                f"{self.seq} was expected)")
        if status != Status.OK:
            detail = bytes(self.resp[RESP.size:RESP.size + detail_len]).decode("utf-8", "replace")
            try:
                st = Status(status)
            except ValueError:
                st = Status.INTERNAL
            header = Header(Opcode.GET, 0, st, 0, seq, 0, 0, 0, size, 0)
            exc = error_for_status(header, key, detail, expected_size=expected_size)
            if isinstance(exc, TransportError):
                self.broken = True
            raise exc
        return status, flags, size

    def wait(self, requests: list[Any], what: str) -> None:
        """Progress until every request completed. Bounded by ``io_timeout_s`` and the
        liveness probe; on failure the lane is broken (and closed by its owner)."""
        cfg = self._config
        now = time.monotonic()
        deadline = now + cfg.io_timeout_s
        next_probe = now + cfg.liveness_interval_s
        pending = list(requests)
        while True:
            still = []
            for r in pending:
                done, error = _ended(r)
                if not done:
                    still.append(r)
                elif error is not None:
                    self.broken = True
                    raise PeerUnavailable(f"UCX {what} failed: {error}")
            pending = still
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                self.broken = True
                raise PeerUnavailable(f"UCX {what} timed out after {cfg.io_timeout_s:g} s")
            if self._liveness is not None and now >= next_probe:
                next_probe = now + cfg.liveness_interval_s
                if not self._liveness():
                    self.broken = True
                    raise PeerUnavailable(f"UCX {what}: the control plane reports the peer dead")
            self.worker.progress(min(deadline, next_probe) - now)

    def close(self) -> None:
        """Close the endpoint: cancels whatever is still posted on it (so no buffer is touched
        afterwards). Best effort BYE first when the lane is healthy."""
        w = self.worker
        if not self.broken:
            with contextlib.suppress(Exception):
                self.seq = (self.seq + 1) & _SEQ_MASK
                REQ.pack_into(self.req, 0, MAGIC, Op.BYE, 0, 0, self.client_id, self.seq, 0)
                send = self.ep.tag_send(w.array(memoryview(self.req)[:REQ.size]),
                                        tag=w.ucx.UCXXTag(_tag(Kind.REQUEST, self.client_id,
                                                                self.seq)))
                deadline = time.monotonic() + 0.2
                while not send.completed and time.monotonic() < deadline:
                    w.progress(0.01)
        with contextlib.suppress(Exception):
            self.ep.close()
        with contextlib.suppress(Exception):
            w.progress(0)


class UcxClient:
    """A thread-safe UCX data-plane client for one :class:`UcxServer` (contract:
    ``base.Transport``). The constructor touches no network; lanes open on first use.

    ``liveness``: an optional control-plane probe (True while the peer is alive), asked every
    ``liveness_interval_s`` while a call waits, so a dead peer is reported within about that
    interval instead of ``io_timeout_s`` (UCX itself cannot tell; see the module docstring).
    A failed lane is discarded; nothing is retried behind the caller's back.
    """

    def __init__(self, worker_address: bytes, *, lanes: int = 2, io_timeout_s: float = 30.0,
                 liveness: Callable[[], bool] | None = None, liveness_interval_s: float = 0.5,
                 inline_put_bytes: int = DEFAULT_INLINE_PUT_BYTES,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
                 net_devices: str | None = None, ticket: TicketSource | None = None) -> None:
        """``net_devices``: :attr:`UcxClientConfig.net_devices`. ``ticket``: where each lane
        gets the session ticket its HELLO presents, for a server that requires one (module
        docstring, "Session tickets"; None: no ticket)."""
        if not worker_address:
            raise InvalidArgument("a UCX worker address must not be empty")
        self._server_address = bytes(worker_address)
        self._config = UcxClientConfig(lanes=lanes, io_timeout_s=io_timeout_s,
                                       liveness_interval_s=liveness_interval_s,
                                       inline_put_bytes=inline_put_bytes,
                                       max_value_bytes=max_value_bytes,
                                       net_devices=net_devices)
        self._liveness = liveness
        self._ticket = ticket
        self._lock = threading.Lock()
        self._idle: list[_Lane] = []
        self._slots = threading.BoundedSemaphore(lanes)
        self._closed = False

    @property
    def config(self) -> UcxClientConfig:
        return self._config

    # --- lanes ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lane(self) -> Any:
        self._slots.acquire()
        try:
            with self._lock:
                if self._closed:
                    raise PeerUnavailable("the UCX client is closed")
                lane = self._idle.pop() if self._idle else None
            if lane is None:
                lane = _Lane(self._server_address, self._config, self._liveness, self._ticket)
            try:
                forgotten = lane.idle_ttl_s and \
                    time.monotonic() - lane.last_used > lane.idle_ttl_s / 2
                if forgotten or (lane.renew_at and time.time() >= lane.renew_at):
                    lane.hello()  # forgotten by the server meanwhile, or the ticket is due
                yield lane
            except Unauthenticated:
                if lane.renew_at:  # its session ended early (clocks apart): renew on next use
                    lane.renew_at = 1.0
                raise
            finally:
                lane.last_used = time.monotonic()
                with self._lock:
                    keep = not lane.broken and not self._closed
                    if keep:
                        self._idle.append(lane)
                if not keep:
                    lane.close()
        finally:
            self._slots.release()

    # --- Transport --------------------------------------------------------------------------

    def put(self, key: bytes, src: Buffer) -> None:
        """Store ``src`` under ``key``, all or nothing (see the module docstring)."""
        k = check_key(key)
        view = host_byte_view(src)
        size = view.nbytes
        if size > self._config.max_value_bytes:
            raise InvalidArgument(f"value of {size} bytes exceeds max_value_bytes "
                                  f"{self._config.max_value_bytes}")
        with self._lane() as lane:
            if size <= self._config.inline_put_bytes:
                lane.call(Op.PUT, k, size, payload=view)
                return
            _status, flags, _size = lane.call(Op.PUT, k, size)
            if not flags & _FLAG_READY:
                lane.broken = True
                raise ProtocolError("the UCX server accepted a large PUT without READY")
            w = lane.worker
            tag = w.ucx.UCXXTag
            done = lane.ep.tag_recv(w.array(lane.resp),
                                    tag=tag(_tag(Kind.DONE, lane.client_id, lane.seq)))
            send = lane.ep.tag_send(w.array(view),
                                    tag=tag(_tag(Kind.TO_SERVER, lane.client_id, lane.seq)))
            lane.wait([send, done], f"PUT of {size} bytes")
            lane._response(k, size)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` (exactly the value's size) with the value; return the byte count."""
        k = check_key(key)
        out = host_byte_view(dst, writable=True)
        with self._lane() as lane:
            return self._get(lane, k, out)

    def get(self, key: bytes) -> bytearray:
        k = check_key(key)
        with self._lane() as lane:
            _status, _flags, size = lane.call(Op.GET, k, 0, flags=_FLAG_ANY_SIZE)
            if size > self._config.max_value_bytes:
                lane.broken = True
                raise ProtocolError(f"UCX server announced a {size}-byte value")
            out = bytearray(size)
            self._recv_value(lane, memoryview(out))
            return out

    def _get(self, lane: _Lane, key: bytes, out: memoryview) -> int:
        if out.nbytes <= INLINE_GET_BYTES:
            _status, flags, size = lane.call(Op.GET, key, out.nbytes, flags=_FLAG_INLINE)
            if not flags & _FLAG_INLINE or size != out.nbytes:
                lane.broken = True
                raise ProtocolError(f"UCX server answered a {out.nbytes}-byte inline GET with "
                                    f"{size} bytes (flags {flags:#x})")
            out[:] = memoryview(lane.resp)[RESP.size:RESP.size + size]
            return size
        _status, _flags, size = lane.call(Op.GET, key, out.nbytes)
        if size != out.nbytes:
            lane.broken = True
            raise ProtocolError(f"UCX server answered {size} bytes for a {out.nbytes}-byte GET")
        self._recv_value(lane, out)
        return size

    @staticmethod
    def _recv_value(lane: _Lane, out: memoryview) -> None:
        w = lane.worker
        recv = lane.ep.tag_recv(w.array(out), tag=w.ucx.UCXXTag(
            _tag(Kind.TO_CLIENT, lane.client_id, lane.seq)))
        lane.wait([recv], f"GET of {out.nbytes} bytes")

    def size_of(self, key: bytes) -> int | None:
        k = check_key(key)
        with self._lane() as lane:
            _status, _flags, size = lane.call(Op.SIZE, k, 0)
        return None if size == _NO_SIZE else size

    def exists(self, key: bytes) -> bool:
        return self.size_of(key) is not None

    def remove(self, key: bytes) -> bool:
        k = check_key(key)
        with self._lane() as lane:
            _status, flags, _size = lane.call(Op.REMOVE, k, 0)
        return bool(flags & _FLAG_REMOVED)

    def close(self) -> None:
        """Close every idle lane (BYE, then the endpoint). Idempotent."""
        with self._lock:
            self._closed = True
            lanes, self._idle = self._idle, []
        for lane in lanes:
            lane.close()

    def __enter__(self) -> UcxClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --- server ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UcxServerConfig:
    """Server tuning. ``host`` is advertised (UCX has no port to bind); ``listen_host`` (None:
    ``host``) is the address the daemon serves on, and decides which network devices the
    worker may use (:func:`net_devices_for`: loopback stays loopback). ``net_devices``, when
    set, is UCX's ``NET_DEVICES`` as given (e.g. ``"mlx5_0:1,eth0"``)."""

    host: str = "127.0.0.1"
    listen_host: str | None = None
    net_devices: str | None = None
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    io_timeout_s: float = 30.0
    inline_put_bytes: int = DEFAULT_INLINE_PUT_BYTES
    request_slots: int = 16
    poll_interval_s: float = 0.05
    """Longest the loop sleeps in epoll before checking deadlines and shutdown."""
    drain_timeout_s: float = 5.0
    client_idle_ttl_s: float = 300.0
    """A client that sent nothing for this long (and has no transfer in flight) is forgotten
    and its endpoint closed: UCX cannot tell an idle client from a dead one. Told to clients
    in the HELLO answer; a client idle for half of it says HELLO again before its next
    request. 0: never forget."""
    max_connections: int = 1024
    """Client endpoints (one per client lane) held at once; a HELLO past it is refused with
    CAPACITY (module docstring, "Endpoints, counted and bounded")."""

    def __post_init__(self) -> None:
        if not self.host:
            raise InvalidArgument("host must not be empty")
        if self.listen_host is not None and not self.listen_host:
            raise InvalidArgument("listen_host must be None or an address, not empty")
        if self.net_devices is not None and not self.net_devices:
            raise InvalidArgument("net_devices must be None or a UCX device list, not empty")
        if self.max_value_bytes < 1:
            raise InvalidArgument(f"max_value_bytes must be >= 1, got {self.max_value_bytes}")
        if self.io_timeout_s <= 0 or self.poll_interval_s <= 0 or self.drain_timeout_s < 0:
            raise InvalidArgument("io_timeout_s and poll_interval_s must be > 0, "
                                  "drain_timeout_s >= 0")
        if not 0 <= self.inline_put_bytes <= 1 << 20:
            raise InvalidArgument(f"inline_put_bytes must be 0..1 MiB, got {self.inline_put_bytes}")
        if not 1 <= self.request_slots <= 1024:
            raise InvalidArgument(f"request_slots must be 1..1024, got {self.request_slots}")
        if not 0 <= self.client_idle_ttl_s <= 86400:
            raise InvalidArgument(f"client_idle_ttl_s must be 0..86400, got "
                                  f"{self.client_idle_ttl_s}")
        if self.max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {self.max_connections}")


@dataclass(slots=True)
class UcxServerStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    clients: int = 0
    """Client lanes introduced (HELLO), each with its endpoint."""
    transfers_open: int = 0
    transfers_timed_out: int = 0
    clients_expired: int = 0
    endpoints_open: int = 0
    """Every endpoint the server holds: its clients' and those answering a refusal."""
    connections_refused: int = 0
    """HELLOs refused at ``max_connections``."""
    connections_unauthenticated: int = 0
    """Lanes refused for their session ticket (none, forged, stale, another scope's) and
    requests refused or dropped without a valid one (before any HELLO, after expiry)."""


class _Transfer:
    """A GET send or large-PUT receive in flight on the server."""

    __slots__ = ("client_id", "deadline", "lease", "request", "seq", "size")

    def __init__(self, client_id: int, seq: int, lease: ReadLease | WriteLease, request: Any,
                 deadline: float, size: int) -> None:
        """``lease`` is the ReadLease a GET sends from, or the WriteLease a PUT receives into."""
        self.client_id = client_id
        self.seq = seq
        self.lease = lease
        self.request = request
        self.deadline = deadline
        self.size = size


class UcxServer:
    """Serves one :class:`LeaseBackend` over UCX (contract: ``base.TransportServer``).

    The constructor records the config; :meth:`start` creates the worker and the serving thread
    and returns an endpoint carrying the worker address. Raises TransportError from ``start``
    when ucxx is unavailable.
    """

    def __init__(self, backend: LeaseBackend, config: UcxServerConfig | None = None, *,
                 authorize: SessionAuthorizer | None = None) -> None:
        """``authorize``: the session-ticket check every lane's HELLO passes before anything
        is served for it (module docstring, "Session tickets"); None serves every lane."""
        self._backend = backend
        self._config = config or UcxServerConfig()
        self._authorize = authorize
        self._endpoint: Endpoint | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._draining = False
        self._drain_deadline = 0.0
        self._stats = UcxServerStats()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        # owned by the serving thread after start
        self._w: _Worker | None = None
        self._clients: dict[int, Any] = {}
        self._grants: dict[int, SessionGrant] = {}
        """The verified grant of each lane (with an authorizer only)."""
        self._backends: dict[int, LeaseBackend] = {}
        """The scoped backend of each lane whose grant has a tenant scope."""
        self._unauthenticated = 0
        self._last_seen: dict[int, float] = {}
        self._next_sweep = 0.0
        self._slots: list[tuple[bytearray, Any]] = []
        self._transfers: list[_Transfer] = []
        self._sends: list[tuple[Any, bytearray]] = []
        self._refusing: list[tuple[Any, Any, bytearray, float]] = []
        """(endpoint, send, buffer, deadline) of each CAPACITY answer in flight."""

    # --- TransportServer --------------------------------------------------------------------

    def start(self) -> Endpoint:
        if self._thread is not None:
            raise TransportError("the UCX server is already started")
        _ucx()
        self._thread = threading.Thread(target=self._run, name="kvtier-ucx-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise TransportError(f"UCX server failed to start: {self._start_error}"
                                 ) from self._start_error
        assert self._w is not None
        self._endpoint = Endpoint(TransportKind.UCX, self._config.host, 0,
                                  worker_address=self._w.address)
        return self._endpoint

    @property
    def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            raise TransportError("the UCX server is not started")
        return self._endpoint

    def stats(self) -> UcxServerStats:
        s = self._stats
        clients = len(self._clients)
        return UcxServerStats(s.bytes_sent, s.bytes_received, clients, len(self._transfers),
                              s.transfers_timed_out, s.clients_expired,
                              clients + len(self._refusing), s.connections_refused,
                              self._unauthenticated)

    def close(self, drain_timeout_s: float | None = None) -> None:
        """Refuse new requests (SHUTTING_DOWN), let transfers in flight finish for up to
        ``drain_timeout_s``, then cut the rest (write leases aborted, read leases released)."""
        thread = self._thread
        if thread is None or self._stop.is_set():
            return
        timeout = self._config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        self._drain_deadline = time.monotonic() + timeout
        self._draining = True
        thread.join(timeout + self._config.poll_interval_s * 4 + 5.0)
        self._stop.set()
        thread.join()

    # --- the serving thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            cfg = self._config
            devices = cfg.net_devices or net_devices_for(cfg.listen_host or cfg.host)
            self._w = _Worker(devices)
            log.info("UCX server worker on network devices %s", devices or "all (UCX default)")
            for _ in range(self._config.request_slots):
                self._slots.append(self._post_slot(None))
        except BaseException as exc:
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        w = self._w
        try:
            while not self._stop.is_set():
                w.progress(self._config.poll_interval_s)
                self._serve_once()
                if self._draining and (not self._transfers
                                       or time.monotonic() >= self._drain_deadline):
                    break
        except BaseException:
            log.exception("the UCX server loop failed")
            raise
        finally:
            self._shutdown()

    def _post_slot(self, buf: bytearray | None) -> tuple[bytearray, Any]:
        w = self._w
        assert w is not None
        cfg = self._config
        if buf is None:
            buf = bytearray(REQ.size + _KEY_FIELD_BYTES
                            + max(cfg.inline_put_bytes, _MAX_WORKER_ADDRESS_BYTES))
        req = w.worker.tag_recv(w.array(buf), tag=w.ucx.UCXXTag(int(Kind.REQUEST) << _KIND_SHIFT),
                                tag_mask=w.ucx.UCXXTagMask(_KIND_MASK))
        return buf, req

    def _serve_once(self) -> None:
        for i, (buf, req) in enumerate(self._slots):
            done, error = _ended(req)
            if not done:
                continue
            if error is None:
                try:
                    self._handle(buf)
                except KvtierError as exc:
                    log.warning("dropped a UCX request: %s", exc)
            elif not self._stop.is_set():
                log.warning("a UCX request receive failed: %s", error)
            self._slots[i] = self._post_slot(buf)
        now = time.monotonic()
        if self._transfers:
            still = []
            for t in self._transfers:
                done, error = _ended(t.request)
                if not done and now >= t.deadline:
                    # UCX cannot tell a dead peer (error handling off): the deadline does.
                    # Closing the client's endpoint cancels the posted request first, so the
                    # lease's memory is not touched after it is aborted or released.
                    self._stats.transfers_timed_out += 1
                    log.warning("UCX transfer of %d bytes for client %08x timed out after "
                                "%g s; dropping the client", t.size, t.client_id,
                                self._config.io_timeout_s)
                    self._drop_client(t.client_id)
                    done, error = True, "timed out"
                if done:
                    self._finish(t, error)
                else:
                    still.append(t)
            self._transfers = still
        if self._sends:
            self._sends = [(r, b) for r, b in self._sends if not r.completed]
        if self._refusing:
            self._end_refusals(now)
        ttl = self._config.client_idle_ttl_s
        if ttl and now >= self._next_sweep:
            self._next_sweep = now + ttl / 4
            self._forget_idle_clients(now, ttl)

    def _forget_idle_clients(self, now: float, ttl_s: float) -> None:
        """Close the endpoints of clients silent for ``ttl_s`` (dead ones included: UCX cannot
        tell), unless a transfer of theirs is still in flight."""
        busy = {t.client_id for t in self._transfers}
        for client_id, seen in list(self._last_seen.items()):
            if now - seen > ttl_s and client_id not in busy:
                log.info("forgetting UCX client %08x, silent for %.0f s", client_id, now - seen)
                self._drop_client(client_id)
                self._stats.clients_expired += 1

    def _refuse(self, client_id: int, seq: int, worker_address: bytes,
                status: Status = Status.CAPACITY, why: str = "") -> None:
        """Answer a HELLO with ``status`` (CAPACITY: past ``max_connections``; or a refused
        session ticket, ``why``), on an endpoint of its own that :meth:`_end_refusals` closes
        once the answer has left."""
        limit = self._config.max_connections
        if status is Status.CAPACITY:
            self._stats.connections_refused += 1
            why = (f"the server is at its limit of {limit} UCX endpoints (max_connections); "
                   "try again later")
        else:
            self._unauthenticated += 1
        if len(self._refusing) >= _MAX_REFUSING:
            log.warning("refusing UCX client %08x silently (%s): %d refusals in flight",
                        client_id, why, _MAX_REFUSING)
            return
        log.warning("refusing UCX client %08x: %s", client_id, why)
        assert self._w is not None
        w = self._w
        ep = w.endpoint_to(worker_address)
        raw = why.encode("utf-8", "replace")[:_MAX_DETAIL_BYTES]
        buf = bytearray(RESP.size + len(raw))
        RESP.pack_into(buf, 0, MAGIC, int(status), 0, len(raw), seq, 0)
        buf[RESP.size:] = raw
        send = ep.tag_send(w.array(buf), tag=w.ucx.UCXXTag(_tag(Kind.RESPONSE, client_id, seq)))
        self._refusing.append((ep, send, buf, time.monotonic() + self._config.io_timeout_s))

    def _end_refusals(self, now: float) -> None:
        """Close the endpoints of refusals whose answer left (or that timed out)."""
        still = []
        for ep, send, buf, deadline in self._refusing:
            if send.completed or now >= deadline:
                with contextlib.suppress(Exception):
                    ep.close()  # cancels the answer if it is still posted
            else:
                still.append((ep, send, buf, deadline))
        self._refusing = still

    def _finish(self, t: _Transfer, error: str | None) -> None:
        lease = t.lease
        if _is_write(lease):
            if error is None:
                try:
                    lease.commit()
                except KvtierError as exc:
                    lease.abort()
                    self._respond(t.client_id, t.seq, Kind.DONE, exc)
                    return
                self._stats.bytes_received += t.size
                self._respond(t.client_id, t.seq, Kind.DONE, None)
            else:
                lease.abort()
                self._respond(t.client_id, t.seq, Kind.DONE,
                              TransportError(f"PUT transfer failed: {error}"))
        else:
            cast(ReadLease, lease).release()
            if error is None:
                self._stats.bytes_sent += t.size

    def _drop_client(self, client_id: int) -> None:
        self._last_seen.pop(client_id, None)
        self._grants.pop(client_id, None)
        self._backends.pop(client_id, None)
        ep = self._clients.pop(client_id, None)
        if ep is None:
            return
        with contextlib.suppress(Exception):
            ep.close()  # cancels what is still posted on it
        # let the cancellations complete, then end the transfers that belonged to it
        assert self._w is not None
        self._w.progress(0)

    def _handle(self, buf: bytearray) -> None:
        magic, op, flags, key_len, client_id, seq, size = REQ.unpack_from(buf)
        if magic != MAGIC or key_len > (MAX_TICKET_BYTES if op == Op.HELLO else MAX_KEY_BYTES):
            raise ProtocolError(f"malformed UCX request (magic {magic!r}, key_len {key_len})")
        key = bytes(buf[REQ.size:REQ.size + key_len])
        body = REQ.size + key_len
        if op == Op.HELLO:  # "key": the session ticket (module docstring, "Session tickets")
            if not 0 < size <= _MAX_WORKER_ADDRESS_BYTES:
                raise ProtocolError(f"HELLO with a {size}-byte worker address")
            self._hello(client_id, seq, key, bytes(buf[body:body + size]))
            return
        if op == Op.BYE:  # also from a client already forgotten for its silence
            self._drop_client(client_id)
            return
        if client_id not in self._clients:
            if self._authorize is not None:
                self._unauthenticated += 1
            raise ProtocolError(f"request from unknown UCX client {client_id:08x} (no HELLO "
                                "accepted from it: nothing is served, and there is no "
                                "endpoint to answer on)")
        self._last_seen[client_id] = time.monotonic()
        if self._draining:
            self._respond(client_id, seq, Kind.RESPONSE, None, status=Status.SHUTTING_DOWN,
                          detail="the server is shutting down")
            return
        if self._authorize is not None and time.time() >= \
                self._grants[client_id].expires_at_unix_s:
            self._unauthenticated += 1
            log.warning("UCX client %08x refused: its session ticket expired", client_id)
            self._respond(client_id, seq, Kind.RESPONSE, Unauthenticated(
                "the session ticket of this UCX lane expired; say HELLO with a new one"))
            return
        backend = self._backends.get(client_id, self._backend)
        try:
            check_key(key)
            if op == Op.GET:
                self._get(backend, client_id, seq, key, flags, size)
            elif op == Op.PUT:
                self._put(backend, client_id, seq, key, size, memoryview(buf)[body:body + size])
            elif op == Op.SIZE:
                found = backend.size_of(key)
                self._respond(client_id, seq, Kind.RESPONSE, None,
                              size=_NO_SIZE if found is None else found)
            elif op == Op.REMOVE:
                removed = backend.remove(key)
                self._respond(client_id, seq, Kind.RESPONSE, None,
                              flags=_FLAG_REMOVED if removed else 0)
            else:
                raise ProtocolError(f"unknown UCX op {op}")
        except KvtierError as exc:
            self._respond(client_id, seq, Kind.RESPONSE, exc)

    def _hello(self, client_id: int, seq: int, ticket: bytes, address: bytes) -> None:
        """Introduce (or renew) lane ``client_id``: with an authorizer, only for a ticket it
        accepts (a renewal: for the lane's tenant scope), else refused on an endpoint of the
        refusal's own, the lane forgotten (module docstring, "Session tickets")."""
        assert self._w is not None
        previous = self._grants.get(client_id)
        backend = self._backends.get(client_id)
        self._drop_client(client_id)  # a lane saying HELLO again keeps its place
        grant = None
        if self._authorize is not None:
            try:
                grant = renewed_grant(self._authorize, ticket, f"UCX lane {client_id:08x}",
                                      previous)
                if previous is None and grant.scope is not None:
                    backend = scoped_backend(self._backend, grant.scope)
            except (Unauthenticated, PermissionDenied) as exc:
                self._refuse(client_id, seq, address, status_for_error(exc), str(exc))
                return
        if len(self._clients) >= self._config.max_connections:
            self._refuse(client_id, seq, address)
            return
        self._clients[client_id] = self._w.endpoint_to(address)
        if grant is not None:
            self._grants[client_id] = grant
            if backend is not None:
                self._backends[client_id] = backend
        self._last_seen[client_id] = time.monotonic()
        self._respond(client_id, seq, Kind.RESPONSE, None,
                      size=int(self._config.client_idle_ttl_s * 1000))

    def _get(self, backend: LeaseBackend, client_id: int, seq: int, key: bytes, flags: int,
             size: int) -> None:
        if flags & _FLAG_INLINE and not flags & _FLAG_ANY_SIZE and size <= INLINE_GET_BYTES:
            self._get_inline(backend, client_id, seq, key, size)
            return
        lease = backend.open_read(key)
        try:
            if not flags & _FLAG_ANY_SIZE and lease.size_bytes != size:
                self._respond(client_id, seq, Kind.RESPONSE, None, status=Status.SIZE_MISMATCH,
                              size=lease.size_bytes, detail=f"stored {lease.size_bytes} bytes")
                lease.release()
                return
            self._respond(client_id, seq, Kind.RESPONSE, None, size=lease.size_bytes)
            assert self._w is not None
            w = self._w
            send = self._clients[client_id].tag_send(w.array(lease.view), tag=w.ucx.UCXXTag(
                _tag(Kind.TO_CLIENT, client_id, seq)))
        except BaseException:
            lease.release()
            raise
        self._transfers.append(_Transfer(client_id, seq, lease, send,
                                         time.monotonic() + self._config.io_timeout_s,
                                         lease.size_bytes))

    def _get_inline(self, backend: LeaseBackend, client_id: int, seq: int, key: bytes,
                    size: int) -> None:
        """One message for a small GET: the value copied behind the RESPONSE header (no lease
        outlives the call). SizeMismatch / ChunkNotFound reach ``_handle``, which answers them
        before any byte moved."""
        ep = self._clients.get(client_id)
        if ep is None:
            return
        buf = bytearray(RESP.size + size)
        backend.read_into(key, memoryview(buf)[RESP.size:])
        RESP.pack_into(buf, 0, MAGIC, int(Status.OK), _FLAG_INLINE, 0, seq, size)
        assert self._w is not None
        w = self._w
        send = ep.tag_send(w.array(buf), tag=w.ucx.UCXXTag(_tag(Kind.RESPONSE, client_id, seq)))
        self._stats.bytes_sent += size
        if not send.completed:
            self._sends.append((send, buf))  # keep the buffer alive until it has left

    def _put(self, backend: LeaseBackend, client_id: int, seq: int, key: bytes, size: int,
             inline: memoryview) -> None:
        cfg = self._config
        if size > cfg.max_value_bytes:
            raise InvalidArgument(f"value of {size} bytes exceeds max_value_bytes "
                                  f"{cfg.max_value_bytes}")
        lease = backend.open_write(key, size)
        try:
            if size <= cfg.inline_put_bytes:
                lease.buffer[:size] = inline
                lease.commit()
                self._stats.bytes_received += size
                self._respond(client_id, seq, Kind.RESPONSE, None)
                return
            assert self._w is not None
            w = self._w
            recv = self._clients[client_id].tag_recv(w.array(lease.buffer), tag=w.ucx.UCXXTag(
                _tag(Kind.TO_SERVER, client_id, seq)))
        except BaseException:
            lease.abort()
            raise
        self._transfers.append(_Transfer(client_id, seq, lease, recv,
                                         time.monotonic() + cfg.io_timeout_s, size))
        self._respond(client_id, seq, Kind.RESPONSE, None, flags=_FLAG_READY)

    def _respond(self, client_id: int, seq: int, kind: Kind, exc: KvtierError | None, *,
                 status: Status = Status.OK, flags: int = 0, size: int = 0,
                 detail: str = "") -> None:
        ep = self._clients.get(client_id)
        if ep is None:
            return
        if exc is not None:
            status = status_for_error(exc)
            detail = str(exc)
            if hasattr(exc, "expected"):
                size = int(exc.expected)
        raw = detail.encode("utf-8", "replace")[:_MAX_DETAIL_BYTES]
        buf = bytearray(RESP.size + len(raw))
        RESP.pack_into(buf, 0, MAGIC, int(status), flags, len(raw), seq, size)
        buf[RESP.size:] = raw
        assert self._w is not None
        w = self._w
        send = ep.tag_send(w.array(buf), tag=w.ucx.UCXXTag(_tag(kind, client_id, seq)))
        if not send.completed:
            self._sends.append((send, buf))  # keep the buffer alive until it has left

    def _shutdown(self) -> None:
        """Cut what is still in flight, close every endpoint, stop the worker."""
        for client_id in list(self._clients):
            self._drop_client(client_id)
        self._end_refusals(float("inf"))
        for t in self._transfers:
            self._finish(t, "server shut down")
        self._transfers = []
        w = self._w
        if w is not None:
            with contextlib.suppress(Exception):
                w.worker.cancel_inflight_requests(0, 1)
            with contextlib.suppress(Exception):
                w.progress(0)
        self._slots = []
        self._sends = []


def _is_write(lease: ReadLease | WriteLease) -> TypeGuard[WriteLease]:
    return hasattr(lease, "commit")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.dataplane.transport.ucx``: serve an in-memory backend over UCX.

    Prints ``UCX-LISTENING <worker address hex>`` once serving, then serves until SIGTERM/SIGINT
    or, with ``--exit-on-stdin-eof``, until its parent closes stdin. A test and benchmark harness.
    """
    import argparse
    import signal
    import sys

    from kvstore.dataplane.transport.memory_backend import MemoryBackend

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--max-value-bytes", type=int, default=DEFAULT_MAX_VALUE_BYTES)
    parser.add_argument("--capacity-bytes", type=int, default=None)
    parser.add_argument("--io-timeout-s", type=float, default=30.0)
    parser.add_argument("--exit-on-stdin-eof", action="store_true")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.exit_on_stdin_eof:
        def watch_stdin() -> None:
            while os.read(sys.stdin.fileno(), 4096):
                pass
            stop.set()

        threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    server = UcxServer(MemoryBackend(capacity_bytes=args.capacity_bytes), UcxServerConfig(
        max_value_bytes=args.max_value_bytes, io_timeout_s=args.io_timeout_s))
    endpoint = server.start()
    print(f"UCX-LISTENING {endpoint.worker_address.hex()}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

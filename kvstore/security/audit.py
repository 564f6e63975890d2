"""The audit log: one JSON line per operator action and per refused request (docs/security.md,
"Audit log").

What is written, by the server interceptors of :mod:`kvstore.security.auth`:

* ``"event": "operator_action"``: every call of a method only operators may call (the
  operator-only rows of :data:`~kvstore.security.auth.METHOD_ROLES`: Stats, List, Inspect,
  Remove, Evict, Drain, Pin, Unpin and their batch forms), after the handler finished, with
  its outcome (``ok``, or ``error`` with the status and the reason);
* ``"event": "refused"``: every call refused with UNAUTHENTICATED or PERMISSION_DENIED, by the
  interceptor (no or bad credentials, a role the method table does not allow) or by the
  handler (a tenant the credentials do not allow, a scoped operator acting on every tenant),
  and every put refused by its tenant's quota (RESOURCE_EXHAUSTED with ``QuotaExceeded``).

Allowed calls of the other methods (an engine's put, get and lookup) write nothing: the hot
path stays quiet and pays a ``try`` around the handler and, on ``grpc.aio``, a small wrapper
of its context (:class:`AuditedCall`).

One record, keys sorted, on one line::

    {"code": "PERMISSION_DENIED", "error": "PermissionDenied", "event": "refused",
     "method": "/kvtier.v1.Store/Drain", "outcome": "refused", "peer": "ipv4:127.0.0.1:50522",
     "principal": {"name": "vllm-0", "role": "engine", "shared_writer": false,
                   "tenants": ["acme"]},
     "reason": "vllm-0 (role engine) may not call Drain: it needs role operator",
     "request": {}, "service": "the daemon's gRPC service", "tenant": null,
     "ts": "2026-12-03T08:51:07.123456Z"}

``principal`` is null when the caller was not authenticated; its ``tenants`` is ``"*"`` for a
caller of every tenant. ``tenant`` is what the call's ``kvtier-tenant`` metadata named (null:
none). ``request`` is what is cheap to read from a unary request: ``keys`` (how many keys it
names), ``key_prefix`` (hex, at most 64 bytes shown), ``bytes`` and ``tier`` (evict by size),
``lease_id`` / ``leases``; never key bytes or values beyond the prefix. It is empty for a call
the interceptor refused (that happens before the request is read) and for streaming calls.

Writing (:class:`AuditLog`): each line is one ``write(2)`` on a file opened ``O_APPEND``
(created mode ``0600``): nothing is buffered in the process, so a line is in the kernel when
the call's response is sent; no ``fsync`` (a host crash may lose the last lines). Before a
line would take the file past ``max_bytes`` the file is rotated: ``audit.log`` becomes
``audit.log.1``, ``.1`` becomes ``.2`` and so on, and the oldest beyond ``backups`` is
dropped, so at most ``backups + 1`` files of at most ``max_bytes`` each exist (a single line
longer than ``max_bytes`` gets a file of its own). One process per file: two services must not
share a path. A failed write (disk full) is logged as an error and the call goes on: the audit
log does not make the store unavailable. ``-`` as the path writes the lines to stderr (no
rotation; for containers whose log collector reads stderr).
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.security.identity import Principal
from kvstore.wire import ERROR_METADATA_KEY, TENANT_MAX_CHARS, TENANT_METADATA_KEY

log = logging.getLogger(__name__)

STDERR = Path("-")
"""The ``audit_log`` path that means stderr."""
_REASON_MAX_CHARS = 512
_PREFIX_MAX_BYTES = 64
_REFUSED_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
_REFUSED_ERRORS = frozenset({"QuotaExceeded"})
"""kvtier errors that are refusals of policy under another status (RESOURCE_EXHAUSTED)."""


def utc_now_iso() -> str:
    """Now, UTC, ISO 8601 with microseconds and a ``Z``."""
    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _principal_doc(principal: Principal | None) -> dict[str, Any] | None:
    if principal is None:
        return None
    return {"name": principal.name, "role": principal.role.value,
            "tenants": "*" if principal.tenants is None else sorted(principal.tenants),
            "shared_writer": principal.shared_writer}


def requested_tenant(metadata: Any) -> str | None:
    """The first ``kvtier-tenant`` value of the call's metadata (cut at 128 characters), or
    None. The daemon's own check (``resolve_tenant``) decides what the call acts for; this is
    only what it asked for."""
    for key, value in metadata or ():
        if key == TENANT_METADATA_KEY:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
            return text[:TENANT_MAX_CHARS]
    return None


def request_summary(request: Any) -> dict[str, Any]:
    """What a unary request says about its scope, cheaply (module docstring): no copies of
    key bytes beyond a prefix, nothing for a streaming request or one that did not decode."""
    list_fields = getattr(request, "ListFields", None)
    if list_fields is None:
        return {}
    out: dict[str, Any] = {}
    for field, value in list_fields():
        name = field.name
        if name == "keys":
            out["keys"] = len(value)
        elif name == "key":
            out["keys"] = 1
        elif name == "items":  # BatchPut (items with a key), BatchPin (items with keys)
            out["keys"] = sum(len(i.keys) if hasattr(i, "keys") else 1 for i in value)
        elif name == "key_prefix":
            out["key_prefix"] = bytes(value[:_PREFIX_MAX_BYTES]).hex()
        elif name == "bytes":
            out["bytes"] = int(value)
        elif name == "tier":
            out["tier"] = field.enum_type.values_by_number[value].name \
                if field.enum_type is not None else int(value)
        elif name == "lease_id":
            out["lease_id"] = int(value)
        elif name == "lease_ids":
            out["leases"] = len(value)
    return out


def _error_name(trailing: Any) -> str | None:
    for key, value in trailing or ():
        if key == ERROR_METADATA_KEY:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)
    return None


def _code_name(code: Any) -> str:
    """A grpc.StatusCode (or an int from grpc.aio) as its name; None (never set) is OK."""
    if code is None:
        return "OK"
    name = getattr(code, "name", None)
    if isinstance(name, str):
        return name
    import grpc

    for status in grpc.StatusCode:
        if status.value[0] == code:
            return str(status.name)
    return str(code)


class AuditLog:
    """The audit log of one service (module docstring). Thread-safe: the conductor's handler
    threads and the daemon's event loop write through one lock. Open with :meth:`open`."""

    def __init__(self, path: Path, max_bytes: int, backups: int, service: str,
                 fd: int, size_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.service = service
        self._fd = fd
        self._size_bytes = size_bytes
        self._lock = threading.Lock()
        self.write_errors = 0
        """Lines that could not be written (each logged as an error)."""

    @classmethod
    def open(cls, path: Path, max_bytes: int, backups: int, service: str) -> AuditLog:
        """Open (create, mode 0600) ``path`` for appending; ``-``: stderr. ConfigError naming
        the path and the reason when it cannot be opened (a missing directory, no write
        permission, a directory or other non-regular file)."""
        if path == STDERR:
            return cls(path, max_bytes, backups, service, sys.stderr.fileno(), 0)
        try:
            if path.exists() and not path.is_file():
                raise ConfigError(f"security.audit_log: {str(path)!r} exists and is not a "
                                  "regular file")
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"security.audit_log: cannot open {str(path)!r} for appending: "
                              f"{exc.strerror or exc} (its directory must exist and be "
                              "writable by this service)") from exc
        size = os.fstat(fd).st_size
        log.info("%s: audit log %s (rotated at %d bytes, %d backup(s))", service, path,
                 max_bytes, backups)
        return cls(path, max_bytes, backups, service, fd, size)

    # --- records ---------------------------------------------------------------------------

    def call(self, method: str, principal: Principal, context: Any, request: Any, *,
             operator: bool, aio: bool) -> AuditedCall:
        """The record keeper of one call the interceptor let through to its handler."""
        return AuditedCall(self, method, principal, context, request, operator, aio)

    def refused(self, method: str, principal: Principal | None, context: Any,
                exc: Exception, code: str) -> None:
        """The interceptor refused the call before its handler ran (``principal``: None when
        the credentials were missing or bad)."""
        self.write(self.record(method, principal, context, None, code, str(exc),
                               type(exc).__name__))

    def record(self, method: str, principal: Principal | None, context: Any, request: Any,
               code: str, details: Any, error: str | None) -> dict[str, Any]:
        """One record (module docstring) of a call that ended with ``code``."""
        refused = code in _REFUSED_CODES or error in _REFUSED_ERRORS
        reason = None if details is None else (
            details.decode("utf-8", "replace") if isinstance(details, bytes) else str(details))
        return {"ts": utc_now_iso(), "service": self.service,
                "event": "refused" if refused else "operator_action",
                "outcome": "ok" if code == "OK" else ("refused" if refused else "error"),
                "method": method, "principal": _principal_doc(principal),
                "peer": str(context.peer()),
                "tenant": requested_tenant(context.invocation_metadata()),
                "request": request_summary(request) if request is not None else {},
                "code": code, "error": error,
                "reason": reason[:_REASON_MAX_CHARS] if reason else None}

    # --- the file --------------------------------------------------------------------------

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one JSON line (rotating first when it would not fit)."""
        data = (json.dumps(record, sort_keys=True, separators=(", ", ": "), default=str)
                + "\n").encode("utf-8")
        with self._lock:
            try:
                if self._fd < 0:  # a rotation failed half-way: try the file again
                    self._reopen()
                if (self.path != STDERR and self._size_bytes > 0
                        and self._size_bytes + len(data) > self.max_bytes):
                    self._rotate()
                view = memoryview(data)
                while view:
                    n = os.write(self._fd, view)
                    view = view[n:]
                self._size_bytes += len(data)
            except OSError as exc:
                self.write_errors += 1
                log.error("%s: audit log %s: a record was not written: %s", self.service,
                          self.path, exc)

    def _rotate(self) -> None:
        """``path`` -> ``path.1`` -> ... -> ``path.<backups>`` (the oldest dropped); a new,
        empty ``path``. Called with the lock held."""
        os.close(self._fd)
        self._fd = -1
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        self._reopen()

    def _reopen(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                           0o600)
        self._size_bytes = os.fstat(self._fd).st_size

    def close(self) -> None:
        with self._lock:
            if self.path != STDERR and self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


class AuditedCall:
    """One call through the audited interceptor: writes its record, at most once, when it
    ends: always for an operator-only method, else only when it was refused (the handler
    ended it UNAUTHENTICATED or PERMISSION_DENIED, or with a ``QuotaExceeded``).

    ``context`` is what the handler gets. On ``grpc.aio`` that is a proxy whose ``abort``
    writes the record first: aio's ``abort`` sends the status to the client before it
    raises, so a record written after it could land after the caller saw the answer. The
    threaded server sends the status only once the handler has returned, so there the
    handler gets the real context."""

    __slots__ = ("_audit", "_context", "_done", "_method", "_operator", "_principal",
                 "_request", "context")

    def __init__(self, audit: AuditLog, method: str, principal: Principal, context: Any,
                 request: Any, operator: bool, aio: bool) -> None:
        self._audit, self._method, self._principal = audit, method, principal
        self._context, self._request, self._operator = context, request, operator
        self._done = False
        self.context: Any = _AioAuditedContext(context, self) if aio else context

    def aborting(self, code: Any, details: Any, trailing: Any) -> None:
        """The handler is ending the call with ``code`` (before the status is sent)."""
        self._end(_code_name(code), details, _error_name(trailing))

    def succeeded(self) -> None:
        """The handler returned (a status it set with ``set_code`` counts)."""
        if self._operator:
            code = self._context.code()
            self._end(_code_name(code), self._context.details() if code is not None else None,
                      _error_name(self._context.trailing_metadata()))

    def failed(self, exc: BaseException) -> None:
        """The handler raised ``exc`` (after an abort, or a bug, or the call was cancelled)."""
        code = self._context.code()
        if code is None:  # no status from the handler: grpc answers UNKNOWN, or it was a cancel
            name = "CANCELLED" if isinstance(exc, asyncio.CancelledError) else "UNKNOWN"
            self._end(name, f"{type(exc).__name__}: {exc}", None)
        else:
            self._end(_code_name(code), self._context.details(),
                      _error_name(self._context.trailing_metadata()))

    def _end(self, code: str, details: Any, error: str | None) -> None:
        if self._done:
            return
        self._done = True
        if self._operator or code in _REFUSED_CODES or error in _REFUSED_ERRORS:
            self._audit.write(self._audit.record(self._method, self._principal, self._context,
                                                 self._request, code, details, error))


class _AioAuditedContext:
    """A ``grpc.aio.ServicerContext`` whose ``abort`` tells the :class:`AuditedCall` first
    (everything else is the real context's)."""

    __slots__ = ("_call", "_context")

    def __init__(self, context: Any, call: AuditedCall) -> None:
        self._context, self._call = context, call

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> Any:
        self._call.aborting(code, details, trailing_metadata)
        return await self._context.abort(code, details, trailing_metadata=trailing_metadata)

    async def abort_with_status(self, status: Any) -> Any:
        self._call.aborting(status.code, status.details, status.trailing_metadata)
        return await self._context.abort_with_status(status)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

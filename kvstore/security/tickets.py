"""Data-plane session tickets: what a caller authenticated over gRPC shows on a TCP data connection.

The data plane (TCP frames) carries no certificates or bearer tokens of its own: a client first
authenticates to the daemon's gRPC service (mTLS or a signed token: :mod:`kvstore.security`),
asks it for a ticket, and presents that ticket as the first frame of every TCP data connection
(a ``HELLO`` frame: :mod:`kvstore.dataplane.transport.tcp`). The TCP server checks it before it
serves any other frame, through the hook it was given: :meth:`TicketAuthority.authorize`.

Format (ASCII, at most :data:`~kvstore.dataplane.transport.auth.MAX_TICKET_BYTES`)::

    kvt1.<claims: base64url of JSON>.<mac: base64url of HMAC-SHA256(key, "kvt1." + claims)>

Claims: ``aud`` the daemon it is for (its node id), ``sub`` the principal's name, ``role``,
``ten`` its tenants (sorted; null for every tenant), ``sw`` shared writer, ``scope`` the tenant
the session acts for (``[read, write]``, each a tenant name or null: a
:class:`~kvstore.dataplane.transport.auth.TenantScope`, resolved by the daemon's gRPC service
when it issued the ticket, as for any of its calls; null: no scope, only for a data plane that
knows no tenants), ``iat`` / ``exp`` issue and expiry times (Unix seconds), ``nonce`` 16 random
bytes (hex): two tickets are never equal.

The key is drawn at random per daemon process (:func:`secrets.token_bytes`, 32 bytes) and never
leaves it, so only the daemon that minted a ticket accepts it: a ticket from another daemon, or
from this one before it restarted, is *stale* and fails like a forged one (the client asks for
a new one). Verification order: shape, MAC (constant time, before any claim is read), audience,
expiry. Every refusal is :class:`~kvstore.errors.Unauthenticated` with the reason; the TCP
server answers it with an ``UNAUTHENTICATED`` frame and closes the connection.

What it does not do: bind a ticket to the client's address or TLS session (a stolen ticket works
from anywhere until it expires: keep ``ttl_s`` short and the data plane on TLS or a trusted
network), or revoke a ticket before it expires (restarting the daemon revokes them all).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.dataplane.transport.auth import MAX_TICKET_BYTES, SessionGrant, TenantScope
from kvstore.errors import InvalidArgument, Unauthenticated
from kvstore.security.identity import Principal, Role

TICKET_PREFIX = b"kvt1."
KEY_BYTES = 32
DEFAULT_TTL_S = 600.0
"""Ten minutes: a client asks again when its ticket is close to expiry (``expires_at_unix_s``)."""
MAX_TTL_S = 86400.0


@dataclass(frozen=True, slots=True)
class IssuedTicket:
    """A minted ticket and when it expires (the client renews before then)."""

    ticket: bytes
    expires_at_unix_s: float


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def _unb64(data: bytes) -> bytes:
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


class TicketAuthority:
    """Mints and verifies one daemon's session tickets (module docstring).

    ``audience``: the daemon's node id, written into every ticket and required back.
    ``key``: the HMAC key (default: 32 random bytes, drawn here; pass one only in tests).
    ``ttl_s``: the default lifetime. ``clock``: wall-clock seconds (tests pass their own).
    Thread-safe: it holds no mutable state.
    """

    def __init__(self, audience: str, *, key: bytes | None = None,
                 ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not audience:
            raise InvalidArgument("a ticket authority needs an audience (the daemon's node id)")
        if key is not None and len(key) < 16:
            raise InvalidArgument(f"a ticket key must be at least 16 bytes, got {len(key)}")
        _check_ttl(ttl_s)
        self._audience = audience
        self._key = key if key is not None else secrets.token_bytes(KEY_BYTES)
        self._ttl_s = ttl_s
        self._clock = clock

    @property
    def audience(self) -> str:
        return self._audience

    @property
    def ttl_s(self) -> float:
        """The default lifetime of a ticket."""
        return self._ttl_s

    def mint(self, principal: Principal, *, scope: TenantScope | None = None,
             ttl_s: float | None = None) -> IssuedTicket:
        """A ticket for ``principal`` (the caller the gRPC layer authenticated: pass
        ``current_principal()``) acting for ``scope`` (the tenant resolved for the issuing
        call; None: no scope), valid for ``ttl_s`` (default: the authority's)."""
        lifetime = self._ttl_s if ttl_s is None else _check_ttl(ttl_s)
        if scope is not None and not isinstance(scope, TenantScope):
            raise InvalidArgument(f"scope must be a TenantScope or None, got {scope!r}")
        now = self._clock()
        claims = {
            "aud": self._audience,
            "sub": principal.name,
            "role": principal.role.value,
            "ten": None if principal.tenants is None else sorted(principal.tenants),
            "sw": principal.shared_writer,
            "scope": None if scope is None else [scope.read, scope.write],
            "iat": now,
            "exp": now + lifetime,
            "nonce": secrets.token_hex(16),
        }
        body = TICKET_PREFIX + _b64(json.dumps(claims, separators=(",", ":"),
                                               sort_keys=True).encode())
        ticket = body + b"." + _b64(self._mac(body))
        if len(ticket) > MAX_TICKET_BYTES:
            raise InvalidArgument(f"a ticket for {principal.name!r} would be {len(ticket)} "
                                  f"bytes, over the {MAX_TICKET_BYTES}-byte limit (too many "
                                  "tenants for one ticket)")
        return IssuedTicket(ticket, now + lifetime)

    def verify(self, ticket: bytes) -> Principal:
        """The principal ``ticket`` was minted for. Raises Unauthenticated (malformed, forged
        or stale, for another daemon, expired)."""
        return self._check(ticket)[0]

    def authorize(self, ticket: bytes, peer: str) -> SessionGrant:
        """The data-plane servers' hook
        (:data:`~kvstore.dataplane.transport.auth.SessionAuthorizer`): the grant of a valid
        ticket, with its scope. Raises Unauthenticated, naming ``peer``."""
        try:
            principal, expires_at, scope = self._check(ticket)
        except Unauthenticated as exc:
            raise Unauthenticated(f"data connection from {peer}: {exc}") from None
        return SessionGrant(principal.name, principal.role.value, principal.tenants,
                            expires_at, scope)

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()

    def _check(self, ticket: bytes) -> tuple[Principal, float, TenantScope | None]:
        if not isinstance(ticket, bytes | bytearray | memoryview):
            raise Unauthenticated(f"a session ticket is bytes, got {type(ticket).__name__}")
        raw = bytes(ticket)
        if not raw:
            raise Unauthenticated("no session ticket presented (ask the daemon's gRPC service "
                                  "for one)")
        if len(raw) > MAX_TICKET_BYTES or not raw.startswith(TICKET_PREFIX) \
                or raw.count(b".") != 2:
            raise Unauthenticated("malformed session ticket (not a kvt1 ticket)")
        body, _, mac_text = raw.rpartition(b".")
        try:
            mac = _unb64(mac_text)
        except (binascii.Error, ValueError):
            raise Unauthenticated("malformed session ticket (bad signature encoding)") from None
        if not hmac.compare_digest(mac, self._mac(body)):
            raise Unauthenticated("session ticket does not verify: forged, or issued by "
                                  "another daemon or before this daemon restarted (stale); "
                                  "ask for a new one")
        try:
            claims = json.loads(_unb64(body[len(TICKET_PREFIX):]))
            audience = claims["aud"]
            name = claims["sub"]
            role = Role(claims["role"])
            tenants = claims["ten"]
            shared_writer = claims["sw"]
            expires_at = float(claims["exp"])
            raw_scope = claims["scope"]
            scope = None if raw_scope is None else TenantScope(*raw_scope)
        except (ValueError, KeyError, TypeError, binascii.Error, InvalidArgument):
            # Signed by our key yet unreadable: only a bug in mint() could make one.
            raise Unauthenticated("session ticket claims are malformed") from None
        if audience != self._audience:
            raise Unauthenticated(f"session ticket is for daemon {audience!r}, this is "
                                  f"{self._audience!r}")
        now = self._clock()
        if not math.isfinite(expires_at) or now >= expires_at:
            raise Unauthenticated(f"session ticket expired {now - expires_at:.1f} s ago; ask "
                                  "for a new one")
        if not isinstance(name, str) or not isinstance(shared_writer, bool) or not (
                tenants is None or (isinstance(tenants, list)
                                    and all(isinstance(t, str) for t in tenants))):
            raise Unauthenticated("session ticket claims are malformed")
        principal = Principal(name, role, None if tenants is None else frozenset(tenants),
                              shared_writer=shared_writer)
        return principal, expires_at, scope


def holder_scope(ticket: bytes) -> TenantScope | None:
    """The scope ``ticket``'s claims name, read *without* checking its MAC (only the daemon
    holds the key): for its holder, which got it from the daemon over an authenticated channel
    and wants to know what it was issued (which owners its lease-free reads may copy), never
    for a decision anyone else relies on. Raises InvalidArgument for a ticket that does not
    parse."""
    raw = bytes(ticket)
    if not raw.startswith(TICKET_PREFIX) or raw.count(b".") != 2:
        raise InvalidArgument("not a kvt1 session ticket")
    body = raw.rpartition(b".")[0]
    try:
        raw_scope = json.loads(_unb64(body[len(TICKET_PREFIX):]))["scope"]
        return None if raw_scope is None else TenantScope(*raw_scope)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise InvalidArgument(f"session ticket claims do not parse: {exc}") from None


def _check_ttl(ttl_s: float) -> float:
    if not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"ticket ttl_s must be in (0, {MAX_TTL_S:g}] seconds, "
                              f"got {ttl_s!r}")
    return float(ttl_s)

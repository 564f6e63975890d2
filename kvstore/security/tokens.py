"""Signed bearer tokens: who the caller is, for how long, under which key.

Format (one line of URL-safe text)::

    kvt1.<key id>.<base64url(JSON claims)>.<base64url(Ed25519 signature)>

The signature covers the ASCII bytes ``kvt1.<key id>.<claims>``. Claims::

    {"sub": "engine-a", "role": "engine", "tenants": ["a", "b"] | "*",
     "shared_writer": false, "iat": 1767300000, "exp": 1767303600}

``tenants`` is required for an engine (``"*"``: a shared engine serving every tenant, which
enforces ``cache_salt`` itself); an operator or peer without it may use every tenant.

**Why Ed25519, not HMAC-SHA256.** Every daemon and conductor verifies tokens. With HMAC each of
them would hold the secret that *mints* tokens, so one compromised daemon could forge an
operator token for the whole cluster. With Ed25519 they hold only public keys; the private key
stays with whoever mints (an operator, a deployment's secret store). Verifying costs ~50 us
here, so a verified token is cached per service (:class:`TokenVerifier`), and the per-call cost
is a dictionary look-up plus an expiry check.

**Rotation.** The verifiers read every ``<key id>.pub`` of a directory (:class:`KeyDirectory`);
a token verifies while its key id is in the directory. To rotate: add the new public key, mint
with the new private key, wait until tokens of the old key have expired or been replaced, delete
the old ``.pub``: from the next check (``token_reload_interval_s``) the old tokens are refused,
cached ones included. ``kvtier token keygen``, ``mint`` and ``verify`` do the steps.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import json
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvstore.errors import ConfigError, Unauthenticated
from kvstore.security.identity import Principal, Role

TOKEN_PREFIX = "kvt1"
MAX_TOKEN_CHARS = 4096
CLOCK_SKEW_S = 60.0
"""A token issued up to this far in the future (the minting host's clock ahead) is accepted."""
_KID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9._@:/-]{1,128}$")
_CACHE_MAX = 4096


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def check_key_id(kid: str) -> str:
    if not _KID_RE.match(kid):
        raise ConfigError(f"key id {kid!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return kid


def check_tenants(role: Role, tenants: Iterable[str] | None) -> frozenset[str] | None:
    """The tenants a principal of ``role`` may use: ``None`` for every tenant. An engine must
    name them (``["*"]`` for every tenant); a daemon acts for none (it may name none); a tenant
    is 1-128 characters without commas."""
    if role is Role.DAEMON:
        if tenants is not None and list(tenants):
            raise Unauthenticated("a daemon identity acts for no tenant: it may not name "
                                  "tenants")
        return frozenset()
    if tenants is None:
        if role is Role.ENGINE:
            raise Unauthenticated("an engine identity must name its tenants (a list, or '*' "
                                  "for a shared engine that enforces cache_salt itself)")
        return None
    names = list(tenants)
    if names == ["*"]:
        return None
    for name in names:
        if not isinstance(name, str) or not 1 <= len(name) <= 128 or "," in name \
                or name == "*":
            raise Unauthenticated(f"tenant {name!r} must be 1-128 characters without ',' "
                                  "('*' alone means every tenant)")
    return frozenset(names)


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """What a token says (module docstring). ``exp`` and ``iat``: Unix seconds."""

    subject: str
    role: Role
    tenants: frozenset[str] | None
    shared_writer: bool
    issued_at: int
    expires_at: int
    key_id: str

    def principal(self) -> Principal:
        return Principal(self.subject, self.role, self.tenants, shared_writer=self.shared_writer)


def mint(private_key: Ed25519PrivateKey, key_id: str, *, subject: str, role: Role,
         tenants: Iterable[str] | None, ttl_s: float, shared_writer: bool = False,
         now_s: float | None = None) -> str:
    """A token for ``subject`` valid ``ttl_s`` seconds from now. ``tenants``: ``None`` (operator
    or peer: every tenant), ``["*"]`` or the tenant names."""
    check_key_id(key_id)
    if not _NAME_RE.match(subject):
        raise ConfigError(f"subject {subject!r} must be 1-128 characters of "
                          "[A-Za-z0-9._@:/-]")
    if not (ttl_s > 0 and ttl_s <= 366 * 86400):
        raise ConfigError(f"ttl_s must be > 0 and at most a year, got {ttl_s}")
    try:
        checked = check_tenants(role, tenants)
    except Unauthenticated as exc:
        raise ConfigError(str(exc)) from None
    now = int(time.time() if now_s is None else now_s)
    claims: dict[str, Any] = {
        "sub": subject, "role": role.value,
        "tenants": "*" if checked is None and tenants is not None else
        (sorted(checked) if checked is not None else None),
        "shared_writer": bool(shared_writer), "iat": now, "exp": now + int(ttl_s)}
    if claims["tenants"] is None:
        del claims["tenants"]
    body = _b64(json.dumps(claims, separators=(",", ":"), sort_keys=True).encode())
    signed = f"{TOKEN_PREFIX}.{key_id}.{body}"
    return f"{signed}.{_b64(private_key.sign(signed.encode('ascii')))}"


def split_token(token: str) -> tuple[str, str, str]:
    """(key id, signed part, signature part) of a token; Unauthenticated when malformed."""
    if len(token) > MAX_TOKEN_CHARS:
        raise Unauthenticated(f"bearer token is {len(token)} characters; at most "
                              f"{MAX_TOKEN_CHARS}")
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX:
        raise Unauthenticated("malformed bearer token: expected kvt1.<key id>.<claims>."
                              "<signature> (mint one with `kvtier token mint`)")
    return parts[1], ".".join(parts[:3]), parts[3]


def _claims(kid: str, body: str) -> TokenClaims:
    try:
        doc = json.loads(_unb64(body))
    except (ValueError, binascii.Error) as exc:
        raise Unauthenticated(f"bearer token claims do not decode: {exc}") from None
    if not isinstance(doc, dict):
        raise Unauthenticated("bearer token claims must be a JSON object")
    try:
        subject, role_name = doc["sub"], doc["role"]
        issued_at, expires_at = doc["iat"], doc["exp"]
    except KeyError as exc:
        raise Unauthenticated(f"bearer token lacks the claim {exc.args[0]!r}") from None
    if not isinstance(subject, str) or not _NAME_RE.match(subject):
        raise Unauthenticated("bearer token subject is malformed")
    try:
        role = Role(role_name)
    except ValueError:
        raise Unauthenticated(f"bearer token role {role_name!r} is not one of "
                              f"{', '.join(r.value for r in Role)}") from None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in (issued_at, expires_at)):
        raise Unauthenticated("bearer token iat and exp must be integers (Unix seconds)")
    raw = doc.get("tenants")
    if raw is not None and raw != "*" and not isinstance(raw, list):
        raise Unauthenticated("bearer token tenants must be a list or '*'")
    tenants = check_tenants(role, None if raw is None else (["*"] if raw == "*" else raw))
    shared = doc.get("shared_writer", False)
    if not isinstance(shared, bool):
        raise Unauthenticated("bearer token shared_writer must be true or false")
    return TokenClaims(subject, role, tenants, shared, issued_at, expires_at, kid)


def _iso(unix_s: float) -> str:
    return datetime.datetime.fromtimestamp(unix_s, datetime.UTC).isoformat(timespec="seconds")


def check_times(claims: TokenClaims, now_s: float) -> None:
    """Unauthenticated when the token expired or was issued in the future."""
    if now_s >= claims.expires_at:
        raise Unauthenticated(f"bearer token of {claims.subject} expired at "
                              f"{_iso(claims.expires_at)} ({now_s - claims.expires_at:.0f} s "
                              "ago): mint a new one")
    if claims.issued_at > now_s + CLOCK_SKEW_S:
        raise Unauthenticated(f"bearer token of {claims.subject} is issued in the future "
                              f"({_iso(claims.issued_at)}): check the minting host's clock")


def verify(token: str, keys: dict[str, Ed25519PublicKey], *, now_s: float | None = None
           ) -> TokenClaims:
    """The claims of ``token`` when a key of ``keys`` (by key id) signed it and it has not
    expired; Unauthenticated otherwise."""
    kid, signed, signature = split_token(token)
    key = keys.get(kid)
    if key is None:
        raise Unauthenticated(f"bearer token signed with key id {kid!r}, which is not in this "
                              "service's verification key set (rotated out, or another "
                              "cluster's)")
    try:
        key.verify(_unb64(signature), signed.encode("ascii"))
    except (InvalidSignature, ValueError, binascii.Error, UnicodeEncodeError):
        raise Unauthenticated(f"bearer token signature does not verify with key {kid!r}") \
            from None
    claims = _claims(kid, signed.split(".")[2])
    check_times(claims, time.time() if now_s is None else now_s)
    return claims


# --- keys ----------------------------------------------------------------------------------------


def generate_key(directory: Path, key_id: str) -> tuple[Path, Path]:
    """A new Ed25519 key pair as ``<key id>.key`` (PKCS#8 PEM, mode 0600) and ``<key id>.pub``
    (PEM) in ``directory``; refuses to overwrite."""
    check_key_id(key_id)
    directory.mkdir(parents=True, exist_ok=True)
    private_path, public_path = directory / f"{key_id}.key", directory / f"{key_id}.pub"
    for path in (private_path, public_path):
        if path.exists():
            raise ConfigError(f"{path} exists: pick another key id")
    key = Ed25519PrivateKey.generate()
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    public_path.write_bytes(key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private_path, public_path


def load_signing_key(path: Path, key_id: str | None = None) -> tuple[str, Ed25519PrivateKey]:
    """(key id, private key) from a PEM file; the key id defaults to the file's stem."""
    kid = check_key_id(key_id or path.stem)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"cannot load the signing key {path}: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"{path} is not an Ed25519 private key")
    return kid, key


def load_public_keys(directory: Path) -> dict[str, Ed25519PublicKey]:
    """Every ``<key id>.pub`` of ``directory``; ConfigError when one does not load."""
    try:
        paths = sorted(p for p in directory.iterdir() if p.suffix == ".pub")
    except OSError as exc:
        raise ConfigError(f"cannot read the token key directory {directory}: {exc}") from exc
    keys: dict[str, Ed25519PublicKey] = {}
    for path in paths:
        kid = check_key_id(path.stem)
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the token verification key {path}: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise ConfigError(f"{path} is not an Ed25519 public key")
        keys[kid] = key
    return keys


class KeyDirectory:
    """The verification keys of a directory, re-read when it changes (checked at most every
    ``reload_interval_s``; 0: at every call). A directory that fails to load keeps the keys
    it had and :attr:`last_error` says why (a half-copied key must not lock everyone out)."""

    def __init__(self, directory: Path, reload_interval_s: float = 1.0) -> None:
        self.directory = directory
        self.reload_interval_s = reload_interval_s
        self._lock = threading.Lock()
        self._signature: tuple[Any, ...] | None = None
        self._checked_at = -float("inf")
        self._keys: dict[str, Ed25519PublicKey] = {}
        self.generation = 0
        """Incremented whenever the key set changes (caches of verified tokens compare it)."""
        self.last_error: str | None = None
        self.refresh(force=True)
        if not self._keys:
            raise ConfigError(f"the token key directory {directory} holds no <key id>.pub "
                              "files: no token could verify (create one with "
                              "`kvtier token keygen`)")

    def _stat(self) -> tuple[Any, ...]:
        entries = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".pub"):
                st = entry.stat()
                entries.append((entry.name, st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(sorted(entries))

    def refresh(self, *, force: bool = False) -> dict[str, Ed25519PublicKey]:
        """The current keys (re-read first when the interval passed and the files changed)."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._checked_at < self.reload_interval_s:
                return self._keys
            self._checked_at = now
            try:
                signature = self._stat()
            except OSError as exc:
                if force:
                    raise ConfigError(f"cannot read the token key directory "
                                      f"{self.directory}: {exc}") from exc
                self.last_error = str(exc)
                return self._keys
            if signature == self._signature:
                return self._keys
            try:
                keys = load_public_keys(self.directory)
            except ConfigError as exc:
                if force:
                    raise
                self.last_error = str(exc)
                return self._keys
            self._signature = signature
            if keys.keys() != self._keys.keys() or any(
                    keys[k].public_bytes_raw() != self._keys[k].public_bytes_raw() for k in keys):
                self.generation += 1
            self._keys = keys
            self.last_error = None
            return keys


class TokenVerifier:
    """Verifies tokens against a :class:`KeyDirectory`, caching verified ones (module
    docstring). Thread-safe."""

    def __init__(self, keys: KeyDirectory) -> None:
        self.keys = keys
        self._cache: dict[str, tuple[TokenClaims, int]] = {}
        self._lock = threading.Lock()

    def verify(self, token: str) -> TokenClaims:
        current = self.keys.refresh()
        generation = self.keys.generation
        with self._lock:
            hit = self._cache.get(token)
        if hit is not None and hit[1] == generation:
            check_times(hit[0], time.time())
            return hit[0]
        claims = verify(token, current)
        with self._lock:
            if len(self._cache) >= _CACHE_MAX:
                self._cache.clear()
            self._cache[token] = (claims, generation)
        return claims

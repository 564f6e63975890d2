"""A client's side: channels that speak TLS and present a certificate, and the bearer token
each call carries (:class:`~kvstore.security.config.ClientSecurity`).

:func:`sync_channel` and :func:`aio_channel` open a plaintext channel when ``ca_file`` is
unset, else a TLS channel (with the client's certificate when given; its dates and key are
checked first, ConfigError otherwise). :class:`TokenSource` reads the token file and re-reads it
when it changes (checked at most once a second), so a long-lived client picks up a renewed
token without restarting; :meth:`TokenSource.metadata` is the ``authorization`` pair to send.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.security.auth import AUTHORIZATION_METADATA_KEY, BEARER
from kvstore.security.config import ClientSecurity
from kvstore.security.tls import channel_options, client_credentials
from kvstore.security.tokens import MAX_TOKEN_CHARS

TOKEN_RECHECK_S = 1.0


class TokenSource:
    """One token file (module docstring). Thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._checked_at = -float("inf")
        self._signature: tuple[int, int, int] | None = None
        self._token = ""
        self._read(force=True)

    def _read(self, *, force: bool = False) -> str:
        now = time.monotonic()
        with self._lock:
            if not force and now - self._checked_at < TOKEN_RECHECK_S:
                return self._token
            self._checked_at = now
            try:
                st = os.stat(self.path)
                signature = (st.st_mtime_ns, st.st_size, st.st_ino)
                if signature == self._signature:
                    return self._token
                token = self.path.read_text().strip()
            except OSError as exc:
                if force:
                    raise ConfigError(f"cannot read the token file {self.path}: {exc}") from exc
                return self._token  # keep the token we have; the server says if it expired
            if not token or len(token) > MAX_TOKEN_CHARS or any(c.isspace() for c in token):
                if force:
                    raise ConfigError(f"the token file {self.path} must hold one token "
                                      "(`kvtier token mint` prints one)")
                return self._token
            self._signature, self._token = signature, token
            return token

    def token(self) -> str:
        return self._read()

    def metadata(self) -> tuple[str, str]:
        return AUTHORIZATION_METADATA_KEY, BEARER + self._read()


def token_source(security: ClientSecurity) -> TokenSource | None:
    return TokenSource(security.token_file) if security.token_file is not None else None


def sync_channel(address: str, security: ClientSecurity,
                 options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A ``grpc.Channel`` to ``address`` as ``security`` says (module docstring)."""
    import grpc

    opts = [*options, *channel_options(security)]
    if not security.tls:
        return grpc.insecure_channel(address, options=opts)
    return grpc.secure_channel(address, client_credentials(security), options=opts)


def aio_channel(address: str, security: ClientSecurity,
                options: Sequence[tuple[str, Any]] = ()) -> Any:
    """A ``grpc.aio.Channel`` to ``address`` as ``security`` says (module docstring)."""
    import grpc

    opts = [*options, *channel_options(security)]
    if not security.tls:
        return grpc.aio.insecure_channel(address, options=opts)
    return grpc.aio.secure_channel(address, client_credentials(security), options=opts)

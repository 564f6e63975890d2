"""What a :class:`~kvstore.client.store_client.StoreClient` is configured with and returns: the
data-plane choice, its config, and the result of a prefix lookup."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.shm import ShmClientConfig
from kvstore.dataplane.transport.shm.frames import MAX_KEYS
from kvstore.errors import InvalidArgument
from kvstore.security.config import ClientSecurity
from kvstore.wire import (
    SESSION_MAX_CHARS,
    SESSION_MIN_CHARS,
    TENANT_MAX_CHARS,
    TENANT_METADATA_KEY,
)


class DataPlane(enum.Enum):
    AUTO = "auto"
    SHM = "shm"
    UCX = "ucx"
    TCP = "tcp"


@dataclass(frozen=True, slots=True)
class StoreClientConfig:
    data_plane: DataPlane = DataPlane.AUTO
    tcp_connections: int = 4
    rpc_timeout_s: float = 30.0
    """Longest a gRPC call, or a wait on the same-host lease channel, may take."""
    lease_ttl_s: float = 0.0
    """TTL of same-host leases (0: the daemon's default; 60 s for the lease of a
    ``read_view``, whose deadline the client must know)."""
    session: str = ""
    """The session this client's gRPC calls belong to (16 to 128 characters; a secret): pins
    and leases it takes can be ended only by a client presenting the same session. Empty: a
    random one per client. ``kvtier pin``/``unpin`` share the operator's
    (:func:`kvstore.client.daemon_control.operator_session`)."""
    wait_for_ready: bool = False
    """``connect`` waits up to ``rpc_timeout_s`` for a daemon that is not listening yet,
    instead of failing at once with PeerUnavailable."""
    populate_arena: bool = True
    """On the shared-memory plane, fault the whole mapped arena into this process's page
    tables at ``connect`` (one read per page: ~30 ms per 256 MiB here, plus 2 MiB of page
    tables per GiB). Without it the first copy to or from each arena page costs a page fault:
    measured 340 µs instead of 52 µs for a first 1 MiB copy, i.e. a cold client runs at a
    sixth of memcpy until it has touched the whole arena."""
    ucx_io_timeout_s: float = 30.0
    """Longest a UCX transfer may wait (UCX does not detect a dead peer by itself)."""
    ucx_liveness_interval_s: float = 0.5
    """While a UCX call waits, the daemon's gRPC health is asked this often."""
    ucx_retry_after_s: float = 30.0
    """After a UCX failure, calls use TCP for this long before UCX is tried again."""
    ucx_min_bytes: int = 1 << 20
    """Smaller values go over TCP even when UCX is chosen: measured here (one host, CMA), a
    4-64 KiB value cost 120-250 µs over UCX against 55-115 µs over TCP, while from 4 MiB up
    UCX moved 1.2-2x what TCP did (docs/transport.md). 0: every value over UCX."""
    tcp_io_timeout_s: float = 30.0
    """Longest a TCP data-plane request waits on its socket without progress (and, up to 5 s,
    to connect) before it fails with PeerUnavailable. ``rpc_timeout_s`` does not bound the TCP
    plane: a stopped or partitioned daemon holds a TCP request this long."""
    tcp_spin_us: int = 0
    """How long a small TCP get polls for its answer before its thread sleeps (needs the
    native extension; ``TcpClientConfig.spin_us``). Trades a core's time while waiting for one
    scheduler wake-up less per get (docs/transport.md, "Waiting for an answer")."""
    lease_free_reads: bool = True
    """On the shared-memory plane, copy chunks the daemon's read index publishes without a
    lease round trip (Linux on x86-64 only; elsewhere, or when the daemon serves no index,
    every read takes a lease)."""
    lease_free_attempts: int = 4
    """Copies of one chunk tried lease-free before the read takes a lease (each retry follows
    a copy the daemon invalidated meanwhile: the chunk was evicted, moved or removed)."""
    read_report_interval_s: float = 0.05
    """Lease-free reads are reported to the daemon (hits, recency) at least this often..."""
    read_report_batch: int = 1024
    """...and as soon as this many are waiting."""
    security: ClientSecurity | None = None
    """What the gRPC channel presents (TLS CA, client certificate, bearer token file;
    docs/security.md). None: :meth:`ClientSecurity.from_env` at connect (``KVTIER_TLS_CA``,
    ``KVTIER_TLS_CERT``, ``KVTIER_TLS_KEY``, ``KVTIER_TOKEN_FILE``; none set: plaintext
    without credentials, what a loopback daemon without security config accepts). A daemon
    whose TCP data plane speaks TLS (``NodeInfo.data_tls_required``) is reached with the same
    CA, client certificate and server name."""

    tenant: str | None = None
    """The tenant this client acts for, sent as ``kvtier-tenant`` metadata on every gRPC call
    (printable ASCII, at most 128 characters). The daemon checks it against the credentials
    (docs/security.md, "Tenant isolation"): None is fine for credentials of exactly one tenant
    and for operators (every tenant); an engine allowed several tenants must name one. On a
    daemon with security the TCP plane and the lease channel act for it too (their session
    ticket is issued for it); a daemon without security has no ticket, so its data planes
    carry no tenant (they act for the default tenant) and UCX is never served with security."""

    data_ticket_ttl_s: float = 0.0
    """The lifetime of the data-plane session tickets this client asks a daemon with security
    for (0: the daemon's, ten minutes; shorter only: docs/security.md, "Data planes")."""

    def __post_init__(self) -> None:
        if not isinstance(self.data_plane, DataPlane):
            raise InvalidArgument(f"data_plane must be a DataPlane, got {self.data_plane!r}")
        if self.tcp_connections < 1:
            raise InvalidArgument("tcp_connections must be >= 1")
        if not 0 <= self.tcp_spin_us <= 10_000:
            raise InvalidArgument(f"tcp_spin_us must be 0..10000, got {self.tcp_spin_us}")
        if self.rpc_timeout_s <= 0 or self.lease_ttl_s < 0 or not self.tcp_io_timeout_s > 0:
            raise InvalidArgument("rpc_timeout_s and tcp_io_timeout_s must be > 0 and "
                                  "lease_ttl_s >= 0")
        if self.session and not SESSION_MIN_CHARS <= len(self.session) <= SESSION_MAX_CHARS:
            raise InvalidArgument(f"session must be empty or {SESSION_MIN_CHARS} to "
                                  f"{SESSION_MAX_CHARS} characters, got {len(self.session)}")
        if min(self.ucx_io_timeout_s, self.ucx_liveness_interval_s) <= 0 \
                or self.ucx_retry_after_s < 0 or self.ucx_min_bytes < 0:
            raise InvalidArgument("ucx_io_timeout_s and ucx_liveness_interval_s must be > 0, "
                                  "ucx_retry_after_s and ucx_min_bytes >= 0")
        if self.tenant is not None and (
                not isinstance(self.tenant, str) or len(self.tenant) > TENANT_MAX_CHARS
                or not all(" " <= c <= "~" for c in self.tenant)):
            raise InvalidArgument(f"tenant must be None or at most {TENANT_MAX_CHARS} printable "
                                  f"ASCII characters (it travels as {TENANT_METADATA_KEY} "
                                  f"metadata), got {self.tenant!r}")
        if not (isinstance(self.data_ticket_ttl_s, int | float)
                and 0 <= self.data_ticket_ttl_s < float("inf")):
            raise InvalidArgument(f"data_ticket_ttl_s must be 0 (the daemon's) or a finite "
                                  f"number of seconds > 0, got {self.data_ticket_ttl_s!r}")
        if self.security is not None and not isinstance(self.security, ClientSecurity):
            raise InvalidArgument(f"security must be a ClientSecurity, got {self.security!r}")
        if self.lease_free_attempts < 1 or self.read_report_interval_s <= 0 \
                or not 1 <= self.read_report_batch <= MAX_KEYS:
            raise InvalidArgument(f"lease_free_attempts must be >= 1, read_report_interval_s "
                                  f"> 0 and read_report_batch 1..{MAX_KEYS}")

    def client_security(self) -> ClientSecurity:
        """:attr:`security`, or the environment's when it is None."""
        return self.security if self.security is not None else ClientSecurity.from_env()

    def shm_config(self) -> ShmClientConfig:
        """The shared-memory client's part of this config."""
        return ShmClientConfig(
            lease_ttl_s=self.lease_ttl_s, populate_arena=self.populate_arena,
            lease_free_reads=self.lease_free_reads, lease_free_attempts=self.lease_free_attempts,
            read_report_interval_s=self.read_report_interval_s,
            read_report_batch=self.read_report_batch, io_timeout_s=self.rpc_timeout_s)


@dataclass(frozen=True, slots=True)
class LookupResult:
    length: int
    """How many leading keys are cached."""
    tiers: tuple[TierKind, ...]
    """Where each of them lives."""

    def by_tier(self) -> dict[TierKind, int]:
        out: dict[TierKind, int] = {}
        for t in self.tiers:
            out[t] = out.get(t, 0) + 1
        return out

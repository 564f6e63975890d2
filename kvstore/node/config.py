"""The store daemon's configuration: one frozen-dataclass tree, one loader.

Precedence, lowest first: the dataclass defaults, a config **file** (YAML ``.yaml``/``.yml`` or
TOML ``.toml``), the **environment**, then **flags** (``--set section.field=value`` and the
daemon command's shortcuts). Every value is validated; a bad one raises
:class:`~kvstore.errors.ConfigError` naming the key and where it came from, e.g.
``dram.capacity_bytes: expected a size in bytes, got 'lots' (environment
KVTIER_DRAM__CAPACITY_BYTES)``. Unknown keys are errors too (a typo must not be ignored).

File layout (YAML shown; TOML uses ``[dram]`` tables)::

    node_id: node-a
    dram: {capacity_bytes: 1GiB,
           arena_groups: ["team-a:tenants=alice+carol;group=kvtier-a;capacity=256MiB"]}
    nvme: {directory: /var/lib/kvtier, capacity_bytes: 64GiB}
    server: {host: 0.0.0.0, grpc_port: 50051, tcp_port: 50052}
    etcd: {endpoints: [10.0.0.1:2379, 10.0.0.2:2379, 10.0.0.3:2379],
           ca_file: /etc/kvtier/etcd-ca.crt, username: kvtier-daemon,
           password_file: /etc/kvtier/etcd-password}
    metrics: {enabled: true, port: 9464}
    security: {cert_file: /etc/kvtier/daemon.crt, key_file: /etc/kvtier/daemon.key,
               client_ca_file: /etc/kvtier/ca.crt}
    tenants: {max_tracked: 64, quotas: ["alice:dram:max=4GiB;guaranteed=1GiB"]}

``etcd.endpoints`` is a YAML list or comma-separated text (``etcd.endpoint`` is the older,
single-member spelling of the same key); ``etcd``'s security keys (``ca_file``, ``cert_file``,
``key_file``, ``username``, ``password``/``password_file``, ``server_name``) are those of
:class:`~kvstore.security.etcd.EtcdSecurity`, also read from the ``KVTIER_ETCD_CA``-style
variables every etcd client takes (docs/security.md, "etcd").

``security`` (:class:`~kvstore.security.config.ServerSecurity`, docs/security.md) authenticates
the gRPC service: mTLS or bearer tokens. Without it the daemon listens on loopback only; a
non-loopback ``server.host`` without authentication needs ``security.insecure: true``.

``tenants`` (:class:`TenantsConfig`, docs/tenants.md): how many tenants get a metrics label of
their own, and per-tenant caps and guaranteed shares per tier (``TENANT:TIER:LIMITS`` entries,
``,``-separated in text), checked against the tiers' capacities when the config loads.

Environment: ``KVTIER_<SECTION>__<FIELD>`` (double underscore between section and field), and
``KVTIER_<FIELD>`` for top-level fields (``KVTIER_NODE_ID``). Other ``KVTIER_*`` variables
without a double underscore are not config (``KVTIER_ETCD_BINARY`` belongs to the test
fixtures) and are ignored, except the etcd security variables above (``KVTIER_ETCD_CA`` is
``etcd.ca_file``; ``KVTIER_ETCD__CA_FILE`` beats it); one with a double underscore that names no field is an error.

Values from the environment and flags are text: sizes accept ``4096``, ``64KiB``, ``1GiB``,
``1_000_000`` (binary units only: ``MB`` is refused as ambiguous); booleans accept
``true/false/yes/no/on/off/1/0`` (anything else is an error: ``"false"`` must never be truthy);
optional fields accept ``none``/``null``/``off``/empty for None.
"""

from __future__ import annotations

import dataclasses
import enum
import grp
import math
import os
import pwd
import re
import socket
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml

from kvstore.dataplane.dram import ArenaGroup
from kvstore.dataplane.tier import TierKind
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.membership.endpoints import parse_etcd_endpoints
from kvstore.node.policies import PolicyName
from kvstore.node.tenants import DEFAULT_MAX_TENANTS, TenantQuota, parse_quota, quota_table
from kvstore.security.config import ServerSecurity
from kvstore.security.etcd import (
    ENV_ETCD_CA,
    ENV_ETCD_CERT,
    ENV_ETCD_KEY,
    ENV_ETCD_PASSWORD,
    ENV_ETCD_PASSWORD_FILE,
    ENV_ETCD_SERVER_NAME,
    ENV_ETCD_USER,
    EtcdSecurity,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
ENV_PREFIX = "KVTIER_"
_SIZE_RE = re.compile(r"^\s*(\d[\d_]*)\s*(B|KiB|MiB|GiB|TiB)?\s*$")
_UNITS = {None: 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": 1 << 40}
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "off", ""}
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HIDDEN = "<hidden>"
"""What :meth:`DaemonConfig.to_dict` shows in place of a configured etcd password."""
# The etcd security variables every etcd client reads (kvstore.security.etcd), taken by the
# loader as the etcd section's keys (environment layer; KVTIER_ETCD__<FIELD> beats them).
_ETCD_SECURITY_ENV = {ENV_ETCD_CA: "ca_file", ENV_ETCD_CERT: "cert_file",
                      ENV_ETCD_KEY: "key_file", ENV_ETCD_USER: "username",
                      ENV_ETCD_PASSWORD: "password", ENV_ETCD_PASSWORD_FILE: "password_file",
                      ENV_ETCD_SERVER_NAME: "server_name"}


class _SizeMarker:
    """Marks an int field as a size in bytes (``64MiB`` accepted in text)."""


SizeBytes = Annotated[int, _SizeMarker()]


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _port(name: str, value: int) -> None:
    _require(0 <= value < 65536, f"{name} must be 0..65535 (0: an ephemeral port), got {value}")


@dataclass(frozen=True, slots=True)
class ArenaGroupConfig:
    """One entry of ``dram.arena_groups``, parsed (:func:`parse_arena_group`): an arena of its
    own for ``tenants``, ``capacity_bytes`` of the DRAM tier, handed to the unix group ``gid``
    (``0660``: only the daemon and that group can open it), and a lease channel of its own that
    admits only peers whose uid is the daemon's or in ``uids``, or whose primary gid is ``gid``
    (docs/dram-arena.md, "Arenas per tenant group")."""

    name: str
    tenants: frozenset[str]
    gid: int
    uids: frozenset[int]
    capacity_bytes: int

    def arena(self) -> ArenaGroup:
        """The data plane's description of this arena."""
        return ArenaGroup(self.name, self.tenants, self.capacity_bytes, self.gid)


def parse_arena_group(spec: str) -> ArenaGroupConfig:
    """One arena group from its config text ``NAME:tenants=T1+T2;group=GROUP;users=U1+U2;
    capacity=SIZE``: ``group`` a unix group name or gid (required), ``users`` user names or
    uids (optional), ``capacity`` a size (``64MiB``). Example:
    ``team-a:tenants=alice+carol;group=kvtier-a;users=engine-a;capacity=4GiB``. Names are
    looked up on this host now: an unknown group or user is a ConfigError."""
    name, colon, rest = spec.strip().partition(":")
    if not colon:
        raise ConfigError(f"arena group {spec!r} must read NAME:tenants=T1+T2;group=GROUP;"
                          "users=U1+U2;capacity=SIZE")
    values: dict[str, str] = {}
    for item in rest.split(";"):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("tenants", "group", "users", "capacity") or key in values:
            raise ConfigError(f"arena group {spec!r}: fields are tenants=, group=, users= and "
                              "capacity=, each once, joined by ';'")
        values[key] = value.strip()
    for required in ("tenants", "group", "capacity"):
        if not values.get(required):
            raise ConfigError(f"arena group {spec!r} needs {required}=")
    tenants = frozenset(t.strip() for t in values["tenants"].split("+"))
    if "" in tenants:
        raise ConfigError(f"arena group {spec!r}: an empty tenant name (the default tenant's "
                          "chunks stay in the default arena)")
    m = _SIZE_RE.match(values["capacity"])
    if m is None:
        raise ConfigError(f"arena group {spec!r}: capacity {values['capacity']!r} is not a size "
                          "in bytes (4096, 64MiB, 1GiB)")
    capacity = int(m.group(1).replace("_", "")) * _UNITS[m.group(2)]
    _require(capacity >= 64 * KiB, f"arena group {spec!r}: capacity must be >= 64 KiB, got "
             f"{capacity}")
    users = [u.strip() for u in values.get("users", "").split("+") if u.strip()]
    try:
        group = ArenaGroupConfig(name.strip(), tenants, _gid(values["group"], spec),
                                 frozenset(_uid(u, spec) for u in users), capacity)
        group.arena()  # the data plane's checks (name, tenants)
    except InvalidArgument as exc:
        raise ConfigError(f"arena group {spec!r}: {exc}") from None
    return group


def _gid(text: str, spec: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ConfigError(f"arena group {spec!r}: no unix group {text!r} on this host") from None


def _uid(text: str, spec: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise ConfigError(f"arena group {spec!r}: no user {text!r} on this host") from None


@dataclass(frozen=True, slots=True)
class DramConfig:
    """The pinned-DRAM tier: one pre-faulted shared-memory arena (same-host clients map it), or
    with ``arena_groups`` one per tenant group plus the default one."""

    capacity_bytes: SizeBytes = 256 * MiB
    prefault: bool = True
    arena_name: str | None = None
    """None: ``kvtier-<pid>-<random>`` (lets a restart sweep the arenas of dead daemons)."""
    read_index: bool = True
    """Publish DRAM chunks in a shared-memory read index so same-host clients copy them with
    no lease round trip (``docs/dram-arena.md``, "Lease-free reads"). Only where it is correct
    (Linux on x86-64); elsewhere the daemon logs why and serves leases only."""
    read_index_slots: int = 0
    """Slots of the read index (a power of two >= 64); 0: enough for the arena full of 64 KiB
    chunks. A chunk that finds the index full is still served, through a lease."""
    arena_groups: tuple[str, ...] = ()
    """Separate arenas per tenant group, for hosts shared by mutually untrusted engines
    (docs/dram-arena.md, "Arenas per tenant group"): ``NAME:tenants=T1+T2;group=GROUP;
    users=U1+U2;capacity=SIZE`` entries (:func:`parse_arena_group`; in text, entries are
    separated by ``,``). Each group's capacity comes out of ``capacity_bytes``; the default
    arena (every other tenant) keeps the rest, at least 64 KiB. A tenant is in one group at
    most. Needs security (the tenant of a same-host session comes from its identity)."""

    def __post_init__(self) -> None:
        _require(self.capacity_bytes >= 64 * KiB,
                 f"capacity_bytes must be >= 64 KiB, got {self.capacity_bytes}")
        slots = self.read_index_slots
        _require(slots == 0 or (slots >= 64 and slots & (slots - 1) == 0),
                 f"read_index_slots must be 0 (auto) or a power of two >= 64, got {slots}")
        groups = self.arena_group_list()
        seen: dict[str, str] = {}
        for g in groups:
            _require(g.name not in {h.name for h in groups if h is not g},
                     f"arena_groups: two groups are named {g.name!r}")
            for tenant in sorted(g.tenants):
                _require(tenant not in seen, f"arena_groups: tenant {tenant!r} is in groups "
                         f"{seen.get(tenant)!r} and {g.name!r} (a tenant's chunks live in one "
                         "arena)")
                seen[tenant] = g.name
        taken = sum(g.capacity_bytes for g in groups)
        _require(not groups or self.capacity_bytes - taken >= 64 * KiB,
                 f"arena_groups take {taken} of capacity_bytes {self.capacity_bytes}: the "
                 "default arena (every tenant in no group) needs at least 64 KiB of it")

    def arena_group_list(self) -> tuple[ArenaGroupConfig, ...]:
        """The arena groups, parsed (ConfigError naming a bad entry)."""
        return tuple(parse_arena_group(spec) for spec in self.arena_groups)


@dataclass(frozen=True, slots=True)
class NvmeConfig:
    """The NVMe tier; off unless ``directory`` is set. Its chunks survive restarts."""

    directory: Path | None = None
    capacity_bytes: SizeBytes = 1 * GiB
    segment_bytes: SizeBytes = 64 * MiB

    def __post_init__(self) -> None:
        _require(self.capacity_bytes >= MiB, f"capacity_bytes must be >= 1 MiB, got "
                 f"{self.capacity_bytes}")
        _require(self.segment_bytes >= MiB and self.segment_bytes % (4 * KiB) == 0,
                 f"segment_bytes must be a multiple of 4 KiB and >= 1 MiB, got "
                 f"{self.segment_bytes}")


@dataclass(frozen=True, slots=True)
class HbmConfig:
    """The GPU tier; off unless ``capacity_bytes`` > 0 (needs CUDA)."""

    capacity_bytes: SizeBytes = 0
    device: int = 0

    def __post_init__(self) -> None:
        _require(self.capacity_bytes >= 0, "capacity_bytes must be >= 0")
        _require(self.device >= 0, f"device must be >= 0, got {self.device}")


@dataclass(frozen=True, slots=True)
class CacheSection:
    policy: PolicyName = PolicyName.LRU
    lease_ttl_s: float = 30.0
    """Default TTL of pins, reads in flight and gRPC leases."""
    promote_on_hit: bool = True
    write_tier: TierKind | None = None
    """None: the fastest configured tier."""
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    demote_interval_s: float = 1.0
    """How often the daemon brings tiers above their high watermark down to the low one."""

    def __post_init__(self) -> None:
        _require(math.isfinite(self.lease_ttl_s) and self.lease_ttl_s > 0,
                 f"lease_ttl_s must be finite and > 0, got {self.lease_ttl_s}")
        _require(0.0 <= self.low_watermark <= self.high_watermark <= 1.0,
                 "watermarks must satisfy 0 <= low_watermark <= high_watermark <= 1")
        _require(self.demote_interval_s > 0, "demote_interval_s must be > 0")


class UcxMode(enum.Enum):
    """Whether the daemon serves the UCX data plane (``ucxx``) beside TCP."""

    AUTO = "auto"
    """Serve it when ``ucxx`` imports here; otherwise log why and serve TCP only."""
    REQUIRED = "required"
    """Fail the start when ``ucxx`` is unavailable."""
    DISABLED = "disabled"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Listening addresses and limits of the control service and the data plane."""

    host: str = "127.0.0.1"
    advertise_host: str | None = None
    """The host others should dial (None: ``host``, or this machine's name when ``host`` is
    a wildcard)."""
    grpc_port: int = 0
    tcp_port: int = 0
    inline_max_bytes: SizeBytes = 1 * MiB
    """Largest value Put/Get carry inside a gRPC message; larger ones use the data plane."""
    max_value_bytes: SizeBytes = 1 * GiB
    """Largest chunk the TCP transport accepts."""
    rpc_workers: int = 8
    """Threads that run cache operations for the gRPC service."""
    shm_channel: bool = True
    """Serve same-host clients the Unix-socket lease channel (shared-memory data plane)."""
    shm_lease_ttl_s: float = 300.0
    """Leases of the lease channel end with their connection; this bounds a stuck client."""
    reservation_ttl_s: float = 30.0
    """A gRPC Reserve (or a multi-part TCP put) not committed within this is aborted."""
    tcp_io_timeout_s: float = 30.0
    ucx: UcxMode = UcxMode.AUTO
    """The UCX data plane: its worker address is advertised in Info and the etcd record."""
    ucx_io_timeout_s: float = 30.0
    """UCX cannot detect a dead client (error handling is off): a transfer not done within
    this is cut and its lease aborted or released."""
    max_ttl_s: float = 3600.0
    """Upper bound of every TTL a client may ask for (pins, read leases, reservations, parent
    hints); a larger or non-finite one is refused with INVALID_ARGUMENT."""
    max_leases: int = 65536
    """Pins, read leases and reservations the daemon holds for clients at once; beyond it a new
    one is refused (RESOURCE_EXHAUSTED) until others end."""
    idle_timeout_s: float = 300.0
    """A data-plane or lease-channel connection with no request and nothing held for this long
    is closed; a gRPC connection with no call open for this long too (GOAWAY: a client's
    channel connects again at its next call)."""
    header_timeout_s: float = 10.0
    """Once a frame's first byte arrived, the rest of its header must arrive within this."""
    max_connections: int = 1024
    """Connections each listener (TCP data plane, lease channel, gRPC) serves at once; one more
    is refused with an error frame and closed (gRPC: closed)."""
    tcp_tls: bool = False
    """TLS on the TCP data plane, with the gRPC port's certificate, key and client CA
    (``security.cert_file``/``key_file``/``client_ca_file``: client certificates required
    there too with mTLS) and their hot reload; ``NodeInfo.data_tls_required`` says so to
    clients (docs/security.md, "TLS on the TCP data plane"). Needs ``security.cert_file``."""

    def __post_init__(self) -> None:
        _require(bool(self.host), "host must not be empty")
        _port("grpc_port", self.grpc_port)
        _port("tcp_port", self.tcp_port)
        _require(KiB <= self.inline_max_bytes <= 3 * MiB,
                 f"inline_max_bytes must be 1 KiB..3 MiB (gRPC messages are capped at 4 MiB), "
                 f"got {self.inline_max_bytes}")
        _require(self.max_value_bytes >= MiB, "max_value_bytes must be >= 1 MiB")
        _require(1 <= self.rpc_workers <= 256, f"rpc_workers must be 1..256, got "
                 f"{self.rpc_workers}")
        for name in ("shm_lease_ttl_s", "reservation_ttl_s", "tcp_io_timeout_s",
                     "ucx_io_timeout_s", "idle_timeout_s", "header_timeout_s"):
            _require(math.isfinite(getattr(self, name)) and getattr(self, name) > 0,
                     f"{name} must be finite and > 0")
        _require(math.isfinite(self.max_ttl_s) and self.max_ttl_s >= 1,
                 f"max_ttl_s must be finite and >= 1, got {self.max_ttl_s}")
        for name in ("shm_lease_ttl_s", "reservation_ttl_s"):
            _require(getattr(self, name) <= self.max_ttl_s, f"{name} must be <= max_ttl_s")
        _require(self.max_leases >= 1, f"max_leases must be >= 1, got {self.max_leases}")
        _require(1 <= self.max_connections <= 65536,
                 f"max_connections must be 1..65536, got {self.max_connections}")


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """Prometheus metrics over HTTP (off by default)."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9464
    """0: an ephemeral port (reported at start-up)."""

    def __post_init__(self) -> None:
        _port("port", self.port)


@dataclass(frozen=True, slots=True)
class EtcdConfig:
    """Membership; off unless ``endpoints`` is set. The other keys say how to authenticate to
    etcd (docs/security.md, "etcd"): they are the fields of
    :class:`~kvstore.security.etcd.EtcdSecurity` (:meth:`security`)."""

    endpoints: tuple[str, ...] = ()
    """The etcd cluster's members: a YAML list, or comma-separated text (``a:2379,b:2379``);
    each ``host:port``, ``http://host:port`` or ``https://host:port``
    (:mod:`kvstore.membership.endpoints`). The client fails over between them
    (docs/etcd-failover.md)."""
    prefix: str = "/kvtier/"
    ttl_s: int = 10
    """The node's key disappears this long after the daemon dies."""
    ca_file: Path | None = None
    """CA bundle (PEM) of etcd's server certificate: TLS to etcd (``--etcd-ca``)."""
    cert_file: Path | None = None
    """Client certificate (PEM) for etcd's ``--client-cert-auth`` (``--etcd-cert``)."""
    key_file: Path | None = None
    """Its private key (``--etcd-key``)."""
    username: str | None = None
    """etcd user to authenticate as (``--etcd-user``)."""
    password: str | None = field(default=None, repr=False)
    """That user's password; prefer ``password_file``. Never shown (``repr``, ``--print-config``
    and log lines leave it out)."""
    password_file: Path | None = None
    """File holding the user's password, re-read whenever the client authenticates
    (``--etcd-password-file``)."""
    server_name: str | None = None
    """Name to check etcd's certificate against when it is not the dialed host
    (``--etcd-server-name``)."""

    def __post_init__(self) -> None:
        _require(self.ttl_s >= 2, f"ttl_s must be >= 2 seconds, got {self.ttl_s}")
        _require(self.prefix.startswith("/") and self.prefix.endswith("/"),
                 f"prefix must start and end with '/', got {self.prefix!r}")
        try:
            endpoints = (tuple(str(e) for e in parse_etcd_endpoints(self.endpoints))
                         if self.endpoints else ())
        except InvalidArgument as exc:
            raise ConfigError(str(exc)) from exc
        object.__setattr__(self, "endpoints", endpoints)  # "a:1, b:2" split, stripped
        self.security()  # inconsistent settings fail here

    @property
    def endpoint(self) -> str | None:
        """The endpoints as comma-separated text, None when off: the older spelling (the loader
        reads an ``etcd.endpoint`` key, ``--etcd`` or ``KVTIER_ETCD__ENDPOINT`` as
        ``endpoints``)."""
        return ",".join(self.endpoints) or None

    @property
    def enabled(self) -> bool:
        """Whether the daemon registers in etcd (some endpoint is configured)."""
        return bool(self.endpoints)

    def security(self) -> EtcdSecurity:
        """What the daemon presents to etcd. Raises ConfigError for inconsistent settings (a
        certificate without its key, a user without a password, ...)."""
        return EtcdSecurity(ca_file=self.ca_file, cert_file=self.cert_file,
                            key_file=self.key_file, username=self.username,
                            password=self.password, password_file=self.password_file,
                            server_name=self.server_name)


@dataclass(frozen=True, slots=True)
class EventsConfig:
    ring_capacity: int = 65536
    """Events kept for replay; a subscriber further behind must resync from a snapshot."""

    def __post_init__(self) -> None:
        _require(self.ring_capacity >= 1, f"ring_capacity must be >= 1, got "
                 f"{self.ring_capacity}")


@dataclass(frozen=True, slots=True)
class ShutdownConfig:
    drain_timeout_s: float = 10.0
    """How long a graceful stop lets transfers in flight finish."""
    persist_dram: bool = False
    """On a graceful stop, demote every DRAM chunk to NVMe first (so a restart keeps it)."""

    def __post_init__(self) -> None:
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")


@dataclass(frozen=True, slots=True)
class TenantsConfig:
    """Per-tenant figures and quotas (docs/tenants.md)."""

    max_tracked: int = DEFAULT_MAX_TENANTS
    """Tenants with a metrics label of their own; the others are counted under ``(other)``."""
    quotas: tuple[str, ...] = ()
    """``TENANT:TIER:max=SIZE;guaranteed=SIZE`` entries (``kvstore.node.tenants.parse_quota``;
    in text, entries are separated by ``,``)."""

    def __post_init__(self) -> None:
        _require(0 <= self.max_tracked <= 100_000,
                 f"max_tracked must be 0..100000, got {self.max_tracked}")
        self.quota_list()

    def quota_list(self) -> tuple[TenantQuota, ...]:
        """The quotas, parsed (ConfigError naming a bad entry)."""
        return tuple(parse_quota(spec) for spec in self.quotas)


def default_node_id() -> str:
    """This host's name, reduced to the characters a node id allows."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._") or "node"
    return name[:128]


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything one store daemon needs. Build with :func:`load_config`."""

    node_id: str = field(default_factory=default_node_id)
    log_level: str = "INFO"
    dram: DramConfig = field(default_factory=DramConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)
    hbm: HbmConfig = field(default_factory=HbmConfig)
    cache: CacheSection = field(default_factory=CacheSection)
    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    security: ServerSecurity = field(default_factory=ServerSecurity)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)

    def __post_init__(self) -> None:
        _require(bool(_ID_RE.match(self.node_id)),
                 f"node_id must be 1-128 characters of [A-Za-z0-9._-], got {self.node_id!r}")
        _require(self.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR"},
                 f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")
        _require(self.cache.lease_ttl_s <= self.server.max_ttl_s,
                 f"cache.lease_ttl_s ({self.cache.lease_ttl_s}) must be <= server.max_ttl_s "
                 f"({self.server.max_ttl_s})")
        if self.cache.write_tier is not None:
            _require(self.cache.write_tier in self.tier_kinds(),
                     f"cache.write_tier {self.cache.write_tier.value} is not configured")
        # Quotas against the configured capacities (the cache checks them again against the
        # real ones, which the filesystem may lower for NVMe).
        capacity = {TierKind.HBM: self.hbm.capacity_bytes, TierKind.DRAM: self.dram.capacity_bytes,
                    TierKind.NVME: self.nvme.capacity_bytes}
        try:
            quota_table(self.tenants.quota_list(), {k: capacity[k] for k in self.tier_kinds()})
        except ConfigError as exc:
            raise ConfigError(f"tenants.quotas: {exc}") from None

    def tier_kinds(self) -> tuple[TierKind, ...]:
        kinds = [TierKind.DRAM]
        if self.hbm.capacity_bytes > 0:
            kinds.insert(0, TierKind.HBM)
        if self.nvme.directory is not None:
            kinds.append(TierKind.NVME)
        return tuple(kinds)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (enums by value, paths as text, tuples as lists): what ``kvtier daemon
        --print-config`` shows, and a valid config file when dumped as YAML, except that an
        etcd password reads :data:`HIDDEN`."""
        plain: dict[str, Any] = _plain(self)
        if plain["etcd"]["password"] is not None:
            plain["etcd"]["password"] = HIDDEN
        return plain


# --- loading -------------------------------------------------------------------------------------


def load_config(path: Path | str | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, str] | None = None) -> DaemonConfig:
    """Defaults < file ``path`` < environment ``env`` (default ``os.environ``) < ``overrides``
    (``{"dram.capacity_bytes": "1GiB"}``). Raises ConfigError naming the key and its source."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        layers.append((f"file {path}", _read_file(Path(path))))
    layers.append(("environment", _from_env(os.environ if env is None else env)))
    layers.append(("flags", _from_overrides(overrides or {})))
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, tree in layers:
        _fold_aliases(tree, source)
        _merge(merged, tree, sources, source, prefix="")
    config: DaemonConfig = _build(DaemonConfig, merged, sources, prefix="")
    return config


def _fold_aliases(tree: dict[str, Any], source: str) -> None:
    """Read ``etcd.endpoint`` (the single-endpoint spelling) as ``etcd.endpoints``, within one
    layer, so a later layer's either spelling beats an earlier one's."""
    etcd = tree.get("etcd")
    if not isinstance(etcd, dict) or "endpoint" not in etcd:
        return
    if "endpoints" in etcd:
        raise ConfigError(f"etcd: give endpoints or endpoint, not both ({source})")
    etcd["endpoints"] = etcd.pop("endpoint")


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    try:
        if path.suffix in (".yaml", ".yml"):
            doc = yaml.safe_load(text)
        elif path.suffix == ".toml":
            doc = tomllib.loads(text)
        else:
            raise ConfigError(f"config file {path} must end in .yaml, .yml or .toml")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} does not parse: {exc}") from exc
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return doc


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    top = {f.name for f in dataclasses.fields(DaemonConfig)}
    tree: dict[str, Any] = {}
    for name, key in _ETCD_SECURITY_ENV.items():
        if env.get(name, "").strip():
            tree.setdefault("etcd", {})[key] = _Text(env[name].strip() if key != "password"
                                                     else env[name], f"environment {name}")
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        if "__" in rest:
            section, _, key = rest.partition("__")
            if "__" in key:
                raise ConfigError(f"environment {name}: one '__' between section and field")
            tree.setdefault(section, {})[key] = _Text(value, f"environment {name}")
        elif rest in top:
            tree[rest] = _Text(value, f"environment {name}")
    return tree


def _from_overrides(overrides: Mapping[str, str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if not all(parts) or len(parts) > 2:
            raise ConfigError(f"flag key {dotted!r} must be 'field' or 'section.field'")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _Text(value, f"flag {dotted}")
    return tree


@dataclass(frozen=True, slots=True)
class _Text:
    """A value given as text (environment or flag): coerced to the field's type."""

    text: str
    source: str


def _merge(into: dict[str, Any], tree: Mapping[str, Any], sources: dict[str, str], source: str,
           prefix: str) -> None:
    for key, value in tree.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r} must be text")
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            existing = into.get(key)
            if existing is not None and not isinstance(existing, dict):
                raise ConfigError(f"{dotted}: expected a section ({source})")
            _merge(into.setdefault(key, {}), value, sources, source, f"{dotted}.")
        else:
            into[key] = value
            sources[dotted] = value.source if isinstance(value, _Text) else source


def _build(cls: type[Any], values: Mapping[str, Any], sources: Mapping[str, str],
           prefix: str) -> Any:
    hints = typing.get_type_hints(cls, include_extras=True)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            where = sources.get(f"{prefix}{key}", "config")
            raise ConfigError(f"{prefix}{key}: unknown key ({where}); known keys: "
                              f"{', '.join(sorted(known))}")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        dotted = f"{prefix}{name}"
        hint = hints[name]
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{dotted}: expected a section, got {value!r}")
            kwargs[name] = _build(hint, value, sources, f"{dotted}.")
        else:
            kwargs[name] = _coerce(hint, value, dotted, sources.get(dotted, "config"))
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        where = ", ".join(sorted({sources[k] for k in sources if k.startswith(prefix)})) or \
            "defaults"
        label = prefix.rstrip(".") or "config"
        raise ConfigError(f"{label}: {exc} ({where})") from exc


def _coerce(hint: Any, value: Any, key: str, source: str) -> Any:
    text = value.text if isinstance(value, _Text) else None
    raw: Any = text if text is not None else value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.strip().lower() in _NONE):
            return None
        hint = args[0]

    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{key}: expected {expected}, got {raw!r} ({source})")

    if typing.get_origin(hint) is Annotated:
        if not any(isinstance(m, _SizeMarker) for m in hint.__metadata__):
            raise ConfigError(f"{key}: unsupported config type {hint!r}")  # a bug here
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            m = _SIZE_RE.match(raw)
            if m:
                return int(m.group(1).replace("_", "")) * _UNITS[m.group(2)]
        raise bad("a size in bytes (4096, 64KiB, 1GiB)")
    if typing.get_origin(hint) is tuple:
        if typing.get_args(hint) != (str, Ellipsis):
            raise ConfigError(f"{key}: unsupported config type {hint!r}")  # a bug here
        if isinstance(raw, str):  # text (environment, flags, a YAML string): comma-separated
            return () if raw.strip().lower() in _NONE else tuple(raw.split(","))
        if isinstance(raw, list | tuple) and all(isinstance(item, str) for item in raw):
            return tuple(raw)
        raise bad("a list of text, or comma-separated text")
    if hint is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
            return raw.strip().lower() in _TRUE
        raise bad("true or false")
    if hint is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str):
            try:
                return int(raw.replace("_", ""))
            except ValueError:
                pass
        raise bad("an integer")
    if hint is float:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, str):
            try:
                return float(raw)
            except ValueError:
                pass
        raise bad("a number")
    if hint is str:
        if isinstance(raw, str):
            return raw
        raise bad("text")
    if hint is Path:
        if isinstance(raw, str) and raw:
            return Path(raw).expanduser()
        raise bad("a path")
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(raw.lower() if isinstance(raw, str) else raw)
        except ValueError:
            choices = ", ".join(str(m.value) for m in hint)
            raise bad(f"one of {choices}") from None
    raise ConfigError(f"{key}: unsupported config type {hint!r}")  # a bug in this module


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, tuple):
        return [_plain(item) for item in obj]
    return obj

"""Per-tenant accounting of one daemon: counters with bounded label cardinality, and quotas.

:class:`TenantMeter` counts, per tenant, what the cache did for it (hits, misses, bytes read and
written, refused requests); the bytes each tenant holds per tier are the index's
(:meth:`~kvstore.node.index.CacheIndex.tenant_usage`). The daemon exports both on ``/metrics``
and in the Stats RPC (``docs/tenants.md``).

Bounded cardinality
    A tenant gets a label of its own only when it **stores** a chunk (a put, a commit, a chunk
    recovered as its) while fewer than ``max_tenants`` are tracked; tracked tenants stay
    tracked for the daemon's life. Everything of the others is counted under
    :data:`OTHER_LABEL`. Reads, misses and refusals never create a label: a caller naming
    tenants it may not use (refused) cannot push real tenants out of the table. The default
    tenant is labelled :data:`DEFAULT_LABEL`. (A tenant literally named like one of the two
    labels shares its series.)

Attribution
    Hits and bytes read go to the tenant the read acted for; a read for every tenant (an
    operator naming none, an unscoped data-plane connection, a daemon without security) goes
    to the owner of the chunk read. Misses and refusals go to the tenant the call named (or
    the default tenant). Lease-free same-host reads (the read index) carry no tenant and are
    counted per tier only.

Quotas (:class:`TenantQuota`, configured per tenant and tier): ``max_bytes`` caps what a tenant
holds in a tier (a put over it first evicts the tenant's own chunks there, and is refused with
:class:`~kvstore.errors.CapacityError` naming the tenant and the quota when that cannot make
room); ``guaranteed_bytes`` is a floor that eviction driven by another tenant's writes never
takes the tenant below in that tier. The rules as the index applies them: ``CacheIndex``,
"Quotas".

Thread safety: every method may be called from any thread (one lock, held for a dict update).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvstore.dataplane.tier import TierKind
from kvstore.errors import ConfigError

DEFAULT_LABEL = "(default)"
"""The label of the default tenant (``""``)."""
OTHER_LABEL = "(other)"
"""The label every untracked tenant is counted under."""
DEFAULT_MAX_TENANTS = 64


@dataclass(slots=True)
class TenantCounters:
    """What the cache did for one tenant (or for every untracked one) since start."""

    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    refused: int = 0


@dataclass(frozen=True, slots=True)
class TenantReport:
    """One label's counters and bytes held per tier (a snapshot)."""

    label: str
    tenant: str | None
    """The tenant (None: :data:`OTHER_LABEL`, every untracked tenant together)."""
    counters: TenantCounters
    used_bytes: Mapping[TierKind, int] = field(default_factory=dict)
    quotas: Mapping[TierKind, TenantQuota] = field(default_factory=dict)
    """The tenant's quotas by tier (none for the other label)."""


class TenantMeter:
    """Per-tenant counters under at most ``max_tenants`` labels (module docstring)."""

    def __init__(self, max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        if not isinstance(max_tenants, int) or max_tenants < 0:
            raise ConfigError(f"max_tenants must be an int >= 0, got {max_tenants!r}")
        self.max_tenants = max_tenants
        self._lock = threading.Lock()
        self._counters: dict[str, TenantCounters] = {}
        self._other = TenantCounters()

    def _slot(self, tenant: str | None, create: bool) -> TenantCounters:
        """Caller holds the lock."""
        if tenant is None:
            return self._other
        c = self._counters.get(tenant)
        if c is None:
            if not create or len(self._counters) >= self.max_tenants:
                return self._other
            c = self._counters[tenant] = TenantCounters()
        return c

    def tracked(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self._counters

    def track(self, tenants: Iterable[str]) -> None:
        """Give these tenants labels while there is room (chunks stored as them)."""
        with self._lock:
            for tenant in tenants:
                self._slot(tenant, True)

    def stored(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            self._slot(tenant, True).bytes_written += nbytes

    def read(self, tenant: str | None, nbytes: int, hits: int = 1) -> None:
        with self._lock:
            c = self._slot(tenant, False)
            c.hits += hits
            c.bytes_read += nbytes

    def missed(self, tenant: str | None, misses: int = 1) -> None:
        with self._lock:
            self._slot(tenant, False).misses += misses

    def refused(self, tenant: str | None) -> None:
        with self._lock:
            self._slot(tenant, False).refused += 1

    def label(self, tenant: str | None) -> str:
        """The label ``tenant``'s figures are exported under."""
        with self._lock:
            if tenant is None or tenant not in self._counters:
                return OTHER_LABEL
        return tenant_label(tenant)

    def report(self, used: Mapping[TierKind, Mapping[str, int]] | None = None
               ) -> list[TenantReport]:
        """Every tracked tenant, then :data:`OTHER_LABEL` (always present), with the bytes
        ``used`` (``CacheIndex.tenant_usage()``) says each holds per tier, untracked tenants'
        bytes summed under the other label."""
        used = used or {}
        with self._lock:
            tracked = {t: _copy(c) for t, c in self._counters.items()}
            other = _copy(self._other)
        held: dict[str | None, dict[TierKind, int]] = {t: {} for t in tracked}
        held[None] = {}
        for tier, by_tenant in used.items():
            for tenant, nbytes in by_tenant.items():
                row = held[tenant if tenant in tracked else None]
                row[tier] = row.get(tier, 0) + nbytes
        out = [TenantReport(tenant_label(t), t, c, held[t]) for t, c in sorted(tracked.items())]
        out.append(TenantReport(OTHER_LABEL, None, other, held[None]))
        return out


def tenant_label(tenant: str) -> str:
    return DEFAULT_LABEL if tenant == "" else tenant


def _copy(c: TenantCounters) -> TenantCounters:
    return TenantCounters(c.hits, c.misses, c.bytes_read, c.bytes_written, c.refused)


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """One tenant's limits in one tier (bytes; see the module docstring)."""

    tenant: str
    tier: TierKind
    max_bytes: int | None = None
    """A cap on what the tenant holds in the tier (None: no cap)."""
    guaranteed_bytes: int = 0
    """What eviction driven by other tenants' writes leaves the tenant in the tier."""

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or len(self.tenant) > 128 or "," in self.tenant:
            raise ConfigError(f"quota tenant must be a tenant name (at most 128 characters, no "
                              f"','), got {self.tenant!r}")
        if not isinstance(self.tier, TierKind):
            raise ConfigError(f"quota tier must be a TierKind, got {self.tier!r}")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int)
                                           or self.max_bytes < 1):
            raise ConfigError(f"tenant {self.tenant!r} in {self.tier.value}: max_bytes must be "
                              f"a positive number of bytes, got {self.max_bytes!r}")
        if not isinstance(self.guaranteed_bytes, int) or self.guaranteed_bytes < 0:
            raise ConfigError(f"tenant {self.tenant!r} in {self.tier.value}: guaranteed_bytes "
                              f"must be >= 0, got {self.guaranteed_bytes!r}")
        if self.max_bytes is not None and self.guaranteed_bytes > self.max_bytes:
            raise ConfigError(f"tenant {self.tenant!r} in {self.tier.value}: guaranteed_bytes "
                              f"({self.guaranteed_bytes}) exceeds max_bytes ({self.max_bytes})")


_SIZE_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_quota(spec: str) -> TenantQuota:
    """One quota from its config text ``TENANT:TIER:LIMITS``: ``LIMITS`` is ``max=SIZE``
    and/or ``guaranteed=SIZE`` joined by ``;`` (sizes as ``4096``, ``64MiB``, ``1GiB``); the
    tenant may be empty (the default tenant) and may itself hold ``:``. Examples:
    ``alice:dram:max=4GiB;guaranteed=1GiB``, ``:nvme:max=100GiB``. Raises ConfigError."""
    parts = spec.strip().rsplit(":", 2)
    if len(parts) != 3:
        raise ConfigError(f"quota {spec!r} must read TENANT:TIER:max=SIZE;guaranteed=SIZE")
    tenant, tier_name, limits = parts
    try:
        tier = TierKind(tier_name.strip().lower())
    except ValueError:
        raise ConfigError(f"quota {spec!r}: tier must be one of "
                          f"{', '.join(t.value for t in TierKind)}") from None
    values: dict[str, int] = {}
    for item in limits.split(";"):
        name, eq, size = item.partition("=")
        name = name.strip()
        if not eq or name not in ("max", "guaranteed") or name in values:
            raise ConfigError(f"quota {spec!r}: limits are max=SIZE and/or guaranteed=SIZE, "
                              f"each once, joined by ';'")
        values[name] = _size(size, spec)
    if not values:
        raise ConfigError(f"quota {spec!r} sets no limit")
    return TenantQuota(tenant, tier, values.get("max"), values.get("guaranteed", 0))


def _size(text: str, spec: str) -> int:
    t = text.strip().replace("_", "")
    digits = t.rstrip("BKMGTi")
    unit = t[len(digits):]
    if not digits.isdigit() or unit not in _SIZE_UNITS:
        raise ConfigError(f"quota {spec!r}: {text!r} is not a size in bytes (4096, 64MiB, "
                          "1GiB; binary units only)")
    return int(digits) * _SIZE_UNITS[unit]


def quota_table(quotas: Iterable[TenantQuota], capacity_bytes: Mapping[TierKind, int]
                ) -> dict[TierKind, dict[str, TenantQuota]]:
    """The quotas by tier and tenant, checked against the tiers' capacities: one quota per
    tenant and tier, every tier configured, and the guarantees of a tier summing to at most its
    capacity (they could not all be kept otherwise). Raises ConfigError, naming the problem."""
    table: dict[TierKind, dict[str, TenantQuota]] = {}
    for q in quotas:
        if q.tier not in capacity_bytes:
            raise ConfigError(f"quota for tenant {q.tenant!r} names tier {q.tier.value}, which "
                              "is not configured")
        row = table.setdefault(q.tier, {})
        if q.tenant in row:
            raise ConfigError(f"two quotas for tenant {q.tenant!r} in {q.tier.value}")
        row[q.tenant] = q
    for tier, row in table.items():
        floor = sum(q.guaranteed_bytes for q in row.values())
        if floor > capacity_bytes[tier]:
            raise ConfigError(f"the guaranteed shares in {tier.value} sum to {floor} bytes, more "
                              f"than the tier's {capacity_bytes[tier]}")
    return table

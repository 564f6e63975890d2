"""Prometheus metrics of one store daemon.

Everything lives in the daemon's own ``CollectorRegistry`` (no global registry is touched, so
two daemons in one test process do not collide). Two kinds of metric:

* recorded as they happen: ``kvtier_rpc_seconds{method,code}`` (a histogram per gRPC method)
  and ``kvtier_inline_bytes_total{direction}`` (values carried inside gRPC messages);
* read at scrape time from the daemon's parts through :class:`MetricsSource` (cheap snapshots,
  no locks held across the scrape): per tier ``kvtier_tier_{capacity,used}_bytes``,
  ``kvtier_tier_chunks``, ``kvtier_{hits,puts,evictions,demotions,promotions,corrupt}_total``,
  ``kvtier_misses_total``, ``kvtier_bytes_moved_total{path,direction}`` (path: ``tier`` reads
  and writes of each tier, ``tcp``, ``shm``, ``inline``), ``kvtier_events_last_seq``,
  ``kvtier_shm_leases_open{kind}`` and ``kvtier_tcp_connections_open``;
* per tenant, read at scrape time from ``tenant_source`` (the cache's
  :meth:`~kvstore.node.cache.TieredCache.tenant_report`):
  ``kvtier_tenant_{hits,misses,bytes_read,bytes_written,refused}_total{tenant}``,
  ``kvtier_tenant_used_bytes{tenant,tier}``, ``kvtier_tenant_quota_bytes{tenant,tier,kind}``
  (``kind``: ``max``, ``guaranteed``) and ``kvtier_tenants_tracked``. The ``tenant``
  label takes at most ``tenants.max_tracked`` tenant names plus ``(default)`` and ``(other)``
  (every untracked tenant together): :mod:`kvstore.node.tenants`, "Bounded cardinality".

Eviction here means a chunk dropped from a tier (``drops``); a demotion moves it down a tier and
is counted separately.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvstore.dataplane.tier import TierStats
from kvstore.node.cache import TierReport
from kvstore.node.tenants import TenantReport
from kvstore.security.config import ServerSecurity
from kvstore.security.http import SecureHttpEndpoint
from kvstore.security.server import SecureServing

log = logging.getLogger(__name__)

RPC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 10.0)


@dataclass(frozen=True, slots=True)
class MetricsSnapshot:
    tiers: list[TierReport]
    misses: int
    events_last_seq: int
    shm_leases_open: tuple[int, int]
    shm_bytes: tuple[int, int]
    """(read by clients, written by clients)"""
    tcp_bytes: tuple[int, int]
    """(sent, received)"""
    tcp_connections_open: int
    dram_arenas: tuple[tuple[str, TierStats], ...] = ()
    """Each DRAM arena's stats by name, with ``dram.arena_groups`` (the default arena: "")."""


class MetricsSource(Protocol):
    def metrics_snapshot(self) -> MetricsSnapshot: ...


class _ScrapeCollector(Collector):
    def __init__(self, metrics: DaemonMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        source = self._metrics.source
        if source is None:
            return
        snap = source.metrics_snapshot()
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Tier capacity.", labels=["tier"])
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes stored in the tier.",
                                 labels=["tier"])
        chunks = GaugeMetricFamily("kvtier_tier_chunks", "Chunks in the tier.", labels=["tier"])
        counters = {
            name: CounterMetricFamily(f"kvtier_{name}", help_text, labels=["tier"])
            for name, help_text in (
                ("hits", "Chunks read from the tier."),
                ("puts", "Chunks written into the tier by puts."),
                ("evictions", "Chunks dropped from the tier."),
                ("demotions", "Chunks moved from the tier to the one below."),
                ("promotions", "Chunks moved into the tier from the one below."),
                ("corrupt", "Chunks found corrupt in the tier (and dropped), also at open."),
            )
        }
        moved = CounterMetricFamily("kvtier_bytes_moved", "Bytes moved, by path and direction.",
                                    labels=["path", "direction"])
        for report in snap.tiers:
            tier = report.kind.value
            cap.add_metric([tier], report.stats.capacity_bytes)
            used.add_metric([tier], report.stats.used_bytes)
            chunks.add_metric([tier], report.stats.chunks)
            c = report.counters
            for name, value in (("hits", c.hits), ("puts", c.puts), ("evictions", c.drops),
                                ("demotions", c.demotions_out), ("promotions", c.promotions_in),
                                ("corrupt", report.corrupt)):
                counters[name].add_metric([tier], value)
            moved.add_metric([f"tier_{tier}", "read"], c.bytes_read)
            moved.add_metric([f"tier_{tier}", "write"], c.bytes_written)
        moved.add_metric(["tcp", "sent"], snap.tcp_bytes[0])
        moved.add_metric(["tcp", "received"], snap.tcp_bytes[1])
        moved.add_metric(["shm", "read"], snap.shm_bytes[0])
        moved.add_metric(["shm", "write"], snap.shm_bytes[1])
        yield cap
        yield used
        yield chunks
        yield from counters.values()
        yield moved
        yield CounterMetricFamily("kvtier_misses", "Reads of chunks no tier holds.",
                                  value=snap.misses)
        yield GaugeMetricFamily("kvtier_events_last_seq", "Sequence number of the newest event.",
                                value=snap.events_last_seq)
        leases = GaugeMetricFamily("kvtier_shm_leases_open", "Same-host leases outstanding.",
                                   labels=["kind"])
        leases.add_metric(["read"], snap.shm_leases_open[0])
        leases.add_metric(["write"], snap.shm_leases_open[1])
        yield leases
        yield GaugeMetricFamily("kvtier_tcp_connections_open", "Open data-plane connections.",
                                value=snap.tcp_connections_open)
        if snap.dram_arenas:
            families = [GaugeMetricFamily(f"kvtier_dram_arena_{what}", text, labels=["arena"])
                        for what, text in (
                            ("capacity_bytes", "Capacity of a DRAM arena (dram.arena_groups)."),
                            ("used_bytes", "Bytes stored in a DRAM arena."),
                            ("chunks", "Chunks in a DRAM arena."))]
            for name, stats in snap.dram_arenas:
                label = name or "(default)"
                for family, value in zip(families, (stats.capacity_bytes, stats.used_bytes,
                                                    stats.chunks), strict=True):
                    family.add_metric([label], value)
            yield from families
        tenants = self._metrics.tenant_source
        if tenants is not None:
            yield from _tenant_families(tenants())


def _tenant_families(reports: list[TenantReport]
                     ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    counters = {
        name: CounterMetricFamily(f"kvtier_tenant_{name}", help_text, labels=["tenant"])
        for name, help_text in (
            ("hits", "Chunks read for the tenant."),
            ("misses", "Reads for the tenant that found nothing."),
            ("bytes_read", "Bytes read for the tenant."),
            ("bytes_written", "Bytes stored by the tenant's puts."),
            ("refused", "Requests of the tenant refused (another tenant's key, a quota, a "
                        "tenant its credentials do not name)."),
        )
    }
    used = GaugeMetricFamily("kvtier_tenant_used_bytes", "Bytes the tenant holds in the tier.",
                             labels=["tenant", "tier"])
    quota = GaugeMetricFamily("kvtier_tenant_quota_bytes", "The tenant's cap (max) and "
                              "guaranteed share in the tier, where configured.",
                              labels=["tenant", "tier", "kind"])
    for r in reports:
        c = r.counters
        for name, value in (("hits", c.hits), ("misses", c.misses),
                            ("bytes_read", c.bytes_read), ("bytes_written", c.bytes_written),
                            ("refused", c.refused)):
            counters[name].add_metric([r.label], value)
        for tier, nbytes in r.used_bytes.items():
            used.add_metric([r.label, tier.value], nbytes)
        for tier, q in r.quotas.items():
            if q.max_bytes is not None:
                quota.add_metric([r.label, tier.value, "max"], q.max_bytes)
            if q.guaranteed_bytes:
                quota.add_metric([r.label, tier.value, "guaranteed"], q.guaranteed_bytes)
    yield from counters.values()
    yield used
    yield quota
    yield GaugeMetricFamily("kvtier_tenants_tracked", "Tenants with a label of their own.",
                            value=sum(r.tenant is not None for r in reports))


class DaemonMetrics:
    """The daemon's registry and recorders. Nothing is served until :meth:`serve`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.source: MetricsSource | None = None
        self.tenant_source: Callable[[], list[TenantReport]] | None = None
        """Per-tenant figures at scrape time (set by whoever wires the cache in)."""
        self.rpc_seconds = Histogram("kvtier_rpc_seconds", "gRPC call latency.",
                                     ["method", "code"], buckets=RPC_BUCKETS_S,
                                     registry=self.registry)
        self.inline_bytes = Counter("kvtier_inline_bytes", "Value bytes carried inside gRPC.",
                                    ["direction"], registry=self.registry)
        self.registry.register(_ScrapeCollector(self))
        self._server: SecureHttpEndpoint | None = None
        self.port: int | None = None

    def render(self) -> bytes:
        """The text exposition format, as the HTTP endpoint serves it."""
        return generate_latest(self.registry)

    def serve(self, host: str, port: int, security: ServerSecurity | None = None,
              serving: SecureServing | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: ephemeral) under the daemon's ``security``
        (:class:`kvstore.security.http.SecureHttpEndpoint`: loopback only without it, an
        operator's credentials and TLS with it; ``serving``: the gRPC port's, whose rotated
        certificates and CRL it shares); return the port. Raises ConfigError for a binding
        the daemon's gRPC port would refuse as well."""
        endpoint = SecureHttpEndpoint(security or ServerSecurity(), host, port, self.render,
                                      "the daemon's metrics endpoint", serving=serving)
        self.port = endpoint.start()
        self._server = endpoint
        return self.port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()

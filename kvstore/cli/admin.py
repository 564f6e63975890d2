"""Operator commands against live daemons: ``kvtier nodes|stats|ls|inspect|evict|pin|unpin|drain``.

A daemon is named by its gRPC address (``--address host:port``); ``nodes`` and ``stats`` can
instead find every daemon through etcd (``--etcd host:port``). Keys are written in hex (the
store's keys are binary prefix hashes). Every command prints a readable table, or one JSON
document with ``--json`` (for scripts). Exit status: 0 on success, 1 when a daemon answered
with an error or could not be reached, 2 for bad arguments.

Credentials (docs/security.md): ``--ca`` (the CA of the daemon's certificate: TLS), ``--cert``
and ``--key`` (an operator's client certificate: mTLS) or ``--token-file`` (an operator's
bearer token); each defaults to ``KVTIER_TLS_CA``, ``KVTIER_TLS_CERT``, ``KVTIER_TLS_KEY``,
``KVTIER_TOKEN_FILE``. A refused call exits 1 with ``Unauthenticated`` or ``PermissionDenied``.

Tenant: ``--tenant NAME`` sends ``kvtier-tenant: NAME`` on every call
(``StoreClientConfig.tenant``), so an operator of every tenant sees and acts on that tenant's
chunks only (``ls``, ``inspect``, ``pin``, ``evict --prefix``); without it such an operator sees
every tenant. An operator whose credentials name tenants may act only for those
(PermissionDenied otherwise). ``unpin`` takes it too (a pin's lease is the operator session's).
``stats`` and ``drain`` are node-wide and have none; ``evict --bytes`` acts on every tenant, so
the daemon refuses it scoped to one. A name that is not printable ASCII of at most 128
characters exits 2.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from kvstore.cli.etcd_options import (
    ETCD_CA,
    ETCD_CERT,
    ETCD_ENDPOINTS_HELP,
    ETCD_KEY,
    ETCD_PASSWORD_FILE,
    ETCD_SERVER_NAME,
    ETCD_USER,
    apply_etcd_options,
)
from kvstore.errors import KvtierError

ADDRESS = typer.Option(..., "--address", "-a", help="The daemon's gRPC address, host:port.")
JSON = typer.Option(False, "--json", help="Print one JSON document instead of a table.")
TIERS = ("hbm", "dram", "nvme")
CA = typer.Option(None, "--ca", help="CA of the daemon's certificate (TLS); env KVTIER_TLS_CA.")
CERT = typer.Option(None, "--cert", help="Client certificate (mTLS); env KVTIER_TLS_CERT.")
KEY = typer.Option(None, "--key", help="Its private key; env KVTIER_TLS_KEY.")
TOKEN_FILE = typer.Option(None, "--token-file", help="Bearer token file; env KVTIER_TOKEN_FILE.")
TENANT = typer.Option(None, "--tenant", help="Act for this tenant only (kvtier-tenant metadata); "
                      "default: every tenant the credentials allow.")


@dataclass(frozen=True)
class _Creds:
    ca: Path | None
    cert: Path | None
    key: Path | None
    token_file: Path | None
    tenant: str | None = None

    def security(self, command: str) -> Any:
        from kvstore.errors import ConfigError
        from kvstore.security.config import ClientSecurity

        try:
            return ClientSecurity.from_env().merged(ca_file=self.ca, cert_file=self.cert,
                                                    key_file=self.key,
                                                    token_file=self.token_file)
        except ConfigError as exc:
            raise _fail(command, exc, 2) from exc


def _fail(command: str, exc: Exception, code: int = 1) -> typer.Exit:
    typer.echo(f"kvtier {command}: {type(exc).__name__}: {exc}", err=True)
    return typer.Exit(code)


def _hex(text: str, what: str) -> bytes:
    try:
        value = bytes.fromhex(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not hex", param_hint=what) from None
    return value


def _tier(name: str | None) -> Any:
    from kvstore.dataplane.tier import TierKind

    if name is None:
        return None
    try:
        return TierKind(name.lower())
    except ValueError:
        raise typer.BadParameter(f"{name!r} is not one of {', '.join(TIERS)}",
                                 param_hint="--tier") from None


@contextmanager
def _client(command: str, address: str, creds: _Creds) -> Iterator[Any]:
    from kvstore.client.daemon_control import operator_session
    from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig

    security = creds.security(command)
    try:
        config = StoreClientConfig(data_plane=DataPlane.TCP, rpc_timeout_s=10.0,
                                   session=operator_session(), security=security,
                                   tenant=creds.tenant)
    except KvtierError as exc:  # a bad --tenant
        raise _fail(command, exc, 2) from exc
    try:  # the operator's session: `kvtier unpin` may end what `kvtier pin` took
        client = StoreClient.connect(address, config)
    except KvtierError as exc:
        raise _fail(command, exc) from exc
    try:
        yield client
    except KvtierError as exc:
        raise _fail(command, exc) from exc
    finally:
        client.close()


def _emit(as_json: bool, doc: Any, table: Callable[[], None]) -> None:
    if as_json:
        typer.echo(json.dumps(doc, indent=2, sort_keys=True))
    else:
        table()


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in ("node", "tier", "key", "parent") else "right")
    for row in rows:
        t.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # a pipe: don't squeeze the table to 80 columns
    console.print(t)


def entry_doc(entry: Any) -> dict[str, Any]:
    from kvstore.wire import PB_TO_TIER

    return {"key": entry.key.hex(), "parent": entry.parent.hex() or None,
            "tier": PB_TO_TIER[entry.tier].value, "size_bytes": entry.size_bytes,
            "depth": entry.depth, "access_count": entry.access_count,
            "children": entry.children, "pinned": entry.pinned,
            "age_s": round(entry.age_s, 3), "idle_s": round(entry.idle_s, 3)}


async def _list_nodes(endpoint: str, prefix: str) -> dict[str, Any]:
    from kvstore.membership.etcd import KeyLayout, etcd_client
    from kvstore.membership.nodes import list_nodes

    async with etcd_client(endpoint) as client:
        return await list_nodes(client, layout=KeyLayout(prefix))


def _etcd_security(command: str, *options: Any) -> None:
    """Apply the ``--etcd-*`` options (:mod:`kvstore.cli.etcd_options`); exit 2 when bad."""
    try:
        apply_etcd_options(*options)
    except KvtierError as exc:
        raise _fail(command, exc, code=2) from exc


def _nodes_from_etcd(command: str, endpoint: str, prefix: str) -> dict[str, Any]:
    try:
        return asyncio.run(_list_nodes(endpoint, prefix))
    except KvtierError as exc:
        raise _fail(command, exc) from exc


# --- commands ------------------------------------------------------------------------------------


def nodes(
    etcd: str = typer.Option(..., "--etcd", help=ETCD_ENDPOINTS_HELP),
    prefix: str = typer.Option("/kvtier/", "--prefix", help="The cluster's etcd key prefix."),
    as_json: bool = JSON,
    etcd_ca: Path | None = ETCD_CA,
    etcd_cert: Path | None = ETCD_CERT,
    etcd_key: Path | None = ETCD_KEY,
    etcd_user: str | None = ETCD_USER,
    etcd_password_file: Path | None = ETCD_PASSWORD_FILE,
    etcd_server_name: str | None = ETCD_SERVER_NAME,
) -> None:
    """The store daemons registered in etcd."""
    _etcd_security("nodes", etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file,
                   etcd_server_name)
    records = _nodes_from_etcd("nodes", etcd, prefix)
    doc = [record.to_dict() for record in records.values()]

    def table() -> None:
        _table(f"{len(doc)} node(s) in {etcd}{prefix}",
               ["node", "gRPC", "TCP", "host", "tiers", "version"],
               [[r["node_id"], r["grpc_address"], r["tcp_address"], r["hostname"],
                 ", ".join(f"{t} {_size(n)}" for t, n in r["tier_capacity_bytes"].items()),
                 r["version"]] for r in doc])

    _emit(as_json, doc, table)


def stats(
    address: list[str] = typer.Option([], "--address", "-a", help="A daemon's gRPC address "
                                      "(repeatable)."),
    etcd: str | None = typer.Option(None, "--etcd", help="Or: every node registered in etcd."),
    prefix: str = typer.Option("/kvtier/", "--prefix", help="The cluster's etcd key prefix."),
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
    etcd_ca: Path | None = ETCD_CA,
    etcd_cert: Path | None = ETCD_CERT,
    etcd_key: Path | None = ETCD_KEY,
    etcd_user: str | None = ETCD_USER,
    etcd_password_file: Path | None = ETCD_PASSWORD_FILE,
    etcd_server_name: str | None = ETCD_SERVER_NAME,
) -> None:
    """Per node and tier: capacity, used, chunks, hits and hit ratio, evictions, moves; then per
    tenant the caller may see: hits, misses, bytes read and written, refusals, bytes held per tier
    with its quota."""
    targets = list(address)
    if etcd:
        _etcd_security("stats", etcd_ca, etcd_cert, etcd_key, etcd_user, etcd_password_file,
                       etcd_server_name)
        targets += [r.grpc_address for r in _nodes_from_etcd("stats", etcd, prefix).values()]
    if not targets:
        raise typer.BadParameter("give --address or --etcd", param_hint="--address")
    from kvstore.wire import stats_doc

    doc = []
    for target in targets:
        with _client("stats", target, _Creds(ca_file, cert_file, key_file, token_file)) as client:
            doc.append(stats_doc(client.stats(), target))

    def table() -> None:
        rows = []
        for node in doc:
            ratio = "-" if node["hit_ratio"] is None else f"{node['hit_ratio']:.3f}"
            for t in node["tiers"]:
                rows.append([node["node_id"], t["tier"], _size(t["capacity_bytes"]),
                             _size(t["used_bytes"]), str(t["chunks"]), str(t["hits"]), ratio,
                             str(t["evictions"]), str(t["demotions"]), str(t["promotions"])])
        _table("store nodes", ["node", "tier", "capacity", "used", "chunks", "hits",
                               "node hit ratio", "evictions", "demotions", "promotions"], rows)
        tenant_rows = []
        for node in doc:
            for t in node["tenants"]:
                held = ", ".join(_held(u) for u in t["tiers"]) or "-"
                tenant_rows.append([node["node_id"], t["tenant"] or "(default)", str(t["hits"]),
                                    str(t["misses"]), _size(t["bytes_read"]),
                                    _size(t["bytes_written"]), str(t["refused"]), held])
        if tenant_rows:
            _table("tenants", ["node", "tenant", "hits", "misses", "read", "written",
                               "refused", "held per tier (cap, guaranteed)"], tenant_rows)

    _emit(as_json, doc if len(doc) > 1 or etcd else doc[0], table)


def _held(tier: dict[str, Any]) -> str:
    """``dram 3.0 MiB (cap 4.0 MiB, guaranteed 1.0 MiB)``: a tenant's bytes in one tier."""
    limits = [f"{what} {_size(tier[key])}" for what, key in
              (("cap", "max_bytes"), ("guaranteed", "guaranteed_bytes")) if tier[key]]
    return f"{tier['tier']} {_size(tier['used_bytes'])}" + (f" ({', '.join(limits)})"
                                                            if limits else "")


def ls(
    address: str = ADDRESS,
    prefix: str = typer.Option("", "--prefix", help="Only keys starting with these hex bytes."),
    tier: str | None = typer.Option(None, "--tier", help="Only chunks in this tier."),
    limit: int = typer.Option(1000, "--limit", help="At most this many (0: the daemon's cap)."),
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
    tenant: str | None = TENANT,
) -> None:
    """List chunks (sorted by key)."""
    key_prefix = _hex(prefix, "--prefix")
    creds = _Creds(ca_file, cert_file, key_file, token_file, tenant)
    with _client("ls", address, creds) as client:
        reply = client.list_chunks(key_prefix, _tier(tier), limit)
    doc = {"entries": [entry_doc(e) for e in reply.entries], "truncated": reply.truncated}

    def table() -> None:
        _table(f"{len(reply.entries)} chunk(s)" + (" (truncated)" if reply.truncated else ""),
               ["key", "tier", "size", "depth", "hits", "pinned"],
               [[e["key"], e["tier"], _size(e["size_bytes"]), str(e["depth"]),
                 str(e["access_count"]), "yes" if e["pinned"] else ""] for e in doc["entries"]])

    _emit(as_json, doc, table)


def inspect(
    key: str = typer.Argument(..., help="The chunk's key in hex."),
    address: str = ADDRESS,
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
    tenant: str | None = TENANT,
) -> None:
    """Everything a daemon knows about one chunk."""
    k = _hex(key, "KEY")
    creds = _Creds(ca_file, cert_file, key_file, token_file, tenant)
    with _client("inspect", address, creds) as client:
        doc = entry_doc(client.inspect(k))
    _emit(as_json, doc, lambda: _table(f"chunk {key}", ["field", "value"],
                                       [[name, str(value)] for name, value in doc.items()]))


def evict(
    address: str = ADDRESS,
    tier: str | None = typer.Option(None, "--tier", help="With --bytes: the tier to free."),
    bytes_: int = typer.Option(0, "--bytes", help="Free this many bytes (demoting chunks down)."),
    prefix: str | None = typer.Option(None, "--prefix",
                                      help="Or: remove every chunk whose hex key starts so."),
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
    tenant: str | None = TENANT,
) -> None:
    """Free bytes in a tier, or remove chunks by key prefix (pinned ones are skipped)."""
    if (prefix is None) == (bytes_ == 0):
        raise typer.BadParameter("give either --tier with --bytes, or --prefix",
                                 param_hint="--bytes")
    if bytes_ and tier is None:
        raise typer.BadParameter("--bytes needs --tier", param_hint="--tier")
    creds = _Creds(ca_file, cert_file, key_file, token_file, tenant)
    with _client("evict", address, creds) as client:
        reply = client.evict(tier=_tier(tier), bytes_=bytes_,
                             key_prefix=_hex(prefix, "--prefix") if prefix is not None else b"")
    doc = {"freed_bytes": reply.freed_bytes, "removed_chunks": reply.removed_chunks,
           "busy_chunks": reply.busy_chunks}
    _emit(as_json, doc, lambda: typer.echo(
        f"freed {_size(reply.freed_bytes)}, removed {reply.removed_chunks} chunk(s), "
        f"{reply.busy_chunks} pinned chunk(s) skipped"))


def pin(
    keys: list[str] = typer.Argument(..., help="Keys in hex (all or nothing)."),
    address: str = ADDRESS,
    ttl_s: float = typer.Option(0.0, "--ttl", help="Seconds (0: the daemon's default)."),
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
    tenant: str | None = TENANT,
) -> None:
    """Pin chunks so they are neither evicted nor moved; prints the lease id for unpin."""
    parsed = [_hex(k, "KEYS") for k in keys]
    creds = _Creds(ca_file, cert_file, key_file, token_file, tenant)
    with _client("pin", address, creds) as client:
        lease_id = client.pin(parsed, ttl_s)
    _emit(as_json, {"lease_id": lease_id}, lambda: typer.echo(str(lease_id)))


def unpin(
    lease_id: int = typer.Argument(..., help="The id `kvtier pin` printed."),
    address: str = ADDRESS,
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
    tenant: str | None = TENANT,
) -> None:
    """End a pin (released: false when it had already expired)."""
    creds = _Creds(ca_file, cert_file, key_file, token_file, tenant)
    with _client("unpin", address, creds) as client:
        released = client.unpin(lease_id)
    _emit(as_json, {"released": released}, lambda: typer.echo(
        "released" if released else "not held (expired or unknown)"))


def drain(
    address: str = ADDRESS,
    as_json: bool = JSON,
    ca_file: Path | None = CA,
    cert_file: Path | None = CERT,
    key_file: Path | None = KEY,
    token_file: Path | None = TOKEN_FILE,
) -> None:
    """Stop a daemon gracefully: refuse new work, finish transfers, deregister, exit."""
    with _client("drain", address, _Creds(ca_file, cert_file, key_file, token_file)) as client:
        accepted = client.drain()
    _emit(as_json, {"accepted": accepted}, lambda: typer.echo(
        "draining" if accepted else "already draining"))


def register(app: typer.Typer) -> None:
    """Add the admin commands to the ``kvtier`` app."""
    for fn in (nodes, stats, ls, inspect, evict, pin, unpin, drain):
        app.command(name=fn.__name__)(fn)

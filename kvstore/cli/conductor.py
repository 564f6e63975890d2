"""``kvtier conductor``: run one conductor (leader or standby) until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

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
from kvstore.errors import ConfigError, KvtierError


def conductor(
    etcd: str = typer.Option(..., "--etcd", help=ETCD_ENDPOINTS_HELP),
    listen: str = typer.Option("127.0.0.1:0", "--listen",
                               help="host:port to serve gRPC on (port 0: any free port)."),
    advertise_host: str | None = typer.Option(
        None, "--advertise-host",
        help="Host published in etcd for clients (default: the listen host, or the hostname "
             "when listening on 0.0.0.0; in Kubernetes pass the pod IP)."),
    conductor_id: str | None = typer.Option(None, "--id",
                                            help="This conductor's id (default: host-pid)."),
    prefix: str = typer.Option("/kvtier/", "--prefix", help="etcd key prefix of the cluster."),
    policy: str = typer.Option("global-cache", "--policy",
                               help="random | load | local-cache | global-cache"),
    ttft_slo_s: float | None = typer.Option(None, "--ttft-slo-s",
                                            help="Reject requests whose TTFT estimate exceeds it."),
    tpot_slo_s: float | None = typer.Option(None, "--tpot-slo-s",
                                            help="Reject requests whose predicted TPOT exceeds it."),
    cache_affinity_margin: float = typer.Option(
        0.25, "--cache-affinity-margin",
        help="A request stays with the engine holding its prefix in its own cache unless "
             "another is predicted faster by more than this fraction (0: lowest estimate)."),
    block_size_tokens: int = typer.Option(512, "--block-size-tokens",
                                          help="Tokens per KV block (must match the engines)."),
    election_ttl_s: int = typer.Option(2, "--election-ttl-s",
                                       help="Leader lease TTL: a dead leader is replaced "
                                            "about this long after it dies."),
    rpc_workers: int = typer.Option(4, "--rpc-workers", help="Threads serving RPCs."),
    preload_blocks: int = typer.Option(0, "--preload-blocks", hidden=True,
                                       help="Benchmark only: synthetic blocks in the index."),
    clock: str = typer.Option("wall", "--clock",
                              help="wall | client: schedule on the callers' at_s times "
                                   "(trace replay on a simulated clock; one driver only)."),
    log_level: str = typer.Option("INFO", "--log-level"),
    insecure: bool = typer.Option(False, "--insecure", help="Listen on a non-loopback address "
                                  "WITHOUT authentication (logged as a warning)."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="This conductor's "
                                         "certificate (PEM): TLS on its port."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="Its private key (PEM)."),
    client_ca: Path | None = typer.Option(None, "--client-ca", help="CA of client "
                                          "certificates: mTLS (docs/security.md)."),
    crl: Path | None = typer.Option(None, "--crl", help="CRL of --client-ca's CA."),
    revoked_serials: str = typer.Option("", "--revoked-serials",
                                        help="Client certificate serials to refuse (hex, "
                                             "comma-separated)."),
    token_keys: Path | None = typer.Option(None, "--token-keys", help="Directory of Ed25519 "
                                           "<key id>.pub keys: bearer tokens."),
    audit_log: Path | None = typer.Option(None, "--audit-log", help="Audit log file (JSON "
                                          "lines: refused calls; '-': stderr); needs "
                                          "--client-ca or --token-keys."),
    audit_max_bytes: int = typer.Option(64 << 20, "--audit-max-bytes",
                                        help="Rotate the audit log at this size."),
    audit_backups: int = typer.Option(5, "--audit-backups",
                                      help="Rotated audit log files kept."),
    daemon_ca: Path | None = typer.Option(None, "--daemon-ca", help="CA of the daemons' "
                                          "certificates (default with --client-ca: that CA)."),
    daemon_cert: Path | None = typer.Option(None, "--daemon-cert", help="Certificate shown to "
                                            "the daemons (default with --client-ca: "
                                            "--tls-cert)."),
    daemon_key: Path | None = typer.Option(None, "--daemon-key", help="Its key (default "
                                           "with --client-ca: --tls-key)."),
    daemon_token_file: Path | None = typer.Option(None, "--daemon-token-file",
                                                  help="A peer token for the daemons."),
    daemon_server_name: str | None = typer.Option(
        None, "--daemon-server-name",
        help="The name each daemon's server certificate must carry, with {node} for its node "
             "id, e.g. {node}.daemons.kvtier: a node record pointing at another server of the "
             "CA is not followed (default: the dialed address)."),
    etcd_ca: Path | None = ETCD_CA,
    etcd_cert: Path | None = ETCD_CERT,
    etcd_key: Path | None = ETCD_KEY,
    etcd_user: str | None = ETCD_USER,
    etcd_password_file: Path | None = ETCD_PASSWORD_FILE,
    etcd_server_name: str | None = ETCD_SERVER_NAME,
) -> None:
    """Serve the conductor: discover daemons and engines through etcd, follow the daemons' chunk
    events into the global prefix index, campaign for leadership, and (as leader) schedule.

    Prints `KVTIER-CONDUCTOR-READY {json}` with its id and address once it serves. Without
    --client-ca or --token-keys it listens on loopback only (or with --insecure).
    """
    from conductor.scheduler import Policy
    from conductor.server import (
        READY_PREFIX,
        ClockMode,
        Conductor,
        ConductorConfig,
        default_conductor_id,
    )
    from kvstore.membership.etcd import KeyLayout
    from kvstore.security.config import ClientSecurity, ServerSecurity

    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        apply_etcd_options(etcd_ca, etcd_cert, etcd_key, etcd_user,
                           etcd_password_file, etcd_server_name)
        security = ServerSecurity(insecure=insecure, cert_file=tls_cert, key_file=tls_key,
                                  client_ca_file=client_ca, crl_file=crl,
                                  revoked_serials=revoked_serials, token_keys=token_keys,
                                  audit_log=audit_log, audit_max_bytes=audit_max_bytes,
                                  audit_backups=audit_backups)
        if client_ca is not None and daemon_ca is None and daemon_cert is None:
            daemon_ca, daemon_cert, daemon_key = client_ca, tls_cert, tls_key
        daemon_security = ClientSecurity(ca_file=daemon_ca, cert_file=daemon_cert,
                                         key_file=daemon_key, token_file=daemon_token_file,
                                         server_name=daemon_server_name)
        config = ConductorConfig(
            etcd_endpoint=etcd, conductor_id=conductor_id or default_conductor_id(),
            listen=listen, advertise_host=advertise_host, layout=KeyLayout(prefix),
            policy=Policy(policy),
            ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s,
            cache_affinity_margin=cache_affinity_margin, block_size_tokens=block_size_tokens,
            election_ttl_s=election_ttl_s, rpc_workers=rpc_workers,
            preload_blocks=preload_blocks, clock=ClockMode(clock), security=security,
            daemon_security=daemon_security)
    except (KvtierError, ValueError) as exc:
        typer.echo(f"kvtier conductor: {exc}", err=True)
        raise typer.Exit(2) from exc

    async def main() -> None:
        node = Conductor(config)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        try:
            address = await node.start()
            typer.echo(READY_PREFIX + json.dumps(
                {"conductor_id": config.conductor_id, "address": address,
                 "indexed_blocks": len(node.index)}))
            sys.stdout.flush()
            await stop.wait()
        finally:
            await node.stop()

    try:
        asyncio.run(main())
    except ConfigError as exc:  # e.g. a non-loopback address without authentication
        typer.echo(f"kvtier conductor: ConfigError: {exc}", err=True)
        raise typer.Exit(2) from exc
    except KvtierError as exc:
        typer.echo(f"kvtier conductor: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc

"""``kvtier daemon``: run one store node from config (file < environment < flags)."""

from __future__ import annotations

import asyncio
import logging
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
)
from kvstore.errors import ConfigError, KvtierError


def daemon(
    config: Path | None = typer.Option(None, "--config", "-c",
                                       help="YAML (.yaml/.yml) or TOML (.toml) config file."),
    set_: list[str] = typer.Option([], "--set", help="Override one key: section.field=value "
                                   "(repeatable; beats the file and KVTIER_* variables)."),
    node_id: str | None = typer.Option(None, "--node-id", help="Same as --set node_id=..."),
    grpc_port: int | None = typer.Option(None, "--grpc-port", help="--set server.grpc_port=..."),
    tcp_port: int | None = typer.Option(None, "--tcp-port", help="--set server.tcp_port=..."),
    etcd: str | None = typer.Option(None, "--etcd", help="--set etcd.endpoint=...: "
                                    + ETCD_ENDPOINTS_HELP),
    host: str | None = typer.Option(None, "--host", help="--set server.host=... (a "
                                    "non-loopback host needs mTLS, tokens or --insecure)."),
    insecure: bool = typer.Option(False, "--insecure", help="--set security.insecure=true: "
                                  "listen on a non-loopback host WITHOUT authentication."),
    tls_cert: Path | None = typer.Option(None, "--tls-cert", help="--set security.cert_file=..."),
    tls_key: Path | None = typer.Option(None, "--tls-key", help="--set security.key_file=..."),
    client_ca: Path | None = typer.Option(None, "--client-ca", help="--set "
                                          "security.client_ca_file=... (mTLS)"),
    token_keys: Path | None = typer.Option(None, "--token-keys", help="--set "
                                           "security.token_keys=DIR (bearer tokens)"),
    ready_file: Path | None = typer.Option(
        None, "--ready-file", help="Write the bound addresses (JSON) here once serving."),
    print_config: bool = typer.Option(False, "--print-config",
                                      help="Print the effective config as YAML and exit."),
    etcd_ca: Path | None = ETCD_CA,
    etcd_cert: Path | None = ETCD_CERT,
    etcd_key: Path | None = ETCD_KEY,
    etcd_user: str | None = ETCD_USER,
    etcd_password_file: Path | None = ETCD_PASSWORD_FILE,
    etcd_server_name: str | None = ETCD_SERVER_NAME,
) -> None:
    """Run a store daemon until SIGTERM/SIGINT or `kvtier drain`; then drain and exit 0.

    Prints `KVTIER-DAEMON-READY {json}` with its addresses once it serves. Without security
    config it listens on loopback only (docs/security.md).
    """
    from kvstore.node.config import load_config
    from kvstore.node.daemon import run_daemon

    overrides: dict[str, str] = {}
    for item in set_:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r} is not section.field=value", param_hint="--set")
        overrides[key.strip()] = value.strip()
    shortcuts: dict[str, object] = {"node_id": node_id, "server.grpc_port": grpc_port,
                                    "server.tcp_port": tcp_port, "etcd.endpoint": etcd,
                                    "server.host": host, "security.cert_file": tls_cert,
                                    "security.key_file": tls_key,
                                    "security.client_ca_file": client_ca,
                                    "security.token_keys": token_keys,
                                    "security.insecure": "true" if insecure else None,
                                    # the --etcd-* options are the etcd section's keys here
                                    "etcd.ca_file": etcd_ca, "etcd.cert_file": etcd_cert,
                                    "etcd.key_file": etcd_key, "etcd.username": etcd_user,
                                    "etcd.password_file": etcd_password_file,
                                    "etcd.server_name": etcd_server_name}
    overrides.update({k: str(v) for k, v in shortcuts.items() if v is not None})
    if etcd_password_file is not None:  # a password file replaces a password from elsewhere
        overrides["etcd.password"] = "none"
    try:
        cfg = load_config(config, overrides=overrides)
    except ConfigError as exc:
        typer.echo(f"kvtier daemon: {exc}", err=True)
        raise typer.Exit(2) from exc
    if print_config:
        import yaml

        typer.echo(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return
    logging.basicConfig(level=cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = asyncio.run(run_daemon(cfg, ready_file=str(ready_file) if ready_file else None))
    except ConfigError as exc:  # e.g. a non-loopback host without authentication
        typer.echo(f"kvtier daemon: ConfigError: {exc}", err=True)
        raise typer.Exit(2) from exc
    except KvtierError as exc:
        typer.echo(f"kvtier daemon: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from exc
    raise typer.Exit(code)

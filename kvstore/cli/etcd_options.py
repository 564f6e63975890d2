"""The ``--etcd-*`` options every command that reaches etcd takes (docs/security.md, "etcd"),
and the help of their ``--etcd`` endpoint list (docs/etcd-failover.md).

Each command declares them as parameters (``etcd_ca: Path | None = ETCD_CA``, ...) and calls
:func:`apply_etcd_options` before it opens an etcd client: the options, over the
``KVTIER_ETCD_*`` environment, are written into the process environment, where every etcd
client the command opens (a daemon's registration, a conductor's watches and election, an
engine's record) reads them (:meth:`kvstore.security.etcd.EtcdSecurity.from_env`).
"""

from __future__ import annotations

from pathlib import Path

import typer

from kvstore.security.etcd import EtcdSecurity, etcd_security_from_options

ETCD_ENDPOINTS_HELP = ("etcd members: host:port[,host:port...] (or http://, https://); the "
                       "client fails over between them (docs/etcd-failover.md).")
"""The help of every command's ``--etcd``: one member or a comma-separated list of them."""

ETCD_CA: Path | None = typer.Option(
    None, "--etcd-ca", help="CA bundle (PEM) of etcd's server certificate: TLS to etcd "
    "(KVTIER_ETCD_CA).")
ETCD_CERT: Path | None = typer.Option(
    None, "--etcd-cert", help="Client certificate (PEM) for etcd's --client-cert-auth "
    "(KVTIER_ETCD_CERT).")
ETCD_KEY: Path | None = typer.Option(None, "--etcd-key", help="Its private key "
                                     "(KVTIER_ETCD_KEY).")
ETCD_USER: str | None = typer.Option(None, "--etcd-user", help="etcd user to authenticate "
                                     "as (KVTIER_ETCD_USER).")
ETCD_PASSWORD_FILE: Path | None = typer.Option(
    None, "--etcd-password-file", help="File holding that user's password "
    "(KVTIER_ETCD_PASSWORD_FILE; or KVTIER_ETCD_PASSWORD).")
ETCD_SERVER_NAME: str | None = typer.Option(
    None, "--etcd-server-name", help="Name to check etcd's certificate against, when not the "
    "dialed host (KVTIER_ETCD_SERVER_NAME).")


def apply_etcd_options(ca_file: Path | None, cert_file: Path | None, key_file: Path | None,
                       username: str | None, password_file: Path | None,
                       server_name: str | None) -> EtcdSecurity:
    """The effective etcd security (options over environment), exported into the process
    environment. Raises ConfigError for inconsistent settings."""
    return etcd_security_from_options(ca_file=ca_file, cert_file=cert_file, key_file=key_file,
                                      username=username, password_file=password_file,
                                      server_name=server_name)

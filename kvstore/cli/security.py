"""``kvtier token keygen|mint|verify``: the operator's side of bearer tokens
(:mod:`kvstore.security.tokens`, docs/security.md).

::

    kvtier token keygen --dir /etc/kvtier/token-keys --kid k1   # k1.key (secret) + k1.pub
    kvtier token mint --key /etc/kvtier/token-keys/k1.key --subject vllm-0 --role engine \\
        --tenant acme --ttl 86400 > vllm-0.token
    kvtier token verify --keys /etc/kvtier/token-keys "$(cat vllm-0.token)"

Daemons and conductors get only the ``.pub`` files (``security.token_keys``); keep the ``.key``
where tokens are minted. Exit status: 0, 1 when a token does not verify, 2 for bad arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from kvstore.errors import ConfigError, Unauthenticated

app = typer.Typer(help="Bearer tokens: make keys, mint and check tokens.", no_args_is_help=True)


@app.command()
def keygen(
    directory: Path = typer.Option(..., "--dir", help="Where to write <kid>.key and <kid>.pub."),
    kid: str = typer.Option(..., "--kid", help="The key id (1-64 of [A-Za-z0-9_-])."),
) -> None:
    """Make an Ed25519 signing key (<kid>.key, mode 0600) and its public key (<kid>.pub)."""
    from kvstore.security.tokens import generate_key

    try:
        private_path, public_path = generate_key(directory, kid)
    except ConfigError as exc:
        typer.echo(f"kvtier token keygen: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"signing key {private_path} (keep it secret)\n"
               f"public key  {public_path} (copy it into every service's token_keys directory)")


@app.command()
def mint(
    key: Path = typer.Option(..., "--key", help="The signing key <kid>.key (its stem is the "
                             "key id)."),
    subject: str = typer.Option(..., "--subject", help="Who the token names (logs, audit)."),
    role: str = typer.Option(..., "--role", help="engine | operator | peer (the conductor) | daemon"),
    tenant: list[str] = typer.Option([], "--tenant", help="A tenant it may use (repeatable; "
                                     "'*': every tenant). Required for an engine."),
    shared_writer: bool = typer.Option(False, "--shared-writer",
                                       help="It may also write the shared tenant."),
    ttl_s: float = typer.Option(3600.0, "--ttl", help="Seconds until it expires."),
) -> None:
    """Print a signed token (one line) for a daemon's or conductor's callers."""
    from kvstore.security.identity import Role
    from kvstore.security.tokens import load_signing_key
    from kvstore.security.tokens import mint as mint_token

    try:
        try:
            parsed_role = Role(role)
        except ValueError:
            raise ConfigError(f"--role must be one of {', '.join(r.value for r in Role)}, "
                              f"got {role!r}") from None
        kid, private_key = load_signing_key(key)
        token = mint_token(private_key, kid, subject=subject, role=parsed_role,
                           tenants=tenant or None, ttl_s=ttl_s, shared_writer=shared_writer)
    except ConfigError as exc:
        typer.echo(f"kvtier token mint: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(token)


@app.command()
def verify(
    token: str = typer.Argument(..., help="The token ('-': read it from stdin)."),
    keys: Path = typer.Option(..., "--keys", help="Directory of <kid>.pub verification keys."),
) -> None:
    """Check a token as a service would; print its claims as JSON."""
    import sys

    from kvstore.security.tokens import load_public_keys
    from kvstore.security.tokens import verify as verify_token

    text = sys.stdin.read().strip() if token == "-" else token.strip()
    try:
        claims = verify_token(text, load_public_keys(keys))
    except ConfigError as exc:
        typer.echo(f"kvtier token verify: {exc}", err=True)
        raise typer.Exit(2) from exc
    except Unauthenticated as exc:
        typer.echo(f"kvtier token verify: Unauthenticated: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(json.dumps({
        "subject": claims.subject, "role": claims.role.value,
        "tenants": None if claims.tenants is None else sorted(claims.tenants),
        "shared_writer": claims.shared_writer, "issued_at": claims.issued_at,
        "expires_at": claims.expires_at, "key_id": claims.key_id}, sort_keys=True))

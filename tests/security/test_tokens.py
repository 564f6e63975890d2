"""Bearer tokens: mint, verify, expiry, rotation of the key directory (real files, real Ed25519)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvstore.errors import ConfigError, Unauthenticated
from kvstore.security.identity import Role
from kvstore.security.tokens import (
    KeyDirectory,
    TokenVerifier,
    generate_key,
    load_signing_key,
    mint,
)


def test_mint_and_verify_round_trip(tmp_path: Path) -> None:
    priv, _ = generate_key(tmp_path, "k1")
    kid, key = load_signing_key(priv)
    token = mint(key, kid, subject="vllm-0", role=Role.ENGINE, tenants=["a", "b"], ttl_s=60)
    claims = TokenVerifier(KeyDirectory(tmp_path, 0)).verify(token)
    p = claims.principal()
    assert (p.name, p.role, p.tenants, p.shared_writer) == ("vllm-0", Role.ENGINE,
                                                          frozenset({"a", "b"}), False)


def test_expired_and_tampered_tokens_are_refused(tmp_path: Path) -> None:
    kid, key = load_signing_key(generate_key(tmp_path, "k1")[0])
    verifier = TokenVerifier(KeyDirectory(tmp_path, 0))
    old = mint(key, kid, subject="e", role=Role.ENGINE, tenants=["a"], ttl_s=10,
               now_s=time.time() - 100)
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.verify(old)
    good = mint(key, kid, subject="e", role=Role.ENGINE, tenants=["a"], ttl_s=60)
    head, _, sig = good.rsplit(".", 2)
    forged = mint(key, kid, subject="e", role=Role.OPERATOR, tenants=None, ttl_s=60)
    with pytest.raises(Unauthenticated, match="signature"):
        verifier.verify(f"{head}.{forged.split('.')[2]}.{sig}")
    with pytest.raises(Unauthenticated, match="malformed"):
        verifier.verify("not-a-token")


def test_engine_token_must_name_tenants(tmp_path: Path) -> None:
    kid, key = load_signing_key(generate_key(tmp_path, "k1")[0])
    with pytest.raises(ConfigError, match="tenants"):
        mint(key, kid, subject="e", role=Role.ENGINE, tenants=None, ttl_s=60)


def test_rotation_old_key_verifies_until_removed(tmp_path: Path) -> None:
    keys = tmp_path / "pub"
    keys.mkdir()
    k1_priv, k1_pub = generate_key(tmp_path / "k1", "k1")
    k2_priv, k2_pub = generate_key(tmp_path / "k2", "k2")
    (keys / "k1.pub").write_bytes(k1_pub.read_bytes())
    verifier = TokenVerifier(KeyDirectory(keys, 0))
    old = mint(*reversed(load_signing_key(k1_priv)), subject="e", role=Role.ENGINE, tenants=["a"],
               ttl_s=600)
    assert verifier.verify(old).key_id == "k1"
    (keys / "k2.pub").write_bytes(k2_pub.read_bytes())  # the new key joins the set
    new = mint(*reversed(load_signing_key(k2_priv)), subject="e", role=Role.ENGINE, tenants=["a"],
               ttl_s=600)
    assert verifier.verify(new).key_id == "k2"
    assert verifier.verify(old).key_id == "k1"  # both verify during the overlap
    (keys / "k1.pub").unlink()  # the old key leaves: its tokens stop verifying, cached or not
    with pytest.raises(Unauthenticated, match="k1"):
        verifier.verify(old)
    assert verifier.verify(new).key_id == "k2"

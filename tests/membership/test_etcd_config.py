"""The daemon config's etcd section: a list of endpoints in every spelling, and the etcd
security keys (file < environment < flags, loud errors, the password never shown)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import ConfigError
from kvstore.membership.endpoints import parse_etcd_endpoints
from kvstore.node.config import HIDDEN, load_config
from kvstore.security.etcd import EtcdSecurity

MEMBERS = ("10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379")


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("etcd_yaml", [
    "endpoints: [10.0.0.1:2379, 10.0.0.2:2379, 10.0.0.3:2379]",
    "endpoints: 10.0.0.1:2379,10.0.0.2:2379, 10.0.0.3:2379",
    "endpoint: 10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379",
    "endpoint: [10.0.0.1:2379, 10.0.0.2:2379, 10.0.0.3:2379]",
])
def test_endpoints_are_a_list_in_every_spelling(tmp_path: Path, etcd_yaml: str) -> None:
    config = load_config(_yaml(tmp_path, f"etcd:\n  {etcd_yaml}\n"), env={})
    assert config.etcd.endpoints == MEMBERS
    assert config.etcd.enabled
    assert config.etcd.endpoint == ",".join(MEMBERS)


def test_a_single_endpoint_still_works_and_later_layers_win(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "etcd:\n  endpoints: [10.0.0.1:2379, 10.0.0.2:2379]\n")
    assert load_config(env={}, overrides={"etcd.endpoint": "127.0.0.1:2379"}
                       ).etcd.endpoints == ("127.0.0.1:2379",)
    # the environment's single-endpoint spelling beats the file's list, a flag beats both
    env = {"KVTIER_ETCD__ENDPOINT": "10.0.0.9:2379"}
    assert load_config(path, env=env).etcd.endpoints == ("10.0.0.9:2379",)
    assert load_config(path, env=env, overrides={"etcd.endpoints": "a:1,b:2"}
                       ).etcd.endpoints == ("a:1", "b:2")
    assert not load_config(env={}).etcd.enabled
    assert load_config(path, env={}, overrides={"etcd.endpoint": "none"}).etcd.endpoint is None


@pytest.mark.parametrize(("value", "message"), [
    ("a:1,a:1", "listed twice"),
    ("https://a:1,http://b:2", "mix http:// with https://"),
    ("a:1,,b:2", "stray comma"),
    ("a:99999", "host:port"),
    ("ftp://a:1", "host:port"),
])
def test_bad_endpoints_fail_loudly_naming_the_key(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(env={}, overrides={"etcd.endpoint": value})
    assert "etcd" in str(raised.value) and "flag etcd.endpoint" in str(raised.value)


def test_both_spellings_in_one_layer_are_refused(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "etcd:\n  endpoint: a:1\n  endpoints: [b:2]\n")
    with pytest.raises(ConfigError, match="endpoints or endpoint, not both"):
        load_config(path, env={})


def test_parse_keeps_order_and_schemes() -> None:
    members = parse_etcd_endpoints(["https://a:1", "https://b:2/"])
    assert [(m.scheme, m.host, m.port) for m in members] == [("https", "a", 1), ("https", "b", 2)]
    assert [str(m) for m in parse_etcd_endpoints("[::1]:2379, c:3")] == ["[::1]:2379", "c:3"]
    # a bare host:port takes the list's scheme (the chart prefixes only its first member)
    assert [m.scheme for m in parse_etcd_endpoints("https://a:1,b:2")] == ["https", ""]


def test_security_keys_from_the_file(tmp_path: Path) -> None:
    for name in ("ca.crt", "client.crt", "client.key", "password"):
        (tmp_path / name).write_text("x\n")
    path = _yaml(tmp_path, f"""etcd:
  endpoints: [https://e1:2379, https://e2:2379]
  ca_file: {tmp_path}/ca.crt
  cert_file: {tmp_path}/client.crt
  key_file: {tmp_path}/client.key
  username: kvtier-daemon
  password_file: {tmp_path}/password
  server_name: etcd.internal
""")
    config = load_config(path, env={})
    assert config.etcd.security() == EtcdSecurity(
        ca_file=tmp_path / "ca.crt", cert_file=tmp_path / "client.crt",
        key_file=tmp_path / "client.key", username="kvtier-daemon",
        password_file=tmp_path / "password", server_name="etcd.internal")
    config.etcd.security().check_files()
    # the KVTIER_ETCD_* variables every etcd client reads are the same keys, environment layer
    env = {"KVTIER_ETCD_USER": "from-env", "KVTIER_ETCD_SERVER_NAME": "other"}
    assert load_config(path, env=env).etcd.username == "from-env"
    assert load_config(path, env={**env, "KVTIER_ETCD__USERNAME": "wins"}).etcd.username == "wins"
    assert load_config(path, env=env, overrides={"etcd.server_name": "flag"}
                       ).etcd.server_name == "flag"


def test_the_password_is_never_shown(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "etcd:\n  endpoints: [a:1]\n  username: u\n  password: s3cret-pw\n")
    config = load_config(path, env={})
    assert config.etcd.security().read_password() == "s3cret-pw"
    assert "s3cret-pw" not in repr(config)
    assert config.to_dict()["etcd"]["password"] == HIDDEN
    assert "s3cret-pw" not in repr(config.to_dict())


@pytest.mark.parametrize(("etcd_yaml", "message"), [
    ("username: u", "needs a password"),
    ("password: p", "password without a user"),
    ("cert_file: /c.crt", "certificate and its key go together"),
    ("cert_file: /c.crt\n  key_file: /c.key", "presented over TLS"),
    ("username: u\n  password: p\n  password_file: /p", "not both"),
    ("ca_file: 7", None),  # a number is not refused as a path: a path of "7"
])
def test_inconsistent_security_fails_loudly(tmp_path: Path, etcd_yaml: str,
                                            message: str | None) -> None:
    path = _yaml(tmp_path, f"etcd:\n  endpoints: [a:1]\n  {etcd_yaml}\n")
    if message is None:
        with pytest.raises(ConfigError, match=r"etcd\.ca_file: expected a path"):
            load_config(path, env={})
        return
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(path, env={})
    assert f"file {path}" in str(raised.value)


def test_missing_files_are_named(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match=r"CA bundle .*missing\.crt does not exist"):
        EtcdSecurity(ca_file=tmp_path / "missing.crt").check_files()
    with pytest.raises(ConfigError, match=r"password file .*dir is not a file"):
        EtcdSecurity(username="u", password_file=tmp_path / "dir").check_files()

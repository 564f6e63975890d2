"""The daemon config loader: file < environment < flags, and loud errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.dataplane.tier import TierKind
from kvstore.errors import ConfigError
from kvstore.node.config import DaemonConfig, load_config
from kvstore.node.policies import PolicyName

MiB = 1 << 20


def test_defaults_are_a_dram_only_node() -> None:
    config = load_config(env={})
    assert config == DaemonConfig(node_id=config.node_id)
    assert config.tier_kinds() == (TierKind.DRAM,)
    assert config.metrics.enabled is False


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_file_then_environment_then_flags(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"node{suffix}"
    if suffix == ".yaml":
        path.write_text("node_id: from-file\ndram:\n  capacity_bytes: 8MiB\n"
                        "nvme:\n  directory: /tmp/n\ncache:\n  policy: s3fifo\n")
    else:
        path.write_text('node_id = "from-file"\n[dram]\ncapacity_bytes = "8MiB"\n'
                        '[nvme]\ndirectory = "/tmp/n"\n[cache]\npolicy = "s3fifo"\n')
    config = load_config(path, env={"KVTIER_NODE_ID": "from-env",
                                    "KVTIER_DRAM__CAPACITY_BYTES": "16MiB",
                                    "KVTIER_ETCD_BINARY": "/usr/bin/etcd"},
                         overrides={"dram.capacity_bytes": "32MiB", "server.grpc_port": "0"})
    assert config.node_id == "from-env"
    assert config.dram.capacity_bytes == 32 * MiB
    assert config.nvme.directory == Path("/tmp/n")
    assert config.cache.policy is PolicyName.S3FIFO
    assert config.tier_kinds() == (TierKind.DRAM, TierKind.NVME)
    assert load_config(path, env={}).dram.capacity_bytes == 8 * MiB


@pytest.mark.parametrize(("env", "overrides", "message"), [
    ({"KVTIER_DRAM__CAPACITY_BYTES": "lots"}, {}, "dram.capacity_bytes: expected a size"),
    ({"KVTIER_DRAM__CAPACITY_BYTES": "1MB"}, {}, "KVTIER_DRAM__CAPACITY_BYTES"),
    ({}, {"metrics.enabled": "maybe"}, "metrics.enabled: expected true or false"),
    ({}, {"metrics.enabld": "true"}, "metrics.enabld: unknown key"),
    ({"KVTIER_DRAM__SIZE": "1"}, {}, "dram.size: unknown key (environment KVTIER_DRAM__SIZE)"),
    ({}, {"server.grpc_port": "70000"}, "grpc_port must be 0..65535"),
    ({}, {"cache.policy": "fifo"}, "cache.policy: expected one of"),
    ({}, {"node_id": "bad id!"}, "node_id must be"),
    ({}, {"cache.write_tier": "nvme"}, "write_tier nvme is not configured"),
    ({}, {"etcd.ttl_s": "1"}, "ttl_s must be >= 2"),
])
def test_bad_values_fail_loudly_naming_the_key(env: dict[str, str], overrides: dict[str, str],
                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(env=env, overrides=overrides)


def test_false_is_false_and_none_is_none() -> None:
    config = load_config(env={"KVTIER_DRAM__PREFAULT": "false"},
                         overrides={"etcd.endpoint": "none"})
    assert config.dram.prefault is False
    assert config.etcd.endpoint is None


def test_a_broken_file_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("dram: [1, 2\n")
    with pytest.raises(ConfigError, match="does not parse"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    ini = tmp_path / "x.ini"
    ini.write_text("[dram]\n")
    with pytest.raises(ConfigError, match="must end in"):
        load_config(ini, env={})


def test_to_dict_round_trips_through_a_yaml_file(tmp_path: Path) -> None:
    import yaml

    config = load_config(env={}, overrides={"nvme.directory": str(tmp_path),
                                            "cache.write_tier": "dram"})
    path = tmp_path / "dump.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    assert load_config(path, env={}) == config

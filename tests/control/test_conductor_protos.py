"""The conductor's checked-in generated code must be what scripts/gen_protos.sh makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GENERATED = ("conductor_pb2.py", "conductor_pb2.pyi", "conductor_pb2_grpc.py")


def test_conductor_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(REPO / "scripts/gen_protos.sh"), str(tmp_path)], check=True,
                   cwd=REPO, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    stale = [name for name in GENERATED
             if (tmp_path / "kvtier/v1" / name).read_bytes()
             != (REPO / "kvstore/_proto/kvtier/v1" / name).read_bytes()]
    assert not stale, (f"{stale} differ from what proto/ generates: "
                       "run scripts/gen_protos.sh and commit the result")


def test_conductor_stubs_import_from_the_package() -> None:
    from kvstore._proto.kvtier.v1 import conductor_pb2, conductor_pb2_grpc

    assert conductor_pb2.DESCRIPTOR.package == "kvtier.v1"
    assert hasattr(conductor_pb2_grpc, "ConductorServicer")

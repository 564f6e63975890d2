"""The checked-in generated code must be exactly what scripts/gen_protos.sh makes from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(REPO / "scripts/gen_protos.sh"), str(tmp_path)], check=True,
                   cwd=REPO, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    generated = sorted(p.name for p in (tmp_path / "kvtier/v1").glob("*_pb2*"))
    assert {"store_pb2.py", "store_pb2.pyi", "store_pb2_grpc.py"} <= set(generated)
    checked_in = REPO / "kvstore/_proto/kvtier/v1"
    stale = [name for name in generated
             if not (checked_in / name).exists()
             or (tmp_path / "kvtier/v1" / name).read_bytes() != (checked_in / name).read_bytes()]
    assert not stale, (f"{stale} differ from what proto/ generates: "
                       "run scripts/gen_protos.sh and commit the result")


def test_generated_code_imports_from_the_package() -> None:
    from kvstore._proto.kvtier.v1 import store_pb2, store_pb2_grpc

    assert store_pb2.DESCRIPTOR.package == "kvtier.v1"
    assert hasattr(store_pb2_grpc, "StoreServicer")

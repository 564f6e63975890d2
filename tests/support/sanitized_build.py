"""AddressSanitizer/UBSan builds of the native artifacts (``native/``) for
``tests/dataplane/test_native_fuzz.py``, cached per machine so that only the first run pays for
the compiles.

The cache lives under ``<cache root>/native-fuzz/<key>/`` (the root is
``kvstore.cluster.vllm_instance.default_cache_root``: ``~/.cache/kvtier-tests``, moved by
``KVTIER_TEST_CACHE``). The key is a SHA-256 of everything a build reads or is told:

* every ``*.c`` and ``*.h`` under ``native/`` (``build/`` excepted), by relative path and
  content, so a changed include (``third_party/xxhash.h``, ``fastpath.c`` inside ``pyfast.c``)
  rebuilds as a changed source does;
* the compiler's resolved path, ``--version`` and ``-dumpmachine``;
* each artifact's sources, output name and flags;
* the Python the extension is built for (version, ``EXT_SUFFIX``, include directory).

A build is written to a staging directory beside its entry and renamed into place, so no run
sees half a build; of two concurrent builders the second's rename fails and its copy is
discarded. A failed build is not cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvstore.cluster.vllm_instance import default_cache_root

__all__ = ["Artifact", "build_key", "cached_build"]

_DONE = "DONE"


@dataclass(frozen=True)
class Artifact:
    """One shared object: ``cc <flags> -o <output_name> <sources>``."""

    output_name: str
    sources: tuple[Path, ...]
    flags: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.sources or "/" in self.output_name or not self.output_name:
            raise ValueError(f"an artifact needs sources and a plain file name: {self!r}")


def _compiler_identity(cc: str) -> bytes:
    parts = [str(Path(cc).resolve()).encode()]
    for flag in ("--version", "-dumpmachine"):
        done = subprocess.run([cc, flag], capture_output=True, check=False)
        parts.append(done.stdout + done.stderr)
    return b"\0".join(parts)


def build_key(cc: str, artifacts: Sequence[Artifact], native_dir: Path) -> str:
    """The cache key of building ``artifacts`` with ``cc`` from the sources in ``native_dir``."""
    digest = hashlib.sha256()

    def add(part: bytes) -> None:
        digest.update(len(part).to_bytes(8, "little") + part)

    for path in sorted(p for p in native_dir.rglob("*")
                       if p.suffix in (".c", ".h") and p.is_file()
                       and "build" not in p.relative_to(native_dir).parts):
        add(str(path.relative_to(native_dir)).encode())
        add(path.read_bytes())
    add(_compiler_identity(cc))
    for artifact in artifacts:
        add(artifact.output_name.encode())
        for source in artifact.sources:
            add(str(source.resolve().relative_to(native_dir.resolve())).encode())
        add("\0".join(artifact.flags).encode())
    add(f"{sys.version}\0{sysconfig.get_config_var('EXT_SUFFIX')}\0"
        f"{sysconfig.get_paths()['include']}".encode())
    return digest.hexdigest()[:32]


def cached_build(cc: str, artifacts: Sequence[Artifact], native_dir: Path,
                 root: Path | None = None) -> Path | str:
    """The directory holding every artifact built (now or by an earlier run), or why a build
    failed (the compiler's message)."""
    base = (root or default_cache_root()) / "native-fuzz"
    target = base / build_key(cc, artifacts, native_dir)
    if (target / _DONE).is_file():
        return target
    base.mkdir(parents=True, exist_ok=True)
    staging = base / f".staging-{os.getpid()}-{time.monotonic_ns()}"
    staging.mkdir()
    try:
        for artifact in artifacts:
            done = subprocess.run([cc, *artifact.flags, "-o", str(staging / artifact.output_name),
                                   *map(str, artifact.sources)],
                                  capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"a sanitizer build failed: {done.stderr.strip()[:500]}"
        (staging / _DONE).write_text("")
        try:
            staging.rename(target)
        except OSError:
            if not (target / _DONE).is_file():  # not a concurrent builder's finished copy
                raise
        return target
    finally:
        shutil.rmtree(staging, ignore_errors=True)

"""Small real filesystems for disk-full tests: a tmpfs or a loop-mounted ext4 image.

Mounting needs root (and a kernel that allows it); :func:`small_filesystem` skips the test
with the reason otherwise, and always unmounts on exit.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

MiB = 1 << 20


@contextlib.contextmanager
def small_filesystem(kind: str, where: Path, image_dir: Path, size_bytes: int
                     ) -> Iterator[Path]:
    """Mount a ``size_bytes`` ``tmpfs`` or ``ext4`` (loop image in ``image_dir``) at ``where``."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    where.mkdir()
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)]
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("mkfs.ext4 not installed")
        image = image_dir / f"{where.name}.ext4"
        with open(image, "wb") as f:
            f.truncate(size_bytes)
        made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"mkfs.ext4 failed: {made.stderr.decode().strip()}")
        cmd = ["mount", "-o", "loop", str(image), str(where)]
    done = subprocess.run(cmd, capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount {kind}: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def free_bytes(where: Path) -> int:
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize


def total_bytes(where: Path) -> int:
    st = os.statvfs(where)
    return st.f_blocks * st.f_frsize


def fill(where: Path, leave_bytes: int, name: str = "filler") -> Path:
    """Another file (real blocks, fsynced) taking all but about ``leave_bytes`` of the free
    space under ``where``."""
    path = where / name
    size = max(0, free_bytes(where) - leave_bytes)
    block = bytes(MiB)
    with open(path, "wb") as f:
        written = 0
        while written < size:
            written += f.write(block[:min(MiB, size - written)])
        f.flush()
        os.fsync(f.fileno())
    return path

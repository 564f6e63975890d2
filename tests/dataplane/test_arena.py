"""ShmArena against real POSIX shared memory: creation, pre-fault, attach, ownership, stale sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.dataplane import arena as arena_mod
from kvstore.dataplane.arena import (
    ArenaAccess,
    PinMode,
    ShmArena,
    copy_bytes,
    host_byte_view,
    remove_stale_arenas,
)
from kvstore.dataplane.cuda import cuda_available
from kvstore.errors import CapacityError, InvalidArgument, TierUnavailable

MiB = 1 << 20


def mapping_rss_bytes(name: str) -> int:
    """Resident bytes of this process's mapping of /dev/shm/<name>, from /proc/self/smaps."""
    rss_kib = 0
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and fields[0][0] in "0123456789abcdef":
                inside = line.rstrip().endswith(f"/dev/shm/{name}")
            elif inside and fields[0] == "Rss:":
                rss_kib += int(fields[1])
    return rss_kib * 1024


def test_create_maps_a_named_segment_and_close_unlinks_it() -> None:
    arena = ShmArena.create(3 * MiB + 1, pin=PinMode.OFF)
    path = f"/dev/shm/{arena.name}"
    assert arena.name.startswith(f"kvtier-{os.getpid()}-")
    assert arena.size_bytes == 3 * MiB + 4096  # rounded up to whole pages
    assert os.path.getsize(path) == arena.size_bytes
    assert arena.owner and arena.access is ArenaAccess.READ_WRITE and not arena.pinned
    arena.close()
    arena.close()  # idempotent
    assert arena.closed and not os.path.exists(path)
    with pytest.raises(TierUnavailable):
        arena.view(0, 1)


def test_prefault_makes_every_page_resident() -> None:
    with ShmArena.create(8 * MiB, pin=PinMode.OFF) as hot:
        assert hot.prefault_s is not None and hot.prefault_s >= 0
        assert mapping_rss_bytes(hot.name) == 8 * MiB
    with ShmArena.create(8 * MiB, prefault=False, pin=PinMode.OFF) as cold:
        assert cold.prefault_s is None
        assert mapping_rss_bytes(cold.name) == 0


def test_prefault_falls_back_to_page_writes_without_populate_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(arena_mod, "MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL
    with ShmArena.create(4 * MiB, pin=PinMode.OFF) as arena:
        assert mapping_rss_bytes(arena.name) == 4 * MiB
        assert not arena.array(0, 4 * MiB).any()  # still all zeros


def test_name_collision_and_bad_names_are_rejected() -> None:
    with ShmArena.create(MiB, pin=PinMode.OFF) as first:
        with pytest.raises(InvalidArgument, match="already exists"):
            ShmArena.create(MiB, name=first.name, pin=PinMode.OFF)
        assert os.path.exists(f"/dev/shm/{first.name}")  # the loser did not unlink it
    for bad in ["", "a/b", "../etc", "x" * 300]:
        with pytest.raises(InvalidArgument):
            ShmArena.create(MiB, name=bad, pin=PinMode.OFF)
    with pytest.raises(InvalidArgument):
        ShmArena.create(0, pin=PinMode.OFF)


def test_larger_than_dev_shm_is_a_capacity_error_and_leaves_nothing() -> None:
    st = os.statvfs("/dev/shm")
    total = st.f_blocks * st.f_frsize
    if total == 0:
        pytest.skip("/dev/shm has no size limit")
    before = set(os.listdir("/dev/shm"))
    # tmpfs rejects a fallocate beyond its total size up front, without allocating.
    with pytest.raises(CapacityError):
        ShmArena.create(2 * total, pin=PinMode.OFF)
    assert set(os.listdir("/dev/shm")) == before


def test_attach_read_write_shares_bytes_both_ways() -> None:
    with ShmArena.create(MiB, pin=PinMode.OFF) as owner:
        other = ShmArena.attach(owner.name, access=ArenaAccess.READ_WRITE)
        try:
            owner.array(4096, 4)[:] = [1, 2, 3, 4]
            assert bytes(other.view(4096, 4)) == b"\x01\x02\x03\x04"
            other.view(0, 2, readonly=False)[:] = b"hi"
            assert bytes(owner.view(0, 2)) == b"hi"
            assert not other.owner
        finally:
            other.close()
        assert os.path.exists(f"/dev/shm/{owner.name}")  # closing an attacher keeps it


def test_attach_unknown_name_is_invalid() -> None:
    with pytest.raises(InvalidArgument, match="no shared-memory arena"):
        ShmArena.attach("kvtier-does-not-exist")


def test_views_are_bounds_checked() -> None:
    with ShmArena.create(MiB, pin=PinMode.OFF) as arena:
        for offset, size in [(-1, 1), (0, MiB + 1), (MiB, 1), (10, -1)]:
            with pytest.raises(InvalidArgument):
                arena.view(offset, size)


def test_a_killed_creator_leaves_a_segment_that_the_sweep_removes() -> None:
    code = textwrap.dedent(
        """
        import sys, time
        from kvstore.dataplane.arena import PinMode, ShmArena
        a = ShmArena.create(1 << 20, pin=PinMode.OFF)
        sys.stdout.write(a.name + "\\n"); sys.stdout.flush()
        time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name.startswith(f"kvtier-{proc.pid}-")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert os.path.exists(f"/dev/shm/{name}")  # SIGKILL skips the owner's unlink
    with ShmArena.create(MiB, pin=PinMode.OFF) as live:
        removed = remove_stale_arenas()
        assert name in removed
        assert live.name not in removed  # our own process is alive
        assert os.path.exists(f"/dev/shm/{live.name}")
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.skipif(cuda_available(), reason="a CUDA device is present")
def test_pinning_without_a_gpu() -> None:
    with ShmArena.create(MiB, pin=PinMode.AUTO) as arena:
        assert not arena.pinned  # skipped with a log line
    with pytest.raises(TierUnavailable):
        ShmArena.create(MiB, pin=PinMode.REQUIRE)


@pytest.mark.gpu
def test_pinning_with_a_gpu_registers_and_unregisters() -> None:
    from kvstore.dataplane import cuda

    with ShmArena.create(4 * MiB, pin=PinMode.REQUIRE) as arena:
        assert arena.pinned
        address = int(arena.array(0, 1).ctypes.data)
        tensor = cuda.pinned_tensor_for(address + 4096, 8192)
        assert tensor is not None and tensor.numel() == 8192 and tensor.is_pinned()
    assert cuda.pinned_tensor_for(address + 4096, 8192) is None


# --- caller buffers and copies ------------------------------------------------------------------


def test_host_byte_view_flattens_without_copying() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = host_byte_view(arr, writable=True)
    assert view.format == "B" and view.ndim == 1 and view.nbytes == 48
    view[0:4] = b"\x00\x00\x80\x3f"  # 1.0f written through the view lands in the array
    assert arr[0, 0] == 1.0


def test_host_byte_view_refuses_a_strided_byte_destination_and_copies_a_strided_source(
        ) -> None:
    strided = memoryview(bytearray(range(16)))[::2]  # 1-D, format B, not contiguous
    with pytest.raises(InvalidArgument):
        host_byte_view(strided, writable=True)
    src = host_byte_view(strided)
    assert src.c_contiguous and bytes(src) == bytes(range(0, 16, 2))


def test_host_byte_view_handles_torch_dtypes_without_numpy_equivalents() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(8, dtype=torch.bfloat16)
    view = host_byte_view(t, writable=True)
    assert view.nbytes == 16
    view[0:2] = b"\x00\x00"
    assert t[0].item() == 0.0 and t[1].item() == 1.0


@pytest.mark.parametrize("size", [100, 1 << 20])  # both sides of the GIL-release threshold
def test_copy_bytes(size: int) -> None:
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = bytearray(size)
    copy_bytes(memoryview(dst), memoryview(src))
    assert bytes(dst) == src.tobytes()


def test_a_forked_child_exiting_does_not_unlink_the_parents_arena() -> None:
    with ShmArena.create(MiB, pin=PinMode.OFF) as arena:
        pid = os.fork()
        if pid == 0:  # the child: run the normal interpreter shutdown (atexit, finalizers)
            try:
                arena.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert os.path.exists(f"/dev/shm/{arena.name}")

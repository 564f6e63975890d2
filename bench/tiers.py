"""Put and get throughput of each storage tier, beside the limit measured in the same run.

Run with ``kvtier bench tiers [--quick] [--json PATH] [--dir PATH]``.

For each chunk size (256 KiB, 1 MiB, 4 MiB, 16 MiB, 64 MiB) and tier, a pass puts
``total`` bytes as chunks of that size (one thread, distinct keys), then a pass reads them
all back with ``get_into``. Beside each figure, measured in the same run, interleaved with
the tier's passes round by round (so a noisy neighbour hits both alike):

* **dram**: one-thread ``numpy.copyto`` between pre-touched buffers of the same size
  (sources cycle over a pool larger than the last-level cache). The DRAM tier's source
  and destination buffers are the same pre-touched memory.
* **nvme**: the device through the same filesystem: O_DIRECT sequential ``pwrite`` of
  chunk-sized aligned buffers into a preallocated, already written file, **each followed
  by fdatasync** (the durability a tier put gives), and O_DIRECT sequential ``pread``.
  ``raw_write_gbps`` (the same writes without fdatasync) is recorded too. Tier segments
  are created by an untimed warm-up pass, so timed puts overwrite written blocks exactly
  like the limit's writes. Reads never come from the page cache: with O_DIRECT they
  cannot; if the filesystem lacks O_DIRECT the segment and limit files get
  ``posix_fadvise(DONTNEED)`` before every read pass (the JSON says which).
  Sources/destinations are page-aligned (as DRAM-tier arena views are: the demotion path);
  ``--unaligned`` rows add the staged path for arbitrary caller memory.
* **hbm** (only with a CUDA device): ``torch`` copies between pinned host memory and the
  device, beside the HBM tier's put (host to device) and get (device to host).

Each figure is the best of ``rounds`` passes (1 in ``--quick``, 5 otherwise) of 512 MiB
(128 MiB in ``--quick``) per chunk size.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench._meta import run_header
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.directio import AlignedBuffer, IoMode, open_flags
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.errors import CapacityError

REPO_ROOT = Path(__file__).resolve().parents[1]
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
CHUNK_SIZES = (256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)
SOURCE_POOL_BYTES = 64 * MiB
"""Sources cycle over at least this much memory, so copies do not run from the CPU cache."""


DRAM_LIMIT = "numpy copyto, one thread, pre-touched"


def short_limit(limit: str) -> str:
    """A table-sized name for a limit's description."""
    if limit == DRAM_LIMIT:
        return "memcpy"
    if "fdatasync" in limit:
        return f"{limit.split()[0]} write+fdatasync"
    if limit.endswith("pread"):
        return f"{limit.split()[0]} read"
    if "host -> device" in limit:
        return "H2D copy"
    if "device -> pinned host" in limit:
        return "D2H copy"
    return limit


@dataclass(frozen=True, slots=True)
class Row:
    tier: str
    op: str
    chunk_bytes: int
    gbps: float
    limit_gbps: float
    ratio_to_limit: float
    total_bytes: int
    src_aligned: bool
    limit: str
    """What ``limit_gbps`` measured."""
    raw_write_gbps: float | None = None
    """NVMe puts only: the limit's writes without fdatasync (what the device does unsynced)."""


@dataclass(frozen=True, slots=True)
class Plan:
    quick: bool
    rounds: int
    dram_total_bytes: int
    nvme_total_bytes: int
    unaligned: bool
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES

    def chunks(self, total_bytes: int, chunk_bytes: int) -> int:
        return max(2, total_bytes // chunk_bytes)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _timed(fn: Callable[..., object], *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class Cycle:
    """Index a list cyclically (``cycle[i] == items[i % len(items)]``)."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __getitem__(self, i: int) -> Any:
        return self._items[i % len(self._items)]


def _tier_put(tier: Any, keys: list[bytes], src: Any) -> None:
    for i, key in enumerate(keys):
        tier.put(key, src[i])


def _tier_get(tier: Any, keys: list[bytes], dst: Any) -> None:
    for i, key in enumerate(keys):
        tier.get_into(key, dst[i])


def _memcpy(src: BufferSet, dst: BufferSet, n: int) -> None:
    for i in range(n):
        np.copyto(np.frombuffer(dst[i], np.uint8), np.frombuffer(src[i], np.uint8))


class BufferSet:
    """``count`` page-aligned, pre-touched buffers of ``chunk_bytes`` (offset by 1 if unaligned)."""

    def __init__(self, chunk_bytes: int, count: int, *, aligned: bool = True, seed: int = 0) -> None:
        self._buffers = [AlignedBuffer(chunk_bytes + 1) for _ in range(count)]
        lo = 0 if aligned else 1
        rng = np.random.default_rng(seed)
        block = rng.integers(0, 256, min(chunk_bytes, 4 * MiB), dtype=np.uint8)
        self.views: list[memoryview] = []
        for buf in self._buffers:
            view = buf.view[lo:lo + chunk_bytes]
            arr = np.frombuffer(view, dtype=np.uint8)
            for start in range(0, chunk_bytes, block.size):
                n = min(block.size, chunk_bytes - start)
                arr[start:start + n] = block[:n]
            arr[:8] = rng.integers(0, 256, 8, dtype=np.uint8)  # distinct chunks
            del arr
            self.views.append(view)

    def __getitem__(self, i: int) -> memoryview:
        return self.views[i % len(self.views)]

    def close(self) -> None:
        for view in self.views:
            view.release()
        for buf in self._buffers:
            buf.close()


def _pool_count(chunk_bytes: int, chunks: int) -> int:
    return min(chunks, max(2, SOURCE_POOL_BYTES // chunk_bytes))


# --- DRAM ---------------------------------------------------------------------------------------


def bench_dram(plan: Plan) -> list[Row]:
    from kvstore.dataplane.dram import DramTier

    rows: list[Row] = []
    for chunk in plan.chunk_sizes:
        n = plan.chunks(plan.dram_total_bytes, chunk)
        total = n * chunk
        pool = _pool_count(chunk, n)
        src, dst = BufferSet(chunk, pool), BufferSet(chunk, pool, seed=1)
        tier = DramTier(total + 16 * MiB)
        keys = [f"d{chunk}-{i}".encode() for i in range(n)]
        best = {"memcpy": 0.0, "put": 0.0, "get": 0.0}
        try:
            for _ in range(plan.rounds):
                best["memcpy"] = max(best["memcpy"], _gbps(total, _timed(_memcpy, src, dst, n)))
                best["put"] = max(best["put"], _gbps(total, _timed(_tier_put, tier, keys, src)))
                best["get"] = max(best["get"], _gbps(total, _timed(_tier_get, tier, keys, dst)))
                for key in keys:
                    tier.remove(key)
        finally:
            tier.close()
            src.close()
            dst.close()
        limit = best["memcpy"]
        for op in ("put", "get"):
            rows.append(Row("dram", op, chunk, best[op], limit, best[op] / limit, total, True,
                            DRAM_LIMIT))
    return rows


# --- NVMe ---------------------------------------------------------------------------------------


def default_nvme_dir() -> tuple[Path, bool]:
    """A scratch directory on the repository's filesystem; True when the caller must delete it.

    The system temp dir is used when it is on the same filesystem as the repository (and
    so is not a tmpfs that would hide the disk); otherwise ``.bench-tmp`` in the repository.
    """
    tmp = Path(tempfile.gettempdir())
    if os.stat(tmp).st_dev == os.stat(REPO_ROOT).st_dev:
        base = tmp
    else:
        base = REPO_ROOT / ".bench-tmp"
        base.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-", dir=base)), True


def filesystem_of(path: Path) -> dict[str, str]:
    """Mount point, type and device of the filesystem holding ``path`` (from /proc/mounts)."""
    best = {"mount": "?", "type": "?", "device": "?"}
    try:
        resolved = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, fstype = line.split()[:3]
            if (resolved == mount or resolved.startswith(mount.rstrip("/") + "/")) \
                    and len(mount) >= len(best["mount"].replace("?", "")):
                best = {"mount": mount, "type": fstype, "device": device}
    except OSError:
        pass  # not Linux: leave unknown
    return best


def _drop_file_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class DiskLimit:
    """O_DIRECT (or buffered) sequential writes and reads of one preallocated, written file."""

    def __init__(self, directory: Path, total_bytes: int, mode: IoMode) -> None:
        self.path = directory / "limit.bin"
        self.mode = mode
        self.fd = os.open(self.path, os.O_CREAT | open_flags(mode), 0o644)
        zeros = AlignedBuffer(4 * MiB)
        try:
            for pos in range(0, total_bytes, zeros.size_bytes):
                os.pwrite(self.fd, zeros.view[:min(zeros.size_bytes, total_bytes - pos)], pos)
            os.fsync(self.fd)
        finally:
            zeros.close()

    def write(self, bufs: BufferSet, n: int, chunk: int, sync: bool) -> None:
        for i in range(n):
            os.pwrite(self.fd, bufs[i], i * chunk)
            if sync:
                os.fdatasync(self.fd)

    def read(self, bufs: BufferSet, n: int, chunk: int) -> None:
        if self.mode is IoMode.BUFFERED:
            _drop_file_cache([self.path])
        for i in range(n):
            os.preadv(self.fd, [bufs[i]], i * chunk)

    def close(self) -> None:
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def bench_nvme(plan: Plan, directory: Path) -> tuple[list[Row], dict[str, Any]]:
    rows: list[Row] = []
    max_total = max(plan.chunks(plan.nvme_total_bytes, c) * c for c in plan.chunk_sizes)
    tier_dir = directory / "tier"
    # Room for every pass plus per-chunk headers and segment tails (the 256 KiB pass adds
    # 4 KiB per chunk).
    capacity = max_total + max_total // 4 + 64 * MiB
    tier = NvmeTier.open(NvmeTierConfig(directory=tier_dir, capacity_bytes=capacity))
    info: dict[str, Any] = {"directory": str(directory), "filesystem": filesystem_of(directory),
                            "io_mode": tier.io_mode.value,
                            "io_mode_reason": tier.nvme_stats().io_mode_reason,
                            "capacity_bytes": capacity}
    info["read_cache"] = ("O_DIRECT: reads bypass the page cache"
                          if tier.io_mode is IoMode.DIRECT else
                          "buffered: posix_fadvise(DONTNEED) on every file before each read pass")
    limit = DiskLimit(directory, max_total, tier.io_mode)
    try:
        # Warm-up, untimed: fill the whole budget once so every segment file exists (and is
        # zero-filled) before the timed passes, which then overwrite written blocks like the
        # limit's writes do.
        warm = BufferSet(min(16 * MiB, max(plan.chunk_sizes)), 1)
        warm_keys: list[bytes] = []
        try:
            with contextlib.suppress(CapacityError):
                while True:
                    warm_keys.append(f"warm{len(warm_keys)}".encode())
                    tier.put(warm_keys[-1], warm[0])
            for key in warm_keys[:-1]:
                tier.remove(key)
        finally:
            warm.close()
        variants = [True, False] if plan.unaligned else [True]
        how = "O_DIRECT" if tier.io_mode is IoMode.DIRECT else "buffered"
        for chunk in plan.chunk_sizes:
            n = plan.chunks(plan.nvme_total_bytes, chunk)
            total = n * chunk
            bufs = {a: (BufferSet(chunk, _pool_count(chunk, n), aligned=a),
                        BufferSet(chunk, _pool_count(chunk, n), aligned=a, seed=1))
                    for a in variants}
            keys = [f"n{chunk}-{i}".encode() for i in range(n)]
            best: dict[str, float] = {}

            def keep(name: str, seconds: float, total: int = total,
                     best: dict[str, float] = best) -> None:
                best[name] = max(best.get(name, 0.0), _gbps(total, seconds))

            try:
                # Every round measures the limits and each variant back to back, so a slow
                # moment of the shared disk hits the tier and its limit alike.
                for _ in range(plan.rounds):
                    src, dst = bufs[True]
                    keep("raw", _timed(limit.write, src, n, chunk, False))
                    keep("write", _timed(limit.write, src, n, chunk, True))
                    keep("read", _timed(limit.read, dst, n, chunk))
                    for aligned, (src, dst) in bufs.items():
                        keep(f"put-{aligned}", _timed(_tier_put, tier, keys, src))
                        if tier.io_mode is IoMode.BUFFERED:  # not timed
                            _drop_file_cache(sorted(tier_dir.glob("seg-*.kvt")))
                        keep(f"get-{aligned}", _timed(_tier_get, tier, keys, dst))
                        for key in keys:
                            tier.remove(key)
            finally:
                for src, dst in bufs.values():
                    src.close()
                    dst.close()
            for aligned in variants:
                put, get = best[f"put-{aligned}"], best[f"get-{aligned}"]
                rows.append(Row("nvme", "put", chunk, put, best["write"], put / best["write"],
                                total, aligned,
                                f"{how} sequential pwrite + fdatasync per chunk", best["raw"]))
                rows.append(Row("nvme", "get", chunk, get, best["read"], get / best["read"],
                                total, aligned, f"{how} sequential pread"))
        info["segments"] = tier.nvme_stats().segments
    finally:
        limit.close()
        tier.close()
    return rows, info


# --- HBM ----------------------------------------------------------------------------------------


def bench_hbm(plan: Plan) -> list[Row]:
    """Host<->device beside the HBM tier (only with CUDA; never run on the reference machine)."""
    import torch

    from kvstore.dataplane.hbm import HbmTier

    rows: list[Row] = []
    for chunk in plan.chunk_sizes:
        n = plan.chunks(plan.dram_total_bytes, chunk)
        total = n * chunk
        pool = _pool_count(chunk, n)
        host_src = Cycle([torch.randint(0, 255, (chunk,), dtype=torch.uint8).pin_memory()
                          for _ in range(pool)])
        host_dst = Cycle([torch.empty(chunk, dtype=torch.uint8).pin_memory()
                          for _ in range(pool)])
        device = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        tier = HbmTier(total + 16 * MiB)
        keys = [f"h{chunk}-{i}".encode() for i in range(n)]
        best = {"h2d": 0.0, "d2h": 0.0, "put": 0.0, "get": 0.0}
        try:
            for _ in range(plan.rounds):
                steps: list[tuple[str, Callable[..., object], tuple[Any, ...]]] = [
                    ("h2d", _h2d, (device, host_src, n)), ("put", _tier_put, (tier, keys, host_src)),
                    ("d2h", _d2h, (device, host_dst, n)), ("get", _tier_get, (tier, keys, host_dst))]
                for name, fn, args in steps:
                    best[name] = max(best[name], _gbps(total, _timed(fn, *args)))
                for key in keys:
                    tier.remove(key)
        finally:
            tier.close()
        rows.append(Row("hbm", "put", chunk, best["put"], best["h2d"], best["put"] / best["h2d"],
                        total, True, "torch copy_ pinned host -> device"))

        rows.append(Row("hbm", "get", chunk, best["get"], best["d2h"], best["get"] / best["d2h"],
                        total, True, "torch copy_ device -> pinned host"))
    return rows


def _h2d(device: Any, host: Cycle, n: int) -> None:
    import torch

    for i in range(n):
        device.copy_(host[i])
    torch.cuda.synchronize()


def _d2h(device: Any, host: Cycle, n: int) -> None:
    import torch

    for i in range(n):
        host[i].copy_(device)
    torch.cuda.synchronize()


# --- driver -------------------------------------------------------------------------------------


def _cuda_available() -> bool:
    try:
        from kvstore.dataplane import cuda
    except ImportError:
        return False
    return bool(cuda.cuda_available())


@contextlib.contextmanager
def _scratch_dir(directory: Path | None) -> Iterator[Path]:
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="kvtier-bench-tiers-", dir=directory))
    else:
        scratch, _ = default_nvme_dir()
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(quick: bool, directory: Path | None = None, unaligned: bool = False,
        plan: Plan | None = None) -> dict[str, Any]:
    """Measure every row (``plan`` overrides the sizes: tests use a tiny one)."""
    plan = plan or Plan(quick=quick, rounds=1 if quick else 5,
                        dram_total_bytes=128 * MiB if quick else 512 * MiB,
                        nvme_total_bytes=128 * MiB if quick else 512 * MiB, unaligned=unaligned)
    started = time.perf_counter()
    rows = bench_dram(plan)
    with _scratch_dir(directory) as scratch:
        nvme_rows, nvme_info = bench_nvme(plan, scratch)
    rows += nvme_rows
    hbm = "measured" if _cuda_available() else "skipped: no CUDA device"
    if _cuda_available():
        rows += bench_hbm(plan)
    return {
        **run_header("tiers", dists=("numpy", "xxhash", "torch"),
                     dirty_paths=("kvstore/dataplane", "bench/tiers.py")),
        "quick": quick,
        "rounds": plan.rounds,
        "figures": "best of rounds; GB/s = 1e9 bytes/s; one thread",
        "nvme": nvme_info,
        "hbm": hbm,
        "elapsed_s": time.perf_counter() - started,
        "rows": [asdict(r) for r in rows],
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Tier throughput beside the limit measured in the same run "
                        f"({'quick' if result['quick'] else 'full'}, best of {result['rounds']})")
    for col in ("tier", "op", "chunk", "buffers", "GB/s", "limit GB/s", "ratio", "limit",
                "unsynced"):
        table.add_column(col, justify="right" if col not in ("tier", "op", "limit") else "left")
    for r in result["rows"]:
        chunk = r["chunk_bytes"]
        size = f"{chunk // MiB} MiB" if chunk >= MiB else f"{chunk // KiB} KiB"
        ratio = r["ratio_to_limit"]
        colour = "green" if ratio >= 0.8 else "yellow" if ratio >= 0.6 else "red"
        raw = r.get("raw_write_gbps")
        table.add_row(r["tier"], r["op"], size, "aligned" if r["src_aligned"] else "unaligned",
                      f"{r['gbps']:.2f}", f"{r['limit_gbps']:.2f}",
                      f"[{colour}]{ratio:.2f}[/{colour}]", short_limit(r["limit"]),
                      f"{raw:.2f}" if raw else "")
    console = Console(width=max(110, Console().width))
    console.print(table)
    console.print("unsynced: the same O_DIRECT writes without fdatasync (GB/s)")
    nvme = result["nvme"]
    console.print(f"nvme: {nvme['directory']} on {nvme['filesystem']['type']} "
                  f"({nvme['filesystem']['device']}), {nvme['io_mode']} I/O; {nvme['read_cache']}")
    console.print(f"hbm: {result['hbm']}; git {result['git_sha']}; "
                  f"{result['machine']['cpus']} CPUs; {result['elapsed_s']:.0f} s")


def main(json_path: Path | None, quick: bool, directory: Path | None = None,
         unaligned: bool = False) -> dict[str, Any]:
    result = run(quick, directory, unaligned)
    print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    return result

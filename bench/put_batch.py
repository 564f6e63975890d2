"""A batched same-host put of one step's blocks, beside a memcpy of the same bytes in the same run.

Run with ``python -m bench.put_batch [--quick] [--json PATH]``.

Each call stores ``BATCH_BLOCKS`` blocks of one size as one chain (block ``i``'s parent is block
``i - 1``; the first is a root) with one ``StoreClient.put_many(keys, values, parents=...)`` on the
shared-memory plane against a ``kvtier daemon`` process (DRAM only), what a KV connector's save of
one step does. The limit is ``memcpy``: the same blocks copied with ``copy_bytes`` into the next
slots of a pre-touched 256 MiB store (not in the CPU cache, as an arena range a put writes is not),
as ``bench/datapath.py``'s ``memcpy`` path. The two take turns per round, so background load lands
on both alike. Between timed calls the chain is removed (untimed), so every put writes blocks that
are not stored. Figures are ``bytes / sum(per-call seconds)`` in GB/s (10^9 B/s); ``ratio`` is the
put's figure over memcpy's. Every chain is read back once and compared.

Where a put's time goes: per timed call, the CPU time the daemon process spent (all its threads,
``/proc/<pid>/task/*/schedstat``, read outside the timed region) and the calling thread's own
(``time.thread_time_ns``: its copies and framing), as medians per call. A daemon CPU per call
near the put's wall time says the daemon's bookkeeping is the limit; the client's near it, the
copies are.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._meta import git_sha
from bench.datapath import MemcpyPath, _split_cpus, spawn_daemon, stop_daemon

KiB, MiB = 1 << 10, 1 << 20
SIZES_BYTES = (64 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 4 * MiB)
MODEL_BLOCK_BYTES = 512 * KiB
"""One block of ``kvtier bench vllm``'s model (all its layers): the size issue 13's goal starts at."""
BATCH_BLOCKS = 32
BATCH_BYTES_TARGET = 256 * MiB
"""Bytes each size moves per round and path (at least 8 calls)."""


def process_cpu_ns(pid: int) -> int:
    """CPU time (ns) the live threads of process ``pid`` have run, from the scheduler's own
    count (``/proc/<pid>/task/*/schedstat``, nanoseconds; ``/proc/<pid>/stat`` counts clock
    ticks of 10 ms, too coarse for a call of a millisecond). A thread that ended no longer
    counts. Linux only; raises OSError when the process is gone."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return total


def _calls(size_bytes: int, quick: bool) -> int:
    return max(8, (BATCH_BYTES_TARGET // (4 if quick else 1)) // (size_bytes * BATCH_BLOCKS))


def run(quick: bool, sizes_bytes: tuple[int, ...] = SIZES_BYTES) -> dict[str, Any]:
    from kvstore.client import DataPlane, StoreClient, StoreClientConfig

    split = _split_cpus()
    before = os.sched_getaffinity(0)
    import bench.datapath as datapath

    if split is not None:
        os.sched_setaffinity(0, split[0])
        datapath._SERVER_CPUS = split[1]
    proc, address = spawn_daemon("bench-put-batch")
    client = StoreClient.connect(address, StoreClientConfig(data_plane=DataPlane.SHM,
                                                            wait_for_ready=True))
    memcpy = MemcpyPath()
    rounds = 3 if quick else 5
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[int]] = {}  # ("daemon" | "client", size): ns per call
    rng = np.random.default_rng(0)
    try:
        for size in sizes_bytes:
            blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(BATCH_BLOCKS)]
            srcs = [b.data for b in blocks]
            per_round = -(-_calls(size, quick) // rounds)
            for r in range(rounds):
                for name in (("put", "memcpy") if r % 2 == 0 else ("memcpy", "put")):
                    ts = times.setdefault((name, size), [])
                    for i in range(per_round + (1 if r == 0 else 0)):  # one warm-up call
                        keys = [b"pb-%d-%d-%d-%d" % (size, r, i, j) for j in range(BATCH_BLOCKS)]
                        parents: list[bytes | None] = [None, *keys[:-1]]
                        if name == "put":
                            daemon0 = process_cpu_ns(proc.pid)
                            client0 = time.thread_time_ns()
                        t0 = time.perf_counter()
                        if name == "put":
                            stored = client.put_many(keys, srcs, parents=parents)
                        else:
                            memcpy.put_many(keys, srcs)
                        elapsed = time.perf_counter() - t0
                        if r or i:
                            ts.append(elapsed)
                            if name == "put":
                                client_ns = time.thread_time_ns() - client0
                                cpu.setdefault(("daemon", size), []).append(
                                    process_cpu_ns(proc.pid) - daemon0)
                                cpu.setdefault(("client", size), []).append(client_ns)
                        if name == "put":
                            if not all(stored):
                                raise RuntimeError(f"put_many stored {stored}")
                            if r == 0 and i == 0:
                                _check(client, keys, blocks)
                            client.remove(keys[0])  # untimed: the whole chain
    finally:
        client.close()
        stop_daemon(proc)
        os.sched_setaffinity(0, before)
        datapath._SERVER_CPUS = None
    rows = []
    for size in sizes_bytes:
        put, cp = times[("put", size)], times[("memcpy", size)]
        nbytes = size * BATCH_BLOCKS
        put_gbps = nbytes * len(put) / sum(put) / 1e9
        cp_gbps = nbytes * len(cp) / sum(cp) / 1e9
        rows.append({"block_bytes": size, "model_block": size == MODEL_BLOCK_BYTES,
                     "blocks": BATCH_BLOCKS, "calls": len(put),
                     "put_gbps": put_gbps, "memcpy_gbps": cp_gbps,
                     "ratio_to_memcpy": put_gbps / cp_gbps,
                     "put_p50_us": float(np.percentile(np.asarray(put) * 1e6, 50)),
                     "memcpy_p50_us": float(np.percentile(np.asarray(cp) * 1e6, 50)),
                     "daemon_cpu_us_per_call": float(np.median(cpu[("daemon", size)])) / 1e3,
                     "client_cpu_us_per_call": float(np.median(cpu[("client", size)])) / 1e3})
    return {"benchmark": "put_batch", "quick": quick, "git_sha": git_sha(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(),
                        "load_average": os.getloadavg()},
            "settings": {"blocks_per_call": BATCH_BLOCKS, "rounds": rounds, "chain": True,
                         "cpu_pinning": None if split is None else {
                             "client": sorted(split[0]), "servers": sorted(split[1])}},
            "rows": rows}


def _check(client: Any, keys: list[bytes], blocks: list[np.ndarray]) -> None:
    out = np.empty(blocks[0].size, np.uint8)
    for key, block in zip(keys, blocks, strict=True):
        client.get_into(key, out)
        if not np.array_equal(out, block):
            raise RuntimeError(f"block {key!r} read back other bytes")


def print_table(result: dict[str, Any]) -> None:
    print(f"batched same-host put of {BATCH_BLOCKS} chained blocks vs memcpy of the same bytes "
          "(same run; GB/s = 10^9 B/s)")
    print(f"{'block':>8} {'put GB/s':>9} {'memcpy GB/s':>12} {'ratio':>6} {'put p50 µs':>11} "
          f"{'memcpy p50 µs':>14} {'daemon CPU µs':>14} {'client CPU µs':>14}")
    for row in result["rows"]:
        size = row["block_bytes"]
        label = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
        if row.get("model_block"):
            label = "*" + label
        print(f"{label:>8} {row['put_gbps']:9.2f} {row['memcpy_gbps']:12.2f} "
              f"{row['ratio_to_memcpy']:6.2f} {row['put_p50_us']:11.0f} "
              f"{row['memcpy_p50_us']:14.0f} {row['daemon_cpu_us_per_call']:14.0f} "
              f"{row['client_cpu_us_per_call']:14.0f}")
    print("CPU: median per put call, the daemon's (all threads) and the calling thread's")
    print(f"* the model's block size ({MODEL_BLOCK_BYTES // KiB} KiB: one block of bench vllm's "
          "model, all layers)")
    print(f"git {result['git_sha']}, {result['machine']['platform']}, "
          f"{result['machine']['cpus']} CPUs, load {result['machine']['load_average']}")


def main(argv: list[str]) -> None:
    result = run("--quick" in argv)
    print_table(result)
    if "--json" in argv:
        path = Path(argv[argv.index("--json") + 1])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

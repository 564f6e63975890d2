"""The DRAM tier's own measurements: pre-fault cost, copy paths, tier put/get, fragmentation, codecs.

Run with ``.venv/bin/python -m bench.dram_arena [--quick] [--json PATH]``. (``kvtier bench
tiers`` compares the tiers end to end; this one explains the DRAM tier's design choices.)

Every throughput is the best of ``REPEATS`` passes over a working set larger than the
CPU caches, beside the limit measured in the same run: single-thread numpy ``copyto``
between two pre-touched anonymous buffers of the same chunk size.

Sections (each prints a markdown table and lands in the JSON):

* ``prefault``: seconds per GiB to create an arena (``posix_fallocate`` + the
  pre-fault), by method, and the first-touch copy speed without a pre-fault;
* ``copy``: numpy ``copyto`` vs memoryview slice assignment into the arena, and the
  DramTier ``put``/``get_into`` throughput, each as a ratio to memcpy;
* ``fragmentation``: the allocator under a mixed-size churn at high occupancy;
* ``codecs``: ratio and single-thread speed of each codec on fp16/bf16 KV chunks of a
  random-weight Llama (NOT representative of a trained model) and on N(0,1) fp16.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench._meta import run_header
from kvstore.dataplane import arena as arena_mod
from kvstore.dataplane.allocator import ExtentAllocator
from kvstore.dataplane.arena import PinMode, ShmArena
from kvstore.dataplane.compress import CodecKind, CodecSpec, make_codec
from kvstore.dataplane.dram import DramTier
from kvstore.errors import CapacityError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
REPEATS = 3
CHUNK_SIZES = (256 * KiB, MiB, 4 * MiB, 16 * MiB, 64 * MiB)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def _best(fn: Callable[[], int], repeats: int = REPEATS) -> float:
    """Best GB/s of ``repeats`` runs of ``fn`` (which returns the bytes it moved)."""
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        moved = fn()
        best = max(best, _gbps(moved, time.perf_counter() - start))
    return best


# --- pre-fault ------------------------------------------------------------------------------------


def bench_prefault(size_bytes: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for method in ("populate_write", "page_writes", "none"):
        secs: list[float] = []
        first_touch_gbps: list[float] = []
        for _ in range(REPEATS):
            saved = arena_mod.MADV_POPULATE_WRITE
            if method == "page_writes":
                arena_mod.MADV_POPULATE_WRITE = 0x7FFF  # unknown advice -> the fallback path
            try:
                start = time.perf_counter()
                arena = ShmArena.create(size_bytes, prefault=method != "none", pin=PinMode.OFF)
                secs.append(time.perf_counter() - start)
            finally:
                arena_mod.MADV_POPULATE_WRITE = saved
            try:
                src = np.ones(64 * MiB, dtype=np.uint8)
                dst = arena.array(0, size_bytes)
                start = time.perf_counter()
                for off in range(0, size_bytes, src.size):
                    n = min(src.size, size_bytes - off)
                    np.copyto(dst[off : off + n], src[:n])
                first_touch_gbps.append(_gbps(size_bytes, time.perf_counter() - start))
                del dst
            finally:
                arena.close()
        rows.append(
            {
                "method": method,
                "arena_bytes": size_bytes,
                "create_s_per_gib": min(secs) / (size_bytes / GiB),
                "create_s_per_gib_worst": max(secs) / (size_bytes / GiB),
                "first_copy_gbps": max(first_touch_gbps),
                "first_copy_gbps_worst": min(first_touch_gbps),
            }
        )
    return rows


# --- copies -------------------------------------------------------------------------------------


def _copy_ops(
    tier: DramTier, srcs: list[np.ndarray], dsts: list[np.ndarray], outs: list[np.ndarray]
) -> dict[str, Callable[[], int]]:
    """One pass of each copy path over every chunk; each returns the bytes it moved."""
    chunk = srcs[0].size
    total = chunk * len(srcs)
    keys = [f"c{i}".encode() for i in range(len(srcs))]
    arena = tier._arena
    arena_np = [arena.array(i * chunk, chunk) for i in range(len(srcs))]
    arena_mv = [arena.view(i * chunk, chunk, readonly=False) for i in range(len(srcs))]
    src_mv = [memoryview(s.data) for s in srcs]

    def memcpy() -> int:
        for d, s in zip(dsts, srcs, strict=True):
            np.copyto(d, s)
        return total

    def arena_numpy() -> int:
        for d, s in zip(arena_np, srcs, strict=True):
            np.copyto(d, s)
        return total

    def arena_memoryview() -> int:
        for d, s in zip(arena_mv, src_mv, strict=True):
            d[:] = s
        return total

    def tier_put() -> int:
        for k in keys:
            tier.remove(k)  # untimed in spirit: a dict pop and an allocator free (~2 µs)
        for k, s in zip(keys, srcs, strict=True):
            tier.put(k, s)
        return total

    def tier_get() -> int:
        for k, o in zip(keys, outs, strict=True):
            tier.get_into(k, o)
        return total

    return {
        "memcpy": memcpy,
        "arena_numpy_copyto": arena_numpy,
        "arena_memoryview": arena_memoryview,
        "tier_put": tier_put,
        "tier_get": tier_get,
    }


def bench_copies(working_set_bytes: int, passes: int) -> list[dict[str, Any]]:
    """Each path copies the working set ``passes`` times; paths are interleaved round by
    round (best of REPEATS rounds) so a noisy neighbour hurts them alike."""
    rows: list[dict[str, Any]] = []
    src_all = np.full(working_set_bytes, 7, dtype=np.uint8)  # all pre-touched
    dst_all = np.full(working_set_bytes, 1, dtype=np.uint8)
    out_all = np.full(working_set_bytes, 2, dtype=np.uint8)
    for chunk in CHUNK_SIZES:
        n = working_set_bytes // chunk

        def split(buf: np.ndarray, n: int = n, chunk: int = chunk) -> list[np.ndarray]:
            return [buf[i * chunk : (i + 1) * chunk] for i in range(n)]

        tier = DramTier(n * chunk, pin=PinMode.OFF)
        try:
            ops = _copy_ops(tier, split(src_all), split(dst_all), split(out_all))
            ops["tier_put"]()  # so the first tier_get finds every key
            best = dict.fromkeys(ops, 0.0)
            for _ in range(REPEATS):
                for name, op in ops.items():
                    start = time.perf_counter()
                    moved = sum(op() for _ in range(passes))
                    best[name] = max(best[name], _gbps(moved, time.perf_counter() - start))
            del ops
        finally:
            tier.close()
        limit = best["memcpy"]
        rows.append(
            {
                "chunk_bytes": chunk,
                "memcpy_gbps": limit,
                "arena_numpy_copyto_gbps": best["arena_numpy_copyto"],
                "arena_memoryview_gbps": best["arena_memoryview"],
                "tier_put_gbps": best["tier_put"],
                "tier_get_gbps": best["tier_get"],
                "put_ratio": best["tier_put"] / limit,
                "get_ratio": best["tier_get"] / limit,
            }
        )
    return rows


# --- fragmentation ------------------------------------------------------------------------------


def bench_fragmentation(ops: int) -> list[dict[str, Any]]:
    """Churn at a target occupancy; count requests refused while enough bytes were free."""
    rows: list[dict[str, Any]] = []
    capacity = 4 * GiB
    workloads: dict[str, Callable[[random.Random], int]] = {
        "uniform 2 MiB": lambda r: 2 * MiB,
        "two sizes (1 and 2 MiB + 1)": lambda r: MiB if r.random() < 0.5 else 2 * MiB + 1,
        "log-uniform 64 KiB..16 MiB": lambda r: int(2 ** r.uniform(16, 24)),
    }
    for name, draw in workloads.items():
        for occupancy in (0.80, 0.95):
            rng = random.Random(42)
            alloc = ExtentAllocator(capacity, 4096)
            live: list[int] = []
            refused = refused_with_room = 0
            frag_samples: list[float] = []
            start = time.perf_counter()
            for i in range(ops):
                if alloc.used_bytes > occupancy * capacity:
                    alloc.free(live.pop(rng.randrange(len(live))))
                    continue
                size = draw(rng)
                try:
                    live.append(alloc.allocate(size))
                except CapacityError:
                    refused += 1
                    if alloc.free_bytes >= size:
                        refused_with_room += 1
                    alloc.free(live.pop(rng.randrange(len(live))))
                if i % 100 == 0:
                    frag_samples.append(alloc.fragmentation())
            elapsed = time.perf_counter() - start
            alloc.check_invariants()
            rows.append(
                {
                    "workload": name,
                    "occupancy_target": occupancy,
                    "ops": ops,
                    "refused": refused,
                    "refused_with_enough_free_bytes": refused_with_room,
                    "mean_fragmentation": float(np.mean(frag_samples)),
                    "max_fragmentation": float(np.max(frag_samples)),
                    "free_extents_end": alloc.free_extent_count,
                    "us_per_op": elapsed / ops * 1e6,
                }
            )
    return rows


# --- codecs -------------------------------------------------------------------------------------


def model_kv_chunks(quick: bool) -> dict[str, list[bytes]]:
    """KV chunks (256-token blocks) of the random-weight reference Llama, as fp16 and bf16."""
    import torch

    from kvstore.client.kvlayout import KVLayout
    from kvstore.engine.model import build_reference_model

    model = build_reference_model()
    tokens = 512 if quick else 2048
    ids = torch.randint(
        0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layout = KVLayout.for_model(model, block_tokens=256)
    chunks = layout.pack(cache, 0, tokens // 256)
    return {
        "llama-random fp16": [
            c.to(torch.float16).contiguous().view(torch.uint8).numpy().tobytes() for c in chunks
        ],
        "llama-random bf16": [
            c.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes() for c in chunks
        ],
    }


def bench_codecs(quick: bool) -> list[dict[str, Any]]:
    datasets = model_kv_chunks(quick)
    rng = np.random.default_rng(0)
    datasets["N(0,1) fp16"] = [
        rng.standard_normal(MiB).astype(np.float16).tobytes() for _ in range(4)
    ]
    specs = [
        CodecSpec(CodecKind.LZ4, level=0, min_saving=0.0),
        CodecSpec(CodecKind.LZ4, level=0, shuffle_bytes=2, min_saving=0.0),
        CodecSpec(CodecKind.ZSTD, level=1, min_saving=0.0),
        CodecSpec(CodecKind.ZSTD, level=1, shuffle_bytes=2, min_saving=0.0),
        CodecSpec(CodecKind.ZSTD, level=3, shuffle_bytes=2, min_saving=0.0),
    ]
    rows: list[dict[str, Any]] = []
    for data_name, chunks in datasets.items():
        raw_total = sum(len(c) for c in chunks)
        for spec in specs:
            codec = make_codec(spec)
            assert codec is not None
            packed: list[bytes] = []
            start = time.perf_counter()
            for c in chunks:
                out = codec.compress(memoryview(c))
                packed.append(out if out is not None else c)
            c_s = time.perf_counter() - start
            outs = [bytearray(len(c)) for c in chunks]
            start = time.perf_counter()
            for p, o, c in zip(packed, outs, chunks, strict=True):
                if p is not c:
                    codec.decompress_into(memoryview(p), memoryview(o))
            d_s = time.perf_counter() - start
            stored_raw = all(p is c for p, c in zip(packed, chunks, strict=True))
            rows.append(
                {
                    "data": data_name,
                    "chunk_bytes": len(chunks[0]),
                    "codec": f"{spec.kind.value}-{spec.level}"
                    + (" +shuffle" if spec.shuffle_bytes else ""),
                    "ratio": raw_total / sum(len(p) for p in packed),
                    "compress_gbps": _gbps(raw_total, c_s),
                    # All chunks stored raw (the frame would have grown): nothing to decode.
                    "decompress_gbps": float("nan") if stored_raw else _gbps(raw_total, d_s),
                }
            )
    return rows


# --- driver -------------------------------------------------------------------------------------


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])

    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(json_path: Path | None = None, quick: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {**run_header("dram_arena", dists=("numpy",)), "quick": quick}
    sections: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        ("prefault", lambda: bench_prefault(256 * MiB if quick else GiB)),
        ("copy", lambda: bench_copies(256 * MiB if quick else 512 * MiB, 2 if quick else 4)),
        ("fragmentation", lambda: bench_fragmentation(20_000 if quick else 200_000)),
        ("codecs", lambda: bench_codecs(quick)),
    ]
    for name, run in sections:
        rows = run()
        result[name] = rows
        print(f"\n### {name}\n\n{_table(rows)}", flush=True)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    main(args.json, args.quick)

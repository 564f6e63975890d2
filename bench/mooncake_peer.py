"""The Mooncake store as a data-path peer, run by ``bench/datapath.py`` in Mooncake's own venv.

It is started with the Python of the virtual environment that
``../shared/peers/mooncake/run_peer.sh`` makes (``mooncake-transfer-engine-non-cuda``), so it
imports only numpy and mooncake, never kvtier. Roles:

``holder``
    Mounts a segment (the memory every value lands in), prints ``READY``, and serves until
    its stdin closes.
``client``
    Contributes no memory, so every byte crosses Mooncake's TCP transport to the holder
    process. Reads a JSON plan on stdin (``{"sizes": [...], "ops": [...], "calls": {...},
    "warmup": n, "batch_keys": k}``) and prints one JSON line with per-call seconds for each
    op and size: zero-copy ``put_from``/``get_into`` on registered buffers for single values,
    ``batch_put_from``/``batch_get_into`` for batches. Put calls remove their keys untimed
    between iterations; gets are checked against the bytes put.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from mooncake.store import MooncakeDistributedStore, ReplicateConfig


def setup(args: argparse.Namespace, segment_bytes: int, local_bytes: int
          ) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", args.metadata, segment_bytes, local_bytes, "tcp", "",
                     args.master)
    if rc != 0:
        raise SystemExit(f"mooncake setup() failed with {rc}")
    return store


def holder(args: argparse.Namespace) -> None:
    store = setup(args, args.segment_bytes, 16 << 20)
    print("READY", flush=True)
    sys.stdin.read()  # until the driver closes our stdin
    store.close()


def _put(store: MooncakeDistributedStore, cfg: ReplicateConfig, keys: list[str],
         ptrs: list[int], sizes: list[int]) -> None:
    if len(keys) == 1:
        codes = [store.put_from(keys[0], ptrs[0], sizes[0], cfg)]
    else:
        codes = store.batch_put_from(keys, ptrs, sizes, cfg)
    if any(c != 0 for c in codes):
        raise SystemExit(f"mooncake put of {sizes[0]} bytes failed: {codes}")


def client(args: argparse.Namespace) -> None:
    plan = json.loads(sys.stdin.readline())
    sizes, ops, batch_keys = plan["sizes"], plan["ops"], plan["batch_keys"]
    store = setup(args, 0, args.local_bytes)
    cfg = ReplicateConfig()
    cfg.replica_num = 1
    largest = max(max(sizes), batch_keys * plan["batch_max_value_bytes"])
    src = np.random.default_rng(0).integers(0, 256, largest, dtype=np.uint8)
    dst = np.zeros(largest, dtype=np.uint8)
    for buf in (src, dst):
        if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
            raise SystemExit("mooncake register_buffer failed")
    out: dict[str, list[float]] = {}
    for size in sizes:
        for op in ops:
            batch = batch_keys if op.endswith("_batch") else 1
            if batch > 1 and size > plan["batch_max_value_bytes"]:
                continue
            calls = plan["calls"][f"{op}:{size}"]
            keys = [f"mc-{size}-{i}" for i in range(batch)]
            src_ptrs = [src.ctypes.data] * batch
            dst_ptrs = [dst.ctypes.data + i * size for i in range(batch)]
            sizes_list = [size] * batch
            times: list[float] = []
            if op.startswith("put"):
                for i in range(plan["warmup"] + calls):
                    t0 = time.perf_counter()
                    _put(store, cfg, keys, src_ptrs, sizes_list)
                    elapsed = time.perf_counter() - t0
                    for key in keys:
                        store.remove(key, True)
                    if i >= plan["warmup"]:
                        times.append(elapsed)
            else:
                _put(store, cfg, keys, src_ptrs, sizes_list)
                for i in range(plan["warmup"] + calls):
                    t0 = time.perf_counter()
                    if batch == 1:
                        got = [store.get_into(keys[0], dst_ptrs[0], size)]
                    else:
                        got = store.batch_get_into(keys, dst_ptrs, sizes_list)
                    elapsed = time.perf_counter() - t0
                    if any(g != size for g in got):
                        raise SystemExit(f"mooncake get of {size} bytes returned {got}")
                    if i >= plan["warmup"]:
                        times.append(elapsed)
                if not np.array_equal(dst[:size], src[:size]):
                    raise SystemExit(f"mooncake get of {size} bytes returned other bytes")
                for key in keys:
                    store.remove(key, True)
            out[f"{op}:{size}"] = times
    store.close()
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--role", choices=["holder", "client"], required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--metadata", required=True)
    ap.add_argument("--segment-bytes", type=int, default=1 << 30)
    ap.add_argument("--local-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    holder(args) if args.role == "holder" else client(args)


if __name__ == "__main__":
    main()

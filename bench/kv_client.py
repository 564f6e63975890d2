"""KVClient throughput for a realistic chunk, beside the daemon's own data path and memcpy.

Run with ``.venv/bin/python -m bench.kv_client [--quick] [--json PATH]``.

The KV layout is a Llama-3-8B-like model (32 layers, 8 KV heads, head dim 128, bf16) in blocks of
32 tokens: one chunk (all layers of one block) is 4 MiB, one layer of one block 128 KiB. A
``kvtier daemon`` child process (DRAM only) serves a client in this process over shared memory
(``shm``) and over its TCP plane (``tcp``, what another node sees). Rows, each over ``N`` blocks
moved per call, GB/s = bytes / seconds (10^9), median of the repetitions:

``memcpy``          one torch ``copy_`` per 4 MiB chunk between pre-touched buffers (the limit)
``store put/get``   :class:`StoreClient` ``put`` of a chain / ``load_prefix`` into chunk buffers:
                    the daemon data path, no engine layout
``client save``     :meth:`KVClient.save` from a contiguous ``[L, 2, H, T, D]`` engine buffer:
                    the per-layer gather into chunk layout, then the puts
``client load``     :meth:`KVClient.load` into such a buffer: fetch, then the per-layer scatter
                    (``transfer``/``scatter``: the two phases alone, from the result's
                    timings; ``save gather`` sums the layer copies, which run on two threads)
``per-layer put/get`` the alternative design: one 128 KiB chunk per (block, layer), put one by one
                    and fetched with one batch call per layer (``get_many_into``)

Then the cross-request batch rows: one engine step of ``--requests`` requests of
``--blocks-per-request`` blocks, through ``lookup_many`` / ``load_many`` / ``save_many`` against
as many single ``lookup`` / ``load`` / ``save`` calls (the loads and saves issued together and
waited for together), in ms per step, for the 4 MiB chunks above and for 512 KiB chunks
(``SMALL_LAYOUT``), beside a memcpy of the same bytes and one gRPC round trip (the floor of a
lookup). The saves are layer by layer as in an engine step: layer ``l`` of every request is
handed over (``save_layer``) before layer ``l + 1``, then the step's saves are finished.
``--batch-only`` skips the first table.

Then the vLLM CPU rows (``--vllm-only`` runs only them): ``--vllm-blocks`` (96) blocks of vLLM's
CPU layout (``CpuBlocksKV``: per layer ``[num_blocks, heads, block, 2 * head]``, every layer a
view of one allocation, as vLLM allocates them) for ``kvtier bench vllm``'s model
(``PREFILL_BOUND``: 8 layers, 4 KV heads, head dim 64, float32, 32-token blocks: 512 KiB
chunks), in 4 requests with shuffled vLLM block ids: a step's ``begin_save_many`` through staging
(gather into staging rows, then one ``put_many``; ``one_copy_save=False``) and in one copy
(reserve the step's chunks, gather straight into the arena, commit; "put" is then the commit
and the wait for the reservation), and ``load_many`` through the staging path (fetch into staging rows,
then a scatter per layer: the path before the one-copy load, forced with a layout that has no
``scatter_chunks``) and through the one-copy path (one copy per block out of the arena: with no
lease where the daemon's read index publishes the chunks, so "transfer" is 0), on the transfer
threads (``inline_load_bytes=0``) and, for a step of up to ``INLINE_LOAD_BYTES`` (16 MiB), also
in the calling thread ("one-copy inline"); the requests carry their keys (``BlockKeys``, made
before the clock starts, as the connector does), each as ms and as a multiple of a memcpy of the same
bytes in the same run; the load kinds take turns in order from one repetition to the next.
Then the same rows for one request of ``--vllm-small-blocks`` (15) blocks, the size of an average
request's load in ``kvtier bench vllm``, where per-call fixed costs weigh most (0 skips them).

The machine is shared and noisy (2 cores): compare ratios within one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from bench import datapath
from bench._meta import run_header
from kvstore.client.handles import LoadHandle
from kvstore.client.kv_client import KVClient, KVClientConfig
from kvstore.client.kvlayout import KVLayout, namespace_for
from kvstore.client.layouts import ContiguousKV
from kvstore.client.requests import BlockKeys, LoadRequest, RemoteFetch, SaveRequest
from kvstore.client.store_client import DataPlane

LAYOUT = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=32,
                  dtype=torch.bfloat16)
DAEMON_DRAM = "768MiB"


def spawn_daemon(node_id: str = "bench-kvclient") -> tuple[subprocess.Popen[str], str]:
    return datapath.spawn_daemon(node_id, DAEMON_DRAM)


def gbps(n_bytes: int, seconds: float) -> float:
    return n_bytes / seconds / 1e9


def measure(plane: DataPlane, address: str, n_blocks: int, reps: int) -> dict[str, float]:
    layout = LAYOUT
    g = torch.Generator().manual_seed(0)
    engine_kv = torch.randn((layout.num_layers, 2, layout.num_kv_heads,
                             n_blocks * layout.block_tokens, layout.head_dim),
                            generator=g).to(layout.dtype)
    dst_kv = torch.zeros_like(engine_kv)
    chunks = layout.empty_chunks(n_blocks)
    chunks.copy_(torch.randn(chunks.shape, generator=g).to(layout.dtype))
    out_chunks = torch.zeros_like(chunks)
    layer_src = chunks.transpose(0, 1).contiguous()  # [L, n, 2, H, B, D]: one row per key
    layer_dst = torch.zeros_like(layer_src)

    cfg = KVClientConfig(data_plane=plane)
    ns = namespace_for(layout, "bench-llama-8b", plane.value)
    with KVClient.connect(address, layout, ns, cfg) as client:
        return _rounds(client, n_blocks, reps, engine_kv, dst_kv, chunks, out_chunks, layer_src,
                       layer_dst)


def _rounds(client: KVClient, n_blocks: int, reps: int, engine_kv: torch.Tensor,
            dst_kv: torch.Tensor, chunks: torch.Tensor, out_chunks: torch.Tensor,
            layer_src: torch.Tensor, layer_dst: torch.Tensor) -> dict[str, float]:
    layout = client.layout
    n_bytes = n_blocks * layout.chunk_bytes
    g = torch.Generator().manual_seed(1)
    samples: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(gbps(n_bytes, seconds))

    plane = client.store.data_plane
    store = client.store
    for rep in range(reps + 1):  # rep 0 warms up (and touches the staging pool), untimed
        tokens = torch.randint(0, 100_000, (n_blocks * layout.block_tokens,), generator=g).tolist()
        keys = client.keys(tokens)
        # memcpy limit
        t0 = time.perf_counter()
        for i in range(n_blocks):
            out_chunks[i].copy_(chunks[i])
        t_memcpy = time.perf_counter() - t0
        # store put / get of the raw chunks
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            store.put(key, chunks[i], parent=keys[i - 1] if i else None)
        t_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = store.load_prefix(keys, list(out_chunks))
        t_get = time.perf_counter() - t0
        assert got == n_blocks and torch.equal(out_chunks, chunks)
        store.remove(keys[0])
        # client save / load through the engine layout
        t0 = time.perf_counter()
        saved = client.save(tokens, ContiguousKV(engine_kv, layout)).result()
        t_save = time.perf_counter() - t0
        assert len(saved.stored_blocks) == n_blocks, saved
        t0 = time.perf_counter()
        loaded = client.load(tokens, ContiguousKV(dst_kv, layout)).result()
        t_load = time.perf_counter() - t0
        assert loaded.complete and torch.equal(dst_kv, engine_kv), loaded
        store.remove(keys[0])
        # per-layer chunks
        tag = xxhash.xxh3_64_digest(f"{rep}-{plane.value}".encode())
        layer_keys = [[tag + xxhash.xxh3_64_digest(k + bytes([layer])) for k in keys]
                      for layer in range(layout.num_layers)]
        t0 = time.perf_counter()
        for layer in range(layout.num_layers):
            for i, layer_key in enumerate(layer_keys[layer]):
                store.put(layer_key, layer_src[layer, i])
        t_lput = time.perf_counter() - t0
        t0 = time.perf_counter()
        for layer in range(layout.num_layers):
            store.get_many_into(layer_keys[layer], list(layer_dst[layer]))
        t_lget = time.perf_counter() - t0
        assert torch.equal(layer_dst, layer_src)
        store.evict(key_prefix=tag)
        if rep == 0:
            continue
        add("memcpy", t_memcpy)
        add("store put", t_put)
        add("store get", t_get)
        add("client save", t_save)
        add("client load", t_load)
        add("client load transfer", loaded.transfer_s)
        add("client load scatter", loaded.scatter_s)
        add("client save gather", saved.gather_s)
        add("client save put", saved.put_s)
        add("per-layer put", t_lput)
        add("per-layer get", t_lget)
    return {name: statistics.median(v) for name, v in samples.items()}


def measure_batch(plane: DataPlane, address: str, layout: KVLayout, n_requests: int,
                  m_blocks: int, reps: int) -> dict[str, float]:
    """One engine step of ``n_requests`` requests of ``m_blocks`` blocks each, moved through the
    cross-request batch APIs and through ``n_requests`` single calls (issued together, then
    waited for together, as a connector's ``start_load_kv`` would). Milliseconds per step,
    median of ``reps``; the single/batched order alternates between repetitions."""
    g = torch.Generator().manual_seed(2)
    n_tokens = m_blocks * layout.block_tokens
    shape = (layout.num_layers, 2, layout.num_kv_heads, n_tokens, layout.head_dim)
    sources = [torch.randn(shape, generator=g).to(layout.dtype) for _ in range(n_requests)]
    dsts = [torch.zeros_like(t) for t in sources]
    flat = layout.empty_chunks(n_requests * m_blocks)
    flat_src = torch.randn(flat.shape, generator=g).to(layout.dtype)
    samples: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds * 1e3)

    cfg = KVClientConfig(data_plane=plane)
    ns = namespace_for(layout, f"bench-batch-{layout.num_layers}", plane.value)
    with KVClient.connect(address, layout, ns, cfg) as client:
        store = client.store
        for rep in range(reps + 1):  # rep 0 warms up (staging pool, connections), untimed
            toks = [torch.randint(0, 100_000, (n_tokens,), generator=g).tolist()
                    for _ in range(n_requests)]
            kvs = [ContiguousKV(t, layout) for t in sources]
            outs = [ContiguousKV(t, layout) for t in dsts]
            t0 = time.perf_counter()
            flat.copy_(flat_src)
            t_memcpy = time.perf_counter() - t0
            t0 = time.perf_counter()
            store.refresh_info()  # one unary gRPC round trip: the floor of any lookup
            t_rtt = time.perf_counter() - t0
            timed: dict[str, float] = {}
            for batched in ((False, True) if rep % 2 else (True, False)):
                kind = "batched" if batched else "single"
                t0 = time.perf_counter()
                # As in an engine step: every request's layer l is handed over after layer l
                # ran for the whole batch, then the step's saves are finished.
                if batched:
                    many = client.begin_save_many([SaveRequest(t, kv) for t, kv in
                                                   zip(toks, kvs, strict=True)])
                    for layer in range(layout.num_layers):
                        many.save_layer(layer)
                    saved = many.finish().result()
                else:
                    savers = [client.begin_save(t, kv) for t, kv in zip(toks, kvs, strict=True)]
                    for layer in range(layout.num_layers):
                        for saver in savers:
                            saver.save_layer(layer)
                    saved = [f.result() for f in [saver.finish() for saver in savers]]
                timed[f"save {kind}"] = time.perf_counter() - t0
                assert all(len(r.stored_blocks) == m_blocks for r in saved), saved
                t0 = time.perf_counter()
                matches = (client.lookup_many(toks) if batched
                           else [client.lookup(t) for t in toks])
                timed[f"lookup {kind}"] = time.perf_counter() - t0
                assert all(m.blocks == m_blocks for m in matches)
                for d in dsts:
                    d.zero_()
                t0 = time.perf_counter()
                if batched:
                    handles = client.load_many([LoadRequest(t, o) for t, o in
                                                zip(toks, outs, strict=True)])
                else:
                    handles = [client.load(t, o) for t, o in zip(toks, outs, strict=True)]
                loaded = [h.result() for h in handles]
                timed[f"load {kind}"] = time.perf_counter() - t0
                assert all(r.complete for r in loaded), loaded
                assert all(torch.equal(a, b) for a, b in zip(dsts, sources, strict=True))
                for t in toks:
                    store.remove(client.keys(t)[0])
            if rep == 0:
                continue
            add("memcpy", t_memcpy)
            add("grpc round trip", t_rtt)
            for name, seconds in timed.items():
                add(name, seconds)
    return {name: statistics.median(v) for name, v in samples.items()}


VLLM_CPU_LAYOUT = KVLayout(num_layers=8, num_kv_heads=4, head_dim=64, block_tokens=32,
                           dtype=torch.float32)
"""``kvtier bench vllm``'s model (``kvstore.cluster.vllm_instance.PREFILL_BOUND``) in vLLM's
CPU blocks of 32 tokens: 64 KiB per layer and block, 512 KiB chunks."""


INLINE_LOAD_BYTES = 16 << 20
"""``KVClientConfig.inline_load_bytes`` of the "one-copy inline" load rows (the other one-copy
rows run with 0: on the transfer threads)."""


class _StagedOnly:
    """An engine layout without ``scatter_chunks``: loads into it take the staging path."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def gather_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.gather_layer(layer, blocks, chunks)

    def scatter_layer(self, layer: int, blocks: range, chunks: torch.Tensor) -> None:
        self._inner.scatter_layer(layer, blocks, chunks)


def measure_vllm_cpu(address: str, n_blocks: int, reps: int, n_requests: int = 4
                     ) -> dict[str, float]:
    """One step's save and load of ``n_blocks`` blocks in vLLM's CPU layout (module
    docstring), ms, median of ``reps``; the staged/one-copy order alternates."""
    from kvstore.integrations.vllm.layout import CpuBlocksKV

    layout = VLLM_CPU_LAYOUT
    g = torch.Generator().manual_seed(4)
    total_blocks = 2 * n_blocks + 16
    shape = (layout.num_layers, total_blocks, layout.num_kv_heads, layout.block_tokens,
             2 * layout.head_dim)
    src_all = torch.randn(shape, generator=g)
    dst_all = torch.zeros(shape)
    src, dst = list(src_all), list(dst_all)  # per-layer views of one allocation
    perm = torch.randperm(total_blocks, generator=g).tolist()
    per = n_blocks // n_requests
    src_ids = [perm[i * per:(i + 1) * per] for i in range(n_requests)]
    dst_ids = [perm[n_blocks + i * per:n_blocks + (i + 1) * per] for i in range(n_requests)]
    flat = layout.empty_chunks(n_requests * per)
    flat_src = torch.randn(flat.shape, generator=g)
    samples: dict[str, list[float]] = {}
    inline = n_requests * per * layout.chunk_bytes <= INLINE_LOAD_BYTES
    ns = namespace_for(layout, "bench-vllm-cpu")
    with KVClient.connect(address, layout, ns, KVClientConfig(data_plane=DataPlane.SHM)
                          ) as client, \
            KVClient.connect(address, layout, ns, KVClientConfig(data_plane=DataPlane.SHM,
                                                                 one_copy_save=False)
                             ) as staging:
        for rep in range(reps + 1):  # rep 0 warms up, untimed
            t0 = time.perf_counter()
            flat.copy_(flat_src)
            timed = {"memcpy": time.perf_counter() - t0}
            saved_toks: dict[str, list[BlockKeys]] = {}
            for kind in (("staged", "one-copy") if rep % 2 else ("one-copy", "staged")):
                # Keys made before the clock starts, as the connector's scheduler half makes
                # them from vLLM's block hashes (the worker never hashes a token)
                toks = [BlockKeys(tuple(client.keys(
                    torch.randint(0, 100_000, (per * layout.block_tokens,), generator=g)
                    .tolist()))) for _ in range(n_requests)]
                saved_toks[kind] = toks
                saving = client if kind == "one-copy" else staging
                t0 = time.perf_counter()
                saver = saving.begin_save_many([
                    SaveRequest(t, CpuBlocksKV(src, ids, layout))
                    for t, ids in zip(toks, src_ids, strict=True)])
                for layer in range(layout.num_layers):
                    saver.save_layer(layer)
                saved = saver.finish().result()
                timed[f"save {kind}"] = time.perf_counter() - t0
                assert all(len(r.stored_blocks) == per for r in saved), saved
                timed[f"save {kind} gather"] = saved[0].gather_s
                timed[f"save {kind} put"] = saved[0].put_s
            toks = saved_toks["one-copy"]
            kinds = ["staged", "one-copy"] + (["one-copy inline"] if inline else [])
            for kind in kinds[rep % len(kinds):] + kinds[:rep % len(kinds)]:
                dst_all.zero_()
                intos = [CpuBlocksKV(dst, ids, layout) for ids in dst_ids]
                client.config = dataclasses.replace(
                    client.config, inline_load_bytes=INLINE_LOAD_BYTES if kind.endswith(
                        "inline") else 0)
                t0 = time.perf_counter()
                handles = client.load_many([
                    LoadRequest(t, into if kind.startswith("one-copy") else _StagedOnly(into))
                    for t, into in zip(toks, intos, strict=True)])
                loaded = [h.result() for h in handles]
                timed[f"load {kind}"] = time.perf_counter() - t0
                assert all(r.complete for r in loaded), loaded
                timed[f"load {kind} transfer"] = max(r.transfer_s for r in loaded)
                timed[f"load {kind} scatter"] = max(r.scatter_s for r in loaded)
                for s_ids, d_ids in zip(src_ids, dst_ids, strict=True):
                    assert torch.equal(dst_all[:, d_ids], src_all[:, s_ids])
            for t in (t for ts in saved_toks.values() for t in ts):
                client.store.remove(t.keys[0])
            if rep == 0:
                continue
            for name, seconds in timed.items():
                samples.setdefault(name, []).append(seconds * 1e3)
    return {name: statistics.median(v) for name, v in samples.items()}


def print_vllm_cpu(r: dict[str, float], n_blocks: int, n_requests: int = 4) -> None:
    n_bytes = n_blocks * VLLM_CPU_LAYOUT.chunk_bytes
    print(f"\nvLLM CPU layout (CpuBlocksKV), one step of {n_blocks} blocks of "
          f"{VLLM_CPU_LAYOUT.chunk_bytes >> 10} KiB ({n_bytes / 2**20:.1f} MiB) in "
          f"{n_requests} request{'s' if n_requests > 1 else ''}, shm; "
          f"ms (x memcpy of the same bytes: cost, lower is better)")
    print("| op | ms | x memcpy |")
    print("|---|---|---|")
    for row in ("memcpy", "save staged", "save staged gather", "save staged put",
                "save one-copy", "save one-copy gather", "save one-copy put", "load staged",
                "load staged transfer",
                "load staged scatter", "load one-copy", "load one-copy transfer",
                "load one-copy scatter", "load one-copy inline",
                "load one-copy inline transfer", "load one-copy inline scatter"):
        if row in r:
            print(f"| {row} | {r[row]:.2f} | {r[row] / r['memcpy']:.2f} |")


def print_batch(results: dict[str, dict[str, float]], layout: KVLayout, n_requests: int,
                m_blocks: int) -> None:
    n_bytes = n_requests * m_blocks * layout.chunk_bytes
    print(f"\n{n_requests} requests x {m_blocks} blocks of {layout.chunk_bytes >> 10} KiB "
          f"({n_bytes >> 20} MiB per step); ms per step (GB/s, ratio to memcpy of the same "
          f"bytes); speedup = single / batched")
    print("| plane | op | N single calls | batched | speedup |")
    print("|---|---|---|---|---|")
    for plane, r in results.items():
        print(f"| {plane} | memcpy (limit) | {r['memcpy']:.2f} ({gbps(n_bytes, r['memcpy'] / 1e3):.2f}) "
              f"| | |")
        print(f"| {plane} | lookup | {r['lookup single']:.2f} | {r['lookup batched']:.2f} "
              f"(one gRPC round trip: {r['grpc round trip']:.2f}) | "
              f"{r['lookup single'] / r['lookup batched']:.2f}x |")
        for op in ("load", "save"):
            cells = []
            for kind in ("single", "batched"):
                ms = r[f"{op} {kind}"]
                rate = gbps(n_bytes, ms / 1e3)
                cells.append(f"{ms:.2f} ({rate:.2f}, {r['memcpy'] / ms:.2f})")
            print(f"| {plane} | {op} | {cells[0]} | {cells[1]} | "
                  f"{r[f'{op} single'] / r[f'{op} batched']:.2f}x |")


def measure_remote(own: str, other: str, n_blocks: int, reps: int) -> dict[str, float]:
    """Loads of ``n_blocks`` 4 MiB blocks into an engine buffer, GB/s, median of ``reps``: from
    the own daemon (shared memory), from another node's daemon over TCP (what another host
    sees) and over shared memory (AUTO: it is in fact on this host), and a fetch plan whose
    first half is local and second half remote (TCP)."""
    layout = LAYOUT
    n_tokens = n_blocks * layout.block_tokens
    g = torch.Generator().manual_seed(3)
    src = torch.randn((layout.num_layers, 2, layout.num_kv_heads, n_tokens, layout.head_dim),
                      generator=g).to(layout.dtype)
    dst = torch.zeros_like(src)
    copy_dst = torch.zeros_like(src)
    ns = namespace_for(layout, "bench-remote")
    samples: dict[str, list[float]] = {}
    n_bytes = n_blocks * layout.chunk_bytes
    with KVClient.connect(other, layout, ns) as on_other, \
            KVClient.connect(own, layout, ns, KVClientConfig(
                remote_data_plane=DataPlane.TCP)) as tcp_engine, \
            KVClient.connect(own, layout, ns) as shm_engine:
        for rep in range(reps + 1):
            toks = torch.randint(0, 100_000, (n_tokens,), generator=g).tolist()
            assert len(on_other.save(toks, ContiguousKV(src, layout)).result().stored_blocks) \
                == n_blocks
            half = n_blocks // 2
            tcp_engine.save(toks[:half * layout.block_tokens],
                            ContiguousKV(src[:, :, :, :half * layout.block_tokens], layout)
                            ).result()
            t0 = time.perf_counter()
            copy_dst.copy_(src)
            timed = {"memcpy": time.perf_counter() - t0}
            into = ContiguousKV(dst, layout)
            plan = RemoteFetch("other", other, half, n_blocks)
            runs: list[tuple[str, Callable[..., LoadHandle], tuple[Any, ...],
                             dict[str, Any]]] = [
                    ("own daemon (shm), first half", tcp_engine.load, (toks, into),
                     {"num_blocks": half}),
                    ("other node over tcp", tcp_engine.load_from, (other, toks, into), {}),
                    ("other node over shm (same host)", shm_engine.load_from,
                     (other, toks, into), {}),
                    ("plan: half own + half other (tcp)", tcp_engine.load, (toks, into),
                     {"remote": plan})]
            for name, start, args, kwargs in runs:
                dst.zero_()
                t0 = time.perf_counter()
                result = start(*args, **kwargs).result()
                timed[name] = time.perf_counter() - t0
                assert result.loaded_blocks in (half, n_blocks), (name, result)
                assert torch.equal(dst[:, :, :, :result.loaded_blocks * layout.block_tokens],
                                   src[:, :, :, :result.loaded_blocks * layout.block_tokens])
            keys = on_other.keys(toks)
            on_other.store.remove(keys[0])
            tcp_engine.store.remove(keys[0])
            if rep == 0:
                continue
            for name, seconds in timed.items():
                moved = n_bytes // 2 if name.startswith("own") else n_bytes
                samples.setdefault(name, []).append(gbps(moved, seconds))
    return {name: statistics.median(v) for name, v in samples.items()}


SMALL_LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_tokens=16,
                        dtype=torch.bfloat16)
"""A 1B-class model in 16-token blocks (vLLM's default): 512 KiB chunks, where per-call costs
weigh more than with the 4 MiB chunks of ``LAYOUT``."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 blocks, 2 repetitions")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=16,
                        help="requests per engine step in the batch rows")
    parser.add_argument("--blocks-per-request", type=int, default=4)
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions (default 5; --quick: 2)")
    parser.add_argument("--batch-only", action="store_true",
                        help="only the cross-request batch rows (and the remote-load rows)")
    parser.add_argument("--vllm-only", action="store_true",
                        help="only the vLLM CPU layout rows")
    parser.add_argument("--vllm-blocks", type=int, default=96,
                        help="blocks per step in the vLLM CPU rows (a multiple of 4)")
    parser.add_argument("--vllm-small-blocks", type=int, default=15,
                        help="blocks of the one-request vLLM CPU rows (0: none)")
    args = parser.parse_args(argv)
    n_blocks, reps = (8, 2) if args.quick else (32, 5)
    reps = args.reps or reps
    n_req, m_blocks = (4, 2) if args.quick else (args.requests, args.blocks_per_request)
    planes = (DataPlane.SHM, DataPlane.TCP)
    torch.set_num_threads(1)
    proc, address = spawn_daemon()
    small = args.vllm_small_blocks
    if args.vllm_only:
        try:
            vllm_cpu = measure_vllm_cpu(address, args.vllm_blocks, reps)
            vllm_small = measure_vllm_cpu(address, small, reps, 1) if small else {}
        finally:
            proc.terminate()
            proc.wait(20)
        load = os.getloadavg()
        doc = {**run_header("kv_client", dists=("torch",)), "repetitions": reps,
               "vllm_cpu": {"blocks": args.vllm_blocks,
                            "chunk_bytes": VLLM_CPU_LAYOUT.chunk_bytes, "ms": vllm_cpu},
               "vllm_cpu_one_request": {"blocks": small, "ms": vllm_small},
               "loadavg": load}
        if args.json:
            args.json.write_text(json.dumps(doc, indent=2))
        print_vllm_cpu(vllm_cpu, args.vllm_blocks)
        if small:
            print_vllm_cpu(vllm_small, small, 1)
        print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        return doc
    try:
        vllm_cpu = measure_vllm_cpu(address, args.vllm_blocks, reps)
        results = {} if args.batch_only else {
            plane.value: measure(plane, address, n_blocks, reps) for plane in planes}
        batch = {f"{lay.chunk_bytes >> 10}KiB": {
            plane.value: measure_batch(plane, address, lay, n_req, m_blocks, reps)
            for plane in planes} for lay in (LAYOUT, SMALL_LAYOUT)}
        other_proc, other_address = spawn_daemon("bench-kvclient-other")
        try:
            remote = measure_remote(address, other_address, n_blocks, reps)
        finally:
            other_proc.terminate()
            other_proc.wait(20)
    finally:
        proc.terminate()
        proc.wait(20)
    load = os.getloadavg()
    doc = {**run_header("kv_client", dists=("torch",)), "chunk_bytes": LAYOUT.chunk_bytes,
           "blocks_per_call": n_blocks, "repetitions": reps, "gbps": results,
           "batch": {"requests": n_req, "blocks_per_request": m_blocks, "ms_per_step": batch},
           "remote_gbps": remote, "loadavg": load,
           "vllm_cpu": {"blocks": args.vllm_blocks, "chunk_bytes": VLLM_CPU_LAYOUT.chunk_bytes,
                        "ms": vllm_cpu}}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))
    if results:
        print_single(results, n_blocks, reps)
    for lay in (LAYOUT, SMALL_LAYOUT):
        print_batch(batch[f"{lay.chunk_bytes >> 10}KiB"], lay, n_req, m_blocks)
    print(f"\nloads from another node's daemon: {n_blocks} blocks of "
          f"{LAYOUT.chunk_bytes >> 20} MiB into [L, 2, H, T, D], GB/s (ratio to memcpy)")
    print("| source | GB/s |")
    print("|---|---|")
    for name, rate in remote.items():
        print(f"| {name} | {rate:.2f} ({rate / remote['memcpy']:.2f}) |")
    print_vllm_cpu(vllm_cpu, args.vllm_blocks)
    print(f"\nload average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return doc


def print_single(results: dict[str, dict[str, float]], n_blocks: int, reps: int) -> None:
    print(f"chunk {LAYOUT.chunk_bytes >> 20} MiB ({LAYOUT.num_layers} layers x "
          f"{LAYOUT.chunk_bytes // LAYOUT.num_layers >> 10} KiB), {n_blocks} blocks per call, "
          f"median of {reps}; GB/s (ratio to memcpy)")
    rows = list(results["shm"])
    print(f"| path | {' | '.join(results)} |")
    print(f"|---|{'---|' * len(results)}")
    for row in rows:
        cells = [f"{r[row]:.2f} ({r[row] / r['memcpy']:.2f})" for r in results.values()]
        print(f"| {row} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()

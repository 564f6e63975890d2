"""Conductor benchmark: the global prefix index at scale, scheduling latency, policies on traces.

``kvtier bench schedule [--trace PATH ...] [--json PATH] [--quick]`` (or
``python -m bench.schedule``) runs three parts and prints a table for each:

1. **Index at scale** (1M and 10M blocks; ``--quick``: 1M). Each size runs in a
   fresh process (RSS deltas are only meaningful there). 8 nodes hold chains of
   64 blocks; a quarter of the chains also sit on a second node. Reported
   beside the limits measured in the same process: a bare ``dict`` of the same
   number of 16-byte keys (what any dict-keyed index must pay in CPython), the
   raw key bytes, and a bare loop of ``dict.get`` over the same 64 keys (the
   probes a lookup cannot avoid).
2. **Scheduling latency** with the index preloaded to 1M (and 10M) blocks: the
   GLOBAL_CACHE policy replaying the Mooncake trace, wall-clock and CPU time
   of each ``Scheduler.schedule`` call, decisions per second. The goal
   (issue 4) is p99 < 2 ms at 1M blocks and >= 5,000 decisions/s; this is
   in-process; part 4 measures the same through the gRPC service.
3. **Policies** on each trace (default: the Mooncake conversation trace and
   both Azure traces), arrivals rescaled so the prefill instances would be
   ``--load`` busy with no reuse at all: hit ratio, simulated TTFT and the
   scheduler's estimate of it, scheduling latency; then variants: replication
   hints, a balancing threshold of 2, and LOAD and GLOBAL_CACHE with TTFT and
   TPOT targets (``--ttft-slo-s``, ``--tpot-slo-s``) to count rejections.

4. **Over gRPC**: a real ``kvtier conductor`` process with 1M blocks indexed (preloaded
   synthetic blocks, plus the real blocks of the first trace requests stored in a real
   daemon and learned from its events), 2 real daemons, etcd, 8 + 8 engine records; the
   Mooncake trace's requests sent by one client process on one channel, first with one
   call in flight (latency), then 64 (throughput). Beside each figure: an empty ``Lookup``
   on the same channel, the cheapest call the service answers (the gRPC limit here).
   ``python -m bench.schedule --grpc-only [--grpc-blocks N --grpc-requests N]`` runs only it.

5. **Through real processes** (``--real``; ``--real-only`` runs only it): each policy
   replays the trace through a real conductor (``--clock client``), real daemons holding
   every block (4 KiB each, LRU at ``node_capacity_blocks``) and etcd, with simulated
   engines writing, fetching and reporting load (:mod:`planner.live_replay`). Hit ratio,
   TTFT and its estimate, rejections, Schedule RPC latency p50/p99 and decisions/s (one
   in flight), and each decision checked against the daemons' contents.

No peer conductor is runnable here (Mooncake's conductor is not published);
the policy table is the comparison, as in the Mooncake paper's Figure 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from bench._meta import spawn_kvtier, stop_child
from conductor.index import GlobalPrefixIndex
from conductor.scheduler import Policy
from kvstore.dataplane.tier import TierKind
from planner.replay import (
    ClusterSpec,
    ReplayResult,
    default_engine_model,
    offered_prefill_load,
    replay,
    scale_to_load,
)
from planner.workload import Workload, load_trace

DEFAULT_TRACES = ("mooncake", "azure-code", "azure-conv")
FULL_SIZES = (1_000_000, 10_000_000)
QUICK_SIZES = (1_000_000,)
NODES = 8
CHAIN_BLOCKS = 64
LOOKUPS = 20_000
DEFAULT_LOAD = 0.85
DEFAULT_TTFT_SLO_S = 5.0
DEFAULT_TPOT_SLO_S = 0.05


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _chain_keys(chain: int) -> list[bytes]:
    digest = xxhash.xxh3_128_digest
    return [digest(b"bench-chain:%d:%d" % (chain, i)) for i in range(CHAIN_BLOCKS)]


def _placements(size: int) -> Iterator[tuple[int, int, list[tuple[bytes, TierKind]]]]:
    """(node, chain, entries): chain c on node c % NODES; every 4th chain also on the next node."""
    tiers = (TierKind.DRAM, TierKind.DRAM, TierKind.NVME, TierKind.HBM)
    for chain in range(size // CHAIN_BLOCKS):
        keys = _chain_keys(chain)
        entries = [(key, tiers[(chain + i // 16) % 4]) for i, key in enumerate(keys)]
        yield chain % NODES, chain, entries
        if chain % 4 == 0:
            yield (chain + 1) % NODES, chain, entries[: CHAIN_BLOCKS // 2]


def _pct(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values, dtype=np.float64)
    p50, p99 = np.percentile(arr, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "mean": float(arr.mean())}


def index_worker(size: int) -> dict[str, Any]:
    """Build an index of ``size`` blocks and measure it (run in a fresh process)."""
    rss0 = _rss_bytes()
    index = GlobalPrefixIndex()
    started = time.perf_counter()
    loaders = {n: index.begin_snapshot(f"node-{n}", 1, 0) for n in range(NODES)}
    placements = 0
    for node, _, entries in _placements(size):
        loaders[node].add(entries)
        placements += len(entries)
    for loader in loaders.values():
        assert loader.commit()
    build_s = time.perf_counter() - started
    rss1 = _rss_bytes()
    keys_indexed = len(index)

    rng = random.Random(7)
    chains = size // CHAIN_BLOCKS
    hit_ns: list[int] = []
    miss_ns: list[int] = []
    probes: list[int] = []
    for _ in range(LOOKUPS):
        chain = rng.randrange(chains)
        keys = _chain_keys(chain)
        t0 = time.perf_counter_ns()
        m = index.match(keys)
        hit_ns.append(time.perf_counter_ns() - t0)
        probes.append(m.probes)
        if m.best_length != CHAIN_BLOCKS:
            raise AssertionError(f"chain {chain} matched {m.best_length} blocks")
        miss = [b"miss" + keys[0][4:], *keys[1:]]
        t0 = time.perf_counter_ns()
        index.match(miss)
        miss_ns.append(time.perf_counter_ns() - t0)
    return {
        "blocks": keys_indexed,
        "placements": placements,
        "nodes": NODES,
        "build_s": build_s,
        "build_blocks_per_s": placements / build_s,
        "index_bytes_per_block": (rss1 - rss0) / keys_indexed,
        "raw_key_bytes": 16,
        "match64_hit_us": {k: v / 1000 for k, v in _pct(hit_ns).items()},
        "match_miss_us": {k: v / 1000 for k, v in _pct(miss_ns).items()},
        "probes_per_hit_lookup": float(np.mean(probes)),
    }


def plain_dict_worker(size: int) -> dict[str, Any]:
    """The limit: a bare dict of ``size`` 16-byte keys to a small int, and 64 ``get``s on it."""
    digest = xxhash.xxh3_128_digest
    rss0 = _rss_bytes()
    plain: dict[bytes, int] = {}
    for chain in range(size // CHAIN_BLOCKS):
        for i in range(CHAIN_BLOCKS):
            plain[digest(b"plain:%d:%d" % (chain, i))] = 2
    rss1 = _rss_bytes()
    rng = random.Random(7)
    get = plain.get
    get_ns: list[int] = []
    for _ in range(LOOKUPS):
        chain = rng.randrange(size // CHAIN_BLOCKS)
        keys = [digest(b"plain:%d:%d" % (chain, i)) for i in range(CHAIN_BLOCKS)]
        t0 = time.perf_counter_ns()
        for key in keys:
            if get(key) is None:
                break
        get_ns.append(time.perf_counter_ns() - t0)
    return {"plain_dict_bytes_per_block": (rss1 - rss0) / len(plain),
            "dict_get64_us": {k: v / 1000 for k, v in _pct(get_ns).items()}}


def index_scale(sizes: Sequence[int]) -> list[dict[str, Any]]:
    """Each measurement in a fresh process: an RSS delta is only meaningful there."""
    ctx = multiprocessing.get_context("spawn")
    out = []
    for size in sizes:
        with ctx.Pool(1) as pool:
            row = pool.apply(index_worker, (size,))
        with ctx.Pool(1) as pool:
            row.update(pool.apply(plain_dict_worker, (size,)))
        out.append(row)
    return out


def scheduling_latency(workload: Workload, load: float,
                       preloads: Sequence[int]) -> list[ReplayResult]:
    cluster = ClusterSpec()
    engine = default_engine_model(workload.block_tokens)
    wl = scale_to_load(workload, engine.latency, cluster.prefill_instances, load)
    return [replay(wl, Policy.GLOBAL_CACHE, cluster=cluster, preload_blocks=n) for n in preloads]


def policies(workload: Workload, load: float, ttft_slo_s: float,
             tpot_slo_s: float) -> dict[str, Any]:
    cluster = ClusterSpec()
    engine = default_engine_model(workload.block_tokens)
    natural = offered_prefill_load(workload, engine.latency, cluster.prefill_instances)
    wl = scale_to_load(workload, engine.latency, cluster.prefill_instances, load)
    rows = [replay(wl, p, cluster=cluster).to_json() for p in Policy]
    variants = []
    if wl.block_ids is not None:
        variants.append(replay(wl, Policy.GLOBAL_CACHE, cluster=cluster,
                               hot_prefix_fetches=2).to_json() | {"variant": "hot_prefix_fetches=2"})
        variants.append(replay(wl, Policy.GLOBAL_CACHE, cluster=cluster,
                               kvcache_balancing_threshold=2.0).to_json()
                        | {"variant": "kvcache_balancing_threshold=2"})
    for p in (Policy.LOAD, Policy.GLOBAL_CACHE):
        variants.append(replay(wl, p, cluster=cluster, ttft_slo_s=ttft_slo_s,
                               tpot_slo_s=tpot_slo_s).to_json()
                        | {"variant": f"SLO TTFT {ttft_slo_s:g} s, TPOT {tpot_slo_s * 1000:g} ms"})
    return {"trace": workload.name, "requests": len(wl), "offered_load_at_trace_timing": natural,
            "load": load, "rate_per_s": wl.rate_per_s, "engine": engine.label,
            "cluster": cluster.__dict__, "rows": rows, "variants": variants}


# --------------------------------------------------------------------------- 5. real processes


def live_policies(workload: Workload, load: float, ttft_slo_s: float | None = None,
                  tpot_slo_s: float | None = None) -> dict[str, Any]:
    """Every policy through real processes, plus the in-process replay of the same slice."""
    from planner.live_replay import run_live_replay

    cluster = ClusterSpec()
    engine = default_engine_model(workload.block_tokens)
    wl = scale_to_load(workload, engine.latency, cluster.prefill_instances, load)
    rows = []
    for policy in Policy:
        row = run_live_replay(wl, policy, cluster=cluster, ttft_slo_s=ttft_slo_s,
                              tpot_slo_s=tpot_slo_s).to_json()
        fast = replay(wl, policy, cluster=cluster, ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s)
        row["in_process"] = {"hit_ratio": fast.hit_ratio, "ttft_s": fast.ttft_s,
                             "rejected": fast.rejected}
        rows.append(row)
        print(f"  {workload.name} {policy.value}: {row['wall_s']:.1f} s", file=sys.stderr)
    return {"trace": workload.name, "requests": len(wl), "load": load,
            "rate_per_s": wl.rate_per_s, "engine": engine.label, "cluster": cluster.__dict__,
            "ttft_slo_s": ttft_slo_s, "tpot_slo_s": tpot_slo_s, "rows": rows}


def format_live(traces: Sequence[dict[str, Any]]) -> str:
    lines = []
    for trace in traces:
        slo = (f"; SLO TTFT {trace['ttft_slo_s']:g} s, TPOT {trace['tpot_slo_s'] * 1000:g} ms"
               if trace.get("ttft_slo_s") else "")
        lines += ["", f"5. Through real processes: {trace['trace']}, {trace['requests']:,} "
                  f"requests at {trace['rate_per_s']:.2f}/s (simulated clock){slo}; a real "
                  "conductor, 8 real daemons (4 KiB blocks), etcd; Schedule RPCs one at a time",
                  f"{'policy':>13} {'hit':>6} {'(in-proc)':>9} {'TTFT mean':>9} {'p50':>6} "
                  f"{'p99':>6} {'(in-proc mean)':>14} {'est mean':>8} {'est err':>7} "
                  f"{'fetched':>8} {'rejected':>8} {'RPC p50/p99 us':>15} {'dec/s':>6} "
                  f"{'held/checked':>13} {'index=daemons':>14} {'wall s':>7}"]
        for row in trace["rows"]:
            t, e, s = row["ttft_s"], row["ttft_estimate_s"], row["schedule_latency_us"]
            fast = row["in_process"]
            c = row["consistency"]
            err = row["ttft_estimate_error"]
            held = c["checked"] - c["violations"]
            lines.append(
                f"{row['policy']:>13} {row['hit_ratio']:>6.3f} {fast['hit_ratio']:>9.3f} "
                f"{t['mean'] or 0:>9.3f} {t['p50'] or 0:>6.3f} {t['p99'] or 0:>6.2f} "
                f"{fast['ttft_s']['mean'] or 0:>14.3f} {e['mean'] or 0:>8.3f} "
                f"{'-' if err is None else f'{err:.3f}':>7} {row['fetched_blocks']:>8,} "
                f"{sum(row['rejected'].values()):>8} "
                f"{_us(s, 'p50'):>7}/{_us(s, 'p99'):<7} {row['decisions_per_s']:>6,.0f} "
                f"{held:>6}/{c['checked']:<6} "
                f"{row['indexed_blocks'] == row['daemon_blocks']!s:>14} "
                f"{row['wall_s']:>7.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- 4. over gRPC

GRPC_NODES = 2
GRPC_INSTANCES_PER_NODE = 4
GRPC_CONCURRENCY = 64
"""Calls in flight on one channel (FIELD-NOTES: ~2,000 in flight caused CANCELLED; 64 is safe)."""
GRPC_MODEL = "trace-model"
GRPC_BATCH = 16
"""Requests per ScheduleBatch call in the batched variant."""
GRPC_BLOCKS = 1_000_000
"""Index size for ``--grpc-only`` (a full run uses the smallest of its index sizes)."""
GRPC_REQUESTS = 20_000
GRPC_QUICK_REQUESTS = 5_000
GRPC_STORED_REQUESTS = 200
"""The first requests' chains are stored in a real daemon, so decisions really hit its blocks."""


def _spawn(cmd: list[str], ready_prefix: str, log_path: Path, timeout_s: float = 60.0
           ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    return spawn_kvtier(cmd, ready_prefix, log_path, timeout_s)


def _store_trace_chains(address: str, workload: Workload, requests: int) -> int:
    """Put the first requests' blocks (1 KiB each, chained) into a daemon; blocks stored."""
    from kvstore.client.store_client import StoreClient
    from planner.trace import block_key

    assert workload.block_ids is not None
    seen: set[int] = set()
    value = b"\0" * 1024
    with StoreClient.connect(address) as store:
        for ids in workload.block_ids[:requests]:
            parent: bytes | None = None
            for hash_id in ids:
                key = block_key(hash_id)
                if hash_id not in seen:
                    seen.add(hash_id)
                    store.put(key, value, parent=parent)
                parent = key
    return len(seen)


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(address: str, server_pid: int, etcd_url: str, prefix: str, workload: Workload,
                 requests: int, concurrency: int) -> dict[str, Any]:
    from kvstore._proto.kvtier.v1 import conductor_pb2 as pb
    from kvstore.client.conductor_client import ConductorClient
    from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
    from kvstore.membership.etcd import KeyLayout, etcd_client
    from planner.trace import block_key

    layout = KeyLayout(prefix)
    async with etcd_client(etcd_url) as etcd:
        for n in range(GRPC_NODES):
            for i in range(GRPC_INSTANCES_PER_NODE):
                await put_engine_record(etcd, EngineRecord(
                    f"prefill-{n}-{i}", EngineRole.PREFILL, GRPC_MODEL, f"node-{n}"),
                    layout=layout)
                await put_engine_record(etcd, EngineRecord(
                    f"decode-{n}-{i}", EngineRole.DECODE, GRPC_MODEL, f"node-{n}",
                    kv_capacity_tokens=1 << 50), layout=layout)
    assert workload.block_ids is not None
    keys = [[block_key(h) for h in ids] for ids in workload.block_ids]
    prompt = [int(t) for t in workload.prompt_tokens]
    async with ConductorClient(address=address) as client:
        deadline = time.monotonic() + 30.0
        while True:  # discovery of nodes and engines is asynchronous
            info = await client.leader_info()
            if info.is_leader and len(info.prefill_instances) == GRPC_NODES * \
                    GRPC_INSTANCES_PER_NODE and len(info.live_nodes) == GRPC_NODES:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"conductor not ready: {info}")
            await asyncio.sleep(0.1)
        indexed = int(info.indexed_blocks)
        gate = [asyncio.Semaphore(concurrency)]
        latencies: list[float] = []
        outcome = {"accepted": 0, "rejected": 0, "reused_blocks": 0, "fetches": 0}

        async def one(i: int) -> None:
            j = i % len(keys)
            async with gate[0]:
                started = time.perf_counter()
                reply = await client.schedule(f"r{i}", GRPC_MODEL, keys=keys[j],
                                              input_tokens=prompt[j])
                latencies.append(time.perf_counter() - started)
            outcome["accepted" if reply.accepted else "rejected"] += 1
            outcome["reused_blocks"] += reply.prefix_blocks
            outcome["fetches"] += reply.HasField("fetch")

        async def batch(i: int) -> None:
            requests_ = []
            for k in range(i * GRPC_BATCH, (i + 1) * GRPC_BATCH):
                j = k % len(keys)
                requests_.append(pb.ScheduleRequest(request_id=f"b{k}", model=GRPC_MODEL,
                                                    keys=keys[j], input_tokens=prompt[j]))
            async with gate[0]:
                started = time.perf_counter()
                items = await client.schedule_batch(requests_)
                latencies.append(time.perf_counter() - started)
            for item in items:
                if item.error:
                    raise RuntimeError(f"batch item failed: {item.error}: {item.detail}")
                reply = item.reply
                outcome["accepted" if reply.accepted else "rejected"] += 1
                outcome["reused_blocks"] += reply.prefix_blocks
                outcome["fetches"] += reply.HasField("fetch")

        async def noop(i: int) -> None:  # the transport's own cost: an empty Lookup
            async with gate[0]:
                started = time.perf_counter()
                await client.lookup(keys=())
                latencies.append(time.perf_counter() - started)

        results: dict[str, Any] = {"indexed_blocks": indexed}
        # Latency with one call in flight (the time a caller waits when not queued behind
        # 63 others), then throughput with `concurrency` in flight: by Little's law a
        # latency at 64 in flight is ~64 / throughput, whatever the service costs.
        # Batches: `concurrency` requests in flight as concurrency / GRPC_BATCH calls.
        for name, fn, count, width, per_call in (
                ("noop_lookup_serial", noop, min(requests, 2_000), 1, 1),
                ("schedule_serial", one, min(requests, 2_000), 1, 1),
                ("noop_lookup", noop, min(requests, 10_000), concurrency, 1),
                ("schedule", one, requests, concurrency, 1),
                ("schedule_batch", batch, max(1, requests // GRPC_BATCH),
                 max(1, concurrency // GRPC_BATCH), GRPC_BATCH)):
            gate[0] = asyncio.Semaphore(width)
            await asyncio.gather(*(fn(i) for i in range(min(count, 300 // per_call))))
            latencies.clear()
            for k in outcome:
                outcome[k] = 0
            server_cpu_s = _process_cpu_s(server_pid)
            client_cpu_s = time.process_time()
            started = time.perf_counter()
            await asyncio.gather(*(fn(i) for i in range(count)))
            wall_s = time.perf_counter() - started
            decisions = count * per_call
            results[name] = {"calls": count, "requests_per_call": per_call,
                             "in_flight": width * per_call, "wall_s": wall_s,
                             "calls_per_s": decisions / wall_s,
                             "latency_us": _pct([x * 1e6 for x in latencies]),
                             "server_cpu_us_per_call":
                                 (_process_cpu_s(server_pid) - server_cpu_s) / decisions * 1e6,
                             "client_cpu_us_per_call":
                                 (time.process_time() - client_cpu_s) / decisions * 1e6}
            if fn is not noop:
                results[name].update(outcome)
        return results


def grpc_scheduling(workload: Workload, blocks: int, requests: int,
                    concurrency: int = GRPC_CONCURRENCY) -> dict[str, Any]:
    """Decisions/s and latency through a real conductor process (2 real daemons, etcd).

    The conductor's index holds ``blocks`` synthetic blocks (``--preload-blocks``: loaded
    through the index's snapshot path at start; keys no request names) plus the real blocks
    of the first requests, stored in daemon node-0 and learned from its events.
    """
    import tempfile

    from kvstore.membership.launcher import LocalEtcd

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-grpc-") as tmp:
        work = Path(tmp)
        procs: list[subprocess.Popen[str]] = []
        prefix = "/bench-grpc/"
        with LocalEtcd(work_dir=work / "etcd") as etcd:
            try:
                daemons = []
                for n in range(GRPC_NODES):
                    proc, addresses = _spawn(
                        ["daemon", "--set", f"node_id=node-{n}", "--set",
                         "dram.capacity_bytes=64MiB", "--set", f"etcd.endpoint={etcd.client_url}",
                         "--set", f"etcd.prefix={prefix}", "--set", "etcd.ttl_s=2",
                         "--set", "log_level=WARNING"],
                        "KVTIER-DAEMON-READY ", work / f"node-{n}.log")
                    procs.append(proc)
                    daemons.append(addresses)
                stored = _store_trace_chains(str(daemons[0]["grpc_address"]), workload,
                                             GRPC_STORED_REQUESTS)
                proc, ready = _spawn(
                    ["conductor", "--etcd", etcd.client_url, "--prefix", prefix, "--id", "bench",
                     "--preload-blocks", str(blocks), "--log-level", "WARNING"],
                    "KVTIER-CONDUCTOR-READY ", work / "conductor.log", timeout_s=300.0)
                procs.append(proc)
                result = asyncio.run(_drive(str(ready["address"]), proc.pid, etcd.client_url,
                                            prefix, workload, requests, concurrency))
            finally:
                for proc in reversed(procs):
                    stop_child(proc)
    return {"preloaded_blocks": blocks, "daemon_blocks": stored, "concurrency": concurrency,
            "nodes": GRPC_NODES, "prefill_instances": GRPC_NODES * GRPC_INSTANCES_PER_NODE,
            "decode_instances": GRPC_NODES * GRPC_INSTANCES_PER_NODE, **result}


def format_grpc(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["4. Scheduling over gRPC: a real conductor process, 2 real daemons, etcd; one client "
             "process, one channel (goal p99 < 2 ms at 1M blocks, >= 5,000 decisions/s). The "
             "limit is an empty Lookup on the same channel, measured the same way. CPU: "
             "microseconds of CPU per call in the conductor process / in the client process.",
             f"{'indexed':>11} {'in flight':>17} {'decisions/s':>12} {'p50 us':>8} {'p99 us':>8} "
             f"{'CPU srv/cli':>11} {'limit calls/s':>14} {'p50 us':>8} {'p99 us':>8} "
             f"{'CPU srv/cli':>11} {'ratio':>6} {'accepted':>9}"]
    for row in rows:
        for sched, noop in (("schedule_serial", "noop_lookup_serial"), ("schedule", "noop_lookup"),
                            ("schedule_batch", "noop_lookup")):
            s, n = row[sched], row[noop]
            flight = f"{s['in_flight']}" + (f" ({s['requests_per_call']}/call)"
                                            if s.get("requests_per_call", 1) > 1 else "")
            lines.append(
                f"{row['indexed_blocks']:>11,} {flight:>17} {s['calls_per_s']:>12,.0f} "
                f"{s['latency_us']['p50']:>8.0f} {s['latency_us']['p99']:>8.0f} "
                f"{s['server_cpu_us_per_call']:>5.0f}/{s['client_cpu_us_per_call']:<5.0f} "
                f"{n['calls_per_s']:>14,.0f} {n['latency_us']['p50']:>8.0f} "
                f"{n['latency_us']['p99']:>8.0f} "
                f"{n['server_cpu_us_per_call']:>5.0f}/{n['client_cpu_us_per_call']:<5.0f} "
                f"{s['calls_per_s'] / n['calls_per_s']:>6.2f} "
                f"{s['accepted']:>9,}")
    return "\n".join(lines)


def _environment() -> dict[str, Any]:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = None
    return {"git_sha": sha, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "load_average": os.getloadavg()}


def run(traces: Sequence[str], *, quick: bool, limit: int | None, load: float,
        ttft_slo_s: float, tpot_slo_s: float,
        sizes: Sequence[int] | None = None) -> dict[str, Any]:
    sizes = tuple(sizes) if sizes else (QUICK_SIZES if quick else FULL_SIZES)
    if any(size < CHAIN_BLOCKS for size in sizes):
        raise ValueError(f"index sizes must be at least {CHAIN_BLOCKS} blocks")
    # Resolve every trace first: a bad --trace fails before the long index part.
    workloads = [load_trace(t, count=limit) for t in traces]
    engine = default_engine_model()
    for wl in workloads:
        scale_to_load(wl, engine.latency, ClusterSpec().prefill_instances, load)  # validates
    with_ids = [wl for wl in workloads if wl.block_ids is not None]
    mooncake = with_ids[0] if with_ids else load_trace("mooncake", count=limit)
    result: dict[str, Any] = {"environment": _environment(), "quick": quick, "limit": limit}
    result["index_scale"] = index_scale(sizes)
    sched = scheduling_latency(mooncake, load, (0, *sizes))
    result["scheduling"] = [r.to_json() for r in sched]
    result["policies"] = [policies(wl, load, ttft_slo_s, tpot_slo_s) for wl in workloads]
    # Over gRPC at the smallest index size asked for (1M by default: the goal's size); a
    # --limit bounds the requests sent, as it bounds the replays.
    requests = GRPC_QUICK_REQUESTS if quick else GRPC_REQUESTS
    result["grpc"] = [grpc_scheduling(mooncake, min(sizes),
                                      min(requests, limit) if limit else requests)]
    return result


def _us(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    return "-" if v is None else f"{v:.1f}"


def format_result(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [f"git {env['git_sha']}  python {env['python']}  cpus {env['cpus']}  "
             f"load average {tuple(round(x, 1) for x in env['load_average'])}", "",
             "1. Global prefix index (8 nodes, 64-block chains; limits measured in the same process)",
             f"{'blocks':>11} {'B/block':>8} {'bare dict':>9} {'key':>4} {'build':>11} "
             f"{'match64 p50/p99 us':>19} {'dict.get x64 p50':>17} {'miss p50':>9} {'probes':>7}"]
    for row in result["index_scale"]:
        lines.append(
            f"{row['blocks']:>11,} {row['index_bytes_per_block']:>8.1f} "
            f"{row['plain_dict_bytes_per_block']:>9.1f} {row['raw_key_bytes']:>4} "
            f"{row['build_blocks_per_s'] / 1e6:>7.2f} M/s "
            f"{row['match64_hit_us']['p50']:>9.1f}/{row['match64_hit_us']['p99']:<9.1f} "
            f"{row['dict_get64_us']['p50']:>17.1f} {row['match_miss_us']['p50']:>9.2f} "
            f"{row['probes_per_hit_lookup']:>7.1f}")
    lines += ["", "2. Scheduling latency, GLOBAL_CACHE on a trace with prefix ids (in-process; "
              "goal p99 < 2 ms at 1M blocks, >= 5,000 decisions/s)",
              f"{'preloaded':>11} {'wall p50':>9} {'wall p99':>9} {'cpu p50':>8} {'cpu p99':>8} "
              f"{'decisions/s':>12} {'requests':>9}"]
    for row in result["scheduling"]:
        w, c = row["schedule_latency_us"], row["schedule_cpu_us"]
        lines.append(f"{row['preloaded_blocks']:>11,} {_us(w, 'p50'):>9} {_us(w, 'p99'):>9} "
                     f"{_us(c, 'p50'):>8} {_us(c, 'p99'):>8} {row['decisions_per_s']:>12,.0f} "
                     f"{row['requests']:>9,}")
    for trace in result["policies"]:
        lines += ["", f"3. Policies on {trace['trace']}: {trace['requests']:,} requests at "
                  f"{trace['rate_per_s']:.2f}/s (no-reuse prefill load {trace['load']}; "
                  f"{trace['offered_load_at_trace_timing']:.2f} at the trace's own timing); "
                  f"{trace['engine']}",
                  f"{'policy':>36} {'hit':>6} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
                  f"{'est mean':>8} {'est err':>7} {'fetched':>8} {'rejected':>8} "
                  f"{'sched p50/p99 us':>17} {'dec/s':>7}"]
        for row in trace["rows"] + trace["variants"]:
            name = row["policy"] + (f" ({row['variant']})" if "variant" in row else "")
            t, e, s = row["ttft_s"], row["ttft_estimate_s"], row["schedule_latency_us"]
            err = row["ttft_estimate_error"]
            lines.append(
                f"{name:>36} {row['hit_ratio']:>6.3f} {t['mean'] or 0:>9.3f} {t['p50'] or 0:>7.3f} "
                f"{t['p99'] or 0:>7.2f} {e['mean'] or 0:>8.3f} "
                f"{'-' if err is None else f'{err:.3f}':>7} {row['fetched_blocks']:>8,} "
                f"{sum(row['rejected'].values()):>8} "
                f"{_us(s, 'p50'):>8}/{_us(s, 'p99'):<8} {row['decisions_per_s']:>7,.0f}")
    if result.get("grpc"):
        lines += ["", format_grpc(result["grpc"])]
    return "\n".join(lines)


def main_real(json_path: Path | None, traces: Sequence[str] | None, limit: int | None,
              load: float = DEFAULT_LOAD, ttft_slo_s: float | None = None,
              tpot_slo_s: float | None = None) -> int:
    """Part 5 alone: each trace, each policy, through real processes; print, write JSON."""
    workloads = [load_trace(t, count=limit) for t in (traces or ("mooncake",))]
    live = [live_policies(wl, load, ttft_slo_s, tpot_slo_s) for wl in workloads]
    result = {"environment": _environment(), "limit": limit, "live": live}
    print(format_live(live))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {json_path}")
    return 0


def main(json_path: Path | None = None, quick: bool = False,
         traces: Sequence[str] | None = None, limit: int | None = None,
         load: float = DEFAULT_LOAD, ttft_slo_s: float = DEFAULT_TTFT_SLO_S,
         tpot_slo_s: float = DEFAULT_TPOT_SLO_S,
         sizes: Sequence[int] | None = None) -> dict[str, Any]:
    """Run, print the tables, write JSON. ``sizes`` overrides the index sizes (blocks)."""
    if quick and limit is None:
        limit = 2000
    result = run(list(traces or DEFAULT_TRACES), quick=quick, limit=limit, load=load,
                 ttft_slo_s=ttft_slo_s, tpot_slo_s=tpot_slo_s, sizes=sizes)
    print(format_result(result))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {json_path}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", action="append", help="mooncake, azure-code, azure-conv or a path")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD)
    parser.add_argument("--ttft-slo-s", type=float, default=DEFAULT_TTFT_SLO_S)
    parser.add_argument("--tpot-slo-s", type=float, default=DEFAULT_TPOT_SLO_S)
    parser.add_argument("--index-blocks", type=int, action="append")
    parser.add_argument("--grpc-only", action="store_true",
                        help="Only part 4 (over gRPC), at --grpc-blocks, --grpc-requests")
    parser.add_argument("--grpc-blocks", type=int, default=GRPC_BLOCKS)
    parser.add_argument("--grpc-requests", type=int, default=GRPC_REQUESTS)
    parser.add_argument("--grpc-concurrency", type=int, default=GRPC_CONCURRENCY)
    parser.add_argument("--real-only", action="store_true",
                        help="Only part 5: each policy through real processes")
    args = parser.parse_args()
    if args.real_only:
        sys.exit(main_real(args.json, args.trace, args.limit, args.load))
    if args.grpc_only:
        wl = load_trace((args.trace or ["mooncake"])[0], count=args.limit)
        grpc_rows = [grpc_scheduling(wl, args.grpc_blocks, args.grpc_requests,
                                     args.grpc_concurrency)]
        grpc_result = {"environment": _environment(), "grpc": grpc_rows}
        print(format_grpc(grpc_rows))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(grpc_result, indent=2))
        sys.exit(0)
    main(args.json, args.quick, args.trace, args.limit, args.load, args.ttft_slo_s,
         args.tpot_slo_s, args.index_blocks)
    sys.exit(0)

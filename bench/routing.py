"""The front door's routing decision without vLLM: what it costs, part by part, beside one bare RPC.

``kvtier bench routing [--quick] [--json PATH]`` (or ``python -m bench.routing``) starts real
components: etcd, one store daemon (``node-a``: engines are schedulable only on a live node) and a
``kvtier conductor`` process started as the fleet starts it (``--block-size-tokens 32 --policy
global-cache``, log level INFO). Two vLLM-like instances ``v0`` and ``v1`` are registered in etcd
as the fleet registers its servers (``kvstore.cluster.vllm_fleet.Fleet.records``: a prefill record
with ``http_url`` and ``vllm_kv_events``, a colocated decode record with ``kv_capacity_tokens``;
no KV fingerprint, so only the engines' own caches are matched). Their KV events are vLLM's wire
format (msgpack ``[ts, events, dp_rank]`` batches; ``BlockStored`` with 8-byte int hashes of
``sha256_cbor`` at seed ``"0"``) served by this process from a ZMQ ROUTER (the replay socket the
conductor asks from seq 0) and a PUB socket, as vLLM's ``ZmqEventPublisher`` does; no vLLM runs.

Two prefix states, each for prompts of 100 to 4,000 tokens:

* ``cold``: every prompt is new (no engine holds any of its blocks); after each decision the
  chosen instance's events store the prompt's blocks, as vLLM's would after the prefill (the
  conductor expects them: its mismatch check);
* ``warm``: v0's events say it holds the first three quarters of each prompt's blocks (16 prompts
  per length, reused), so every decision matches a prefix. The same prompts again: the best
  case of the conductor's chain memo (a conversation's next turn hashes only its new blocks,
  a new prompt all of them, as ``cold`` does).

Each decision is made the way the front door makes it (``kvstore.frontdoor``: a
``TimedRouter`` around a ``ConductorRouter`` on a ``TicketingConductorClient`` found through
etcd, one request at a time, each reported done afterwards as the fleet does), and timed in parts:

(a) ``hash``: hashing the prompt's blocks as the conductor does per Schedule (the prompt's vLLM
    block hashes, :func:`hashings_per_decision` times, through the engine index's chain memo
    where the conductor has one), timed in this process with the same code on the same kind of
    input (a numpy array of the ids) in the same order;
(b) ``schedule``: the ``ConductorClient.schedule`` call the router makes (request built, RPC, reply);
(c) ``decision``: the router's whole ``route`` (what the fleet's "routing p50 / p99" is);
(d) ``health``: one bare gRPC ``grpc.health.v1.Health/Check`` to the same conductor on its own
    channel: the physical floor of a unary RPC here (client and server in Python on loopback);
    and ``lookup0``, an empty ``Lookup`` through the same client: the floor of the client's
    plumbing (leader following, metadata) on the same channel as (b).

(e) ``local``: the same decision made in this process (``kvstore.frontdoor.local.LocalRouter``
    in a ``TimedRouter``: the conductor's scheduler on a replica of its inputs, which follows the
    same etcd records and the same engines' KV event sockets as the conductor does), on another
    prompt of the same kind, interleaved with the others; its shadow ``Schedule`` to the
    conductor (the conductor's books, and the agreement count) runs after the route returned
    and is waited for, untimed, before the next step. ``local``/``fallback`` count the
    decisions it made itself and those it asked the conductor for; ``agreed``/``disagreed``
    compare its choices with the conductor's shadow decisions.

The ratio columns are (c)'s and (e)'s p99 over (d)'s p99. The fleet's own figure comes from a
real run with vLLM on the same two cores; this one isolates routing from that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._meta import run_header, spawn_kvtier, stop_child

BLOCK_TOKENS = 32
"""The fleet's vLLM block size (``FleetSpec.block_tokens``)."""
HASH_SEED = "0"
"""The fleet's vLLM ``PYTHONHASHSEED`` (``kvstore.cluster.vllm_instance.HASH_SEED``)."""
MODEL = "bench-routing"
PREFIX = "/bench-routing/"
NODE = "node-a"
INSTANCES = ("v0", "v1")
LENGTHS = (100, 500, 1000, 2000, 4000)
WARM_PROMPTS = 16
"""Distinct warm prompts per length (each decision picks one)."""
WARM_FRACTION = 0.75
"""Share of a warm prompt's blocks that v0 holds."""
DECISIONS = 300
QUICK_DECISIONS = 100
WARMUP = 20
VOCAB = 32000
KV_CAPACITY_TOKENS = 1 << 30
READY_CONDUCTOR = "KVTIER-CONDUCTOR-READY "
READY_DAEMON = "KVTIER-DAEMON-READY "
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _stats_us(values_s: Sequence[float]) -> dict[str, float]:
    us = [v * 1e6 for v in values_s]
    return {"p50_us": percentile(us, 50), "p99_us": percentile(us, 99),
            "mean_us": sum(us) / len(us) if us else float("nan"), "count": len(us)}


# -- real child processes -------------------------------------------------------------------

def _spawn(cmd: list[str], ready_prefix: str, log_path: Path, timeout_s: float = 120.0
           ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    return spawn_kvtier(cmd, ready_prefix, log_path, timeout_s)


class KvEventPublisher:
    """One engine's KV event sockets as vLLM's ``ZmqEventPublisher`` binds them: a PUB socket and
    a ROUTER that answers a replay request ``[b"", start_seq]`` with every buffered batch from
    ``start_seq`` on (``[b"", topic, seq, payload]`` each), then the end marker (seq -1).

    Batches added before :meth:`start` are learned by the conductor's first replay; those added
    after it are published live (and kept for replays, as vLLM's buffer keeps them). The
    sockets live on one thread of their own until :meth:`close`; :meth:`add_stored` may be
    called from any thread."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str = "kv") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.batches: list[bytes] = []
        """Every batch, by seq (the thread's own once started)."""
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.replays = 0

    def add_stored(self, chains: Sequence[tuple[Sequence[object], Sequence[int]]]) -> None:
        """One batch of ``BlockStored`` events, one per (block hashes, token ids) chain."""
        import msgspec

        events = []
        for hashes, token_ids in chains:
            events.append({"type": "BlockStored", "block_hashes": list(hashes),
                           "parent_block_hash": None, "token_ids": list(token_ids),
                           "block_size": BLOCK_TOKENS, "lora_id": None, "medium": "GPU",
                           "extra_keys": None, "group_idx": 0})
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        if self._started:
            self._outbox.put(payload)
        else:
            self.batches.append(payload)

    def start(self) -> None:
        self._started = True
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True,
                                        name="kv-event-publisher")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the KV event publisher did not bind")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _serve(self, ready: threading.Event) -> None:
        import zmq

        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        router = context.socket(zmq.ROUTER)
        try:
            pub.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            router.bind(self.replay_endpoint)
            ready.set()
            while not self._stop.is_set():
                while not self._outbox.empty():
                    payload = self._outbox.get()
                    seq = len(self.batches)
                    self.batches.append(payload)
                    pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
                if not router.poll(2):
                    continue
                frames = router.recv_multipart()
                identity, start = frames[0], int.from_bytes(frames[-1], "big")
                self.replays += 1
                for seq in range(start, len(self.batches)):
                    router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"),
                                           self.batches[seq]])
                router.send_multipart([identity, b"", self.topic, _END_SEQ, b""])
        finally:
            pub.close(0)
            router.close(0)
            context.term()


# -- prompts --------------------------------------------------------------------------------

def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _warm_prompts(rng: random.Random) -> dict[int, list[list[int]]]:
    return {n: [_prompt(rng, n) for _ in range(WARM_PROMPTS)] for n in LENGTHS}


def _spec(work: Path, name: str) -> Any:
    from kvstore.membership.engines import VllmKvEvents

    return VllmKvEvents(endpoint=f"ipc://{work}/{name}-kv.sock",
                        replay_endpoint=f"ipc://{work}/{name}-replay.sock", topic="kv",
                        hash_algo="sha256_cbor", hash_seed=HASH_SEED,
                        block_size_tokens=BLOCK_TOKENS)


def hashings_per_decision() -> int:
    """How many times the conductor's Schedule hashes a prompt's blocks (part (a)): once where
    its engine index keeps a match's hashes for the mismatch probe (``EngineCacheIndex.match``),
    twice in the code before it (matched, then hashed again for the probe)."""
    from conductor.engine_index import EngineCacheIndex

    return 1 if hasattr(EngineCacheIndex, "match") else 2


# -- the measurement ------------------------------------------------------------------------

async def _wait_ready(client: Any, expected_blocks: dict[str, int]) -> Any:
    deadline = time.monotonic() + 60.0
    while True:
        info = await client.leader_info()
        caches = {c.instance_id: c.blocks for c in info.engine_caches}
        if info.is_leader and sorted(info.prefill_instances) == sorted(INSTANCES) and \
                len(info.decode_instances) == len(INSTANCES) and \
                all(caches.get(i) == n for i, n in expected_blocks.items()):
            return info
        if time.monotonic() > deadline:
            raise RuntimeError(f"the conductor never saw both engines and their caches: {info}")
        await asyncio.sleep(0.1)


def _cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of a process so far (Linux schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total


async def _drive(etcd_url: str, address: str, server_pid: int, work: Path, decisions: int,
                 warm: dict[int, list[list[int]]], rng: random.Random) -> dict[str, Any]:
    import grpc
    import numpy as np
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from conductor import engine_index
    from conductor.engine_index import VllmBlockHashes
    from conductor.scheduler import Policy
    from kvstore.client.conductor_client import ConductorClient
    from kvstore.frontdoor.instrument import TicketingConductorClient, TimedRouter
    from kvstore.frontdoor.local import LocalRouter
    from kvstore.frontdoor.router import Backend, BackendPool, ConductorRouter, RouteRequest
    from kvstore.membership.engines import EngineRecord, EngineRole, put_engine_record
    from kvstore.membership.etcd import KeyLayout, etcd_client

    layout = KeyLayout(PREFIX)
    specs = {name: _spec(work, name) for name in INSTANCES}
    hasher = VllmBlockHashes(specs["v0"])
    publishers = {name: KvEventPublisher(s.endpoint, s.replay_endpoint)
                  for name, s in specs.items()}
    held = 0
    for prompts in warm.values():
        chains = []
        for prompt in prompts:
            keep = int(len(prompt) // BLOCK_TOKENS * WARM_FRACTION)
            chains.append((hasher.hashes(prompt)[:keep], prompt[: keep * BLOCK_TOKENS]))
            held += keep
        publishers["v0"].add_stored(chains)
    for publisher in publishers.values():
        publisher.start()
    try:
        async with etcd_client(etcd_url) as etcd:
            for name in INSTANCES:
                url = f"http://127.0.0.1:{9 + INSTANCES.index(name)}"  # never contacted
                await put_engine_record(etcd, EngineRecord(
                    name, EngineRole.PREFILL, MODEL, NODE, http_url=url,
                    vllm_kv_events=specs[name]), layout=layout)
                await put_engine_record(etcd, EngineRecord(
                    f"{name}.decode", EngineRole.DECODE, MODEL, NODE,
                    kv_capacity_tokens=KV_CAPACITY_TOKENS, http_url=url), layout=layout)
        pool = BackendPool([Backend(n, f"http://127.0.0.1:{9 + i}")
                            for i, n in enumerate(INSTANCES)])
        schedule_s: list[float] = []

        class TimedClient(TicketingConductorClient):
            async def schedule(self, *args: Any, **kwargs: Any) -> Any:
                began = time.perf_counter()
                reply = await super().schedule(*args, **kwargs)
                schedule_s.append(time.perf_counter() - began)
                return reply

        client = TimedClient(etcd_endpoint=etcd_url, layout=layout)
        router = TimedRouter(ConductorRouter(client, pool, MODEL))
        local_client = ConductorClient(etcd_endpoint=etcd_url, layout=layout)
        local = LocalRouter(local_client, pool, MODEL, etcd_endpoint=etcd_url, layout=layout,
                            policy=Policy.GLOBAL_CACHE, block_size_tokens=BLOCK_TOKENS)
        local_router = TimedRouter(local)
        health_channel = grpc.aio.insecure_channel(address)
        health = health_pb2_grpc.HealthStub(health_channel)
        rows: list[dict[str, Any]] = []
        try:
            info = await _wait_ready(client, {"v0": held, "v1": 0})
            await local.start()
            deadline = time.monotonic() + 60.0
            while local.stale_reason() is not None or \
                    len(local.engine_cache.view("v0") or ()) != held:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the local router never got fresh: "
                                       f"{local.stale_reason()}")
                await asyncio.sleep(0.1)
            count = 0

            async def decide(prompt: list[int], publish: bool) -> Any:
                nonlocal count
                count += 1
                request = RouteRequest(f"bench-{count}", "/v1/completions", MODEL, 16, False)
                decision = await router.route(prompt, request)
                await client.finish(16)
                if publish and isinstance(decision, Backend):
                    # What the engine would do after the prefill: store the prompt's blocks
                    # (the conductor's mismatch check expects the routed blocks to appear).
                    full = len(prompt) // BLOCK_TOKENS
                    publishers[decision.name].add_stored(
                        [(hasher.hashes(prompt), prompt[: full * BLOCK_TOKENS])])
                return decision

            async def decide_locally(prompt: list[int], publish: bool) -> Any:
                nonlocal count
                count += 1
                request = RouteRequest(f"bench-{count}", "/v1/completions", MODEL, 16, False)
                decision = await local_router.route(prompt, request)
                local_router.done(request.request_id, 16)
                await local.idle()  # its shadow and completion reports: untimed
                if publish and isinstance(decision, Backend):
                    full = len(prompt) // BLOCK_TOKENS
                    publishers[decision.name].add_stored(
                        [(hasher.hashes(prompt), prompt[: full * BLOCK_TOKENS])])
                return decision

            hashings = hashings_per_decision()
            memo = engine_index.ChainMemo() if hasattr(engine_index, "ChainMemo") else None
            for state in ("cold", "warm"):
                for n in LENGTHS:
                    def pick(n: int = n, state: str = state) -> list[int]:
                        return rng.choice(warm[n]) if state == "warm" else _prompt(rng, n)

                    for _ in range(WARMUP):
                        await decide(pick(), state == "cold")
                        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                        await client.lookup()
                        await decide_locally(pick(), state == "cold")
                    router.reset()
                    local_router.reset()
                    local.counters.clear()
                    schedule_s.clear()
                    hash_s: list[float] = []
                    health_s: list[float] = []
                    lookup_s: list[float] = []
                    backends: dict[str, int] = {}
                    local_backends: dict[str, int] = {}
                    cached = 0
                    # Interleaved, so that every part sees the same machine state.
                    for _ in range(decisions):
                        prompt = pick()
                        # What the conductor hashes: a numpy array of the request's ids (made
                        # untimed, as the handler makes it in microseconds) through a chain
                        # memo fed the same prompts in the same order, or before those
                        # changes, a list of them, hashed whole.
                        ids = np.array(prompt, dtype=np.uint32)
                        began = time.perf_counter()
                        if memo is not None:
                            hasher.convert(memo.keys("", hasher, ids))
                        else:
                            hasher.hashes(ids if hashings == 1 else prompt)
                        hash_s.append((time.perf_counter() - began) * hashings)
                        decision = await decide(prompt, state == "cold")
                        name = getattr(decision, "name", f"rejected:{getattr(decision, 'code', '')}")
                        backends[name] = backends.get(name, 0) + 1
                        began = time.perf_counter()
                        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                        health_s.append(time.perf_counter() - began)
                        began = time.perf_counter()
                        await client.lookup()
                        lookup_s.append(time.perf_counter() - began)
                        decision = await decide_locally(pick(), state == "cold")
                        name = getattr(decision, "name", f"rejected:{getattr(decision, 'code', '')}")
                        local_backends[name] = local_backends.get(name, 0) + 1
                    cached = sum(int(d.engine_cached_tokens) for d in
                                 client.decisions[-decisions:]) // decisions
                    # CPU per call, which other load on the machine does not inflate as it
                    # does wall time: decisions alone (each with its ReportCompletion, and no
                    # events published), then bare Health checks alone.
                    prompts = [pick() for _ in range(decisions)]
                    s0, c0 = _cpu_ns(server_pid), time.process_time_ns()
                    for prompt in prompts:
                        await decide(prompt, False)
                    s1, c1 = _cpu_ns(server_pid), time.process_time_ns()
                    for _ in range(decisions):
                        await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    s2, c2 = _cpu_ns(server_pid), time.process_time_ns()
                    cpu = {"decision_conductor_us": (s1 - s0) / decisions / 1e3,
                           "decision_client_us": (c1 - c0) / decisions / 1e3,
                           "health_conductor_us": (s2 - s1) / decisions / 1e3,
                           "health_client_us": (c2 - c1) / decisions / 1e3}
                    rows.append({
                        "state": state, "prompt_tokens": n, "blocks": n // BLOCK_TOKENS,
                        "decisions": decisions, "backends": backends,
                        "mean_engine_cached_tokens": cached,
                        "hash": _stats_us(hash_s), "schedule": _stats_us(schedule_s),
                        "decision": _stats_us(router.decision_s),
                        "health": _stats_us(health_s), "lookup0": _stats_us(lookup_s),
                        "local": _stats_us(local_router.decision_s),
                        "local_backends": local_backends,
                        "local_counters": {k: local.counters[k] for k in (
                            "local", "fallback", "shadow_agreed", "shadow_disagreed",
                            "shadow_skipped", "shadow_failed")},
                        "cpu": cpu})
        finally:
            await health_channel.close()
            await local.close()
            await local_client.close()
            await client.close()
        return {"indexed_blocks": int(info.indexed_blocks), "warm_blocks_v0": held,
                "replays_served": {n: p.replays for n, p in publishers.items()}, "rows": rows}
    finally:
        for publisher in publishers.values():
            publisher.close()


def run(quick: bool = False, seed: int = 0, work_dir: Path | None = None) -> dict[str, Any]:
    """Start etcd, a daemon and a conductor, measure, stop them; the JSON document.
    ``work_dir``: where etcd's data, the sockets and the logs go (kept); None: a temporary
    directory."""
    from kvstore.membership.launcher import LocalEtcd

    decisions = QUICK_DECISIONS if quick else DECISIONS
    rng = random.Random(seed)
    warm = _warm_prompts(rng)
    result = run_header("routing", dists=("grpcio", "protobuf", "numpy"))
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="kvtier-bench-routing-")))
        else:
            work = work_dir.resolve()
            work.mkdir(parents=True, exist_ok=True)
        procs: list[subprocess.Popen[str]] = []
        with LocalEtcd(work_dir=work / "etcd") as etcd:
            try:
                proc, _ = _spawn(
                    ["daemon", "--set", f"node_id={NODE}", "--set", "dram.capacity_bytes=16MiB",
                     "--set", f"etcd.endpoint={etcd.client_url}", "--set",
                     f"etcd.prefix={PREFIX}", "--set", "etcd.ttl_s=3", "--set",
                     "log_level=WARNING"], READY_DAEMON, work / "daemon.log")
                procs.append(proc)
                proc, ready = _spawn(
                    ["conductor", "--etcd", etcd.client_url, "--prefix", PREFIX, "--id",
                     "conductor-0", "--block-size-tokens", str(BLOCK_TOKENS), "--policy",
                     "global-cache"], READY_CONDUCTOR, work / "conductor.log")
                procs.append(proc)
                measured = asyncio.run(_drive(etcd.client_url, str(ready["address"]), proc.pid, work,
                                              decisions, warm, rng))
            finally:
                for proc in reversed(procs):
                    stop_child(proc)
    result.update({"quick": quick, "block_tokens": BLOCK_TOKENS,
                   "hashings_per_decision": hashings_per_decision(), **measured})
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        "Routing decision at the front door (ConductorRouter -> conductor Schedule), one at a "
        "time; microseconds p50 / p99",
        f"(a) hash: the prompt's block hashing x{result['hashings_per_decision']} per decision; "
        "(b) schedule: the client's Schedule call; (c) decision: the router's route(); "
        "(d) health: a bare gRPC Health/Check (the RPC floor); lookup0: an empty Lookup via the "
        "client; (e) local: the decision made in process (LocalRouter). ratio = (c) p99 / (d) "
        "p99, ratio e = (e) p99 / (d) p99. cpu: microseconds of CPU per call, conductor + "
        "front door (the decision's includes its ReportCompletion). local: decided here / "
        "asked the conductor; shadow: agreed / disagreed with the conductor.",
        f"{'state':<5} {'tokens':>6} {'blocks':>6} {'cached':>6}  {'(a) hash':>13}  "
        f"{'(b) schedule':>13}  {'(c) decision':>13}  {'(d) health':>13}  {'lookup0':>13}  "
        f"{'(e) local':>13}  {'ratio':>5}  {'ratio e':>7}  {'cpu (c)':>9}  {'cpu (d)':>9}  "
        f"{'local':>7}  {'shadow':>7}  backends"]

    def cell(s: dict[str, float]) -> str:
        return f"{s['p50_us']:>6.0f}/{s['p99_us']:<6.0f}"

    for row in result["rows"]:
        ratio = row["decision"]["p99_us"] / row["health"]["p99_us"]
        ratio_e = row["local"]["p99_us"] / row["health"]["p99_us"]
        backends = " ".join(f"{k}:{v}" for k, v in sorted(row["backends"].items()))
        local_backends = " ".join(f"{k}:{v}" for k, v in sorted(row["local_backends"].items()))
        cpu = row["cpu"]
        lc = row["local_counters"]
        lines.append(
            f"{row['state']:<5} {row['prompt_tokens']:>6} {row['blocks']:>6} "
            f"{row['mean_engine_cached_tokens']:>6}  {cell(row['hash'])}  "
            f"{cell(row['schedule'])}  {cell(row['decision'])}  {cell(row['health'])}  "
            f"{cell(row['lookup0'])}  {cell(row['local'])}  {ratio:>5.1f}  {ratio_e:>7.2f}  "
            f"{cpu['decision_conductor_us']:>4.0f}+{cpu['decision_client_us']:<4.0f}  "
            f"{cpu['health_conductor_us']:>4.0f}+{cpu['health_client_us']:<4.0f}  "
            f"{lc['local']:>3}/{lc['fallback']:<3}  "
            f"{lc['shadow_agreed']:>3}/{lc['shadow_disagreed']:<3}  {backends} | local "
            f"{local_backends}")
    lines.append(f"git {result['git_sha'][:12]}, load avg {result['machine']['load_avg_1m']:.2f} "
                 f"on {result['machine']['cpus']} CPUs")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_DECISIONS} decisions per row instead of {DECISIONS}")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="Keep etcd's data and the conductor's and daemon's logs here.")
    args = parser.parse_args(argv)
    result = run(args.quick, args.seed, args.work_dir)
    print(format_table(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

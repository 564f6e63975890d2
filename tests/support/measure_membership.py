"""Measure membership timings against a real local etcd and print a markdown table.

Usage: ``.venv/bin/python -m tests.support.measure_membership [--ttl-s 2] [--repeat 3]``.

Figures (median of ``--repeat`` runs, each beside the bound it should respect):
etcd start and restart until healthy; register (grant + create-if-absent txn), list,
clean deregister until a watcher sees LEFT; a SIGKILLed registrant until a watcher sees
LEFT (bound: the TTL); etcd down for a whole TTL, then restarted, until the registration
is confirmed again. Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd
from kvstore.membership.nodes import (
    NodeEventKind,
    NodeWatch,
    list_nodes,
    register_node,
    watch_nodes,
)
from kvstore.membership.registration import RegistrationState
from tests.support.registrant import sample_record

REPO_ROOT = Path(__file__).resolve().parents[2]


async def _next_left(events: NodeWatch, node_id: str) -> None:
    async for event in events:
        if event.kind is NodeEventKind.LEFT and event.node_id == node_id:
            return


async def _one_round(server: LocalEtcd, ttl_s: int, round_no: int) -> dict[str, float]:
    out: dict[str, float] = {}
    layout = KeyLayout(f"/measure-{round_no}/")
    async with (
        etcd_client(server.client_url) as client,
        watch_nodes(client, layout=layout) as events,
    ):
        t0 = time.perf_counter()
        registration = register_node(client, sample_record("clean"), ttl_s=ttl_s, layout=layout)
        await registration.start()
        out["register (grant + txn)"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        await list_nodes(client, layout=layout)
        out["list_nodes"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        await registration.close()
        await _next_left(events, "clean")
        out["clean exit -> watcher sees LEFT"] = time.perf_counter() - t0

        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.support.registrant",
            server.client_url,
            layout.prefix,
            "crashed",
            str(ttl_s),
            cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        await proc.stdout.readline()
        proc.send_signal(signal.SIGKILL)
        t0 = time.perf_counter()
        await _next_left(events, "crashed")
        out["SIGKILL -> watcher sees LEFT"] = time.perf_counter() - t0
        await proc.wait()

        async with register_node(
            client, sample_record("survivor"), ttl_s=ttl_s, layout=layout
        ) as survivor:
            server.stop()
            await survivor.wait_state(RegistrationState.LOST)
            t0 = time.perf_counter()
            server.start()
            out["etcd start (restart, same data)"] = time.perf_counter() - t0
            await survivor.wait_state(RegistrationState.REGISTERED)
            out["etcd restart -> registration confirmed"] = time.perf_counter() - t0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttl-s", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    samples: dict[str, list[float]] = {}
    # One event loop for every round: gRPC's asyncio layer stays bound to its first loop.
    with LocalEtcd() as server, asyncio.Runner() as runner:
        for round_no in range(args.repeat):
            for name, value in runner.run(_one_round(server, args.ttl_s, round_no)).items():
                samples.setdefault(name, []).append(value)
    start_s: list[float] = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        with LocalEtcd():
            start_s.append(time.perf_counter() - t0)
    samples["etcd first start (fresh data dir)"] = start_s

    ttl = float(args.ttl_s)
    bounds: dict[str, Callable[[], str]] = {
        "SIGKILL -> watcher sees LEFT": lambda: f"TTL {ttl:.1f} s (+ etcd's 0.5 s expiry tick)",
        "etcd restart -> registration confirmed": lambda: "etcd start + 1 retry (0.5 s)",
    }
    print(f"TTL {args.ttl_s} s, median of {args.repeat}\n")
    print("| what | median | min | max | bound |")
    print("|---|---|---|---|---|")
    for name, values in samples.items():
        bound = bounds.get(name, lambda: "")()
        print(
            f"| {name} | {statistics.median(values) * 1e3:.1f} ms | {min(values) * 1e3:.1f} ms "
            f"| {max(values) * 1e3:.1f} ms | {bound} |"
        )


if __name__ == "__main__":
    main()

"""kvtier's main job (``make run``): a vLLM fleet behind the conductor and the front door.

What runs, as child processes of this one (docs/fleet.md)::

    etcd ── conductor ── daemons node-a, node-b (DRAM + a small NVMe tier each)
                 ▲ KV events (ZMQ ipc://)          ▲ kvtier connector (gRPC + shm)
    vllm serve v0, v1: the tiny Llama with its tokenizer, colocated (prefill and decode in
    one instance), sha256_cbor block hashes, PYTHONHASHSEED fixed; both connectors on
    node-a's daemon (this machine is one host: FleetSpec.shared_store says why), node-b
    the second host's store (empty unless shared_store=False puts v1 there)
    [vllm serve alone-0, alone-1: no connector; KV events only when events-only runs]
    front door (in this process, aiohttp): the OpenAI endpoint the replay talks to

Only the servers the chosen modes need are started (:func:`servers_for`): ``v0``/``v1`` for
the kvtier modes, ``alone-0`` for ``vllm-single``, both ``alone-*`` for ``vllm-alone`` and
``events-only``. For each mode the conductor routes (:data:`ROUTED`) its two servers are
registered in etcd by :func:`~kvstore.membership.vllm_registration.hold_while_healthy` (in
this process) as colocated engines, for that mode only: a prefill record ``<name>`` with the
server's ``http_url`` and KV events, and a decode record ``<name>.decode`` with the same
``http_url`` (the conductor pairs them: docs/conductor.md, "Colocated engines"); the mode
starts once the conductor schedules onto exactly those two, and the records are revoked after
it (so the conductor never routes a request to another mode's server).

**Modes**, one after another, each under its own ``cache_salt`` (vLLM's prefix cache and
kvtier's keys both include it, so no mode reuses another's blocks; greedy outputs do not
depend on it):

* ``vllm-single``: every request to ``alone-0``: one colocated vLLM (chunked prefill, vLLM's
  default) with its own prefix cache only.
* ``vllm-alone``: round robin over ``alone-0``/``alone-1`` (their own prefix caches only).
  Separate servers because the connector cannot be switched off per request; they start
  beside the others (in parallel) and cost start time only.
* ``round-robin+kvtier``: round robin over ``v0``/``v1``; a prefix one instance computed is
  loaded by the other from kvtier.
* ``kvtier+conductor``: the front door asks the conductor (``Schedule`` with the token ids),
  which routes to the instance whose own cache holds the longest prefix (learned from vLLM's
  KV events) at the best predicted TTFT; what the chosen instance lacks it loads from kvtier.
* ``events-only``: the same conductor routing over ``alone-0``/``alone-1``, which publish KV
  events but have no connector: prefix matching on vLLM's events with no store (what llm-d's
  precise prefix-cache scorer does).
* ``pd+kvtier``: prefill on ``v0`` (``max_tokens=1``), decode on ``v1`` with the
  ``kv_transfer_params`` the prefill answered, the KV moving through kvtier; run only when the
  front door has a P/D router (``kvstore.frontdoor.router.PdRouter``), else a row saying so.

**Arrivals** (:class:`Arrivals`, the same in every mode): ``chat`` (the default) keeps
``FleetSpec.in_flight`` conversations in flight, each sending its next turn when the previous
answer has arrived (the chat pattern: a user reads the answer, then asks again; think time 0),
a new conversation starting, in trace order, when one ends (:func:`drive`); so both instances
are loaded and a follow-up can find the instance holding its prefix busy. ``closed`` sends one
request at a time in trace order (nothing queues: every KV-aware router then sends each prefix
to the one instance that has it), each after the previous one's KV is in the store (the
connector's puts are asynchronous: :meth:`Fleet._await_saved`). Every request streams (TTFT = first token's arrival at the
client, TPOT = the rest over their count), greedy with ``ignore_eos``. The conductor's router
reports each request's first token (its prefill is over; the conductor times it) and its end
(the front door's ``first_token`` and ``done`` hooks,
:class:`~kvstore.frontdoor.instrument.ReportingConductorRouter`), so its queues follow the
engines and its reservations are released as requests end; each routed request's record keeps
the conductor's prediction for it (``predicted``: TTFT and its parts) beside what it got. Figures per mode: server ``/metrics`` deltas (vLLM's own prefix-cache hits, the
connector's external hits, kvtier's bytes loaded and saved), daemon ``Stats`` deltas per tier,
the front door's routing decision latency, and every request's output token ids, compared
across modes.

Shutdown: :meth:`Fleet.stop` (also on ``__exit__``: an exception, Ctrl-C, or a failed start)
stops the front door and the registrations (records revoked), the vLLM servers (their whole
process groups), the conductor, the daemons, etcd. Children run in their own sessions under
``setpriv --pdeathsig`` (:mod:`kvstore.cluster.local`), so a Ctrl-C reaches only this process.

The pure parts (:class:`FleetRequest`, :func:`servers_for`, :func:`summarize`,
:func:`goodput`, :func:`routing_latency`, :func:`working_set_blocks`,
:func:`identical_outputs`, :func:`tier_deltas`, the tables) are tested without processes; the
constructor records settings only.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import math
import random
import re
import shutil
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from kvstore.cluster.local import _Child, _wait_ready
from kvstore.cluster.vllm_instance import PREFILL_BOUND, TinyLlama, tiny_llama_checkpoint
from kvstore.cluster.vllm_server import VllmServer, VllmServerError
from kvstore.errors import KvtierError, MembershipError, PeerUnavailable

VLLM_DTYPE = "float32"
"""The servers' ``--dtype`` (and so their KV dtype, in the connector's fingerprint)."""

__all__ = ["MODE_SERVERS", "ROUTED", "Arrivals", "Fleet", "FleetRequest", "FleetSpec", "Mode",
           "ModeResult", "RequestRecord", "ServerPlan", "Slo", "assemble", "conversations",
           "drive", "format_tables", "goodput", "identical_outputs", "kv_cache_tokens",
           "max_in_flight", "pool_rounds", "routing_latency", "run_fleet", "servers_for", "speedup",
           "summarize", "tier_deltas", "working_set_blocks"]

MiB = 1 << 20
NODES = ("node-a", "node-b")
INSTANCES = ("v0", "v1")
ALONE = ("alone-0", "alone-1")
METRICS = {"local_hits": "vllm:prefix_cache_hits_total",
           "local_queries": "vllm:prefix_cache_queries_total",
           "external_hits": "vllm:external_prefix_cache_hits_total",
           "prompt_tokens": "vllm:prompt_tokens_total",
           "kvtier_loaded_bytes": "vllm:kvtier_loaded_bytes_total",
           "kvtier_saved_bytes": "vllm:kvtier_saved_bytes_total",
           "kvtier_load_seconds": "vllm:kvtier_load_seconds_total"}
"""Server counters read before and after each mode (tokens, or bytes)."""


class Arrivals(enum.Enum):
    """When each request of the replay is sent (the module docstring)."""

    CHAT = "chat"
    """``in_flight`` conversations at once, each turn sent when the previous one answered."""
    CLOSED = "closed"
    """One request at a time, in trace order."""


class Mode(enum.Enum):
    VLLM_SINGLE = "vllm-single"
    VLLM_ALONE = "vllm-alone"
    ROUND_ROBIN = "round-robin+kvtier"
    CONDUCTOR = "kvtier+conductor"
    EVENTS_ONLY = "events-only"
    PD = "pd+kvtier"


MODE_SERVERS: dict[Mode, tuple[str, ...]] = {
    Mode.VLLM_SINGLE: ALONE[:1], Mode.VLLM_ALONE: ALONE, Mode.ROUND_ROBIN: INSTANCES,
    Mode.CONDUCTOR: INSTANCES, Mode.EVENTS_ONLY: ALONE, Mode.PD: INSTANCES}
"""The servers each mode sends requests to."""

ROUTED = frozenset({Mode.CONDUCTOR, Mode.EVENTS_ONLY})
"""Modes the conductor routes: their servers are registered in etcd for the mode only (so the
conductor never picks a server of another mode)."""


@dataclass(frozen=True)
class ServerPlan:
    """One vLLM server to start: with the kvtier connector or not, with KV events or not."""

    name: str
    connector: bool
    kv_events: bool


def servers_for(modes: Sequence[Mode]) -> list[ServerPlan]:
    """The servers the modes need, and nothing more: ``v0``/``v1`` (connector and KV events)
    for the kvtier modes; ``alone-0`` (and ``alone-1`` unless only ``vllm-single`` runs)
    without the connector, with KV events only when ``events-only`` runs (the conductor
    follows their caches from them)."""
    names = {n for m in modes for n in MODE_SERVERS[m]}
    events = Mode.EVENTS_ONLY in modes
    plans = [ServerPlan(n, True, True) for n in INSTANCES if n in names]
    plans += [ServerPlan(n, False, events) for n in ALONE if n in names]
    return plans


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request meets when both hold (goodput's definition)."""

    ttft_s: float = 1.0
    tpot_s: float = 0.1

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"SLO targets must be > 0 s, got TTFT {self.ttft_s!r}, "
                             f"TPOT {self.tpot_s!r}")


# ---------------------------------------------------------------------------------------------
# What is replayed and measured (pure)


@dataclass(frozen=True)
class FleetRequest:
    """One prompt of the replay, as token ids (the front door takes them as they are)."""

    label: str
    token_ids: tuple[int, ...]
    conversation: str = ""
    """The conversation it is a turn of (its turns are sent in order, each after the previous
    one answered); ``""``: a conversation of its own."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.label}: empty prompt")


@dataclass
class RequestRecord:
    label: str
    backend: str
    prompt_tokens: int
    cached_tokens: int | None
    """vLLM's ``num_cached_tokens`` (own prefix cache + connector), from the answer's usage."""
    ttft_s: float
    tpot_s: float | None
    token_ids: list[int]
    sent_s: float = 0.0
    """When it was sent, and when its answer ended: seconds since the mode's replay began."""
    done_s: float = 0.0
    request_id: str = ""
    """The front door's id of the request (``x-kvtier-request-id``)."""
    predicted: dict[str, Any] | None = None
    """The conductor's estimate for it (routed modes): instance, TTFT and its parts, s."""


@dataclass
class ModeResult:
    mode: str
    status: str = "ok"
    """``ok``, or why the mode did not run (then no figure is filled in)."""
    records: list[RequestRecord] = field(default_factory=list)
    server_deltas: dict[str, float] = field(default_factory=dict)
    """Sums over the mode's servers of each :data:`METRICS` counter's increase."""
    tiers: list[dict[str, Any]] = field(default_factory=list)
    """Per node and tier: the daemon counters' increase over the mode (:func:`tier_deltas`)."""
    decision_s: list[float] = field(default_factory=list)
    floor_s: list[float] = field(default_factory=list)
    """Beside each decision, the same process's trivial one (a round robin pick) timed
    right after it: the floor of the front door's routing step at that moment."""
    decision_cpu_s: list[float] = field(default_factory=list)
    """The front door thread's CPU seconds of each decision (wall minus this: waiting)."""
    placements: list[tuple[str, str]] = field(default_factory=list)
    """The conductor's accepted decisions (warm-ups included): (prefill, decode) instance."""
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def predicted_parts(reply: Any) -> dict[str, Any]:
    """What the conductor predicted for a request it accepted (a ``ScheduleReply``): the
    instance, the TTFT and its parts (seconds), and the reuse it planned."""
    return {"instance": reply.prefill_instance, "ttft_s": reply.ttft_estimate_s,
            "queue_s": reply.queue_s, "prefill_s": reply.prefill_s, "load_s": reply.load_s,
            "transfer_s": reply.transfer_s, "engine_cached_tokens": reply.engine_cached_tokens,
            "prefix_blocks": reply.prefix_blocks}


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def goodput(records: Sequence[RequestRecord], wall_s: float, slo: Slo) -> dict[str, Any]:
    """How many requests met both objectives (TTFT and TPOT; a request with a single output
    token has no TPOT and is judged by its TTFT), their fraction, and per second of the mode's
    wall time (None where there is no request or no time)."""
    met = sum(r.ttft_s <= slo.ttft_s and (r.tpot_s is None or r.tpot_s <= slo.tpot_s)
              for r in records)
    return {"slo_ttft_s": slo.ttft_s, "slo_tpot_s": slo.tpot_s, "slo_met": met,
            "slo_fraction": met / len(records) if records else None,
            "goodput_per_s": met / wall_s if records and wall_s > 0 else None}


def routing_latency(decision_s: Sequence[float]) -> dict[str, float | int | None]:
    """The front door's routing decisions: count, p50, p99, max (seconds; None when none)."""
    if not decision_s:
        return {"count": 0, "p50_s": None, "p99_s": None, "max_s": None}
    return {"count": len(decision_s), "p50_s": percentile(decision_s, 50),
            "p99_s": percentile(decision_s, 99), "max_s": max(decision_s)}


def working_set_blocks(requests: Sequence[FleetRequest], block_tokens: int) -> int:
    """Distinct full blocks of the slice (a block is its whole prefix: vLLM's chained hashes),
    what a cache would have to hold to miss nothing but first sightings."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens!r}")
    seen: set[tuple[int, ...]] = set()
    for r in requests:
        for end in range(block_tokens, len(r.token_ids) + 1, block_tokens):
            seen.add(r.token_ids[:end])
    return len(seen)


def conversations(requests: Sequence[FleetRequest]) -> list[list[FleetRequest]]:
    """The requests grouped by conversation, in trace order: conversations by their first
    request, each one's turns in their order (a request without a conversation is one alone)."""
    groups: dict[str, list[FleetRequest]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r.conversation or f"#{i}", []).append(r)
    return list(groups.values())


async def drive(requests: Sequence[FleetRequest], arrivals: Arrivals, in_flight: int,
                send: Callable[[FleetRequest], Awaitable[RequestRecord]]
                ) -> list[RequestRecord]:
    """Send every request through ``send`` as ``arrivals`` says (the module docstring):
    ``closed``, one at a time in trace order; ``chat``, ``in_flight`` workers, each taking the
    next conversation (trace order) and sending its turns one after another. The records in
    trace order. The first exception from ``send`` stops the other workers and is raised."""
    if in_flight < 1:
        raise ValueError(f"in_flight must be >= 1, got {in_flight!r}")
    order = {r.label: i for i, r in enumerate(requests)}
    records: list[RequestRecord] = []
    if arrivals is Arrivals.CLOSED:
        for r in requests:
            records.append(await send(r))
        return records
    pending = iter(conversations(requests))

    async def worker() -> None:
        for turns in pending:  # one shared iterator: each conversation goes to one worker
            for r in turns:
                records.append(await send(r))

    try:
        async with asyncio.TaskGroup() as group:
            for _ in range(in_flight):
                group.create_task(worker())
    except ExceptionGroup as failed:  # the mode's row says what failed first
        raise failed.exceptions[0] from None
    return sorted(records, key=lambda rec: order.get(rec.label, len(order)))


def pool_rounds(rounds: Sequence[Sequence[ModeResult]]) -> list[ModeResult]:
    """Several replays of the same modes (rounds: each runs every mode once, in order) as one
    result per mode: its records, decisions and floors together, its server and tier counters
    and its wall time summed; a mode that failed in any round is failed. The rounds spread a
    load spike of a shared machine over every mode instead of the one it fell on."""
    if not rounds:
        return []
    out = []
    for i, first in enumerate(rounds[0]):
        same = [r[i] for r in rounds]
        if any(r.mode != first.mode for r in same):
            raise ValueError("rounds must run the same modes in the same order")
        failed = next((r for r in same if not r.ok), None)
        if failed is not None:
            out.append(ModeResult(first.mode, status=failed.status))
            continue
        pooled = ModeResult(first.mode)
        for r in same:
            # Times from the rounds' own starts, laid end to end (max_in_flight stays true).
            shift = pooled.wall_s
            pooled.records += [dataclasses.replace(x, sent_s=x.sent_s + shift,
                                                   done_s=x.done_s + shift) for x in r.records]
            pooled.decision_s += r.decision_s
            pooled.floor_s += r.floor_s
            pooled.decision_cpu_s += r.decision_cpu_s
            pooled.placements += r.placements
            pooled.wall_s += r.wall_s
            for key, value in r.server_deltas.items():
                pooled.server_deltas[key] = pooled.server_deltas.get(key, 0.0) + value
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for r in same:
            for t in r.tiers:
                row = rows.get((t["node"], t["tier"]))
                if row is None:
                    rows[(t["node"], t["tier"])] = dict(t)
                    continue
                for name in _TIER_COUNTERS:
                    row[name] += t[name]
                row["used_bytes"] = t["used_bytes"]  # at the end of the last round
        pooled.tiers = list(rows.values())
        out.append(pooled)
    return out


def max_in_flight(records: Sequence[RequestRecord]) -> int:
    """The most requests that were in flight at once (sent, answer not yet ended)."""
    edges = sorted([(r.sent_s, 1) for r in records] + [(r.done_s, -1) for r in records],
                   key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def summarize(result: ModeResult, slo: Slo | None = None) -> dict[str, Any]:
    """One mode's figures (None where not measured), with goodput under ``slo`` (default
    :class:`Slo`)."""
    if not result.ok:
        return {"mode": result.mode, "status": result.status}
    ttft = [r.ttft_s for r in result.records]
    tpot = [r.tpot_s for r in result.records if r.tpot_s is not None]
    d = result.server_deltas
    queries = d.get("local_queries", 0.0)
    prompt = sum(r.prompt_tokens for r in result.records)
    backends: dict[str, int] = {}
    for r in result.records:
        backends[r.backend] = backends.get(r.backend, 0) + 1
    routing = routing_latency(result.decision_s)
    floor = routing_latency(result.floor_s)
    cpu = routing_latency(result.decision_cpu_s)
    return {
        "mode": result.mode, "status": "ok", "requests": len(result.records),
        "prompt_tokens": prompt,
        "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "tpot_mean_s": statistics.fmean(tpot) if tpot else None,
        "tpot_p99_s": percentile(tpot, 99) if tpot else None,
        "engine_hit_ratio": d.get("local_hits", 0.0) / queries if queries else None,
        "kvtier_hit_ratio": d.get("external_hits", 0.0) / queries if queries else None,
        "kvtier_loaded_bytes": d.get("kvtier_loaded_bytes", 0.0),
        "kvtier_saved_bytes": d.get("kvtier_saved_bytes", 0.0),
        "kvtier_load_seconds": d.get("kvtier_load_seconds", 0.0),
        "tpot_p50_s": percentile(tpot, 50) if tpot else None,
        "decision_p50_s": routing["p50_s"], "decision_p99_s": routing["p99_s"],
        "decision_max_s": routing["max_s"],
        "decision_floor_p50_s": floor["p50_s"], "decision_floor_p99_s": floor["p99_s"],
        "decision_cpu_p50_s": cpu["p50_s"], "decision_cpu_p99_s": cpu["p99_s"],
        "max_in_flight": max_in_flight(result.records),
        "backends": dict(sorted(backends.items())),
        "wall_s": result.wall_s,
        **goodput(result.records, result.wall_s, slo or Slo()),
    }


def identical_outputs(results: Sequence[ModeResult]) -> dict[str, int | None]:
    """Per mode that ran: how many requests' output token ids differ from the first mode that
    ran (0: identical; None: a mode that did not run)."""
    ran = [r for r in results if r.ok]
    if not ran:
        return {r.mode: None for r in results}
    reference = {rec.label: rec.token_ids for rec in ran[0].records}
    out: dict[str, int | None] = {}
    for r in results:
        if not r.ok:
            out[r.mode] = None
            continue
        mine = {rec.label: rec.token_ids for rec in r.records}
        out[r.mode] = sum(mine.get(label) != ids for label, ids in reference.items()) + sum(
            label not in reference for label in mine)
    return out


_TIER_COUNTERS = ("puts", "hits", "bytes_written", "bytes_read", "demotions", "promotions",
                  "evictions")


def tier_deltas(before: Sequence[Mapping[str, Any]], after: Sequence[Mapping[str, Any]]
                ) -> list[dict[str, Any]]:
    """Daemon stats (``kvstore.wire.stats_doc`` of each node) before and after a mode: per node
    and tier, the increase of each counter, and the bytes used at the end."""
    old = {(n["node_id"], t["tier"]): t for n in before for t in n["tiers"]}
    rows = []
    for node in after:
        for t in node["tiers"]:
            prev = old.get((node["node_id"], t["tier"]), {})
            row: dict[str, Any] = {"node": node["node_id"], "tier": t["tier"],
                                   "used_bytes": t["used_bytes"]}
            for name in _TIER_COUNTERS:
                row[name] = t[name] - prev.get(name, 0)
            rows.append(row)
    return rows


_KV_CACHE_LINE = re.compile(rb"KV cache size: ([\d,]+) tokens")


def kv_cache_tokens(log: bytes) -> int | None:
    """The KV cache size vLLM reports at start (``... KV cache size: 2,048 tokens, ...``),
    the last one in ``log``; None when it has not said."""
    found = _KV_CACHE_LINE.findall(log)
    return int(found[-1].replace(b",", b"")) if found else None


def parse_sse(lines: Sequence[bytes]) -> list[dict[str, Any]]:
    """The JSON events of an SSE body's ``data:`` lines (``[DONE]`` and others skipped)."""
    events = []
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[len(b"data:"):].strip()
        if payload == b"[DONE]" or not payload:
            continue
        events.append(json.loads(payload))
    return events


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1e3:.0f}"


def _us(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1e6:.0f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def format_tables(doc: Mapping[str, Any]) -> list[Any]:
    """The rich tables of a run's document (:func:`run_fleet`'s answer)."""
    from rich.table import Table

    config = doc.get("config", {})
    slo = config.get("slo", {})
    arrivals = {"chat": f", {config.get('in_flight')} conversations in flight",
                "closed": ", one request at a time"}.get(config.get("arrivals", ""), "")
    title = "vLLM fleet: the same trace slice through each mode" + arrivals + (
        f" (SLO: TTFT <= {slo['ttft_s']:g} s and TPOT <= {slo['tpot_s']:g} s)" if slo else "")
    modes = Table(title=title)
    modes.add_column("mode", justify="right", no_wrap=True)
    for col in ("TTFT mean ms", "p50", "p99", "TPOT p50 ms", "p99", "SLO met", "goodput /s",
                "own-cache hits", "kvtier hits", "kvtier loaded MiB", "saved MiB",
                "routing p50 / p99 us", "CPU p50 / p99 us", "floor p99 us", "in flight",
                "requests per instance",
                "outputs"):
        modes.add_column(col, justify="right")
    same = doc.get("outputs_differ", {})
    for s in doc["modes"]:
        if s["status"] != "ok":
            modes.add_row(s["mode"], *(["-"] * 16), s["status"])
            continue
        dp50, dp99 = s["decision_p50_s"], s["decision_p99_s"]
        routing = "-" if dp50 is None else f"{dp50 * 1e6:.0f} / {dp99 * 1e6:.0f}"
        differ = same.get(s["mode"])
        modes.add_row(
            s["mode"], _ms(s["ttft_mean_s"]), _ms(s["ttft_p50_s"]), _ms(s["ttft_p99_s"]),
            "-" if s.get("tpot_p50_s") is None else f"{s['tpot_p50_s'] * 1e3:.1f}",
            "-" if s["tpot_p99_s"] is None else f"{s['tpot_p99_s'] * 1e3:.1f}",
            _pct(s.get("slo_fraction")),
            "-" if s.get("goodput_per_s") is None else f"{s['goodput_per_s']:.2f}",
            _pct(s["engine_hit_ratio"]), _pct(s["kvtier_hit_ratio"]),
            f"{s['kvtier_loaded_bytes'] / MiB:.1f}", f"{s['kvtier_saved_bytes'] / MiB:.1f}",
            routing, f"{_us(s.get('decision_cpu_p50_s'))} / {_us(s.get('decision_cpu_p99_s'))}",
            _us(s.get("decision_floor_p99_s")), str(s.get("max_in_flight", "-")),
            " ".join(f"{k}:{v}" for k, v in s["backends"].items()),
            "identical" if differ == 0 else f"{differ} differ")
    tiers = Table(title="Bytes moved per tier and mode (daemon counters' increase)")
    for col in ("mode", "node", "tier", "puts", "hits", "MiB written", "MiB read",
                "demotions", "evictions", "used MiB at end"):
        tiers.add_column(col, justify="right")
    for mode, rows in doc.get("tiers", {}).items():
        for t in rows:
            tiers.add_row(mode, t["node"], t["tier"], str(t["puts"]), str(t["hits"]),
                          f"{t['bytes_written'] / MiB:.1f}", f"{t['bytes_read'] / MiB:.1f}",
                          str(t["demotions"]), str(t["evictions"]),
                          f"{t['used_bytes'] / MiB:.1f}")
    return [modes, tiers]


# ---------------------------------------------------------------------------------------------
# The fleet (processes)


@dataclass(frozen=True)
class FleetSpec:
    """What to start and replay. Sizes per daemon / per vLLM instance."""

    work_dir: Path
    requests: tuple[FleetRequest, ...]
    modes: tuple[Mode, ...] = tuple(Mode)
    max_tokens: int = 8
    model: TinyLlama = PREFILL_BOUND
    block_tokens: int = 32
    max_model_len: int = 32 * 32 + 256
    vllm_kv_bytes: int = 64 * MiB
    """Each instance's own KV cache (a few requests' worth, as HBM is in production)."""
    dram_bytes: int = 256 * MiB
    nvme_bytes: int = 128 * MiB
    prefix: str = "/kvtier/"
    instance_env: Callable[[int], dict[str, str]] | None = None
    """Extra environment of the ``i``-th server of a pair (e.g. bind its model to core i)."""
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0
    conductor_policy: str = "global-cache"
    cache_affinity_margin: float = 0.25
    """The conductor's (and a local router's) ``--cache-affinity-margin``."""
    router: str = "conductor"
    """How the routed modes' front door decides: ``conductor`` (a ``Schedule`` RPC per
    request) or ``local`` (``kvstore.frontdoor.local.LocalRouter``: the conductor's decision
    in the front door's process, docs/routing.md)."""
    slo: Slo = Slo()
    """The objectives goodput is counted against (:func:`goodput`)."""
    arrivals: Arrivals = Arrivals.CHAT
    in_flight: int = 4
    """Conversations in flight at once under ``chat`` arrivals (:func:`drive`)."""
    engine_nice: int = 0
    """The vLLM servers' CPU niceness: > 0 lets this process (the front door and the replay's
    client) run first where they share cores with the engines, as a front door on its own
    cores would (its routing latency is then not time spent waiting for an engine's core)."""
    shared_store: bool = True
    """Both connectors use ``node-a``'s daemon (this machine is one host, and a host's engines
    share its store): a prefix one instance saved is there for the other, and P/D's decode
    finds what the prefill saved. False: ``v1`` uses ``node-b``; the connector reads and writes
    only its own daemon (kvtier has no cross-node fetch on that path yet), so nothing moves
    between the instances through kvtier and P/D's decode waits ``pd_wait_timeout_s`` for
    blocks that never come, then computes the prompt itself."""

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("the fleet needs at least one request to replay")
        if not self.modes or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be distinct and not empty, got {self.modes!r}")
        if self.max_tokens < 2:
            raise ValueError("max_tokens must be >= 2 (TPOT needs a second token)")
        if self.in_flight < 1:
            raise ValueError(f"in_flight must be >= 1, got {self.in_flight!r}")
        if self.router not in ("conductor", "local"):
            raise ValueError(f"router must be conductor or local, got {self.router!r}")
        longest = max(len(r.token_ids) for r in self.requests)
        if longest + self.max_tokens > self.max_model_len:
            raise ValueError(f"a prompt of {longest} tokens + {self.max_tokens} exceeds "
                             f"max_model_len {self.max_model_len}")

    @property
    def model_name(self) -> str:
        return f"tiny-llama-{self.model.key()}"

    def store_of(self, index: int) -> str:
        """The node (daemon) the ``index``-th connector instance uses."""
        return NODES[0] if self.shared_store else NODES[index]

    @property
    def kv_capacity_tokens(self) -> int:
        return self.vllm_kv_bytes // self.model.kv_bytes_per_token()

    @property
    def cache_blocks(self) -> int:
        """Blocks of each instance's own KV cache (``vllm_kv_bytes`` over a block's bytes)."""
        return self.kv_capacity_tokens // self.block_tokens


def _pd_router_class() -> Any:
    """The front door's P/D router, where it exists (another change adds it)."""
    from kvstore.frontdoor import router

    return getattr(router, "PdRouter", None)


class Fleet:
    """See the module docstring. ``start`` / ``stop`` (or ``with``); :meth:`replay` in between."""

    def __init__(self, spec: FleetSpec, log: Callable[[str], None] = print) -> None:
        self.spec = spec
        self.log = log
        self.children: dict[str, _Child] = {}
        self.servers: dict[str, VllmServer] = {}
        self.connector_servers: set[str] = set()
        """The servers started with kvtier's connector (their records carry its fingerprint)."""
        self.daemon_addresses: dict[str, str] = {}
        self.etcd_endpoint = ""
        self.startup_s = 0.0
        self._etcd: Any = None
        self.run_id = uuid.uuid4().hex[:6]
        self.replays = 0
        """Replays begun: part of each mode's ``cache_salt`` (a second replay reuses nothing)."""

    @property
    def logs_dir(self) -> Path:
        return self.spec.work_dir / "logs"

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        from kvstore.membership.launcher import LocalEtcd

        spec = self.spec
        t0 = time.monotonic()
        deadline = t0 + spec.start_timeout_s
        work = spec.work_dir
        for stale in ("etcd", *(f"{n}-nvme" for n in NODES), "events"):
            shutil.rmtree(work / stale, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        try:
            model_dir = tiny_llama_checkpoint(spec.model)
            etcd = LocalEtcd(work_dir=work / "etcd", name="kvtier-fleet")
            self._etcd = etcd
            etcd.start()
            self.etcd_endpoint = etcd.client_url
            first = [self._conductor_child(), *(self._daemon_child(n) for n in NODES)]
            for child in first:
                child.spawn()
            _wait_ready(first, deadline)
            self.daemon_addresses = {n: str(self.children[n].ready["grpc_address"])
                                     for n in NODES}
            self._make_servers(model_dir)
            self.log(f"starting {len(self.servers)} vLLM servers side by side "
                     f"({', '.join(self.servers)}) ...")
            # Not ``with``: leaving it waits for every start, so a Ctrl-C or one failed start
            # would wait for the others to become healthy before stopping them. The servers
            # are stopped first (their start threads then fail fast), then the pool.
            pool = ThreadPoolExecutor(len(self.servers))
            try:
                futures = [pool.submit(s.start, max(1.0, deadline - time.monotonic()))
                           for s in self.servers.values()]
                for future in futures:
                    future.result()
            finally:
                pool.shutdown(wait=False, cancel_futures=True)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _make_servers(self, model_dir: Path) -> None:
        spec = self.spec
        events_dir = spec.work_dir / "events"
        events_dir.mkdir(parents=True, exist_ok=True)
        common: dict[str, Any] = {
            "model_name": spec.model_name, "block_size": spec.block_tokens, "dtype": VLLM_DTYPE,
            "max_model_len": spec.max_model_len, "kv_cache_memory_bytes": spec.vllm_kv_bytes,
            "tokenizer": True, "prompt_tokens_details": True}

        def env(i: int) -> dict[str, str]:
            return spec.instance_env(i) if spec.instance_env is not None else {}

        for plan in servers_for(spec.modes):
            i = _pair_index(plan.name)
            connector = None
            if plan.connector:
                self.connector_servers.add(plan.name)
                connector = {"kv_connector": "KvtierConnector",
                             "kv_connector_module_path": "kvstore.integrations.vllm.connector",
                             "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                             "kv_connector_extra_config": {
                                 "daemon": self.daemon_addresses[spec.store_of(i)],
                                 "model": spec.model_name}}
            self.servers[plan.name] = VllmServer(
                model_dir, self.logs_dir, plan.name, kv_transfer_config=connector,
                kv_events=plan.kv_events, events_dir=events_dir, env=env(i),
                nice=spec.engine_nice, **common)

    def _conductor_child(self) -> _Child:
        from conductor.server import READY_PREFIX

        child = _Child("conductor", [
            _python(), "-m", "kvstore.cli.main", "conductor", "--etcd", self.etcd_endpoint,
            "--prefix", self.spec.prefix, "--id", "conductor-0",
            "--block-size-tokens", str(self.spec.block_tokens),
            "--policy", self.spec.conductor_policy,
            "--cache-affinity-margin", str(self.spec.cache_affinity_margin)], READY_PREFIX,
            self.logs_dir / "conductor.log")
        self.children["conductor"] = child
        return child

    def _daemon_child(self, node_id: str) -> _Child:
        spec = self.spec
        settings = {"node_id": node_id, "dram.capacity_bytes": str(spec.dram_bytes),
                    "etcd.endpoint": self.etcd_endpoint, "etcd.prefix": spec.prefix,
                    "etcd.ttl_s": "3", "shutdown.drain_timeout_s": "5"}
        if spec.nvme_bytes:
            settings |= {"nvme.directory": str(spec.work_dir / f"{node_id}-nvme"),
                         "nvme.capacity_bytes": str(spec.nvme_bytes),
                         "nvme.segment_bytes": str(min(16 * MiB, spec.nvme_bytes))}
        argv = [_python(), "-m", "kvstore.cli.main", "daemon"]
        for key, value in settings.items():
            argv += ["--set", f"{key}={value}"]
        child = _Child(node_id, argv, "KVTIER-DAEMON-READY ", self.logs_dir / f"{node_id}.log")
        self.children[node_id] = child
        return child

    def stop(self) -> None:
        """Stop everything started, in dependency order (see the module docstring)."""
        servers = list(self.servers.values())
        if servers:
            with ThreadPoolExecutor(len(servers)) as pool:
                list(pool.map(lambda s: s.close(), servers))
        for group in (("conductor",), NODES):
            children = [self.children[n] for n in group if n in self.children]
            for child in children:
                child.terminate()
            for child in children:
                child.wait_or_kill(self.spec.stop_timeout_s)
        self.children.clear()
        if self._etcd is not None:
            self._etcd.close()
            self._etcd = None

    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- the replay ----------------------------------------------------------------------

    def records(self, names: Sequence[str] = INSTANCES) -> dict[str, list[Any]]:
        """The engine records each named server is held under while the conductor routes to
        it (colocated: a prefill and a decode record with the same ``http_url``). Every named
        server must publish KV events (the conductor follows its cache from them). The node
        is the host's store daemon (``node-a`` when shared): the conductor needs a live node;
        a server without the connector never loads from it. A server with the connector
        also carries its KV fingerprint (:meth:`connector_fingerprint`), so the conductor
        hashes a prompt into the connector's keys and prices what the store holds for it."""
        from kvstore.membership.engines import EngineRecord, EngineRole

        spec = self.spec
        out: dict[str, list[Any]] = {}
        for name in names:
            node = spec.store_of(_pair_index(name))
            server = self.servers[name]
            if server.kv_events_spec is None:
                raise ValueError(f"server {name} publishes no KV events: the conductor "
                                 "cannot route on its cache")
            out[name] = [
                EngineRecord(name, EngineRole.PREFILL, spec.model_name, node,
                             http_url=server.base_url, vllm_kv_events=server.kv_events_spec,
                             kv_fingerprint=self.connector_fingerprint()
                             if name in self.connector_servers else None),
                EngineRecord(f"{name}.decode", EngineRole.DECODE, spec.model_name, node,
                             kv_capacity_tokens=spec.kv_capacity_tokens,
                             http_url=server.base_url)]
        return out

    def connector_fingerprint(self) -> Any:
        """The KV fingerprint kvtier's connector derives in these servers
        (:meth:`kvstore.integrations.vllm.spec.ConnectorSpec.fingerprint`: the configured model
        name, the KV dtype the servers run, the model's layers, KV heads and head size, the
        block size, one TP shard)."""
        from kvstore.keys import KVDtype, KVFingerprint

        m = self.spec.model
        return KVFingerprint(model=self.spec.model_name, dtype=KVDtype(VLLM_DTYPE),
                             num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                             head_dim=m.head_dim, block_size_tokens=self.spec.block_tokens)

    def replay(self, progress: Any = None) -> list[ModeResult]:
        """Run every mode of the spec (see the module docstring); ``progress`` is a rich
        ``Progress`` (one task per mode) or None."""
        self.replays += 1
        return asyncio.run(self._replay(progress))

    async def _replay(self, progress: Any) -> list[ModeResult]:
        results = []
        for mode in self.spec.modes:
            try:
                results.append(await self._run_mode(mode, progress))
            except (KvtierError, VllmServerError, aiohttp.ClientError, OSError,
                    TimeoutError, ValueError) as exc:
                # One mode failing (a backend error, an answer without tokens) is a row
                # saying so; the other modes still run, and the run fails.
                self.log(f"mode {mode.value} failed: {type(exc).__name__}: {exc}")
                results.append(ModeResult(
                    mode.value, status=f"failed: {type(exc).__name__}: {exc}"[:300]))
        return results

    @contextlib.asynccontextmanager
    async def _registered(self, names: Sequence[str]) -> AsyncIterator[None]:
        """Hold the named servers' records in etcd (:func:`hold_while_healthy`) until the
        conductor schedules onto exactly them; revoked on leaving, so the next routed mode's
        conductor sees only its own servers."""
        from kvstore.membership.etcd import KeyLayout, etcd_client
        from kvstore.membership.vllm_registration import hold_while_healthy, http_health

        layout = KeyLayout(self.spec.prefix)
        holders: list[asyncio.Task[None]] = []
        async with etcd_client(self.etcd_endpoint) as etcd:
            for name, recs in self.records(names).items():
                holders.append(asyncio.create_task(hold_while_healthy(
                    etcd, recs, http_health(self.servers[name].base_url), ttl_s=5,
                    layout=layout, poll_interval_s=1.0), name=f"fleet-register-{name}"))
            try:
                await self._wait_schedulable(layout, names)
                yield
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    async def _wait_schedulable(self, layout: Any, names: Sequence[str]) -> None:
        from kvstore.client.conductor_client import ConductorClient

        deadline = time.monotonic() + 60.0
        async with ConductorClient(etcd_endpoint=self.etcd_endpoint, layout=layout) as client:
            while True:
                with contextlib.suppress(MembershipError, PeerUnavailable):
                    info = await client.leader_info()
                    if sorted(info.prefill_instances) == sorted(names) and len(
                            info.decode_instances) == len(names) and \
                            {c.instance_id for c in info.engine_caches} >= set(names):
                        return
                if time.monotonic() > deadline:
                    raise MembershipError(f"the conductor never saw exactly {', '.join(names)}"
                                          f"; logs in {self.logs_dir}")
                await asyncio.sleep(0.2)

    async def _run_mode(self, mode: Mode, progress: Any) -> ModeResult:
        from kvstore.frontdoor import (
            Backend,
            BackendPool,
            FrontDoor,
            PromptTokenizer,
            RoundRobinRouter,
        )
        from kvstore.frontdoor.instrument import (
            ReportingConductorRouter,
            TicketingConductorClient,
            TimedRouter,
        )
        from kvstore.membership.etcd import KeyLayout

        result = ModeResult(mode.value)
        names = list(MODE_SERVERS[mode])
        pool = BackendPool([Backend(n, self.servers[n].base_url) for n in names])
        conductor: TicketingConductorClient | None = None
        local: Any = None
        inner: Any
        if mode in ROUTED and self.spec.router == "local":
            from conductor.scheduler import Policy
            from kvstore.client.conductor_client import ConductorClient
            from kvstore.frontdoor.local import LocalRouter

            layout = KeyLayout(self.spec.prefix)
            # It reports its own tickets from the front door's done hook: a plain client.
            local = inner = LocalRouter(
                ConductorClient(etcd_endpoint=self.etcd_endpoint, layout=layout), pool,
                self.spec.model_name, etcd_endpoint=self.etcd_endpoint, layout=layout,
                policy=Policy(self.spec.conductor_policy),
                block_size_tokens=self.spec.block_tokens,
                cache_affinity_margin=self.spec.cache_affinity_margin)
        elif mode in ROUTED:
            conductor = TicketingConductorClient(etcd_endpoint=self.etcd_endpoint,
                                                 layout=KeyLayout(self.spec.prefix))
            inner = ReportingConductorRouter(conductor, pool, self.spec.model_name)
        elif mode is Mode.PD:
            pd = _pd_router_class()
            if pd is None:
                result.status = "not run: the front door has no P/D mode yet"
                return result
            backends = pool.all()
            inner = pd(pool, backends[:1], backends[1:])
        else:
            inner = RoundRobinRouter(pool)
        # The floor beside each decision: a round robin pick, timed at the same moment in the
        # same process (what routing costs the front door with no decision to make).
        router = TimedRouter(inner, floor=RoundRobinRouter(pool))
        tokenizer = PromptTokenizer.from_model_dir(self.servers[names[0]].model_dir)
        door = FrontDoor(pool, tokenizer, router=router)
        salt = f"{mode.value}-{self.run_id}-{self.replays}"
        async with contextlib.AsyncExitStack() as stack:
            if conductor is not None:
                stack.push_async_callback(conductor.close)
            if local is not None:
                stack.push_async_callback(local.conductor.close)
                await local.start()
                stack.push_async_callback(local.close)
            if mode in ROUTED:
                await stack.enter_async_context(self._registered(names))
            if local is not None:
                await self._wait_fresh(local)
            stack.push_async_callback(door.close)
            await self._run_requests(result, door, router, conductor, names, salt, progress)
            if local is not None:
                await local.idle()
                result.placements = [(name, name) for name, count in
                                     sorted(router.backends.items()) for _ in range(count)]
                self.log(f"mode {mode.value}: local routing {dict(local.counters)}")
        return result

    async def _wait_fresh(self, local: Any, timeout_s: float = 30.0) -> None:
        """Until the local router's replica agrees with the conductor (else it asks the
        conductor for each request, which the log line after the mode counts)."""
        deadline = time.monotonic() + timeout_s
        while local.stale_reason() is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)

    async def _run_requests(self, result: ModeResult, door: Any, router: Any,
                            conductor: Any, names: Sequence[str], salt: str,
                            progress: Any) -> None:
        task = None if progress is None else progress.add_task(result.mode,
                                                               total=len(self.spec.requests))
        await door.start()
        await self._warm(door.url, names)
        if conductor is not None:
            await conductor.settle()
        router.reset()
        metrics_before = await self._metrics(names)
        stats_before = await asyncio.to_thread(self._daemon_stats)
        began = time.perf_counter()
        spec = self.spec
        # One connection per request in flight (aiohttp's default pool holds 100).
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

            async def send(request: FleetRequest) -> RequestRecord:
                record = await self._one(http, door.url, request, salt, began)
                if spec.arrivals is Arrivals.CLOSED:
                    await self._await_saved(record, request, salt)
                    if conductor is not None:
                        await conductor.settle()  # released before the next decision
                if task is not None:
                    progress.advance(task)
                return record

            result.records = await drive(spec.requests, spec.arrivals, spec.in_flight, send)
        result.wall_s = time.perf_counter() - began
        if conductor is not None:
            await conductor.settle()
        metrics_after = await self._metrics(names)
        result.tiers = tier_deltas(stats_before, await asyncio.to_thread(self._daemon_stats))
        result.server_deltas = {
            key: sum(metrics_after[n].get(key, 0.0) - metrics_before[n].get(key, 0.0)
                     for n in names) for key in METRICS}
        result.decision_s = list(router.decision_s)
        result.floor_s = list(router.floor_s)
        result.decision_cpu_s = list(router.cpu_s)
        if conductor is not None:
            result.placements = [(d.prefill_instance, d.decode_instance)
                                 for d in conductor.decisions]
            predicted = {d.request_id: predicted_parts(d) for d in conductor.decisions}
            for x in result.records:
                x.predicted = predicted.get(x.request_id)

    def cache_tokens(self) -> dict[str, int | None]:
        """Each server's KV cache in tokens, as vLLM reported it in its log at start."""
        return {name: kv_cache_tokens(server.log_path.read_bytes())
                if server.log_path.exists() else None for name, server in self.servers.items()}

    def profile_engine(self, name: str, prompt_tokens: Sequence[int] = (64, 256, 512, 1024),
                       repeats: int = 2) -> dict[str, Any]:
        """A ``kvtier.latency-profile/1`` document (docs/planner.md) of server ``name``'s
        engine, for the planner: each length's all-miss prompt (random token ids, a fresh
        ``cache_salt`` per request, so no cache holds any of it) sent ``repeats`` times,
        straight to the server, streamed like the replay. Prefill time = the median TTFT
        (HTTP and scheduling included, as the replay's TTFT includes them); decode = one
        point at batch 1: the mean TPOT over all of them. Lengths that do not fit
        ``max_model_len`` with the output are left out."""
        lengths = [n for n in prompt_tokens
                   if n > 0 and n + self.spec.max_tokens <= self.spec.max_model_len]
        if not lengths or repeats < 1:
            raise ValueError(f"nothing to profile: lengths {list(prompt_tokens)} within "
                             f"max_model_len {self.spec.max_model_len}, repeats {repeats}")
        return asyncio.run(self._profile(name, lengths, repeats))

    async def _profile(self, name: str, lengths: Sequence[int], repeats: int
                       ) -> dict[str, Any]:
        url = self.servers[name].base_url
        rng = random.Random(f"profile-{self.run_id}")
        vocab = self.spec.model.vocab_size
        prefill, tpots = [], []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            for n in lengths:
                ttfts = []
                for k in range(repeats):
                    ids = tuple(rng.randrange(3, vocab) for _ in range(n))
                    rec = await self._one(http, url, FleetRequest(f"profile-{n}", ids),
                                          f"profile-{self.run_id}-{n}-{k}")
                    ttfts.append(rec.ttft_s)
                    if rec.tpot_s is not None:
                        tpots.append(rec.tpot_s)
                prefill.append({"tokens": n, "time_ms": round(statistics.median(ttfts) * 1e3, 3)})
        if not tpots:
            raise VllmServerError(f"{name}: no answer of the profile had a second token")
        return {"schema": "kvtier.latency-profile/1", "model": self.spec.model_name,
                "gpu": f"cpu: vllm serve {name}, its model on one core", "tp": 1,
                "prefill": prefill,
                "decode": [{"batch_size": 1, "time_ms": round(statistics.fmean(tpots) * 1e3, 3)}],
                "method": f"all-miss prompts, {repeats} per length, streamed to {name}: "
                          "prefill = median TTFT, decode = mean TPOT (batch 1)"}

    async def _await_saved(self, record: RequestRecord, request: FleetRequest, salt: str,
                           timeout_s: float = 10.0) -> None:
        """The closed loop's next request waits until the store holds the full blocks of this
        one's prompt, when a server with the connector computed it (the prefill's, for P/D).
        The connector's puts end after the step that queued them, so an answer can be back
        before its KV is in the store; a follow-up sent at once on the other instance then
        races them (a CI run: 0 of 160 tokens from kvtier). Past ``timeout_s`` it goes anyway,
        logged (the row then shows the miss)."""
        from conductor.store_keys import key_scheme
        from kvstore.client.store_client import StoreClient

        saver = record.backend.split(">")[0]
        n = len(request.token_ids) // self.spec.block_tokens
        if saver not in self.connector_servers or n == 0:
            return
        scheme = key_scheme(self.records([saver])[saver][0])
        if scheme is None:
            return
        keys = scheme.hasher(salt).hash_blocks(list(request.token_ids))[:n]
        address = self.daemon_addresses[self.spec.store_of(_pair_index(saver))]

        def wait() -> int:
            deadline = time.monotonic() + timeout_s
            with StoreClient.connect(address) as store:
                while (held := store.lookup(keys).length) < n and time.monotonic() < deadline:
                    time.sleep(0.01)
            return held

        held = await asyncio.to_thread(wait)
        if held < n:
            self.log(f"request {request.label}: {held} of its {n} blocks in the store "
                     f"{timeout_s} s after its answer; the next request goes anyway")

    async def _warm(self, url: str, names: Sequence[str]) -> None:
        """Untimed requests under salts no mode uses: one to each backend directly (vLLM's first
        request is slow; a routed front door may send every warm-up to one instance, and the
        other's 1 s first answer then lands in the replay and in the conductor's speed
        factor), then one per backend through the front door (its own first requests; a round
        robin goes round once and starts the replay at the first backend)."""
        warm = FleetRequest("warm", tuple(range(3, 3 + 2 * self.spec.block_tokens)))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            for name in names:
                await self._one(http, self.servers[name].base_url, warm,
                                f"warm-{self.run_id}-{name}")
            for i in range(len(names)):
                await self._one(http, url, warm, f"warm-{self.run_id}-{i}")

    async def _one(self, http: Any, url: str, request: FleetRequest, salt: str,
                   epoch: float | None = None) -> RequestRecord:
        """Send one request, streamed; ``epoch``: the ``perf_counter`` its record's
        ``sent_s``/``done_s`` count from (default: its own start)."""
        body = {"model": self.spec.model_name, "prompt": list(request.token_ids),
                "max_tokens": self.spec.max_tokens, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True, "stream": True, "cache_salt": salt,
                "stream_options": {"include_usage": True}}
        began = time.perf_counter()
        first_s: float | None = None
        last_s = began
        token_ids: list[int] = []
        usage: dict[str, Any] = {}
        async with http.post(url + "/v1/completions", json=body) as answer:
            if answer.status != 200:
                raise PeerUnavailable(f"request {request.label}: front door answered "
                                      f"{answer.status}: {await answer.text()}")
            backend = answer.headers.get("x-kvtier-backend", "?")
            request_id = answer.headers.get("x-kvtier-request-id", "")
            prefill = answer.headers.get("x-kvtier-prefill")
            fallback = answer.headers.get("x-kvtier-pd-fallback")
            if prefill:
                backend = f"{prefill}>{backend}"
            elif fallback:
                backend = f"fallback({fallback})>{backend}"
            buffer = b""
            async for chunk in answer.content.iter_any():
                now = time.perf_counter()
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for event in parse_sse(lines):
                    if "error" in event:
                        raise PeerUnavailable(f"request {request.label}: {event['error']}")
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or ():
                        ids = choice.get("token_ids") or []
                        if ids:
                            first_s = now if first_s is None else first_s
                            last_s = now
                            token_ids += [int(t) for t in ids]
        if first_s is None:
            raise PeerUnavailable(f"request {request.label}: no token came back")
        details = usage.get("prompt_tokens_details") or {}
        n = len(token_ids)
        zero = began if epoch is None else epoch
        return RequestRecord(
            request.label, backend, len(request.token_ids), details.get("cached_tokens"),
            first_s - began, (last_s - first_s) / (n - 1) if n > 1 else None, token_ids,
            began - zero, time.perf_counter() - zero, request_id)

    async def _metrics(self, names: Sequence[str]) -> dict[str, dict[str, float]]:
        out = {}
        for n in names:
            values = await asyncio.to_thread(self.servers[n].metrics)
            out[n] = {key: values.get(metric, 0.0) for key, metric in METRICS.items()}
        return out

    def _daemon_stats(self) -> list[dict[str, Any]]:
        from kvstore.client.store_client import StoreClient
        from kvstore.wire import stats_doc

        docs = []
        for address in self.daemon_addresses.values():
            with StoreClient.connect(address) as store:
                docs.append(stats_doc(store.stats(), address))
        return docs


def _python() -> str:
    return sys.executable


def _pair_index(name: str) -> int:
    """Which of its pair a server is (``v1``, ``alone-1``: 1): its core and its store."""
    for pair in (INSTANCES, ALONE):
        if name in pair:
            return pair.index(name)
    raise ValueError(f"unknown fleet server {name!r}")


def speedup(by_mode: Mapping[str, Mapping[str, Any]], baseline: Mode, of: Mode
            ) -> float | None:
    """``baseline``'s mean TTFT over ``of``'s (None unless both ran)."""
    base = by_mode.get(baseline.value, {}).get("ttft_mean_s")
    mine = by_mode.get(of.value, {}).get("ttft_mean_s")
    return base / mine if base and mine else None


def assemble(results: Sequence[ModeResult], spec: FleetSpec, startup_s: float
             ) -> dict[str, Any]:
    """The run's document: per mode figures, tiers, output identity, configuration.

    Speedups are mean TTFT ratios against ``kvtier+conductor``: ``..._vs_round_robin`` over
    ``vllm-alone`` (two instances, round robin, no kvtier: the issue's baseline (b)),
    ``..._vs_round_robin_kvtier`` over ``round-robin+kvtier``, ``..._vs_events_only`` over
    ``events-only``, ``..._vs_vllm_single`` over ``vllm-single``. Each mode also has its mean
    TTFT over first turns (a conversation's first request: nothing but a shared system prompt
    to reuse, whatever the routing) and over follow-ups (what routing can reuse), and
    ``followup_ttft_speedup_vs_*`` the same ratios over follow-ups only."""
    summaries = [summarize(r, spec.slo) for r in results]
    first = {turns[0].label for turns in conversations(spec.requests)}
    for summary, r in zip(summaries, results, strict=True):
        if r.ok:
            for name, pick in (("first_turn", True), ("followup", False)):
                ttft = [x.ttft_s for x in r.records if (x.label in first) is pick]
                summary[f"{name}_ttft_mean_s"] = statistics.fmean(ttft) if ttft else None
    by_mode = {s["mode"]: s for s in summaries}

    def followup(baseline: Mode) -> float | None:
        base = by_mode.get(baseline.value, {}).get("followup_ttft_mean_s")
        mine = by_mode.get(Mode.CONDUCTOR.value, {}).get("followup_ttft_mean_s")
        return base / mine if base and mine else None

    differ = identical_outputs(results)
    return {
        "modes": summaries,
        "tiers": {r.mode: r.tiers for r in results if r.ok},
        "requests": {r.mode: [{"label": x.label, "backend": x.backend,
                               "prompt_tokens": x.prompt_tokens, "cached_tokens": x.cached_tokens,
                               "ttft_s": x.ttft_s, "tpot_s": x.tpot_s, "sent_s": x.sent_s,
                               "done_s": x.done_s, "predicted": x.predicted}
                              for x in r.records]
                     for r in results if r.ok},
        "outputs_differ": differ,
        "outputs_identical": all(v == 0 for v in differ.values() if v is not None),
        "failed_modes": [r.mode for r in results if r.status.startswith("failed")],
        "ttft_speedup_vs_round_robin": speedup(by_mode, Mode.VLLM_ALONE, Mode.CONDUCTOR),
        "ttft_speedup_vs_round_robin_kvtier": speedup(by_mode, Mode.ROUND_ROBIN,
                                                      Mode.CONDUCTOR),
        "ttft_speedup_vs_events_only": speedup(by_mode, Mode.EVENTS_ONLY, Mode.CONDUCTOR),
        "ttft_speedup_vs_vllm_single": speedup(by_mode, Mode.VLLM_SINGLE, Mode.CONDUCTOR),
        "followup_ttft_speedup_vs_round_robin": followup(Mode.VLLM_ALONE),
        "followup_ttft_speedup_vs_events_only": followup(Mode.EVENTS_ONLY),
        "startup_s": startup_s,
        "config": {"requests": len(spec.requests), "max_tokens": spec.max_tokens,
                   "prompt_tokens": sum(len(r.token_ids) for r in spec.requests),
                   "model": spec.model_name, "block_tokens": spec.block_tokens,
                   "vllm_kv_bytes": spec.vllm_kv_bytes, "cache_blocks": spec.cache_blocks,
                   "working_set_blocks": working_set_blocks(spec.requests, spec.block_tokens),
                   "dram_bytes": spec.dram_bytes, "nvme_bytes": spec.nvme_bytes,
                   "slo": {"ttft_s": spec.slo.ttft_s, "tpot_s": spec.slo.tpot_s},
                   "modes": [m.value for m in spec.modes], "router": spec.router,
                   "cache_affinity_margin": spec.cache_affinity_margin,
                   "arrivals": spec.arrivals.value, "engine_nice": spec.engine_nice,
                   "in_flight": spec.in_flight if spec.arrivals is Arrivals.CHAT else 1},
    }


def run_fleet(spec: FleetSpec, *, console: Any = None) -> dict[str, Any]:
    """Bring the fleet up, replay every mode with a progress bar, print the tables, stop
    everything (also on Ctrl-C or a failed start); the run's document (:func:`assemble`)."""
    from rich.console import Console
    from rich.progress import Progress

    console = console or Console(width=160)
    servers = ", ".join(
        f"{p.name} ({'kvtier connector' if p.connector else 'no connector'}"
        f"{', KV events' if p.kv_events else ''})" for p in servers_for(spec.modes))
    console.print(f"bringing up a vLLM fleet in {spec.work_dir}: etcd, conductor, daemons "
                  f"{' and '.join(NODES)}, vLLM {servers}, the front door; "
                  f"{len(spec.requests)} requests per mode")
    with Fleet(spec, log=console.print) as fleet:
        console.print(f"fleet up in {fleet.startup_s:.1f} s (logs in {fleet.logs_dir})")
        with Progress(console=console) as progress:
            results = fleet.replay(progress)
    doc = assemble(results, spec, fleet.startup_s)
    for table in format_tables(doc):
        console.print(table)
    return doc

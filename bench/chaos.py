"""The fault suite: a three-host kvtier cluster in network namespaces, one fault per run under a
steady load, the recorded history checked for kvtier's invariants (docs/chaos.md).

Run with ``kvtier bench chaos [--quick] [--json PATH] [--fault NAME] [--soak MINUTES]`` (root:
it builds network namespaces). :func:`run_fault` returns one :class:`FaultRow`;
:func:`run_soak` draws faults at random into one cluster (:class:`SoakResult`); :func:`main`
prints the table.

The cluster (:class:`ChaosCluster`)
    :class:`~kvstore.cluster.netns.NetnsLab` with hosts ``h0``-``h2`` and an observer. Each host
    runs a member of one three-member etcd cluster (``--initial-cluster``, data in the run's
    temp dir) and a store daemon with DRAM and NVMe tiers (NVMe in the temp dir, kept across a
    restart), listening on the host's address on the fixed ports a deployment uses (every host
    is its own network stack, so fixed ports collide with nothing), ``--insecure`` (no
    certificates in the lab), registered through its host's etcd member with a 2 s lease (given
    all three members, its own first, it fails over to another: docs/etcd-failover.md), and with
    ``cache.write_tier=nvme``: every acknowledged put is durable (written through to NVMe and
    fdatasync'd before the answer), so the history marks each acknowledged put durable.
    ``h0`` and ``h2`` also run a conductor (leader and standby, 2 s election TTL), and every
    host holds the records of one prefill and one decode engine on its node, under their own
    leases from a process in its namespace (``python -m bench.chaos engines``): the
    conductors schedule onto them (those do not run; the decisions are what is checked).
    With :attr:`Engines.REFERENCE` (``--engines``, the default) real engines run too: a
    prefill and a decode worker of the reference engine on each of ``ENGINE_HOSTS``
    (:meth:`ChaosCluster._spawn_worker`), their node's daemon their store; with
    :attr:`Engines.VLLM` one ``vllm serve`` with kvtier's connector on each instead
    (:func:`_vllm_main`), each prompt's no-cache output computed by the servers before the
    load starts.
    The namespaces share a boot id, a hostname and ``/dev/shm``: a client would take a daemon
    in another namespace for a same-host one, so the load uses ``DataPlane.TCP`` and the
    daemons serve no lease channel (``server.shm_channel=false``) and no UCX, but where a
    fault needs it (:class:`Need`, on ``h1``: the lease channel, UCX, a small tmpfs under its
    NVMe directory). Every daemon serves at most ``MAX_CONNECTIONS`` data connections and
    drops a frame header not whole within ``HEADER_TIMEOUT_S``.

The load (``python -m bench.chaos loadgen CONFIG``, in the observer namespace)
    Worker threads, each a loop of puts (a new key, placed on the next node the etcd
    membership watch shows alive: a ``SCHEDULE`` record, then the ``PUT``) and gets (a key
    acknowledged earlier, on its node if the watch shows it alive); a node a request just
    failed on gets nothing new for ``SUSPECT_S`` (2 s). Clients bound every request by 2 s
    (``rpc_timeout_s`` and ``tcp_io_timeout_s``). Values are
    :func:`~kvstore.cluster.chaos_check.chunk_value` of key and version. Every request is one
    :class:`~kvstore.cluster.chaos_check.Record`; the watch's LEFT/JOINED events are the lease
    gaps. One more thread per conductor asks it to ``Schedule`` a request and who leads
    (``Leader``), recording each claim of leadership and each decision with its term
    (``LEASE`` records) and the prefill node it chose (``SCHEDULE``). On ``stop`` (stdin) it reads back every acknowledged key from its node (so a durable
    chunk lost in a crash shows as an ``ABSENT`` get after the restart), closes its data
    connections and asks each daemon's Stats for connections and leases still open (the
    leaks), then writes the history as JSON lines. One more thread per daemon follows its
    chunk events and records every REMOVED (an eviction at the budget is no loss). One more
    per engine (:meth:`_Load.engine_driver`) sends its prefill worker prompts
    (:func:`engine_prompts`) one at a time, each an ``ENGINE`` record checked against the
    prompt's no-cache output (:func:`no_cache_outputs`, computed before the cluster starts;
    vLLM: :meth:`_Load._vllm_request` to the host's server, checked against the outputs the
    servers computed under salts nothing else uses).

Faults (:data:`FAULTS`)
    ``kill-daemon``: ``kill -9`` of ``h1``'s daemon; after ``down_s`` (past the 2 s lease) it
    restarts on the same NVMe directory; the window runs from the kill to the new daemon's
    ready line. ``sigstop-daemon``: SIGSTOP for ``down_s``, then SIGCONT (a zombie: its lease
    expired meanwhile). ``partition-host``: the host's bridge port down for ``down_s`` + 4 s
    (its etcd member loses quorum too; the extra time covers an etcd leader election, which
    extends every lease), then up. ``sigstop-etcd-member`` / ``sigstop-etcd-leader``: SIGSTOP
    of a follower member (``h1``'s, ``h2``'s when ``h1``'s leads) / the leading member for
    ``down_s`` + 2 s, then SIGCONT (etcd 3.4 revokes every lease when a paused leader
    resumes, docs/etcd-failover.md: the leader row notes which);
    ``etcd-quorum-loss``: the same for ``h1``'s and ``h2``'s members.
    ``corrupt-segment``: one byte flipped in three chunks of ``h1``'s segment files
    (:func:`flip_payload_bytes`), read at once from NVMe (the load empties the node's DRAM
    first), then ``kill -9`` and a restart on the damaged directory.
    ``kill-conductor-leader``: ``kill -9`` of the leading conductor, restarted after
    ``down_s`` (a standby then); ``sigstop-conductor-leader``: SIGSTOP of it for ``down_s``,
    then SIGCONT (it must not decide in its old term). ``truncate-segment``
    (:func:`truncate_segment`), ``nvme-full``, ``kill-client-shm/tcp/ucx``
    (:func:`_client_main`), ``flood-connections`` and ``slowloris``: their functions' and
    docs/chaos.md's table. The load watches
    membership through a member the fault leaves alone. After the fault the run waits (up to
    30 s) until the load saw every node that left registered again, then loads ``after_s``
    more.

Row figures
    attempted/completed/failed: data requests started during the fault window (completed:
    answered, hit or miss; failed: an error or no answer); wrong reads and durable chunks lost
    (:func:`~kvstore.cluster.chaos_check.check`); detect: fault start to the LEFT event of the
    node seen by the load generator; recover: fault start to the later of its JOINED event and
    its first successful request started after the fault (etcd faults: to every member
    healthy again; conductor faults: detect at the first act in a newer term, recover at its
    first decision; client faults: recover at the first probe that finds nothing held;
    ``nvme-full``: detect at the first ``DiskFull``, recover at the first put after; flood:
    detect is the wait of a client arriving during it; slowloris: detect is the slowest
    data-plane drop); leaks: TCP connections and
    shared-memory leases the daemons still count after the load closed its clients, plus the
    faulted daemon's own excess counts for the client and flood faults (:func:`_leaks`); left:
    membership lease expiries the load saw (any beyond the faulted daemon's: a healthy node
    evicted); over
    timeout: requests that took longer than the clients' ``rpc_timeout_s`` (2 s) + 1 s; stall:
    the longest span of the window with no request answered (at most 3 s: a request that needs
    the faulted node gives up in time and the load goes on with the others); engine a/c/f:
    engine requests started in the window, answered within ``ENGINE_TIMEOUT_S`` + 1 s, failed
    (one failed on an engine the fault did not cut off is a violation: it must recompute);
    reuse before/after: the share of prompt tokens the faulted node's engine loaded from
    kvtier. Times come from one monotonic clock (the namespaces share it).
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import itertools
import json
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvstore.cluster.chaos_check import (
    TIMEOUT_SLACK_S,
    Fault,
    History,
    Invariant,
    LeaseGap,
    Op,
    Record,
    Removal,
    Restart,
    Result,
    Violation,
    check,
    chunk_value,
    digest,
    durable_unverified,
    engine_requests_during,
    engine_reuse,
    engine_stats,
    fault_stats,
    longest_stall,
    tokens_digest,
)
from kvstore.cluster.netns import Host, NetnsLab, unavailable_reason
from kvstore.errors import (
    CapacityError,
    ChunkNotFound,
    ConfigError,
    KvtierError,
    PeerUnavailable,
)

if TYPE_CHECKING:
    from kvstore.client.store_client import StoreClient

REPO = Path(__file__).resolve().parents[1]
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
GRPC_PORT = 50051
TCP_PORT = 50052
PREFIX = "/kvtier/"
LEASE_TTL_S = 2
REQUEST_TIMEOUT_S = 2.0
"""The load's clients' ``rpc_timeout_s``: the bound the history checks every request against."""
MAX_STALL_S = REQUEST_TIMEOUT_S + TIMEOUT_SLACK_S
"""Longest a fault may leave the whole load without an answer: a request that needs the
faulted node gives up within its timeout, and the load moves on to the others."""
DAEMON_READY = "KVTIER-DAEMON-READY "
LOADGEN_READY = "KVTIER-LOADGEN-READY"
LOADGEN_DONE = "KVTIER-LOADGEN-DONE "
LOADGEN_READ = "KVTIER-LOADGEN-READ "
"""The answer to a ``read NODE KEY...`` command: what each get returned, and the node's count
of chunks found corrupt."""
LOADGEN_LEFT = "KVTIER-LOADGEN-LEFT "
"""The load generator saw a node's key leave etcd (its lease expired)."""
LOADGEN_REJOINED = "KVTIER-LOADGEN-REJOINED "
"""The load generator saw a node register again after its lease had expired."""
LOADGEN_DECIDED = "KVTIER-LOADGEN-DECIDED "
"""The load generator saw a conductor decide in a term newer than every earlier decision's:
``<conductor id> <term>``."""
REJOIN_TIMEOUT_S = 30.0
SUSPECT_S = float(LEASE_TTL_S)
"""After a request to a node failed, the load sends it nothing new for this long (what an
engine does: it recomputes instead of queueing behind a node that does not answer)."""
CONDUCTOR_PORT = 50061
CONDUCTOR_HOSTS = (0, 2)
"""Hosts with a conductor (leader and standby), as the issue's cluster has."""
ELECTION_TTL_S = 2
MODEL = "chaos"
ENGINES_READY = "KVTIER-ENGINES-READY"
CONDUCTOR_READY = "KVTIER-CONDUCTOR-READY "
FAULTED_HOST = 1
"""The host most faults hit (the load watches membership through another host's etcd member)."""
SMALL_NVME_FS_BYTES = 48 << 20
"""Size of the tmpfs ``h1``'s NVMe directory lives on when a fault needs a filesystem it can
fill (:attr:`Need.SMALL_NVME`); the tier's budget is ``SMALL_NVME_BUDGET_BYTES`` below it."""
SMALL_NVME_BUDGET_BYTES = 40 << 20
MAX_CONNECTIONS = 64
"""``server.max_connections`` of every daemon in the lab (the default is 1024): a flood of
twice that is cheap on 2 cores."""
HEADER_TIMEOUT_S = 3.0
"""``server.header_timeout_s`` of every daemon in the lab (the default is 10 s): a slowloris
connection that sent part of a frame header is dropped after this."""
IDLE_TIMEOUT_S = 2.0
"""``server.idle_timeout_s`` of every daemon in the lab (the default is 300 s): the flood's idle
HTTP/2 connections, at the gRPC port's bound, are closed after this, well within the flood."""
UCX_IO_TIMEOUT_S = 4.0
"""``server.ucx_io_timeout_s`` of ``h1`` when it serves UCX (default 30 s): UCX cannot see a
dead client, so a transfer of one is cut (its lease aborted or released) only after this."""
RELEASE_TIMEOUT_S = 10.0
"""How long the daemon may take to end what a killed client held (UCX: ``UCX_IO_TIMEOUT_S``
more); held past it is a leak."""
CLIENT_READY = "KVTIER-CLIENT-HOLDING "
"""The killed-client process holds its transfers open (and says which)."""
FLOOD_READY = "KVTIER-FLOOD-HOLDING "
FLOOD_DONE = "KVTIER-FLOOD-DONE "
LOADGEN_PROBE = "KVTIER-LOADGEN-PROBE "
"""The answer to ``probe NODE``: the node's counts after its DRAM was emptied."""


GRPC_FLOOD_CONNECTIONS = MAX_CONNECTIONS
"""Idle HTTP/2 connections of the flood: the gRPC port's bound (``MAX_CONNECTIONS``; with the
lab's own connections, a few are refused). It was 3/4 of it while idle HTTP/2 connections
were not timed out (a flood at the bound kept the load's new client, which needs gRPC first,
out while it lasted); they now close after ``IDLE_TIMEOUT_S``. Both:
tests/node/test_grpc_connection_bound.py."""
SLOWLORIS_CONNECTIONS = 16
GRPC_HANDSHAKE_BOUND_S = 60.0 + TIMEOUT_SLACK_S
"""How long a gRPC connection that sent part of the HTTP/2 preface may stay open: grpc's
server handshake timeout (not set by the daemon; measured 60.0 s here), plus the slack."""


class Engines(enum.Enum):
    """Which real engines serve prompts during a run (``--engines``)."""

    NONE = "none"
    REFERENCE = "reference"
    """A prefill and a decode worker of the reference engine (``python -m
    kvstore.engine.worker``: a real transformer, random fixed-seed weights) on each of
    ``ENGINE_HOSTS``, saving to and loading from their node's daemon over TCP."""
    VLLM = "vllm"
    """One ``vllm serve`` with kvtier's connector (``kv_both``) on each of ``ENGINE_HOSTS``,
    in the host's namespace, its node's daemon its store over TCP (:func:`_vllm_main`): the
    tiny Llama of :class:`~kvstore.cluster.vllm_instance.TinyLlama`, greedy, vLLM's own
    prefix cache off (every cached prompt token came from kvtier)."""


ENGINE_HOSTS = (0, FAULTED_HOST)
"""Hosts with an engine pair: ``h1``, whose daemon the daemon faults hit (its engine must
degrade to recomputing), and ``h0``, which keeps serving."""
ENGINE_MODEL = "chaos-ref"
ENGINE_SPEC: dict[str, int] = {"vocab_size": 1000, "hidden_size": 128,
                               "intermediate_size": 256, "num_layers": 2,
                               "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 32,
                               "max_positions": 1024, "seed": 7}
"""The engines' model (:class:`~kvstore.engine.model.ModelSpec` fields): the tests' tiny
2-layer reference Llama (tests/support/models.py), cheap on 2 cores next to the cluster."""
ENGINE_BLOCK_TOKENS = 16
ENGINE_PREFILL_PORT = 50071
ENGINE_DECODE_PORT = 50072
ENGINE_NEW_TOKENS = 4
ENGINE_FAMILIES = 4
"""Prompt families: each shares a 4-block prefix; ``ENGINE_VARIANTS`` prompts per family."""
ENGINE_VARIANTS = 6
ENGINE_KV_TIMEOUT_S = REQUEST_TIMEOUT_S
"""The engines' KV clients' ``rpc_timeout_s`` (``--kv-timeout-s``), as the load's clients."""
ENGINE_TIMEOUT_S = 10.0
"""The bound on one engine request (generate to done): a prefill whose daemon does not
answer waits for its KV client's timeout on the lookup and on the save, and the decode
on its load, before recomputing; the history checks every engine request against it."""
ENGINE_PAUSE_S = 0.05
ENGINE_TENANT = "chaos"


VLLM_PORT = 8000
"""Where each host's ``vllm serve`` listens (on the host's address: its own network stack)."""
VLLM_BLOCK_TOKENS = 32
"""vLLM's block size (a multiple of 32 on CPU) and so the connector's chunk: 64 KiB of the
tiny Llama's KV (2 layers x 2 KV heads x 64 x float32, K and V)."""
VLLM_MAX_MODEL_LEN = 512
VLLM_KV_BYTES = 16 << 20
"""Each server's own KV cache (256 blocks: room for a few requests; prefix caching is off,
so it holds nothing between them)."""
VLLM_START_TIMEOUT_S = 600.0
"""Two ``vllm serve`` starting beside the cluster on 2 cores: ~1-2 min; a loaded box more."""
VLLM_READY = "KVTIER-VLLM-READY "
"""The launcher's line once its server is healthy and computed the no-cache outputs."""
VLLM_NICE = 10
"""The servers' niceness. vLLM's Worker busy-polls its message queue (``sched_yield``) for 1 s
after every step (``shm_broadcast``), so under a steady load each server's Worker takes a
core; at niceness 0 the two starved the daemons, etcd and the load on 2 cores (a first put
took 6.3 s against its 2 s timeout, a restarted daemon 12.5 s to come up, a lookup of a
healthy daemon timed out). At 10 they get what the others leave."""
VLLM_PAUSE_S = 0.1
"""The vLLM driver's pause between requests (each server is an API server, an EngineCore
and a Worker process on 2 shared cores: less load than the reference workers' pause)."""


def engine_prompts(block_tokens: int = ENGINE_BLOCK_TOKENS,
                   vocab: int = ENGINE_SPEC["vocab_size"]) -> dict[str, list[int]]:
    """The prompts the engines serve (a deterministic function of the block size and the
    vocabulary): ``ENGINE_FAMILIES`` families of ``ENGINE_VARIANTS``, each a shared 4-block
    prefix plus a suffix of its own of 1-2 blocks and a partial block (so requests of a family
    reuse its prefix, and a repeated prompt reuses every full block)."""
    rng = random.Random(16)
    prompts = {}
    for f in range(ENGINE_FAMILIES):
        prefix = [rng.randrange(vocab) for _ in range(4 * block_tokens)]
        for v in range(ENGINE_VARIANTS):
            n = block_tokens * (1 + v % 2) + 1 + rng.randrange(block_tokens - 1)
            prompts[f"f{f}v{v}"] = prefix + [rng.randrange(vocab) for _ in range(n)]
    return prompts


def vllm_prompts() -> dict[str, list[int]]:
    """:func:`engine_prompts` in vLLM's blocks (``VLLM_BLOCK_TOKENS``) and the tiny Llama's
    vocabulary: at most 223 tokens, 4 new ones fit ``VLLM_MAX_MODEL_LEN``."""
    from kvstore.cluster.vllm_instance import TinyLlama

    return engine_prompts(VLLM_BLOCK_TOKENS, TinyLlama().vocab_size)


def prompts_for(engines: Engines) -> dict[str, list[int]]:
    """The prompts ``engines`` serve (none without engines)."""
    if engines is Engines.VLLM:
        return vllm_prompts()
    return engine_prompts() if engines is Engines.REFERENCE else {}


def vllm_model_name() -> str:
    """The connector's ``model`` (its key namespace) and vLLM's ``--served-model-name``."""
    from kvstore.cluster.vllm_instance import TinyLlama

    return f"tiny-llama-{TinyLlama().key()}"


def vllm_kv_transfer_config(daemon_address: str) -> dict[str, Any]:
    """``--kv-transfer-config`` of a host's ``vllm serve``: kvtier's connector on the host's
    daemon over TCP (the namespaces share ``/dev/shm`` and a boot id, and the daemons serve no
    lease channel or read index: docs/chaos.md), bounded by the suite's timeouts
    (``ENGINE_KV_TIMEOUT_S`` for a lookup, a step's loads and its saves), a failed load
    recomputed."""
    return {"kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "daemon": daemon_address, "model": vllm_model_name(), "data_plane": "tcp",
                "lookup_index": "off", "lookup_timeout_s": ENGINE_KV_TIMEOUT_S,
                "load_timeout_s": ENGINE_KV_TIMEOUT_S, "save_timeout_s": ENGINE_KV_TIMEOUT_S}}


def http_post(address: str, path: str, body: dict[str, Any]) -> bytes:
    """An HTTP/1.1 POST of ``body`` as JSON to ``address`` (``host:port``), asking the server
    to close the connection after its answer (so the answer is everything read to the end)."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    return head.encode("ascii") + data


def http_answer(raw: bytes) -> tuple[int, Any]:
    """The status and the JSON body (None when empty) of an HTTP/1.1 answer read to its end:
    a ``Content-Length`` body or a chunked one. ValueError for anything else."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split()
    if not sep or len(status_line) < 2 or not status_line[0].startswith("HTTP/"):
        raise ValueError(f"not an HTTP answer: {raw[:60]!r}")
    headers = {name.strip().lower(): value.strip()
               for name, _, value in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        out, rest = bytearray(), body
        while True:
            size_line, crlf, rest = rest.partition(b"\r\n")
            if not crlf:
                raise ValueError("a chunked answer cut short")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            if len(rest) < size + 2:
                raise ValueError("a chunked answer cut short")
            out += rest[:size]
            rest = rest[size + 2:]
        body = bytes(out)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if len(body) < length:
            raise ValueError(f"an answer of {len(body)} of its {length} bytes")
        body = body[:length]
    return int(status_line[1]), (json.loads(body) if body.strip() else None)


def no_cache_outputs(prompts: dict[str, list[int]]) -> dict[str, str]:
    """Each prompt's greedy output by the engines' model with no store at all (one full
    prefill, then one decode per token), as :func:`~kvstore.cluster.chaos_check.tokens_digest`."""
    import torch

    from kvstore.engine.colocated import reference_generate
    from kvstore.engine.model import ModelSpec, build_reference_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_reference_model(ModelSpec(**ENGINE_SPEC))
        return {key: tokens_digest(reference_generate(model, tokens, ENGINE_NEW_TOKENS))
                for key, tokens in prompts.items()}
    finally:
        torch.set_num_threads(threads)


class Need(enum.Enum):
    """What a fault needs of the cluster beyond the common setup (:attr:`FaultPlan.needs`)."""

    SMALL_NVME = "small-nvme"
    """``h1``'s NVMe directory on a small tmpfs (``SMALL_NVME_FS_BYTES``) another file can fill."""
    SHM = "shm"
    """``h1``'s daemon serves the lease channel (the shared-memory plane, for a client in
    ``h1``'s namespace: its abstract socket exists in that namespace only)."""
    UCX = "ucx"
    """``h1``'s daemon serves UCX."""


@dataclass(frozen=True)
class ChaosSpec:
    """Sizes and durations of one run (``quick``: the test's and ``--quick``'s)."""

    warmup_s: float = 3.0
    down_s: float = 4.0
    """How long a killed daemon stays down (past its lease TTL, so the lease expires)."""
    after_s: float = 4.0
    """Load after the fault is removed, before the read-back."""
    workers: int = 3
    value_bytes: int = 16 << 10
    op_pause_s: float = 0.004
    """Each worker's pause between requests (a steady, not saturating, load on 2 cores)."""
    start_timeout_s: float = 60.0
    slowloris_wait_s: float = GRPC_HANDSHAKE_BOUND_S + 1.0
    """How long the slowloris fault watches its connections (long enough for gRPC's bound;
    quick: the data plane's only)."""
    engines: Engines = Engines.REFERENCE
    """Real engines serving prompts beside the synthetic load (:class:`Engines`)."""

    def __post_init__(self) -> None:
        if not isinstance(self.engines, Engines):
            raise ConfigError(f"ChaosSpec.engines must be an Engines, not {self.engines!r}")

    @classmethod
    def quick(cls, engines: Engines = Engines.REFERENCE) -> ChaosSpec:
        return cls(warmup_s=1.5, down_s=3.5, after_s=2.0, workers=2, slowloris_wait_s=5.0,
                   engines=engines)


@dataclass
class FaultRow:
    fault: str
    attempted: int
    completed: int
    failed: int
    wrong_reads: int
    durable_lost: int
    durable_unverified: int
    detect_s: float | None
    recover_s: float | None
    leaks: int
    nodes_left: int = 0
    """Times the load saw a node's lease expire (the faulted daemon's: expected; any other:
    a healthy node evicted)."""
    over_timeout: int = 0
    """Puts and gets that took longer than ``REQUEST_TIMEOUT_S`` + 1 s."""
    longest_stall_s: float = 0.0
    """Longest span of the fault window with no request answered."""
    other_violations: list[str] = field(default_factory=list)
    records: int = 0
    decisions: int = 0
    """Requests the conductors placed over the whole run."""
    last_answer_s: dict[str, float] = field(default_factory=dict)
    """When each conductor last answered a Schedule (monotonic s): a paused one woke up."""
    schedule_errors: list[str] = field(default_factory=list)
    damaged: int = 0
    """Chunks the fault corrupted on disk."""
    corrupt_reported: int = 0
    """Chunks the damaged node counted corrupt (before its kill, plus after its restart)."""
    leak_detail: dict[str, int] = field(default_factory=dict)
    """The faulted daemon's own counts after the fault beyond before it (client faults,
    floods): leases, connections, DRAM bytes held, sockets, other descriptors."""
    notes: list[str] = field(default_factory=list)
    skipped: str = ""
    """Why the fault did not run here (the row holds no figures)."""
    engine_attempted: int = 0
    engine_completed: int = 0
    engine_failed: int = 0
    """Engine requests under way during the fault (started in it, or in flight at its start):
    answered within ``ENGINE_TIMEOUT_S`` + 1 s, or not (an error, no answer, or later)."""
    engine_slowest_s: float = 0.0
    """The longest of those (what degrading cost)."""
    engine_wrong: int = 0
    """Engine answers that differ from their prompt's no-cache output (counted in
    ``wrong_reads`` too)."""
    reuse_before: float | None = None
    reuse_after: float | None = None
    """Share of the prompt tokens the faulted node's engine (every engine, when the fault hit
    no engine's node) loaded from kvtier instead of computing, before the fault and after it;
    None: no engine request answered there."""

    @property
    def clean(self) -> bool:
        return (self.wrong_reads == 0 and self.durable_lost == 0 and self.leaks == 0
                and self.over_timeout == 0 and not self.other_violations)


# --- processes with a ready line ------------------------------------------------------------


class _Child:
    """A child in the lab whose stdout lines are read by a thread (so the pipe never fills)."""

    def __init__(self, proc: subprocess.Popen[str], name: str, log_path: Path) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._seen: list[str] = []
        self._seen_lock = threading.Lock()
        threading.Thread(target=self._read, name=f"read-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._seen_lock:
                self._seen.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def seen(self, prefix: str) -> list[str]:
        """The rest of every line read so far that starts with ``prefix``, in order."""
        with self._seen_lock:
            return [line[len(prefix):] for line in self._seen if line.startswith(prefix)]

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        """The first stdout line starting with ``prefix``; ConfigError with the log tail if the
        child exits or ``timeout_s`` passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                line = "" if left > 0 else None
                if line is None:
                    raise ConfigError(f"{self.name}: no {prefix.strip()!r} line in {timeout_s} s"
                                      f"; log:\n{self.log_tail()}") from None
                continue
            if line is None:
                raise ConfigError(f"{self.name} exited ({self.proc.wait()}) before "
                                  f"{prefix.strip()!r}; log:\n{self.log_tail()}")
            if line.startswith(prefix):
                return line[len(prefix):]

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc.poll() is None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    return env


# --- the cluster --------------------------------------------------------------------------


class ChaosCluster:
    """etcd members and daemons on the lab's hosts; see the module docstring. ``start`` is the
    only method with side effects besides the faults; ``close`` tears everything down."""

    def __init__(self, work_dir: Path, spec: ChaosSpec,
                 needs: frozenset[Need] = frozenset()) -> None:
        self.work_dir = work_dir
        self.spec = spec
        self.needs = needs
        self.lab = NetnsLab(hosts=3)
        self._mounted: list[Path] = []
        self.etcd: dict[str, _Child] = {}
        self.daemons: dict[str, _Child] = {}
        self.engines: dict[str, _Child] = {}
        self.conductors: dict[str, _Child] = {}
        self.conductor_addresses: dict[str, str] = {}
        self.workers: dict[str, _Child] = {}
        """The real engines' worker processes (``prefill-h1``, ``decode-h1``...)."""
        self.vllm: dict[str, _Child] = {}
        """The ``vllm serve`` launchers (:data:`Engines.VLLM`), per host name."""
        self.vllm_expected: dict[str, str] = {}
        """Each prompt's no-cache output by the vLLM servers (:func:`_vllm_main`), once up."""
        self.vllm_start_s: dict[str, float] = {}
        self.node_ids = [f"node-{h.name}" for h in self.lab.hosts]

    def __enter__(self) -> ChaosCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._stop_vllm()
            self.lab.close()
        finally:
            for path in reversed(self._mounted):  # after every process in the lab died
                subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)
            self._mounted.clear()

    def nvme_dir(self, host: Host) -> Path:
        if Need.SMALL_NVME in self.needs and host is self.lab.hosts[FAULTED_HOST]:
            return self.small_fs(host) / "nvme"
        return self.work_dir / f"nvme-{host.name}"

    def small_fs(self, host: Host) -> Path:
        """Where the small tmpfs under ``host``'s NVMe directory is mounted."""
        return self.work_dir / f"fs-{host.name}"

    def _mount_small_nvme(self, host: Host) -> None:
        """A tmpfs of ``SMALL_NVME_FS_BYTES`` on ``host``'s NVMe directory, mounted before its
        daemon starts (so the daemon's mount namespace, copied at ``ip netns exec``, has it;
        a file written into it from here fills the same filesystem)."""
        path = self.small_fs(host)
        path.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o",
                                 f"size={SMALL_NVME_FS_BYTES},mode=0700", "kvtier-chaos", str(path)],
                                capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise ConfigError(f"cannot mount a tmpfs on {path}: {result.stderr.strip()}")
        self._mounted.append(path)

    def start(self) -> None:
        self.lab.up()
        if Need.SMALL_NVME in self.needs:
            self._mount_small_nvme(self.lab.hosts[FAULTED_HOST])
        for host in self.lab.hosts:
            self.lab.wait_reachable(self.lab.observer, host)
        for host in self.lab.hosts:
            self._start_etcd(host)
        for host in self.lab.hosts:
            self.wait_etcd(host)
        for host in self.lab.hosts:  # started together, awaited together: ~2 s, not ~6
            self.daemons[host.name] = self._spawn_daemon(host)
        for host in self.lab.hosts:
            self.daemons[host.name].wait_line(DAEMON_READY, self.spec.start_timeout_s)
        if self.spec.engines is Engines.VLLM:  # the longest start: under way from here on
            from kvstore.cluster.vllm_instance import TinyLlama, tiny_llama_checkpoint

            model_dir = tiny_llama_checkpoint(TinyLlama())
            for n, i in enumerate(ENGINE_HOSTS):
                host = self.lab.hosts[i]
                self.vllm[host.name] = self._spawn_vllm(host, model_dir, n)
        for host in self.lab.hosts:
            self.engines[host.name] = self._spawn_engines(host)
        for host in self.lab.hosts:
            self.engines[host.name].wait_line(ENGINES_READY, self.spec.start_timeout_s)
        if self.spec.engines is Engines.REFERENCE:  # model loads overlap the conductors'
            for i in ENGINE_HOSTS:
                for role in ("prefill", "decode"):
                    name = f"{role}-{self.lab.hosts[i].name}"
                    self.workers[name] = self._spawn_worker(self.lab.hosts[i], role)
        for i in CONDUCTOR_HOSTS:
            self.conductors[self.lab.hosts[i].name] = self._spawn_conductor(self.lab.hosts[i])
        for i in CONDUCTOR_HOSTS:
            self._wait_conductor(self.lab.hosts[i])
        from kvstore.engine.worker import READY_PREFIX

        for child in self.workers.values():
            child.wait_line(READY_PREFIX, self.spec.start_timeout_s)
        self._wait_vllm()

    def _spawn_vllm(self, host: Host, model_dir: Path, n: int) -> _Child:
        """The launcher of ``host``'s ``vllm serve`` (:func:`_vllm_main`) in its namespace: the
        server on the host's address, kvtier's connector on the host's daemon, its model bound
        to the ``n``-th core this process may use (two servers on two cores: one each)."""
        cpus = sorted(os.sched_getaffinity(0))
        config = {"model_dir": str(model_dir), "work_dir": str(self.work_dir),
                  "name": f"vllm-{host.name}", "host": host.address,
                  "kv_transfer_config": vllm_kv_transfer_config(f"{host.address}:{GRPC_PORT}"),
                  "env": {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[n % len(cpus)]),
                          "VLLM_NO_USAGE_STATS": "1"},
                  "prompts": vllm_prompts()}
        path = self.work_dir / f"vllm-{host.name}.json"
        path.write_text(json.dumps(config))
        return self.spawn_tool(host, ["vllm", str(path)], f"vllm-{host.name}-launcher")

    def _wait_vllm(self) -> None:
        """Until every ``vllm serve`` is healthy and computed each prompt's no-cache output;
        those become :attr:`vllm_expected` (the servers must agree on every one)."""
        answers: dict[str, dict[str, str]] = {}
        for name, child in self.vllm.items():
            ready = json.loads(child.wait_line(VLLM_READY, VLLM_START_TIMEOUT_S))
            answers[name] = {str(k): str(v) for k, v in ready["expected"].items()}
            self.vllm_start_s[name] = float(ready["start_s"])
        if not answers:
            return
        first, *others = answers.items()
        for name, outputs in others:
            differ = sorted(k for k in outputs if outputs[k] != first[1].get(k))
            if differ or set(outputs) != set(first[1]):
                raise ConfigError(f"the vLLM servers of {first[0]} and {name} disagree on the "
                                  f"no-cache output of {len(differ)} prompts ({differ[:4]}): "
                                  "no reference to check engine answers against")
        self.vllm_expected = dict(first[1])

    def _stop_vllm(self) -> None:
        """SIGTERM to every launcher, which closes its server (SIGTERM to the server's group,
        SIGKILL what is left, its shared memory unlinked:
        :class:`~kvstore.cluster.vllm_server.VllmServer`), also one still starting, before
        the lab's teardown SIGKILLs what is left in the namespaces (vLLM's shared memory would
        stay behind)."""
        for child in self.vllm.values():
            if child.alive():
                child.proc.send_signal(signal.SIGTERM)
        for child in self.vllm.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(60)
        self.vllm.clear()

    def _spawn_worker(self, host: Host, role: str) -> _Child:
        """One worker of the reference engine on ``host`` (:data:`Engines.REFERENCE`), its
        node's daemon its store; listening on the host's address."""
        port = ENGINE_PREFILL_PORT if role == "prefill" else ENGINE_DECODE_PORT
        argv = [sys.executable, "-m", "kvstore.engine.worker", "--role", role,
                "--instance-id", f"ref-{role}-{host.name}", "--node-id", f"node-{host.name}",
                "--daemon", f"{host.address}:{GRPC_PORT}", "--etcd", self.etcd_endpoints(host),
                "--prefix", PREFIX, "--model-name", ENGINE_MODEL,
                "--spec-json", json.dumps(ENGINE_SPEC),
                "--block-tokens", str(ENGINE_BLOCK_TOKENS), "--threads", "1",
                "--listen", f"{host.address}:{port}",
                "--kv-timeout-s", str(ENGINE_KV_TIMEOUT_S)]
        log_path = self.work_dir / f"{role}-{host.name}.log"
        with log_path.open("a") as log:
            proc = self.lab.popen(host, argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                  cwd=REPO, env=_env())
        return _Child(proc, f"{role}-{host.name}", log_path)

    def engine_addresses(self) -> list[dict[str, str]]:
        """What the load's engine driver sends prompts to: per engine host its node and its
        prefill and decode workers' addresses."""
        if self.spec.engines is Engines.NONE:
            return []
        if self.spec.engines is Engines.VLLM:
            return [{"node": f"node-{h.name}", "kind": Engines.VLLM.value,
                     "url": f"{h.address}:{VLLM_PORT}", "model": vllm_model_name()}
                    for h in (self.lab.hosts[i] for i in ENGINE_HOSTS)]
        return [{"node": f"node-{h.name}", "prefill": f"{h.address}:{ENGINE_PREFILL_PORT}",
                 "decode": f"{h.address}:{ENGINE_DECODE_PORT}"}
                for h in (self.lab.hosts[i] for i in ENGINE_HOSTS)]

    def _spawn_engines(self, host: Host) -> _Child:
        """The engine records of ``host`` (one prefill, one decode instance on its node),
        held under their own leases by a process in the host's namespace, as an engine holds
        them: the conductor schedules onto them (no engine runs; the decisions are checked)."""
        log_path = self.work_dir / f"engines-{host.name}.log"
        argv = [sys.executable, "-m", "bench.chaos", "engines", self.etcd_endpoints(host),
                PREFIX, f"node-{host.name}", host.name]
        with log_path.open("a") as log:
            proc = self.lab.popen(host, argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                  cwd=REPO, env=_env())
        return _Child(proc, f"engines-{host.name}", log_path)

    def _spawn_conductor(self, host: Host) -> _Child:
        argv = [sys.executable, "-m", "kvstore.cli.main", "conductor",
                "--etcd", self.etcd_endpoints(host), "--prefix", PREFIX,
                "--listen", f"{host.address}:{CONDUCTOR_PORT}", "--insecure",
                "--id", f"conductor-{host.name}", "--election-ttl-s", str(ELECTION_TTL_S)]
        log_path = self.work_dir / f"conductor-{host.name}.log"
        with log_path.open("a") as log:
            proc = self.lab.popen(host, argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                  cwd=REPO, env=_env())
        return _Child(proc, f"conductor-{host.name}", log_path)

    def _wait_conductor(self, host: Host) -> None:
        ready = json.loads(self.conductors[host.name].wait_line(CONDUCTOR_READY,
                                                               self.spec.start_timeout_s))
        self.conductor_addresses[ready["conductor_id"]] = ready["address"]

    def conductor_leader(self) -> Host:
        """The host whose conductor etcd names leader now."""
        h0 = self.lab.hosts[0]
        result = self.lab.run(h0, ["etcdctl", "--endpoints", self.etcd_endpoint(h0),
                                   "--command-timeout=2s", "get", "--print-value-only",
                                   f"{PREFIX}conductor/leader"],
                              env=dict(os.environ, ETCDCTL_API="3"))
        if result.returncode != 0 or not result.stdout.strip():
            raise ConfigError(f"no conductor leader in etcd: {result.stderr.strip()}")
        leader = json.loads(result.stdout)["conductor_id"]
        return next(h for h in self.lab.hosts if f"conductor-{h.name}" == leader)

    def etcd_endpoint(self, host: Host) -> str:
        return f"{host.address}:{ETCD_CLIENT_PORT}"

    def etcd_endpoints(self, host: Host) -> str:
        """Every member, ``host``'s own first: what its daemon, conductor and engines are
        given, so they talk to their own member and fail over to the others
        (docs/etcd-failover.md)."""
        hosts = [host, *(h for h in self.lab.hosts if h is not host)]
        return ",".join(self.etcd_endpoint(h) for h in hosts)

    def _start_etcd(self, host: Host) -> None:
        binary = shutil.which(os.environ.get("KVTIER_ETCD_BINARY") or "etcd")
        if binary is None:
            raise ConfigError("etcd binary not found (install etcd-server or set "
                              "KVTIER_ETCD_BINARY)")
        cluster = ",".join(f"etcd-{h.name}=http://{h.address}:{ETCD_PEER_PORT}"
                           for h in self.lab.hosts)
        data = self.work_dir / f"etcd-{host.name}"
        argv = [binary, "--name", f"etcd-{host.name}", "--data-dir", str(data),
                "--listen-client-urls", f"http://{host.address}:{ETCD_CLIENT_PORT}",
                "--advertise-client-urls", f"http://{host.address}:{ETCD_CLIENT_PORT}",
                "--listen-peer-urls", f"http://{host.address}:{ETCD_PEER_PORT}",
                "--initial-advertise-peer-urls", f"http://{host.address}:{ETCD_PEER_PORT}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", self.lab.prefix,
                "--heartbeat-interval", "100", "--election-timeout", "1000"]
        log_path = self.work_dir / f"etcd-{host.name}.log"
        with log_path.open("a") as log:
            proc = self.lab.popen(host, argv, stdout=subprocess.PIPE, stderr=log, text=True)
        self.etcd[host.name] = _Child(proc, f"etcd-{host.name}", log_path)

    def _etcd_members(self) -> tuple[dict[str, int], int]:
        """Each host's etcd member id, and the id of the member that leads."""
        h0 = self.lab.hosts[0]
        endpoints = ",".join(self.etcd_endpoint(h) for h in self.lab.hosts)
        result = self.lab.run(h0, ["etcdctl", "--endpoints", endpoints, "--command-timeout=2s",
                                   "endpoint", "status", "-w", "json"],
                              env=dict(os.environ, ETCDCTL_API="3"))
        if result.returncode != 0:
            raise ConfigError(f"etcdctl endpoint status failed: {result.stderr.strip()}")
        ids: dict[str, int] = {}
        leader = 0
        for status in json.loads(result.stdout):
            address = status["Endpoint"].removeprefix("http://").rpartition(":")[0]
            host = next(h for h in self.lab.hosts if h.address == address)
            ids[host.name] = int(status["Status"]["header"]["member_id"])
            leader = int(status["Status"]["leader"]) or leader
        return ids, leader

    def etcd_leader(self) -> Host:
        """The host whose etcd member leads now."""
        ids, leader = self._etcd_members()
        for host in self.lab.hosts:
            if ids.get(host.name) == leader:
                return host
        raise ConfigError(f"no etcd member leads: {ids}, leader {leader:x}")

    def etcd_follower(self) -> Host:
        """``h1`` if its etcd member does not lead, else the next host whose member does not."""
        leader = self.etcd_leader()
        hosts = self.lab.hosts
        return next(hosts[(FAULTED_HOST + i) % len(hosts)] for i in range(len(hosts))
                    if hosts[(FAULTED_HOST + i) % len(hosts)] is not leader)

    def move_etcd_leader(self, away_from: Host) -> Host:
        """Hand etcd's leadership from ``away_from``'s member to another (``etcdctl
        move-leader``); the new leader's host."""
        ids, _ = self._etcd_members()
        to = next(h for h in self.lab.hosts if h is not away_from)
        result = self.lab.run(away_from, ["etcdctl", "--endpoints",
                                          self.etcd_endpoint(away_from), "--command-timeout=5s",
                                          "move-leader", f"{ids[to.name]:x}"],
                              env=dict(os.environ, ETCDCTL_API="3"))
        if result.returncode != 0:
            raise ConfigError(f"etcdctl move-leader failed: {result.stderr.strip()}")
        return to

    def wait_etcd(self, host: Host) -> None:
        """Until ``host``'s etcd member answers healthy (it has a leader and a quorum)."""
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            result = self.lab.run(host, ["etcdctl", "--endpoints", self.etcd_endpoint(host),
                                         "--command-timeout=1s", "endpoint", "health"],
                                  env=dict(os.environ, ETCDCTL_API="3"))
            if result.returncode == 0:
                return
            child = self.etcd[host.name]
            if not child.alive() or time.monotonic() > deadline:
                raise ConfigError(f"etcd on {host.name} not healthy: {result.stderr.strip()}; "
                                  f"log:\n{child.log_tail()}")
            time.sleep(0.2)

    def _spawn_daemon(self, host: Host) -> _Child:
        settings = {
            "node_id": f"node-{host.name}", "log_level": "INFO",
            "server.host": host.address, "server.grpc_port": str(GRPC_PORT),
            "server.tcp_port": str(TCP_PORT), "security.insecure": "true",
            "server.shm_channel": "false", "server.ucx": "disabled",
            "server.max_connections": str(MAX_CONNECTIONS),
            "server.header_timeout_s": str(HEADER_TIMEOUT_S),
            "server.idle_timeout_s": str(IDLE_TIMEOUT_S),
            "dram.capacity_bytes": "32MiB", "dram.read_index": "false",
            "nvme.directory": str(self.nvme_dir(host)),
            "nvme.capacity_bytes": "256MiB", "nvme.segment_bytes": "8MiB",
            "cache.write_tier": "nvme",
            "etcd.endpoint": self.etcd_endpoints(host), "etcd.prefix": PREFIX,
            "etcd.ttl_s": str(LEASE_TTL_S), "shutdown.drain_timeout_s": "2",
        }
        if host is self.lab.hosts[FAULTED_HOST]:
            if Need.SMALL_NVME in self.needs:
                settings["nvme.capacity_bytes"] = str(SMALL_NVME_BUDGET_BYTES)
                settings["nvme.segment_bytes"] = "1MiB"  # a new one every ~1 s of load
            if Need.SHM in self.needs:
                settings["server.shm_channel"] = "true"
            if Need.UCX in self.needs:
                settings["server.ucx"] = "required"
                settings["server.ucx_io_timeout_s"] = str(UCX_IO_TIMEOUT_S)
        argv = [sys.executable, "-m", "kvstore.cli.main", "daemon"]
        for key, value in settings.items():
            argv += ["--set", f"{key}={value}"]
        log_path = self.work_dir / f"daemon-{host.name}.log"
        with log_path.open("a") as log:
            proc = self.lab.popen(host, argv, stdout=subprocess.PIPE, stderr=log, text=True,
                                  cwd=REPO, env=_env())
        return _Child(proc, f"daemon-{host.name}", log_path)

    def kill_daemon(self, host: Host) -> float:
        """``kill -9`` of ``host``'s daemon; the monotonic time of the signal."""
        child = self.daemons[host.name]
        at = time.monotonic()
        child.kill()
        return at

    def restart_daemon(self, host: Host) -> float:
        """Start ``host``'s daemon again on the same NVMe directory; the time it is ready."""
        child = self._spawn_daemon(host)
        self.daemons[host.name] = child
        child.wait_line(DAEMON_READY, self.spec.start_timeout_s)
        return time.monotonic()

    def spawn_tool(self, host: Host, args: list[str], name: str) -> _Child:
        """``python -m bench.chaos ARGS`` in ``host``'s namespace, stdin a pipe."""
        log_path = self.work_dir / f"{name}.log"
        with log_path.open("a") as log:
            proc = self.lab.popen(host, [sys.executable, "-m", "bench.chaos", *args],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                  text=True, cwd=REPO, env=_env())
        return _Child(proc, name, log_path)

    def start_loadgen(self, history_path: Path, watch: Host) -> _Child:
        """The load generator in the observer namespace, watching membership through
        ``watch``'s etcd member; returns once it sees every node."""
        config = {"etcd": self.etcd_endpoint(watch), "prefix": PREFIX,
                  "nodes": self.node_ids, "history": str(history_path),
                  "workers": self.spec.workers, "value_bytes": self.spec.value_bytes,
                  "op_pause_s": self.spec.op_pause_s,
                  "conductors": self.conductor_addresses,
                  "engines": self.engine_addresses(),
                  "prompts": prompts_for(self.spec.engines)}
        config_path = self.work_dir / "loadgen.json"
        config_path.write_text(json.dumps(config))
        log_path = self.work_dir / "loadgen.log"
        with log_path.open("a") as log:
            proc = self.lab.popen(self.lab.observer,
                                  [sys.executable, "-m", "bench.chaos", "loadgen",
                                   str(config_path)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                  text=True, cwd=REPO, env=_env())
        child = _Child(proc, "loadgen", log_path)
        child.wait_line(LOADGEN_READY, self.spec.start_timeout_s)
        return child


# --- faults ---------------------------------------------------------------------------------


@dataclass
class _Injected:
    fault: Fault
    restarts: list[Restart] = field(default_factory=list)
    healthy_at: float | None = None
    """When every etcd member answered healthy again (etcd faults)."""
    damaged: list[tuple[str, str]] = field(default_factory=list)
    corrupt_reported: int = 0
    """Chunks the damaged daemon counted corrupt before it was killed."""
    leaks: dict[str, int] = field(default_factory=dict)
    """What the faulted daemon still held after the fault, beyond what it held before it
    (:func:`_leaks`): every value's goal is 0."""
    notes: list[str] = field(default_factory=list)
    """What the fault did and saw, for the report."""
    violations: list[str] = field(default_factory=list)
    """Broken goals only the fault can see (a slowloris connection not dropped in time, a
    flood that took the daemon past its bound)."""
    detect_s: float | None = None
    recover_s: float | None = None
    """Set by faults whose detect/recover are not membership events (seconds from start)."""
    served_after: float | None = None
    """The faulted node must answer a data request started after this and before the fault's
    end (a flood must not keep a client that arrives during it out)."""
    must_serve_gets: bool = False
    """The faulted node must answer gets during the fault (a full disk leaves DRAM and the
    stored chunks readable)."""
    paused_leader: bool = False
    """An etcd fault paused the member that led (the row says which leases ended at its
    resume: etcd 3.4 revokes them, docs/etcd-failover.md)."""
    cut_off: str = ""
    """The node whose host the fault cut off the network (its engine cannot be reached: its
    requests may fail); every other engine must answer every request, recomputing what the
    store cannot give it."""
    detect_error: str = ""
    """Detect at the first request that failed with this error class, recover at the first
    put on the node that succeeded after the fault (a fault the node answers with an error,
    not by leaving)."""


def _kill_daemon(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    down = cluster.kill_daemon(host)
    time.sleep(cluster.spec.down_s)
    up = cluster.restart_daemon(host)
    return _Injected(Fault("kill-daemon", f"node-{host.name}", down, up),
                     [Restart(f"node-{host.name}", down, up)])


def _stop_daemon(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    child = cluster.daemons[host.name]
    start = time.monotonic()
    child.proc.send_signal(signal.SIGSTOP)  # the daemon itself: setpriv and ip exec'd it
    time.sleep(cluster.spec.down_s)
    child.proc.send_signal(signal.SIGCONT)
    return _Injected(Fault("sigstop-daemon", f"node-{host.name}", start, time.monotonic()))


def _partition_host(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    start = time.monotonic()
    cluster.lab.partition(host)
    # Longer than the others: if the host held etcd's leadership, the majority first elects a
    # new leader (which extends every lease by its TTL) before the host's lease can expire.
    time.sleep(cluster.spec.down_s + 2 * LEASE_TTL_S)
    cluster.lab.heal(host)
    return _Injected(Fault("partition-host", f"node-{host.name}", start, time.monotonic()),
                     cut_off=f"node-{host.name}")


def _kill_conductor(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """``kill -9`` of the leading conductor; restarted (as a standby) after ``down_s``."""
    start = time.monotonic()
    cluster.conductors[host.name].kill()
    time.sleep(cluster.spec.down_s)
    cluster.conductors[host.name] = cluster._spawn_conductor(host)
    cluster._wait_conductor(host)
    return _Injected(Fault("kill-conductor-leader", f"conductor-{host.name}", start,
                           time.monotonic()))


def _stop_conductor(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """SIGSTOP of the leading conductor past its election TTL (a standby takes over), then
    SIGCONT: the woken one must not decide in its old term."""
    child = cluster.conductors[host.name]
    start = time.monotonic()
    child.proc.send_signal(signal.SIGSTOP)
    time.sleep(cluster.spec.down_s)
    child.proc.send_signal(signal.SIGCONT)
    return _Injected(Fault("sigstop-conductor-leader", f"conductor-{host.name}", start,
                           time.monotonic()))


def load_key(key: bytes) -> bool:
    """Whether a stored chunk's key is one of the load's (printable ASCII, as ``w0/17``), not
    an engine's (a binary namespace prefix and block hash, :mod:`kvstore.keys`): the faults
    that damage chunks on disk report the load's, which the history can check; an engine
    must survive losing its own (it recomputes)."""
    return bool(key) and all(0x21 <= b <= 0x7E for b in key)


def flip_payload_bytes(directory: Path, count: int) -> list[str]:
    """Flip one byte in the middle of the payload of ``count`` LIVE records of the load's
    (:func:`load_key`) in the NVMe segment files in ``directory``, durably; return their keys.
    The oldest record (read before, so likely promoted to DRAM; past the 64 newest a restart
    verifies, once enough were written) and the ``count - 1`` newest (likely never read: on
    NVMe only; verified at a restart). Walks the header chain as a scan does."""
    from kvstore.dataplane.nvme.format import (
        HEADER_BYTES,
        RecordKind,
        decode_record_header,
        decode_segment_header,
    )

    found = []
    for path in sorted(directory.glob("seg-*.kvt")):
        with path.open("rb") as f:
            segment = decode_segment_header(f.read(HEADER_BYTES))
            if segment is None:
                continue
            pos = HEADER_BYTES
            while pos < segment.segment_bytes:
                f.seek(pos)
                _, header = decode_record_header(f.read(HEADER_BYTES),
                                                 segment_id=segment.segment_id, offset=pos,
                                                 segment_bytes=segment.segment_bytes)
                if header is None:
                    break
                if header.kind is RecordKind.LIVE and load_key(header.key):
                    found.append((path, header))
                pos = header.end
    found.sort(key=lambda item: item[1].seq)
    chosen = (found[:1] + found[len(found) - (count - 1):]) if len(found) > count else found
    for path, header in chosen:
        at = header.offset + HEADER_BYTES + header.payload_bytes // 2
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([byte[0] ^ 0x5A]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
    return [header.key.decode() for _, header in chosen]


def _corrupt_segment(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """Bytes flipped in three stored chunks of a running daemon; the load empties the node's
    DRAM and reads them at once (the daemon must notice, drop and count them), then the
    daemon is killed and restarted on the damaged directory (and the load's read-back reads
    them again)."""
    node = f"node-{host.name}"
    start = time.monotonic()
    keys = flip_payload_bytes(cluster.work_dir / f"nvme-{host.name}", 3)
    if not keys:
        raise ConfigError(f"no stored chunk on {node} to corrupt")
    assert load.proc.stdin is not None
    load.proc.stdin.write(f"read {node} {' '.join(keys)}\n")
    load.proc.stdin.flush()
    answer = json.loads(load.wait_line(LOADGEN_READ, 30.0))
    down = cluster.kill_daemon(host)
    time.sleep(cluster.spec.down_s)
    up = cluster.restart_daemon(host)
    return _Injected(Fault("corrupt-segment", node, start, up), [Restart(node, down, up)],
                     damaged=[(node, k) for k in keys],
                     corrupt_reported=max(int(answer["corrupt"]), 0))


def _ask(load: _Child, command: str, answer: str, timeout_s: float = 30.0) -> Any:
    """Send the load generator ``command``; its JSON answer on the ``answer`` line."""
    assert load.proc.stdin is not None
    load.proc.stdin.write(command + "\n")
    load.proc.stdin.flush()
    return json.loads(load.wait_line(answer, timeout_s))


def fd_counts(pid: int) -> dict[str, int]:
    """A process's open file descriptors by kind (``/proc/<pid>/fd``): sockets, NVMe segment
    files, the rest. A descriptor closed while it is read is skipped."""
    counts = {"sockets": 0, "segments": 0, "other": 0}
    fd_dir = Path(f"/proc/{pid}/fd")
    for entry in fd_dir.iterdir():
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:"):
            counts["sockets"] += 1
        elif Path(target).name.startswith("seg-"):
            counts["segments"] += 1
        else:
            counts["other"] += 1
    return counts


def rss_bytes(pid: int) -> int:
    """A process's resident memory (``VmRSS`` of ``/proc/<pid>/status``); 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _leaks(before: dict[str, int], after: dict[str, int], fds_before: dict[str, int],
           fds_after: dict[str, int]) -> dict[str, int]:
    """What a daemon holds after a fault beyond what it held before: lease-channel leases,
    data connections, UCX endpoints, DRAM bytes still pinned or reserved once its DRAM was
    emptied, socket and other (not segment-file) descriptors. A probe that got no answer (-1)
    is one leak."""
    if -1 in after.values():
        return {"no_answer": 1}
    return {"shm_leases": max(0, after["shm_leases_open"] - max(before["shm_leases_open"], 0)),
            "tcp_connections": max(0, after["tcp_connections_open"]
                                   - max(before["tcp_connections_open"], 0)),
            "ucx_endpoints": max(0, after["ucx_endpoints_open"]
                                 - max(before["ucx_endpoints_open"], 0)),
            "dram_bytes_held": max(0, after["dram_used_bytes"]
                                   - max(before["dram_used_bytes"], 0)),
            "sockets": max(0, fds_after["sockets"] - fds_before["sockets"]),
            "other_fds": max(0, fds_after["other"] - fds_before["other"])}


def _settle(load: _Child, node: str, pid: int, before: dict[str, int],
            fds_before: dict[str, int], timeout_s: float = RELEASE_TIMEOUT_S
            ) -> tuple[dict[str, int], float]:
    """Probe ``node`` until it holds nothing beyond ``before`` (or ``timeout_s`` passes): its
    leaks and when they were last measured."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = _ask(load, f"probe {node}", LOADGEN_PROBE)
        leaks = _leaks(before, after, fds_before, fd_counts(pid))
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks, time.monotonic()
        time.sleep(0.2)


def _kill_client(plane: str) -> Callable[[ChaosCluster, Host, _Child], _Injected]:
    """A client in ``host``'s namespace on the ``plane`` data plane, holding transfers open
    (:func:`_client_main`) while its loops put and get, is killed with SIGKILL at a random
    moment; the daemon must end what it held for it: its leases, pinned chunks, reserved
    extents, connections and descriptors, counted before and after (:func:`_leaks`).
    recover: the kill to the first probe that finds nothing held."""
    name = f"kill-client-{plane}"

    def inject(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
        node = f"node-{host.name}"
        pid = cluster.daemons[host.name].proc.pid
        before = _ask(load, f"probe {node}", LOADGEN_PROBE)
        fds_before = fd_counts(pid)
        start = time.monotonic()
        client = cluster.spawn_tool(host, ["client", f"{host.address}:{GRPC_PORT}", plane, "2"],
                                    name)
        said = json.loads(client.wait_line(CLIENT_READY, cluster.spec.start_timeout_s))
        holding = _ask(load, f"probe {node}", LOADGEN_PROBE)
        time.sleep(random.uniform(0.05, 0.5))
        client.kill()
        killed = time.monotonic()
        leaks, settled = _settle(load, node, pid, before, fds_before, RELEASE_TIMEOUT_S
                                 + (UCX_IO_TIMEOUT_S if plane == "ucx" else 0.0))
        notes = [f"held at the kill: {', '.join(said['holds']) or 'loops only'}; the daemon "
                 f"counted {holding['shm_leases_open']} lease-channel leases, "
                 f"{holding['tcp_connections_open'] - before['tcp_connections_open']} more "
                 f"data connections, {holding['dram_used_bytes']} DRAM bytes it could not "
                 f"evict; released {settled - killed:.2f} s after the kill"]
        violations = []
        if said["holds"] and holding["dram_used_bytes"] <= before["dram_used_bytes"]:
            violations.append(f"{name}: the client said it held {said['holds']} but the daemon "
                              "held no DRAM for it (the fault did not hit mid-transfer)")
        return _Injected(Fault(name, node, start, settled), leaks=leaks, notes=notes,
                         violations=violations, recover_s=settled - killed)

    return inject


def truncate_segment(directory: Path, count: int, oldest: bool = False) -> list[str]:
    """Cut the segment file holding the newest LIVE record of ``directory`` (``oldest``: the
    one holding the oldest) in the middle of the payload of its ``count``-th record from the
    end, or of the load's newest record there when that cut would reach only engines'
    chunks (vLLM's 64 KiB chunks, saved several a request, fill a file's tail: the first
    ``--engines vllm`` run of the fault found none of the load's to cut), durably; return the
    keys of every record of the load's (:func:`load_key`) the cut reaches (torn or gone). An
    engine's chunks the cut reaches are gone too, unreported."""
    from kvstore.dataplane.nvme.directio import ALIGN_BYTES
    from kvstore.dataplane.nvme.format import (
        HEADER_BYTES,
        RecordKind,
        decode_record_header,
        decode_segment_header,
    )

    per_file: dict[Path, list[Any]] = {}
    for path in sorted(directory.glob("seg-*.kvt")):
        with path.open("rb") as f:
            segment = decode_segment_header(f.read(HEADER_BYTES))
            if segment is None:
                continue
            pos, end = HEADER_BYTES, min(segment.segment_bytes, os.fstat(f.fileno()).st_size)
            while pos < end:
                f.seek(pos)
                _, header = decode_record_header(f.read(HEADER_BYTES),
                                                 segment_id=segment.segment_id, offset=pos,
                                                 segment_bytes=segment.segment_bytes)
                if header is None:  # a hole (an earlier cut): look at the next block, as
                    pos += ALIGN_BYTES  # the tier's scan resyncs, so no record past it is
                    continue  # missed (a record cut again would go unrecorded)
                if header.kind is RecordKind.LIVE:
                    per_file.setdefault(path, []).append(header)
                pos = header.end
    if not per_file:
        return []
    pick = min if oldest else max
    path = pick(per_file, key=lambda p: pick(h.seq for h in per_file[p]))
    records = sorted(per_file[path], key=lambda h: h.offset)
    victim = records[-min(count, len(records))]
    ours = [h for h in records if load_key(h.key)]
    if ours and ours[-1].offset < victim.offset:  # past the cut only engines' chunks
        victim = ours[-1]
    cut = victim.offset + HEADER_BYTES + victim.payload_bytes // 2
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, cut)
        os.fsync(fd)
    finally:
        os.close(fd)
    return [h.key.decode() for h in records if h.end > cut and load_key(h.key)]


def _truncate_segment(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """The segment file a running daemon writes into cut in the middle of its third-newest
    record (the daemon paused for the few ms of the cut, so no write races it; its later
    writes land past the cut, leaving a hole); the load empties the node's DRAM and reads
    the cut chunks at once (dropped, counted, never returned); then ``kill -9``, the oldest
    segment cut too while it is down, and a restart on the truncated files."""
    node = f"node-{host.name}"
    daemon = cluster.daemons[host.name]
    start = time.monotonic()
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        keys = truncate_segment(cluster.nvme_dir(host), 3)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    if not keys:
        raise ConfigError(f"no stored chunk on {node} to cut")
    answer = _ask(load, f"read {node} {' '.join(keys)}", LOADGEN_READ)
    down = cluster.kill_daemon(host)
    more = truncate_segment(cluster.nvme_dir(host), 2, oldest=True)
    time.sleep(cluster.spec.down_s)
    up = cluster.restart_daemon(host)
    returned = sum(1 for v in answer["results"].values() if v == Result.OK.value)
    notes = [f"cut under the running daemon: {len(keys)} chunks, read at once: "
             f"{returned} returned bytes; cut while it was down: {len(more)} chunks"]
    return _Injected(Fault("truncate-segment", node, start, up), [Restart(node, down, up)],
                     damaged=[(node, k) for k in [*keys, *more]],
                     corrupt_reported=max(int(answer["corrupt"]), 0), notes=notes)


def _fill_nvme(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """``host``'s NVMe filesystem (a small tmpfs, :attr:`Need.SMALL_NVME`) filled by another
    file while the load writes (every put is durable: it must fail with ``DiskFull``, not be
    acknowledged and lost); after ``down_s`` the file is removed (puts must succeed again),
    then ``kill -9`` and a restart: every chunk acknowledged, also while the disk was full,
    must be there."""
    node = f"node-{host.name}"
    filler = cluster.small_fs(host) / "filler"
    start = time.monotonic()
    block = bytes(1 << 20)
    with filler.open("wb", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: full
        while True:
            f.write(block)
    free = shutil.disk_usage(cluster.small_fs(host)).free
    time.sleep(cluster.spec.down_s)
    filler.unlink()
    end = time.monotonic()
    time.sleep(1.0)  # puts on the node again before the kill
    down = cluster.kill_daemon(host)
    time.sleep(LEASE_TTL_S + 0.5)
    up = cluster.restart_daemon(host)
    return _Injected(Fault("nvme-full", node, start, end), [Restart(node, down, up)],
                     must_serve_gets=True,
                     notes=[f"filesystem filled ({free} bytes left) for {end - start:.1f} s"],
                     detect_error="DiskFull")


def _flood(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """Twice ``MAX_CONNECTIONS`` connections to ``host``'s data plane (silent) and
    ``GRPC_FLOOD_CONNECTIONS`` to its gRPC port (HTTP/2 preface, then idle), from the
    observer, held for ``down_s``;
    the load sends the node nothing while the flood connects (so the flood takes every slot),
    then loads it again over new connections: it must be served before the flood ends (silent
    connections are dropped after ``HEADER_TIMEOUT_S``). The data plane must refuse what
    exceeds its bound; the daemon's descriptors must stay bounded and come back when the
    flood ends. detect: from the load's return to its first answer from the node."""
    node = f"node-{host.name}"
    pid = cluster.daemons[host.name].proc.pid
    count = 2 * MAX_CONNECTIONS
    before = _ask(load, f"probe {node}", LOADGEN_PROBE)
    fds_before = fd_counts(pid)
    start = time.monotonic()
    assert load.proc.stdin is not None
    load.proc.stdin.write(f"quiet {node}\n")  # the flood takes every slot, the load's too
    load.proc.stdin.flush()
    flood = cluster.spawn_tool(cluster.lab.observer, ["flood", host.address, str(TCP_PORT),
                                                      str(GRPC_PORT), str(count),
                                                      str(GRPC_FLOOD_CONNECTIONS)], "flood")
    ready = json.loads(flood.wait_line(FLOOD_READY, 60.0))
    load.proc.stdin.write(f"loud {node}\n")  # a well-behaved client arrives: it must get in
    load.proc.stdin.flush()
    loud = time.monotonic()
    peak = dict(fds_before)
    rss_before = rss_peak = rss_bytes(pid)
    deadline = time.monotonic() + cluster.spec.down_s
    while time.monotonic() < deadline:
        now = fd_counts(pid)
        peak = {k: max(v, now[k]) for k, v in peak.items()}
        rss_peak = max(rss_peak, rss_bytes(pid))
        time.sleep(0.2)
    assert flood.proc.stdin is not None
    flood.proc.stdin.write("stop\n")
    flood.proc.stdin.flush()
    flood.wait_line(FLOOD_DONE, 30.0)
    end = time.monotonic()
    leaks, settled = _settle(load, node, pid, before, fds_before)
    violations = []
    for plane in ("tcp", "grpc"):
        if ready[f"{plane}_open"] > MAX_CONNECTIONS:
            violations.append(f"flood: {ready[f'{plane}_open']} {plane} connections served at "
                              f"once (bound {MAX_CONNECTIONS})")
    bound = fds_before["sockets"] + 2 * MAX_CONNECTIONS + 8  # each listener's bound + slack
    if peak["sockets"] > bound:
        violations.append(f"flood: the daemon held {peak['sockets']} sockets (bound {bound})")
    notes = [f"flood: {ready['tcp_connected']} data connections made, {ready['tcp_open']} "
             f"served (bound {MAX_CONNECTIONS}), {ready['grpc_connected']} gRPC ones, "
             f"{ready['grpc_open']} served; daemon "
             f"sockets {fds_before['sockets']} before, {peak['sockets']} at most, RSS "
             f"{rss_before >> 20} MiB before, {rss_peak >> 20} MiB at most (bound "
             f"{bound} sockets: each listener's {MAX_CONNECTIONS}); counts back "
             f"{settled - end:.2f} s after"]
    return _Injected(Fault("flood-connections", node, start, end), leaks=leaks, notes=notes,
                     violations=violations, served_after=loud)




def _slowloris(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
    """``SLOWLORIS_CONNECTIONS`` connections to each of ``host``'s ports that send half a
    frame (half a data-plane header; half the HTTP/2 preface) and stall, from the observer,
    while the load runs. The data plane must drop each within ``HEADER_TIMEOUT_S`` + 1 s,
    gRPC within ``GRPC_HANDSHAKE_BOUND_S`` (checked when the run waits that long:
    ``ChaosSpec.slowloris_wait_s``); the load must not notice (its own invariants)."""
    node = f"node-{host.name}"
    wait_s = max(cluster.spec.slowloris_wait_s, HEADER_TIMEOUT_S + TIMEOUT_SLACK_S + 1.0)
    start = time.monotonic()
    slow = cluster.spawn_tool(cluster.lab.observer,
                              ["slowloris", host.address, str(TCP_PORT), str(GRPC_PORT),
                               str(SLOWLORIS_CONNECTIONS), str(wait_s)], "slowloris")
    slow.wait_line(FLOOD_READY, 60.0)
    done = json.loads(slow.wait_line(FLOOD_DONE, wait_s + 30.0))
    end = time.monotonic()
    violations = []
    tcp, grpc_ = done["tcp"], done["grpc"]
    if tcp["open"] or (tcp["max_drop_s"] or 0) > HEADER_TIMEOUT_S + TIMEOUT_SLACK_S:
        violations.append(f"slowloris: data plane: {tcp['open']} connections still open after "
                          f"{wait_s:.1f} s, the slowest dropped after {tcp['max_drop_s']} s "
                          f"(bound {HEADER_TIMEOUT_S} s + {TIMEOUT_SLACK_S} s)")
    if wait_s >= GRPC_HANDSHAKE_BOUND_S and (
            grpc_["open"] or (grpc_["max_drop_s"] or 0) > GRPC_HANDSHAKE_BOUND_S):
        violations.append(f"slowloris: gRPC: {grpc_['open']} connections still open after "
                          f"{wait_s:.1f} s, the slowest dropped after {grpc_['max_drop_s']} s "
                          f"(bound {GRPC_HANDSHAKE_BOUND_S} s)")
    notes = [f"slowloris: data plane {tcp['dropped']}/{SLOWLORIS_CONNECTIONS} dropped, the "
             f"slowest after {_fmt_s(tcp['max_drop_s'])} s; gRPC {grpc_['dropped']}/"
             f"{SLOWLORIS_CONNECTIONS} dropped within {wait_s:.1f} s (slowest "
             f"{_fmt_s(grpc_['max_drop_s'])} s)"]
    return _Injected(Fault("slowloris", node, start, end), notes=notes, violations=violations,
                     detect_s=tcp["max_drop_s"])


def _stop_etcd(name: str, count: int) -> Callable[[ChaosCluster, Host, _Child], _Injected]:
    """SIGSTOP of ``count`` etcd members from ``host`` on (wrapping), for ``down_s`` + one
    lease TTL, then SIGCONT; healthy when every member answers again."""

    def inject(cluster: ChaosCluster, host: Host, load: _Child) -> _Injected:
        hosts = cluster.lab.hosts
        first = hosts.index(host)
        members = [hosts[(first + i) % len(hosts)] for i in range(count)]
        notes = []
        leader = cluster.etcd_leader()
        if name == "sigstop-etcd-member" and leader is host:
            # A follower's pause is this fault; the leader's is sigstop-etcd-leader (which
            # etcd 3.4 answers by revoking every lease when the leader resumes).
            leader = cluster.move_etcd_leader(host)
            notes.append(f"etcd's leadership moved from {host.name} to {leader.name} first")
        notes.append(f"etcd leader when paused: {leader.name}")
        start = time.monotonic()
        for h in members:
            cluster.etcd[h.name].proc.send_signal(signal.SIGSTOP)
        time.sleep(cluster.spec.down_s + LEASE_TTL_S)
        for h in members:
            cluster.etcd[h.name].proc.send_signal(signal.SIGCONT)
        end = time.monotonic()
        for h in hosts:
            cluster.wait_etcd(h)
        fault = Fault(name, "+".join(f"etcd-{h.name}" for h in members), start, end)
        return _Injected(fault, healthy_at=time.monotonic(), notes=notes,
                         paused_leader=leader in members)

    return inject


@dataclass(frozen=True)
class FaultPlan:
    """Which host a fault hits (chosen once the cluster is up) and how it is injected."""

    target: Callable[[ChaosCluster], Host]
    inject: Callable[[ChaosCluster, Host, _Child], _Injected]
    """Called with the cluster, the target and the running load generator."""
    needs: frozenset[Need] = frozenset()
    skip: Callable[[], str | None] = lambda: None
    """Why the fault cannot run here (None: it can)."""


def _ucx_missing() -> str | None:
    try:
        import ucxx  # noqa: F401
    except ImportError as exc:
        return f"ucxx does not import ({exc}): no UCX data plane to kill a client on"
    return None


def _faulted_host(cluster: ChaosCluster) -> Host:
    return cluster.lab.hosts[FAULTED_HOST]


FAULTS: dict[str, FaultPlan] = {
    "kill-daemon": FaultPlan(_faulted_host, _kill_daemon),
    "sigstop-daemon": FaultPlan(_faulted_host, _stop_daemon),
    "partition-host": FaultPlan(_faulted_host, _partition_host),
    "sigstop-etcd-member": FaultPlan(lambda c: c.etcd_follower(),
                                     _stop_etcd("sigstop-etcd-member", 1)),
    "sigstop-etcd-leader": FaultPlan(lambda c: c.etcd_leader(),
                                     _stop_etcd("sigstop-etcd-leader", 1)),
    "etcd-quorum-loss": FaultPlan(_faulted_host, _stop_etcd("etcd-quorum-loss", 2)),
    "corrupt-segment": FaultPlan(_faulted_host, _corrupt_segment),
    "truncate-segment": FaultPlan(_faulted_host, _truncate_segment),
    "nvme-full": FaultPlan(_faulted_host, _fill_nvme, frozenset({Need.SMALL_NVME})),
    "kill-client-shm": FaultPlan(_faulted_host, _kill_client("shm"), frozenset({Need.SHM})),
    "kill-client-tcp": FaultPlan(_faulted_host, _kill_client("tcp")),
    "kill-client-ucx": FaultPlan(_faulted_host, _kill_client("ucx"), frozenset({Need.UCX}),
                                 _ucx_missing),
    "flood-connections": FaultPlan(_faulted_host, _flood),
    "slowloris": FaultPlan(_faulted_host, _slowloris),
    "kill-conductor-leader": FaultPlan(lambda c: c.conductor_leader(), _kill_conductor),
    "sigstop-conductor-leader": FaultPlan(lambda c: c.conductor_leader(), _stop_conductor),
}
"""Every fault on ``h1`` but the leaders' (the etcd member or conductor that leads when the
load starts) and the etcd follower's (``h1``'s member unless it leads); the quorum loss stops
``h1``'s and ``h2``'s members."""


def run_fault(name: str, *, spec: ChaosSpec | None = None,
              work_dir: Path | None = None) -> FaultRow:
    """Build the cluster, run the load, inject fault ``name`` once, check the history."""
    if name not in FAULTS:
        raise ConfigError(f"unknown fault {name!r} (known: {', '.join(FAULTS)})")
    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(f"the fault suite needs network namespaces: {reason}")
    spec = spec or ChaosSpec()
    why_not = FAULTS[name].skip()
    if why_not is not None:
        return FaultRow(name, 0, 0, 0, 0, 0, 0, None, None, 0, skipped=why_not)
    expected = (no_cache_outputs(engine_prompts()) if spec.engines is Engines.REFERENCE
                else {})
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="kvtier-chaos-")))
        work_dir.mkdir(parents=True, exist_ok=True)
        plan = FAULTS[name]
        cluster = stack.enter_context(ChaosCluster(work_dir, spec, plan.needs))
        expected = cluster.vllm_expected or expected  # vLLM's: computed by the servers
        history_path = work_dir / "history.jsonl"
        target = plan.target(cluster)
        # The load watches membership through a member the fault leaves alone (the quorum
        # loss stops the target's and the next host's: the one before them stays).
        watch = cluster.lab.hosts[(cluster.lab.hosts.index(target) - 1) % 3]
        load = cluster.start_loadgen(history_path, watch)
        time.sleep(spec.warmup_s)
        terms = len(load.seen(LOADGEN_DECIDED))
        injected = plan.inject(cluster, target, load)
        _await_rejoin(load)
        _await_new_term(load, injected, terms)
        time.sleep(spec.after_s)
        summary = _stop_load(load)
        _append_injected(history_path, injected)
        _append_expected(history_path, expected)
        history = read_history(history_path)
        violations = check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                           engine_timeout_s=ENGINE_TIMEOUT_S)
        row = _finish_row(_row(history, injected, summary, violations), history, injected,
                          summary)
        if cluster.vllm_start_s:
            row.notes.append("vllm serve healthy after " + ", ".join(
                f"{n} {s:.0f} s" for n, s in sorted(cluster.vllm_start_s.items())))
        return row


def _await_rejoin(load: _Child) -> None:
    """Recovery is measured, not assumed: wait (at most ``REJOIN_TIMEOUT_S``) until every node
    the load saw leave is back."""
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    while time.monotonic() < deadline and load.alive():
        left, back = load.seen(LOADGEN_LEFT), load.seen(LOADGEN_REJOINED)
        if all(left.count(n) <= back.count(n) for n in left):
            break
        time.sleep(0.1)


def _await_new_term(load: _Child, injected: _Injected, terms_before: int) -> None:
    """After a conductor fault, wait (at most ``REJOIN_TIMEOUT_S``) until a conductor decided
    in a new term, so that ``after_s`` of load follow the takeover whatever it took: since the
    takeover fence (one election TTL after a term that ended without a resignation) the first
    decision comes ~4 s after a SIGSTOP at best, past a 3.5 s fault plus 2 s of load on a
    loaded box (the flaky ``sigstop-conductor-leader`` case: docs/chaos.md)."""
    if not injected.fault.node.startswith("conductor-"):
        return
    deadline = time.monotonic() + REJOIN_TIMEOUT_S
    while time.monotonic() < deadline and load.alive() \
            and len(load.seen(LOADGEN_DECIDED)) <= terms_before:
        time.sleep(0.1)


def _stop_load(load: _Child) -> dict[str, Any]:
    """Stop the load (it reads everything back, closes, counts leaks); its summary."""
    assert load.proc.stdin is not None
    load.proc.stdin.write("stop\n")
    load.proc.stdin.flush()
    summary: dict[str, Any] = json.loads(load.wait_line(LOADGEN_DONE, 300.0))
    return summary


def _append_injected(history_path: Path, injected: _Injected) -> None:
    """The fault's own records after the load's, so the whole history is one file."""
    with history_path.open("a") as f:
        f.write(json.dumps({"kind": "fault", **asdict(injected.fault)}) + "\n")
        for restart in injected.restarts:
            f.write(json.dumps({"kind": "restart", **asdict(restart)}) + "\n")
        for node, key in injected.damaged:
            f.write(json.dumps({"kind": "damage", "node": node, "key": key}) + "\n")


def _append_expected(history_path: Path, expected: dict[str, str]) -> None:
    """The engines' prompts' no-cache outputs (:func:`no_cache_outputs`) into the history."""
    with history_path.open("a") as f:
        for key, tokens in sorted(expected.items()):
            f.write(json.dumps({"kind": "engine_expected", "key": key, "digest": tokens})
                    + "\n")


def _finish_row(row: FaultRow, history: History, injected: _Injected,
                summary: dict[str, Any]) -> FaultRow:
    row.records = len(history.records)
    row.decisions = int(summary.get("decisions", 0))
    row.damaged = len(injected.damaged)
    row.corrupt_reported = injected.corrupt_reported + int(
        summary.get("corrupt", {}).get(injected.fault.node, 0))
    row.last_answer_s = {k: float(v) for k, v in summary.get("last_answer", {}).items()}
    row.schedule_errors = list(summary.get("schedule_errors", []))
    return row


SOAK_EXCLUDED: dict[str, str] = {}
"""Faults a soak does not draw, and why (``--fault`` can still name them). ``nvme-full`` was
one until the load recorded the daemons' REMOVED events: its 48 MiB tmpfs fills with the
load's own chunks within minutes, and the tier then evicts acknowledged chunks (as it should
at its budget), which the durable rule could not tell from a loss."""


@dataclass
class SoakResult:
    minutes: float
    seed: int
    rows: list[FaultRow]
    violations: list[str]
    """Every broken invariant of the whole history (also those the rows count)."""
    leaks: dict[str, dict[str, int]]
    """What every daemon still held at the end, after the load closed its clients."""
    records: int = 0
    decisions: int = 0
    skipped: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.violations and all(r.clean for r in self.rows) and not any(
            n for per_node in self.leaks.values() for n in per_node.values())


def run_soak(minutes: float, *, spec: ChaosSpec | None = None, faults: list[str] | None = None,
             work_dir: Path | None = None, seed: int | None = None) -> SoakResult:
    """Faults drawn at random (from ``faults``, default: every one that can run here but
    ``SOAK_EXCLUDED``) and injected one at a time into one cluster under one load for
    ``minutes``, each removed and recovered from (every node back in the membership, then
    ``after_s`` of load) before the next; the whole history checked at the end. A fault that
    would stop the etcd member the load watches through is drawn again."""
    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(f"the fault suite needs network namespaces: {reason}")
    if not minutes > 0:
        raise ConfigError(f"--soak needs minutes > 0, got {minutes}")
    spec = spec or ChaosSpec()
    names = [n for n in (faults or [f for f in FAULTS if f not in SOAK_EXCLUDED])]
    skipped = [f"{n}: {FAULTS[n].skip()}" for n in names if FAULTS[n].skip() is not None]
    names = [n for n in names if FAULTS[n].skip() is None]
    if not names:
        raise ConfigError("no fault to draw from")
    seed = secrets_seed() if seed is None else seed
    rng = random.Random(seed)
    needs = frozenset(need for n in names for need in FAULTS[n].needs)
    expected = (no_cache_outputs(engine_prompts()) if spec.engines is Engines.REFERENCE
                else {})
    with contextlib.ExitStack() as stack:
        if work_dir is None:
            work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="kvtier-soak-")))
        work_dir.mkdir(parents=True, exist_ok=True)
        cluster = stack.enter_context(ChaosCluster(work_dir, spec, needs))
        expected = cluster.vllm_expected or expected
        history_path = work_dir / "history.jsonl"
        watch = cluster.lab.hosts[0]  # no fault stops h0's member (etcd-leader: redrawn)
        load = cluster.start_loadgen(history_path, watch)
        time.sleep(spec.warmup_s)
        end = time.monotonic() + 60.0 * minutes
        injected: list[_Injected] = []
        while time.monotonic() < end and load.alive():
            name = rng.choice(names)
            plan = FAULTS[name]
            target = plan.target(cluster)
            if target is watch and name.startswith(("sigstop-etcd", "etcd-")):
                continue
            print(f"soak: {name} on {target.name}", file=sys.stderr, flush=True)
            terms = len(load.seen(LOADGEN_DECIDED))
            injected.append(plan.inject(cluster, target, load))
            _await_rejoin(load)
            _await_new_term(load, injected[-1], terms)
            time.sleep(spec.after_s)
        summary = _stop_load(load)
        for one in injected:
            _append_injected(history_path, one)
        _append_expected(history_path, expected)
        history = read_history(history_path)
    violations = check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                       engine_timeout_s=ENGINE_TIMEOUT_S)
    rows = []
    for i, one in enumerate(injected):  # each row counts the violations of its own stretch
        until = injected[i + 1].fault.start_s if i + 1 < len(injected) else math.inf
        since = one.fault.start_s if i else -math.inf
        mine = [v for v in violations if v.record is not None
                and since <= v.record.start_s < until]
        row = _row(history, one, {}, mine)
        rows.append(_finish_row(row, history, one, {}))
    return SoakResult(minutes, seed, rows,
                      [f"{v.invariant.value}: {v.message}" for v in violations],
                      summary.get("leaks", {}), len(history.records),
                      int(summary.get("decisions", 0)), skipped)


def secrets_seed() -> int:
    import secrets

    return secrets.randbelow(1 << 31)


def read_history(path: Path) -> History:
    """A run's history from its JSON lines (records, lease gaps, faults, restarts)."""
    history = History()
    for line in path.read_text().splitlines():
        item = json.loads(line)
        kind = item.pop("kind")
        if kind == "gap":
            history.lease_gaps.append(LeaseGap(**item))
        elif kind == "fault":
            history.faults.append(Fault(**item))
        elif kind == "restart":
            history.restarts.append(Restart(**item))
        elif kind == "damage":
            history.damaged.append((item["node"], item["key"]))
        elif kind == "removed":
            history.removed.append(Removal(**item))
        elif kind == "engine_expected":
            history.engine_expected[str(item["key"])] = str(item["digest"])
        else:
            history.records.append(Record.from_dict(item))
    return history


def _row(history: History, injected: _Injected, summary: dict[str, Any],
         violations: list[Violation]) -> FaultRow:
    """The row of one injected fault from the history and ``violations`` (those of this
    fault's run, or of its stretch of a soak)."""
    fault = injected.fault
    [stats] = fault_stats(History(records=history.records, faults=[fault]))

    def count(inv: Invariant) -> int:
        return sum(1 for v in violations if v.invariant is inv)

    # Lease gaps of this fault: expired inside its window (or just after: a lease outlives
    # the fault's end by up to its TTL), not a later fault's of a soak.
    gaps = [g for g in history.lease_gaps if g.node == fault.node
            and fault.start_s <= g.expired_s <= fault.end_s + LEASE_TTL_S + 1.0]
    left = [g.expired_s for g in gaps]
    detect = min(left) - fault.start_s if left else None
    rejoined = [g.renewed_s for g in gaps if g.renewed_s is not None]
    served = [r.end_s for r in history.records if r.node == fault.node
              and r.op in (Op.PUT, Op.GET) and r.result is Result.OK and r.end_s is not None
              and r.start_s >= fault.end_s]
    recover = (max(min(rejoined), min(served)) - fault.start_s) if rejoined and served else None
    if injected.healthy_at is not None:  # an etcd fault: until every member is healthy
        recover = injected.healthy_at - fault.start_s
    if fault.node.startswith("conductor-"):  # detect: a new term; recover: its first decision
        acts = [r for r in history.records if r.op is Op.LEASE and r.result is Result.OK]
        before = max((r.epoch for r in acts if r.start_s < fault.start_s), default=0)
        newer = [r for r in acts if r.epoch > before and r.start_s >= fault.start_s]
        detect = min(r.start_s for r in newer) - fault.start_s if newer else None
        decided = [r.end_s for r in newer if r.key != "leader" and r.end_s is not None]
        recover = min(decided) - fault.start_s if decided else None
    others = [f"{v.invariant.value}: {v.message}" for v in violations
              if v.invariant not in (Invariant.WRONG_READ, Invariant.DURABLE_LOST,
                                     Invariant.OVER_TIMEOUT)]
    leaks = sum(int(n) for per_node in summary.get("leaks", {}).values()
                for n in per_node.values()) + sum(injected.leaks.values())
    if injected.detect_error:
        refused = [r.start_s for r in history.records if r.node == fault.node
                   and r.result is Result.ERR and r.error.startswith(injected.detect_error)
                   and r.start_s >= fault.start_s]
        detect = min(refused) - fault.start_s if refused else None
        put_again = [r.end_s for r in history.records if r.node == fault.node
                     and r.op is Op.PUT and r.result is Result.OK and r.end_s is not None
                     and r.start_s >= fault.end_s]
        recover = min(put_again) - fault.start_s if put_again else None
    if injected.detect_s is not None:
        detect = injected.detect_s
    if injected.recover_s is not None:
        recover = injected.recover_s
    if injected.served_after is not None:
        answered = [r.end_s for r in history.records if r.node == fault.node
                    and r.op in (Op.PUT, Op.GET) and r.result is Result.OK
                    and r.end_s is not None
                    and injected.served_after <= r.start_s <= fault.end_s]
        if not answered:
            others.append(f"{fault.name}: {fault.node} served no client that arrived during "
                          "the fault")
        else:
            detect = min(answered) - injected.served_after
    if injected.must_serve_gets:
        served_gets = sum(1 for r in history.records if r.node == fault.node
                          and r.op is Op.GET and r.result is Result.OK
                          and fault.start_s <= r.start_s <= fault.end_s)
        if not served_gets:
            others.append(f"{fault.name}: {fault.node} served no get during the fault")
    errors: dict[str, int] = {}
    for r in history.records:
        if (r.op in (Op.PUT, Op.GET) and r.result is Result.ERR
                and fault.start_s <= r.start_s <= fault.end_s):
            name = r.error.partition(":")[0] or "no answer"
            errors[name] = errors.get(name, 0) + 1
    notes = list(injected.notes)
    if injected.paused_leader:
        revoked = sorted({g.node for g in history.lease_gaps
                          if fault.end_s <= g.expired_s <= fault.end_s + 1.0})
        if revoked:
            notes.append(f"leases that ended within 1 s of the paused etcd leader's resume "
                         f"(revoked by it: etcd-io/etcd#15247): {', '.join(revoked)}")
    if errors:
        notes.append("failed in the window: " + ", ".join(
            f"{n} {name}" for name, n in sorted(errors.items(), key=lambda kv: -kv[1])))
    engine = engine_stats(history.records, fault, ENGINE_TIMEOUT_S)
    caught = engine_requests_during(history.records, fault)
    engine_errors: dict[str, int] = {}
    for r in caught:
        if r.result is Result.ERR:
            name = f"{r.node} " + (r.error.partition(":")[0] or "no answer")
            engine_errors[name] = engine_errors.get(name, 0) + 1
    if engine_errors:
        notes.append("engine requests failed in the window: " + ", ".join(
            f"{n} {name}" for name, n in sorted(engine_errors.items(), key=lambda kv: -kv[1])))
    degraded_not = [r for r in caught if r.result is Result.ERR and r.node != injected.cut_off]
    if degraded_not:
        others.append(f"{fault.name}: {len(degraded_not)} engine requests failed on a reachable "
                      f"engine instead of recomputing (first: {degraded_not[0].node} "
                      f"{degraded_not[0].error})")
    # Reuse of the faulted node's engine where it has one (the one whose store the fault
    # hit), else of every engine.
    reuse_of = [r for r in history.records if r.op is Op.ENGINE and r.node == fault.node] \
        or history.records
    engine_wrong = sum(1 for v in violations if v.invariant is Invariant.WRONG_READ
                       and v.record is not None and v.record.op is Op.ENGINE)
    return FaultRow(fault.name, stats.attempted, stats.completed, stats.failed,
                    count(Invariant.WRONG_READ), count(Invariant.DURABLE_LOST),
                    durable_unverified(history), detect, recover, leaks,
                    sum(1 for g in history.lease_gaps if fault.start_s - 1.0 <= g.expired_s
                        <= fault.end_s + LEASE_TTL_S + 1.0), count(Invariant.OVER_TIMEOUT),
                    longest_stall(history.records, fault)[0], others + injected.violations,
                    leak_detail=dict(injected.leaks), notes=notes,
                    engine_attempted=engine.attempted, engine_completed=engine.completed,
                    engine_failed=engine.failed, engine_wrong=engine_wrong,
                    engine_slowest_s=max((r.end_s - r.start_s for r in caught
                                          if r.end_s is not None), default=0.0),
                    reuse_before=engine_reuse(reuse_of, until_s=fault.start_s),
                    reuse_after=engine_reuse(reuse_of, since_s=fault.end_s))


# --- the load generator (runs in the observer namespace) -------------------------------------


_PRINT_LOCK = threading.Lock()


def _say(line: str) -> None:
    with _PRINT_LOCK:
        print(line, flush=True)


class _Membership:
    """The etcd node watch on a private event loop: who is alive, and the lease gaps."""

    def __init__(self, endpoint: str, prefix: str) -> None:
        self.endpoint = endpoint
        self.prefix = prefix
        self.lock = threading.Lock()
        self.alive: dict[str, Any] = {}
        self.gaps: list[LeaseGap] = []
        self._open_gaps: dict[str, float] = {}
        self._loop: Any = None
        self._task: Any = None
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        import asyncio

        async def watch() -> None:
            from kvstore.membership.etcd import KeyLayout, etcd_client
            from kvstore.membership.nodes import NodeEventKind, watch_nodes

            async with etcd_client(self.endpoint) as client, \
                    watch_nodes(client, layout=KeyLayout(self.prefix)) as events:
                async for event in events:
                    now = time.monotonic()
                    with self.lock:
                        if event.kind is NodeEventKind.LEFT:
                            self.alive.pop(event.node_id, None)
                            self._open_gaps.setdefault(event.node_id, now)
                            _say(LOADGEN_LEFT + event.node_id)
                        else:
                            self.alive[event.node_id] = event.record
                            since = self._open_gaps.pop(event.node_id, None)
                            if since is not None:
                                self.gaps.append(LeaseGap(event.node_id, since, now))
                                _say(LOADGEN_REJOINED + event.node_id)

        self._loop = asyncio.new_event_loop()
        try:
            self._task = self._loop.create_task(watch())
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass
        except BaseException as exc:  # reported by the load generator's summary
            self.error = exc
        finally:
            self._loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._task is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)

    def all_gaps(self) -> list[LeaseGap]:
        with self.lock:
            return [*self.gaps, *(LeaseGap(n, t, None) for n, t in self._open_gaps.items())]

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.alive)


class _Clients:
    """One StoreClient per node over TCP, made on first use from the node's etcd record and
    dropped after an error (the next request reconnects, to the address etcd shows then)."""

    def __init__(self, membership: _Membership) -> None:
        self.membership = membership
        self.lock = threading.Lock()
        self.clients: dict[str, StoreClient] = {}

    def get(self, node: str) -> StoreClient:
        from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig

        with self.lock:
            client = self.clients.get(node)
        if client is not None:
            return client
        record = self.membership.snapshot().get(node)
        if record is None:
            raise PeerUnavailable(f"{node} is not in the membership (its lease expired)")
        client = StoreClient.connect(record.grpc_address, StoreClientConfig(
            data_plane=DataPlane.TCP, rpc_timeout_s=REQUEST_TIMEOUT_S,
            tcp_io_timeout_s=REQUEST_TIMEOUT_S, tcp_connections=1))
        with self.lock:
            if node in self.clients:
                client.close()
                return self.clients[node]
            self.clients[node] = client
        return client

    def drop(self, node: str, client: StoreClient) -> None:
        with self.lock:
            if self.clients.get(node) is client:
                del self.clients[node]
            else:
                return
        with contextlib.suppress(KvtierError, OSError):
            client.close()

    def close_all(self) -> None:
        with self.lock:
            clients, self.clients = list(self.clients.values()), {}
        for client in clients:
            with contextlib.suppress(KvtierError, OSError):
                client.close()


class _Load:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.size = int(config["value_bytes"])
        self.pause_s = float(config["op_pause_s"])
        self.membership = _Membership(config["etcd"], config["prefix"])
        self.clients = _Clients(self.membership)
        self.lock = threading.Lock()
        self.records: list[Record] = []
        self.acked: list[tuple[str, str, int]] = []
        self.stopping = threading.Event()
        self.suspect: dict[str, float] = {}
        self.decisions = 0
        self.corrupt_at_end: dict[str, int] = {}
        self.last_answer: dict[str, float] = {}
        """When each conductor last answered a Schedule (accepted, rejected or refused)."""
        self.schedule_errors: list[str] = []
        self.top_term = 0
        """The newest term any conductor decided in (LOADGEN_DECIDED)."""
        self.quiet: set[str] = set()
        """Nodes the workers send nothing new while a probe empties their DRAM."""
        self.in_flight: dict[str, int] = {}
        """Requests under way per node (a probe waits for none)."""
        self.removed: list[Removal] = []
        """REMOVED events the daemons reported (:meth:`follow_removals`)."""
        self.following = threading.Event()
        """Set while :meth:`follow_removals` should go on (past the read-back)."""
        self.streams: dict[str, Any] = {}
        """Each node's event stream in progress (cancelled to stop following)."""

    def add(self, record: Record) -> None:
        with self.lock:
            self.records.append(record)

    def request(self, op: Op, key: str, node: str, version: int = 0) -> Record:
        """One put or get, recorded."""
        start = time.monotonic()
        with self.lock:
            self.in_flight[node] = self.in_flight.get(node, 0) + 1
        try:
            return self._request(op, key, node, version, start)
        finally:
            with self.lock:
                self.in_flight[node] -= 1

    def _request(self, op: Op, key: str, node: str, version: int, start: float) -> Record:
        client: Any = None
        try:
            client = self.clients.get(node)
            if op is Op.PUT:
                client.put(key.encode(), chunk_value(key, version, self.size))
                record = Record(op, key, node, start, time.monotonic(), Result.OK,
                                version=version, size_bytes=self.size, durable=True)
                with self.lock:
                    self.acked.append((key, node, version))
            else:
                buf = bytearray(self.size)
                client.get_into(key.encode(), buf)
                record = Record(op, key, node, start, time.monotonic(), Result.OK,
                                digest=digest(buf))
        except ChunkNotFound:
            record = Record(op, key, node, start, time.monotonic(), Result.ABSENT,
                            size_bytes=self.size if op is Op.PUT else 0)
        except CapacityError as exc:  # the node answered (it is full): no reason to avoid it
            record = Record(op, key, node, start, time.monotonic(), Result.ERR, version=version,
                            size_bytes=self.size if op is Op.PUT else 0,
                            error=f"{type(exc).__name__}: {exc}"[:200])
        except (KvtierError, OSError) as exc:
            if client is not None:
                self.clients.drop(node, client)
            with self.lock:
                self.suspect[node] = time.monotonic() + SUSPECT_S
            record = Record(op, key, node, start, time.monotonic(), Result.ERR, version=version,
                            size_bytes=self.size if op is Op.PUT else 0,
                            error=f"{type(exc).__name__}: {exc}"[:200])
        self.add(record)
        return record

    def follow_removals(self, node: str) -> None:
        """Record every REMOVED event ``node`` reports (a chunk evicted at its budget or
        removed is no loss: :class:`~kvstore.cluster.chaos_check.Removal`), from its event
        stream over gRPC (no data connection), across restarts: after a break the stream is
        asked again from the last seq seen; a RESYNC for a new epoch (the daemon restarted)
        starts over from that epoch's first event, one in the same epoch (we fell behind the
        ring) continues from the seq it names. Events missed that way can only make a removal
        look like a loss, never the reverse."""
        import grpc

        from kvstore._proto.kvtier.v1 import store_pb2 as pb
        from kvstore._proto.kvtier.v1 import store_pb2_grpc as pb_grpc

        seq, epoch, address = 0, "", ""
        channel: Any = None
        while self.following.is_set():
            record = self.membership.snapshot().get(node)
            if record is None:
                time.sleep(0.2)
                continue
            if record.grpc_address != address or channel is None:
                if channel is not None:
                    channel.close()
                address = record.grpc_address
                # Reconnect within 0.5 s of a restart, not after gRPC's backoff (1 s doubling
                # to 120 s): a daemon killed again before the stream is back would take the
                # events of its whole life with it.
                channel = grpc.insecure_channel(address, options=[
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 500)])
            stub = pb_grpc.StoreStub(channel)  # type: ignore[no-untyped-call]
            stream = stub.Subscribe(pb.SubscribeRequest(from_seq=seq, epoch=epoch),
                                    timeout=30.0)
            with self.lock:
                self.streams[node] = stream
            if not self.following.is_set():  # stopped before the stream was published
                stream.cancel()
            try:
                for event in stream:
                    if event.kind == pb.EVENT_RESYNC:
                        # A new epoch (the daemon restarted): all of it, from its first
                        # event (recovery, then the evictions right after). The same epoch:
                        # we fell behind its ring; go on from where it is now.
                        seq = 0 if event.epoch != epoch else int(event.seq)
                        epoch = event.epoch
                        break
                    seq, epoch = int(event.seq), event.epoch
                    if event.kind == pb.EVENT_REMOVED:
                        removal = Removal(node, event.key.decode(errors="replace"),
                                          time.monotonic())
                        with self.lock:
                            self.removed.append(removal)
            except grpc.RpcError:
                time.sleep(0.2)
        if channel is not None:
            channel.close()

    def worker(self, wid: int) -> None:
        rng = random.Random(wid)
        seq = 0
        while not self.stopping.is_set():
            now = time.monotonic()
            with self.lock:
                alive = sorted(n for n in self.membership.snapshot()
                               if self.suspect.get(n, 0.0) <= now and n not in self.quiet)
            if not alive:
                time.sleep(0.05)
                continue
            with self.lock:
                readable = [a for a in self.acked if a[1] in alive]
            if not readable or rng.random() < 0.5:
                node = alive[seq % len(alive)]
                key = f"w{wid}/{seq}"
                seq += 1
                now = time.monotonic()
                self.add(Record(Op.SCHEDULE, key, node, now, now, Result.OK))
                self.request(Op.PUT, key, node, version=seq % 3)
            else:
                key, node, _ = rng.choice(readable)
                self.request(Op.GET, key, node)
            time.sleep(self.pause_s)

    def scheduler(self, conductor_id: str, address: str) -> None:
        """Ask one conductor, in a loop, to place a request (``Schedule``) and who leads
        (``Leader``). A follower refuses with FAILED_PRECONDITION. Every ``Leader`` answer
        that claims leadership is a ``LEASE`` record in its term; an accepted request is a
        decision of that conductor as leader (a ``LEASE`` record too, and a ``SCHEDULE``
        record for the prefill node it names), in the higher of the terms it claimed just
        before and just after (the reply carries none; the higher one is never the stale
        one). One thread per conductor, so a paused one holds up only its own."""
        import grpc

        from kvstore._proto.kvtier.v1 import conductor_pb2 as cpb
        from kvstore._proto.kvtier.v1 import conductor_pb2_grpc as cpb_grpc

        channel = grpc.insecure_channel(address)
        stub = cpb_grpc.ConductorStub(channel)  # type: ignore[no-untyped-call]

        def failed(exc: grpc.RpcError) -> None:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code is grpc.StatusCode.FAILED_PRECONDITION:  # a follower's answer
                with self.lock:
                    self.last_answer[conductor_id] = time.monotonic()
            if code not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE,
                            grpc.StatusCode.DEADLINE_EXCEEDED):
                detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                with self.lock:
                    self.schedule_errors.append(f"{conductor_id}: {code}: {detail}"[:200])
            time.sleep(0.05)

        def claimed_term() -> int:
            """The term this conductor says it leads in (0: it does not, or no answer)."""
            start = time.monotonic()
            try:
                leader = stub.Leader(cpb.LeaderRequest(), timeout=REQUEST_TIMEOUT_S)
            except grpc.RpcError as exc:
                failed(exc)
                return 0
            if not leader.is_leader:
                return 0
            self.add(Record(Op.LEASE, "leader", conductor_id, start, time.monotonic(),
                            Result.OK, epoch=int(leader.term)))
            return int(leader.term)

        seq = 0
        try:
            term = claimed_term()
            while not self.stopping.is_set():
                seq += 1
                request_id = f"{conductor_id}/{seq}"
                keys = [f"{request_id}/{i}".encode() for i in range(3)]
                start = time.monotonic()
                try:
                    reply = stub.Schedule(cpb.ScheduleRequest(
                        request_id=request_id, model=MODEL, keys=keys, input_tokens=1536),
                        timeout=REQUEST_TIMEOUT_S)
                except grpc.RpcError as exc:
                    failed(exc)
                    term = claimed_term()
                    continue
                end = time.monotonic()
                with self.lock:
                    self.last_answer[conductor_id] = end
                after = claimed_term()
                if reply.accepted:
                    self.add(Record(Op.LEASE, request_id, conductor_id, start, end, Result.OK,
                                    epoch=max(term, after)))
                    self.add(Record(Op.SCHEDULE, request_id, reply.prefill_node, start, end,
                                    Result.OK))
                    with self.lock:
                        self.decisions += 1
                        newer = max(term, after) > self.top_term
                        self.top_term = max(self.top_term, term, after)
                    if newer:
                        _say(f"{LOADGEN_DECIDED}{conductor_id} {max(term, after)}")
                term = after
                time.sleep(0.02)
        finally:
            channel.close()

    def engine_driver(self, engine: dict[str, str], prompts: dict[str, list[int]],
                      seed: int) -> None:
        """Send one engine's prefill worker a prompt at a time (drawn at random from
        ``prompts``) and record each request (``Op.ENGINE``): its greedy tokens' digest and
        how many prompt tokens the prefill loaded from kvtier. A request is bounded by
        ``ENGINE_TIMEOUT_S`` (no answer by then: an error). No store is named here: the
        worker uses its node's daemon, and the history compares the tokens with the prompt's
        no-cache output."""
        import asyncio

        rng = random.Random(seed)
        keys = sorted(prompts)
        vllm = engine.get("kind") == Engines.VLLM.value
        request = self._vllm_request if vllm else self._engine_request
        pause_s = VLLM_PAUSE_S if vllm else ENGINE_PAUSE_S

        async def drive() -> None:
            seq = 0
            while not self.stopping.is_set():
                key = rng.choice(keys)
                seq += 1
                self.add(await request(engine, key, prompts[key], seq))
                await asyncio.sleep(pause_s)

        asyncio.run(drive())

    async def _engine_request(self, engine: dict[str, str], key: str, tokens: list[int],
                              seq: int) -> Record:
        import asyncio

        from kvstore.engine.frames import read_frame, write_frame

        start = time.monotonic()
        writer: Any = None
        try:
            async with asyncio.timeout(ENGINE_TIMEOUT_S):
                host, _, port = engine["prefill"].rpartition(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                await write_frame(writer, {
                    "op": "generate", "request_id": f"{engine['node']}/{seq}",
                    "token_ids": tokens, "tenant": ENGINE_TENANT, "reuse": True,
                    "prefix_blocks": 0, "ticket": 0, "decode_address": engine["decode"],
                    "max_new_tokens": ENGINE_NEW_TOKENS, "fetch": None})
                first, _ = await read_frame(reader)
                done = first if first.get("event") == "error" else (await read_frame(reader))[0]
            if done.get("event") == "error":
                raise KvtierError(f"{done.get('error')}: {done.get('message')}")
            out = [int(t) for t in done["decode"]["tokens"]]
            reused = int(first["prefill"]["reused_tokens"])
            return Record(Op.ENGINE, key, engine["node"], start, time.monotonic(), Result.OK,
                          digest=tokens_digest(out), prompt_tokens=len(tokens),
                          reused_tokens=reused)
        except (TimeoutError, KvtierError, OSError, KeyError, TypeError, ValueError) as exc:
            return Record(Op.ENGINE, key, engine["node"], start, time.monotonic(), Result.ERR,
                          prompt_tokens=len(tokens),
                          error=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            if writer is not None:
                writer.close()

    async def _vllm_request(self, engine: dict[str, str], key: str, tokens: list[int],
                            seq: int) -> Record:
        """One greedy ``/v1/completions`` of ``tokens`` to a host's ``vllm serve`` (no
        ``cache_salt``: the connector's keys are the prompt's), bounded by
        ``ENGINE_TIMEOUT_S``. ``reused_tokens`` is vLLM's ``cached_tokens``: with its own prefix
        cache off, the prompt tokens it took from kvtier (a load that then failed is recomputed
        but still counted)."""
        import asyncio

        start = time.monotonic()
        writer: Any = None
        try:
            async with asyncio.timeout(ENGINE_TIMEOUT_S):
                host, _, port = engine["url"].rpartition(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(http_post(engine["url"], "/v1/completions", {
                    "model": engine["model"], "prompt": tokens,
                    "max_tokens": ENGINE_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True,
                    "return_token_ids": True}))
                await writer.drain()
                raw = await reader.read()  # to the end: the request says Connection: close
            status, answer = http_answer(raw)
            if status != 200:
                raise KvtierError(f"vllm answered HTTP {status}: {str(answer)[:120]}")
            out = [int(t) for t in answer["choices"][0]["token_ids"]]
            details = answer["usage"].get("prompt_tokens_details") or {}
            return Record(Op.ENGINE, key, engine["node"], start, time.monotonic(), Result.OK,
                          digest=tokens_digest(out), prompt_tokens=len(tokens),
                          reused_tokens=int(details.get("cached_tokens") or 0))
        except (TimeoutError, KvtierError, OSError, KeyError, TypeError, ValueError,
                IndexError) as exc:
            return Record(Op.ENGINE, key, engine["node"], start, time.monotonic(), Result.ERR,
                          prompt_tokens=len(tokens),
                          error=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            if writer is not None:
                writer.close()

    def read_back(self) -> None:
        """Every acknowledged key from its node, once (after the faults were removed)."""
        with self.lock:
            acked = list(self.acked)
        for key, node, _ in acked:
            self.request(Op.GET, key, node)

    def empty_dram(self, node: str) -> None:
        """Evict every DRAM chunk of ``node`` (its NVMe copies stay: puts are durable)."""
        from kvstore._proto.kvtier.v1 import store_pb2 as pb
        from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
        from kvstore.dataplane.tier import TierKind
        from kvstore.errors import CapacityError

        record = self.membership.snapshot().get(node)
        if record is None:
            return
        with StoreClient.connect(record.grpc_address, StoreClientConfig(
                data_plane=DataPlane.TCP, rpc_timeout_s=REQUEST_TIMEOUT_S)) as control:
            used = sum(int(t.used_bytes) for t in control.stats().tiers
                       if t.tier == pb.TIER_DRAM)
            with contextlib.suppress(CapacityError):  # a chunk read meanwhile stays leased
                control.evict(tier=TierKind.DRAM, bytes_=used)

    def corrupt_count(self, node: str) -> int:
        """Chunks ``node``'s tiers found corrupt since it started (its Stats), -1: no answer."""
        from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig

        record = self.membership.snapshot().get(node)
        if record is None:
            return -1
        try:
            with StoreClient.connect(record.grpc_address, StoreClientConfig(
                    data_plane=DataPlane.TCP, rpc_timeout_s=REQUEST_TIMEOUT_S)) as control:
                return sum(int(t.corrupt) for t in control.stats().tiers)
        except KvtierError:
            return -1

    def probe(self, node: str) -> dict[str, int]:
        """What ``node`` holds for clients, with no request of this load under way there: the
        load sends it nothing new meanwhile; its DRAM is emptied first (every chunk demoted
        or dropped), so what DRAM still uses is pinned or reserved (a read lease, a pin, a
        reservation: space a dead client may have leaked). -1 everywhere: no answer."""
        from kvstore._proto.kvtier.v1 import store_pb2 as pb
        from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig

        with self.lock:
            self.quiet.add(node)
        try:
            deadline = time.monotonic() + 2 * REQUEST_TIMEOUT_S
            while time.monotonic() < deadline:
                with self.lock:
                    if not self.in_flight.get(node, 0):
                        break
                time.sleep(0.01)
            record = self.membership.snapshot().get(node)
            if record is None:
                return {"tcp_connections_open": -1, "shm_leases_open": -1,
                        "ucx_endpoints_open": -1, "dram_used_bytes": -1, "dram_chunks": -1}
            try:
                self.empty_dram(node)
                with StoreClient.connect(record.grpc_address, StoreClientConfig(
                        data_plane=DataPlane.TCP, rpc_timeout_s=REQUEST_TIMEOUT_S)) as control:
                    stats = control.stats()
            except KvtierError:
                return {"tcp_connections_open": -1, "shm_leases_open": -1,
                        "ucx_endpoints_open": -1, "dram_used_bytes": -1, "dram_chunks": -1}
            [dram] = [t for t in stats.tiers if t.tier == pb.TIER_DRAM]
            return {"tcp_connections_open": int(stats.tcp_connections_open),
                    "shm_leases_open": int(stats.shm_leases_open),
                    "ucx_endpoints_open": int(stats.ucx_endpoints_open),
                    "dram_used_bytes": int(dram.used_bytes), "dram_chunks": int(dram.chunks)}
        finally:
            with self.lock:
                self.quiet.discard(node)

    def leaks(self) -> dict[str, dict[str, int]]:
        """Per node: data connections and leases the daemon still holds for clients that
        closed (polled for up to 5 s: a close reaches the daemon's threads asynchronously)."""
        from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig

        out: dict[str, dict[str, int]] = {}
        for node, record in sorted(self.membership.snapshot().items()):
            with StoreClient.connect(record.grpc_address, StoreClientConfig(
                    data_plane=DataPlane.TCP, rpc_timeout_s=REQUEST_TIMEOUT_S)) as control:
                deadline = time.monotonic() + 5.0
                while True:
                    stats = control.stats()
                    held = {"tcp_connections_open": int(stats.tcp_connections_open),
                            "shm_leases_open": int(stats.shm_leases_open),
                            "ucx_endpoints_open": int(stats.ucx_endpoints_open)}
                    corrupt = sum(int(t.corrupt) for t in stats.tiers)
                    if not any(held.values()) or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            out[node] = held
            self.corrupt_at_end[node] = corrupt
        return out

    def run(self) -> None:
        self.membership.start()
        expected = set(self.config["nodes"])
        deadline = time.monotonic() + 30.0
        while set(self.membership.snapshot()) != expected:
            if self.membership.error is not None or time.monotonic() > deadline:
                raise ConfigError(f"membership never showed {sorted(expected)}: "
                                  f"{self.membership.error!r}")
            time.sleep(0.05)
        threads = [threading.Thread(target=self.worker, args=(w,), name=f"load-{w}",
                                    daemon=True) for w in range(int(self.config["workers"]))]
        threads += [threading.Thread(target=self.scheduler, args=(cid, address),
                                     name=f"schedule-{cid}", daemon=True)
                    for cid, address in sorted(self.config.get("conductors", {}).items())]
        threads += [threading.Thread(target=self.engine_driver,
                                     args=(engine, self.config["prompts"], i),
                                     name=f"engine-{engine['node']}", daemon=True)
                    for i, engine in enumerate(self.config.get("engines", []))]
        followers = [threading.Thread(target=self.follow_removals, args=(node,),
                                      name=f"removals-{node}", daemon=True)
                     for node in sorted(expected)]
        self.following.set()
        for t in followers:
            t.start()
        for t in threads:
            t.start()
        _say(LOADGEN_READY)
        for line in sys.stdin:
            words = line.split()
            if words == ["stop"]:
                break
            if words[:1] == ["read"]:  # read NODE KEY...: get them now, report what came back
                node, keys = words[1], words[2:]
                self.empty_dram(node)  # so the gets read the NVMe copies
                results = {k: self.request(Op.GET, k, node).result.value for k in keys}
                _say(LOADGEN_READ + json.dumps({"results": results,
                                                "corrupt": self.corrupt_count(node)}))
            elif words[:1] == ["probe"]:  # probe NODE: its counts, DRAM emptied first
                _say(LOADGEN_PROBE + json.dumps(self.probe(words[1])))
            elif words[:1] == ["quiet"]:  # quiet NODE: send it nothing, close its client
                with self.lock:
                    self.quiet.add(words[1])
                with self.clients.lock:
                    dropped = self.clients.clients.get(words[1])
                if dropped is not None:
                    self.clients.drop(words[1], dropped)
            elif words[:1] == ["loud"]:  # loud NODE: load it again (over new connections)
                with self.lock:
                    self.quiet.discard(words[1])
        self.stopping.set()
        for t in threads:
            t.join(60)
        self.read_back()
        self.clients.close_all()
        leaks = self.leaks()
        self.membership.stop()
        self.following.clear()
        with self.lock:
            streams = list(self.streams.values())
        for stream in streams:
            stream.cancel()
        for t in followers:
            t.join(10)
        with open(self.config["history"], "w") as f:
            for r in self.records:
                f.write(json.dumps({"kind": "record", **r.to_dict()}) + "\n")
            with self.lock:
                removed = list(self.removed)
            for removal in removed:
                f.write(json.dumps({"kind": "removed", **asdict(removal)}) + "\n")
            for g in self.membership.all_gaps():
                f.write(json.dumps({"kind": "gap", **asdict(g)}) + "\n")
        _say(LOADGEN_DONE + json.dumps({"records": len(self.records), "leaks": leaks,
                                         "decisions": self.decisions,
                                         "corrupt": self.corrupt_at_end,
                                         "last_answer": self.last_answer,
                                         "schedule_errors": self.schedule_errors[:20]}))


# --- report ---------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}"


def print_table(rows: list[FaultRow], out: IO[str] = sys.stdout, *, soak: bool = False) -> None:
    """The table, then each row's notes (``soak``: without the per-run totals, which a soak's
    rows share)."""
    head = ("fault", "attempted", "completed", "failed", "wrong reads", "durable lost",
            "unverified", "detect s", "recover s", "leaks", "left", "over timeout", "stall s",
            "engine a/c/f", "reuse % before/after")
    lines = [head] + [(r.fault, str(r.attempted), str(r.completed), str(r.failed),
                       str(r.wrong_reads), str(r.durable_lost), str(r.durable_unverified),
                       _fmt_s(r.detect_s), _fmt_s(r.recover_s), str(r.leaks), str(r.nodes_left),
                       str(r.over_timeout), _fmt_s(r.longest_stall_s),
                       f"{r.engine_attempted}/{r.engine_completed}/{r.engine_failed}",
                       f"{_fmt_pct(r.reuse_before)}/{_fmt_pct(r.reuse_after)}") for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                        enumerate(zip(line, widths, strict=True))), file=out)
    for r in rows:
        if r.skipped:
            print(f"{r.fault}: skipped: {r.skipped}", file=out)
            continue
        for note in r.notes:
            print(f"{r.fault}: {note}", file=out)
        if any(r.leak_detail.values()):
            print(f"{r.fault}: LEAKED {r.leak_detail}", file=out)
        if r.engine_attempted:
            print(f"{r.fault}: engine requests in the window: {r.engine_attempted} under way, "
                  f"{r.engine_completed} answered in time, the slowest "
                  f"{r.engine_slowest_s:.2f} s (bound {ENGINE_TIMEOUT_S} s + "
                  f"{TIMEOUT_SLACK_S} s)", file=out)
        if not soak:
            print(f"{r.fault}: {r.decisions} conductor decisions, {r.records} records", file=out)
        if r.damaged:
            print(f"{r.fault}: {r.damaged} chunks corrupted on disk, {r.corrupt_reported} "
                  "counted corrupt by the node", file=out)
        for v in r.other_violations:
            print(f"{r.fault}: VIOLATION {v}", file=out)
        for e in r.schedule_errors:
            print(f"{r.fault}: schedule error {e}", file=out)
    print(f"goals: wrong reads 0 (engine outputs: equal to the no-cache ones), durable lost "
          f"0, leaks 0, over timeout 0 (requests {REQUEST_TIMEOUT_S} s + {TIMEOUT_SLACK_S} s, "
          f"engine requests {ENGINE_TIMEOUT_S} s + {TIMEOUT_SLACK_S} s), stall <= "
          f"{MAX_STALL_S} s, engine requests completing in every window; detect about the "
          f"{LEASE_TTL_S} s lease TTL", file=out)


def main(json_path: Path | None, quick: bool, faults: list[str] | None = None,
         soak_minutes: float | None = None, engines: Engines = Engines.REFERENCE
         ) -> list[FaultRow]:
    """Run ``faults`` (default: all), one cluster each, or with ``soak_minutes`` a soak
    (:func:`run_soak`) drawing from them, with ``engines`` serving prompts; print the table,
    write the JSON. A soak whose whole history broke an invariant, or that leaked, returns a
    row that is not clean."""
    from bench._meta import run_header

    unknown = [f for f in faults or () if f not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown fault(s) {', '.join(unknown)} (known: {', '.join(FAULTS)})")

    spec = ChaosSpec.quick(engines) if quick else ChaosSpec(engines=engines)
    extra: dict[str, Any] = {}
    if soak_minutes is not None:
        soak = run_soak(soak_minutes, spec=spec, faults=faults)
        rows = soak.rows
        print_table(rows, soak=True)
        print(f"soak: {len(rows)} faults in {soak_minutes:g} min (seed {soak.seed}), "
              f"{soak.records} records, {soak.decisions} conductor decisions; whole history: {len(soak.violations)} violations; "
              f"leaks at the end: {soak.leaks}")
        for line in soak.skipped:
            print(f"soak: not drawn: {line}")
        for v in soak.violations:
            print(f"soak: VIOLATION {v}")
        extra = {"soak": {"minutes": soak_minutes, "seed": soak.seed, "clean": soak.clean,
                          "violations": soak.violations, "leaks": soak.leaks,
                          "sequence": [r.fault for r in rows]}}
        if not soak.clean:
            rows = [*rows, FaultRow("soak (whole history)", 0, 0, 0, 0, 0, 0, None, None,
                                    sum(n for d in soak.leaks.values() for n in d.values()),
                                    other_violations=soak.violations or ["leaks"])]
    else:
        rows = [run_fault(name, spec=spec) for name in (faults or list(FAULTS))]
        print_table(rows)
    if json_path is not None:
        result = {**run_header("chaos"), "spec": {**asdict(spec), "engines": spec.engines.value},
                  **extra,
                  "rows": [asdict(r) for r in rows]}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)
    return rows


def _engines_main(endpoint: str, prefix: str, node_id: str, host_name: str) -> None:
    import asyncio

    from kvstore.membership.engines import EngineRecord, EngineRole, register_engine
    from kvstore.membership.etcd import KeyLayout, etcd_client

    async def hold() -> None:
        layout = KeyLayout(prefix)
        prefill = EngineRecord(f"prefill-{host_name}", EngineRole.PREFILL, MODEL, node_id)
        decode = EngineRecord(f"decode-{host_name}", EngineRole.DECODE, MODEL, node_id,
                              kv_capacity_tokens=1 << 24)
        async with etcd_client(endpoint) as client, \
                register_engine(client, prefill, ttl_s=LEASE_TTL_S, layout=layout), \
                register_engine(client, decode, ttl_s=LEASE_TTL_S, layout=layout):
            _say(ENGINES_READY)
            await asyncio.Event().wait()

    asyncio.run(hold())


def _vllm_main(config_path: str) -> None:
    """``python -m bench.chaos vllm CONFIG``, in an engine host's namespace: start its ``vllm
    serve`` (:class:`~kvstore.cluster.vllm_server.VllmServer` on the host's address, kvtier's
    connector from CONFIG, vLLM's own prefix cache off), compute every prompt's no-cache output
    on it (each under a ``cache_salt`` of its own that nothing else uses: vLLM's hash and so
    the connector's keys differ, the store has nothing for it), say ``VLLM_READY`` with them,
    and close the server on SIGTERM (or when stdin ends). A no-cache request that
    reports cached tokens is a ConfigError: the reference would not be one."""
    import secrets

    from kvstore.cluster.vllm_server import VllmServer

    os.environ["no_proxy"] = os.environ["NO_PROXY"] = "*"  # its health checks: in the lab
    config = json.loads(Path(config_path).read_text())
    server = VllmServer(Path(config["model_dir"]), Path(config["work_dir"]), config["name"],
                        host=config["host"], port=VLLM_PORT, model_name=vllm_model_name(),
                        block_size=VLLM_BLOCK_TOKENS, max_model_len=VLLM_MAX_MODEL_LEN,
                        kv_cache_memory_bytes=VLLM_KV_BYTES,
                        kv_transfer_config=config["kv_transfer_config"],
                        extra_args=["--no-enable-prefix-caching"],
                        env={**config["env"], "no_proxy": "*", "NO_PROXY": "*"},
                        prompt_tokens_details=True, nice=VLLM_NICE)

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        server.start(VLLM_START_TIMEOUT_S)
        salt = f"no-cache-{config['name']}-{secrets.token_hex(4)}"
        expected = {}
        for key, tokens in sorted(config["prompts"].items()):
            answer = server.complete(tokens, max_tokens=ENGINE_NEW_TOKENS,
                                     cache_salt=f"{salt}-{key}")
            cached = (answer.raw["usage"].get("prompt_tokens_details") or {}).get(
                "cached_tokens") or 0
            if cached:
                raise ConfigError(f"{config['name']}: the no-cache request of {key} found "
                                  f"{cached} cached tokens")
            expected[key] = tokens_digest(answer.token_ids)
        _say(VLLM_READY + json.dumps({"url": server.base_url, "start_s": server.start_s,
                                      "expected": expected}))
        sys.stdin.readline()
    finally:
        server.close()


def _loadgen_main(config_path: str) -> None:
    _Load(json.loads(Path(config_path).read_text())).run()


CLIENT_VALUE_BYTES = 1 << 20
"""Values the killed client puts and gets in its loops (and its held shared-memory put)."""
CLIENT_HELD_GET_BYTES = 6 << 20
"""The chunk its held TCP get asks for: more than a socket's largest send buffer (4 MiB
here) plus its own 4 KiB receive buffer, so the daemon's send blocks with the lease held."""


def _client_main(address: str, plane: str, threads: int) -> None:
    """A client a fault kills with SIGKILL (``python -m bench.chaos client``, in the daemon's
    host namespace). It holds transfers open on the daemon: on the shared-memory plane a put
    reserved and half written and a read lease; on TCP a PUT frame half sent and a GET of a
    large chunk it does not read (the daemon's send blocks, the chunk pinned); on UCX none
    (no API holds one open). It says what it holds (``CLIENT_READY``), then puts and gets
    1 MiB values on ``threads`` threads until it dies. Its keys are its own
    (``client-<random>/``): the load's history does not include them."""
    import secrets
    import socket

    from kvstore.client.store_client import DataPlane, StoreClient, StoreClientConfig
    from kvstore.dataplane.transport.frames import HEADER_BYTES, Opcode, pack_header

    kind = DataPlane(plane)
    client = StoreClient.connect(address, StoreClientConfig(
        data_plane=kind, rpc_timeout_s=REQUEST_TIMEOUT_S, tcp_io_timeout_s=REQUEST_TIMEOUT_S,
        tcp_connections=2))
    if client.data_plane is not kind:
        raise ConfigError(f"asked for the {kind.value} data plane, got "
                          f"{client.data_plane.value}")
    tag = f"client-{secrets.token_hex(4)}"
    value = os.urandom(CLIENT_VALUE_BYTES)  # not checked: this client is not in the history
    seed = f"{tag}/seed".encode()
    client.put(seed, value)
    holds: list[str] = []
    keep: list[Any] = []
    if kind is DataPlane.SHM:
        shm: Any = client.plane
        writer = shm.open_write(f"{tag}/held-put".encode(), CLIENT_VALUE_BYTES)
        writer.buffer[:CLIENT_VALUE_BYTES // 2] = value[:CLIENT_VALUE_BYTES // 2]
        keep.append(writer)
        holds.append("shm put reserved, half written")
        keep.append(shm.open_read(seed))
        holds.append("shm read lease")
    elif kind is DataPlane.TCP:
        big = f"{tag}/big".encode()
        client.put(big, os.urandom(CLIENT_HELD_GET_BYTES))
        host, _, port = client.info.tcp_address.rpartition(":")
        key = f"{tag}/held-put".encode()
        put = socket.create_connection((host, int(port)), timeout=5)
        header = pack_header(bytearray(HEADER_BYTES), Opcode.PUT, key_len=len(key),
                             request_id=1, length=CLIENT_VALUE_BYTES,
                             total_size=CLIENT_VALUE_BYTES, payload_len=CLIENT_VALUE_BYTES)
        put.sendall(bytes(header) + key + value[:CLIENT_VALUE_BYTES // 2])
        keep.append(put)
        holds.append("tcp PUT frame half sent")
        get = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        get.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        get.connect((host, int(port)))
        header = pack_header(bytearray(HEADER_BYTES), Opcode.GET, key_len=len(big),
                             request_id=2, total_size=CLIENT_HELD_GET_BYTES)
        get.sendall(bytes(header) + big)
        keep.append(get)
        holds.append("tcp GET of a 6 MiB chunk, unread")

    def loop(tid: int) -> None:
        buf = bytearray(CLIENT_VALUE_BYTES)
        for i in itertools.count():
            key = f"{tag}/t{tid}/{i % 8}".encode()
            with contextlib.suppress(KvtierError):
                client.put(key, value)
            with contextlib.suppress(KvtierError):
                client.get_into(key, buf)

    workers = [threading.Thread(target=loop, args=(t,), daemon=True) for t in range(threads)]
    for t in workers:
        t.start()
    time.sleep(0.2)  # the loops under way too
    _say(CLIENT_READY + json.dumps({"holds": holds, "plane": client.data_plane.value}))
    threading.Event().wait()  # until SIGKILL


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_HTTP2_EMPTY_SETTINGS = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _open_many(address: tuple[str, int], count: int, first: bytes) -> list[Any]:
    import socket

    out = []
    for _ in range(count):
        try:
            sock = socket.create_connection(address, timeout=2)
            if first:
                sock.sendall(first)
        except OSError:
            continue
        out.append(sock)
    return out


def _open_after(socks: list[Any], wait_s: float) -> list[Any]:
    """Those of ``socks`` the server has not closed after ``wait_s`` (a close or a refusal
    frame followed by a close reads as the end of the stream)."""
    import select

    deadline = time.monotonic() + wait_s
    live = list(socks)
    while live and time.monotonic() < deadline:
        readable, _, _ = select.select(live, [], [], max(0.0, deadline - time.monotonic()))
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                live.remove(sock)
    return live


def _flood_main(host: str, tcp_port: int, grpc_port: int, count: int,
                grpc_count: int) -> None:
    """``count`` connections to the data plane (no byte sent) and ``grpc_count`` to gRPC (the
    HTTP/2 preface and an empty SETTINGS frame: valid, idle), held until stdin says stop."""
    tcp = _open_many((host, tcp_port), count, b"")
    grpc_socks = _open_many((host, grpc_port), grpc_count,
                            _HTTP2_PREFACE + _HTTP2_EMPTY_SETTINGS)
    tcp_open = _open_after(tcp, 1.0)
    grpc_open = _open_after(grpc_socks, 1.0)  # served: the daemon's SETTINGS, then nothing
    _say(FLOOD_READY + json.dumps({"tcp_connected": len(tcp), "tcp_open": len(tcp_open),
                                   "grpc_connected": len(grpc_socks),
                                   "grpc_open": len(grpc_open)}))
    sys.stdin.readline()
    for sock in [*tcp, *grpc_socks]:
        sock.close()
    _say(FLOOD_DONE + "{}")


def _slowloris_main(host: str, tcp_port: int, grpc_port: int, count: int,
                    wait_s: float) -> None:
    """``count`` connections to each port that send half a frame and stall: half a data-plane
    header (32 of 64 bytes) / half the HTTP/2 preface. Reports how many the daemon dropped
    and when (seconds from the last byte sent), and how many were still open after
    ``wait_s``."""
    import select

    from kvstore.dataplane.transport.frames import HEADER_BYTES, Opcode, pack_header

    half = bytes(pack_header(bytearray(HEADER_BYTES), Opcode.GET, key_len=8,
                             total_size=1))[:HEADER_BYTES // 2]
    sent_at = time.monotonic()
    socks = {"tcp": _open_many((host, tcp_port), count, half),
             "grpc": _open_many((host, grpc_port), count, _HTTP2_PREFACE[:12])}
    _say(FLOOD_READY + json.dumps({k: len(v) for k, v in socks.items()}))
    dropped_s: dict[str, list[float]] = {k: [] for k in socks}
    live = {sock: name for name, group in socks.items() for sock in group}
    deadline = sent_at + wait_s
    while live and time.monotonic() < deadline:
        readable, _, _ = select.select(list(live), [], [], max(0.0, deadline - time.monotonic()))
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                dropped_s[live.pop(sock)].append(time.monotonic() - sent_at)
                sock.close()
    _say(FLOOD_DONE + json.dumps({name: {"dropped": len(dropped_s[name]),
                                         "max_drop_s": max(dropped_s[name], default=None),
                                         "open": sum(1 for n in live.values() if n == name)}
                                  for name in socks}))
    for sock in live:
        sock.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.chaos")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("loadgen", help="(internal) the load generator, in the observer ns")
    gen.add_argument("config")
    vll = sub.add_parser("vllm", help="(internal) one host's vllm serve, in its ns")
    vll.add_argument("config")
    eng = sub.add_parser("engines", help="(internal) hold one host's engine records")
    for name in ("endpoint", "prefix", "node_id", "host_name"):
        eng.add_argument(name)
    cli = sub.add_parser("client", help="(internal) a client killed mid-transfer")
    cli.add_argument("address")
    cli.add_argument("plane")
    cli.add_argument("threads", type=int)
    for cmd in ("flood", "slowloris"):
        f = sub.add_parser(cmd, help=f"(internal) the {cmd} fault's connections")
        f.add_argument("host")
        f.add_argument("tcp_port", type=int)
        f.add_argument("grpc_port", type=int)
        f.add_argument("count", type=int)
        if cmd == "flood":
            f.add_argument("grpc_count", type=int)
        if cmd == "slowloris":
            f.add_argument("wait_s", type=float)
    args = parser.parse_args()
    if args.cmd == "loadgen":
        _loadgen_main(args.config)
    elif args.cmd == "vllm":
        _vllm_main(args.config)
    elif args.cmd == "client":
        _client_main(args.address, args.plane, args.threads)
    elif args.cmd == "flood":
        _flood_main(args.host, args.tcp_port, args.grpc_port, args.count, args.grpc_count)
    elif args.cmd == "slowloris":
        _slowloris_main(args.host, args.tcp_port, args.grpc_port, args.count, args.wait_s)
    else:
        _engines_main(args.endpoint, args.prefix, args.node_id, args.host_name)

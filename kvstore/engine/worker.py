"""Disaggregated prefill and decode workers: one process each, a plain-socket service each.

A request's life (the gateway, :mod:`kvstore.engine.gateway`, drives it)::

    gateway ──generate──► prefill worker                         decode worker
                            load the cached prefix (KVClient,
                            its node's daemon), compute the rest,
                            save every full block (layer by layer)
            ◄─first_token──┤
                            ├──decode (token ids, first token, ──► load the full blocks through
                            │   tail KV, where the blocks are)     kvtier (the prefill node's
                            │                                       daemon), append the tail,
                            │◄────────────────── done ─────────────┤ decode greedily
            ◄──── done ─────┤

**What moves through kvtier.** Every *full* block of the prompt: the prefill worker saves it
into its node's daemon and the decode worker loads it from there (shared memory on one host,
the TCP data plane across hosts). The last, partial block (fewer than ``block_tokens`` tokens)
cannot be a chunk (a chunk key names a full block of tokens), so its KV travels inside the
``decode`` frame, beside the first token; it is at most ``block_tokens - 1`` tokens of KV.
A decode whose load comes back short (a chunk evicted between the save and the load, a
daemon gone) recomputes from the first missing block, tail included: slower, never wrong.

**Reuse.** The conductor's ``prefix_blocks`` says how much of the prompt is cached on the
prefill node. The worker also asks its daemon itself just before loading (the conductor's
index trails the daemon's events by a few milliseconds, so the request right after the one
that stored a prefix may be scheduled before the conductor heard of it) and loads the longer
of the two; a load that comes back short degrades to computing more. Both counts are reported.
Fetch plans (blocks held by another node) are not followed yet: only the prefill node's own
blocks are reused.

**Wire format.** One frame = 8-byte header ``>II`` (JSON length, payload length), the JSON
object, then the payload bytes (KV, little-endian in the model's dtype). One request per
connection; the connection closes after ``done`` or ``error``. An ``error`` frame carries the
kvtier error class name and a message; the gateway raises it again.

**Threads.** Each worker runs one asyncio loop (sockets, conductor reports, etcd lease) and
computes on one extra thread: the model is not shared across threads. The prefill worker
computes one request at a time, in arrival order. The decode worker runs continuous batching
on its compute thread: a request's KV load starts as it arrives (on the KVClient's threads,
overlapping the running batch), the request joins the running batch between two steps once
its load is done, and every step is one batched forward over all running sequences with
ragged KV (:class:`kvstore.engine.batching.DecodeBatch`, shared with the colocated
engine); greedy outputs equal one-at-a-time decoding. Both register an
:class:`~kvstore.membership.engines.EngineRecord` under an etcd lease (refreshed every TTL/3; the
record vanishes with the process) and report load and completions to the conductor; a failed
report is logged, never fails the request.

**Device.** ``--device cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``: the model, the KV
buffers the loads fill and the saves read, and every input tensor live there; the KVClient
copies between its host staging and those tensors layer by layer. A CUDA device this machine
lacks is refused (:func:`resolve_device`, exit code 2), never replaced by the CPU.

Run one with ``python -m kvstore.engine.worker --role prefill ...`` (see :func:`main`); it
prints ``KVTIER-WORKER-READY {json}`` once it serves. :mod:`kvstore.cluster.local` starts them.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import functools
import json
import logging
import queue
import re
import signal
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aetcd
import grpc

from kvstore.engine.model import ModelSpec
from kvstore.errors import (
    ConfigError,
    InvalidArgument,
    InvariantViolation,
    KvtierError,
    PeerUnavailable,
    ProtocolError,
)
from kvstore.membership.engines import EngineRecord, EngineRole

if TYPE_CHECKING:

    from kvstore.client.conductor_client import ConductorClient
    from kvstore.client.handles import LoadHandle
    from kvstore.client.kv_client import KVClient
    from kvstore.client.kvlayout import KVLayout
    from kvstore.client.requests import RemoteFetch
    from kvstore.engine.batching import DecodeBatch

log = logging.getLogger(__name__)

__all__ = ["READY_PREFIX", "WorkerConfig", "read_frame", "serve", "write_frame"]

READY_PREFIX = "KVTIER-WORKER-READY "
_HEADER = struct.Struct(">II")
MAX_HEADER_BYTES = 16 << 20
MAX_PAYLOAD_BYTES = 1 << 30


# --- frames -------------------------------------------------------------------------------------


async def read_frame(reader: asyncio.StreamReader) -> tuple[dict[str, Any], bytes]:
    """One frame; PeerUnavailable when the peer closed, ProtocolError when it is malformed."""
    try:
        head = await reader.readexactly(_HEADER.size)
        json_len, payload_len = _HEADER.unpack(head)
        if json_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
            raise ProtocolError(f"frame too large: {json_len} + {payload_len} bytes")
        doc = json.loads(await reader.readexactly(json_len))
        payload = await reader.readexactly(payload_len) if payload_len else b""
    except asyncio.IncompleteReadError as exc:
        raise PeerUnavailable("the peer closed the connection mid-frame") from exc
    except (ConnectionError, OSError) as exc:
        raise PeerUnavailable(f"connection lost: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame header is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ProtocolError("frame header must be a JSON object")
    return doc, payload


async def write_frame(writer: asyncio.StreamWriter, doc: dict[str, Any],
                      payload: bytes | memoryview = b"") -> None:
    body = json.dumps(doc, separators=(",", ":")).encode()
    writer.write(_HEADER.pack(len(body), len(payload)))
    writer.write(body)
    if payload:
        writer.write(payload)
    try:
        await writer.drain()
    except (ConnectionError, OSError) as exc:
        raise PeerUnavailable(f"connection lost: {exc}") from exc


def error_frame(exc: BaseException) -> dict[str, Any]:
    return {"event": "error", "error": type(exc).__name__, "message": str(exc)}


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process. ``daemon_address`` is the gRPC address of ``node_id``'s daemon."""

    role: EngineRole
    instance_id: str
    node_id: str
    daemon_address: str
    etcd_endpoint: str
    etcd_prefix: str = "/kvtier/"
    model_name: str = "ref-llama"
    spec: ModelSpec = field(default_factory=ModelSpec)
    model_path: Path | None = None
    """A local Hugging Face checkpoint directory to serve instead of the seeded reference model."""
    block_tokens: int = 64
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    torch_threads: int = 1
    kv_capacity_tokens: int = 1_000_000
    """Decode KV room announced to the conductor (decode role only)."""
    lease_ttl_s: int = 5
    device: str = "cpu"
    """Where the model, its KV and the layer-by-layer loads and saves live: ``cpu``, ``cuda``,
    ``cuda:N`` or ``auto`` (cuda when this machine has one, else cpu); see :func:`resolve_device`."""
    max_decode_batch: int = 64
    """Most sequences in one batched decode step (decode role); later ones wait to join."""

    def __post_init__(self) -> None:
        if not isinstance(self.role, EngineRole):
            raise InvalidArgument(f"role must be an EngineRole, got {self.role!r}")
        for name in ("block_tokens", "torch_threads", "kv_capacity_tokens", "lease_ttl_s",
                     "max_decode_batch"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"WorkerConfig.{name} must be positive")
        if not 0 <= self.listen_port < 65536:
            raise InvalidArgument(f"listen_port out of range: {self.listen_port}")
        if not _DEVICE_RE.fullmatch(self.device):
            raise InvalidArgument(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")


_DEVICE_RE = re.compile(r"cpu|auto|cuda(:[0-9]+)?")


def resolve_device(device: str) -> str:
    """The torch device a worker runs on, checked against this machine.

    ``auto`` is ``cuda`` when CUDA is available, else ``cpu``. An explicit ``cuda`` or
    ``cuda:N`` on a machine without CUDA (or without device ``N``) raises ConfigError: a worker
    never falls back to the CPU silently when it was asked for a GPU.
    """
    import torch

    if not _DEVICE_RE.fullmatch(device):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if device == "cpu":
        return device
    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available on this "
                          f"machine (torch {torch.__version__}, cuda build "
                          f"{torch.version.cuda or 'none'}); use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def load_worker_model(cfg: WorkerConfig, device: str = "cpu") -> Any:
    """The model a worker serves, on ``device`` (already resolved): a real checkpoint when
    ``cfg.model_path`` is set, else the reference Llama built from ``cfg.spec`` (random weights
    from its seed)."""
    from kvstore.engine.model import build_reference_model, load_model

    if cfg.model_path is not None:
        return load_model(cfg.model_path, device=device)
    return build_reference_model(cfg.spec).to(device)


# --- the shared part ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _PrefillOutcome:
    first_token: int
    tail: bytes
    tail_tokens: int
    full_blocks: int
    reused_tokens: int
    computed_tokens: int
    local_lookup_blocks: int
    load_s: float
    compute_s: float
    save_s: float
    loaded_bytes: int
    """Loaded from the own daemon and the fetch plan's node together."""
    stored_bytes: int
    """Put into the own daemon: new blocks and fetched blocks replicated."""
    load_tiers: dict[str, int]
    fetch_plan_blocks: int = 0
    """Blocks the fetch plan offered beyond the own daemon's prefix (0: no plan)."""
    fetched_blocks: int = 0
    """Blocks that came from the plan's node."""
    fetched_bytes: int = 0
    fetch_node: str = ""


@dataclass(frozen=True, slots=True)
class _DecodeOutcome:
    tokens: list[int]
    loaded_blocks: int
    recomputed_tokens: int
    loaded_bytes: int
    load_s: float
    """Arrival at this worker to joining the decode batch (KV load, tail, any recompute)."""
    decode_s: float
    tpot_s: float
    batch_mean: float
    """Mean decode batch size over this request's steps."""


class _Worker:
    """Model, KV clients, conductor reports and the etcd record; subclasses serve requests."""

    def __init__(self, config: WorkerConfig) -> None:
        """Record settings; :meth:`start` loads the model and opens everything."""
        self.config = config
        self._model: Any = None
        self._layout: KVLayout | None = None
        self._clients: dict[tuple[str, str], KVClient] = {}
        self._compute = cf.ThreadPoolExecutor(1, thread_name_prefix=f"{config.role.value}-compute")
        self._conductor: ConductorClient | None = None
        self._etcd: Any = None
        self._lease: Any = None
        self._record: EngineRecord | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None
        self.address = ""
        self._queued_tokens = 0
        self._active = 0
        self.device = "cpu"
        """The resolved torch device (set by :meth:`start`)."""

    @property
    def model(self) -> Any:
        return self._model

    @property
    def layout(self) -> KVLayout:
        assert self._layout is not None, "start() first"
        return self._layout

    def kv_client(self, address: str, tenant: str) -> KVClient:
        """One KVClient per (daemon, tenant), connected on first use (compute thread only)."""
        from kvstore.client.kv_client import KVClient
        from kvstore.client.kvlayout import namespace_for

        client = self._clients.get((address, tenant))
        if client is None:
            client = KVClient.connect(address, self.layout,
                                      namespace_for(self.layout, self.config.model_name, tenant))
            self._clients[(address, tenant)] = client
        return client

    async def start(self) -> str:
        import torch

        from kvstore.client.conductor_client import ConductorClient
        from kvstore.client.kvlayout import KVLayout, namespace_for
        from kvstore.membership.engines import put_engine_record
        from kvstore.membership.etcd import KeyLayout, etcd_client
        cfg = self.config
        self.device = resolve_device(cfg.device)
        torch.set_num_threads(cfg.torch_threads)
        loop = asyncio.get_running_loop()
        self._model = await loop.run_in_executor(self._compute, load_worker_model, cfg,
                                                 self.device)
        self._layout = KVLayout.for_model(self._model, cfg.block_tokens)
        self._server = await asyncio.start_server(self._serve, cfg.listen_host, cfg.listen_port)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"{host}:{port}"
        layout = KeyLayout(cfg.etcd_prefix)
        self._conductor = ConductorClient(etcd_endpoint=cfg.etcd_endpoint, layout=layout)
        self._etcd = etcd_client(cfg.etcd_endpoint)
        self._lease = await self._etcd.lease(cfg.lease_ttl_s)
        self._record = EngineRecord(
            cfg.instance_id, cfg.role, cfg.model_name, cfg.node_id,
            kv_capacity_tokens=cfg.kv_capacity_tokens if cfg.role is EngineRole.DECODE else 0,
            address=self.address,
            kv_fingerprint=namespace_for(self.layout, cfg.model_name).fingerprint)
        await put_engine_record(self._etcd, self._record, layout=layout, lease_id=self._lease.id)
        self._spawn(self._keepalive())
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._lease is not None:
            with contextlib.suppress(Exception):  # etcd may be gone first; the TTL then ends it
                await asyncio.wait_for(self._lease.revoke(), 2.0)
        if self._etcd is not None:
            with contextlib.suppress(Exception):  # closing a client of a dead etcd
                await self._etcd.close()
        if self._conductor is not None:
            await self._conductor.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._close_clients)

    def _close_clients(self) -> None:
        self._compute.shutdown(wait=True)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keepalive(self) -> None:
        """Refresh the lease every TTL/3. When etcd says the lease is gone (it lapsed while
        this process or etcd was stalled: the record was deleted with it), register again
        under a new lease, so the conductor sees the worker again."""
        period_s = self.config.lease_ttl_s / 3
        while True:
            await asyncio.sleep(period_s)
            try:
                reply = await asyncio.wait_for(self._lease.refresh(), period_s)
                if reply is not None and int(reply.TTL) <= 0:
                    await self._register_again()
            except (aetcd.ClientError, grpc.RpcError, TimeoutError, KvtierError) as exc:
                # etcd down: keep trying; the record lapses with the lease if it stays down
                log.warning("engine lease refresh failed: %s", exc)

    async def _register_again(self) -> None:
        from kvstore.membership.engines import put_engine_record
        from kvstore.membership.etcd import KeyLayout

        log.warning("engine lease %s expired; registering %s again", self._lease.id,
                    self.config.instance_id)
        self._lease = await self._etcd.lease(self.config.lease_ttl_s)
        assert self._record is not None
        await put_engine_record(self._etcd, self._record,
                                layout=KeyLayout(self.config.etcd_prefix), lease_id=self._lease.id)

    def _report(self, coro: Any) -> None:
        """Send a report to the conductor in the background; failures are logged only."""
        async def send() -> None:
            try:
                await coro
            except KvtierError as exc:
                log.warning("conductor report failed: %s", exc)
        self._spawn(send())

    def _report_load(self) -> None:
        assert self._conductor is not None
        if self.config.role is EngineRole.PREFILL:
            call = self._conductor.report_load(self.config.instance_id,
                                               queued_prefill_tokens=self._queued_tokens)
        else:
            call = self._conductor.report_load(self.config.instance_id,
                                               running_decode_batch=self._active,
                                               kv_used_tokens=self._queued_tokens)
        self._report(call)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            doc, payload = await read_frame(reader)
            await self.handle(doc, payload, writer)
        except KvtierError as exc:
            log.warning("request failed: %s: %s", type(exc).__name__, exc)
            with contextlib.suppress(KvtierError):
                await write_frame(writer, error_frame(exc))
        except Exception as exc:  # a bug (torch, transformers): the caller must hear of it
            log.exception("request failed with an unexpected error")
            with contextlib.suppress(KvtierError):
                await write_frame(writer, error_frame(InvariantViolation(
                    f"worker {self.config.instance_id}: {type(exc).__name__}: {exc}")))
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()

    async def handle(self, doc: dict[str, Any], payload: bytes,
                     writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


def _field(doc: dict[str, Any], name: str, kind: type) -> Any:
    value = doc.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidArgument(f"field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def _token_ids(doc: dict[str, Any]) -> list[int]:
    ids = _field(doc, "token_ids", list)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidArgument("token_ids must be a non-empty list of ints")
    return list(ids)


# --- prefill ------------------------------------------------------------------------------------


class PrefillWorker(_Worker):
    """Serves ``generate``: prefill with reuse, save, hand the request to the decode worker."""

    async def handle(self, doc: dict[str, Any], payload: bytes,
                     writer: asyncio.StreamWriter) -> None:
        if doc.get("op") != "generate":
            raise InvalidArgument(f"a prefill worker serves 'generate', not {doc.get('op')!r}")
        token_ids = _token_ids(doc)
        tenant = _field(doc, "tenant", str)
        reuse = _field(doc, "reuse", bool)
        planned = _field(doc, "prefix_blocks", int)
        ticket = _field(doc, "ticket", int)
        decode_address = _field(doc, "decode_address", str)
        max_new_tokens = _field(doc, "max_new_tokens", int)
        if max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")
        fetch = _fetch_plan(doc)
        self._queued_tokens += len(token_ids)
        self._report_load()
        loop = asyncio.get_running_loop()
        received = time.time()
        try:
            out = await loop.run_in_executor(self._compute, self._prefill, token_ids, tenant,
                                             reuse, planned, fetch)
        except KvtierError:
            self._cancel(ticket)
            raise
        finally:
            self._queued_tokens -= len(token_ids)
            self._report_load()
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        assert self._conductor is not None
        self._report(self._conductor.report_completion(pb.CompletionReport(
            ticket=ticket, prefill=pb.PrefillDone(
                prefill_s=out.compute_s, computed_tokens=out.computed_tokens,
                reused_tokens=out.reused_tokens,
                transfer_s=out.load_s if out.fetched_blocks else 0.0,
                transferred_bytes=out.fetched_bytes))))
        stats = {k: v for k, v in asdict(out).items() if k not in ("tail", "first_token")}
        await write_frame(writer, {"event": "first_token", "token": out.first_token,
                                   "received_unix_s": received, "prefill": stats})
        # Hand over to the decode worker and relay its answer.
        try:
            d_reader, d_writer = await asyncio.open_connection(
                *decode_address.rsplit(":", 1))
        except OSError as exc:
            self._cancel(ticket)
            raise PeerUnavailable(f"decode worker {decode_address}: {exc}") from exc
        try:
            await write_frame(d_writer, {
                "op": "decode", "token_ids": token_ids, "tenant": tenant, "ticket": ticket,
                "first_token": out.first_token, "max_new_tokens": max_new_tokens,
                "kv_address": self.config.daemon_address, "full_blocks": out.full_blocks,
                "tail_tokens": out.tail_tokens}, out.tail)
            reply, _ = await read_frame(d_reader)
        finally:
            d_writer.close()
        await write_frame(writer, reply)

    def _cancel(self, ticket: int) -> None:
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        assert self._conductor is not None
        self._report(self._conductor.report_completion(
            pb.CompletionReport(ticket=ticket, cancelled=True)))

    def _prefill(self, token_ids: list[int], tenant: str, reuse: bool,
                 planned_blocks: int, fetch: RemoteFetch | None = None) -> _PrefillOutcome:
        """Load the reusable prefix (own daemon, then ``fetch``'s node for the blocks it holds
        beyond), compute the rest, save every full block the own daemon lacks."""
        import torch
        from transformers.cache_utils import DynamicCache

        from kvstore.client.layouts import ContiguousKV, HFCacheKV
        from kvstore.engine.remote import layered_cache

        lay = self.layout
        B = lay.block_tokens
        full = len(token_ids) // B
        reusable = min(full, (len(token_ids) - 1) // B) if reuse else 0
        client = self.kv_client(self.config.daemon_address, tenant)
        t0 = time.perf_counter()
        local = 0
        tiers: dict[str, int] = {}
        if reusable:
            match = client.lookup(token_ids[:reusable * B])
            local = match.blocks
            tiers = {k.value: v for k, v in match.by_tier.items()}
        fetch_end = min(reusable, fetch.end_block) if fetch is not None else 0
        remote = fetch if fetch is not None and fetch_end > local else None
        want = min(reusable, max(local, planned_blocks, fetch_end))
        handle: LoadHandle | None = None
        loaded = 0
        cache: Any = DynamicCache()
        if want:
            buffer = torch.empty((lay.num_layers, 2, lay.num_kv_heads, want * B, lay.head_dim),
                                 dtype=lay.dtype, device=self.device)
            # Blocks the own daemon lacks come from the plan's node, and are put into the own
            # daemon afterwards (replicate): the saves below chain onto them, and the decode
            # worker loads every full block from this node.
            handle = client.load(token_ids[:want * B], ContiguousKV(buffer, lay),
                                 remote=remote, replicate=remote is not None)
            loaded = handle.transferred()
            if loaded:
                cache = layered_cache(buffer, loaded * B, handle)
        t1 = time.perf_counter()
        saver = (client.begin_save(token_ids, HFCacheKV(cache, lay), first_block=loaded)
                 if full > loaded else None)
        hooks = []
        for index, layer in enumerate(self.model.model.layers):
            if loaded and handle is not None:
                def wait(_m: Any, _a: Any, index: int = index) -> None:
                    assert handle is not None
                    handle.wait_for_layer(index)
                hooks.append(layer.register_forward_pre_hook(wait))
            if saver is not None:
                def save(_m: Any, _a: Any, _o: Any, index: int = index) -> None:
                    assert saver is not None
                    saver.save_layer(index)
                hooks.append(layer.register_forward_hook(save))
        rest = torch.tensor([token_ids[loaded * B:]], dtype=torch.long, device=self.device)
        try:
            with torch.no_grad():
                # Only the last position's logits are needed (the lm_head over every prompt token
                # would be ~40% of this small model's prefill FLOPs).
                out = self.model(input_ids=rest, past_key_values=cache, use_cache=True,
                                 logits_to_keep=1)
        finally:
            for h in hooks:
                h.remove()
        t2 = time.perf_counter()
        load = handle.result() if handle is not None else None
        stored = 0
        if handle is not None and remote is not None:
            # The fetched blocks must be in the own daemon before the new blocks that chain
            # onto them are put (a chunk's parent must be cached).
            replicated = handle.replication()
            if replicated is not None:
                stored += replicated.stored_bytes
                if replicated.failed_blocks:
                    log.warning("replicating fetched blocks %s failed: %s",
                                replicated.failed_blocks, replicated.error)
        if saver is not None:
            result = saver.finish().result()
            stored += result.stored_bytes
            if result.failed_blocks:
                # The decode worker would find fewer blocks and recompute them: slower, not wrong.
                log.warning("save failed for blocks %s: %s", result.failed_blocks, result.error)
        t3 = time.perf_counter()
        past = out.past_key_values
        tail = torch.stack([torch.stack((past.layers[i].keys[0, :, full * B:],
                                         past.layers[i].values[0, :, full * B:]))
                            for i in range(lay.num_layers)]).cpu().contiguous()
        fetched = load.remote_blocks if load is not None else 0
        return _PrefillOutcome(
            first_token=int(torch.argmax(out.logits[0, -1])),
            # As bytes through a uint8 view: numpy has no bfloat16.
            tail=tail.view(torch.uint8).numpy().tobytes(),
            tail_tokens=len(token_ids) - full * B, full_blocks=full,
            reused_tokens=loaded * B, computed_tokens=len(token_ids) - loaded * B,
            local_lookup_blocks=local, load_s=t1 - t0, compute_s=t2 - t1, save_s=t3 - t2,
            loaded_bytes=load.loaded_bytes if load is not None else 0, stored_bytes=stored,
            load_tiers=tiers, fetch_plan_blocks=fetch_end - min(local, fetch_end),
            fetched_blocks=fetched, fetched_bytes=fetched * lay.chunk_bytes,
            fetch_node=fetch.node_id if fetch is not None else "")


def _fetch_plan(doc: dict[str, Any]) -> RemoteFetch | None:
    """The ``fetch`` field of a ``generate`` frame (see :func:`kvstore.engine.gateway.
    fetch_plan_doc`): None, or another node's blocks as a :class:`RemoteFetch`."""
    from kvstore.client.requests import RemoteFetch

    plan = doc.get("fetch")
    if plan is None:
        return None
    if not isinstance(plan, dict):
        raise InvalidArgument(f"field 'fetch' must be an object or null, got {plan!r}")
    return RemoteFetch(node_id=_field(plan, "src_node", str),
                       address=_field(plan, "src_address", str),
                       first_block=_field(plan, "first_block", int),
                       end_block=_field(plan, "end_block", int))


# --- decode -------------------------------------------------------------------------------------


class DecodeWorker(_Worker):
    """Serves ``decode``: load the prompt's KV through kvtier, append the tail, and decode
    greedily with continuous batching.

    Every request becomes a :class:`_DecodeJob` on the compute thread, which runs
    :meth:`_decode_loop`: between two steps it starts the loads of new arrivals (on the
    KVClient's executor, so they overlap the running batch's steps), moves every job whose load
    finished into the running batch (at most ``max_decode_batch``; later ones wait), runs one
    :class:`~kvstore.engine.batching.DecodeBatch` step over the whole batch (ragged KV: one
    left-padded batch cache, rebuilt only when a sequence joins or leaves) and answers the
    jobs that reached ``max_new_tokens``. Outputs equal one-request-at-a-time decoding token
    for token (tests/engine/test_cluster.py).
    """

    def __init__(self, config: WorkerConfig) -> None:
        """Record settings; :meth:`start` also starts the decode loop on the compute thread."""
        super().__init__(config)
        self._inbox: queue.SimpleQueue[_DecodeJob | None] = queue.SimpleQueue()
        self._loop_future: cf.Future[None] | None = None
        self._batch: DecodeBatch | None = None
        """The running sequences' batch (compute thread only)."""
        self.decode_batch_sizes: collections.Counter[int] = collections.Counter()
        """Decode steps per batch size since start (how much batching happened)."""

    async def start(self) -> str:
        address = await super().start()
        self._loop_future = self._compute.submit(self._decode_loop)
        self._loop_future.add_done_callback(_log_if_failed)
        return address

    async def stop(self) -> None:
        self._inbox.put(None)  # the loop fails what is left and returns; the executor joins it
        await super().stop()

    async def handle(self, doc: dict[str, Any], payload: bytes,
                     writer: asyncio.StreamWriter) -> None:
        if doc.get("op") != "decode":
            raise InvalidArgument(f"a decode worker serves 'decode', not {doc.get('op')!r}")
        token_ids = _token_ids(doc)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[_DecodeOutcome] = loop.create_future()
        job = _DecodeJob(
            token_ids=token_ids, tenant=_field(doc, "tenant", str),
            kv_address=_field(doc, "kv_address", str),
            full_blocks=_field(doc, "full_blocks", int),
            first_token=_field(doc, "first_token", int),
            tail_tokens=_field(doc, "tail_tokens", int), tail=payload,
            max_new_tokens=_field(doc, "max_new_tokens", int),
            deliver=functools.partial(_deliver, loop, answer), submitted_s=time.perf_counter())
        ticket = _field(doc, "ticket", int)
        B = self.layout.block_tokens
        if job.full_blocks != len(token_ids) // B or \
                job.tail_tokens != len(token_ids) - job.full_blocks * B:
            raise InvalidArgument("full_blocks/tail_tokens do not match the prompt")
        if len(payload) != job.tail_tokens * self.layout.bytes_per_token:
            raise InvalidArgument(f"tail KV has {len(payload)} bytes, expected "
                                  f"{job.tail_tokens * self.layout.bytes_per_token}")
        if job.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")
        self._active += 1
        self._queued_tokens += len(token_ids)
        self._report_load()
        try:
            self._inbox.put(job)
            out = await answer
        finally:
            self._active -= 1
            self._queued_tokens -= len(token_ids)
            self._report_load()
        from kvstore._proto.kvtier.v1 import conductor_pb2 as pb

        assert self._conductor is not None
        self._report(self._conductor.report_completion(pb.CompletionReport(
            ticket=ticket, decode=pb.DecodeDone(
                output_tokens=len(out.tokens), tpot_s=out.tpot_s,
                batch_size=max(1, round(out.batch_mean)),
                context_tokens=len(token_ids) + len(out.tokens)))))
        await write_frame(writer, {"event": "done", "decode": asdict(out)})

    # --- the compute thread -----------------------------------------------------------------

    def _decode_loop(self) -> None:
        """Continuous batching until the stop sentinel (see the class docstring)."""
        from kvstore.engine.batching import DecodeBatch

        self._batch = DecodeBatch(self.model)
        loading: list[_DecodeJob] = []
        running: list[_DecodeJob] = []
        stopping = False
        while not stopping:
            # Arrivals: wait for one only when there is nothing else to do.
            block = not loading and not running
            while True:
                try:
                    job = self._inbox.get(block=block)
                except queue.Empty:
                    break
                block = False
                if job is None:
                    stopping = True
                    break
                self._start_load(job, loading)
            if stopping:
                break
            if loading and not running:
                loading[0].wait_loaded()  # nothing to compute meanwhile
            for job in [j for j in loading if j.load_done()]:
                if len(running) >= self.config.max_decode_batch:
                    break
                loading.remove(job)
                self._join(job, running)
            if running:
                self._step(running)
        for job in loading + running:
            job.deliver(None, PeerUnavailable("the decode worker is stopping"))

    def _start_load(self, job: _DecodeJob, loading: list[_DecodeJob]) -> None:
        """Allocate the job's KV buffer and start loading its full blocks (returns at once)."""
        import torch

        from kvstore.client.layouts import ContiguousKV

        lay = self.layout
        try:
            job.buffer = torch.empty((lay.num_layers, 2, lay.num_kv_heads, len(job.token_ids),
                                      lay.head_dim), dtype=lay.dtype, device=self.device)
            if job.full_blocks:
                job.handle = self.kv_client(job.kv_address, job.tenant).load(
                    job.token_ids[:job.full_blocks * lay.block_tokens],
                    ContiguousKV(job.buffer, lay))
        except Exception as exc:  # daemon unreachable (PeerUnavailable) or a bug: this job only
            job.deliver(None, exc)
            return
        loading.append(job)

    def _join(self, job: _DecodeJob, running: list[_DecodeJob]) -> None:
        """A loaded job: append the tail KV (or recompute from the first missing block) and
        add it to the running batch (or answer it, when it wants one token)."""
        import torch

        from kvstore.engine.remote import layered_cache

        lay = self.layout
        B = lay.block_tokens
        n = len(job.token_ids)
        try:
            if job.handle is not None:
                result = job.handle.result()
                job.loaded, job.loaded_bytes = result.loaded_blocks, result.loaded_bytes
                if result.failed_blocks:
                    log.warning("decode load stopped at block %d (%s): recomputing",
                                job.loaded, result.error)
            assert job.buffer is not None
            if job.loaded == job.full_blocks:
                if job.tail_tokens:
                    shape = (lay.num_layers, 2, lay.num_kv_heads, job.tail_tokens, lay.head_dim)
                    job.buffer[:, :, :, job.full_blocks * B:] = torch.frombuffer(
                        bytearray(job.tail), dtype=lay.dtype).view(shape).to(self.device)
                job.cache = layered_cache(job.buffer, n, None)
            else:
                from transformers.cache_utils import DynamicCache

                cache = (layered_cache(job.buffer, job.loaded * B, None) if job.loaded
                         else DynamicCache())
                job.recomputed = n - job.loaded * B
                with torch.no_grad():
                    out = self.model(input_ids=torch.tensor([job.token_ids[job.loaded * B:]],
                                                            device=self.device),
                                     past_key_values=cache, use_cache=True, logits_to_keep=1)
                job.cache = out.past_key_values
        except Exception as exc:  # a bug (torch, transformers): this job only
            job.deliver(None, exc)
            return
        job.buffer = None  # the cache holds views of what it needs
        job.joined_s = time.perf_counter()
        if job.max_new_tokens == 1:
            job.deliver(job.outcome(job.joined_s), None)
        else:
            assert self._batch is not None
            self._batch.join(job, job.cache)  # the batch owns the KV from now on
            job.cache = None
            running.append(job)

    def _step(self, running: list[_DecodeJob]) -> None:
        """One token for every running job; answer the finished ones."""
        from kvstore.engine.batching import DecodeBatch

        assert self._batch is not None
        size = len(running)
        try:
            nxt = self._batch.step({job: job.tokens[-1] for job in running})
        except Exception as exc:  # a bug: every job of the batch hears of it
            for job in running:
                job.deliver(None, exc)
            running.clear()
            self._batch = DecodeBatch(self.model)
            return
        self.decode_batch_sizes[size] += 1
        now = time.perf_counter()
        for job in list(running):
            job.tokens.append(nxt[job])
            job.batch_sum += size
            if len(job.tokens) >= job.max_new_tokens:
                running.remove(job)
                self._batch.leave(job)
                job.deliver(job.outcome(now), None)


@dataclass(eq=False, slots=True)
class _DecodeJob:
    """One decode request inside the worker; fields after ``deliver`` belong to the compute
    thread."""

    token_ids: list[int]
    tenant: str
    kv_address: str
    full_blocks: int
    first_token: int
    tail_tokens: int
    tail: bytes
    max_new_tokens: int
    deliver: Callable[[_DecodeOutcome | None, BaseException | None], None]
    """Hands the outcome (or the error) to the request's event loop; thread-safe."""
    submitted_s: float = 0.0
    joined_s: float = 0.0
    buffer: Any = None
    handle: LoadHandle | None = None
    cache: Any = None
    tokens: list[int] = field(default_factory=list)
    loaded: int = 0
    loaded_bytes: int = 0
    recomputed: int = 0
    batch_sum: int = 0

    def __post_init__(self) -> None:
        self.tokens = [self.first_token]

    def load_done(self) -> bool:
        return self.handle is None or self.handle.done()

    def wait_loaded(self) -> None:
        if self.handle is not None:
            self.handle.result()

    def outcome(self, finish_s: float) -> _DecodeOutcome:
        steps = len(self.tokens) - 1
        decode_s = finish_s - self.joined_s
        return _DecodeOutcome(
            list(self.tokens), self.loaded, self.recomputed, self.loaded_bytes,
            self.joined_s - self.submitted_s, decode_s, decode_s / steps if steps else 0.0,
            self.batch_sum / steps if steps else 1.0)


def _deliver(loop: asyncio.AbstractEventLoop, answer: asyncio.Future[Any],
             value: Any, exc: BaseException | None) -> None:
    """Resolve ``answer`` on its loop from any thread (a no-op once it is resolved or the loop
    is closed: the request's connection is gone then)."""
    def resolve() -> None:
        if answer.done():
            return
        if exc is not None:
            answer.set_exception(exc)
        else:
            answer.set_result(value)
    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop is closed (shutdown): nobody waits for this answer
        log.debug("decode answer dropped: the event loop is closed")


def _log_if_failed(fut: cf.Future[None]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("the decode loop died", exc_info=fut.exception())


# --- process ------------------------------------------------------------------------------------


async def serve(config: WorkerConfig, *, ready: Any = None) -> None:
    """Run a worker until SIGTERM/SIGINT; ``ready(address)`` is called once it serves."""
    worker: _Worker = (PrefillWorker(config) if config.role is EngineRole.PREFILL
                       else DecodeWorker(config))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        address = await worker.start()
        if ready is not None:
            ready(address)
        await stop.wait()
    finally:
        await worker.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstore.engine.worker --role prefill|decode --instance-id ID --node-id N
    --daemon HOST:PORT --etcd URL [--prefix P] [--model-name M] [--spec-json J]
    [--block-tokens B] [--threads T] [--kv-capacity-tokens K] [--device cpu|cuda|cuda:N|auto]
    [--max-decode-batch N]``.

    Exit code 2 for a bad flag, a device this machine lacks included (``--device cuda``
    without CUDA is refused before anything starts, never run on the CPU instead)."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvstore.engine.worker")
    parser.add_argument("--role", required=True, choices=[r.value for r in EngineRole])
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--node-id", required=True)
    parser.add_argument("--daemon", required=True, help="gRPC address of the node's daemon")
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--prefix", default="/kvtier/")
    parser.add_argument("--model-name", default="ref-llama")
    parser.add_argument("--spec-json", default="{}", help="ModelSpec fields as JSON")
    parser.add_argument("--model-path", type=Path, default=None,
                        help="a local Hugging Face checkpoint (default: the seeded reference model)")
    parser.add_argument("--block-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-capacity-tokens", type=int, default=1_000_000)
    parser.add_argument("--device", default="cpu",
                        help="cpu (default), cuda, cuda:N, or auto (cuda when available)")
    parser.add_argument("--max-decode-batch", type=int, default=64,
                        help="most sequences per batched decode step (decode role)")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = WorkerConfig(
            role=EngineRole(args.role), instance_id=args.instance_id, node_id=args.node_id,
            daemon_address=args.daemon, etcd_endpoint=args.etcd, etcd_prefix=args.prefix,
            model_name=args.model_name, spec=ModelSpec(**json.loads(args.spec_json)),
            model_path=args.model_path,
            block_tokens=args.block_tokens, torch_threads=args.threads,
            kv_capacity_tokens=args.kv_capacity_tokens, device=args.device,
            max_decode_batch=args.max_decode_batch)
        resolve_device(config.device)  # refuse a missing GPU here, before anything starts
    except (KvtierError, TypeError, ValueError) as exc:
        print(f"kvstore.engine.worker: {exc}", file=sys.stderr)
        return 2

    def ready(address: str) -> None:
        print(READY_PREFIX + json.dumps({"instance_id": config.instance_id,
                                         "role": config.role.value, "address": address}),
              flush=True)

    try:
        asyncio.run(serve(config, ready=ready))
    except KvtierError as exc:
        print(f"kvstore.engine.worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

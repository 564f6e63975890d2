"""The decode worker: serves ``decode``: loads the prompt's full blocks through kvtier (from the
prefill node's daemon), appends the tail KV that came in the frame, and decodes greedily with
continuous batching (see :class:`DecodeWorker`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import functools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.engine.frames import write_frame
from kvstore.engine.worker.base import WorkerBase, doc_field, doc_token_ids
from kvstore.engine.worker.config import WorkerConfig
from kvstore.errors import InvalidArgument, PeerUnavailable

if TYPE_CHECKING:
    from kvstore.client.handles import LoadHandle
    from kvstore.engine.batching import DecodeBatch

log = logging.getLogger(__name__)

__all__ = ["DecodeWorker"]


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


class DecodeWorker(WorkerBase):
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
        token_ids = doc_token_ids(doc)
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[_DecodeOutcome] = loop.create_future()
        job = _DecodeJob(
            token_ids=token_ids, tenant=doc_field(doc, "tenant", str),
            kv_address=doc_field(doc, "kv_address", str),
            full_blocks=doc_field(doc, "full_blocks", int),
            first_token=doc_field(doc, "first_token", int),
            tail_tokens=doc_field(doc, "tail_tokens", int), tail=payload,
            max_new_tokens=doc_field(doc, "max_new_tokens", int),
            deliver=functools.partial(_deliver, loop, answer), submitted_s=time.perf_counter())
        ticket = doc_field(doc, "ticket", int)
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
                try:
                    job.handle = self.kv_client(job.kv_address, job.tenant).load(
                        job.token_ids[:job.full_blocks * lay.block_tokens],
                        ContiguousKV(job.buffer, lay))
                except PeerUnavailable as exc:  # the daemon is gone: recompute every block
                    log.warning("daemon %s unreachable, recomputing the prompt: %s",
                                job.kv_address, exc)
                    self.drop_kv_client(job.kv_address, job.tenant)
        except Exception as exc:  # a bug: this job only
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
                if result.error is not None:  # the daemon failed it: connect afresh next time
                    self.drop_kv_client(job.kv_address, job.tenant)
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


"""A colocated engine: prefill and decode on one model instance in one process, no kvtier.

The baseline that disaggregated serving ((c) and (d) of ``kvtier bench e2e``) is compared with.
It replays an open-loop arrival trace in real time and schedules iterations in one of two
:class:`SchedulerMode` s:

* ``CONTINUOUS_BATCHING`` (vLLM's default scheduler without chunking): an iteration prefills at
  most one waiting prompt *whole* (its first token comes from that prefill), then runs one
  batched decode step over every sequence that was already decoding.
* ``CHUNKED_PREFILL`` (SARATHI-Serve): an iteration has a budget of ``token_budget`` tokens;
  every running decode takes one, and the rest goes to chunks of waiting prompts in arrival
  order. A long prompt is prefilled over several iterations, its KV cache carried from chunk to
  chunk; its first token comes from the last chunk. The decodes and the chunks run as separate
  forward calls of the same iteration (the reference model is Hugging Face's, which has no
  fused ragged kernel); the budget, not the fusion, is what bounds an iteration's latency.

**Batched decode over ragged KV.** Each sequence prefills into its own one-sequence
``DynamicCache``; the running sequences decode in a :class:`kvstore.engine.batching.DecodeBatch`
(one left-padded batch cache kept across steps, 2-D mask, per-sequence positions; shared with
the disaggregated decode worker), which takes a sequence's cache when it starts decoding.
Greedy outputs equal those of a single-request reference token for token
(``tests/engine/test_colocated.py``).

Threading: an engine is used from one thread; :meth:`ColocatedEngine.serve` blocks until every
request is done. The constructor only records the model and the configuration.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvstore.engine.batching import DecodeBatch
from kvstore.errors import ConfigError, InvalidArgument

__all__ = ["ColocatedConfig", "ColocatedEngine", "ColocatedRequest", "ColocatedResult",
           "ForwardStats", "SchedulerMode", "reference_generate"]


class SchedulerMode(Enum):
    CONTINUOUS_BATCHING = "continuous_batching"
    CHUNKED_PREFILL = "chunked_prefill"


@dataclass(frozen=True, slots=True)
class ColocatedConfig:
    mode: SchedulerMode = SchedulerMode.CONTINUOUS_BATCHING
    token_budget: int = 256
    """Tokens per iteration in ``CHUNKED_PREFILL`` (decodes count one each); unused otherwise."""
    max_batch: int = 64
    """Most sequences decoding at once; later prompts wait before their prefill starts."""

    def __post_init__(self) -> None:
        if not isinstance(self.mode, SchedulerMode):
            raise ConfigError(f"ColocatedConfig.mode must be a SchedulerMode, not {self.mode!r}")
        if self.token_budget <= 0 or self.max_batch <= 0:
            raise ConfigError("token_budget and max_batch must be positive")
        if self.mode is SchedulerMode.CHUNKED_PREFILL and self.token_budget <= self.max_batch:
            raise ConfigError("token_budget must exceed max_batch, or a full batch of decodes "
                              "would leave no tokens for prefill chunks")


@dataclass(frozen=True, slots=True)
class ColocatedRequest:
    request_id: str
    token_ids: list[int]
    arrival_s: float
    """Seconds after the start of :meth:`ColocatedEngine.serve` at which the request arrives."""
    max_new_tokens: int

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise InvalidArgument("a prompt needs at least one token")
        if self.max_new_tokens < 1 or self.arrival_s < 0:
            raise InvalidArgument("max_new_tokens must be >= 1 and arrival_s >= 0")


@dataclass(frozen=True, slots=True)
class ColocatedResult:
    """One request's tokens and timings (seconds since the start of ``serve``)."""

    request_id: str
    tokens: list[int]
    arrival_s: float
    prefill_start_s: float
    first_token_s: float
    finish_s: float
    computed_tokens: int
    prefill_compute_s: float
    """Forward time of this request's prefill (all its chunks)."""
    prefill_chunks: int

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def queue_wait_s(self) -> float:
        """Arrival to the start of the first prefill forward (or chunk)."""
        return self.prefill_start_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        steps = len(self.tokens) - 1
        return (self.finish_s - self.first_token_s) / steps if steps > 0 else 0.0


@dataclass(slots=True)
class ForwardStats:
    """Where one :meth:`ColocatedEngine.serve` spent its forward time (seconds, wall clock).

    Lets a benchmark tell a slow schedule from slow forwards: on a shared machine a
    multi-threaded torch process slows down far more than its share when another process takes
    a core (the OpenMP threads of every op wait for the descheduled one; docs/engines.md).
    """

    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decode_s: float = 0.0
    """Batched decode steps, rebuilding the padded batch cache included."""
    pad_s: float = 0.0
    """Rebuilding the left-padded batch cache when sequences join or leave (part of
    ``decode_s``)."""

    @property
    def prefill_ms_per_token(self) -> float:
        return self.prefill_s / self.prefill_tokens * 1e3 if self.prefill_tokens else 0.0

    @property
    def decode_ms_per_step(self) -> float:
        return self.decode_s / self.decode_steps * 1e3 if self.decode_steps else 0.0


@dataclass(slots=True)
class _Sequence:
    request: ColocatedRequest
    cache: Any = None
    prefilled: int = 0
    tokens: list[int] = field(default_factory=list)
    prefill_start_s: float = -1.0
    first_token_s: float = 0.0
    prefill_compute_s: float = 0.0
    chunks: int = 0

    def result(self, finish_s: float) -> ColocatedResult:
        r = self.request
        return ColocatedResult(r.request_id, list(self.tokens), r.arrival_s, self.prefill_start_s,
                               self.first_token_s, finish_s, self.prefilled,
                               self.prefill_compute_s, self.chunks)


class ColocatedEngine:
    """Serve an arrival trace on one model (see the module docstring)."""

    def __init__(self, model: Any, config: ColocatedConfig | None = None) -> None:
        self.model = model
        self.config = config or ColocatedConfig()
        self.decode_batch_sizes: collections.Counter[int] = collections.Counter()
        """Decode steps per batch size in the last :meth:`serve` (how much batching happened)."""
        self.forward_stats = ForwardStats()
        """Forward time of the last :meth:`serve`."""
        self._batch: DecodeBatch | None = None

    # --- the loop ---------------------------------------------------------------------------

    def serve(self, requests: list[ColocatedRequest], *,
              on_done: Callable[[ColocatedResult], None] | None = None) -> list[ColocatedResult]:
        """Replay ``requests`` at their arrival times; results in the order of ``requests``.

        Blocks until all are done; sleeps while nothing has arrived. ``on_done`` is called (on
        this thread) as each request finishes.
        """
        cfg = self.config
        pending = collections.deque(sorted(requests, key=lambda r: r.arrival_s))
        waiting: collections.deque[_Sequence] = collections.deque()
        running: list[_Sequence] = []
        done: dict[str, ColocatedResult] = {}
        self.decode_batch_sizes.clear()
        self.forward_stats = ForwardStats()
        self._batch = DecodeBatch(self.model)
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        def finish(seq: _Sequence) -> None:
            res = seq.result(now())
            done[res.request_id] = res
            if on_done is not None:
                on_done(res)

        while pending or waiting or running:
            while pending and pending[0].arrival_s <= now():
                waiting.append(_Sequence(pending.popleft()))
            if not waiting and not running:
                time.sleep(max(0.0, pending[0].arrival_s - now()))
                continue
            decoding = list(running)  # sequences that join this iteration decode from the next
            if cfg.mode is SchedulerMode.CONTINUOUS_BATCHING:
                if waiting and len(running) < cfg.max_batch:
                    seq = waiting.popleft()
                    self._prefill_chunk(seq, len(seq.request.token_ids), now)
                    self._admit(seq, running, finish)
            else:
                budget = cfg.token_budget - len(decoding)
                while budget > 0 and waiting and len(running) < cfg.max_batch:
                    seq = waiting[0]
                    take = min(budget, len(seq.request.token_ids) - seq.prefilled)
                    self._prefill_chunk(seq, take, now)
                    budget -= take
                    if seq.prefilled == len(seq.request.token_ids):
                        waiting.popleft()
                        self._admit(seq, running, finish)
            if decoding:
                self._decode_step(decoding)
                for seq in decoding:
                    if len(seq.tokens) >= seq.request.max_new_tokens:
                        running.remove(seq)
                        finish(seq)
        return [done[r.request_id] for r in requests]

    @staticmethod
    def _admit(seq: _Sequence, running: list[_Sequence],
               finish: Callable[[_Sequence], None]) -> None:
        if len(seq.tokens) >= seq.request.max_new_tokens:
            finish(seq)
        else:
            running.append(seq)

    # --- forwards ---------------------------------------------------------------------------

    def _prefill_chunk(self, seq: _Sequence, n_tokens: int, now: Callable[[], float]) -> None:
        """Prefill the next ``n_tokens`` prompt tokens of ``seq`` on top of its cache; the last
        chunk's logits give the first token."""
        import torch
        from transformers.cache_utils import DynamicCache

        prompt = seq.request.token_ids
        chunk = prompt[seq.prefilled: seq.prefilled + n_tokens]
        start = now()
        if seq.prefill_start_s < 0:
            seq.prefill_start_s = start
        if seq.cache is None:
            seq.cache = DynamicCache()
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([chunk], dtype=torch.long),
                             past_key_values=seq.cache, use_cache=True, logits_to_keep=1)
        seq.cache = out.past_key_values
        seq.prefilled += len(chunk)
        seq.chunks += 1
        end = now()
        seq.prefill_compute_s += end - start
        self.forward_stats.prefill_tokens += len(chunk)
        self.forward_stats.prefill_s += end - start
        if seq.prefilled == len(prompt):
            seq.tokens.append(int(torch.argmax(out.logits[0, -1])))
            seq.first_token_s = end

    def _decode_step(self, seqs: list[_Sequence]) -> None:
        """One greedy token for each of ``seqs`` (each has >= 1 token and a full prompt cache)."""
        start = time.perf_counter()
        try:
            self._decode_forward(seqs)
        finally:
            self.forward_stats.decode_steps += 1
            self.forward_stats.decode_s += time.perf_counter() - start

    def _decode_forward(self, seqs: list[_Sequence]) -> None:
        batch = self._batch
        assert batch is not None, "serve() makes the batch"
        self.decode_batch_sizes[len(seqs)] += 1
        members = {s.request.request_id: s for s in seqs}
        for key in batch.members:
            if key not in members:
                batch.leave(key)  # finished at the previous step
        for key, seq in members.items():
            if key not in batch:
                batch.join(key, seq.cache)  # the batch owns its KV from now on
        pad_before = batch.pad_s
        nxt = batch.step({key: seq.tokens[-1] for key, seq in members.items()})
        self.forward_stats.pad_s += batch.pad_s - pad_before
        for key, seq in members.items():
            seq.tokens.append(nxt[key])


def reference_generate(model: Any, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens of one request alone: full prefill, then one decode per token (the
    single-request reference the engine's outputs must equal)."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids], dtype=torch.long), use_cache=True,
                    logits_to_keep=1)
        tokens = [int(torch.argmax(out.logits[0, -1]))]
        cache = out.past_key_values
        while len(tokens) < max_new_tokens:
            out = model(input_ids=torch.tensor([[tokens[-1]]], dtype=torch.long),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            tokens.append(int(torch.argmax(out.logits[0, -1])))
    return tokens

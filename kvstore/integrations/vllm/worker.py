"""The worker half of the connector (runs in vLLM's Worker process, one per TP rank).

Per step: ``start_load_kv`` starts one batched load (``KVClient.load_many``) of every request
the metadata names, into vLLM's own blocks through :class:`GuardedKV` (on the daemon's host and
for CPU blocks: one copy, straight out of the daemon's shared-memory arena into the blocks,
``CpuBlocksKV.scatter_chunks``, with no lease where the daemon's read index publishes the
chunks, and for a small step done before ``load_many`` returns; over TCP, or into GPU blocks:
fetched into staging, then scattered), and one batched save
(``begin_save_many``); ``wait_for_layer_load(l)`` waits (bounded by the step's load deadline)
until layer ``l`` is in; ``save_kv_layer(l)`` queues layer ``l``'s copy out of vLLM's blocks;
``wait_for_save`` waits for the copies (the puts run on after the step: the staging is ours;
puts not done within ``save_timeout_s`` are counted as failed and no longer tracked; each chunk
is committed atomically by the daemon, so a late or abandoned put never leaves half a block
visible);
``get_block_ids_with_load_errors`` names the vLLM blocks of every block that did not arrive
(missing, corrupt, daemon dead, timed out), and vLLM recomputes them. A load given up is closed
first, so it can never write a block vLLM recomputes. A request whose load failed this step is
not saved this step (its new KV was computed over the blocks that did not arrive): its save is
reported failed, its load by the first block that did not arrive, and the scheduler half saves
the recomputed blocks with a later step.

How each save and each failed load ended goes back to the scheduler half in ``build_connector_worker_meta``
(:class:`~kvstore.integrations.vllm.metadata.KvtierWorkerMetadata`): every save the metadata
named is reported once, as saved or failed (refused, daemon gone, skipped for want of a
daemon, copy failed, past ``save_timeout_s``), so the scheduler half can save a failed one
again. Saves never hold vLLM's blocks past the step (``get_finished`` has nothing to report).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.client.handles import BatchSave, DirectBatchSave, LoadHandle
from kvstore.client.kv_client import KVClient
from kvstore.client.kvlayout import KVLayout
from kvstore.client.requests import BlockKeys, LoadRequest, SaveRequest
from kvstore.errors import ConfigError, KvtierError
from kvstore.integrations.vllm.config import ConnectorConfig
from kvstore.integrations.vllm.layout import GuardedKV, engine_kv_for, layout_of
from kvstore.integrations.vllm.metadata import (
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadFailure,
    LoadSpec,
    SaveFailure,
    SaveSpec,
)
from kvstore.integrations.vllm.session import ClientSession
from kvstore.integrations.vllm.spec import ConnectorSpec
from kvstore.integrations.vllm.stats import KvtierConnectorStats

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["WorkerSide"]

CLIENT_ERRORS = (KvtierError, RuntimeError)
"""What a client call may raise here without a bug: a kvtier error, or RuntimeError ("cannot
schedule new futures after shutdown") from a client the session closed under this step after
its daemon failed (seen end to end: a daemon killed mid-batch killed vLLM's worker through
``save_kv_layer``)."""


@dataclass
class _Load:
    spec: LoadSpec
    guard: GuardedKV
    handle: LoadHandle | None  # None: never started (no daemon)
    given_up: bool = False


@dataclass
class _PendingSave:
    """One step's puts in flight: done (counted by the callback) or expired (counted failed at
    its deadline; a late result is then ignored), never both."""

    blocks: int
    deadline: float
    started: float
    client: KVClient
    specs: list[tuple[str, int, int]]
    """(req_id, seq, first_block) of each save of the step, in the order of the results."""
    settled: bool = False


class WorkerSide:
    def __init__(self, config: ConnectorConfig, spec: ConnectorSpec,
                 session: ClientSession) -> None:
        self.config = config
        self.spec = spec
        self.session = session
        self.kv_caches: list[torch.Tensor] = []
        self.layout: KVLayout | None = None
        self._layer_index = {name: i for i, name in enumerate(spec.layer_names)}
        self._loads: list[_Load] = []
        self._deadline = 0.0
        self._saver: BatchSave | DirectBatchSave | None = None
        self._saver_client: KVClient | None = None
        self._copies: list[cf.Future[None] | None] = []
        self._errors: set[int] = set()
        self._load_failed: set[str] = set()
        """Requests whose load failed this step (their save of the step is not put)."""
        self._save_blocks = 0
        self._save_tail: cf.Future[None] | None = None
        """Done when the last step's puts ended: the next step's start after it."""
        self._lock = threading.Lock()  # guards stats and _pending (put callbacks run on pool threads)
        self._pending: list[_PendingSave] = []
        self._save_specs: list[tuple[str, int, int]] = []
        self._report = KvtierWorkerMetadata()
        """Saves ended since the last build_connector_worker_meta (guarded by _lock)."""
        self.stats = KvtierConnectorStats()
        """This interval's loads and saves (vLLM takes them each step)."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.spec.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"kvtier connector: vLLM registered no KV cache for {missing}")
        self.kv_caches = [kv_caches[n] for n in self.spec.layer_names]
        self.layout = layout_of(self.kv_caches, self.spec.num_kv_heads, self.spec.head_dim,
                                self.spec.block_tokens)

    # --- loads ------------------------------------------------------------------------------

    def start_load_kv(self, meta: KvtierConnectorMetadata) -> None:
        self._finish_loads()  # a previous step's loads, if vLLM never asked for their errors
        self._load_failed = set()
        self._deadline = time.monotonic() + self.config.load_timeout_s
        if self.layout is None:
            raise ConfigError("kvtier connector: start_load_kv before register_kv_caches")
        client = self.session.get() if meta.loads else None
        loads = [_Load(s, GuardedKV(engine_kv_for(self.kv_caches, s.block_ids, self.layout)),
                       None) for s in meta.loads]
        if client is not None and loads:
            handles: list[LoadHandle | None]
            try:
                handles = list(client.load_many([
                    LoadRequest(BlockKeys(ld.spec.keys), ld.guard, ld.spec.first_block,
                                ld.spec.num_blocks) for ld in loads]))
            except CLIENT_ERRORS as exc:  # closed client, or a bad spec (a bug): recomputed
                log.error("kvtier connector: load_many refused: %s: %s", type(exc).__name__,
                          exc)
                handles = [None] * len(loads)
            for ld, h in zip(loads, handles, strict=True):
                ld.handle = h
        self._loads = loads
        self._start_save(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        for ld in self._loads:
            if ld.handle is None or ld.given_up:
                continue
            try:
                ld.handle.wait_for_layer(layer, max(0.0, self._deadline - time.monotonic()))
            except TimeoutError:
                self._give_up(ld, f"layer {layer} not loaded within "
                                  f"{self.config.load_timeout_s} s")

    def _give_up(self, ld: _Load, why: str) -> None:
        ld.guard.close()  # from here on the load cannot write vLLM's blocks
        ld.given_up = True
        log.warning("kvtier connector: load of %s given up: %s", ld.spec.req_id, why)

    def _finish_loads(self) -> None:
        """Collect the step's loads: every block that did not arrive becomes a load error."""
        loads, self._loads = self._loads, []
        longest_s = 0.0
        for ld in loads:
            failed: Sequence[int]
            spec = ld.spec
            if ld.handle is None:
                failed = range(spec.first_block, spec.first_block + spec.num_blocks)
            else:
                try:
                    res = ld.handle.result(max(0.0, self._deadline - time.monotonic())
                                           if not ld.given_up else 0.0)
                except cf.TimeoutError:
                    res = None
                if res is None or ld.given_up:
                    if not ld.given_up:
                        self._give_up(ld, "not done by the load deadline")
                    failed = range(spec.first_block, spec.first_block + spec.num_blocks)
                else:
                    failed = res.failed_blocks
                    longest_s = max(longest_s, res.transfer_s + res.scatter_s)
                    with self._lock:
                        self.stats.add("loaded_blocks", res.loaded_blocks)
                        self.stats.add("loaded_bytes", res.loaded_bytes)
                    if res.error and "PeerUnavailable" in res.error:
                        client = self.session.get()
                        if client is not None:
                            self.session.failed(client, res.error)
            with self._lock:
                self.stats.add("load_error_blocks", len(failed))
                self.stats.add("load_timeouts", int(ld.given_up))
            self._errors.update(spec.block_ids[b] for b in failed)
            if failed:
                self._load_failed.add(spec.req_id)
                with self._lock:
                    self._report.load_failed.append(LoadFailure(spec.req_id, min(failed)))
        if longest_s:
            with self._lock:
                self.stats.add("load_seconds", longest_s)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_loads()
        errors, self._errors = self._errors, set()
        return errors

    # --- saves ------------------------------------------------------------------------------

    def _failed(self, specs: Sequence[tuple[str, int, int]], blocks: int = 0) -> None:
        """Report ``specs`` (req_id, seq, first_block) as not saved (caller holds _lock)."""
        self._report.failed.extend(SaveFailure(r, q, f) for r, q, f in specs)
        self.stats.add("save_failed_blocks", blocks)

    def _start_save(self, meta: KvtierConnectorMetadata) -> None:
        self._saver, self._saver_client, self._copies = None, None, []
        self._expire_saves()
        self._save_specs = [(s.req_id, s.seq, s.first_block) for s in meta.saves]
        if not meta.saves or self.layout is None:
            return
        client = self.session.get()
        if client is None:  # no daemon now: not saved (the scheduler half tries again)
            with self._lock:
                self._failed(self._save_specs, _blocks(meta.saves))
            return
        try:
            self._saver = client.begin_save_many([
                SaveRequest(BlockKeys(s.keys), engine_kv_for(self.kv_caches, s.block_ids,
                                                             self.layout), s.first_block)
                for s in meta.saves])
        except CLIENT_ERRORS as exc:
            log.error("kvtier connector: begin_save_many refused: %s: %s", type(exc).__name__,
                      exc)
            with self._lock:
                self._failed(self._save_specs, _blocks(meta.saves))
            return
        self._saver_client = client
        self._save_blocks = _blocks(meta.saves)
        self._copies = [None] * self.spec.num_layers

    def _drop_save(self, exc: BaseException) -> None:
        """This step's save cannot go on (its client was closed under it): not saved."""
        log.warning("kvtier connector: a step's save dropped: %s: %s", type(exc).__name__, exc)
        for fut in self._copies:
            if fut is not None:
                fut.cancel()
        self._saver, self._copies = None, []
        with self._lock:
            self._failed(self._save_specs, self._save_blocks)

    def save_kv_layer(self, layer_name: str) -> None:
        layer = self._layer_index.get(layer_name)
        if self._saver is None or layer is None or self._copies[layer] is not None:
            return
        try:
            self._copies[layer] = self._saver.save_layer(layer)
        except CLIENT_ERRORS as exc:  # never into vLLM's forward
            self._drop_save(exc)

    def wait_for_save(self) -> None:
        saver = self._saver
        if saver is None:
            return
        # The forward waited for every layer of the loads: collect them now, so that the KV a
        # request computed over blocks that did not arrive is never put.
        self._finish_loads()
        skip = [i for i, (req_id, _seq, _first) in enumerate(self._save_specs)
                if req_id in self._load_failed]
        for layer, fut in enumerate(self._copies):
            if fut is None:  # a layer vLLM did not hand over: copy it now
                try:
                    self._copies[layer] = saver.save_layer(layer)
                except CLIENT_ERRORS as exc:
                    self._drop_save(exc)
                    return
        self._saver = None
        copies, self._copies = self._copies, []
        try:
            for fut in copies:
                assert fut is not None
                fut.result()  # local copies out of vLLM's blocks; they raise only on a bug
        except Exception:  # never into vLLM's engine loop: this step's blocks are not saved
            log.exception("kvtier connector: copying a step's blocks for saving failed")
            for fut in copies:
                if fut is not None:
                    fut.cancel()
            with self._lock:
                self._failed(self._save_specs, self._save_blocks)
            return
        now = time.monotonic()
        assert self._saver_client is not None
        pending = _PendingSave(self._save_blocks, now + self.config.save_timeout_s, now,
                               self._saver_client, self._save_specs)
        with self._lock:
            self._pending.append(pending)
            prev, done = self._save_tail, cf.Future()  # type: ignore[var-annotated]
            self._save_tail = done

        def finished(fut: cf.Future[list]) -> None:  # type: ignore[type-arg]
            try:
                self._saved(pending, fut)
            finally:
                done.set_result(None)

        def launch(_prev: object = None) -> None:
            try:
                fut = saver.finish(skip)
            except Exception as exc:  # never into vLLM's engine loop
                log.exception("kvtier connector: starting a step's save failed")
                fut = cf.Future()
                fut.set_exception(exc)
            fut.add_done_callback(finished)

        # One step's puts at a time: the next step's blocks are children of this step's, and a
        # child put before its parent landed is refused (the prefix rule): seen end to end as a
        # cold instance finding 3 of 4 blocks.
        if prev is None:
            launch()
        else:
            prev.add_done_callback(launch)

    def _saved(self, pending: _PendingSave, fut: cf.Future[list]) -> None:  # type: ignore[type-arg]
        now = time.monotonic()
        elapsed_s = now - pending.started
        try:
            results = fut.result()
        except CLIENT_ERRORS as exc:
            log.warning("kvtier connector: save failed: %s: %s", type(exc).__name__, exc)
            results = None
        with self._lock:
            late = pending.settled
            pending.settled = True
            if not late:
                self._pending.remove(pending)
                if now >= pending.deadline:  # ended past its deadline before anyone looked
                    late = True
                    self.stats.add("save_timeouts")
                    self._failed(pending.specs, pending.blocks)
                elif results is None:
                    self._failed(pending.specs, pending.blocks)
                else:
                    # gather_s: the step's copies out of vLLM's blocks (one figure per step)
                    self.stats.add("save_seconds",
                                   (results[0].gather_s if results else 0.0) + elapsed_s)
                    for r, (req_id, seq, _first) in zip(results, pending.specs, strict=True):
                        self.stats.add("saved_blocks", len(r.stored_blocks))
                        self.stats.add("saved_bytes", r.stored_bytes)
                        if r.failed_blocks:
                            self._failed([(req_id, seq, min(r.failed_blocks))],
                                         len(r.failed_blocks))
                        else:
                            self._report.saved.append((req_id, seq))
        if late:
            log.info("kvtier connector: a save given up at save_timeout_s ended after %.1f s",
                     elapsed_s)
        for r in results or ():
            if r.error and "PeerUnavailable" in r.error:
                self.session.failed(pending.client, r.error)
                break

    def _expire_saves(self, now: float | None = None) -> None:
        """Count the puts past ``save_timeout_s`` as failed; their results are ignored."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [p for p in self._pending if now >= p.deadline]
            for p in expired:
                p.settled = True
                self._pending.remove(p)
                self.stats.add("save_timeouts")
                self._failed(p.specs, p.blocks)
        for p in expired:
            log.warning("kvtier connector: %d blocks not saved within save_timeout_s=%s: "
                        "counted as failed", p.blocks, self.config.save_timeout_s)

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        """How the saves that ended since the last call ended, and the step's failed loads
        (None: nothing to report)."""
        self._expire_saves()
        with self._lock:
            report = self._report
            if not report.saved and not report.failed and not report.load_failed:
                return None
            self._report = KvtierWorkerMetadata()
        return report

    def take_stats(self) -> KvtierConnectorStats | None:
        self._expire_saves()
        with self._lock:
            return self.stats.take()

    def saves_in_flight(self) -> int:
        """Saves neither done nor past ``save_timeout_s``."""
        self._expire_saves()
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Collect the loads; wait for the saves in flight until their deadlines at most."""
        self._finish_loads()
        while True:
            with self._lock:
                left = [p.deadline for p in self._pending]
            if not left:
                break
            time.sleep(min(0.05, max(0.0, min(left) - time.monotonic())))
            self._expire_saves()
        self.session.close()


def _blocks(saves: Sequence[SaveSpec]) -> int:
    return sum(len(s.keys) - s.first_block for s in saves)

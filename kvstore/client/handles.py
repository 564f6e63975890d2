"""Transfers in flight: a load's :class:`LoadHandle`, a save fed layer by layer
(:class:`LayerwiseSave`) and one engine step's saves together (:class:`BatchSave`, or
:class:`DirectBatchSave` where the step's sources can write the daemon's arena themselves).

The :class:`~kvstore.client.kv_client.KVClient` makes them and runs their work on its executor;
the engine waits on them. Every method is safe from any thread. A load handle is completed by
the client alone (the underscore methods below are the client's side of it); a save's copies
and puts run on the client's threads, and its staging buffers return to the client's pool when
the puts are done.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvstore.client.layouts import EngineKV, strided_runs
from kvstore.client.results import LoadResult, SaveResult
from kvstore.errors import InvalidArgument, KvtierError
from kvstore.keys import PrefixKey

if TYPE_CHECKING:
    import torch

    from kvstore.client.kv_client import KVClient
    from kvstore.dataplane.transport.shm import ShmBatchWrite

__all__ = ["BatchSave", "ChainBatch", "DirectBatchSave", "LayerwiseSave", "LoadHandle"]


class LoadHandle:
    """A load in flight. ``transferred()`` waits until the chunks are fetched (and says how
    many arrived); ``wait_for_layer(l)`` until layer ``l`` is in the destination;
    ``result()`` until everything is done. All three are safe from any thread."""

    def __init__(self, num_layers: int, first_block: int, requested_blocks: int) -> None:
        # Layers become ready in order (every load path copies layer-major, or all layers at
        # once), so one count under one condition says which are in: not one Event per layer,
        # whose making and setting was ~20 us of a 15-block load's ~1 ms.
        self._num_layers = num_layers
        self._layers_in = 0
        """Layers ``0 .. _layers_in - 1`` are in the destination (written under ``_cond``)."""
        self._cond = threading.Condition(threading.Lock())
        self._fetched: cf.Future[int] = cf.Future()
        self._done: cf.Future[LoadResult] = cf.Future()
        self._replicated: cf.Future[SaveResult | None] = cf.Future()
        self._remote_blocks = 0  # written before _fetched completes, read after
        self.first_block = first_block
        self.requested_blocks = requested_blocks

    def transferred(self, timeout_s: float | None = None) -> int:
        """How many leading blocks arrived from the store (the count the result will carry)."""
        return self._fetched.result(timeout_s)

    def transferred_remote(self, timeout_s: float | None = None) -> int:
        """How many of the :meth:`transferred` blocks (the last ones) came from another node:
        the own daemon lacks them, so a save that follows should start before them."""
        self._fetched.result(timeout_s)
        return self._remote_blocks

    def wait_for_layer(self, layer: int, timeout_s: float | None = None) -> None:
        """Block until layer ``layer`` of every loaded block is in the destination."""
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"layer {layer} outside [0, {self._num_layers})")
        if self._layers_in > layer:  # in already (an int read; the count only grows)
            return
        with self._cond:
            if not self._cond.wait_for(lambda: self._layers_in > layer, timeout_s):
                raise TimeoutError(f"layer {layer} not loaded within {timeout_s} s")

    def _layers_ready(self, n: int | None = None) -> None:
        """Layers ``0 .. n - 1`` (None: all) are in the destination; callers report them in
        layer order."""
        n = self._num_layers if n is None else n
        with self._cond:
            if n > self._layers_in:
                self._layers_in = n
                self._cond.notify_all()

    def result(self, timeout_s: float | None = None) -> LoadResult:
        return self._done.result(timeout_s)

    def done(self) -> bool:
        return self._done.done()

    def replication(self, timeout_s: float | None = None) -> SaveResult | None:
        """After a remote load with ``replicate``: how putting the fetched blocks into the local
        daemon went (waits for it). None when nothing was to be replicated."""
        self._done.result(timeout_s)
        return self._replicated.result(timeout_s)

    def _finish(self, result: LoadResult) -> None:
        if not self._fetched.done():
            self._fetched.set_result(result.loaded_blocks)
        self._layers_ready()
        self._done.set_result(result)

    def _finish_replication(self, result: SaveResult | None) -> None:
        if not self._replicated.done():
            self._replicated.set_result(result)

    def _fail(self, error: str) -> None:
        """End a handle whose load hit a bug: every block failed, every layer released."""
        if not self.done():
            first, n = self.first_block, self.requested_blocks
            self._finish(LoadResult(first, n, 0, tuple(range(first, first + n)), error, 0, 0.0,
                                    0.0))
        self._finish_replication(None)


class LayerwiseSave:
    """A save fed layer by layer: ``save_layer(l)`` after the engine wrote layer ``l``'s KV of
    the blocks being saved; ``finish()`` once every layer was given. Layer copies run on the
    client's executor while the engine computes the next layer; the chunks are put when all
    layers are in (a chunk is all layers of one block). Dropping a save unfinished stores
    nothing."""

    def __init__(self, client: KVClient, keys: list[PrefixKey], first_block: int,
                 source: EngineKV) -> None:
        self._client = client
        self._keys = keys
        self._first_block = first_block
        self._source = source
        layout = client.layout
        n = len(keys) - first_block
        self._blocks = range(first_block, len(keys))
        self._staging, self._buffer = client._staging.acquire(max(n, 0))
        self._copies: list[cf.Future[None] | None] = [None] * layout.num_layers
        self._gather_s = [0.0] * layout.num_layers
        self._finished: cf.Future[SaveResult] | None = None

    @property
    def blocks(self) -> range:
        return self._blocks

    def save_layer(self, layer: int) -> cf.Future[None]:
        """Copy layer ``layer`` out of the source in the background. Raises InvalidArgument
        for a layer out of range or given twice."""
        _check_layer(layer, self._copies, self._finished)

        def copy() -> None:
            t0 = time.perf_counter()
            if len(self._blocks):
                self._source.gather_layer(layer, self._blocks, self._staging[:, layer])
            self._gather_s[layer] = time.perf_counter() - t0

        fut = self._client._pool.submit(copy)
        self._copies[layer] = fut
        return fut

    def finish(self) -> cf.Future[SaveResult]:
        """Put the chunks once every layer's copy is done; the future's SaveResult says which
        blocks were stored. Raises InvalidArgument when a layer was never given."""
        missing = [i for i, c in enumerate(self._copies) if c is None]
        if missing:
            raise InvalidArgument(f"layers {missing} were never saved")
        if self._finished is None:
            copies = [c for c in self._copies if c is not None]

            def put() -> SaveResult:
                for c in copies:
                    c.result()  # a copy that raised (a bug or bad shapes) raises here
                try:
                    return self._client._put_chain(self._keys, self._first_block, self._staging,
                                                   sum(self._gather_s))
                finally:
                    self._client._staging.release(self._buffer)

            self._finished = self._client._pool.submit(put)
        return self._finished


class BatchSave:
    """Layer-by-layer saves of several requests (one engine step) that share one staging
    buffer, one copy task per layer and one flush.

    ``save_layer(l)`` queues one task that copies layer ``l`` of every request's blocks out of
    the engine's buffers; ``finish()`` puts every request's chunks once all layers are in (one
    flush task per worker thread, each for a share of the requests), and its future gives one
    :class:`SaveResult` per request, in order. A refusal stops
    that request's chain only (the others are still put). Same ownership rules as
    :class:`LayerwiseSave`: after ``save_layer(l)``'s future, the engine may overwrite layer
    ``l`` of the sources (vLLM's ``wait_for_save`` = every layer's copy future done). Each flush
    puts its share of the requests in one ``put_many`` (one pipelined exchange over shared
    memory)."""

    def __init__(self, client: KVClient,
                 parts: list[tuple[list[PrefixKey], int, EngineKV]]) -> None:
        self._client = client
        self._parts = parts
        # One pooled staging buffer per request (as in load_many: request-sized buffers are
        # the ones the pool holds; one for the whole step was a fresh allocation each time).
        self._held = [client._staging.acquire(len(keys) - first) for keys, first, _s in parts]
        self._copies: list[cf.Future[None] | None] = [None] * client.layout.num_layers
        self._gather_s = [0.0] * client.layout.num_layers
        self._finished: cf.Future[list[SaveResult]] | None = None

    def save_layer(self, layer: int) -> cf.Future[None]:
        """Copy layer ``layer`` of every request out of its source in the background. Raises
        InvalidArgument for a layer out of range or given twice."""
        _check_layer(layer, self._copies, self._finished)

        def copy() -> None:
            t0 = time.perf_counter()
            for (keys, first, source), (view, _buf) in zip(self._parts, self._held,
                                                            strict=True):
                if len(keys) > first:
                    source.gather_layer(layer, range(first, len(keys)), view[:, layer])
            self._gather_s[layer] = time.perf_counter() - t0

        fut = self._client._pool.submit(copy)
        self._copies[layer] = fut
        return fut

    def finish(self, skip: Collection[int] = ()) -> cf.Future[list[SaveResult]]:
        """Put every request's chunks once every layer's copy is done, but those of the
        requests at the indices ``skip``: nothing of theirs is put, their results fail every
        block ("skipped"). Raises InvalidArgument when a layer was never given."""
        missing = [i for i, c in enumerate(self._copies) if c is None]
        if missing:
            raise InvalidArgument(f"layers {missing} were never saved")
        if self._finished is None:
            copies = [c for c in self._copies if c is not None]
            skipped = frozenset(skip)

            def put(group: list[int]) -> list[SaveResult]:
                try:
                    for c in copies:  # queued before this task: running or done, not waiting
                        c.result()
                    gather_s = sum(self._gather_s)
                    saving = [i for i in group if i not in skipped]
                    saved = dict(zip(saving, self._client._put_chains(
                        [(self._parts[i][0], self._parts[i][1], self._held[i][0])
                         for i in saving], gather_s), strict=True))
                    return [saved[i] if i in saved else _skipped(self._parts[i], gather_s)
                            for i in group]
                finally:
                    for i in group:
                        self._client._staging.release(self._held[i][1])

            # One flush per worker thread (requests split by blocks), as N single saves run.
            groups = split_even([len(k) - f for k, f, _s in self._parts],
                                 self._client.config.workers)
            self._finished = _gather_futures(
                [self._client._pool.submit(put, g) for g in groups])
        return self._finished

class DirectBatchSave:
    """One engine step's saves in one copy (same host, sources with ``gather_chunks``).

    The step's new chunks are reserved in the daemon's arena when the save begins (one
    RESERVE_MANY exchange on the client's writer connection,
    :mod:`kvstore.dataplane.transport.shm.writes`); ``save_layer(l)`` copies layer ``l`` of
    every request straight out of the engine's buffers into the reserved ranges; ``finish()``
    commits them all (one COMMIT_MANY). A layer whose copy runs before the reservation is
    granted (a slow or stopped daemon) is copied into staging rows instead, as
    :class:`BatchSave` does, and from there into the reserved ranges before the commit: the
    engine's buffers are always read within the step, and no copy ever waits for the daemon.
    The daemon exchanges run on the client's save thread, never on the executor the copies
    need. Same interface, ownership rules and results as :class:`BatchSave`; a block two
    requests of the step share is reserved once and written from the first of them. Nothing
    reserved becomes visible unless every layer of it was written: a copy that raised, a batch
    past its reservations' margin, or a skipped request aborts those chunks."""

    def __init__(self, client: KVClient,
                 parts: list[tuple[list[PrefixKey], int, EngineKV]]) -> None:
        self._client = client
        self._parts = parts
        self._batch = ChainBatch([(keys, first) for keys, first, _s in parts])
        # Per request, the (block, item) pairs it writes: the chunks it owns that were
        # reserved. Filled by the reservation, read once it is done.
        self._targets: list[list[tuple[int, int]]] = []
        self._chunks: list[torch.Tensor | None] = []
        self._late = False  # a copy found the reservations past their margin: not committed
        self._lock = threading.Lock()
        self._staged: set[int] = set()  # layers copied into staging rows
        self._held: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._reserved = client._save_thread().submit(self._reserve)
        self._copies: list[cf.Future[None] | None] = [None] * client.layout.num_layers
        self._gather_s = [0.0] * client.layout.num_layers
        self._finished: cf.Future[list[SaveResult]] | None = None

    @property
    def reservation(self) -> cf.Future[ShmBatchWrite | None]:
        """The reservation of the step's chunks (None: nothing new to save). An engine never
        waits for it; a layer handed over before it is granted goes through staging."""
        return self._reserved

    def _reserve(self) -> ShmBatchWrite | None:
        batch = self._batch
        if not batch.keys:
            return None
        lay = self._client.layout
        reserved = self._client._writer().reserve(
            batch.keys, [lay.chunk_bytes] * len(batch.keys), batch.parents)
        self._chunks = reserved.tensors(lay.dtype, lay.chunk_shape)
        for r, (keys, first, _s) in enumerate(self._parts):
            self._targets.append([(i, item) for i, item in zip(range(first, len(keys)),
                                                                batch.items[r], strict=True)
                                  if batch.owner[item] == (r, i)
                                  and self._chunks[item] is not None])
        return reserved

    def save_layer(self, layer: int) -> cf.Future[None]:
        """Copy layer ``layer`` of every request out of its source in the background (into the
        reserved chunks, or staging rows while they are not granted). Raises InvalidArgument
        for a layer out of range or given twice."""
        _check_layer(layer, self._copies, self._finished)

        def copy() -> None:
            t0 = time.perf_counter()
            fut = self._reserved
            if not fut.done():
                self._stage(layer)
            elif fut.exception() is None and (reserved := fut.result()) is not None:
                if reserved.writable:
                    self._write(range(layer, layer + 1))
                else:
                    self._late = True
            self._gather_s[layer] = time.perf_counter() - t0

        fut = self._client._pool.submit(copy)
        self._copies[layer] = fut
        return fut

    def _write(self, layers: range) -> None:
        """Layers ``layers`` of every request's owned, reserved blocks into their chunks."""
        for (_keys, _first, source), targets in zip(self._parts, self._targets, strict=True):
            gather = source.gather_chunks  # type: ignore[attr-defined]
            for blocks, items in _runs(targets):
                gather(layers, blocks, [self._chunks[i] for i in items])

    def _stage(self, layer: int) -> None:
        with self._lock:
            if self._held is None:
                self._held = [self._client._staging.acquire(len(keys) - first)
                              for keys, first, _s in self._parts]
            self._staged.add(layer)
        for (keys, first, source), (view, _buf) in zip(self._parts, self._held, strict=True):
            if len(keys) > first:
                source.gather_layer(layer, range(first, len(keys)), view[:, layer])

    def finish(self, skip: Collection[int] = ()) -> cf.Future[list[SaveResult]]:
        """Commit every request's chunks once every layer's copy is done and the reservation
        answered, but those of the requests at the indices ``skip`` (aborted: their results
        fail every block, "skipped"). Raises InvalidArgument when a layer was never given."""
        missing = [i for i, c in enumerate(self._copies) if c is None]
        if missing:
            raise InvalidArgument(f"layers {missing} were never saved")
        if self._finished is None:
            copies = [c for c in self._copies if c is not None]
            skipped = frozenset(skip)
            out: cf.Future[list[SaveResult]] = cf.Future()
            self._finished = out

            def run() -> None:
                try:
                    out.set_result(self._commit(copies, skipped))
                except BaseException as exc:
                    out.set_exception(exc)

            def ready() -> None:  # on the save thread, after this step's reservation
                try:
                    self._client._save_thread().submit(run)
                except (RuntimeError, KvtierError) as exc:  # the client is closing
                    self._release()
                    out.set_exception(exc)

            _when_all([*copies, self._reserved], ready)
        return self._finished

    def _commit(self, copies: list[cf.Future[None]], skipped: frozenset[int]
                ) -> list[SaveResult]:
        t0 = time.perf_counter()
        batch = self._batch
        outcome: list[bool | None] = [None] * len(batch.keys)
        error: str | None = None
        reserved: ShmBatchWrite | None = None
        try:
            reserved = self._reserved.result()
            for c in copies:
                c.result()  # a copy that raised (a bug or bad shapes) raises here
            if reserved is not None:
                if self._staged and reserved.writable and not self._late:
                    self._unstage()
                if self._late or not reserved.writable:
                    reserved.abort()
                    error = "InvalidArgument: the step's copies ran past the reservations' " \
                            "margin: not committed"
                else:
                    drop = {item for r in skipped for item in batch.items[r]
                            if batch.owner[item][0] == r}
                    outcome = reserved.commit(skip=drop)
                    if reserved.refusal is not None:
                        error = describe(reserved.refusal)
        except KvtierError as exc:  # the daemon is gone, or nothing could be reserved
            error = describe(exc)
        except BaseException:
            if reserved is not None:
                reserved.abort()
            raise
        finally:
            self._release()
        gather_s = sum(self._gather_s)
        results = batch.results(outcome, error, self._client.layout.chunk_bytes, gather_s,
                                time.perf_counter() - t0)
        return [_skipped(self._parts[r], gather_s) if r in skipped else res
                for r, res in enumerate(results)]

    def _unstage(self) -> None:
        """The staged layers of every owned, reserved block into its chunk: one copy per run
        of chunks at one stride in the arena (:func:`strided_runs`) and range of staged
        layers, not one per block and layer."""
        assert self._held is not None
        lay = self._client.layout
        layers = [(r.start, r.stop) for r, _i in _runs([(layer, 0) for layer in
                                                        sorted(self._staged)])]
        per_layer = math.prod(lay.chunk_shape[1:])  # elements of one layer of a chunk
        for (_keys, first, _s), targets, (view, _buf) in zip(self._parts, self._targets,
                                                               self._held, strict=True):
            for blocks, items in _runs(targets):
                chunks: list[torch.Tensor] = [self._chunks[item] for item in items]  # type: ignore[misc]  # reserved: not None
                rows = view[blocks.start - first:blocks.stop - first].view(
                    len(blocks), lay.num_layers, per_layer)
                for a, b, step in strided_runs(chunks, lay.num_layers * per_layer):
                    for lo, hi in layers:
                        if step == 0:  # not one contiguous view: chunk by chunk
                            for k in range(a, b):
                                part = chunks[k][lo:hi]
                                part.copy_(rows[k, lo:hi].view(part.shape))
                            continue
                        c0 = chunks[a]
                        dst = c0.as_strided((b - a, hi - lo, per_layer), (step, per_layer, 1),
                                            c0.storage_offset() + lo * per_layer)
                        dst.copy_(rows[a:b, lo:hi])

    def _release(self) -> None:
        with self._lock:
            held, self._held = self._held, None
        for _view, buf in held or ():
            self._client._staging.release(buf)


def _check_layer(layer: int, copies: Sequence[cf.Future[None] | None],
                 finished: cf.Future[Any] | None) -> None:
    """A save's ``save_layer(layer)`` arguments: InvalidArgument for a layer out of range or
    given twice, or once the save is finished."""
    if not 0 <= layer < len(copies):
        raise InvalidArgument(f"layer {layer} out of range [0, {len(copies)})")
    if copies[layer] is not None or finished is not None:
        raise InvalidArgument(f"layer {layer} was already saved (or the save is finished)")


def _when_all(futures: Sequence[cf.Future[Any]], then: Callable[[], None]) -> None:
    """Call ``then()`` once every one of ``futures`` is done (in the thread that ends the
    last)."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_f: cf.Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        then()

    if not futures:
        then()
    for f in futures:
        f.add_done_callback(one_done)


class ChainBatch:
    """Several requests' new blocks as one batch put: each chain's blocks ``keys[first:]``,
    parent-first (block i a child of block i - 1), a block another chain of the batch also has
    (requests sharing a prefix) listed once, owned by the first chain that has it."""

    __slots__ = ("chains", "items", "keys", "owner", "parents")

    def __init__(self, chains: Sequence[tuple[list[PrefixKey], int]]) -> None:
        self.chains = chains
        self.keys: list[bytes] = []
        self.parents: list[bytes | None] = []
        self.owner: list[tuple[int, int]] = []  # per item: (chain, block) that lists it first
        self.items: list[list[int]] = []  # per chain, per new block: its item
        slot: dict[bytes, int] = {}
        for r, (keys, first) in enumerate(chains):
            mine = []
            for i in range(first, len(keys)):
                key = keys[i]
                if key not in slot:
                    slot[key] = len(self.keys)
                    self.keys.append(key)
                    self.parents.append(keys[i - 1] if i else None)
                    self.owner.append((r, i))
                mine.append(slot[key])
            self.items.append(mine)

    def results(self, outcome: Sequence[bool | None], error: str | None, chunk_bytes: int,
                gather_s: float, put_s: float) -> list[SaveResult]:
        """One SaveResult per chain from the batch's per-item ``outcome`` (True stored, False
        already stored, None not stored): a chain stops at its first block not stored
        (nothing under it can be cached); a block stored for an earlier chain is "existing"
        for the later ones. ``error`` is given to the chains that failed a block."""
        out = []
        for r, ((keys, first), mine) in enumerate(zip(self.chains, self.items, strict=True)):
            stored: list[int] = []
            existing: list[int] = []
            failed_from = len(keys)
            for i, item in zip(range(first, len(keys)), mine, strict=True):
                got = outcome[item]
                if got is None:
                    failed_from = i
                    break
                (stored if got and self.owner[item] == (r, i) else existing).append(i)
            failed = tuple(range(failed_from, len(keys)))
            out.append(SaveResult(tuple(stored), tuple(existing), failed,
                                  error if failed else None, len(stored) * chunk_bytes,
                                  gather_s, put_s))
        return out


def _runs(targets: list[tuple[int, int]]) -> list[tuple[range, list[int]]]:
    """``(block, item)`` pairs cut into runs of consecutive blocks: (blocks, their items)."""
    runs: list[tuple[range, list[int]]] = []
    start = prev = -2
    items: list[int] = []
    for block, item in targets:
        if block != prev + 1:
            if items:
                runs.append((range(start, prev + 1), items))
            start, items = block, []
        items.append(item)
        prev = block
    if items:
        runs.append((range(start, prev + 1), items))
    return runs


def describe(exc: BaseException) -> str:
    """``LoadResult.error``/``SaveResult.error`` text: the error class, then its message."""
    return f"{type(exc).__name__}: {exc}"


def _skipped(part: tuple[list[PrefixKey], int, EngineKV], gather_s: float) -> SaveResult:
    keys, first, _source = part
    return SaveResult((), (), tuple(range(first, len(keys))), "skipped", 0, gather_s, 0.0)


def split_even(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into at most ``parts`` contiguous non-empty groups of about
    equal sum (in order; every index in exactly one group): each item goes to the share of the
    total its midpoint falls in."""
    total = sum(sizes)
    groups: dict[int, list[int]] = {}
    acc = 0
    for i, size in enumerate(sizes):
        share = min(parts - 1, (2 * acc + size) * parts // (2 * total)) if total else 0
        groups.setdefault(share, []).append(i)
        acc += size
    return [groups[g] for g in sorted(groups)]


def _gather_futures(futures: list[cf.Future[list[SaveResult]]]
                    ) -> cf.Future[list[SaveResult]]:
    """One future of the concatenated results of ``futures`` (in order), completed when the
    last one is. The first exception (in order) wins."""
    out: cf.Future[list[SaveResult]] = cf.Future()

    def all_done() -> None:
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            out.set_exception(errors[0])
        else:
            out.set_result([r for f in futures for r in f.result()])

    _when_all(futures, all_done)
    return out

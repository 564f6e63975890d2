"""The scheduler half of the connector (runs in vLLM's EngineCore).

Per request it keeps the kvtier keys of its full blocks (vLLM's ``request.block_hashes`` behind
the namespace prefix of the request's tenant: no token is rehashed), how many leading blocks
the store holds (found by the lookup or saved since: the first block a save must store), and
its vLLM block ids.

**Lookups** of a daemon on this host are answered at once from its **read index**
(``lookup_index``, default ``auto``): the shared-memory table where the daemon publishes its
committed raw DRAM chunks with their owners' tags (:meth:`StoreClient.published_prefix`: a
probe per block, microseconds, no round trip, only chunks the session's tenant may read). When
the index publishes every block asked, that is the hit; when it does not, its count is the
answer only if the daemon runs no tier but DRAM (``auto``; what it holds beyond the index is
then compressed, being written, or refused by a full index: rare, and missed, not wrong; a
daemon that compresses its DRAM chunks wants ``covered``); otherwise (an NVMe or HBM tier
may hold more, ``covered``, ``off``, or no index: another host, the daemon gone) the daemon is
asked as below. A block seen in the index may be evicted before the worker loads it: the load
fails for that block and the blocks after it, the worker reports them
(``get_block_ids_with_load_errors``) and vLLM recomputes them (``kv_load_failure_policy=
"recompute"``), as for any failed load (see "Saves" for the resave).

**Daemon lookups** run off vLLM's engine loop (``lookup_async``, the default): the first
``get_num_new_matched_tokens`` of a request starts the daemon lookup on a background thread and
answers ``None``, which vLLM 0.32's scheduler takes as "ask again": the request stays WAITING
(skipped this step, not failed) and is asked again at the next step; once the daemon answered,
the hit. A lookup that fails, or is not answered within ``lookup_timeout_s`` of its start, is
0 hits (vLLM recomputes at full speed; the late answer is ignored). The answer is kept until
vLLM admits the request (it may ask several times when it cannot place the request yet); a
request that comes back later (preempted) is looked up afresh. A request finished or aborted
with its lookup in flight is forgotten (the lookup is cancelled, or ends unread). With
``lookup_async=false`` each lookup is one call on the engine loop, bounded by
``lookup_timeout_s``. Any kvtier failure is 0 hits.

**Saves** are planned here (``stored_blocks`` advances when a save is scheduled) and reported
back by the workers (``KVConnectorOutput.kv_connector_worker_meta``, see
:mod:`.metadata`): a save that failed rolls ``stored_blocks`` back to its first failed block,
so the request's next step saves from there again (at most ``MAX_SAVE_RETRIES`` times per
request; a request that finished first cannot be saved again: its blocks are vLLM's again).
A load that failed from block k (corrupt, evicted since the lookup, daemon gone) rolls
``stored_blocks`` back to k as well: vLLM recomputes blocks k.. in a later step, and that step's
save stores them (the workers never put what a request computed in the step of its failed
load: it attended to blocks that did not arrive). Without it the store kept a hole at k and
refused every later block of the prefix ("parent is not cached").
Saves copy out of vLLM's blocks within the step (``wait_for_save``), so ``request_finished``
never delays freeing and ``get_finished`` has nothing to report.

**Prefill/decode disaggregation** (vLLM's convention: the proxy sends the prefill request with
``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``, then the decode
request with the ``kv_transfer_params`` the prefill answered). Prefill side (saves on): a
request for remote decode that finished normally returns from ``request_finished`` a
:class:`~.metadata.PdHandoff`: the leading blocks of its prompt the store holds or that are
being put (``stored_blocks``, less any block whose save failed for good) and the kvtier key of
the last. Its saves may still be in flight: they were copied out of vLLM's blocks within the
step, so freeing the blocks need not wait (``delay_free`` stays False), and the answer cannot
wait (vLLM sends it as the request finishes, whatever ``request_finished`` returns). So the
decode side waits: a request carrying a hand-off (and ``do_remote_prefill``) whose lookup finds
fewer blocks than promised is looked up again every ``PD_POLL_INTERVAL_S`` (answering "ask
again" meanwhile, like a lookup in flight) until the store holds them or
``pd_wait_timeout_s`` passed since its first ask; then it takes what the store holds and vLLM
computes the rest. A hand-off whose last key differs from the decode's own key of that block
(other token ids, model, block size, hash seed or salt) is an ERROR, counted
(``pd_mismatches``), and not waited for.

**KV events**: with vLLM's KV events on, every save all TP ranks confirmed becomes a
``BlockStored`` event (``medium="KVTIER"``, vLLM's own block hashes) from ``take_events``, so a
KV-event-driven router sees what kvtier holds.

At start the model's manifest in the daemon is checked (:mod:`.manifest`): another instance of
the model with another block size, hash algorithm or hash seed is an ERROR and counts
``config_mismatch``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.client.kv_client import KVClient
from kvstore.client.requests import BlockKeys
from kvstore.dataplane.tier import TierKind
from kvstore.errors import KvtierError
from kvstore.integrations.vllm.config import ConnectorConfig, LookupIndex, SaveMode
from kvstore.integrations.vllm.manifest import check_manifest
from kvstore.integrations.vllm.metadata import (
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadFailure,
    LoadSpec,
    PdHandoff,
    SaveFailure,
    SaveSpec,
)
from kvstore.integrations.vllm.session import ClientSession
from kvstore.integrations.vllm.spec import ConnectorSpec
from kvstore.integrations.vllm.stats import KvtierConnectorStats
from kvstore.keys import BlockHasher, HashMode, Namespace, PrefixKey

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KV_EVENT_MEDIUM", "MAX_SAVE_RETRIES", "PD_POLL_INTERVAL_S", "SchedulerSide"]

MAX_SAVE_RETRIES = 3
"""Failed saves of one request saved again at most this often (a daemon that keeps failing
must not make every step of a long request re-send its blocks)."""
KV_EVENT_MEDIUM = "KVTIER"
PD_POLL_INTERVAL_S = 0.005
"""A decode request waiting for its prefill's blocks looks them up again this often (one
small RPC; the prefill's puts normally land within milliseconds of its answer)."""
_MAX_PENDING_EVENTS = 4096
_LOOKUP_THREADS = 4


@dataclass(frozen=True, slots=True)
class _Answer:
    """A lookup's outcome (made on a lookup thread, read on the engine loop)."""

    blocks: int
    error: str | None = None
    timed_out: bool = False


@dataclass
class _Lookup:
    num_keys: int
    """Blocks asked about (a request asked about more blocks is looked up again)."""
    future: cf.Future[_Answer] | None
    deadline: float
    found: int | None = None
    """Leading blocks the daemon holds, once known."""
    retry_at: float = 0.0
    """With neither ``future`` nor ``found``: a P/D wait's next lookup is due then."""


@dataclass
class _PdWait:
    """A decode request's wait for the blocks its prefill instance handed off."""

    blocks: int
    """Blocks promised (all of them checked against the request's own keys)."""
    deadline: float
    waited: bool = False


@dataclass
class _Save:
    first_block: int
    end_block: int
    confirmed: int = 0
    """TP ranks that reported it saved."""


@dataclass
class _Counts:
    """One request's figures, logged (debug) when it finishes."""

    load_blocks: int = 0
    """Blocks taken from kvtier (scheduled to load)."""
    load_error_blocks: int = 0
    save_blocks: int = 0
    saved_blocks: int = 0
    save_failures: int = 0
    save_retries: int = 0


@dataclass
class _Tracked:
    request: Request
    stored_blocks: int = 0
    """Leading blocks the store holds (found by the lookup, or saved since)."""
    local_tokens: int = 0
    """Tokens vLLM had computed itself when it asked (block-aligned)."""
    load_blocks: int = 0
    """Blocks of the last lookup's hit beyond ``local_tokens`` (loaded if vLLM agrees)."""
    block_ids: list[int] = field(default_factory=list)
    lookup: _Lookup | None = None
    """The lookup of the current admission attempt (cleared when vLLM admits the request)."""
    saves: dict[int, _Save] = field(default_factory=dict)
    """Every save scheduled for the request, by seq."""
    save_seq: int = 0
    loading: set[int] = field(default_factory=set)
    """vLLM block ids of the last load, until the step's load errors are in."""
    counts: _Counts = field(default_factory=_Counts)
    lost_from: int | None = None
    """First block whose save failed and is not tried again (a P/D hand-off stops before)."""
    pd: _PdWait | None = None
    """Decode side: the hand-off this request waits for (until admitted or given up)."""
    pd_checked: bool = False


@dataclass
class _PendingEvent:
    event: Any  # vllm.distributed.kv_events.BlockStored
    confirmed: int = 0


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, spec: ConnectorSpec, session: ClientSession,
                 vllm_hash_seed: str, *, load: bool, save: bool, kv_events: bool = False
                 ) -> None:
        self.config = config
        self.spec = spec
        self.session = session
        self.load_enabled = load
        self.save_enabled = save and config.save is SaveMode.ALL
        self.kv_events = kv_events
        self._seed = vllm_hash_seed
        self._hashers: dict[str, BlockHasher] = {}
        self._reqs: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._loading: set[str] = set()
        """Requests whose loads this step's worker output reports on."""
        self._warned_hashes = False
        self._warned_unhashed = False
        self._pool = cf.ThreadPoolExecutor(_LOOKUP_THREADS, thread_name_prefix="kvtier-lookup")
        self._events: list[KVCacheEvent] = []
        self._pending_events: dict[tuple[str, int], _PendingEvent] = {}
        self._bg_lock = threading.Lock()  # guards the two below (lookup threads write them)
        self._bg_counts: dict[str, int] = {}
        self._manifest_client: KVClient | None = None
        self.mismatches: list[str] = []
        """Differences the manifest check found (also logged and counted)."""
        self.stats = KvtierConnectorStats()
        """This interval's lookups and hits (vLLM takes them each step)."""
        client = session.get()
        if client is not None:  # at start (bounded by the RPC timeout); else with a lookup
            self._ensure_manifest(client)

    # --- keys -------------------------------------------------------------------------------

    def _hasher(self, tenant: str) -> BlockHasher:
        hasher = self._hashers.get(tenant)
        if hasher is None:
            hasher = BlockHasher(Namespace(self.spec.fingerprint(), tenant),
                                 mode=HashMode.SHA256_CBOR, vllm_hash_seed=self._seed)
            self._hashers[tenant] = hasher
        return hasher

    def keys_of(self, request: Request, n_blocks: int) -> tuple[PrefixKey, ...]:
        """kvtier keys of the request's first ``n_blocks`` full blocks (its tenant is its
        ``cache_salt``, else the configured tenant)."""
        hasher = self._hasher(request.cache_salt or self.config.tenant)
        return tuple(hasher.key_from_vllm_hash(bytes(h)) for h in request.block_hashes[:n_blocks])

    def _full_blocks(self, request: Request) -> int:
        """Full blocks with a hash; 0 (and one warning) when vLLM's hashes are not per block."""
        B = self.spec.block_tokens
        n = len(request.block_hashes)
        if n == 0 and request.num_tokens >= B:
            if not self._warned_unhashed:
                log.error("kvtier connector: request %s has %d tokens but no block hashes "
                          "(this vLLM hashes blocks only with prefix caching on?): no reuse "
                          "through kvtier", request.request_id, request.num_tokens)
                self._warned_unhashed = True
            return 0
        if n > request.num_tokens // B:
            if not self._warned_hashes:
                log.error("kvtier connector: request %s has %d block hashes for %d tokens of "
                          "block size %d (vLLM hashes blocks of another size?): no reuse",
                          request.request_id, n, request.num_tokens, B)
                self._warned_hashes = True
            return 0
        return n

    # --- lookups ----------------------------------------------------------------------------

    def _ensure_manifest(self, client: KVClient) -> None:
        """Check the model's manifest once per client (a new client may be a new daemon)."""
        with self._bg_lock:
            if self._manifest_client is client:
                return
            self._manifest_client = client  # (a failed check is tried again with the next)
        diffs = check_manifest(client.store, self.spec, self._seed)
        with self._bg_lock:
            if diffs is None:
                if self._manifest_client is client:
                    self._manifest_client = None
            elif diffs:
                self.mismatches.extend(diffs)
                self._bg_counts["config_mismatch"] = self._bg_counts.get("config_mismatch", 0) + 1

    def _lookup(self, keys: tuple[PrefixKey, ...]) -> _Answer:
        """One daemon lookup (on a lookup thread, or on the engine loop when synchronous)."""
        client = self.session.get()
        if client is None:
            return _Answer(0)
        self._ensure_manifest(client)
        t0 = time.monotonic()
        try:
            return _Answer(client.lookup(BlockKeys(keys)).blocks)
        except KvtierError as exc:  # dead, slow or restarted daemon: recompute
            timed_out = ("DEADLINE_EXCEEDED" in str(exc)
                         or time.monotonic() - t0 >= self.config.lookup_timeout_s)
            self.session.failed(client, f"lookup: {type(exc).__name__}: {exc}")
            return _Answer(0, f"{type(exc).__name__}: {exc}", timed_out)
        except (ValueError, RuntimeError) as exc:
            # Another lookup thread's failure closed this client under this call (gRPC: "closed
            # channel"); the session has dropped it already.
            return _Answer(0, f"{type(exc).__name__}: {exc}")

    def _index_lookup(self, client: KVClient, keys: tuple[PrefixKey, ...]) -> int | None:
        """The leading blocks of ``keys`` the same-host daemon's read index publishes, when
        that is the answer (module docstring, "Lookups"); None: ask the daemon."""
        mode = self.config.lookup_index
        if mode is LookupIndex.OFF:
            return None
        store = client.store
        try:
            n = store.published_prefix(keys)
        except ValueError:  # closed under this call (another thread's failure): no index
            return None
        if n is None:
            return None
        if n < len(keys) and not (mode is LookupIndex.AUTO and self._dram_only(store.info)):
            return None  # the daemon may hold the rest outside the index (NVMe, HBM)
        if self._manifest_client is not client:  # a new daemon: its manifest, off the loop
            self._pool.submit(self._ensure_manifest, client)
        return n

    @staticmethod
    def _dram_only(info: Any) -> bool:
        """Whether the daemon of ``info`` (its ``NodeInfo``) runs no tier but DRAM."""
        return set(info.tier_capacity_bytes) <= {TierKind.DRAM.value}

    def _settle(self, answer: _Answer) -> int:
        if answer.error is not None:
            self.stats.add("lookup_errors")
            if answer.timed_out:
                self.stats.add("lookup_timeouts")
        return answer.blocks

    def _answer(self, tracked: _Tracked, lk: _Lookup) -> int | None:
        """The lookup's answer (0 for a failure or past ``lookup_timeout_s``); None while in
        flight."""
        assert lk.future is not None
        if lk.future.done():
            try:
                answer = lk.future.result()
            except Exception as exc:  # a bug on the lookup thread: never into vLLM
                log.error("kvtier connector: lookup of %s failed: %r: 0 hits",
                          tracked.request.request_id, exc, exc_info=exc)
                answer = _Answer(0, repr(exc))
            return self._settle(answer)
        if time.monotonic() < lk.deadline:
            return None
        # Not answered in time: 0 hits. The thread ends on its own (the RPC is bounded by the
        # same timeout); its answer is never read.
        lk.future.cancel()
        self.stats.add("lookup_errors")
        self.stats.add("lookup_timeouts")
        log.warning("kvtier connector: lookup of %s not answered within lookup_timeout_s="
                    "%s: 0 hits", tracked.request.request_id, self.config.lookup_timeout_s)
        return 0

    def _found(self, tracked: _Tracked, usable: int) -> int | None:
        """Leading blocks of the request's first ``usable`` the daemon holds; None while the
        lookup is in flight (or a P/D wait's next lookup is not due)."""
        lk = tracked.lookup
        if lk is not None and lk.num_keys == usable:
            if lk.found is not None:  # asked again before vLLM could admit the request
                return lk.found
            if lk.future is not None:
                found = self._answer(tracked, lk)
                if found is None:
                    return None
                if not self._pd_wants_more(tracked, found, usable):
                    lk.found = found
                    return found
                lk.future = None
                lk.retry_at = time.monotonic() + PD_POLL_INTERVAL_S
                return None
            if time.monotonic() < lk.retry_at:
                return None  # P/D: the store is asked again when the poll is due
        elif lk is not None and lk.future is not None:
            lk.future.cancel()  # the request grew: what it asked no longer matters
        client = self.session.get()
        if client is None:
            tracked.lookup = None
            tracked.pd = None
            return 0  # no daemon now: nothing to wait for
        keys = self.keys_of(tracked.request, usable)
        self.stats.add("lookups")
        local = self._index_lookup(client, keys)
        if local is not None or not self.config.lookup_async:
            if local is not None:
                self.stats.add("lookups_local")
                found = local
            else:
                found = self._settle(self._lookup(keys))
            if self._pd_wants_more(tracked, found, usable):
                tracked.lookup = _Lookup(usable, None, 0.0,
                                         retry_at=time.monotonic() + PD_POLL_INTERVAL_S)
                return None
            tracked.lookup = _Lookup(usable, None, 0.0, found)
            return found
        tracked.lookup = _Lookup(usable, self._pool.submit(self._lookup, keys),
                                 time.monotonic() + self.config.lookup_timeout_s)
        return None

    # --- P/D hand-offs ----------------------------------------------------------------------

    def _pd_wait_of(self, request: Request) -> _PdWait | None:
        """The hand-off a decode request carries, checked against its own keys (None: none,
        malformed, or for other blocks than this request's)."""
        try:
            handoff = PdHandoff.from_params(request.kv_transfer_params)
        except KvtierError as exc:
            log.error("kvtier connector: request %s: %s: treated as an ordinary request",
                      request.request_id, exc)
            self.stats.add("pd_mismatches")
            return None
        if handoff is None:
            return None
        self.stats.add("pd_received")
        n = handoff.blocks
        if n == 0:
            return None
        B = self.spec.block_tokens
        why = None
        if handoff.block_tokens is not None and handoff.block_tokens != B:
            why = f"the prefill's blocks are {handoff.block_tokens} tokens, ours {B}"
        elif n > self._full_blocks(request):
            why = f"{n} blocks promised, the prompt has {self._full_blocks(request)} full blocks"
        elif handoff.key is not None and self.keys_of(request, n)[-1] != handoff.key:
            why = (f"the key of block {n - 1} differs (other token ids, model, block size, "
                   f"hash seed or cache_salt on the prefill instance)")
        if why is not None:
            log.error("kvtier connector: P/D hand-off of request %s does not match it: %s; "
                      "not waited for", request.request_id, why)
            self.stats.add("pd_mismatches")
            return None
        return _PdWait(n, time.monotonic() + self.config.pd_wait_timeout_s)

    def _pd_wants_more(self, tracked: _Tracked, found: int, usable: int) -> bool:
        """Whether the request should look up again: it waits for a hand-off that promised
        more than ``found`` blocks, within ``pd_wait_timeout_s`` (the wait ends otherwise)."""
        pd = tracked.pd
        if pd is None:
            return False
        target = min(pd.blocks, usable)
        if found >= target:
            tracked.pd = None
            return False
        if time.monotonic() >= pd.deadline:
            tracked.pd = None
            self.stats.add("pd_wait_timeouts")
            self.stats.add("pd_missing_blocks", target - found)
            log.warning("kvtier connector: request %s: %d of the %d blocks its prefill handed "
                        "off are in kvtier after pd_wait_timeout_s=%s: the rest is computed",
                        tracked.request.request_id, found, target,
                        self.config.pd_wait_timeout_s)
            return False
        if not pd.waited:
            pd.waited = True
            self.stats.add("pd_waited")
        return True

    def _pd_handoff(self, tracked: _Tracked | None, request: Request) -> PdHandoff | None:
        """Prefill side: the hand-off of a request for remote decode that finished normally
        (None for any other request)."""
        params = request.kv_transfer_params
        if tracked is None or not params or not params.get("do_remote_decode") or \
                not self.save_enabled:
            return None
        from vllm.v1.request import RequestStatus

        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                  RequestStatus.FINISHED_STOPPED):
            return None  # aborted: nobody decodes it
        B = self.spec.block_tokens
        n = min(tracked.stored_blocks, request.num_prompt_tokens // B,
                len(request.block_hashes))
        if tracked.lost_from is not None:
            n = min(n, tracked.lost_from)
        key = self.keys_of(request, n)[-1] if n else None
        self.stats.add("pd_sent")
        self.stats.add("pd_sent_blocks", n)
        return PdHandoff(n, key, B)

    # --- vLLM's calls -----------------------------------------------------------------------

    def _track(self, request: Request) -> _Tracked:
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            tracked = self._reqs[request.request_id] = _Tracked(request)
        else:
            tracked.request = request
        return tracked

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        tracked = self._track(request)
        tracked.load_blocks = 0
        tracked.local_tokens = num_computed_tokens
        if not tracked.pd_checked:
            tracked.pd_checked = True
            if self.load_enabled:
                tracked.pd = self._pd_wait_of(request)
        B = self.spec.block_tokens
        # Never the whole prompt: at least one token is left for vLLM to compute.
        usable = min(self._full_blocks(request), max(request.num_tokens - 1, 0) // B)
        if not self.load_enabled or usable * B <= num_computed_tokens:
            return 0, False
        found = self._found(tracked, usable)
        if found is None:
            self.stats.add("lookups_deferred")
            return None, False  # vLLM keeps the request WAITING and asks again next step
        hit = min(found, usable)
        tracked.stored_blocks = max(tracked.stored_blocks, hit)
        first = num_computed_tokens // B
        if hit <= first:
            return 0, False
        tracked.load_blocks = hit - first
        return hit * B - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._track(request)
        tracked.lookup = None  # admitted: a later admission (after a preemption) asks afresh
        tracked.pd = None  # and does not wait for a hand-off again
        block_ids = list(blocks.get_block_ids()[0])
        tracked.block_ids = block_ids
        if num_external_tokens <= 0 or tracked.load_blocks <= 0:
            tracked.load_blocks = 0
            return
        B = self.spec.block_tokens
        first = tracked.local_tokens // B
        n = min(tracked.load_blocks, num_external_tokens // B)
        if n > 0 and first + n <= len(block_ids):
            spec = LoadSpec(request.request_id, self.keys_of(request, first + n),
                            tuple(block_ids[:first + n]), first, n)
            self._loads.append(spec)
            tracked.loading = set(spec.target_block_ids)
            self._loading.add(request.request_id)
            tracked.counts.load_blocks += n
            self.stats.add("hit_blocks", n)
            self.stats.add("hit_tokens", num_external_tokens)
        tracked.load_blocks = 0

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(loads=self._loads)
        self._loads = []
        computed: dict[str, int] = {}  # tokens computed before this step, per request
        for new in scheduler_output.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens
            tracked = self._reqs.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            computed[req_id] = cached.num_computed_tokens[i]
            tracked = self._reqs.get(req_id)
            new_ids = cached.new_block_ids[i]
            if tracked is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0])
            else:
                tracked.block_ids.extend(new_ids[0])
        if self.save_enabled:
            for req_id, n_tokens in scheduler_output.num_scheduled_tokens.items():
                before = computed.get(req_id)
                spec = None if before is None else self._save_spec(req_id, before + n_tokens)
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    def _save_spec(self, req_id: str, done_tokens: int) -> SaveSpec | None:
        """Blocks full once this step's forward wrote its KV (``done_tokens`` computed) that
        the store does not hold yet."""
        tracked = self._reqs.get(req_id)
        if tracked is None:
            return None
        request = tracked.request
        B = self.spec.block_tokens
        end = min(done_tokens // B, self._full_blocks(request), len(tracked.block_ids))
        first = tracked.stored_blocks
        if end <= first:
            return None
        tracked.save_seq += 1
        seq = tracked.save_seq
        spec = SaveSpec(req_id, self.keys_of(request, end), tuple(tracked.block_ids[:end]),
                        first, seq)
        tracked.saves[seq] = _Save(first, end)
        tracked.counts.save_blocks += end - first
        tracked.stored_blocks = end
        if self.kv_events:
            self._pending_events[(req_id, seq)] = _PendingEvent(
                self._stored_event(request, first, end))
            if len(self._pending_events) > _MAX_PENDING_EVENTS:  # reports lost (a dead worker)
                del self._pending_events[next(iter(self._pending_events))]
        return spec

    def _stored_event(self, request: Request, first: int, end: int) -> KVCacheEvent:
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        B = self.spec.block_tokens
        hashes = request.block_hashes
        lora = request.lora_request
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[first:end]],
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first else None,
            token_ids=list(request.all_token_ids[first * B:end * B]), block_size=B,
            lora_id=lora.adapter_id if lora else None, medium=KV_EVENT_MEDIUM,
            lora_name=lora.name if lora else None, group_idx=0)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' reports of one step: saves that ended, blocks that failed to load."""
        invalid = connector_output.invalid_block_ids
        for req_id in self._loading:  # this step's loads (per request, for its log line)
            tracked = self._reqs.get(req_id)
            if tracked is not None:
                tracked.counts.load_error_blocks += len(tracked.loading & invalid)
                tracked.loading = set()
        self._loading.clear()
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, KvtierWorkerMetadata):
            return
        for req_id, seq in meta.saved:
            self._save_confirmed(req_id, seq)
        for failure in meta.failed:
            self._save_failed(failure)
        for load_failure in meta.load_failed:
            self._load_failed(load_failure)

    def _save_confirmed(self, req_id: str, seq: int) -> None:
        tp = self.spec.tp_size
        tracked = self._reqs.get(req_id)
        save = None if tracked is None else tracked.saves.get(seq)
        if save is not None:
            save.confirmed += 1
            if save.confirmed == tp:
                assert tracked is not None
                tracked.counts.saved_blocks += save.end_block - save.first_block
        pending = self._pending_events.get((req_id, seq))
        if pending is not None:
            pending.confirmed += 1
            if pending.confirmed == tp:
                del self._pending_events[(req_id, seq)]
                self._events.append(pending.event)

    def _save_failed(self, failure: SaveFailure) -> None:
        """Roll ``stored_blocks`` back so the request's next step saves the blocks again."""
        self._pending_events.pop((failure.req_id, failure.seq), None)
        tracked = self._reqs.get(failure.req_id)
        if tracked is None:  # finished: its blocks are vLLM's again
            return
        tracked.counts.save_failures += 1
        block = failure.first_failed_block
        if block >= tracked.stored_blocks:
            return  # rolled back below it already
        if any(seq > failure.seq and s.first_block <= block for seq, s in tracked.saves.items()):
            return  # a later save (a retry) covers the block
        if tracked.counts.save_retries >= MAX_SAVE_RETRIES:
            tracked.lost_from = block if tracked.lost_from is None else \
                min(tracked.lost_from, block)
            log.warning("kvtier connector: saving blocks %d.. of %s failed %d times: not tried "
                        "again", block, failure.req_id, tracked.counts.save_retries + 1)
            return
        tracked.counts.save_retries += 1
        self.stats.add("save_retry_blocks", tracked.stored_blocks - block)
        log.info("kvtier connector: save %d of %s failed from block %d: saved again with its "
                 "next step", failure.seq, failure.req_id, block)
        tracked.stored_blocks = block

    def _load_failed(self, failure: LoadFailure) -> None:
        """Roll ``stored_blocks`` back to the first block that did not arrive: vLLM recomputes
        it and the blocks after it, and the step that does saves them."""
        tracked = self._reqs.get(failure.req_id)
        block = failure.first_failed_block
        if tracked is None or block >= tracked.stored_blocks:
            return  # finished, or rolled back below it already (another TP rank's report)
        self.stats.add("load_resave_blocks", tracked.stored_blocks - block)
        log.info("kvtier connector: load of %s failed from block %d: its recomputed blocks are "
                 "saved", failure.req_id, block)
        tracked.stored_blocks = block

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        tracked = self._reqs.pop(request.request_id, None)
        handoff = self._pd_handoff(tracked, request)
        if tracked is not None:
            if tracked.lookup is not None and tracked.lookup.future is not None:
                tracked.lookup.future.cancel()  # aborted while asking: forget it
            c = tracked.counts
            log.debug("kvtier connector: request %s: %d blocks from kvtier (%d load errors), "
                      "%d blocks to save, %d saved, %d failed saves (%d retried)",
                      request.request_id, c.load_blocks, c.load_error_blocks, c.save_blocks,
                      c.saved_blocks, c.save_failures, c.save_retries)
        # Saves copy out of vLLM's blocks within their step: vLLM may free them now, also for a
        # hand-off whose puts are still in flight (the decode side waits for them).
        if handoff is not None:
            log.debug("kvtier connector: request %s handed off for remote decode: %d blocks",
                      request.request_id, handoff.blocks)
            return False, handoff.to_params()
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def pending_lookups(self) -> int:
        """Lookups in flight (started, not yet answered nor given up)."""
        return sum(1 for t in self._reqs.values() if t.lookup is not None
                   and t.lookup.found is None and t.lookup.future is not None
                   and not t.lookup.future.done())

    def take_stats(self) -> KvtierConnectorStats | None:
        with self._bg_lock:
            counts, self._bg_counts = self._bg_counts, {}
        for name, value in counts.items():
            self.stats.add(name, value)
        return self.stats.take()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.session.close()

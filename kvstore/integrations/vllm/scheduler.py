"""The scheduler half of the connector (runs in vLLM's EngineCore).

Per request it keeps the kvtier keys of its full blocks (vLLM's ``request.block_hashes`` behind
the namespace prefix of the request's tenant: no token is rehashed), how many leading blocks
the store held at lookup time (the first block a save must store), and its vLLM block ids.
Lookups are synchronous, bounded by ``lookup_timeout_s``; any kvtier failure is 0 hits.
Saves copy out of vLLM's blocks within the step (``wait_for_save``), so ``request_finished``
never delays freeing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstore.client.requests import BlockKeys
from kvstore.errors import KvtierError
from kvstore.integrations.vllm.config import ConnectorConfig, SaveMode
from kvstore.integrations.vllm.metadata import KvtierConnectorMetadata, LoadSpec, SaveSpec
from kvstore.integrations.vllm.session import ClientSession
from kvstore.integrations.vllm.spec import ConnectorSpec
from kvstore.integrations.vllm.stats import KvtierConnectorStats
from kvstore.keys import BlockHasher, HashMode, Namespace, PrefixKey

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["SchedulerSide"]


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


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, spec: ConnectorSpec, session: ClientSession,
                 vllm_hash_seed: str, *, load: bool, save: bool) -> None:
        self.config = config
        self.spec = spec
        self.session = session
        self.load_enabled = load
        self.save_enabled = save and config.save is SaveMode.ALL
        self._seed = vllm_hash_seed
        self._hashers: dict[str, BlockHasher] = {}
        self._reqs: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._warned_hashes = False
        self._warned_unhashed = False
        self.stats = KvtierConnectorStats()
        """This interval's lookups and hits (vLLM takes them each step)."""

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

    # --- vLLM's calls -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            tracked = self._reqs[request.request_id] = _Tracked(request)
        tracked.load_blocks = 0
        tracked.local_tokens = num_computed_tokens
        B = self.spec.block_tokens
        # Never the whole prompt: at least one token is left for vLLM to compute.
        usable = min(self._full_blocks(request), max(request.num_tokens - 1, 0) // B)
        if not self.load_enabled or usable * B <= num_computed_tokens:
            return 0, False
        client = self.session.get()
        if client is None:
            return 0, False
        keys = self.keys_of(request, usable)
        self.stats.add("lookups")
        t0 = time.monotonic()
        try:
            match = client.lookup(BlockKeys(keys))
        except KvtierError as exc:  # dead, slow or restarted daemon: recompute
            self.stats.add("lookup_errors")
            if ("DEADLINE_EXCEEDED" in str(exc)
                    or time.monotonic() - t0 >= self.config.lookup_timeout_s):
                self.stats.add("lookup_timeouts")
            self.session.failed(client, f"lookup: {type(exc).__name__}: {exc}")
            return 0, False
        hit = min(match.blocks, usable)
        tracked.stored_blocks = max(tracked.stored_blocks, hit)
        first = num_computed_tokens // B
        if hit <= first:
            return 0, False
        tracked.load_blocks = hit - first
        self.stats.add("hit_blocks", hit - first)
        self.stats.add("hit_tokens", hit * B - num_computed_tokens)
        return hit * B - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        tracked = self._reqs.get(request.request_id)
        if tracked is None:
            tracked = self._reqs[request.request_id] = _Tracked(request)
        block_ids = list(blocks.get_block_ids()[0])
        tracked.block_ids = block_ids
        if num_external_tokens <= 0 or tracked.load_blocks <= 0:
            tracked.load_blocks = 0
            return
        B = self.spec.block_tokens
        first = tracked.local_tokens // B
        n = min(tracked.load_blocks, num_external_tokens // B)
        if n > 0 and first + n <= len(block_ids):
            self._loads.append(LoadSpec(request.request_id, self.keys_of(request, first + n),
                                        tuple(block_ids[:first + n]), first, n))
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
        if end <= tracked.stored_blocks:
            return None
        spec = SaveSpec(req_id, self.keys_of(request, end), tuple(tracked.block_ids[:end]),
                        tracked.stored_blocks)
        tracked.stored_blocks = end
        return spec

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None  # saves copy out of vLLM's blocks within their step

    def take_stats(self) -> KvtierConnectorStats | None:
        return self.stats.take()

    def close(self) -> None:
        self.session.close()



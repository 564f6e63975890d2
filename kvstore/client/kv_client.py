"""The engine-facing client: token prefixes in, KV tensors in the engine's own layout out.

:class:`KVClient` sits on top of a :class:`~kvstore.client.store_client.StoreClient` of its own
daemon (shared-memory or TCP data plane) and speaks the engine's language: token ids, layers,
torch tensors. It owns the namespace (model fingerprint + tenant), the block size and the hash
mode (``KVClientConfig.hash_mode``: xxh3, or vLLM's own ``sha256_cbor`` block hashes behind the
namespace prefix), so the engine never sees a chunk key unless it has one already
(:class:`BlockKeys`, e.g. from vLLM's block hashes).

Three ways to move more than one request's prefix
    * batch APIs for one engine step: :meth:`KVClient.lookup_many` (one round trip),
      :meth:`KVClient.load_many` (one handle per request, batched transfers),
      :meth:`KVClient.begin_save_many` (one staging set, one copy task per layer, one flush);
    * loads from *another node's* daemon: :meth:`KVClient.load_from` (an address) and
      ``load(..., remote=RemoteFetch)`` (a conductor fetch plan: the own daemon first, the
      rest from that node), with one StoreClient per remote address kept by the client;
    * optional replication of the fetched blocks into the own daemon (``replicate``).

Chunks are per *block*, not per layer
    One chunk is one block of ``block_tokens`` tokens for every layer (:class:`KVLayout`'s
    ``[layer, k|v, kv_head, token, head_dim]``). Per-layer chunks would let the first layer's
    bytes arrive before the last layer's, but they multiply keys (index entries, events, lease
    round trips) by the number of layers, and they split a prefix into L chains the daemon can
    evict independently. Measured on this machine (``bench/kv_client.py``, see
    ``docs/kv-client.md``): per-layer chunks of a 4 MiB block move several times slower
    through the daemon than whole-block chunks. So the layer pipeline lives on the engine's side
    of the store: a save copies each layer out of the engine's buffers as soon as the engine is
    done with it (:meth:`LayerwiseSave.save_layer`) and puts whole chunks once every layer is
    in; a load fetches whole chunks, then scatters them into the engine's buffers one layer at
    a time, so layer ``l``'s attention waits only for layer ``l`` (:meth:`LoadHandle.wait_for_layer`).
    On the same host, :meth:`KVClient.load_many` into a layout with ``scatter_chunks`` (vLLM's
    CPU layout) copies once instead: leased parts of the call straight out of the daemon's
    arena into the engine's buffers, every layer of a block at once (docs/kv-client.md, "One
    copy on the same host").

Where the rest lives
    The engine's buffers are seen through an :class:`~kvstore.client.layouts.EngineKV`
    (:mod:`kvstore.client.layouts`: contiguous, paged, chunk and transformers-cache layouts);
    what a call answers is in :mod:`kvstore.client.results`, what it takes besides token ids in
    :mod:`kvstore.client.requests`, transfers in flight in :mod:`kvstore.client.handles`, the
    staging buffers in :mod:`kvstore.client.staging`, and the etcd lookups behind
    :meth:`KVClient.from_etcd` and :meth:`KVClient.node_address` in
    :mod:`kvstore.client.discovery`.

Failures are results, not exceptions
    A load stops at the first block it cannot get (a miss, a chunk evicted since
    :meth:`KVClient.lookup`, a corrupt chunk the daemon dropped, a daemon, own or remote, that
    died mid-load or cannot be reached):
    :class:`LoadResult` says how many leading blocks arrived and which ones failed, and the
    engine recomputes those. KV after a failed block is useless (it depends on the missing
    block), so a load result is always a prefix. A save reports the blocks it stored, the ones
    that were already there and the ones it could not store. Bad arguments (wrong shapes,
    layer out of range) still raise ``InvalidArgument`` at the call.

Threading
    ``lookup``, ``load`` and ``save`` may be called from any thread. Transfers and copies run on
    the client's executor (``KVClientConfig.workers`` threads); handles are futures. The engine
    must not write the destination of a load before :meth:`LoadHandle.wait_for_layer` (or
    :meth:`LoadHandle.result`) returned for that layer, nor overwrite the source of a save's
    layer before that layer's copy finished (:meth:`LayerwiseSave.finish` waits for all).

Ownership
    Handles copy into and out of the engine's tensors; the client keeps no reference to them
    once the handle has completed. Staging buffers are the client's.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvstore.client.cpus import widen_thread_affinity
from kvstore.client.discovery import choose_node, discover_nodes
from kvstore.client.handles import (
    BatchSave,
    ChainBatch,
    DirectBatchSave,
    LayerwiseSave,
    LoadHandle,
    split_even,
)
from kvstore.client.handles import describe as _describe
from kvstore.client.kvlayout import KVLayout
from kvstore.client.layouts import EngineKV
from kvstore.client.requests import BlockKeys, LoadRequest, RemoteFetch, SaveRequest
from kvstore.client.results import LoadResult, PrefixMatch, SaveResult
from kvstore.client.staging import StagingPool
from kvstore.client.store_client import (
    DataPlane,
    StoreClient,
    StoreClientConfig,
)
from kvstore.dataplane.transport.shm import ShmBatchRead, ShmClient, ShmWriter
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkNotFound,
    InvalidArgument,
    KvtierError,
    MembershipError,
    PeerUnavailable,
    SizeMismatch,
    TierUnavailable,
    TransportError,
)
from kvstore.keys import BlockHasher, HashMode, Namespace, PrefixKey
from kvstore.security.config import ClientSecurity

if TYPE_CHECKING:
    import torch

    from kvstore.membership.etcd import KeyLayout

log = logging.getLogger(__name__)


__all__ = ["KVClient", "KVClientConfig"]


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class KVClientConfig:
    data_plane: DataPlane = DataPlane.AUTO
    """SHM when the daemon is on this host (AUTO), or force TCP (a remote node's path)."""
    workers: int = 2
    """Threads that run transfers and layer copies."""
    load_batch_blocks: int = 32
    """Blocks fetched per daemon call in a load (one lease round trip each on SHM)."""
    rpc_timeout_s: float = 30.0
    """Bound on each gRPC call to a daemon (``StoreClientConfig.rpc_timeout_s``)."""
    tcp_io_timeout_s: float | None = None
    """Bound on a TCP data-plane request that makes no progress
    (``StoreClientConfig.tcp_io_timeout_s``); None: ``rpc_timeout_s``, so that a stopped or
    partitioned daemon holds a load or save over TCP no longer than a gRPC call."""
    security: ClientSecurity | None = None
    """Credentials presented to daemons (docs/security.md); None: the environment's
    (``KVTIER_TLS_*``, ``KVTIER_TOKEN_FILE``), no credentials when none is set."""
    tenant: str | None = None
    """The tenant this client acts for on its daemon: ``StoreClientConfig.tenant``, sent as
    ``kvtier-tenant`` on every gRPC call and checked against the credentials (docs/security.md,
    "Tenant isolation"); None: the credentials' only tenant (or every tenant, for an operator).
    Not the namespace's tenant, which only salts the keys. Checked when :meth:`KVClient.connect`
    builds the StoreClientConfig (InvalidArgument for a bad name)."""
    staging_pool_bytes: int = 256 << 20
    """Chunk-layout staging buffers kept for reuse (pre-touched); more are made on demand."""
    hash_mode: HashMode = HashMode.XXH3_128
    """How token blocks become chunk keys. ``SHA256_CBOR`` makes every key
    ``namespace prefix (16 B) || vLLM's own block hash (32 B)``, so a vLLM connector maps
    ``request.block_hashes`` to keys without rehashing (:meth:`KVClient.keys_from_vllm`)."""
    vllm_hash_seed: str | None = None
    """``SHA256_CBOR`` only (and required there): the vLLM processes' ``PYTHONHASHSEED``."""
    batch_blocks: int = 256
    """Blocks per daemon call in :meth:`KVClient.load_many` (all requests' blocks together)."""
    remote_data_plane: DataPlane = DataPlane.AUTO
    """Data plane to another node's daemon (:meth:`KVClient.load_from`): AUTO picks shared
    memory when that daemon is in fact on this host, else UCX, else TCP."""
    replicate_remote: bool = False
    """Default of ``replicate`` in remote loads: put the blocks fetched from another node into
    this client's own daemon afterwards (a replication step; the engine does not wait for it)."""
    one_copy_save: bool = True
    """Same host, sources with ``gather_chunks``: :meth:`KVClient.begin_save_many` reserves the
    step's chunks in the daemon's arena and copies the engine's KV straight into them
    (:class:`~kvstore.client.handles.DirectBatchSave`); False: through staging rows and one
    ``put_many`` (two copies)."""
    widen_thread_affinity: bool = True
    """Transfer threads run on every CPU the container allows, not only on the cores of the
    thread that started them (an engine's model thread bound to its cores):
    :mod:`kvstore.client.cpus`."""
    inline_load_bytes: int = 16 << 20
    """Same host: a :meth:`KVClient.load_many` of up to this many bytes copies the chunks the
    daemon's read index publishes in the calling thread, before it returns (no lease, no
    round trip, no hand-off to a transfer thread: for a 15-block request those were most of
    its cost); what is left (not published, moved during the copy) goes on on the transfer
    threads. Such a copy never waits for the daemon, and runs out of the caller's
    ``torch.inference_mode`` (vLLM's thread is in it: docs/kv-client.md, "One copy"). 0: every
    load on the transfer threads (the default during session 12, until the turn's block real
    vLLM lost with 16 MiB was found to be a test reading before the save landed)."""

    def __post_init__(self) -> None:
        if self.staging_pool_bytes < 0:
            raise InvalidArgument("staging_pool_bytes must be >= 0")
        if not isinstance(self.hash_mode, HashMode):
            raise InvalidArgument(f"hash_mode must be a HashMode, got {self.hash_mode!r}")
        if (self.hash_mode is HashMode.SHA256_CBOR) != (self.vllm_hash_seed is not None):
            raise InvalidArgument("vllm_hash_seed is required with, and only with, "
                                  "HashMode.SHA256_CBOR")
        if not isinstance(self.remote_data_plane, DataPlane):
            raise InvalidArgument(f"remote_data_plane must be a DataPlane, got "
                                  f"{self.remote_data_plane!r}")
        if self.batch_blocks < 1:
            raise InvalidArgument("batch_blocks must be >= 1")
        if not isinstance(self.data_plane, DataPlane):
            raise InvalidArgument(f"data_plane must be a DataPlane, got {self.data_plane!r}")
        if self.workers < 1 or self.load_batch_blocks < 1:
            raise InvalidArgument("workers and load_batch_blocks must be >= 1")
        if self.rpc_timeout_s <= 0:
            raise InvalidArgument("rpc_timeout_s must be > 0")
        if self.tcp_io_timeout_s is not None and not self.tcp_io_timeout_s > 0:
            raise InvalidArgument("tcp_io_timeout_s must be > 0 (or None: rpc_timeout_s)")
        if self.inline_load_bytes < 0:
            raise InvalidArgument("inline_load_bytes must be >= 0")

    def store_config(self, data_plane: DataPlane) -> StoreClientConfig:
        """The StoreClient settings of a connection to a daemon over ``data_plane``."""
        return StoreClientConfig(
            data_plane=data_plane, rpc_timeout_s=self.rpc_timeout_s,
            tcp_io_timeout_s=(self.rpc_timeout_s if self.tcp_io_timeout_s is None
                              else self.tcp_io_timeout_s),
            security=self.security, tenant=self.tenant)


_DIRECT_PART_BLOCKS = 16
"""Blocks per read lease of a one-copy load (:meth:`KVClient._load_many_direct`): every part's
request goes at once on one connection and the daemon pins part k + 1 while the client copies
part k. Measured here (loaded box): one lease of 96 keys of 512 KiB took 1.7-10 ms, up to a
third of their copies; in parts, the load waits for the first part's only."""


# --- the client ---------------------------------------------------------------------------------


class KVClient:
    """KV of token prefixes between kvtier daemons and an engine's tensors.

    Build with :meth:`connect` (an explicit daemon address) or :meth:`from_etcd` (discover the
    daemons in etcd and pick this host's, or a named node). That daemon is the client's own
    (``store``): lookups, loads and saves go there. :meth:`load_from` and ``load(...,
    remote=...)`` also read from *another* node's daemon; the client keeps one
    :class:`StoreClient` per remote address, opened on first use and closed with the client.
    See the module docstring for the contracts. ``close()`` closes every store connection and
    the executor.
    """

    def __init__(self, store: StoreClient, layout: KVLayout, namespace: Namespace,
                 config: KVClientConfig | None = None, *, etcd_endpoint: str | None = None,
                 key_layout: KeyLayout | None = None) -> None:
        """Wrap an open StoreClient (the KVClient owns it from now on) and start the executor.
        ``etcd_endpoint``/``key_layout`` are only remembered, for :meth:`node_address`."""
        if namespace.fingerprint.block_size_tokens != layout.block_tokens:
            raise InvalidArgument("the namespace's block size differs from the layout's")
        if (namespace.fingerprint.num_layers, namespace.fingerprint.num_kv_heads,
                namespace.fingerprint.head_dim) != (layout.num_layers, layout.num_kv_heads,
                                                    layout.head_dim):
            raise InvalidArgument("the namespace's fingerprint does not match the layout")
        self.store = store
        self.layout = layout
        self.namespace = namespace
        self.config = config or KVClientConfig()
        self.hasher = BlockHasher(namespace, mode=self.config.hash_mode,
                                  vllm_hash_seed=self.config.vllm_hash_seed)
        self._etcd_endpoint = etcd_endpoint
        self._key_layout = key_layout
        self._remotes: dict[str, StoreClient] = {}
        self._node_addresses: dict[str, str] = {}
        self._remote_lock = threading.Lock()
        self._closed = False
        self._shm_writer: ShmWriter | None = None
        self._save_io: cf.ThreadPoolExecutor | None = None
        self._pool = cf.ThreadPoolExecutor(
            self.config.workers, thread_name_prefix="kvclient",
            initializer=widen_thread_affinity if self.config.widen_thread_affinity else None)
        self._staging = StagingPool(layout, self.config.staging_pool_bytes)

    # --- construction -------------------------------------------------------------------------

    @classmethod
    def connect(cls, address: str, layout: KVLayout, namespace: Namespace,
                config: KVClientConfig | None = None, *, etcd_endpoint: str | None = None,
                key_layout: KeyLayout | None = None) -> KVClient:
        """Connect to the daemon at ``host:port``. Raises PeerUnavailable."""
        cfg = config or KVClientConfig()
        store = StoreClient.connect(address, cfg.store_config(cfg.data_plane))
        try:
            return cls(store, layout, namespace, cfg, etcd_endpoint=etcd_endpoint,
                       key_layout=key_layout)
        except BaseException:
            store.close()
            raise

    @classmethod
    def from_etcd(cls, etcd_endpoint: str, layout: KVLayout, namespace: Namespace,
                  config: KVClientConfig | None = None, *, node_id: str | None = None,
                  key_layout: KeyLayout | None = None) -> KVClient:
        """Find the daemons registered in etcd and connect to ``node_id``, or else to one on
        this host (shared memory), or else to the first by id. Raises MembershipError (etcd
        unreachable, no such node, no node at all), PeerUnavailable."""
        nodes = discover_nodes(etcd_endpoint, key_layout)
        record = choose_node(nodes, node_id)
        client = cls.connect(record.grpc_address, layout, namespace, config,
                             etcd_endpoint=etcd_endpoint, key_layout=key_layout)
        client._node_addresses.update({n: r.grpc_address for n, r in nodes.items()})
        return client

    # --- keys and lookup ----------------------------------------------------------------------

    def keys(self, token_ids: object) -> list[PrefixKey]:
        """The chunk keys of the full blocks of ``token_ids`` (or the keys a :class:`BlockKeys`
        carries, checked for this client's key length)."""
        if isinstance(token_ids, BlockKeys):
            size = self.hasher.key_size_bytes
            if any(len(k) != size for k in token_ids.keys):
                raise InvalidArgument(f"this client's keys are {size} bytes "
                                      f"({self.hasher.mode.value})")
            return list(token_ids.keys)
        return self.hasher.hash_blocks(token_ids)

    def keys_from_vllm(self, block_hashes: Sequence[bytes]) -> BlockKeys:
        """The keys of blocks whose vLLM ``sha256_cbor`` hashes the engine already computed
        (``request.block_hashes``), without rehashing any token. Equal to ``keys(tokens)``
        when vLLM ran with this client's ``vllm_hash_seed`` as ``PYTHONHASHSEED`` and
        ``cache_salt == tenant``. Raises InvalidArgument outside ``HashMode.SHA256_CBOR``."""
        return BlockKeys(tuple(self.hasher.key_from_vllm_hash(bytes(h)) for h in block_hashes))

    def lookup(self, token_ids: object, *, address: str | None = None) -> PrefixMatch:
        """How many leading full blocks of ``token_ids`` the daemon holds (the client's own, or
        the one at ``address``), and in which tiers. A miss is ``blocks == 0``. Raises
        PeerUnavailable when the daemon is gone."""
        store = self.store if address is None else self._remote_store(address)
        keys = self.keys(token_ids)
        if not keys:
            return PrefixMatch(0, self.layout.block_tokens, {}, store.info.node_id)
        found = store.lookup(keys)
        return PrefixMatch(found.length, self.layout.block_tokens, found.by_tier(),
                           store.info.node_id)

    def lookup_many(self, token_lists: Sequence[object], *,
                    address: str | None = None) -> list[PrefixMatch]:
        """:meth:`lookup` of several requests in one daemon round trip (``BatchLookup``); one
        match per request, in order. Raises PeerUnavailable."""
        store = self.store if address is None else self._remote_store(address)
        key_lists = [self.keys(t) for t in token_lists]
        asked = [i for i, keys in enumerate(key_lists) if keys]
        node_id = store.info.node_id
        out = [PrefixMatch(0, self.layout.block_tokens, {}, node_id) for _ in key_lists]
        found = store.lookup_many([key_lists[i] for i in asked])
        for i, result in zip(asked, found, strict=True):
            out[i] = PrefixMatch(result.length, self.layout.block_tokens, result.by_tier(),
                                 node_id)
        return out

    # --- load ---------------------------------------------------------------------------------

    def load(self, token_ids: object, into: EngineKV, *, first_block: int = 0,
             num_blocks: int | None = None,
             on_blocks_fetched: Callable[[int], None] | None = None,
             remote: RemoteFetch | None = None, replicate: bool | None = None) -> LoadHandle:
        """Load blocks ``[first_block, first_block + num_blocks)`` of ``token_ids`` (default: all
        its full blocks) into ``into``; returns at once with a :class:`LoadHandle`.

        Blocks before ``first_block`` must already be in the engine's buffers (a prefix the
        engine holds itself). With ``remote`` (a conductor fetch plan), the blocks the
        client's own daemon does not have are fetched from that other node, from where the
        local part stopped up to ``remote.end_block`` (``replicate``: then put them into the
        own daemon, see :meth:`load_from`). ``on_blocks_fetched(n)`` is called on the
        executor after each batch with the running count of arrived blocks (progress; tests
        use it to fault mid-load). Never raises for store failures: the result says what
        arrived.
        """
        keys = self.keys(token_ids)
        total = self._check_range(keys, first_block, num_blocks)
        handle = LoadHandle(self.layout.num_layers, first_block, total)
        self._pool.submit(self._run_load, handle, keys, into, on_blocks_fetched, True, remote,
                          self._replicate(replicate))
        return handle

    def load_from(self, address: str, token_ids: object, into: EngineKV, *,
                  first_block: int = 0, num_blocks: int | None = None,
                  replicate: bool | None = None,
                  on_blocks_fetched: Callable[[int], None] | None = None) -> LoadHandle:
        """Load blocks ``[first_block, first_block + num_blocks)`` of ``token_ids`` from the
        daemon of *another node* at ``address`` (gRPC ``host:port``, e.g. a fetch plan's
        ``src_grpc_address``; see :meth:`node_address` for a node id) into ``into``.

        Same contract as :meth:`load`: returns at once; a dead or unreachable node, or blocks it
        evicted, end the load early and the result names the failed blocks (recompute them).
        The connection to that daemon is opened on first use and kept (shared memory when it
        is in fact on this host, else UCX or TCP: ``KVClientConfig.remote_data_plane``).
        ``replicate`` (default ``KVClientConfig.replicate_remote``): after the blocks are in
        ``into``, put them into this client's own daemon too (their parent, block
        ``first_block - 1``, must be there); :meth:`LoadHandle.replication` reports it.
        """
        keys = self.keys(token_ids)
        total = self._check_range(keys, first_block, num_blocks)
        handle = LoadHandle(self.layout.num_layers, first_block, total)
        plan = RemoteFetch("", address, first_block, first_block + total)
        self._pool.submit(self._run_load, handle, keys, into, on_blocks_fetched, False, plan,
                          self._replicate(replicate))
        return handle

    def load_many(self, requests: Sequence[LoadRequest]) -> list[LoadHandle]:
        """Load several requests' blocks (one engine step) from the own daemon: one handle per
        request, in order, with per-request layer readiness; the blocks of all requests move
        together in calls of up to ``KVClientConfig.batch_blocks`` (``get_many_into``: one
        lease round trip per call on shared memory, one pipelined batch over TCP).

        The requests are cut into ``KVClientConfig.workers`` groups of about equal blocks,
        one executor task each (N single loads would run that many at once too: one task
        alone measured slower than them on 2 cores). On shared memory, when every layout of a
        group has ``scatter_chunks``, the group is copied once, straight out of the daemon's
        arena (:meth:`_load_many_direct`: read leases on parts of 16 blocks, pipelined on one
        connection; a request's layers are ready together once its blocks are in). Otherwise
        the blocks are fetched into staging rows and scattered layer-major (layer 0 of every
        request, then layer 1...), so a step's ``wait_for_layer(0)`` on every handle returns
        first. Ask only for blocks a
        :meth:`lookup_many` found: a miss inside a call makes the StoreClient read that call's
        keys one by one. Per request, the result is a prefix as in :meth:`load`.
        """
        jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]] = []
        handles: list[LoadHandle] = []
        remote: list[tuple[LoadHandle, list[PrefixKey], LoadRequest]] = []
        for req in requests:
            keys = self.keys(req.token_ids)
            total = self._check_range(keys, req.first_block, req.num_blocks)
            handle = LoadHandle(self.layout.num_layers, req.first_block, total)
            handles.append(handle)
            if req.remote is not None:
                remote.append((handle, keys, req))
            else:
                jobs.append((handle, keys[req.first_block:req.first_block + total], req.into))
        reach: list[int] | None = None
        if jobs and sum(len(k) for _h, k, _i in jobs) * self.layout.chunk_bytes \
                <= self.config.inline_load_bytes:
            jobs, reach = self._load_inline(jobs)
        for group in split_even([len(keys) for _h, keys, _i in jobs], self.config.workers):
            self._pool.submit(self._run_load_many, [jobs[i] for i in group],
                              None if reach is None else [reach[i] for i in group])
        for handle, keys, req in remote:  # after the batch: local KV first
            self._pool.submit(self._run_load, handle, keys, req.into, None, True, req.remote,
                              self._replicate(None))
        return handles

    def _replicate(self, replicate: bool | None) -> bool:
        return self.config.replicate_remote if replicate is None else replicate

    @staticmethod
    def _check_range(keys: list[PrefixKey], first_block: int, num_blocks: int | None) -> int:
        total = len(keys) - first_block if num_blocks is None else num_blocks
        if first_block < 0 or total < 0 or first_block + total > len(keys):
            raise InvalidArgument(f"blocks [{first_block}, {first_block + total}) outside the "
                                  f"{len(keys)} full blocks of the tokens")
        return total

    def _run_load(self, handle: LoadHandle, keys: list[PrefixKey], into: EngineKV,
                  on_fetched: Callable[[int], None] | None, use_local: bool,
                  remote: RemoteFetch | None, replicate: bool) -> None:
        try:
            self._load(handle, keys, into, on_fetched, use_local, remote, replicate)
        except BaseException as exc:  # a bug: never leave the engine waiting on a layer
            log.exception("load failed unexpectedly")
            handle._fail(f"{type(exc).__name__}: {exc}")
            raise

    def _load(self, handle: LoadHandle, keys: list[PrefixKey], into: EngineKV,
              on_fetched: Callable[[int], None] | None, use_local: bool,
              remote: RemoteFetch | None, replicate: bool) -> None:
        first, total = handle.first_block, handle.requested_blocks
        wanted = keys[first:first + total]
        staging, buffer = self._staging.acquire(total)
        try:
            t0 = time.perf_counter()
            loaded, error = 0, None
            if use_local:
                loaded, error = self._fetch_prefix(self.store, wanted, staging, 0, total,
                                                   on_fetched, first)
            remote_from, address = loaded, ""
            remote_stop = 0 if remote is None else min(total, remote.end_block - first)
            if remote is not None and loaded < remote_stop:
                loaded, error, address = self._fetch_remote(remote, wanted, staging, loaded,
                                                            remote_stop, on_fetched, first)
            t1 = time.perf_counter()
            handle._remote_blocks = loaded - remote_from
            handle._fetched.set_result(loaded)
            blocks = range(first, first + loaded)
            for layer in range(self.layout.num_layers):
                if loaded:
                    into.scatter_layer(layer, blocks, staging[:loaded, layer])
                handle._layers_ready(layer + 1)
            t2 = time.perf_counter()
            failed = tuple(range(first + loaded, first + total))
            why = _describe(error) if failed and error is not None else None
            handle._finish(LoadResult(first, total, loaded, failed, why,
                                      loaded * self.layout.chunk_bytes, t1 - t0, t2 - t1,
                                      loaded - remote_from, address))
            replicated = None
            if replicate and loaded > remote_from:
                # The staging rows are ours until released: put them after the engine has its
                # KV, so replication never delays the forward pass.
                replicated = self._put_chain(keys[:first + loaded], first + remote_from,
                                             staging[remote_from:loaded], 0.0)
            handle._finish_replication(replicated)
        finally:
            self._staging.release(buffer)

    def _fetch_remote(self, remote: RemoteFetch, keys: list[PrefixKey], staging: torch.Tensor,
                      start: int, stop: int, on_fetched: Callable[[int], None] | None,
                      first_block: int) -> tuple[int, KvtierError | None, str]:
        """Fetch ``keys[start:stop]`` from the plan's node: (blocks reached, error, address)."""
        address = remote.address
        try:
            if not address:
                address = self.node_address(remote.node_id)
            store = self._remote_store(address)
        except KvtierError as exc:  # not registered, unreachable: recompute
            log.warning("remote load from %s failed: %s", address or remote.node_id,
                        _describe(exc))
            if remote.node_id:
                self._forget_node(remote.node_id)
            return start, exc, address
        loaded, error = self._fetch_prefix(store, keys, staging, start, stop, on_fetched,
                                           first_block)
        if isinstance(error, PeerUnavailable):
            self._drop_remote(address, store)  # reconnect next time (it may come back)
            if remote.node_id:
                self._forget_node(remote.node_id)
        return loaded, error, address

    def _fetch_prefix(self, store: StoreClient, keys: list[PrefixKey], staging: torch.Tensor,
                      start: int, stop: int, on_fetched: Callable[[int], None] | None,
                      first_block: int) -> tuple[int, KvtierError | None]:
        """Fetch the longest held prefix of ``keys[start:stop]`` into the same staging rows, in
        batches; return (index reached, the error that stopped it early or None)."""
        loaded: int = start
        error: KvtierError | None = None
        batch = self.config.load_batch_blocks
        while loaded < stop:
            before, end = loaded, min(loaded + batch, stop)
            try:
                got = store.load_prefix(keys[before:end], list(staging[before:end]))
            except SizeMismatch as exc:  # a chunk of another layout under our key: a bug
                error = exc
                log.error("load from %s stopped at block %d: %s", store.address,
                          first_block + loaded, _describe(exc))
                break
            except KvtierError as exc:  # dead daemon, corrupt chunk, ...: recompute the rest
                error = exc
                log.warning("load from %s stopped at block %d: %s", store.address,
                            first_block + loaded, _describe(exc))
                break
            loaded += got
            if on_fetched is not None:
                on_fetched(loaded)
            if got < end - before:
                break  # a miss: evicted since lookup, or never there
        return loaded, error

    def _load_inline(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]]
                     ) -> tuple[list[tuple[LoadHandle, list[PrefixKey], EngineKV]], list[int]]:
        """The lease-free part of a small :meth:`load_many`, in the calling thread
        (``KVClientConfig.inline_load_bytes``): the requests it completed are finished here;
        returns the others, with the blocks of each already copied."""
        sinks = [getattr(into, "scatter_chunks", None) for _h, _k, into in jobs]
        if self.store.data_plane is not DataPlane.SHM or any(s is None for s in sinks) \
                or getattr(self.store.plane, "read_free", None) is None:
            return jobs, [0] * len(jobs)
        import torch

        try:
            # Out of the caller's inference mode: vLLM calls load_many (start_load_kv) inside
            # torch.inference_mode, and a tensor made there is an inference tensor, which
            # nothing outside inference mode may write. The first lease-free read makes the
            # arena-wide tensor the ShmClient keeps and derives every later arena view from,
            # a save's reserved chunks too: made here in inference mode, a step's save whose
            # layers were staged failed when the save thread moved them into those chunks
            # (RuntimeError, the save lost: tests/integrations/test_vllm_inline_load.py).
            # The engine's layouts enter inference mode for their own copies (InferenceModeKV).
            with torch.inference_mode(False):
                reach, copied_s = self._copy_lease_free(jobs, sinks)  # type: ignore[arg-type]
        except Exception as exc:  # a bug: logged, the blocks recomputed, never in the engine
            log.exception("lease-free load failed unexpectedly")
            for handle, _keys, _into in jobs:
                handle._fail(f"{type(exc).__name__}: {exc}")
            return [], []
        rest: list[tuple[LoadHandle, list[PrefixKey], EngineKV]] = []
        left: list[int] = []
        for job, n in zip(jobs, reach, strict=True):
            handle, keys, _into = job
            if n < len(keys):
                rest.append(job)
                left.append(n)
                continue
            handle._finish(LoadResult(handle.first_block, n, n, (), None,
                                      n * self.layout.chunk_bytes, 0.0, copied_s))
            handle._finish_replication(None)
        return rest, left

    def _copy_lease_free(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]],
                         sinks: list[Callable[[range, range, Sequence[torch.Tensor]], None]]
                         ) -> tuple[list[int], float]:
        """Copy each request's leading chunks the daemon's read index publishes straight out
        of the arena (``ShmClient.read_free``: no lease, no round trip; the index's seqlock
        says afterwards which copies were the chunks' own): (leading blocks of each request
        that arrived, seconds)."""
        lay = self.layout
        every = range(lay.num_layers)
        reach = [0] * len(jobs)
        read_free = getattr(self.store.plane, "read_free", None)
        if read_free is None:
            return reach, 0.0
        t0 = time.perf_counter()
        for k, (handle, keys, _into) in enumerate(jobs):
            free = read_free(keys, lay.dtype, lay.chunk_shape) if keys else None
            if free is None:
                continue
            first = handle.first_block
            try:
                sinks[k](every, range(first, first + len(free.tensors)), free.tensors)
            finally:
                free.tensors = []  # the arena views go before the check
            reach[k] = free.confirm()
        return reach, time.perf_counter() - t0

    def _run_load_many(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]],
                       reach: list[int] | None = None) -> None:
        try:
            self._load_many(jobs, reach)
        except BaseException as exc:  # a bug: never leave the engine waiting on a layer
            log.exception("batch load failed unexpectedly")
            for handle, _keys, _into in jobs:
                handle._fail(f"{type(exc).__name__}: {exc}")
            raise

    def _get_each(self, keys: list[PrefixKey], rows: list[torch.Tensor], start: int, end: int,
                  got: list[int | None], why_at: dict[int, str], call_error: str
                  ) -> tuple[int, TransportError | None]:
        """Read ``keys[start:end]`` into ``rows`` one by one, into ``got`` (None: not there or
        unreadable, with why in ``why_at``; a chunk missing now is explained by
        ``call_error``, the batch call's: the daemon drops a chunk it found corrupt, with its
        descendants); return (index reached, the transport error that stopped it or None)."""
        for i in range(start, end):
            try:
                got[i] = self.store.get_into(keys[i], rows[i])
            except ChunkNotFound:
                got[i] = None
                why_at[i] = call_error
            except TransportError as exc:
                return i, exc
            except KvtierError as exc:  # corrupt, unreadable, wrong size: this block only
                got[i] = None
                why_at[i] = _describe(exc)
        return end, None

    def _load_many(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]],
                   reach: list[int] | None = None) -> None:
        """``reach``: blocks of each request already copied (by :meth:`_load_inline`: then
        every layout has ``scatter_chunks``), None: none yet."""
        if self.store.data_plane is DataPlane.SHM:
            sinks = [getattr(into, "scatter_chunks", None) for _h, _k, into in jobs]
            if all(sink is not None for sink in sinks):
                self._load_many_direct(jobs, [s for s in sinks if s is not None], reach)
                return
        self._load_many_staged(jobs)

    def _load_many_direct(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]],
                          sinks: list[Callable[[range, range, Sequence[torch.Tensor]], None]],
                          reach0: list[int] | None = None) -> None:
        """The one-copy load (same host, layouts with ``scatter_chunks``; docs/kv-client.md,
        "One copy"). The keys of all requests are cut into parts of ``_DIRECT_PART_BLOCKS``;
        every part's read lease is asked for at once on one connection
        (``StoreClient.read_parts``), and as each part's lease arrives the requests' blocks in
        it are copied by their layouts straight out of the daemon's arena into the engine's
        buffers, every layer at once, while the daemon pins the next part. A part the daemon
        refuses whole (a miss, a corrupt chunk, DRAM full or busy, a chunk of another size) is
        read into staging rows instead, per key when needed (:meth:`_fetch_staged`), so a
        per-key error keeps the blocks before it. A copy that ended past the leases' deadline
        fails its blocks and stops the load (the bytes may be another chunk's: the engine
        recomputes them). A request's layers are all ready once its last block is in or it
        stopped; the leases are released before the results are set.

        First, where the daemon's read index publishes a request's leading chunks, they are
        copied with no lease and no round trip at all (``ShmClient.read_free``: a lookup in
        the mapped index per chunk, the copy, then the index's seqlock says which copies were
        the chunks' own all along); the leased parts then cover only what is left of each
        request (what was not published, or moved during its copy: copied again, under a
        lease). A request whose blocks all came this way has its layers ready at once. For a
        15-block request this drops the lease round trip (~0.2-0.4 ms with the daemon in
        Python, more than the copy itself)."""
        lay = self.layout
        every = range(lay.num_layers)
        if reach0 is None:
            reach, copied_s = self._copy_lease_free(jobs, sinks)
        else:  # copied by _load_inline already
            reach, copied_s = list(reach0), 0.0
        closed = [False] * len(jobs)
        waited_s = 0.0

        def close(k: int) -> None:  # the request's blocks are all in, or it stopped
            if not closed[k]:
                closed[k] = True
                handle = jobs[k][0]
                handle._fetched.set_result(reach[k])
                handle._layers_ready()

        for k, (_h, keys, _i) in enumerate(jobs):
            if reach[k] == len(keys):
                close(k)
        flat = [k for (_h, keys, _i), n in zip(jobs, reach, strict=True) for k in keys[n:]]
        total = len(flat)
        size = min(self.config.batch_blocks, _DIRECT_PART_BLOCKS)
        bounds = [(a, min(a + size, total)) for a in range(0, total, size)]
        # starts[k] + i: where block i of request k would lie in ``flat``, had its first
        # reach[k] blocks (copied above) been left in (flat holds only the rest)
        starts: list[int] = []
        offset = 0
        for (_h, keys, _i), n in zip(jobs, reach, strict=True):
            starts.append(offset - n)
            offset += len(keys) - n
        taking = [True] * len(jobs)  # whether a request still takes blocks
        chunks: list[torch.Tensor | None] = [None] * total
        why_at: dict[int, str] = {}  # flat index -> why it did not arrive (per key)
        staged: list[torch.Tensor] = []
        read: ShmBatchRead | None = None
        error: str | None = None
        pos = total  # where a call-wide error stopped the load

        try:
            if total:
                t_ask = time.perf_counter()
                try:
                    read = self.store.read_parts([flat[a:b] for a, b in bounds])
                except TransportError as exc:  # dead daemon: nothing arrives
                    error, pos = _describe(exc), 0
                    log.warning("batch load of %d blocks failed: %s", total, error)
                waited_s += time.perf_counter() - t_ask  # the first part's reply is in
            j = 0  # the first request that may have blocks in the current part
            for a, b in bounds if read is not None else ():
                assert read is not None
                t_wait = time.perf_counter()
                leased, stop = True, None
                try:
                    chunks[a:b] = read.tensors(read.next_part(), lay.dtype, lay.chunk_shape)
                except TransportError as exc:  # dead daemon: the rest failed
                    error, pos = _describe(exc), a
                    log.warning("batch load stopped at %d of %d blocks: %s", a, total, error)
                    break
                except KvtierError as exc:  # refused whole: this part through staging
                    leased = False
                    log.debug("batch load of blocks %d..%d: %s: through staging", a, b,
                              _describe(exc))
                    # A chunk missing now is explained by this error (the daemon drops a
                    # chunk it found corrupt, with its descendants); a plain miss is not one.
                    call_error = None if isinstance(exc, (ChunkNotFound, CapacityError,
                                                          ChunkBusy)) else _describe(exc)
                    reached, exc_t = self._fetch_staged(flat, a, b, chunks, why_at, staged,
                                                        call_error)
                    if exc_t is not None:
                        stop = (_describe(exc_t), reached)
                t_copy = time.perf_counter()
                waited_s += t_copy - t_wait
                while j < len(jobs) and starts[j] + len(jobs[j][1]) <= a:
                    j += 1
                k = j
                expired = False
                while k < len(jobs) and starts[k] < b:
                    n_k = len(jobs[k][1])
                    if taking[k]:
                        lo, hi = starts[k] + reach[k], min(b, starts[k] + n_k)
                        run = lo
                        while run < hi and chunks[run] is not None:
                            run += 1
                        if run > lo:
                            first = jobs[k][0].first_block + reach[k]
                            sinks[k](every, range(first, first + run - lo),
                                     chunks[lo:run])  # type: ignore[arg-type]  # not None
                            if leased and read.expired:  # its bytes may be another chunk's
                                expired = True
                                break
                            reach[k] += run - lo
                        if run < hi:
                            taking[k] = False  # a block that did not arrive: a prefix ends
                        if not taking[k] or reach[k] == n_k:
                            close(k)
                    k += 1
                chunks[a:b] = [None] * (b - a)
                copied_s += time.perf_counter() - t_copy
                if expired:
                    error, pos = ("LeaseExpired: the batch read's leases passed their deadline "
                                  "during the copy"), a
                    log.warning("batch load stopped at %d of %d blocks: %s", a, total, error)
                    break
                if stop is not None:
                    (error, pos) = stop
                    log.warning("batch load stopped at %d of %d blocks: %s", pos, total, error)
                    break
            chunks.clear()  # the arena views go before their leases
            if read is not None:
                # Before the results: a load that returned holds no lease (a remove right
                # after it must not find its chunks pinned).
                done: ShmBatchRead = read
                read = None
                _release(done)
            for k, (handle, keys, _into) in enumerate(jobs):
                close(k)
                n, first = reach[k], handle.first_block
                failed = tuple(range(first + n, first + len(keys)))
                # The call-wide error explains this request's stop only if it stopped where
                # the load did (a plain miss before it is a miss).
                why = why_at.get(starts[k] + n) if failed else None
                if why is None and failed and starts[k] + n >= pos:
                    why = error
                handle._finish(LoadResult(first, len(keys), n, failed, why,
                                          n * lay.chunk_bytes, waited_s, copied_s))
                handle._finish_replication(None)
        finally:
            chunks.clear()
            if read is not None:
                _release(read)
            for buf in staged:
                self._staging.release(buf)

    def _fetch_staged(self, keys: list[PrefixKey], start: int, end: int,
                      chunks: list[torch.Tensor | None], why_at: dict[int, str],
                      staged: list[torch.Tensor], call_error: str | None = None
                      ) -> tuple[int, TransportError | None]:
        """Read ``keys[start:end]`` into pooled staging rows (appended to ``staged``), set
        ``chunks[i]`` to the row of each that arrived and ``why_at[i]`` for per-key errors
        (a chunk not there is explained by ``call_error`` when one is given); return (index
        reached, the transport error that stopped it or None)."""
        view, buf = self._staging.acquire(end - start)
        staged.append(buf)
        rows = list(view)
        sub = keys[start:end]
        got: list[int | None] = [None] * len(sub)
        why: dict[int, str] = {}
        reached, stop_error = len(sub), None
        try:
            got = self.store.get_many_into(sub, rows)
        except TransportError as exc:
            return start, exc
        except KvtierError as exc:  # one chunk corrupt or unreadable: one by one
            reached, stop_error = self._get_each(sub, rows, 0, len(sub), got, why,
                                                 _describe(exc))
        for i in range(reached):
            if got[i] is not None:
                chunks[start + i] = rows[i]
            elif call_error is not None:
                why.setdefault(i, call_error)
        why_at.update({start + i: w for i, w in why.items()})
        return start + reached, stop_error

    def _load_many_staged(self, jobs: list[tuple[LoadHandle, list[PrefixKey], EngineKV]]
                          ) -> None:
        # One pooled staging buffer per request, not one for the step: the destinations of a
        # batched read need not be contiguous, and per-request sizes reuse the buffers single
        # calls left in the pool (one big buffer measured 4x slower: a fresh 128 MiB buffer
        # per step, first-touched, when the pool was full of request-sized ones).
        held = [self._staging.acquire(len(keys)) for _h, keys, _i in jobs]
        try:
            flat = [k for _h, keys, _i in jobs for k in keys]
            rows = [row for view, _buf in held for row in view]
            total = len(flat)
            got: list[int | None] = [None] * total
            why_at: dict[int, str] = {}  # flat index -> why it did not arrive (per key)
            t0 = time.perf_counter()
            pos, error, step = 0, None, self.config.batch_blocks
            while pos < total:
                end = min(pos + step, total)
                try:
                    got[pos:end] = self.store.get_many_into(flat[pos:end], rows[pos:end])
                except TransportError as exc:  # dead daemon: the rest failed
                    error = _describe(exc)
                    log.warning("batch load stopped at %d of %d blocks: %s", pos, total, error)
                    break
                except KvtierError as exc:
                    # One chunk of the call is corrupt or unreadable (a per-key error that
                    # fails the whole call): read the call's chunks one by one, so that the
                    # blocks before it, and the other requests' blocks, still arrive.
                    log.warning("batch load of blocks %d..%d of %d: %s: read one by one", pos,
                                end, total, _describe(exc))
                    stopped, exc_t = self._get_each(flat, rows, pos, end, got, why_at,
                                                    _describe(exc))
                    if exc_t is not None:
                        error, pos = _describe(exc_t), stopped
                        log.warning("batch load stopped at %d of %d blocks: %s", pos, total,
                                    error)
                        break
                pos = end
            t1 = time.perf_counter()
            loaded: list[int] = []
            offset = 0
            for handle, keys, _into in jobs:
                n = 0
                while n < len(keys) and got[offset + n] is not None:
                    n += 1
                loaded.append(n)
                handle._fetched.set_result(n)
                offset += len(keys)
            for layer in range(self.layout.num_layers):
                for (handle, _keys, into), n, (view, _buf) in zip(jobs, loaded, held,
                                                                  strict=True):
                    if n:
                        into.scatter_layer(layer, range(handle.first_block,
                                                        handle.first_block + n),
                                           view[:n, layer])
                    handle._layers_ready(layer + 1)
            t2 = time.perf_counter()
            offset = 0
            for (handle, keys, _into), n in zip(jobs, loaded, strict=True):
                first = handle.first_block
                failed = tuple(range(first + n, first + len(keys)))
                # The batch error explains this request's stop only if it stopped where the
                # fetch did (a plain miss before it is a miss).
                why = why_at.get(offset + n) if failed else None
                if why is None and failed and offset + n >= pos:
                    why = error
                handle._finish(LoadResult(first, len(keys), n, failed, why,
                                          n * self.layout.chunk_bytes, t1 - t0, t2 - t1))
                handle._finish_replication(None)
                offset += len(keys)
        finally:
            for _view, buf in held:
                self._staging.release(buf)

    # --- other nodes --------------------------------------------------------------------------

    def node_address(self, node_id: str) -> str:
        """The gRPC address of daemon ``node_id``, from etcd (cached; needs a client built by
        :meth:`from_etcd` or given ``etcd_endpoint``). Raises MembershipError."""
        with self._remote_lock:
            address = self._node_addresses.get(node_id)
        if address is not None:
            return address
        if self._etcd_endpoint is None:
            raise MembershipError(f"node {node_id!r}: no address and no etcd endpoint to ask")
        record = choose_node(discover_nodes(self._etcd_endpoint, self._key_layout), node_id)
        with self._remote_lock:
            self._node_addresses[node_id] = record.grpc_address
        return record.grpc_address

    def _forget_node(self, node_id: str) -> None:
        with self._remote_lock:
            self._node_addresses.pop(node_id, None)

    def _remote_store(self, address: str) -> StoreClient:
        """The StoreClient of the daemon at ``address`` (the own one if it is that address),
        connected on first use. Raises PeerUnavailable, TierUnavailable."""
        if address == self.store.address:
            return self.store
        with self._remote_lock:
            if self._closed:
                raise PeerUnavailable("the client is closed")
            store = self._remotes.get(address)
        if store is not None:
            return store
        cfg = self.config
        store = StoreClient.connect(address, cfg.store_config(cfg.remote_data_plane))
        with self._remote_lock:
            kept = None if self._closed else self._remotes.setdefault(address, store)
        if kept is not store:  # closed meanwhile, or another thread connected first
            store.close()
            if kept is None:
                raise PeerUnavailable("the client is closed")
        return kept

    def _drop_remote(self, address: str, store: StoreClient) -> None:
        with self._remote_lock:
            if self._remotes.get(address) is store:
                del self._remotes[address]
            else:
                return
        store.close()

    @property
    def remote_addresses(self) -> list[str]:
        """Addresses of the other nodes' daemons this client holds a connection to."""
        with self._remote_lock:
            return sorted(self._remotes)

    # --- save ---------------------------------------------------------------------------------

    def begin_save(self, token_ids: object, from_: EngineKV, *,
                   first_block: int = 0) -> LayerwiseSave:
        """Start a layer-by-layer save of the full blocks ``[first_block, ...)`` of
        ``token_ids`` (blocks before it are assumed stored: the first saved chunk's parent)."""
        keys = self.keys(token_ids)
        if not 0 <= first_block <= len(keys):
            raise InvalidArgument(f"first_block {first_block} outside [0, {len(keys)}]")
        return LayerwiseSave(self, keys, first_block, from_)

    def save(self, token_ids: object, from_: EngineKV, *,
             first_block: int = 0) -> cf.Future[SaveResult]:
        """Save every layer of the full blocks ``[first_block, ...)`` at once (a future)."""
        saver = self.begin_save(token_ids, from_, first_block=first_block)
        for layer in range(self.layout.num_layers):
            saver.save_layer(layer)
        return saver.finish()

    def begin_save_many(self, requests: Sequence[SaveRequest]
                        ) -> BatchSave | DirectBatchSave:
        """Start layer-by-layer saves of several requests (one engine step): one copy task
        per layer and one flush. On the same host, when every source has ``gather_chunks``
        (and ``one_copy_save``), the step's chunks are reserved in the daemon's arena and
        written there directly (:class:`DirectBatchSave`); otherwise through one staging
        buffer and ``put_many`` (:class:`BatchSave`)."""
        parts: list[tuple[list[PrefixKey], int, EngineKV]] = []
        for req in requests:
            keys = self.keys(req.token_ids)
            if not 0 <= req.first_block <= len(keys):
                raise InvalidArgument(f"first_block {req.first_block} outside "
                                      f"[0, {len(keys)}]")
            parts.append((keys, req.first_block, req.from_))
        if self.config.one_copy_save and self.store.data_plane is DataPlane.SHM and all(
                getattr(src, "gather_chunks", None) is not None for _k, _f, src in parts):
            return DirectBatchSave(self, parts)
        return BatchSave(self, parts)

    def save_many(self, requests: Sequence[SaveRequest]) -> cf.Future[list[SaveResult]]:
        """Save every layer of several requests at once: one SaveResult per request."""
        saver = self.begin_save_many(requests)
        for layer in range(self.layout.num_layers):
            saver.save_layer(layer)
        return saver.finish()

    def _put_chain(self, keys: list[PrefixKey], first_block: int, staging: torch.Tensor,
                   gather_s: float) -> SaveResult:
        """Put ``keys[first_block:]`` from ``staging`` (row i: block ``first_block + i``)."""
        return self._put_chains([(keys, first_block, staging)], gather_s)[0]

    def _put_chains(self, chains: Sequence[tuple[list[PrefixKey], int, torch.Tensor]],
                    gather_s: float) -> list[SaveResult]:
        """Put several requests' new blocks in one ``put_many`` (one pipelined exchange over
        shared memory), as a :class:`ChainBatch`: a refusal stops that chain from the refused
        block on (what is under it cannot be cached) and leaves the other chains as they went;
        a transport failure fails every block whose outcome is unknown. Each result's
        ``put_s`` is the whole batch's."""
        t0 = time.perf_counter()
        batch = ChainBatch([(keys, first) for keys, first, _s in chains])
        srcs = [chains[r][2][i - chains[r][1]] for r, i in batch.owner]
        outcome: list[bool | None] = [None] * len(batch.keys)
        error: str | None = None
        if batch.keys:
            try:
                outcome = list(self.store.put_many(batch.keys, srcs, batch.parents))
            except KvtierError as exc:  # full, parent evicted, daemon gone
                error = _describe(exc)
                if exc.batch_outcome is not None:
                    outcome = exc.batch_outcome
                log.warning("save of %d blocks: %s", len(batch.keys), error)
        return batch.results(outcome, error, self.layout.chunk_bytes, gather_s,
                             time.perf_counter() - t0)

    def _save_thread(self) -> cf.ThreadPoolExecutor:
        """The one thread one-copy saves talk to the daemon on (reserve, commit), in the order
        they are asked: never the executor's threads, which the engine's copies need."""
        with self._remote_lock:
            if self._closed:
                raise PeerUnavailable("the client is closed")
            if self._save_io is None:
                self._save_io = cf.ThreadPoolExecutor(1, thread_name_prefix="kvclient-save")
            return self._save_io

    def _writer(self) -> ShmWriter:
        """The connection one-copy saves reserve and commit on (made on first use)."""
        with self._remote_lock:
            if self._closed:
                raise PeerUnavailable("the client is closed")
            if self._shm_writer is None:
                plane = self.store.plane
                if not isinstance(plane, ShmClient):
                    raise TierUnavailable("one-copy saves need the shared-memory plane")
                self._shm_writer = plane.open_writer()
            return self._shm_writer

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for transfers in flight, then close the executor and every store connection."""
        self._pool.shutdown(wait=True)
        save_io = self._save_io
        if save_io is not None:
            save_io.shutdown(wait=True)
        with self._remote_lock:
            self._closed = True
            remotes, self._remotes = list(self._remotes.values()), {}
            writer, self._shm_writer = self._shm_writer, None
        if writer is not None:
            writer.close()
        for store in remotes:
            store.close()
        self.store.close()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _release(lease: ShmBatchRead) -> None:
    """End a batch read's leases; a daemon gone meanwhile ended them already."""
    try:
        lease.release()
    except KvtierError as exc:
        log.debug("batch read lease release: %s", _describe(exc))

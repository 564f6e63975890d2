"""The store daemon's client: gRPC for control, one data plane for the bytes.

``StoreClient.connect(address)`` asks the daemon for its :class:`NodeInfo` and picks the data
plane (:class:`DataPlane`; the choice: :mod:`kvstore.client.planes`):

* **SHM**, when the daemon runs on this host (same hostname and boot id), its DRAM arena can be
  mapped and its lease channel reached
  (:class:`~kvstore.dataplane.transport.shm.ShmClient`). ``get_into`` of a chunk the daemon's
  **read index** publishes (it is in DRAM, stored raw) is lease-free: a lookup in the mapped
  index, one memcpy and a seqlock check, no round trip at all (Linux on x86-64 only,
  ``StoreClientConfig.lease_free_reads``); the keys read are reported to the daemon in batches
  afterwards (hits, recency); ``published_prefix`` asks the same index which leading keys it
  publishes (a presence check: a vLLM scheduler's lookup without a round trip). Otherwise (not published, moved during the copy, or in NVMe)
  ``get_into`` = one ACQUIRE_READ round trip on the lease channel (~30 µs; the daemon pins the
  chunk in DRAM, promoting it from NVMe first) + one memcpy out of the mapped arena + a RELEASE
  sent without waiting for a reply. ``put`` = RESERVE (an invisible slot) + one memcpy into the
  arena + COMMIT (values up to 64 KiB travel inside one PUT request instead: one round trip).
  Leases belong to the channel connection: if this process dies, the daemon ends them (no
  half-written chunk becomes visible; nothing stays pinned). A chunk DRAM cannot take right now
  is read over TCP instead. ``read_parts`` leases parts of a batch, pipelined on one connection,
  for a caller that copies straight out of the arena (``KVClient.load_many``'s one copy).
* **UCX** when the daemon advertises a UCX worker address (``NodeInfo.ucx_worker_address``)
  and ``ucxx`` imports here (:class:`~kvstore.dataplane.transport.ucx.UcxClient`: tag messages
  received straight into ``dst``; RDMA where the hardware has it). UCX cannot see a dead peer
  on its own, so waits are bounded and the daemon's gRPC health is asked every
  ``ucx_liveness_interval_s`` while one lasts. A UCX failure (``TransportError``) falls back to
  TCP for that call and keeps UCX off for ``ucx_retry_after_s``. Batches stay on TCP (its
  pipelining suits many small values).
* **TCP** otherwise: the framed TCP transport (:class:`~kvstore.dataplane.transport.tcp.TcpClient`,
  ``recv_into`` straight into ``dst``, striping large values over pooled connections). TCP
  frames carry no parent key, so a put with a parent goes inline over gRPC when it is small
  (one call) and otherwise announces the parent with ``SetParents`` first.

``AUTO`` (the default) chooses SHM when possible, then UCX, then TCP. Every error is a
:mod:`kvstore.errors` class: the daemon's own errors keep their class across the wire
(``ChunkExists``, ``SizeMismatch``...); a dead or unreachable daemon is ``PeerUnavailable``.

Ownership: ``put`` reads ``src`` and ``get_into`` writes ``dst`` only during the call. Misses:
``get_into`` of an unknown key raises ``ChunkNotFound`` (an explicit read); ``lookup``,
``exists`` and ``load_prefix`` report misses as counts. Thread safety: one client may be used
from many threads (the lease channel and TCP connections are pooled).

GPU buffers: ``put``/``get_into`` also take contiguous CUDA tensors. On the shared-memory plane
the bytes are copied between the device and the arena directly (the client registers the mapped
arena with CUDA, so the copy is DMA); over TCP they go through a pinned host bounce buffer.

Ordering: a RELEASE travels after the get returns; a gRPC ``remove`` right behind a get waits
for the releases this client sent (one ping per channel) so it never sees its own read lease.
Lease-free reads are reported late: :meth:`StoreClient.flush_reads` waits until the daemon has
counted them (``stats`` does it first).

Tenants: ``StoreClientConfig.tenant`` travels as ``kvtier-tenant`` metadata on every gRPC call
(:mod:`kvstore.client.daemon_control`). Against a daemon with security the data planes act for
it too: the client fetches a session ticket for it (``IssueDataTicket``) and every TCP and lease
channel connection presents it (:mod:`kvstore.client.planes`), so what it puts there belongs to
that tenant and its data-plane reads see only what that tenant may read. Against a daemon
without security the data planes carry no tenant (the default tenant's; docs/security.md).

Where the parts live: the gRPC calls in :mod:`kvstore.client.daemon_control`, the choice of the
data plane and the remote (TCP/UCX) plane in :mod:`kvstore.client.planes`, the config and
results in :mod:`kvstore.client.store_config`; the shared-memory plane is the data plane's
(:mod:`kvstore.dataplane.transport.shm`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl, open_channel, translate_rpc_error
from kvstore.client.planes import RemotePlane, ValuePlane, open_plane
from kvstore.client.store_config import DataPlane, LookupResult, StoreClientConfig
from kvstore.dataplane.read_index import ReadIndexReader
from kvstore.dataplane.tier import Buffer, TierKind, check_key
from kvstore.dataplane.transport.base import ReadLease
from kvstore.dataplane.transport.shm import LeaseFreeCounters, ShmBatchRead, ShmClient
from kvstore.errors import ChunkNotFound, KvtierError, LeaseExpired, short_key
from kvstore.security.tenancy import DEFAULT_TENANT, SHARED_TENANT

__all__ = ["DataPlane", "LeaseFreeCounters", "LookupResult", "StoreClient", "StoreClientConfig",
           "translate_rpc_error"]


class StoreClient(DaemonControl):
    """A client of one store daemon: its gRPC calls (:class:`DaemonControl`) and one data
    plane for values. Build with :meth:`connect`; see the module docstring."""

    def __init__(self, address: str, info: pb.NodeInfo, channel: grpc.Channel,
                 config: StoreClientConfig) -> None:
        """Wrap an open gRPC channel; use :meth:`connect` (which also opens the data plane)."""
        super().__init__(address, info, channel, config)
        self._plane: ValuePlane | None = None
        self._remote: RemotePlane | None = None
        self._kind = DataPlane.TCP
        self._close_lock = threading.Lock()
        self._closed = False
        self._scoped_reader: ReadIndexReader | None = None
        """The read index scoped to this client's tenant, for :meth:`published_prefix` on a
        daemon without security (whose data plane's reader sees every owner's chunks)."""
        self._scoped_tried = False

    @classmethod
    def connect(cls, address: str, config: StoreClientConfig | None = None) -> StoreClient:
        """Open a gRPC channel to ``host:port``, fetch the daemon's info and pick the data plane.

        Raises PeerUnavailable (no daemon there), TierUnavailable (SHM or UCX was required but
        is not possible from here).
        """
        cfg = config or StoreClientConfig()
        channel, info = open_channel(address, cfg)
        client = cls(address, info, channel, cfg)
        try:
            client._use(*open_plane(client, cfg))
        except BaseException:
            client.close()
            raise
        return client

    def _use(self, plane: ValuePlane, remote: RemotePlane, kind: DataPlane) -> None:
        self._plane, self._remote, self._kind = plane, remote, kind
        # Bound once: a get is the plane's own method, with no dispatch frame in between (on
        # the shared-memory plane a lease-free get stays one Python frame and one C call).
        self.get_into = plane.get_into  # type: ignore[method-assign]

    @property
    def data_plane(self) -> DataPlane:
        """SHM, UCX or TCP: the plane this client moves single values over (a UCX client
        falls back to TCP per call while UCX is marked bad)."""
        return self._kind

    @property
    def plane(self) -> ValuePlane:
        """The data-plane object values go through (a ``ShmClient`` or a ``RemotePlane``)."""
        assert self._plane is not None, "StoreClient is built by connect()"
        return self._plane

    # --- values -----------------------------------------------------------------------------

    def put(self, key: bytes, src: Buffer, *, parent: bytes | None = None) -> None:
        """Store ``src`` under ``key`` (a child of ``parent``), all or nothing.

        Raises ChunkExists, ChunkBusy, CapacityError, InvalidArgument (bad key, empty value,
        uncached parent), PeerUnavailable.
        """
        self.plane.put(key, src, parent=parent)

    def get_into(self, key: bytes, dst: Buffer) -> int:
        """Fill ``dst`` (exactly the chunk's size) with the chunk; return its size.

        Raises ChunkNotFound, SizeMismatch (nothing copied), PeerUnavailable. (Replaced at
        connect by the plane's own ``get_into``.)
        """
        return self.plane.get_into(key, dst)

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[Buffer],
                 parents: Sequence[bytes | None] | None = None) -> list[bool]:
        """Store several chunks, ``keys[i]`` a child of ``parents[i]`` (None, or no
        ``parents``: a root); ``True`` where stored, ``False`` where the key was already stored.

        A parent must be cached already or be an earlier item of the same call (parent-first:
        one step's chain is ``parents = [last_saved_or_None, keys[0], ..., keys[-2]]``). Items
        are stored in order. An item refused otherwise (CapacityError, an uncached parent,
        TooManyLeases...) is not stored, nor is anything under it in the batch (its prefix is not
        cached, so nothing orphaned becomes visible); every other item is stored, then the
        first refusal is raised. Over shared memory the whole batch is one pipelined exchange
        on one connection: PUT_MANY requests for values up to 64 KiB; for larger ones
        RESERVE_MANY, one copy from ``srcs`` straight into the arena, COMMIT_MANY (the daemon
        reserves the next part while this client copies). Over TCP/UCX: roots are pipelined
        TCP puts; with parents, one put per item (``SetParents`` or an inline gRPC put).
        Raises InvalidArgument (bad key, empty value, lengths differ) before anything is sent,
        PeerUnavailable.
        """
        return self.plane.put_many(keys, srcs, parents)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> list[int | None]:
        """Fill ``dsts[i]`` with chunk ``keys[i]``; None where it is not stored. Over shared
        memory all of them are leased with one round trip when all are present."""
        return self.plane.get_many_into(keys, dsts)

    @contextlib.contextmanager
    def read_lease(self, key: bytes) -> Iterator[ReadLease]:
        """A read lease on the chunk in the daemon's arena for the ``with`` block: its
        ``view`` (read-only, zero-copy) keeps its bytes until the block ends or until
        ``deadline_s`` (``time.monotonic()``; request time + ``lease_ttl_s``, 60 s by default),
        whichever comes first; past the deadline ``view`` raises LeaseExpired. Only this client
        can end the lease.

        Same host only (TierUnavailable over TCP). Raises ChunkNotFound, CapacityError (the
        chunk lives in a slower tier and DRAM cannot take it now: use ``get_into``).
        """
        lease = self.plane.open_read(key)
        try:
            yield lease
        finally:
            lease.release()

    @contextlib.contextmanager
    def read_view(self, key: bytes) -> Iterator[memoryview]:
        """A read-only, zero-copy view of the chunk in the daemon's arena, valid inside the
        ``with`` block and at most until the lease's deadline (see :meth:`read_lease`, which
        also exposes it): a block that ends past the deadline raises LeaseExpired, since what
        it read late may be another chunk's bytes.

        Same host only (TierUnavailable over TCP). Raises ChunkNotFound, CapacityError (the
        chunk lives in a slower tier and DRAM cannot take it now: use ``get_into``).
        """
        with self.read_lease(key) as lease:
            yield lease.view
            deadline_s, now_s = lease.deadline_s, time.monotonic()
            if deadline_s is not None and now_s >= deadline_s:
                raise LeaseExpired(f"read_view of {short_key(lease.key)} outlived its lease "
                                   f"(the deadline passed {now_s - deadline_s:.3f} s before the "
                                   "block ended): bytes read after it may be another chunk's")

    def read_parts(self, parts: Sequence[Sequence[bytes]]) -> ShmBatchRead:
        """Read leases on the chunks of every part of ``parts``, for copying them straight
        out of the daemon's arena (:class:`~kvstore.dataplane.transport.shm.ShmBatchRead`:
        one connection, every part's request sent at once and served in order, so a part is
        pinned while the caller copies the one before; each part all or nothing, its ranges
        or its error from ``next_part()``; the caller must ``release()`` it).

        Same host only (TierUnavailable over TCP). Raises InvalidArgument, PeerUnavailable.
        """
        return self.plane.open_read_parts(parts)

    def get(self, key: bytes) -> bytearray:
        """The whole chunk in a new buffer. Raises ChunkNotFound."""
        k = check_key(key)
        sizes = self.sizes([k])
        if sizes[0] is None:
            raise ChunkNotFound(k, f"node {self._info.node_id}")
        out = bytearray(sizes[0])
        self.get_into(k, out)
        return out

    def load_prefix(self, keys: Sequence[bytes], dsts: Sequence[Buffer]) -> int:
        """Copy the longest cached prefix of ``keys`` into ``dsts``; return how many loaded.

        Every ``dsts[i]`` must be exactly the size of chunk ``keys[i]`` (SizeMismatch
        otherwise, nothing copied). A miss is a short count, not an error.
        """
        return self.plane.load_prefix(keys, dsts)

    # --- lease-free reads -------------------------------------------------------------------

    def lease_free_counters(self) -> LeaseFreeCounters:
        """What lease-free reads did so far (see :class:`LeaseFreeCounters`)."""
        return self.plane.lease_free_counters()

    def flush_reads(self) -> None:
        """Send the pending reports of lease-free reads and wait until the daemon counted them
        (its hit counters and recency then include every read this client finished)."""
        self.plane.flush_reads()

    def published_prefix(self, keys: Sequence[bytes]) -> int | None:
        """How many leading ``keys`` the daemon's read index publishes right now, for this
        client's tenant scope, without a round trip (microseconds; never blocks): a presence
        check, not a read (no hit counted, nothing pinned, so a chunk seen here may be evicted
        before it is read). None when there is no read index to ask (not the daemon's host,
        lease-free reads off or unsupported, the daemon gone).

        The index publishes committed DRAM chunks stored raw only: a key it does not publish
        may still be held by the daemon (in NVMe or HBM, compressed, being written, the index
        full), so a short count is what the index knows, and only :meth:`lookup` says what the
        daemon holds. The scope is the one :meth:`lookup` has on the daemon (``resolve_tenant``):
        with security, the data-plane session's readable owners (its tenant and the shared
        one); without, ``config.tenant`` (else the default tenant) and the shared one.
        """
        reader = self._presence_reader()
        if reader is None:
            return None
        n = 0
        locate = reader.locate
        for key in keys:
            if locate(key) is None:
                break
            n += 1
        # A dead daemon's mapping stays readable, frozen: what it says is not the store's.
        return n if reader.alive() else None

    def _presence_reader(self) -> ReadIndexReader | None:
        plane = self._plane
        if not isinstance(plane, ShmClient):
            return None
        reader = plane.reader
        if reader is None:  # off, unsupported, or dropped when the daemon died
            return None
        if reader.owners is not None or self.info.data_ticket_required:
            return reader  # ticketed: scoped as the daemon scopes this session (or every owner)
        # Without security the data plane's reader copies every owner's chunks (the daemon
        # does not check them there); a lookup sees only the tenant's and the shared ones.
        with self._close_lock:
            if self._scoped_tried or self._closed:
                return self._scoped_reader
            self._scoped_tried = True
            owners = (self._config.tenant or DEFAULT_TENANT, SHARED_TENANT)
            try:
                self._scoped_reader = ReadIndexReader.attach(
                    self.info.shm_read_index, plane.arena, owners=owners)
            except KvtierError:  # closed or gone since the plane attached it: no index
                self._scoped_reader = None
            return self._scoped_reader

    # --- control calls that wait for the data plane first ----------------------------------

    def remove(self, key: bytes) -> list[bytes]:
        """Drop a chunk and everything cached under it; return the dropped keys (empty: it was
        not held). Raises ChunkBusy while any of them is pinned."""
        self.plane.sync()
        return super().remove(key)

    def evict(self, *, tier: TierKind | None = None, bytes_: int = 0,
              key_prefix: bytes = b"") -> pb.EvictResponse:
        """Free ``bytes_`` in ``tier`` (demoting), or remove chunks whose key starts with
        ``key_prefix`` (optionally only in ``tier``)."""
        self.plane.sync()
        return super().evict(tier=tier, bytes_=bytes_, key_prefix=key_prefix)

    def stats(self) -> pb.StatsResponse:
        """Per-tier figures of the daemon (after reporting this client's lease-free reads)."""
        self.flush_reads()
        return super().stats()

    # --- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close every connection and unmap the arena. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            plane, remote = self._plane, self._remote
            scoped, self._scoped_reader = self._scoped_reader, None
        if scoped is not None:
            scoped.close()
        if plane is not None:
            plane.close()
        if remote is not None and remote is not plane:
            remote.close()
        super().close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""What the prefill and the decode worker share: the model, one KVClient per (daemon, tenant),
the socket server, load and completion reports to the conductor, and the etcd record.

Each worker runs one asyncio loop (sockets, conductor reports, etcd lease) and computes on one
extra thread (``_compute``): the model is not shared across threads, and KV clients are used
from that thread only. A failed conductor report is logged, never fails the request.

The worker's :class:`~kvstore.membership.engines.EngineRecord` is held by
:func:`~kvstore.membership.engines.register_engine` for the process's lifetime: a lease kept
alive every TTL/3, the record written again under a new lease when the old one lapsed (this
process or etcd stalled; the record went with it), so the conductor sees the worker again. The
record vanishes with the process (the lease is revoked on a clean stop, expires after a kill).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from kvstore.engine.frames import error_frame, read_frame, write_frame
from kvstore.engine.worker.config import WorkerConfig, load_worker_model
from kvstore.engine.worker.device import resolve_device
from kvstore.errors import InvalidArgument, InvariantViolation, KvtierError
from kvstore.membership.engines import EngineRecord, EngineRole

if TYPE_CHECKING:
    from kvstore.client.conductor_client import ConductorClient
    from kvstore.client.kv_client import KVClient
    from kvstore.client.kvlayout import KVLayout
    from kvstore.membership.etcd import EtcdClient
    from kvstore.membership.registration import Registration

log = logging.getLogger(__name__)

__all__ = ["WorkerBase", "doc_field", "doc_token_ids"]


class WorkerBase:
    """Model, KV clients, conductor reports and the etcd record; subclasses serve requests."""

    def __init__(self, config: WorkerConfig) -> None:
        """Record settings; :meth:`start` loads the model and opens everything."""
        self.config = config
        self._model: Any = None
        self._layout: KVLayout | None = None
        self._clients: dict[tuple[str, str], KVClient] = {}
        self._compute = cf.ThreadPoolExecutor(1, thread_name_prefix=f"{config.role.value}-compute")
        self._conductor: ConductorClient | None = None
        self._etcd: EtcdClient | None = None
        self._registration: Registration[EngineRecord] | None = None
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
        from kvstore.client.kv_client import KVClient, KVClientConfig
        from kvstore.client.kvlayout import namespace_for

        client = self._clients.get((address, tenant))
        if client is None:
            client = KVClient.connect(address, self.layout,
                                      namespace_for(self.layout, self.config.model_name, tenant),
                                      KVClientConfig(rpc_timeout_s=self.config.kv_rpc_timeout_s))
            self._clients[(address, tenant)] = client
        return client

    def drop_kv_client(self, address: str, tenant: str) -> None:
        """Close and forget the KVClient of (daemon, tenant) after that daemon failed it
        (compute thread only): the next request connects afresh. Kept, its gRPC channel would
        wait out its reconnect backoff (1 s, growing to 2 min while the daemon stays away)
        before it tried again, and the worker would go on recomputing for that long after the
        daemon came back."""
        client = self._clients.pop((address, tenant), None)
        if client is not None:
            with contextlib.suppress(KvtierError, OSError):
                client.close()

    async def start(self) -> str:
        import torch

        from kvstore.client.conductor_client import ConductorClient
        from kvstore.client.kvlayout import KVLayout, namespace_for
        from kvstore.membership.engines import register_engine
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
        record = EngineRecord(
            cfg.instance_id, cfg.role, cfg.model_name, cfg.node_id,
            kv_capacity_tokens=cfg.kv_capacity_tokens if cfg.role is EngineRole.DECODE else 0,
            address=self.address,
            kv_fingerprint=namespace_for(self.layout, cfg.model_name).fingerprint)
        self._registration = register_engine(self._etcd, record, ttl_s=cfg.lease_ttl_s,
                                             layout=layout)
        await self._registration.start()
        return self.address

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        if self._registration is not None:
            try:  # a revoke etcd does not answer is logged there: the TTL then ends the record
                await self._registration.close()
            except KvtierError as exc:  # the keepalive had crashed (a bug it logged)
                log.warning("deregistering failed (the record expires with its lease): %s", exc)
            self._registration = None
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


def doc_field(doc: dict[str, Any], name: str, kind: type) -> Any:
    """Field ``name`` of a request frame, checked to be a ``kind`` (a bool is not an int)."""
    value = doc.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise InvalidArgument(f"field {name!r} must be {kind.__name__}, got {value!r}")
    return value


def doc_token_ids(doc: dict[str, Any]) -> list[int]:
    """The frame's ``token_ids``: a non-empty list of ints."""
    ids = doc_field(doc, "token_ids", list)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidArgument("token_ids must be a non-empty list of ints")
    return list(ids)

"""The gateway: ask the conductor where a request runs, forward it, return tokens and timings.

For each request :meth:`Gateway.generate`

1. calls the conductor's ``Schedule`` with the token ids (the conductor hashes them into the
   chained keys with the KV fingerprint the workers published, and answers a prefill and a
   decode instance, the reusable prefix and a ticket),
2. finds both instances' addresses in their etcd :class:`~kvstore.membership.engines.EngineRecord`
   (:func:`~kvstore.membership.engines.list_engines` once, again when a name is unknown),
3. sends ``generate`` to the prefill worker (frames of :mod:`kvstore.engine.frames`), with the
   conductor's fetch plan when the decision has one (blocks ``[first_block, end_block)`` are
   on another node: ``src_node`` and its daemon's ``src_address``), and reads
   ``first_token`` (TTFT is measured here, from before the Schedule call) and then ``done``
   (the decode worker's answer, relayed).

A conductor rejection is an answer (:attr:`GatewayResult.accepted` false, with the reason), not
an exception. A worker's ``error`` frame is raised again as the kvtier error it names
(:func:`~kvstore.wire.error_from_name`); a worker that is unreachable or closes the connection
mid-request raises PeerUnavailable.

asyncio only; one gateway may serve any number of concurrent requests from one event loop.
The constructor records settings; :meth:`start` opens the conductor and etcd clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from kvstore.client.conductor_client import ConductorClient
from kvstore.engine.frames import read_frame, write_frame
from kvstore.errors import InvalidArgument, MembershipError, PeerUnavailable
from kvstore.membership.engines import EngineRecord, list_engines
from kvstore.membership.etcd import EtcdClient, KeyLayout, etcd_client
from kvstore.wire import error_from_name

__all__ = ["Gateway", "GatewayResult", "fetch_plan_doc"]


@dataclass(frozen=True, slots=True)
class GatewayResult:
    """One request, as the gateway saw it. Times are seconds on the gateway's clock except the
    workers' own measurements in ``prefill`` and ``decode`` (their ``asdict`` reports)."""

    request_id: str
    accepted: bool
    reject_reason: str = ""
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    """From before Schedule to the first token at the gateway (queue, load, compute, save)."""
    e2e_s: float = 0.0
    schedule_s: float = 0.0
    prefill_instance: str = ""
    decode_instance: str = ""
    conductor_prefix_blocks: int = 0
    fetch: dict[str, Any] | None = None
    """The conductor's fetch plan as sent to the prefill worker (None: nothing to fetch)."""
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)

    @property
    def tpot_s(self) -> float:
        """Gateway-side time per output token after the first (0 for one token)."""
        steps = len(self.tokens) - 1
        return (self.e2e_s - self.ttft_s) / steps if steps > 0 else 0.0


class Gateway:
    """See the module docstring."""

    def __init__(self, *, etcd_endpoint: str, prefix: str = "/kvtier/",
                 model_name: str = "ref-llama", request_timeout_s: float = 300.0) -> None:
        if request_timeout_s <= 0:
            raise InvalidArgument("request_timeout_s must be positive")
        self._etcd_endpoint = etcd_endpoint
        self._layout = KeyLayout(prefix)
        self.model_name = model_name
        self._timeout_s = request_timeout_s
        self._conductor: ConductorClient | None = None
        self._etcd: EtcdClient | None = None
        self._engines: dict[str, EngineRecord] = {}

    async def start(self) -> None:
        self._conductor = ConductorClient(etcd_endpoint=self._etcd_endpoint,
                                          layout=self._layout)
        self._etcd = etcd_client(self._etcd_endpoint)
        await self._list_engines()

    async def close(self) -> None:
        if self._conductor is not None:
            await self._conductor.close()
        if self._etcd is not None:
            with contextlib.suppress(Exception):  # etcd may already be gone at shutdown
                await self._etcd.close()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def conductor(self) -> ConductorClient:
        assert self._conductor is not None, "start() first"
        return self._conductor

    async def _list_engines(self) -> None:
        """Read every engine record again (malformed ones are skipped). MembershipError."""
        assert self._etcd is not None, "start() first"
        self._engines = await list_engines(self._etcd, layout=self._layout)

    async def _address(self, instance_id: str) -> str:
        record = self._engines.get(instance_id)
        if record is None:
            await self._list_engines()
            record = self._engines.get(instance_id)
        if record is None or record.address is None:
            raise MembershipError(f"engine {instance_id!r} has no address in etcd")
        return record.address

    async def generate(self, request_id: str, token_ids: list[int], *, max_new_tokens: int,
                       tenant: str = "", reuse: bool = True) -> GatewayResult:
        """Run one request through the cluster (see the module docstring)."""
        if max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens must be >= 1")
        t0 = time.perf_counter()
        reply = await self.conductor.schedule(
            request_id, self.model_name, token_ids=token_ids, tenant=tenant,
            input_tokens=len(token_ids), expected_output_tokens=max_new_tokens)
        t_sched = time.perf_counter() - t0
        if not reply.accepted:
            return GatewayResult(request_id, False, reject_reason=reply.message,
                                 schedule_s=t_sched)
        prefill_address = await self._address(reply.prefill_instance)
        decode_address = await self._address(reply.decode_instance)
        fetch = fetch_plan_doc(reply)
        host, port = prefill_address.rsplit(":", 1)
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            raise PeerUnavailable(f"prefill worker {prefill_address}: {exc}") from exc
        try:
            async with asyncio.timeout(self._timeout_s):
                await write_frame(writer, {
                    "op": "generate", "request_id": request_id, "token_ids": token_ids,
                    "tenant": tenant, "reuse": reuse, "prefix_blocks": reply.prefix_blocks,
                    "ticket": reply.ticket, "decode_address": decode_address,
                    "max_new_tokens": max_new_tokens, "fetch": fetch})
                first, _ = await read_frame(reader)
                _raise_if_error(first)
                ttft = time.perf_counter() - t0
                done, _ = await read_frame(reader)
                _raise_if_error(done)
        finally:
            writer.close()
        e2e = time.perf_counter() - t0
        decode = done.get("decode", {})
        return GatewayResult(request_id, True, tokens=list(decode.get("tokens", [])),
                             ttft_s=ttft, e2e_s=e2e, schedule_s=t_sched,
                             prefill_instance=reply.prefill_instance,
                             decode_instance=reply.decode_instance,
                             conductor_prefix_blocks=reply.prefix_blocks, fetch=fetch,
                             prefill=first.get("prefill", {}), decode=decode)


def fetch_plan_doc(reply: Any) -> dict[str, Any] | None:
    """The ``fetch`` field of a ``generate`` frame from a ScheduleReply: None when the decision
    has no fetch plan, else the source node, its daemon's gRPC address and the block range."""
    if not reply.HasField("fetch"):
        return None
    plan = reply.fetch
    return {"src_node": plan.src_node, "src_address": plan.src_grpc_address,
            "first_block": int(plan.first_block), "end_block": int(plan.end_block)}


def _raise_if_error(doc: dict[str, Any]) -> None:
    if doc.get("event") == "error":
        raise error_from_name(str(doc.get("error", "")), str(doc.get("message", "")))

"""Disaggregated prefill and decode workers: one process each, a plain-socket service each.

A request's life (the gateway, :mod:`kvstore.engine.gateway`, drives it)::

    gateway ──generate──► prefill worker                         decode worker
                            load the cached prefix (KVClient,
                            its node's daemon), compute the rest,
                            save every full block (layer by layer)
            ◄─first_token──┤
                            ├──decode (token ids, first token, ──► load the full blocks through
                            │   tail KV, where the blocks are)     kvtier (the prefill node's
                            │                                       daemon), append the tail,
                            │◄────────────────── done ─────────────┤ decode greedily
            ◄──── done ─────┤

**What moves through kvtier.** Every *full* block of the prompt: the prefill worker saves it
into its node's daemon and the decode worker loads it from there (shared memory on one host,
the TCP data plane across hosts). The last, partial block (fewer than ``block_tokens`` tokens)
cannot be a chunk (a chunk key names a full block of tokens), so its KV travels inside the
``decode`` frame, beside the first token; it is at most ``block_tokens - 1`` tokens of KV.
A decode whose load comes back short (a chunk evicted between the save and the load, a
daemon gone) recomputes from the first missing block, tail included: slower, never wrong.

Modules
    * :mod:`~kvstore.engine.worker.base`: what both workers share (model, KV clients, the
      socket server, conductor reports, the etcd record);
    * :mod:`~kvstore.engine.worker.prefill`: :class:`PrefillWorker` (reuse, fetch plans, saves);
    * :mod:`~kvstore.engine.worker.decode`: :class:`DecodeWorker` (continuous batching);
    * :mod:`~kvstore.engine.worker.config`: :class:`WorkerConfig`, :func:`load_worker_model`;
    * :mod:`~kvstore.engine.worker.device`: :func:`resolve_device` (a missing GPU is refused);
    * :mod:`~kvstore.engine.worker.cli`: :func:`serve`, :func:`main` and :data:`READY_PREFIX`
      (``python -m kvstore.engine.worker --role prefill ...``).

The frames on the sockets are :mod:`kvstore.engine.frames` (shared with the gateway).
"""

from kvstore.engine.worker.cli import READY_PREFIX, main, serve
from kvstore.engine.worker.config import WorkerConfig, load_worker_model
from kvstore.engine.worker.decode import DecodeWorker
from kvstore.engine.worker.device import resolve_device
from kvstore.engine.worker.prefill import PrefillWorker

__all__ = ["READY_PREFIX", "DecodeWorker", "PrefillWorker", "WorkerConfig", "load_worker_model",
           "main", "resolve_device", "serve"]

"""Finding store daemons through etcd from synchronous code: the client's own daemon (this
host's, or a named node) and the other nodes a fetch plan names.

etcd is reached only through :mod:`kvstore.membership` (the client box never imports aetcd).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore.errors import MembershipError

if TYPE_CHECKING:
    from kvstore.membership.etcd import KeyLayout
    from kvstore.membership.nodes import NodeRecord

__all__ = ["choose_node", "discover_nodes"]


def discover_nodes(etcd_endpoint: str | Sequence[str], key_layout: KeyLayout | None = None
                   ) -> dict[str, NodeRecord]:
    """The daemons registered in etcd, by id. ``etcd_endpoint`` is one member or a list (a
    sequence, or comma-separated text), tried in turn (docs/etcd-failover.md). Runs the asyncio
    etcd client on a private thread and loop, so it works from synchronous code and from inside
    a running event loop alike. Raises MembershipError."""
    from kvstore.membership.etcd import DEFAULT_LAYOUT, etcd_client
    from kvstore.membership.nodes import list_nodes

    layout = key_layout or DEFAULT_LAYOUT
    out: cf.Future[dict[str, NodeRecord]] = cf.Future()

    async def read() -> dict[str, NodeRecord]:
        async with etcd_client(etcd_endpoint) as client:
            return await list_nodes(client, layout=layout)

    def run() -> None:
        try:
            out.set_result(asyncio.run(read()))
        except BaseException as exc:  # handed to the caller below
            out.set_exception(exc)

    thread = threading.Thread(target=run, name="kvclient-etcd", daemon=True)
    thread.start()
    thread.join()
    return out.result()


def choose_node(nodes: dict[str, NodeRecord], node_id: str | None = None) -> NodeRecord:
    """``node_id``'s record, else the first node on this host, else the first by id."""
    if not nodes:
        raise MembershipError("no store daemon is registered in etcd")
    if node_id is not None:
        if node_id not in nodes:
            raise MembershipError(f"node {node_id!r} is not registered (known: {sorted(nodes)})")
        return nodes[node_id]
    here = socket.gethostname()
    local = [r for r in nodes.values() if r.hostname == here]
    return local[0] if local else next(iter(nodes.values()))


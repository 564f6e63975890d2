"""A stand-in store daemon for tests: register one node, report it, then idle until killed.

Usage: ``python -m tests.support.registrant ENDPOINT PREFIX NODE_ID TTL_S``. Prints
``REGISTERED <lease id hex>`` on stdout once the key is in etcd; exits 1 with the error on
stderr if registration fails. Tests kill it with SIGKILL to simulate a crashed daemon.
"""

from __future__ import annotations

import asyncio
import sys
import time

from kvstore.dataplane.tier import TierKind
from kvstore.errors import MembershipError
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.nodes import NodeRecord, register_node


def sample_record(node_id: str) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        grpc_address="127.0.0.1:50051",
        tcp_address="127.0.0.1:50052",
        hostname="test-host",
        tier_capacity_bytes={TierKind.DRAM: 1 << 30, TierKind.NVME: 8 << 30},
        started_at_unix_s=time.time(),
        version="test",
        shm_arena=f"kvtier-{node_id}",
    )


async def _main(endpoint: str, prefix: str, node_id: str, ttl_s: int) -> None:
    async with (
        etcd_client(endpoint) as client,
        register_node(
            client, sample_record(node_id), ttl_s=ttl_s, layout=KeyLayout(prefix)
        ) as registration,
    ):
        print(f"REGISTERED {registration.lease_id:x}", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    endpoint, prefix, node_id, ttl_text = sys.argv[1:5]
    try:
        asyncio.run(_main(endpoint, prefix, node_id, int(ttl_text)))
    except MembershipError as exc:
        print(f"registration failed: {exc}", file=sys.stderr)
        sys.exit(1)

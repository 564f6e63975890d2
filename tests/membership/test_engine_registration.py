"""Engine registration against a real etcd: ``register_engine`` (the generic Registration in
replace mode) and ``list_engines``, as the reference workers and the gateway use them.

The worker's own lease loop used to do this; these tests pin what it did: the record is under a
kept-alive lease, it comes back under a new lease after its lease was revoked (as if etcd had
expired it), a stale record of a dead predecessor is taken over, and it is gone once the engine
leaves. Every wait is bounded; nothing sleeps for a fixed time to make something happen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aetcd
import pytest

from kvstore.errors import InvalidArgument, MembershipError
from kvstore.keys import KVDtype, KVFingerprint
from kvstore.membership.engines import (
    EngineChange,
    EngineRecord,
    EngineRole,
    EngineWatch,
    list_engines,
    put_engine_record,
    register_engine,
)
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.launcher import LocalEtcd, _pick_free_ports
from kvstore.membership.registration import RegistrationState
from tests.support.etcd import run

TTL_S = 2


async def wait_until(predicate: Callable[[], Coroutine[Any, Any, bool]], what: str,
                     timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def prefill(instance_id: str = "prefill-0", **kw: Any) -> EngineRecord:
    fp = KVFingerprint(model="m", dtype=KVDtype.FLOAT16, num_layers=2, num_kv_heads=2,
                       head_dim=8, block_size_tokens=16)
    fields: dict[str, Any] = {"address": "127.0.0.1:7001", "kv_fingerprint": fp, **kw}
    return EngineRecord(instance_id, EngineRole.PREFILL, "m", "node-a", **fields)


async def stored_lease(client: aetcd.Client, record: EngineRecord, layout: KeyLayout) -> int:
    """The lease the record's key is attached to; 0 when the key is absent."""
    got = await client.get(record.key(layout).encode())
    return 0 if got is None else int(got.lease)


def test_register_engine_lists_updates_and_deregisters(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            record = prefill()
            decode = EngineRecord("decode-0", EngineRole.DECODE, "m", "node-b",
                                  kv_capacity_tokens=1000)
            assert await list_engines(client, layout=etcd_layout) == {}
            async with (
                register_engine(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg,
                register_engine(client, decode, ttl_s=TTL_S, layout=etcd_layout),
            ):
                assert reg.state is RegistrationState.REGISTERED
                assert reg.key == record.key(etcd_layout)
                assert await list_engines(client, layout=etcd_layout) == {
                    "decode-0": decode, "prefill-0": record}
                assert await stored_lease(client, record, etcd_layout) == reg.lease_id
                moved = dataclasses.replace(record, address="127.0.0.1:7002")
                await reg.update(moved)
                assert (await list_engines(client, layout=etcd_layout))["prefill-0"] == moved
                with pytest.raises(InvalidArgument, match="must keep its key"):
                    await reg.update(dataclasses.replace(
                        moved, role=EngineRole.DECODE, kv_capacity_tokens=1))
            # Leaving revokes the lease: the record is gone at once, not after the TTL.
            assert await list_engines(client, layout=etcd_layout) == {}

    run(aio, scenario())


def test_engine_record_reappears_after_its_lease_is_revoked(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    # What a stalled worker (or etcd) does to the record: the lease lapses and etcd deletes the
    # key with it. Revoking the lease does the same at once; the keepalive notices at its next
    # refresh (TTL 0), takes a new lease and writes the record again.
    async def scenario() -> None:
        states: list[RegistrationState] = []
        async with etcd_client(etcd_server.client_url) as client:
            record = prefill()
            async with (
                register_engine(client, record, ttl_s=TTL_S, layout=etcd_layout,
                                on_state_change=states.append) as reg,
                EngineWatch(client, layout=etcd_layout) as changes,
            ):
                assert await anext(changes) == EngineChange("prefill-0", record)
                old_lease = reg.lease_id
                assert old_lease is not None
                await client.revoke_lease(old_lease)
                assert await stored_lease(client, record, etcd_layout) == 0
                # The conductor's watch sees it leave and come back.
                async with asyncio.timeout(10):
                    assert await anext(changes) == EngineChange("prefill-0", None)
                    assert await anext(changes) == EngineChange("prefill-0", record)

                async def back_under_a_new_lease() -> bool:
                    lease = await stored_lease(client, record, etcd_layout)
                    return lease not in (0, old_lease) and lease == reg.lease_id

                await wait_until(back_under_a_new_lease, "the record under a new lease")
                await reg.wait_state(RegistrationState.REGISTERED)
                assert reg.leases_granted == 2
                assert await list_engines(client, layout=etcd_layout) == {"prefill-0": record}
        assert states[:3] == [RegistrationState.REGISTERED, RegistrationState.LOST,
                              RegistrationState.REGISTERED]
        assert states[-1] is RegistrationState.CLOSED

    run(aio, scenario())


def test_engine_takes_over_a_stale_record(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    # A worker restarted before its predecessor's lease expired: the old record (another lease,
    # still alive) is replaced at once, not refused as a duplicate node id would be, and it
    # stays when the predecessor's lease ends.
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            old = prefill(address="127.0.0.1:6999")
            stale = await client.lease(30)
            await put_engine_record(client, old, layout=etcd_layout, lease_id=stale.id)
            record = prefill()
            async with register_engine(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg:
                assert reg.state is RegistrationState.REGISTERED
                assert await stored_lease(client, record, etcd_layout) == reg.lease_id
                assert await list_engines(client, layout=etcd_layout) == {"prefill-0": record}
                await client.revoke_lease(stale.id)
                assert await list_engines(client, layout=etcd_layout) == {"prefill-0": record}
                # An update after the takeover is written under our lease, too.
                moved = dataclasses.replace(record, address="127.0.0.1:7003")
                await reg.update(moved)
                assert await list_engines(client, layout=etcd_layout) == {"prefill-0": moved}
                assert await stored_lease(client, record, etcd_layout) == reg.lease_id

    run(aio, scenario())


def test_list_engines_skips_malformed_and_misplaced_records(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            good = prefill()
            await put_engine_record(client, good, layout=etcd_layout)
            prefix = f"{etcd_layout.prefix}engines/"
            await client.put(f"{prefix}prefill/garbage".encode(), b"not json")
            # A valid record under another instance's key: the conductor skips it too.
            await client.put(f"{prefix}prefill/elsewhere".encode(), prefill("p-9").to_json())
            assert await list_engines(client, layout=etcd_layout) == {"prefill-0": good}

    run(aio, scenario())


def test_register_engine_rejects_bad_arguments_and_an_unreachable_etcd(
    aio: asyncio.Runner, etcd_layout: KeyLayout
) -> None:
    (closed_port,) = _pick_free_ports(1)

    async def scenario() -> None:
        async with etcd_client(f"127.0.0.1:{closed_port}", rpc_timeout_s=2.0) as client:
            with pytest.raises(InvalidArgument, match="EngineRecord"):
                register_engine(client, "prefill-0", layout=etcd_layout)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="ttl_s"):
                register_engine(client, prefill(), ttl_s=1, layout=etcd_layout)
            registration = register_engine(client, prefill(), layout=etcd_layout)
            with pytest.raises(MembershipError):
                await registration.start()
            assert registration.state is RegistrationState.PENDING
            with pytest.raises(MembershipError):
                await list_engines(client, layout=etcd_layout)

    run(aio, scenario())



def test_engine_record_deleted_or_overwritten_by_hand_is_written_back(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    """Issue 12: the same healing for engines (REPLACE): deleted or overwritten while the lease
    lives, the record comes back under the same lease, and the conductor's watch sees it."""
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            record = prefill()
            key = record.key(etcd_layout).encode()
            async with (
                register_engine(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg,
                EngineWatch(client, layout=etcd_layout) as changes,
            ):
                assert await anext(changes) == EngineChange("prefill-0", record)

                async def restored() -> bool:
                    return (await stored_lease(client, record, etcd_layout) == reg.lease_id
                            and await list_engines(client, layout=etcd_layout)
                            == {"prefill-0": record})

                await client.delete(key)
                async with asyncio.timeout(5 * TTL_S):
                    assert await anext(changes) == EngineChange("prefill-0", None)
                    assert await anext(changes) == EngineChange("prefill-0", record)
                await wait_until(restored, "the record written back after a delete",
                                 timeout_s=5 * TTL_S)
                await client.put(key, b"{not an engine record")
                await wait_until(restored, "the record written back after an overwrite",
                                 timeout_s=5 * TTL_S)
                assert reg.leases_granted == 1 and reg.state is RegistrationState.REGISTERED

    run(aio, scenario(), timeout_s=60.0)

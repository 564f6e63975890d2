"""Membership against a real etcd: registration, discovery, watch, failures.

Every wait is bounded by a deadline; nothing sleeps for a fixed time. Fault tests
(restart, pause) use a private server; the rest share the session server under a
per-test key prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aetcd
import pytest

from kvstore.dataplane.tier import TierKind
from kvstore.errors import InvalidArgument, MembershipError
from kvstore.membership.etcd import KeyLayout, etcd_call, etcd_client
from kvstore.membership.launcher import LocalEtcd, _pick_free_ports
from kvstore.membership.nodes import (
    NodeEvent,
    NodeEventKind,
    NodeRecord,
    _diff,
    _Member,
    list_nodes,
    register_node,
    watch_nodes,
)
from kvstore.membership.registration import RegistrationState
from tests.support.etcd import run
from tests.support.registrant import sample_record

REPO_ROOT = Path(__file__).resolve().parents[2]
TTL_S = 2
EVENT_TIMEOUT_S = 10.0


async def next_events(
    events: AsyncIterator[NodeEvent], count: int, timeout_s: float = EVENT_TIMEOUT_S
) -> list[tuple[NodeEventKind, str]]:
    """The next ``count`` events as (kind, node_id), failing with what came if they do not."""
    got: list[tuple[NodeEventKind, str]] = []
    try:
        async with asyncio.timeout(timeout_s):
            while len(got) < count:
                event = await anext(events)
                got.append((event.kind, event.node_id))
    except TimeoutError:
        pytest.fail(f"expected {count} node events within {timeout_s} s, got {got}")
    return got


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


async def wait_state(registration: Any, state: RegistrationState, timeout_s: float = 10.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            await registration.wait_state(state)
    except TimeoutError:
        pytest.fail(
            f"registration stayed {registration.state} instead of {state} for {timeout_s} s"
        )


# --------------------------------------------------------------------------- pure logic


def test_record_round_trips_through_json_and_orders_tiers() -> None:
    record = dataclasses.replace(
        sample_record("node-a"),
        tier_capacity_bytes={TierKind.NVME: 3, TierKind.HBM: 1, TierKind.DRAM: 2},
        ucx_address="deadbeef",
    )
    decoded = NodeRecord.from_json(record.to_json())
    assert decoded == record
    assert list(decoded.tier_capacity_bytes) == [TierKind.HBM, TierKind.DRAM, TierKind.NVME]
    doc = json.loads(record.to_json())
    assert doc["tier_capacity_bytes"] == {"hbm": 1, "dram": 2, "nvme": 3}
    assert doc["schema"] == 1
    with pytest.raises(TypeError):
        record.tier_capacity_bytes[TierKind.HBM] = 5  # type: ignore[index]


def test_record_from_json_ignores_unknown_fields() -> None:
    record = sample_record("node-a")
    doc = json.loads(record.to_json())
    doc["added_in_a_later_version"] = {"x": 1}
    assert NodeRecord.from_json(json.dumps(doc).encode()) == record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"grpc_address": "no-port"}, "host:port"),
        ({"tcp_address": "h:70000"}, "host:port"),
        ({"node_id": "a/b"}, "node_id"),
        ({"tier_capacity_bytes": {"dram": True}}, "non-negative int"),
        ({"tier_capacity_bytes": {"dram": -1}}, "non-negative int"),
        ({"tier_capacity_bytes": {"cxl": 1}}, "cxl"),
        ({"started_at_unix_s": "yesterday"}, "started_at_unix_s"),
        ({"schema": None}, "schema"),
        ({"hostname": ""}, "hostname"),
    ],
)
def test_record_from_json_rejects_malformed(change: dict[str, Any], message: str) -> None:
    doc = json.loads(sample_record("node-a").to_json())
    doc.update(change)
    with pytest.raises(InvalidArgument, match=message):
        NodeRecord.from_json(json.dumps(doc).encode())


@pytest.mark.parametrize("data", [b"", b"not json", b"[1, 2]", b"\xff\xfe", b'{"schema": 1}'])
def test_record_from_json_rejects_garbage(data: bytes) -> None:
    with pytest.raises(InvalidArgument):
        NodeRecord.from_json(data)


def test_key_layout() -> None:
    layout = KeyLayout("/c1/")
    assert layout.node_key("n1") == "/c1/nodes/n1"
    assert layout.node_id_of("/c1/nodes/n1") == "n1"
    assert layout.node_id_of("/c1/nodes/a/b") is None
    assert layout.node_id_of("/c2/nodes/n1") is None
    assert layout.engine_key("prefill", "e0") == "/c1/engines/prefill/e0"
    assert layout.conductor_leader_key == "/c1/conductor/leader"
    for bad in ("c1/", "/c1", "//", "/a//b/"):
        with pytest.raises(InvalidArgument):
            KeyLayout(bad)
    with pytest.raises(InvalidArgument):
        layout.node_key("../etc")


def test_diff_reports_leave_join_update_and_restart_in_order() -> None:
    a, b, c = (sample_record(n) for n in ("a", "b", "c"))
    b2 = dataclasses.replace(b, version="2")
    known = {"a": _Member(10, a), "b": _Member(11, b), "c": _Member(12, c)}
    current = {"b": _Member(11, b2), "c": _Member(20, c), "d": _Member(21, sample_record("d"))}
    events = [(e.kind, e.node_id, e.revision) for e in _diff(known, current, 30)]
    assert events == [
        (NodeEventKind.LEFT, "a", 30),
        (NodeEventKind.UPDATED, "b", 30),
        (NodeEventKind.LEFT, "c", 30),  # re-created key: the node restarted
        (NodeEventKind.JOINED, "c", 30),
        (NodeEventKind.JOINED, "d", 30),
    ]
    assert known == current
    assert _diff(known, dict(current), 31) == []


def test_etcd_call_never_swallows_a_cancellation() -> None:
    """A cancel that lands as the call completes must still cancel (3.11's wait_for loses it;
    that once left a keepalive running after close())."""

    async def scenario() -> str:
        reply: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        call = asyncio.create_task(etcd_call("refresh lease", reply, timeout_s=5.0))
        await asyncio.sleep(0)  # the call is now waiting for its reply
        reply.set_result(1)
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            return "cancelled"
        return "swallowed"

    assert asyncio.run(scenario()) == "cancelled"


def test_etcd_call_translates_timeouts_and_client_errors() -> None:
    async def scenario() -> None:
        never: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with pytest.raises(MembershipError, match="did not answer within"):
            await etcd_call("get", never, timeout_s=0.01)

        async def failing() -> int:
            raise aetcd.ConnectionFailedError("connection refused")

        with pytest.raises(MembershipError, match="get: connection refused") as info:
            await etcd_call("get", failing(), timeout_s=1.0)
        assert isinstance(info.value.__cause__, aetcd.ConnectionFailedError)

    asyncio.run(scenario())


# --------------------------------------------------------------------------- real etcd


def test_register_list_deregister(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            assert await list_nodes(client, layout=etcd_layout) == {}
            record = sample_record("node-a")
            async with register_node(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg:
                assert reg.state is RegistrationState.REGISTERED
                assert await list_nodes(client, layout=etcd_layout) == {"node-a": record}
                stored = await client.get(etcd_layout.node_key("node-a").encode())
                assert stored.lease == reg.lease_id
                updated = dataclasses.replace(record, tier_capacity_bytes={TierKind.DRAM: 7})
                await reg.update(updated)
                assert await list_nodes(client, layout=etcd_layout) == {"node-a": updated}
            # Leaving revokes the lease: the key is gone at once, not after the TTL.
            # mypy keeps the narrowing from the assert above across the awaits.
            assert reg.state is RegistrationState.CLOSED  # type: ignore[comparison-overlap]
            assert await list_nodes(client, layout=etcd_layout) == {}

    run(aio, scenario())


def test_duplicate_node_id_is_rejected(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            first = sample_record("node-a")
            impostor = dataclasses.replace(first, hostname="impostor")
            async with register_node(client, first, ttl_s=TTL_S, layout=etcd_layout):
                with pytest.raises(MembershipError, match="already registered"):
                    async with register_node(client, impostor, ttl_s=TTL_S, layout=etcd_layout):
                        pytest.fail("a second live node with the same id was accepted")
                assert await list_nodes(client, layout=etcd_layout) == {"node-a": first}
            # Once the first node is gone, the id is free again.
            async with register_node(client, impostor, ttl_s=TTL_S, layout=etcd_layout):
                assert await list_nodes(client, layout=etcd_layout) == {"node-a": impostor}

    run(aio, scenario())


def test_watch_reports_snapshot_then_changes_in_order(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            kw: dict[str, Any] = {"ttl_s": TTL_S, "layout": etcd_layout}
            async with (
                register_node(client, sample_record("node-a"), **kw),
                watch_nodes(client, layout=etcd_layout) as events,
            ):
                assert await next_events(events, 1) == [(NodeEventKind.JOINED, "node-a")]
                async with register_node(client, sample_record("node-b"), **kw) as reg_b:
                    await reg_b.update(dataclasses.replace(reg_b.record, version="2"))
                    await reg_b.update(reg_b.record)  # unchanged: no event
                async with register_node(client, sample_record("node-c"), **kw):
                    pass
                assert await next_events(events, 5) == [
                    (NodeEventKind.JOINED, "node-b"),
                    (NodeEventKind.UPDATED, "node-b"),
                    (NodeEventKind.LEFT, "node-b"),
                    (NodeEventKind.JOINED, "node-c"),
                    (NodeEventKind.LEFT, "node-c"),
                ]
            # Events carry records; LEFT carries the last record seen for the node.
            record_d = sample_record("node-d")
            record_d2 = dataclasses.replace(record_d, tier_capacity_bytes={TierKind.DRAM: 1})
            async with watch_nodes(client, layout=etcd_layout) as events:
                async with register_node(client, record_d, **kw) as reg_d:
                    await reg_d.update(record_d2)
                async with asyncio.timeout(EVENT_TIMEOUT_S):
                    got = [await anext(events) for _ in range(3)]
                assert [(e.kind, e.record) for e in got] == [
                    (NodeEventKind.JOINED, record_d),
                    (NodeEventKind.UPDATED, record_d2),
                    (NodeEventKind.LEFT, record_d2),
                ]
                assert got[0].revision < got[1].revision < got[2].revision

    run(aio, scenario())


def test_malformed_values_are_logged_and_skipped(
    aio: asyncio.Runner,
    etcd_server: LocalEtcd,
    etcd_layout: KeyLayout,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvstore.membership")

    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            good = sample_record("good")
            bad_tier = json.loads(good.to_json())
            bad_tier.update(node_id="cxl", tier_capacity_bytes={"cxl": 1})
            junk = {
                "garbage": b"not json",
                "wrong-id": sample_record("someone-else").to_json(),
                "cxl": json.dumps(bad_tier).encode(),
                "nested/key": good.to_json(),
            }
            for name, value in junk.items():
                await client.put(f"{etcd_layout.nodes_prefix}{name}".encode(), value)
            await client.put(etcd_layout.node_key("good").encode(), good.to_json())
            assert await list_nodes(client, layout=etcd_layout) == {"good": good}
            async with watch_nodes(client, layout=etcd_layout) as events:
                assert await next_events(events, 1) == [(NodeEventKind.JOINED, "good")]
                await client.put(etcd_layout.node_key("live-bad").encode(), b"{")
                await client.put(etcd_layout.node_key("good").encode(), b"[]")  # bad update
                await client.delete(etcd_layout.node_key("garbage").encode())  # never reported
                await client.put(
                    etcd_layout.node_key("late").encode(), sample_record("late").to_json()
                )
                await client.delete(etcd_layout.node_key("good").encode())
                assert await next_events(events, 2) == [
                    (NodeEventKind.JOINED, "late"),
                    (NodeEventKind.LEFT, "good"),
                ]

    run(aio, scenario())
    messages = "\n".join(r.getMessage() for r in caplog.records)
    for fragment in ("not valid JSON", "someone-else", "cxl", "nested/key", "live-bad"):
        assert fragment in messages


def test_key_disappears_when_registrant_process_is_killed(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with (
            etcd_client(etcd_server.client_url) as client,
            watch_nodes(client, layout=etcd_layout) as events,
        ):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.support.registrant",
                etcd_server.client_url,
                etcd_layout.prefix,
                "doomed",
                str(TTL_S),
                cwd=REPO_ROOT,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                async with asyncio.timeout(EVENT_TIMEOUT_S):
                    line = await proc.stdout.readline()  # type: ignore[union-attr]
                assert line.startswith(b"REGISTERED"), (line, await proc.stderr.read())  # type: ignore[union-attr]
                assert await next_events(events, 1) == [(NodeEventKind.JOINED, "doomed")]
                key = etcd_layout.node_key("doomed").encode()
                stored = await client.get(key)
                assert stored is not None and int(stored.lease) != 0
                proc.send_signal(signal.SIGKILL)  # no chance to revoke: only the TTL removes it
                assert await proc.wait() == -signal.SIGKILL
                # The LEFT is of that very key (same create revision), and it is really gone.
                # (No timing is asserted: when etcd expires the lease is etcd's business.)
                async with asyncio.timeout(5 * TTL_S + 5):  # a bounded wait, generous
                    left = await anext(events)
                assert (left.kind, left.node_id) == (NodeEventKind.LEFT, "doomed")
                assert left.create_revision == stored.create_revision
                assert left.revision > stored.mod_revision
                assert await client.get(key) is None
                assert await list_nodes(client, layout=etcd_layout) == {}
            finally:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()

    run(aio, scenario())


def test_expired_lease_is_replaced_and_key_rewritten(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            record = sample_record("node-a")
            async with (
                register_node(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg,
                watch_nodes(client, layout=etcd_layout) as events,
            ):
                assert await next_events(events, 1) == [(NodeEventKind.JOINED, "node-a")]
                old_lease = reg.lease_id
                assert old_lease is not None
                await client.revoke_lease(old_lease)  # as if etcd had expired it
                assert await next_events(events, 2) == [
                    (NodeEventKind.LEFT, "node-a"),
                    (NodeEventKind.JOINED, "node-a"),
                ]
                await wait_state(reg, RegistrationState.REGISTERED)
                assert reg.leases_granted == 2
                assert reg.lease_id not in (None, old_lease)
                stored = await client.get(etcd_layout.node_key("node-a").encode())
                assert stored.lease == reg.lease_id
                assert NodeRecord.from_json(stored.value) == record

    run(aio, scenario())


def test_unreachable_etcd_fails_fast_with_membership_error(
    aio: asyncio.Runner, etcd_layout: KeyLayout
) -> None:
    (closed_port,) = _pick_free_ports(1)

    async def scenario() -> None:
        async with etcd_client(f"127.0.0.1:{closed_port}", rpc_timeout_s=2.0) as client:
            with pytest.raises(MembershipError) as info:
                await list_nodes(client, layout=etcd_layout)
            assert info.value.__cause__ is not None
            with pytest.raises(MembershipError):
                async with watch_nodes(client, layout=etcd_layout, rpc_timeout_s=2.0):
                    pytest.fail("entered a watch of an unreachable etcd")
            registration = register_node(client, sample_record("n"), layout=etcd_layout)
            with pytest.raises(MembershipError):
                await registration.start()
            assert registration.state is RegistrationState.PENDING

    run(aio, scenario())


# --------------------------------------------------------------------------- faults


def test_registration_and_watch_survive_etcd_restart(
    aio: asyncio.Runner, private_etcd: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        states: list[RegistrationState] = []
        async with etcd_client(private_etcd.client_url) as client:
            record = sample_record("node-a")
            async with (
                register_node(
                    client, record, ttl_s=TTL_S, layout=etcd_layout, on_state_change=states.append
                ) as reg,
                watch_nodes(client, layout=etcd_layout) as events,
            ):
                assert await next_events(events, 1) == [(NodeEventKind.JOINED, "node-a")]
                private_etcd.stop()
                await wait_state(reg, RegistrationState.LOST, timeout_s=TTL_S + 5)
                private_etcd.start()  # same ports, same data directory
                await wait_state(reg, RegistrationState.REGISTERED, timeout_s=15)
                stored = await client.get(etcd_layout.node_key("node-a").encode())
                assert stored is not None and stored.lease == reg.lease_id
                assert await list_nodes(client, layout=etcd_layout) == {"node-a": record}
                # The watch reconnected: a node joining after the restart is reported,
                # and the watcher's view ends up equal to etcd's.
                view = {"node-a"}
                async with register_node(
                    client, sample_record("node-b"), ttl_s=TTL_S, layout=etcd_layout
                ):
                    while "node-b" not in view:
                        for kind, node_id in await next_events(events, 1, timeout_s=15):
                            if kind is NodeEventKind.LEFT:
                                view.discard(node_id)
                            else:
                                view.add(node_id)
                    assert view == set(await list_nodes(client, layout=etcd_layout))
        assert states[:2] == [RegistrationState.REGISTERED, RegistrationState.LOST]
        assert RegistrationState.REGISTERED in states[2:]

    run(aio, scenario(), timeout_s=45)


def test_paused_etcd_marks_registration_lost_until_resumed(
    aio: asyncio.Runner, private_etcd: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    async def scenario() -> None:
        async with (
            etcd_client(private_etcd.client_url, rpc_timeout_s=1.0) as client,
            register_node(client, sample_record("node-a"), ttl_s=TTL_S, layout=etcd_layout) as reg,
        ):
            private_etcd.pause()  # connections stay open, nothing answers
            try:
                await wait_state(reg, RegistrationState.LOST, timeout_s=TTL_S + 5)
                with pytest.raises(MembershipError, match="did not answer"):
                    await list_nodes(client, layout=etcd_layout, rpc_timeout_s=0.5)
            finally:
                private_etcd.resume()
            await wait_state(reg, RegistrationState.REGISTERED, timeout_s=15)
            stored = await client.get(etcd_layout.node_key("node-a").encode())
            assert stored is not None and stored.lease == reg.lease_id

    run(aio, scenario(), timeout_s=40)


def test_key_deleted_or_overwritten_by_hand_is_written_back(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    """Issue 12: the key deleted, overwritten under no lease, or overwritten under the daemon's
    own lease, while that lease lives: the keepalive notices and restores the record (within
    one keepalive step, ttl_s / 3; the wait below is bounded generously for a noisy machine)."""
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            record = sample_record("node-a")
            key = etcd_layout.node_key("node-a").encode()

            async def restored() -> bool:
                stored = await client.get(key)
                return (stored is not None and stored.lease == reg.lease_id
                        and stored.value == record.to_json())

            async def wait_restored(what: str) -> None:
                deadline = time.monotonic() + 5 * TTL_S
                while not await restored():
                    if time.monotonic() > deadline:
                        pytest.fail(f"the record was not written back after {what}")
                    await asyncio.sleep(0.05)

            async with register_node(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg:
                lease = reg.lease_id
                await client.delete(key)
                await wait_restored("a delete")
                await client.put(key, b'{"someone": "else"}')  # a plain put: no lease
                await wait_restored("an overwrite under no lease")
                await client.put(key, b"garbage", lease=reg.lease_id)
                await wait_restored("an overwrite under its own lease")
                await client.put(key, record.to_json())  # its value, detached from the lease
                await wait_restored("detaching it from its lease")
                assert reg.lease_id == lease and reg.leases_granted == 1
                assert reg.state is RegistrationState.REGISTERED
            assert await client.get(key) is None  # leaving still revokes it

    run(aio, scenario(), timeout_s=60.0)


def test_start_takes_a_key_that_no_lease_holds(
    aio: asyncio.Runner, etcd_server: LocalEtcd, etcd_layout: KeyLayout
) -> None:
    """A value written by hand under no lease is not a live daemon: registering takes it."""
    async def scenario() -> None:
        async with etcd_client(etcd_server.client_url) as client:
            record = sample_record("node-a")
            key = etcd_layout.node_key("node-a").encode()
            await client.put(key, b"left over by hand")
            async with register_node(client, record, ttl_s=TTL_S, layout=etcd_layout) as reg:
                stored = await client.get(key)
                assert stored.lease == reg.lease_id
                assert NodeRecord.from_json(stored.value) == record

    run(aio, scenario())

"""Clients of a real three-member etcd cluster when a member stops answering (SIGSTOP).

Each test starts its own cluster (:class:`~kvstore.membership.launcher.LocalEtcdCluster`) on
ephemeral ports in a temp dir. The member a client talks to first is the first of its list;
pausing it leaves the cluster with quorum, so everything must carry on through the other two:
a real daemon's record is kept alive (never deleted, same lease) for longer than its TTL, a
watch started before the pause sees every later change exactly once, and the conductor's
elected leader keeps leading. With two members paused (quorum lost) a daemon degrades as with
a single etcd down, and recovers when they come back. No timed assertions: conditions are
awaited with generous deadlines.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aetcd
import pytest

from kvstore.client.discovery import discover_nodes
from kvstore.membership.election import Election, LeaderRecord
from kvstore.membership.etcd import KeyLayout, etcd_client
from kvstore.membership.failover import EtcdClusterClient
from kvstore.membership.launcher import LocalEtcdCluster
from kvstore.membership.nodes import NodeEventKind, NodeRecord, watch_nodes
from tests.support.daemon import DaemonProcess, kvtier
from tests.support.etcd import require_etcd, run

DEADLINE_S = 60.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalEtcdCluster]:
    require_etcd()
    etcd = LocalEtcdCluster(work_dir=tmp_path / "etcd-cluster", name="kvtier-failover")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.close()


async def wait_until(predicate: Callable[[], bool], what: str,
                     timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.1)


def node_record(node_id: str, port: int) -> NodeRecord:
    return NodeRecord(node_id=node_id, grpc_address=f"127.0.0.1:{port}",
                      tcp_address=f"127.0.0.1:{port + 1}", hostname="test-host",
                      tier_capacity_bytes={}, started_at_unix_s=1.0, version="test")


def test_a_daemon_keeps_its_record_while_its_member_is_paused(
        tmp_path: Path, cluster: LocalEtcdCluster, aio: asyncio.Runner) -> None:
    layout = KeyLayout("/kvtier-failover/daemon/")
    ttl_s = 6
    daemon = DaemonProcess(tmp_path, "node-f", nvme=False, etcd_endpoint=cluster.endpoints,
                           etcd_prefix=layout.prefix, settings={"etcd.ttl_s": str(ttl_s)})
    key = layout.node_key("node-f").encode()
    others = cluster.client_urls[1:]  # the observer never talks to the paused member

    async def scenario() -> None:
        async with etcd_client(others) as observer:
            kv = await observer.get(key)
            assert kv is not None, "the daemon did not register"
            lease, created = int(kv.lease), int(kv.create_revision)
            deletes: list[aetcd.Event] = []
            watch = await observer.watch(key, start_revision=int(kv.mod_revision) + 1)

            async def collect() -> None:
                async for event in watch:
                    if event.kind == aetcd.EventKind.DELETE:
                        deletes.append(event)

            collector = asyncio.create_task(collect())
            cluster.members[0].pause()
            paused_at = time.monotonic()
            try:
                await wait_until(lambda: "moving to" in daemon.log_path.read_text(),
                                 "the daemon's etcd client to leave the paused member")
                # Two whole TTLs after the pause: without failover the lease would be gone.
                await wait_until(lambda: time.monotonic() > paused_at + 2 * ttl_s,
                                 "two TTLs to pass")
                info = await observer.get_lease_info(lease)
                kv = await observer.get(key)
            finally:
                cluster.members[0].resume()
                await watch.cancel()
                collector.cancel()
            assert deletes == [], f"the daemon's key was deleted: {deletes}"
            assert kv is not None and int(kv.lease) == lease
            assert int(kv.create_revision) == created
            assert int(info.TTL) > 0, "the daemon's lease expired"

    daemon.start()
    try:
        run(aio, scenario(), timeout_s=3 * DEADLINE_S)
    finally:
        daemon.stop()


def test_a_watch_sees_every_change_once_across_a_paused_member(
        cluster: LocalEtcdCluster, aio: asyncio.Runner) -> None:
    layout = KeyLayout("/kvtier-failover/watch/")

    async def scenario() -> None:
        async with etcd_client(cluster.client_urls) as watcher_client, \
                etcd_client(cluster.client_urls[1:]) as writer:
            assert isinstance(watcher_client, EtcdClusterClient)
            await writer.put(layout.node_key("before").encode(),
                             node_record("before", 1000).to_json())
            async with watch_nodes(watcher_client, layout=layout) as watch:
                first = await anext(watch)
                assert (first.kind, first.record.node_id) == (NodeEventKind.JOINED, "before")
                assert watcher_client.member == watcher_client.members[0]
                cluster.members[0].pause()
                try:
                    # the writer's requests need a leader (the paused member may have led)
                    await wait_until(lambda: cluster.leader() in (1, 2),
                                     "a leader among the members left")
                    expected: list[tuple[NodeEventKind, str, int]] = []
                    for i in range(6):  # joins, updates, leaves, written through the others
                        node_id = f"n{i}"
                        reply = await writer.put(layout.node_key(node_id).encode(),
                                                 node_record(node_id, 2000 + i).to_json())
                        expected.append((NodeEventKind.JOINED, node_id, reply.header.revision))
                    for i in range(0, 6, 2):
                        node_id = f"n{i}"
                        reply = await writer.put(layout.node_key(node_id).encode(),
                                                 node_record(node_id, 3000 + i).to_json())
                        expected.append((NodeEventKind.UPDATED, node_id, reply.header.revision))
                    for i in range(1, 6, 2):
                        node_id = f"n{i}"
                        deleted = await writer.delete(layout.node_key(node_id).encode())
                        assert deleted is not None
                        expected.append((NodeEventKind.LEFT, node_id, deleted.header.revision))
                    seen: list[tuple[NodeEventKind, str, int]] = []

                    async def collect(count: int) -> None:
                        while len(seen) < count:
                            event = await anext(watch)
                            seen.append((event.kind, event.record.node_id, event.revision))

                    async with asyncio.timeout(DEADLINE_S * 2):
                        await collect(len(expected))
                    # a sentinel written last: nothing may come between the deletes and it
                    reply = await writer.put(layout.node_key("sentinel").encode(),
                                             node_record("sentinel", 4000).to_json())
                    async with asyncio.timeout(DEADLINE_S):
                        await collect(len(expected) + 1)
                finally:
                    cluster.members[0].resume()
            assert seen[:len(expected)] == expected
            assert seen[-1] == (NodeEventKind.JOINED, "sentinel", reply.header.revision)
            assert watch.resumes >= 1 and watch.relists == 0, (watch.resumes, watch.relists)
            assert watcher_client.member != watcher_client.members[0]

    run(aio, scenario(), timeout_s=4 * DEADLINE_S)


def test_a_watch_whose_revision_was_compacted_resyncs_in_full(
        cluster: LocalEtcdCluster, aio: asyncio.Runner) -> None:
    """Resuming needs the history since the last revision seen; compacted away, the watch
    re-lists and reports the difference instead (nothing missed, nothing twice)."""
    layout = KeyLayout("/kvtier-failover/compacted/")

    async def scenario() -> None:
        async with etcd_client(cluster.client_urls) as watcher_client, \
                etcd_client(cluster.client_urls[1:]) as writer:
            await writer.put(layout.node_key("a").encode(), node_record("a", 1000).to_json())
            async with watch_nodes(watcher_client, layout=layout) as watch:
                assert (await anext(watch)).record.node_id == "a"
                cluster.members[0].pause()
                try:
                    # the writer's requests need a leader (the paused member may have led)
                    await wait_until(lambda: cluster.leader() in (1, 2),
                                     "a leader among the members left")
                    await writer.put(layout.node_key("b").encode(),
                                     node_record("b", 2000).to_json())
                    await writer.delete(layout.node_key("a").encode())
                    reply = await writer.put(layout.node_key("c").encode(),
                                             node_record("c", 3000).to_json())
                    await writer.compact(reply.header.revision)
                    seen = []
                    async with asyncio.timeout(DEADLINE_S * 2):
                        while len(seen) < 3:
                            event = await anext(watch)
                            seen.append((event.kind, event.record.node_id))
                finally:
                    cluster.members[0].resume()
            assert seen == [(NodeEventKind.LEFT, "a"), (NodeEventKind.JOINED, "b"),
                            (NodeEventKind.JOINED, "c")]
            assert watch.relists == 1

    run(aio, scenario(), timeout_s=3 * DEADLINE_S)


def test_the_conductor_leader_keeps_leading_while_its_member_is_paused(
        cluster: LocalEtcdCluster, aio: asyncio.Runner) -> None:
    layout = KeyLayout("/kvtier-failover/election/")
    ttl_s = 4

    async def scenario() -> None:
        async with etcd_client(cluster.client_urls) as leader_client, \
                etcd_client(cluster.client_urls[1:]) as standby_client:
            changes: list[bool] = []
            leader = Election(leader_client, LeaderRecord("c-leader", "127.0.0.1:1"),
                              ttl_s=ttl_s, layout=layout, on_change=changes.append)
            standby = Election(standby_client, LeaderRecord("c-standby", "127.0.0.1:2"),
                               ttl_s=ttl_s, layout=layout)
            async with leader:
                await wait_until(lambda: leader.is_leader, "the first candidate to lead")
                async with standby:
                    term = leader.term
                    cluster.members[0].pause()
                    paused_at = time.monotonic()
                    try:
                        assert isinstance(leader_client, EtcdClusterClient)
                        await wait_until(lambda: leader_client.failovers >= 1,
                                         "the leader's client to leave the paused member")
                        await wait_until(lambda: time.monotonic() > paused_at + 3 * ttl_s,
                                         "three TTLs to pass")
                    finally:
                        cluster.members[0].resume()
                    assert leader.is_leader and leader.term == term
                    assert changes == [True], f"leadership changed: {changes}"
                    assert standby.terms_won == 0 and not standby.is_leader
                    assert standby.leader is not None
                    assert standby.leader.record.conductor_id == "c-leader"

    run(aio, scenario(), timeout_s=3 * DEADLINE_S)


def test_a_daemon_degrades_without_quorum_and_recovers(
        tmp_path: Path, cluster: LocalEtcdCluster, aio: asyncio.Runner) -> None:
    layout = KeyLayout("/kvtier-failover/quorum/")
    daemon = DaemonProcess(tmp_path, "node-q", nvme=False, etcd_endpoint=cluster.endpoints,
                           etcd_prefix=layout.prefix, settings={"etcd.ttl_s": "4"})
    key = layout.node_key("node-q").encode()

    def log_text() -> str:
        return daemon.log_path.read_text()

    async def scenario() -> None:
        cluster.members[0].pause()
        cluster.members[1].pause()
        try:
            await wait_until(lambda: "registered -> lost" in log_text(),
                             "the daemon to report its registration lost")
        finally:
            cluster.members[0].resume()
            cluster.members[1].resume()
        lost_at = log_text().rindex("registered -> lost")
        await wait_until(lambda: "lost -> registered" in log_text()[lost_at:],
                         "the daemon to register again")
        async with etcd_client(cluster.client_urls) as observer:
            kv = None
            deadline = time.monotonic() + DEADLINE_S
            while kv is None and time.monotonic() < deadline:
                kv = await observer.get(key)
                if kv is None:
                    await asyncio.sleep(0.2)
            assert kv is not None, "the daemon's record is not back"
            assert NodeRecord.from_json(kv.value).node_id == "node-q"

    daemon.start()
    try:
        run(aio, scenario(), timeout_s=4 * DEADLINE_S)
        assert daemon.proc is not None and daemon.proc.poll() is None, "the daemon exited"
    finally:
        daemon.stop()


def test_one_shot_reads_ask_the_next_member(cluster: LocalEtcdCluster,
                                            aio: asyncio.Runner) -> None:
    """``kvtier nodes --etcd a,b,c`` and an engine's discover_nodes with the first member
    paused: the read that member does not answer is asked again of the next one."""
    layout = KeyLayout("/kvtier-failover/one-shot/")

    async def write() -> None:
        async with etcd_client(cluster.client_urls) as writer:
            await writer.put(layout.node_key("n-a").encode(), node_record("n-a", 5000).to_json())

    run(aio, write())
    cluster.members[0].pause()
    try:
        result = kvtier("nodes", "--etcd", cluster.endpoints, "--prefix", layout.prefix,
                        "--json", timeout_s=DEADLINE_S)
        assert result.returncode == 0, result.stderr
        assert [node["node_id"] for node in json.loads(result.stdout)] == ["n-a"]
        assert set(discover_nodes(cluster.endpoints, layout)) == {"n-a"}
    finally:
        cluster.members[0].resume()


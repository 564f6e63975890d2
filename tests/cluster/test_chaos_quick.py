"""The fault suite's runs as tests: a three-host cluster in network namespaces (a real
three-member etcd, three real daemons with DRAM and NVMe, two real conductors, real reference
engines on two hosts in the kill-daemon test), a steady load from the observer namespace, one fault per test, and the
recorded history checked for every invariant (docs/chaos.md). The quick one (unmarked):
``kill -9`` of a daemon and its restart on the same NVMe directory, ~40 s (~17 s of it
without the engines). The others (``slow``): SIGSTOP of a daemon, a host
partition, etcd member / leader / quorum faults, the leading conductor killed or paused,
corrupted chunks, and a shared-memory client killed mid-transfer. The rest of the faults
(full disk, truncation, other clients, floods, slowloris, a soak) are in
test_chaos_faults.py, outside ``make test``. Needs root and the etcd binary."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import (
    ENGINE_TIMEOUT_S,
    MAX_STALL_S,
    REQUEST_TIMEOUT_S,
    ChaosSpec,
    Engines,
    FaultRow,
    read_history,
    run_fault,
)
from kvstore.cluster.chaos_check import History, Op, Result, check, durable_unverified
from kvstore.cluster.netns import lab_leftovers, unavailable_reason
from tests.support.daemon import kvtier
from tests.support.etcd import require_etcd

QUICK = ChaosSpec.quick(Engines.NONE)
"""The slow tests' runs: without the real engines (~25 s each on 2 cores; `make test` runs
these too). The kill-daemon test has them, and test_chaos_faults.py (outside `make test`)."""

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _assert_clean(row: FaultRow, history: History) -> None:
    """Every invariant held, and the run did what it claims: load on every node, the faulted
    node's lease expired during the fault and it registered again after it."""
    assert check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                 engine_timeout_s=ENGINE_TIMEOUT_S) == []
    assert row.clean, row
    ok_puts = {r.node for r in history.records if r.op is Op.PUT and r.result is Result.OK}
    assert ok_puts == {"node-h0", "node-h1", "node-h2"}
    [gap] = history.lease_gaps
    [fault] = history.faults
    assert gap.node == "node-h1" and fault.start_s <= gap.expired_s <= fault.end_s
    assert gap.renewed_s is not None and gap.renewed_s > gap.expired_s
    assert row.completed > 0 and row.detect_s is not None and row.recover_s is not None, row


def test_kill_9_of_a_daemon_under_load_breaks_no_invariant(tmp_path: Path) -> None:
    """Also with real engines (the reference workers on h0 and on the killed daemon's h1):
    every engine request completes with its prompt's no-cache output, h1's recomputing while
    its daemon is dead, and h1's engine loads prefixes from its restarted daemon again."""
    require_etcd()
    before = set(lab_leftovers())
    spec = ChaosSpec.quick()
    row = run_fault("kill-daemon", spec=spec, work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    _assert_clean(row, history)
    [fault] = history.faults
    engine = [r for r in history.records if r.op is Op.ENGINE]
    assert {r.node for r in engine} == {"node-h0", "node-h1"}
    assert history.engine_expected and check(
        history, engine_timeout_s=ENGINE_TIMEOUT_S) == []  # outputs equal the no-cache ones
    assert row.engine_attempted > 0 and row.engine_failed == 0, row
    dead = [r for r in engine if r.node == "node-h1" and r.result is Result.OK  # before the
            and fault.start_s <= r.start_s <= fault.start_s + spec.down_s]  # restart
    assert dead and all(r.reused_tokens == 0 for r in dead)  # recomputed: no store
    assert any(r.reused_tokens for r in engine if r.node == "node-h1"
               and r.start_s < fault.start_s)  # the outputs compared include loaded KV
    assert row.reuse_after, row  # h1's engine reuses from its restarted daemon
    assert any(r.node == "node-h1" and r.result is Result.ERR for r in history.records)
    # every chunk acknowledged on the killed node before the kill was read back after it
    assert durable_unverified(history) == 0
    killed_before = [r for r in history.records if r.op is Op.PUT and r.durable
                     and r.node == "node-h1" and r.end_s is not None
                     and r.end_s < history.lease_gaps[0].expired_s]
    assert killed_before, "no durable put reached the killed node before the kill"
    assert set(lab_leftovers()) <= before




@pytest.mark.slow
def test_sigstop_of_a_daemon_past_its_lease(tmp_path: Path) -> None:
    """A zombie: paused past its 2 s lease, then continued. It comes back through a new
    registration; the load routes around it meanwhile, within its 2 s request timeout."""
    require_etcd()
    row = run_fault("sigstop-daemon", spec=QUICK, work_dir=tmp_path)
    _assert_clean(row, read_history(tmp_path / "history.jsonl"))


@pytest.mark.slow
def test_partition_of_a_host_past_its_lease(tmp_path: Path) -> None:
    """The host's bridge port down past the lease (its etcd member loses quorum too), healed."""
    require_etcd()
    row = run_fault("partition-host", spec=QUICK, work_dir=tmp_path)
    _assert_clean(row, read_history(tmp_path / "history.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop-etcd-member", "sigstop-etcd-leader",
                                   "etcd-quorum-loss"])
def test_etcd_faults_leave_the_data_plane_serving(fault: str, tmp_path: Path) -> None:
    """etcd members paused past every lease (one; the leader; two: no quorum), then continued:
    the daemons keep serving what the load's last membership view points at, and etcd is
    whole again after."""
    require_etcd()
    row = run_fault(fault, spec=QUICK, work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    assert check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                 engine_timeout_s=ENGINE_TIMEOUT_S) == []
    assert row.clean and row.completed > 0 and row.recover_s is not None, row
    for gap in history.lease_gaps:  # a node evicted meanwhile came back
        assert gap.renewed_s is not None, gap


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill-conductor-leader", "sigstop-conductor-leader"])
def test_a_conductor_leader_killed_or_paused_is_replaced_and_fenced(fault: str,
                                                                   tmp_path: Path) -> None:
    """The leading conductor killed (restarted as a standby) or paused past its election TTL
    and continued: the standby takes over in a new term, and no conductor decides in a term
    older than the newest (the woken one answers again, as a follower)."""
    require_etcd()
    row = run_fault(fault, spec=QUICK, work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    assert check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                 engine_timeout_s=ENGINE_TIMEOUT_S) == []
    assert row.clean and row.schedule_errors == [], row
    assert row.detect_s is not None and row.recover_s is not None, row  # a new term decided
    [f] = history.faults
    epochs = {r.node: r.epoch for r in history.records if r.op is Op.LEASE}
    assert len(set(epochs.values())) == 2 and f.node in epochs, epochs  # both led, in turn
    assert row.last_answer_s[f.node] > f.end_s, row  # the faulted one answered again after


@pytest.mark.slow
def test_corrupt_chunks_are_dropped_counted_and_never_returned(tmp_path: Path) -> None:
    """Bytes flipped in three stored chunks under a running daemon (read from NVMe at once),
    then a kill -9 and a restart on the damaged directory: no wrong bytes ever, the node
    counts them corrupt, every other acknowledged chunk survives."""
    require_etcd()
    row = run_fault("corrupt-segment", spec=QUICK, work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    _assert_clean(row, history)
    assert row.damaged == 3 and row.corrupt_reported >= 1, row
    damaged = {key for _, key in history.damaged}
    [restart] = history.restarts
    after = [r for r in history.records if r.op is Op.GET and r.key in damaged
             and r.start_s >= restart.up_s]
    assert after and all(r.result is not Result.OK for r in after), after  # gone for good


@pytest.mark.slow
def test_a_shared_memory_client_killed_mid_transfer_leaks_nothing(tmp_path: Path) -> None:
    """A client on the shared-memory plane holding a reserved, half-written put and a read
    lease, its loops putting and getting, SIGKILLed: the daemon ends its leases, frees the
    extents and closes its descriptors (counts after = before), and nobody else notices."""
    require_etcd()
    row = run_fault("kill-client-shm", spec=QUICK, work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    assert check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                 engine_timeout_s=ENGINE_TIMEOUT_S) == []
    assert row.clean and row.completed > 0, row
    assert row.leak_detail and not any(row.leak_detail.values()), row.leak_detail
    assert "shm put reserved, half written" in row.notes[0], row.notes  # it was mid-transfer
    assert row.recover_s is not None, row


def test_an_unknown_fault_is_refused_by_name() -> None:
    result = kvtier("bench", "chaos", "--fault", "kill-everything")
    assert result.returncode == 2 and "unknown fault(s) kill-everything" in result.stderr
    assert "kill-daemon" in result.stderr  # the known ones are listed

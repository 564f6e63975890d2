"""The fault suite's quick run: a three-host cluster in network namespaces (a real three-member
etcd, three real daemons with DRAM and NVMe), a steady load from the observer namespace, one
``kill -9`` of a daemon and its restart on the same NVMe directory, and the recorded history
checked for every invariant (docs/chaos.md). Needs root and the etcd binary."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import ChaosSpec, read_history, run_fault
from kvstore.cluster.chaos_check import Op, Result, check, durable_unverified
from kvstore.cluster.netns import lab_leftovers, unavailable_reason
from tests.support.etcd import require_etcd

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def test_kill_9_of_a_daemon_under_load_breaks_no_invariant(tmp_path: Path) -> None:
    require_etcd()
    before = set(lab_leftovers())
    row = run_fault("kill-daemon", spec=ChaosSpec.quick(), work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    assert check(history) == []  # progress included: requests completed during the fault
    assert (row.wrong_reads, row.durable_lost, row.leaks, row.other_violations) == (0, 0, 0, [])
    # the run did what it claims: load on every node, the fault seen and survived
    ok_puts = {r.node for r in history.records if r.op is Op.PUT and r.result is Result.OK}
    assert ok_puts == {"node-h0", "node-h1", "node-h2"}
    assert row.completed > 0 and row.failed > 0, row  # the killed node's requests failed
    assert row.detect_s is not None and row.recover_s is not None, row
    assert [g.node for g in history.lease_gaps] == ["node-h1"]
    # every chunk acknowledged on the killed node before the kill was read back after it
    assert durable_unverified(history) == 0
    killed_before = [r for r in history.records if r.op is Op.PUT and r.durable
                     and r.node == "node-h1" and r.end_s is not None
                     and r.end_s < history.lease_gaps[0].expired_s]
    assert killed_before, "no durable put reached the killed node before the kill"
    assert set(lab_leftovers()) <= before


KNOWN_UNBOUNDED_TCP_WAIT = (
    "known defect: a StoreClient's TCP data plane is not bounded by rpc_timeout_s (TcpClient's "
    "io_timeout_s, 30 s, is not configurable through StoreClientConfig), so requests to a "
    "stopped or partitioned daemon wait until it comes back, and stall the load")


def _check_stall_fault(name: str, tmp_path: Path) -> None:
    row = run_fault(name, spec=ChaosSpec.quick(), work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    assert (row.wrong_reads, row.durable_lost, row.leaks) == (0, 0, 0), row
    # the node's lease expired during the fault, and it registered again after it
    [gap] = history.lease_gaps
    [fault] = history.faults
    assert gap.node == "node-h1" and fault.start_s <= gap.expired_s <= fault.end_s
    assert gap.renewed_s is not None and gap.renewed_s >= fault.end_s
    assert row.recover_s is not None, row
    assert not [v for v in row.other_violations if not v.startswith("no_progress")], row
    if row.over_timeout or row.other_violations:
        pytest.xfail(f"{KNOWN_UNBOUNDED_TCP_WAIT}: {row}")


@pytest.mark.slow
def test_sigstop_of_a_daemon_past_its_lease(tmp_path: Path) -> None:
    """A zombie: paused past its 2 s lease, then continued. It must come back through a new
    registration and serve its own chunks, never anything else."""
    require_etcd()
    _check_stall_fault("sigstop-daemon", tmp_path)


@pytest.mark.slow
def test_partition_of_a_host_past_its_lease(tmp_path: Path) -> None:
    """The host's bridge port down past the lease (its etcd member loses quorum too), healed."""
    require_etcd()
    _check_stall_fault("partition-host", tmp_path)

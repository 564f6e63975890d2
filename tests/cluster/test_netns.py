"""The network-namespace lab of the fault suite: hosts come up and reach each other, a partition
cuts one off and a heal brings it back, and teardown leaves no ``kvtc-`` namespace, link or
process behind, also when the test body fails or the parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvstore.cluster.netns import NetnsLab, lab_leftovers, unavailable_reason
from kvstore.errors import InvalidArgument
from tests.support.common import REPO_ROOT, wait_until

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _gone(pid: str) -> bool:
    """Whether process ``pid`` is dead (gone, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _ours(prefix: str) -> list[str]:
    return [name for name in lab_leftovers() if name.startswith(prefix)]


def test_hosts_reach_each_other_and_a_partition_cuts_one_off() -> None:
    with NetnsLab(hosts=3) as lab:
        names = set(_ours(lab.prefix))
        assert {h.netns for h in lab.all_hosts} | {lab.bridge_ns} <= names
        h0, h1, h2 = lab.hosts
        assert len({h.address for h in lab.all_hosts}) == 4
        for src in (h0, lab.observer):
            for dst in (h1, h2):
                lab.wait_reachable(src, dst)
        lab.partition(h2)
        assert not lab.reachable(h0, h2, timeout_s=0.5)
        assert not lab.reachable(lab.observer, h2, timeout_s=0.5)
        assert lab.reachable(h0, h1)
        lab.heal(h2)
        lab.wait_reachable(h0, h2)
        # the lab's addresses exist only inside it: the namespace we run in has none
        here = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert f"10.213.{lab.subnet}." not in here
        with pytest.raises(InvalidArgument, match="no host"):
            lab.host("h9")
    assert _ours(lab.prefix) == []


def test_teardown_after_a_failure_kills_processes_and_removes_everything() -> None:
    lab = NetnsLab(hosts=2)
    with pytest.raises(RuntimeError, match="the test body failed"), lab:
        proc = lab.popen(lab.hosts[0], ["sleep", "300"])
        inner = lab.popen(lab.hosts[1], ["sh", "-c", "sleep 300 & wait"])
        assert proc.poll() is None and inner.poll() is None
        raise RuntimeError("the test body failed")
    assert proc.poll() is not None and inner.poll() is not None
    assert _ours(lab.prefix) == []
    lab.close()  # idempotent


def test_a_killed_parent_takes_its_lab_processes_along_and_sigterm_tears_down() -> None:
    """A parent that builds a lab and starts a process in it: SIGTERM to the parent tears the
    lab down (the handler); the namespace's process dies with it."""
    code = textwrap.dedent("""
        import sys, time
        from kvstore.cluster.netns import NetnsLab
        lab = NetnsLab(hosts=1).up()
        proc = lab.popen(lab.hosts[0], ["sleep", "300"])
        print(lab.prefix, proc.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(
                                  REPO_ROOT)))
    try:
        assert parent.stdout is not None
        prefix, pid = parent.stdout.readline().split()
        assert _ours(prefix)
        os.kill(parent.pid, signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM
        wait_until(lambda: _gone(pid), 10, "the lab's process to die")
        assert _ours(prefix) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_a_parent_killed_with_sigkill_takes_its_lab_processes_along() -> None:
    """No handler runs on SIGKILL: the children die by PDEATHSIG; the namespaces stay (nobody
    is left to delete them) and are deleted here."""
    code = textwrap.dedent("""
        import time
        from kvstore.cluster.netns import NetnsLab
        lab = NetnsLab(hosts=1).up()
        proc = lab.popen(lab.hosts[0], ["sleep", "300"])
        print(lab.prefix, proc.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO_ROOT, text=True,
                              stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(
                                  REPO_ROOT)))
    prefix = ""
    try:
        assert parent.stdout is not None
        prefix, pid = parent.stdout.readline().split()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        wait_until(lambda: _gone(pid), 10, "the lab's process to die")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        for name in _ours(prefix) if prefix else []:
            subprocess.run(["ip", "netns", "delete", name], check=False)
    assert _ours(prefix) == []

"""The batched put benchmark still runs against a real daemon and says where a call's CPU goes:
the daemon's (every thread, from the scheduler's nanosecond counts) and the calling thread's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench import put_batch

KiB = 1 << 10

_BURN = """
import sys, time
x = 0
for i in range(3_000_000):
    x += i
print(time.thread_time_ns(), flush=True)
sys.stdin.readline()
"""


def test_process_cpu_counts_what_a_child_ran_and_refuses_a_gone_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", _BURN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdin is not None
        ran_ns = int(child.stdout.readline())
        # The child's main thread alone ran ran_ns; the process ran at least that.
        assert ran_ns > 0 and put_batch.process_cpu_ns(child.pid) >= ran_ns
        child.stdin.write("\n")
        child.stdin.flush()
    finally:
        child.wait(30)
    with pytest.raises(OSError):
        put_batch.process_cpu_ns(child.pid)


@pytest.mark.slow
def test_put_batch_rows_carry_the_daemon_and_client_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(put_batch, "_calls", lambda size, quick: 4)
    result = put_batch.run(quick=True, sizes_bytes=(64 * KiB,))
    (row,) = result["rows"]
    assert row["block_bytes"] == 64 * KiB and row["calls"] > 0
    assert row["put_gbps"] > 0 and row["memcpy_gbps"] > 0
    # Every put call ran daemon code (reserve, commit) and client code (the copies).
    assert row["daemon_cpu_us_per_call"] > 0 and row["client_cpu_us_per_call"] > 0

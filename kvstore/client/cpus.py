"""Which CPUs the client's transfer threads run on.

A thread inherits the CPU affinity of the thread that starts it. The client's pool threads are
started by whichever thread first submits work, which inside an engine is the engine's model
thread; an engine that binds that thread to cores (vLLM on CPU binds its OpenMP threads, the
model thread included, to ``VLLM_CPU_OMP_THREADS_BIND``'s cores) would then run kvtier's copies
and socket work on the model's own cores, where every copy delays a layer. vLLM leaves other
cores for exactly this ("reserve one more core" when a KV connector is set), so the pool
threads widen their affinity to every CPU the container allows (:func:`allowed_cpus`) when
they start. Measured on the 2-core box: with the model bound to core 1, every thread of the
worker process, kvtier's included, was bound to core 1.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

__all__ = ["allowed_cpus", "parse_cpu_list", "widen_thread_affinity"]

_CGROUP_CPUS = ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.cpus")


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}. Raises ValueError on a malformed list."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        first, last = int(low), int(high) if sep else int(low)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.update(range(first, last + 1))
    return cpus


def allowed_cpus() -> set[int]:
    """The CPUs this container's cgroup allows (cgroup v2 or v1 cpuset), else every online CPU."""
    for path in _CGROUP_CPUS:
        try:
            with open(path) as f:
                cpus = parse_cpu_list(f.read())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


def widen_thread_affinity() -> None:
    """Let the calling thread run on every allowed CPU (:func:`allowed_cpus`). A refusal (a
    CPU set the kernel does not accept here) leaves the affinity as it was: it only costs speed."""
    try:
        os.sched_setaffinity(0, allowed_cpus())  # 0: the calling thread, on Linux
    except (OSError, AttributeError) as exc:  # AttributeError: no sched_setaffinity (not Linux)
        log.debug("kvtier client thread keeps its CPU affinity: %s", exc)

"""Offline tools: the capacity planner behind ``kvtier plan`` and the scheduling replays.

Nothing here runs inside a daemon or a conductor; the runtime conductor imports none of it. The
planner builds on the conductor's cost model (:mod:`conductor.perf`: hardware, model shapes,
latency models). The modules, from the bottom up:

* :mod:`~planner.trace` -- the one reader of Mooncake JSONL traces (records in the file's units,
  milliseconds; block keys for the eviction replay) and the default trace's path.
* :mod:`~planner.workload` -- arrival traces in seconds (Mooncake through :mod:`~planner.trace`,
  Azure CSV) and synthetic ones.
* :mod:`~planner.kv` -- ``plan kv``: KV size of a prompt, transfer time against prefill time,
  whether layer-by-layer pipelining hides the transfer.
* :mod:`~planner.prefix_cache`, :mod:`~planner.metrics` -- the simulator's prefix cache and results.
* :mod:`~planner.sim` -- the discrete-event simulator of one deployment.
* :mod:`~planner.goodput` -- highest request rate meeting both SLOs for 90% of requests.
* :mod:`~planner.search` -- DistServe-style search over Np:Nd and per-phase TP/PP, and the verdict.
* :mod:`~planner.plots` -- PNGs (matplotlib, imported lazily).
* :mod:`~planner.replay` -- the conductor's scheduler replayed over a trace, in process.
* :mod:`~planner.live_replay` -- the same trace through real daemons and a real conductor
  (spawns processes; ``kvtier bench schedule --live``).

Nothing here runs on import; data files are read only when a loader is called.
"""

from __future__ import annotations

"""The capacity planner behind ``kvtier plan``: colocate or disaggregate, with numbers.

Pure computation: no sockets, no etcd, no GPU. The modules, from the bottom up:

* :mod:`~conductor.planner.hardware` -- GPUs (memory, peak rates, power) and interconnects.
* :mod:`~conductor.planner.models` -- model shapes: KV bytes per token (MHA, GQA, MLA) and weight bytes;
  presets and Hugging Face ``config.json``.
* :mod:`~conductor.planner.kv` -- ``plan kv``: KV size of a prompt, transfer time against prefill time,
  whether layer-by-layer pipelining hides the transfer.
* :mod:`~conductor.planner.latency` -- the :class:`~conductor.planner.latency.LatencyModel` protocol and
  its implementations: DistServe's A100 fits, tables (SplitwiseSim, or a measured kvtier engine profile),
  a roofline estimate, and a constant service time.
* :mod:`~conductor.planner.workload` -- arrival traces (Mooncake JSONL, Azure CSV) and synthetic ones.
* :mod:`~conductor.planner.sim` -- the discrete-event simulator of one deployment.
* :mod:`~conductor.planner.goodput` -- highest request rate meeting both SLOs for 90% of requests.
* :mod:`~conductor.planner.search` -- DistServe-style search over Np:Nd and per-phase TP/PP, and the verdict.
* :mod:`~conductor.planner.plots` -- PNGs (matplotlib, imported lazily).

Nothing here runs on import; data files are read only when a loader is called.
"""

from __future__ import annotations

"""The cost model the scheduler prices with, and the planner builds on.

Pure computation: no sockets, no etcd, no GPU, no plotting. From the bottom up:

* :mod:`~conductor.perf.hardware` -- GPUs (memory, peak rates, power) and interconnects.
* :mod:`~conductor.perf.models` -- model shapes: KV bytes per token (MHA, GQA, MLA) and weight
  bytes; presets and Hugging Face ``config.json``.
* :mod:`~conductor.perf.latency` -- the :class:`~conductor.perf.latency.LatencyModel` protocol and
  its implementations: DistServe's A100 fits, tables (SplitwiseSim, or a measured kvtier engine
  profile), a roofline estimate, and a constant service time.
* :mod:`~conductor.perf.engine_model` -- the engine a conductor assumes when none is measured.
* :mod:`~conductor.perf.data` -- where the public traces and latency profiles are found.

Nothing here runs on import; data files are read only when a loader is called.
"""

"""kvtier: a tiered KV-cache store for LLM serving (see README.md and docs/architecture.md).

The ``kvstore`` package holds every box but the conductor and the offline tools, from the
bottom up: ``errors``, ``keys`` and ``_proto`` (foundation); ``dataplane`` (arenas, tiers,
transports: moves bytes, never talks to etcd or the conductor); ``wire`` and ``membership``
(shared: the wire-error and tier mapping, etcd membership); ``node`` (the store daemon: the
tiered cache, gRPC service, events, metrics) and ``client`` (``StoreClient``, ``KVClient``,
the conductor's client), side by side; ``engine`` (reference model, prefill and decode workers,
gateway); ``cluster`` (a local cluster as processes, the ``make run`` job); ``cli`` (the
``kvtier`` command). The conductor is the ``conductor`` package, the offline tools ``planner``.
"""

__version__ = "0.1.0"

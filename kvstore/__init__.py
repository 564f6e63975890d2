"""kvtier node, client and operator surface.

Layout: ``kvstore.dataplane`` moves bytes (arenas, tiers, transports) and never
talks to etcd or the conductor; ``kvstore.node`` owns one machine's tiers (the
tiered cache, later the daemon); ``kvstore.cli`` is the ``kvtier`` command.
"""

__version__ = "0.1.0"

"""A whole kvtier cluster on one machine: the processes (:mod:`~kvstore.cluster.local`) and the
serving job ``make run`` and ``kvtier bench e2e`` run on it (:mod:`~kvstore.cluster.serving`)."""

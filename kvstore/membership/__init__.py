"""etcd membership and discovery, shared by the node, the client, the engines and the conductor.

* :mod:`~kvstore.membership.etcd` -- the key layout, a client with deadlines, watched prefixes.
* :mod:`~kvstore.membership.registration` -- a record under a lease kept alive in the background.
* :mod:`~kvstore.membership.nodes` -- store daemons: records, registration, listing, watching.
* :mod:`~kvstore.membership.engines` -- engine instances: records, registration, listing, watching.
* :mod:`~kvstore.membership.election` -- conductor leader election.
* :mod:`~kvstore.membership.launcher` -- a local single-member etcd server (tests, ``make run``).

See docs/membership.md.
"""

"""Control-plane tests: membership in a real etcd, and later the conductor."""

"""Reference engine pieces: a real transformer model and the KV layout kvtier stores for it."""

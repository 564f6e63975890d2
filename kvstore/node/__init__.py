"""The node: one machine's tiered cache (index, eviction policies, tier moves)."""

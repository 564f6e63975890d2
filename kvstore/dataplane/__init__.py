"""Data plane: memory arenas, storage tiers and transports. Moves bytes; knows no control plane."""

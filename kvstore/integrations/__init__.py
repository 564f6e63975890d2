"""kvtier inside engines it does not own: adapters on top of the client (docs/architecture.md)."""

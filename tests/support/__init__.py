"""Test support shared across test packages: fixtures and helper programs built on kvtier code."""

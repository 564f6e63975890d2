"""Tests of the benchmarks' pure parts (no timed assertions)."""

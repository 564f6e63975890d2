"""kvtier benchmarks. Each module measures one path beside its physical limit, in the same run.

Run them through ``kvtier bench NAME``; figures are recorded in ``bench/RESULTS.md``.
"""

"""``kvtier bench routing``'s table (pure): the in-process decision (e) shown beside the RPC
decision and the bare-RPC floor, with its ratio to the floor and the shadow's agreement."""

from __future__ import annotations

from bench.routing import format_table


def _stats(p50: float, p99: float) -> dict[str, float]:
    return {"p50_us": p50, "p99_us": p99, "mean_us": p50, "count": 100}


def test_the_table_shows_the_local_path_against_the_floor() -> None:
    row = {"state": "warm", "prompt_tokens": 1000, "blocks": 31, "decisions": 100,
           "backends": {"v0": 100}, "mean_engine_cached_tokens": 736,
           "hash": _stats(50, 400), "schedule": _stats(900, 2900),
           "decision": _stats(910, 3000), "health": _stats(700, 2000),
           "lookup0": _stats(710, 2100), "local": _stats(300, 800),
           "local_backends": {"v0": 100},
           "local_counters": {"local": 99, "fallback": 1, "shadow_agreed": 98,
                              "shadow_disagreed": 1, "shadow_skipped": 0, "shadow_failed": 0},
           "cpu": {"decision_conductor_us": 800.0, "decision_client_us": 600.0,
                   "health_conductor_us": 300.0, "health_client_us": 300.0}}
    result = {"hashings_per_decision": 1, "rows": [row], "git_sha": "0123456789abcdef",
              "machine": {"load_avg_1m": 1.5, "cpus": 2}}
    table = format_table(result)
    line = table.splitlines()[3]
    assert "300/800" in line  # (e) p50/p99
    assert " 1.5 " in line and " 0.40 " in line  # ratio (c) = 3000/2000, ratio e = 800/2000
    assert "99/1" in line and "98/1" in line  # decided here / asked; agreed / disagreed
    assert line.endswith("v0:100 | local v0:100")

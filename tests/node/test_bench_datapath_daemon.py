"""The data-path benchmark's daemon paths (shm, tcp-daemon) and their memcpy limit still run."""

from __future__ import annotations

import pytest

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.slow
def test_daemon_paths_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import datapath

    monkeypatch.setattr(datapath, "SIZES_BYTES", (4 * KiB, 1 * MiB))
    monkeypatch.setattr(datapath, "OPS", ("put", "get", "get_batch"))
    monkeypatch.setattr(datapath, "BATCH_KEYS", 4)
    monkeypatch.setattr(datapath, "DAEMON_DRAM", "32MiB")
    monkeypatch.setattr(datapath, "calls_for", lambda size, batch, quick: 3)
    result = datapath.run(quick=True, path_names=("socket", "memcpy", "tcp-daemon", "shm",
                                                  "socket-spin", "tcp-daemon-spin"))
    rows = {(r["variant"], r["op"], r["value_bytes"]): r for r in result["rows"]}
    assert len(rows) == 6 * 3 * 2
    limits = {"shm": "memcpy", "memcpy": "memcpy", "tcp-daemon-spin": "socket-spin",
              "socket-spin": "socket-spin"}
    for (variant, op, size), row in rows.items():
        assert row["gbps"] > 0 and row["p50_us"] > 0
        limit = rows[(limits.get(variant, "socket"), op, size)]
        assert row["limit_gbps"] == pytest.approx(limit["gbps"]), (variant, op, size)
        assert row["path"] == {"tcp-daemon": "tcp", "tcp-daemon-spin": "tcp"}.get(variant,
                                                                                   variant)

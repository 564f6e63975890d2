"""The data-path benchmark's cost-of-security paths (shm-auth, tcp-daemon-auth, tcp-daemon-tls,
tls-socket) run against real secured daemons and report ratios to the same paths without
security, in one run."""

from __future__ import annotations

import pytest

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.slow
def test_security_paths_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench import datapath

    monkeypatch.setattr(datapath, "SIZES_BYTES", (4 * KiB, 1 * MiB))
    monkeypatch.setattr(datapath, "OPS", ("put", "get"))
    monkeypatch.setattr(datapath, "DAEMON_DRAM", "32MiB")
    monkeypatch.setattr(datapath, "calls_for", lambda size, batch, quick: 3)
    names = ("socket", "memcpy", "tcp-daemon", "shm", "shm-auth", "tcp-daemon-auth",
             "tcp-daemon-tls", "tls-socket")
    result = datapath.run(quick=True, path_names=names)
    rows = {(r["variant"], r["op"], r["value_bytes"]): r for r in result["rows"]}
    secured = {"shm-auth": "shm", "tcp-daemon-auth": "tcp-daemon",
               "tcp-daemon-tls": "tcp-daemon", "tls-socket": "socket"}
    physical = {"shm-auth": "memcpy", "tcp-daemon-auth": "socket", "tcp-daemon-tls": "socket",
                "tls-socket": "socket"}
    for variant, plain in secured.items():
        assert (variant, "put", 4 * KiB) not in rows  # get only: --quick stays quick
        for size in datapath.SIZES_BYTES:
            row = rows[(variant, "get", size)]
            assert row["gbps"] > 0
            assert row["limit_gbps"] == pytest.approx(rows[(plain, "get", size)]["gbps"])
            assert row["physical_ratio"] == pytest.approx(
                row["gbps"] / rows[(physical[variant], "get", size)]["gbps"])
    with pytest.raises(ValueError, match="tcp-daemon-tls path needs the tcp-daemon path"):
        datapath.run(quick=True, path_names=("socket", "tcp-daemon-tls"))


@pytest.mark.slow
def test_ucx_security_path_smoke(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ucx-daemon-auth``: UCX lanes ticketed by a daemon with tokens, a ratio to
    ``ucx-daemon`` in the same run (skipped where ``ucxx`` does not import)."""
    from bench import datapath
    from kvstore.dataplane.transport.ucx import ucx_unavailable

    reason = ucx_unavailable()
    if reason is not None:
        pytest.skip(f"ucxx: {reason}")
    monkeypatch.setattr(datapath, "SIZES_BYTES", (4 * KiB, 1 * MiB))
    monkeypatch.setattr(datapath, "OPS", ("put", "get"))
    monkeypatch.setattr(datapath, "DAEMON_DRAM", "32MiB")
    monkeypatch.setattr(datapath, "calls_for", lambda size, batch, quick: 3)
    result = datapath.run(quick=True, path_names=("socket", "ucx-daemon", "ucx-daemon-auth"))
    rows = {(r["variant"], r["op"], r["value_bytes"]): r for r in result["rows"]}
    for size in datapath.SIZES_BYTES:
        row = rows[("ucx-daemon-auth", "get", size)]
        assert row["gbps"] > 0
        assert row["limit_gbps"] == pytest.approx(rows[("ucx-daemon", "get", size)]["gbps"])
    with pytest.raises(ValueError, match="ucx-daemon-auth path needs the ucx-daemon path"):
        datapath.run(quick=True, path_names=("socket", "ucx-daemon-auth"))

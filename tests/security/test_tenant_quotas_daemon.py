"""Per-tenant metrics, caps and guaranteed shares against a real token daemon (issue 15): a
child process, real sockets, tokens minted here, quotas given on its command line
(``--set tenants.quotas=...``), figures read from its Prometheus endpoint and its Stats RPC.

* A flood by alice cannot take bob below his guaranteed DRAM share: every byte of bob's reads
  back from DRAM afterwards (without the share, LRU evicts bob's older chunks first).
* Carol over her DRAM cap evicts only her own chunks (alice's and bob's all stay), holds at
  most her cap, and a chunk larger than the cap is refused with a CapacityError naming her
  and the quota.
* The metrics: one label per tenant that stored chunks, up to ``tenants.max_tracked``, the
  rest under ``(other)``; refusals of a tenant another caller names never make a label.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstore._proto.kvtier.v1 import store_pb2 as pb
from kvstore.client.daemon_control import DaemonControl, open_channel
from kvstore.client.store_config import StoreClientConfig
from kvstore.dataplane.tier import TierKind
from kvstore.errors import CapacityError, ConfigError, PermissionDenied, QuotaExceeded
from kvstore.node.config import load_config
from kvstore.security.config import ClientSecurity
from kvstore.security.identity import Role
from kvstore.security.tokens import generate_key, load_signing_key, mint
from tests.support.daemon import DaemonProcess, kvtier

KiB, MiB = 1 << 10, 1 << 20
TENANTS = ("alice", "bob", "carol", "dave")


def _tokens(tmp: Path) -> dict[str, Path]:
    generate_key(tmp / "keys", "k1")
    (tmp / "keys" / "k1.key").rename(tmp / "k1.key")
    kid, signing = load_signing_key(tmp / "k1.key")
    out: dict[str, Path] = {}
    for name, role, tenants in [*((t, Role.ENGINE, [t]) for t in TENANTS),
                                ("op", Role.OPERATOR, None)]:
        path = tmp / f"{name}.token"
        path.write_text(mint(signing, kid, subject=name, role=role, tenants=tenants,
                             ttl_s=3600))
        out[name] = path
    return out


def _process(tmp: Path, **settings: str) -> DaemonProcess:
    return DaemonProcess(tmp, "quotas", nvme=False, dram_bytes="4MiB", settings={
        "security.token_keys": str(tmp / "keys"), "security.token_reload_interval_s": "0",
        "server.shm_channel": "false", "server.inline_max_bytes": "3MiB",
        "metrics.enabled": "true", "metrics.port": "0",
        "security.audit_log": str(tmp / "audit.log"), **settings})


@contextmanager
def _daemon(tmp: Path, **settings: str
            ) -> Iterator[tuple[DaemonProcess, dict[str, DaemonControl]]]:
    tokens = _tokens(tmp)
    d = _process(tmp, **settings)
    d.start()
    clients: dict[str, DaemonControl] = {}
    try:
        for name, token in tokens.items():
            cfg = StoreClientConfig(rpc_timeout_s=10.0, security=ClientSecurity(token_file=token))
            channel, info = open_channel(d.grpc_address, cfg)
            clients[name] = DaemonControl(d.grpc_address, info, channel, cfg)
        yield d, clients
    finally:
        for c in clients.values():
            c.close()
        d.stop()


def _put(c: DaemonControl, key: bytes, value: bytes) -> None:
    c.call("Put", pb.PutRequest(key=key, value=value))


def _get(c: DaemonControl, key: bytes) -> bytes | None:
    reply = c.call("Get", pb.GetRequest(key=key))
    return bytes(reply.value) if reply.found else None


def _scrape(d: DaemonProcess) -> str:
    """A scrape with the operator's token (the daemon has security: /metrics is operators')."""
    url = f"http://{d.addresses['metrics_address']}/metrics"
    token = (d.work_dir / "op.token").read_text().strip()
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return str(reply.read().decode())


def _series(text: str, name: str) -> dict[tuple[str, ...], float]:
    """``{label values: value}`` of one metric family in the exposition text."""
    out: dict[tuple[str, ...], float] = {}
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m:
            labels = tuple(v for v in re.findall(r'="((?:[^"\\]|\\.)*)"', m.group(1)))
            out[labels] = float(m.group(2))
    return out


def _stats(c: DaemonControl) -> dict[str, pb.TenantStats]:
    return {("(other)" if row.other else row.tenant): row for row in c.stats().tenants}


def test_a_flood_leaves_a_guaranteed_share_byte_for_byte(tmp_path: Path) -> None:
    with _daemon(tmp_path, **{"tenants.quotas": "bob:dram:guaranteed=1MiB"}) as (_d, c):
        bob = {b"bob-%02d" % i: os.urandom(128 * KiB) for i in range(8)}  # 1 MiB: his share
        for key, value in bob.items():
            _put(c["bob"], key, value)
        flood = {b"alice-%03d" % i: os.urandom(256 * KiB) for i in range(48)}  # 12 MiB > DRAM
        for key, value in flood.items():
            _put(c["alice"], key, value)
        for key, value in bob.items():
            assert _get(c["bob"], key) == value, key
            assert c["bob"].lookup([key]).tiers == (TierKind.DRAM,)
        # Alice's flood went on by evicting her own older chunks; her newest are there.
        assert all(_get(c["alice"], k) == v for k, v in list(flood.items())[-4:])
        rows = _stats(c["op"])
        assert rows["bob"].tiers[0].used_bytes == 1 * MiB
        assert rows["bob"].tiers[0].guaranteed_bytes == 1 * MiB
        text = _scrape(_d)
        # (label values in the order the exposition prints them: kind, tenant, tier)
        assert _series(text, "kvtier_tenant_quota_bytes") == {("guaranteed", "bob", "dram"):
                                                              float(MiB)}
        assert _series(text, "kvtier_tenant_used_bytes")[("bob", "dram")] == float(MiB)


def test_kvtier_stats_shows_each_tenant_with_its_quota(tmp_path: Path) -> None:
    """``kvtier stats`` (the operator's CLI, a real process with an operator token) prints the
    per-tenant rows: JSON with each tenant's counters and bytes per tier with its quota, and a
    table naming them."""
    with _daemon(tmp_path, **{"tenants.quotas": "carol:dram:max=1MiB"}) as (d, c):
        _put(c["carol"], b"carol-0", os.urandom(256 * KiB))
        _put(c["bob"], b"bob-0", os.urandom(128 * KiB))
        assert _get(c["carol"], b"carol-0") is not None
        with pytest.raises(PermissionDenied):  # bob's key: refused, counted for carol
            _put(c["carol"], b"bob-0", b"x")
        args = ("stats", "--address", d.grpc_address, "--token-file",
                str(tmp_path / "op.token"))
        result = kvtier(*args, "--json")
        assert result.returncode == 0, result.stderr
        rows = {t["tenant"]: t for t in json.loads(result.stdout)["tenants"]}
        assert rows["carol"]["hits"] == 1 and rows["carol"]["bytes_written"] == 256 * KiB
        assert rows["carol"]["tiers"] == [{"tier": "dram", "used_bytes": 256 * KiB,
                                           "max_bytes": MiB, "guaranteed_bytes": 0}]
        assert rows["carol"]["refused"] == 1
        assert rows["bob"]["tiers"][0]["used_bytes"] == 128 * KiB
        table = kvtier(*args)
        assert table.returncode == 0, table.stderr
        line = next(x for x in table.stdout.splitlines() if "carol" in x)
        assert "cap 1.0 MiB" in line or "cap 1 MiB" in line, table.stdout


def test_a_tenant_over_its_cap_evicts_only_its_own_or_is_refused(tmp_path: Path) -> None:
    with _daemon(tmp_path, **{"tenants.quotas": "carol:dram:max=1MiB"}) as (_d, c):
        others = {("alice", b"alice-%d" % i): os.urandom(128 * KiB) for i in range(4)}
        others.update({("bob", b"bob-%d" % i): os.urandom(128 * KiB) for i in range(4)})
        for (who, key), value in others.items():
            _put(c[who], key, value)
        carol = {b"carol-%02d" % i: os.urandom(128 * KiB) for i in range(16)}  # 2 MiB
        for key, value in carol.items():
            _put(c["carol"], key, value)  # each put past 1 MiB evicts carol's oldest
        for (who, key), value in others.items():
            assert _get(c[who], key) == value, key
        kept = [k for k in carol if _get(c["carol"], k) is not None]
        assert kept == list(carol)[-8:]  # her newest 1 MiB, in order
        rows = _stats(c["op"])
        assert rows["carol"].tiers[0].used_bytes == 1 * MiB
        assert rows["carol"].tiers[0].max_bytes == 1 * MiB
        with pytest.raises(CapacityError, match=r"tenant 'carol'.*quota in dram.*max_bytes "
                                                 r"1048576"):
            _put(c["carol"], b"carol-big", os.urandom(MiB + 4 * KiB))
        assert _get(c["carol"], b"carol-big") is None
        assert [k for k in carol if _get(c["carol"], k) is not None] == kept
        assert _stats(c["op"])["carol"].refused == 1
        # The refusal is a QuotaExceeded (a CapacityError) and is audited as one; the puts
        # that fitted by evicting carol's own chunks are not.
        with pytest.raises(QuotaExceeded):
            _put(c["carol"], b"carol-big", os.urandom(MiB + 4 * KiB))
        lines = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
        quota = [x for x in lines if x.get("error") == "QuotaExceeded"]
        assert len(quota) == 2, lines
        assert {x["principal"]["name"] for x in quota} == {"carol"}
        assert {(x["event"], x["code"], x["method"]) for x in quota} == {
            ("refused", "RESOURCE_EXHAUSTED", "/kvtier.v1.Store/Put")}
        assert "tenant 'carol' is at its quota in dram" in quota[0]["reason"]
        assert not [x for x in lines if x["method"].endswith("/Put") and x not in quota]


def test_metrics_per_tenant_with_a_bounded_label_set(tmp_path: Path) -> None:
    with _daemon(tmp_path, **{"tenants.max_tracked": "2"}) as (d, c):
        _put(c["alice"], b"alice-0", b"a" * 4096)
        _put(c["alice"], b"alice-1", b"a" * 8192)
        _put(c["bob"], b"bob-0", b"b" * 1000)
        _put(c["carol"], b"carol-0", b"c" * 3000)  # a third tenant: counted under (other)
        assert _get(c["alice"], b"alice-0") == b"a" * 4096
        assert _get(c["alice"], b"nothing") is None
        with pytest.raises(PermissionDenied):  # bob writing alice's key: bob refused
            _put(c["bob"], b"alice-0", b"x")
        assert _get(c["bob"], b"alice-1") is None  # absent to bob: a miss of bob's
        # dave, never having stored anything, is refused naming alice: no label for either.
        cfg = StoreClientConfig(rpc_timeout_s=10.0, tenant="alice",
                                security=ClientSecurity(token_file=tmp_path / "dave.token"))
        channel, info = open_channel(d.grpc_address, cfg)
        dave_as_alice = DaemonControl(d.grpc_address, info, channel, cfg)
        try:
            with pytest.raises(PermissionDenied):
                _put(dave_as_alice, b"dave-0", b"d")
        finally:
            dave_as_alice.close()
        text = _scrape(d)
        written = _series(text, "kvtier_tenant_bytes_written_total")
        assert written == {("alice",): 12288.0, ("bob",): 1000.0, ("(other)",): 3000.0}
        assert _series(text, "kvtier_tenant_hits_total")[("alice",)] == 1.0
        assert _series(text, "kvtier_tenant_bytes_read_total")[("alice",)] == 4096.0
        misses = _series(text, "kvtier_tenant_misses_total")
        assert misses[("alice",)] == 1.0 and misses[("bob",)] == 1.0
        refused = _series(text, "kvtier_tenant_refused_total")
        assert refused[("bob",)] == 1.0
        assert refused[("alice",)] == 1.0  # the refusal of a call naming alice
        used = _series(text, "kvtier_tenant_used_bytes")
        assert used == {("alice", "dram"): 12288.0, ("bob", "dram"): 1000.0,
                        ("(other)", "dram"): 3000.0}
        assert "\nkvtier_tenants_tracked 2.0\n" in text
        labels = {labels[0] for fam in ("kvtier_tenant_hits_total", "kvtier_tenant_refused_total",
                                        "kvtier_tenant_misses_total")
                  for labels in _series(text, fam)}
        assert labels == {"alice", "bob", "(other)"}  # dave never got one
        # The Stats RPC: the operator sees every row; a client naming bob only bob's.
        assert set(_stats(c["op"])) == {"alice", "bob", "(other)"}
        cfg = StoreClientConfig(rpc_timeout_s=10.0, tenant="bob",
                                security=ClientSecurity(token_file=tmp_path / "op.token"))
        channel, info = open_channel(d.grpc_address, cfg)
        op_as_bob = DaemonControl(d.grpc_address, info, channel, cfg)
        try:
            rows = _stats(op_as_bob)
        finally:
            op_as_bob.close()
        assert set(rows) == {"bob"} and rows["bob"].bytes_written == 1000


def test_bad_quotas_are_refused_when_the_config_loads() -> None:
    with pytest.raises(ConfigError, match="tier must be one of"):
        load_config(env={}, overrides={"tenants.quotas": "alice:ssd:max=1GiB"})
    with pytest.raises(ConfigError, match="sum to"):
        load_config(env={}, overrides={"dram.capacity_bytes": "256MiB",
                                       "tenants.quotas": "a:dram:guaranteed=200MiB,"
                                                         "b:dram:guaranteed=100MiB"})
    with pytest.raises(ConfigError, match="not configured"):
        load_config(env={}, overrides={"tenants.quotas": "a:nvme:max=1GiB"})
    cfg = load_config(env={}, overrides={"tenants.quotas": "a:dram:max=64MiB;guaranteed=1MiB",
                                         "tenants.max_tracked": "5"})
    assert cfg.tenants.max_tracked == 5
    (q,) = cfg.tenants.quota_list()
    assert (q.tenant, q.tier, q.max_bytes, q.guaranteed_bytes) == ("a", TierKind.DRAM, 64 * MiB,
                                                                    MiB)


def test_a_daemon_with_a_bad_quota_does_not_start(tmp_path: Path) -> None:
    _tokens(tmp_path)
    d = _process(tmp_path, **{"tenants.quotas": "alice:dram:max=1MB"})
    with pytest.raises(RuntimeError, match="did not become ready"):
        d.start()
    assert "'1MB' is not a size in bytes" in d.log_path.read_text()

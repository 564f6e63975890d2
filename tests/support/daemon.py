"""Store daemons as real child processes (``python -m kvstore.cli.main daemon``) for tests.

:class:`DaemonProcess` writes nothing but its own temp directory: the daemon's NVMe files and
its log (stderr) live there, and the shared-memory arena is the daemon's (unlinked when it
drains; swept by the next daemon after a ``kill -9``). Every daemon binds ephemeral ports on
127.0.0.1 and prints its addresses on a ready line, which :meth:`DaemonProcess.start` parses.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
READY_PREFIX = "KVTIER-DAEMON-READY "


class DaemonProcess:
    """One daemon child process. ``settings`` are ``--set`` overrides (``section.field``)."""

    def __init__(self, work_dir: Path, node_id: str, *, dram_bytes: str = "32MiB",
                 nvme: bool = True, etcd_endpoint: str | None = None, etcd_prefix: str = "",
                 settings: dict[str, str] | None = None,
                 pythonpath_first: Path | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.work_dir = work_dir
        self.node_id = node_id
        self.log_path = work_dir / f"{node_id}.log"
        values = {"node_id": node_id, "dram.capacity_bytes": dram_bytes,
                  "log_level": "INFO", "shutdown.drain_timeout_s": "3"}
        if nvme:
            values["nvme.directory"] = str(work_dir / f"{node_id}-nvme")
            values["nvme.capacity_bytes"] = "64MiB"
            values["nvme.segment_bytes"] = "4MiB"
        if etcd_endpoint:
            values["etcd.endpoint"] = etcd_endpoint
            values["etcd.ttl_s"] = "2"
            if etcd_prefix:
                values["etcd.prefix"] = etcd_prefix
        values.update(settings or {})
        self.settings = values
        self.pythonpath_first = pythonpath_first
        """A directory put before the repository on PYTHONPATH (e.g. a sitecustomize)."""
        self.extra_args = extra_args
        """More command-line arguments (e.g. the ``--etcd-*`` options)."""
        self.proc: subprocess.Popen[str] | None = None
        self.addresses: dict[str, Any] = {}

    @property
    def grpc_address(self) -> str:
        return str(self.addresses["grpc_address"])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "kvstore.cli.main", "daemon"]
        for key, value in self.settings.items():
            cmd += ["--set", f"{key}={value}"]
        cmd += list(self.extra_args)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["PYTHONPATH"] = str(REPO) if self.pythonpath_first is None else \
            f"{self.pythonpath_first}{os.pathsep}{REPO}"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("a")
        try:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        finally:
            log.close()
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                self.addresses = json.loads(line[len(READY_PREFIX):])
                return self.addresses
        self.kill()
        raise RuntimeError(f"daemon {self.node_id} did not become ready; log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: no drain, no deregistration."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def stop(self) -> None:
        """Graceful if possible, else kill (fixture teardown)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def run_python(code: str, *, timeout_s: float = 60.0, check: bool = True
               ) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter with the repository importable (a client process)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                            capture_output=True, timeout=timeout_s)
    if check and result.returncode != 0:
        raise AssertionError(f"client process failed ({result.returncode}):\n{result.stdout}\n"
                             f"{result.stderr}")
    return result


def kvtier(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the ``kvtier`` command line in a child process."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "kvstore.cli.main", *args], cwd=REPO, env=env,
                          text=True, capture_output=True, timeout=timeout_s)


def kvtier_here(*args: str) -> subprocess.CompletedProcess[str]:
    """The ``kvtier`` command line run in this process (typer's ``CliRunner``), with the
    exit status, stdout and stderr that :func:`kvtier` would give, without a fresh interpreter
    (about 1.5 s each on a 2-core box). An exception the command does not turn into an exit
    status is raised here (a child process would print it and exit 1).

    Only for commands that make no event loop of their own: the ``--address`` admin commands.
    ``--etcd`` ones call ``asyncio.run``, and gRPC's asyncio layer binds to the first loop it
    runs on (see ``tests/support/etcd.py``): run those with :func:`kvtier`. The entry point
    itself (``python -m kvstore.cli.main``) is run as a process by tests/test_cli.py and
    by the ``--etcd`` tests."""
    from typer.testing import CliRunner

    from kvstore.cli.main import app

    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["kvtier", *args], result.exit_code, result.stdout,
                                       result.stderr)


@contextlib.contextmanager
def running(*daemons: DaemonProcess) -> Iterator[tuple[DaemonProcess, ...]]:
    """Start each daemon in turn; on exit (or when a later one fails to start) stop every one
    that was started."""
    started: list[DaemonProcess] = []
    try:
        for daemon in daemons:
            daemon.start()
            started.append(daemon)
        yield daemons
    finally:
        for daemon in started:
            daemon.stop()

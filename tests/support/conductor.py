"""Conductors as real child processes (``python -m kvstore.cli.main conductor``) for tests.

Each binds an ephemeral port on 127.0.0.1 and prints its address on a ready line, which
:meth:`ConductorProcess.start` parses. Its log (stderr) goes to a file in the test's directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY_PREFIX = "KVTIER-CONDUCTOR-READY "


class ConductorProcess:
    def __init__(self, work_dir: Path, conductor_id: str, *, etcd_endpoint: str, prefix: str,
                 extra_args: tuple[str, ...] = (),
                 pythonpath_first: Path | None = None) -> None:
        self.work_dir = work_dir
        self.conductor_id = conductor_id
        self.log_path = work_dir / f"{conductor_id}.log"
        self.args = ["--etcd", etcd_endpoint, "--prefix", prefix, "--id", conductor_id,
                     *extra_args]
        self.pythonpath_first = pythonpath_first
        """A directory put before the repository on PYTHONPATH (e.g. a sitecustomize)."""
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self, timeout_s: float = 60.0) -> str:
        cmd = [sys.executable, "-m", "kvstore.cli.main", "conductor", *self.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
        env["PYTHONPATH"] = str(REPO) if self.pythonpath_first is None else \
            f"{self.pythonpath_first}{os.pathsep}{REPO}"
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                self.address = json.loads(line[len(READY_PREFIX):])["address"]
                return self.address
        self.kill()
        raise RuntimeError(f"conductor {self.conductor_id} did not become ready; log:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: no resignation; the leader key expires after the election TTL."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

"""Launch and control a local etcd server: one member, or a cluster of several.

:class:`LocalEtcd` runs ``etcd`` as a child process on 127.0.0.1 with its data
directory in a work directory (a fresh temporary one unless given). It serves
two callers: the test fixtures in ``tests/support/etcd.py`` and the operator's
local cluster (``make run``). A production deployment points kvtier at an etcd
cluster it does not own and never uses this module.

Lifecycle and contracts
    * The constructor only records settings: no process, port or directory
      exists until :meth:`LocalEtcd.start`.
    * Ports are picked on the first start (free ephemeral ports, checked by
      binding, then handed to etcd; a port stolen in between makes etcd exit,
      and the start is retried with new ports) and kept for every later start,
      so :meth:`restart` brings the server back at the same address with the
      same data, as a rebooted etcd host would.
    * :meth:`start` returns once ``/health`` answers ``true``; it raises
      :class:`~kvstore.errors.MembershipError` (with the tail of etcd's log)
      when the binary is missing, etcd exits, or it is not healthy in time.
    * :meth:`stop` sends SIGTERM, then SIGKILL after ``timeout_s``; :meth:`kill`
      sends SIGKILL at once (a crash). Both keep the data directory.
    * :meth:`pause` / :meth:`resume` send SIGSTOP / SIGCONT: clients see a
      server that accepts connections but never answers, as under quorum loss.
    * :meth:`close` stops the server and deletes the work directory if this
      object created it. The class is a context manager (``start`` / ``close``).
    * With ``tls`` (:class:`EtcdServerTls`) etcd serves clients over TLS only (``https://``
      in :attr:`LocalEtcd.client_url`), optionally requiring client certificates and
      refusing a CRL's serials; ``/health`` is then probed on a third, plain-HTTP metrics
      port (``--listen-metrics-urls``), so the probe needs no certificate. etcd's users and
      roles are set up by whoever owns the server (``etcdctl``), not here.
    * With ``die_with_parent`` (the default, when ``setpriv`` exists) etcd is
      started under ``setpriv --pdeathsig KILL``, so a test run that is killed
      does not leave a server behind. The signal fires when the *thread* that
      called :meth:`start` exits: call it from a long-lived thread.

:class:`LocalEtcdCluster` runs several such members as one etcd cluster on 127.0.0.1
(``--initial-cluster`` naming each), for failover tests (docs/etcd-failover.md).

Not thread-safe: one owner drives an instance.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from kvstore.errors import InvalidArgument, MembershipError

log = logging.getLogger(__name__)

DEFAULT_ETCD_BINARY = "etcd"
_HEALTH_PROBE_TIMEOUT_S = 0.5
_POLL_INTERVAL_S = 0.05
_PORT_RETRIES = 3
_LOG_TAIL_BYTES = 2000


def find_etcd_binary(binary: str | None = None) -> str | None:
    """The absolute path of the etcd binary (``binary``, else ``$KVTIER_ETCD_BINARY``, else
    ``etcd`` on ``PATH``), or None when it is not installed."""
    candidate = binary or os.environ.get("KVTIER_ETCD_BINARY") or DEFAULT_ETCD_BINARY
    return shutil.which(candidate)


def _pick_free_ports(count: int) -> list[int]:
    """Ask the kernel for ``count`` distinct free ports on 127.0.0.1.

    The sockets stay bound until all ports are chosen (so the kernel cannot
    return the same port twice), then close: there is a small window in which
    another process may take one, which :meth:`LocalEtcd.start` handles.
    """
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True, slots=True)
class EtcdServerTls:
    """TLS on a :class:`LocalEtcd`'s client port (etcd's flags in parentheses)."""

    cert_file: Path
    """The server's certificate (``--cert-file``); its SANs must name 127.0.0.1."""
    key_file: Path
    """Its key (``--key-file``)."""
    trusted_ca_file: Path | None = None
    """The CA that signs client certificates (``--trusted-ca-file``)."""
    client_cert_auth: bool = False
    """Require a client certificate signed by ``trusted_ca_file`` (``--client-cert-auth``);
    with etcd's auth enabled, a certificate's common name is taken as the user."""
    crl_file: Path | None = None
    """Client certificates revoked by this CRL are refused (``--client-crl-file``)."""

    def __post_init__(self) -> None:
        if self.client_cert_auth and self.trusted_ca_file is None:
            raise InvalidArgument("client_cert_auth needs trusted_ca_file (the client CA)")

    def args(self) -> list[str]:
        out = [f"--cert-file={self.cert_file}", f"--key-file={self.key_file}"]
        if self.trusted_ca_file is not None:
            out.append(f"--trusted-ca-file={self.trusted_ca_file}")
        if self.client_cert_auth:
            out.append("--client-cert-auth")
        if self.crl_file is not None:
            out.append(f"--client-crl-file={self.crl_file}")
        return out


class LocalEtcd:
    """One etcd server process on 127.0.0.1; see the module docstring for the contract."""

    def __init__(
        self,
        *,
        work_dir: Path | None = None,
        name: str = "kvtier-etcd",
        binary: str | None = None,
        start_timeout_s: float = 15.0,
        die_with_parent: bool = True,
        extra_args: tuple[str, ...] = (),
        tls: EtcdServerTls | None = None,
        ports: tuple[int, int, int] | None = None,
        initial_cluster: str | None = None,
    ) -> None:
        """Record settings; nothing is started or created here.

        ``work_dir`` holds ``data/`` (etcd's data directory) and ``etcd.log``;
        when None, :meth:`start` creates a temporary one that :meth:`close`
        deletes. ``extra_args`` are appended to etcd's command line (for
        example ``("--auto-compaction-retention=1",)``). ``tls``: see the module docstring.
        ``ports`` (client, peer, metrics) and ``initial_cluster`` (etcd's
        ``NAME=PEER_URL,...``) make this one member of a :class:`LocalEtcdCluster`.
        """
        if not name or "=" in name or "," in name:
            raise InvalidArgument(
                f"etcd member name must be non-empty without '=' or ',': {name!r}"
            )
        if start_timeout_s <= 0:
            raise InvalidArgument(f"start_timeout_s must be positive, got {start_timeout_s}")
        self._name = name
        self._binary = binary
        self._start_timeout_s = start_timeout_s
        self._die_with_parent = die_with_parent
        self._extra_args = tuple(extra_args)
        self._tls = tls
        self._metrics_port: int | None = None
        self._work_dir = work_dir
        self._owns_work_dir = False
        self._client_port: int | None = None
        self._peer_port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._paused = False
        self._initial_cluster = initial_cluster
        if ports is not None:
            self._client_port, self._peer_port, self._metrics_port = ports

    # ----------------------------------------------------------------- properties

    @property
    def client_host(self) -> str:
        return "127.0.0.1"

    @property
    def client_port(self) -> int:
        """The client port (fixed after the first :meth:`start`)."""
        if self._client_port is None:
            raise MembershipError("local etcd has not been started: no client port yet")
        return self._client_port

    @property
    def peer_port(self) -> int:
        if self._peer_port is None:
            raise MembershipError("local etcd has not been started: no peer port yet")
        return self._peer_port

    @property
    def client_url(self) -> str:
        """``http://127.0.0.1:PORT`` (``https://`` with ``tls``), the endpoint clients use."""
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{self.client_host}:{self.client_port}"

    @property
    def tls(self) -> EtcdServerTls | None:
        return self._tls

    @property
    def _health_url(self) -> str:
        if self._tls is not None:
            return f"http://{self.client_host}:{self._metrics_port}/health"
        return f"{self.client_url}/health"

    @property
    def work_dir(self) -> Path:
        if self._work_dir is None:
            raise MembershipError("local etcd has not been started: no work directory yet")
        return self._work_dir

    @property
    def data_dir(self) -> Path:
        return self.work_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "etcd.log"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (paused included), else None."""
        return self._process.pid if self.running and self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def paused(self) -> bool:
        return self.running and self._paused

    # ----------------------------------------------------------------- lifecycle

    def _prepare(self) -> str:
        """The binary's path, with the work directory created. Raises MembershipError."""
        if self.running:
            raise MembershipError(f"local etcd is already running (pid {self.pid})")
        binary = find_etcd_binary(self._binary)
        if binary is None:
            raise MembershipError(
                f"etcd binary {self._binary or DEFAULT_ETCD_BINARY!r} not found "
                "(install etcd-server, or set KVTIER_ETCD_BINARY)"
            )
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="kvtier-etcd-"))
            self._owns_work_dir = True
        self._work_dir.mkdir(parents=True, exist_ok=True)
        return binary

    def start(self) -> None:
        """Start the server and wait until it is healthy (a cluster's member: until the
        cluster has a leader). Raises MembershipError."""
        binary = self._prepare()

        ports_fixed = self._client_port is not None
        attempts = 1 if ports_fixed else _PORT_RETRIES
        for attempt in range(1, attempts + 1):
            if not ports_fixed:
                self._client_port, self._peer_port, self._metrics_port = _pick_free_ports(3)
            self._spawn(binary)
            try:
                self._wait_healthy(self._start_timeout_s)
                return
            except MembershipError:
                exited = not self.running
                if exited and attempt < attempts and "address already in use" in self._log_tail():
                    log.info("etcd port taken between pick and bind; retrying with new ports")
                    continue
                self.kill()
                raise
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

    def _spawn(self, binary: str) -> None:
        client_url = self.client_url
        peer_url = f"http://127.0.0.1:{self._peer_port}"
        argv = [
            binary,
            f"--name={self._name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self._initial_cluster or f'{self._name}={peer_url}'}",
            "--initial-cluster-state=new",
            *(self._tls.args() if self._tls is not None else []),
            *([f"--listen-metrics-urls=http://127.0.0.1:{self._metrics_port}"]
              if self._tls is not None else []),
            *self._extra_args,
        ]
        setpriv = shutil.which("setpriv") if self._die_with_parent else None
        if setpriv is not None:
            argv = [setpriv, "--pdeathsig", "KILL", "--", *argv]
        with self.log_path.open("ab") as log_file:
            log_file.write(f"\n=== kvtier: starting {' '.join(argv)}\n".encode())
            log_file.flush()
            # The child inherits its own copy of the descriptor; ours closes here.
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                close_fds=True,
            )
        self._paused = False
        log.debug("started etcd pid %d at %s", self._process.pid, client_url)

    def is_healthy(self) -> bool:
        """One ``/health`` probe (at most 0.5 s): True when etcd reports itself healthy."""
        if not self.running or self._paused:
            return False
        try:
            with urllib.request.urlopen(
                self._health_url, timeout=_HEALTH_PROBE_TIMEOUT_S
            ) as response:
                body = response.read()
        except (urllib.error.URLError, OSError):
            return False
        return b'"true"' in body

    def is_leader(self) -> bool:
        """Whether this member is its cluster's raft leader now (its ``/metrics`` say so)."""
        if not self.running or self._paused:
            return False
        scheme_port = (f"http://{self.client_host}:{self._metrics_port}" if self._tls is not None
                       else self.client_url)
        try:
            with urllib.request.urlopen(f"{scheme_port}/metrics",
                                        timeout=_HEALTH_PROBE_TIMEOUT_S * 4) as response:
                body = response.read()
        except (urllib.error.URLError, OSError):
            return False
        return b"\netcd_server_is_leader 1" in body

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running:
                code = self._process.returncode if self._process is not None else None
                raise MembershipError(
                    f"etcd exited with code {code} during start-up; log tail:\n{self._log_tail()}"
                )
            if self.is_healthy():
                return
            if time.monotonic() >= deadline:
                raise MembershipError(
                    f"etcd at {self.client_url} not healthy after {timeout_s:.1f} s; "
                    f"log tail:\n{self._log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)

    def wait_healthy(self, timeout_s: float = 10.0) -> None:
        """Block until ``/health`` answers true. Raises MembershipError on timeout or exit."""
        self._wait_healthy(timeout_s)

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; return the exit code (None if not running).

        The data directory is kept, so :meth:`start` (or :meth:`restart`) resumes it.
        """
        process = self._process
        if process is None or process.poll() is not None:
            return process.returncode if process is not None else None
        if self._paused:  # a stopped process only acts on SIGTERM once continued
            self._signal(signal.SIGCONT)
            self._paused = False
        self._signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "etcd pid %d ignored SIGTERM for %.1f s; sending SIGKILL", process.pid, timeout_s
            )
            return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the server at once (a crash); return its exit code (None if not running)."""
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            self._signal(signal.SIGKILL)
        self._paused = False
        return process.wait()

    def restart(self, timeout_s: float = 5.0) -> None:
        """Stop (SIGTERM, then SIGKILL) and start again on the same ports and data directory."""
        self.stop(timeout_s)
        self.start()

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        if not self.running:
            raise MembershipError("cannot pause local etcd: it is not running")
        self._signal(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused server."""
        if not self.running:
            raise MembershipError("cannot resume local etcd: it is not running")
        self._signal(signal.SIGCONT)
        self._paused = False

    def close(self) -> None:
        """Stop the server and delete the work directory if this object created it."""
        try:
            self.stop()
        finally:
            if self._owns_work_dir and self._work_dir is not None:
                shutil.rmtree(self._work_dir, ignore_errors=True)
                self._work_dir = None
                self._owns_work_dir = False

    def _signal(self, signum: signal.Signals) -> None:
        assert self._process is not None
        # The process may exit between poll() and here; that is not an error.
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signum)

    def _log_tail(self) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - _LOG_TAIL_BYTES))
                return f.read().decode(errors="replace")
        except OSError as exc:
            return f"(cannot read {self.log_path}: {exc})"

    def __enter__(self) -> LocalEtcd:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.client_url if self._client_port is not None else "not started"
        state = "paused" if self.paused else "running" if self.running else "stopped"
        return f"LocalEtcd({where}, {state})"


class LocalEtcdCluster:
    """``size`` etcd members on 127.0.0.1 forming one cluster, each a :class:`LocalEtcd` on
    its own ephemeral ports in ``work_dir/<name>-<i>`` (fault tests: pause one member, or
    two for quorum loss). Same contracts as :class:`LocalEtcd`: nothing exists before
    :meth:`start`, which returns once every member reports healthy (the cluster has a
    leader); :meth:`close` stops every member. Not thread-safe.
    """

    def __init__(self, *, size: int = 3, work_dir: Path | None = None,
                 name: str = "kvtier-etcd", binary: str | None = None,
                 start_timeout_s: float = 30.0, die_with_parent: bool = True,
                 extra_args: tuple[str, ...] = ()) -> None:
        """Record settings; nothing is started or created here."""
        if size < 1:
            raise InvalidArgument(f"an etcd cluster needs at least one member, got {size}")
        if not name or "=" in name or "," in name:
            raise InvalidArgument(
                f"etcd member name must be non-empty without '=' or ',': {name!r}")
        self._size = size
        self._work_dir = work_dir
        self._owns_work_dir = False
        self._name = name
        self._binary = binary
        self._start_timeout_s = start_timeout_s
        self._die_with_parent = die_with_parent
        self._extra_args = tuple(extra_args)
        self.members: list[LocalEtcd] = []

    @property
    def client_urls(self) -> list[str]:
        """Every member's client URL, in member order."""
        if not self.members:
            raise MembershipError("local etcd cluster has not been started")
        return [member.client_url for member in self.members]

    @property
    def endpoints(self) -> str:
        """The members' client URLs as one comma-separated endpoint list."""
        return ",".join(self.client_urls)

    def leader(self) -> int | None:
        """The index of the member that is raft leader now, None when none says so."""
        for index, member in enumerate(self.members):
            if member.is_leader():
                return index
        return None

    def start(self) -> None:
        """Start every member, then wait until each is healthy. Raises MembershipError."""
        if self.members:
            raise MembershipError("local etcd cluster already started")
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="kvtier-etcd-cluster-"))
            self._owns_work_dir = True
        ports = _pick_free_ports(3 * self._size)
        names = [f"{self._name}-{i}" for i in range(self._size)]
        initial_cluster = ",".join(
            f"{name}=http://127.0.0.1:{ports[3 * i + 1]}" for i, name in enumerate(names))
        self.members = [
            LocalEtcd(work_dir=self._work_dir / name, name=name, binary=self._binary,
                      start_timeout_s=self._start_timeout_s,
                      die_with_parent=self._die_with_parent, extra_args=self._extra_args,
                      ports=(ports[3 * i], ports[3 * i + 1], ports[3 * i + 2]),
                      initial_cluster=initial_cluster)
            for i, name in enumerate(names)]
        try:
            for member in self.members:  # all first: no member is healthy before a quorum
                member._spawn(member._prepare())
            for member in self.members:
                member.wait_healthy(self._start_timeout_s)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop every member and delete the work directory if this object created it."""
        try:
            for member in self.members:
                member.close()
        finally:
            self.members = []
            if self._owns_work_dir and self._work_dir is not None:
                shutil.rmtree(self._work_dir, ignore_errors=True)
                self._work_dir = None
                self._owns_work_dir = False

    def __enter__(self) -> LocalEtcdCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

"""Test hosts as Linux network namespaces: a bridge, N hosts and an observer, torn down at exit.

::

    with NetnsLab(hosts=3) as lab:          # needs root and iproute2
        proc = lab.popen(lab.hosts[0], ["etcd", "--listen-client-urls", ...])
        lab.partition(lab.hosts[2])         # its cable pulled: unreachable from the others
        lab.heal(lab.hosts[2])

Layout (``<p>`` is ``kvtc-<6 random hex digits>``, one per lab, so two labs never meet)::

    <p>-br    the bridge namespace: bridge ``br0`` and one port ``p<i>`` per host
    <p>-h<i>  host i: ``eth0`` = 10.213.<s>.<i+1>/24, its veth peer is port ``p<i>``
    <p>-obs   the observer (load generator): ``eth0`` = 10.213.<s>.200/24

``<s>`` is random too. Addresses exist only inside these namespaces; no route leads out of
them and nothing is added to the namespace the lab is created from, so traffic can reach no
address outside the lab. Every namespace has ``lo`` up (a process may use 127.0.0.1 for
itself).

Processes (:meth:`NetnsLab.popen`) run through ``ip netns exec`` under ``setpriv --pdeathsig
KILL`` (a ``prctl(PR_SET_PDEATHSIG)`` in the child where ``setpriv`` is missing), in their own
session: a parent killed with SIGKILL takes them along. As with every ``PDEATHSIG``, the signal
fires when the *thread* that started the child exits: start them from a long-lived thread.

Partitions take the host's bridge port down (:meth:`NetnsLab.partition`): the host keeps its
address and its sockets, as with a pulled cable, but no frame crosses. ``tc netem`` is not
available on these kernels (docs/chaos.md).

Teardown (:meth:`NetnsLab.close`; also ``__exit__``, ``atexit``, SIGTERM and SIGINT) kills
every process started here (its whole process group), then every process still inside a lab
namespace (``ip netns pids``), then deletes the namespaces, which deletes their links. It is
idempotent and never raises for a namespace already gone. The signal handlers are installed
only from the main thread, chain to the handlers they replace, and are restored at close.

Bad use (not root, no ``ip`` command, an unknown host) raises
:class:`~kvstore.errors.ConfigError` or :class:`~kvstore.errors.InvalidArgument`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from kvstore.errors import ConfigError, InvalidArgument

__all__ = ["PREFIX", "Host", "NetnsLab", "lab_leftovers", "unavailable_reason"]

PREFIX = "kvtc-"
OBSERVER_OCTET = 200
_PR_SET_PDEATHSIG = 1
_IP_TIMEOUT_S = 10.0


def unavailable_reason() -> str | None:
    """Why labs cannot be made here (not root, no ``ip``), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    return None


def lab_leftovers() -> list[str]:
    """Namespaces and links named ``kvtc-...`` visible from here: what a teardown leaves."""
    out = []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=False).stdout
    out += [line.split()[0] for line in names.splitlines() if line.startswith(PREFIX)]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           check=False).stdout
    for line in links.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1 and parts[1].strip().split("@")[0].startswith(PREFIX):
            out.append(parts[1].strip())
    return out


@dataclass(frozen=True, slots=True)
class Host:
    """One test host: its short name (``h0``, ``obs``), namespace and address."""

    name: str
    netns: str
    address: str
    port: str
    """Its port on the bridge (in the bridge namespace)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True,
                            timeout=_IP_TIMEOUT_S, check=False)
    if check and result.returncode != 0:
        raise ConfigError(f"ip {' '.join(args)} failed ({result.returncode}): "
                          f"{result.stderr.strip()}")
    return result


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class NetnsLab:
    """A bridge, ``hosts`` host namespaces and an observer; see the module docstring."""

    def __init__(self, hosts: int = 3) -> None:
        """Record settings; nothing is created before :meth:`up`."""
        if not 1 <= hosts <= 16:
            raise InvalidArgument(f"hosts must be 1..16, got {hosts}")
        self.prefix = f"{PREFIX}{secrets.token_hex(3)}"
        self.subnet = secrets.randbelow(256)
        self.bridge_ns = f"{self.prefix}-br"
        self.hosts = [Host(f"h{i}", f"{self.prefix}-h{i}", f"10.213.{self.subnet}.{i + 1}",
                           f"p{i}") for i in range(hosts)]
        self.observer = Host("obs", f"{self.prefix}-obs",
                             f"10.213.{self.subnet}.{OBSERVER_OCTET}", "pobs")
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._old_handlers: dict[int, Any] = {}

    @property
    def all_hosts(self) -> list[Host]:
        return [*self.hosts, self.observer]

    def host(self, name: str) -> Host:
        for h in self.all_hosts:
            if h.name == name:
                return h
        raise InvalidArgument(f"no host {name!r} in this lab (have "
                              f"{', '.join(h.name for h in self.all_hosts)})")

    # --- lifecycle ------------------------------------------------------------------------

    def up(self) -> NetnsLab:
        """Create the namespaces and links. Raises ConfigError (and tears down what it made)."""
        reason = unavailable_reason()
        if reason is not None:
            raise ConfigError(f"cannot build a network-namespace lab: {reason}")
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for h in self.all_hosts:
                self._add_ns(h.netns)
                _ip("-n", h.netns, "link", "add", "eth0", "type", "veth", "peer", "name",
                    h.port, "netns", self.bridge_ns)
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
                _ip("-n", h.netns, "link", "set", "eth0", "up")
                _ip("-n", self.bridge_ns, "link", "set", h.port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", h.port, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def __enter__(self) -> NetnsLab:
        return self.up()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs in the lab and delete its namespaces (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            for proc in self._procs:
                _kill_group(proc)
            for name in reversed(self._created):
                pids = _ip("netns", "pids", name, check=False).stdout.split()
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            for proc in self._procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
            for name in reversed(self._created):
                _ip("netns", "delete", name, check=False)
        finally:
            self._restore_signal_handlers()
            with contextlib.suppress(Exception):
                atexit.unregister(self.close)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._old_handlers[signum] = signal.signal(signum, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in self._old_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        previous = self._old_handlers.get(signum)
        self.close()
        if callable(previous):
            previous(signum, frame)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            sys.exit(128 + signum)

    # --- processes --------------------------------------------------------------------------

    def command(self, host: Host, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace, dying with this process."""
        self._check(host)
        wrapped = ["ip", "netns", "exec", host.netns, *argv]
        if shutil.which("setpriv") is not None:
            return ["setpriv", "--pdeathsig", "KILL", *wrapped]
        return wrapped

    def popen(self, host: Host, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in ``host``'s namespace (its own session; killed at teardown).
        ``kwargs`` go to :class:`subprocess.Popen`."""
        if self._closed:
            raise InvalidArgument("this lab is closed")
        preexec = None if shutil.which("setpriv") is not None else _set_pdeathsig
        proc: subprocess.Popen[Any] = subprocess.Popen(
            self.command(host, argv), start_new_session=True, preexec_fn=preexec, **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: Host, argv: Sequence[str], *, timeout_s: float = 30.0,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in ``host``'s namespace to completion (text output captured)."""
        self._check(host)
        return subprocess.run(["ip", "netns", "exec", host.netns, *argv], capture_output=True,
                              text=True, timeout=timeout_s, check=False, **kwargs)

    def _check(self, host: Host) -> None:
        if host not in self.all_hosts:
            raise InvalidArgument(f"{host} is not a host of lab {self.prefix}")

    # --- faults -------------------------------------------------------------------------------

    def partition(self, host: Host) -> None:
        """Cut ``host`` off the bridge (its port down): no frame reaches or leaves it."""
        self._check(host)
        _ip("-n", self.bridge_ns, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        self._check(host)
        _ip("-n", self.bridge_ns, "link", "set", host.port, "up")

    def reachable(self, src: Host, dst: Host, *, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection attempt from ``src`` gets an answer from ``dst`` (an
        accept or a refusal both prove the path; a timeout or no route does not). No ``ping``
        here: a SYN to a port nobody listens on answers with a reset."""
        code = ("import socket,sys\n"
                "s=socket.socket(); s.settimeout(float(sys.argv[2]))\n"
                "try:\n s.connect((sys.argv[1], 9)); sys.exit(0)\n"
                "except ConnectionRefusedError: sys.exit(0)\n"
                "except OSError: sys.exit(3)\n")
        self._check(dst)
        result = self.run(src, [sys.executable, "-c", code, dst.address, str(timeout_s)],
                          timeout_s=timeout_s + 10)
        if result.returncode not in (0, 3):
            raise ConfigError(f"reachability probe failed: {result.stderr.strip()}")
        return result.returncode == 0

    def wait_reachable(self, src: Host, dst: Host, timeout_s: float = 10.0) -> None:
        """Until ``dst`` answers ``src`` (a fresh veth takes a moment); ConfigError after."""
        deadline = time.monotonic() + timeout_s
        while not self.reachable(src, dst):
            if time.monotonic() > deadline:
                raise ConfigError(f"{dst.name} unreachable from {src.name} after {timeout_s} s")
            time.sleep(0.1)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()

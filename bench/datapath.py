"""Data-path throughput and latency between two processes on loopback, beside the socket limit.

Run with ``kvtier bench datapath [--quick] [--json PATH]``.

For each value size (4 KiB .. 64 MiB) and op, every *path* moves the same bytes from this process
to a peer process and back. Ops: ``put`` and ``get`` of one value per call; ``put_batch`` and
``get_batch`` of ``BATCH_KEYS`` values per call, pipelined (sizes up to 1 MiB only).

``socket`` (the limit)
    A bare request/response over one TCP connection: a 16-byte request, then the payload with one
    ``sendmsg`` into a peer that ``recv_into``s (``MSG_WAITALL``) a preallocated, pre-touched
    buffer and answers one byte (put); or the peer ``sendall``s from such a buffer into the
    caller's (get). No framing, no keys, no store: what one connection can carry here. Batches
    send all requests, then read all answers.
``tcp``
    :class:`kvstore.dataplane.transport.tcp.TcpClient` against a ``TcpServer`` over a
    ``MemoryBackend`` in its own process (``python -m kvstore.dataplane.transport``). Values of
    at least the stripe threshold are striped over the client's connections (``conns`` column);
    a second client with one connection shows the same sizes unstriped. Batches use
    ``put_many``/``get_many_into``. Put rows remove the keys between iterations (untimed), so
    each put reuses the backend's pre-touched buffers, as the daemon's arenas are pre-touched.
``memcpy`` (the same-host limit)
    One ``copy_bytes`` (the call the shared-memory client uses; ``np.copyto`` from 64 KiB up, as
    ``bench/tiers.py`` measures its DRAM limit) per value, between the caller's buffer and the
    next slot of a pre-touched store of ``WORKING_SET_BYTES`` (256 MiB, 8x the 32 MiB LLC here):
    a get copies from, a put into, a slot that is not in the CPU cache, as a get from (or a put
    into) a large arena does. This is the limit ``shm`` rows are divided by. It is a limit,
    not a store: a get copies whatever the next slot holds (its bytes are not checked).
``memcpy-hot`` (shown, not a limit)
    The same copy with the store slot always at offset 0: cache-hot up to a few MiB (~40 GB/s
    here against ~10-20 GB/s from DRAM). It only tells how much of a gap is the cache.
``shm``
    :class:`kvstore.client.StoreClient` on its shared-memory data plane against a
    ``kvtier daemon`` process (DRAM tier only): a get of a chunk the daemon's read index
    publishes is lease-free (a lookup in the mapped index, one memcpy out of the mapped arena,
    a seqlock check; no round trip; docs/dram-arena.md), otherwise one lease-channel round trip,
    one memcpy and a release sent without waiting; a put is a reservation, one memcpy into the
    arena and a commit (values up to 64 KiB: one PUT request carrying the value). Batches read
    lease-free key by key, or lease all keys in one round trip. Its ``limit_gbps`` is the
    ``memcpy`` figure.
``shm-leased``
    The same with ``StoreClientConfig(lease_free_reads=False)``: every get takes a lease (what
    ``shm`` did before the read index), for comparison in one run.
``tcp`` / ``tcp-daemon``
    The daemon's TCP data plane: the same ``TcpClient`` as above, but against a
    ``kvtier daemon`` process whose server sends from and receives into the DRAM arena through
    the tiered cache (``variant`` ``daemon``; the standalone server is ``memory-backend``).
``socket-spin`` (the limit of ``tcp-daemon-spin``) / ``tcp-daemon-spin``
    The same pair and daemon path with a client that polls for its answer for ``SPIN_US``
    before it sleeps (``StoreClientConfig.tcp_spin_us``; the native extension does it with the
    GIL released). On this VM a sleeping receiver's wake-up costs ~10-30 µs, so this shows what
    a spinning client buys for small values, each against a limit that spins alike.
``shm-auth`` / ``tcp-daemon-auth`` / ``ucx-daemon-auth`` / ``tcp-daemon-tls`` (the cost of
security; get only)
    The ``shm``, ``tcp-daemon`` and ``ucx-daemon`` paths against a daemon with authentication
    (UCX lanes ticketed like TCP connections): bearer tokens
    on gRPC (a signing key and a token of one tenant minted at run time), so the TCP
    plane serves ticketed, tenant-scoped connections and the lease channel scoped ones
    (docs/security.md, "Data planes"). ``tcp-daemon-tls`` adds TLS on the TCP plane
    (``server.tcp_tls``, with a throwaway CA and certificate made at run time; the gRPC port
    speaks TLS too). Their limit is the same path without security in the same run
    (``shm``, ``tcp-daemon``), so ``ratio`` is "with security / without": the issue's goal is
    at least 0.9 from 64 KiB up for the ``-auth`` rows, and the ``tls`` row is TLS TCP as a
    ratio to plain TCP; ``socket_ratio`` puts each beside the physical limit too.
``tls-socket`` (shown beside ``tcp-daemon-tls``; get only)
    The ``socket`` pair with TLS on its one connection (Python's ``ssl``, the same OpenSSL and
    throwaway certificate): what TLS itself costs here, a limit for the TLS row.
``redis``
    ``/usr/bin/redis-server`` started here on an ephemeral port (no persistence), driven over a raw
    RESP socket that sends with ``sendmsg`` and receives with ``recv_into`` into the caller's
    buffer (a Python client library would add its own copies: this is Redis at its best from
    Python). SETs overwrite the same keys; batches are pipelined SETs / GETs.

Working set: every path's calls cycle over distinct keys (up to ``MAX_WORKING_SET_KEYS`` keys
or batches, and no more than needed for ``WORKING_SET_BYTES``), stored before the timed gets;
a timed put goes to a key not stored at the time (its previous copy is removed untimed, long
after it was written), so neither a get nor a put keeps hitting one cache-hot arena range.

Each figure is ``value_bytes * values moved / sum(per-call seconds)`` in GB/s (10^9 bytes/s),
after untimed warm-up calls; ``limit_gbps`` is the figure of the path's limit (``socket``, or
``memcpy`` for ``shm``) for the same op and size from the same run. Latency p50/p99 are per call (a whole batch for batch ops). Every get is
checked against the bytes put. The machine is shared and noisy: each measurement is split into
rounds in which the paths take turns, so background load lands on all paths alike.

``mooncake`` (optional)
    The Mooncake store over loopback TCP (``../shared/peers/mooncake``): a master, a holder
    process that owns the memory and a client that owns none, so every byte crosses Mooncake's
    TCP transport. It runs in its own virtual environment, so it is measured by a helper
    process (``bench/mooncake_peer.py``) after the interleaved rounds, with zero-copy
    ``put_from``/``get_into`` on registered buffers at the same sizes; skipped, with the
    reason, when it cannot be installed or started.

Adding a path: implement :class:`DataPath` and add a factory to ``PATHS``; rows, ratios, the
table and the JSON pick it up.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from kvstore.dataplane.arena import copy_bytes
from kvstore.dataplane.transport.tcp import DEFAULT_STRIPE_THRESHOLD_BYTES, TcpClient

REPO_ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1 << 10, 1 << 20
SIZES_BYTES = (4 * KiB, 64 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB)
OPS = ("put", "get", "put_batch", "get_batch")
BATCH_KEYS = 32
BATCH_MAX_VALUE_BYTES = 4 * MiB
WORKING_SET_BYTES = 256 * MiB
"""What the memcpy limit cycles over, and the most each path's keys cover (> the LLC)."""
MAX_WORKING_SET_KEYS = 1024
"""Keys (or batches) a path's calls cycle over at most: small values cover less than
``WORKING_SET_BYTES`` (4 KiB x 1024 = 4 MiB) so the untimed stores stay quick; their calls are
bound by round trips, not by the copy."""
TCP_CONNECTIONS = 4
REDIS_BINARY = "/usr/bin/redis-server"
_SOCKET_REQUEST = struct.Struct("<4sQ4x")  # op b"PUT_"/b"GET_", size; 16 bytes


# --- paths -----------------------------------------------------------------------------------------


class DataPath(Protocol):
    """One way of moving values to a peer process and back. Buffers are flat byte views; a
    batch's ``keys``/``srcs``/``dsts`` are parallel lists. Values are stored under the keys
    given (repeated puts of one key either overwrite or follow ``after_put``).

    ``limit`` names the path whose figure for the same op and size is this one's limit."""

    name: str
    connections: int
    limit: str

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None: ...

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None: ...

    def after_put(self, keys: Sequence[bytes]) -> None:
        """Untimed clean-up between put iterations (e.g. remove the keys)."""
        ...

    def covers(self, size_bytes: int) -> bool:
        """Whether this path is measured at this size (a variant may cover only some)."""
        ...

    def close(self) -> None: ...


_SERVER_CPUS: set[int] | None = None
"""While :func:`run` pins (``pin_cpus``): the CPUs every server process runs on; the measuring
process and the Mooncake client run on the others."""


def _as_server() -> None:
    """``preexec_fn`` of every server process: pin it (all its threads) to the server CPUs."""
    if _SERVER_CPUS is not None:
        os.sched_setaffinity(0, _SERVER_CPUS)


def _split_cpus() -> tuple[set[int], set[int]] | None:
    """(client CPUs, server CPUs): the first allowed CPU, and the rest; None with one CPU."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    return {cpus[0]}, set(cpus[1:])


def _spawn_listening(cmd: list[str], ready_prefix: str, timeout_s: float = 30.0
                     ) -> tuple[subprocess.Popen[str], int]:
    """Start a peer process that prints ``<ready_prefix> ... <port>``; return it and the port."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, preexec_fn=_as_server)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(ready_prefix):
            return proc, int(line.split()[-1])
    proc.kill()
    raise RuntimeError(f"peer {cmd} did not report {ready_prefix!r}")


def _stop(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    pos = 0
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS takes none
    while pos < len(view):
        got = sock.recv_into(view[pos:], len(view) - pos, flags)
        if got == 0:
            raise ConnectionError("peer closed")
        pos += got


class SocketPath:
    """The limit: bare sendmsg/recv_into over one connection to :func:`socket_peer`.

    ``spin_us``: the client polls (non-blocking receives) this long before it sleeps in a
    blocking receive, as ``tcp-daemon-spin`` does (``StoreClientConfig.tcp_spin_us``); the peer
    sleeps as the daemon does. The limit of a client that does not sleep right away."""

    connections = 1

    def __init__(self, spin_us: int = 0, tls: bool = False) -> None:
        self.name = self.limit = "socket-spin" if spin_us else "tls-socket" if tls \
            else "socket"
        self.ops: tuple[str, ...] = OPS
        if tls:  # the limit of TLS itself, shown as a ratio to the plain socket
            self.limit, self.ops = "socket", ("get",)
        self._spin_s = spin_us / 1e6
        self._dir: str | None = None
        peer = [sys.executable, "-m", "bench.datapath", "--socket-peer"]
        if tls:
            self._dir = tempfile.mkdtemp(prefix="kvtier-bench-tls-")
            _settings, security = _bench_security(Path(self._dir), tls=True)
            peer += [_settings["security.cert_file"], _settings["security.key_file"]]
        self._proc, port = _spawn_listening(peer, "LISTENING")
        self._sock = _connect(port)
        if tls:
            context = ssl.create_default_context(cafile=str(security.ca_file))
            self._sock = context.wrap_socket(self._sock, server_hostname="127.0.0.1")
        self._acks = memoryview(bytearray(BATCH_KEYS))

    def _recv_spinning(self, view: memoryview) -> None:
        pos, size = 0, len(view)
        deadline = time.perf_counter() + self._spin_s
        while pos < size and time.perf_counter() < deadline:
            try:
                got = self._sock.recv_into(view[pos:], size - pos, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            if got == 0:
                raise ConnectionError("peer closed")
            pos += got
        if pos < size:
            _recv_exact(self._sock, view[pos:])

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None:
        parts: list[bytes | memoryview] = []
        for src in srcs:
            parts += [_SOCKET_REQUEST.pack(b"PUT_", len(src)), src]
        if isinstance(self._sock, ssl.SSLSocket):  # no sendmsg through TLS
            for part in parts:
                self._sock.sendall(part)
        else:
            self._sock.sendmsg(parts)
        _recv_exact(self._sock, self._acks[:len(srcs)])

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None:
        self._sock.sendall(b"".join(_SOCKET_REQUEST.pack(b"GET_", len(d)) for d in dsts))
        for dst in dsts:
            if self._spin_s:
                self._recv_spinning(dst)
            else:
                _recv_exact(self._sock, dst)

    def after_put(self, keys: Sequence[bytes]) -> None:
        pass

    def covers(self, size_bytes: int) -> bool:
        return True

    def close(self) -> None:
        self._sock.close()
        _stop(self._proc)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def socket_peer(tls_files: list[str]) -> None:
    """The ``socket`` path's peer process: one connection, a pre-touched 64 MiB buffer; with
    ``tls_files`` (certificate, key) the connection speaks TLS (``tls-socket``)."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"LISTENING 127.0.0.1 {listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls_files:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls_files)
        conn = context.wrap_socket(conn, server_side=True)
    buf = np.ones(max(SIZES_BYTES), dtype=np.uint8).data
    req = memoryview(bytearray(_SOCKET_REQUEST.size))
    while True:
        try:
            _recv_exact(conn, req)
        except ConnectionError:
            return
        op, size = _SOCKET_REQUEST.unpack(req)
        if op == b"PUT_":
            _recv_exact(conn, buf[:size])
            conn.sendall(b"k")
        else:
            conn.sendall(buf[:size])


class TcpPath:
    """kvtier's TCP transport against a standalone server process.

    ``striped_only``: measure only the sizes that are striped by default (the one-connection
    variant, which is the same code as the default below the stripe threshold).
    """

    name = "tcp"
    limit = "socket"

    def __init__(self, connections: int = TCP_CONNECTIONS, striped_only: bool = False) -> None:
        self.connections = connections
        self._striped_only = striped_only
        self._proc, port = _spawn_listening(
            [sys.executable, "-m", "kvstore.dataplane.transport", "--exit-on-stdin-eof",
             "--max-value-bytes", str(2 * max(SIZES_BYTES))], "LISTENING")
        self._client = TcpClient("127.0.0.1", port, connections=connections)

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None:
        if len(keys) == 1:
            self._client.put(keys[0], srcs[0])
        else:
            self._client.put_many(keys, srcs)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None:
        if len(keys) == 1:
            self._client.get_into(keys[0], dsts[0])
        else:
            self._client.get_many_into(keys, dsts)

    def after_put(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._client.remove(key)

    def covers(self, size_bytes: int) -> bool:
        return not self._striped_only or size_bytes >= DEFAULT_STRIPE_THRESHOLD_BYTES

    def close(self) -> None:
        self._client.close()
        _stop(self._proc)


class UcxPath:
    """kvtier's UCX transport (``ucxx``) against a standalone server process; on one host UCX
    moves the bytes over shared memory / CMA, so it may beat the socket limit."""

    name = "ucx"
    limit = "socket"

    def __init__(self) -> None:
        from kvstore.dataplane.transport.ucx import UcxClient

        self._proc, address_hex = _spawn_ucx_server()
        self._client = UcxClient(bytes.fromhex(address_hex))
        self.connections = self._client.config.lanes

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None:
        for key, src in zip(keys, srcs, strict=True):
            self._client.put(key, src)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None:
        for key, dst in zip(keys, dsts, strict=True):
            self._client.get_into(key, dst)

    def after_put(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._client.remove(key)

    def covers(self, size_bytes: int) -> bool:
        return True

    def close(self) -> None:
        self._client.close()
        _stop(self._proc)


def _spawn_ucx_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.dataplane.transport.ucx", "--exit-on-stdin-eof",
         "--max-value-bytes", str(2 * max(SIZES_BYTES))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        preexec_fn=_as_server)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("UCX-LISTENING "):
        proc.kill()
        raise RuntimeError(f"UCX server did not start: {line!r}")
    return proc, line.split()[1]


class RedisPath:
    """redis-server on an ephemeral port, over raw RESP with zero-copy receives."""

    name = "redis"
    connections = 1
    limit = "socket"

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
        self._proc: subprocess.Popen[bytes] | None = None
        for _ in range(5):  # redis-server cannot bind port 0: pick a free one, retry on a race
            port = _free_port()
            proc = subprocess.Popen(
                [REDIS_BINARY, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--protected-mode", "no", "--dir", self._dir,
                 "--proto-max-bulk-len", str(2 * max(SIZES_BYTES))],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_as_server)
            sock = _wait_for_port(port, proc)
            if sock is not None:
                self._proc, self._sock = proc, sock
                break
        if self._proc is None:
            raise RuntimeError("redis-server did not start")
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._oks = memoryview(bytearray(5 * BATCH_KEYS))
        self._crlf = memoryview(bytearray(2))

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None:
        parts: list[bytes | memoryview] = []
        for key, src in zip(keys, srcs, strict=True):
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, len(src)),
                      src, b"\r\n"]
        self._sock.sendmsg(parts)
        oks = self._oks[:5 * len(keys)]
        _recv_exact(self._sock, oks)
        if oks.tobytes() != b"+OK\r\n" * len(keys):
            raise RuntimeError(f"redis SET answered {oks.tobytes()[:40]!r}")

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None:
        self._sock.sendall(b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)
                                    for k in keys))
        for dst in dsts:
            prefix = b"$%d\r\n" % len(dst)
            got = memoryview(bytearray(len(prefix)))
            _recv_exact(self._sock, got)
            if got.tobytes() != prefix:
                raise RuntimeError(f"redis GET answered {got.tobytes()!r}, expected {prefix!r}")
            _recv_exact(self._sock, dst)
            _recv_exact(self._sock, self._crlf)

    def after_put(self, keys: Sequence[bytes]) -> None:
        pass  # the next SET overwrites the same keys

    def covers(self, size_bytes: int) -> bool:
        return True

    def close(self) -> None:
        self._sock.close()
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


class MemcpyPath:
    """The same-host limit: ``copy_bytes`` between the caller's buffer and the next slot of a
    pre-touched ``WORKING_SET_BYTES`` store (module docstring); ``hot``: always the first slot."""

    name = "memcpy"
    connections = 1
    limit = "memcpy"

    def __init__(self, hot: bool = False) -> None:
        self._hot = hot
        batch_bytes = BATCH_KEYS * BATCH_MAX_VALUE_BYTES
        room = max(max(SIZES_BYTES), batch_bytes) if hot else max(WORKING_SET_BYTES,
                                                                   2 * batch_bytes)
        self._room = room
        self._store = np.ones(room, dtype=np.uint8).data  # pre-touched by the fill
        self._pos = 0

    def _slots(self, sizes: Sequence[int]) -> int:
        """Where the next call's values start (consecutive slots, wrapping over the store)."""
        total = sum(sizes)
        if self._hot or self._pos + total > self._room:
            self._pos = 0
        start = self._pos
        self._pos += total
        return start

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None:
        pos = self._slots([len(s) for s in srcs])
        for src in srcs:
            copy_bytes(self._store[pos:pos + len(src)], src)
            pos += len(src)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None:
        pos = self._slots([len(d) for d in dsts])
        for dst in dsts:
            copy_bytes(dst, self._store[pos:pos + len(dst)])
            pos += len(dst)

    def after_put(self, keys: Sequence[bytes]) -> None:
        pass

    def covers(self, size_bytes: int) -> bool:
        return True

    def close(self) -> None:
        pass


DAEMON_DRAM = "640MiB"
"""Room for a 256 MiB working set plus the largest value (64 MiB) or batch (32 x 4 MiB)."""


def spawn_daemon(node_id: str, dram_bytes: str = DAEMON_DRAM,
                 settings: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
    """A ``kvtier daemon`` child (DRAM only, no etcd, no metrics); returns it and its gRPC
    address. ``settings``: more ``--set`` values. The other benchmarks start theirs here too."""
    from kvstore.node.daemon import READY_PREFIX

    cmd = [sys.executable, "-m", "kvstore.cli.main", "daemon", "--set", f"node_id={node_id}",
           "--set", f"dram.capacity_bytes={dram_bytes}", "--set", "log_level=WARNING",
           "--set", f"server.max_value_bytes={2 * max(SIZES_BYTES)}",
           "--set", "shutdown.drain_timeout_s=2"]
    for name, value in (settings or {}).items():
        cmd += ["--set", f"{name}={value}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                            cwd=REPO_ROOT, preexec_fn=_as_server)
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(READY_PREFIX):
            return proc, json.loads(line[len(READY_PREFIX):])["grpc_address"]
    proc.kill()
    raise RuntimeError("kvtier daemon did not become ready")


def stop_daemon(proc: subprocess.Popen[str]) -> None:
    proc.terminate()  # SIGTERM: a graceful drain
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()


def _bench_security(directory: Path, tls: bool) -> tuple[dict[str, str], Any]:
    """Throwaway credentials for a secured daemon: an Ed25519 token key and one token of
    tenant ``bench``; with ``tls`` a CA and a certificate for 127.0.0.1, and TLS on the TCP
    plane. Returns the daemon's ``--set`` values and the client's ``ClientSecurity``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from kvstore.security.config import ClientSecurity
    from kvstore.security.identity import Role
    from kvstore.security.tokens import generate_key, load_signing_key, mint

    generate_key(directory / "keys", "k1")
    signing_path = directory / "k1.key"
    (directory / "keys" / "k1.key").rename(signing_path)
    kid, signing = load_signing_key(signing_path)
    token = directory / "engine.token"
    # An operator scoped to one tenant: its data planes act for that tenant as an engine's
    # would (tenant-scoped tickets), and it may Remove between put iterations.
    token.write_text(mint(signing, kid, subject="bench", role=Role.OPERATOR, tenants=["bench"],
                          ttl_s=86400))
    settings = {"security.token_keys": str(directory / "keys")}
    if not tls:
        return settings, ClientSecurity(token_file=token)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier bench CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench daemon")]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "daemon.crt").write_bytes(cert.public_bytes(pem))
    (directory / "daemon.key").write_bytes(key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    settings |= {"security.cert_file": str(directory / "daemon.crt"),
                 "security.key_file": str(directory / "daemon.key"), "server.tcp_tls": "true"}
    return settings, ClientSecurity(ca_file=directory / "ca.crt", token_file=token)


class DaemonPath:
    """:class:`StoreClient` against a ``kvtier daemon`` process, over shared memory or TCP.

    ``security``: ``"auth"`` (bearer tokens: ticketed, tenant-scoped data planes) or ``"tls"``
    (tokens and TLS on the TCP plane) against a daemon started with them; its limit is then
    the same plane without security (module docstring)."""

    def __init__(self, plane: str, *, lease_free: bool = True, tcp_spin_us: int = 0,
                 security: str = "") -> None:
        from kvstore.client import DataPlane, StoreClient, StoreClientConfig

        self._plane = DataPlane(plane)
        self._one_by_one = self._plane is DataPlane.UCX  # StoreClient batches go over TCP
        self.name = self._plane.value
        self.limit = "memcpy" if self._plane is DataPlane.SHM else \
            "socket-spin" if tcp_spin_us else "socket"
        self.connections = {DataPlane.SHM: 1, DataPlane.UCX: 2}.get(self._plane, TCP_CONNECTIONS)
        self.ops: tuple[str, ...] = OPS
        settings: dict[str, str] = {}
        client_security = None
        self._dir: str | None = None
        if security:
            self._dir = tempfile.mkdtemp(prefix="kvtier-bench-security-")
            settings, client_security = _bench_security(Path(self._dir), security == "tls")
            if self._plane is DataPlane.UCX:  # under security UCX is served only when asked
                settings["server.ucx"] = "required"
            self.limit = {DataPlane.SHM: "shm", DataPlane.UCX: "ucx-daemon"}.get(
                self._plane, "tcp-daemon")
            self.ops = ("get",)
        self._proc, address = spawn_daemon(f"bench-{plane}{'-' + security if security else ''}",
                                           settings=settings)
        self._client = StoreClient.connect(address, StoreClientConfig(
            data_plane=self._plane, tcp_connections=TCP_CONNECTIONS, wait_for_ready=True,
            ucx_min_bytes=0, lease_free_reads=lease_free, tcp_spin_us=tcp_spin_us,
            security=client_security))  # ucx_min_bytes: measure UCX at every size

    def put_many(self, keys: Sequence[bytes], srcs: Sequence[memoryview]) -> None:
        if len(keys) == 1 or self._one_by_one:
            for key, src in zip(keys, srcs, strict=True):
                self._client.put(key, src)
        else:
            self._client.put_many(keys, srcs)

    def get_many_into(self, keys: Sequence[bytes], dsts: Sequence[memoryview]) -> None:
        if len(keys) == 1 or self._one_by_one:
            for key, dst in zip(keys, dsts, strict=True):
                self._client.get_into(key, dst)
        else:
            self._client.get_many_into(keys, dsts)

    def after_put(self, keys: Sequence[bytes]) -> None:
        from kvstore.errors import ChunkBusy

        for key in keys:
            # The daemon's TCP server ends a read lease after its last send, so a remove right
            # behind a TCP get can still find the chunk leased for a moment: retry briefly.
            for attempt in range(100):
                try:
                    self._client.remove(key)
                    break
                except ChunkBusy:
                    if attempt == 99:
                        raise
                    time.sleep(0.01)

    def covers(self, size_bytes: int) -> bool:
        return True

    def close(self) -> None:
        self._client.close()
        stop_daemon(self._proc)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(port: int, proc: subprocess.Popen[bytes]) -> socket.socket | None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=1)
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None


PATHS: dict[str, Callable[[], DataPath]] = {
    "socket": SocketPath,
    "memcpy": MemcpyPath,
    "memcpy-hot": lambda: MemcpyPath(hot=True),
    "tcp": TcpPath,
    "tcp-1conn": lambda: TcpPath(connections=1, striped_only=True),
    "tcp-daemon": lambda: DaemonPath("tcp"),
    "socket-spin": lambda: SocketPath(spin_us=SPIN_US),
    "tcp-daemon-spin": lambda: DaemonPath("tcp", tcp_spin_us=SPIN_US),
    "shm": lambda: DaemonPath("shm"),
    "shm-leased": lambda: DaemonPath("shm", lease_free=False),
    "shm-auth": lambda: DaemonPath("shm", security="auth"),
    "tcp-daemon-auth": lambda: DaemonPath("tcp", security="auth"),
    "tcp-daemon-tls": lambda: DaemonPath("tcp", security="tls"),
    "tls-socket": lambda: SocketPath(tls=True),
    "ucx": UcxPath,
    "ucx-daemon": lambda: DaemonPath("ucx"),
    "ucx-daemon-auth": lambda: DaemonPath("ucx", security="auth"),
    "redis": RedisPath,
}
"""Every path the benchmark runs, limits first. Add new paths here; ``socket`` must stay (and
``memcpy`` wherever ``shm`` runs). The key is the row's ``variant``. The ``ucx`` paths run only
where ``ucxx`` imports (``main`` drops them otherwise and says why)."""
UCX_PATHS = ("ucx", "ucx-daemon", "ucx-daemon-auth")
SECURED_PATHS = {"shm-auth": "shm", "tcp-daemon-auth": "tcp-daemon", "tcp-daemon-tls": "tcp-daemon",
                 "ucx-daemon-auth": "ucx-daemon"}
"""The cost-of-security paths and the path each is a ratio to (its ``limit``)."""
SPIN_US = 50
"""How long ``socket-spin`` and ``tcp-daemon-spin`` poll before sleeping (a few of this
machine's scheduler wake-ups, ~10-30 µs each)."""


# --- the Mooncake peer (its own venv, measured by bench/mooncake_peer.py) ---------------------------

MOONCAKE_PYTHON_ENV = "KVTIER_MOONCAKE_PYTHON"
MOONCAKE_INSTALL_HINT = "bash ../shared/peers/mooncake/run_peer.sh installs it"


def mooncake_python() -> str | None:
    """The Python of Mooncake's venv: $KVTIER_MOONCAKE_PYTHON, else where run_peer.sh puts it."""
    explicit = os.environ.get(MOONCAKE_PYTHON_ENV)
    if explicit:
        return explicit
    work = os.environ.get("WORK") or os.environ.get("TMPDIR") or "/tmp"
    candidate = Path(work) / "mooncake-peer" / "venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else None


@dataclass(frozen=True, slots=True)
class _ExternalPath:
    """A path measured outside the interleaved rounds (its rows only need these fields)."""

    name: str
    connections: int
    limit: str


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            time.sleep(0.1)
    return False


def run_mooncake(quick: bool) -> tuple[dict[tuple[str, int], list[float]], str]:
    """Per-call seconds for each (op, size) from the Mooncake peer, or ({}, why it was skipped)."""
    python = mooncake_python()
    if python is None:
        return {}, f"no Mooncake venv found ({MOONCAKE_INSTALL_HINT}, or set {MOONCAKE_PYTHON_ENV})"
    check = subprocess.run([python, "-c", "import mooncake.store"], capture_output=True,
                           text=True)
    if check.returncode != 0:
        return {}, f"mooncake does not import: {check.stderr.strip().splitlines()[-1:]}"
    master_bin = Path(python).parent / "mooncake_master"
    if not master_bin.exists():
        return {}, f"{master_bin} is missing"
    logs = Path(tempfile.mkdtemp(prefix="kvtier-bench-mooncake-"))
    env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
    rpc_port, meta_port, metrics_port = _free_port(), _free_port(), _free_port()
    procs: list[subprocess.Popen[Any]] = []
    try:
        with (logs / "master.log").open("w") as log:
            master = subprocess.Popen(
                [str(master_bin), "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={meta_port}", "--metrics_host=127.0.0.1",
                 f"--metrics_port={metrics_port}", "--logtostderr"],
                stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_as_server)
        procs.append(master)
        if not (_wait_port(rpc_port, master) and _wait_port(meta_port, master)):
            return {}, f"mooncake_master did not start (see {logs}/master.log)"
        common = ["--master", f"127.0.0.1:{rpc_port}",
                  "--metadata", f"http://127.0.0.1:{meta_port}/metadata"]
        peer = str(REPO_ROOT / "bench" / "mooncake_peer.py")
        with (logs / "holder.log").open("w") as log:
            holder = subprocess.Popen([python, peer, "--role", "holder", *common,
                                       "--segment-bytes", str(1 << 30)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=log, text=True, env=env, preexec_fn=_as_server)
        procs.append(holder)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != "READY":
            return {}, f"the Mooncake holder did not start (see {logs}/holder.log)"
        calls = {}
        for size in SIZES_BYTES:
            for op in OPS:
                batch = BATCH_KEYS if op.endswith("_batch") else 1
                calls[f"{op}:{size}"] = calls_for(size, batch, quick)
        plan = {"sizes": list(SIZES_BYTES), "ops": list(OPS), "calls": calls,
                "warmup": 2, "batch_keys": BATCH_KEYS,
                "batch_max_value_bytes": BATCH_MAX_VALUE_BYTES}
        with (logs / "client.log").open("w") as log:
            client = subprocess.run([python, peer, "--role", "client", *common,
                                     "--local-bytes", str(256 << 20)],
                                    input=json.dumps(plan) + "\n", stdout=subprocess.PIPE,
                                    stderr=log, text=True, env=env, timeout=900)
        if client.returncode != 0:
            return {}, f"the Mooncake client failed (see {logs}/client.log)"
        raw = json.loads(client.stdout.strip().splitlines()[-1])
        return {(k.split(":")[0], int(k.split(":")[1])): v for k, v in raw.items()}, ""
    finally:
        for proc in reversed(procs):
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


# --- measurement -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    path: str
    variant: str
    """Which implementation of ``path`` (the ``PATHS`` key: ``tcp-daemon`` is the daemon's TCP
    data plane, ``tcp`` the standalone transport server)."""
    op: str
    value_bytes: int
    batch_keys: int
    connections: int
    calls: int
    gbps: float
    """10^9 bytes per second over the timed calls."""
    limit_gbps: float
    """The limit path's figure (``socket``; ``memcpy`` for ``shm``) for the same op and size
    in this run."""
    ratio_to_limit: float
    p50_us: float
    """Per call: one value, or a whole batch of ``batch_keys`` values."""
    p99_us: float
    physical_ratio: float = 0.0
    """``gbps`` over the physical limit's figure (``socket`` or ``memcpy``): the limit's own
    limit, for rows whose ``limit_gbps`` is another store path (the cost-of-security rows);
    equal to ``ratio_to_limit`` otherwise."""


def calls_for(size_bytes: int, batch_keys: int, quick: bool) -> int:
    budget = (24 if quick else 384) * MiB
    low, high = (6, 300) if quick else (15, 4000)
    return max(low, min(high, budget // (size_bytes * batch_keys)))


def working_set(size_bytes: int, batch_keys: int, calls: int) -> int:
    """How many distinct keys (batches of keys) a measurement cycles over (module docstring)."""
    per_call = size_bytes * batch_keys
    return max(1, min(calls, MAX_WORKING_SET_KEYS, -(-WORKING_SET_BYTES // per_call)))


def measure(path: DataPath, op: str, size_bytes: int, src: memoryview, dst: memoryview,
            calls: int, warmup: int) -> list[float]:
    """Per-call seconds of ``calls`` calls after ``warmup`` untimed ones, cycling over a
    working set of keys (module docstring)."""
    batch = BATCH_KEYS if op.endswith("_batch") else 1
    groups = [[b"bench-%d-%d-%d" % (size_bytes, g, i) for i in range(batch)]
              for g in range(working_set(size_bytes, batch, warmup + calls))]
    srcs = [src[:size_bytes]] * batch
    dsts = [dst[i * size_bytes:(i + 1) * size_bytes] for i in range(batch)]
    times: list[float] = []
    if op.startswith("put"):
        for i in range(warmup + calls):
            keys = groups[i % len(groups)]
            if i >= len(groups):
                path.after_put(keys)  # untimed: its previous copy was written long ago
            t0 = time.perf_counter()
            path.put_many(keys, srcs)
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                times.append(elapsed)
        for keys in groups[:warmup + calls]:
            path.after_put(keys)
        return times
    for keys in groups:
        path.put_many(keys, srcs)
    for i in range(warmup + calls):
        keys = groups[i % len(groups)]
        t0 = time.perf_counter()
        path.get_many_into(keys, dsts)
        elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
    if path.name not in ("socket", "socket-spin", "tls-socket", "memcpy"):  # the limits move bytes, they store nothing
        want = xxhash.xxh3_64_digest(srcs[0])
        if any(xxhash.xxh3_64_digest(d) != want for d in dsts):
            raise RuntimeError(f"{path.name} {op} of {size_bytes} bytes returned other bytes")
    for keys in groups:
        path.after_put(keys)
    return times


def run(quick: bool, path_names: tuple[str, ...] = tuple(PATHS), *,
        mooncake: bool = False, pin_cpus: bool = True) -> dict[str, Any]:
    """Measure every path, op and size, the paths taking turns in rotating order per round;
    then, with ``mooncake``, the Mooncake peer (skipped, with the reason, when unavailable).

    ``pin_cpus`` (with two CPUs or more): this process (every client) runs on one CPU and every
    server process on the others. Unpinned, the scheduler sometimes puts a client and its
    server on one CPU (a round trip is two context switches) and sometimes on two (two
    cross-CPU wake-ups, 3-4x slower for small values on this VM), and keeps each placement for
    minutes: paths measured in the same round differed by 3x for no reason of their own."""
    global _SERVER_CPUS
    split = _split_cpus() if pin_cpus else None
    before = os.sched_getaffinity(0)
    if split is not None:
        os.sched_setaffinity(0, split[0])
        _SERVER_CPUS = split[1]
    try:
        result = _run(quick, path_names, mooncake=mooncake)
    finally:
        _SERVER_CPUS = None
        os.sched_setaffinity(0, before)
    result["settings"]["cpu_pinning"] = None if split is None else {
        "client": sorted(split[0]), "servers": sorted(split[1])}
    return result


def _run(quick: bool, path_names: tuple[str, ...], *, mooncake: bool) -> dict[str, Any]:
    if path_names[0] != "socket":
        raise ValueError("the socket path (the limit) must be measured, and first")
    if any(n.startswith("shm") for n in path_names) and "memcpy" not in path_names:
        raise ValueError("the shm path needs the memcpy path (its limit)")
    if "tcp-daemon-spin" in path_names and "socket-spin" not in path_names:
        raise ValueError("the tcp-daemon-spin path needs the socket-spin path (its limit)")
    for secured, plain in SECURED_PATHS.items():
        if secured in path_names and plain not in path_names:
            raise ValueError(f"the {secured} path needs the {plain} path (its limit)")
    largest = max(SIZES_BYTES)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, largest, dtype=np.uint8).data  # pre-touched by the fill
    dst = np.ones(max(largest, BATCH_KEYS * BATCH_MAX_VALUE_BYTES), dtype=np.uint8).data
    rounds = 3 if quick else 5
    times: dict[tuple[str, str, int], list[float]] = {}
    paths: dict[str, DataPath] = {}
    try:
        for name in path_names:
            paths[name] = PATHS[name]()
        for size in SIZES_BYTES:
            for op in OPS:
                batch = BATCH_KEYS if op.endswith("_batch") else 1
                if batch > 1 and size > BATCH_MAX_VALUE_BYTES:
                    continue
                per_round = -(-calls_for(size, batch, quick) // rounds)
                for r in range(rounds):
                    order = path_names[r % len(path_names):] + path_names[:r % len(path_names)]
                    for name in order:
                        if paths[name].covers(size) and op in getattr(paths[name], "ops", OPS):
                            times.setdefault((name, op, size), []).extend(measure(
                                paths[name], op, size, src, dst, per_round,
                                warmup=max(2, per_round // 5) if r == 0 else 1))
    finally:
        for path in paths.values():
            path.close()
    skipped: dict[str, str] = {}
    row_paths: dict[str, DataPath | _ExternalPath] = dict(paths)
    if mooncake:
        mc_times, reason = run_mooncake(quick)
        if mc_times:
            row_paths["mooncake"] = _ExternalPath("mooncake", 1, "socket")
            for (op, size), ts in mc_times.items():
                times[("mooncake", op, size)] = ts
        else:
            skipped["mooncake"] = reason
            print(f"mooncake skipped: {reason}", file=sys.stderr)
    paths = row_paths  # type: ignore[assignment]
    limit_of = {name: path.limit for name, path in row_paths.items()}

    def physical(name: str) -> str:
        while limit_of.get(limit_of[name], name) != limit_of[name]:
            name = limit_of[name]
        return limit_of[name]

    rows = []
    for (name, op, size), ts in times.items():
        batch = BATCH_KEYS if op.endswith("_batch") else 1
        gbps = size * batch * len(ts) / sum(ts) / 1e9
        limit = times[(limit_of[name], op, size)]
        limit_gbps = size * batch * len(limit) / sum(limit) / 1e9
        phys = times[(physical(name), op, size)]
        phys_gbps = size * batch * len(phys) / sum(phys) / 1e9
        us = np.asarray(ts) * 1e6
        rows.append(Row(paths[name].name, name, op, size, batch, paths[name].connections,
                        len(ts), gbps, limit_gbps, gbps / limit_gbps,
                        float(np.percentile(us, 50)), float(np.percentile(us, 99)),
                        gbps / phys_gbps))
    return {
        "benchmark": "datapath",
        "quick": quick,
        "git_sha": git_sha(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "versions": {"numpy": np.__version__, "redis_server": _redis_version()},
        "settings": {"tcp_connections": TCP_CONNECTIONS, "daemon_dram": DAEMON_DRAM,
                     "stripe_threshold_bytes": DEFAULT_STRIPE_THRESHOLD_BYTES,
                     "batch_keys": BATCH_KEYS, "rounds": rounds},
        "rows": [asdict(r) for r in rows],
        "skipped": skipped,
    }


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvstore/dataplane",
                                "kvstore/node", "kvstore/client",
                                "bench/datapath.py"], cwd=REPO_ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def _redis_version() -> str:
    try:
        out = subprocess.run([REDIS_BINARY, "--version"], capture_output=True, text=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "missing"
    return out.split("v=")[1].split()[0] if "v=" in out else out.strip()


def _size_label(size_bytes: int) -> str:
    return f"{size_bytes // MiB} MiB" if size_bytes >= MiB else f"{size_bytes // KiB} KiB"


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="data path between two processes on loopback (GB/s = 10^9 B/s; "
                        "limit = the path's limit (socket, socket-spin or memcpy; for -auth/-tls "
                        "rows the path without security), same op and size, same run; phys = "
                        "ratio to socket or memcpy; µs per call)")
    for col in ("op", "size", "path", "variant", "conns", "GB/s", "limit GB/s", "ratio",
                "phys", "p50 µs", "p99 µs"):
        table.add_column(col, justify="left" if col in ("op", "path", "variant") else "right")
    order = [*PATHS, "mooncake"]
    for row in sorted(result["rows"], key=lambda r: (
            OPS.index(r["op"]), r["value_bytes"],
            order.index(r["variant"]) if r["variant"] in order else len(order))):
        op = row["op"] if row["batch_keys"] == 1 else f"{row['op']} ×{row['batch_keys']}"
        table.add_row(op, _size_label(row["value_bytes"]), row["path"], row["variant"],
                      str(row["connections"]), f"{row['gbps']:.2f}", f"{row['limit_gbps']:.2f}",
                      f"{row['ratio_to_limit']:.2f}",
                      f"{row.get('physical_ratio') or row['ratio_to_limit']:.2f}",
                      f"{row['p50_us']:.0f}",
                      f"{row['p99_us']:.0f}")
    console = Console(width=None if sys.stdout.isatty() else 140)
    console.print(table)
    console.print(f"git {result['git_sha']}, {result['machine']['platform']}, "
                  f"{result['machine']['cpus']} CPUs, redis-server "
                  f"{result['versions']['redis_server']}, tcp connections "
                  f"{result['settings']['tcp_connections']}, striping from "
                  f"{_size_label(result['settings']['stripe_threshold_bytes'])}")


def main(json_path: Path | None, quick: bool, mooncake: bool = True) -> None:
    """Run the benchmark, print its table, and write its JSON to ``json_path`` when given."""
    from kvstore.dataplane.transport.ucx import ucx_unavailable

    paths = tuple(p for p in PATHS if p != "redis" or Path(REDIS_BINARY).exists())
    ucx_reason = ucx_unavailable()
    if ucx_reason is not None:
        paths = tuple(p for p in paths if p not in UCX_PATHS)
        print(f"ucx skipped: {ucx_reason}", file=sys.stderr)
    result = run(quick, paths, mooncake=mooncake)
    if ucx_reason is not None:
        result["skipped"]["ucx"] = ucx_reason
    print_table(result)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--socket-peer"]:
        socket_peer(sys.argv[2:])
    else:
        main(Path(sys.argv[2]) if sys.argv[1:2] == ["--json"] else None,
             quick="--quick" in sys.argv)

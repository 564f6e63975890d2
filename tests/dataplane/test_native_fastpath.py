"""The native small-GET loop of the TCP server (``native/fastpath.c``, ``kvstore.dataplane.native``).

Each wire test runs the same raw byte script against two real servers over the same kind of
backend (a shared-memory DRAM tier with its read index, the daemon's ``CacheLeaseBackend``): one
with the native loop, one in Python only. Their answers must be byte-for-byte equal, and the
native one must show (through its hit counter) that the C loop served the hits. The library is
built when missing; the tests skip, saying why, only when no C compiler exists.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import xxhash

from kvstore.dataplane import native
from kvstore.dataplane.dram import DramTier
from kvstore.dataplane.read_index import lease_free_supported
from kvstore.dataplane.tier import TierKind
from kvstore.dataplane.transport.frames import HEADER, MAGIC, VERSION, Flags, Opcode, pack_header
from kvstore.dataplane.transport.tcp import TcpClient, TcpServer, TcpServerConfig
from kvstore.errors import ChunkNotFound
from kvstore.node.backend import CacheLeaseBackend
from kvstore.node.cache import TieredCache
from tests.support.native import built_library

KiB = 1 << 10

pytestmark = pytest.mark.skipif(not lease_free_supported(),
                                reason="the read index needs Linux on x86-64")


@pytest.fixture(scope="module")
def library() -> native._Library:
    """The native library, built when missing (skip only without a compiler)."""
    lib: native._Library = built_library()
    return lib


def value_of(key: bytes, size: int, version: int = 0) -> bytes:
    """A value derived from its key and a version (so a torn or foreign copy is detectable)."""
    head = version.to_bytes(8, "little") + len(key).to_bytes(1, "little") + key
    body = (head * (size // len(head) + 1))[:size]
    return body


@dataclass
class Stack:
    cache: TieredCache
    backend: CacheLeaseBackend
    server: TcpServer

    @property
    def port(self) -> int:
        return self.server.endpoint.port

    def close(self) -> None:
        self.server.close(0.5)
        self.cache.close()


def make_stack(*, use_native: bool, dram_bytes: int = 4 << 20, slots: int = 1024) -> Stack:
    cache = TieredCache({TierKind.DRAM: DramTier(dram_bytes, read_index_slots=slots)})
    backend = CacheLeaseBackend(cache)
    server = TcpServer(backend, TcpServerConfig(native_fast_path=use_native, io_timeout_s=2.0))
    server.start()
    return Stack(cache, backend, server)


STORED = {b"small": 4 * KiB, b"tiny": 1, b"edge": 64 * KiB, b"big": 64 * KiB + 1,
          b"k" * 64: 100}


@pytest.fixture
def stacks(library: native._Library) -> Iterator[tuple[Stack, Stack]]:
    fast, slow = make_stack(use_native=True), make_stack(use_native=False)
    assert fast.server.native_active and not slow.server.native_active
    for stack in (fast, slow):
        for key, size in STORED.items():
            stack.cache.put(key, value_of(key, size))
    yield fast, slow
    fast.close()
    slow.close()


def frame(opcode: int, key: bytes = b"", *, request_id: int = 1, flags: int = 0,
          total_size: int = 0, payload: bytes = b"", key_len: int | None = None,
          magic: bytes = MAGIC, status: int = 0, offset: int = 0, length: int = 0) -> bytes:
    return HEADER.pack(magic, VERSION, opcode, flags, status,
                       len(key) if key_len is None else key_len, 0, request_id, 0, offset,
                       length, total_size, len(payload)) + key + payload


def get(key: bytes, request_id: int, size: int, *, flags: int = 0) -> bytes:
    return frame(Opcode.GET, key, request_id=request_id, total_size=size, flags=flags)


def exchange(port: int, script: bytes, *, byte_by_byte: bool = False) -> bytes:
    """Send ``script``, end the sending side, and return every byte the server answered
    before it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        if byte_by_byte:
            for i in range(len(script)):
                sock.sendall(script[i:i + 1])
                if i % 16 == 0:
                    time.sleep(0.0005)
        else:
            sock.sendall(script)
        sock.shutdown(socket.SHUT_WR)
        chunks: list[bytes] = []
        while True:
            got = sock.recv(1 << 20)
            if not got:
                return b"".join(chunks)
            chunks.append(got)


def hit_answer(key: bytes, request_id: int) -> bytes:
    size = STORED[key]
    head = pack_header(bytearray(64), Opcode.GET, request_id=request_id, length=size,
                       total_size=size, payload_len=size)
    return bytes(head) + value_of(key, size)


def both(stacks: tuple[Stack, Stack], script: bytes, **kw: bool) -> bytes:
    fast, slow = stacks
    got_fast = exchange(fast.port, script, **kw)
    got_slow = exchange(slow.port, script, **kw)
    assert got_fast == got_slow
    return got_fast


def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# --- the hash and the lookup ---------------------------------------------------------------------


def test_c_xxh3_matches_the_python_module(library: native._Library) -> None:
    for n in (1, 3, 4, 8, 9, 16, 17, 32, 33, 63, 64, 128, 129, 240, 241, 1000):
        key = bytes((i * 37 + n) % 256 for i in range(n))
        assert library.xxh3_64(key, n) == xxhash.xxh3_64_intdigest(key), n


def test_c_lookup_reads_what_the_read_index_publishes(library: native._Library) -> None:
    tier = DramTier(1 << 20, read_index_slots=64)
    try:
        keys = [b"key-%d" % i for i in range(40)]  # enough to force probe chains in 64 slots
        for key in keys:
            tier.put(key, value_of(key, 300))
        source = native.NativeReadSource.attach(tier.arena_name, tier.read_index_name)
        cfg = source.config(copy_read_max_bytes=64 * KiB, max_value_bytes=1 << 30)
        st = (ctypes.c_int64 * 16)()
        out = bytearray(64 * KiB)
        dst = (ctypes.c_uint8 * len(out)).from_buffer(out)
        for key in keys:
            n = library.index_read(cfg, st, key, len(key), 300, ctypes.addressof(dst),
                                   len(out))
            assert n == 300 and bytes(out[:300]) == value_of(key, 300)
            assert library.index_read(cfg, st, key, len(key), 299,
                                      ctypes.addressof(dst), len(out)) == -2
        assert library.index_read(cfg, st, b"absent", 6, -1, ctypes.addressof(dst),
                                  len(out)) == -1
        tier.remove(keys[0])
        assert library.index_read(cfg, st, keys[0], len(keys[0]), -1,
                                  ctypes.addressof(dst), len(out)) == -1
        del dst
        source.close()
    finally:
        tier.close()


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch,
                                     library: native._Library) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert native.load() is None
    stack = make_stack(use_native=True)
    try:
        assert not stack.server.native_active
    finally:
        stack.close()


def test_a_library_older_than_its_source_is_not_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        library: native._Library) -> None:
    copy = tmp_path / native.LIBRARY_PATH.name
    copy.write_bytes(library.path.read_bytes())
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    assert native.load() is not None
    old = native.SOURCE_PATH.stat().st_mtime - 60
    os.utime(copy, (old, old))
    assert native.load() is None


def test_both_builds_load_from_another_directory(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path,
                                                 library: native._Library) -> None:
    """``KVTIER_NATIVE_DIR`` (an installed package, the image) holds both builds."""
    from tests.support.native import built_extension

    ext_source = native.extension_path()
    built_extension()
    monkeypatch.setenv(native.ENV_DIR, str(tmp_path))
    assert native.load() is None and native.load_extension() is None  # nothing there yet
    (tmp_path / native.LIBRARY_PATH.name).write_bytes(library.path.read_bytes())
    (tmp_path / native.EXTENSION_PATH.name).write_bytes(ext_source.read_bytes())
    lib = native.load()
    assert lib is not None and lib.path == tmp_path / native.LIBRARY_PATH.name
    ext = native.load_extension()
    assert ext is not None and ext.__file__ == str(tmp_path / native.EXTENSION_PATH.name)


# --- same answers as the Python loop -------------------------------------------------------------


def test_hits_are_byte_for_byte_and_served_natively(stacks: tuple[Stack, Stack]) -> None:
    fast, slow = stacks
    script = b"".join(get(k, i, STORED[k]) for i, k in enumerate(
        [b"small", b"tiny", b"edge", b"k" * 64, b"small"]))
    got = both(stacks, script)
    assert got == b"".join(hit_answer(k, i) for i, k in enumerate(
        [b"small", b"tiny", b"edge", b"k" * 64, b"small"]))
    assert fast.server.stats().native_gets == 5
    assert slow.server.stats().native_gets == 0
    wait_for(lambda: fast.backend.native_hits == 5)
    assert slow.backend.native_hits == 0
    # Eviction and metrics see the reads: the cache counted the same hits either way.
    for stack in stacks:
        dram = next(r for r in stack.cache.report() if r.kind is TierKind.DRAM)
        assert dram.counters.hits == 5
        assert stack.server.stats().requests["GET"] == 5


def test_any_size_hits_match(stacks: tuple[Stack, Stack]) -> None:
    script = get(b"small", 7, 0, flags=Flags.ANY_SIZE) + get(b"big", 8, 0, flags=Flags.ANY_SIZE)
    got = both(stacks, script)
    assert got.startswith(hit_answer(b"small", 7))
    assert stacks[0].server.stats().native_gets == 1  # "big" is over the copy limit: Python


def test_misses_size_mismatches_and_other_opcodes_match(stacks: tuple[Stack, Stack]) -> None:
    script = b"".join([
        get(b"small", 1, STORED[b"small"]),
        get(b"absent", 2, 4 * KiB),                    # miss
        get(b"small", 3, 4 * KiB + 1),                 # size mismatch
        get(b"big", 4, STORED[b"big"]),                # over the copy limit: lease path
        frame(Opcode.EXISTS, b"small", request_id=5),
        frame(Opcode.PUT, b"new", request_id=6, total_size=3, length=3, payload=b"abc"),
        get(b"new", 7, 3),
        frame(Opcode.GET, b"", request_id=8, total_size=1),  # empty key: BAD_REQUEST
        frame(Opcode.GET, b"small", request_id=9, total_size=4 * KiB, payload=b"xy"),
        frame(Opcode.PING, request_id=10),
        get(b"tiny", 11, 1),
    ])
    got = both(stacks, script)
    assert got.endswith(hit_answer(b"tiny", 11))
    assert stacks[0].server.stats().native_gets == 3  # small, new, tiny


def test_pipelined_mix_with_more_flags_matches(stacks: tuple[Stack, Stack]) -> None:
    more = int(Flags.MORE)
    parts = []
    for i in range(40):
        key = [b"small", b"absent", b"tiny", b"big"][i % 4]
        parts.append(get(key, 100 + i, STORED.get(key, 5), flags=more if i < 39 else 0))
    got = both(stacks, b"".join(parts))
    assert hit_answer(b"small", 100) in got
    assert stacks[0].server.stats().native_gets == 20


def test_partial_frames_arriving_a_byte_at_a_time_match(stacks: tuple[Stack, Stack]) -> None:
    script = b"".join([get(b"small", 1, STORED[b"small"]), get(b"absent", 2, 9),
                       get(b"k" * 64, 3, STORED[b"k" * 64])])
    got = both(stacks, script, byte_by_byte=True)
    assert got.startswith(hit_answer(b"small", 1))
    assert got.endswith(hit_answer(b"k" * 64, 3))
    assert stacks[0].server.stats().native_gets == 2


@pytest.mark.parametrize("bad", ["magic", "key_len", "status", "oversized"])
def test_bad_headers_match(stacks: tuple[Stack, Stack], bad: str) -> None:
    good = get(b"small", 1, STORED[b"small"])
    if bad == "magic":
        broken = frame(Opcode.GET, b"small", request_id=2, total_size=5, magic=b"XXXX")
    elif bad == "key_len":
        broken = frame(Opcode.GET, b"x" * 65, request_id=2, total_size=5)
    elif bad == "status":
        broken = frame(Opcode.GET, b"small", request_id=2, total_size=5, status=1)
    else:
        broken = frame(Opcode.GET, b"small", request_id=2, total_size=1 << 40)
    got = both(stacks, good + broken + good)
    assert got.startswith(hit_answer(b"small", 1))
    assert len(got) > len(hit_answer(b"small", 1))  # a PROTOCOL answer, then the close
    for stack in stacks:
        wait_for(lambda s=stack: s.server.stats().protocol_errors == 1)  # type: ignore[misc]


def test_client_vanishing_mid_request(stacks: tuple[Stack, Stack]) -> None:
    for stack in stacks:
        with socket.create_connection(("127.0.0.1", stack.port)) as sock:
            sock.sendall(get(b"small", 1, STORED[b"small"]) + get(b"small", 2, 4 * KiB)[:40])
            want = hit_answer(b"small", 1)
            got = b""
            while len(got) < len(want):
                got += sock.recv(1 << 16)
            assert got == want
        wait_for(lambda s=stack: s.server.stats().connections_open == 0)  # type: ignore[misc]
        # The server still serves others.
        with TcpClient("127.0.0.1", stack.port, connections=1) as client:
            assert bytes(client.get(b"small")) == value_of(b"small", STORED[b"small"])


def test_removed_and_overwritten_chunks_are_never_served_stale(
        stacks: tuple[Stack, Stack]) -> None:
    fast, _slow = stacks
    with TcpClient("127.0.0.1", fast.port, connections=1) as client:
        buf = bytearray(STORED[b"small"])
        assert client.get_into(b"small", buf) == len(buf)
        fast.cache.remove(b"small")
        with pytest.raises(ChunkNotFound):
            client.get_into(b"small", buf)
        fast.cache.put(b"small", value_of(b"small", len(buf), version=9))
        client.get_into(b"small", buf)
        assert bytes(buf) == value_of(b"small", len(buf), version=9)
    assert fast.server.stats().native_gets == 2
    # The first hit's accounting may land after the remove: record_reads skips a key gone.
    wait_for(lambda: fast.backend.native_hits >= 1)


def test_shutdown_ends_an_idle_native_connection(library: native._Library) -> None:
    stack = make_stack(use_native=True)
    stack.cache.put(b"small", value_of(b"small", 4 * KiB))
    sock = socket.create_connection(("127.0.0.1", stack.port))
    try:
        sock.sendall(get(b"small", 1, 4 * KiB))
        want = hit_answer(b"small", 1)
        got = b""
        while len(got) < len(want):
            got += sock.recv(1 << 16)
        t0 = time.monotonic()
        stack.close()
        assert time.monotonic() - t0 < 2.0  # the idle tick lets the loop see the shutdown
        assert sock.recv(16) == b""
    finally:
        sock.close()


# --- concurrent writers, a reader in another process --------------------------------------------

_READER = r"""
import sys, time
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.errors import ChunkNotFound, SizeMismatch
port, seconds, size = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
keys = [b"race-%d" % i for i in range(8)]
def ok(key, data):
    head_len = 9 + len(key)
    head = data[:head_len]
    if head[8] != len(key) or head[9:] != key:
        return False
    return data == (head * (size // head_len + 1))[:size]
hits = misses = torn = 0
buf = bytearray(size)
with TcpClient("127.0.0.1", port, connections=1) as client:
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        key = keys[i % len(keys)]
        i += 1
        try:
            client.get_into(key, buf)
        except (ChunkNotFound, SizeMismatch):
            misses += 1
            continue
        if ok(key, bytes(buf)):
            hits += 1
        else:
            torn += 1
print(hits, misses, torn)
"""


def test_concurrent_remove_and_overwrite_never_tear(library: native._Library) -> None:
    size = 16 * KiB
    # A small arena: removed extents are reused at once by the next key's put.
    stack = make_stack(use_native=True, dram_bytes=12 * size, slots=64)
    keys = [b"race-%d" % i for i in range(8)]
    for key in keys:
        stack.cache.put(key, value_of(key, size))
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        version = 1
        while not stop.is_set():
            for key in keys:
                with contextlib.suppress(ChunkNotFound):
                    stack.cache.remove(key)
                stack.cache.put(key, value_of(key, size, version))
                version += 1
                writes[0] += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        env = dict(os.environ)
        done = subprocess.run([sys.executable, "-c", _READER, str(stack.port), "2.0", str(size)],
                              capture_output=True, text=True, timeout=60, env=env, check=False)
    finally:
        stop.set()
        thread.join(10)
        stack.close()
    assert done.returncode == 0, done.stderr
    hits, _misses, torn = map(int, done.stdout.split())
    assert torn == 0
    assert hits > 0 and writes[0] > 0
    assert stack.server.stats().native_gets > 0  # the C loop took part in the race

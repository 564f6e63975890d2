"""The native extension's client calls (``native/pyfast.c``): ``tcp_get`` and ``IndexReader``.

``tcp_get`` runs against the real TCP servers (native loop and Python) and against scripted raw
socket peers that answer in pieces, with refusals, with a wrong request id, close mid-answer, or
never answer. Every case that is not a plain OK answer must come back to Python (a negative
count of the bytes received), and ``TcpClient`` must then raise what it raises without the
extension. The extension is built when missing; tests skip only without a compiler or Python.h.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from types import ModuleType

import numpy as np
import pytest
import xxhash

from kvstore.dataplane import native
from kvstore.dataplane.read_index import NOT_TRIED, lease_free_supported
from kvstore.dataplane.transport.frames import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    VERSION,
    Opcode,
    Status,
    decode_header,
)
from kvstore.dataplane.transport.tcp import TcpClient
from kvstore.errors import ChunkNotFound, PeerUnavailable, ProtocolError, SizeMismatch
from tests.dataplane.test_native_fastpath import Stack, make_stack, value_of
from tests.support.native import built_extension

KiB = 1 << 10

pytestmark = pytest.mark.skipif(not lease_free_supported(),
                                reason="the native fast path is built for Linux on x86-64")


@pytest.fixture(scope="module")
def ext() -> ModuleType:
    module: ModuleType = built_extension()
    return module


def template() -> bytearray:
    return bytearray(HEADER.pack(MAGIC, VERSION, Opcode.GET, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))


def answer(request_id: int, payload: bytes, *, status: int = 0, total: int | None = None,
           opcode: int = Opcode.GET) -> bytes:
    size = len(payload) if total is None else total
    return HEADER.pack(MAGIC, VERSION, opcode, 0, status, 0, 0, request_id, 0, 0,
                       size if status == 0 else 0, size, len(payload)) + payload


@contextlib.contextmanager
def scripted_peer(script: Callable[[socket.socket, int, bytes], None]
                  ) -> Iterator[socket.socket]:
    """A raw peer on loopback: reads one GET request, hands (conn, request id, key) to
    ``script``; yields the client's connected socket."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            head = conn.recv(HEADER_BYTES, socket.MSG_WAITALL)
            if len(head) < HEADER_BYTES:
                return  # the client sent nothing (a call refused before it sent)
            fields = HEADER.unpack(head)
            key = conn.recv(fields[5], socket.MSG_WAITALL)
            script(conn, fields[7], key)
            done.wait(10)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = socket.create_connection(listener.getsockname())
    try:
        yield client
    finally:
        done.set()
        client.close()
        thread.join(10)
        listener.close()


def call(ext: ModuleType, sock: socket.socket, key: bytes, dst: memoryview, *,
         request_id: int = 7, spin_ns: int = 0, timeout_ms: int = 5000,
         header: bytearray | None = None) -> int:
    n: int = ext.tcp_get(sock.fileno(), request_id, key, dst, template(),
                         header if header is not None else bytearray(HEADER_BYTES), spin_ns,
                         timeout_ms)
    return n


# --- tcp_get against the real servers --------------------------------------------------------


@pytest.fixture(params=["native-loop", "python-loop"])
def server(request: pytest.FixtureRequest) -> Iterator[Stack]:
    if request.param == "native-loop":
        from tests.support.native import built_library

        built_library()
    stack = make_stack(use_native=request.param == "native-loop")
    for key, size in {b"a": 1, b"b": 4 * KiB, b"c": 64 * KiB, b"d": 64 * KiB + 1,
                      b"k" * 64: 100, b"e": 1 << 20}.items():
        stack.cache.put(key, value_of(key, size))
    yield stack
    stack.close()


@pytest.mark.parametrize("spin_ns", [0, 200_000])
def test_plain_gets_finish_in_c_with_the_right_bytes(ext: ModuleType, server: Stack,
                                                      spin_ns: int) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for i, (key, size) in enumerate([(b"a", 1), (b"b", 4 * KiB), (b"c", 64 * KiB),
                                         (b"d", 64 * KiB + 1), (b"k" * 64, 100),
                                         (b"e", 1 << 20)]):
            dst = bytearray(size)
            assert call(ext, sock, key, memoryview(dst), request_id=i + 1,
                        spin_ns=spin_ns) == size
            assert dst == value_of(key, size), key


def test_a_refusal_comes_back_with_its_header(ext: ModuleType, server: Stack) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        header = bytearray(HEADER_BYTES)
        dst = bytearray(b"\xee" * 100)
        got = call(ext, sock, b"nope", memoryview(dst), header=header)
        assert got < 0 and -1 - got >= HEADER_BYTES
        assert decode_header(header, 1 << 30).status is Status.NOT_FOUND
        header = bytearray(HEADER_BYTES)
        got = call(ext, sock, b"b", memoryview(dst), request_id=8, header=header)
        assert got < 0 and decode_header(header, 1 << 30).status is Status.SIZE_MISMATCH
        assert dst == b"\xee" * 100  # refusals without detail leave the buffer alone


@pytest.mark.parametrize("extension", ["extension", "python"])
def test_tcp_client_results_match_with_and_without_the_extension(
        ext: ModuleType, server: Stack, extension: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if extension == "python":
        monkeypatch.setenv(native.ENV_SWITCH, "0")
    client = TcpClient("127.0.0.1", server.port, connections=1)
    try:
        out = np.empty(4 * KiB, np.uint8)
        assert client.get_into(b"b", out) == 4 * KiB
        assert out.tobytes() == value_of(b"b", 4 * KiB)
        with pytest.raises(ChunkNotFound):
            client.get_into(b"nope", out)
        with pytest.raises(SizeMismatch):
            client.get_into(b"c", out)
        assert client.get_into(b"c", np.empty(64 * KiB, np.uint8)) == 64 * KiB  # still in step
    finally:
        client.close()


# --- tcp_get against scripted peers ----------------------------------------------------------


def test_an_answer_in_pieces_is_assembled(ext: ModuleType) -> None:
    payload = bytes(range(256)) * 16

    def script(conn: socket.socket, request_id: int, key: bytes) -> None:
        data = answer(request_id, payload)
        for cut in (0, 10, 63, 64, 65, 1000, len(data)):
            conn.sendall(data[:cut])
            data = data[cut:]
            time.sleep(0.01)

    with scripted_peer(script) as sock:
        dst = bytearray(len(payload))
        assert call(ext, sock, b"key", memoryview(dst), spin_ns=1_000_000) == len(payload)
        assert dst == payload


@pytest.mark.parametrize("bad", ["request-id", "opcode", "short-payload-header"])
def test_an_answer_that_is_not_a_plain_ok_goes_back_to_python(ext: ModuleType, bad: str) -> None:
    payload = b"x" * 100

    def script(conn: socket.socket, request_id: int, key: bytes) -> None:
        if bad == "request-id":
            conn.sendall(answer(request_id + 1, payload))
        elif bad == "opcode":
            conn.sendall(answer(request_id, payload, opcode=Opcode.PUT))
        else:
            conn.sendall(answer(request_id, payload[:50], total=100))

    with scripted_peer(script) as sock:
        header = bytearray(HEADER_BYTES)
        got = call(ext, sock, b"key", memoryview(bytearray(100)), header=header)
        assert got < 0 and -1 - got >= HEADER_BYTES


def test_a_peer_that_closes_mid_answer_returns_what_came(ext: ModuleType) -> None:
    def script(conn: socket.socket, request_id: int, key: bytes) -> None:
        conn.sendall(answer(request_id, b"y" * 1000)[:HEADER_BYTES + 300])
        conn.shutdown(socket.SHUT_WR)

    with scripted_peer(script) as sock:
        assert call(ext, sock, b"key", memoryview(bytearray(1000))) == -1 - (HEADER_BYTES + 300)


def test_a_silent_peer_times_out(ext: ModuleType) -> None:
    with scripted_peer(lambda conn, rid, key: None) as sock:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            call(ext, sock, b"key", memoryview(bytearray(10)), spin_ns=1_000_000, timeout_ms=200)
        assert time.monotonic() - t0 >= 0.15


@pytest.mark.parametrize("spin_ns", [0, 1_000_000])
def test_a_blocking_socket_times_out_by_its_kernel_timeout(ext: ModuleType, spin_ns: int) -> None:
    """timeout_ms=-1 (TcpClient's sockets): after any spin the receive itself sleeps, and the
    socket's SO_RCVTIMEO ends it."""
    with scripted_peer(lambda conn, rid, key: None) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 200_000))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            call(ext, sock, b"key", memoryview(bytearray(10)), spin_ns=spin_ns, timeout_ms=-1)
        assert time.monotonic() - t0 >= 0.15


def test_tcp_client_maps_every_failure_like_the_python_path(
        ext: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``TcpClient`` (which uses the extension): a wrong request id is a protocol
    error, a close mid-answer a PeerUnavailable; both drop the connection."""
    for script, error in [
            (lambda c, rid, k: c.sendall(answer(rid + 5, b"z" * 10)), ProtocolError),
            (lambda c, rid, k: (c.sendall(answer(rid, b"z" * 10)[:HEADER_BYTES + 3]),
                                c.shutdown(socket.SHUT_WR)), PeerUnavailable)]:
        listener = socket.create_server(("127.0.0.1", 0))

        def serve(script: Callable[..., object] = script,
                  listener: socket.socket = listener) -> None:
            conn, _ = listener.accept()
            with conn:
                fields = HEADER.unpack(conn.recv(HEADER_BYTES, socket.MSG_WAITALL))
                conn.recv(fields[5], socket.MSG_WAITALL)
                script(conn, fields[7], b"")
                conn.recv(1)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        client = TcpClient("127.0.0.1", listener.getsockname()[1], connections=1,
                           io_timeout_s=5)
        try:
            with pytest.raises(error):
                client.get_into(b"key", bytearray(10))
        finally:
            client.close()
            thread.join(10)
            listener.close()


def test_bad_arguments_are_refused(ext: ModuleType) -> None:
    with scripted_peer(lambda conn, rid, key: None) as sock:
        with pytest.raises(ValueError):
            call(ext, sock, b"k" * 256, memoryview(bytearray(10)))
        with pytest.raises(ValueError):
            ext.tcp_get(sock.fileno(), 1, b"k", bytearray(10), bytearray(10),
                        bytearray(HEADER_BYTES), 0, 100)
        with pytest.raises(BufferError):
            call(ext, sock, b"k", memoryview(b"read-only"))
    assert ext.xxh3_64(b"kvtier") == xxhash.xxh3_64_intdigest(b"kvtier")


# --- IndexReader ---------------------------------------------------------------------------


def test_index_reader_counts_and_reports_reads(ext: ModuleType) -> None:
    from tests.dataplane.test_read_index import Pair

    pair = Pair()
    try:
        pair.tier.put(b"hot", b"h" * 4 * KiB)
        pair.reader.use_extension(ext)
        queue: list[bytes] = []
        woken: list[int] = []
        pair.reader.report_reads_to(queue, 3, lambda: woken.append(len(queue)))
        fast = pair.reader.fast_get
        assert fast is not None
        out = bytearray(4 * KiB)
        for _ in range(4):
            assert fast(b"hot", out) == 4 * KiB and out == b"h" * 4 * KiB
        assert fast(b"cold", out) == -1
        assert fast(b"hot", bytearray(10)) == -2  # wrong size: a conflict, nothing copied
        assert queue == [b"hot"] * 4 and woken == [3]
        assert pair.reader.native_counters() == (4, 1, 1)
        # Not tried: the caller's path decides (a key that is not bytes, a read-only buffer).
        assert fast(bytearray(b"hot"), out) == NOT_TRIED
        assert fast(b"hot", b"r" * 4 * KiB) == NOT_TRIED
        # A test hook on the copy turns the native reads off.
        pair.reader.before_copy = lambda: None
        assert pair.reader.fast_get is None
        pair.reader.before_copy = None
        assert pair.reader.fast_get is not None
    finally:
        pair.close()
    assert fast(b"hot", out) == -1  # a closed reader misses, its mappings stay valid


def test_spin_settings_validate_and_a_spinning_client_gets_the_same_bytes(
        ext: ModuleType, server: Stack) -> None:
    from kvstore.client import StoreClientConfig
    from kvstore.dataplane.transport.tcp import TcpClientConfig
    from kvstore.errors import InvalidArgument

    for bad in (-1, 10_001):
        with pytest.raises(InvalidArgument):
            TcpClientConfig(spin_us=bad)
        with pytest.raises(InvalidArgument):
            StoreClientConfig(tcp_spin_us=bad)
    client = TcpClient("127.0.0.1", server.port, connections=1, spin_us=200)
    try:
        for key, size in [(b"b", 4 * KiB), (b"c", 64 * KiB), (b"e", 1 << 20)]:
            out = bytearray(size)
            assert client.get_into(key, out) == size and out == value_of(key, size)
        with pytest.raises(ChunkNotFound):
            client.get_into(b"nope", bytearray(3))
    finally:
        client.close()

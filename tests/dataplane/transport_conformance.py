"""The conformance suite every data-plane transport runs (TCP, UCX, shared memory).

In the spirit of ``trio/testing/_check_streams.py``: one set of tests written against the
contract in ``kvstore/dataplane/transport/base.py`` (when the two disagree, the contract wins),
run against each real implementation over a real server process. A transport's test module
subclasses :class:`TransportConformance` (or :class:`BatchTransportConformance`,
:class:`MappedTransportConformance` for the richer contracts) and provides a ``harness``
fixture: a :class:`TransportHarness` that makes clients of a shared server, private servers to
kill or freeze, and the raw misbehaviour only that transport's wire can express::

    class TestTcpConformance(BatchTransportConformance):
        @pytest.fixture
        def harness(self, tcp_harness: TcpHarness) -> TransportHarness:
            return tcp_harness

What it checks: round trips of every size class (inline, leased, striped), buffer ownership
(``src`` read and ``dst`` written only during the call, ``get`` returns the caller's buffer,
refusals leave ``dst`` untouched, a lease's view ends with the lease), per-call refusals (unknown
key, wrong size, existing key, bad input, a value over the client's or the server's limit) and
per-key outcomes in batches, a dead server and a frozen one (``PeerUnavailable`` within a bounded
time, no hang), a writer and a reader that die mid-transfer (nothing visible, nothing pinned),
malformed and oversized frames (the server drops that connection and keeps serving), threads
sharing one client, and closing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvstore.dataplane.transport.base import BatchTransport, MappedTransport, Transport
from kvstore.errors import (
    ChunkBusy,
    ChunkExists,
    ChunkNotFound,
    InvalidArgument,
    KvtierError,
    PeerUnavailable,
    SizeMismatch,
)
from tests.support.common import all_threads_stopped, payload, wait_until

KiB, MiB = 1 << 10, 1 << 20
BOUND_S = 10.0
"""How long a call against a dead or frozen server may take at most (the clients under test
use timeouts of about a second)."""


class PrivateServer:
    """A server process of one test's own (to kill or freeze). Subclassed per transport."""

    def client(self, **options: Any) -> Transport:
        """A client of this server; ``io_timeout_s`` and ``max_value_bytes`` are understood by
        every transport."""
        raise NotImplementedError

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone."""
        raise NotImplementedError

    @property
    def pid(self) -> int:
        """The server's process id."""
        raise NotImplementedError

    def freeze(self) -> None:
        """SIGSTOP, and wait until every thread of it is stopped."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: all_threads_stopped(self.pid), what="SIGSTOP to take hold")

    def thaw(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop it (gracefully when still alive); idempotent."""
        raise NotImplementedError


class ChildServer(PrivateServer):
    """A private server held as ``self.server``: a child process wrapper with ``proc``,
    ``alive()`` and ``stop()`` (the TCP and UCX test servers)."""

    server: Any

    def kill(self) -> None:
        self.server.proc.kill()
        self.server.proc.wait(10)

    @property
    def pid(self) -> int:
        return self.server.proc.pid

    def stop(self) -> None:
        if self.server.alive():
            self.thaw()
        self.server.stop()


class TransportHarness:
    """What a transport's test module provides to the suite. Subclassed per transport."""

    name = "transport"
    io_timeout_s = 1.0
    """The timeout the suite gives clients of frozen or dead servers."""
    stalled_reader_keeps_its_lease = True
    """Whether a reader that stops mid-get holds its read lease until it dies (False for a
    server that drops such a reader after its own timeout, as UCX's does)."""

    def client(self, **options: Any) -> Transport:
        """A fresh client of the shared server (room for at least 128 MiB of values)."""
        raise NotImplementedError

    def private_server(self, *, limit_bytes: int = 0) -> PrivateServer:
        """A server of its own; ``limit_bytes``: the largest value it accepts (0: as the
        shared one)."""
        raise NotImplementedError

    def partial_put(self, key: bytes, total_bytes: int) -> subprocess.Popen[str]:
        """A writer process that began a put of ``total_bytes`` under ``key``, sent part of it
        and printed READY; it then waits to be killed."""
        raise NotImplementedError

    def partial_get(self, key: bytes, total_bytes: int) -> subprocess.Popen[str]:
        """A reader process that began a get of ``key`` (``total_bytes``), holds the transfer
        and printed READY; it then waits to be killed."""
        raise NotImplementedError

    def send_garbage(self) -> None:
        """Send a malformed request on a raw connection; return once the server has refused
        it (answered, dropped or closed, as that transport does)."""
        raise NotImplementedError

    def send_oversized(self) -> None:
        """Send a request announcing more than the server accepts; return once refused."""
        raise NotImplementedError


def _removed(client: Transport, key: bytes) -> bool:
    try:
        return client.remove(key)
    except ChunkBusy:  # a read lease ends just after its last byte left (base.py, "Ordering")
        return False


def _remove(client: Transport, key: bytes) -> None:
    wait_until(lambda: _removed(client, key), timeout_s=10, what=f"remove of {key!r}")


def _writable(client: Transport, key: bytes, data: bytes) -> bool:
    assert not client.exists(key), "a partial write became visible"
    try:
        client.put(key, data)
    except ChunkBusy:
        return False
    return True


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == "READY", f"the helper process said {line!r}"


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(10)


class TransportConformance:
    """Contract tests for any :class:`Transport`. Subclasses provide the ``harness`` fixture."""

    @pytest.fixture
    def harness(self) -> TransportHarness:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def client(self, harness: TransportHarness) -> Iterator[Transport]:
        c = harness.client()
        yield c
        c.close()

    @pytest.fixture
    def key(self, request: pytest.FixtureRequest) -> bytes:
        """A key unique to the test (tests share one server), with room for a suffix."""
        return request.node.name.encode()[-56:]

    @pytest.fixture
    def private(self, harness: TransportHarness) -> Iterator[PrivateServer]:
        srv = harness.private_server()
        yield srv
        srv.stop()

    # --- round trips --------------------------------------------------------------------------

    def test_is_a_transport(self, client: Transport) -> None:
        assert isinstance(client, Transport)

    @pytest.mark.parametrize("size_bytes", [1, 4 * KiB, 64 * KiB + 1, MiB, 9 * MiB])
    def test_round_trip_returns_the_same_bytes(self, client: Transport, key: bytes,
                                               size_bytes: int) -> None:
        data = payload(size_bytes, size_bytes)
        client.put(key, data)
        assert client.exists(key)
        assert client.size_of(key) == size_bytes
        dst = bytearray(size_bytes)
        assert client.get_into(key, dst) == size_bytes
        assert dst == data
        assert client.get(key) == data
        _remove(client, key)
        assert not client.exists(key)

    def test_an_empty_value_is_stored_or_refused_per_call(self, client: Transport,
                                                           key: bytes) -> None:
        try:
            client.put(key, b"")
        except InvalidArgument:  # the backend's decision (base.py): a per-call refusal
            assert not client.exists(key)
        else:
            assert client.size_of(key) == 0
            assert client.get_into(key, bytearray()) == 0
            assert client.get(key) == b""
        client.put(key + b"-after", b"x")  # the client stays usable either way
        assert client.get(key + b"-after") == b"x"

    def test_numpy_and_torch_buffers_move_without_conversion(self, client: Transport,
                                                              key: bytes) -> None:
        torch = pytest.importorskip("torch")
        src = np.arange(3000, dtype=np.float16).reshape(100, 30)
        client.put(key, src)
        dst = torch.empty(100, 30, dtype=torch.float16)
        assert client.get_into(key, dst) == src.nbytes
        assert np.array_equal(dst.numpy(), src)
        tensor = torch.arange(128 * KiB, dtype=torch.float16)
        client.put(key + b"-t", tensor)
        arr = np.zeros(tensor.numel(), dtype=np.float16)
        client.get_into(key + b"-t", arr)
        assert np.array_equal(arr, tensor.numpy())

    # --- buffer ownership ---------------------------------------------------------------------

    @pytest.mark.parametrize("size_bytes", [64 * KiB, 2 * MiB])
    def test_src_is_read_only_during_the_put(self, client: Transport, key: bytes,
                                             size_bytes: int) -> None:
        data = payload(size_bytes, 7)
        src = bytearray(data)
        client.put(key, src)
        src[:] = bytes(size_bytes)  # the caller owns src again: the stored value is unaffected
        assert client.get(key) == data

    @pytest.mark.parametrize("size_bytes", [64 * KiB, 9 * MiB])
    def test_dst_is_written_only_during_the_get(self, client: Transport, key: bytes,
                                                size_bytes: int) -> None:
        data = payload(size_bytes, 8)
        client.put(key, data)
        dst = bytearray(size_bytes)
        client.get_into(key, dst)
        _remove(client, key)
        client.put(key, payload(size_bytes, 9))  # the key now holds other bytes
        time.sleep(0.2)  # nothing the transport started may still land in dst
        assert dst == data

    def test_get_returns_a_buffer_the_caller_owns(self, client: Transport, key: bytes) -> None:
        data = payload(100 * KiB, 10)
        client.put(key, data)
        first, second = client.get(key), client.get(key)
        first[0] ^= 0xFF
        assert second == data and client.get(key) == data

    @pytest.mark.parametrize("size_bytes", [100, 2 * MiB, 9 * MiB])
    def test_refusals_leave_dst_untouched(self, client: Transport, key: bytes,
                                          size_bytes: int) -> None:
        client.put(key, payload(size_bytes, 11))
        for wrong in (size_bytes - 1, size_bytes + 1):
            dst = bytearray(b"\xee" * wrong)
            with pytest.raises(SizeMismatch) as info:
                client.get_into(key, dst)
            assert (info.value.expected, info.value.actual) == (size_bytes, wrong)
            assert dst == b"\xee" * wrong
        dst = bytearray(b"\xee" * size_bytes)
        with pytest.raises(ChunkNotFound):
            client.get_into(key + b"-missing", dst)
        assert dst == b"\xee" * size_bytes
        assert client.size_of(key) == size_bytes  # still in step

    # --- per-call refusals --------------------------------------------------------------------

    def test_unknown_key_is_chunk_not_found_and_misses_are_not_errors(
            self, client: Transport, key: bytes) -> None:
        missing = key + b"-never"
        with pytest.raises(ChunkNotFound):
            client.get(missing)
        with pytest.raises(ChunkNotFound):
            client.get_into(missing, bytearray(10))
        assert client.exists(missing) is False
        assert client.size_of(missing) is None
        assert client.remove(missing) is False
        client.put(key, b"still works")  # refusals leave the client usable
        assert client.get(key) == b"still works"

    @pytest.mark.parametrize("size_bytes", [10, 3 * MiB])
    def test_put_of_an_existing_key_is_chunk_exists_and_keeps_the_first_value(
            self, client: Transport, key: bytes, size_bytes: int) -> None:
        client.put(key, payload(size_bytes, 1))
        with pytest.raises(ChunkExists):
            client.put(key, payload(size_bytes, 2))
        assert client.get(key) == payload(size_bytes, 1)

    def test_bad_input_is_refused_before_anything_is_sent(self, harness: TransportHarness,
                                                           key: bytes) -> None:
        c = harness.client(max_value_bytes=MiB)
        try:
            with pytest.raises(InvalidArgument):
                c.put(b"", b"x")
            with pytest.raises(InvalidArgument):
                c.put(b"k" * 65, b"x")
            with pytest.raises(InvalidArgument):
                c.put(key, "text")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="max_value_bytes"):
                c.put(key, bytes(MiB + 1))
            assert not c.exists(key)
            c.put(key, bytes(MiB))  # exactly the limit is fine
            with pytest.raises(InvalidArgument):
                c.get_into(key, bytes(MiB))  # read-only destination
            with pytest.raises(InvalidArgument):
                c.get_into(key, np.empty(2 * MiB, np.uint8)[::2])  # not contiguous
            with pytest.raises(InvalidArgument):
                c.get_into(b"", bytearray(1))
        finally:
            c.close()

    def test_a_value_over_the_servers_limit_is_refused_and_the_client_recovers(
            self, harness: TransportHarness, key: bytes) -> None:
        srv = harness.private_server(limit_bytes=2 * MiB)
        try:
            c = srv.client(max_value_bytes=64 * MiB)  # the client would allow it
            try:
                with pytest.raises(KvtierError):  # refused by the server, per call or frame
                    c.put(key, bytes(8 * MiB))
                assert not c.exists(key)
                c.put(key, payload(MiB, 12))
                assert c.get(key) == payload(MiB, 12)
            finally:
                c.close()
        finally:
            srv.stop()

    def test_a_closed_client_raises_peer_unavailable(self, harness: TransportHarness,
                                                      key: bytes) -> None:
        c = harness.client()
        c.put(key, b"v")
        c.close()
        c.close()  # idempotent
        with pytest.raises(PeerUnavailable):
            c.get(key)
        with pytest.raises(PeerUnavailable):
            c.put(key + b"-2", b"v")

    # --- dead and frozen peers ----------------------------------------------------------------

    def test_a_dead_server_is_peer_unavailable_without_a_hang(
            self, harness: TransportHarness, private: PrivateServer) -> None:
        c = private.client(io_timeout_s=harness.io_timeout_s)
        try:
            c.put(b"small", payload(4 * KiB, 1))
            c.put(b"large", payload(MiB, 2))
            private.kill()
            started = time.monotonic()
            with pytest.raises(PeerUnavailable):
                c.get_into(b"small", bytearray(4 * KiB))
            with pytest.raises(PeerUnavailable):
                c.get_into(b"large", bytearray(MiB))
            with pytest.raises(PeerUnavailable):
                c.put(b"after", payload(10 * MiB, 3))
            with pytest.raises(PeerUnavailable):
                c.size_of(b"small")
            assert time.monotonic() - started < BOUND_S
        finally:
            c.close()

    def test_a_frozen_server_times_out_as_peer_unavailable(
            self, harness: TransportHarness, private: PrivateServer) -> None:
        c = private.client(io_timeout_s=harness.io_timeout_s)
        try:
            c.put(b"k", b"v")
            private.freeze()
            try:
                started = time.monotonic()
                with pytest.raises(PeerUnavailable, match="timed out"):
                    c.put(b"during", b"x")
                with pytest.raises(PeerUnavailable, match="timed out"):
                    c.size_of(b"k")
                assert time.monotonic() - started < BOUND_S
            finally:
                private.thaw()
            wait_until(lambda: c.size_of(b"k") == 1, timeout_s=BOUND_S,
                       what="the client to recover on a fresh connection")
            assert c.get(b"k") == b"v"
        finally:
            c.close()

    # --- peers dying mid-transfer -------------------------------------------------------------

    def test_a_writer_killed_mid_put_leaves_nothing_and_the_key_writable(
            self, harness: TransportHarness, client: Transport, key: bytes) -> None:
        total = 16 * MiB
        writer = harness.partial_put(key, total)
        try:
            _ready(writer)
            assert not client.exists(key)
            with pytest.raises(ChunkBusy):  # the half-written lease is still held...
                client.put(key, b"x")
            _kill(writer)
            # ...and ended when the server sees the writer go (or its transfer time out)
            wait_until(lambda: _writable(client, key, payload(total, 4)), timeout_s=15,
                       what="the killed writer's lease to be aborted")
            assert client.get(key) == payload(total, 4)
        finally:
            _kill(writer)

    def test_a_reader_gone_mid_get_releases_its_lease(
            self, harness: TransportHarness, client: Transport, key: bytes) -> None:
        total = 32 * MiB
        client.put(key, payload(total, 5))
        reader = harness.partial_get(key, total)
        try:
            _ready(reader)
            if harness.stalled_reader_keeps_its_lease:
                with pytest.raises(ChunkBusy):  # the read is in progress: still leased
                    client.remove(key)
            _kill(reader)
            wait_until(lambda: _removed(client, key), timeout_s=15,
                       what="the dead reader's lease to be released")
            assert not client.exists(key)
        finally:
            _kill(reader)

    # --- malformed frames ---------------------------------------------------------------------

    def test_garbage_and_oversized_frames_leave_the_server_serving(
            self, harness: TransportHarness, client: Transport, key: bytes) -> None:
        client.put(key, b"before")
        harness.send_garbage()
        harness.send_oversized()
        assert client.get(key) == b"before"  # other connections are untouched
        fresh = harness.client()
        try:
            fresh.put(key + b"-after", b"after")
            assert fresh.get(key + b"-after") == b"after"
        finally:
            fresh.close()

    # --- concurrency --------------------------------------------------------------------------

    def test_threads_share_one_client(self, client: Transport, key: bytes) -> None:
        errors: list[BaseException] = []
        sizes = [1, 4 * KiB, 100 * KiB, 3 * MiB + 1]

        def worker(t: int) -> None:
            try:
                for i in range(8):
                    k = key[:48] + b"-%d-%d" % (t, i)
                    data = payload(sizes[i % len(sizes)], t * 100 + i)
                    client.put(k, data)
                    dst = bytearray(len(data))
                    client.get_into(k, dst)
                    assert dst == data, k
                    _remove(client, k)
            except BaseException as exc:  # collected and re-raised by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors


class BatchTransportConformance(TransportConformance):
    """Contract tests for a :class:`BatchTransport`: per-key outcomes in batches."""

    def test_is_a_batch_transport(self, client: Transport) -> None:
        assert isinstance(client, BatchTransport)

    def test_batches_report_misses_and_existing_keys_per_key(self, client: Transport,
                                                             key: bytes) -> None:
        assert isinstance(client, BatchTransport)
        sizes = [1, 4 * KiB, 64 * KiB + 1, 300 * KiB] * 10 + [9 * MiB]
        keys = [key[:48] + b"-%d" % i for i in range(len(sizes))]
        values = [payload(n, i) for i, n in enumerate(sizes)]
        client.put(keys[7], values[7])
        assert client.put_many(keys, values) == [i != 7 for i in range(len(keys))]
        dsts = [bytearray(n) for n in sizes]
        assert client.get_many_into([*keys, key + b"-missing"], [*dsts, bytearray(5)]) == \
            [*sizes, None]
        assert dsts == values
        with pytest.raises(SizeMismatch):
            client.get_many_into([keys[0], keys[1]], [bytearray(1), bytearray(5)])
        assert client.get(keys[1]) == values[1]  # still in step after the refused batch
        with pytest.raises(InvalidArgument):
            client.get_many_into(keys[:2], dsts[:1])
        with pytest.raises(InvalidArgument):
            client.put_many(keys[:2], values[:1])
        assert client.get_many_into([], []) == []


class MappedTransportConformance(BatchTransportConformance):
    """Contract tests for a :class:`MappedTransport`: leases lent to the caller."""

    def test_is_a_mapped_transport(self, client: Transport) -> None:
        assert isinstance(client, MappedTransport)

    def test_a_read_lease_pins_the_chunk_and_its_view_ends_with_it(
            self, client: Transport, key: bytes) -> None:
        assert isinstance(client, MappedTransport)
        data = payload(256 * KiB, 13)
        client.put(key, data)
        lease = client.open_read(key)
        view = lease.view
        assert lease.size_bytes == len(data) and view.readonly and view == data
        with pytest.raises(ChunkBusy):  # pinned while leased
            client.remove(key)
        lease.release()
        lease.release()  # idempotent
        with pytest.raises(ValueError):
            view[0]  # the view ended with the lease
        with pytest.raises(InvalidArgument):
            lease.view  # noqa: B018
        assert client.remove(key) is True

    def test_a_write_lease_is_invisible_until_commit_and_an_abort_leaves_nothing(
            self, client: Transport, key: bytes) -> None:
        assert isinstance(client, MappedTransport)
        data = payload(200 * KiB, 14)
        lease = client.open_write(key, len(data))
        lease.buffer[:] = data
        assert not client.exists(key)
        with pytest.raises(ChunkBusy):  # the key is being written
            client.put(key, data)
        lease.commit()
        with pytest.raises(InvalidArgument):
            lease.commit()
        with pytest.raises(InvalidArgument):
            lease.buffer  # noqa: B018
        assert client.get(key) == data
        aborted = client.open_write(key + b"-ab", 4 * KiB)
        aborted.buffer[:] = bytes(4 * KiB)
        aborted.abort()
        aborted.abort()  # idempotent
        assert not client.exists(key + b"-ab")
        client.put(key + b"-ab", b"free again")
        with pytest.raises(ChunkExists):
            client.open_write(key, 10)

    def test_load_prefix_stops_at_the_first_miss(self, client: Transport, key: bytes) -> None:
        assert isinstance(client, MappedTransport)
        keys = [key[:48] + b"-p%d" % i for i in range(4)]
        values = [payload(64 * KiB, 20 + i) for i in range(3)]
        parent = None
        for k, v in zip(keys, values, strict=False):
            client.put(k, v, parent=parent)
            parent = k
        dsts = [bytearray(64 * KiB) for _ in keys]
        assert client.load_prefix(keys, dsts) == 3
        assert dsts[:3] == values and dsts[3] == bytes(64 * KiB)
        with pytest.raises(SizeMismatch):
            client.load_prefix(keys[:2], [bytearray(64 * KiB), bytearray(1)])
        assert client.load_prefix([], []) == 0
        client.sync()  # every release sent so far has been processed

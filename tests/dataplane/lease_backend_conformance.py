"""The conformance suite every :class:`kvstore.dataplane.transport.base.LeaseBackend` runs.

Subclass :class:`LeaseBackendConformance` in a ``test_*.py`` module and provide a ``backend``
fixture returning a fresh, empty backend with room for at least 16 MiB::

    class TestMemoryBackend(LeaseBackendConformance):
        @pytest.fixture
        def backend(self) -> LeaseBackend:
            return MemoryBackend()

The suite is written against the contract in ``kvstore/dataplane/transport/base.py``; when it
and an implementation disagree, the contract wins.
"""

from __future__ import annotations

import threading

import pytest

from kvstore.dataplane.transport.base import LeaseBackend
from kvstore.errors import ChunkBusy, ChunkExists, ChunkNotFound, InvalidArgument, SizeMismatch
from tests.support.common import payload

MiB = 1 << 20




def write(backend: LeaseBackend, key: bytes, data: bytes) -> None:
    lease = backend.open_write(key, len(data))
    lease.buffer[:] = data
    lease.commit()


def read(backend: LeaseBackend, key: bytes) -> bytes:
    lease = backend.open_read(key)
    try:
        return bytes(lease.view)
    finally:
        lease.release()


class LeaseBackendConformance:
    """Contract tests for any LeaseBackend. Subclasses provide the ``backend`` fixture."""

    @pytest.fixture
    def backend(self) -> LeaseBackend:  # pragma: no cover - overridden
        raise NotImplementedError

    def test_is_a_lease_backend(self, backend: LeaseBackend) -> None:
        assert isinstance(backend, LeaseBackend)

    @pytest.mark.parametrize("size_bytes", [1, 4096, MiB + 5])
    def test_committed_write_reads_back_the_same_bytes(self, backend: LeaseBackend,
                                                       size_bytes: int) -> None:
        data = payload(size_bytes, size_bytes)
        write(backend, b"k", data)
        assert backend.exists(b"k")
        assert backend.size_of(b"k") == size_bytes
        assert read(backend, b"k") == data

    def test_write_lease_buffer_has_exactly_the_size_and_is_writable(
            self, backend: LeaseBackend) -> None:
        lease = backend.open_write(b"k", 1000)
        try:
            assert lease.size_bytes == 1000
            assert len(lease.buffer) == 1000
            assert not lease.buffer.readonly
        finally:
            lease.abort()

    def test_uncommitted_write_is_invisible(self, backend: LeaseBackend) -> None:
        lease = backend.open_write(b"k", 10)
        lease.buffer[:] = b"x" * 10
        assert not backend.exists(b"k")
        assert backend.size_of(b"k") is None
        with pytest.raises(ChunkNotFound):
            backend.open_read(b"k")
        lease.commit()
        assert backend.exists(b"k")

    def test_aborted_write_is_never_visible_and_frees_the_key(self, backend: LeaseBackend
                                                             ) -> None:
        lease = backend.open_write(b"k", 10)
        lease.buffer[:] = b"y" * 10
        lease.abort()
        lease.abort()  # idempotent
        assert not backend.exists(b"k")
        write(backend, b"k", b"z" * 3)
        assert read(backend, b"k") == b"zzz"

    def test_abort_after_commit_is_a_no_op_and_commit_twice_is_refused(
            self, backend: LeaseBackend) -> None:
        lease = backend.open_write(b"k", 2)
        lease.buffer[:] = b"ab"
        lease.commit()
        lease.abort()
        assert read(backend, b"k") == b"ab"
        with pytest.raises(InvalidArgument):
            lease.commit()

    def test_second_write_of_a_committed_key_raises_chunk_exists(self, backend: LeaseBackend
                                                                ) -> None:
        write(backend, b"k", b"1")
        with pytest.raises(ChunkExists):
            backend.open_write(b"k", 1)
        assert read(backend, b"k") == b"1"

    def test_second_write_of_a_key_being_written_raises_chunk_busy(self, backend: LeaseBackend
                                                                  ) -> None:
        lease = backend.open_write(b"k", 4)
        try:
            with pytest.raises(ChunkBusy):
                backend.open_write(b"k", 4)
        finally:
            lease.abort()

    def test_read_view_is_read_only(self, backend: LeaseBackend) -> None:
        write(backend, b"k", b"abc")
        lease = backend.open_read(b"k")
        try:
            assert lease.view.readonly
            assert lease.size_bytes == 3
        finally:
            lease.release()

    def test_remove_of_a_leased_chunk_raises_busy_until_released(self, backend: LeaseBackend
                                                                ) -> None:
        write(backend, b"k", b"abc")
        first, second = backend.open_read(b"k"), backend.open_read(b"k")
        with pytest.raises(ChunkBusy):
            backend.remove(b"k")
        first.release()
        first.release()  # idempotent: must not unpin twice
        with pytest.raises(ChunkBusy):
            backend.remove(b"k")
        assert bytes(second.view) == b"abc"
        second.release()
        assert backend.remove(b"k") is True
        assert not backend.exists(b"k")

    @pytest.mark.parametrize("size_bytes", [1, 4096, 64 * 1024 + 3])
    def test_read_into_copies_the_committed_bytes_and_leaves_no_pin(
            self, backend: LeaseBackend, size_bytes: int) -> None:
        data = payload(size_bytes, size_bytes + 1)
        write(backend, b"k", data)
        dst = bytearray(size_bytes)
        assert backend.read_into(b"k", memoryview(dst)) == size_bytes
        assert dst == data
        assert backend.remove(b"k") is True  # nothing pinned it

    def test_read_into_a_wrong_size_buffer_raises_size_mismatch_and_copies_nothing(
            self, backend: LeaseBackend) -> None:
        write(backend, b"k", b"abcdef")
        for wrong in (5, 7):
            dst = bytearray(b"\xee" * wrong)
            with pytest.raises(SizeMismatch) as info:
                backend.read_into(b"k", memoryview(dst))
            assert (info.value.expected, info.value.actual) == (6, wrong)
            assert dst == b"\xee" * wrong

    def test_read_into_does_not_see_uncommitted_or_unknown_chunks(self, backend: LeaseBackend
                                                                  ) -> None:
        lease = backend.open_write(b"k", 3)
        lease.buffer[:] = b"abc"
        with pytest.raises(ChunkNotFound):
            backend.read_into(b"k", memoryview(bytearray(3)))
        lease.abort()
        with pytest.raises(ChunkNotFound):
            backend.read_into(b"nope", memoryview(bytearray(3)))

    def test_misses_are_not_errors(self, backend: LeaseBackend) -> None:
        assert backend.exists(b"nope") is False
        assert backend.size_of(b"nope") is None
        assert backend.remove(b"nope") is False
        with pytest.raises(ChunkNotFound):
            backend.open_read(b"nope")

    @pytest.mark.parametrize("key", [b"", b"x" * 65])
    def test_malformed_keys_are_invalid_arguments(self, backend: LeaseBackend, key: bytes
                                                  ) -> None:
        with pytest.raises(InvalidArgument):
            backend.open_write(key, 1)
        with pytest.raises(InvalidArgument):
            backend.exists(key)

    def test_concurrent_writers_and_readers_on_distinct_keys(self, backend: LeaseBackend
                                                             ) -> None:
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                for j in range(20):
                    key = b"t%d-%d" % (i, j)
                    data = payload(4096 + j, i * 100 + j)
                    write(backend, key, data)
                    assert read(backend, key) == data
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert all(backend.exists(b"t%d-%d" % (i, j)) for i in range(4) for j in range(20))

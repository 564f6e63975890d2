"""NvmeTier against the Tier contract and its own promises, on real files with fdatasync.

The conformance suite runs twice: O_DIRECT where the test directory's filesystem takes it
(ext4 on the reference machine) with small I/O pieces so multi-piece transfers are
exercised, and forced buffered I/O (what tmpfs-like filesystems get). Disk-full tests mount
a real 4 MiB tmpfs and an 8 MiB loop-mounted ext4 image (``tests/support/smallfs.py``), fill
them with other files where the test needs it, and skip cleanly where mounting is not
permitted.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvstore.dataplane.nvme import write as nvme_write
from kvstore.dataplane.nvme.config import NvmeTierConfig, OpenVerify, Preallocation
from kvstore.dataplane.nvme.directio import AlignedBuffer, IoMode
from kvstore.dataplane.nvme.format import HEADER_BYTES
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.dataplane.tier import MAX_META_BYTES, PersistentTier, Tier, TierKind
from kvstore.errors import (
    CapacityError,
    ChunkBusy,
    ChunkCorrupt,
    ChunkExists,
    ChunkNotFound,
    ConfigError,
    DiskFull,
    InvalidArgument,
    StorageError,
    TierUnavailable,
)
from tests.dataplane.tier_conformance import KiB, MiB, TierConformance, payload, read_back
from tests.support.common import flip_byte
from tests.support.smallfs import fill, free_bytes, small_filesystem, total_bytes

TierFactory = Callable[[int], Tier]


def open_tier(directory: Path, capacity_bytes: int = 16 * MiB, **overrides: object) -> NvmeTier:
    return NvmeTier.open(NvmeTierConfig(directory=directory, capacity_bytes=capacity_bytes,
                                        **overrides))  # type: ignore[arg-type]


class TestNvmeTierConformance(TierConformance):
    """The contract, with O_DIRECT when available and 256 KiB pieces (so 1 MiB chunks split)."""

    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Iterator[TierFactory]:
        tiers: list[NvmeTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = open_tier(tmp_path / f"tier{len(tiers)}", capacity_bytes,
                             io_block_bytes=256 * KiB)
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            tier.close()


class TestNvmeTierBufferedConformance(TierConformance):
    """The same contract with buffered I/O (the mode filesystems without O_DIRECT get)."""

    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Iterator[TierFactory]:
        tiers: list[NvmeTier] = []

        def factory(capacity_bytes: int) -> Tier:
            tier = open_tier(tmp_path / f"tier{len(tiers)}", capacity_bytes,
                             io_mode=IoMode.BUFFERED)
            tiers.append(tier)
            return tier

        yield factory
        for tier in tiers:
            tier.close()


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[NvmeTier]:
    t = open_tier(tmp_path / "nvme", 32 * MiB, segment_bytes=8 * MiB, io_block_bytes=256 * KiB)
    yield t
    t.close()


# --- data paths -------------------------------------------------------------------------------


def test_direct_io_is_used_where_the_filesystem_takes_it(tier: NvmeTier) -> None:
    stats = tier.nvme_stats()
    assert stats.io_mode is tier.io_mode
    probe = tier.directory / "probe"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
        assert tier.io_mode is IoMode.BUFFERED
        return
    os.close(fd)
    probe.unlink()
    assert tier.io_mode is IoMode.DIRECT, stats.io_mode_reason


@pytest.mark.parametrize("size_bytes", [1, 4095, 4096, 4097, 256 * KiB, 256 * KiB + 1,
                                        3 * 256 * KiB - 5, 2 * MiB])
@pytest.mark.parametrize("aligned", [True, False])
def test_aligned_and_unaligned_buffers_round_trip(tier: NvmeTier, size_bytes: int,
                                                  aligned: bool) -> None:
    data = payload(size_bytes, seed=size_bytes)
    src_buf = AlignedBuffer(size_bytes + 1)
    dst_buf = AlignedBuffer(size_bytes + 1)
    try:
        lo = 0 if aligned else 1  # offset 1: never 4 KiB-aligned
        src = src_buf.view[lo:lo + size_bytes]
        src[:] = data
        info = tier.put(b"k", src)
        assert info.checksum == xxhash.xxh3_64_intdigest(data)
        dst = dst_buf.view[lo:lo + size_bytes]
        assert tier.get_into(b"k", dst) == size_bytes
        assert dst == data
        del src, dst
    finally:
        src_buf.close()
        dst_buf.close()


def test_chunks_report_sizes_and_checksums(tier: NvmeTier) -> None:
    for i in range(5):
        tier.put(f"c{i}".encode(), payload(1000 * (i + 1), seed=i))
    infos = {info.key: info for info in tier.chunks()}
    assert set(infos) == {f"c{i}".encode() for i in range(5)}
    for i in range(5):
        info = infos[f"c{i}".encode()]
        assert info.tier is TierKind.NVME
        assert info.size_bytes == 1000 * (i + 1)
        assert info.checksum == xxhash.xxh3_64_intdigest(payload(1000 * (i + 1), seed=i))


def test_metadata_is_kept_with_the_chunk_across_a_restart(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    with open_tier(directory) as tier:
        assert isinstance(tier, PersistentTier)
        info = tier.put_with_meta(b"child", payload(6000, seed=1), b"parent-key")
        assert info.meta == b"parent-key"
        tier.put(b"plain", payload(10, seed=2))
        tier.put_with_meta(b"big", payload(MiB + 1, seed=3), b"p" * MAX_META_BYTES)
        with pytest.raises(InvalidArgument):
            tier.put_with_meta(b"x", b"data", b"m" * (MAX_META_BYTES + 1))
        assert not tier.contains(b"x")
    with open_tier(directory) as tier:
        metas = {info.key: info.meta for info in tier.chunks()}
        assert metas == {b"child": b"parent-key", b"plain": b"", b"big": b"p" * MAX_META_BYTES}
        assert read_back(tier, b"big") == payload(MiB + 1, seed=3)


def test_used_bytes_count_headers_padding_and_segment_headers(tier: NvmeTier) -> None:
    tier.put(b"a", payload(5000, seed=1))  # 4 KiB header + 8 KiB padded payload
    tier.put(b"b", payload(4096, seed=2))  # 4 KiB header + 4 KiB
    stats = tier.stats()
    assert stats.used_bytes == HEADER_BYTES + (4 + 8) * KiB + (4 + 4) * KiB
    assert stats.capacity_bytes == 32 * MiB
    tier.remove(b"a")
    assert tier.stats().used_bytes == HEADER_BYTES + 8 * KiB


def test_a_freed_extent_is_reused_in_place(tier: NvmeTier) -> None:
    tier.put(b"a", payload(64 * KiB, seed=1))
    tier.put(b"b", payload(64 * KiB, seed=2))
    loc_a = tier.record_location(b"a")
    assert loc_a is not None
    tier.remove(b"a")
    tier.put(b"c", payload(60 * KiB, seed=3))  # same padded size: best fit is a's old extent
    loc_c = tier.record_location(b"c")
    assert loc_c is not None
    assert (loc_c.path, loc_c.header_offset) == (loc_a.path, loc_a.header_offset)
    assert read_back(tier, b"b") == payload(64 * KiB, seed=2)


def test_segments_are_created_on_demand_within_the_budget(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "t", 3 * MiB, segment_bytes=MiB)
    try:
        assert tier.nvme_stats().segments == 0
        stored = 0
        with pytest.raises(CapacityError):
            for i in range(100):
                tier.put(f"k{i}".encode(), payload(200 * KiB, seed=i))
                stored += 1
        stats = tier.nvme_stats()
        assert stats.segments == 3
        assert stats.segment_bytes_total == 3 * MiB
        assert sum(p.stat().st_size for p in (tmp_path / "t").glob("seg-*.kvt")) == 3 * MiB
        assert stored == 3 * ((MiB - HEADER_BYTES) // (204 * KiB))
    finally:
        tier.close()


def test_segments_hold_a_whole_number_of_uniform_chunks(tmp_path: Path) -> None:
    with open_tier(tmp_path / "t", 8 * MiB, segment_bytes=MiB) as tier:
        for i in range(11):  # 100 KiB chunks: 104 KiB records, 10 per ~1 MiB segment
            tier.put(f"k{i}".encode(), payload(100 * KiB, seed=i))
            assert tier.nvme_stats().segments == (1 if i < 10 else 2)
        assert tier.nvme_stats().segment_bytes_total == 2 * (HEADER_BYTES + 10 * 104 * KiB)


def test_a_chunk_bigger_than_a_segment_gets_its_own_segment(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "t", 8 * MiB, segment_bytes=MiB)
    try:
        data = payload(3 * MiB + 5, seed=9)
        tier.put(b"big", data)
        assert read_back(tier, b"big") == data
        loc = tier.record_location(b"big")
        assert loc is not None and loc.path.stat().st_size == 3 * MiB + 4 * KiB + 2 * HEADER_BYTES
    finally:
        tier.close()


def test_accepts_torch_tensors_of_any_dtype(tier: NvmeTier) -> None:
    torch = pytest.importorskip("torch")
    src = torch.randn(3, 1000, dtype=torch.float32)
    tier.put(b"t", src)
    dst = torch.empty_like(src)
    tier.get_into(b"t", dst)
    assert torch.equal(src, dst)


def test_read_only_destination_is_rejected(tier: NvmeTier) -> None:
    tier.put(b"k", b"x" * 10)
    with pytest.raises(InvalidArgument):
        tier.get_into(b"k", b"\x00" * 10)


@pytest.mark.parametrize("verify", [OpenVerify.NONE, OpenVerify.NEWEST])
def test_corrupt_payload_is_dropped_never_returned(tmp_path: Path, verify: OpenVerify) -> None:
    directory = tmp_path / "t"
    with open_tier(directory, io_block_bytes=64 * KiB) as tier:
        tier.put(b"old", payload(300 * KiB, seed=1))
        tier.put(b"new", payload(10 * KiB, seed=2))
        loc = tier.record_location(b"old")
        assert loc is not None
    flip_byte(loc.path, loc.payload_offset + 200 * KiB)
    # NEWEST with 1: only "new" is verified at open, so "old" is caught by the read.
    with open_tier(directory, open_verify=verify, open_verify_newest=1) as tier:
        assert tier.recovery.corrupt_dropped == 0
        assert tier.contains(b"old")
        dst = bytearray(b"\xaa" * (300 * KiB))
        with pytest.raises(ChunkCorrupt):
            tier.get_into(b"old", dst)
        assert dst == bytes(len(dst)), "bad bytes must not be left in the caller's buffer"
        assert not tier.contains(b"old")
        assert tier.nvme_stats().corrupt_dropped == 1
        with pytest.raises(ChunkNotFound):
            tier.get_into(b"old", dst)
        assert read_back(tier, b"new") == payload(10 * KiB, seed=2)
        free_before = tier.stats().free_bytes
    with open_tier(directory) as tier:  # stays dropped, its space is free again
        assert not tier.contains(b"old")
        assert read_back(tier, b"new") == payload(10 * KiB, seed=2)
        assert tier.stats().free_bytes == free_before


@pytest.mark.parametrize("where", ["payload", "header"])
def test_corruption_found_at_open_is_counted_in_the_stats(tmp_path: Path, where: str) -> None:
    """A damaged payload (checksum verified at open) or a damaged record header (the scan
    resyncs past it) drops the chunk at open and shows in ``TierStats.corrupt_at_open``, the
    figure the daemon adds to its corrupt counter; the other chunks stay."""
    directory = tmp_path / "t"
    with open_tier(directory) as tier:
        tier.put(b"victim", payload(64 * KiB, seed=1))
        tier.put(b"other", payload(64 * KiB, seed=2))
        assert tier.stats().corrupt_at_open == 0
        loc = tier.record_location(b"victim")
        assert loc is not None
    offset = loc.payload_offset + 1000 if where == "payload" else loc.header_offset + 100
    flip_byte(loc.path, offset)
    with open_tier(directory) as tier:
        assert not tier.contains(b"victim")
        assert tier.recovery.corrupt_found == 1
        assert (tier.recovery.corrupt_dropped, tier.recovery.corrupt_headers) == \
            ((1, 0) if where == "payload" else (0, 1))
        assert tier.stats().corrupt_at_open == 1
        assert read_back(tier, b"other") == payload(64 * KiB, seed=2)
    with open_tier(directory) as tier:  # repaired: the next open finds nothing new
        assert tier.stats().corrupt_at_open == 0


# --- concurrency ------------------------------------------------------------------------------


def test_a_second_open_of_the_same_directory_is_refused(tmp_path: Path) -> None:
    with open_tier(tmp_path / "t"), pytest.raises(TierUnavailable, match="in use"):
        open_tier(tmp_path / "t")
    with open_tier(tmp_path / "t"):  # the lock went with close()
        pass


def test_concurrent_put_of_one_key_is_busy_not_duplicated(tmp_path: Path) -> None:
    results: list[str] = []
    with open_tier(tmp_path / "t", 64 * MiB) as tier:
        data = payload(8 * MiB, seed=1)
        barrier = threading.Barrier(4)

        def worker() -> None:
            barrier.wait()
            try:
                tier.put(b"same", data)
                results.append("stored")
            except ChunkBusy:
                results.append("busy")
            except ChunkExists:  # the winner had already finished
                results.append("exists")

        threads = [threading.Thread(target=worker) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert results.count("stored") == 1
        assert len(results) == 4
        assert tier.stats().chunks == 1
    with open_tier(tmp_path / "t", 64 * MiB) as tier:
        assert tier.recovery.duplicates_dropped == 0
        assert read_back(tier, b"same") == data


def test_remove_during_reads_frees_space_after_they_end(tmp_path: Path) -> None:
    with open_tier(tmp_path / "t", 64 * MiB, io_block_bytes=256 * KiB) as tier:
        baseline = None
        for round_ in range(5):
            data = payload(4 * MiB, seed=round_)
            tier.put(b"k", data)
            if baseline is None:
                baseline = tier.stats().used_bytes - 4 * MiB - HEADER_BYTES
            outcomes: list[str] = []

            def reader(data: bytes = data, outcomes: list[str] = outcomes) -> None:
                dst = bytearray(len(data))
                try:
                    tier.get_into(b"k", dst)
                    outcomes.append("ok" if dst == data else "WRONG BYTES")
                except ChunkNotFound:
                    outcomes.append("gone")

            threads = [threading.Thread(target=reader) for _ in range(3)]
            for th in threads:
                th.start()
            assert tier.remove(b"k")
            for th in threads:
                th.join()
            assert "WRONG BYTES" not in outcomes
            assert tier.stats().chunks == 0
            assert tier.stats().used_bytes == baseline
        assert tier.nvme_stats().corrupt_dropped == 0


def test_many_threads_put_get_remove_then_reopen_agrees(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    kept: dict[bytes, bytes] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    with open_tier(directory, 64 * MiB, segment_bytes=4 * MiB, io_block_bytes=128 * KiB) as tier:
        def worker(t: int) -> None:
            try:
                for i in range(30):
                    key = f"w{t}-{i}".encode()
                    data = payload(1 + (t * 7919 + i * 104729) % (400 * KiB), seed=t * 1000 + i)
                    tier.put(key, data)
                    assert read_back(tier, key) == data
                    if i % 3 == 0:
                        assert tier.remove(key)
                    else:
                        with lock:
                            kept[key] = data
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert {i.key for i in tier.chunks()} == set(kept)
    for _ in range(2):
        with open_tier(directory, 64 * MiB, open_verify=OpenVerify.ALL) as tier:
            report = tier.recovery
            assert (report.invalid_headers, report.torn_records, report.corrupt_dropped,
                    report.repaired_gaps) == (0, 0, 0, 0)
            assert {i.key for i in tier.chunks()} == set(kept)
            for key, data in kept.items():
                assert read_back(tier, key) == data


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {"capacity_bytes": True},
    {"capacity_bytes": 100},
    {"segment_bytes": 5000},
    {"io_block_bytes": 1000},
    {"io_threads": 0},
    {"preallocation": "sparse"},
    {"io_mode": "direct"},
    {"open_verify_newest": -1},
])
def test_bad_configuration_fails_loudly(tmp_path: Path, overrides: dict[str, object]) -> None:
    fields: dict[str, object] = {"directory": tmp_path, "capacity_bytes": MiB, **overrides}
    with pytest.raises(ConfigError):
        NvmeTierConfig(**fields)  # type: ignore[arg-type]


def test_existing_segments_beyond_the_capacity_are_a_config_error(tmp_path: Path) -> None:
    with open_tier(tmp_path / "t", 8 * MiB, segment_bytes=4 * MiB) as tier:
        tier.put(b"a", payload(3 * MiB, seed=1))
        tier.put(b"b", payload(3 * MiB, seed=2))
    with pytest.raises(ConfigError, match="more than capacity"):
        open_tier(tmp_path / "t", 4 * MiB)
    with open_tier(tmp_path / "t", 8 * MiB) as tier:  # the failed open released the lock
        assert tier.stats().chunks == 2


# --- a full filesystem ------------------------------------------------------------------------


@pytest.fixture(params=["tmpfs", "ext4-loop"])
def small_fs(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB tmpfs or 8 MiB ext4 image (skips where mounting is not permitted)."""
    size = 4 * MiB if request.param == "tmpfs" else 8 * MiB
    with small_filesystem(request.param, tmp_path / "mnt", tmp_path, size) as mountpoint:
        yield mountpoint


def test_capacity_is_what_the_filesystem_can_give(small_fs: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """64 MiB configured on a 4-8 MiB filesystem: the tier says what it really has (so the
    cache's budgets and Stats are true), fills up to it, refuses the rest loudly and keeps
    every chunk it acknowledged, also across a reopen."""
    directory = small_fs / "t"
    stored: dict[bytes, bytes] = {}
    with caplog.at_level("WARNING", logger="kvstore.dataplane.nvme.tier"):
        tier = open_tier(directory, 64 * MiB)
    with tier:
        assert "the filesystem can give only" in caplog.text
        capacity = tier.capacity_bytes
        assert capacity == tier.stats().capacity_bytes
        assert capacity <= free_bytes(small_fs) <= total_bytes(small_fs) < 64 * MiB
        assert capacity >= MiB
        with pytest.raises(CapacityError):
            for i in range(400):
                data = payload(200 * KiB, seed=i)
                tier.put(f"k{i}".encode(), data)
                stored[f"k{i}".encode()] = data
        assert tier.stats().used_bytes <= capacity
        assert len(stored) * 200 * KiB >= capacity // 2, "the filesystem's room went unused"
        assert not list(directory.glob("*.tmp"))
        for key, data in stored.items():
            assert read_back(tier, key) == data
    with open_tier(directory, 64 * MiB, open_verify=OpenVerify.ALL) as tier:
        assert tier.capacity_bytes == capacity  # its own files count as room it has
        assert tier.recovery.corrupt_found == 0
        assert {i.key for i in tier.chunks()} == set(stored)
        for key, data in stored.items():
            assert read_back(tier, key) == data


def test_a_filesystem_with_no_sane_room_is_refused_at_open(small_fs: Path) -> None:
    fill(small_fs, leave_bytes=512 * KiB)
    with pytest.raises(DiskFull, match="below the minimum"):
        open_tier(small_fs / "t", 64 * MiB)
    with open_tier(small_fs / "t2", 256 * KiB) as tier:  # asks no more than there is
        assert tier.capacity_bytes == 256 * KiB
        tier.put(b"k", payload(100 * KiB, seed=1))


def test_a_new_segment_is_cut_to_the_space_left(small_fs: Path) -> None:
    """Other files fill the filesystem after open: a new segment gets what is left instead of
    failing whole, and once even that is gone the put gets DiskFull, nothing half-made."""
    directory = small_fs / "t"
    stored: dict[bytes, bytes] = {}
    with open_tier(directory, 64 * MiB, segment_bytes=4 * MiB) as tier:
        filler = fill(small_fs, leave_bytes=MiB + 64 * KiB)
        with pytest.raises(DiskFull, match="no room for a new segment"):
            for i in range(100):
                data = payload(200 * KiB, seed=i)
                tier.put(f"k{i}".encode(), data)
                stored[f"k{i}".encode()] = data
        assert len(stored) >= 4
        assert not list(directory.glob("*.tmp"))
        for key, data in stored.items():
            assert read_back(tier, key) == data
        filler.unlink()
        tier.put(b"after", payload(200 * KiB, seed=999))  # room again: a new segment
        stored[b"after"] = payload(200 * KiB, seed=999)
    with open_tier(directory, 64 * MiB, open_verify=OpenVerify.ALL) as tier:
        assert {i.key for i in tier.chunks()} == set(stored)


def test_disk_full_while_creating_a_segment_keeps_everything(small_fs: Path) -> None:
    directory = small_fs / "t"
    stored: dict[bytes, bytes] = {}
    with open_tier(directory, 64 * MiB, segment_bytes=MiB) as tier:
        fill(small_fs, leave_bytes=2 * MiB)  # other files take the room the tier counted on
        with pytest.raises(DiskFull) as caught:
            for i in range(200):
                key = f"k{i}".encode()
                data = payload(200 * KiB, seed=i)
                tier.put(key, data)
                stored[key] = data
        assert isinstance(caught.value, CapacityError)
        assert not tier.contains(f"k{len(stored)}".encode())
        assert len(stored) >= 4
        assert not list(directory.glob("*.tmp")), "a half-made segment was left behind"
        for key, data in stored.items():
            assert read_back(tier, key) == data
        victim = next(iter(stored))
        tier.remove(victim)
        del stored[victim]
        tier.put(b"again", payload(200 * KiB, seed=999))  # room in an existing segment
        stored[b"again"] = payload(200 * KiB, seed=999)
    with open_tier(directory, 64 * MiB, open_verify=OpenVerify.ALL) as tier:
        assert {i.key for i in tier.chunks()} == set(stored)


def test_disk_full_mid_write_discards_the_partial_record(small_fs: Path) -> None:
    directory = small_fs / "t"
    stored: dict[bytes, bytes] = {}
    failed_key = b""
    with open_tier(directory, 64 * MiB, segment_bytes=32 * MiB,
                   preallocation=Preallocation.SPARSE) as tier:
        fill(small_fs, leave_bytes=3 * MiB // 2)  # a SPARSE segment reserved nothing
        with pytest.raises(DiskFull):
            for i in range(200):
                failed_key = f"k{i}".encode()
                data = payload(300 * KiB, seed=i)
                tier.put(failed_key, data)
                stored[failed_key] = data
        assert failed_key not in stored
        assert not tier.contains(failed_key)
        assert tier.nvme_stats().quarantined_bytes == 0
        for key, data in stored.items():
            assert read_back(tier, key) == data
    for _ in range(2):
        with open_tier(directory, 64 * MiB, open_verify=OpenVerify.ALL) as tier:
            assert not tier.contains(failed_key)
            assert tier.recovery.corrupt_dropped == 0
            assert {i.key for i in tier.chunks()} == set(stored)


def _fail_writes(fd: int, buffers: object, offset: int) -> int:
    raise OSError(errno.EIO, "injected write error")


def _quarantine_one(tier: NvmeTier, monkeypatch: pytest.MonkeyPatch) -> int:
    """A put whose record write and clean-up (the FREE header over it) both fail: its extent
    is quarantined. Returns the extent's size."""
    with monkeypatch.context() as m:
        m.setattr(nvme_write, "pwritev_all", _fail_writes)
        with pytest.raises(StorageError, match="injected"):
            tier.put(b"failed", payload(64 * KiB, seed=9))
    return HEADER_BYTES + 64 * KiB


def test_a_failed_write_whose_clean_up_fails_is_quarantined_until_reopen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "t"
    with open_tier(directory) as tier:
        tier.put(b"a", payload(64 * KiB, seed=1))
        used = tier.stats().used_bytes
        loc_a = tier.record_location(b"a")
        assert loc_a is not None
        extent = _quarantine_one(tier, monkeypatch)
        assert not tier.contains(b"failed")
        # the extent and the rest of the free run it was cut from (a stale header may cover it)
        quarantined = tier.nvme_stats().quarantined_bytes
        assert quarantined >= extent
        assert tier.stats().used_bytes == used + quarantined  # claimed back out of the free space
        tier.remove(b"a")
        tier.put(b"c", payload(64 * KiB, seed=3))  # best fit: a's extent, not the quarantined one
        loc_c = tier.record_location(b"c")
        assert loc_c is not None and loc_c.header_offset == loc_a.header_offset
        assert tier.stats().used_bytes == used + quarantined
    with open_tier(directory) as tier:
        assert {i.key for i in tier.chunks()} == {b"c"}
        assert tier.nvme_stats().quarantined_bytes == 0
        assert tier.stats().used_bytes == used  # the next open frees the quarantined extent


def test_a_put_after_a_quarantine_survives_a_reopen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The failed record's place may keep the FREE header of the whole run it was cut from, which
    would hide from the next scan anything put into the rest of that run: the rest is quarantined
    too, so a later put goes elsewhere (here: a second segment) and is found after a reopen."""
    directory = tmp_path / "t"
    with open_tier(directory, 8 * MiB, segment_bytes=4 * MiB) as tier:
        tier.put(b"a", payload(64 * KiB, seed=1))
        _quarantine_one(tier, monkeypatch)
        tier.put(b"c", payload(64 * KiB, seed=3))  # durable when put returns
        loc_a, loc_c = tier.record_location(b"a"), tier.record_location(b"c")
        assert loc_a is not None and loc_c is not None and loc_c.path != loc_a.path
    with open_tier(directory, 8 * MiB, segment_bytes=4 * MiB) as tier:
        assert {i.key for i in tier.chunks()} == {b"a", b"c"}
        dst = bytearray(64 * KiB)
        assert tier.get_into(b"c", dst) == 64 * KiB
        assert bytes(dst) == bytes(payload(64 * KiB, seed=3))


def test_a_put_with_no_room_left_by_a_quarantine_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every byte quarantined or used, a put is refused loudly, never acknowledged and lost."""
    directory = tmp_path / "t"
    with open_tier(directory) as tier:
        tier.put(b"a", payload(64 * KiB, seed=1))
        _quarantine_one(tier, monkeypatch)
        with pytest.raises(CapacityError):
            tier.put(b"c", payload(64 * KiB, seed=3))
    with open_tier(directory) as tier:
        assert {i.key for i in tier.chunks()} == {b"a"}
        tier.put(b"c", payload(64 * KiB, seed=3))  # the reopen freed the quarantine



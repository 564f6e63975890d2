"""Crash recovery of the NVMe tier, on real files: SIGKILL mid-stream, truncation, bit flips.

The SIGKILL test runs a real writer process that reports, through a pipe, each put and
remove *after* it returned; the parent kills it at an arbitrary moment, reopens the
directory and checks: every acknowledged put is there with the right bytes, every
acknowledged remove is gone, and nothing else appears except the few operations that were
in flight (which, if present, must also read back correctly).

The acknowledgements are collected by :func:`_lines_until_killed`, which reads the pipe
only through its file object: a ``readline`` pulls whole chunks of the pipe into that
object's buffer, and ``Popen.communicate(timeout=...)`` reads the raw descriptor, so
acknowledgements already buffered would be dropped and an acknowledged remove would look
like a lost put (``docs/nvme-tier.md``, "Testing crash recovery").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from kvstore.dataplane.nvme.config import NvmeTierConfig, OpenVerify
from kvstore.dataplane.nvme.core import SEGMENT_NAME
from kvstore.dataplane.nvme.directio import ALIGN_BYTES, IoMode
from kvstore.dataplane.nvme.format import (
    HEADER_BYTES,
    RecordHeader,
    RecordKind,
    decode_record_header,
)
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.errors import ChunkNotFound
from tests.dataplane.tier_conformance import KiB, MiB, read_back
from tests.support.common import flip_byte, payload


def open_tier(directory: Path, **overrides: object) -> NvmeTier:
    fields: dict[str, object] = {"directory": directory, "capacity_bytes": 64 * MiB,
                                 "segment_bytes": 4 * MiB, "io_block_bytes": 128 * KiB,
                                 **overrides}
    return NvmeTier.open(NvmeTierConfig(**fields))  # type: ignore[arg-type]


def chunk_for(key: str, max_bytes: int = 300 * KiB) -> bytes:
    """The bytes stored under ``key`` (the writer process computes the same)."""
    crc = zlib.crc32(key.encode())
    return payload(1 + crc % max_bytes, seed=crc)


def _lines_until_killed(proc: subprocess.Popen[str], lines_before_kill: int) -> list[str]:
    """Read ``proc``'s stdout until ``lines_before_kill`` lines arrived, SIGKILL it, and return
    every line it wrote (stripped, empty ones left out), the unread ones included.

    The rest is read through ``proc.stdout`` after the process is gone, never with
    ``communicate(timeout=...)``: that reads the descriptor itself and would miss the lines
    ``readline`` had already buffered.
    """
    assert proc.stdout is not None
    lines: list[str] = []
    while len(lines) < lines_before_kill:
        line = proc.stdout.readline()
        assert line, f"writer process died on its own after {lines}"
        lines.append(line.strip())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    lines += [ln.strip() for ln in proc.stdout.read().splitlines() if ln.strip()]
    proc.stdout.close()
    return lines


def test_lines_written_before_the_kill_are_all_collected() -> None:
    """Regression (session 3): acknowledgements that ``readline`` had buffered were dropped.

    The child writes every line in one ``write`` before the parent reads, so the parent's
    first ``readline`` buffers all of them: each one must still come back.
    """
    burst = "".join(f"put k-{i}\n" for i in range(50))
    child = f"import sys, time; sys.stdout.write({burst!r}); sys.stdout.flush(); time.sleep(600)"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert _lines_until_killed(proc, 1) == [f"put k-{i}" for i in range(50)]
    assert proc.returncode == -signal.SIGKILL


WRITER = textwrap.dedent("""
    import sys, threading, zlib
    from pathlib import Path
    from kvstore.dataplane.nvme.config import NvmeTierConfig
    from kvstore.dataplane.nvme.directio import IoMode
    from kvstore.dataplane.nvme.tier import NvmeTier
    from tests.dataplane.tier_conformance import KiB, MiB, payload

    directory, threads, mode, max_bytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    tier = NvmeTier.open(NvmeTierConfig(
        directory=Path(directory), capacity_bytes=64 * MiB, segment_bytes=4 * MiB,
        io_block_bytes=128 * KiB, io_mode=IoMode(mode) if mode != "auto" else None))
    out = threading.Lock()

    def say(line):
        with out:
            sys.stdout.write(line + "\\n")
            sys.stdout.flush()

    def worker(t):
        i = 0
        while True:
            key = f"t{t}-{i}"
            crc = zlib.crc32(key.encode())
            tier.put(key.encode(), payload(1 + crc % max_bytes, seed=crc))
            say(f"put {key}")
            if i % 3 == 2:
                old = f"t{t}-{i - 1}"
                tier.remove(old.encode())
                say(f"rm {old}")
            i += 1

    say("ready")
    for t in range(threads):
        threading.Thread(target=worker, args=(t,), daemon=True).start()
    threading.Event().wait()
""")


@pytest.mark.parametrize(("threads", "mode", "acks_before_kill", "max_bytes"), [
    (1, "auto", 25, 300 * KiB), (1, "auto", 60, 300 * KiB), (3, "auto", 45, 300 * KiB),
    (1, "buffered", 40, 300 * KiB), (3, "buffered", 30, 300 * KiB),
    (2, "auto", 10, 8 * MiB), (1, "buffered", 10, 8 * MiB),
])
def test_sigkill_mid_stream_loses_nothing_acknowledged(tmp_path: Path, threads: int, mode: str,
                                                       acks_before_kill: int,
                                                       max_bytes: int) -> None:
    directory = tmp_path / "t"
    repo_root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(threads), mode,
                             str(max_bytes)],
                            stdout=subprocess.PIPE, text=True, cwd=repo_root)
    lines = _lines_until_killed(proc, 1 + acks_before_kill)
    assert lines[0] == "ready", "writer process failed to start"
    assert proc.returncode == -signal.SIGKILL

    put_acked = {ln.split()[1] for ln in lines if ln.startswith("put ")}
    rm_acked = {ln.split()[1] for ln in lines if ln.startswith("rm ")}
    last_put: dict[str, int] = {}
    for key in put_acked:
        t, i = key[1:].split("-")
        last_put[t] = max(last_put.get(t, -1), int(i))
    # Each writer thread had at most one operation in flight: the put after its last
    # acknowledged one, or the remove that follows every third put.
    in_flight_puts = {f"t{t}-{i + 1}" for t, i in last_put.items()}
    in_flight_puts |= {f"t{t}-0" for t in range(threads) if str(t) not in last_put}
    in_flight_rms = {f"t{t}-{i - 1}" for t, i in last_put.items() if i % 3 == 2} - rm_acked
    must_have = put_acked - rm_acked - in_flight_rms

    for attempt in range(2):  # reopening twice finds the same thing
        with open_tier(directory) as tier:
            present = {info.key.decode() for info in tier.chunks()}
            assert must_have <= present, (f"acknowledged puts lost: {sorted(must_have - present)}"
                                          f" ({tier.recovery}; acknowledged: {lines})")
            assert not (present & rm_acked), f"removed chunks came back: {present & rm_acked}"
            unexpected = present - put_acked
            assert unexpected <= in_flight_puts, f"chunks never put appeared: {unexpected}"
            for key in present:
                assert read_back(tier, key.encode()) == chunk_for(key, max_bytes), key
            if attempt == 1:
                report = tier.recovery
                assert (report.invalid_headers, report.torn_records, report.repaired_gaps) \
                    == (0, 0, 0), report
            # The tier keeps working where the writer died.
            tier.put(f"after-{attempt}".encode(), chunk_for(f"after-{attempt}", max_bytes))
            must_have.add(f"after-{attempt}")
            put_acked.add(f"after-{attempt}")


def _put_all(directory: Path, sizes: dict[bytes, int]) -> dict[bytes, bytes]:
    stored = {}
    with open_tier(directory) as tier:
        for i, (key, size) in enumerate(sizes.items()):
            stored[key] = payload(size, seed=i)
            tier.put(key, stored[key])
    return stored


def _location(directory: Path, key: bytes) -> tuple[Path, int, int]:
    with open_tier(directory, open_verify=OpenVerify.NONE) as tier:
        loc = tier.record_location(key)
        assert loc is not None
        return loc.path, loc.header_offset, loc.payload_offset



def _assert_holds(tier: NvmeTier, expected: dict[bytes, bytes]) -> None:
    assert {info.key for info in tier.chunks()} == set(expected)
    for key, data in expected.items():
        assert read_back(tier, key) == data


SIZES = {b"a": 100 * KiB, b"b": 5000, b"c": 300 * KiB + 3, b"d": 64 * KiB}


@pytest.mark.parametrize("cut", ["payload", "header"])
def test_truncated_segment_drops_only_the_torn_record(tmp_path: Path, cut: str) -> None:
    directory = tmp_path / "t"
    stored = _put_all(directory, SIZES)
    path, header_at, payload_at = _location(directory, b"d")  # the last record
    size_before = path.stat().st_size
    os.truncate(path, payload_at + 50 * KiB + 7 if cut == "payload" else header_at + 100)
    del stored[b"d"]
    with open_tier(directory) as tier:
        report = tier.recovery
        assert report.torn_records + report.invalid_headers >= 1
        assert report.repaired_gaps >= 1
        _assert_holds(tier, stored)
        assert path.stat().st_size == size_before, "the segment was not re-extended"
        stored[b"e"] = payload(200 * KiB, seed=77)
        tier.put(b"e", stored[b"e"])
    for _ in range(2):
        with open_tier(directory) as tier:
            report = tier.recovery
            assert (report.invalid_headers, report.torn_records, report.repaired_gaps) == (0, 0, 0)
            _assert_holds(tier, stored)


def test_flipped_header_byte_loses_that_record_and_resyncs_past_it(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    stored = _put_all(directory, SIZES)
    path, header_at, _ = _location(directory, b"b")  # a record in the middle of the chain
    flip_byte(path, header_at + 60, mask=0x5A)  # inside the key
    del stored[b"b"]
    with open_tier(directory) as tier:
        report = tier.recovery
        assert report.invalid_headers == 1
        assert report.repaired_gaps == 1
        _assert_holds(tier, stored)  # c and d, after the broken link, were found by the resync
    with open_tier(directory) as tier:
        assert tier.recovery.invalid_headers == 0
        _assert_holds(tier, stored)


@pytest.mark.parametrize("verify", [OpenVerify.ALL, OpenVerify.NEWEST])
def test_flipped_payload_byte_is_caught_at_open(tmp_path: Path, verify: OpenVerify) -> None:
    directory = tmp_path / "t"
    stored = _put_all(directory, SIZES)
    path, _, payload_at = _location(directory, b"c")
    flip_byte(path, payload_at + 123_456, mask=0x5A)
    del stored[b"c"]
    with open_tier(directory, open_verify=verify) as tier:
        assert tier.recovery.corrupt_dropped == 1
        _assert_holds(tier, stored)
    with open_tier(directory, open_verify=OpenVerify.NONE) as tier:
        assert tier.recovery.repaired_gaps == 0
        _assert_holds(tier, stored)


def test_removed_chunks_stay_removed_and_stale_tombstones_do_not_hide_new_puts(
        tmp_path: Path) -> None:
    directory = tmp_path / "t"
    with open_tier(directory) as tier:
        tier.put(b"k", payload(64 * KiB, seed=1))
        first = tier.record_location(b"k")
        tier.remove(b"k")
        tier.put(b"gone", payload(10 * KiB, seed=2))
        tier.remove(b"gone")
        tier.put(b"k", payload(64 * KiB, seed=3))  # same size: reuses the DEAD extent
        again = tier.record_location(b"k")
        assert first is not None and again is not None
        assert again.header_offset == first.header_offset
        tier.put(b"k2", payload(8 * KiB, seed=4))
        tier.remove(b"k2")
        tier.put(b"k2", payload(80 * KiB, seed=5))  # bigger: lands elsewhere, old DEAD stays
    for _ in range(2):
        with open_tier(directory) as tier:
            _assert_holds(tier, {b"k": payload(64 * KiB, seed=3), b"k2": payload(80 * KiB, seed=5)})
            with pytest.raises(ChunkNotFound):
                tier.get_into(b"gone", bytearray(10 * KiB))


def test_an_older_duplicate_of_a_key_loses_to_the_newer_and_stays_dead(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    stored = _put_all(directory, {b"k": 8 * KiB, b"other": 4 * KiB})
    path, header_at, payload_at = _location(directory, b"k")
    _, other_at, _ = _location(directory, b"other")
    free_at = other_at + 2 * HEADER_BYTES  # the free run after the last record
    segment_bytes = path.stat().st_size
    # Put an *older* LIVE copy of k at the start of the free run, on the header chain (as a
    # failed remove followed by a re-put could leave it), and a FREE header after it.
    with open(path, "r+b") as f:
        f.seek(header_at)
        _, original = decode_record_header(f.read(HEADER_BYTES), segment_id=1,
                                           offset=header_at, segment_bytes=segment_bytes)
        assert original is not None
        f.seek(payload_at)
        body = f.read(8 * KiB)
        old = memoryview(bytearray(HEADER_BYTES))
        RecordHeader(RecordKind.LIVE, 1, free_at, original.extent_bytes, 0,
                     original.payload_bytes, original.payload_xxh3, b"k").encode_into(old)
        rest = memoryview(bytearray(HEADER_BYTES))
        rest_at = free_at + original.extent_bytes
        RecordHeader(RecordKind.FREE, 1, rest_at, segment_bytes - rest_at, 0).encode_into(rest)
        f.seek(free_at)
        f.write(bytes(old) + body + bytes(rest))
        os.fsync(f.fileno())
    with open_tier(directory) as tier:
        assert tier.recovery.duplicates_dropped == 1
        loc = tier.record_location(b"k")
        assert loc is not None and loc.header_offset == header_at
        _assert_holds(tier, stored)
        tier.remove(b"k")
        del stored[b"k"]
    with open_tier(directory) as tier:  # the loser was overwritten: k does not resurface
        assert tier.recovery.duplicates_dropped == 0
        _assert_holds(tier, stored)


def test_a_live_header_off_the_chain_is_ignored(tmp_path: Path) -> None:
    """A header inside a free run (not reachable by hops) is stale and never resurfaces."""
    directory = tmp_path / "t"
    stored = _put_all(directory, {b"a": 8 * KiB})
    path, header_at, _ = _location(directory, b"a")
    with open(path, "r+b") as f:
        f.seek(header_at)
        _, original = decode_record_header(f.read(HEADER_BYTES), segment_id=1,
                                           offset=header_at, segment_bytes=4 * MiB)
        assert original is not None
        ghost = memoryview(bytearray(HEADER_BYTES))
        RecordHeader(RecordKind.LIVE, 1, MiB, original.extent_bytes, 99, original.payload_bytes,
                     original.payload_xxh3, b"ghost").encode_into(ghost)
        f.seek(MiB)
        f.write(bytes(ghost))
        os.fsync(f.fileno())
    with open_tier(directory) as tier:
        _assert_holds(tier, stored)


def test_damaged_segment_header_keeps_the_records(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    stored = _put_all(directory, SIZES)
    flip_byte(directory / SEGMENT_NAME.format(1), 10, mask=0x5A)
    for expected_damage in (1, 0):
        with open_tier(directory) as tier:
            assert tier.recovery.damaged_segment_headers == expected_damage
            _assert_holds(tier, stored)


def test_unfinished_segment_file_is_removed_at_open(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    stored = _put_all(directory, {b"a": 10 * KiB})
    leftover = directory / (SEGMENT_NAME.format(7) + ".tmp")
    leftover.write_bytes(b"\0" * ALIGN_BYTES)
    with open_tier(directory) as tier:
        assert not leftover.exists()
        _assert_holds(tier, stored)


def test_garbage_between_records_is_skipped(tmp_path: Path) -> None:
    directory = tmp_path / "t"
    with open_tier(directory) as tier:
        tier.put(b"a", payload(20 * KiB, seed=1))
        tier.put(b"b", payload(20 * KiB, seed=2))
        tier.put(b"c", payload(20 * KiB, seed=3))
        tier.remove(b"b")
        loc_b_free = tier.record_location(b"a")
    assert loc_b_free is not None
    # Overwrite b's DEAD header with random bytes that happen to start with the magic.
    path = loc_b_free.path
    with open(path, "r+b") as f:
        f.seek(loc_b_free.header_offset + loc_b_free.extent_bytes)
        f.write(b"KVTR" + os.urandom(HEADER_BYTES - 4))
        os.fsync(f.fileno())
    with open_tier(directory, io_mode=IoMode.BUFFERED) as tier:
        assert tier.recovery.invalid_headers == 1
        _assert_holds(tier, {b"a": payload(20 * KiB, seed=1), b"c": payload(20 * KiB, seed=3)})

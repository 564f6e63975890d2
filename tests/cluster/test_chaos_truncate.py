"""The truncate-segment fault's cut (:func:`bench.chaos.truncate_segment`) on a real NVMe tier
across a restart, no cluster needed: the cut reaches the records it says (the one cut in half
and every one after it in that file), the tier reopens on the short file, drops exactly those
(never returning their bytes), reports them, and keeps every other chunk byte for byte."""

from __future__ import annotations

from pathlib import Path

from bench.chaos import flip_payload_bytes, load_key, truncate_segment
from kvstore.dataplane.nvme.config import NvmeTierConfig
from kvstore.dataplane.nvme.tier import NvmeTier
from kvstore.errors import ChunkCorrupt, ChunkNotFound

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 16 * KiB


def value(i: int) -> bytes:
    return i.to_bytes(4, "little") * (CHUNK // 4)


def config(directory: Path) -> NvmeTierConfig:
    return NvmeTierConfig(directory=directory, capacity_bytes=8 * MiB, segment_bytes=MiB)


def test_a_segment_cut_mid_record_drops_the_cut_chunks_at_reopen(tmp_path: Path) -> None:
    directory = tmp_path / "nvme"
    keys = [b"k%03d" % i for i in range(90)]  # a full first segment, part of a second
    with NvmeTier.open(config(directory)) as tier:
        for i, key in enumerate(keys):
            tier.put(key, value(i))
    cut = truncate_segment(directory, 3)
    assert cut == [k.decode() for k in keys[-3:]]  # the newest file: its last three records
    oldest = truncate_segment(directory, 2, oldest=True)
    with NvmeTier.open(config(directory)) as tier:
        report = tier.recovery
        gone = {k.encode() for k in [*cut, *oldest]}
        buf = bytearray(CHUNK)
        for i, key in enumerate(keys):
            if key in gone:
                try:
                    tier.get_into(key, buf)
                except (ChunkNotFound, ChunkCorrupt):
                    continue
                raise AssertionError(f"{key!r} was cut but came back")
            assert tier.get_into(key, buf) == CHUNK and buf == value(i), key
        assert len(gone) == 5
        # reported: one torn record per cut file (the rest of each file is simply gone)
        assert report.chunks == len(keys) - len(gone) and report.torn_records == 2, report


def test_a_second_cut_of_the_same_file_reports_the_records_past_the_first(
        tmp_path: Path) -> None:
    """One segment file cut, then written past the cut (the tier resyncs over the hole), then
    cut again earlier: the second cut names every record it reaches, those past the hole too
    (the first version stopped at the hole, so the fault did not know it had destroyed them,
    and the run reported them as durable chunks lost)."""
    directory = tmp_path / "nvme"
    with NvmeTier.open(config(directory)) as tier:
        for i in range(20):  # one file
            tier.put(b"a%02d" % i, value(i))
    first = truncate_segment(directory, 3)
    with NvmeTier.open(config(directory)) as tier:
        for i in range(5):  # written after the hole the first cut left
            tier.put(b"b%02d" % i, value(100 + i))
    second = truncate_segment(directory, 8, oldest=True)
    assert {f"b{i:02d}" for i in range(5)} <= set(second), second
    with NvmeTier.open(config(directory)) as tier:
        survivors = {info.key for info in tier.chunks()}
    every = {b"a%02d" % i for i in range(20)} | {b"b%02d" % i for i in range(5)}
    assert survivors == every - {k.encode() for k in [*first, *second]}


def test_the_disk_faults_damage_and_report_the_loads_chunks_not_the_engines(
        tmp_path: Path) -> None:
    """With real engines in the cluster (issue 16) the NVMe tier also holds their chunks,
    whose keys are binary (a namespace prefix and a block hash): the faults damage and report
    only the load's (printable) keys, which the history checks; the first version decoded
    every key and crashed (UnicodeDecodeError) on the engines' first chunk."""
    directory = tmp_path / "nvme"
    engine = [bytes([0x8F, i]) + bytes(range(30)) for i in range(30)]
    ours = [b"w0/%d" % i for i in range(30)]
    with NvmeTier.open(config(directory)) as tier:
        for i in range(30):  # interleaved, an engine's chunk newest
            tier.put(ours[i], value(i))
            tier.put(engine[i], value(100 + i))
    flipped = flip_payload_bytes(directory, 3)
    assert flipped == [ours[0].decode(), ours[-2].decode(), ours[-1].decode()]
    cut = truncate_segment(directory, 4)  # the last 4 records: 2 of the load's, 2 engine's
    assert cut == [ours[-2].decode(), ours[-1].decode()]
    assert not load_key(engine[0]) and load_key(ours[0]) and not load_key(b"")

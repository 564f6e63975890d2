"""How an NVMe tier is configured: :class:`NvmeTierConfig` and its modes."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from kvstore.dataplane.nvme.directio import ALIGN_BYTES, IoMode
from kvstore.errors import ConfigError

MiB = 1 << 20
MIN_SEGMENT_BYTES = 3 * ALIGN_BYTES
"""A segment header, one record header and one payload block."""
MIN_REAL_CAPACITY_BYTES = 1 * MiB
"""Below this much real room (free space plus the tier's own files) an NVMe tier whose
filesystem cannot give it the configured capacity refuses to open (``DiskFull``): it could
hold next to nothing, and a node that silently runs without its disk tier is worse than one
that does not start."""


class Preallocation(enum.Enum):
    """How a new segment file's space is reserved."""

    ZERO_FILL = "zero-fill"
    """Write zeros over the whole file once (~0.1 s per 256 MiB here). Later puts overwrite
    written blocks, so their fdatasync flushes data only: measured ~2x faster durable puts
    than FALLOCATE on ext4. The default."""
    FALLOCATE = "fallocate"
    """``posix_fallocate``: instant, space reserved, but each first write of a block converts
    an unwritten extent (a journal commit inside the put's fdatasync)."""
    SPARSE = "sparse"
    """``ftruncate`` only: nothing reserved; a full filesystem surfaces as ``DiskFull`` from
    the put whose write hits it (still safe: that record is discarded)."""


class OpenVerify(enum.Enum):
    """Which payload checksums :meth:`NvmeTier.open` verifies (every read verifies anyway)."""

    NEWEST = "newest"
    """The ``open_verify_newest`` records with the highest sequence numbers: a crash can
    only have torn records still in flight, which are the newest."""
    ALL = "all"
    """Every record (reads the whole directory)."""
    NONE = "none"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class NvmeTierConfig:
    """Configuration of one NVMe tier. Validates itself (``ConfigError``)."""

    directory: Path
    capacity_bytes: int
    """Budget for the segment files in ``directory`` (rounded down to 4 KiB). At open it is
    lowered, with a warning, to what the filesystem can really give (``os.statvfs`` free
    space plus the tier's own files): ``NvmeTier.capacity_bytes`` is the figure in use."""
    segment_bytes: int = 256 * MiB
    io_mode: IoMode | None = None
    """None: O_DIRECT when the filesystem takes it (probed), else buffered. DIRECT: require it."""
    preallocation: Preallocation = Preallocation.ZERO_FILL
    io_block_bytes: int = 4 * MiB
    """Size of staging/bounce buffers and of the pieces large transfers are split into."""
    io_threads: int = 2
    """Reads of one large chunk keep this many pieces in flight."""
    open_verify: OpenVerify = OpenVerify.NEWEST
    open_verify_newest: int = 64
    group: int | None = None
    """Who besides the daemon's uid may read the tier's files. None: nobody (directory
    ``0700``, files ``0600``). A gid: the directory and files belong to that group, directory
    ``0750``, files ``0640`` (read-only for the group: an operator's backup or inspection
    tool; clients never read segment files, the daemon serves them)."""

    @property
    def directory_mode(self) -> int:
        """The mode the tier gives its directory (``group``)."""
        return 0o700 if self.group is None else 0o750

    @property
    def file_mode(self) -> int:
        """The mode the tier gives its segment and lock files (``group``)."""
        return 0o600 if self.group is None else 0o640

    def __post_init__(self) -> None:
        if isinstance(self.directory, str):
            object.__setattr__(self, "directory", Path(self.directory))
        if not isinstance(self.directory, Path):
            raise ConfigError(f"directory must be a path, not {type(self.directory).__name__}")
        for name in ("capacity_bytes", "segment_bytes", "io_block_bytes", "io_threads",
                     "open_verify_newest"):
            if not _is_int(getattr(self, name)):
                raise ConfigError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.capacity_bytes < MIN_SEGMENT_BYTES:
            raise ConfigError(f"capacity_bytes {self.capacity_bytes} is below the minimum "
                              f"{MIN_SEGMENT_BYTES}")
        if self.segment_bytes < MIN_SEGMENT_BYTES or self.segment_bytes % ALIGN_BYTES:
            raise ConfigError(f"segment_bytes {self.segment_bytes} must be a multiple of "
                              f"{ALIGN_BYTES} and at least {MIN_SEGMENT_BYTES}")
        if self.io_block_bytes < ALIGN_BYTES or self.io_block_bytes % ALIGN_BYTES:
            raise ConfigError(f"io_block_bytes {self.io_block_bytes} must be a positive "
                              f"multiple of {ALIGN_BYTES}")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io_threads must be 1..64, got {self.io_threads}")
        if self.open_verify_newest < 0:
            raise ConfigError("open_verify_newest must be >= 0")
        if self.io_mode is not None and not isinstance(self.io_mode, IoMode):
            raise ConfigError(f"io_mode must be an IoMode or None, got {self.io_mode!r}")
        if not isinstance(self.preallocation, Preallocation):
            raise ConfigError(f"preallocation must be a Preallocation, got {self.preallocation!r}")
        if self.group is not None and (not _is_int(self.group) or self.group < 0):
            raise ConfigError(f"group must be a gid (int >= 0) or None, got {self.group!r}")
        if not isinstance(self.open_verify, OpenVerify):
            raise ConfigError(f"open_verify must be an OpenVerify, got {self.open_verify!r}")

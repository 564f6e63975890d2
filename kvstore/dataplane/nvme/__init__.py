"""The NVMe tier: chunks in preallocated segment files, checksummed, crash-safe.

One role per module:

* :mod:`~kvstore.dataplane.nvme.tier`: :class:`NvmeTier`, the public class (the Tier
  protocol, open and close), with :class:`NvmeTierStats` and :class:`RecordLocation`;
* :mod:`~kvstore.dataplane.nvme.config`: :class:`NvmeTierConfig`, :class:`Preallocation`,
  :class:`OpenVerify`;
* :mod:`~kvstore.dataplane.nvme.core`: what the parts share (index, segments, locks, pools);
* :mod:`~kvstore.dataplane.nvme.write`: the write path (records, DEAD and FREE headers,
  segment files);
* :mod:`~kvstore.dataplane.nvme.read`: the read path (payloads into caller memory, verified);
* :mod:`~kvstore.dataplane.nvme.recovery`: rebuilding the index at open
  (:class:`RecoveryReport`);
* :mod:`~kvstore.dataplane.nvme.format`: the on-disk byte layout;
  :mod:`~kvstore.dataplane.nvme.scan`: walking a segment's header chain;
* :mod:`~kvstore.dataplane.nvme.directio`: aligned buffers, the O_DIRECT probe,
  ``pwritev_all``/``preadv_all``.

The names below are re-exported for users of the tier; code inside the package imports the
modules themselves. Design and measurements: ``docs/nvme-tier.md``.
"""

from kvstore.dataplane.nvme.config import NvmeTierConfig, OpenVerify, Preallocation
from kvstore.dataplane.nvme.core import SEGMENT_NAME
from kvstore.dataplane.nvme.directio import IoMode
from kvstore.dataplane.nvme.recovery import RecoveryReport
from kvstore.dataplane.nvme.tier import NvmeTier, NvmeTierStats, RecordLocation

__all__ = [
    "SEGMENT_NAME",
    "IoMode",
    "NvmeTier",
    "NvmeTierConfig",
    "NvmeTierStats",
    "OpenVerify",
    "Preallocation",
    "RecordLocation",
    "RecoveryReport",
]

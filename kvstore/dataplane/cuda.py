"""Lazy, guarded access to CUDA through torch: availability, host registration, tensors.

Nothing here imports torch at module import time. :func:`cuda_available` avoids
importing torch at all on a machine without an NVIDIA driver (no ``/dev/nvidiactl``
and no ``/proc/driver/nvidia``), so CPU-only processes never pay torch's import
cost for a check that cannot succeed.

Host registration (``cudaHostRegister``) is recorded in a process-wide registry of
pinned address ranges so the HBM tier can tell whether a host buffer (for example a
view into the DRAM arena) is pinned and copy it with DMA directly instead of through
its staging buffer. The registry is created lazily and guarded by a lock; importing
this module changes no global state.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from bisect import bisect_right
from dataclasses import dataclass
from typing import Any

from kvstore.errors import TierUnavailable

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h).
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08


def _driver_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def torch_module() -> Any:
    """Import and return torch, or raise TierUnavailable when it is not installed."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a project dependency
        raise TierUnavailable("torch is not installed; the HBM tier needs it") from exc
    return torch


def cuda_available() -> bool:
    """True when torch can use a CUDA device. Cheap (no torch import) on driverless machines."""
    if "torch" not in sys.modules and not _driver_present():
        return False
    try:
        torch = torch_module()
    except TierUnavailable:
        return False
    return bool(torch.cuda.is_available())


@dataclass(frozen=True, slots=True)
class PinnedRange:
    """One host range registered with CUDA. ``tensor`` is a CPU uint8 tensor over it."""

    address: int
    size_bytes: int
    tensor: Any


class _PinnedRegistry:
    """Address-ordered list of registered ranges (few entries: one per arena)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ranges: list[PinnedRange] = []

    def add(self, pinned: PinnedRange) -> None:
        with self._lock:
            idx = bisect_right(self._starts, pinned.address)
            self._starts.insert(idx, pinned.address)
            self._ranges.insert(idx, pinned)

    def remove(self, address: int) -> PinnedRange | None:
        with self._lock:
            idx = bisect_right(self._starts, address) - 1
            if idx < 0 or self._starts[idx] != address:
                return None
            del self._starts[idx]
            return self._ranges.pop(idx)

    def find(self, address: int, size_bytes: int) -> PinnedRange | None:
        with self._lock:
            idx = bisect_right(self._starts, address) - 1
            if idx < 0:
                return None
            pinned = self._ranges[idx]
        if address + size_bytes <= pinned.address + pinned.size_bytes:
            return pinned
        return None


_registry_lock = threading.Lock()
_registry: _PinnedRegistry | None = None


def _pinned_registry() -> _PinnedRegistry:
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = _PinnedRegistry()
        return _registry


def host_register(buffer: memoryview, *, read_only: bool = False) -> bool:
    """Pin a host buffer with ``cudaHostRegister``; return False (and log) when no GPU exists.

    ``buffer`` must be C-contiguous, stay mapped until :func:`host_unregister`, and
    (unless ``read_only``) be writable. Raises ``TierUnavailable`` when CUDA exists but
    registration fails (for example the memlock limit is too low).
    """
    if not cuda_available():
        log.info("no CUDA device: arena of %d bytes stays unpinned", buffer.nbytes)
        return False
    import numpy as np

    torch = torch_module()
    array = np.frombuffer(buffer, dtype=np.uint8)
    address = int(array.ctypes.data)
    flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
    err = int(torch.cuda.cudart().cudaHostRegister(address, buffer.nbytes, flags))
    if err != 0:
        raise TierUnavailable(
            f"cudaHostRegister of {buffer.nbytes} bytes failed with cudaError {err} "
            "(check `ulimit -l` and that the range is not registered twice)"
        )
    # A read-only range is never written through this tensor (torch warns once about it).
    tensor = torch.from_numpy(array)
    _pinned_registry().add(PinnedRange(address, buffer.nbytes, tensor))
    log.info("pinned %d bytes at 0x%x with cudaHostRegister", buffer.nbytes, address)
    return True


def host_unregister(address: int) -> None:
    """Undo :func:`host_register` for the range starting at ``address`` (no-op if unknown)."""
    pinned = _pinned_registry().remove(address)
    if pinned is None:
        return
    torch = torch_module()
    err = int(torch.cuda.cudart().cudaHostUnregister(address))
    if err != 0:
        log.warning("cudaHostUnregister(0x%x) failed with cudaError %d", address, err)


def pinned_tensor_for(address: int, size_bytes: int) -> Any | None:
    """A CPU uint8 tensor over ``[address, address + size_bytes)`` when that range is pinned."""
    if _registry is None:
        return None
    pinned = _registry.find(address, size_bytes)
    if pinned is None:
        return None
    start = address - pinned.address
    return pinned.tensor[start : start + size_bytes]

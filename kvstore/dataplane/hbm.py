"""The HBM tier: chunks in one pre-allocated CUDA device buffer, through torch.

``HbmTier`` implements :class:`~kvstore.dataplane.tier.Tier` (not ``HostMemoryTier``:
device memory has no host view). See ``tier.py`` for ownership, errors and
threading. What is specific here:

* **Memory.** The constructor allocates one ``torch.uint8`` buffer of
  ``capacity_bytes`` on ``cuda:<device>`` and places chunks in it with the same
  best-fit :class:`~kvstore.dataplane.allocator.ExtentAllocator` as DRAM (256 B
  alignment: CUDA's own allocation granule, enough for coalesced copies). It raises
  ``TierUnavailable`` when torch sees no CUDA device or the buffer does not fit.
* **Sources and destinations.** ``put``/``get_into`` take CUDA tensors (any dtype,
  contiguous; a device-to-device copy, also across devices) and every host buffer
  the DRAM tier takes. Host memory that is *pinned* (a pinned CPU tensor, or any
  range of an arena registered by :mod:`kvstore.dataplane.cuda`, e.g. a DRAM-tier
  view or slot buffer) is copied by DMA directly. Other host memory goes through two
  pinned staging buffers per thread (``staging_bytes`` each): a CPU memcpy into one
  overlaps the DMA out of the other.
* **Streams.** Each calling thread gets its own CUDA stream, so copies from several
  threads overlap. A copy first waits for the caller's *current* stream on the
  source/destination device (so a tensor produced by queued kernels is read after
  they finish), and every call synchronises its stream before returning: when
  ``put`` returns the caller may overwrite ``src``; when ``get_into`` returns
  ``dst`` holds the bytes.
* **No compression** (no GPU codec here) and no checksums: ``ChunkInfo.checksum`` is None.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.dataplane import cuda
from kvstore.dataplane.allocator import ExtentAllocator
from kvstore.dataplane.arena import buffer_address, host_byte_view
from kvstore.dataplane.compress import CodecKind
from kvstore.dataplane.extent_table import ExtentTable, ExtentTableTier
from kvstore.dataplane.tier import ChunkInfo, TierKind, check_key
from kvstore.errors import InvalidArgument, SizeMismatch, TierUnavailable

log = logging.getLogger(__name__)

DEFAULT_ALIGNMENT_BYTES = 256
DEFAULT_STAGING_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class TransferCounts:
    """How many copies took each path since the tier was made (for tests and metrics)."""

    device: int
    """Device-to-device (a CUDA tensor on the other side)."""
    pinned: int
    """Direct DMA to or from pinned host memory."""
    staged: int
    """Through the per-thread pinned staging buffers (pageable host memory)."""


class _ThreadCopyState:
    """One thread's CUDA stream, two pinned staging buffers and their events."""

    def __init__(self, torch: Any, device: Any, staging_bytes: int) -> None:
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device=device)
            self.events = (torch.cuda.Event(), torch.cuda.Event())
        try:
            self.staging = tuple(
                torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            )
        except RuntimeError as exc:
            raise TierUnavailable(f"cannot allocate pinned staging buffers: {exc}") from exc
        self.staging_np: tuple[np.ndarray, ...] = tuple(t.numpy() for t in self.staging)


class HbmTier(ExtentTableTier):
    """Chunks in GPU memory. See the module docstring.

    The constructor imports torch and allocates ``capacity_bytes`` on the device;
    it raises ``TierUnavailable`` when no CUDA device exists or the memory does not fit.
    """

    _KIND = TierKind.HBM

    def __init__(
        self,
        capacity_bytes: int,
        *,
        device: int = 0,
        alignment_bytes: int = DEFAULT_ALIGNMENT_BYTES,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
    ) -> None:
        if not cuda.cuda_available():
            raise TierUnavailable(
                "no CUDA device: the HBM tier needs torch with a visible CUDA GPU "
                "(torch.cuda.is_available() is False on this machine)"
            )
        torch = cuda.torch_module()
        if not isinstance(capacity_bytes, int) or capacity_bytes < alignment_bytes:
            raise InvalidArgument(
                f"capacity must be an int >= {alignment_bytes} bytes, got {capacity_bytes!r}"
            )
        if not 0 <= device < torch.cuda.device_count():
            raise InvalidArgument(
                f"CUDA device {device} does not exist ({torch.cuda.device_count()} visible)"
            )
        if staging_bytes < 1:
            raise InvalidArgument(f"staging_bytes must be positive, got {staging_bytes}")
        self._torch = torch
        self._device = torch.device("cuda", device)
        allocator = ExtentAllocator(capacity_bytes, alignment_bytes)
        try:
            self._buffer: Any = torch.empty(
                allocator.capacity_bytes, dtype=torch.uint8, device=self._device
            )
        except torch.cuda.OutOfMemoryError as exc:
            raise TierUnavailable(
                f"cannot allocate {allocator.capacity_bytes} bytes on {self._device}: {exc}"
            ) from exc
        self._table = ExtentTable(allocator, where=f"HBM tier {self._device}")
        self._staging_bytes = staging_bytes
        self._local = threading.local()
        self._counts_lock = threading.Lock()
        self._counts = {"device": 0, "pinned": 0, "staged": 0}
        log.info("HBM tier: %d bytes on %s", allocator.capacity_bytes, self._device)

    # --- identity -----------------------------------------------------------------------------

    @property
    def device(self) -> Any:
        """The ``torch.device`` holding the buffer."""
        return self._device

    def transfer_counts(self) -> TransferCounts:
        with self._counts_lock:
            return TransferCounts(**self._counts)

    # --- the tier contract ----------------------------------------------------------------------

    def put(self, key: bytes, src: Any) -> ChunkInfo:
        """Store a copy of ``src`` (host buffer or CUDA tensor). Raises ChunkExists, CapacityError."""
        chunk_key = check_key(key)
        source = self._as_endpoint(src, writable=False)
        size = _nbytes(source)
        if size == 0:
            raise InvalidArgument("cannot store an empty chunk")
        token = object()
        offset = self._table.begin_write(chunk_key, size, token)
        try:
            self._copy(self._device_slice(offset, size), source, to_device=True)
            self._table.commit_write(chunk_key, token, offset, size, size, CodecKind.NONE)
        except BaseException:
            self._table.abort_write(chunk_key, token, offset)
            raise
        return ChunkInfo(chunk_key, size, TierKind.HBM)

    def get_into(self, key: bytes, dst: Any) -> int:
        """Copy the chunk into ``dst`` (host buffer or CUDA tensor, exactly its size)."""
        chunk_key = check_key(key)
        target = self._as_endpoint(dst, writable=True)
        extent = self._table.acquire(chunk_key)
        try:
            if _nbytes(target) != extent.size_bytes:
                raise SizeMismatch(
                    f"get_into {chunk_key.hex()}",
                    expected=extent.size_bytes,
                    actual=_nbytes(target),
                )
            device_slice = self._device_slice(extent.offset, extent.size_bytes)
            self._copy(device_slice, target, to_device=False)
        finally:
            self._table.release(extent)
        return extent.size_bytes

    def close(self) -> None:
        """Forget every chunk and drop the device buffer. Idempotent.

        Copies still in flight hold their own slices, so the memory is returned to
        torch's caching allocator when the last of them ends.
        """
        if self._table.close():
            self._buffer = None

    def __enter__(self) -> HbmTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HbmTier({self.capacity_bytes} bytes on {self._device})"

    # --- copies -------------------------------------------------------------------------------

    def _as_endpoint(self, buf: Any, *, writable: bool) -> Any:
        """A flat uint8 CUDA tensor, a flat uint8 pinned CPU tensor, or a host memoryview."""
        torch = self._torch
        if isinstance(buf, torch.Tensor):
            tensor = buf.detach()
            if not tensor.is_contiguous():
                if writable:
                    raise InvalidArgument("destination tensor must be contiguous")
                tensor = tensor.contiguous()
            flat = tensor.reshape(-1).view(torch.uint8)
            if flat.is_cuda or (flat.device.type == "cpu" and flat.is_pinned()):
                return flat
            # A pageable CPU tensor: treat it as host memory (staged).
        view = host_byte_view(buf, writable=writable)
        if view.nbytes:
            pinned = cuda.pinned_tensor_for(buffer_address(view), view.nbytes)
            if pinned is not None:
                return pinned
        return view

    def _device_slice(self, offset: int, size_bytes: int) -> Any:
        buffer = self._buffer  # read once: close() may drop it concurrently
        if buffer is None:
            raise TierUnavailable(f"HBM tier on {self._device} is closed")
        return buffer[offset : offset + size_bytes]

    def _state(self) -> _ThreadCopyState:
        state: _ThreadCopyState | None = getattr(self._local, "state", None)
        if state is None:
            state = _ThreadCopyState(self._torch, self._device, self._staging_bytes)
            self._local.state = state
        return state

    def _count(self, path: str) -> None:
        with self._counts_lock:
            self._counts[path] += 1

    def _copy(self, device_slice: Any, other: Any, *, to_device: bool) -> None:
        """Copy between a slice of the device buffer and ``other``; synchronised on return."""
        torch = self._torch
        state = self._state()
        stream = state.stream
        if isinstance(other, torch.Tensor):
            # Order after whatever the caller queued on the device it works on.
            caller_device = other.device if other.is_cuda else self._device
            stream.wait_stream(torch.cuda.current_stream(caller_device))
            with torch.cuda.stream(stream):
                if to_device:
                    device_slice.copy_(other, non_blocking=True)
                else:
                    other.copy_(device_slice, non_blocking=True)
            stream.synchronize()
            self._count("device" if other.is_cuda else "pinned")
            return
        stream.wait_stream(torch.cuda.current_stream(self._device))
        host = np.frombuffer(other, dtype=np.uint8)
        if to_device:
            self._staged_to_device(state, device_slice, host)
        else:
            self._staged_to_host(state, device_slice, host)
        self._count("staged")

    def _pieces(self, size_bytes: int) -> list[tuple[int, int]]:
        step = self._staging_bytes
        return [(off, min(step, size_bytes - off)) for off in range(0, size_bytes, step)]

    def _staged_to_device(self, state: _ThreadCopyState, dst: Any, host: np.ndarray) -> None:
        torch = self._torch
        stream = state.stream
        for i, (off, length) in enumerate(self._pieces(host.size)):
            b = i & 1
            state.events[b].synchronize()  # the DMA that last read staging[b] is done
            np.copyto(state.staging_np[b][:length], host[off : off + length])
            with torch.cuda.stream(stream):
                dst[off : off + length].copy_(state.staging[b][:length], non_blocking=True)
                state.events[b].record(stream)
        stream.synchronize()

    def _staged_to_host(self, state: _ThreadCopyState, src: Any, host: np.ndarray) -> None:
        torch = self._torch
        stream = state.stream
        pieces = self._pieces(host.size)

        def issue(i: int) -> None:
            off, length = pieces[i]
            b = i & 1
            with torch.cuda.stream(stream):
                state.staging[b][:length].copy_(src[off : off + length], non_blocking=True)
                state.events[b].record(stream)

        issue(0)
        for i, (off, length) in enumerate(pieces):
            if i + 1 < len(pieces):
                issue(i + 1)  # staging[(i+1)&1] was drained by the CPU in iteration i-1
            b = i & 1
            state.events[b].synchronize()
            np.copyto(host[off : off + length], state.staging_np[b][:length])
        stream.synchronize()


def _nbytes(endpoint: Any) -> int:
    if isinstance(endpoint, memoryview):
        return endpoint.nbytes
    return int(endpoint.numel())

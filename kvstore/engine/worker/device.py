"""Where a worker computes: ``--device cpu`` (default), ``cuda``, ``cuda:N`` or ``auto``.

The model, the KV buffers the loads fill and the saves read, and every input tensor live on the
resolved device; the KVClient copies between its host staging and those tensors layer by layer.
A CUDA device this machine lacks is refused (:func:`resolve_device`, exit code 2 from the
command line), never replaced by the CPU.
"""

from __future__ import annotations

import re

from kvstore.errors import ConfigError

__all__ = ["DEVICE_RE", "resolve_device"]

DEVICE_RE = re.compile(r"cpu|auto|cuda(:[0-9]+)?")
"""The device names a worker accepts."""


def resolve_device(device: str) -> str:
    """The torch device a worker runs on, checked against this machine.

    ``auto`` is ``cuda`` when CUDA is available, else ``cpu``. An explicit ``cuda`` or
    ``cuda:N`` on a machine without CUDA (or without device ``N``) raises ConfigError: a worker
    never falls back to the CPU silently when it was asked for a GPU.
    """
    import torch

    if not DEVICE_RE.fullmatch(device):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if device == "cpu":
        return device
    available = torch.cuda.is_available()
    if device == "auto":
        return "cuda" if available else "cpu"
    if not available:
        raise ConfigError(f"device {device!r} asked for, but CUDA is not available on this "
                          f"machine (torch {torch.__version__}, cuda build "
                          f"{torch.version.cuda or 'none'}); use --device cpu")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r} asked for, but this machine has "
                          f"{torch.cuda.device_count()} CUDA device(s)")
    return device

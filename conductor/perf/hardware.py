"""Hardware the planner reasons about: GPUs, their power, and the links KV caches travel over.

Figures are datasheet numbers (dense BF16 peak, HBM bandwidth, board TDP) unless a docstring says
otherwise; the planner treats them as upper bounds and applies utilisation factors where it estimates.

Power model (used for the energy estimate per request)
    A GPU draws ``idle_w`` when idle, ``tdp_w * prefill_power_fraction`` while running a prefill or a
    mixed (chunked) batch, and ``tdp_w * decode_power_fraction`` while running a decode-only batch:

        energy = sum over GPUs of  idle_w * span
                                 + (prefill_w - idle_w) * prefill_busy_s
                                 + (decode_w  - idle_w) * decode_busy_s

    The two fractions come from SplitwiseSim's measurements (``profiles/splitwise_perf_model.csv``,
    Llama-2-70B on 8xA100): ``peak_power`` reaches 0.95-1.0 of TDP for prompts of 2,048 tokens and more,
    while ``average_power`` over runs dominated by token generation is 0.43-0.46 of TDP. The idle draw
    (15% of TDP, about 60 W on an A100) is an assumption, not a measurement; override it per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import ConfigError, InvalidArgument

GIB = 1 << 30
GB = 1_000_000_000


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model.

    ``memory_bytes`` is the HBM size; ``peak_flops`` the dense BF16/FP16 tensor rate; ``hbm_bytes_per_s``
    the memory bandwidth; ``tdp_w`` the board power limit; ``nvlink_bytes_per_s`` the per-direction NVLink
    bandwidth between GPUs of one node (for tensor-parallel all-reduces).
    """

    name: str
    memory_bytes: int
    peak_flops: float
    hbm_bytes_per_s: float
    tdp_w: float
    nvlink_bytes_per_s: float = 300e9
    idle_fraction: float = 0.15
    prefill_power_fraction: float = 1.0
    decode_power_fraction: float = 0.45

    def __post_init__(self) -> None:
        if (
            self.memory_bytes <= 0
            or self.peak_flops <= 0
            or self.hbm_bytes_per_s <= 0
            or self.tdp_w <= 0
        ):
            raise InvalidArgument(
                f"GPU {self.name!r}: memory, flops, bandwidth and TDP must be positive"
            )
        for label, value in (
            ("idle_fraction", self.idle_fraction),
            ("prefill_power_fraction", self.prefill_power_fraction),
            ("decode_power_fraction", self.decode_power_fraction),
        ):
            if not 0.0 <= value <= 1.0:
                raise InvalidArgument(f"GPU {self.name!r}: {label} must be in [0, 1], got {value}")

    @property
    def idle_w(self) -> float:
        return self.tdp_w * self.idle_fraction

    @property
    def prefill_w(self) -> float:
        return self.tdp_w * self.prefill_power_fraction

    @property
    def decode_w(self) -> float:
        return self.tdp_w * self.decode_power_fraction


GPUS: dict[str, GpuSpec] = {
    # NVIDIA A100 SXM4 80GB datasheet: 312 TFLOPS BF16 dense, 2,039 GB/s, 400 W, NVLink 3 600 GB/s
    # (300 GB/s per direction).
    "a100-80g": GpuSpec("a100-80g", 80 * GIB, 312e12, 2.039e12, 400.0, 300e9),
    # NVIDIA H100 SXM5 80GB datasheet: 989 TFLOPS BF16 dense, 3.35 TB/s, 700 W, NVLink 4 900 GB/s.
    "h100-80g": GpuSpec("h100-80g", 80 * GIB, 989e12, 3.35e12, 700.0, 450e9),
    # NVIDIA H200 SXM 141GB datasheet: 989 TFLOPS BF16 dense, 4.8 TB/s, 700 W, NVLink 4 900 GB/s.
    "h200": GpuSpec("h200", 141 * GB, 989e12, 4.8e12, 700.0, 450e9),
}
GPU_ALIASES = {"a100": "a100-80g", "h100": "h100-80g", "h200-141g": "h200"}


def gpu_by_name(name: str) -> GpuSpec:
    """Return a GPU preset by name (``a100``, ``h100``, ``h200``, or the full names in :data:`GPUS`)."""
    key = GPU_ALIASES.get(name.lower(), name.lower())
    try:
        return GPUS[key]
    except KeyError as exc:
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}") from exc


@dataclass(frozen=True)
class Link:
    """An interconnect a KV cache crosses, with its *effective* bandwidth in bytes per second.

    ``setup_s`` is a fixed cost per transfer (connection, descriptor exchange).
    """

    name: str
    bandwidth_bytes_per_s: float
    setup_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise InvalidArgument(f"link {self.name!r}: bandwidth must be positive")
        if self.setup_s < 0:
            raise InvalidArgument(f"link {self.name!r}: setup_s must be >= 0")

    def transfer_s(self, size_bytes: int) -> float:
        """Seconds to move ``size_bytes`` over this link alone."""
        return self.setup_s + size_bytes / self.bandwidth_bytes_per_s


LINKS: dict[str, Link] = {
    "pcie-gen5-x16": Link("pcie-gen5-x16", 64 * GB),
    "roce-400g": Link("roce-400g", 45 * GB),  # 400 Gb/s RoCE, ~45 GB/s effective
    "ib-800g": Link("ib-800g", 90 * GB),  # 800 Gb/s InfiniBand (XDR), ~90 GB/s effective
    "eth-100g": Link("eth-100g", 11 * GB),  # 100 GbE, ~11 GB/s effective
    "eth-25g": Link("eth-25g", 3.125 * GB),  # 25 Gb/s line rate: DistServe's cross-node testbed
    "nvlink-a100": Link("nvlink-a100", 300 * GB),  # NVLink 3, per direction
}


def link_by_name(name: str, bandwidth_gb_per_s: float | None = None) -> Link:
    """Return an interconnect preset, or a custom one when ``bandwidth_gb_per_s`` is given.

    ``name`` may be ``custom`` (then the bandwidth is required) or any key of :data:`LINKS`.
    """
    if bandwidth_gb_per_s is not None:
        label = name if name and name != "custom" else f"custom-{bandwidth_gb_per_s:g}GB/s"
        return Link(label, bandwidth_gb_per_s * GB)
    try:
        return LINKS[name.lower()]
    except KeyError as exc:
        raise ConfigError(
            f"unknown interconnect {name!r}; known: {', '.join(LINKS)} "
            "(or pass a bandwidth for a custom link)"
        ) from exc

"""``kvtier plan kv``: KV bytes of a prompt, its transfer time, and whether pipelining hides it.

Layer-by-layer pipelining
    Prefill computes the ``L`` layers one after the other (``prefill_s / L`` each) and the KV of a layer can
    leave as soon as that layer is done (``transfer_s / L`` each). With uniform layers the last byte lands

        ``max(transfer_s / L, transfer_s - prefill_s * (L - 1) / L)``

    after the prefill ends (the *exposed* transfer). When ``transfer_s <= prefill_s`` the link keeps up with
    the compute and only the last layer's share is exposed: the transfer is *hidden*. Without pipelining
    the whole ``transfer_s`` is exposed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from conductor.perf.hardware import GIB, GpuSpec, Link
from conductor.perf.latency import LatencyModel
from conductor.perf.models import DType, ModelSpec
from kvstore.errors import InvalidArgument


def exposed_transfer_s(transfer_s: float, prefill_s: float, layers: int, pipelined: bool) -> float:
    """Seconds of KV transfer left after the prefill ends (see the module docstring)."""
    if not pipelined:
        return transfer_s
    return max(transfer_s / layers, transfer_s - prefill_s * (layers - 1) / layers)


@dataclass(frozen=True)
class LinkTransfer:
    """Moving one prompt's KV over one interconnect."""

    link: str
    bandwidth_bytes_per_s: float
    transfer_s: float
    per_layer_transfer_s: float
    exposed_s_pipelined: float
    hidden_by_layer_pipelining: bool
    transfer_to_prefill_ratio: float


@dataclass(frozen=True)
class KvPlan:
    """The answer of ``plan kv`` for one model, dtype and prompt length."""

    model: str
    dtype: str
    layers: int
    tokens: int
    bytes_per_token: int
    total_bytes: int
    total_gb: float
    total_gib: float
    gpu: str
    tp: int
    prefill_s: float
    prefill_source: str
    nics: int
    transfers: list[LinkTransfer] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def plan_kv(
    model: ModelSpec,
    dtype: DType,
    tokens: int,
    links: list[Link],
    *,
    gpu: GpuSpec,
    tp: int,
    latency: LatencyModel,
    nics: int = 1,
) -> KvPlan:
    """Size the KV cache of a ``tokens``-long prompt and compare its transfer with the prefill.

    ``nics`` links run in parallel (one NIC per GPU, KV sharded across them).
    """
    if tokens <= 0:
        raise InvalidArgument(f"tokens must be positive, got {tokens}")
    if nics <= 0:
        raise InvalidArgument(f"nics must be positive, got {nics}")
    bpt = model.kv_bytes_per_token(dtype)
    total = bpt * tokens
    prefill = latency.prefill_s([tokens], [0])
    transfers = []
    for link in links:
        bandwidth = link.bandwidth_bytes_per_s * nics
        transfer = link.setup_s + total / bandwidth
        transfers.append(
            LinkTransfer(
                link=link.name,
                bandwidth_bytes_per_s=bandwidth,
                transfer_s=transfer,
                per_layer_transfer_s=transfer / model.layers,
                exposed_s_pipelined=exposed_transfer_s(
                    transfer, prefill, model.layers, pipelined=True
                ),
                hidden_by_layer_pipelining=transfer <= prefill,
                transfer_to_prefill_ratio=transfer / prefill,
            )
        )
    return KvPlan(
        model=model.name,
        dtype=dtype.value,
        layers=model.layers,
        tokens=tokens,
        bytes_per_token=bpt,
        total_bytes=total,
        total_gb=total / 1e9,
        total_gib=total / GIB,
        gpu=gpu.name,
        tp=tp,
        prefill_s=prefill,
        prefill_source=latency.label,
        nics=nics,
        transfers=transfers,
    )


def min_tp_that_fits(
    model: ModelSpec,
    gpu: GpuSpec,
    weight_dtype: DType,
    candidates: list[int],
    memory_fraction: float = 0.9,
) -> int:
    """Smallest TP degree whose GPUs hold the weights within ``memory_fraction`` of HBM (else the largest)."""
    weights = model.weight_bytes(weight_dtype)
    for tp in sorted(candidates):
        if weights <= gpu.memory_bytes * memory_fraction * tp:
            return tp
    return max(candidates)

"""A worker's settings (:class:`WorkerConfig`) and the model it serves (:func:`load_worker_model`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.engine.model import ModelSpec
from kvstore.engine.worker.device import DEVICE_RE
from kvstore.errors import InvalidArgument
from kvstore.membership.engines import EngineRole

__all__ = ["WorkerConfig", "load_worker_model"]


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process. ``daemon_address`` is the gRPC address of ``node_id``'s daemon."""

    role: EngineRole
    instance_id: str
    node_id: str
    daemon_address: str
    etcd_endpoint: str
    etcd_prefix: str = "/kvtier/"
    model_name: str = "ref-llama"
    spec: ModelSpec = field(default_factory=ModelSpec)
    model_path: Path | None = None
    """A local Hugging Face checkpoint directory to serve instead of the seeded reference model."""
    block_tokens: int = 64
    listen_host: str = "127.0.0.1"
    listen_port: int = 0
    torch_threads: int = 1
    kv_capacity_tokens: int = 1_000_000
    """Decode KV room announced to the conductor (decode role only)."""
    lease_ttl_s: int = 5
    device: str = "cpu"
    """Where the model, its KV and the layer-by-layer loads and saves live: ``cpu``, ``cuda``,
    ``cuda:N`` or ``auto`` (cuda when this machine has one, else cpu); see
    :func:`~kvstore.engine.worker.device.resolve_device`."""
    max_decode_batch: int = 64
    """Most sequences in one batched decode step (decode role); later ones wait to join."""
    kv_rpc_timeout_s: float = 30.0
    """The KV clients' ``rpc_timeout_s``: how long a lookup, load or save waits for a daemon
    that does not answer before the worker recomputes (docs/chaos.md: 2 s under the faults)."""

    def __post_init__(self) -> None:
        if not isinstance(self.role, EngineRole):
            raise InvalidArgument(f"role must be an EngineRole, got {self.role!r}")
        for name in ("block_tokens", "torch_threads", "kv_capacity_tokens", "lease_ttl_s",
                     "max_decode_batch"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"WorkerConfig.{name} must be positive")
        if self.lease_ttl_s < 2:  # etcd's unit is a second; Registration needs two
            raise InvalidArgument("WorkerConfig.lease_ttl_s must be >= 2 seconds")
        if not self.kv_rpc_timeout_s > 0:
            raise InvalidArgument("WorkerConfig.kv_rpc_timeout_s must be > 0")
        if not 0 <= self.listen_port < 65536:
            raise InvalidArgument(f"listen_port out of range: {self.listen_port}")
        if not DEVICE_RE.fullmatch(self.device):
            raise InvalidArgument(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")



def load_worker_model(cfg: WorkerConfig, device: str = "cpu") -> Any:
    """The model a worker serves, on ``device`` (already resolved): a real checkpoint when
    ``cfg.model_path`` is set, else the reference Llama built from ``cfg.spec`` (random weights
    from its seed)."""
    from kvstore.engine.model import build_reference_model, load_model

    if cfg.model_path is not None:
        return load_model(cfg.model_path, device=device)
    return build_reference_model(cfg.spec).to(device)

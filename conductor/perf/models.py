"""Model shapes: how many KV bytes one token costs, and how many bytes the weights take.

KV bytes per token
    * Multi-head and grouped-query attention keep a key and a value vector per KV head per layer:
      ``2 x layers x kv_heads x head_dim x bytes_per_element``.
      Llama-3-70B in FP16: ``2 x 80 x 8 x 128 x 2 = 327,680`` bytes.
    * Multi-head latent attention (DeepSeek-V2/V3) caches one compressed latent plus a decoupled RoPE key
      per layer, shared by all heads: ``layers x (kv_lora_rank + qk_rope_head_dim) x bytes_per_element``.
      DeepSeek-V3 in BF16: ``61 x (512 + 64) x 2 = 70,272`` bytes.

Parameter counts of the presets are the published ones; for an arbitrary ``config.json`` they are
estimated from the shapes (embeddings, attention, MLP or MoE experts) and can be overridden.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError, InvalidArgument


class DType(enum.Enum):
    """Element type of the KV cache or the weights."""

    FP16 = "fp16"
    BF16 = "bf16"
    FP8 = "fp8"
    FP32 = "fp32"

    @property
    def size_bytes(self) -> int:
        return _DTYPE_BYTES[self]

    @classmethod
    def parse(cls, text: str) -> DType:
        aliases = {
            "float16": "fp16",
            "half": "fp16",
            "bfloat16": "bf16",
            "float32": "fp32",
            "fp8_e4m3": "fp8",
            "fp8_e5m2": "fp8",
            "float8": "fp8",
            "e4m3": "fp8",
        }
        key = aliases.get(text.lower(), text.lower())
        try:
            return cls(key)
        except ValueError as exc:
            raise ConfigError(f"unknown dtype {text!r}; use fp16, bf16, fp8 or fp32") from exc


_DTYPE_BYTES = {DType.FP16: 2, DType.BF16: 2, DType.FP8: 1, DType.FP32: 4}


@dataclass(frozen=True)
class ModelSpec:
    """The shapes of one model that matter for serving.

    ``mla_latent_dim`` is set only for multi-head latent attention (``kv_lora_rank + qk_rope_head_dim``);
    then ``kv_heads``/``head_dim`` describe the attention compute, not the cache. ``active_params`` differs
    from ``params`` for mixture-of-experts models (compute uses the active ones, memory all of them).
    """

    name: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    params: float
    active_params: float | None = None
    mla_latent_dim: int | None = None
    max_context_tokens: int | None = None
    hf_id: str | None = None

    def __post_init__(self) -> None:
        for label in ("layers", "attention_heads", "kv_heads", "head_dim", "hidden_size"):
            if getattr(self, label) <= 0:
                raise InvalidArgument(f"model {self.name!r}: {label} must be positive")
        if self.attention_heads % self.kv_heads:
            raise InvalidArgument(
                f"model {self.name!r}: attention heads ({self.attention_heads}) are not a "
                f"multiple of KV heads ({self.kv_heads})"
            )
        if not self.params > 0:
            raise InvalidArgument(f"model {self.name!r}: params must be positive")
        if self.active_params is not None and not 0 < self.active_params <= self.params:
            raise InvalidArgument(f"model {self.name!r}: active_params must be in (0, params]")
        if self.mla_latent_dim is not None and self.mla_latent_dim <= 0:
            raise InvalidArgument(f"model {self.name!r}: mla_latent_dim must be positive")

    @property
    def compute_params(self) -> float:
        """Parameters touched per token (the active ones for MoE)."""
        return self.active_params if self.active_params is not None else self.params

    @property
    def kv_elements_per_token_per_layer(self) -> int:
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim
        return 2 * self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: DType) -> int:
        """KV-cache bytes one token occupies across all layers."""
        return self.layers * self.kv_elements_per_token_per_layer * dtype.size_bytes

    def weight_bytes(self, dtype: DType) -> int:
        """Bytes of all weights in ``dtype`` (one full copy of the model)."""
        return int(self.params * dtype.size_bytes)

    @property
    def attention_dim(self) -> int:
        """Query width (heads x head dim), the factor in attention FLOPs."""
        return self.attention_heads * self.head_dim


def _preset(
    name: str,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    params: float,
    **kw: Any,
) -> ModelSpec:
    return ModelSpec(name, layers, heads, kv_heads, head_dim, hidden, params, **kw)


PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        _preset(
            "llama-3-8b",
            32,
            32,
            8,
            128,
            4096,
            8.03e9,
            max_context_tokens=8192,
            hf_id="meta-llama/Meta-Llama-3-8B",
        ),
        _preset(
            "llama-3-70b",
            80,
            64,
            8,
            128,
            8192,
            70.6e9,
            max_context_tokens=8192,
            hf_id="meta-llama/Meta-Llama-3-70B",
        ),
        _preset(
            "llama-2-70b",
            80,
            64,
            8,
            128,
            8192,
            69.0e9,
            max_context_tokens=4096,
            hf_id="meta-llama/Llama-2-70b-hf",
        ),
        _preset(
            "mistral-7b",
            32,
            32,
            8,
            128,
            4096,
            7.24e9,
            max_context_tokens=32768,
            hf_id="mistralai/Mistral-7B-v0.1",
        ),
        _preset(
            "qwen2.5-72b",
            80,
            64,
            8,
            128,
            8192,
            72.7e9,
            max_context_tokens=131072,
            hf_id="Qwen/Qwen2.5-72B",
        ),
        # MLA: kv_lora_rank 512 + qk_rope_head_dim 64; attention compute uses 128 heads x 192 (q/k head dim).
        _preset(
            "deepseek-v3",
            61,
            128,
            128,
            192,
            7168,
            671e9,
            active_params=37e9,
            mla_latent_dim=576,
            max_context_tokens=131072,
            hf_id="deepseek-ai/DeepSeek-V3",
        ),
        _preset(
            "deepseek-v2",
            60,
            128,
            128,
            192,
            5120,
            236e9,
            active_params=21e9,
            mla_latent_dim=576,
            max_context_tokens=131072,
            hf_id="deepseek-ai/DeepSeek-V2",
        ),
        _preset(
            "opt-13b",
            40,
            40,
            40,
            128,
            5120,
            12.85e9,
            max_context_tokens=2048,
            hf_id="facebook/opt-13b",
        ),
        _preset(
            "opt-66b",
            64,
            72,
            72,
            128,
            9216,
            65.7e9,
            max_context_tokens=2048,
            hf_id="facebook/opt-66b",
        ),
        _preset(
            "opt-175b",
            96,
            96,
            96,
            128,
            12288,
            175e9,
            max_context_tokens=2048,
            hf_id="facebook/opt-175b",
        ),
        _preset(
            "bloom-176b",
            70,
            112,
            112,
            128,
            14336,
            176e9,
            max_context_tokens=2048,
            hf_id="bigscience/bloom",
        ),
    )
}


def _normalise(name: str) -> str:
    key = name.strip().lower().split("/")[-1]
    key = key.removeprefix("meta-")
    key = key.replace("llama3", "llama-3").replace("llama2", "llama-2").replace("_", "-")
    return key.removesuffix("-hf")


_ALIASES = {_normalise(spec.hf_id): spec.name for spec in PRESETS.values() if spec.hf_id}


def model_by_name(name: str) -> ModelSpec:
    """Return a preset by short name (``llama-3-70b``) or Hugging Face id (``meta-llama/Meta-Llama-3-70B``)."""
    key = _normalise(name)
    key = _ALIASES.get(key, key)
    try:
        return PRESETS[key]
    except KeyError as exc:
        raise ConfigError(
            f"unknown model {name!r}; presets: {', '.join(sorted(PRESETS))} "
            "(or pass a Hugging Face config.json)"
        ) from exc


def _int(cfg: dict[str, Any], *keys: str, default: int | None = None) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"config.json: {key} must be a positive number, got {value!r}")
            return int(value)
    if default is None:
        raise ConfigError(f"config.json: missing {' / '.join(keys)}")
    return default


def estimate_params(cfg: dict[str, Any]) -> tuple[float, float]:
    """Estimate (total, active) parameters from a Hugging Face config.

    Embeddings (untied unless ``tie_word_embeddings``), attention projections, and a gated (SwiGLU, three
    matrices) or plain (two matrices) MLP; mixture-of-experts layers count every routed expert for the total
    and ``num_experts_per_tok`` of them (plus shared experts) for the active count. Norms and biases are
    ignored (well under 1%).
    """
    hidden = _int(cfg, "hidden_size", "d_model", "n_embd")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    head_dim = _int(cfg, "head_dim", default=hidden // heads)
    vocab = _int(cfg, "vocab_size", default=32000)
    inter = _int(cfg, "intermediate_size", "ffn_dim", default=4 * hidden)
    model_type = str(cfg.get("model_type", "")).lower()
    gated = model_type not in {"opt", "gpt2", "gpt_neox", "bloom", "falcon", "gptj"}
    mats = 3 if gated else 2
    if cfg.get("kv_lora_rank"):
        # MLA: down-projection to the latent, up-projections to per-head K (nope part) and V, Q projection.
        rank = _int(cfg, "kv_lora_rank")
        rope = _int(cfg, "qk_rope_head_dim", default=64)
        nope = _int(cfg, "qk_nope_head_dim", default=128)
        v_dim = _int(cfg, "v_head_dim", default=128)
        q_rank = cfg.get("q_lora_rank")
        q_proj = (
            (hidden * int(q_rank) + int(q_rank) * heads * (nope + rope))
            if q_rank
            else hidden * heads * (nope + rope)
        )
        attn = (
            q_proj + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden
        )
    else:
        attn = (
            hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
        )
    experts = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or cfg.get("num_experts")
    dense_mlp = mats * hidden * inter
    if experts:
        expert_inter = _int(cfg, "moe_intermediate_size", default=inter)
        per_tok = _int(cfg, "num_experts_per_tok", default=2)
        shared = int(cfg.get("n_shared_experts") or 0)
        dense_layers = int(cfg.get("first_k_dense_replace") or 0)
        expert_mlp = mats * hidden * expert_inter
        moe_total = (int(experts) + shared) * expert_mlp
        moe_active = (per_tok + shared) * expert_mlp
        mlp_total = dense_layers * dense_mlp + (layers - dense_layers) * moe_total
        mlp_active = dense_layers * dense_mlp + (layers - dense_layers) * moe_active
    else:
        mlp_total = mlp_active = layers * dense_mlp
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings", False) else 2)
    total = embeddings + layers * attn + mlp_total
    active = embeddings + layers * attn + mlp_active
    return float(total), float(active)


def model_from_hf_config(
    cfg: dict[str, Any], name: str | None = None, params: float | None = None
) -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed Hugging Face ``config.json``.

    ``params`` overrides the estimated parameter count (both total and active).
    """
    hidden = _int(cfg, "hidden_size", "d_model", "n_embd")
    layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, "num_attention_heads", "n_head")
    kv_heads = _int(cfg, "num_key_value_heads", default=heads)
    mla: int | None = None
    if cfg.get("kv_lora_rank"):
        mla = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim", default=64)
        head_dim = _int(cfg, "qk_nope_head_dim", default=128) + _int(
            cfg, "qk_rope_head_dim", default=64
        )
        kv_heads = heads
    else:
        head_dim = _int(cfg, "head_dim", default=hidden // heads)
    total, active = estimate_params(cfg)
    if params is not None:
        total = active = params
    label = name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "custom-model")
    context = cfg.get("max_position_embeddings")
    return ModelSpec(
        label,
        layers,
        heads,
        kv_heads,
        head_dim,
        hidden,
        total,
        active_params=active if active < total else None,
        mla_latent_dim=mla,
        max_context_tokens=int(context) if isinstance(context, int) else None,
    )


def load_model(
    name: str | None = None, config_path: str | Path | None = None, params: float | None = None
) -> ModelSpec:
    """Resolve ``--model`` / ``--config``: a preset, or a ``config.json`` file (which wins when both given)."""
    if config_path is not None:
        path = Path(config_path)
        try:
            cfg = json.loads(path.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"model config {path} is not valid JSON: {exc}") from exc
        if not isinstance(cfg, dict):
            raise ConfigError(f"model config {path} is not a JSON object")
        return model_from_hf_config(cfg, name=name or path.parent.name or None, params=params)
    if name is None:
        raise ConfigError("give a model preset name or a config.json path")
    spec = model_by_name(name)
    return replace(spec, params=params, active_params=None) if params is not None else spec

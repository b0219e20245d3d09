"""Model architecture from a Hugging Face ``config.json``: Llama, Qwen3, Qwen3-MoE, Mixtral and
DeepSeek-V3 (MLA), with the derived sizes engines and the cost model need. Field names follow the
Hugging Face configs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


class UnsupportedModelError(ValueError):
    """The config names an architecture kiln cannot build, or is not a valid config."""


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN: ``num_experts`` routed experts, ``top_k`` per token, shared
    experts and the dense layers.

    Attributes:
        norm_topk_prob: renormalise the top-k router probabilities to sum to 1.
        round_router_weights: cast the top-k weights to the model dtype before scaling
            (Qwen3-MoE); False keeps them float32 (Mixtral).
        load_zipf_exponent: kiln's, not Hugging Face's: the expert-load skew engines impose on
            random-weight routers; 0 = the router's own load.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    round_router_weights: bool = True
    load_zipf_exponent: float = 0.0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention ranks (the cache holds ``kv_lora_rank +
    qk_rope_head_dim`` values per token and layer).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer's architecture; sizes in elements, ``head_dim`` defaulting to
    ``hidden_size // num_attention_heads``.
    """

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str = "bfloat16"
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def is_moe(self) -> bool:
        """True when some layers route tokens to experts."""
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN."""
        return self.moe is not None and layer not in self.moe.dense_layers

    def attention_params(self) -> int:
        """Weights of one attention block (projections and q/k norms), elements."""
        h, d = self.hidden_size, self.head_dim
        if self.mla is not None:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:
                q = (
                    h * m.q_lora_rank
                    + m.q_lora_rank
                    + m.q_lora_rank * self.num_attention_heads * qk
                )
            else:
                q = h * self.num_attention_heads * qk
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            kv += m.kv_lora_rank * self.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)
            o = self.num_attention_heads * m.v_head_dim * h
            return q + kv + o
        q = h * self.num_attention_heads * d
        kv = 2 * h * self.num_key_value_heads * d
        o = self.num_attention_heads * d * h
        bias = (
            (self.num_attention_heads + 2 * self.num_key_value_heads) * d
            if self.attention_bias
            else 0
        )
        norms = 2 * d if self.qk_norm else 0
        return q + kv + o + bias + norms

    def ffn_params(self, layer: int) -> tuple[int, int]:
        """(total, active per token) FFN weights of ``layer``, elements (router included for
        MoE).
        """
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            dense = 3 * h * self.intermediate_size
            return dense, dense
        assert self.moe is not None
        m = self.moe
        expert = 3 * h * m.intermediate_size
        router = h * m.num_experts
        shared = m.num_shared_experts * expert
        return router + m.num_experts * expert + shared, router + m.top_k * expert + shared

    def param_count(self) -> int:
        """Total weights, elements (embedding, layers, final norm, LM head unless tied)."""
        embed = self.vocab_size * self.hidden_size
        layers = sum(
            self.attention_params() + self.ffn_params(i)[0] + 2 * self.hidden_size
            for i in range(self.num_hidden_layers)
        )
        head = 0 if self.tie_word_embeddings else embed
        return embed + layers + self.hidden_size + head

    def active_param_count(self) -> int:
        """Weights read per token when every expert load is distinct (the LM head, not embedding
        rows).
        """
        layers = sum(
            self.attention_params() + self.ffn_params(i)[1] + 2 * self.hidden_size
            for i in range(self.num_hidden_layers)
        )
        return layers + self.hidden_size + self.vocab_size * self.hidden_size

    def kv_elements_per_token(self) -> int:
        """KV-cache elements one token occupies across all layers (K and V; MLA: latent + rope)."""
        if self.mla is not None:
            per_layer = self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_key_value_heads * self.head_dim
        return per_layer * self.num_hidden_layers

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """KV-cache bytes per token across all layers in ``dtype``."""
        return self.kv_elements_per_token() * DTYPE_BYTES[dtype]

    def with_layers(self, num_hidden_layers: int) -> ModelConfig:
        """The same architecture truncated to its first ``num_hidden_layers`` layers."""
        if not 1 <= num_hidden_layers <= self.num_hidden_layers:
            raise ValueError(f"layers must be within 1..{self.num_hidden_layers}")
        return replace(self, num_hidden_layers=num_hidden_layers)

    def with_expert_skew(self, zipf_exponent: float) -> ModelConfig:
        """The same with :attr:`MoEConfig.load_zipf_exponent` set (dense configs unchanged);
        ValueError if negative or not finite.
        """
        if not (math.isfinite(zipf_exponent) and zipf_exponent >= 0):
            raise ValueError(f"the Zipf exponent must be finite and >= 0, got {zipf_exponent}")
        if self.moe is None:
            return self
        return replace(self, moe=replace(self.moe, load_zipf_exponent=float(zipf_exponent)))


def _require(cfg: dict[str, Any], key: str, name: str) -> Any:
    if key not in cfg:
        raise UnsupportedModelError(f"{name}: config has no {key!r}")
    return cfg[key]


def parse_config(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """A ModelConfig from a parsed ``config.json``; UnsupportedModelError for an unknown
    ``model_type`` or a missing field.
    """
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{name}: config.json must be a JSON object")
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name}: unsupported architecture {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    heads = int(_require(cfg, "num_attention_heads", name))
    hidden = int(_require(cfg, "hidden_size", name))
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    layers = int(_require(cfg, "num_hidden_layers", name))
    if model_type == "qwen3_moe" and int(cfg.get("num_experts") or 0) > 0:
        # transformers' Qwen3MoeDecoderLayer: a layer is sparse unless listed in
        # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step.
        sparse_step = int(cfg.get("decoder_sparse_step") or 1)
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % sparse_step != 0)
        moe = MoEConfig(
            num_experts=int(cfg["num_experts"]),
            top_k=int(_require(cfg, "num_experts_per_tok", name)),
            intermediate_size=int(_require(cfg, "moe_intermediate_size", name)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=dense,
            round_router_weights=True,
        )
    elif model_type == "mixtral":
        moe = MoEConfig(
            num_experts=int(_require(cfg, "num_local_experts", name)),
            top_k=int(_require(cfg, "num_experts_per_tok", name)),
            intermediate_size=int(_require(cfg, "intermediate_size", name)),
            norm_topk_prob=True,
            round_router_weights=False,
        )
    elif model_type == "deepseek_v3":
        moe = MoEConfig(
            num_experts=int(cfg["n_routed_experts"]),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            num_shared_experts=int(cfg.get("n_shared_experts", 0)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=tuple(range(int(cfg.get("first_k_dense_replace", 0)))),
        )
        mla = MLAConfig(
            q_lora_rank=cfg.get("q_lora_rank"),
            kv_lora_rank=int(cfg["kv_lora_rank"]),
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
        )
    return ModelConfig(
        name=name,
        model_type=model_type,
        vocab_size=int(_require(cfg, "vocab_size", name)),
        hidden_size=hidden,
        intermediate_size=int(_require(cfg, "intermediate_size", name)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        rope_scaling=cfg.get("rope_scaling"),
        torch_dtype=str(cfg.get("torch_dtype", "bfloat16")),
        moe=moe,
        mla=mla,
        raw=cfg,
    )


def parse_config_json(text: str, name: str = "model") -> ModelConfig:
    """A ModelConfig from a workload's ``model.config_json`` text.

    Raises:
        UnsupportedModelError: empty, not JSON, or :func:`parse_config`'s reasons.
    """
    if not text.strip():
        raise UnsupportedModelError(
            "workload.model.config_json is empty: send the config.json text"
        )
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{name}: config_json is not valid JSON ({exc})") from None
    return parse_config(cfg, name)


def load_config(path: str | Path) -> ModelConfig:
    """Read and parse a ``config.json`` (named after its stem, or its directory for
    ``config.json``). FileNotFoundError, or UnsupportedModelError for bad JSON or an unsupported
    architecture.
    """
    p = Path(path)
    name = p.parent.name if p.name == "config.json" else p.stem
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{p}: not valid JSON ({exc})") from None
    return parse_config(cfg, name)

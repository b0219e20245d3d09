"""Model architecture from a Hugging Face ``config.json``: Llama, Qwen3, Qwen3-MoE, Mixtral,
DeepSeek-V3 / Kimi-K2 (MLA), GLM-5 (MLA + sparse-attention indexer), MiniMax-M2 (its main
model; MTP modules ignored) and gpt-oss,
with the derived sizes engines and the cost model need. Field names follow the Hugging Face
configs. Every number is checked against a stated range (:mod:`kiln.workloads.config_bounds`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from kiln.domain.quoting import quote
from kiln.workloads import glm_moe_dsa, gpt_oss
from kiln.workloads.config_bounds import (
    MAX_CONFIG_CHARS,
    MAX_DTYPE_CHARS,
    MAX_NAME_CHARS,
    MAX_ROPE_THETA,
    MAX_ROUTED_SCALING,
    finite_tree,
    layer_list,
    real,
    whole,
)
from kiln.workloads.config_bounds import ConfigRangeError as ConfigRangeError
from kiln.workloads.config_bounds import UnsupportedModelError as UnsupportedModelError

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "kimi_k2", "minimax_m2",
    "gpt_oss", "glm_moe_dsa",
)  # fmt: skip
DEEPSEEK_V3_TYPES = ("deepseek_v3", "kimi_k2")
"""Model types of the DeepSeek-V3 architecture (Kimi-K2's ``config.json`` says ``kimi_k2`` and
``DeepseekV3ForCausalLM``)."""
MLA_TYPES = (*DEEPSEEK_V3_TYPES, glm_moe_dsa.GLM_MOE_DSA)
"""Model types built with MLA and DeepSeek-V3's MoE (GLM-5 adds the indexer)."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN: ``num_experts`` routed experts, ``top_k`` per token, shared
    experts and the dense layers.

    Attributes:
        norm_topk_prob: renormalise the top-k router probabilities to sum to 1.
        round_router_weights: cast the top-k weights to the model dtype before scaling
            (Qwen3-MoE); False keeps them float32 (Mixtral, DeepSeek-V3).
        scoring: ``"softmax"`` (top-k of the softmax) or ``"sigmoid"`` (DeepSeek-V3's
            ``noaux_tc``: top-k of ``sigmoid + e_score_correction_bias`` within the best
            ``topk_group`` of ``n_group`` expert groups, weights from the un-biased sigmoid).
        n_group, topk_group: expert groups and the groups a token may pick from (sigmoid).
        routed_scaling_factor: multiplies the routed weights (after ``norm_topk_prob``).
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
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    load_zipf_exponent: float = 0.0


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek multi-head latent attention ranks (the cache holds ``kv_lora_rank +
    qk_rope_head_dim`` values per token and layer). ``rope_interleave``: the rope dims of the
    checkpoint's projections are interleaved pairs (transformers' ``rope_interleave``, default
    True).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True


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
    qk_norm_type: str = "per_head"
    """``per_head`` (Qwen3: weights ``[D]``, each head) or ``per_layer`` (MiniMax-M2: weights
    ``[heads * D]``, over a token's whole q or k projection)."""
    rope_scaling: dict[str, Any] | None = None
    torch_dtype: str = "bfloat16"
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    sliding_window: int | None = None
    """Tokens a sliding-window layer attends to (gpt-oss; :mod:`kiln.workloads.gpt_oss`)."""
    sliding_layers: tuple[int, ...] = ()
    """The layers that attend within ``sliding_window`` (the others attend to all)."""
    dsa: glm_moe_dsa.IndexerConfig | None = None
    """GLM-5's sparse-attention indexer (:mod:`kiln.workloads.glm_moe_dsa`), or None."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # ------------------------------------------------------------------ derived sizes
    @property
    def is_moe(self) -> bool:
        """True when some layers route tokens to experts."""
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN."""
        return self.moe is not None and layer not in self._dense_layer_set

    @cached_property
    def _dense_layer_set(self) -> frozenset[int]:
        return frozenset(self.moe.dense_layers if self.moe is not None else ())

    @cached_property
    def _moe_prefix(self) -> tuple[int, ...]:
        """``[i]``: MoE layers among the first ``i`` (so range counts cost O(1))."""
        out, n = [0], 0
        for i in range(self.num_hidden_layers):
            n += self.is_moe_layer(i)
            out.append(n)
        return tuple(out)

    def moe_layers_in(self, layers: range) -> int:
        """MoE layers within ``layers`` (a step-1 range inside ``0..num_hidden_layers``)."""
        return self._moe_prefix[layers.stop] - self._moe_prefix[layers.start]

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
            index = self.dsa.params(h, m.q_lora_rank or 0) if self.dsa is not None else 0
            return q + kv + o + index
        q = h * self.num_attention_heads * d
        kv = 2 * h * self.num_key_value_heads * d
        o = self.num_attention_heads * d * h
        bias = (
            (self.num_attention_heads + 2 * self.num_key_value_heads) * d
            if self.attention_bias
            else 0
        )
        norms = 2 * d if self.qk_norm else 0
        if self.qk_norm and self.qk_norm_type == "per_layer":
            norms = (self.num_attention_heads + self.num_key_value_heads) * d
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

    def kv_elements_per_layer(self) -> int:
        """KV-cache elements one token occupies in one layer: K and V of every KV head, or for
        MLA one latent and one rope key (``kv_lora_rank + qk_rope_head_dim``, no x2), plus for
        GLM-5 the indexer's key (``index_head_dim``).
        """
        if self.mla is not None:
            index = self.dsa.head_dim if self.dsa is not None else 0
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim + index
        return 2 * self.num_key_value_heads * self.head_dim

    def kv_elements_per_token(self) -> int:
        """KV-cache elements one token occupies across all layers (K and V; MLA: latent + rope)."""
        return self.kv_elements_per_layer() * self.num_hidden_layers

    def kv_bytes_per_token(self, dtype: str = "bfloat16") -> int:
        """KV-cache bytes per token across all layers in ``dtype``. Sliding-window layers
        (gpt-oss) count as full ones: kiln's cache holds the whole context in every layer."""
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


def _model_type(cfg: Any, name: str) -> str:
    if not isinstance(cfg, dict):
        raise UnsupportedModelError(f"{name}: config.json must be a JSON object")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{name}: unsupported architecture {quote(model_type)} "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return model_type


def _moe(cfg: dict[str, Any], model_type: str, name: str, layers: int) -> MoEConfig | None:
    if model_type == "qwen3_moe" and cfg.get("num_experts"):
        experts = whole(cfg, "num_experts", name)
        # transformers' Qwen3MoeDecoderLayer: a layer is sparse unless listed in
        # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step.
        sparse_step = whole(cfg, "decoder_sparse_step", name, 1, high=layers)
        mlp_only = layer_list(cfg, "mlp_only_layers", name, layers)
        dense = tuple(i for i in range(layers) if i in mlp_only or (i + 1) % sparse_step != 0)
        return MoEConfig(
            num_experts=experts,
            top_k=whole(cfg, "num_experts_per_tok", name, high=experts),
            intermediate_size=whole(cfg, "moe_intermediate_size", name),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=dense,
            round_router_weights=True,
        )
    if model_type in ("mixtral", gpt_oss.GPT_OSS, "minimax_m2"):
        # Every layer MoE, `num_local_experts` of `intermediate_size`, top-k renormalised.
        # GptOssTopKRouter: softmax over the top-k logits, in the model dtype. MiniMax-M2's
        # MiniMaxM2TopKRouter: top-k of sigmoid + e_score_correction_bias, weights the un-biased
        # sigmoid renormalised.
        experts = whole({"num_experts": cfg.get("num_local_experts")}, "num_experts", name)
        return MoEConfig(
            num_experts=experts,
            top_k=whole(cfg, "num_experts_per_tok", name, high=experts),
            intermediate_size=whole(cfg, "intermediate_size", name),
            norm_topk_prob=True,
            round_router_weights=model_type == gpt_oss.GPT_OSS,
            scoring="sigmoid" if model_type == "minimax_m2" else "softmax",
        )
    if model_type in MLA_TYPES:
        # transformers' DeepseekV3DecoderLayer (and GlmMoeDsaDecoderLayer): layer i is MoE when
        # i >= first_k_dense_replace;
        # DeepseekV3TopkRouter: sigmoid scores, group-limited top-k, routed_scaling_factor.
        experts = whole({"num_experts": cfg.get("n_routed_experts")}, "num_experts", name)
        first_dense = whole(cfg, "first_k_dense_replace", name, 0, high=layers)
        n_group = whole(cfg, "n_group", name, 1, high=experts)
        return MoEConfig(
            num_experts=experts,
            top_k=whole(cfg, "num_experts_per_tok", name, high=experts),
            intermediate_size=whole(cfg, "moe_intermediate_size", name),
            num_shared_experts=whole(cfg, "n_shared_experts", name, 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            dense_layers=tuple(range(first_dense)),
            round_router_weights=False,
            scoring="sigmoid",
            n_group=n_group,
            topk_group=whole(cfg, "topk_group", name, 1, high=n_group),
            routed_scaling_factor=real(
                cfg, "routed_scaling_factor", name, 1.0, low=0.0, high=MAX_ROUTED_SCALING
            ),
        )
    return None


def _mla(cfg: dict[str, Any], model_type: str, name: str) -> MLAConfig | None:
    if model_type not in MLA_TYPES:
        return None
    return MLAConfig(
        q_lora_rank=whole(cfg, "q_lora_rank", name) if cfg.get("q_lora_rank") else None,
        kv_lora_rank=whole(cfg, "kv_lora_rank", name),
        qk_nope_head_dim=whole(cfg, "qk_nope_head_dim", name),
        qk_rope_head_dim=whole(cfg, "qk_rope_head_dim", name),
        v_head_dim=whole(cfg, "v_head_dim", name),
        rope_interleave=cfg.get("rope_interleave") is not False,
    )


def _optional_dict(cfg: dict[str, Any], key: str, name: str) -> dict[str, Any] | None:
    value = cfg.get(key)
    if value is not None and not isinstance(value, dict):
        raise UnsupportedModelError(f"{name}: {key} must be a JSON object or null")
    finite_tree(value, name, key)
    return value


def parse_config(cfg: dict[str, Any], name: str = "model") -> ModelConfig:
    """A ModelConfig from a parsed ``config.json``, every number within
    :data:`kiln.workloads.config_bounds.LIMITS`.

    Raises:
        UnsupportedModelError: an unknown ``model_type``, a missing field, a value of the wrong
            kind (text or a fraction for a count, NaN, ``1e400``), or query heads not a multiple
            of the KV heads.
        ConfigRangeError: a number out of range (e.g. 0 heads, 3x10^8 layers).
    """
    if len(name) > MAX_NAME_CHARS:
        raise UnsupportedModelError(
            f"model name {quote(name)} is longer than {MAX_NAME_CHARS} characters"
        )
    model_type = _model_type(cfg, name)
    layers = whole(cfg, "num_hidden_layers", name)
    heads = whole(cfg, "num_attention_heads", name)
    hidden = whole(cfg, "hidden_size", name)
    kv_heads = whole(cfg, "num_key_value_heads", name, heads, high=heads)
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"{name}: {heads} attention heads are not a multiple of {kv_heads} KV heads"
        )
    head_dim = whole(cfg, "head_dim", name) if cfg.get("head_dim") else None
    if head_dim is None:
        head_dim = whole({"head_dim": hidden // heads}, "head_dim", f"{name} (hidden / heads)")
    torch_dtype = cfg.get("torch_dtype", "bfloat16")
    if not isinstance(torch_dtype, str) or len(torch_dtype) > MAX_DTYPE_CHARS:
        raise UnsupportedModelError(f"{name}: torch_dtype {quote(torch_dtype)} is not a dtype")
    _optional_dict(cfg, "quantization_config", name)
    _optional_dict(cfg, "rope_parameters", name)
    return ModelConfig(
        name=name,
        model_type=model_type,
        vocab_size=whole(cfg, "vocab_size", name),
        hidden_size=hidden,
        intermediate_size=whole(cfg, "intermediate_size", name),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=real(cfg, "rms_norm_eps", name, 1e-6, low=0.0, high=1.0),
        rope_theta=real(cfg, "rope_theta", name, 10000.0, low=0.0, high=MAX_ROPE_THETA),
        max_position_embeddings=whole(cfg, "max_position_embeddings", name, 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "minimax_m2"),
        qk_norm_type="per_layer" if model_type == "minimax_m2" else "per_head",
        rope_scaling=_optional_dict(cfg, "rope_scaling", name),
        torch_dtype=torch_dtype,
        moe=_moe(cfg, model_type, name, layers),
        mla=_mla(cfg, model_type, name),
        sliding_window=gpt_oss.sliding_window(cfg, name) if model_type == gpt_oss.GPT_OSS else None,
        sliding_layers=(
            gpt_oss.sliding_layers(cfg, name, layers) if model_type == gpt_oss.GPT_OSS else ()
        ),
        dsa=(
            glm_moe_dsa.indexer_config(cfg, name) if model_type == glm_moe_dsa.GLM_MOE_DSA else None
        ),
        raw=cfg,
    )


def read_config_json(text: str, name: str = "model") -> Any:
    """``config_json`` text parsed (any JSON value; :func:`parse_config` checks it).

    Raises:
        UnsupportedModelError: empty, longer than ``MAX_CONFIG_CHARS``, not JSON, or nested too
            deeply to parse.
    """
    if not text.strip():
        raise UnsupportedModelError(
            "workload.model.config_json is empty: send the config.json text"
        )
    if len(text) > MAX_CONFIG_CHARS:
        raise UnsupportedModelError(
            f"{name}: config_json is {len(text)} characters; the limit is {MAX_CONFIG_CHARS}"
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise UnsupportedModelError(f"{name}: config_json is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UnsupportedModelError(f"{name}: config_json is not valid JSON ({exc})") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        message = f"{name}: config_json has an unreadable value ({exc})"
        raise UnsupportedModelError(message) from None


def parse_config_json(text: str, name: str = "model") -> ModelConfig:
    """A ModelConfig from a workload's ``model.config_json`` text.

    Raises:
        UnsupportedModelError: :func:`read_config_json`'s and :func:`parse_config`'s reasons
            (:class:`ConfigRangeError` for a number out of range).
    """
    return parse_config(read_config_json(text, name), name)


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
    except ValueError as exc:  # e.g. an integer of more digits than Python converts
        raise UnsupportedModelError(f"{p}: an unreadable value ({exc})") from None
    return parse_config(cfg, name)

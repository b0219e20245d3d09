"""Build a :class:`~kiln.workloads.models.decoder.DecoderModel` from a model config.

gpt-fast's ``Transformer.from_name`` for kiln: the config picks the architecture, the weights
come from a local safetensors directory or a seed, the cache is static.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from kiln.domain.quoting import quote
from kiln.workloads import glm_moe_dsa, gpt_oss, minimax_m2
from kiln.workloads.config import DEEPSEEK_V3_TYPES, ModelConfig
from kiln.workloads.glm_moe_dsa_weights import load_glm, seeded_random_glm
from kiln.workloads.gpt_oss import GPT_OSS
from kiln.workloads.gpt_oss_weights import load_gpt_oss, seeded_random_gpt_oss
from kiln.workloads.mla_weights import CORRECTION_BIAS, mla_shapes, seeded_random_mla
from kiln.workloads.models import routing
from kiln.workloads.models.binding import OpBinding
from kiln.workloads.models.decoder import DecoderModel
from kiln.workloads.models.kv_cache import StaticKVCache
from kiln.workloads.models.rope_frequencies import SUPPORTED_ROPE_TYPES, rope_parameters
from kiln.workloads.weights import WeightStore, load_safetensors, seeded_random

BUILDABLE_MODEL_TYPES = (
    "llama", "qwen3", "qwen3_moe", "mixtral", *DEEPSEEK_V3_TYPES, minimax_m2.MINIMAX_M2,
    GPT_OSS, glm_moe_dsa.GLM_MOE_DSA,
)  # fmt: skip


class UnbuildableModelError(NotImplementedError):
    """kiln parses this config but cannot build it yet (an unsupported feature); the message
    says which and why."""


def _mla_refusal(config: ModelConfig) -> str | None:
    """What of a DeepSeek-V3-architecture config kiln does not build (None: nothing)."""
    raw, moe, mla = config.raw, config.moe, config.mla
    assert mla is not None
    if config.attention_bias:
        return "MLA with projection biases"
    if mla.qk_rope_head_dim % 2:
        return f"an odd qk_rope_head_dim ({mla.qk_rope_head_dim})"
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        return f"router scoring {quote(raw.get('scoring_func'))} (DeepSeek-V3 scores by sigmoid)"
    if raw.get("topk_method", "noaux_tc") != "noaux_tc":
        return f"top-k method {quote(raw.get('topk_method'))} (built: 'noaux_tc')"
    if raw.get("moe_layer_freq", 1) != 1:
        return f"moe_layer_freq {quote(raw.get('moe_layer_freq'))} (built: 1)"
    if moe is not None and moe.n_group > 1:
        per_group, rest = divmod(moe.num_experts, moe.n_group)
        if rest or per_group < 2:
            return f"{moe.num_experts} experts in {moe.n_group} groups (equal groups of 2 or more)"
        if moe.top_k > moe.topk_group * per_group:
            return f"top-{moe.top_k} routing within {moe.topk_group} groups of {per_group}"
    return None


def check_buildable(config: ModelConfig) -> None:
    """Raise :class:`UnbuildableModelError` unless ``config`` is a Llama / Qwen3 dense model, a
    Qwen3-MoE / Mixtral model (top-k routed SwiGLU experts, no shared experts) with default or
    Llama-3 RoPE, or a DeepSeek-V3 / Kimi-K2 model (MLA, sigmoid ``noaux_tc`` group-limited
    routing, shared experts, dense first layers, YaRN allowed), or a MiniMax-M2 model (main
    model only; :func:`kiln.workloads.minimax_m2.refusal`), or a GLM-5 model (DeepSeek-V3's plus
    the sparse-attention indexer; :func:`kiln.workloads.glm_moe_dsa.refusal`), or a gpt-oss
    model (sinks, sliding windows, YaRN, clamped-SwiGLU experts; :mod:`kiln.workloads.gpt_oss`),
    each with SiLU, no MLP bias and no
    sliding window."""
    why = _refusal(config)
    if why is not None:
        raise UnbuildableModelError(f"{config.name}: kiln cannot build {why}")


def _refusal(config: ModelConfig) -> str | None:
    """The first feature of ``config`` kiln does not build, or None."""
    raw = config.raw
    if config.mla is not None:
        why = _mla_refusal(config)
        if why is None and config.dsa is not None:
            m = config.mla
            why = glm_moe_dsa.refusal(config.raw, config.dsa, m.q_lora_rank, m.qk_rope_head_dim)
        if why is not None:
            return why
    elif config.moe is not None and config.moe.num_shared_experts:
        return f"{config.model_type!r}: shared experts"
    if config.model_type == minimax_m2.MINIMAX_M2 and (why := minimax_m2.refusal(config)):
        return why
    if config.model_type == GPT_OSS and (why := gpt_oss.refusal(config.raw)):
        return why
    if config.model_type not in BUILDABLE_MODEL_TYPES:
        return f"model type {config.model_type!r} (buildable: {', '.join(BUILDABLE_MODEL_TYPES)})"
    if raw.get("mlp_bias"):
        return "MLP biases"
    if raw.get("use_sliding_window") or (
        config.model_type == "mixtral" and raw.get("sliding_window")
    ):
        return "sliding-window attention"
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {quote(raw.get('hidden_act'))}"
    kind = rope_parameters(config)["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        return f"RoPE type {quote(kind)} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    if kind == "yarn" and config.mla is None and config.model_type != GPT_OSS:
        # its cos/sin factor is applied by mla_proj, or by gpt-oss's attention scale
        return "RoPE type 'yarn' outside latent attention and gpt-oss"
    return None


def _load_checkpoint(
    weights_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> WeightStore:
    """``weights_dir``'s weights for ``cfg`` (block-FP8 and MXFP4 dequantized into ``dtype``:
    :mod:`kiln.workloads.quantized_checkpoint`); WeightError for missing or mis-shaped ones."""
    if cfg.dsa is not None:  # MLA plus the indexer's weights
        return load_glm(weights_dir, cfg, dtype, device)
    if cfg.model_type == GPT_OSS:
        return load_gpt_oss(weights_dir, cfg, dtype, device)
    if cfg.model_type == minimax_m2.MINIMAX_M2:
        shapes = minimax_m2.minimax_shapes(cfg)
        bias = (minimax_m2.CORRECTION_BIAS,)
        return load_safetensors(weights_dir, cfg, dtype, device, shapes=shapes, float32=bias)
    if cfg.mla is not None:
        return load_safetensors(
            weights_dir, cfg, dtype, device, shapes=mla_shapes(cfg), float32=(CORRECTION_BIAS,)
        )
    return load_safetensors(weights_dir, cfg, dtype, device)


def build_model(
    config: ModelConfig,
    *,
    layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
    weights_dir: str | Path | None = None,
    weights: WeightStore | None = None,
    max_batch: int = 1,
    max_seq_len: int = 2048,
    recipe: Mapping[str, str] | None = None,
    allow_lossy: bool = False,
) -> DecoderModel:
    """A model of ``config`` made of swappable ops.

    Args:
        config: the architecture.
        layers: keep only the first N layers (the fast tier; embedding and LM head kept).
        dtype, device: of weights, activations and cache.
        seed: for :func:`~kiln.workloads.weights.seeded_random` when no weights are given, and for
            the router biases fitted here to ``config.moe.load_zipf_exponent`` (measured load:
            ``model.expert_load``; :mod:`kiln.workloads.models.routing`). Checkpoint weights and a
            given store get no new bias.
        weights_dir: a local directory of ``*.safetensors`` with HF names (instead of random);
            block-FP8 and MXFP4 checkpoints are dequantized into ``dtype`` at load.
        weights: an existing store to share (instead of reading or drawing weights).
        max_batch, max_seq_len: KV-cache capacity (sequences, tokens per sequence).
        recipe: op → implementation name; other ops use ``reference``.
        allow_lossy: permit lossy implementations in ``recipe``.

    Raises:
        UnbuildableModelError: an architecture or feature kiln cannot build yet.
        ValueError: ``layers`` outside ``1..num_hidden_layers``.
        kiln.workloads.weights.WeightError: missing or mis-shaped weights.
        kiln.ops.registry.UnknownOpError, UnknownImplementationError: a bad recipe.
    """
    check_buildable(config)
    cfg = config.with_layers(layers) if layers is not None else config
    binding = OpBinding.from_recipe(recipe, allow_lossy=allow_lossy)
    skew = cfg.moe is not None and cfg.moe.load_zipf_exponent > 0
    calibrate = False
    if weights is None:
        if weights_dir is not None:
            weights = _load_checkpoint(weights_dir, cfg, dtype, device)
        else:
            random = seeded_random_mla if cfg.mla is not None else seeded_random
            if cfg.dsa is not None:  # MLA plus the indexer's weights
                random = seeded_random_glm
            if cfg.model_type == minimax_m2.MINIMAX_M2:
                random = minimax_m2.seeded_random_minimax
            if cfg.model_type == GPT_OSS:  # experts in kiln's layout: gpt_oss_weights
                random = seeded_random_gpt_oss
            weights = random(cfg, dtype, device, seed)
            if skew:
                routing.add_router_biases(weights, cfg)
                calibrate = True
    cache = StaticKVCache.for_config(
        cfg, max_batch=max_batch, max_len=max_seq_len, dtype=dtype, device=device
    )
    model = DecoderModel(cfg, weights, cache, binding)
    if calibrate:
        model.expert_load = routing.calibrate_router_bias(model, seed=seed)
    return model

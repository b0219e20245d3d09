"""One gpt-oss decoder layer's own op sites (transformers' ``GptOssDecoderLayer``; weights:
:mod:`kiln.workloads.gpt_oss_weights`).

``attention`` gets ``sinks`` and ``window`` (the layer's ``sliding_window`` or None) and the
softmax scale ``head_dim ** -0.5 * f ** 2``, ``f`` YaRN's cos/sin factor (transformers multiplies
cos and sin of q and k by ``f``; the cache holds the unscaled keys, the same scores). ``moe``
gets the router's bias as ``router_bias`` (float32) and the experts' biases and clamped SwiGLU
as ``swiglu``; ``norm_topk_prob`` makes route()'s top-k of the softmax equal to
``GptOssTopKRouter``'s softmax over the top-k logits. With an expert-load skew (random weights),
the fitted skew bias replaces the router's bias.
"""

from __future__ import annotations

from typing import Any

from kiln.ops.moe_clamped import ClampedSwiGLU
from kiln.workloads import gpt_oss
from kiln.workloads.config import ModelConfig
from kiln.workloads.gpt_oss_weights import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS
from kiln.workloads.models import rope_frequencies
from kiln.workloads.models.slot_types import Site
from kiln.workloads.weights import ROUTER_BIAS, WeightStore


def attention_scale(config: ModelConfig) -> float:
    """``head_dim ** -0.5`` times the square of YaRN's cos/sin factor (1 without YaRN)."""
    f = rope_frequencies.attention_factor(config)
    return float(config.head_dim**-0.5 * f * f)


def gpt_oss_sites(config: ModelConfig, store: WeightStore, i: int) -> tuple[Site, Site]:
    """Layer ``i``'s ``attention`` and ``moe`` sites (module docstring; the other sites are the
    GQA decoder's); WeightError for a missing weight."""
    assert config.moe is not None
    p = f"model.layers.{i}"
    attn, mlp = f"{p}.self_attn", f"{p}.mlp"
    window = config.sliding_window if i in config.sliding_layers else None
    sinks = store[f"{attn}.sinks"]
    attention = {"scale": attention_scale(config), "sinks": sinks, "window": window}
    alpha, limit = gpt_oss.swiglu_constants(config.raw, config.name)
    skew = store.get(f"{mlp}.{ROUTER_BIAS}")
    moe: dict[str, Any] = {
        "router_weight": store[f"{mlp}.router.weight"],
        "gate_up_weight": store[f"{p}.{GATE_UP}"],
        "down_weight": store[f"{p}.{DOWN}"],
        "top_k": config.moe.top_k,
        "norm_topk_prob": True,
        "round_router_weights": config.moe.round_router_weights,
        "router_bias": skew if skew is not None else store[f"{mlp}.router.bias"].float(),
        "swiglu": ClampedSwiGLU(
            gate_up_bias=store[f"{p}.{GATE_UP_BIAS}"],
            down_bias=store[f"{p}.{DOWN_BIAS}"],
            alpha=alpha,
            limit=limit,
        ),
    }
    return Site("attention", attn, attention), Site("moe", mlp, moe)

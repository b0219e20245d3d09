"""One gpt-oss decoder layer's op sites (transformers' ``GptOssDecoderLayer``; weights:
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
from kiln.workloads.models.slot_types import LayerSlots, Site
from kiln.workloads.weights import ROUTER_BIAS, WeightStore


def _norm(store: WeightStore, name: str, eps: float) -> Site:
    return Site("rms_norm", name, {"weight": store[name + ".weight"], "eps": eps})


def attention_scale(config: ModelConfig) -> float:
    """``head_dim ** -0.5`` times the square of YaRN's cos/sin factor (1 without YaRN)."""
    f = rope_frequencies.attention_factor(config)
    return float(config.head_dim**-0.5 * f * f)


def gpt_oss_layer(
    config: ModelConfig, store: WeightStore, i: int, rope_site: Site
) -> LayerSlots[Site]:
    """Layer ``i``'s sites (module docstring); WeightError for a missing weight."""
    assert config.moe is not None
    p = f"model.layers.{i}"
    attn, mlp = f"{p}.self_attn", f"{p}.mlp"
    qkv: dict[str, Any] = {
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
    }
    for proj in "qkv":
        qkv[f"{proj}_weight"] = store[f"{attn}.{proj}_proj.weight"]
        qkv[f"{proj}_bias"] = store.get(f"{attn}.{proj}_proj.bias")
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
    eps = config.rms_norm_eps
    o_proj = f"{attn}.o_proj"
    return LayerSlots(
        input_norm=_norm(store, f"{p}.input_layernorm", eps),
        qkv_proj=Site("qkv_proj", attn, qkv),
        q_norm=None,
        k_norm=None,
        rope=rope_site,
        attention=Site("attention", attn, attention),
        o_proj=Site(
            "o_proj", o_proj, {"weight": store[o_proj + ".weight"], "bias": store[o_proj + ".bias"]}
        ),
        post_attention_norm=_norm(store, f"{p}.post_attention_layernorm", eps),
        ffn=Site("moe", mlp, moe),
    )

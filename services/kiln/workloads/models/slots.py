"""Op slots: where in a decoder each op is called, and with which base params.

A :class:`Site` is one call site; :class:`LayerSlots` / :class:`ModelSlots` give each a role in
the forward and hold the bound callables after binding. The only place that knows HF parameter
names for the forward.

A latent-attention (DeepSeek-V3) layer fills the same roles with other ops: ``qkv_proj`` is
``mla_proj``, ``attention`` is ``mla_attention`` (:mod:`kiln.ops.mla`), no ``q_norm``/``k_norm``,
and an MoE layer's shared expert is ``shared_ffn`` (an ``mlp``, added to the ``moe`` output).
A GLM-5 layer adds ``index_proj`` and ``indexer`` (:mod:`kiln.workloads.models.glm_moe_dsa_slots`)
and its ``mla_attention`` takes their ``topk_indices``.
"""

from __future__ import annotations

from typing import Any

from kiln.workloads import minimax_m2
from kiln.workloads.config import ModelConfig
from kiln.workloads.glm_moe_dsa import CALL_PARAMS as DSA_CALL_PARAMS
from kiln.workloads.mla_weights import CORRECTION_BIAS
from kiln.workloads.models import rope_frequencies
from kiln.workloads.models.glm_moe_dsa_slots import indexer_sites
from kiln.workloads.models.gpt_oss_slots import gpt_oss_sites
from kiln.workloads.models.slot_types import LayerSlots as LayerSlots
from kiln.workloads.models.slot_types import ModelSlots as ModelSlots
from kiln.workloads.models.slot_types import Site as Site
from kiln.workloads.weights import LM_HEAD, ROUTER_BIAS, WeightStore


def _norm(store: WeightStore, name: str, eps: float) -> Site:
    return Site("rms_norm", name, {"weight": store[name + ".weight"], "eps": eps})


LATENT_NORM_EPS = 1e-6
"""Epsilon of MLA's ``q_a_layernorm`` and ``kv_a_layernorm``: transformers builds them with the
RMS norm's default, not ``rms_norm_eps`` (``DeepseekV3Attention``)."""


def _o_proj(store: WeightStore, attn: str) -> Site:
    name = f"{attn}.o_proj"
    return Site(
        "o_proj", name, {"weight": store[name + ".weight"], "bias": store.get(name + ".bias")}
    )


def _mla_layer(
    config: ModelConfig, store: WeightStore, i: int, rope_site: Site
) -> LayerSlots[Site]:
    m = config.mla
    assert m is not None
    p = f"model.layers.{i}"
    attn = f"{p}.self_attn"
    lora = bool(m.q_lora_rank)
    proj: dict[str, Any] = {
        "q_weight": None if lora else store[f"{attn}.q_proj.weight"],
        "q_a_weight": store[f"{attn}.q_a_proj.weight"] if lora else None,
        "q_a_norm": store[f"{attn}.q_a_layernorm.weight"] if lora else None,
        "q_b_weight": store[f"{attn}.q_b_proj.weight"] if lora else None,
        "kv_a_weight": store[f"{attn}.kv_a_proj_with_mqa.weight"],
        "kv_a_norm": store[f"{attn}.kv_a_layernorm.weight"],
        "num_heads": config.num_attention_heads,
        "nope_dim": m.qk_nope_head_dim,
        "rope_dim": m.qk_rope_head_dim,
        "eps": LATENT_NORM_EPS,
        "interleaved": m.rope_interleave,
        "rope_scale": rope_frequencies.attention_factor(config),
    }
    attention = {
        "kv_b_weight": store[f"{attn}.kv_b_proj.weight"],
        "nope_dim": m.qk_nope_head_dim,
        "v_dim": m.v_head_dim,
        "scale": rope_frequencies.mla_softmax_scale(config),
    }
    eps = config.rms_norm_eps
    index_proj = indexer = None
    call_params: tuple[str, ...] = ()
    if config.dsa is not None:
        index_proj, indexer = indexer_sites(config, store, i, LATENT_NORM_EPS)
        call_params = DSA_CALL_PARAMS["mla_attention"]
    return LayerSlots(
        input_norm=_norm(store, f"{p}.input_layernorm", eps),
        qkv_proj=Site("mla_proj", attn, proj),
        q_norm=None,
        k_norm=None,
        rope=rope_site,
        attention=Site("mla_attention", attn, attention, call_params),
        o_proj=_o_proj(store, attn),
        post_attention_norm=_norm(store, f"{p}.post_attention_layernorm", eps),
        ffn=_ffn(config, store, i),
        shared_ffn=_shared_ffn(config, store, i),
        index_proj=index_proj,
        indexer=indexer,
    )


def _layer(config: ModelConfig, store: WeightStore, i: int, rope_site: Site) -> LayerSlots[Site]:
    if config.mla is not None:
        return _mla_layer(config, store, i, rope_site)
    p = f"model.layers.{i}"
    attn = f"{p}.self_attn"
    qkv: dict[str, Any] = {
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
    }
    for proj in "qkv":
        qkv[f"{proj}_weight"] = store[f"{attn}.{proj}_proj.weight"]
        qkv[f"{proj}_bias"] = store.get(f"{attn}.{proj}_proj.bias")
    if config.model_type == "gpt_oss":  # sinks, windows, the clamped SwiGLU
        attention, ffn = gpt_oss_sites(config, store, i)
    else:
        attention = Site("attention", attn, {"scale": config.head_dim**-0.5})
        ffn = _ffn(config, store, i)
    eps = config.rms_norm_eps
    return LayerSlots(
        input_norm=_norm(store, f"{p}.input_layernorm", eps),
        qkv_proj=Site("qkv_proj", attn, qkv),
        q_norm=_norm(store, f"{attn}.q_norm", eps) if config.qk_norm else None,
        k_norm=_norm(store, f"{attn}.k_norm", eps) if config.qk_norm else None,
        rope=rope_site,
        attention=attention,
        o_proj=_o_proj(store, attn),
        post_attention_norm=_norm(store, f"{p}.post_attention_layernorm", eps),
        ffn=ffn,
    )


def _mlp(store: WeightStore, name: str) -> Site:
    return Site(
        "mlp",
        name,
        {
            "gate_weight": store[f"{name}.gate_proj.weight"],
            "up_weight": store[f"{name}.up_proj.weight"],
            "down_weight": store[f"{name}.down_proj.weight"],
        },
    )


def _ffn(config: ModelConfig, store: WeightStore, i: int) -> Site:
    mlp = f"model.layers.{i}.mlp"
    if config.moe is None or not config.is_moe_layer(i):
        return _mlp(store, mlp)
    moe = config.moe
    params: dict[str, Any] = {
        "router_weight": store[f"{mlp}.gate.weight"],
        "gate_up_weight": store[f"{mlp}.experts.gate_up_proj"],
        "down_weight": store[f"{mlp}.experts.down_proj"],
        "top_k": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "round_router_weights": moe.round_router_weights,
        "router_bias": store.get(f"{mlp}.{ROUTER_BIAS}"),
    }
    if moe.scoring != "softmax":  # softmax sites keep the params every moe implementation takes
        minimax = config.model_type == minimax_m2.MINIMAX_M2
        bias = minimax_m2.CORRECTION_BIAS if minimax else CORRECTION_BIAS
        params.update(
            scoring=moe.scoring,
            n_group=moe.n_group,
            topk_group=moe.topk_group,
            correction_bias=store.get(f"{mlp}.{bias}"),
            routed_scaling_factor=moe.routed_scaling_factor,
        )
    return Site("moe", mlp, params)


def _shared_ffn(config: ModelConfig, store: WeightStore, i: int) -> Site | None:
    if config.moe is None or not config.is_moe_layer(i) or not config.moe.num_shared_experts:
        return None
    return _mlp(store, f"model.layers.{i}.mlp.shared_experts")


def dense_decoder_slots(
    config: ModelConfig, store: WeightStore, *, max_positions: int
) -> ModelSlots[Site]:
    """The sites of a Llama / Qwen3 / Qwen3-MoE / Mixtral / DeepSeek-V3 / MiniMax-M2 decoder with
    ``config``'s layers; ``max_positions`` bounds table-based RoPE.

    Raises:
        kiln.workloads.weights.WeightError: a weight the forward needs is not in ``store``.
        UnsupportedRopeError: a RoPE type kiln does not implement.
    """
    freq = rope_frequencies.inv_freq(config, device=store[LM_HEAD].device)
    rope_site = Site("rope", "model.rotary_emb", {"inv_freq": freq, "max_positions": max_positions})
    return ModelSlots(
        embedding=Site(
            "embedding", "model.embed_tokens", {"weight": store["model.embed_tokens.weight"]}
        ),
        layers=tuple(_layer(config, store, i, rope_site) for i in range(config.num_hidden_layers)),
        final_norm=_norm(store, "model.norm", config.rms_norm_eps),
        lm_head=Site("lm_head", "lm_head", {"weight": store[LM_HEAD]}),
        sampler=Site("sampler", "sampler", {}),
    )

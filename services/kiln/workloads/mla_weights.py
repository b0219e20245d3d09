"""Weight names and shapes of the DeepSeek-V3 architecture (MLA, shared experts, dense first
layers), and seeded random weights for it.

Names and shapes are transformers' ``DeepseekV3ForCausalLM`` state dict (5.x: experts stacked
as ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``, the router's
``mlp.gate.weight [E, H]`` and ``mlp.gate.e_score_correction_bias [E]``). Random weights follow
:func:`kiln.workloads.weights.seeded_random`'s scheme (one generator per (seed, name), drawn in
float32 then cast; norms 1), with the correction bias float32 zeros as transformers initialises
it. Published checkpoints (per-expert names, block-FP8) are read by
:func:`kiln.workloads.weights.load_safetensors` with these shapes (dequantized at load:
:mod:`kiln.workloads.quantized_checkpoint`), the correction biases kept float32.
"""

from __future__ import annotations

import torch

from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import EMBED, LM_HEAD, WeightError, WeightStore, seeded_tensors

CORRECTION_BIAS = "gate.e_score_correction_bias"
"""Suffix (after a layer's ``...mlp.``) of the router's float32 ``[E]`` selection bias."""


def mla_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a DeepSeek-V3-architecture model with ``config``'s layers.

    Raises:
        WeightError: ``config`` has no MLA.
    """
    m = config.mla
    if m is None:
        raise WeightError(f"{config.name}: not a latent-attention (MLA) model")
    h, v, heads = config.hidden_size, config.vocab_size, config.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {EMBED: (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (v, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if m.q_lora_rank:
            shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, h)
            shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
            shapes[a + "q_b_proj.weight"] = (heads * qk, m.q_lora_rank)
        else:
            shapes[a + "q_proj.weight"] = (heads * qk, h)
        shapes[a + "kv_a_proj_with_mqa.weight"] = (m.kv_lora_rank + m.qk_rope_head_dim, h)
        shapes[a + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        shapes[a + "kv_b_proj.weight"] = (
            heads * (m.qk_nope_head_dim + m.v_head_dim),
            m.kv_lora_rank,
        )
        shapes[a + "o_proj.weight"] = (h, heads * m.v_head_dim)
        moe = config.moe
        if moe is None or not config.is_moe_layer(i):
            inter = config.intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (inter, h)
            shapes[p + "mlp.up_proj.weight"] = (inter, h)
            shapes[p + "mlp.down_proj.weight"] = (h, inter)
            continue
        e, mi = moe.num_experts, moe.intermediate_size
        shapes[p + "mlp.gate.weight"] = (e, h)
        shapes[p + "mlp." + CORRECTION_BIAS] = (e,)
        shapes[p + "mlp.experts.gate_up_proj"] = (e, 2 * mi, h)
        shapes[p + "mlp.experts.down_proj"] = (e, h, mi)
        if moe.num_shared_experts:
            shared = mi * moe.num_shared_experts
            for proj in ("gate_proj", "up_proj"):
                shapes[f"{p}mlp.shared_experts.{proj}.weight"] = (shared, h)
            shapes[p + "mlp.shared_experts.down_proj.weight"] = (h, shared)
    return shapes


def seeded_random_mla(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightStore:
    """Random weights of :func:`mla_shapes`: norms 1, correction biases float32 zeros, the rest
    ``normal(0, initializer_range)`` from a generator on ``device`` seeded by ``(seed, name)``
    (stacked experts one expert at a time), cast to ``dtype``. Same seed, same weights on the
    same device type; a fast tier's layers equal the full model's. WeightError without MLA.
    """
    shapes = mla_shapes(config)
    tensors = seeded_tensors(shapes, config, dtype, device, seed, zeros=(CORRECTION_BIAS,))
    return WeightStore(tensors, tied=config.tie_word_embeddings)

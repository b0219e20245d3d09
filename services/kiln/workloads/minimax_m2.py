"""MiniMax-M2 (``model_type: minimax_m2``, transformers' ``MiniMaxM2ForCausalLM``, 5.x): what
kiln builds of it, its extra weights and seeded random weights.

The architecture is a GQA decoder whose every layer is a sparse MoE: Q/K RMSNorm over a token's
whole q and k projections (``qk_norm_type: per_layer``, weights ``[heads * head_dim]``, before
the heads are split and rotated), partial RoPE (the first ``rotary_dim`` of each head's
``head_dim`` dims, rotate-half within them; :mod:`kiln.ops.rope`), and a sigmoid router with a
selection-only correction bias (``mlp.e_score_correction_bias``; the routing of
:mod:`kiln.ops.moe_routing` with one group and no scaling), no shared expert.

kiln builds the main model only: the multi-token-prediction modules (``use_mtp``,
``num_mtp_modules``, ``mtp_transformer_layers``) are ignored, as transformers ignores them.
Published checkpoints (block-FP8, ``block_sparse_moe`` names) are read with
:func:`minimax_shapes` (dequantized at load: :mod:`kiln.workloads.quantized_checkpoint`), the
correction biases kept float32.
"""

from __future__ import annotations

import torch

from kiln.domain.quoting import quote
from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import WeightStore, expected_shapes, seeded_random

MINIMAX_M2 = "minimax_m2"
CORRECTION_BIAS = "e_score_correction_bias"
"""Suffix (after a layer's ``...mlp.``) of the router's float32 ``[E]`` selection bias
(transformers' ``MiniMaxM2SparseMoeBlock`` buffer)."""

FULL_ATTENTION = 1
"""``attn_type_list`` value of a softmax-attention layer (0: MiniMax-01's lightning attention)."""


def refusal(config: ModelConfig) -> str | None:
    """What of a MiniMax-M2 config kiln does not build (None: nothing): lightning-attention
    layers, a router other than biased sigmoid, shared experts, Q/K norms off or not
    ``per_layer``, a rotary width that is odd or over ``head_dim``, projection biases.
    """
    from kiln.workloads.models.rope_frequencies import rotary_dim  # (models imports this)

    raw = config.raw
    types = raw.get("attn_type_list") or []
    if not isinstance(types, list) or any(t != FULL_ATTENTION for t in types):
        return "MiniMax lightning-attention layers (attn_type_list entries other than 1)"
    if raw.get("scoring_func", "sigmoid") != "sigmoid":
        return f"router scoring {quote(raw.get('scoring_func'))} (MiniMax-M2 scores by sigmoid)"
    if raw.get("shared_intermediate_size") or raw.get("num_shared_experts"):
        return "MiniMax shared experts (shared_intermediate_size > 0)"
    if raw.get("use_qk_norm") is False:
        return "MiniMax-M2 without Q/K norms (transformers' MiniMaxM2Attention always norms)"
    if raw.get("qk_norm_type", "per_layer") != "per_layer":
        return f"qk_norm_type {quote(raw.get('qk_norm_type'))} (built: 'per_layer')"
    dim = rotary_dim(config)
    if dim % 2 or not 2 <= dim <= config.head_dim:
        return f"rotary_dim {dim} (even, 2..head_dim {config.head_dim})"
    if config.attention_bias:
        return "MiniMax-M2 with projection biases"
    return None


def routing_bias(config: ModelConfig) -> bool:
    """Whether the routers hold a correction bias (``use_routing_bias``, default True)."""
    return config.raw.get("use_routing_bias") is not False


def correction_bias_name(layer: int) -> str:
    """The HF name of layer ``layer``'s router correction bias."""
    return f"model.layers.{layer}.mlp.{CORRECTION_BIAS}"


def minimax_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of a MiniMax-M2 model with ``config``'s layers (transformers'
    ``MiniMaxM2ForCausalLM`` state dict): :func:`~kiln.workloads.weights.expected_shapes` plus
    the correction biases (with :func:`routing_bias`)."""
    shapes = expected_shapes(config)
    if routing_bias(config) and config.moe is not None:
        for i in range(config.num_hidden_layers):
            shapes[correction_bias_name(i)] = (config.moe.num_experts,)
    return shapes


def seeded_random_minimax(
    config: ModelConfig,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> WeightStore:
    """:func:`kiln.workloads.weights.seeded_random` (whose shapes include the ``per_layer`` Q/K
    norms) plus, with :func:`routing_bias`, each layer's correction bias as float32 zeros (as
    transformers initialises it).
    """
    store = seeded_random(config, dtype, device, seed)
    if routing_bias(config):
        e = config.moe.num_experts if config.moe is not None else 0
        for i in range(config.num_hidden_layers):
            store.add(correction_bias_name(i), torch.zeros(e, dtype=torch.float32, device=device))
    return store

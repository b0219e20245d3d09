"""One GLM-5 layer's indexer sites (transformers' ``GlmMoeDsaIndexer``; weights:
:mod:`kiln.workloads.glm_moe_dsa_weights`; ops: :mod:`kiln.ops.dsa_indexer`).

``index_proj`` (``dsa_index_proj``) shares the attention's ``q_a_proj`` / ``q_a_layernorm``
tensors (no copy) and its latent-norm epsilon; ``indexer`` (``dsa_indexer``) scores with
``index_head_dim ** -0.5`` and keeps ``index_topk``. The layer's ``mla_attention`` site declares
``topk_indices`` as a call param (:data:`kiln.workloads.glm_moe_dsa.CALL_PARAMS`), so an
implementation that cannot take the selection is refused at bind.
"""

from __future__ import annotations

from kiln.workloads import glm_moe_dsa
from kiln.workloads.config import ModelConfig
from kiln.workloads.glm_moe_dsa_weights import HEAD_WEIGHTS, KEY_NORM_BIAS, indexer_prefix
from kiln.workloads.models import rope_frequencies
from kiln.workloads.models.slot_types import Site
from kiln.workloads.weights import WeightStore


def indexer_sites(config: ModelConfig, store: WeightStore, i: int, eps: float) -> tuple[Site, Site]:
    """Layer ``i``'s ``index_proj`` and ``indexer`` sites (``eps``: the q LoRA norm's);
    WeightError for a missing weight."""
    dsa, mla = config.dsa, config.mla
    assert dsa is not None and mla is not None
    attn, p = f"model.layers.{i}.self_attn", indexer_prefix(i)
    proj = {
        "q_a_weight": store[f"{attn}.q_a_proj.weight"],
        "q_a_norm": store[f"{attn}.q_a_layernorm.weight"],
        "q_b_weight": store[f"{p}.wq_b.weight"],
        "k_weight": store[f"{p}.wk.weight"],
        "k_norm_weight": store[f"{p}.k_norm.weight"],
        "k_norm_bias": store[f"{p}.{KEY_NORM_BIAS}"],
        "head_weight": store[f"{p}.{HEAD_WEIGHTS}"],
        "num_heads": dsa.n_heads,
        "head_dim": dsa.head_dim,
        "rope_dim": mla.qk_rope_head_dim,
        "eps": eps,
        "k_norm_eps": glm_moe_dsa.INDEXER_NORM_EPS,
        "interleaved": True,
        "rope_scale": rope_frequencies.attention_factor(config),
    }
    select = {"scale": dsa.head_dim**-0.5, "topk": dsa.topk}
    return Site("dsa_index_proj", p, proj), Site("dsa_indexer", f"{p}.topk", select)

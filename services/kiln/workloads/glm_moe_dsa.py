"""GLM-5 (``model_type: glm_moe_dsa``, transformers' ``GlmMoeDsaForCausalLM``, 5.x,
``transformers/models/glm_moe_dsa/modeling_glm_moe_dsa.py``): DeepSeek-V3's MLA (q/kv LoRA,
interleaved decoupled rope) and MoE (sigmoid ``noaux_tc`` group routing, a shared expert,
``routed_scaling_factor``, the first ``first_k_dense_replace`` layers dense), plus DeepSeek Sparse
Attention's *indexer* (``GlmMoeDsaIndexer``; DeepSeek-V3.2-Exp's lightning indexer).

The indexer, per layer (:mod:`kiln.ops.dsa_indexer`): query heads ``wq_b(q_resid)`` from the
attention's normalised q LoRA latent, one key ``LayerNorm(wk(x))`` per token (eps 1e-6, with a
bias), both rotated by the layer's RoPE on their first ``qk_rope_head_dim`` dims (always
interleaved pairs in transformers), per-head weights ``weights_proj(x) * index_n_heads**-0.5``
(float32: transformers keeps ``indexer.weights_proj`` in float32). A query's index score of key
``s`` is ``sum_h w_h relu(q_h . k_s / sqrt(index_head_dim))``; the attention then sees only the
``index_topk`` best-scoring visible (causal) keys. The cache keeps the indexer keys next to the
latent (``index_head_dim`` more values per token and layer; transformers' ``update_indexer``).

kiln builds the main model only: the MTP layer (``num_nextn_predict_layers``) is ignored, as
transformers ignores it. Not built (refused): cross-layer top-k sharing (``indexer_types``
``"shared"``, ``index_topk_pattern``, ``index_topk_freq > 1``), a config without q LoRA, rope
layouts other than interleaved. Importing does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.workloads.config_bounds import whole

GLM_MOE_DSA = "glm_moe_dsa"
INDEXER_NORM_EPS = 1e-6
"""Epsilon of the indexer's key LayerNorm (``nn.LayerNorm(index_head_dim, eps=1e-6)``)."""

CALL_PARAMS: dict[str, tuple[str, ...]] = {"mla_attention": ("topk_indices",)}
"""Op -> keyword inputs a GLM-5 layer passes at call time (the indexer's selection); an
implementation must accept them to run this family (binding and :mod:`kiln.runtime.support`
refuse the others)."""


@dataclass(frozen=True)
class IndexerConfig:
    """The sparse-attention indexer: ``n_heads`` heads of ``head_dim``, ``topk`` keys kept per
    query (``index_n_heads``, ``index_head_dim``, ``index_topk``)."""

    n_heads: int
    head_dim: int
    topk: int

    def params(self, hidden: int, q_lora_rank: int) -> int:
        """Weights of one layer's indexer, elements: ``wq_b``, ``wk``, the key LayerNorm's weight
        and bias, ``weights_proj``."""
        d, h = self.head_dim, self.n_heads
        return q_lora_rank * h * d + hidden * d + 2 * d + hidden * h


def indexer_config(cfg: dict[str, Any], name: str) -> IndexerConfig:
    """The indexer of a ``glm_moe_dsa`` ``cfg`` (transformers' defaults 32 heads of 128, top
    2048); UnsupportedModelError / ConfigRangeError for a bad count."""
    return IndexerConfig(
        n_heads=whole(cfg, "index_n_heads", name, 32),
        head_dim=whole(cfg, "index_head_dim", name, 128),
        topk=whole(cfg, "index_topk", name, 2048),
    )


def _shares_top_k(raw: dict[str, Any]) -> bool:
    """Whether some layer reuses a previous layer's top-k (``GlmMoeDsaConfig.__post_init__``)."""
    types = raw.get("indexer_types")
    if types is not None:
        return not isinstance(types, list) or any(t != "full" for t in types)
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, (str, list)):
            return True
        return any(c not in ("F", "full") for c in pattern)
    freq = raw.get("index_topk_freq", 1)
    return not isinstance(freq, int) or freq > 1


def refusal(
    raw: dict[str, Any], dsa: IndexerConfig, q_lora_rank: int | None, rope_dim: int
) -> str | None:
    """What of a GLM-5 config (``raw``, its indexer, q LoRA rank and ``qk_rope_head_dim``) kiln
    does not build beyond DeepSeek-V3's refusals (None: nothing): shared top-k layers, no q
    LoRA, non-interleaved rope, an indexer narrower than the rope dims."""
    if _shares_top_k(raw):
        return "GLM-5 cross-layer top-k sharing (indexer_types 'shared'; built: every layer 'full')"
    if not q_lora_rank:
        return "glm_moe_dsa without q LoRA (its indexer reads the q LoRA latent)"
    if raw.get("rope_interleave") is False or raw.get("indexer_rope_interleave") is False:
        return "glm_moe_dsa with plain rope layout (transformers always rotates interleaved pairs)"
    if dsa.head_dim < rope_dim:
        return f"index_head_dim {dsa.head_dim} below qk_rope_head_dim {rope_dim}"
    return None

"""``dsa_index_proj`` and ``dsa_indexer``: the sparse-attention indexer of GLM-5 (DeepSeek
Sparse Attention, DeepSeek-V3.2-Exp's "lightning indexer"; semantics of transformers'
``GlmMoeDsaIndexer`` and ``GlmMoeDsaAttention``, ``transformers/models/glm_moe_dsa/
modeling_glm_moe_dsa.py``, 5.x).

- ``dsa_index_proj(x) -> (q [B, Hi, T, Di], k [B, 1, T, Di], w [B, T, Hi])``: index queries
  ``wq_b(q_resid)`` with ``q_resid = rms_norm(q_a_proj(x))`` (the attention's q LoRA latent,
  recomputed here from the same weights), the key ``LayerNorm(wk(x))`` (weight and bias, eps
  1e-6), and the per-head weights ``weights_proj(x) * Hi**-0.5`` in float32 (float64 kept). The
  first ``rope_dim`` dims of q and k are the rotated ones; with ``interleaved`` they come out
  de-interleaved (evens, then odds) so the ``rope`` op's partial rotate-half rotation equals
  transformers' ``apply_rotary_pos_emb_interleave`` on them (q and k permuted alike).
- ``dsa_indexer(q, w, key_cache, positions, seq_lens) -> topk_indices [B, T, K] int64``:
  ``score[b, t, s] = sum_h w[b, t, h] relu(q[b, h, t] . key_cache[b, 0, s] * scale)`` in
  float32 (float64 kept), ``-inf`` where query ``t`` may not see slot ``s``
  (:func:`kiln.ops.attention.cache_mask`), then the ``K = min(topk, S)`` best slots; a chosen slot
  the query may not see (fewer than K visible) is ``-1``. So the visible selection is the top
  ``topk`` of the visible slots, all of them when fewer: transformers' mask (its ``-inf`` / dtype
  minimum keeps causally hidden slots hidden whether or not they are "selected").

``mla_attention`` takes the indices as ``topk_indices`` (:func:`kiln.ops.mla.selection_mask`): a
query attends to its visible slots that were selected.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops import rms_norm
from kiln.ops.attention import SCORES_BUDGET, cache_mask
from kiln.ops.mla import deinterleave
from kiln.ops.precision import widened
from kiln.ops.registry import register

Tensor = torch.Tensor


def _rope_first(x: Tensor, rope_dim: int) -> Tensor:
    """``x [..., D]`` with its first ``rope_dim`` dims de-interleaved, the rest kept."""
    return torch.cat((deinterleave(x[..., :rope_dim]), x[..., rope_dim:]), dim=-1)


@register("dsa_index_proj", "reference")
def reference_proj(
    x: Tensor,
    *,
    q_a_weight: Tensor,
    q_a_norm: Tensor,
    q_b_weight: Tensor,
    k_weight: Tensor,
    k_norm_weight: Tensor,
    k_norm_bias: Tensor,
    head_weight: Tensor,
    num_heads: int,
    head_dim: int,
    rope_dim: int,
    eps: float,
    k_norm_eps: float,
    interleaved: bool,
    rope_scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """The indexer's projections as plain matmuls (module docstring).

    Args:
        x: ``[B, T, H]`` the layer's normalised hidden states (model dtype).
        q_a_weight, q_a_norm: ``[Rq, H]``, ``[Rq]`` the attention's q LoRA (``q_a_proj``,
            ``q_a_layernorm``); eps: that norm's epsilon.
        q_b_weight: ``[Hi*Di, Rq]`` (``wq_b``); k_weight: ``[Di, H]`` (``wk``).
        k_norm_weight, k_norm_bias: ``[Di]`` the key LayerNorm; k_norm_eps: its epsilon.
        head_weight: ``[Hi, H]`` (``weights_proj``, float32 in transformers).
        num_heads, head_dim, rope_dim: Hi, Di and the rotated leading dims.
        interleaved: de-interleave the rotated dims; rope_scale: YaRN's cos/sin factor, which
            multiplies them (transformers' indexer shares the layer's scaled cos/sin).

    Returns:
        ``q [B, Hi, T, Di]`` and ``k [B, 1, T, Di]`` in ``x.dtype`` (unrotated), ``w [B, T,
        Hi]`` float32 (float64 for float64 inputs).
    """
    q_latent, _ = rms_norm.reference(F.linear(x, q_a_weight), weight=q_a_norm, eps=eps)
    q = F.linear(q_latent, q_b_weight).unflatten(-1, (num_heads, head_dim)).transpose(1, 2)
    k = F.layer_norm(
        widened(F.linear(x, k_weight)),
        (head_dim,),
        widened(k_norm_weight),
        widened(k_norm_bias),
        k_norm_eps,
    ).to(x.dtype)[:, None]
    if interleaved:
        q, k = _rope_first(q, rope_dim), _rope_first(k, rope_dim)
    if rope_scale != 1.0:
        scale = torch.ones(head_dim, dtype=q.dtype, device=q.device)
        scale[:rope_dim] = rope_scale
        q, k = q * scale, k * scale
    w = widened(F.linear(x.to(head_weight.dtype), head_weight)) * num_heads**-0.5
    return q, k, w


def _select(
    q: Tensor, w: Tensor, keys: Tensor, positions: Tensor, seq_lens: Tensor, scale: float, k: int
) -> Tensor:
    qf = widened(q)  # [B, Hi, T, Di]
    scores = torch.relu(torch.matmul(qf, keys.to(qf.dtype).transpose(-1, -2)) * scale)
    # transformers' order: [B, T, 1, Hi] @ [B, T, Hi, S] -> [B, T, S]
    index = torch.matmul(w.to(qf.dtype)[:, :, None], scores.transpose(1, 2)).squeeze(2)
    mask = cache_mask(positions, seq_lens, keys.shape[2])[:, 0]  # [B, T, S]
    chosen = index.masked_fill(~mask, float("-inf")).topk(k, dim=-1).indices
    return chosen.masked_fill(~mask.gather(-1, chosen), -1)


@register("dsa_indexer", "reference")
def reference(
    q: Tensor,
    w: Tensor,
    key_cache: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    *,
    scale: float,
    topk: int,
) -> Tensor:
    """The module docstring's selection, over query chunks of at most
    :data:`~kiln.ops.attention.SCORES_BUDGET` per-head scores.

    Args:
        q: ``[B, Hi, T, Di]`` rotated index queries; w: ``[B, T, Hi]`` head weights.
        key_cache: ``[B, 1, S, Di]`` rotated index keys (this step's written).
        positions: ``[B, T]`` int64; seq_lens: ``[B]`` int64 valid lengths after this step.
        scale: ``index_head_dim ** -0.5``; topk: ``index_topk``.

    Returns ``[B, T, min(topk, S)]`` int64 slot indices, ``-1`` for a slot not visible.
    """
    b, heads, t, _ = q.shape
    s = key_cache.shape[2]
    k = min(topk, s)
    chunk = max(1, SCORES_BUDGET // max(1, b * heads * s))
    parts = [
        _select(q[:, :, i : i + chunk], w[:, i : i + chunk], key_cache,
                positions[:, i : i + chunk], seq_lens, scale, k)
        for i in range(0, t, chunk)
    ]  # fmt: skip
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

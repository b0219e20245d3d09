"""``mla_proj`` and ``mla_attention``: DeepSeek's multi-head latent attention (DeepSeek-V2 paper,
arXiv:2405.04434, section 2.1; semantics of transformers' ``DeepseekV3Attention``,
``transformers/models/deepseek_v3/modeling_deepseek_v3.py``, 5.x).

Per layer the cache holds, per token, one normalised latent ``c [R]`` (``R = kv_lora_rank``) and
one rotated rope key ``k_r [Dr]`` shared by every head; head ``h``'s key is ``[W_UK[h] c, k_r]``
and its value ``W_UV[h] c``, with ``kv_b_proj = [W_UK[h]; W_UV[h]]`` per head.

- ``mla_proj(x) -> (q_nope, q_rope, latent, k_rope)``: the query (``q_proj``, or the q LoRA
  ``q_b_proj(rms_norm(q_a_proj(x)))``) split into ``[B, Hq, T, Dn]`` and ``[B, Hq, T, Dr]``, and
  ``kv_a_proj_with_mqa(x)`` split into the latent (``kv_a_layernorm`` applied, ``[B, 1, T, R]``)
  and the rope key ``[B, 1, T, Dr]``. Interleaved checkpoints' rope dims come out de-interleaved
  (evens, then odds), so the ``rope`` op's rotate-half rotation is transformers'
  ``apply_rotary_pos_emb_interleave`` (q and k permuted alike: their dot products are unchanged).
  YaRN's cos/sin factor (``rope_scale``) multiplies both rope parts here.
- ``mla_attention(q_nope, q_rope, latent_cache, rope_cache, positions, seq_lens) -> out [B, Hq,
  T, Dv]``: causal attention over the latent cache with the visibility of
  :mod:`kiln.ops.attention`; ``reference`` expands per-head keys and values from the latents,
  ``absorbed`` folds ``W_UK`` into the query and ``W_UV`` into the output (the weights-absorbed
  form, DeepSeek-V2 section 2.1.2) and never forms per-head K/V. GLM-5 sites pass the sparse
  indexer's choice as the keyword ``topk_indices [B, T, K]`` (:mod:`kiln.ops.dsa_indexer`): a
  query then sees only the visible slots it names (:func:`selection_mask`); every implementation
  takes it. ``absorbed_triton`` (CUDA) is ``absorbed`` with a decode step's latent-space
  attention in the split-KV Triton kernel :mod:`kiln.ops.kernels.mla_decode` (imported on first
  call, as :mod:`kiln.ops.attention_triton` does; under ``torch.compile`` the custom op
  ``kiln::mla_decode``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops import rms_norm
from kiln.ops.attention import cache_mask
from kiln.ops.precision import widened
from kiln.ops.registry import Derivation, register

Tensor = torch.Tensor


def deinterleave(x: Tensor) -> Tensor:
    """``[..., D]`` pairs ``(x0, x1), (x2, x3), ...`` as ``[x0, x2, ..., x1, x3, ...]``."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


@register("mla_proj", "reference")
def reference_proj(
    x: Tensor,
    *,
    q_weight: Tensor | None,
    q_a_weight: Tensor | None,
    q_a_norm: Tensor | None,
    q_b_weight: Tensor | None,
    kv_a_weight: Tensor,
    kv_a_norm: Tensor,
    num_heads: int,
    nope_dim: int,
    rope_dim: int,
    eps: float,
    interleaved: bool,
    rope_scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The MLA projections as plain matmuls and the reference RMS norm.

    Args:
        x: ``[B, T, H]`` normalised hidden states (model dtype).
        q_weight: ``[Hq*(Dn+Dr), H]`` (``q_proj``) when the model has no q LoRA, else None.
        q_a_weight, q_a_norm, q_b_weight: ``[Rq, H]``, ``[Rq]``, ``[Hq*(Dn+Dr), Rq]`` (q LoRA),
            or None without it.
        kv_a_weight: ``[R+Dr, H]`` (``kv_a_proj_with_mqa``); kv_a_norm: ``[R]``.
        num_heads, nope_dim, rope_dim: Hq, Dn, Dr; eps: the norms' epsilon.
        interleaved: de-interleave the rope dims (module docstring); rope_scale: their factor.

    Returns:
        ``q_nope [B, Hq, T, Dn]``, ``q_rope [B, Hq, T, Dr]``, ``latent [B, 1, T, R]``, ``k_rope
        [B, 1, T, Dr]`` in ``x.dtype``.

    Raises:
        ValueError: neither ``q_weight`` nor the q LoRA weights given.
    """
    if q_a_weight is not None and q_a_norm is not None and q_b_weight is not None:
        q_latent, _ = rms_norm.reference(F.linear(x, q_a_weight), weight=q_a_norm, eps=eps)
        q = F.linear(q_latent, q_b_weight)
    elif q_weight is not None:
        q = F.linear(x, q_weight)
    else:
        raise ValueError("mla_proj needs q_weight or q_a_weight, q_a_norm and q_b_weight")
    q = q.unflatten(-1, (num_heads, nope_dim + rope_dim)).transpose(1, 2)
    q_nope, q_rope = q.split([nope_dim, rope_dim], dim=-1)
    latent, k_rope = F.linear(x, kv_a_weight).split([kv_a_norm.shape[0], rope_dim], dim=-1)
    latent, _ = rms_norm.reference(latent, weight=kv_a_norm, eps=eps)
    k_rope = k_rope[:, None]
    if interleaved:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    if rope_scale != 1.0:
        q_rope, k_rope = q_rope * rope_scale, k_rope * rope_scale
    return q_nope, q_rope, latent[:, None], k_rope


def selection_mask(topk_indices: Tensor, cache_len: int) -> Tensor:
    """``[B, 1, T, S]`` bool, True at the slots of ``topk_indices [B, T, K]`` int (``-1``:
    none)."""
    b, t, _ = topk_indices.shape
    picked = torch.zeros(b, t, cache_len + 1, dtype=torch.bool, device=topk_indices.device)
    slots = topk_indices.long().masked_fill(topk_indices < 0, cache_len)
    picked.scatter_(-1, slots, True)
    return picked[:, None, :, :cache_len]


def _attend(
    scores: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    values: Tensor,
    scale: float,
    topk_indices: Tensor | None = None,
) -> Tensor:
    """``softmax(scores * scale + mask) @ values`` (``scores [B, Hq, T, S]``), the mask narrowed
    to ``topk_indices`` when given."""
    mask = cache_mask(positions, seq_lens, scores.shape[-1])  # [B, 1, T, S]
    if topk_indices is not None:
        mask = mask & selection_mask(topk_indices, scores.shape[-1])
    probs = torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, values)


@register("mla_attention", "reference")
def reference(
    q_nope: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    *,
    kv_b_weight: Tensor,
    nope_dim: int,
    v_dim: int,
    scale: float,
    topk_indices: Tensor | None = None,
) -> Tensor:
    """Per-head keys ``[k_nope, k_rope]`` and values expanded from every cached latent through
    ``kv_b_weight`` (in the model dtype, as transformers' ``expand_kv``), then explicit softmax
    attention in float32 (float64 for float64 inputs).

    Args:
        q_nope: ``[B, Hq, T, Dn]``; q_rope: ``[B, Hq, T, Dr]`` (rotated).
        latent_cache: ``[B, 1, S, R]``; rope_cache: ``[B, 1, S, Dr]`` (this step's written).
        positions: ``[B, T]`` int64; seq_lens: ``[B]`` int64 valid lengths after this step.
        kv_b_weight: ``[Hq*(Dn+Dv), R]`` (``kv_b_proj``); nope_dim, v_dim: Dn, Dv.
        scale: the softmax scale (:func:`kiln.workloads.models.rope_frequencies.mla_softmax_scale`).
        topk_indices: ``[B, T, K]`` int64 slots a query may see (``-1``: none), or None: all.

    Returns ``[B, Hq, T, Dv]`` in ``q_nope.dtype``.
    """
    heads = q_nope.shape[1]
    kv = F.linear(latent_cache[:, 0], kv_b_weight.to(latent_cache.dtype))  # [B, S, Hq*(Dn+Dv)]
    kv = kv.unflatten(-1, (heads, nope_dim + v_dim)).transpose(1, 2)
    k_nope, v = kv.split([nope_dim, v_dim], dim=-1)
    k = torch.cat((k_nope, rope_cache.expand(-1, heads, -1, -1)), dim=-1)
    q = widened(torch.cat((q_nope, q_rope), dim=-1))
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2))
    out = _attend(scores, positions, seq_lens, v.to(q.dtype), scale, topk_indices)
    return out.to(q_nope.dtype)


def absorb(params: Mapping[str, Any]) -> dict[str, Any]:
    """The absorbed layout of ``kv_b_weight [Hq*(Dn+Dv), R]``: ``w_uk [Hq, Dn, R]`` (query side)
    and ``w_uv_t [Hq, R, Dv]`` (output side), contiguous copies; ``scale`` kept."""
    w: Tensor = params["kv_b_weight"]
    dn, dv = params["nope_dim"], params["v_dim"]
    per_head = w.unflatten(0, (-1, dn + dv))
    return {
        "w_uk": per_head[:, :dn].contiguous(),
        "w_uv_t": per_head[:, dn:].transpose(1, 2).contiguous(),
        "scale": params["scale"],
    }


ABSORBED = Derivation("mla_absorbed", absorb)


@register("mla_attention", "absorbed", derived=ABSORBED)
def absorbed(
    q_nope: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    *,
    w_uk: Tensor,
    w_uv_t: Tensor,
    scale: float,
    topk_indices: Tensor | None = None,
) -> Tensor:
    """Attention in the latent space: scores ``(q_nope W_UK) . c + q_rope . k_rope``, the
    probabilities times the latents, then ``W_UV`` per head (:func:`absorb`'s layout); the
    contract of :func:`reference`. The absorbed query and the latent output are rounded to the
    model dtype before their products with the weights, the scores and softmax are float32.
    """
    q_latent = torch.matmul(q_nope, w_uk.to(q_nope.dtype))  # [B, Hq, T, R]
    ql, qr = widened(q_latent), widened(q_rope)
    latent, rope = latent_cache.to(ql.dtype), rope_cache.to(ql.dtype)  # [B, 1, S, .]
    scores = torch.matmul(ql, latent.transpose(-1, -2)) + torch.matmul(qr, rope.transpose(-1, -2))
    out_latent = _attend(scores, positions, seq_lens, latent, scale, topk_indices)
    out_latent = out_latent.to(q_nope.dtype)
    return torch.matmul(out_latent, w_uv_t.to(q_nope.dtype))


@register("mla_attention", "absorbed_triton", derived=ABSORBED, devices=("cuda",))
def absorbed_triton(
    q_nope: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    positions: Tensor,
    seq_lens: Tensor,
    *,
    w_uk: Tensor,
    w_uv_t: Tensor,
    scale: float,
    topk_indices: Tensor | None = None,
) -> Tensor:
    """:func:`absorbed` (its contract, params and rounding points: the absorbed query and the
    latent output in the model dtype) with a decode step's (``T == 1``) attention over the latent
    cache in :func:`kiln.ops.kernels.mla_decode.mla_decode`: scores and softmax in float32, the
    probabilities rounded to the cache dtype for ``p @ c``. At decode the query sits at
    ``seq_lens[b] - 1``, so ``positions`` is not read; a slot ``topk_indices`` names twice is
    attended once, as :func:`selection_mask` does. Prefill (``T > 1``) and float64 run
    :func:`absorbed`.

    Raises:
        KernelUnavailableError: at decode without CUDA (or ``TRITON_INTERPRET=1``).
    """
    if q_nope.shape[2] != 1 or q_nope.dtype == torch.float64:
        return absorbed(
            q_nope, q_rope, latent_cache, rope_cache, positions, seq_lens,
            w_uk=w_uk, w_uv_t=w_uv_t, scale=scale, topk_indices=topk_indices,
        )  # fmt: skip
    q_latent = torch.matmul(q_nope, w_uk.to(q_nope.dtype))[:, :, 0]  # [B, Hq, R]
    selected = None if topk_indices is None else topk_indices[:, 0]
    args = (q_latent, q_rope[:, :, 0], latent_cache[:, 0], rope_cache[:, 0], seq_lens)
    if torch.compiler.is_compiling():
        out_latent = mla_decode_op(*args, scale, selected)
    else:
        out_latent = _mla_decode(*args, scale, selected)
    return torch.matmul(out_latent.unsqueeze(2), w_uv_t.to(q_nope.dtype))


def _mla_decode(
    q_latent: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    seq_lens: Tensor,
    scale: float,
    topk_indices: Tensor | None,
) -> Tensor:
    from kiln.ops.kernels.mla_decode import mla_decode

    return mla_decode(
        q_latent, q_rope, latent_cache, rope_cache, seq_lens, scale=scale,
        topk_indices=topk_indices,
    )  # fmt: skip


@torch.library.custom_op("kiln::mla_decode", mutates_args=())
def mla_decode_op(
    q_latent: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    seq_lens: Tensor,
    scale: float,
    topk_indices: Tensor | None,
) -> Tensor:
    """:func:`kiln.ops.kernels.mla_decode.mla_decode` as an op ``torch.compile`` does not trace
    into: ``q_latent [B, Hq, R]``, ``q_rope [B, Hq, Dr]``, caches ``[B, S, R]`` / ``[B, S, Dr]``,
    ``seq_lens [B]`` int64, ``topk_indices [B, K]`` or None; a new ``[B, Hq, R]`` in q's dtype."""
    return _mla_decode(q_latent, q_rope, latent_cache, rope_cache, seq_lens, scale, topk_indices)


@mla_decode_op.register_fake
def _mla_decode_fake(
    q_latent: Tensor,
    q_rope: Tensor,
    latent_cache: Tensor,
    rope_cache: Tensor,
    seq_lens: Tensor,
    scale: float,
    topk_indices: Tensor | None,
) -> Tensor:
    return q_latent.new_empty(q_latent.shape)

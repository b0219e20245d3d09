"""``qkv_proj``: the query, key and value projections, split into heads.

Call: ``qkv_proj(x) -> (q, k, v)``. Base params (HF ``self_attn.{q,k,v}_proj``): ``q_weight
[Hq*D, H]``, ``k_weight [Hkv*D, H]``, ``v_weight [Hkv*D, H]``, ``q_bias``/``k_bias``/``v_bias``
(``[Hq*D]``/``[Hkv*D]`` or None), ``num_heads`` (Hq), ``num_kv_heads`` (Hkv), ``head_dim`` (D).
Outputs are ``[B, heads, T, D]`` views in the model dtype (not necessarily contiguous).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.registry import Derivation, register

Tensor = torch.Tensor


def _heads(x: Tensor, heads: int, head_dim: int) -> Tensor:
    """``[B, T, heads*D] -> [B, heads, T, D]`` (a view)."""
    return x.unflatten(-1, (heads, head_dim)).transpose(1, 2)


@register("qkv_proj", "reference")
def reference(
    x: Tensor,
    *,
    q_weight: Tensor,
    k_weight: Tensor,
    v_weight: Tensor,
    q_bias: Tensor | None,
    k_bias: Tensor | None,
    v_bias: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Three matmuls ``x @ W.T + b``.

    Args:
        x: ``[B, T, H]`` normalised hidden states (model dtype).

    Returns:
        ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]``, ``v [B, Hkv, T, D]`` in ``x.dtype``.
    """
    q = F.linear(x, q_weight, q_bias)
    k = F.linear(x, k_weight, k_bias)
    v = F.linear(x, v_weight, v_bias)
    return (
        _heads(q, num_heads, head_dim),
        _heads(k, num_kv_heads, head_dim),
        _heads(v, num_kv_heads, head_dim),
    )


def fuse_qkv(params: Mapping[str, Any]) -> dict[str, Any]:
    """The fused layout: ``qkv_weight = cat([q_weight, k_weight, v_weight])`` ``[(Hq+2Hkv)*D,
    H]`` and the biases concatenated the same way (None when the model has none)."""
    biases = [params["q_bias"], params["k_bias"], params["v_bias"]]
    return {
        "qkv_weight": torch.cat([params["q_weight"], params["k_weight"], params["v_weight"]]),
        "qkv_bias": None if biases[0] is None else torch.cat(biases),
        "num_heads": params["num_heads"],
        "num_kv_heads": params["num_kv_heads"],
        "head_dim": params["head_dim"],
    }


FUSED_QKV = Derivation("fused_qkv", fuse_qkv)


@register("qkv_proj", "fused", derived=FUSED_QKV)
def fused(
    x: Tensor,
    *,
    qkv_weight: Tensor,
    qkv_bias: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """One matmul on the derived ``[(Hq+2Hkv)*D, H]`` weight (:func:`fuse_qkv`), then a split.
    Same contract as :func:`reference`."""
    qkv = F.linear(x, qkv_weight, qkv_bias)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    return (
        _heads(q, num_heads, head_dim),
        _heads(k, num_kv_heads, head_dim),
        _heads(v, num_kv_heads, head_dim),
    )

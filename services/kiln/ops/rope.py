"""``rope``: rotary position embedding of queries and keys (Su et al. 2021, RoFormer).

Call: ``rope(q, k, positions) -> (q, k)``. Base params: ``inv_freq [D/2]`` float32 (a model
config's, from :mod:`kiln.workloads.models.rope_frequencies`) and ``max_positions`` (the
engine's KV-cache length; positions are below it).
The rotation pairs dimension ``i`` with ``i + D/2`` ("rotate half"), as transformers'
``apply_rotary_pos_emb`` does for Llama and Qwen3 checkpoints. Partial rotary (MiniMax-M2):
when ``inv_freq`` has ``R/2 < D/2`` entries, only each head's first R dims rotate (pairing ``i``
with ``i + R/2``) and the other ``D - R`` pass through unchanged, as transformers'
``MiniMaxM2`` ``apply_rotary_pos_emb``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.ops.precision import widened
from kiln.ops.registry import Derivation, register

Tensor = torch.Tensor


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * [cos, cos] + rotate_half(x) * [sin, sin]`` in float32, cast back to ``x.dtype``.
    ``cos``/``sin``: ``[B, 1, T, R/2]`` float32; the first R dims of ``x [..., D]`` rotate, the
    rest (R < D: partial rotary) are copied."""
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    xf = widened(x)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@register("rope", "reference")
def reference(
    q: Tensor,
    k: Tensor,
    positions: Tensor,
    *,
    inv_freq: Tensor,
    max_positions: int,
) -> tuple[Tensor, Tensor]:
    """Angles ``positions * inv_freq`` computed per call, rotation in float32.

    Args:
        q: ``[B, Hq, T, D]``; k: ``[B, Hkv, T, D]`` (model dtype, any strides).
        positions: ``[B, T]`` int64 token positions (``< max_positions``; unchecked here).
        inv_freq: ``[R/2]`` float32, R = D or the partial rotary width (module docstring).
        max_positions: unused by this implementation (the bound for table-based ones).

    Returns:
        Rotated ``(q, k)``, same shapes and dtypes, contiguous.
    """
    del max_positions
    angles = positions[:, None, :, None].float() * inv_freq  # [B, 1, T, D/2]
    cos, sin = angles.cos(), angles.sin()
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def cos_sin_table(params: Mapping[str, Any]) -> dict[str, Any]:
    """Precomputed ``cos``/``sin`` ``[max_positions, D/2]`` float32 of ``p * inv_freq``
    (vLLM's ``cos_sin_cache``)."""
    freq = params["inv_freq"]
    pos = torch.arange(params["max_positions"], device=freq.device, dtype=torch.float)
    angles = pos[:, None] * freq
    return {"cos": angles.cos(), "sin": angles.sin()}


COS_SIN_TABLE = Derivation("rope_cos_sin_table", cos_sin_table)


@register("rope", "cos_sin_cache", derived=COS_SIN_TABLE)
def cos_sin_cache(
    q: Tensor, k: Tensor, positions: Tensor, *, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor]:
    """Same contract as :func:`reference`, reading angles from the derived table
    (:func:`cos_sin_table`) instead of computing ``cos``/``sin`` per call. Positions must be
    ``< max_positions`` (an index error on CPU)."""
    c, s = cos[positions][:, None], sin[positions][:, None]
    return _rotate(q, c, s), _rotate(k, c, s)

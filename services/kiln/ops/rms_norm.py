"""``rms_norm``: root-mean-square layer norm with an optional residual add before it.

Call: ``rms_norm(x, residual=None) -> (normed, residual_out)``; params ``weight``, ``eps``.
When ``residual`` is given the op first forms ``s = x + residual`` and normalises ``s``; it
returns ``s`` as ``residual_out`` so the decoder carries the residual stream through the ops
(vLLM's ``fused_add_rms_norm`` contract, without its in-place update). Without a residual,
``residual_out`` is ``x`` itself. Formula: Zhang & Sennrich 2019; rounding order as
transformers' ``LlamaRMSNorm`` (normalise in float32, cast to the input dtype, then scale).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.precision import widened
from kiln.ops.registry import register


@register("rms_norm", "reference")
def reference(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight * (s / sqrt(mean(s**2) + eps))`` over the last dim, with ``s = x (+ residual)``.

    Args:
        x: ``[..., N]`` (model dtype; N = hidden size, or head dim for Qwen3's q/k norms).
        residual: ``[..., N]`` same dtype, or None.
        weight: ``[N]`` scale.
        eps: added to the mean square (the config's ``rms_norm_eps``).

    Returns:
        ``(normed [..., N] in x.dtype, residual_out [..., N])``; statistics in float32.
    """
    if residual is not None:
        x = x + residual
    h = widened(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


@register("rms_norm", "fused_residual")
def fused_residual(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`reference`, using ATen's fused ``rms_norm`` kernel
    (``torch.nn.functional.rms_norm``, one pass instead of five elementwise ops). On GPU this is
    the slot for a kernel that also fuses the residual add."""
    if residual is not None:
        x = x + residual
    return F.rms_norm(x, (x.shape[-1],), weight, eps), x

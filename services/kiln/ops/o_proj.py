"""``o_proj``: attention output projection, merging heads back into the hidden size.

Call: ``o_proj(attn) -> hidden``; params ``weight [H, Hq*D]``, ``bias [H]`` or None (HF
``self_attn.o_proj``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.registry import register


@register("o_proj", "reference")
def reference(
    attn: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``merge_heads(attn) @ weight.T + bias``.

    Args:
        attn: ``[B, Hq, T, D]`` attention output (model dtype).

    Returns:
        ``[B, T, H]`` in ``attn.dtype``.
    """
    merged = attn.transpose(1, 2).flatten(2)
    return F.linear(merged, weight, bias)

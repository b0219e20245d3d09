"""``lm_head``: hidden states to vocabulary logits.

Call: ``lm_head(x) -> logits``; params ``weight [V, H]`` (HF ``lm_head.weight``, or
``model.embed_tokens.weight`` when the config ties embeddings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.precision import widened
from kiln.ops.registry import register


@register("lm_head", "reference")
def reference(x: torch.Tensor, *, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in the model dtype, returned as float32 (for sampling and comparison).

    Args:
        x: ``[..., H]`` final-normed hidden states (model dtype).

    Returns:
        ``[..., V]`` float32 logits (float64 for float64 ``x``).
    """
    return widened(F.linear(x, weight))

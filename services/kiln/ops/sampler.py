"""``sampler``: next tokens from last-position logits.

Call: ``sampler(logits) -> tokens``; no params. Only greedy decoding for now (temperature, top-k
and top-p would be params of the site).
"""

from __future__ import annotations

import torch

from kiln.ops.registry import register


@register("sampler", "reference")
def reference(logits: torch.Tensor) -> torch.Tensor:
    """Greedy: ``argmax`` over the vocabulary (the lowest index on ties).

    Args:
        logits: ``[B, V]`` float32, the last position of each sequence.

    Returns:
        ``[B]`` int64 token ids.
    """
    return torch.argmax(logits, dim=-1)

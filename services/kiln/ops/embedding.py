"""``embedding``: token ids to hidden states (a row gather).

Call: ``embedding(tokens) -> hidden``; params ``weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.registry import register


@register("embedding", "reference")
def reference(tokens: torch.Tensor, *, weight: torch.Tensor) -> torch.Tensor:
    """Rows of the embedding table.

    Args:
        tokens: ``[B, T]`` int64 token ids in ``[0, V)``.
        weight: ``[V, H]`` embedding table (the model dtype); HF ``model.embed_tokens.weight``.

    Returns:
        ``[B, T, H]`` in ``weight.dtype``.

    Raises:
        IndexError: a token id outside ``[0, V)`` (raised by PyTorch).
    """
    return F.embedding(tokens, weight)

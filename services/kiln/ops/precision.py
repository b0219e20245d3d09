"""The arithmetic type of the reference ops' float32 steps (softmax, norms, rotations, logits).

The gate's exact forward (:mod:`kiln.runtime.exact`) runs the reference ops on float64 copies
of the model's weights; there every step stays float64, so its result carries no rounding of
the model dtype or of float32 (docs/design/engine.md, "Check").
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def widened(t: Tensor) -> Tensor:
    """``t`` as float32, or ``t`` itself when it is float64 (never narrowed)."""
    return t if t.dtype == torch.float64 else t.float()

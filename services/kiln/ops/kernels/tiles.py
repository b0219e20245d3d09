"""Launch-shape rules the Triton kernels share: the warp counts they accept, ``tl.dot``'s smallest
dimension, power-of-two checks and log2(e) for ``exp2``-based softmax."""

from __future__ import annotations

LOG2E = 1.4426950408889634
"""log2(e): softmax kernels use ``exp2`` with scores pre-multiplied by it."""
NUM_WARPS = (1, 2, 4, 8, 16)
"""Warp counts a launch configuration may ask for."""
MMA_MIN = 16
"""``tl.dot`` needs every dimension >= 16."""


def is_pow2(n: int) -> bool:
    """Whether ``n`` is a positive power of two."""
    return n > 0 and n & (n - 1) == 0

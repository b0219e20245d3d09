"""The error of reading or checking weights (its own module: the store and the checkpoint
readers both raise it)."""

from __future__ import annotations


class WeightError(ValueError):
    """Weights missing, mis-shaped or unreadable; the message names the tensors."""

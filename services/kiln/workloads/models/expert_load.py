"""The expert load of an MoE model's layers as measured on a sample (see
:func:`kiln.workloads.models.routing.measure_expert_load`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ExpertLoadReport:
    """Expert load of an MoE model's layers on a sample: ``tokens`` per layer, the imposed
    ``zipf_exponent`` (0.0: none), and per layer index the ``measured`` and ``target`` shares.
    """

    tokens: int
    zipf_exponent: float
    measured: dict[int, tuple[float, ...]]
    target: dict[int, tuple[float, ...]] = field(default_factory=dict)

    def rank_profile(self) -> list[float]:
        """Mean over layers of the shares sorted in decreasing order."""
        rows = [sorted(v, reverse=True) for v in self.measured.values()]
        return [sum(col) / len(rows) for col in zip(*rows, strict=True)] if rows else []

    def hot_ratio(self) -> float:
        """Mean over layers of the hottest share over the uniform share (>= 1)."""
        if not self.measured:
            return 1.0
        return sum(len(v) * max(v) for v in self.measured.values()) / len(self.measured)

    def distance(self) -> float:
        """Largest total-variation distance between a layer's measured and target load (0.0
        without one).
        """
        return max(
            (
                sum(abs(a - b) for a, b in zip(self.measured[i], t, strict=True)) / 2
                for i, t in self.target.items()
            ),
            default=0.0,
        )

    def to_dict(self) -> dict[str, object]:
        """JSON-compatible form (layer keys as strings)."""
        return {
            "tokens": self.tokens,
            "zipf_exponent": self.zipf_exponent,
            "measured": {str(i): list(v) for i, v in self.measured.items()},
            "target": {str(i): list(v) for i, v in self.target.items()},
        }

"""What the planner optimises: output tokens/s per GPU under the user's TTFT and TPOT targets,
and the interactivity-vs-throughput Pareto frontier of the feasible plans.

Figures: an estimate's ``served_*`` properties -- the serving model's medians where it ran (the
planner runs it for its best :data:`~kiln.cost_model.planner.SERVED_PLANS` plans), else the
roofline step's.

Ranking (best first): plans meeting both targets before those that miss; within each, plans
with a lossless KV cache (the activation dtype) before those with an FP8 one, which changes the
model's outputs, so FP8 KV is the answer only where no lossless plan meets the targets (or none
fits the batch). Among those meeting the targets, most output tokens/s per occupied device, then
lowest TPOT, then fewest devices; among those missing, the smallest miss (``max(TPOT / target,
TTFT / target) - 1``) first. Ties (the roofline often costs expert TP and EP over the same group
alike) go to the simpler plan, as practice has it: experts split by EP rather than by expert TP
(whole expert GEMMs), then no DCP, then no PP. The planner computes the *frontier* over the
plans the serving model ran for: a plan is on it when no other of them has at least its tokens/s
per device and at most its TPOT, one of them strictly.

Targets of 0 (unset) take :data:`DEFAULT_TPOT_MS` and :data:`DEFAULT_TTFT_MS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.cost_model.estimate import Estimate

DEFAULT_TPOT_MS = 50.0
"""kiln's default TPOT target, ms: 20 output tokens/s per user, faster than people read."""
DEFAULT_TTFT_MS = 2000.0
"""kiln's default TTFT target, ms."""


@dataclass(frozen=True)
class ServingTargets:
    """Latency targets a plan must meet, ms (each > 0)."""

    tpot_ms: float = DEFAULT_TPOT_MS
    ttft_ms: float = DEFAULT_TTFT_MS

    @classmethod
    def of(cls, tpot_ms: float = 0.0, ttft_ms: float = 0.0) -> ServingTargets:
        """Targets from wire values, 0 meaning the default; ValueError for negative or
        non-finite ones."""
        for name, v in (("tpot_ms", tpot_ms), ("ttft_ms", ttft_ms)):
            if not v >= 0 or v == float("inf"):
                raise ValueError(f"targets.{name} {v!r} must be a finite number >= 0 (0: default)")
        return cls(tpot_ms or DEFAULT_TPOT_MS, ttft_ms or DEFAULT_TTFT_MS)

    def miss(self, est: Estimate) -> float:
        """How far ``est`` misses the targets: 0 when it meets both, else the larger relative
        excess (0.5 = 50 % over a target)."""
        return max(
            0.0, est.served_tpot_ms / self.tpot_ms - 1.0, est.served_ttft_ms / self.ttft_ms - 1.0
        )

    def describe(self) -> str:
        """The objective in words."""
        return (
            f"most output tokens/s per GPU with TPOT ≤ {self.tpot_ms:g} ms and TTFT ≤ "
            f"{self.ttft_ms:g} ms (a lossless KV cache before an FP8 one), then lowest TPOT, "
            "then fewest devices (plans missing a target after, the smallest miss first)"
        )


DEFAULT_TARGETS = ServingTargets()


def rank(estimates: Sequence[Estimate], targets: ServingTargets) -> list[Estimate]:
    """``estimates`` best first under ``targets`` (see the module docs)."""

    def key(e: Estimate) -> tuple[float, float, float, int, int, int, int, str]:
        miss, lossy = targets.miss(e), lossy_kv(e)
        p = e.plan
        simpler = (p.expert_tp, p.dcp, p.pp, p.label())
        if miss > 0:
            return (3.0 if lossy else 2.0, miss, e.served_tpot_ms, p.devices, *simpler)
        return (1.0 if lossy else 0.0, -e.served_per_device, e.served_tpot_ms, p.devices, *simpler)

    return sorted(estimates, key=key)


def lossy_kv(est: Estimate) -> bool:
    """Whether ``est``'s plan keeps its KV cache in FP8 (lossy against the BF16 activations)."""
    return est.plan.kv_dtype.startswith("float8")


def frontier(estimates: Sequence[Estimate]) -> frozenset[str]:
    """Labels of the plans on the tokens/s-per-device vs TPOT Pareto frontier."""
    ordered = sorted(estimates, key=lambda e: (e.served_tpot_ms, -e.served_per_device))
    out: set[str] = set()
    best = float("-inf")
    for e in ordered:
        if e.served_per_device > best:
            out.add(e.plan.label())
            best = e.served_per_device
    return frozenset(out)

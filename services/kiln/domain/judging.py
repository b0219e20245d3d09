"""The tiers, the runner's own agent names, and how a measurement's speedup is taken.

Agents search on :data:`SEARCH_TIER` (fast: a few layers); winners are confirmed on
:data:`CONFIRM_TIER` (full: all layers) by :data:`CONFIRM_AGENT`, each right after the reference
is measured there again. A correct measurement's speedup (:func:`speedup`) is its tokens/s over:

- on the full tier, the reference's correct full-tier measurement (tokens/s > 0) completed last
  before it (:func:`full_reference`);
- on the fast tier, the compilation's baseline (``BaselineMeasured``).

:func:`agreement_text` says the ``TierAgreement`` verdict in words (a succeeded compilation's
reason ends with it, after :data:`AGREEMENT_PREFIX`).
"""

from __future__ import annotations

from collections.abc import Iterable

from kiln.domain.compilation import Baseline
from kiln.domain.experiment import Completed, ExperimentRecord, Requested
from kiln.events.types import Tier

BASELINE_AGENT = "baseline"
"""The agent name of the reference-forward experiment on the fast tier."""
CONFIRM_AGENT = "confirm"
"""The agent name of full-tier experiments (the reference and the candidates confirmed)."""
SEARCH_TIER: Tier = "fast"
"""The tier agents search on."""
CONFIRM_TIER: Tier = "full"
"""The tier winners are confirmed on."""

Result = tuple[Requested, Completed]


def completed_on(experiments: Iterable[ExperimentRecord], tier: Tier) -> list[Result]:
    """The completed experiments requested on ``tier``, in the order they completed."""
    done = [
        (r.requested, r.completed)
        for r in experiments
        if r.completed is not None and r.requested.tier == tier
    ]
    return sorted(done, key=lambda p: p[1].position)


def full_reference(experiments: Iterable[ExperimentRecord], before: int) -> Completed | None:
    """The reference's correct full-tier measurement completed last before ledger position
    ``before`` (with tokens/s > 0), or None."""
    nearest: Completed | None = None
    for req, done in completed_on(experiments, CONFIRM_TIER):
        if done.position >= before:
            break
        if req.candidate.is_reference and done.ok and done.result.tokens_per_s > 0:
            nearest = done
    return nearest


def speedup(
    experiments: Iterable[ExperimentRecord], baseline: Baseline | None, completed: Completed
) -> float | None:
    """tokens/s of a correct measurement over the reference: on the full tier, over the
    nearest earlier full-tier reference (:func:`full_reference`); on the fast tier, over
    ``baseline``. None when the measurement is not correct or its reference is missing."""
    if not completed.ok:
        return None
    if completed.result.tier == CONFIRM_TIER:
        ref = full_reference(experiments, completed.position)
        return None if ref is None else completed.result.tokens_per_s / ref.result.tokens_per_s
    if baseline is None or baseline.tokens_per_s <= 0:
        return None
    return completed.result.tokens_per_s / baseline.tokens_per_s


AGREEMENT_PREFIX = "fast vs full tier: "
"""How :func:`agreement_text` starts (a succeeded compilation's reason ends with it)."""
NONE_CONFIRMED = "no candidate confirmed: "
"""How the reason of a compilation that succeeded without a best begins: ``NONE_CONFIRMED +
why + "; " + why it ended`` (:mod:`kiln.agent_runner.outcome`)."""


def agreement_text(n: int, rho: float | None) -> str:
    """One line for people, e.g. ``fast vs full tier: Spearman rho 0.80 over 5 candidates``."""
    if rho is not None:
        return f"{AGREEMENT_PREFIX}Spearman rho {rho:.2f} over {n} candidates"
    if n == 0:
        return f"{AGREEMENT_PREFIX}no candidate was measured correct on both tiers"
    if n == 1:
        return f"{AGREEMENT_PREFIX}1 candidate measured on both tiers, too few to rank"
    return f"{AGREEMENT_PREFIX}no rank correlation over {n} candidates (one tier ties them all)"

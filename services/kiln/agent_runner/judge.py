"""Judging completed experiments: the baseline, confirmation on the full tier, best-so-far and
tier agreement. Pure functions of the compilation's state, so a restarted runner reaches the same
verdicts. The rules and why they are so: ``docs/design/layers.md`` (Judging).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import replace

from kiln.agent_runner import records
from kiln.agent_runner.state import CompilationState
from kiln.agent_runner.usage import device_ms_of
from kiln.domain import judging
from kiln.domain.candidate import Candidate
from kiln.domain.experiment import Completed, Requested
from kiln.domain.judging import AGREEMENT_PREFIX as AGREEMENT_PREFIX
from kiln.domain.judging import BASELINE_AGENT, CONFIRM_TIER, SEARCH_TIER, Result
from kiln.domain.judging import CONFIRM_AGENT as CONFIRM_AGENT
from kiln.domain.judging import agreement_text as agreement_text
from kiln.domain.step_time import band_top_ms, decision_step_ms
from kiln.events.types import (
    BaselineCompared,
    BestCandidateImproved,
    ExperimentCompleted,
    Tier,
    TierPoint,
    is_counted,
)
from kiln.ledger.model import NewEvent


def completed_on(state: CompilationState, tier: Tier) -> list[Result]:
    """The completed experiments requested on ``tier``, in completion order."""
    return judging.completed_on(state.experiments.values(), tier)


def fast_leader(state: CompilationState) -> Result | None:
    """The correct fast-tier candidate (not the reference) with the most tokens/s if it beats the
    baseline (on a tie the earlier); else None.
    """
    if state.baseline is None:
        return None
    leader: Result | None = None
    bar = state.baseline.tokens_per_s
    for req, done in completed_on(state, SEARCH_TIER):
        if req.candidate.is_reference or not done.ok:
            continue
        if done.result.tokens_per_s > bar:
            leader, bar = (req, done), done.result.tokens_per_s
    return leader


def confirmation_due(state: CompilationState) -> Candidate | None:
    """The fast leader when it has no full-tier experiment yet (requested or done), else None."""
    leader = fast_leader(state)
    if leader is None:
        return None
    cid = leader[0].candidate.id
    if any(
        r.requested.tier == CONFIRM_TIER and r.requested.candidate.id == cid
        for r in state.experiments.values()
    ):
        return None
    return leader[0].candidate


def needs_reference(state: CompilationState) -> bool:
    """Whether the next confirmation starts with a full-tier reference: unless the latest
    full-tier request is the reference.
    """
    full = [r.requested for r in state.experiments.values() if r.requested.tier == CONFIRM_TIER]
    if not full:
        return True
    return not max(full, key=lambda r: r.position).candidate.is_reference


def full_reference(state: CompilationState, before: int) -> Completed | None:
    """The reference's last correct full-tier measurement (tokens/s > 0) completed before ledger
    position ``before``, or None.
    """
    return judging.full_reference(state.experiments.values(), before)


def distinguishable(candidate: ExperimentCompleted, reference: ExperimentCompleted) -> bool:
    """Whether the candidate's p90 step, raised to its decision step
    (:func:`~kiln.domain.step_time.band_top_ms`: front-loaded work cannot hide below the band),
    is faster than the reference's p10 step (decision steps when either lacks percentiles).
    """
    if candidate.p90_ms <= 0 or reference.p10_ms <= 0:
        mine = decision_step_ms(candidate.median_ms, candidate.mean_ms)
        return mine < decision_step_ms(reference.median_ms, reference.mean_ms)
    return band_top_ms(candidate.p90_ms, candidate.median_ms, candidate.mean_ms) < reference.p10_ms


def speedup(state: CompilationState, completed: Completed) -> float | None:
    """tokens/s of a correct measurement over the fast-tier baseline (fast tier) or over
    :func:`full_reference` (full tier); None when either is missing.
    """
    return judging.speedup(state.experiments.values(), state.baseline, completed)


def ranks_by_tokens_per_s(state: CompilationState) -> bool:
    """Whether confirmed candidates rank by their full-tier tokens/s (GPU targets) rather than by
    speedup over their adjacent reference (CPU targets).
    """
    return state.workload.hardware.name.strip().lower() not in ("", "cpu")


def beats_best(state: CompilationState, result: ExperimentCompleted, gain: float) -> bool:
    """Whether a confirmed candidate (``gain`` its speedup over the adjacent reference) beats the
    current best (:func:`ranks_by_tokens_per_s` says by which measure).
    """
    assert state.best is not None
    if ranks_by_tokens_per_s(state):
        return result.tokens_per_s > state.best.tokens_per_s
    return gain > state.best.speedup


def judgement(state: CompilationState, req: Requested, completed: Completed) -> NewEvent | None:
    """The ``BaselineMeasured`` or ``BestCandidateImproved`` a completed experiment calls for, or
    None (also when judged before).
    """
    result, cid = completed.result, state.compilation_id
    if req.tier == CONFIRM_TIER:
        if req.candidate.is_reference:
            return None
        gain = speedup(state, completed)
        if gain is None or gain <= 1.0:
            return None
        if state.best is not None and not beats_best(state, result, gain):
            return None
        ref = full_reference(state, completed.position)
        if ref is None or not distinguishable(result, ref.result):
            return None
        event = records.best_improved(
            cid,
            workload_key=state.workload_key,
            experiment_id=req.experiment_id,
            candidate_id=req.candidate.id,
            tokens_per_s=result.tokens_per_s,
            median_ms=result.median_ms,
            speedup=gain,
            tier=CONFIRM_TIER,
            reference_experiment_id=ref.experiment_id,
            reference_tokens_per_s=ref.result.tokens_per_s,
        )
        return with_progress(event, state, completed)
    if req.agent == BASELINE_AGENT and req.candidate.is_reference:
        if state.baseline is None and completed.ok and result.tokens_per_s > 0:
            return records.baseline_measured(
                cid, req.experiment_id, req.candidate.id, result.tokens_per_s, result.median_ms
            )
    return None


def with_progress(event: NewEvent, state: CompilationState, completed: Completed) -> NewEvent:
    """``event`` with ``elapsed_s`` since submission, ``experiments`` of this compilation
    completed at or before ``completed``'s position and their engine time ``device_s``: a
    function of the state.
    """
    done = [  # measured here: a reused measurement took no experiment and no device time
        r.completed
        for r in state.experiments.values()
        if r.completed is not None and r.completed.position <= completed.position and state.own(r)
    ]
    device_ms = sum(device_ms_of(c.result.model_dump()) for c in done)
    data = dict(event.data) if isinstance(event.data, dict) else {}
    data["elapsed_s"] = max(0.0, (completed.recorded_at - state.submitted_at).total_seconds())
    data["experiments"] = sum(int(is_counted(c.result.status)) for c in done)
    data["device_s"] = device_ms / 1e3
    payload = BestCandidateImproved.model_validate(data)
    return replace(event, data=payload.model_dump(mode="json"))


# ---------------------------------------------------------------------- tier agreement
def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, ties getting the average of the ranks they span."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation with ties (Pearson's correlation of the average ranks, as
    ``scipy.stats.spearmanr``); None for fewer than two pairs or constant ranks on one side.

    Raises:
        ValueError: ``x`` and ``y`` differ in length.
    """
    if len(x) != len(y):
        raise ValueError(f"spearman: {len(x)} values against {len(y)}")
    n = len(x)
    if n < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mean = (n + 1) / 2  # the mean of average ranks, ties or not
    sxy = sum((a - mean) * (b - mean) for a, b in zip(rx, ry, strict=True))
    sxx = sum((a - mean) ** 2 for a in rx)
    syy = sum((b - mean) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return None
    return max(-1.0, min(1.0, sxy / math.sqrt(sxx * syy)))


def tier_points(state: CompilationState) -> list[TierPoint]:
    """Candidates measured correct on both tiers, in fast-tier order: (fast tokens/s, full
    tokens/s, the median when measured several times).
    """
    fast: dict[str, float] = {}
    for req, done in completed_on(state, SEARCH_TIER):
        if done.ok:
            fast.setdefault(req.candidate.id, done.result.tokens_per_s)
    full: dict[str, list[float]] = {}
    for req, done in completed_on(state, CONFIRM_TIER):
        if done.ok:
            full.setdefault(req.candidate.id, []).append(done.result.tokens_per_s)
    return [
        TierPoint(
            candidate_id=cid,
            fast_tokens_per_s=tps,
            full_tokens_per_s=statistics.median(full[cid]),
        )
        for cid, tps in fast.items()
        if cid in full
    ]


def tier_agreement(state: CompilationState) -> NewEvent:
    """``TierAgreement`` for the compilation as it stands."""
    points = tier_points(state)
    rho = spearman([p.fast_tokens_per_s for p in points], [p.full_tokens_per_s for p in points])
    return records.tier_agreement(state.compilation_id, len(points), rho, points)


# ---------------------------------------------------------------------- baselines compared
def compared_event(state: CompilationState, req: Requested, completed: Completed) -> NewEvent:
    """The ``BaselineCompared`` of a baseline experiment: tokens/s, timings, its own check, skip
    or failure reason, operating point (older events: batch = tokens/s x median s), weights bytes
    and prefill median (ms, 0 = not timed).
    """
    from kiln.domain.baselines import skipped_reason

    r = completed.result
    skipped = skipped_reason(r.status, r.error)
    payload = BaselineCompared(
        name=req.baseline,
        experiment_id=req.experiment_id,
        status=r.status,
        correct=r.correct,
        tokens_per_s=r.tokens_per_s,
        median_ms=r.median_ms,
        p10_ms=r.p10_ms,
        p90_ms=r.p90_ms,
        max_abs_error=r.max_abs_error,
        skipped_reason=skipped,
        error="" if skipped else r.error[:500],
        tier=req.tier,
        batch=r.batch_size or (round(r.tokens_per_s * r.median_ms / 1e3) if r.median_ms else 0),
        weights_bytes=r.weights_bytes,
        context=r.context_len,
        prefill_median_ms=r.prefill_median_ms,
    )
    return records.baseline_compared(state.compilation_id, payload)

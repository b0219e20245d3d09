"""Judging a completed experiment: does it set the baseline or a new best? (pure)

- The baseline: the reference candidate proposed by ``baseline``, measured correct with
  tokens/s > 0, while the compilation has no baseline yet -> ``BaselineMeasured``.
- A new best: any other candidate measured correct (status ok and correct) with tokens/s above
  the best so far (the baseline's at first) -> ``BestCandidateImproved`` with speedup =
  tokens/s ÷ baseline tokens/s. Judged on the tier it ran on (fast for now; confirming winners
  on full engines before they count comes with a later issue).
"""

from __future__ import annotations

from kiln.agent_runner import records
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.state import CompilationState
from kiln.ledger.model import NewEvent

BASELINE_AGENT = "baseline"
"""The agent name of the reference-forward experiment."""


def speedup(state: CompilationState, completed: Completed) -> float | None:
    """tokens/s ÷ baseline tokens/s of a correct measurement; None without both."""
    if not completed.ok or state.baseline is None or state.baseline.tokens_per_s <= 0:
        return None
    return completed.result.tokens_per_s / state.baseline.tokens_per_s


def judgement(state: CompilationState, req: Requested, completed: Completed) -> NewEvent | None:
    """The compilation event a completed experiment calls for, or None."""
    result, cid = completed.result, state.compilation_id
    if req.agent == BASELINE_AGENT and req.candidate.is_reference:
        if state.baseline is None and completed.ok and result.tokens_per_s > 0:
            return records.baseline_measured(
                cid, req.experiment_id, req.candidate.id, result.tokens_per_s, result.median_ms
            )
        return None
    gain = speedup(state, completed)
    if gain is None or state.baseline is None:
        return None
    best = state.best.tokens_per_s if state.best else state.baseline.tokens_per_s
    if result.tokens_per_s <= best:
        return None
    return records.best_improved(
        cid,
        workload_key=state.workload_key,
        experiment_id=req.experiment_id,
        candidate_id=req.candidate.id,
        tokens_per_s=result.tokens_per_s,
        median_ms=result.median_ms,
        speedup=gain,
        tier=result.tier,
    )

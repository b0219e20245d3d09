"""Promotion with proof: what an ended compilation of a deployment decides.

- The initial compilation: its confirmed winner (``Compilation.best``, full tier) becomes the
  active candidate (``CandidatePromoted``, reason ``initial``); when it succeeded but nothing
  beat the reference forward, the reference candidate is promoted (it is what serves); a
  failed or cancelled one -> ``PromotionDeclined`` with ``compilation_failed`` (the deployment
  has failed).
- A recompilation: its ``IncumbentComparison`` (Contract 2: the active candidate and the winner
  measured side by side on the full tier at the new shape) decides. Promoted only when the
  challenger is better beyond noise (``challenger_better``) and its gain is at least the
  policy's ``promotion_margin``, and the incumbent compared is still the active candidate.
  Otherwise declined with the numbers and the reason. A compilation that failed or found no
  correct winner is declined with ``compilation_failed`` (its shape is not proven: nothing was
  measured there); in every other case the shape becomes the proven shape, since the active
  candidate was measured there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.json_format import MessageToDict

from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.domain.deployment import DeploymentState
from kiln.events.deployment_types import CandidatePromoted, Comparison, PromotionDeclined
from kiln.v1 import compiler_pb2

_STATUS = {
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED: "succeeded",
    compiler_pb2.COMPILATION_STATUS_FAILED: "failed",
    compiler_pb2.COMPILATION_STATUS_CANCELLED: "cancelled",
}


def comparison_of(c: compiler_pb2.Compilation) -> Comparison:
    """The compilation's IncumbentComparison as the event's :class:`Comparison` (empty when
    none was recorded)."""
    if not c.HasField("incumbent"):
        return Comparison()
    i = c.incumbent
    return Comparison(
        incumbent_candidate_id=i.incumbent_candidate_id,
        challenger_candidate_id=i.challenger_candidate_id,
        incumbent_tokens_per_s=list(i.incumbent_tokens_per_s),
        challenger_tokens_per_s=list(i.challenger_tokens_per_s),
        incumbent_median=max(i.incumbent_median, 0.0),
        challenger_median=max(i.challenger_median, 0.0),
        gain=i.gain,
        noise=max(i.noise, 0.0),
        challenger_better=i.challenger_better,
        reason=i.reason,
        experiment_ids=list(i.experiment_ids),
    )


def decide(
    state: DeploymentState,
    started: Mapping[str, Any],
    compilation: compiler_pb2.Compilation,
    margin: float,
    rebased_at_s: float | None,
) -> CandidatePromoted | PromotionDeclined:
    """The verdict on ``compilation`` (started as ``started``, a RecompilationStarted payload)."""
    cid = str(started["compilation_id"])
    shape = dict(started.get("shape") or MessageToDict(compilation.workload.traffic))
    best = compilation.best if compilation.HasField("best") else None
    status = _STATUS.get(compilation.status, "ended")
    no_winner = best is None or not best.candidate.candidate_id
    if started["reason"] == "initial":
        if no_winner and compilation.status == compiler_pb2.COMPILATION_STATUS_SUCCEEDED:
            # Nothing beat the reference forward: it is what serves (measured, correct).
            return CandidatePromoted(
                compilation_id=cid,
                candidate_id=REFERENCE_CANDIDATE.id,
                reason="initial",
                tokens_per_s=max(compilation.baseline.tokens_per_s, 0.0),
                speedup=1.0,
                shape=shape,
                comparison=Comparison(
                    challenger_candidate_id=REFERENCE_CANDIDATE.id,
                    reason="no candidate beat the reference forward; the reference serves",
                ),
            )
        if no_winner:
            why = compilation.reason or "no candidate was confirmed on the full tier"
            return PromotionDeclined(
                compilation_id=cid,
                reason=f"the first compilation {status} without a confirmed winner: {why}",
                compilation_failed=True,
                shape=shape,
            )
        assert best is not None
        return CandidatePromoted(
            compilation_id=cid,
            candidate_id=best.candidate.candidate_id,
            reason="initial",
            tokens_per_s=max(best.measurement.tokens_per_s, 0.0),
            speedup=max(best.speedup, 0.0),
            shape=shape,
            comparison=Comparison(
                challenger_candidate_id=best.candidate.candidate_id,
                challenger_median=max(best.measurement.tokens_per_s, 0.0),
                reason="the first compilation's confirmed winner (no incumbent)",
            ),
        )
    incumbent = str(started.get("incumbent_candidate_id") or "")
    active = state.active.candidate_id if state.active else ""
    comparison = comparison_of(compilation)
    common: dict[str, Any] = {
        "compilation_id": cid,
        "incumbent_candidate_id": incumbent,
        "shape": shape,
        "comparison": comparison,
        "rebased_at_s": rebased_at_s,
    }
    if no_winner:
        why = compilation.reason or "no candidate was confirmed on the full tier"
        return PromotionDeclined(
            **{**common, "shape": {}},
            reason=f"the recompilation {status} without a confirmed winner: {why}",
            compilation_failed=True,
        )
    assert best is not None
    challenger = best.candidate.candidate_id
    common["challenger_candidate_id"] = challenger
    if challenger == incumbent:
        return PromotionDeclined(
            **common, reason="the recompilation's winner is the active candidate itself"
        )
    if not compilation.HasField("incumbent") or not comparison.incumbent_candidate_id:
        return PromotionDeclined(
            **common,
            reason="no side-by-side comparison with the active candidate was recorded"
            + (f": {comparison.reason}" if comparison.reason else ""),
        )
    if not compilation.incumbent.compared:
        return PromotionDeclined(
            **common, reason=f"not compared side by side: {comparison.reason or 'no reason'}"
        )
    if active != incumbent:
        return PromotionDeclined(
            **common,
            reason=f"the active candidate changed to {active} during the recompilation "
            f"(compared against {incumbent})",
        )
    numbers = (
        f"{comparison.challenger_median:.4g} vs {comparison.incumbent_median:.4g} tokens/s "
        f"({comparison.gain:+.1%}, noise {comparison.noise:.1%}, margin {margin:.1%})"
    )
    if not comparison.challenger_better:
        return PromotionDeclined(
            **common, reason=f"not better beyond noise: {numbers}; {comparison.reason}"
        )
    if comparison.gain < margin:
        return PromotionDeclined(**common, reason=f"better, but below the margin: {numbers}")
    return CandidatePromoted(
        compilation_id=cid,
        candidate_id=challenger,
        previous_candidate_id=incumbent,
        reason="better",
        tokens_per_s=comparison.challenger_median,
        speedup=max(best.speedup, 0.0),
        shape=shape,
        comparison=comparison,
        rebased_at_s=rebased_at_s,
    )

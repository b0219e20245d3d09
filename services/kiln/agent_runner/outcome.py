"""What a compilation's search came to, said at its end (``CompilationEnded.outcome`` and, when
nothing was confirmed, the start of its reason), so that "succeeded" never hides an empty result.

A pure function of the state (a restarted runner says the same):

- ``confirmed``: a candidate was confirmed on the full tier (the compilation has a best);
- ``none_beat_the_baseline``: no candidate beat the reference on the fast tier, so there was
  nothing to confirm;
- ``unconfirmed``: a fast-tier winner's full-tier confirmation never measured correct (the
  budget was spent before it ran or finished, it failed there, or the full-tier reference did
  not measure);
- ``lost_on_full_tier``: every candidate measured on the full tier lost to the reference
  measured next to it, or was within its timing noise.
"""

from __future__ import annotations

from collections import Counter

from kiln.agent_runner.judge import CONFIRM_TIER, SEARCH_TIER, completed_on, fast_leader, speedup
from kiln.agent_runner.state import CompilationState
from kiln.domain.candidate import Candidate
from kiln.domain.judging import NONE_CONFIRMED as NONE_CONFIRMED
from kiln.events.types import Outcome


def _what(candidate: Candidate) -> str:
    text = candidate.describe()
    return text if len(text) <= 80 else text[:77] + "..."


def outcome_of(state: CompilationState) -> tuple[Outcome, str]:
    """The outcome and, unless ``confirmed``, why nothing was confirmed: one clause without
    ``"; "`` (the reason's next clause starts after the first ``"; "``)."""
    outcome, why = _outcome(state)
    return outcome, why.replace("; ", ", ")


def _outcome(state: CompilationState) -> tuple[Outcome, str]:
    if state.best is not None:
        return "confirmed", ""
    leader = fast_leader(state)
    if leader is None:
        correct = sum(
            1
            for req, done in completed_on(state, SEARCH_TIER)
            if done.ok and not req.candidate.is_reference
        )
        if correct == 0:
            return "none_beat_the_baseline", "no candidate measured correct on the fast tier"
        return "none_beat_the_baseline", (
            f"none of the {correct} candidates measured correct on the fast tier beat the "
            "reference there"
        )
    full = [
        (req, done)
        for req, done in completed_on(state, CONFIRM_TIER)
        if not req.candidate.is_reference
    ]
    ok = [(req, done) for req, done in full if done.ok]
    if ok:
        gains = [g for _, done in ok if (g := speedup(state, done)) is not None]
        if not gains:
            return "unconfirmed", (
                f"{len(ok)} candidate(s) measured on the full tier, but the reference did not "
                "measure correct there, so none could be compared"
            )
        return "lost_on_full_tier", (
            f"{len(ok)} candidate(s) measured on the full tier and none beat the reference "
            f"measured next to it beyond timing noise (best {max(gains):.2f}x)"
        )
    gain = leader[1].result.tokens_per_s / state.baseline.tokens_per_s if state.baseline else 0.0
    lead = f"the fast tier's leader ({_what(leader[0].candidate)}, {gain:.2f}x there)"
    refs = [done for req, done in completed_on(state, CONFIRM_TIER) if req.candidate.is_reference]
    failed = [d for d in refs if d.result.status not in ("ok", "cancelled")]
    if failed and not any(d.ok for d in refs):
        r = failed[0].result
        return "unconfirmed", (
            f"the reference did not measure correct on the full tier ({r.status}"
            f"{': ' + r.error[:120] if r.error else ''}), so {lead} could not be confirmed"
        )
    if not full:
        return "unconfirmed", f"{lead} was not measured on the full tier before the end"
    statuses = Counter(done.result.status for _, done in full)
    if set(statuses) == {"cancelled"}:
        return "unconfirmed", f"{lead} ended before its full-tier confirmation finished"
    counts = ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))
    first = next((done.result.error for _, done in full if done.result.error), "")
    detail = f": {first[:120]}" if first else ""
    return "unconfirmed", f"no full-tier confirmation measured correct ({counts}){detail}"

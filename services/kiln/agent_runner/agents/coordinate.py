"""Greedy coordinate descent: from the best candidate so far, change one dimension at a time.

It starts from the space's transforms stacked (on a GPU target: the decode step's fused
kernels captured in a CUDA graph, the engine's fastest known path), then walks the measured
candidates from fastest to slowest (its view: every agent's correct results and the
baseline) and proposes the first one-dimension neighbour that nobody has claimed. So it
climbs from whatever is best right now, including what other agents found, and falls back to
the next-best point when a point's neighbourhood is used up.
"""

from __future__ import annotations

from kiln.agent_runner.agents.base import Agent, Proposal
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.results import Seen
from kiln.agent_runner.space import CandidateSpace
from kiln.domain.candidate import REFERENCE_CANDIDATE


class CoordinateAgent(Agent):
    """Best-first one-dimension moves (see the module docs)."""

    kind = "coordinate"

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """The space's stacked transforms (:meth:`CandidateSpace.stacked`) while unclaimed,
        else the first unclaimed neighbour of the fastest measured candidate that has one."""
        start = space.stacked()
        if start is not None and start.id not in view.claimed and start.id not in self.tried:
            return Proposal(start, f"start: every transform on ({start.describe()})")
        bases = view.ranked()
        if not any(s.candidate.is_reference for s in bases):
            bases.append(Seen(REFERENCE_CANDIDATE, 0.0, True, "baseline"))
        for base in bases:
            for dim, value, candidate in space.neighbours(base.candidate):
                if candidate.id in view.claimed or candidate.id in self.tried:
                    continue
                why = (
                    f"from {base.candidate.describe()} ({base.tokens_per_s:.4g} tokens/s): "
                    f"{dim} -> {value or 'off'}"
                )
                return Proposal(candidate, why)
        return None

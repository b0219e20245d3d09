"""Random search: every point of the space in an order shuffled by the agent's seed.

The seed comes from the compilation id and the agent's name, so a resumed agent walks the same
order and skips what the board shows as claimed.
"""

from __future__ import annotations

import random

from kiln.agent_runner.agents.base import Agent, Proposal
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.space import CandidateSpace
from kiln.workloads.candidate import Candidate


class RandomSearchAgent(Agent):
    """Uniform sampling without replacement (see the module docs)."""

    kind = "random"

    def __init__(self, name: str, seed: int) -> None:
        super().__init__(name, seed)
        self._order: list[Candidate] | None = None
        self._next = 0

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """The next unclaimed point of the shuffled space."""
        if self._order is None:
            self._order = list(space)
            random.Random(self.seed).shuffle(self._order)
        while self._next < len(self._order):
            candidate = self._order[self._next]
            self._next += 1
            if candidate.id not in view.claimed and candidate.id not in self.tried:
                return Proposal(candidate, f"random sample (seed {self.seed})")
        return None

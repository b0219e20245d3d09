"""Random search: points of the space in an order drawn from the agent's seed.

A small space (at most ``ENUMERATE_LIMIT`` points) is enumerated and shuffled, so every point is
visited once; a large one (a GPU space with kernel-parameter dimensions has about 10⁹ points) is
sampled point by point, uniformly per dimension, skipping what was tried or claimed and the
space's excluded points. The seed comes from the compilation id and the agent's name, so a
resumed agent draws the same order and skips what the board shows as claimed.
"""

from __future__ import annotations

import random

from kiln.agent_runner.agents.base import Agent, Proposal
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.space import CandidateSpace
from kiln.domain.candidate import Candidate

ENUMERATE_LIMIT = 100_000
"""Spaces up to this many points are enumerated and shuffled; larger ones are sampled."""
SAMPLE_TRIES = 1_000
"""Draws per proposal in a sampled space before giving up (all drawn points were used)."""


class RandomSearchAgent(Agent):
    """Uniform sampling without replacement (see the module docs)."""

    kind = "random"

    def __init__(self, name: str, seed: int) -> None:
        super().__init__(name, seed)
        self._order: list[Candidate] | None = None
        self._next = 0
        self._rng = random.Random(seed)

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """The next unclaimed point of the shuffled (or sampled) space."""
        if space.size > ENUMERATE_LIMIT:
            return self._sample(view, space)
        if self._order is None:
            self._order = list(space)
            random.Random(self.seed).shuffle(self._order)
        while self._next < len(self._order):
            candidate = self._order[self._next]
            self._next += 1
            if candidate.id not in view.claimed and candidate.id not in self.tried:
                return Proposal(candidate, f"random sample (seed {self.seed})")
        return None

    def _sample(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        for _ in range(SAMPLE_TRIES):
            point = {d.name: self._rng.choice(d.values) for d in space.dims}
            candidate = space.candidate(point)
            if candidate.is_reference or space.excluded(point) is not None:
                continue
            if candidate.id not in view.claimed and candidate.id not in self.tried:
                return Proposal(candidate, f"random sample (seed {self.seed})")
        return None

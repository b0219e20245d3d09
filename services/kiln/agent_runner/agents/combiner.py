"""Composition: put together the best single moves other agents found.

A *move* is one dimension set to a non-default value. From the correct results in its view
and the baseline (the reference's tokens/s), each result credits every dimension where it
differs from the reference with its speedup split evenly in log space: a result ``s`` times
faster than the reference that differs in ``k`` dimensions credits each with ``s^(1/k)``
(a one-move result credits its move with its whole speedup). Per dimension the best-credited
value is that dimension's move; moves that did not beat the reference (credit <= 1) are
dropped. Compositions of two or more moves (pairs, triples, up to all of them; at most
:data:`MAX_MOVES` moves, the best) are proposed best-first by the product of their moves'
credits, skipping any point the board shows as claimed or that this agent tried, and the
space's excluded points (moves an engine refuses together). With nothing left (no baseline
yet, fewer than two moves, every composition taken) it proposes nothing, and the shared loop
waits for the results in flight. Since the combiner starts with the other agents, when
nothing is in flight yet (their first claims still to come) it waits up to
:attr:`CombinerAgent.quiet_s` for a new result before giving up.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from kiln.agent_runner.agents.base import Agent, Lab, Proposal, slot_left
from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.space import CandidateSpace, Value

MAX_MOVES = 12
"""Moves composed at most (2^12 compositions to rank)."""


@dataclass(frozen=True)
class Move:
    """One dimension set to ``value``, credited with ``speedup`` by result ``source`` (a
    candidate id) of ``agent``."""

    dim: str
    value: Value
    speedup: float
    source: str
    agent: str


def best_moves(view: BoardView, space: CandidateSpace) -> list[Move]:
    """Per dimension, the best-credited non-default value (see the module docs), best first;
    empty without a correct reference result."""
    ranked = view.ranked()
    ref = next((s for s in ranked if s.candidate.is_reference), None)
    if ref is None or ref.tokens_per_s <= 0:
        return []
    best: dict[str, Move] = {}
    for seen in ranked:
        if seen.candidate.is_reference or not space.contains(seen.candidate):
            continue
        point = space.assignment(seen.candidate)
        changed = [d for d in space.dims if point[d.name] != d.values[0]]
        if not changed:
            continue
        credit = (seen.tokens_per_s / ref.tokens_per_s) ** (1.0 / len(changed))
        for d in changed:
            old = best.get(d.name)
            if old is None or credit > old.speedup:
                best[d.name] = Move(d.name, point[d.name], credit, seen.candidate.id, seen.agent)
    moves = [m for m in best.values() if m.speedup > 1.0]
    return sorted(moves, key=lambda m: (-m.speedup, m.dim))[:MAX_MOVES]


def compositions(moves: list[Move]) -> list[tuple[Move, ...]]:
    """Every combination of two or more moves, best first by the product of their speedups
    (ties: fewer moves first, then dimension names)."""
    combos = [c for r in range(2, len(moves) + 1) for c in itertools.combinations(moves, r)]
    return sorted(
        combos,
        key=lambda c: (-math.prod(m.speedup for m in c), len(c), [m.dim for m in c]),
    )


QUIET_POLL_S = 1.0
"""While waiting for a first result, how often the combiner checks that experiment slots are
left (seconds): a compilation whose budget is spent must not wait for it."""


class CombinerAgent(Agent):
    """Compose other agents' best moves (see the module docs)."""

    kind = "combiner"
    quiet_s: float = 30.0
    """With nothing to compose and nothing in flight, seconds to wait for a new result before
    stopping (the other agents may not have claimed anything yet)."""

    async def next_proposal(self, view: BoardView, lab: Lab) -> Proposal | None:
        """:meth:`propose`; with nothing to propose and nothing in flight, wait for results."""
        waited = 0.0
        while True:
            proposal = self.propose(view, lab.space)
            if proposal is not None or view.in_flight:
                return proposal  # None: the shared loop waits for the results in flight
            if not await slot_left(lab):
                return None  # the experiment budget is spent: no result will come to compose
            if waited >= self.quiet_s:
                return None
            step = min(QUIET_POLL_S, self.quiet_s - waited)
            if not await view.wait_for_result(step):
                waited += step

    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """The best-predicted composition of the top moves nobody claimed."""
        for combo in compositions(best_moves(view, space)):
            point = {m.dim: m.value for m in combo}
            candidate = space.candidate(point)
            taken = candidate.id in view.claimed or candidate.id in self.tried
            if taken or space.excluded(point) is not None:
                continue
            parts = ", ".join(f"{m.dim}={m.value} (x{m.speedup:.3g}, {m.agent})" for m in combo)
            predicted = math.prod(m.speedup for m in combo)
            return Proposal(candidate, f"composes {parts}: predicted x{predicted:.3g}")
        return None

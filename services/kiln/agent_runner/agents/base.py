"""The agent loop every strategy shares, and what an agent may use of its compilation.

One step: propose a candidate (the strategy) -> drop it, logged, if the compilation's space says
an engine refuses it (:meth:`CandidateSpace.refusal`: strategies draw from the space, so this
only catches what they build outside it) -> ``board.claim`` it (skip it if another agent
holds it) -> post the idea -> have it measured (the runner requests the experiment, waits for
the ledger's answer and judges it, which puts the result in ``lab.results`` for every agent).
The board carries ideas and claims; results reach agents only from the result feed. An agent
stops when the compilation has no experiment slot left, or when its strategy has nothing left
to propose and no claimed candidate's result is pending (a pending one may open new moves, so
it waits for it, at most ``idle_timeout_s``); the runner cancels it when the wall-clock budget
is spent or the compilation is cancelled.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.experiment import Completed
from kiln.agent_runner.results import ResultFeed, Seen
from kiln.agent_runner.space import CandidateSpace
from kiln.board import Board
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate

log = get_logger("kiln.agent_runner.agent")


@dataclass(frozen=True)
class Outcome:
    """A measured candidate: the experiment, its completion and the speedup over the baseline
    (tokens/s ÷ baseline tokens/s; None unless the candidate was measured correct)."""

    experiment_id: str
    candidate: Candidate
    completed: Completed
    speedup: float | None


@dataclass(frozen=True)
class Proposal:
    """A candidate an agent wants measured and why (posted with the idea)."""

    candidate: Candidate
    why: str


class Lab(Protocol):
    """What an agent may use of its compilation (the runner implements it)."""

    @property
    def compilation_id(self) -> str:
        """The compilation."""

    @property
    def space(self) -> CandidateSpace:
        """The candidate space: the hardware target's, restricted to what an engine runs for
        the model."""

    @property
    def board(self) -> Board:
        """The message board (ideas and claims)."""

    @property
    def results(self) -> ResultFeed:
        """The compilation's search results, from the runner's fold of the ledger."""

    async def acquire(self) -> bool:
        """Take an experiment slot, waiting while every slot left is reserved by work that
        may give it back; False once the experiment budget is spent or the compilation
        stops."""

    def release(self) -> None:
        """Give back a slot that was not used."""

    async def measure(
        self, candidate: Candidate, agent: str, *, profile: bool = False
    ) -> Outcome | None:
        """Request an experiment for a reserved slot (on the fast tier, once any full-tier
        confirmation under way is done) and wait for its result; None (slot released) when the
        candidate was already requested in this compilation. ``profile`` asks the engine for
        the per-op profile (``ExperimentCompleted.op_ms``); the loop passes it only for agents
        with ``wants_profiles``."""


async def slot_left(lab: Lab) -> bool:
    """Whether the compilation has an experiment slot left, without keeping it (a strategy
    checks this before paying for work only a measurement would use: an LLM completion, a
    wait for results to compose); waits while the last slots are only reserved."""
    if not await lab.acquire():
        return False
    lab.release()
    return True


class Agent(ABC):
    """A search strategy with the shared loop.

    Args:
        name: the agent's name on the board (``[A-Za-z0-9_.-]``), unique in the compilation.
        seed: its random seed.
    """

    kind: ClassVar[str]
    idle_timeout_s: ClassVar[float] = 600.0
    """With nothing to propose, how long to wait for another agent's result (seconds)."""
    wants_profiles: ClassVar[bool] = False
    """Ask the engine for the per-op profile of every candidate this agent measures (one extra
    eager decode step each; the result body's ``op_ms``)."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        self.tried: set[str] = set()
        self.measured = 0

    @abstractmethod
    def propose(self, view: BoardView, space: CandidateSpace) -> Proposal | None:
        """The next candidate to try (not claimed per ``view``, not tried by this agent), or
        None when the strategy has nothing left."""

    async def next_proposal(self, view: BoardView, lab: Lab) -> Proposal | None:
        """The loop's hook for the next proposal; strategies that must await (an LLM call)
        override it. The default is :meth:`propose` on ``lab.space``."""
        return self.propose(view, lab.space)

    async def run(self, lab: Lab) -> int:
        """Propose, claim and measure until done; returns the experiments measured.

        Raises:
            nats.errors.Error, KilnError: the board or the ledger failed.
        """
        view = BoardView(lab.board, lab.compilation_id, lab.results)
        await view.start()
        try:
            while True:
                proposal = await self.next_proposal(view, lab)
                if proposal is None:
                    # Results still to come from other agents may open new moves.
                    if view.in_flight and await view.wait_for_result(self.idle_timeout_s):
                        continue
                    log.info("agent done: nothing left to propose", agent=self.name)
                    break
                if not await self._step(lab, view, proposal):
                    log.info("agent done: experiment budget spent", agent=self.name)
                    break
        finally:
            await asyncio.shield(view.close())  # completes even if the agent is cancelled again
        return self.measured

    async def _step(self, lab: Lab, view: BoardView, proposal: Proposal) -> bool:
        """One candidate; False when no experiment slot is left."""
        candidate, cid = proposal.candidate, lab.compilation_id
        self.tried.add(candidate.id)
        refusal = lab.space.refusal(candidate)
        if refusal is not None:
            log.warning(
                "proposal dropped: an engine would refuse it",
                agent=self.name,
                candidate=candidate.describe(),
                reason=refusal,
            )
            return True
        if not await lab.acquire():
            return False
        body = {"candidate": candidate.canonical()}
        if not await lab.board.claim(cid, candidate.id, self.name, body):
            lab.release()
            view.claimed.add(candidate.id)
            return True
        view.claimed.add(candidate.id)
        await lab.board.post_idea(
            cid,
            candidate.id,
            self.name,
            {**body, "why": proposal.why, "text": candidate.describe()},
        )
        if self.wants_profiles:
            outcome = await lab.measure(candidate, self.name, profile=True)
        else:
            outcome = await lab.measure(candidate, self.name)
        if outcome is None:
            return True
        self.measured += 1
        result = outcome.completed.result
        view.record(
            Seen(
                candidate,
                result.tokens_per_s,
                outcome.completed.ok,
                self.name,
                dict(result.op_ms),
                dict(result.op_profile_shape),
            )
        )
        return True

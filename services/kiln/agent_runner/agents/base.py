"""The agent loop every strategy shares, and what an agent may use of its compilation.

One step: propose a candidate; drop it, logged, if an engine would refuse it; claim it on the
board (skip it if another agent holds it); post the idea; have it measured (its result reaches
every agent through ``lab.results``). NATS or the ledger being away is waited out; a slot taken
for a step that ends without a request is given back. An agent stops when no experiment slot is
left, or when its strategy has nothing to propose and no claimed result is pending (waiting at
most ``idle_timeout_s``); the runner cancels it at the wall-clock budget or on cancel.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kiln.agent_runner.agents.view import BoardView
from kiln.agent_runner.experiment import Completed
from kiln.agent_runner.outage import ride_out
from kiln.agent_runner.results import ResultFeed, Seen
from kiln.agent_runner.space import CandidateSpace
from kiln.board import Board
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate

log = get_logger("kiln.agent_runner.agent")


@dataclass(frozen=True)
class Outcome:
    """A measured candidate: the experiment, its completion and its speedup over the baseline
    (None unless correct).
    """

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
        """The hardware target's candidate space restricted to the model."""

    @property
    def board(self) -> Board:
        """The message board (ideas and claims)."""

    @property
    def results(self) -> ResultFeed:
        """The compilation's search results, from the runner's fold of the ledger."""

    async def acquire(self) -> bool:
        """Take an experiment slot, waiting while every slot left is reserved; False once the
        budget is spent or the compilation stops.
        """

    def release(self) -> None:
        """Give back a slot that was not used."""

    async def measure(
        self, candidate: Candidate, agent: str, *, profile: bool = False
    ) -> Outcome | None:
        """Request an experiment for a reserved slot and wait for its result; None (slot
        released) when already requested in this compilation. ``profile`` asks for ``op_ms``.
        """


async def slot_left(lab: Lab) -> bool:
    """Whether an experiment slot is left, without keeping it (waits while the last are
    reserved).
    """
    if not await lab.acquire():
        return False
    lab.release()
    return True


class Agent(ABC):
    """A search strategy with the shared loop; ``name`` (``[A-Za-z0-9_.-]``) unique in the
    compilation.
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
        """The next candidate to try (unclaimed, untried by this agent), or None when done."""

    async def next_proposal(self, view: BoardView, lab: Lab) -> Proposal | None:
        """The loop's hook: :meth:`propose` on ``lab.space``; strategies that must await override
        it.
        """
        return self.propose(view, lab.space)

    async def run(self, lab: Lab) -> int:
        """Propose, claim and measure until done; returns the experiments measured. Raises NATS
        or ledger errors.
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
        idea = {**body, "why": proposal.why, "text": candidate.describe()}
        try:
            claimed = await ride_out(
                lambda: lab.board.claim(cid, candidate.id, self.name, body),
                what="claim a candidate",
                compilation=cid,
            )
            if claimed:
                await ride_out(
                    lambda: lab.board.post_idea(cid, candidate.id, self.name, idea),
                    what="post an idea",
                    compilation=cid,
                )
        except BaseException:
            lab.release()  # nothing was requested: the slot goes back
            raise
        view.claimed.add(candidate.id)
        if not claimed:
            lab.release()
            return True
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

"""A compilation's lab: how its agents (and its runner) measure candidates and judge results.

A search-tier measurement takes a budget slot, passes the confirmations' gate, is requested and
completed once through the tracker and judged one at a time; ``BaselineMeasured`` and
``BestCandidateImproved`` are appended to the compilation's stream. Every search-tier judgement
feeds :attr:`CompilationLab.results`, the agents' only source of results. Once ``stop`` is set,
no slot is given.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from kiln.agent_runner.agents import Outcome
from kiln.agent_runner.budget import ExperimentBudget
from kiln.agent_runner.confirmations import Confirmations
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.errors import Failure
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import CONFIRM_AGENT, CONFIRM_TIER, SEARCH_TIER, judgement, speedup
from kiln.agent_runner.results import ResultFeed
from kiln.agent_runner.space import CandidateSpace, model_space
from kiln.agent_runner.state import CompilationState
from kiln.agent_runner.tracker import ExperimentTracker
from kiln.board import Board
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate
from kiln.ledger.model import NewEvent
from kiln.runtime.support import ModelNotSupported
from kiln.v1 import common_pb2

log = get_logger(__name__)


class CompilationLab:
    """The measuring side of one compilation; ``append`` appends an event to its stream (and
    folds it), ``stop`` is set when it stops.
    """

    def __init__(
        self,
        state: CompilationState,
        experiments: ExperimentTracker,
        budget: ExperimentBudget,
        *,
        dispatcher: ExperimentDispatcher,
        board: Board,
        space: Callable[[str], CandidateSpace],
        append: Callable[[NewEvent], Coroutine[Any, Any, Any]],
        stop: asyncio.Event,
    ) -> None:
        self.state, self.experiments, self.budget = state, experiments, budget
        self._dispatcher, self._board, self._space_of = dispatcher, board, space
        self._append, self._stop = append, stop
        self._space: CandidateSpace | None = None
        self._judge_lock = asyncio.Lock()
        self.results = ResultFeed(state.compilation_id)
        """The compilation's search results (see the module docs)."""
        self.results.fill(state)
        self.confirmations = Confirmations(
            state,
            reserve=self.reserve,
            release=self.release,
            measure=self._measure_full,
            finish=self.finish,
        )

    @property
    def compilation_id(self) -> str:
        return self.state.compilation_id

    @property
    def space(self) -> CandidateSpace:
        """The hardware's candidate space restricted to the model; Failure when kiln cannot build
        it.
        """
        if self._space is None:
            hardware = self.state.workload.hardware.name
            model = self.state.workload.model
            try:
                config = json.loads(model.config_json)
                self._space = model_space(
                    self._space_of(hardware), config, hardware, name=model.name or "model"
                )
            except (ValueError, ModelNotSupported) as exc:
                raise Failure(str(exc)) from exc
            log.info(
                "search space",
                compilation=self.compilation_id,
                dimensions=len(self._space.dims),
                points=self._space.size,
                refused=self._space.support.summary() if self._space.support else [],
            )
        return self._space

    @property
    def board(self) -> Board:
        return self._board

    @property
    def workload(self) -> common_pb2.Workload:
        """The compilation's workload (model config, traffic shape, hardware target)."""
        return self.state.workload

    def reserve(self) -> bool:
        """Take an experiment slot; False when the budget is spent or the compilation is
        stopping.
        """
        return not self._stop.is_set() and self.budget.reserve()

    async def acquire(self) -> bool:
        """Take a slot for an agent once no confirmation holds the gate; False once the budget is
        spent or the compilation is stopping.
        """
        if self._stop.is_set() or not await self.budget.acquire(self.confirmations.gate):
            return False
        if self._stop.is_set():  # stopped while waiting: the slot is not used
            self.budget.release()
            return False
        return True

    def release(self) -> None:
        """Give back an unused slot."""
        self.budget.release()

    async def measure(
        self, candidate: Candidate, agent: str, *, profile: bool = False
    ) -> Outcome | None:
        """Request ``candidate`` on the search tier for a reserved slot, wait and judge it
        (``profile`` asks for ``op_ms``). None (slot released) when requested before in this
        compilation.

        Raises:
            KilnError, nats.errors.Error: the ledger or NATS failed.
        """
        try:
            await self.confirmations.gate.wait()
        except asyncio.CancelledError:
            self.release()
            raise
        if candidate.id in self.experiments.requested:
            self.release()
            return None
        self.experiments.requested.add(candidate.id)
        with self.confirmations.searching():
            try:
                req = await self.experiments.shielded(
                    self.experiments.request(candidate, agent, SEARCH_TIER, profile=profile)
                )
            except Exception:
                self.release()  # nothing was requested (a cancelled caller keeps its slot:
                raise  # the request goes on and is settled when the compilation ends)
            completed = await self._dispatcher.wait(req)
            return await self.experiments.shielded(self.complete(req, completed))

    async def finish(self, req: Requested) -> Outcome:
        """Wait for an experiment already requested, then complete and judge it."""
        completed = await self._dispatcher.wait(req)
        outcome: Outcome = await self.experiments.shielded(self.complete(req, completed))
        return outcome

    async def complete(self, req: Requested, completed: Completed) -> Outcome:
        """Take a completed experiment (its slot once) and judge it."""
        if self.experiments.complete(req, completed):
            self.budget.complete()
        return await self.judge(req, completed)

    async def judge(self, req: Requested, completed: Completed) -> Outcome:
        """Record the baseline or a new best if called for; a search-tier result goes to
        :attr:`results`.
        """
        async with self._judge_lock:
            event = judgement(self.state, req, completed)
            if event is not None:
                await self._append(event)
            gain = speedup(self.state, completed)
            if req.tier == SEARCH_TIER:
                self.results.take(req, completed, gain)
                self.confirmations.search_result()
        return Outcome(req.experiment_id, req.candidate, completed, gain)

    async def _measure_full(self, candidate: Candidate) -> None:
        """Request ``candidate`` on the full tier for a taken slot, wait for it, judge it."""
        try:
            req = await self.experiments.shielded(
                self.experiments.request(candidate, CONFIRM_AGENT, CONFIRM_TIER)
            )
        except Exception:
            self.release()
            raise
        await self.finish(req)

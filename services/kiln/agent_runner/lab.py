"""A compilation's lab: how its agents (and its runner) measure candidates and judge results.

A search-tier measurement takes a budget slot, passes the confirmations' gate and the in-flight
limits (the compilation's ``max_in_flight``, then its team's ``work_slot``), is requested and
completed once through the tracker and judged one at a time; ``BaselineMeasured`` and
``BestCandidateImproved`` are appended to the compilation's stream. Every search-tier judgement
feeds :attr:`CompilationLab.results`, the agents' only source of results. Once ``stop`` is set,
no slot is given; a candidate an earlier measurement answers (``reuse``,
:mod:`kiln.agent_runner.reuse`) is recorded as ``MeasurementReused``, judged like a result and
gives its slot back (no device time, outside the budget). Once
:attr:`CompilationLab.search_stop` is set (the wall clock ran out) or ``quota`` names a reason
(the team's device time is spent), agents get none but confirmations still do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

from kiln.agent_runner import records
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
from kiln.events.warm import MeasurementReused
from kiln.ledger.model import NewEvent
from kiln.runtime.support import ModelNotSupported
from kiln.v1 import common_pb2

log = get_logger(__name__)


class CompilationLab:
    """The measuring side of one compilation; ``append`` appends an event to its stream (and
    folds it), ``stop`` is set when it stops. ``max_in_flight``: search-tier experiments under
    way at once (0 = no limit); ``work_slot``: one of the team's work-item slots; ``quota``: why
    the team may not search now (None: it may).
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
        max_in_flight: int = 0,
        work_slot: Callable[[], AbstractAsyncContextManager[None]] | None = None,
        quota: Callable[[], str | None] | None = None,
        reuse: Callable[[Candidate, str], Awaitable[MeasurementReused | None]] | None = None,
    ) -> None:
        self.state, self.experiments, self.budget = state, experiments, budget
        self._dispatcher, self._board, self._space_of = dispatcher, board, space
        self._append, self._stop = append, stop
        self._in_flight = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        self._work_slot = work_slot or contextlib.nullcontext
        self._quota = quota
        self._reuse = reuse
        self.prior_trials: list[tuple[Candidate, float]] = []
        """Candidates measured elsewhere and their tokens/s as predicted for this compilation
        (:mod:`kiln.agent_runner.seeding`): ranking information for the optuna study."""
        self.search_stop = asyncio.Event()
        """Set when the agents must stop (the wall clock ran out) while confirmations finish."""
        self.quota_reason: str | None = None
        """Why a slot was refused for the team's quota, once one was."""
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

    def _searching_stopped(self) -> bool:
        if self._stop.is_set() or self.search_stop.is_set():
            return True
        reason = self._quota() if self._quota is not None else None
        if reason is not None:
            self.quota_reason = reason
            return True
        return False

    async def acquire(self) -> bool:
        """Take a slot for an agent once no confirmation holds the gate; False once the budget is
        spent, the compilation is stopping or searching, or the team's quota is spent.
        """
        if self._searching_stopped() or not await self.budget.acquire(self.confirmations.gate):
            return False
        if self._searching_stopped():  # stopped while waiting: the slot is not used
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
            limits = await self._pass_gate()
        except asyncio.CancelledError:
            self.release()
            raise
        kept = False  # the limits are held until the experiment settles, even for a cancelled
        try:  # caller (its request goes on and is settled when the compilation ends)
            if candidate.id in self.experiments.requested:
                self.release()
                return None
            self.experiments.requested.add(candidate.id)
            reused = await self._reused(candidate, agent)
            if reused is not None:
                return reused
            with self.confirmations.searching():
                requesting = self.experiments.spawn(
                    self.experiments.request(candidate, agent, SEARCH_TIER, profile=profile)
                )
                try:
                    req = await asyncio.shield(requesting)
                except asyncio.CancelledError:
                    kept = True
                    self.experiments.hold(self._keep_until_settled(requesting, limits))
                    raise
                except Exception:
                    self.release()  # nothing was requested
                    raise
                try:
                    completed = await self._dispatcher.wait(req)
                except asyncio.CancelledError:
                    kept = True
                    self.experiments.hold(self._keep_until_settled(requesting, limits))
                    raise
                return await self.experiments.shielded(self.complete(req, completed))
        finally:
            if not kept:
                await limits.aclose()

    async def _reused(self, candidate: Candidate, agent: str) -> Outcome | None:
        """Answer ``candidate`` from an earlier measurement if one is valid here: append
        ``MeasurementReused`` (the state folds it into an experiment record), give the slot
        back and judge it; None to measure it."""
        if self._reuse is None:
            return None
        try:
            found = await self._reuse(candidate, agent)
            if found is None:
                return None
            event = records.measurement_reused(self.compilation_id, found)
            await self.experiments.shielded(self._append(event))
        except BaseException:
            self.experiments.requested.discard(candidate.id)
            self.release()
            raise
        self.release()
        rec = self.state.experiments[found.experiment_id]
        assert rec.completed is not None
        log.info("measurement reused", candidate=candidate.id, experiment=found.experiment_id)
        return await self.judge(rec.requested, rec.completed)

    async def _keep_until_settled(
        self, requesting: asyncio.Task[Requested], limits: contextlib.AsyncExitStack
    ) -> None:
        """Hold ``limits`` until the experiment ``requesting`` records is settled."""
        try:
            req = await requesting
            await self.experiments.settled(req.experiment_id)
        except Exception:
            self.release()  # nothing was requested
        finally:
            await limits.aclose()

    async def _pass_gate(self) -> contextlib.AsyncExitStack:
        """Wait for the confirmations' gate and the in-flight limits (the compilation's, then
        the team's); returns them held, the gate open. The limits are taken after the gate and
        the gate looked at again, so a confirmation that closed it meanwhile goes first.
        """
        while True:
            await self.confirmations.gate.wait()
            limits = contextlib.AsyncExitStack()
            try:
                if self._in_flight is not None:
                    await limits.enter_async_context(self._in_flight)
                await limits.enter_async_context(self._work_slot())
            except BaseException:
                await limits.aclose()
                raise
            if self.confirmations.gate.is_set():
                return limits
            await limits.aclose()

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

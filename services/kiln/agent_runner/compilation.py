"""One compilation, run to its end: plan, baseline, agents, confirmations, best-so-far, budget,
cancel.

The runner is the only writer of its ``compilation-<id>`` stream besides cancel requests. Its
events, in order: ``CompilationPlanned``, ``BaselineMeasured``, ``BestCandidateImproved`` per
confirmed improvement, ``BaselineCompared`` per baseline (after the search), ``TierAgreement``,
``CompilationEnded``.

It stays ``pending`` until its team's quotas admit it (:mod:`kiln.agent_runner.admission`); its
wall-clock budget runs from then. It ends ``succeeded`` when a budget is spent, the team's device
time is spent or the agents have nothing left to propose (with the search's outcome,
:mod:`kiln.agent_runner.outcome`: a reason starting ``no candidate confirmed: <why>`` when it has
no best); ``cancelled`` after a cancel request;
``failed`` when the cost model is unreachable or refuses, the baseline does not measure, or every
agent fails. When the wall clock runs out while a confirmation is under way or due, the agents
stop and the confirmation still runs, for at most ``RunnerConfig.confirm_grace_s`` (the end's
reason says how long it took, or that it was cut). Before ``CompilationEnded`` every requested
experiment gets its ``ExperimentCompleted`` (``timed_out`` or ``cancelled`` if need be). On
shutdown the runner stops without ending the compilation; a new process resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any

import structlog

from kiln.agent_runner import records
from kiln.agent_runner.admission import Admission
from kiln.agent_runner.agents import build_agents
from kiln.agent_runner.budget import ExperimentBudget, WallClock
from kiln.agent_runner.comparisons import BaselineComparisons
from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.errors import Failure
from kiln.agent_runner.experiment import Requested
from kiln.agent_runner.incumbent import IncumbentComparison
from kiln.agent_runner.judge import (
    BASELINE_AGENT,
    CONFIRM_TIER,
    SEARCH_TIER,
    agreement_text,
    completed_on,
    tier_agreement,
)
from kiln.agent_runner.lab import CompilationLab
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.outage import ride_out
from kiln.agent_runner.outcome import NONE_CONFIRMED, outcome_of
from kiln.agent_runner.planning import choose_plan
from kiln.agent_runner.resume import orphan_claims
from kiln.agent_runner.reuse import ReuseIndex
from kiln.agent_runner.seeding import measure_seeds
from kiln.agent_runner.space import CandidateSpace
from kiln.agent_runner.state import CompilationState
from kiln.agent_runner.stream import CompilationStream
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.agent_runner.tracker import ExperimentTracker
from kiln.agent_runner.workload import workload_to_json
from kiln.board import Board
from kiln.common.logging import get_logger
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.domain.compilation import Status
from kiln.events.types import EndStatus, Outcome

log = get_logger("kiln.agent_runner.compilation")


@dataclass(frozen=True)
class RunnerDeps:
    """What every runner of one agent-runner process shares (ledger clients per team, dispatcher,
    board, a cost model stub and its address, candidate space, config, the teams' admission).
    """

    ledger: LedgerPool
    dispatcher: ExperimentDispatcher
    board: Board
    cost_model: Callable[[str], Any]
    cost_model_addr: str
    space: Callable[[str], CandidateSpace]
    config: RunnerConfig
    admission: Admission


class CompilationRunner:
    """Runs one compilation; its agents measure through :attr:`lab`. ``resumed``: started by a
    restart (orphan claims are then measured).
    """

    def __init__(self, state: CompilationState, deps: RunnerDeps, *, resumed: bool = False) -> None:
        self.state = state
        self._deps = deps
        self._resumed = resumed
        self._stop = asyncio.Event()
        self._cancelled = asyncio.Event()
        """Set once a cancel is known (the baselines, measured after the search, stop on it)."""
        self._stream = CompilationStream(state, deps.ledger.client(state.team), self._stopped)
        workload_json = workload_to_json(state.workload)
        # first: they take the baseline comparisons and incumbent runs out of state.experiments
        self._compares = BaselineComparisons(state, deps.dispatcher, workload_json, self._cancelled)
        cfg = deps.config
        self._incumbent = IncumbentComparison(
            state,
            deps.dispatcher,
            workload_json,
            self._cancelled,
            runs=cfg.incumbent_runs,
            margin=cfg.incumbent_margin,
        )
        self._experiments = ExperimentTracker(state, deps.dispatcher, cfg, workload_json)
        in_flight = len(self._experiments.in_flight)
        self._budget = ExperimentBudget(  # reused measurements are outside the budget
            limit=state.max_experiments,
            completed=sum(state.own(r) for r in state.experiments.values()) - in_flight,
            in_flight=in_flight,
        )
        admission, team = deps.admission, state.team
        if not state.ended:
            if state.compilation.status == Status.RUNNING:
                admission.hold(team, state.compilation_id)  # admitted before a restart
            else:
                admission.enqueue(team, state.compilation_id, state.submitted_position)
        self._agent_tasks: list[asyncio.Task[Any]] = []
        self.lab = CompilationLab(
            state,
            self._experiments,
            self._budget,
            dispatcher=deps.dispatcher,
            board=deps.board,
            space=deps.space,
            append=self._stream.append,
            stop=self._stop,
            max_in_flight=admission.limits(team).max_in_flight,
            work_slot=partial(admission.work_slot, team),
            quota=partial(admission.device_time_spent, team),
            reuse=ReuseIndex(deps.ledger, state, cfg.reuse_max_age_s).lookup,
        )
        """What the agents measure with."""
        self.agents_measured: dict[str, int] = {}
        self.finished = asyncio.Event()
        """Set when :meth:`run` returns (ended, or stopped by shutdown)."""

    @property
    def compilation_id(self) -> str:
        return self.state.compilation_id

    # ------------------------------------------------------------------ control
    def request_cancel(self, reason: str) -> None:
        """Stop the compilation as cancelled (the cancel request is already in the ledger)."""
        if self.state.ended:
            return
        if self.state.cancel_reason is None:
            self.state.cancel_reason = reason or "cancel requested"
        self._stopped()

    def _stopped(self) -> None:
        """Stop the search; a cancel (``state.cancel_reason`` set) stops the baselines too."""
        self._stop.set()
        if self.state.cancel_reason is not None:
            self._cancelled.set()

    async def run(self) -> None:
        """Run to the end (or until cancelled by shutdown, leaving the compilation open)."""
        structlog.contextvars.bind_contextvars(
            compilation_id=self.compilation_id, team=self.state.team
        )
        try:
            await self._run()
        except asyncio.CancelledError:
            log.info("runner stopped; the compilation stays open", compilation=self.compilation_id)
            await asyncio.shield(self._experiments.abandon())
            raise
        except Exception as exc:
            log.exception("runner failed", compilation=self.compilation_id)
            with contextlib.suppress(Exception):
                await self._end("failed", f"internal error in the agent runner: {exc!r}")
        finally:
            self._deps.admission.release(self.state.team, self.compilation_id)
            self.finished.set()

    async def _run(self) -> None:
        st = self.state
        if st.ended:
            return
        status: EndStatus
        if st.cancel_reason is not None:
            status, reason = "cancelled", st.cancel_reason
        else:
            if self._compares.records or self._incumbent.started:  # restarted after the search
                status, reason = "succeeded", "the search had ended before a restart"
            elif not await self._admitted():
                status, reason = "cancelled", st.cancel_reason or "cancel requested"
            else:
                status, reason = await self._search_until_stopped()
            if status == "succeeded" and (st.baselines or self._incumbent.wanted):
                why = f"the search ended ({reason}) before an engine answered"
                await self._settle(why, compares=False)
                await self._incumbent.run(self._stream.append, self._experiments.shielded)
                await self._compares.run(self._stream.append, self._experiments.shielded)
                if st.cancel_reason is not None:
                    status, reason = "cancelled", st.cancel_reason
        await self._end(status, reason)

    async def _admitted(self) -> bool:
        """Wait (pending) until the team's quotas admit the compilation; False when it was
        cancelled meanwhile."""
        st, admission = self.state, self._deps.admission
        if st.compilation.status == Status.RUNNING:
            return True
        admit = asyncio.ensure_future(
            admission.admit(st.team, st.compilation_id, st.submitted_position)
        )
        if not admit.done():
            log.info(
                "compilation pending",
                compilation=st.compilation_id,
                why=admission.why_pending(st.team),
            )
        stopper = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({admit, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            await cancel_and_wait(stopper)
            await cancel_and_wait(admit)
        return st.cancel_reason is None and admit.done() and not admit.cancelled()

    async def _search_until_stopped(self) -> tuple[EndStatus, str]:
        st = self.state
        wall = WallClock(st.compilation.started_at or datetime.now(UTC), st.wall_seconds)
        search = asyncio.create_task(self._search(), name=f"kiln-search-{st.compilation_id}")
        stopper = asyncio.create_task(self._stop.wait())
        overtime = ""
        try:
            done, _ = await asyncio.wait(
                {search, stopper},
                timeout=max(0.0, wall.remaining_s(datetime.now(UTC))),
                return_when=asyncio.FIRST_COMPLETED,
            )
            wall_out = not done
            if wall_out and self.lab.confirmations.pending:
                overtime = await self._finish_confirmation(search, stopper, wall)
                done = {search} if search.done() else set()
        finally:
            self._stop.set()  # agents that miss the cancellation stop at their next step
            await cancel_and_wait(stopper)
            await cancel_and_wait(search)
        if st.cancel_reason is not None:
            return "cancelled", st.cancel_reason
        if search in done:
            exc = search.exception()
            if isinstance(exc, Failure):
                return "failed", exc.reason
            if exc is not None:
                log.error("search failed", compilation=st.compilation_id, exc_info=exc)
                return "failed", f"internal error in the agent runner: {exc!r}"
            if not wall_out:
                return "succeeded", self._search_end_reason()
        if st.baseline is None:
            return "failed", f"{wall.end_reason()} before the baseline was measured"
        return "succeeded", wall.end_reason() + overtime

    def _search_end_reason(self) -> str:
        """Why a search that stopped by itself ended: the team's quota, else the budget's."""
        quota = self.lab.quota_reason
        if quota is not None:
            return f"the search stopped: {quota} ({self._budget.completed} experiments)"
        return self._budget.end_reason()

    async def _finish_confirmation(
        self, search: asyncio.Task[None], stopper: asyncio.Task[Any], wall: WallClock
    ) -> str:
        """The wall clock ran out with a confirmation under way or due: stop the agents, close
        their experiments and wait for the search (which then ends with the confirmation) at
        most ``confirm_grace_s``; returns what the end's reason adds."""
        grace = self._deps.config.confirm_grace_s
        start = time.monotonic()
        self.lab.search_stop.set()  # an agent that misses its cancellation stops at its next step
        for task in self._agent_tasks:
            task.cancel()
        why = f"{wall.end_reason()}: the agents stopped before an engine answered"
        await self._close_search_experiments(why)
        log.info("wall clock spent; finishing a confirmation", compilation=self.compilation_id)
        done, _ = await asyncio.wait(
            {search, stopper}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
        )
        waited = time.monotonic() - start
        if search in done:
            return f"; its last confirmation ended {waited:.1f} s after it"
        if stopper in done:
            return ""
        return f"; a confirmation still waiting for a device after {grace:g} s more was cancelled"

    async def _close_search_experiments(self, why: str) -> None:
        """Close the search-tier experiments in flight as cancelled (their queued work is
        dropped, so the device serves the confirmation and other compilations)."""
        for req in list(self._experiments.in_flight.values()):
            if req.tier != SEARCH_TIER:
                continue
            completed = await self._deps.dispatcher.close(req, why, status="cancelled")
            await self.lab.complete(req, completed)

    async def _end(self, status: EndStatus, reason: str) -> None:
        """Settle every experiment, then append TierAgreement (once a baseline was measured) and
        CompilationEnded in one atomic append.
        """
        self._stop.set()
        await self._settle(f"the compilation ended ({status}) before an engine answered")
        st, events = self.state, []
        agreement = st.tier_agreement
        if st.baseline is not None and agreement is None:
            event = tier_agreement(st)
            assert isinstance(event.data, dict)
            agreement = (int(event.data["n"]), event.data["rho"])
            events.append(event)
        outcome: Outcome = ""
        if status != "failed":
            outcome, why = outcome_of(st)
            if why and status == "succeeded":
                reason = f"{NONE_CONFIRMED}{why}; {reason}"
        if status == "succeeded" and agreement is not None:
            reason = f"{reason}; {agreement_text(*agreement)}"
        if self._incumbent.wanted:  # never ends without the comparison, made or not
            events.append(self._incumbent.not_made(f"the compilation {status} first: {reason}"))
        events.append(records.ended(self.compilation_id, status, reason, outcome))
        await self._stream.append(*events)
        log.info(
            "compilation ended",
            compilation=self.compilation_id,
            status=status,
            outcome=outcome,
            reason=reason,
        )

    async def _settle(self, why: str, *, compares: bool = True) -> None:
        """Wait for requests and judgements under way and close the experiments still pending
        (the baselines' too when ``compares``).
        """
        await self._experiments.drain()
        for req in list(self._experiments.in_flight.values()):
            completed = await self._deps.dispatcher.close(req, why, status="cancelled")
            await self.lab.complete(req, completed)
        if compares:
            await self._compares.close_pending(why)
            await self._incumbent.close_pending(why)

    # ------------------------------------------------------------------ the search
    async def _search(self) -> None:
        st = self.state
        await self._experiments.adopt()
        if st.plan is None:
            await self._plan()
        await self._baseline()
        await self._catch_up_best()
        in_flight = list(self._experiments.in_flight.values())
        extra: list[Coroutine[Any, Any, Any]] = [
            self._finish_adopted(req)
            for req in in_flight
            if req.agent != BASELINE_AGENT and req.tier == SEARCH_TIER
        ]
        if self._resumed:
            extra.extend(await self._orphan_claims())
        agents = build_agents(st.agents, st.compilation_id)
        confirming = asyncio.create_task(
            self.lab.confirmations.run(in_flight), name=f"kiln-confirm-{st.compilation_id}"
        )
        try:
            # the warm start's seeds first, then the agents (kiln.agent_runner.seeding)
            await measure_seeds(self.lab, self._deps.config.warm_measure)
            # Tasks, so that the wall clock can stop the agents and leave the confirmations
            # running (a cancelled one is a CancelledError among the results).
            self._agent_tasks = [
                asyncio.create_task(c) for c in (*(agent.run(self.lab) for agent in agents), *extra)
            ]
            results = await asyncio.gather(*self._agent_tasks, return_exceptions=True)
            self.lab.confirmations.agents_done()
            await asyncio.wait({confirming})
        finally:
            for task in self._agent_tasks:
                task.cancel()
            await cancel_and_wait(confirming)
        errors: list[BaseException] = []
        for agent, result in zip(agents, results, strict=False):
            if isinstance(result, asyncio.CancelledError):
                continue  # stopped by the wall clock
            if isinstance(result, BaseException):
                errors.append(result)
                log.error("agent failed", agent=agent.name, exc_info=result)
            else:
                self.agents_measured[agent.name] = result
        for result in results[len(agents) :]:
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                log.error("resumed experiment failed", exc_info=result)
        if errors and len(errors) == len(agents):
            raise Failure(f"every agent failed; the first: {errors[0]!r}")

    async def _plan(self) -> None:
        st, cfg = self.state, self._deps.config
        plan = await choose_plan(
            self._deps.cost_model(st.team),
            st.workload,
            addr=self._deps.cost_model_addr,
            timeout_s=cfg.plan_timeout_s,
            attempts=cfg.plan_attempts,
            outage_s=cfg.plan_outage_s,
        )
        await self._stream.append(records.planned(st.compilation_id, plan))

    async def _baseline(self) -> None:
        """Measure the reference forward (or finish measuring it after a restart)."""
        st = self.state
        if st.baseline is not None:
            return
        rec = next(
            (r for r in st.experiments.values() if r.requested.agent == BASELINE_AGENT), None
        )
        if rec is not None and rec.completed is not None:
            await self.lab.judge(rec.requested, rec.completed)
        elif rec is not None:
            await self.lab.finish(rec.requested)
        else:
            if not self._budget.reserve():
                raise Failure("no experiment slot is left for the baseline")
            ref = REFERENCE_CANDIDATE
            try:
                await ride_out(
                    lambda: self._deps.board.claim(
                        st.compilation_id, ref.id, BASELINE_AGENT, {"candidate": ref.canonical()}
                    ),
                    what="claim the reference",
                    compilation=st.compilation_id,
                )
            except BaseException:
                self._budget.release()
                raise
            # profiled, so profile-guided agents see where the reference's time goes from the
            # start (one extra eager decode step, after the timed ones)
            await self.lab.measure(ref, BASELINE_AGENT, profile=True)
        if st.baseline is None:
            rec = next(r for r in st.experiments.values() if r.requested.agent == BASELINE_AGENT)
            result = rec.completed.result if rec.completed else None
            detail = f"{result.status}: {result.error or 'no error given'}" if result else "?"
            raise Failure(f"the baseline (reference forward pass) did not measure: {detail}")

    async def _catch_up_best(self) -> None:
        """After a restart: judge the completed confirmations again in completion order (a
        recorded judgement gives nothing).
        """
        for req, completed in completed_on(self.state, CONFIRM_TIER):
            if not req.candidate.is_reference:
                await self.lab.judge(req, completed)

    async def _finish_adopted(self, req: Requested) -> None:
        """Wait for an experiment requested before a restart and judge it."""
        with self.lab.confirmations.searching():
            await self.lab.finish(req)

    async def _orphan_claims(self) -> list[Coroutine[Any, Any, Any]]:
        """Measure candidates claimed before a restart but never requested."""
        posts = await ride_out(
            lambda: self._deps.board.history(self.compilation_id, kinds=["claim"]),
            what="read the board's claims",
            compilation=self.compilation_id,
        )
        return [
            self._measure_orphan(candidate, agent)
            for candidate, agent in orphan_claims(posts, self._experiments.requested)
            if agent != BASELINE_AGENT
        ]

    async def _measure_orphan(self, candidate: Candidate, agent: str) -> None:
        if await self.lab.acquire():
            await self.lab.measure(candidate, agent)

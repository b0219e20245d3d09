"""The experiments a compilation's runner requests, each tracked from its request to its one
completion. NATS being away is waited out; work that NATS refuses closes its experiment at once
(``timed_out``), so none is left open; a completion fills the state's record and is counted once.
Steps a cancelled caller must not cut run shielded; :meth:`ExperimentTracker.drain` waits for
them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from kiln.agent_runner.config import RunnerConfig
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import BASELINE_AGENT, SEARCH_TIER
from kiln.agent_runner.state import CompilationState, ExperimentRecord
from kiln.agent_runner.tasks import cancel_and_wait
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate
from kiln.events.types import Tier

log = get_logger(__name__)


class ExperimentTracker:
    """One compilation's experiments in flight (after a restart: those of ``state``).

    Attributes:
        in_flight: experiment id -> request, not completed yet.
        requested: candidate ids requested on the search tier (each measured once).
    """

    def __init__(
        self,
        state: CompilationState,
        dispatcher: ExperimentDispatcher,
        config: RunnerConfig,
        workload_json: dict[str, Any],
    ) -> None:
        self.state, self._dispatcher, self._config = state, dispatcher, config
        self._workload_json = workload_json
        self.in_flight: dict[str, Requested] = {}
        self.requested: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._holders: set[asyncio.Task[Any]] = set()
        self._settled: dict[str, asyncio.Event] = {}
        for rec in state.experiments.values():
            if rec.requested.tier == SEARCH_TIER:
                self.requested.add(rec.requested.candidate.id)
            if rec.completed is None:
                self.in_flight[rec.requested.experiment_id] = rec.requested

    async def adopt(self) -> None:
        """Queue the work of the experiments in flight again (after a restart)."""
        for req in list(self.in_flight.values()):
            await self._dispatcher.adopt(req, self._workload_json)

    async def request(
        self, candidate: Candidate, agent: str, tier: Tier, *, profile: bool = False
    ) -> Requested:
        """Record the experiment, track it and queue its work (the ledger or NATS being away is
        waited out); KilnError when the ledger refused it.
        """
        st, dispatcher = self.state, self._dispatcher
        req = await dispatcher.record(
            team=st.team,
            compilation_id=st.compilation_id,
            candidate=candidate,
            agent=agent,
            tier=tier,
            profile=profile,
        )
        self.in_flight[req.experiment_id] = req
        st.experiments[req.experiment_id] = ExperimentRecord(req)
        deadline = None  # a search candidate's share of the budget; the reference's in full
        if tier == SEARCH_TIER and agent != BASELINE_AGENT:
            deadline = self._config.search_deadline_s(st.wall_seconds)
        try:
            await dispatcher.publish(req, self._workload_json, deadline)
        except Exception as exc:
            log.error("cannot queue the work", experiment=req.experiment_id, error=repr(exc))
            with contextlib.suppress(Exception):  # else the end of the compilation closes it
                await dispatcher.close(req, f"the work could not be queued on NATS: {exc!r}")
        return req

    def complete(self, req: Requested, completed: Completed) -> bool:
        """Take an experiment's completion; False when it was taken before."""
        if self.in_flight.pop(req.experiment_id, None) is None:
            return False
        settled = self._settled.pop(req.experiment_id, None)
        if settled is not None:
            settled.set()
        self.state.experiments[req.experiment_id] = ExperimentRecord(req, completed)
        self.state.compilation.count(req.experiment_id, completed.result.status)
        self._dispatcher.forget(req.experiment_id)
        return True

    async def settled(self, experiment_id: str) -> None:
        """Wait until the experiment is no longer in flight (completed, or closed)."""
        if experiment_id not in self.in_flight:
            return
        await self._settled.setdefault(experiment_id, asyncio.Event()).wait()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` as a task :meth:`drain` waits for and a cancelled caller does not
        cancel."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def shielded(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` as a task a cancelled caller does not cancel."""
        return await asyncio.shield(self.spawn(coro))

    def hold(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background, e.g. to keep a limit until an experiment settles
        (:meth:`drain` does not wait for it; :meth:`abandon` cancels it)."""
        task = asyncio.create_task(coro)
        self._holders.add(task)
        task.add_done_callback(self._holders.discard)

    async def drain(self) -> None:
        """Wait for the shielded steps under way (and those they start)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def abandon(self) -> None:
        """Cancel the shielded steps under way (shutdown: a restart redoes them)."""
        await asyncio.gather(*(cancel_and_wait(t) for t in [*self._tasks, *self._holders]))

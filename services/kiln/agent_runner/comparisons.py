"""A compilation's baselines (:mod:`kiln.baselines`), measured once its search is over.

Each baseline asked for is one experiment on the full tier (agent ``compare:<name>``, the
reference candidate as a placeholder the engine ignores), recorded as ``BaselineCompared``
(:func:`~kiln.agent_runner.judge.compared_event`), never judged and outside the experiment
budget. They run after the search's wall-clock budget: measured during the search they held the
full-tier engine for minutes on 8B models (compiling, eager steps) while winners waited for
their confirmation.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import CONFIRM_TIER, compared_event
from kiln.agent_runner.state import CompilationState, ExperimentRecord
from kiln.agent_runner.tasks import unless_set
from kiln.common.errors import InvalidArgument
from kiln.common.logging import get_logger
from kiln.domain.baselines import compare_agent, default_baselines, parse_names
from kiln.domain.candidate import REFERENCE_CANDIDATE
from kiln.ledger.model import NewEvent

log = get_logger(__name__)


def validate_baselines(names: list[str], hardware: str) -> list[str]:
    """The baselines a Submit asks for: ``names`` parsed
    (:func:`~kiln.domain.baselines.parse_names`), or the hardware's default
    (:func:`~kiln.domain.baselines.default_baselines`) when ``names`` is empty; ``["none"]``
    asks for none.

    Raises:
        InvalidArgument: an unknown baseline name.
    """
    if not names:
        return default_baselines(hardware)
    try:
        return parse_names(names)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


class BaselineComparisons:
    """The baseline experiments of one compilation, by baseline name.

    Args:
        state: the compilation (its baseline experiments are taken out of
            ``state.experiments``: never judged, not in the experiment budget; their
            completions are counted by ``state.compilation``).
        dispatcher: records, queues and waits for experiments.
        workload_json: the work items' workload (JSON object).
        cancelled: set once the compilation is cancelled.
    """

    def __init__(
        self,
        state: CompilationState,
        dispatcher: ExperimentDispatcher,
        workload_json: dict[str, Any],
        cancelled: asyncio.Event,
    ) -> None:
        self.state, self._dispatcher = state, dispatcher
        self._workload_json, self._cancelled = workload_json, cancelled
        self.records: dict[str, ExperimentRecord] = {}
        for eid, rec in list(state.experiments.items()):
            if rec.requested.baseline:
                del state.experiments[eid]
                self.records[rec.requested.baseline] = rec

    async def run(
        self,
        append: Callable[[NewEvent], Coroutine[Any, Any, Any]],
        shielded: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]],
    ) -> None:
        """Measure the baselines not recorded yet, one after another; ``append`` records an
        event, ``shielded`` runs a step a cancelled caller must not cut. After a restart the
        ones in flight are adopted; a cancel stops them at once (the one in flight is closed
        by :meth:`close_pending`); a baseline no engine answered in time stops the rest (the
        full-tier engines are gone: each would wait as long); a failure is logged and the next
        goes on."""
        st, dispatcher = self.state, self._dispatcher
        for name in st.baselines:
            if name in st.compared:
                continue
            if st.cancel_reason is not None:
                return
            try:
                rec = self.records.get(name)
                if rec is None:
                    req = await shielded(self._request(name))
                    rec = self.records[name] = ExperimentRecord(req)
                elif rec.completed is None:
                    await dispatcher.adopt(rec.requested, self._workload_json)
                completed = rec.completed or await unless_set(
                    self._dispatcher.wait(rec.requested), self._cancelled
                )
                if completed is None:
                    return
                self._completed(rec.requested, completed)
                await shielded(append(compared_event(st, rec.requested, completed)))
                if completed.result.status == "timed_out":
                    log.warning("baselines stopped: no engine answered", baseline=name)
                    return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.error("baseline comparison failed", baseline=name, exc_info=exc)

    async def close_pending(self, why: str) -> None:
        """Close the baseline experiments no engine answered (``cancelled``, ``why``)."""
        for rec in list(self.records.values()):
            if rec.completed is None:
                completed = await self._dispatcher.close(rec.requested, why, status="cancelled")
                self._completed(rec.requested, completed)

    def _completed(self, req: Requested, completed: Completed) -> None:
        """Take a baseline experiment's completion, counted by the compilation aggregate."""
        self._dispatcher.forget(req.experiment_id)
        self.records[req.baseline] = ExperimentRecord(req, completed)
        self.state.compilation.count(req.experiment_id, completed.result.status)

    async def _request(self, name: str) -> Requested:
        """Record and queue baseline ``name``'s experiment (the ledger or NATS being away is
        waited out); work that NATS refuses closes it at once (``timed_out``)."""
        st, dispatcher = self.state, self._dispatcher
        req = await dispatcher.record(
            team=st.team,
            compilation_id=st.compilation_id,
            candidate=REFERENCE_CANDIDATE,
            agent=compare_agent(name),
            tier=CONFIRM_TIER,
            baseline=name,
        )
        try:
            await dispatcher.publish(req, self._workload_json)
        except Exception as exc:
            log.error("cannot queue the baseline", experiment=req.experiment_id, error=repr(exc))
            with contextlib.suppress(Exception):
                await dispatcher.close(req, f"the work could not be queued on NATS: {exc!r}")
        return req

"""The incumbent measured side by side with a compilation's winner, after the search and its
confirmations (docs/design/warm_start.md, "Incumbent").

When ``CompilationSubmitted.incumbent`` is set, the runner measures the incumbent (I) and the
winner, the challenger (C, the last ``BestCandidateImproved``), on the full tier at this
compilation's operating point, interleaved I C I C ... (:attr:`RunnerConfig.incumbent_runs`
each; agent ``incumbent``), so drift of the machine over the minutes it takes falls on both
alike. It is outside the experiment budget, as the baselines are (the verdict must not depend
on what the search left), and runs before them.

Decision (:func:`decide`): over each side's correct runs, ``gain = median(C) / median(I) - 1``
and ``noise = max(margin, spread(I), spread(C))`` with ``spread = (max - min) / median`` of a
side's runs; the challenger is better beyond noise when ``gain > noise``. A challenger with no
correct run is not better; an incumbent with none (it does not run correctly here) loses to a
challenger with correct runs. No comparison is made (``compared`` false, with the reason) when
there is no winner, the winner is the incumbent, or the compilation ends first (cancelled,
failed): the runner records that with ``CompilationEnded``, so a compilation with an incumbent
never ends without it. After a restart the runs already requested are adopted in order (the
k-th by ledger position is run k) and the rest requested.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kiln.agent_runner import records
from kiln.agent_runner.dispatcher import ExperimentDispatcher
from kiln.agent_runner.experiment import Completed, Requested
from kiln.agent_runner.judge import CONFIRM_TIER
from kiln.agent_runner.state import CompilationState, ExperimentRecord
from kiln.agent_runner.tasks import unless_set
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate
from kiln.events.warm import IncumbentCompared
from kiln.ledger.model import NewEvent

log = get_logger(__name__)

INCUMBENT_AGENT = "incumbent"


@dataclass(frozen=True)
class Verdict:
    """What :func:`decide` found: medians, gain, the noise allowed and the verdict."""

    incumbent_median: float
    challenger_median: float
    gain: float
    noise: float
    better: bool
    reason: str


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median > 0 else 0.0


def decide(incumbent: list[float], challenger: list[float], margin: float) -> Verdict:
    """The verdict over each side's correct runs' tokens/s (see the module docs)."""
    if not challenger:
        i_med = statistics.median(incumbent) if incumbent else 0.0
        return Verdict(i_med, 0.0, 0.0, margin, False, "the challenger had no correct run")
    c_med = statistics.median(challenger)
    if not incumbent:
        return Verdict(
            0.0, c_med, 0.0, margin, True, "the incumbent had no correct run at this point"
        )
    i_med = statistics.median(incumbent)
    gain = c_med / i_med - 1.0 if i_med > 0 else 0.0
    noise = max(margin, _spread(incumbent), _spread(challenger))
    better = gain > noise
    relation = "beyond" if better else "within" if abs(gain) <= noise else "below"
    reason = (
        f"challenger {c_med:.4g} vs incumbent {i_med:.4g} tokens/s: gain {gain:+.1%} "
        f"{relation} the noise {noise:.1%} (max of margin {margin:.1%} and the runs' spreads)"
    )
    return Verdict(i_med, c_med, gain, noise, better, reason)


class IncumbentComparison:
    """The incumbent runs of one compilation (taken out of ``state.experiments``: never judged,
    outside the budget; their completions are counted by ``state.compilation``).

    Args:
        state: the compilation.
        dispatcher: records, queues and waits for experiments.
        workload_json: the work items' workload.
        cancelled: set once the compilation is cancelled.
        runs: runs of each side; margin: the least gain that counts (a fraction).
    """

    def __init__(
        self,
        state: CompilationState,
        dispatcher: ExperimentDispatcher,
        workload_json: dict[str, Any],
        cancelled: asyncio.Event,
        *,
        runs: int,
        margin: float,
    ) -> None:
        self.state, self._dispatcher = state, dispatcher
        self._workload_json, self._cancelled = workload_json, cancelled
        self.runs, self.margin = max(1, runs), margin
        self.records: list[ExperimentRecord] = []
        for eid, rec in list(state.experiments.items()):
            if rec.requested.agent == INCUMBENT_AGENT:
                del state.experiments[eid]
                self.records.append(rec)
        self.records.sort(key=lambda r: r.requested.position)

    @property
    def wanted(self) -> bool:
        """An incumbent was given and no comparison is recorded yet."""
        comp = self.state.compilation
        return comp.incumbent is not None and comp.incumbent_compared is None

    @property
    def started(self) -> bool:
        """Runs were requested or the verdict recorded (the search had ended)."""
        return bool(self.records) or self.state.compilation.incumbent_compared is not None

    def not_made(self, reason: str) -> NewEvent:
        """The ``IncumbentCompared`` of a comparison not made, for ``reason``."""
        inc = self.state.compilation.incumbent or {}
        best = self.state.best
        payload = IncumbentCompared(
            compared=False,
            incumbent_candidate_id=str(inc.get("candidate_id", "")),
            challenger_candidate_id=best.candidate_id if best else "",
            reason=reason,
            experiment_ids=[r.requested.experiment_id for r in self.records],
            runs=self.runs,
        )
        return records.incumbent_compared(self.state.compilation_id, payload)

    def _sides(self) -> tuple[Candidate, Candidate] | str:
        """(incumbent, challenger), or why no comparison can be made."""
        st = self.state
        inc = st.compilation.incumbent or {}
        best = st.best
        if best is None:
            return "no correct winner: no candidate was confirmed faster than the reference"
        if best.candidate_id == inc.get("candidate_id"):
            return "the winner is the incumbent itself"
        rec = st.experiments.get(best.experiment_id)
        if rec is None:
            return f"the winner's experiment {best.experiment_id} is not known to the runner"
        return Candidate.from_canonical(dict(inc["candidate"])), rec.requested.candidate

    async def run(
        self,
        append: Callable[[NewEvent], Coroutine[Any, Any, Any]],
        shielded: Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]],
    ) -> None:
        """Measure the runs not measured yet and record ``IncumbentCompared``; returns without
        recording when cancelled (the end records it as not made)."""
        if not self.wanted:
            return
        sides = self._sides()
        if isinstance(sides, str):
            await shielded(append(self.not_made(sides)))
            return
        order = [sides[k % 2] for k in range(2 * self.runs)]
        for k, candidate in enumerate(order):
            if self.state.cancel_reason is not None:
                return
            if k < len(self.records):
                rec = self.records[k]
                if rec.completed is None:
                    await self._dispatcher.adopt(rec.requested, self._workload_json)
            else:
                req = await shielded(self._request(candidate))
                rec = ExperimentRecord(req)
                self.records.append(rec)
            completed = rec.completed or await unless_set(
                self._dispatcher.wait(rec.requested), self._cancelled
            )
            if completed is None:
                return
            self._completed(k, rec.requested, completed)
        await shielded(append(self._verdict(sides)))

    def _verdict(self, sides: tuple[Candidate, Candidate]) -> NewEvent:
        inc_tps: list[float] = []
        chal_tps: list[float] = []
        inc_ok: list[float] = []
        chal_ok: list[float] = []
        for k, rec in enumerate(self.records[: 2 * self.runs]):
            done = rec.completed
            tps = done.result.tokens_per_s if done is not None else 0.0
            ok = done is not None and done.ok and tps > 0
            (inc_tps if k % 2 == 0 else chal_tps).append(tps)
            if ok:
                (inc_ok if k % 2 == 0 else chal_ok).append(tps)
        v = decide(inc_ok, chal_ok, self.margin)
        payload = IncumbentCompared(
            compared=True,
            incumbent_candidate_id=sides[0].id,
            challenger_candidate_id=sides[1].id,
            incumbent_tokens_per_s=inc_tps,
            challenger_tokens_per_s=chal_tps,
            incumbent_median=v.incumbent_median,
            challenger_median=v.challenger_median,
            gain=v.gain,
            noise=v.noise,
            challenger_better=v.better,
            reason=f"{v.reason} ({self.runs} full-tier runs each, interleaved)",
            experiment_ids=[r.requested.experiment_id for r in self.records],
            runs=self.runs,
        )
        log.info("incumbent compared", better=v.better, gain=v.gain, noise=v.noise)
        return records.incumbent_compared(self.state.compilation_id, payload)

    async def close_pending(self, why: str) -> None:
        """Close the runs no engine answered (``cancelled``, ``why``)."""
        for k, rec in enumerate(self.records):
            if rec.completed is None:
                done = await self._dispatcher.close(rec.requested, why, status="cancelled")
                self._completed(k, rec.requested, done)

    def _completed(self, k: int, req: Requested, completed: Completed) -> None:
        self._dispatcher.forget(req.experiment_id)
        self.records[k] = ExperimentRecord(req, completed)
        self.state.compilation.count(req.experiment_id, completed.result.status)

    async def _request(self, candidate: Candidate) -> Requested:
        st = self.state
        req = await self._dispatcher.record(
            team=st.team,
            compilation_id=st.compilation_id,
            candidate=candidate,
            agent=INCUMBENT_AGENT,
            tier=CONFIRM_TIER,
        )
        try:
            await self._dispatcher.publish(req, self._workload_json)
        except Exception as exc:
            log.error(
                "cannot queue an incumbent run", experiment=req.experiment_id, error=repr(exc)
            )
            await self._dispatcher.close(req, f"the work could not be queued on NATS: {exc!r}")
        return req

"""Answering a search-tier experiment from an earlier measurement of the team's
(:mod:`kiln.domain.reuse` has the rules; docs/design/warm_start.md, "Reuse").

:class:`ReuseIndex` is built once per compilation, after its fresh fast-tier reference
(``BaselineMeasured``), from the ledger: the team's other compilations of the same model name
and hardware whose workload has the same :func:`~kiln.domain.reuse.reuse_key` and whose own
reference agrees (environment, measured batch/context, weight and KV bytes), and their correct
fast-tier measurements of candidates other than the reference (the freshest per candidate, from
the experiments projection). :meth:`ReuseIndex.lookup` re-reads the chosen experiment's stream
and checks it again (correct, agreeing, no older than ``max_age_s``) before answering with the
``MeasurementReused`` payload. A ledger failure means "nothing to reuse": the experiment is
then measured, never failed for it.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from kiln.agent_runner import records
from kiln.agent_runner.experiment import domain_event, event_data
from kiln.agent_runner.ledger_access import LedgerPool
from kiln.agent_runner.state import CompilationState
from kiln.agent_runner.workload import workload_to_json
from kiln.common.errors import KilnError, NotFound
from kiln.common.logging import get_logger
from kiln.domain.candidate import Candidate
from kiln.domain.experiment import ExperimentRecord, fold_experiment
from kiln.domain.judging import BASELINE_AGENT, SEARCH_TIER
from kiln.domain.reuse import agrees, reuse_key
from kiln.events.types import ExperimentCompleted
from kiln.events.warm import MeasurementReused

log = get_logger(__name__)

MAX_SOURCE_COMPILATIONS = 50
"""The team's most recent agreeing compilations searched for reusable measurements."""


class ReuseIndex:
    """Reusable measurements for one compilation (see the module docs); ``max_age_s`` <= 0
    turns reuse off."""

    def __init__(self, ledger: LedgerPool, state: CompilationState, max_age_s: float) -> None:
        self._ledger, self.state, self.max_age_s = ledger, state, max_age_s
        self._key = ""
        self._reference: ExperimentCompleted | None = None
        self._sources: dict[str, ExperimentCompleted] = {}
        """Compilation id -> its fast-tier reference, for the agreeing compilations."""
        self._by_candidate: dict[str, tuple[str, str]] = {}
        """Candidate id -> (experiment id, completed_at ISO) of its freshest measurement."""
        self._built = False
        self._building = asyncio.Lock()

    async def lookup(self, candidate: Candidate, agent: str) -> MeasurementReused | None:
        """The reuse answering ``candidate`` on the search tier, or None (measure it)."""
        if self.max_age_s <= 0 or candidate.is_reference or self.state.baseline is None:
            return None
        try:
            async with self._building:  # concurrent seeds wait for the one build
                if not self._built:
                    await self._build()
            found = self._by_candidate.get(candidate.id)
            if found is None or self._reference is None:
                return None
            return await self._answer(candidate, agent, found[0])
        except (KilnError, ValueError, KeyError) as exc:
            log.warning("measurement reuse skipped", candidate=candidate.id, error=repr(exc))
            return None

    async def _read(self, stream: str) -> list[Any]:
        try:
            return list(await self._ledger.system.read_stream(stream))
        except NotFound:
            return []

    async def _experiment(self, experiment_id: str) -> ExperimentRecord | None:
        exps: dict[str, ExperimentRecord] = {}
        for event in await self._read(records.experiment_stream(experiment_id)):
            fold_experiment(exps, domain_event(event))
        return exps.get(experiment_id)

    async def _build(self) -> None:
        self._built = True
        st = self.state
        assert st.baseline is not None
        ref = await self._experiment(st.baseline.experiment_id)
        if ref is None or ref.completed is None:
            return
        self._reference = ref.completed.result
        self._key = reuse_key(workload_to_json(st.workload), SEARCH_TIER)
        rows, _ = await self._ledger.query_all(
            "compilations",
            {
                "team": st.team,
                "hardware": st.compilation.hardware,
                "model_name": st.workload.model.name,
            },
        )
        rows = [r for r in rows if r["compilation_id"] != st.compilation_id]
        rows.sort(key=lambda r: str(r.get("updated_at") or ""), reverse=True)
        for row in rows[:MAX_SOURCE_COMPILATIONS]:
            await self._consider(str(row["compilation_id"]))
        log.info(
            "measurement reuse index",
            compilation=st.compilation_id,
            sources=len(self._sources),
            candidates=len(self._by_candidate),
        )

    async def _consider(self, cid: str) -> None:
        """Add compilation ``cid``'s reusable measurements if it agrees with this one."""
        events = await self._read(records.compilation_stream(cid))
        if not events or events[0].metadata.team != self.state.team:
            return
        workload = dict(event_data(events[0]).get("workload") or {})
        if reuse_key(workload, SEARCH_TIER) != self._key:
            return
        base = [event_data(e) for e in events if e.type == "BaselineMeasured"]
        if not base:
            return
        ref = await self._experiment(str(base[-1]["experiment_id"]))
        if ref is None or ref.completed is None or self._reference is None:
            return
        why = agrees(
            ref.completed.result, self._reference, reference_of_earlier=ref.completed.result
        )
        if why is not None:
            return
        self._sources[cid] = ref.completed.result
        rows, _ = await self._ledger.query_all("experiments", {"compilation_id": cid})
        for row in rows:
            if (
                row.get("tier") != SEARCH_TIER
                or row.get("status") != "ok"
                or not row.get("correct")
                or row.get("agent") in (BASELINE_AGENT,)
                or str(row.get("agent", "")).startswith("compare:")
            ):
                continue
            at = str(row.get("completed_at") or "")
            known = self._by_candidate.get(str(row["candidate_id"]))
            if known is None or at > known[1]:
                self._by_candidate[str(row["candidate_id"])] = (str(row["experiment_id"]), at)

    async def _answer(
        self, candidate: Candidate, agent: str, experiment_id: str
    ) -> MeasurementReused | None:
        rec = await self._experiment(experiment_id)
        if rec is None or rec.completed is None or rec.requested.candidate.id != candidate.id:
            return None
        source = self._sources.get(rec.requested.compilation_id)
        assert self._reference is not None
        if source is None or rec.requested.tier != SEARCH_TIER:
            return None
        why = agrees(rec.completed.result, self._reference, reference_of_earlier=source)
        age = (datetime.now(UTC) - rec.completed.recorded_at).total_seconds()
        if why is None and age > self.max_age_s:
            why = f"stale ({age:.0f} s old; the limit is {self.max_age_s:g} s)"
        if why is not None:
            log.info("measurement not reused", candidate=candidate.id, why=why)
            return None
        return MeasurementReused(
            experiment_id=experiment_id,
            source_compilation_id=rec.requested.compilation_id,
            candidate_id=candidate.id,
            candidate=candidate.canonical(),
            agent=agent,
            tier=SEARCH_TIER,
            reuse_key=self._key,
            result=rec.completed.result.model_dump(mode="json"),
            source_completed_at=rec.completed.recorded_at.isoformat(),
        )

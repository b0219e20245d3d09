"""Folding ledger events into a ``kiln.v1.Compilation`` (what Get, Watch and Submit return).

:class:`Snapshot` folds the compilation's stream and its experiments' events, in global order,
through the domain aggregate and presents it as the message, with the experiments' candidates
and measurements, per-agent usage and the best-so-far curve. :func:`from_row` turns a
projection row into a summary (List).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from google.protobuf.json_format import ParseDict
from google.protobuf.struct_pb2 import Struct
from google.protobuf.timestamp_pb2 import Timestamp

from kiln.agent_runner.experiment import domain_event, event_data, experiment_id_of
from kiln.agent_runner.usage import UsageBook
from kiln.agent_runner.workload import workload_from_json
from kiln.domain import compilation as domain
from kiln.domain.curve import curve_point
from kiln.domain.streams import compilation_stream
from kiln.v1 import common_pb2, compiler_pb2, ledger_pb2

STATUS_BY_NAME = {
    "pending": compiler_pb2.COMPILATION_STATUS_PENDING,
    "running": compiler_pb2.COMPILATION_STATUS_RUNNING,
    "succeeded": compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
    "cancelled": compiler_pb2.COMPILATION_STATUS_CANCELLED,
    "failed": compiler_pb2.COMPILATION_STATUS_FAILED,
}
"""Status names as the ledger writes them -> the wire enum."""

NAME_BY_STATUS = {v: k for k, v in STATUS_BY_NAME.items()}

TIER_BY_NAME = {"fast": common_pb2.TIER_FAST, "full": common_pb2.TIER_FULL}

COMPILATION_TYPES = domain.COMPILATION_TYPES
EXPERIMENT_TYPES = domain.EXPERIMENT_TYPES
WATCHED_TYPES = COMPILATION_TYPES + EXPERIMENT_TYPES
"""Every event type that is part of a compilation's story."""


def measurement_from(d: dict[str, Any]) -> common_pb2.Measurement:
    """An ``ExperimentCompleted`` payload as a Measurement (``memory`` unset: no breakdown)."""
    return common_pb2.Measurement(
        status=common_pb2.ExperimentStatus.Value(
            "EXPERIMENT_STATUS_" + str(d.get("status", "unspecified")).upper()
        ),
        correct=bool(d.get("correct")),
        max_abs_error=float(d.get("max_abs_error", 0.0)),
        timing=common_pb2.Timing(
            median_ms=float(d.get("median_ms", 0.0)),
            p10_ms=float(d.get("p10_ms", 0.0)),
            p90_ms=float(d.get("p90_ms", 0.0)),
            mean_ms=float(d.get("mean_ms", 0.0)),
            max_ms=float(d.get("max_ms", 0.0)),
        ),
        tokens_per_s=float(d.get("tokens_per_s", 0.0)),
        error=str(d.get("error", "")),
        engine_id=str(d.get("engine_id", "")),
        tier=TIER_BY_NAME.get(str(d.get("tier")), common_pb2.TIER_UNSPECIFIED),
        batch_size=int(d.get("batch_size", 0)),
        context_len=int(d.get("context_len", 0)),
        verified_steps=int(d.get("verified_steps", 0)),
        escape_probability=float(d.get("escape_probability", 1.0)),
    )


def candidate_from(candidate_id: str, d: dict[str, Any]) -> common_pb2.Candidate:
    """A candidate's canonical JSON (``Candidate.canonical()``) as a message."""
    return common_pb2.Candidate(
        candidate_id=candidate_id,
        ops=dict(d.get("ops", {})),
        transforms=[
            common_pb2.Transform(name=t["name"], params=dict(t.get("params", {})))
            for t in d.get("transforms", [])
        ],
        code_modules=[
            common_pb2.CodeModule(name=m["name"], source=m["source"])
            for m in d.get("code_modules", [])
        ],
        lossy=bool(d.get("lossy", False)),
    )


def incumbent_from(d: dict[str, Any]) -> compiler_pb2.IncumbentComparison:
    """An ``IncumbentCompared`` payload as the message."""
    return compiler_pb2.IncumbentComparison(
        incumbent_candidate_id=str(d.get("incumbent_candidate_id", "")),
        challenger_candidate_id=str(d.get("challenger_candidate_id", "")),
        incumbent_tokens_per_s=[float(x) for x in d.get("incumbent_tokens_per_s", [])],
        challenger_tokens_per_s=[float(x) for x in d.get("challenger_tokens_per_s", [])],
        incumbent_median=float(d.get("incumbent_median", 0.0)),
        challenger_median=float(d.get("challenger_median", 0.0)),
        gain=float(d.get("gain", 0.0)),
        noise=float(d.get("noise", 0.0)),
        challenger_better=bool(d.get("challenger_better", False)),
        reason=str(d.get("reason", "")),
        experiment_ids=[str(x) for x in d.get("experiment_ids", [])],
        compared=bool(d.get("compared", False)),
    )


def detail_of(event: ledger_pb2.RecordedEvent) -> Struct:
    """An event's payload as a Struct (numbers become doubles)."""
    detail = Struct()
    detail.update(event_data(event))
    return detail


def _timestamp(dt: datetime) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(dt)
    return ts


class Snapshot:
    """A compilation folded from its events: ``message`` so far and the domain ``compilation``
    (None until submitted).
    """

    def __init__(self, compilation_id: str) -> None:
        self.compilation_id = compilation_id
        self.stream_id = compilation_stream(compilation_id)
        self.message = compiler_pb2.Compilation(compilation_id=compilation_id)
        self.compilation: domain.Compilation | None = None
        self._candidates: dict[str, common_pb2.Candidate] = {}
        self._measurements: dict[str, common_pb2.Measurement] = {}
        self._baseline_id = ""
        self.usage = UsageBook()
        """Per-agent usage (:mod:`kiln.agent_runner.usage`), mirrored in ``agent_usage``."""

    def belongs(self, event: ledger_pb2.RecordedEvent) -> bool:
        """True when ``event`` is part of this compilation's story."""
        if event.stream_id == self.stream_id:
            return True
        if event.type in EXPERIMENT_TYPES and experiment_id_of(event) is not None:
            return event_data(event).get("compilation_id") == self.compilation_id
        return False

    @property
    def baseline_experiment_id(self) -> str:
        """The baseline's experiment id ("" before BaselineMeasured)."""
        return self._baseline_id

    @property
    def ended(self) -> bool:
        """True once CompilationEnded is folded."""
        return self.compilation is not None and self.compilation.ended

    def apply(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold one event (global order); events before the submission or already folded change
        nothing. Raises as :meth:`Compilation.apply`.
        """
        m, ev, t = self.message, domain_event(event), event.type
        comp = self.compilation
        if t == domain.SUBMITTED and comp is None:
            comp = self.compilation = domain.Compilation.submitted(ev)
            m.team = comp.team
            m.workload.CopyFrom(workload_from_json(comp.workload))
            m.workload.workload_key = comp.workload_key
            m.budget.wall_seconds = comp.wall_seconds
            m.budget.max_experiments = comp.max_experiments
            m.created_at.CopyFrom(event.recorded_at)
        elif comp is None or not comp.apply(ev):
            return
        elif t == "CompilationPlanned" and comp.plan is not None:
            ParseDict(comp.plan, m.plan, ignore_unknown_fields=True)
        elif t == "BaselineMeasured" and comp.baseline is not None:
            self._set_baseline(comp.baseline)
        elif t == "BestCandidateImproved" and comp.best is not None:
            self._set_best(comp.best, event)
            self._add_progress(dict(ev.data), event)
        elif t == "IncumbentCompared" and comp.incumbent_compared is not None:
            m.incumbent.CopyFrom(incumbent_from(comp.incumbent_compared))
        elif t in EXPERIMENT_TYPES:
            self.learn(event)
            self.count_usage(event)
        m.experiments_reused = comp.reused
        m.status = STATUS_BY_NAME[comp.status]
        m.reason = comp.reason
        m.outcome = comp.outcome
        m.experiments_done, m.failures = comp.experiments_done, comp.failures
        m.updated_at.CopyFrom(event.recorded_at)

    def learn(self, event: ledger_pb2.RecordedEvent) -> None:
        """Take an experiment's candidate or measurement without counting it, refreshing baseline
        and best.
        """
        eid = experiment_id_of(event)
        if eid is None:
            return
        d = event_data(event)
        if event.type == "ExperimentRequested":
            self._candidates[eid] = candidate_from(d["candidate_id"], d.get("candidate", {}))
        elif event.type == "ExperimentCompleted":
            self._measurements[eid] = measurement_from(d)
        m = self.message
        if m.HasField("best") and eid in (m.best.experiment_id, m.best.reference_experiment_id):
            self._refresh_best()
        if m.HasField("baseline") and eid in self._measurements and self._baseline_id == eid:
            m.baseline.CopyFrom(self._measurements[eid])

    def count_usage(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold an experiment event into the per-agent usage (each experiment once)."""
        eid = experiment_id_of(event)
        if eid is None:
            return
        d = event_data(event)
        if event.type == "ExperimentRequested":
            self.usage.request(eid, str(d.get("agent", "")))
        elif event.type == "ExperimentCompleted":
            self.usage.complete(eid, d)
        else:
            return
        del self.message.agent_usage[:]
        self.message.agent_usage.extend(
            compiler_pb2.AgentUsage(
                agent=u.agent,
                experiments=u.experiments,
                ok=u.ok,
                failed=u.failed,
                device_seconds=u.device_s,
                best_tokens_per_s=u.best_tokens_per_s,
            )
            for u in self.usage.rows()
        )

    # ------------------------------------------------------------------ helpers
    def _add_progress(self, d: dict[str, Any], event: ledger_pb2.RecordedEvent) -> None:
        m = self.message
        submitted = m.created_at.ToDatetime() if m.HasField("created_at") else None
        recorded = event.recorded_at.ToDatetime()
        p = curve_point(d, recorded, submitted or recorded)
        m.progress.append(
            compiler_pb2.ProgressPoint(
                elapsed_s=p.elapsed_s,
                experiments=p.experiments,
                device_s=p.device_s,
                tokens_per_s=p.tokens_per_s,
                speedup=p.speedup,
                candidate_id=p.candidate_id,
                experiment_id=p.experiment_id,
            )
        )

    def _set_baseline(self, baseline: domain.Baseline) -> None:
        eid = baseline.experiment_id
        self._baseline_id = eid
        known = self._measurements.get(eid)
        if known is not None:
            self.message.baseline.CopyFrom(known)
            return
        self.message.baseline.CopyFrom(
            common_pb2.Measurement(
                status=common_pb2.EXPERIMENT_STATUS_OK,
                correct=True,
                tokens_per_s=baseline.tokens_per_s,
                timing=common_pb2.Timing(median_ms=baseline.median_ms),
            )
        )

    def _set_best(self, found: domain.Best, event: ledger_pb2.RecordedEvent) -> None:
        best = self.message.best
        best.Clear()
        best.experiment_id = found.experiment_id
        best.speedup = found.speedup
        best.found_at.CopyFrom(event.recorded_at)
        best.candidate.candidate_id = found.candidate_id
        best.measurement.CopyFrom(
            common_pb2.Measurement(
                status=common_pb2.EXPERIMENT_STATUS_OK,
                correct=True,
                tokens_per_s=found.tokens_per_s,
                timing=common_pb2.Timing(median_ms=found.median_ms),
                tier=TIER_BY_NAME.get(found.tier, common_pb2.TIER_UNSPECIFIED),
            )
        )
        if found.reference_experiment_id:
            best.reference_experiment_id = found.reference_experiment_id
            best.reference.CopyFrom(
                common_pb2.Measurement(
                    status=common_pb2.EXPERIMENT_STATUS_OK,
                    correct=True,
                    tokens_per_s=found.reference_tokens_per_s,
                    tier=best.measurement.tier,
                )
            )
        self._refresh_best()

    def _refresh_best(self) -> None:
        """Fill the best's candidate, measurement and reference from the experiments known."""
        best = self.message.best
        eid, ref_id = best.experiment_id, best.reference_experiment_id
        if eid in self._candidates:
            best.candidate.CopyFrom(self._candidates[eid])
        if eid in self._measurements:
            best.measurement.CopyFrom(self._measurements[eid])
        if ref_id and ref_id in self._measurements:
            best.reference.CopyFrom(self._measurements[ref_id])

    def event(self, event: ledger_pb2.RecordedEvent) -> compiler_pb2.CompilationEvent:
        """The wire event for ``event`` (already folded), with a copy of the snapshot."""
        snapshot = compiler_pb2.Compilation()
        snapshot.CopyFrom(self.message)
        return compiler_pb2.CompilationEvent(
            position=event.position,
            compilation_id=self.compilation_id,
            type=event.type,
            recorded_at=event.recorded_at,
            detail=detail_of(event),
            snapshot=snapshot,
        )


def from_row(row: dict[str, Any]) -> compiler_pb2.Compilation:
    """A compilations-projection row as a summary Compilation (no plan, no recipes)."""
    m = compiler_pb2.Compilation(
        compilation_id=row["compilation_id"],
        team=row.get("team") or "",
        status=STATUS_BY_NAME.get(
            row.get("status", ""), compiler_pb2.COMPILATION_STATUS_UNSPECIFIED
        ),
        experiments_done=int(row.get("experiments_done") or 0),
        failures=int(row.get("failures") or 0),
        reason=row.get("reason") or "",
    )
    m.workload.workload_key = row.get("workload_key") or ""
    m.workload.model.name = row.get("model_name") or ""
    m.workload.hardware.name = row.get("hardware") or ""
    m.budget.wall_seconds = float(row.get("budget_wall_seconds") or 0.0)
    m.budget.max_experiments = int(row.get("budget_max_experiments") or 0)
    if row.get("baseline_tokens_per_s") is not None:
        m.baseline.tokens_per_s = float(row["baseline_tokens_per_s"])
    if row.get("best_candidate_id"):
        m.best.candidate.candidate_id = row["best_candidate_id"]
        m.best.measurement.tokens_per_s = float(row.get("best_tokens_per_s") or 0.0)
        m.best.speedup = float(row.get("speedup") or 0.0)
    for field in ("created_at", "updated_at"):
        if row.get(field):
            getattr(m, field).CopyFrom(_timestamp(datetime.fromisoformat(row[field])))
    return m

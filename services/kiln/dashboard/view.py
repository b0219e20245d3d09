"""One compilation as the dashboard shows it, folded from what the APIs return: the
``Compiler.Get`` snapshot, the compilation stream's events (``Ledger.ReadStream``) and its
experiments' events (``Ledger.ReadAll``, filtered by ``compilation_id``).

:class:`CompilationView` is plain data; :meth:`CompilationView.apply` folds one recorded event
(idempotent by ledger position), :meth:`CompilationView.curves` gives the best-so-far per agent.
Nothing here talks to a service.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kiln.dashboard.svg import Series
from kiln.domain import streams
from kiln.domain.candidate import Candidate
from kiln.domain.move_effects import Measured, MoveEffect, move_effects
from kiln.v1 import compiler_pb2, ledger_pb2

STATUS_NAMES = {
    compiler_pb2.COMPILATION_STATUS_PENDING: "pending",
    compiler_pb2.COMPILATION_STATUS_RUNNING: "running",
    compiler_pb2.COMPILATION_STATUS_SUCCEEDED: "succeeded",
    compiler_pb2.COMPILATION_STATUS_CANCELLED: "cancelled",
    compiler_pb2.COMPILATION_STATUS_FAILED: "failed",
}
"""CompilationStatus values by their dashboard names."""

EXPERIMENT_TYPES = ("ExperimentRequested", "ExperimentCompleted")
"""The experiment-stream event types the dashboard reads."""


def status_name(status: int) -> str:
    """``running``, ``succeeded``, ... ("unknown" for an unset value)."""
    return STATUS_NAMES.get(status, "unknown")  # type: ignore[call-overload]


def _ts(event: ledger_pb2.RecordedEvent) -> datetime:
    return event.recorded_at.ToDatetime(tzinfo=UTC)


@dataclass
class Experiment:
    """One experiment of the compilation, requested and (once it has) completed."""

    experiment_id: str
    agent: str = ""
    tier: str = ""
    candidate_id: str = ""
    baseline: str = ""
    status: str = "running"
    correct: bool = False
    tokens_per_s: float = 0.0
    median_ms: float = 0.0
    device_ms: float = 0.0
    engine_id: str = ""
    error: str = ""
    phases_ms: dict[str, float] = field(default_factory=dict)
    requested_s: float | None = None
    completed_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return dict(self.__dict__)


@dataclass
class Baseline:
    """One ``BaselineCompared``: a named baseline measured beside the search."""

    name: str
    status: str
    correct: bool
    tokens_per_s: float
    median_ms: float
    prefill_median_ms: float
    tier: str
    skipped_reason: str
    error: str


@dataclass
class BoardMessage:
    """One post on the compilation's board (untrusted text: escape it)."""

    seq: int
    kind: str
    agent: str
    candidate_id: str
    posted_at: str
    body: str


@dataclass
class CompilationView:
    """A compilation, its experiments, baselines and board posts. Ledger positions: the
    compilation's first event, its ``CompilationEnded`` (0 while it runs), the highest
    experiment event folded."""

    snapshot: compiler_pb2.Compilation
    experiments: dict[str, Experiment] = field(default_factory=dict)
    baselines: list[Baseline] = field(default_factory=list)
    board: list[BoardMessage] = field(default_factory=list)
    board_note: str = ""
    recipes: dict[str, Candidate] = field(default_factory=dict)
    """candidate id -> the candidate as requested (ids recomputed, malformed ones left out)."""
    first_position: int = 0
    end_position: int = 0
    last_position: int = 0
    _seen: set[int] = field(default_factory=set)

    @property
    def compilation_id(self) -> str:
        """The compilation's id."""
        return self.snapshot.compilation_id

    @property
    def created(self) -> datetime | None:
        """Submission time (None when the snapshot has none)."""
        if not self.snapshot.HasField("created_at"):
            return None
        return self.snapshot.created_at.ToDatetime(tzinfo=UTC)

    @property
    def ended(self) -> bool:
        """True once the compilation has an end status."""
        return self.snapshot.status in (
            compiler_pb2.COMPILATION_STATUS_SUCCEEDED,
            compiler_pb2.COMPILATION_STATUS_CANCELLED,
            compiler_pb2.COMPILATION_STATUS_FAILED,
        )

    def _elapsed(self, event: ledger_pb2.RecordedEvent) -> float | None:
        created = self.created
        return None if created is None else max(0.0, (_ts(event) - created).total_seconds())

    def apply(self, event: ledger_pb2.RecordedEvent) -> None:
        """Fold one recorded event (compilation stream or one of its experiments'); events of
        other compilations and positions already folded are ignored."""
        if event.position in self._seen:
            return
        data: dict[str, Any] = json.loads(event.data or b"{}")
        eid = streams.experiment_id_in(event.stream_id)
        if eid is not None:
            if data.get("compilation_id") != self.compilation_id:
                return
            self._apply_experiment(eid, event, data)
            self.last_position = max(self.last_position, event.position)
        elif event.stream_id == streams.compilation_stream(self.compilation_id):
            if not self.first_position or event.position < self.first_position:
                self.first_position = event.position
            if event.type == "BaselineCompared":
                self.baselines.append(_baseline(data))
            elif event.type == "CompilationEnded":
                self.end_position = event.position
        else:
            return
        self._seen.add(event.position)

    def _apply_experiment(
        self, eid: str, event: ledger_pb2.RecordedEvent, data: dict[str, Any]
    ) -> None:
        exp = self.experiments.setdefault(eid, Experiment(eid))
        exp.candidate_id = str(data.get("candidate_id", exp.candidate_id))
        exp.tier = str(data.get("tier", exp.tier))
        if event.type == "ExperimentRequested":
            exp.agent = str(data.get("agent", ""))
            exp.baseline = str(data.get("baseline", ""))
            exp.requested_s = self._elapsed(event)
            self._recipe(data.get("candidate"))
        elif event.type == "ExperimentCompleted":
            exp.status = str(data.get("status", "unknown"))
            exp.correct = bool(data.get("correct"))
            exp.tokens_per_s = float(data.get("tokens_per_s") or 0.0)
            exp.median_ms = float(data.get("median_ms") or 0.0)
            exp.device_ms = float(data.get("device_ms") or 0.0)
            exp.engine_id = str(data.get("engine_id", ""))
            exp.error = str(data.get("error", ""))
            phases = data.get("phases_ms") or {}
            exp.phases_ms = {str(k): float(v) for k, v in phases.items()}
            exp.completed_s = self._elapsed(event)

    def _recipe(self, canonical: Any) -> None:
        try:
            c = Candidate.from_canonical(canonical)
        except (KeyError, TypeError, ValueError, AttributeError):
            return
        self.recipes.setdefault(c.id, c)

    def move_effects(self) -> list[MoveEffect]:
        """What each move of the confirmed best bought on the fast tier, from the correct
        results folded so far (:func:`kiln.domain.move_effects.move_effects`)."""
        if not self.snapshot.HasField("best"):
            return []
        measured = [
            Measured(self.recipes[x.candidate_id], x.tier, x.tokens_per_s)
            for x in self.experiments.values()
            if x.status == "ok" and x.correct and x.candidate_id in self.recipes
        ]
        return move_effects(Candidate.from_proto(self.snapshot.best.candidate), measured, "fast")

    def curves(self) -> list[Series]:
        """Best-so-far tokens/s over seconds since submission: one series per (agent, tier)
        among correct results, then the compilation's confirmed best (dashed)."""
        by_key: dict[str, list[tuple[float, float]]] = {}
        done = [e for e in self.experiments.values() if e.completed_s is not None]
        for exp in sorted(done, key=lambda e: e.completed_s or 0.0):
            if exp.status != "ok" or not exp.correct or exp.tokens_per_s <= 0:
                continue
            key = f"{exp.agent or '?'} ({exp.tier})"
            line = by_key.setdefault(key, [])
            if not line or exp.tokens_per_s > line[-1][1]:
                line.append((exp.completed_s or 0.0, exp.tokens_per_s))
        out = [Series(k, tuple(v)) for k, v in sorted(by_key.items())]
        best = tuple((p.elapsed_s, p.tokens_per_s) for p in self.snapshot.progress)
        out.append(Series("confirmed best", best, dashed=True))
        return out

    def elapsed_now(self) -> float:
        """Seconds from submission to the last update (or now, while it runs)."""
        created = self.created
        if created is None:
            return 0.0
        end = datetime.now(UTC)
        if self.ended and self.snapshot.HasField("updated_at"):
            end = self.snapshot.updated_at.ToDatetime(tzinfo=UTC)
        return max(0.0, (end - created).total_seconds())

    def agents(self) -> list[str]:
        """The agents of its experiments, sorted."""
        return sorted({e.agent for e in self.experiments.values() if e.agent})


def _baseline(d: dict[str, Any]) -> Baseline:
    return Baseline(
        name=str(d.get("name", "?")),
        status=str(d.get("status", "?")),
        correct=bool(d.get("correct")),
        tokens_per_s=float(d.get("tokens_per_s") or 0.0),
        median_ms=float(d.get("median_ms") or 0.0),
        prefill_median_ms=float(d.get("prefill_median_ms") or 0.0),
        tier=str(d.get("tier", "")),
        skipped_reason=str(d.get("skipped_reason", "")),
        error=str(d.get("error", "")),
    )

"""One experiment as plain data: what was requested and what came back, from the events of an
``experiment-<id>`` stream.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kiln.domain import streams
from kiln.domain.candidate import Candidate
from kiln.domain.compilation import EXPERIMENT_COMPLETED, EXPERIMENT_REQUESTED, Event
from kiln.events.registry import parse_payload
from kiln.events.types import ExperimentCompleted, ExperimentRequested, Tier


@dataclass(frozen=True)
class Requested:
    """An experiment asked for (its ``ExperimentRequested``).

    Attributes:
        agent: who proposed it ("baseline" for the reference forward).
        position: global ledger position of the event.
        profile: the engine is asked for the per-op profile.
        baseline: a baseline measured instead of the candidate ("" for none); never judged.
    """

    experiment_id: str
    compilation_id: str
    team: str
    candidate: Candidate
    agent: str
    tier: Tier
    position: int
    profile: bool = False
    baseline: str = ""

    @staticmethod
    def from_event(event: Event) -> Requested:
        """From a recorded ``ExperimentRequested``. Raises ValueError when malformed."""
        eid = streams.experiment_id_in(event.stream_id)
        if eid is None or event.type != ExperimentRequested.event_type:
            raise ValueError(f"not an ExperimentRequested event: {event.type} {event.stream_id}")
        p = parse_payload(ExperimentRequested, dict(event.data))
        return Requested(
            experiment_id=eid,
            compilation_id=p.compilation_id,
            team=event.team,
            candidate=Candidate.from_canonical(p.candidate),
            agent=p.agent,
            tier=p.tier,
            position=event.position,
            profile=p.profile,
            baseline=p.baseline,
        )


@dataclass(frozen=True)
class Completed:
    """An experiment's ``ExperimentCompleted``: the validated ``result``, its global ``position``
    and ``recorded_at``.
    """

    experiment_id: str
    result: ExperimentCompleted
    position: int
    recorded_at: datetime

    @property
    def ok(self) -> bool:
        """Measured and correct: usable as a candidate for best-so-far."""
        return self.result.status == "ok" and self.result.correct

    @staticmethod
    def from_event(event: Event) -> Completed:
        """From a recorded ``ExperimentCompleted``; ValueError when malformed."""
        eid = streams.experiment_id_in(event.stream_id)
        if eid is None or event.type != ExperimentCompleted.event_type:
            raise ValueError(f"not an ExperimentCompleted event: {event.type} {event.stream_id}")
        if event.recorded_at is None:
            raise ValueError(f"ExperimentCompleted on {event.stream_id} without its recorded_at")
        return Completed(
            experiment_id=eid,
            result=parse_payload(ExperimentCompleted, dict(event.data)),
            position=event.position,
            recorded_at=event.recorded_at,
        )

    def summary(self) -> dict[str, Any]:
        """A short JSON summary (the agents' result bodies)."""
        r = self.result
        return {
            "experiment_id": self.experiment_id,
            "status": r.status,
            "correct": r.correct,
            "tokens_per_s": r.tokens_per_s,
            "median_ms": r.median_ms,
            "engine_id": r.engine_id,
            "error": r.error[:500],
            "op_ms": dict(r.op_ms),
            "op_profile_shape": dict(r.op_profile_shape),
        }


@dataclass
class ExperimentRecord:
    """One experiment of a compilation: its request and, once known, its completion."""

    requested: Requested
    completed: Completed | None = None


def fold_experiment(experiments: MutableMapping[str, ExperimentRecord], event: Event) -> None:
    """Fold one event into ``experiments`` (id -> record): a request opens a record, the first
    completion of a requested experiment closes it, anything else is ignored. ValueError on a
    malformed payload.
    """
    eid = streams.experiment_id_in(event.stream_id)
    if eid is None:
        return
    if event.type == EXPERIMENT_REQUESTED:
        experiments[eid] = ExperimentRecord(Requested.from_event(event))
    elif event.type == EXPERIMENT_COMPLETED:
        record = experiments.get(eid)
        if record is not None and record.completed is None:
            record.completed = Completed.from_event(event)

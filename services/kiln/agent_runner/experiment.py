"""One experiment as the runner sees it: what was requested and what came back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kiln.domain import streams
from kiln.domain.compilation import Event
from kiln.events.registry import parse_payload
from kiln.events.types import ExperimentCompleted, ExperimentRequested, Tier
from kiln.v1 import ledger_pb2
from kiln.workloads.candidate import Candidate


def event_data(event: ledger_pb2.RecordedEvent) -> dict[str, Any]:
    """A recorded event's payload as a dict."""
    data = json.loads(event.data or b"{}")
    return data if isinstance(data, dict) else {}


def recorded_at(event: ledger_pb2.RecordedEvent) -> datetime:
    """When the ledger recorded ``event`` (UTC)."""
    return event.recorded_at.ToDatetime(tzinfo=UTC)


def experiment_id_of(event: ledger_pb2.RecordedEvent) -> str | None:
    """The experiment id of an ``experiment-<id>`` stream's event, else None."""
    return streams.experiment_id_in(event.stream_id)


def domain_event(event: ledger_pb2.RecordedEvent) -> Event:
    """A recorded event as the domain folds read it (:class:`kiln.domain.compilation.Event`)."""
    return Event(
        type=event.type,
        data=event_data(event),
        stream_id=event.stream_id,
        version=event.stream_version,
        position=event.position,
        recorded_at=recorded_at(event),
        team=event.metadata.team,
    )


@dataclass(frozen=True)
class Requested:
    """An experiment the runner asked for (its ``ExperimentRequested``).

    Attributes:
        experiment_id: id of its ``experiment-<id>`` stream.
        compilation_id: the compilation.
        team: the team the work is done for.
        candidate: what to measure.
        agent: who proposed it ("baseline" for the reference forward).
        tier: "fast" or "full".
        position: global ledger position of the ExperimentRequested event.
        profile: the engine is asked for the per-op profile (``ExperimentCompleted.op_ms``).
        baseline: a baseline of :mod:`kiln.baselines` measured instead of the candidate ("" for
            a normal experiment); such experiments are never judged.
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
    def from_event(event: ledger_pb2.RecordedEvent) -> Requested:
        """From a recorded ``ExperimentRequested``. Raises ValueError when malformed."""
        eid = experiment_id_of(event)
        if eid is None or event.type != ExperimentRequested.event_type:
            raise ValueError(f"not an ExperimentRequested event: {event.type} {event.stream_id}")
        p = parse_payload(ExperimentRequested, event_data(event))
        return Requested(
            experiment_id=eid,
            compilation_id=p.compilation_id,
            team=event.metadata.team,
            candidate=Candidate.from_canonical(p.candidate),
            agent=p.agent,
            tier=p.tier,
            position=event.position,
            profile=p.profile,
            baseline=p.baseline,
        )


@dataclass(frozen=True)
class Completed:
    """An experiment's ``ExperimentCompleted`` (from an engine, or the runner's time-out).

    Attributes:
        experiment_id: the experiment.
        result: the validated payload (status, correctness, timings in ms, tokens/s).
        position: global ledger position of the event.
        recorded_at: when the ledger recorded it.
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
    def from_event(event: ledger_pb2.RecordedEvent) -> Completed:
        """From a recorded ``ExperimentCompleted``. Raises ValueError when malformed."""
        eid = experiment_id_of(event)
        if eid is None or event.type != ExperimentCompleted.event_type:
            raise ValueError(f"not an ExperimentCompleted event: {event.type} {event.stream_id}")
        return Completed(
            experiment_id=eid,
            result=parse_payload(ExperimentCompleted, event_data(event)),
            position=event.position,
            recorded_at=recorded_at(event),
        )

    def summary(self) -> dict[str, Any]:
        """A short JSON summary (board result bodies)."""
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

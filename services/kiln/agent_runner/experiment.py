"""Recorded ledger events as the runner reads them: payload, time, experiment id, the domain's
:class:`~kiln.domain.compilation.Event`; and an experiment's request and completion
(:class:`~kiln.domain.experiment.Requested`, :class:`~kiln.domain.experiment.Completed`) from a
recorded event."""

from __future__ import annotations

from kiln.domain import streams
from kiln.domain.experiment import Completed, Requested
from kiln.ledger.convert import recorded_data as event_data
from kiln.ledger.convert import recorded_time as recorded_at
from kiln.ledger.convert import recorded_to_domain as domain_event
from kiln.v1 import ledger_pb2

__all__ = [
    "Completed",
    "Requested",
    "completed_of",
    "domain_event",
    "event_data",
    "experiment_id_of",
    "recorded_at",
    "requested_of",
]


def experiment_id_of(event: ledger_pb2.RecordedEvent) -> str | None:
    """The experiment id of an ``experiment-<id>`` stream's event, else None."""
    return streams.experiment_id_in(event.stream_id)


def requested_of(event: ledger_pb2.RecordedEvent) -> Requested:
    """A recorded ``ExperimentRequested``. Raises ValueError when malformed."""
    return Requested.from_event(domain_event(event))


def completed_of(event: ledger_pb2.RecordedEvent) -> Completed:
    """A recorded ``ExperimentCompleted``. Raises ValueError when malformed."""
    return Completed.from_event(domain_event(event))

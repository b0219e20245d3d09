"""The experiment work item: what the agent runner queues and an engine pool runs.

Flow (DESIGN.md: the ledger is the record, NATS carries work):

1. The agent runner appends ``ExperimentRequested`` to ``experiment-<experiment_id>`` (expected
   version: no stream), then publishes an :class:`ExperimentWork` as JSON on
   ``kiln.common.nats.work_subject(prefix, tier)`` with ``Nats-Msg-Id`` = experiment id.
2. An engine pool (durable pull consumer per tier, explicit ack, ``max_deliver`` bounded) runs it
   on a persistent engine and appends ``ExperimentCompleted`` to the same stream with expected
   version 1. ``Aborted`` there means another engine already completed it: ack and drop. Then it
   acks the message. A crash before the ack redelivers the work; the expected version keeps the
   ledger free of duplicates.
3. The agent runner learns the result from the ledger (ReadAll / the events subject), never
   from the engine directly, so either side can restart at any point.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ExperimentWork(BaseModel):
    """One experiment to run.

    Attributes:
        experiment_id: id of the ``experiment-<id>`` stream holding its ExperimentRequested.
        compilation_id: the compilation it belongs to.
        team: the team that submitted the compilation (appends on its behalf carry it).
        tier: "fast" (a few layers) or "full" (all layers).
        candidate: ``kiln.workloads.candidate.Candidate.canonical()``.
        workload: the ``kiln.v1.Workload`` message as JSON (``MessageToDict`` with
            ``preserving_proto_field_name=True``).
        deadline_s: seconds the candidate may take (load, check and measure) before it is
            TIMED_OUT and its engine restarted.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    experiment_id: str = Field(min_length=1, max_length=128)
    compilation_id: str = Field(min_length=1, max_length=128)
    team: str = Field(min_length=1)
    tier: Literal["fast", "full"]
    candidate: dict[str, Any]
    workload: dict[str, Any]
    deadline_s: float = Field(gt=0, le=3600)

    def to_json(self) -> bytes:
        """The message body."""
        return self.model_dump_json().encode()

    @staticmethod
    def from_json(data: bytes) -> ExperimentWork:
        """Parse a message body. Raises pydantic.ValidationError when malformed."""
        return ExperimentWork.model_validate_json(data)

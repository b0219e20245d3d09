"""The deployment events the agent runner appends, with deterministic event ids.

Every event but the creation and a rollback has an id fixed by what it records (UUIDv5 of the
deployment id and its role: the window index, the compilation id), so a controller that
appends it again after a crash, or a second replica racing the first, gets an idempotent no-op
instead of a duplicate. The correlation id is the deployment id. Appends go with the expected
version of the stream the caller folded (:mod:`kiln.agent_runner.deployments.controller`).
"""

from __future__ import annotations

import uuid
from typing import Any

from kiln.events.deployment_types import (
    CandidatePromoted,
    CandidateRolledBack,
    DeploymentCreated,
    DriftDetected,
    PromotionDeclined,
    RecompilationStarted,
    TrafficWindowObserved,
)
from kiln.ledger.model import NewEvent

_NAMESPACE = uuid.UUID("2f0c9d3e-7b61-4c1e-8f2a-5d3b9e6a4c70")


def _event_id(*parts: str) -> str:
    return str(uuid.uuid5(_NAMESPACE, ":".join(parts)))


def _event(payload: Any, event_id: str, deployment_id: str) -> NewEvent:
    return NewEvent(
        type=payload.event_type,
        data=payload.model_dump(mode="json"),
        event_id=event_id,
        correlation_id=deployment_id,
    )


def compilation_id_for(deployment_id: str, ordinal: int) -> str:
    """The id of the deployment's ``ordinal``-th compilation (0: the first): fixed, so a
    restarted controller submits the one it recorded, and the Compiler refuses a second."""
    return f"d{deployment_id[:16]}-{ordinal:04d}"


def created(deployment_id: str, payload: DeploymentCreated) -> NewEvent:
    """``DeploymentCreated`` (a random id; appended to no stream only, so a second creation of
    the name is a conflict)."""
    return _event(payload, str(uuid.uuid4()), deployment_id)


def started(deployment_id: str, payload: RecompilationStarted) -> NewEvent:
    """``RecompilationStarted`` (one per compilation id)."""
    return _event(
        payload, _event_id(deployment_id, "started", payload.compilation_id), deployment_id
    )


def window(deployment_id: str, payload: TrafficWindowObserved) -> NewEvent:
    """``TrafficWindowObserved`` (one per window index)."""
    return _event(payload, _event_id(deployment_id, "window", str(payload.index)), deployment_id)


def drift(deployment_id: str, payload: DriftDetected) -> NewEvent:
    """``DriftDetected`` (one per window index)."""
    return _event(
        payload, _event_id(deployment_id, "drift", str(payload.window_index)), deployment_id
    )


def promoted(deployment_id: str, payload: CandidatePromoted) -> NewEvent:
    """``CandidatePromoted`` (one per compilation)."""
    return _event(payload, _event_id(deployment_id, "ended", payload.compilation_id), deployment_id)


def declined(deployment_id: str, payload: PromotionDeclined) -> NewEvent:
    """``PromotionDeclined`` (one per compilation: the same role as a promotion, so a
    compilation is never both promoted and declined)."""
    return _event(payload, _event_id(deployment_id, "ended", payload.compilation_id), deployment_id)


def rolled_back(deployment_id: str, payload: CandidateRolledBack) -> NewEvent:
    """``CandidateRolledBack`` (a random id: each rollback is its own request)."""
    return _event(payload, str(uuid.uuid4()), deployment_id)

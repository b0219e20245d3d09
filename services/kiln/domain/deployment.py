"""The deployment aggregate: its id, and one fold of its ``deployment-<id>`` stream.

Id: the first 32 hex digits of sha256("<team>/<name>"): a team's names neither reveal nor
collide with another team's (team names may contain '.', so the id is not the name).

State: ``DeploymentCreated`` -> creating (the first compilation runs); ``CandidatePromoted`` ->
active (the candidate serves, ``proven_shape`` = the shape it was promoted at);
``RecompilationStarted`` -> recompiling (the active candidate keeps serving); then
``CandidatePromoted`` or ``PromotionDeclined`` -> active again, the recompilation's shape proven
either way (a decline at a failed compilation keeps the old shape). A decline of the *initial*
compilation -> failed. ``CandidateRolledBack`` pops the active candidate: the one before it is
active again, with the shape it was proven at. ``TrafficWindowObserved`` advances the windows;
``DriftDetected`` is kept as ``last_drift``.

Replay is idempotent: an event at or below :attr:`DeploymentState.version` is ignored. Errors:
``ValueError`` for an event of another stream, a stream not starting with
``DeploymentCreated``, or a second one; ``KeyError`` for a missing field. Stdlib only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kiln.domain import streams
from kiln.domain.compilation import Event

NAME_RULE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A deployment name: 1-64 characters of [A-Za-z0-9_.-], starting with a letter or digit."""
_NAME_RE = re.compile(NAME_RULE)


class InvalidName(ValueError):
    """A value that cannot name a deployment; the message says why."""


def check_name(name: str) -> str:
    """``name`` if it follows :data:`NAME_RULE`, else :class:`InvalidName`."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidName(
            f"invalid deployment name {str(name)[:80]!r}: expected 1-64 characters of "
            "[A-Za-z0-9_.-] starting with a letter or digit"
        )
    return name


def deployment_id(team: str, name: str) -> str:
    """The first 32 hex digits of sha256("<team>/<name>")."""
    return hashlib.sha256(f"{team}/{name}".encode()).hexdigest()[:32]


def stream_of(team: str, name: str) -> str:
    """``deployment-<deployment_id(team, name)>``."""
    return streams.deployment_stream(deployment_id(team, name))


class Status(StrEnum):
    """A deployment's status."""

    CREATING = "creating"
    ACTIVE = "active"
    RECOMPILING = "recompiling"
    FAILED = "failed"


@dataclass(frozen=True)
class Active:
    """One active candidate: which, from which compilation, its tokens/s there, and the shape it
    was proven for (``kiln.v1.TrafficShape`` as JSON)."""

    candidate_id: str
    compilation_id: str
    tokens_per_s: float
    shape: Mapping[str, Any]


@dataclass
class DeploymentState:
    """One deployment as its events say.

    Attributes:
        workload: the first compilation's ``kiln.v1.Workload`` as JSON.
        policy: the ``kiln.v1.DeploymentPolicy`` as JSON; drift_policy: its DriftPolicy dict.
        actives: the active candidates, oldest first; the last is active (rollback pops it).
        proven_shape: the drift reference (the last promotion's or decline's shape).
        recompiling: the running recompilation's ``RecompilationStarted`` payload, or None.
        compilations: every compilation started, oldest first (the warm start's history).
        recompilations: how many were started for drift (the budget counts these).
        last_window: the last ``TrafficWindowObserved`` payload (None before one).
        proven_at_s: the arrival time the drift detector was last rebased at (None: never).
        version: the stream's last version folded.
        events: every event folded (for history and Watch).
    """

    deployment_id: str
    team: str
    name: str
    workload: Mapping[str, Any]
    policy: Mapping[str, Any]
    drift_policy: Mapping[str, Any]
    status: Status = Status.CREATING
    actives: list[Active] = field(default_factory=list)
    proven_shape: Mapping[str, Any] = field(default_factory=dict)
    recompiling: Mapping[str, Any] | None = None
    compilations: list[str] = field(default_factory=list)
    recompilations: int = 0
    windows: int = 0
    last_window: Mapping[str, Any] | None = None
    last_drift: Mapping[str, Any] | None = None
    last_verdict: Mapping[str, Any] | None = None
    proven_at_s: float | None = None
    reason: str = ""
    version: int = 0
    events: list[Event] = field(default_factory=list)

    @property
    def stream_id(self) -> str:
        return streams.deployment_stream(self.deployment_id)

    @property
    def active(self) -> Active | None:
        """The active candidate, None before the first promotion."""
        return self.actives[-1] if self.actives else None

    @property
    def next_window_index(self) -> int:
        """The index of the first window not recorded yet."""
        return 0 if self.last_window is None else int(self.last_window["index"]) + 1

    @classmethod
    def created(cls, event: Event) -> DeploymentState:
        """The state after ``DeploymentCreated``; ValueError for another first event."""
        if event.type != "DeploymentCreated":
            raise ValueError(f"a deployment stream starts with DeploymentCreated, not {event.type}")
        d = event.data
        did = streams.stream_suffix(event.stream_id, streams.DEPLOYMENT_PREFIX)
        if did is None:
            raise ValueError(f"{event.stream_id!r} is not a deployment stream")
        state = cls(
            deployment_id=did,
            team=str(d["team"]),
            name=str(d["name"]),
            workload=dict(d["workload"]),
            policy=dict(d["policy"]),
            drift_policy=dict(d["drift_policy"]),
            proven_shape=dict(d["workload"].get("traffic") or {}),
            version=event.version,
            events=[event],
        )
        return state

    @classmethod
    def fold(cls, events: Iterable[Event]) -> DeploymentState:
        """The state of a whole stream (version order); ValueError for an empty one."""
        it = iter(events)
        first = next(it, None)
        if first is None:
            raise ValueError("a deployment stream starts with DeploymentCreated")
        state = cls.created(first)
        for event in it:
            state.apply(event)
        return state

    def apply(self, event: Event) -> None:
        """Fold one later event (ignored at or below :attr:`version`)."""
        if event.stream_id != self.stream_id:
            raise ValueError(f"event of {event.stream_id!r} applied to {self.stream_id!r}")
        if event.version <= self.version:
            return
        handler = _HANDLERS.get(event.type)
        if event.type == "DeploymentCreated":
            raise ValueError("a second DeploymentCreated")
        if handler is not None:
            handler(self, event.data)
        self.version = event.version
        self.events.append(event)

    # ------------------------------------------------------------------ handlers
    def _started(self, d: Mapping[str, Any]) -> None:
        self.recompiling = dict(d)
        self.compilations.append(str(d["compilation_id"]))
        if d["reason"] != "initial":
            self.recompilations += 1
            self.status = Status.RECOMPILING

    def _window(self, d: Mapping[str, Any]) -> None:
        self.last_window = dict(d)
        self.windows += 1

    def _drift(self, d: Mapping[str, Any]) -> None:
        self.last_drift = dict(d)

    def _promoted(self, d: Mapping[str, Any]) -> None:
        shape = dict(d.get("shape") or self.proven_shape)
        self.actives.append(
            Active(
                str(d["candidate_id"]),
                str(d["compilation_id"]),
                float(d.get("tokens_per_s") or 0.0),
                shape,
            )
        )
        self.proven_shape = shape
        self.last_verdict = {**dict(d.get("comparison") or {}), "promoted": True, **_ids(d)}
        if d.get("rebased_at_s") is not None:
            self.proven_at_s = float(d["rebased_at_s"])
        self._ended_recompilation()

    def _declined(self, d: Mapping[str, Any]) -> None:
        self.last_verdict = {
            **dict(d.get("comparison") or {}),
            "promoted": False,
            "reason": str(d["reason"]),
            **_ids(d),
        }
        if d.get("rebased_at_s") is not None:
            self.proven_at_s = float(d["rebased_at_s"])
        initial = self.recompiling is not None and self.recompiling.get("reason") == "initial"
        if not d.get("compilation_failed") and d.get("shape") and self.active is not None:
            self.proven_shape = dict(d["shape"])
        if initial and self.active is None:
            self.status = Status.FAILED
            self.reason = str(d["reason"])
            self.recompiling = None
            return
        self._ended_recompilation()

    def _ended_recompilation(self) -> None:
        self.recompiling = None
        self.status = Status.ACTIVE

    def _rolled_back(self, d: Mapping[str, Any]) -> None:
        if len(self.actives) > 1:
            self.actives.pop()
            self.proven_shape = dict(self.actives[-1].shape)


def _ids(d: Mapping[str, Any]) -> dict[str, Any]:
    return {"compilation_id": str(d.get("compilation_id", ""))}


_HANDLERS = {
    "RecompilationStarted": DeploymentState._started,
    "TrafficWindowObserved": DeploymentState._window,
    "DriftDetected": DeploymentState._drift,
    "CandidatePromoted": DeploymentState._promoted,
    "PromotionDeclined": DeploymentState._declined,
    "CandidateRolledBack": DeploymentState._rolled_back,
}

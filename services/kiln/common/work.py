"""The experiment work item: what the agent runner queues and an engine pool runs
(docs/design/engine.md, "Work queue").

The runner appends ``ExperimentRequested`` (expected: no stream) and publishes an
:class:`ExperimentWork` on its subject with ``Nats-Msg-Id`` = experiment id. A pool runs it,
appends ``ExperimentCompleted`` at expected version 1 (``Aborted``: completed elsewhere, dropped)
and acks; a crash before the ack redelivers.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MODEL_KEY_CHARS = 12
"""Hex digits of a model key (48 bits: collisions are irrelevant at kiln's scale)."""
DEFAULT_DEVICE_KIND = "cpu"
"""Device kind of a workload that names no hardware."""
_KIND_JUNK = re.compile(r"[^a-z0-9_-]+")


def device_kind(workload: Mapping[str, Any]) -> str:
    """``workload.hardware.name`` lower-cased, characters outside ``[a-z0-9_-]`` made ``-``;
    ``"cpu"`` when none (``workload`` as ``MessageToDict`` JSON).
    """
    name = str((workload.get("hardware") or {}).get("name") or "").strip().lower()
    kind = _KIND_JUNK.sub("-", name).strip("-_")[:64]
    return kind or DEFAULT_DEVICE_KIND


def model_key(workload: Mapping[str, Any]) -> str:
    """A short stable hash (:data:`MODEL_KEY_CHARS` hex digits) of what makes a model's weights:
    the config (canonical JSON, else raw), ``dtype``, ``weights_dir`` and ``seed``.
    """
    model = dict(workload.get("model") or {})
    text = str(model.get("config_json") or "")
    try:
        config: Any = json.loads(text)
    except ValueError:
        config = text
    try:
        seed = str(int(model.get("seed") or 0))
    except (TypeError, ValueError):
        seed = str(model.get("seed"))
    body = {
        "config": config,
        "dtype": str(model.get("dtype") or ""),
        "weights_dir": str(model.get("weights_dir") or ""),
        "seed": seed,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:MODEL_KEY_CHARS]


class ExperimentWork(BaseModel):
    """One experiment to run.

    Attributes:
        experiment_id: of the ``experiment-<id>`` stream holding its ExperimentRequested.
        team: the submitting team (appends on its behalf carry it).
        candidate: ``Candidate.canonical()``.
        workload: ``kiln.v1.Workload`` as ``MessageToDict`` JSON (proto field names).
        deadline_s: seconds the candidate may take before it is TIMED_OUT and its engine
            restarted.
        profile: also profile one eager decode step per op (``op_ms``).
        baseline: a baseline of :mod:`kiln.baselines` to measure instead ("" for none).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    experiment_id: str = Field(min_length=1, max_length=128)
    compilation_id: str = Field(min_length=1, max_length=128)
    team: str = Field(min_length=1)
    tier: Literal["fast", "full"]
    candidate: dict[str, Any]
    workload: dict[str, Any]
    deadline_s: float = Field(gt=0, le=3600)
    profile: bool = False
    baseline: str = Field(default="", max_length=64)

    @property
    def device_kind(self) -> str:
        """The hardware kind its subject names (:func:`device_kind` of the workload)."""
        return device_kind(self.workload)

    @property
    def model_key(self) -> str:
        """The model its subject names (:func:`model_key` of the workload)."""
        return model_key(self.workload)

    def subject(self, prefix: str) -> str:
        """``{prefix}.work.experiments.{device_kind}.{tier}.{model_key}``; InvalidArgument on a
        bad prefix.
        """
        from kiln.common.nats import work_subject  # the NATS client only where it is used

        return work_subject(prefix, self.device_kind, self.tier, self.model_key)

    def to_json(self) -> bytes:
        """The message body."""
        return self.model_dump_json().encode()

    @staticmethod
    def from_json(data: bytes) -> ExperimentWork:
        """Parse a message body. Raises pydantic.ValidationError when malformed."""
        return ExperimentWork.model_validate_json(data)

"""The experiment work item: what the agent runner queues and an engine pool runs
(docs/design/engine.md, "Work queue").

1. The runner appends ``ExperimentRequested`` to ``experiment-<experiment_id>`` (expected: no
   stream), then publishes an :class:`ExperimentWork` as JSON on :meth:`ExperimentWork.subject` =
   ``{prefix}.work.experiments.{device_kind}.{tier}.{model_key}`` with ``Nats-Msg-Id`` = experiment
   id (:func:`device_kind`: the workload's hardware target; :func:`model_key`).
2. A pool (one durable pull consumer per exact subject, shared by every pool serving it; explicit
   ack, bounded ``max_deliver``) runs it and appends ``ExperimentCompleted`` with expected version 1
   (``Aborted``: completed elsewhere; ack and drop), then acks. A crash before the ack redelivers.
3. The runner learns the result from the ledger, never from the engine, so either side can restart
   at any point.
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
    """The device kind a workload's experiments are queued for: ``workload.hardware.name`` in
    lower case ("cpu", "h100", "h200", "b200", ...), characters other than ``[a-z0-9_-]``
    replaced by ``-``; ``"cpu"`` when the workload names no hardware.

    Args:
        workload: the ``kiln.v1.Workload`` message as JSON (``MessageToDict``).
    """
    name = str((workload.get("hardware") or {}).get("name") or "").strip().lower()
    kind = _KIND_JUNK.sub("-", name).strip("-_")[:64]
    return kind or DEFAULT_DEVICE_KIND


def model_key(workload: Mapping[str, Any]) -> str:
    """A short stable hash (:data:`MODEL_KEY_CHARS` hex digits) of what makes a model's weights: the
    config (``config_json`` re-serialized with sorted keys; the raw text when not JSON), ``dtype``,
    ``weights_dir`` and ``seed``; not the name or the traffic, so experiments on one model share
    engines and a queue subject.

    Args:
        workload: the ``kiln.v1.Workload`` message as JSON (``MessageToDict``; the seed may be a
            string).
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
        experiment_id: id of the ``experiment-<id>`` stream holding its ExperimentRequested.
        compilation_id: the compilation it belongs to.
        team: the team that submitted the compilation (appends on its behalf carry it).
        tier: "fast" (a few layers) or "full" (all layers).
        candidate: ``kiln.domain.candidate.Candidate.canonical()``.
        workload: the ``kiln.v1.Workload`` message as JSON (``MessageToDict`` with
            ``preserving_proto_field_name=True``).
        deadline_s: seconds the candidate may take (load, check and measure) before it is TIMED_OUT
            and its engine restarted.
        profile: also profile one extra eager decode step per op (``ExperimentCompleted.op_ms``;
            :mod:`kiln.runtime.op_profile`).
        baseline: measure this baseline of :mod:`kiln.baselines` in the engine instead of the
            candidate; "" for a normal experiment.
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
        """The work subject it is published on:
        ``{prefix}.work.experiments.{device_kind}.{tier}.{model_key}``.

        Raises:
            kiln.common.errors.InvalidArgument: a bad prefix.
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

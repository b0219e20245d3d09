"""What the service asks of an engine process, and the pipe messages (plain pickled dicts). Parent →
worker: ``{"type": "run", "request": RunRequest.to_dict()}`` (the candidate in its canonical form,
decoded once in the worker by :meth:`RunRequest.from_dict`) or ``{"type": "stop"}``. Worker →
parent: :data:`READY` once built, :data:`FAILED` (``error``, ``invalid``: the workload is at fault),
:data:`RESULT` (``Measurement.to_dict()``) per run.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from typing import Any, Final

from kiln.domain.candidate import Candidate
from kiln.runtime.timed_verification import VERIFY_TIMED_STEPS

RUN: Final = "run"
STOP: Final = "stop"
READY: Final = "ready"
FAILED: Final = "failed"
RESULT: Final = "result"


@dataclass(frozen=True)
class RunRequest:
    """One experiment for a built engine.

    Attributes:
        experiment_id: for logs and notes. candidate: what to measure (its id is reported).
        warmup: untimed traffic-shape decode steps before timing (>= 1 runs; the first is checked).
        repeats, min_repeats: timed decode steps at most, at least.
        measure_budget_s: stop once ``min_repeats`` ran and their time reached this (0: always
            ``repeats``).
        seed: of this experiment's fresh check inputs.
        verify_timed_steps: timed steps verified after timing, at most (default
            :data:`~kiln.runtime.timed_verification.VERIFY_TIMED_STEPS`; 0: none;
            :class:`kiln.runtime.check.TimedOutputs`); verified together in as few reference
            forwards as fit in memory.
        prefill_repeats: timed prefills of ``batch_size`` x ``context_len`` after decode timing (0:
            none).
        profile: time each op of one extra eager step (:mod:`kiln.runtime.op_profile`).
        baseline: measure this :mod:`kiln.baselines` baseline instead (``hf_eager``, ``hf_static``,
            ``hf_compile``, ``gpt_fast``) on the engine's weights and operating point; "" for a
            normal experiment.
        deadline_s: seconds the engine has for it (0: none); a sandbox that has not answered by
            then is killed and the experiment TIMED_OUT, before the pool would kill the engine.
    """

    experiment_id: str
    candidate: Candidate
    warmup: int = 1
    repeats: int = 20
    min_repeats: int = 5
    measure_budget_s: float = 0.0
    seed: int = field(default_factory=lambda: secrets.randbits(62))
    verify_timed_steps: int = VERIFY_TIMED_STEPS
    prefill_repeats: int = 0
    profile: bool = False
    baseline: str = ""
    deadline_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the pipe; the candidate as ``Candidate.canonical()``."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {**values, "candidate": self.candidate.canonical()}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RunRequest:
        """Inverse of :meth:`to_dict`.

        Raises:
            KeyError, TypeError, ValueError, AttributeError: not a request's dict.
        """
        return RunRequest(**{**data, "candidate": Candidate.from_canonical(data["candidate"])})

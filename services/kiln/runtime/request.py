"""What the service asks of an engine process, and the messages on the pipe between them.

Parent → worker: ``{"type": "run", "request": RunRequest.to_dict()}`` or ``{"type": "stop"}``.
Worker → parent: ``{"type": "ready", ...}`` once built (:data:`READY`), ``{"type": "failed",
"error": str, "invalid": bool}`` when the build failed (:data:`FAILED`; ``invalid`` when the
workload itself is at fault, e.g. missing weights), and ``{"type": "result", "result":
Measurement.to_dict()}`` per run (:data:`RESULT`). Messages are plain dicts (pickled by
``multiprocessing.Connection``).
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass, field
from typing import Any, Final

RUN: Final = "run"
STOP: Final = "stop"
READY: Final = "ready"
FAILED: Final = "failed"
RESULT: Final = "result"


@dataclass(frozen=True)
class RunRequest:
    """One experiment for a built engine.

    Attributes:
        experiment_id: for logs and notes.
        candidate: ``Candidate.canonical()`` (ops, transforms, code modules, lossy).
        warmup: untimed decode steps at the traffic shape before timing (at least one runs:
            the first is checked against the reference).
        repeats: timed decode steps at most.
        min_repeats: timed decode steps at least.
        measure_budget_s: stop timing once ``min_repeats`` steps ran and their total time
            reached this many seconds (0: always ``repeats`` steps).
        seed: seed of this experiment's fresh random check inputs (a new one per request).
        verify_timed_steps: timed steps whose outputs are verified against the reference after
            timing, chosen at random after each call returns (0: none; see
            :class:`kiln.runtime.check.TimedOutputs`); each costs one reference decode step.
        prefill_repeats: timed prefills of ``batch_size`` prompts of ``context_len`` tokens after
            the decode timing (0: none).
        profile: after everything else, time each op of one extra eager decode step at the
            traffic shape (:mod:`kiln.runtime.op_profile`; ``Measurement.op_ms``).
        baseline: instead of the candidate, measure this baseline of :mod:`kiln.baselines`
            (``hf_eager``, ``hf_static``, ``hf_compile``, ``gpt_fast``) in the engine's process
            at its operating point, on its weights (``warmup`` and ``repeats`` steps); "" for a
            normal experiment.
    """

    experiment_id: str
    candidate: dict[str, Any]
    warmup: int = 1
    repeats: int = 20
    min_repeats: int = 5
    measure_budget_s: float = 0.0
    seed: int = field(default_factory=lambda: secrets.randbits(62))
    verify_timed_steps: int = 1
    prefill_repeats: int = 0
    profile: bool = False
    baseline: str = ""

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for the pipe."""
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RunRequest:
        """Inverse of :meth:`to_dict`."""
        return RunRequest(**data)

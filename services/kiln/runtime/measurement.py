"""The result of one experiment, as plain data (no torch, no protobuf); milliseconds, tokens/s,
bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kiln.domain.step_time import decision_step_ms

Status = Literal["ok", "incorrect", "crashed", "timed_out", "rejected"]
STATUSES: tuple[Status, ...] = ("ok", "incorrect", "crashed", "timed_out", "rejected")

MAX_ERROR_CHARS = 4000
"""Error texts are cut to this many characters (tracebacks can be long)."""


@dataclass
class Timing:
    """Times of the timed decode steps after warm-up, ms: percentiles (linear interpolation),
    sample standard deviation (0 with fewer than two), every sample in order, the untimed runs
    before, and the mean and slowest step (0 when not recorded).

    :attr:`decision_ms` is the step time every rate is derived from
    (:mod:`kiln.domain.step_time`): the median, or the mean over the slack when work was
    front-loaded into a few steps.
    """

    median_ms: float = 0.0
    p10_ms: float = 0.0
    p90_ms: float = 0.0
    stdev_ms: float = 0.0
    samples_ms: list[float] = field(default_factory=list)
    warmup_runs: int = 0
    mean_ms: float = 0.0
    max_ms: float = 0.0

    @property
    def decision_ms(self) -> float:
        """``max(median, mean / FRONT_LOAD_SLACK)``, ms."""
        return decision_step_ms(self.median_ms, self.mean_ms)

    @property
    def mean_decides(self) -> bool:
        """Whether the mean, not the median, gave :attr:`decision_ms`."""
        return self.decision_ms > self.median_ms

    def per_second(self, units: float) -> float:
        """``units`` (tokens) per second at one :attr:`decision_ms` per step; 0.0 untimed."""
        step = self.decision_ms
        return units / (step / 1e3) if step > 0 else 0.0


@dataclass
class MemoryUsage:
    """Memory held for one experiment, bytes: base weights, the measured model's KV cache, and
    workspace (derived layouts plus one step's activations: estimated on CPU, peak on CUDA).
    """

    weights_bytes: int = 0
    kv_cache_bytes: int = 0
    workspace_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Sum of the three, bytes."""
        return self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes


@dataclass
class Measurement:
    """One experiment's outcome.

    Attributes:
        status: ok / incorrect / crashed / timed_out / rejected; error: why, for any but ok.
        max_abs_error: largest ``|candidate - reference|`` over the checked logits (``inf`` for
            non-finite).
        timing: decode-step timings (None unless timed); tokens_per_s: ``batch_size`` per
            :attr:`Timing.decision_ms` (the median unless work was front-loaded).
        prefill: timings of a ``batch_size x context_len`` prefill (None unless asked).
        verified_steps: timed steps verified against the reference; escape_probability:
            ``(1 - CHEAT_FRACTION) ** verified_steps``, the chance a candidate wrong on a fifth
            of its timed steps escaped (:mod:`kiln.runtime.timed_verification`; 1.0: none
            verified).
        phases_ms: wall time per phase; device_ms: :meth:`Engine.run` until the engine is put
            back.
        batch_size, context_len: the operating point measured at (0 when unknown).
        op_ms: op -> ms per step of one extra eager step (empty unless asked), at
            ``op_profile_shape``.
        restart_engine: the worker asks to be restarted after replying (never sent).
        engine_died: the engine process (the judge, which runs no candidate code) died before
            answering; the work queue runs the experiment again on the restarted engine.
    """

    status: Status
    correct: bool = False
    max_abs_error: float = 0.0
    timing: Timing | None = None
    tokens_per_s: float = 0.0
    prefill: Timing | None = None
    prefill_tokens_per_s: float = 0.0
    memory: MemoryUsage = field(default_factory=MemoryUsage)
    error: str = ""
    engine_id: str = ""
    tier: str = "fast"
    candidate_id: str = ""
    phases_ms: dict[str, float] = field(default_factory=dict)
    device_ms: float = 0.0
    environment: dict[str, str] = field(default_factory=dict)
    batch_size: int = 0
    context_len: int = 0
    op_ms: dict[str, float] = field(default_factory=dict)
    op_profile_shape: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    restart_engine: bool = False
    engine_died: bool = False
    verified_steps: int = 0
    escape_probability: float = 1.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")
        if len(self.error) > MAX_ERROR_CHARS:
            self.error = self.error[: MAX_ERROR_CHARS - 3] + "..."

    @staticmethod
    def failed(status: Status, error: str, **fields: Any) -> Measurement:
        return Measurement(status=status, error=error, **fields)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (picklable, JSON-compatible except ``inf``)."""
        return asdict(self)

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Measurement:
        """Inverse of :meth:`to_dict`."""
        values = dict(data)
        timing = values.pop("timing", None)
        prefill = values.pop("prefill", None)
        memory = values.pop("memory", None) or {}
        return Measurement(
            timing=None if timing is None else Timing(**timing),
            prefill=None if prefill is None else Timing(**prefill),
            memory=MemoryUsage(**memory),
            **values,
        )

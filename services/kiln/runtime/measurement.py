"""The result of one experiment, as plain data (no torch, no protobuf).

The worker process fills a :class:`Measurement` and sends it as a dict (:meth:`to_dict`); the
service turns it into a ``kiln.v1.Measurement`` (``kiln.engine_pool.service``) or an
``ExperimentCompleted`` payload (``kiln.engine_pool.queue``). Units: milliseconds, tokens/s,
bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["ok", "incorrect", "crashed", "timed_out", "rejected"]
STATUSES: tuple[Status, ...] = ("ok", "incorrect", "crashed", "timed_out", "rejected")

MAX_ERROR_CHARS = 4000
"""Error texts are cut to this many characters (tracebacks can be long)."""


@dataclass
class Timing:
    """Wall-clock times of the timed decode steps after warm-up, milliseconds.

    Attributes:
        median_ms, p10_ms, p90_ms: percentiles of ``samples_ms`` (linear interpolation).
        stdev_ms: sample standard deviation (0 with fewer than two samples).
        samples_ms: every timed step, in order.
        warmup_runs: untimed steps before them.
    """

    median_ms: float = 0.0
    p10_ms: float = 0.0
    p90_ms: float = 0.0
    stdev_ms: float = 0.0
    samples_ms: list[float] = field(default_factory=list)
    warmup_runs: int = 0


@dataclass
class MemoryUsage:
    """Memory the engine holds for one experiment, bytes: ``weights_bytes`` (base weights, shared by
    reference and candidate), ``kv_cache_bytes`` (the measured model's, batch x context slots, all
    layers), ``workspace_bytes`` (derived layouts plus one step's activations: estimated on CPU,
    measured peak on CUDA).
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
        status: ok / incorrect / crashed / timed_out / rejected.
        correct: matched the reference within tolerance; max_abs_error: largest ``|candidate -
            reference|`` over the checked logits (``inf`` for non-finite).
        timing: decode-step timings (None unless timed); tokens_per_s: ``batch_size / median_s``.
        prefill: timings of a prefill of ``batch_size`` prompts of ``context_len`` tokens (None
            unless asked); prefill_tokens_per_s: ``batch_size x context_len / median_s``.
        memory: bytes held (:class:`MemoryUsage`).
        error: why, for any status but ok.
        engine_id, tier: where it ran; candidate_id: the candidate's content id.
        phases_ms: wall time per phase, ms; device_ms: :meth:`Engine.run` from start to the engine
            put back, ms.
        environment: versions measured with (:mod:`kiln.runtime.environment`).
        batch_size, context_len: the operating point measured at (after any fitting to free memory);
            0 when unknown.
        op_ms: per-op profile of one extra eager step (op -> ms per step over layers;
            :mod:`kiln.runtime.op_profile`), empty unless asked; op_profile_shape: its operating
            point (layers, batch_size, context_len, dtype_bytes).
        notes: clamps, defaults, check seed, transforms applied, in words.
        restart_engine: the worker asks to be restarted after replying; never sent over the wire.
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

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")
        if len(self.error) > MAX_ERROR_CHARS:
            self.error = self.error[: MAX_ERROR_CHARS - 3] + "..."

    @staticmethod
    def failed(status: Status, error: str, **fields: Any) -> Measurement:
        """A measurement without results: ``status`` with ``error``."""
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

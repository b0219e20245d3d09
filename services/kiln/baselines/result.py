"""What one baseline run reports (plain data, no torch)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BaselineResult:
    """One baseline's decode-step measurement at an operating point.

    Attributes:
        name: the baseline (``hf_eager``, ``hf_static``, ``hf_compile``, ``gpt_fast``).
        tokens_per_s: decode tokens/s, ``batch`` per decision step (the median, or the mean /
            1.25 when above it: :mod:`kiln.domain.step_time`, as a candidate's; 0 when not
            measured).
        median_ms, p10_ms, p90_ms: percentiles of the timed decode steps, ms
            (:func:`kiln.runtime.timing.summarize`); mean_ms, max_ms: their mean and slowest.
        steps: timed decode steps.
        notes: what was run, in words.
        skipped_reason: why it did not run; "" when it ran.
        correct: its first decode step's logits matched kiln's reference forward (``max_abs_error <=
            tolerance``).
        max_abs_error: ``max |baseline - reference|`` over those logits (``inf`` when non-finite; 0
            when not checked).
        tolerance: the bound it was held to (``rtol x max |reference|``).
        error: an exception that stopped it mid-run ("" when none).
        batch, context: the operating point (sequences, tokens in the cache).
        prefill_median_ms, prefill_p10_ms, prefill_p90_ms: percentiles of the timed ``[batch,
            context]`` prefills, ms (:func:`kiln.baselines.harness.time_prefill`); 0 when not timed.
    """

    name: str
    tokens_per_s: float = 0.0
    median_ms: float = 0.0
    p10_ms: float = 0.0
    p90_ms: float = 0.0
    steps: int = 0
    notes: list[str] = field(default_factory=list)
    skipped_reason: str = ""
    correct: bool = False
    max_abs_error: float = 0.0
    tolerance: float = 0.0
    error: str = ""
    batch: int = 0
    context: int = 0
    prefill_median_ms: float = 0.0
    prefill_p10_ms: float = 0.0
    prefill_p90_ms: float = 0.0
    mean_ms: float = 0.0
    max_ms: float = 0.0

    @property
    def measured(self) -> bool:
        """It ran to the end with a positive throughput (correct or not)."""
        return not self.skipped_reason and not self.error and self.tokens_per_s > 0

    @property
    def prefill_tokens_per_s(self) -> float:
        """``batch x context / prefill median_s``: prompt tokens/s (0 when not timed)."""
        if self.prefill_median_ms <= 0:
            return 0.0
        return self.batch * self.context / (self.prefill_median_ms / 1e3)

    @property
    def status(self) -> str:
        """``ok`` (measured and correct), ``incorrect`` (measured, wrong), ``skipped`` or
        ``crashed``."""
        if self.skipped_reason:
            return "skipped"
        if self.error or not self.measured:
            return "crashed"
        return "ok" if self.correct else "incorrect"

    @staticmethod
    def skipped(name: str, reason: str, **fields: Any) -> BaselineResult:
        """A baseline that did not run, and why."""
        return BaselineResult(name=name, skipped_reason=reason, **fields)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible dict (a non-finite error is written as ``None``)."""
        out = asdict(self)
        if not math.isfinite(self.max_abs_error):
            out["max_abs_error"] = None
        return out

    @staticmethod
    def from_dict(data: dict[str, Any]) -> BaselineResult:
        """Inverse of :meth:`to_dict` (``None`` error read back as ``inf``)."""
        values = dict(data)
        if values.get("max_abs_error") is None:
            values["max_abs_error"] = math.inf
        return BaselineResult(**values)

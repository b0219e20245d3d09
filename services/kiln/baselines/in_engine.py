"""A baseline measured inside a persistent engine's process (``RunRequest.baseline``).

It runs on the engine's device, operating point (``batch_size``, ``context_len``, layers held,
dtype) and own weights (read-only), so baselines, reference and candidates share weights, device and
timer. Its allocations are dropped and the device cache emptied before the reply; the engine then
verifies its weights are unchanged (else it asks for a restart).

Outcome as a :class:`~kiln.runtime.measurement.Measurement`: measured → ``ok`` with ``correct`` and
``max_abs_error`` from the baseline's check against kiln's reference, its decode timing and, on
``prefill_repeats``, its prefill timing; skipped → ``rejected`` with ``skipped: <reason>``; an
exception → ``crashed``.

:func:`measure_baseline` is the engine pool's external measure (``Engine.run_external``), injected
by ``kiln serve engine-pool`` and pickled by name into each engine process; importing this module
imports no torch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

from kiln.baselines.result import BaselineResult
from kiln.domain.baselines import BASELINE_CANDIDATE_PREFIX, BASELINE_NAMES, SKIPPED_PREFIX
from kiln.runtime.measurement import Measurement, MemoryUsage, Timing
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineSpec

if TYPE_CHECKING:
    import torch

    from kiln.workloads.config import ModelConfig
    from kiln.workloads.weights import WeightStore


class EngineLike(Protocol):
    """What this module reads of :class:`kiln.runtime.engine.Engine`."""

    spec: EngineSpec
    device: torch.device
    dtype: torch.dtype
    weights: WeightStore

    @property
    def model(self) -> Any: ...

    def weights_intact(self) -> bool: ...

    def memory(self) -> MemoryUsage: ...


def to_measurement(result: BaselineResult, base: dict[str, Any]) -> Measurement:
    """A baseline's result as an experiment's measurement (see the module docstring).

    Args:
        result: what the baseline reported.
        base: fields every measurement of the engine carries (engine_id, tier, ...).
    """
    notes = [f"baseline {result.name}", *result.notes]
    base = {**base, "candidate_id": BASELINE_CANDIDATE_PREFIX + result.name}
    if result.skipped_reason:
        return Measurement.failed(
            "rejected", SKIPPED_PREFIX + result.skipped_reason, notes=notes, **base
        )
    if result.error or result.median_ms <= 0:
        return Measurement.failed(
            "crashed", f"baseline {result.name}: {result.error or 'no timing'}", notes=notes, **base
        )
    err = result.max_abs_error if math.isfinite(result.max_abs_error) else math.inf
    prefill_ms = result.prefill_median_ms
    prefill = (
        Timing(prefill_ms, result.prefill_p10_ms, result.prefill_p90_ms, warmup_runs=1)
        if prefill_ms > 0
        else None
    )
    return Measurement(
        status="ok",
        correct=result.correct,
        max_abs_error=err,
        timing=Timing(
            median_ms=result.median_ms,
            p10_ms=result.p10_ms,
            p90_ms=result.p90_ms,
            warmup_runs=0,
            mean_ms=result.mean_ms,
            max_ms=result.max_ms,
        ),
        tokens_per_s=result.tokens_per_s,
        prefill=prefill,
        prefill_tokens_per_s=result.prefill_tokens_per_s,
        notes=notes,
        error="" if result.correct else f"baseline {result.name} differs from kiln's reference",
        **base,
    )


def measure_baseline(engine: EngineLike, request: RunRequest, base: dict[str, Any]) -> Measurement:
    """Run ``request.baseline`` in ``engine``'s process.

    Args:
        engine: the built engine (its model config, operating point, device, dtype, weights).
        request: the experiment; ``warmup`` and ``repeats`` give the untimed and timed decode steps,
            ``prefill_repeats`` the timed prefills (0: none), ``seed`` its prompt and tokens.
        base: fields every measurement of the engine carries.

    Returns:
        The measurement; ``restart_engine`` set when the engine's weights changed.
    """
    if request.baseline not in BASELINE_NAMES:
        return Measurement.failed(
            "rejected",
            f"unknown baseline {request.baseline!r}; known: {', '.join(BASELINE_NAMES)}",
            **base,
        )
    from kiln.baselines.runner import run_named

    spec = engine.spec
    config: ModelConfig = engine.model.config  # the layers this engine holds
    result = run_named(
        request.baseline,
        config,
        batch=spec.batch_size,
        context=spec.context_len,
        device=engine.device,
        dtype=engine.dtype,
        seed=request.seed,
        steps=max(1, request.repeats),
        warmup=max(0, request.warmup),
        weights=engine.weights,
        prefill_repeats=max(0, request.prefill_repeats),
    )
    out = to_measurement(result, base)
    out.memory = engine.memory()
    if not engine.weights_intact():
        out.restart_engine = True
        out.notes.append("engine restarts after this baseline: its weights changed")
    return out

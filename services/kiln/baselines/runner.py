"""Run a baseline by name (``kiln.baselines.<name>.run``), never raising for the baseline's own
failure (the engine worker and the benchmark call this)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kiln.baselines.harness import PREFILL_REPEATS
from kiln.baselines.result import BaselineResult
from kiln.domain.baselines import BASELINE_NAMES
from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import WeightStore


def run_named(
    name: str,
    config: ModelConfig,
    *,
    batch: int,
    context: int,
    device: torch.device | str,
    dtype: torch.dtype,
    seed: int,
    steps: int,
    warmup: int,
    weights: WeightStore | None = None,
    prefill_repeats: int = PREFILL_REPEATS,
    **options: Any,
) -> BaselineResult:
    """``kiln.baselines.<name>.run(config, ...)`` (arguments as there; ``options`` go to that
    ``run``, e.g. ``compile_mode``). An exception the baseline raises (a bad operating point
    included) comes back as a result with ``error`` set.

    Raises:
        ValueError: ``name`` is not one of :data:`kiln.domain.baselines.BASELINE_NAMES`.
    """
    if name not in BASELINE_NAMES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(BASELINE_NAMES)}")
    module = importlib.import_module(f"kiln.baselines.{name}")
    try:
        result: BaselineResult = module.run(
            config,
            batch=batch,
            context=context,
            device=device,
            dtype=dtype,
            seed=seed,
            steps=steps,
            warmup=warmup,
            weights=weights,
            prefill_repeats=prefill_repeats,
            **options,
        )
    except Exception as exc:
        return BaselineResult(
            name=name, error=f"{type(exc).__name__}: {exc}", batch=batch, context=context
        )
    return result

"""Baseline: transformers eager with a ``StaticCache``.

The model of :mod:`kiln.baselines.hf_eager` with a pre-allocated ``StaticCache`` of
``context + 1 + warmup + steps`` slots (transformers 5: ``StaticCache(config=...,
max_cache_len=...)``), positions passed explicitly (``position_ids``, and ``cache_position`` on
versions that take it). Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.baselines import hf
from kiln.baselines.harness import OperatingPoint, Runner, run_baseline
from kiln.baselines.result import BaselineResult
from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import WeightStore

NAME = "hf_static"


def static_parts(point: OperatingPoint) -> tuple[Any, Any, hf.HfCall]:
    """``(model, static cache, call convention)`` for the point."""
    transformers = hf.load_transformers()
    model = hf.hf_model(point)
    return model, hf.static_cache(transformers, model, point), hf.HfCall.of(model)


def build(point: OperatingPoint) -> Runner:
    """The model and its static cache, stepped eagerly."""
    model, cache, call = static_parts(point)

    def prefill(prompt: torch.Tensor) -> None:
        b, t = prompt.shape
        model(prompt, **call.kwargs(cache, 0, t, b, point.device))

    def step(token: torch.Tensor, position: int) -> torch.Tensor:
        kw = call.kwargs(cache, position, 1, point.batch, point.device)
        return model(token, **kw).logits[:, -1]

    note = f"{hf.versions()}; StaticCache of {point.cache_len} slots, eager"
    return Runner(prefill, step, [note])


def run(
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
) -> BaselineResult:
    """Measure transformers static-cache decode steps (see the module docstring).

    Args:
        config: the architecture (all layers built).
        batch, context: the operating point (sequences; prompt tokens prefilled).
        device, dtype: where and in what precision.
        seed: of the weights (when not given) and of the prompt and tokens.
        steps, warmup: timed and untimed decode steps.
        weights: kiln's weights to use (drawn from ``seed`` when None).

    Returns:
        The result; *skipped* ("transformers not installed") without transformers.

    Raises:
        ValueError: non-positive batch, context or steps.
    """
    return run_baseline(
        NAME,
        build,
        config,
        batch=batch,
        context=context,
        device=device,
        dtype=dtype,
        seed=seed,
        steps=steps,
        warmup=warmup,
        weights=weights,
        precheck=hf.precheck,
    )

"""Baseline: transformers eager with its default ``DynamicCache``.

``AutoModelForCausalLM.from_config`` on kiln's weights, ``model(input_ids, <cache>=...,
use_cache=True)`` per decode step: what ``model.generate`` does per token without compilation.
Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.baselines import hf
from kiln.baselines.harness import OperatingPoint, Runner, run_baseline
from kiln.baselines.result import BaselineResult
from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import WeightStore

NAME = "hf_eager"


def build(point: OperatingPoint) -> Runner:
    """The model and a fresh ``DynamicCache`` (made at prefill)."""
    transformers = hf.load_transformers()
    model = hf.hf_model(point)
    call = hf.HfCall.of(model)
    state: dict[str, Any] = {}

    def prefill(prompt: torch.Tensor) -> None:
        try:
            state["cache"] = transformers.DynamicCache(config=model.config)
        except TypeError:  # transformers < 4.56
            state["cache"] = transformers.DynamicCache()
        b, t = prompt.shape
        model(prompt, **call.kwargs(state["cache"], 0, t, b, point.device))

    def step(token: torch.Tensor, position: int) -> torch.Tensor:
        kw = call.kwargs(state["cache"], position, 1, point.batch, point.device)
        return model(token, **kw).logits[:, -1]

    return Runner(prefill, step, [f"{hf.versions()}; DynamicCache, eager attention default"])


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
    """Measure transformers eager decode steps (see the module docstring).

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

"""Baseline: transformers with a ``StaticCache`` and ``torch.compile`` + CUDA graphs.

transformers' documented static-cache recipe: ``model.forward = torch.compile(model.forward,
mode="reduce-overhead", fullgraph=True)`` (``reduce-overhead`` captures CUDA graphs on CUDA).
The prompt is prefilled with the uncompiled forward (one shape, not worth a compile); decode
steps run the compiled one. The checked first step and the warm-up steps compile and record the
graphs (untimed); each step's logits are cloned before the next replay overwrites them.
Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kiln.baselines import hf
from kiln.baselines.harness import OperatingPoint, Runner, run_baseline
from kiln.baselines.hf_static import static_parts
from kiln.baselines.result import BaselineResult
from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import WeightStore

NAME = "hf_compile"
MODE = "reduce-overhead"


def builder(compile_mode: str | None) -> Callable[[OperatingPoint], Runner]:
    """A build function compiling the decode forward with ``compile_mode`` (None: eager)."""
    return functools.partial(build, compile_mode=compile_mode)


def build(point: OperatingPoint, compile_mode: str | None = MODE) -> Runner:
    """The static-cache model with its forward compiled for decode."""
    model, cache, call = static_parts(point)
    eager = model.forward
    compiled = torch.compile(eager, mode=compile_mode, fullgraph=True) if compile_mode else eager

    def prefill(prompt: torch.Tensor) -> None:
        b, t = prompt.shape
        eager(prompt, **call.kwargs(cache, 0, t, b, point.device))

    def step(token: torch.Tensor, position: int) -> torch.Tensor:
        kw = call.kwargs(cache, position, 1, point.batch, point.device)
        return compiled(token, **kw).logits[:, -1].clone()

    how = (
        f"torch.compile(model.forward, mode={compile_mode!r}, fullgraph=True) for decode"
        if compile_mode
        else "eager (no compile)"
    )
    note = f"{hf.versions()}; StaticCache of {point.cache_len} slots, {how}"
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
    compile_mode: str | None = MODE,
) -> BaselineResult:
    """Measure compiled transformers static-cache decode steps (see the module docstring).

    Args:
        config: the architecture (all layers built).
        batch, context: the operating point (sequences; prompt tokens prefilled).
        device, dtype: where and in what precision.
        seed: of the weights (when not given) and of the prompt and tokens.
        steps, warmup: timed and untimed decode steps.
        weights: kiln's weights to use (drawn from ``seed`` when None).
        compile_mode: ``torch.compile`` mode of ``model.forward``; None runs it eager.

    Returns:
        The result; *skipped* ("transformers not installed") without transformers.

    Raises:
        ValueError: non-positive batch, context or steps.
    """
    return run_baseline(
        NAME,
        builder(compile_mode),
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

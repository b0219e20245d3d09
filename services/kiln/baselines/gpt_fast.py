"""Baseline: a compact gpt-fast-style Llama, ``torch.compile(mode="reduce-overhead",
fullgraph=True)`` on ``decode_one_token`` (CUDA graphs on CUDA).

The model is :class:`kiln.baselines.gpt_fast_model.GptFastLlama` over kiln's weights; the prompt
is prefilled uncompiled (gpt-fast compiles prefill separately, with dynamic shapes), decode steps
run compiled; logits are cloned before the next replay. ``compile_mode=None`` runs it eager
(for quick CPU tests). Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.baselines import gpt_fast_model
from kiln.baselines.harness import OperatingPoint, Runner, SkipBaseline, run_baseline
from kiln.baselines.result import BaselineResult
from kiln.workloads.config import ModelConfig
from kiln.workloads.weights import WeightStore

NAME = "gpt_fast"
MODE = "reduce-overhead"


def precheck(config: ModelConfig) -> None:
    """Raise :class:`SkipBaseline` for anything but a dense Llama."""
    if config.model_type != "llama" or config.is_moe or config.attention_bias:
        raise SkipBaseline(f"gpt-fast baseline builds dense Llama only, not {config.model_type!r}")


def builder(compile_mode: str | None) -> Callable[[OperatingPoint], Runner]:
    """A build function compiling ``decode_one_token`` with ``compile_mode`` (None: eager)."""

    def build(point: OperatingPoint) -> Runner:
        model = gpt_fast_model.GptFastLlama(
            point.config, point.weights, point.batch, point.cache_len
        )
        step_fn = gpt_fast_model.decode_one_token
        if compile_mode is not None:
            step_fn = torch.compile(step_fn, mode=compile_mode, fullgraph=True)
        positions = torch.arange(point.cache_len, device=point.device)

        def prefill(prompt: torch.Tensor) -> None:
            gpt_fast_model.prefill(model, prompt)

        def step(token: torch.Tensor, position: int) -> torch.Tensor:
            return step_fn(model, token, positions[position : position + 1]).clone()

        how = (
            f"torch.compile(decode_one_token, mode={compile_mode!r}, fullgraph=True)"
            if compile_mode
            else "eager (no compile)"
        )
        note = f"torch {torch.__version__}; fused wqkv and w13, static KV cache, {how}"
        return Runner(prefill, step, [note])

    return build


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
    """Measure gpt-fast-style decode steps (see the module docstring).

    Args:
        config: the architecture (all layers built).
        batch, context: the operating point (sequences; prompt tokens prefilled).
        device, dtype: where and in what precision.
        seed: of the weights (when not given) and of the prompt and tokens.
        steps, warmup: timed and untimed decode steps.
        weights: kiln's weights to use (drawn from ``seed`` when None).
        compile_mode: ``torch.compile`` mode of ``decode_one_token``; None runs it eager.

    Returns:
        The result; *skipped* for anything but a dense Llama.

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
        precheck=precheck,
    )

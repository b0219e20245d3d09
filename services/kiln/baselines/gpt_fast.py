"""Baseline: a compact gpt-fast-style dense decoder (Llama, Qwen3),
``torch.compile(mode="reduce-overhead", fullgraph=True)`` on ``decode_one_token`` (CUDA graphs
on CUDA).

The model is :class:`kiln.baselines.gpt_fast_model.GptFastTransformer` over kiln's weights; the
prompt is prefilled uncompiled (gpt-fast compiles prefill separately, with dynamic shapes),
decode steps run compiled; logits are cloned before the next replay. ``compile_mode=None`` runs
it eager (for quick CPU tests). Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.baselines import gpt_fast_model
from kiln.baselines.harness import (
    COMPILE_MODE,
    BaselineSetup,
    CompiledBaseline,
    Runner,
    SkipBaseline,
    compiled,
)
from kiln.workloads.config import ModelConfig

NAME = "gpt_fast"
MODE = COMPILE_MODE


def precheck(config: ModelConfig) -> None:
    """Raise :class:`SkipBaseline` for a config the model cannot build (anything but a dense,
    bias-free Llama or Qwen3: :func:`kiln.baselines.gpt_fast_model.unsupported` says why)."""
    reason = gpt_fast_model.unsupported(config)
    if reason is not None:
        raise SkipBaseline(f"gpt-fast baseline {reason}")


def builder(compile_mode: str | None) -> Callable[[BaselineSetup], Runner]:
    """A build function compiling ``decode_one_token`` with ``compile_mode`` (None: eager)."""

    def build(point: BaselineSetup) -> Runner:
        model = gpt_fast_model.GptFastTransformer(
            point.config, point.weights, point.batch, point.cache_len
        )
        decode = gpt_fast_model.decode_one_token
        step_fn, how = compiled(decode, compile_mode, "decode_one_token")
        positions = torch.arange(point.cache_len, device=point.device)

        def prefill(prompt: torch.Tensor) -> None:
            gpt_fast_model.prefill(model, prompt)

        def step(token: torch.Tensor, position: int) -> torch.Tensor:
            logits: torch.Tensor = step_fn(model, token, positions[position : position + 1])
            return logits.clone()

        family = point.config.model_type + (" (q/k norms)" if point.config.qk_norm else "")
        note = f"torch {torch.__version__}; {family}, fused wqkv and w13, static KV cache, {how}"
        return Runner(prefill, step, [note])

    return build


run = CompiledBaseline(
    NAME,
    builder,
    precheck=precheck,
    measures="gpt-fast-style decode steps",
    skipped="for anything but a dense, bias-free Llama or Qwen3 (MoE, MLA, biases)",
    compiles="``decode_one_token``",
)

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

from kiln.baselines import hf
from kiln.baselines.harness import (
    COMPILE_MODE,
    BaselineSetup,
    CompiledBaseline,
    Runner,
    compiled,
)
from kiln.baselines.hf_static import static_parts

NAME = "hf_compile"
MODE = COMPILE_MODE


def builder(compile_mode: str | None) -> Callable[[BaselineSetup], Runner]:
    """A build function compiling the decode forward with ``compile_mode`` (None: eager)."""
    return functools.partial(build, compile_mode=compile_mode)


def build(point: BaselineSetup, compile_mode: str | None = MODE) -> Runner:
    """The static-cache model with its forward compiled for decode."""
    model, cache, call = static_parts(point)
    eager = model.forward
    decode, how = compiled(eager, compile_mode, "model.forward", " for decode")
    note = (
        f"{hf.versions()}; StaticCache of {point.cache_len} slots, {hf.attention(model)} "
        f"attention, {how}"
    )
    return hf.runner(point, call, lambda: cache, eager, decode, note, clone=True)


run = CompiledBaseline(
    NAME,
    builder,
    precheck=hf.precheck,
    measures="compiled transformers static-cache decode steps",
    skipped=hf.SKIPPED,
    compiles="``model.forward``",
)

"""Baseline: transformers eager with a ``StaticCache``.

The model of :mod:`kiln.baselines.hf_eager` with a pre-allocated ``StaticCache`` of
``context + 1 + warmup + steps`` slots (transformers 5: ``StaticCache(config=...,
max_cache_len=...)``), positions passed explicitly (``position_ids``, and ``cache_position`` on
versions that take it). Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

from typing import Any

from kiln.baselines import hf
from kiln.baselines.harness import Baseline, BaselineSetup, Runner

NAME = "hf_static"


def static_parts(point: BaselineSetup) -> tuple[Any, Any, hf.HfCall]:
    """``(model, static cache, call convention)`` for the point."""
    transformers = hf.load_transformers()
    model = hf.hf_model(point)
    return model, hf.static_cache(transformers, model, point), hf.HfCall.of(model)


def build(point: BaselineSetup) -> Runner:
    """The model and its static cache, stepped eagerly."""
    model, cache, call = static_parts(point)
    note = (
        f"{hf.versions()}; StaticCache of {point.cache_len} slots, {hf.attention(model)} "
        "attention, eager forward"
    )
    return hf.runner(point, call, lambda: cache, model, model, note)


run = Baseline(
    NAME,
    build,
    precheck=hf.precheck,
    measures="transformers static-cache decode steps",
    skipped=hf.SKIPPED,
)

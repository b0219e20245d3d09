"""Baseline: transformers eager with its default ``DynamicCache``.

``AutoModelForCausalLM.from_config`` on kiln's weights, ``model(input_ids, <cache>=...,
use_cache=True)`` per decode step: what ``model.generate`` does per token without compilation.
Protocol and check: :mod:`kiln.baselines.harness`.
"""

from __future__ import annotations

from typing import Any

from kiln.baselines import hf
from kiln.baselines.harness import Baseline, BaselineSetup, Runner

NAME = "hf_eager"


def build(point: BaselineSetup) -> Runner:
    """The model and a fresh ``DynamicCache`` (made at prefill)."""
    transformers = hf.load_transformers()
    model = hf.hf_model(point)

    def dynamic_cache() -> Any:
        try:
            return transformers.DynamicCache(config=model.config)
        except TypeError:  # transformers < 4.56
            return transformers.DynamicCache()

    note = f"{hf.versions()}; DynamicCache, {hf.attention(model)} attention, eager forward"
    return hf.runner(point, hf.HfCall.of(model), dynamic_cache, model, model, note)


run = Baseline(
    NAME,
    build,
    precheck=hf.precheck,
    measures="transformers eager decode steps",
    skipped=hf.SKIPPED,
)

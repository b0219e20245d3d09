"""Baselines measured side by side with kiln: the forward passes people would otherwise use.

Four decode-step baselines at an operating point (``batch`` sequences, ``context`` tokens
prefilled), each a module with ``run(config, *, batch, context, device, dtype, seed, steps, warmup)
-> BaselineResult``: :mod:`~kiln.baselines.hf_eager` (transformers, ``DynamicCache``, eager),
:mod:`~kiln.baselines.hf_static` (``StaticCache``, eager), :mod:`~kiln.baselines.hf_compile` (static
cache, ``torch.compile(mode="reduce-overhead", fullgraph=True)``), :mod:`~kiln.baselines.gpt_fast`
(gpt-fast-style Llama, compiled with CUDA graphs).

Each runs on kiln's seeded random weights and checks its first decode step against kiln's reference
forward (:mod:`kiln.baselines.harness`). Their names are domain vocabulary
(:mod:`kiln.domain.baselines`). This ``__init__``, :mod:`~kiln.baselines.result`,
:mod:`~kiln.baselines.table` and :mod:`~kiln.baselines.in_engine` import no torch (the last
imports it when it measures); transformers is imported lazily (without it the HF baselines are
skipped).
"""

from kiln.baselines.result import BaselineResult

__all__ = ["BaselineResult"]

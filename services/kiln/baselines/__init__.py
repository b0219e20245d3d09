"""Baselines measured side by side with kiln: the forward passes people would otherwise use.

Four decode-step baselines at an operating point (``batch`` sequences, ``context`` tokens
prefilled), each in its own module with ``run(config, *, batch, context, device, dtype, seed,
steps, warmup) -> BaselineResult``:

- :mod:`kiln.baselines.hf_eager`: transformers ``AutoModelForCausalLM`` with its default
  ``DynamicCache``, eager;
- :mod:`kiln.baselines.hf_static`: the same model with a ``StaticCache``, eager;
- :mod:`kiln.baselines.hf_compile`: static cache and ``torch.compile(model.forward,
  mode="reduce-overhead", fullgraph=True)`` (transformers' documented static-cache recipe);
- :mod:`kiln.baselines.gpt_fast`: a compact gpt-fast-style Llama (fused QKV and gate/up, static
  KV cache, ``torch.compile`` with CUDA graphs on ``decode_one_token``).

Every baseline runs on kiln's seeded random weights (:func:`kiln.workloads.weights.seeded_random`)
and checks its first decode step against kiln's reference forward on the same weights
(:mod:`kiln.baselines.harness`), so a baseline that is fast because it is wrong is flagged.

This package's ``__init__`` and :mod:`kiln.baselines.names`, :mod:`kiln.baselines.result`,
:mod:`kiln.baselines.table` import no torch (the agent runner and the CLI use them); the
baselines themselves import torch, and transformers lazily (a dev dependency: without it the HF
baselines are *skipped*, not crashed).
"""

from kiln.baselines.names import BASELINE_NAMES, parse_names
from kiln.baselines.result import BaselineResult

__all__ = ["BASELINE_NAMES", "BaselineResult", "parse_names"]

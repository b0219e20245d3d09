"""Comparing a kiln model with a transformers causal LM holding the same weights: load a state
dict strictly, then the largest logit difference over a prefill and greedy decode steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kiln.workloads.models import DecoderModel


def load_weights(hf: Any, state: Mapping[str, torch.Tensor]) -> Any:
    """``hf`` in eval mode with ``state`` loaded; AssertionError naming any missing or
    unexpected name."""
    missing, unexpected = hf.load_state_dict(dict(state), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return hf.eval()


def max_logit_diff(model: DecoderModel, hf: Any, prompt: torch.Tensor, steps: int) -> float:
    """Largest |kiln - transformers| logit over every prompt position, then ``steps`` greedy
    decode steps fed the same (transformers') tokens."""
    with torch.no_grad():
        out = hf(input_ids=prompt, use_cache=True)
        worst = (model.prefill(prompt, all_logits=True) - out.logits).abs().max().item()
        for _ in range(steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = hf(input_ids=token, cache=out.cache, use_cache=True)
            step = model.decode_step(token)
            worst = max(worst, (step - out.logits[:, -1]).abs().max().item())
    return float(worst)

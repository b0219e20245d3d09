"""The ``fused_decode`` chain on CUDA for every dense family's real shapes (skipped without CUDA):
Llama-3.2-1B/3B, Llama-3.1-8B, Qwen3-0.6B/8B cut to two layers (every width as published:
Q/K norms, heads x head_dim != hidden, GQA ratios, tied and untied heads, llama3 RoPE), random
bf16 weights, the fused step captured in a CUDA graph as the engine measures it, at a
matrix-vector batch and at a tensor-core batch, against the reference ops step by step.

Run on a GPU host: ``pytest --noconftest tests/gpu/test_fused_families_gpu.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
MODELS = ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "qwen3-0.6b", "qwen3-8b")
STEPS, CONTEXT, LAYERS = 4, 200, 2


def _config(name: str):  # type: ignore[no-untyped-def]
    from kiln.workloads.config import load_config

    root = Path(os.environ.get("KILN_SHARED_DATA", SHARED))
    return load_config(root / "models" / f"{name}.json").with_layers(LAYERS)


def _steps(config, batch: int, transforms, weights=None):  # type: ignore[no-untyped-def]
    """(weights, logits of STEPS decode steps) of a model prefilled with seeded prompts."""
    from kiln.runtime.transforms import apply_transforms
    from kiln.workloads.models import build_model

    dev = torch.device("cuda")
    model = build_model(
        config, dtype=torch.bfloat16, device=dev, seed=5, weights=weights,
        max_batch=batch, max_seq_len=CONTEXT + STEPS + 8,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, config.vocab_size, (batch, CONTEXT), generator=gen).to(dev)
    lens = torch.randint(CONTEXT // 2, CONTEXT + 1, (batch,), generator=gen).to(dev)
    tokens = torch.randint(0, config.vocab_size, (STEPS, batch, 1), generator=gen).to(dev)
    model.prefill(prompt, lens)
    applied = apply_transforms(model, transforms)
    try:
        out = [model.decode_step(t).clone() for t in tokens]
        torch.cuda.synchronize()
        return model.weights, out
    finally:
        applied.revert()


@pytest.mark.parametrize("batch", [1, 24])
@pytest.mark.parametrize("name", MODELS)
def test_fused_graph_matches_the_reference(name: str, batch: int) -> None:
    from kiln.domain.candidate import Transform

    config = _config(name)
    weights, reference = _steps(config, batch, [])
    _, fused = _steps(
        config, batch, [Transform.of("fused_decode"), Transform.of("cuda_graph")], weights
    )
    for step, (want, got) in enumerate(zip(reference, fused, strict=True)):
        scale = want.abs().max().item()
        assert torch.isfinite(got).all(), step
        assert (got - want).abs().max().item() <= 3e-2 * max(scale, 1.0), (name, batch, step)

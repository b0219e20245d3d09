"""The ``fused_decode`` transform on CUDA (skipped without it): Llama-3.2-1B's real shapes with
random bf16 weights, the fused step captured in a CUDA graph (as the engine measures it) with
and without programmatic dependent launch, against the reference ops step by step.

PDL lets a kernel start before the previous one ends; a missing ``griddepcontrol.wait`` would
show here as logits that differ between PDL modes or drift from the reference over steps.

Run on a GPU host: ``pytest --noconftest tests/gpu/test_fused_decode_gpu.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"
STEPS, BATCH, CONTEXT = 6, 2, 300


def _model_config():  # type: ignore[no-untyped-def]
    import os

    from kiln.workloads.config import load_config

    root = Path(os.environ.get("KILN_SHARED_DATA", SHARED))
    return load_config(root / "models" / "llama-3.2-1b.json")


@pytest.fixture(scope="module")
def models():  # type: ignore[no-untyped-def]
    from kiln.workloads.models import build_model

    config = _model_config()
    dev = torch.device("cuda")
    ref = build_model(
        config, dtype=torch.bfloat16, device=dev, seed=3, max_batch=BATCH, max_seq_len=512
    )
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, config.vocab_size, (BATCH, CONTEXT), generator=gen).to(dev)
    lens = torch.tensor([CONTEXT, CONTEXT - 77], device=dev)
    steps = torch.randint(0, config.vocab_size, (STEPS, BATCH, 1), generator=gen).to(dev)
    return config, ref, prompt, lens, steps


def _run(models, transforms) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Logits of STEPS decode steps (the same random tokens for every run) of a fresh model on
    the shared weights, prefilled with the same prompts."""
    from kiln.runtime.transforms import apply_transforms
    from kiln.workloads.models import build_model

    config, ref, prompt, lens, steps = models
    model = build_model(
        config,
        dtype=torch.bfloat16,
        device=prompt.device,
        weights=ref.weights,
        max_batch=BATCH,
        max_seq_len=512,
    )
    model.prefill(prompt, lens)
    applied = apply_transforms(model, transforms)
    try:
        out = [model.decode_step(tokens).clone() for tokens in steps]
        torch.cuda.synchronize()
        return out
    finally:
        applied.revert()


def test_fused_graph_matches_the_reference_and_pdl_changes_nothing(models) -> None:  # type: ignore[no-untyped-def]
    from kiln.domain.candidate import Transform
    from kiln.ops.kernels.runtime import pdl_available

    reference = _run(models, [])
    runs = {
        pdl: _run(models, [Transform.of("fused_decode", pdl=pdl), Transform.of("cuda_graph")])
        for pdl in (0, 1, 2)
    }
    for step, want in enumerate(reference):
        got = runs[0][step]
        scale = want.abs().max().item()
        assert (got - want).abs().max().item() <= 3e-2 * max(scale, 1.0), step
    for pdl in (1, 2):
        for step in range(STEPS):
            assert torch.equal(runs[pdl][step], runs[0][step]), (pdl, step)
    assert pdl_available("cuda") == (torch.cuda.get_device_capability()[0] >= 9)

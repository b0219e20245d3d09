"""A block-FP8 MiniMax-M2 checkpoint in its published names (``block_sparse_moe.experts.{e}.w1``
/ ``w3`` / ``w2`` FP8 with ``weight_scale_inv``, ``block_sparse_moe.gate`` and the correction
bias as stored, ``modules_to_not_convert`` as MiniMax-M2.7's config lists it) read by kiln's
loader: the tensors equal the test's own dequantization, the forward matches transformers' on
them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.workloads.config import parse_config
from kiln.workloads.minimax_m2 import seeded_random_minimax
from kiln.workloads.models import build_model

from .hf_testing import load_weights, max_logit_diff
from .quantized_files import MINIMAX_EXPERTS, fp8_files, write_checkpoint
from .test_minimax_m2_model import MODELS
from .test_minimax_m2_model import TINY as MINIMAX_TINY

transformers = pytest.importorskip("transformers")

TOL = 1e-5
REAL_QUANT = json.loads((MODELS / "minimax-m2.7.json").read_text())["quantization_config"]
RAW: dict[str, Any] = {
    **MINIMAX_TINY,
    "quantization_config": {**REAL_QUANT, "weight_block_size": [16, 16]},
}


def test_the_checkpoint_loads_and_matches_transformers(tmp_path: Path) -> None:
    config = parse_config(RAW, "tiny-minimax-fp8")
    state = dict(seeded_random_minimax(config, torch.float32, seed=3).items())
    gen = torch.Generator().manual_seed(7)
    for name, t in state.items():  # the routing and norms away from their defaults
        if name.endswith("e_score_correction_bias"):
            state[name] = torch.randn(t.shape, generator=gen) * 0.1
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            state[name] = 1 + torch.randn(t.shape, generator=gen) * 0.2
    files, dequantized = fp8_files(state, (16, 16), MINIMAX_EXPERTS)
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight_scale_inv" in files
    assert "model.layers.0.block_sparse_moe.e_score_correction_bias" in files
    directory = write_checkpoint(tmp_path / "ckpt", RAW, files)
    model = build_model(config, dtype=torch.float32, weights_dir=directory, max_batch=2)
    for name, want in dequantized.items():
        assert torch.equal(model.weights[name], want), name
    assert model.weights["model.layers.1.mlp.e_score_correction_bias"].dtype == torch.float32
    kept = {k: v for k, v in RAW.items() if k not in ("model_type", "quantization_config")}
    kept = {k: v for k, v in kept.items() if v is not None}
    hf_config = transformers.MiniMaxM2Config(**kept, bos_token_id=None, eos_token_id=None)
    hf_config._attn_implementation = "eager"
    hf = load_weights(transformers.MiniMaxM2ForCausalLM(hf_config), dequantized)
    prompt = torch.randint(0, RAW["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(1))
    assert max_logit_diff(model, hf, prompt, steps=4) < TOL

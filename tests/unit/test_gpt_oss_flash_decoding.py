"""A tiny gpt-oss model bound to ``attention`` "flash_decoding" (the decode kernel with sinks and
sliding windows; prefill through the reference, which has sinks) decodes what the reference
recipe does, through Triton's interpreter on CPU (``TRITON_INTERPRET=1`` set below before Triton
is imported; binding does not check devices, the support statement does)."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path
from typing import Any

import torch

from kiln.runtime.support import support_for
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
REAL = json.loads((MODELS / "gpt-oss-20b.json").read_text())
TINY: dict[str, Any] = {
    **{k: v for k, v in REAL.items() if k != "quantization_config"},
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 32,
    "head_dim": 16,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "experts_per_token": 2,
    "max_position_embeddings": 512,
    "pad_token_id": None,
    "eos_token_id": None,
    "rope_scaling": {**REAL["rope_scaling"], "original_max_position_embeddings": 16},
    "initializer_range": 0.2,  # large enough that the sinks matter
    "torch_dtype": "float32",
}
TOL = 1e-4
"""Max |logit difference| in float32 (summation order only)."""


def test_the_support_statement_admits_flash_decoding_for_gpt_oss() -> None:
    config = parse_config(TINY, "tiny-gpt-oss")
    assert support_for(config, "cuda").op_reason("attention", "flash_decoding") is None
    assert "sinks" in (support_for(config, "cuda").op_reason("attention", "sdpa") or "")


def test_a_tiny_gpt_oss_decodes_the_reference_tokens() -> None:
    config = parse_config(TINY, "tiny-gpt-oss")
    kw: dict[str, Any] = {"dtype": torch.float32, "max_batch": 2, "max_seq_len": 24}
    ref = build_model(config, seed=5, **kw)
    fast = build_model(config, weights=ref.weights, recipe={"attention": "flash_decoding"}, **kw)
    assert [layer.attention.params["window"] for layer in fast.slots.layers] == [4, None]
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, TINY["vocab_size"], (2, 9), generator=gen)
    seq_lens = torch.tensor([9, 3])  # rows of different lengths, both past the window later
    want, got = ref.prefill(prompt, seq_lens), fast.prefill(prompt, seq_lens)
    worst = (got - want).abs().max().item()
    for _ in range(8):  # the short row's context grows from 3 to 11, past the window (4)
        token = want.argmax(-1, keepdim=True)
        assert torch.equal(got.argmax(-1, keepdim=True), token)
        want, got = ref.decode_step(token), fast.decode_step(token)
        worst = max(worst, (got - want).abs().max().item())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert worst < TOL, worst

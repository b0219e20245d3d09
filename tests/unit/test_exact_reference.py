"""The float64 exact reference over a bfloat16 model's weights: equal to a float64 model of the
upcast weights, one layer upcast at a time, and nothing of the model written; and the tolerance
derived from it (:func:`kiln.runtime.check.compare_exact`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.runtime.exact import exact_model, exact_step
from kiln.workloads.config import parse_config
from kiln.workloads.models import build_model
from kiln.workloads.models.decoder import DecoderModel
from kiln.workloads.weights import WeightStore

from .engine_testing import TINY_LLAMA

QWEN3 = {**TINY_LLAMA, "model_type": "qwen3", "rope_scaling": None, "tie_word_embeddings": False}
MOE = {
    **TINY_LLAMA,
    "model_type": "qwen3_moe",
    "rope_scaling": None,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def _pair(raw: dict[str, Any]) -> tuple[DecoderModel, DecoderModel]:
    config = parse_config(raw, "tiny")
    low = build_model(config, seed=3, dtype=torch.bfloat16, max_batch=3, max_seq_len=24)
    tensors = {name: low.weights[name].double() for name in low.weights}
    high = build_model(
        config,
        weights=WeightStore(tensors, tied=config.tie_word_embeddings),
        dtype=torch.float64,
        max_batch=3,
        max_seq_len=24,
    )
    return low, high


@pytest.mark.parametrize("raw", [TINY_LLAMA, QWEN3, MOE], ids=["llama", "qwen3", "qwen3_moe"])
def test_exact_matches_a_float64_model_of_the_same_weights(raw: dict[str, Any]) -> None:
    low, high = _pair(raw)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(raw["vocab_size"], (3, 9), generator=g)
    seq_lens = torch.tensor([9, 4, 6])

    fresh = exact_model(low, max_batch=3, max_len=24)
    torch.testing.assert_close(fresh.prefill(tokens, seq_lens), high.prefill(tokens, seq_lens))
    step = torch.randint(raw["vocab_size"], (3, 1), generator=g)
    torch.testing.assert_close(fresh.decode_step(step), high.decode_step(step))

    # From the bf16 model's own cache: the float64 model holds the same (upcast) contents.
    low.prefill(tokens, seq_lens)
    for i in range(len(low.cache.k)):
        high.cache.k[i].copy_(low.cache.k[i].double())
        high.cache.v[i].copy_(low.cache.v[i].double())
    high.cache.restore_state(low.cache.state())
    before = [t.clone() for t in low.cache.k + low.cache.v]
    lengths = low.cache.lengths.clone()
    got = exact_step(low, step)
    torch.testing.assert_close(got, high.decode_step(step))
    assert got.dtype == torch.float64
    assert all(torch.equal(a, b) for a, b in zip(before, low.cache.k + low.cache.v, strict=True))
    assert torch.equal(low.cache.lengths, lengths)  # nothing advanced
    # and the bf16 reference's rounding is visible against it
    assert float((low.decode_step(step) - got).abs().max()) > 0

"""The float32 exact reference over a bfloat16 model's weights: equal to a float32 model of the
upcast weights, one layer upcast at a time, and nothing of the model written."""

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
    tensors = {name: low.weights[name].float() for name in low.weights}
    high = build_model(
        config,
        weights=WeightStore(tensors, tied=config.tie_word_embeddings),
        dtype=torch.float32,
        max_batch=3,
        max_seq_len=24,
    )
    return low, high


@pytest.mark.parametrize("raw", [TINY_LLAMA, QWEN3, MOE], ids=["llama", "qwen3", "qwen3_moe"])
def test_exact_matches_a_float32_model_of_the_same_weights(raw: dict[str, Any]) -> None:
    low, high = _pair(raw)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(raw["vocab_size"], (3, 9), generator=g)
    seq_lens = torch.tensor([9, 4, 6])

    fresh = exact_model(low, max_batch=3, max_len=24)
    torch.testing.assert_close(fresh.prefill(tokens, seq_lens), high.prefill(tokens, seq_lens))
    step = torch.randint(raw["vocab_size"], (3, 1), generator=g)
    torch.testing.assert_close(fresh.decode_step(step), high.decode_step(step))

    # From the bf16 model's own cache: the float32 model holds the same (upcast) contents.
    low.prefill(tokens, seq_lens)
    for i in range(len(low.cache.k)):
        high.cache.k[i].copy_(low.cache.k[i].float())
        high.cache.v[i].copy_(low.cache.v[i].float())
    high.cache.restore_state(low.cache.state())
    before = [t.clone() for t in low.cache.k + low.cache.v]
    lengths = low.cache.lengths.clone()
    got = exact_step(low, step)
    torch.testing.assert_close(got, high.decode_step(step))
    assert got.dtype == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(before, low.cache.k + low.cache.v, strict=True))
    assert torch.equal(low.cache.lengths, lengths)  # nothing advanced
    # and the bf16 reference's rounding is visible against it
    assert float((low.decode_step(step) - got).abs().max()) > 0


def test_compare_against_exact_accepts_the_references_own_rounding_and_no_more() -> None:
    from kiln.runtime.check import NOISE_FACTOR, compare

    g = torch.Generator().manual_seed(1)
    exact = torch.randn(4, 64, generator=g) * 6
    own = torch.randn(4, 64, generator=g)
    reference = exact + 0.3 * own / own.abs().max()  # a deep bf16 reference: 0.3 from exact
    other = torch.randn(4, 64, generator=g)
    honest = exact + 0.35 * other / other.abs().max()  # another rounding, as far off
    rtol = 0.005
    assert float((honest - reference).abs().max()) > rtol * float(reference.abs().max())
    assert not compare([honest], [reference], rtol).correct  # the fixed tolerance alone
    verdict = compare([honest], [reference], rtol, exact=[exact])
    assert verdict.correct, verdict.reason
    assert verdict.tolerance == pytest.approx(NOISE_FACTOR * 0.3, rel=1e-5)
    wrong = exact + (NOISE_FACTOR * 0.3 + 0.05) * other / other.abs().max()
    verdict = compare([wrong], [reference], rtol, exact=[exact])
    assert not verdict.correct and "reference's own error 0.3" in verdict.reason
    # never stricter than the fixed tolerance: what passed it passes against exact too
    close = reference + 0.9 * rtol * float(reference.abs().max()) * other / other.abs().max()
    assert compare([close], [reference], rtol).correct
    assert compare([close], [reference], rtol, exact=[exact]).correct

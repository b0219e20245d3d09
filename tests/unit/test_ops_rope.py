"""``rope``: inverse frequencies vs transformers, alternatives vs the reference."""

from __future__ import annotations

import pytest
import torch

from kiln.ops import rope
from kiln.ops.registry import get, implementations
from kiln.workloads.config import parse_config
from kiln.workloads.models import rope_frequencies
from tests.unit.op_testing import DTYPES, assert_close, randn

ALTERNATIVES = [i for i in implementations("rope") if i != "reference"]

LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}


@pytest.mark.parametrize("scaling", [True, False])
def test_inv_freq_matches_transformers(scaling: bool) -> None:
    mr = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig

    raw = dict(LLAMA3) if scaling else {k: v for k, v in LLAMA3.items() if k != "rope_scaling"}
    ours = rope_frequencies.inv_freq(parse_config(raw))
    hf_config = LlamaConfig.from_dict(raw)
    if scaling:
        theirs, _ = mr._compute_llama3_parameters(hf_config)
    else:
        theirs = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    assert ours.dtype == torch.float32 and ours.shape == (32,)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_unsupported_rope_type_is_named() -> None:
    raw = dict(LLAMA3, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(rope_frequencies.UnsupportedRopeError, match="'yarn'"):
        rope_frequencies.inv_freq(parse_config(raw))


def test_reference_matches_transformers_apply_rotary() -> None:
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    freq = rope_frequencies.inv_freq(parse_config(LLAMA3))
    q, k = torch.randn(2, 4, 5, 64), torch.randn(2, 2, 5, 64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    emb = positions[..., None].float() * freq
    emb = torch.cat((emb, emb), dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb.cos(), emb.sin())
    got_q, got_k = rope.reference(q, k, positions, inv_freq=freq, max_positions=16)
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("group", [1, 4])
def test_alternative_matches_reference(
    impl: str, dtype: torch.dtype, batch: int, tokens: int, group: int
) -> None:
    torch.manual_seed(batch + 10 * tokens + 100 * group)
    head_dim, max_positions = 24, 50
    freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    params = {"inv_freq": freq, "max_positions": max_positions}
    q = randn(batch, 2 * group, tokens, head_dim, dtype=dtype)
    k = randn(batch, 2, tokens, head_dim, dtype=dtype)
    positions = torch.randint(0, max_positions - tokens, (batch, 1)) + torch.arange(tokens)
    expected = get("rope", "reference")(q, k, positions, **params)
    alt = get("rope", impl)
    actual = alt(q, k, positions, **(alt.derived.fn(params) if alt.derived else params))
    for a, e in zip(actual, expected, strict=True):
        assert_close(a, e)

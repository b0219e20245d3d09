"""``attention`` alternatives vs the reference, and the reference's mask semantics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.ops import attention
from kiln.ops.registry import get, implementations
from tests.unit.op_testing import DTYPES, assert_close, randn

# Alternatives that run on CPU and are exact (Triton kernels and lossy ones have their own tests).
ALTERNATIVES = [
    i
    for i in implementations("attention")
    if i != "reference" and get("attention", i).runs_on("cpu") and not get("attention", i).lossy
]
CACHE_LEN = 19
HEAD_DIM = 24
KV_HEADS = 2


def _case(batch: int, tokens: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k_cache, v_cache, positions (from a random start per sequence), seq_lens (random
    valid lengths: right padding within the step)."""
    q = randn(batch, KV_HEADS * group, tokens, HEAD_DIM, dtype=dtype)
    k = randn(batch, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)
    v = randn(batch, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)
    start = torch.randint(0, CACHE_LEN - tokens + 1, (batch,))
    positions = start[:, None] + torch.arange(tokens)
    seq_lens = start + torch.randint(1, tokens + 1, (batch,))
    return q, k, v, positions, seq_lens


@pytest.mark.parametrize("impl", ALTERNATIVES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("group", [1, 4])
def test_alternative_matches_reference(
    impl: str, dtype: torch.dtype, batch: int, tokens: int, group: int
) -> None:
    torch.manual_seed(batch * 100 + tokens * 10 + group)
    q, k, v, positions, seq_lens = _case(batch, tokens, group, dtype)
    scale = HEAD_DIM**-0.5
    expected = get("attention", "reference")(q, k, v, positions, seq_lens, scale=scale)
    actual = get("attention", impl)(q, k, v, positions, seq_lens, scale=scale)
    assert_close(actual, expected)


@pytest.mark.parametrize("group", [1, 4])
def test_reference_is_causal_attention_over_each_sequence(group: int) -> None:
    """Valid queries of a padded batch equal plain causal attention over that sequence alone."""
    torch.manual_seed(group)
    batch, tokens = 3, 7
    q, k, v, _, _ = _case(batch, tokens, group, torch.float32)
    positions = torch.arange(tokens).expand(batch, tokens)
    seq_lens = torch.tensor([7, 3, 1])
    out = attention.reference(q, k, v, positions, seq_lens, scale=HEAD_DIM**-0.5)
    for b, n in enumerate(seq_lens.tolist()):
        kb = k[b : b + 1, :, :n].repeat_interleave(group, dim=1)
        vb = v[b : b + 1, :, :n].repeat_interleave(group, dim=1)
        want = F.scaled_dot_product_attention(q[b : b + 1, :, :n], kb, vb, is_causal=True)
        torch.testing.assert_close(out[b : b + 1, :, :n], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [1, 3 * 4 * CACHE_LEN * 2, 3 * 4 * CACHE_LEN * 5])
def test_reference_in_query_chunks_equals_one_pass(
    monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    """Past its scores budget the reference attends in query chunks (1, 2 and 5 queries here) to
    the same values, padded queries included."""
    torch.manual_seed(budget)
    q, k, v, positions, seq_lens = _case(3, 7, 4, torch.float32)
    whole = attention.reference(q, k, v, positions, seq_lens, scale=HEAD_DIM**-0.5)
    monkeypatch.setattr(attention, "SCORES_BUDGET", budget)
    chunked = attention.reference(q, k, v, positions, seq_lens, scale=HEAD_DIM**-0.5)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)


def test_decode_sees_exactly_the_valid_slots() -> None:
    """T=1 at position p: slots 0..p count, later slots (stale data) do not."""
    torch.manual_seed(1)
    q, k, v, _, _ = _case(2, 1, 2, torch.float32)
    positions = torch.tensor([[4], [10]])
    seq_lens = positions[:, 0] + 1
    out = attention.reference(q, k, v, positions, seq_lens, scale=1.0)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 5:], v2[0, :, 5:] = 1e4, -1e4
    k2[1, :, 11:], v2[1, :, 11:] = 1e4, -1e4
    torch.testing.assert_close(attention.reference(q, k2, v2, positions, seq_lens, scale=1.0), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("window", [1, 3, CACHE_LEN])
def test_sdpa_honours_a_window(dtype: torch.dtype, tokens: int, window: int) -> None:
    """sdpa's boolean mask carries gpt-oss's window (it has no sinks: refused for gpt-oss by its
    signature); the whole-prompt causal path is skipped with a window."""
    torch.manual_seed(window * 10 + tokens)
    q, k, v, positions, seq_lens = _case(3, tokens, 2, dtype)
    scale = HEAD_DIM**-0.5
    expected = attention.reference(q, k, v, positions, seq_lens, scale=scale, window=window)
    assert_close(attention.sdpa(q, k, v, positions, seq_lens, scale=scale, window=window), expected)
    prompt = torch.arange(tokens).expand(3, tokens)
    full = torch.full((3,), tokens)
    expected = attention.reference(q, k, v, prompt, full, scale=scale, window=window)
    assert_close(attention.sdpa(q, k, v, prompt, full, scale=scale, window=window), expected)


def test_cache_mask_shape_and_values() -> None:
    mask = attention.cache_mask(torch.tensor([[0, 1, 2]]), torch.tensor([2]), 4)
    assert mask.shape == (1, 1, 3, 4) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    mask = attention.cache_mask(torch.tensor([[0, 1, 2]]), torch.tensor([3]), 4, window=2)
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 4])
def test_sdpa_whole_prompt_prefill_matches_the_reference(dtype: torch.dtype, group: int) -> None:
    """The maskless causal path (every row a whole prompt from position 0) computes what the
    masked reference does, with stale data in the cache slots beyond the prompt."""
    torch.manual_seed(group)
    batch, tokens = 3, 7
    q, k, v, _, _ = _case(batch, tokens, group, dtype)
    k[:, :, tokens:], v[:, :, tokens:] = 1e4, -1e4  # never read by a correct prompt step
    positions = torch.arange(tokens).expand(batch, tokens)
    seq_lens = torch.full((batch,), tokens)
    scale = HEAD_DIM**-0.5
    expected = attention.reference(q, k, v, positions, seq_lens, scale=scale)
    assert_close(attention.sdpa(q, k, v, positions, seq_lens, scale=scale), expected)
    assert attention._whole_prompt(positions, seq_lens, CACHE_LEN)
    assert not attention._whole_prompt(positions, torch.tensor([7, 3, 7]), CACHE_LEN)
    assert not attention._whole_prompt(positions + 1, seq_lens + 1, CACHE_LEN)

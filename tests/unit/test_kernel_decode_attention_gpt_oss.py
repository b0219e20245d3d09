"""The split-KV decode attention kernel with gpt-oss's sliding ``window`` and attention
``sinks``, two-stage and fused combine, against :func:`kiln.ops.attention.reference` with the
same arguments, through Triton's interpreter (``TRITON_INTERPRET=1`` set below before Triton is
imported; see tests/unit/kernel_testing.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kiln.ops.attention import reference
from kiln.ops.kernels.decode_attention import DecodeAttentionConfig, decode_attention
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

KV_HEADS, GROUP, HEAD_DIM = 2, 2, 16
CACHE_LEN = 101  # 4 splits of 32 (the last partial), blocks of 16
SEQ_LENS = [1, CACHE_LEN, 50]
TWO_STAGE = DecodeAttentionConfig(split_s=32, block_s=16, num_warps=2)
FUSED = DecodeAttentionConfig(split_s=32, block_s=16, num_warps=2, fused_combine=True)
CONFIGS = {"two_stage": TWO_STAGE, "fused": FUSED}
SCALE = HEAD_DIM**-0.5

# Windows against rows of 1, 101 and 50 slots: one slot; 5 (ends mid-block, mid-split: slot 96
# of the long row, 45 of the short); 40 (the long row starts at 61, the second block of its
# split: the first is skipped); 50 (equal to the short row's context); the cache; past it.
WINDOWS = [1, 5, 40, 50, CACHE_LEN, 200]
F32, BF16 = DTYPES


def _case(dtype: torch.dtype, seq_lens: list[int] = SEQ_LENS) -> tuple[torch.Tensor, ...]:
    """q ``[B, Hq, D]``, K/V as views of the first B rows of a larger buffer, seq_lens."""
    b = len(seq_lens)
    q = randn(b, KV_HEADS * GROUP, HEAD_DIM, dtype=dtype)
    k = randn(b + 1, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)[:b]
    v = randn(b + 1, KV_HEADS, CACHE_LEN, HEAD_DIM, dtype=dtype)[:b]
    return q, k, v, torch.tensor(seq_lens, dtype=torch.int64)


def _sinks(kind: str, dtype: torch.dtype) -> torch.Tensor:
    hq = KV_HEADS * GROUP
    values = {
        "normal": torch.randn(hq) * 2,
        "large": torch.tensor([8.0, 30.0, 3.0, 80.0])[:hq],  # the sink outweighs most scores
        "very_negative": torch.full((hq,), -1e4),  # adds nothing
        "mixed": torch.tensor([-1e4, 12.0, float("-inf"), 0.5])[:hq],
    }[kind]
    return values.to(dtype)


def _expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
    window: int | None,
) -> torch.Tensor:
    """The op reference at T == 1, the query at ``seq_lens - 1``."""
    positions = (seq_lens - 1)[:, None]
    out = reference(
        q[:, :, None], k, v, positions, seq_lens, scale=SCALE, sinks=sinks, window=window
    )
    return out[:, :, 0]


def _check(
    dtype: torch.dtype,
    config: DecodeAttentionConfig,
    sinks: torch.Tensor | None,
    window: int | None,
) -> None:
    q, k, v, seq_lens = _case(dtype)
    out = decode_attention(
        q, k, v, seq_lens, scale=SCALE, sinks=sinks, window=window, config=config
    )
    assert_finite(out)
    assert_close(out, _expected(q, k, v, seq_lens, sinks, window))


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("combine", list(CONFIGS))
@pytest.mark.parametrize(
    ("window", "dtype"), [(w, F32) for w in WINDOWS] + [(5, BF16), (40, BF16), (200, BF16)]
)
def test_window_matches_reference(window: int, combine: str, dtype: torch.dtype) -> None:
    torch.manual_seed(window)
    _check(dtype, CONFIGS[combine], None, window)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("combine", list(CONFIGS))
@pytest.mark.parametrize(
    ("kind", "dtype"),
    [(k, F32) for k in ("normal", "large", "very_negative", "mixed")]
    + [("large", BF16), ("mixed", BF16)],  # bfloat16 sinks with bfloat16 q/k/v
)
def test_sinks_match_reference(kind: str, combine: str, dtype: torch.dtype) -> None:
    torch.manual_seed(len(kind))
    _check(dtype, CONFIGS[combine], _sinks(kind, dtype), None)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("combine", list(CONFIGS))
@pytest.mark.parametrize(
    ("kind", "window", "dtype"),
    [("normal", 5, F32), ("large", 40, F32), ("normal", 5, BF16), ("mixed", 40, BF16)],
)
def test_window_and_sinks_match_reference(
    kind: str, window: int, combine: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(window)
    _check(dtype, CONFIGS[combine], _sinks(kind, dtype), window)


def test_the_semantics_move_the_output() -> None:
    """A window and sinks each change the result (the comparisons above are not vacuous), and a
    very negative sink or a window covering the context changes nothing."""
    torch.manual_seed(1)
    q, k, v, seq_lens = _case(torch.float32)
    plain = decode_attention(q, k, v, seq_lens, scale=SCALE, config=TWO_STAGE)
    for kwargs in ({"window": 5}, {"sinks": _sinks("normal", torch.float32)}):
        moved = decode_attention(q, k, v, seq_lens, scale=SCALE, config=TWO_STAGE, **kwargs)
        assert (moved - plain)[1:].abs().max() > 1e-2, kwargs  # row 0 has one slot: v either way
    for kwargs in ({"window": CACHE_LEN}, {"sinks": _sinks("very_negative", torch.float32)}):
        same = decode_attention(q, k, v, seq_lens, scale=SCALE, config=TWO_STAGE, **kwargs)
        assert_close(same, plain)


@pytest.mark.parametrize("combine", list(CONFIGS))
def test_slots_before_the_window_are_never_loaded(combine: str) -> None:
    """NaN in every slot before a row's window (whole skipped splits and the skipped part of the
    split the window starts in) stays out of the result."""
    torch.manual_seed(2)
    q, k, v, seq_lens = _case(torch.float32, [CACHE_LEN, 50, 7])
    window = 40  # the rows see slots 61.., 10.. and 0..
    want = _expected(q, k, v, seq_lens, None, window)
    k, v = k.clone(), v.clone()
    for row, lo in enumerate((CACHE_LEN - window, 50 - window)):
        k[row, :, :lo], v[row, :, :lo] = float("nan"), float("nan")
    out = decode_attention(q, k, v, seq_lens, scale=SCALE, window=window, config=CONFIGS[combine])
    assert_close(out, want)


def test_bad_window_or_sinks_raise() -> None:
    q, k, v, seq_lens = _case(torch.float32)
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k, v, seq_lens, scale=1.0, window=0)
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(q, k, v, seq_lens, scale=1.0, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(q, k, v, seq_lens, scale=1.0, sinks=torch.zeros(4, dtype=torch.int64))

"""Split-KV decode attention kernel vs its plain-PyTorch reference, through Triton's
interpreter (``TRITON_INTERPRET=1`` is set below before Triton is imported; see
tests/unit/kernel_testing.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kiln.ops.kernels.decode_attention import (
    DecodeAttentionConfig,
    decode_attention,
    decode_attention_reference,
)
from kiln.ops.kernels.runtime import KernelUnavailableError
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

KV_HEADS = 2
MAX_BATCH = 4
CACHE_LEN = 101  # not a multiple of split_s
SMALL = DecodeAttentionConfig(split_s=32, block_s=16, num_warps=2)


def _case(
    batch: int, group: int, head_dim: int, dtype: torch.dtype, seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, and K/V as views of the first ``batch`` rows of a ``[MAX_BATCH, ...]`` buffer."""
    q = randn(batch, KV_HEADS * group, head_dim, dtype=dtype)
    k = randn(MAX_BATCH, KV_HEADS, CACHE_LEN, head_dim, dtype=dtype)[:batch]
    v = randn(MAX_BATCH, KV_HEADS, CACHE_LEN, head_dim, dtype=dtype)[:batch]
    return q, k, v, torch.tensor(seq_lens, dtype=torch.int64)


SEQ_LENS = {1: [CACHE_LEN], 2: [1, 57], 3: [1, CACHE_LEN, 33]}


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_reference(batch: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    torch.manual_seed(batch * 1000 + group * 10 + head_dim)
    q, k, v, seq_lens = _case(batch, group, head_dim, dtype, SEQ_LENS[batch])
    out = decode_attention(q, k, v, seq_lens, scale=head_dim**-0.5, config=SMALL)
    assert_finite(out)
    assert_close(out, decode_attention_reference(q, k, v, seq_lens, scale=head_dim**-0.5))


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    [
        DecodeAttentionConfig(split_s=16, block_s=16, use_dot=True),
        DecodeAttentionConfig(split_s=64, block_s=32, use_dot=False),
        DecodeAttentionConfig(split_s=16, block_s=16, pdl=2),  # no PDL here: ordinary launch
        DecodeAttentionConfig(split_s=128, block_s=64, num_warps=8),  # one split
        DecodeAttentionConfig(split_s=16, block_s=16, fused_combine=True),
        DecodeAttentionConfig(split_s=32, block_s=16, use_dot=True, fused_combine=True),
        DecodeAttentionConfig(split_s=128, block_s=64, fused_combine=True),  # one split
    ],
)
def test_configs_and_both_score_paths(config: DecodeAttentionConfig, dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    q, k, v, seq_lens = _case(2, 4, 16, dtype, [1, 57])
    out = decode_attention(q, k, v, seq_lens, scale=0.25, config=config)
    assert_close(out, decode_attention_reference(q, k, v, seq_lens, scale=0.25))


def test_fused_combine_leaves_its_counters_at_zero_for_the_next_call() -> None:
    from kiln.ops.kernels.decode_attention import _counters

    torch.manual_seed(3)
    config = DecodeAttentionConfig(split_s=16, block_s=16, fused_combine=True)
    for lens in ([1, 57, CACHE_LEN], [CACHE_LEN, 2, 40]):  # the second call reuses the counters
        q, k, v, seq_lens = _case(3, 2, 16, torch.float32, lens)
        out = decode_attention(q, k, v, seq_lens, scale=0.25, config=config)
        assert_close(out, decode_attention_reference(q, k, v, seq_lens, scale=0.25))
        assert int(_counters(q.device, 3 * KV_HEADS).abs().sum()) == 0


def test_reference_is_softmax_over_valid_slots_only() -> None:
    """Cache contents past seq_len never matter (the kernel's and the reference's mask)."""
    torch.manual_seed(3)
    q, k, v, seq_lens = _case(2, 2, 16, torch.float32, [1, 33])
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 1:] = 1e4
    v2[1, :, 33:] = -1e4
    for fn in (decode_attention_reference, decode_attention):
        a = fn(q, k, v, seq_lens, scale=0.25)
        b = fn(q, k2, v2, seq_lens, scale=0.25)
        assert_close(b, a)
    # The kernel does not even load them: NaN garbage past seq_len stays out.
    v2[1, :, 33:] = float("nan")
    assert_close(decode_attention(q, k2, v2, seq_lens, scale=0.25, config=SMALL), a)
    # Length 1: the output is the first value row of the query's KV head.
    out = decode_attention(q, k, v, seq_lens, scale=0.25, config=SMALL)
    assert_close(out[0], v[0, torch.arange(4) // 2, 0])


def test_nan_output_never_passes() -> None:
    torch.manual_seed(4)
    q, k, v, seq_lens = _case(1, 2, 16, torch.float32, [40])
    out = decode_attention(q, k, v, seq_lens, scale=0.25, config=SMALL)
    out[0, 1, 3] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(out, decode_attention_reference(q, k, v, seq_lens, scale=0.25))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split_s": 48},
        {"block_s": 8},
        {"split_s": 32, "block_s": 64},
        {"num_warps": 3},
        {"pdl": 3},
    ],
)
def test_config_validation(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        DecodeAttentionConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs_raise() -> None:
    q, k, v, seq_lens = _case(2, 2, 16, torch.float32, [1, 5])
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q[:, :3], k, v, seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention(q, k, v, seq_lens[:1], scale=1.0)
    with pytest.raises(ValueError, match="dtypes"):
        decode_attention(q.double(), k, v, seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="q"):
        decode_attention(q[:, :, None], k, v, seq_lens, scale=1.0)


def test_without_interpreter_on_cpu_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v, seq_lens = _case(1, 2, 16, torch.float32, [5])
    with pytest.raises(KernelUnavailableError):
        decode_attention(q, k, v, seq_lens, scale=1.0)

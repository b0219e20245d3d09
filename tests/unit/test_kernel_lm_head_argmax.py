"""LM head GEMV + argmax kernels vs ``F.linear`` + ``argmax``, through Triton's interpreter
(``TRITON_INTERPRET=1`` set below before Triton is imported; see tests/unit/kernel_testing.py)."""

from __future__ import annotations

import os
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kiln.ops.kernels.lm_head_argmax import (
    lm_head_argmax,
    lm_head_argmax_reference,
)
from tests.unit.kernel_testing import assert_finite, poisoned_empty  # noqa: F401
from tests.unit.op_testing import DTYPES, assert_close, randn

VOCAB = 333  # not a multiple of block_n
HIDDEN = 70  # not a multiple of block_k
SMALL: dict[str, Any] = {"block_n": 32, "block_k": 32, "num_warps": 2}


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("use_dot", [None, True, False])
def test_matches_reference(dtype: torch.dtype, rows: int, use_dot: bool | None) -> None:
    torch.manual_seed(rows * 10 + (use_dot is None) + 2 * bool(use_dot))
    x = randn(rows, HIDDEN, dtype=dtype)
    w = randn(VOCAB, HIDDEN, dtype=dtype)
    logits, tokens = lm_head_argmax(x, w, use_dot=use_dot, **SMALL)
    want_logits, want_tokens = lm_head_argmax_reference(x, w)
    assert_finite(logits)
    assert logits.dtype == torch.float32 and tokens.dtype == torch.int64
    # Logits are rounded to the model dtype like F.linear's: compare at that dtype's tolerance.
    assert_close(logits.to(dtype), want_logits.to(dtype))
    # The kernel's argmax is exact over its own logits.
    assert torch.equal(tokens, torch.argmax(logits, dim=-1))
    if dtype == torch.float32:
        assert torch.equal(tokens, want_tokens)


@pytest.mark.usefixtures("poisoned_empty")
@pytest.mark.parametrize("winners", [(5, 200), (40, 41), (332, 3)])
def test_ties_pick_the_lowest_index(winners: tuple[int, int]) -> None:
    """Two identical dominant rows (in one program or in different ones): the lower index."""
    torch.manual_seed(sum(winners))
    x = torch.rand(2, HIDDEN) + 0.5
    w = torch.rand(VOCAB, HIDDEN) * 0.1
    w[winners[0]] = w[winners[1]] = 1.0
    _, tokens = lm_head_argmax(x, w, **SMALL)
    assert tokens.tolist() == [min(winners)] * 2


def test_all_equal_logits_give_token_zero() -> None:
    x = torch.ones(1, 16)
    _, tokens = lm_head_argmax(x, torch.ones(100, 16), block_n=16, block_k=16)
    assert tokens.tolist() == [0]


def test_nan_output_never_passes() -> None:
    x, w = randn(1, 32, dtype=torch.float32), randn(64, 32, dtype=torch.float32)
    logits, _ = lm_head_argmax(x, w, block_n=16, block_k=16)
    logits[0, 9] = float("nan")
    with pytest.raises(AssertionError):
        assert_close(logits, lm_head_argmax_reference(x, w)[0])


def test_bad_inputs_raise() -> None:
    w = randn(64, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="M <= 16"):
        lm_head_argmax(randn(17, 32, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="K=32"):
        lm_head_argmax(randn(1, 32, dtype=torch.float32), w[:, :31])
    with pytest.raises(ValueError, match="dtype"):
        lm_head_argmax(randn(1, 32, dtype=torch.float32), w.bfloat16())
    with pytest.raises(ValueError, match="block_n"):
        lm_head_argmax(randn(1, 32, dtype=torch.float32), w, block_n=48)

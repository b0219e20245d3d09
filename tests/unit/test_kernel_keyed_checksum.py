"""``kiln.ops.kernels.keyed_checksum`` (the state guard's one-pass checksum) against its
plain-PyTorch reference ``kiln.runtime.state_guard.keyed_checksum``: bit-equal for every element
width, short tails, non-contiguous views and an empty tensor; a one-bit change moves it.

Sets ``TRITON_INTERPRET=1`` before Triton's first import on hosts without CUDA.
"""

from __future__ import annotations

import os
import secrets

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

from kiln.ops.kernels import keyed_checksum as KC
from kiln.runtime import state_guard

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIDTH = state_guard.KEY_WORDS


def _words() -> torch.Tensor:
    return torch.randint(-(2**62), 2**62, (WIDTH,), dtype=torch.int64, device=DEVICE)


def _tensor(dtype: torch.dtype, n: int) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(n) * 50).to(dtype).to(DEVICE)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (n,), dtype=dtype).to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "n"),
    [
        (torch.bfloat16, 3 * WIDTH + 17),
        (torch.float16, WIDTH),
        (torch.float32, 2 * WIDTH - 1),
        (torch.uint8, 100),
        (torch.int64, 9 * WIDTH + 5),  # more rows than one program sums
        (torch.float32, 0),
    ],
)
def test_equals_the_reference_bit_for_bit(dtype: torch.dtype, n: int) -> None:
    t, words, key = _tensor(dtype, n), _words(), secrets.randbits(62)
    want = state_guard.keyed_checksum(t, words, key).item()
    assert KC.keyed_checksum(t, words, key).item() == want


def test_a_view_and_a_one_bit_change() -> None:
    words, key = _words(), secrets.randbits(62)
    base = _tensor(torch.bfloat16, 2 * WIDTH * 3).view(2 * WIDTH, 3)
    view = base.t()  # not contiguous: read as a copy, like the reference
    before = KC.keyed_checksum(view, words, key).item()
    assert before == state_guard.keyed_checksum(view, words, key).item()
    flipped = base.clone()
    flipped.view(torch.int16)[WIDTH + 1, 2] ^= 1
    assert KC.keyed_checksum(flipped.t(), words, key).item() != before
    assert KC.keyed_checksum(view, words, key ^ 1).item() != before  # the key matters


def test_refuses_words_it_cannot_read() -> None:
    t = _tensor(torch.float32, 10)
    with pytest.raises(ValueError, match="int64"):
        KC.keyed_checksum(t, _words().to(torch.int32), 1)
    with pytest.raises(ValueError, match="multiple"):
        KC.keyed_checksum(t, _words()[:1000], 1)

"""The state guard's keyed checksum in one pass over a tensor (Triton).

Equal, bit for bit, to :func:`kiln.runtime.state_guard.keyed_checksum` (its plain-PyTorch
reference): ``sum_r mix(key + r) * sum_j x[r, j] * words[j]`` mod 2**64, ``x`` the tensor's
elements read as same-width integers in rows of ``len(words)``. The reference widens every
chunk to int64 in memory and runs a dozen kernels per chunk; here each program reads its rows
once at their own width and writes one int64 partial, and wrapping int64 arithmetic makes the
order of the additions irrelevant. Imports Triton: import lazily; ``TRITON_INTERPRET=1`` before
Triton's first import to run on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

Tensor = torch.Tensor

ROWS_PER_PROGRAM = 8
"""Rows of ``len(words)`` words each program sums."""
BLOCK = 1024
"""Words per load inside a row."""
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _mix(z):
    """splitmix64's finaliser on int64 (wrapping; shifts made logical by masks)."""
    z = (z ^ ((z >> 30) & 17179869183)) * -4658895280553007687
    z = (z ^ ((z >> 27) & 137438953471)) * -7723592293110705685
    return z ^ ((z >> 31) & 8589934591)


@triton.jit
def _keyed_checksum_kernel(
    x_ptr, words_ptr, out_ptr, n, rows, key, WIDTH: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``p``: rows ``[p*ROWS, (p+1)*ROWS)`` (those below ``rows``; the last one may
    be short: words past ``n`` count as 0) -> ``out[p]``."""
    pid = tl.program_id(0)
    total = tl.zeros((1,), dtype=tl.int64)
    for i in range(ROWS):
        r = pid * ROWS + i
        if r < rows:
            acc = tl.zeros((BLOCK,), dtype=tl.int64)
            base = x_ptr + r.to(tl.int64) * WIDTH
            for j0 in range(0, WIDTH, BLOCK):
                offs = j0 + tl.arange(0, BLOCK)
                mask = r.to(tl.int64) * WIDTH + offs < n
                x = tl.load(base + offs, mask=mask, other=0).to(tl.int64)
                w = tl.load(words_ptr + offs)
                acc += x * w
            row = tl.sum(acc, axis=0)
            z = tl.zeros((1,), dtype=tl.int64) + r + key
            total += row * _mix(z)
    tl.store(out_ptr + pid + tl.arange(0, 1), total)


def keyed_checksum(t: Tensor, words: Tensor, key: int) -> Tensor:
    """The keyed checksum of ``t`` as an int64 scalar on its device (no host sync).

    Args:
        t: any tensor (read as its bit patterns; a copy only if not contiguous).
        words: ``[W]`` int64 random multipliers on ``t``'s device, ``W`` a multiple of
            :data:`BLOCK`.
        key: an int64 (``|key| < 2**62``).

    Raises:
        ValueError: ``words`` is not int64 or its length is not a multiple of :data:`BLOCK`.
    """
    if words.dtype != torch.int64 or words.dim() != 1 or words.numel() % BLOCK:
        raise ValueError(f"words must be 1-D int64 of a multiple of {BLOCK} elements")
    flat = t.detach().reshape(-1)
    w = flat.view(_WORD[flat.element_size()])
    width = words.numel()
    rows = triton.cdiv(w.numel(), width)
    if not rows:
        return torch.zeros((), dtype=torch.int64, device=w.device)
    programs = triton.cdiv(rows, ROWS_PER_PROGRAM)
    partial = torch.empty(programs, dtype=torch.int64, device=w.device)
    _keyed_checksum_kernel[(programs,)](
        w, words, partial, w.numel(), rows, key, WIDTH=width, ROWS=ROWS_PER_PROGRAM, BLOCK=BLOCK
    )
    return partial.sum()

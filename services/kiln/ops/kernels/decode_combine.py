"""Stage 2 of :mod:`kiln.ops.kernels.decode_attention`: the log-sum-exp combine of one
(sequence, query head)'s split partials, as its own kernel or called from stage 1's fused
combine.

Partials are float32 in log2 units: per split the running max ``m`` (``-inf``: an empty split,
weighing 0), the denominator ``l`` and the unnormalised ``acc`` ``[D]``. With ``HAS_SINKS`` the
head's sink (natural-log units, any float dtype) joins the denominator as one more logit with no
value: ``out = sum_c 2^(m_c - M) acc_c / (sum_c 2^(m_c - M) l_c + 2^(sink - M))``, ``M`` the max
over the splits' ``m`` and the sink (log2 units).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.ops.kernels.pdl import pdl_enter
from kiln.ops.kernels.rounding import cast


@triton.jit
def load_sink(sinks_ptr, head, HAS_SINKS: tl.constexpr):
    """Head ``head``'s sink in float32 log2 units (0.0, unused, without sinks)."""
    if HAS_SINKS:
        return tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    else:
        return 0.0


@triton.jit
def combine_row(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    base,
    out_offset,
    stride_od,
    sink,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    EMULATE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Combine one (sequence, query head)'s split partials by log-sum-exp and store the row;
    ``sink``: :func:`load_sink` (read only with ``HAS_SINKS``)."""
    offs_c = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, D_PAD)
    mask_d = offs_d < HEAD_DIM
    m_vec = tl.full([BLOCK_SPLITS], float("-inf"), tl.float32)
    for c in range(0, NUM_SPLITS, BLOCK_SPLITS):
        idx = c + offs_c
        m = tl.load(
            m_ptr + base + idx, mask=idx < NUM_SPLITS, other=float("-inf"), cache_modifier=".cg"
        )
        m_vec = tl.maximum(m_vec, m)
    m_max = tl.max(m_vec, axis=0)
    if HAS_SINKS:
        m_max = tl.maximum(m_max, sink)
    l_vec = tl.zeros([BLOCK_SPLITS], tl.float32)
    acc = tl.zeros([BLOCK_SPLITS, D_PAD], tl.float32)
    for c in range(0, NUM_SPLITS, BLOCK_SPLITS):
        idx = c + offs_c
        mask_c = idx < NUM_SPLITS
        m = tl.load(m_ptr + base + idx, mask=mask_c, other=float("-inf"), cache_modifier=".cg")
        ell = tl.load(l_ptr + base + idx, mask=mask_c, other=0.0, cache_modifier=".cg")
        a = tl.load(
            acc_ptr + (base + idx)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=mask_c[:, None] & mask_d[None, :],
            other=0.0,
            cache_modifier=".cg",
        )
        # Empty splits (m = -inf) weigh 0; so does everything when the row is empty.
        w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
        l_vec += w * ell
        acc += w[:, None] * a
    total = tl.sum(l_vec, axis=0)
    if HAS_SINKS:  # one more logit in the denominator (a -inf sink adds nothing)
        total += tl.where(sink > float("-inf"), tl.exp2(sink - m_max), 0.0)
    out = tl.sum(acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + out_offset + offs_d * stride_od,
        cast(out, out_ptr.dtype.element_ty, EMULATE),
        mask=mask_d,
    )


@triton.jit
def stage2(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    sinks_ptr,
    stride_ob,
    stride_oh,
    stride_od,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    EMULATE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (sequence, query head) row of ``[B * Hq]``."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    b = row // num_heads
    h = row % num_heads
    combine_row(
        m_ptr,
        l_ptr,
        acc_ptr,
        out_ptr,
        row.to(tl.int64) * NUM_SPLITS,
        b * stride_ob + h * stride_oh,
        stride_od,
        load_sink(sinks_ptr, h, HAS_SINKS),
        NUM_SPLITS,
        HEAD_DIM,
        D_PAD,
        BLOCK_SPLITS,
        EMULATE,
        HAS_SINKS,
    )

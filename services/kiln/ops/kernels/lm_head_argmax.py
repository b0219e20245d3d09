"""LM head GEMV fused with greedy argmax, in two Triton kernels: per block of vocabulary rows the
logits (rounded to the model dtype, stored as float32) and a partial ``(max, argmax)``, then a
reduction to the token; the weight is read once. On CPU import only after setting
``TRITON_INTERPRET``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.rounding import cast, emulate_rounding
from kiln.ops.kernels.tiles import NUM_WARPS

Tensor = torch.Tensor

#: Largest M (rows of x) the kernels take; tl.dot pads M to this.
MAX_ROWS = 16


def check_gemv_args(
    x: Tensor, weight: Tensor, *, block_n: int, block_k: int, num_warps: int
) -> None:
    """Shared argument checks of the small-M GEMV kernels; ValueError unless x is ``[M <= 16,
    K]``, weight ``[N, K]`` with a contiguous last dim on x's device, blocks powers of two >= 16.
    """
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"x must be [M, K] with 1 <= M <= {MAX_ROWS}, got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K={x.shape[1]}], got {tuple(weight.shape)}")
    if weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if weight.device != x.device:
        raise ValueError(f"x on {x.device}, weight on {weight.device}")
    for name, block in (("block_n", block_n), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {block}")
    if num_warps not in NUM_WARPS:
        raise ValueError(f"num_warps must be one of {NUM_WARPS}, got {num_warps}")


@triton.jit
def _gemv_argmax(
    x_ptr,
    w_ptr,
    logits_ptr,
    pmax_ptr,
    pidx_ptr,
    M,
    V,
    stride_xm,
    stride_wv,
    stride_lm,
    K: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    EMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < V
    mask_m = offs_m < M
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        mask_k = ks < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n.to(tl.int64)[:, None] * stride_wv + ks[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0.0,
        )
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    # F.linear's output is in the model dtype: round there, then widen (the reference logits).
    logits = cast(acc, x_ptr.dtype.element_ty, EMULATE).to(tl.float32)
    tl.store(
        logits_ptr + offs_m[:, None] * stride_lm + offs_n[None, :],
        logits,
        mask=mask_m[:, None] & mask_n[None, :],
    )
    vals = tl.where(mask_n[None, :], logits, float("-inf"))
    best, where = tl.max(vals, axis=1, return_indices=True, return_indices_tie_break_left=True)
    parts = offs_m * NUM_PARTS + pid
    tl.store(pmax_ptr + parts, best, mask=mask_m)
    tl.store(pidx_ptr + parts, pid * BLOCK_N + where, mask=mask_m)


@triton.jit
def _reduce_argmax(pmax_ptr, pidx_ptr, tokens_ptr, NUM_PARTS: tl.constexpr, BLOCK_P: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    best_v = tl.full([BLOCK_P], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK_P], tl.int32)
    for c in range(0, NUM_PARTS, BLOCK_P):
        p = c + offs
        mask = p < NUM_PARTS
        v = tl.load(pmax_ptr + row * NUM_PARTS + p, mask=mask, other=float("-inf"))
        i = tl.load(pidx_ptr + row * NUM_PARTS + p, mask=mask, other=0)
        # Later chunks hold higher indices: only a strictly larger value replaces a lane's best.
        take = v > best_v
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, i, best_i)
    top = tl.max(best_v, axis=0)
    big = 2147483647
    token = tl.min(tl.where(best_v == top, best_i, big), axis=0)
    tl.store(tokens_ptr + row, token.to(tl.int64))


def lm_head_argmax(
    x: Tensor,
    weight: Tensor,
    *,
    block_n: int = 64,
    block_k: int = 128,
    num_warps: int = 4,
    use_dot: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Logits and greedy tokens of the LM head in one pass over the weight.

    Args:
        x: ``[M, K]`` final-normed hidden states (model dtype), ``1 <= M <= 16``.
        weight: ``[V, K]`` in x's dtype, contiguous last dim.
        block_n, block_k: powers of two >= 16.
        use_dot: ``tl.dot`` (M padded to 16) or multiply-sum; None: sum for M <= 2.

    Returns ``(logits [M, V] float32, tokens [M] int64)``: ``F.linear(x, weight)`` rounded to x's
    dtype, and its argmax (lowest index on ties; NaN not special). Raises ValueError on bad
    shapes, dtypes, devices or blocks; KernelUnavailableError without CUDA or
    ``TRITON_INTERPRET=1``.
    """
    check_gemv_args(x, weight, block_n=block_n, block_k=block_k, num_warps=num_warps)
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x's {x.dtype}")
    runtime.require(x.device)
    m, k = x.shape
    v = weight.shape[0]
    dot = use_dot if use_dot is not None else m > 2
    m_pad = MAX_ROWS if dot else triton.next_power_of_2(m)
    parts = triton.cdiv(v, block_n)
    logits = torch.empty((m, v), dtype=torch.float32, device=x.device)
    pmax = torch.empty((m, parts), dtype=torch.float32, device=x.device)
    pidx = torch.empty((m, parts), dtype=torch.int32, device=x.device)
    _gemv_argmax[(parts,)](
        x,
        weight,
        logits,
        pmax,
        pidx,
        m,
        v,
        x.stride(0),
        weight.stride(0),
        logits.stride(0),
        K=k,
        NUM_PARTS=parts,
        M_PAD=m_pad,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_DOT=dot,
        UPCAST=runtime.interpreting(),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        EMULATE=emulate_rounding(x.dtype),
        num_warps=num_warps,
    )
    tokens = torch.empty((m,), dtype=torch.int64, device=x.device)
    _reduce_argmax[(m,)](
        pmax, pidx, tokens, NUM_PARTS=parts, BLOCK_P=min(triton.next_power_of_2(parts), 1024)
    )
    return logits, tokens


def lm_head_argmax_reference(x: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Plain PyTorch: ``F.linear(x, weight).float()`` and its argmax: ``(logits [M, V], tokens
    [M])``.
    """
    logits = F.linear(x, weight).float()
    return logits, torch.argmax(logits, dim=-1)

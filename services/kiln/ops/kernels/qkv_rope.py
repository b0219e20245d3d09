"""RMS norm + fused QKV projection + RoPE + KV-cache write for one decode step, in one kernel.

Program ``(h, j)`` owns head ``h`` and ``block_n`` rotation pairs, so RoPE needs no exchange
between programs; q is returned rotated, k rotated and v copied into the cache at device-side
positions. Rounding follows kiln's reference ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.ops import rms_norm as rms_norm_op
from kiln.ops.kernels import runtime
from kiln.ops.kernels.gemv import (
    alloc_output,
    check_interpreter,
    check_vector,
    check_weight,
    check_x,
)
from kiln.ops.kernels.gemv_config import DEFAULT_SMS, TILE_BUDGET, GemvConfig
from kiln.ops.kernels.gemv_tiles import _gemv_tiles, _round
from kiln.ops.kernels.pdl import launch_mode, pdl_options
from kiln.ops.kernels.qk_norm_rope import check_rope_write, qk_norm_rope_reference

Tensor = torch.Tensor


def default_qkv_rope_config(
    num_heads: int, num_kv_heads: int, head_dim: int, k: int, *, sms: int = DEFAULT_SMS
) -> GemvConfig:
    """Launch of :func:`rms_norm_qkv_rope`: ``block_n`` the largest power of two <= min(16, D/2)
    giving >= ``2 * sms`` programs, ``block_k`` filling :data:`TILE_BUDGET`. ValueError on a
    non-positive size or odd ``head_dim``.
    """
    if min(num_heads, num_kv_heads, head_dim, k) < 1 or head_dim % 2:
        raise ValueError(
            f"need positive sizes and an even head_dim, got Hq={num_heads}, Hkv={num_kv_heads}, "
            f"D={head_dim}, K={k}"
        )
    heads, half = num_heads + 2 * num_kv_heads, head_dim // 2
    block_n = min(16, triton.next_power_of_2(half))
    while block_n > 1 and heads * triton.cdiv(half, block_n) < 2 * sms:
        block_n //= 2
    # Twice the GEMV tile budget: measured best on an H200 (block_k 2048 for Llama-3.2-1B, 100 µs
    # for 16 layers against 106 at 1024; benchmarks/fused_decode_profile.py --sweep).
    block_k = max(16, min(triton.next_power_of_2(k), 2 * TILE_BUDGET // (2 * block_n)))
    return GemvConfig(block_n=block_n, block_k=block_k)


@triton.jit
def _qkv_rope_kernel(
    x_ptr,
    stride_xm,
    w_ptr,
    stride_wn,
    nw_ptr,
    eps,
    cos_ptr,
    sin_ptr,
    stride_cs,
    pos_ptr,
    q_ptr,
    stride_qb,
    kc_ptr,
    vc_ptr,
    stride_cb,
    stride_ch,
    stride_cp,
    K: tl.constexpr,
    M: tl.constexpr,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_NORM: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(h, j)``: pairs ``j*BLOCK_N ..`` of head ``h`` for all M sequences."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    HALF: tl.constexpr = D // 2
    h = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    i_mask = offs_i < HALF
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rows = h * D + offs_i
    acc_1, acc_2 = _gemv_tiles(
        x_ptr, stride_xm, w_ptr, stride_wn, rows, rows + HALF, i_mask, 0, K, K, nw_ptr, eps,
        M, BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, HAS_NORM, True, EMULATE_RNE, PDL,
    )  # fmt: skip
    x1 = _round(acc_1, DTYPE, EMULATE_RNE)
    x2 = _round(acc_2, DTYPE, EMULATE_RNE)
    mask = m_mask[:, None] & i_mask[None, :]
    is_q = h < HQ
    is_k = (h >= HQ) & (h < HQ + HKV)
    is_v = h >= HQ + HKV
    pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    cs_off = pos[:, None] * stride_cs + offs_i[None, :]
    rope_mask = mask & (h < HQ + HKV)
    c = tl.load(cos_ptr + cs_off, mask=rope_mask, other=1.0)
    s = tl.load(sin_ptr + cs_off, mask=rope_mask, other=0.0)
    o1 = tl.where(is_v, x1, _round(x1 * c - x2 * s, DTYPE, EMULATE_RNE))
    o2 = tl.where(is_v, x2, _round(x2 * c + x1 * s, DTYPE, EMULATE_RNE))
    o1 = o1.to(DTYPE)
    o2 = o2.to(DTYPE)
    q_off = offs_m[:, None] * stride_qb + h * D + offs_i[None, :]
    tl.store(q_ptr + q_off, o1, mask=mask & is_q)
    tl.store(q_ptr + q_off + HALF, o2, mask=mask & is_q)
    kv_head = tl.where(is_k, h - HQ, tl.where(is_v, h - HQ - HKV, 0)).to(tl.int64)
    c_off = (
        offs_m[:, None].to(tl.int64) * stride_cb
        + kv_head * stride_ch
        + pos[:, None] * stride_cp
        + offs_i[None, :]
    )
    tl.store(kc_ptr + c_off, o1, mask=mask & is_k)
    tl.store(kc_ptr + c_off + HALF, o2, mask=mask & is_k)
    tl.store(vc_ptr + c_off, o1, mask=mask & is_v)
    tl.store(vc_ptr + c_off + HALF, o2, mask=mask & is_v)


def _check_inputs(
    x: Tensor,
    norm_weight: Tensor | None,
    qkv_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> Tensor:
    x = check_x(x)
    check_weight(qkv_weight, x, "qkv_weight")
    check_rope_write(x, cos, sin, positions, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv_weight.shape[0] != rows:
        raise ValueError(f"qkv_weight has {qkv_weight.shape[0]} rows; (Hq + 2*Hkv) * D = {rows}")
    if norm_weight is not None:
        check_vector(norm_weight, x.shape[1], x, "norm_weight")
    return x


def rms_norm_qkv_rope(
    x: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    qkv_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    config: GemvConfig | None = None,
    qkv_bias: Tensor | None = None,
) -> Tensor:
    """One decode step's attention prologue: ``rms_norm``, fused QKV GEMV, RoPE of q and k, k and
    v written into the cache.

    Args:
        x: ``[B, K]``, ``1 <= B <= MAX_M``, model dtype.
        norm_weight: ``[K]``, or None for no norm.
        qkv_weight: ``[(Hq + 2*Hkv) * D, K]`` contiguous (``fuse_qkv``).
        cos, sin: ``[P, D/2]`` float32.
        positions: ``[B]`` int64, each ``< P`` and ``< S`` (not checked).
        k_cache, v_cache: ``[max_batch, Hkv, S, D]`` contiguous; written at
            ``[b, h, positions[b], :]``.
        config: ``split_k`` must be 1; qkv_bias must be None.

    Returns a new rotated q ``[B, Hq, D]``. Raises ValueError on mismatches, ``B > MAX_M``,
    ``split_k > 1`` or a bias; KernelUnavailableError when Triton cannot run.
    """
    if qkv_bias is not None:
        raise ValueError("rms_norm_qkv_rope does not support a QKV bias")
    x = _check_inputs(
        x,
        norm_weight,
        qkv_weight,
        cos,
        sin,
        positions,
        k_cache,
        v_cache,
        num_heads,
        num_kv_heads,
        head_dim,
    )
    cfg = config or default_qkv_rope_config(num_heads, num_kv_heads, head_dim, x.shape[1])
    if cfg.split_k != 1:
        raise ValueError("rms_norm_qkv_rope needs split_k == 1 (RoPE needs whole dot products)")
    runtime.require(x.device)
    b, k = x.shape
    block_m = triton.next_power_of_2(b)
    block_r = max(16, min(triton.next_power_of_2(k), 4096 // block_m))
    q = alloc_output((b, num_heads, head_dim), x.dtype, x.device)
    pdl = launch_mode(cfg.pdl, x.device)
    grid = (num_heads + 2 * num_kv_heads, triton.cdiv(head_dim // 2, cfg.block_n))
    _qkv_rope_kernel[grid](
        x,
        x.stride(0),
        qkv_weight,
        qkv_weight.stride(0),
        x if norm_weight is None else norm_weight,
        float(eps),
        cos,
        sin,
        cos.stride(0),
        positions,
        q,
        q.stride(0),
        k_cache,
        v_cache,
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        K=k,
        M=b,
        HQ=num_heads,
        HKV=num_kv_heads,
        D=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        BLOCK_R=block_r,
        HAS_NORM=norm_weight is not None,
        EMULATE_RNE=check_interpreter(),
        PDL=pdl,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_options(pdl),
    )
    return q


def rms_norm_qkv_rope_reference(
    x: Tensor,
    norm_weight: Tensor | None,
    eps: float,
    qkv_weight: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    config: GemvConfig | None = None,
    qkv_bias: Tensor | None = None,
) -> Tensor:
    """Plain PyTorch :func:`rms_norm_qkv_rope`, same cache writes (``config`` ignored)."""
    del config
    h = x if norm_weight is None else rms_norm_op.reference(x, weight=norm_weight, eps=eps)[0]
    qkv = F.linear(h, qkv_weight, qkv_bias)
    return qk_norm_rope_reference(
        qkv, None, None, 0.0, cos, sin, positions, k_cache, v_cache,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
    )  # fmt: skip

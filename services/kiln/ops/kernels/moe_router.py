"""Fused MoE router: logits, softmax, top-k and combine weights of each token in two launches
(the logits spread over many programs, a block of experts each; then softmax and top-k, one
program per token).

Same routing as :func:`kiln.ops.moe.route`: the router product accumulated in float32 and rounded
once to the model dtype (as ``F.linear``), ``router_bias`` added in float32, softmax in float32,
the ``top_k`` largest probabilities (ties to the lower expert id) in decreasing order, divided by
their sum when ``norm_topk_prob``, rounded to the model dtype when ``round_weights``. Probabilities
may differ from torch's in the last bits, so a near-tied choice may differ (the MoE gate treats
those as undetermined). CUDA-graph capturable. Imports Triton: import lazily, and set
``TRITON_INTERPRET=1`` first on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.gemv_tiles import _round
from kiln.ops.kernels.pdl import launch_mode, pdl_enter, pdl_options

Tensor = torch.Tensor

MAX_EXPERTS = 1024
"""Most experts a router program holds (one row of logits in registers)."""


@triton.jit
def _logits_kernel(
    x_ptr,
    stride_xm,
    w_ptr,
    stride_we,
    logits_ptr,
    E: tl.constexpr,
    HID: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(n, j)``: token ``n``'s logits of the ``j``-th block of experts, accumulated in
    float32, rounded to the model dtype, stored as float32 ``[N, E]``. The first chunk of router
    weights is loaded before the PDL wait (no kernel writes them)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    n = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    rows = w_ptr + offs_e[:, None].to(tl.int64) * stride_we
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < HID
    w = tl.load(rows + offs_h[None, :], mask=e_mask[:, None] & h_mask[None, :], other=0.0)
    pdl_enter(PDL)
    xv = tl.load(x_ptr + n * stride_xm + offs_h, mask=h_mask, other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    for h0 in range(BLOCK_H, HID, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < HID
        xv = tl.load(x_ptr + n * stride_xm + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        w = tl.load(rows + offs_h[None, :], mask=e_mask[:, None] & h_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    tl.store(logits_ptr + n * E + offs_e, _round(acc, DTYPE, EMULATE_RNE), mask=e_mask)


@triton.jit
def _router_kernel(
    x_ptr,
    logits_ptr,
    bias_ptr,
    wts_ptr,
    ids_ptr,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_WEIGHTS: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``n``: token ``n``'s ``TOP_K`` weights (float32) and expert ids (int64) from its
    logits (``x_ptr``: only its dtype, the model's, is read)."""
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    n = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < E
    if HAS_BIAS:  # a parameter: loaded before the PDL wait
        bias = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0)
    pdl_enter(PDL)
    logits = tl.load(logits_ptr + n * E + offs_e, mask=e_mask, other=0.0)
    if HAS_BIAS:
        logits += bias
    logits = tl.where(e_mask, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    p = tl.where(e_mask, p, 0.0)
    p = p / tl.sum(p, axis=0)
    p = tl.where(e_mask, p, -1.0)  # padding is never chosen
    offs_k = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for r in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs_e, BLOCK_E), axis=0)
        chosen_w = tl.where(offs_k == r, best, chosen_w)
        chosen_id = tl.where(offs_k == r, idx.to(tl.int64), chosen_id)
        p = tl.where(offs_e == idx, -2.0, p)
    if NORM:
        chosen_w = chosen_w / tl.sum(tl.where(offs_k < TOP_K, chosen_w, 0.0), axis=0)
    if ROUND_WEIGHTS:
        chosen_w = _round(chosen_w, DTYPE, EMULATE_RNE)
    k_mask = offs_k < TOP_K
    tl.store(wts_ptr + n * TOP_K + offs_k, chosen_w, mask=k_mask)
    tl.store(ids_ptr + n * TOP_K + offs_k, chosen_id, mask=k_mask)


def moe_router(
    x: Tensor,
    router_weight: Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    round_weights: bool = False,
    router_bias: Tensor | None = None,
    experts_per_program: int | None = None,
    pdl: int = 2,
) -> tuple[Tensor, Tensor]:
    """Route ``x [N, H]`` (float32/float16/bfloat16) with ``router_weight [E, H]`` (x's dtype and
    device, unit stride along H), ``router_bias`` float32 ``[E]`` or None; the logits of
    ``experts_per_program`` experts (a power of two) a program (None: about 32 programs a token
    on a GPU, one under the interpreter); ``pdl`` the programmatic dependent launch of both
    kernels (:mod:`kiln.ops.kernels.pdl`: 0 off, 1 or 2; off where the device has none).

    Returns ``(weights [N, top_k] float32, experts [N, top_k] int64)``, largest first; weights
    hold model-dtype values when ``round_weights``. Raises ValueError on shapes, dtypes or
    devices that do not match or ``E`` over :data:`MAX_EXPERTS`, KernelUnavailableError when
    Triton cannot run on ``x.device``.
    """
    if x.dim() != 2 or router_weight.dim() != 2 or x.shape[1] != router_weight.shape[1]:
        raise ValueError(
            f"x must be [N, H] and router_weight [E, H], got {tuple(x.shape)} and "
            f"{tuple(router_weight.shape)}"
        )
    n, h = x.shape
    e = router_weight.shape[0]
    if not 1 <= top_k <= e or e > MAX_EXPERTS:
        raise ValueError(f"top_k must be in 1..{e} and experts at most {MAX_EXPERTS}")
    if router_weight.dtype != x.dtype or router_weight.device != x.device:
        raise ValueError(f"router_weight must be {x.dtype} on {x.device}")
    if router_bias is not None and (
        tuple(router_bias.shape) != (e,) or router_bias.dtype != torch.float32
    ):
        raise ValueError(f"router_bias must be float32 [{e}]")
    runtime.require(x.device)
    mode = launch_mode(pdl, x.device)  # ValueError outside 0..2
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = router_weight if router_weight.stride(1) == 1 else router_weight.contiguous()
    weights = torch.empty((n, top_k), dtype=torch.float32, device=x.device)
    experts = torch.empty((n, top_k), dtype=torch.int64, device=x.device)
    if n == 0:
        return weights, experts
    block_e = triton.next_power_of_2(e)
    bias = router_bias.to(x.device) if router_bias is not None else weights
    emulate = runtime.interpreting() and x.dtype == torch.bfloat16
    # ~32 programs a token on a GPU (the router's weights come from L2 after the first token);
    # under the interpreter, which costs per program, one a token.
    split = experts_per_program or (block_e if runtime.interpreting() else max(1, block_e // 32))
    if split & (split - 1):
        raise ValueError(f"experts_per_program must be a power of two, got {split}")
    logits = torch.empty((n, e), dtype=torch.float32, device=x.device)
    _logits_kernel[(n, triton.cdiv(e, split))](
        x,
        x.stride(0),
        weight,
        weight.stride(0),
        logits,
        E=e,
        HID=h,
        BLOCK_E=split,
        BLOCK_H=max(16, min(triton.next_power_of_2(h), 8192 // split)),
        EMULATE_RNE=emulate,
        PDL=mode,
        num_warps=4,
        **pdl_options(mode),
    )
    _router_kernel[(n,)](
        x,
        logits,
        bias,
        weights,
        experts,
        E=e,
        TOP_K=top_k,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        HAS_BIAS=router_bias is not None,
        NORM=norm_topk_prob,
        ROUND_WEIGHTS=round_weights and x.dtype != torch.float32,
        EMULATE_RNE=emulate,
        PDL=mode,
        num_warps=4,
        **pdl_options(mode),
    )
    return weights, experts

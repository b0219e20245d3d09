"""Small-batch MoE decode: SwiGLU over only the routed experts' weights, read straight from the
stacked ``[E, ...]`` weights (no gather, no sort), in two launches: gate/up per (assignment,
column block), then down with the weighted combine over slots in increasing order (float32, no
atomics: deterministic).

Rounding mirrors kiln's ``moe`` except the per-token sum, accumulated in float32 and rounded
once. CUDA-graph capturable (no host reads). Imports Triton: import lazily, and set
``TRITON_INTERPRET=1`` first on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.kernels import runtime
from kiln.ops.kernels.gemv_tiles import _round
from kiln.ops.kernels.pdl import PDL_MODES, launch_mode, pdl_enter, pdl_options

Tensor = torch.Tensor

#: Elements of the down kernel's weight tile (every slot's rows) a program holds at 4 warps.
DOWN_TILE = 8192
#: Float dtypes the kernels take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoeDecodeConfig:
    """Launch configuration: ``block_i``/``block_h`` (gate/up columns and reduction chunk),
    ``block_o``/``block_r`` (down columns and chunk), ``num_warps``; tiles are clamped to the
    shapes. ``pdl``: programmatic dependent launch of both kernels (:mod:`kiln.ops.kernels.pdl`;
    0 off, 1 or 2; where the device has none, off). ValueError unless each tile and
    ``num_warps`` is a positive power of two and ``pdl`` is 0, 1 or 2.
    """

    block_i: int = 8
    block_h: int = 512
    block_o: int = 16
    block_r: int = 256
    num_warps: int = 4
    pdl: int = 2

    def __post_init__(self) -> None:
        for name in ("block_i", "block_h", "block_o", "block_r", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1 or v & (v - 1):
                raise ValueError(f"MoeDecodeConfig.{name} must be a power of two, got {v!r}")
        if self.pdl not in range(PDL_MODES) or isinstance(self.pdl, bool):
            raise ValueError(f"MoeDecodeConfig.pdl must be 0, 1 or 2, got {self.pdl!r}")


def default_config(tokens: int, hidden: int) -> MoeDecodeConfig:
    """The launch for ``tokens`` x ``hidden``: down tiles thin enough for about 512 programs
    (an H200 has 132 SMs), the reduction chunk then set by :data:`DOWN_TILE`."""
    if runtime.interpreting():
        return MoeDecodeConfig(block_i=64, block_h=512, block_o=64, block_r=256)
    block_o = 16
    while block_o > 1 and tokens * triton.cdiv(hidden, block_o) < 512:
        block_o //= 2
    return MoeDecodeConfig(block_o=block_o, block_r=1024)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    stride_xm,
    ids_ptr,
    w_ptr,
    stride_we,
    stride_wr,
    h_ptr,
    INTER: tl.constexpr,
    HID: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(s, j)``: ``h[s, j-th block] = silu(x[n] @ gate_e.T) * (x[n] @ up_e.T)``, ``s =
    n * TOP_K + r``, ``e = ids[s]``.
    """
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pdl_enter(PDL)  # every load depends on the routing: nothing to issue before the wait
    s = tl.program_id(0)
    n = s // TOP_K
    e = tl.load(ids_ptr + s).to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < INTER
    gate = w_ptr + e * stride_we + offs_i[:, None].to(tl.int64) * stride_wr
    up = gate + INTER * stride_wr
    x_row = x_ptr + n.to(tl.int64) * stride_xm
    acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for h0 in range(0, HID, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        h_mask = offs_h < HID
        xv = tl.load(x_row + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        mask = i_mask[:, None] & h_mask[None, :]
        wg = tl.load(gate + offs_h[None, :], mask=mask, other=0.0)
        wu = tl.load(up + offs_h[None, :], mask=mask, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], axis=1)
    g = _round(acc_g, DTYPE, EMULATE_RNE)
    u = _round(acc_u, DTYPE, EMULATE_RNE)
    act = _round(g / (1.0 + tl.exp(-g)), DTYPE, EMULATE_RNE)
    y = _round(act * u, DTYPE, EMULATE_RNE)
    tl.store(h_ptr + s.to(tl.int64) * INTER + offs_i, y.to(DTYPE), mask=i_mask)


@triton.jit
def _down_kernel(
    h_ptr,
    ids_ptr,
    wts_ptr,
    w_ptr,
    stride_we,
    stride_wr,
    out_ptr,
    stride_om,
    res_ptr,
    stride_rm,
    INTER: tl.constexpr,
    HID: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_RES: tl.constexpr,
    EMULATE_RNE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program ``(n, j)``: ``out[n, j-th block] = sum_r wts[n, r] * (h[n*TOP_K + r] @
    down_e.T)``, every slot's rows loaded together, summed in increasing r, float32, rounded once;
    with ``HAS_RES`` the residual row is added to that rounded sum and the total rounded again.
    """
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < HID
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < TOP_K
    slots = n * TOP_K + offs_k
    e = tl.load(ids_ptr + slots, mask=k_mask, other=0).to(tl.int64)
    weight = tl.load(wts_ptr + slots, mask=k_mask, other=0.0)
    rows = w_ptr + e[:, None, None] * stride_we + offs_o[None, :, None].to(tl.int64) * stride_wr
    w_mask = k_mask[:, None, None] & o_mask[None, :, None]
    acc = tl.zeros((BLOCK_K, BLOCK_O), dtype=tl.float32)
    for i0 in range(0, INTER, BLOCK_R):
        offs_r = i0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < INTER
        hv = tl.load(
            h_ptr + slots[:, None] * INTER + offs_r[None, :],
            mask=k_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        wd = tl.load(rows + offs_r[None, None, :], mask=w_mask & r_mask[None, None, :], other=0.0)
        acc += tl.sum(wd.to(tl.float32) * hv[:, None, :], axis=2)
    y = _round(_round(acc, DTYPE, EMULATE_RNE) * weight[:, None], DTYPE, EMULATE_RNE)
    total = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for r in tl.static_range(TOP_K):  # in increasing r, as the reference (adding 0.0 is exact)
        total += tl.sum(tl.where(offs_k[:, None] == r, y, 0.0), axis=0)
    out = _round(total, DTYPE, EMULATE_RNE)
    if HAS_RES:
        res = tl.load(res_ptr + n * stride_rm + offs_o, mask=o_mask, other=0.0).to(tl.float32)
        out = _round(out + res, DTYPE, EMULATE_RNE)
    tl.store(out_ptr + n * stride_om + offs_o, out.to(DTYPE), mask=o_mask)


# ------------------------------------------------------------------------------- host side


def check_interpreter() -> bool:
    """Whether the kernels run under ``TRITON_INTERPRET=1``; KernelUnavailableError if it is set
    but Triton was imported before.
    """
    if not runtime.interpreting():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(_down_kernel, InterpretedFunction):
        raise runtime.KernelUnavailableError(
            "TRITON_INTERPRET=1 was set after Triton (or kiln.ops.kernels.moe_decode) was "
            "imported; set it before the first import of triton in the process"
        )
    return True


def _check(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor
) -> None:
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"x must be a non-empty [N, H], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x dtype {x.dtype} not supported (supported: {DTYPES})")
    n, h = x.shape
    if gate_up_weight.dim() != 3 or down_weight.dim() != 3:
        raise ValueError("gate_up_weight must be [E, 2I, H] and down_weight [E, H, I]")
    e, two_i, _ = gate_up_weight.shape
    inter = two_i // 2
    if two_i % 2 or tuple(gate_up_weight.shape) != (e, 2 * inter, h) or inter < 1:
        raise ValueError(f"gate_up_weight must be [E, 2I, {h}], got {tuple(gate_up_weight.shape)}")
    if tuple(down_weight.shape) != (e, h, inter):
        raise ValueError(f"down_weight must be [{e}, {h}, {inter}], got {tuple(down_weight.shape)}")
    for name, w in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"{name} must be {x.dtype} on {x.device}, got {w.dtype} on {w.device}")
        if w.stride(2) != 1:
            raise ValueError(f"{name} must have unit stride along its last dim")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != n or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [{n}, k], got {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64) or topk_ids.device != x.device:
        raise ValueError(f"topk_ids must be int32/int64 on {x.device}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights must be {tuple(topk_ids.shape)}")
    if topk_weights.dtype != torch.float32 or topk_weights.device != x.device:
        raise ValueError(f"topk_weights must be float32 on {x.device}")


def moe_decode(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    *,
    residual: Tensor | None = None,
    config: MoeDecodeConfig | None = None,
) -> Tensor:
    """``out[n] = sum_r topk_weights[n, r] * down_e(silu(gate_e(x[n])) * up_e(x[n]))``, ``e =
    topk_ids[n, r]``, reading only the routed experts' weights; plus ``residual [N, H]`` (x's
    dtype and device) when given, rounded as ``residual + out`` in PyTorch.

    Args:
        x: ``[N, H]`` float32/float16/bfloat16.
        topk_ids: ``[N, k]`` int32/int64 in ``0..E-1`` (not checked).
        topk_weights: ``[N, k]`` float32.
        gate_up_weight: ``[E, 2I, H]`` in x's dtype, gate rows first; down_weight ``[E, H, I]``;
            both unit stride along the last dim.

    Returns a new ``[N, H]`` tensor in x's dtype. Raises ValueError on shape, dtype, stride or
    device mismatches, KernelUnavailableError when Triton cannot run on ``x.device``.
    """
    _check(x, topk_ids, topk_weights, gate_up_weight, down_weight)
    if residual is not None and (
        tuple(residual.shape) != tuple(x.shape)
        or residual.dtype != x.dtype
        or residual.device != x.device
        or residual.stride(1) != 1
    ):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype} on {x.device}, unit stride")
    runtime.require(x.device)
    interp = check_interpreter()
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, wts = topk_ids.contiguous(), topk_weights.contiguous()
    n, h = x.shape
    k = ids.shape[1]
    inter = down_weight.shape[2]
    cfg = config or default_config(n, h)
    pdl = launch_mode(cfg.pdl, x.device)
    emulate = interp and x.dtype == torch.bfloat16
    hidden = torch.empty((n * k, inter), dtype=x.dtype, device=x.device)
    block_i = min(cfg.block_i, triton.next_power_of_2(inter))
    _gate_up_kernel[(n * k, triton.cdiv(inter, block_i))](
        x,
        x.stride(0),
        ids,
        gate_up_weight,
        gate_up_weight.stride(0),
        gate_up_weight.stride(1),
        hidden,
        INTER=inter,
        HID=h,
        TOP_K=k,
        BLOCK_I=block_i,
        BLOCK_H=min(cfg.block_h, triton.next_power_of_2(h)),
        EMULATE_RNE=emulate,
        PDL=pdl,
        num_warps=cfg.num_warps,
        **pdl_options(pdl),
    )
    out = torch.empty((n, h), dtype=x.dtype, device=x.device)
    block_o = min(cfg.block_o, triton.next_power_of_2(h))
    block_k = triton.next_power_of_2(k)
    block_r = min(cfg.block_r, triton.next_power_of_2(inter))
    if not interp:  # every slot's tile in registers: at most DOWN_TILE elements
        block_r = max(16, min(block_r, DOWN_TILE // (block_k * block_o)))
    _down_kernel[(n, triton.cdiv(h, block_o))](
        hidden,
        ids,
        wts,
        down_weight,
        down_weight.stride(0),
        down_weight.stride(1),
        out,
        out.stride(0),
        out if residual is None else residual,
        0 if residual is None else residual.stride(0),
        INTER=inter,
        HID=h,
        TOP_K=k,
        BLOCK_K=block_k,
        BLOCK_O=block_o,
        BLOCK_R=block_r,
        HAS_RES=residual is not None,
        EMULATE_RNE=emulate,
        PDL=pdl,
        num_warps=cfg.num_warps,
        **pdl_options(pdl),
    )
    return out


def moe_decode_reference(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor
) -> Tensor:
    """Plain PyTorch :func:`moe_decode` with the same roundings (for tests)."""
    inter = down_weight.shape[2]
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for r in range(topk_ids.shape[1]):
        e = topk_ids[:, r]
        gu = torch.bmm(gate_up_weight[e], x.unsqueeze(-1)).squeeze(-1)
        gate, up = gu[:, :inter], gu[:, inter:]
        hidden = torch.nn.functional.silu(gate) * up
        y = torch.bmm(down_weight[e], hidden.unsqueeze(-1)).squeeze(-1)
        total += (y.float() * topk_weights[:, r, None]).to(x.dtype).float()
    return total.to(x.dtype)

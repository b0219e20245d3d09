"""Triton GEMV implementations of the projection ops for small-batch decode (CUDA only).

At decode (``T == 1``, at most :data:`MAX_M` sequences) they run the GEMV kernels; other steps
take the plain-PyTorch path. Kernel modules are imported on first call.
"""

from __future__ import annotations

import torch

from kiln.ops import lm_head as lm_head_op
from kiln.ops import mlp as mlp_op
from kiln.ops import o_proj as o_proj_op
from kiln.ops import qkv_proj as qkv_proj_op
from kiln.ops.registry import register

Tensor = torch.Tensor

#: Largest decode batch the GEMV path takes (``kiln.ops.kernels.gemv.MAX_M``; kept here so
#: importing this module does not import Triton).
MAX_M = 16
IMPL = "triton_gemv"


def _decode_rows(x: Tensor) -> bool:
    return x.shape[1] == 1 and 1 <= x.shape[0] <= MAX_M


@register("qkv_proj", IMPL, derived=qkv_proj_op.FUSED_QKV, devices=("cuda",))
def qkv_proj_gemv(
    x: Tensor,
    *,
    qkv_weight: Tensor,
    qkv_bias: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``qkv_proj`` on the fused ``[(Hq+2Hkv)*D, H]`` weight: ``x [B, T, H]`` -> views ``q [B,
    Hq, T, D]``, ``k``, ``v [B, Hkv, T, D]``.
    """
    if not _decode_rows(x):
        return qkv_proj_op.fused(
            x,
            qkv_weight=qkv_weight,
            qkv_bias=qkv_bias,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
    from kiln.ops.kernels.gemv import gemv

    b = x.shape[0]
    qkv = gemv(x.reshape(b, x.shape[-1]), qkv_weight, bias=qkv_bias).view(b, 1, -1)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = qkv.split(sizes, dim=-1)
    return (
        q.unflatten(-1, (num_heads, head_dim)).transpose(1, 2),
        k.unflatten(-1, (num_kv_heads, head_dim)).transpose(1, 2),
        v.unflatten(-1, (num_kv_heads, head_dim)).transpose(1, 2),
    )


@register("o_proj", IMPL, devices=("cuda",))
def o_proj_gemv(attn: Tensor, *, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``o_proj``: ``merge_heads(attn [B, Hq, T, D]) @ weight.T + bias`` -> ``[B, T, H]``."""
    b, _, t, _ = attn.shape
    if t != 1 or not 1 <= b <= MAX_M:
        return o_proj_op.reference(attn, weight=weight, bias=bias)
    from kiln.ops.kernels.gemv import gemv

    return gemv(attn.reshape(b, -1), weight, bias=bias).view(b, 1, -1)


@register("mlp", "triton_gate_up", derived=mlp_op.FUSED_GATE_UP, devices=("cuda",))
def mlp_gate_up_gemv(x: Tensor, *, gate_up_weight: Tensor, down_weight: Tensor) -> Tensor:
    """``mlp`` at decode: gate/up GEMV with the SiLU·mul epilogue, then down; the contract of
    ``mlp reference``.
    """
    if not _decode_rows(x):
        return mlp_op.fused_gate_up(x, gate_up_weight=gate_up_weight, down_weight=down_weight)
    from kiln.ops.kernels.gemv import gemv
    from kiln.ops.kernels.norm_gemv import gate_up_silu

    b = x.shape[0]
    h = gate_up_silu(x.reshape(b, x.shape[-1]), gate_up_weight)
    return gemv(h, down_weight).view(b, 1, -1)


@register("lm_head", IMPL, devices=("cuda",))
def lm_head_gemv(x: Tensor, *, weight: Tensor) -> Tensor:
    """``lm_head``: ``F.linear(x [..., H], weight)`` in the model dtype -> ``[..., V]`` float32."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 1 <= rows <= MAX_M:
        return lm_head_op.reference(x, weight=weight)
    from kiln.ops.kernels.gemv import gemv

    out = gemv(x.reshape(rows, x.shape[-1]), weight, out_dtype=torch.float32)
    return out.view(*x.shape[:-1], weight.shape[0])


__all__ = ["MAX_M", "lm_head_gemv", "mlp_gate_up_gemv", "o_proj_gemv", "qkv_proj_gemv"]

"""Lossy fp8 (e4m3, one float32 scale per output row) weights for ``qkv_proj``, ``o_proj`` and
``mlp``: implementation "fp8_gemv" of each (CUDA only, ``lossy=True``).

Each site's weights are quantised once by a :class:`~kiln.ops.registry.Derivation`
("fp8_rowwise_qkv" on the fused QKV layout, "fp8_rowwise_o_proj", "fp8_rowwise_mlp" on the fused
gate/up layout plus down) with :func:`kiln.ops.kernels.fp8_gemv.quantize_fp8_rowwise`. At decode
(``T == 1`` and at most 16 rows) the matmuls run the fp8 GEMV kernel, which reads half the bytes
of bf16 weights. Otherwise (prefill, or a batch above 16) they dequantise the weight to the model
dtype on every call and use ``F.linear``: the same quantised values, rounded once more to the
model dtype, at the cost of a temporary full-size weight (prefill is compute-bound; this path is
for correctness, not speed). Error vs the unquantised reference: a few percent relative (see
:mod:`kiln.ops.kernels.fp8_gemv`). Kernel modules are imported on first call (see
:mod:`kiln.ops.attention_triton` for why).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.qkv_proj import fuse_qkv
from kiln.ops.registry import Derivation, register

Tensor = torch.Tensor

#: Rows (batch x tokens) the fp8 GEMV kernel takes (``kiln.ops.kernels.lm_head_argmax.MAX_ROWS``).
GEMV_MAX_ROWS = 16


def _quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    from kiln.ops.kernels.fp8_gemv import quantize_fp8_rowwise

    return quantize_fp8_rowwise(weight)


def fp8_linear(x: Tensor, w_fp8: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ dequant(w_fp8, scale).T + bias`` for ``x [B, T, K]``: the fp8 GEMV kernel when
    ``T == 1`` and ``B <= 16``, else dequantise to x's dtype and ``F.linear``.

    Returns:
        ``[B, T, N]`` in x's dtype.
    """
    from kiln.ops.kernels.fp8_gemv import dequantize_fp8_rowwise, fp8_gemv

    *lead, k = x.shape
    rows = x.reshape(-1, k)
    if x.dim() >= 2 and x.shape[-2] == 1 and rows.shape[0] <= GEMV_MAX_ROWS:
        y = fp8_gemv(rows.contiguous(), w_fp8, scale, bias=bias)
    else:
        y = F.linear(rows, dequantize_fp8_rowwise(w_fp8, scale, x.dtype), bias)
    return y.view(*lead, w_fp8.shape[0])


def _heads(x: Tensor, heads: int, head_dim: int) -> Tensor:
    return x.unflatten(-1, (heads, head_dim)).transpose(1, 2)


def quantize_qkv(params: Mapping[str, Any]) -> dict[str, Any]:
    """``qkv_proj`` base params -> fused QKV weight in fp8: ``qkv_fp8 [(Hq+2Hkv)*D, H]``,
    ``qkv_scale [(Hq+2Hkv)*D]`` float32, ``qkv_bias`` (or None) and the head counts."""
    fused = fuse_qkv(params)
    w8, scale = _quantize(fused.pop("qkv_weight"))
    return {**fused, "qkv_fp8": w8, "qkv_scale": scale}


def quantize_o_proj(params: Mapping[str, Any]) -> dict[str, Any]:
    """``o_proj`` base params -> ``weight_fp8 [H, Hq*D]``, ``scale [H]``, ``bias``."""
    w8, scale = _quantize(params["weight"])
    return {"weight_fp8": w8, "scale": scale, "bias": params["bias"]}


def quantize_mlp(params: Mapping[str, Any]) -> dict[str, Any]:
    """``mlp`` base params -> ``gate_up_fp8 [2I, H]`` (gate rows then up rows),
    ``gate_up_scale [2I]``, ``down_fp8 [H, I]``, ``down_scale [H]``."""
    gate_up, gu_scale = _quantize(torch.cat([params["gate_weight"], params["up_weight"]]))
    down, down_scale = _quantize(params["down_weight"])
    return {
        "gate_up_fp8": gate_up,
        "gate_up_scale": gu_scale,
        "down_fp8": down,
        "down_scale": down_scale,
    }


FP8_QKV = Derivation("fp8_rowwise_qkv", quantize_qkv)
FP8_O_PROJ = Derivation("fp8_rowwise_o_proj", quantize_o_proj)
FP8_MLP = Derivation("fp8_rowwise_mlp", quantize_mlp)


@register("qkv_proj", "fp8_gemv", lossy=True, derived=FP8_QKV, devices=("cuda",))
def qkv_fp8(
    x: Tensor,
    *,
    qkv_fp8: Tensor,
    qkv_scale: Tensor,
    qkv_bias: Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """One fp8 matmul on the fused QKV weight, then the head split. Contract of
    :func:`kiln.ops.qkv_proj.reference`: ``x [B, T, H]`` -> ``q [B, Hq, T, D]``,
    ``k``/``v [B, Hkv, T, D]`` in x's dtype."""
    qkv = fp8_linear(x, qkv_fp8, qkv_scale, qkv_bias)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    return (
        _heads(q, num_heads, head_dim),
        _heads(k, num_kv_heads, head_dim),
        _heads(v, num_kv_heads, head_dim),
    )


@register("o_proj", "fp8_gemv", lossy=True, derived=FP8_O_PROJ, devices=("cuda",))
def o_proj_fp8(attn: Tensor, *, weight_fp8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """Merge heads, then an fp8 matmul. Contract of :func:`kiln.ops.o_proj.reference`:
    ``attn [B, Hq, T, D]`` -> ``[B, T, H]`` in attn's dtype."""
    return fp8_linear(attn.transpose(1, 2).flatten(2), weight_fp8, scale, bias)


@register("mlp", "fp8_gemv", lossy=True, derived=FP8_MLP, devices=("cuda",))
def mlp_fp8(
    x: Tensor,
    *,
    gate_up_fp8: Tensor,
    gate_up_scale: Tensor,
    down_fp8: Tensor,
    down_scale: Tensor,
) -> Tensor:
    """fp8 gate/up matmul, SiLU·mul, fp8 down matmul. Contract of
    :func:`kiln.ops.mlp.reference`: ``x [B, T, H]`` -> ``[B, T, H]`` in x's dtype."""
    gate, up = fp8_linear(x, gate_up_fp8, gate_up_scale).chunk(2, dim=-1)
    return fp8_linear(F.silu(gate) * up, down_fp8, down_scale)

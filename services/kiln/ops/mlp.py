"""``mlp``: the gated feed-forward block ``down(silu(gate(x)) * up(x))`` (Shazeer 2020, SwiGLU;
transformers' ``LlamaMLP``).

Call: ``mlp(x) -> y``. Base params (HF ``mlp.{gate,up,down}_proj``): ``gate_weight [I, H]``,
``up_weight [I, H]``, ``down_weight [H, I]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.registry import Derivation, register

Tensor = torch.Tensor


@register("mlp", "reference")
def reference(x: Tensor, *, gate_weight: Tensor, up_weight: Tensor, down_weight: Tensor) -> Tensor:
    """Three matmuls with SiLU-and-multiply in between.

    Args:
        x: ``[B, T, H]`` (model dtype).

    Returns:
        ``[B, T, H]`` in ``x.dtype``.
    """
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


def fuse_gate_up(params: Mapping[str, Any]) -> dict[str, Any]:
    """The fused layout: ``gate_up_weight = cat([gate_weight, up_weight])`` ``[2I, H]``."""
    return {
        "gate_up_weight": torch.cat([params["gate_weight"], params["up_weight"]]),
        "down_weight": params["down_weight"],
    }


FUSED_GATE_UP = Derivation("fused_gate_up", fuse_gate_up)


@register("mlp", "fused_gate_up", derived=FUSED_GATE_UP)
def fused_gate_up(x: Tensor, *, gate_up_weight: Tensor, down_weight: Tensor) -> Tensor:
    """One matmul on the derived ``[2I, H]`` weight (:func:`fuse_gate_up`), SiLU·mul of its
    halves, then ``down``. Same contract as :func:`reference`."""
    gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down_weight)

"""``moe`` "triton_gather": small-batch decode over only the routed experts (CUDA only; design:
docs/design/kernels.md, "MoE decode kernel").

Routing runs fused in :func:`kiln.ops.kernels.moe_router.moe_router` (the routing of
:func:`kiln.ops.moe.route`, one launch; under ``torch.compile``, ``route`` itself; combine weights
rounded to the model dtype when ``round_router_weights``); experts run in
:func:`kiln.ops.kernels.moe_decode.moe_decode`, deterministic (slots added in order, no atomics),
the per-token sum float32 rounded once. Same contract as :func:`kiln.ops.moe.reference`.

Above :data:`MAX_ASSIGNMENTS` (token, expert) assignments it runs the ``reference``; the choice
depends on shapes only. Off CUDA the kernel runs only under ``TRITON_INTERPRET=1`` (CPU tensors);
elsewhere the call runs the reference (registered for CUDA only). Under ``torch.compile`` the
kernels are called through the custom ops ``kiln::moe_route`` and ``kiln::moe_gather``. The
kernel modules are imported on first call (importing :mod:`kiln.ops` must not import Triton).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kiln.ops.moe import reference, route
from kiln.ops.registry import register

Tensor = torch.Tensor

MAX_ASSIGNMENTS = 64
"""Largest ``N * top_k`` (tokens times experts per token) the kernel path takes; above it the
call runs ``reference``. Decode at batch 1-8 with top-k 8 (Qwen3-MoE) or batch <= 32 with top-k
2 (Mixtral) stays on the kernel. Not measured yet."""


def _kernel_runs(device: torch.device) -> bool:
    """Whether the kernels can run on ``device``: CUDA, or CPU under Triton's interpreter."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@register("moe", "triton_gather", devices=("cuda",))
def triton_gather(
    x: Tensor,
    *,
    router_weight: Tensor,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    top_k: int,
    norm_topk_prob: bool,
    round_router_weights: bool,
    router_bias: Tensor | None = None,
    scoring: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> Tensor:
    """The fused router (softmax scoring; a sigmoid router runs :func:`kiln.ops.moe.route`),
    then the gather-GEMV kernels; ``reference`` above :data:`MAX_ASSIGNMENTS` assignments or
    where the kernels cannot run.

    Args:
        x: ``[B, T, H]`` (model dtype); params as in :mod:`kiln.ops.moe`.

    Returns:
        ``[B, T, H]`` in ``x.dtype``.

    Raises:
        kiln.ops.kernels.runtime.KernelUnavailableError: Triton is not installed (CUDA).
    """
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    if not 1 <= n * top_k <= MAX_ASSIGNMENTS or not _kernel_runs(x.device):
        return reference(
            x,
            router_weight=router_weight,
            gate_up_weight=gate_up_weight,
            down_weight=down_weight,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
            round_router_weights=round_router_weights,
            router_bias=router_bias,
            scoring=scoring,
            n_group=n_group,
            topk_group=topk_group,
            correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )
    if scoring != "softmax":
        weights, experts = route(
            flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob,
            router_bias=router_bias, scoring=scoring, n_group=n_group, topk_group=topk_group,
            correction_bias=correction_bias, routed_scaling_factor=routed_scaling_factor,
        )  # fmt: skip
        if round_router_weights:
            weights = weights.to(x.dtype)
        if torch.compiler.is_compiling():
            out = moe_gather_op(flat, experts, weights, gate_up_weight, down_weight)
        else:
            out = _experts(flat, experts, weights, gate_up_weight, down_weight)
        return out.view(x.shape)
    if torch.compiler.is_compiling():
        weights, experts = moe_route_op(
            flat, router_weight, top_k, norm_topk_prob, round_router_weights, router_bias
        )
        out = moe_gather_op(flat, experts, weights, gate_up_weight, down_weight)
    else:
        weights, experts = _route(
            flat, router_weight, top_k, norm_topk_prob, round_router_weights, router_bias
        )
        out = _experts(flat, experts, weights, gate_up_weight, down_weight)
    return out.view(x.shape)


def with_residual(bound: Any, x: Tensor, residual: Tensor) -> Tensor | None:
    """``residual + bound(x)`` with the add done by the down kernel, when ``bound`` is this
    implementation bound to a site (a ``functools.partial`` of :func:`triton_gather`) with softmax
    routing and the call takes the kernel path; None otherwise (the caller adds). ``x [B, H]``,
    ``residual [B, H]`` in x's dtype; the result is bit-equal to the unfused add.
    """
    if not isinstance(bound, functools.partial) or bound.func is not triton_gather or bound.args:
        return None
    kw = bound.keywords
    top_k = kw["top_k"]
    if kw.get("scoring", "softmax") != "softmax" or torch.compiler.is_compiling():
        return None
    if x.dim() != 2 or not 1 <= x.shape[0] * top_k <= MAX_ASSIGNMENTS or not _kernel_runs(x.device):
        return None
    from kiln.ops.kernels.moe_decode import moe_decode

    weights, experts = _route(
        x, kw["router_weight"], top_k, kw["norm_topk_prob"], kw["round_router_weights"],
        kw.get("router_bias"),
    )  # fmt: skip
    return moe_decode(
        x, experts, weights, kw["gate_up_weight"], kw["down_weight"], residual=residual
    )


def _route(
    x: Tensor,
    router_weight: Tensor,
    top_k: int,
    norm_topk_prob: bool,
    round_weights: bool,
    router_bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    from kiln.ops.kernels.moe_router import moe_router

    return moe_router(
        x, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob,
        round_weights=round_weights, router_bias=router_bias,
    )  # fmt: skip


def _experts(
    x: Tensor, experts: Tensor, weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor
) -> Tensor:
    from kiln.ops.kernels.moe_decode import moe_decode

    return moe_decode(x, experts, weights, gate_up_weight, down_weight)


@torch.library.custom_op("kiln::moe_route", mutates_args=())
def moe_route_op(
    x: Tensor,
    router_weight: Tensor,
    top_k: int,
    norm_topk_prob: bool,
    round_weights: bool,
    router_bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`kiln.ops.kernels.moe_router.moe_router` as an op ``torch.compile`` does not trace
    into: ``(weights [N, top_k] float32, experts [N, top_k] int64)``."""
    return _route(x, router_weight, top_k, norm_topk_prob, round_weights, router_bias)


@moe_route_op.register_fake
def _moe_route_fake(
    x: Tensor,
    router_weight: Tensor,
    top_k: int,
    norm_topk_prob: bool,
    round_weights: bool,
    router_bias: Tensor | None,
) -> tuple[Tensor, Tensor]:
    n = x.shape[0]
    return (
        x.new_empty((n, top_k), dtype=torch.float32),
        x.new_empty((n, top_k), dtype=torch.int64),
    )


@torch.library.custom_op("kiln::moe_gather", mutates_args=())
def moe_gather_op(
    x: Tensor, experts: Tensor, weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor
) -> Tensor:
    """:func:`kiln.ops.kernels.moe_decode.moe_decode` as an op ``torch.compile`` does not trace
    into: ``x [N, H]``, ``experts [N, k]`` int64, ``weights [N, k]`` float32, stacked expert
    weights; returns a new ``[N, H]`` tensor in x's dtype."""
    return _experts(x, experts, weights, gate_up_weight, down_weight)


@moe_gather_op.register_fake
def _moe_gather_fake(
    x: Tensor, experts: Tensor, weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor
) -> Tensor:
    return x.new_empty(x.shape)

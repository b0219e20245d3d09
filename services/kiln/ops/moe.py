"""``moe``: the mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral, DeepSeek-V3's routed
experts), in an expert layer's ``ffn`` slot (design: docs/design/kernels.md, "MoE").

Semantics of transformers' (>= 5) sparse MoE blocks in eval mode: :func:`route`; each chosen
expert computes ``down_e(silu(gate_e(x)) * up_e(x))`` in the model dtype, scaled by its weight
(rounded to the model dtype first when ``round_router_weights``, Qwen3-MoE; else in float32,
Mixtral); the scaled outputs are summed per token in the model dtype.

Call: ``moe(x[B, T, H]) -> [B, T, H]`` in ``x.dtype``. Params: ``router_weight [E, H]``,
``gate_up_weight [E, 2I, H]`` (gate rows first), ``down_weight [E, H, I]``, ``top_k``,
``norm_topk_prob``, ``round_router_weights``, ``router_bias`` (float32 ``[E]`` or None: kiln's
expert-load skew, :mod:`kiln.workloads.models.routing`); the router's ``scoring`` (``"softmax"``,
or ``"sigmoid"`` with ``n_group``, ``topk_group``, ``correction_bias`` float32 ``[E]`` or None
and ``routed_scaling_factor``: :mod:`kiln.ops.moe_routing`). DeepSeek-V3's shared expert is not
part of this op (the layer's ``shared_ffn`` slot, an ``mlp``).

Implementations keep shapes static and never synchronise with the host: ``reference`` (grouped
by expert, summed in increasing expert id as transformers' loop), ``gathered`` (small batches),
``dense`` (every expert on every token). gpt-oss's experts (biases, clamped SwiGLU): the
``reference``'s ``swiglu`` param (:mod:`kiln.ops.moe_clamped`), which no other implementation
takes (binding refuses them for gpt-oss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.moe_clamped import ClampedSwiGLU
from kiln.ops.moe_routing import sigmoid_logits, sigmoid_route
from kiln.ops.precision import widened
from kiln.ops.registry import REFERENCE, register

Tensor = torch.Tensor


def route(
    x: Tensor,
    router_weight: Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    router_bias: Tensor | None = None,
    scoring: str = "softmax",
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Top-k routing of ``x [N, H]``. ``softmax``: in float32 ``softmax(x @ router_weight.T +
    router_bias)`` (the product in the model dtype), top ``top_k`` (``1..E``), renormalised to
    sum 1 if ``norm_topk_prob``, in ``torch.topk`` order. ``sigmoid``:
    :func:`kiln.ops.moe_routing.sigmoid_route` of the float32 product (plus ``router_bias``).

    Returns ``(weights [N, top_k] float32, experts [N, top_k] int64)`` (float64 weights for
    float64 inputs).

    Raises:
        ValueError: an unknown ``scoring``.
    """
    if scoring == "sigmoid":
        return sigmoid_route(
            sigmoid_logits(x, router_weight, router_bias), top_k=top_k, n_group=n_group,
            topk_group=topk_group, norm_topk_prob=norm_topk_prob,
            correction_bias=correction_bias, routed_scaling_factor=routed_scaling_factor,
        )  # fmt: skip
    if scoring != "softmax":
        raise ValueError(f"unknown router scoring {scoring!r} (softmax, sigmoid)")
    logits = widened(F.linear(x, router_weight))
    if router_bias is not None:
        logits = logits + router_bias
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@dataclass(frozen=True)
class Assignments:
    """The ``S = N * top_k`` (token, expert) assignments sorted (stably) by expert: ``token``,
    ``experts``, ``weights`` ``[S]``; ``offsets [E]`` int32 cumulative ends per expert
    (``grouped_mm``'s ``offs``); ``dest [S]`` int64 row ``token * top_k + r`` (``r`` the rank
    among its token's experts by id).
    """

    token: Tensor
    experts: Tensor
    weights: Tensor
    offsets: Tensor
    dest: Tensor


def sort_by_expert(weights: Tensor, experts: Tensor, num_experts: int) -> Assignments:
    """Sort :func:`route`'s ``[N, top_k]`` choices by expert, on the device (no host sync)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    rank = torch.empty_like(experts)  # [N, k]: each choice's rank by expert id within its token
    slots = torch.arange(k, device=experts.device).expand(n, k)
    rank.scatter_(1, torch.argsort(experts, dim=1), slots)
    token = order // k
    return Assignments(
        token=token,
        experts=flat[order],
        weights=weights.reshape(-1)[order],
        offsets=torch.cumsum(counts, dim=0, dtype=torch.int32),
        dest=token * k + rank.reshape(-1)[order],
    )


_ALIGN_BYTES = 16


def grouped_mm_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`grouped_linear` runs ``grouped_mm`` for ``x [S, K]``, ``weight [E, N, K]``
    (bfloat16, 16-byte aligned rows, CUDA >= 9.0); shapes and device only. CPU builds that have
    it run it far slower than the gathered products (0.48 s for 128 rows over 64 experts of
    64 x 64, torch 2.13), so CPU engines gather.
    """
    size = x.element_size()
    if x.dtype != torch.bfloat16 or getattr(F, "grouped_mm", None) is None:
        return False
    if (x.shape[-1] * size) % _ALIGN_BYTES or (weight.shape[1] * size) % _ALIGN_BYTES:
        return False
    if x.device.type == "cuda":  # properties, not get_device_capability: dynamo folds them
        return torch.cuda.get_device_properties(x.device).major >= 9
    return False


GATHER_BYTES = 256 << 20
"""Scratch :func:`gathered_linear` gathers weights into at once, bytes (larger gathers run in chunks
of rows).
"""


def gathered_linear(x: Tensor, weight: Tensor, experts: Tensor) -> Tensor:
    """``x [S, K]`` row ``s`` times ``weight[experts[s]].T`` -> ``[S, N]``, float32 accumulation,
    in chunks within :data:`GATHER_BYTES`.
    """
    s, (_, n, k) = x.shape[0], weight.shape
    rows = max(1, GATHER_BYTES // max(1, n * k * weight.element_size()))
    parts = [
        torch.bmm(x[i : i + rows].unsqueeze(1), weight[experts[i : i + rows]].transpose(1, 2))
        for i in range(0, s, rows)
    ]
    return torch.cat(parts).squeeze(1) if len(parts) > 1 else parts[0].squeeze(1)


def grouped_linear(x: Tensor, weight: Tensor, a: Assignments) -> Tensor:
    """Each expert's rows of ``x [S, K]`` (sorted by expert) times ``weight[e].T`` -> ``[S, N]``."""
    if grouped_mm_applies(x, weight):
        out: Tensor = F.grouped_mm(x, weight.transpose(1, 2), offs=a.offsets)
        return out
    return gathered_linear(x, weight, a.experts)


def _routed(
    x: Tensor, router_weight: Tensor, num_experts: int, round_router_weights: bool, **routing: Any
) -> tuple[Tensor, Assignments]:
    """``x`` flattened to ``[N, H]`` and its assignments sorted by expert (``routing``: the keyword
    arguments of :func:`route`)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(flat, router_weight, **routing)
    if round_router_weights:
        weights = weights.to(x.dtype)
    return flat, sort_by_expert(weights, experts, num_experts)


def _combine(flat: Tensor, a: Assignments, ys: Tensor, top_k: int) -> Tensor:
    """``[N, H]``: weighted expert outputs added per token in increasing expert id, rounding
    after each add.
    """
    scaled = (ys * a.weights[:, None]).to(flat.dtype)
    n, h = flat.shape
    rows = torch.empty(n * top_k, h, dtype=flat.dtype, device=flat.device)
    rows.index_copy_(0, a.dest, scaled)
    per_token = rows.view(n, top_k, h)
    out = per_token[:, 0]
    for j in range(1, top_k):
        out = out + per_token[:, j]
    return out


CHUNK_TOKENS = 16384
"""Most tokens the reference routes and multiplies at once (a 34 x 7,084-token prefill of
Qwen3-30B-A3B at once holds ~25 GB of gathered activations)."""


@register("moe", "reference")
def reference(
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
    swiglu: ClampedSwiGLU | None = None,
) -> Tensor:
    """Assignments sorted by expert, one grouped product per projection: ``x [B, T, H]`` ->
    ``[B, T, H]`` in ``x.dtype``; more than :data:`CHUNK_TOKENS` tokens in chunks of that many
    (each token's result is its own). ``swiglu``: gpt-oss's experts instead of SiLU ones.
    """
    n = x.numel() // x.shape[-1]
    if n > CHUNK_TOKENS:
        flat_x = x.reshape(n, 1, x.shape[-1])
        parts = [
            reference(
                flat_x[i : i + CHUNK_TOKENS], router_weight=router_weight,
                gate_up_weight=gate_up_weight, down_weight=down_weight, top_k=top_k,
                norm_topk_prob=norm_topk_prob, round_router_weights=round_router_weights,
                router_bias=router_bias, scoring=scoring, n_group=n_group, topk_group=topk_group,
                correction_bias=correction_bias, routed_scaling_factor=routed_scaling_factor,
                swiglu=swiglu,
            )
            for i in range(0, n, CHUNK_TOKENS)
        ]  # fmt: skip
        return torch.cat(parts).view(x.shape)
    flat, a = _routed(
        x, router_weight, gate_up_weight.shape[0], round_router_weights, top_k=top_k,
        norm_topk_prob=norm_topk_prob, router_bias=router_bias, scoring=scoring, n_group=n_group,
        topk_group=topk_group, correction_bias=correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )  # fmt: skip
    gate_up = grouped_linear(flat[a.token], gate_up_weight, a)
    if swiglu is not None:
        ys = swiglu.finish(grouped_linear(swiglu.activate(gate_up, a.experts), down_weight, a),
                           a.experts)  # fmt: skip
        return _combine(flat, a, ys, top_k).view(x.shape)
    gate, up = gate_up.chunk(2, dim=-1)
    ys = grouped_linear(F.silu(gate) * up, down_weight, a)
    return _combine(flat, a, ys, top_k).view(x.shape)


@register("moe", "gathered")
def gathered(
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
    """Each assignment times its expert's gathered weights; the contract of :func:`reference`."""
    flat, a = _routed(
        x, router_weight, gate_up_weight.shape[0], round_router_weights, top_k=top_k,
        norm_topk_prob=norm_topk_prob, router_bias=router_bias, scoring=scoring, n_group=n_group,
        topk_group=topk_group, correction_bias=correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )  # fmt: skip
    gate, up = gathered_linear(flat[a.token], gate_up_weight, a.experts).chunk(2, dim=-1)
    ys = gathered_linear(F.silu(gate) * up, down_weight, a.experts)
    return _combine(flat, a, ys, top_k).view(x.shape)


@register("moe", "dense")
def dense(
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
    """Every expert on every token (E/top_k times the FLOPs, scratch ``E * N * (3I + H)``); the
    contract of :func:`reference`. Where that scratch would pass :data:`GATHER_BYTES` (a
    prefill), the step runs :func:`reference` instead.
    """
    b, t, h = x.shape
    n_experts, inter = gate_up_weight.shape[0], down_weight.shape[2]
    if n_experts * b * t * (3 * inter + h) * x.element_size() > GATHER_BYTES:
        return reference(
            x, router_weight=router_weight, gate_up_weight=gate_up_weight,
            down_weight=down_weight, top_k=top_k, norm_topk_prob=norm_topk_prob,
            round_router_weights=round_router_weights, router_bias=router_bias, scoring=scoring,
            n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
            routed_scaling_factor=routed_scaling_factor,
        )  # fmt: skip
    flat = x.reshape(-1, h)
    weights, experts = route(
        flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias,
        scoring=scoring, n_group=n_group, topk_group=topk_group, correction_bias=correction_bias,
        routed_scaling_factor=routed_scaling_factor,
    )  # fmt: skip
    if round_router_weights:
        weights = weights.to(x.dtype)
    combine = torch.zeros(flat.shape[0], n_experts, dtype=weights.dtype, device=x.device)
    combine.scatter_(1, experts, weights)
    xs = flat.unsqueeze(0).expand(n_experts, -1, -1)
    gate, up = torch.bmm(xs, gate_up_weight.transpose(1, 2)).chunk(2, dim=-1)
    ys = torch.bmm(F.silu(gate) * up, down_weight.transpose(1, 2))
    scaled = (ys * combine.T.unsqueeze(-1)).to(x.dtype)
    out = scaled.float().sum(dim=0)
    return out.to(x.dtype).view(b, t, h)


# Names recipes recorded before every implementation became capturable still carry: ``grouped``
# (a per-expert loop that read the counts on the host) and ``grouped_mm`` (now the reference's
# own path) run the reference.
register("moe", "grouped", alias_of=REFERENCE)(reference)
register("moe", "grouped_mm", alias_of=REFERENCE)(reference)

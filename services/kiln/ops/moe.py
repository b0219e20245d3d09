"""``moe``: the mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral), in an expert layer's
``ffn`` slot in place of ``mlp`` (design: docs/design/kernels.md, "MoE").

Semantics of transformers' (>= 5) ``Qwen3MoeSparseMoeBlock`` / ``MixtralSparseMoeBlock`` in eval
mode: (1) :func:`route`: ``logits = x @ router_weight.T`` in the model dtype, in float32 ``p =
softmax(logits + router_bias)``, ``(w, e) = topk(p, top_k)``, ``w /= w.sum(-1)`` if
``norm_topk_prob``; (2) each chosen expert computes ``down_e(silu(gate_e(x)) * up_e(x))`` in the
model dtype, scaled by ``w`` (cast to the model dtype first when ``round_router_weights``,
Qwen3-MoE; else in float32 then cast, Mixtral); (3) the scaled outputs are summed per token in the
model dtype.

Call: ``moe(x[B, T, H]) -> [B, T, H]`` in ``x.dtype``. Params (stacked, as transformers >= 5;
:mod:`kiln.workloads.weights`): ``router_weight`` ``[E, H]`` (HF ``mlp.gate.weight``);
``gate_up_weight`` ``[E, 2I, H]``, gate rows ``[:I]`` then up (HF ``mlp.experts.gate_up_proj``);
``down_weight`` ``[E, H, I]``; ``top_k`` (int), ``norm_topk_prob``, ``round_router_weights`` (bool);
``router_bias``: kiln's float32 ``[E]`` logit bias imposing the traffic's expert-load skew on random
weights (:mod:`kiln.workloads.models.routing`), or None.

Every implementation keeps shapes static and never synchronises with the host (CUDA-graph and
``torch.compile(fullgraph=True)`` safe; scratch sized by ``N * top_k``) and shares :func:`route`:
``reference`` (assignments sorted by expert, one grouped product per projection, summed in
increasing expert id with a rounding after each add, as transformers' loop), ``gathered`` (each
assignment times its expert's gathered weights; small batches), ``dense`` (every expert on every
token: E/top_k times the FLOPs, no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.ops.registry import REFERENCE, register

Tensor = torch.Tensor


def route(
    x: Tensor,
    router_weight: Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    router_bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Top-k routing of tokens to experts (step 1 of the module docs).

    Args:
        x: ``[N, H]`` tokens (model dtype).
        router_weight: ``[E, H]`` (model dtype).
        top_k: experts per token, ``1..E``.
        norm_topk_prob: renormalise the top-k probabilities to sum to 1.
        router_bias: float32 ``[E]`` added to the logits, or None.

    Returns:
        ``(weights [N, top_k] float32, experts [N, top_k] int64)``, experts in decreasing
        probability (``torch.topk`` order).
    """
    logits = F.linear(x, router_weight).float()
    if router_bias is not None:
        logits = logits + router_bias
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


@dataclass(frozen=True)
class Assignments:
    """The ``S = N * top_k`` (token, expert) assignments of a step, sorted by expert (stable).

    Attributes:
        token: ``[S]`` int64 token of each assignment. experts: ``[S]`` int64 its expert.
        weights: ``[S]`` its routing weight (the dtype :func:`route`'s caller chose).
        offsets: ``[E]`` int32 cumulative ends of each expert's rows (``grouped_mm``'s ``offs``).
        dest: ``[S]`` int64 unique row ``token * top_k + r`` of a ``[N * top_k]`` buffer, ``r`` the
            assignment's rank among its token's experts by expert id.
    """

    token: Tensor
    experts: Tensor
    weights: Tensor
    offsets: Tensor
    dest: Tensor


def sort_by_expert(weights: Tensor, experts: Tensor, num_experts: int) -> Assignments:
    """Sort :func:`route`'s ``[N, top_k]`` choices by expert, on the device (no host sync).

    Args:
        weights: ``[N, top_k]`` routing weights. experts: ``[N, top_k]`` int64 in ``0..E-1``.
        num_experts: E.
    """
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


def _cpu_grouped_mm() -> bool:
    """Whether this torch runs ``grouped_mm`` on CPU tensors (probed once, at import)."""
    fn = getattr(F, "grouped_mm", None)
    if fn is None:
        return False
    try:
        one = torch.ones(2, 8, dtype=torch.bfloat16)
        fn(one, torch.ones(1, 8, 8, dtype=one.dtype), offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


_GROUPED_MM_CPU = _cpu_grouped_mm()
_ALIGN_BYTES = 16


def grouped_mm_applies(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`grouped_linear` runs PyTorch's ``grouped_mm`` for ``x [S, K]``, ``weight [E,
    N, K]``: bfloat16, K and N rows of 16-byte multiples, on CUDA capability >= 9.0 or a CPU whose
    torch has it. Depends on shapes and device only, so a captured step never changes path.
    """
    size = x.element_size()
    if x.dtype != torch.bfloat16 or getattr(F, "grouped_mm", None) is None:
        return False
    if (x.shape[-1] * size) % _ALIGN_BYTES or (weight.shape[1] * size) % _ALIGN_BYTES:
        return False
    if x.device.type == "cuda":  # properties, not get_device_capability: dynamo folds them
        return torch.cuda.get_device_properties(x.device).major >= 9
    return x.device.type == "cpu" and _GROUPED_MM_CPU


GATHER_BYTES = 256 << 20
"""Scratch :func:`gathered_linear` gathers weights into at once, bytes (larger gathers run in chunks
of rows).
"""


def gathered_linear(x: Tensor, weight: Tensor, experts: Tensor) -> Tensor:
    """Row ``s`` of ``x [S, K]`` times ``weight[experts[s]].T`` (``weight [E, N, K]``) -> ``[S,
    N]``, float32 accumulation, in row chunks whose gathered weights fit :data:`GATHER_BYTES`
    (shape-determined).
    """
    s, (_, n, k) = x.shape[0], weight.shape
    rows = max(1, GATHER_BYTES // max(1, n * k * weight.element_size()))
    parts = [
        torch.bmm(x[i : i + rows].unsqueeze(1), weight[experts[i : i + rows]].transpose(1, 2))
        for i in range(0, s, rows)
    ]
    return torch.cat(parts).squeeze(1) if len(parts) > 1 else parts[0].squeeze(1)


def grouped_linear(x: Tensor, weight: Tensor, a: Assignments) -> Tensor:
    """Rows ``x[offsets[e-1]:offsets[e]]`` times ``weight[e].T`` for every expert e: ``x [S, K]``
    sorted by expert, ``weight [E, N, K]`` -> ``[S, N]``; one grouped GEMM where
    :func:`grouped_mm_applies`, else :func:`gathered_linear`.
    """
    if grouped_mm_applies(x, weight):
        out: Tensor = F.grouped_mm(x, weight.transpose(1, 2), offs=a.offsets)
        return out
    return gathered_linear(x, weight, a.experts)


def _routed(
    x: Tensor,
    router_weight: Tensor,
    num_experts: int,
    top_k: int,
    norm_topk_prob: bool,
    round_router_weights: bool,
    router_bias: Tensor | None,
) -> tuple[Tensor, Assignments]:
    """``x [B, T, H]`` flattened to ``[N, H]``, and its assignments sorted by expert (weights
    rounded to the model dtype when ``round_router_weights``).
    """
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(
        flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias
    )
    if round_router_weights:
        weights = weights.to(x.dtype)
    return flat, sort_by_expert(weights, experts, num_experts)


def _combine(flat: Tensor, a: Assignments, ys: Tensor, top_k: int) -> Tensor:
    """Scale each assignment's expert output by its weight, round to the model dtype, and add per
    token in increasing expert id, rounding after each add (transformers' ``index_add_`` order;
    deterministic): ``[N, H]``.
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
) -> Tensor:
    """Assignments sorted by expert, one grouped product per projection (module docs).

    Args:
        x: ``[B, T, H]`` (model dtype); params as in the module docs.

    Returns:
        ``[B, T, H]`` in ``x.dtype``.
    """
    flat, a = _routed(
        x, router_weight, gate_up_weight.shape[0], top_k, norm_topk_prob, round_router_weights,
        router_bias,
    )  # fmt: skip
    gate, up = grouped_linear(flat[a.token], gate_up_weight, a).chunk(2, dim=-1)
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
) -> Tensor:
    """Each assignment times its own expert's gathered weights (:func:`gathered_linear`, scratch
    bounded by :data:`GATHER_BYTES`). Same contract as :func:`reference`.
    """
    flat, a = _routed(
        x, router_weight, gate_up_weight.shape[0], top_k, norm_topk_prob, round_router_weights,
        router_bias,
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
) -> Tensor:
    """Every expert on every token (``bmm`` over ``[E, N, H]``), combined through a dense ``[N, E]``
    weight matrix in float32: E/top_k times the reference's FLOPs, scratch ``E * N * (2I + H)``
    elements. Same contract as :func:`reference`.
    """
    b, t, h = x.shape
    flat = x.reshape(-1, h)
    weights, experts = route(
        flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias
    )
    if round_router_weights:
        weights = weights.to(x.dtype)
    n_experts = gate_up_weight.shape[0]
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

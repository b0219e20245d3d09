"""``moe``: the mixture-of-experts feed-forward block (Qwen3-MoE, Mixtral).

It takes the place of ``mlp`` in an expert layer's ``ffn`` slot, so the decoder's forward does
not change. Semantics are transformers' (>= 5) ``Qwen3MoeSparseMoeBlock`` /
``MixtralSparseMoeBlock`` in eval mode (no router jitter):

1. router: ``logits = x @ router_weight.T`` in the model dtype, then in float32
   ``p = softmax(logits + router_bias)``; ``(w, e) = topk(p, top_k)``; if ``norm_topk_prob``,
   ``w /= w.sum(-1)`` (Mixtral always, Qwen3-MoE per its config);
2. each chosen expert ``e`` computes ``down_e(silu(gate_e(x)) * up_e(x))`` in the model dtype
   (Shazeer 2020 SwiGLU, as ``mlp``), scaled by its weight ``w`` — cast to the model dtype first
   when ``round_router_weights`` (Qwen3-MoE), else in float32 then cast (Mixtral);
3. the scaled expert outputs are summed per token in the model dtype.

``router_bias`` is kiln's, not a checkpoint weight: a float32 ``[E]`` bias added to the router
logits that engines with random weights use to impose the traffic's expert-load skew
(:mod:`kiln.workloads.models.routing`); None = no bias (the checkpoint's routing).

Call: ``moe(x[B, T, H]) -> [B, T, H]`` in ``x.dtype``. Base params (held stacked, as
transformers >= 5 holds them; see :mod:`kiln.workloads.weights`):

- ``router_weight`` ``[E, H]`` (HF ``mlp.gate.weight``);
- ``gate_up_weight`` ``[E, 2I, H]``: expert e's gate rows ``[:I]`` then up rows ``[I:]``
  (HF ``mlp.experts.gate_up_proj``);
- ``down_weight`` ``[E, H, I]`` (HF ``mlp.experts.down_proj``);
- ``top_k`` (int), ``norm_topk_prob`` (bool), ``round_router_weights`` (bool),
  ``router_bias`` (float32 ``[E]`` or None).

Implementations: ``reference`` (transformers' per-expert loop), ``grouped`` (tokens sorted by
expert, one contiguous matmul pair per expert hit, one gather and one scatter), ``grouped_mm``
(the same layout as two grouped GEMMs over all experts, no host synchronisation) and ``dense``
(every expert on every token as batched matmuls, combined with a dense ``[N, E]`` weight matrix:
E/top_k times the FLOPs, but no host synchronisation and no data-dependent shapes, so it can be
captured in a CUDA graph). Which wins depends on the batch and on how many distinct experts the
routing hits — which is why the traffic's expert-load skew matters. All of them share
:func:`route`, so they pick the same experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.registry import register

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


def _expert(x: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """One expert's SwiGLU: ``x [n, H]``, ``gate_up [2I, H]``, ``down [H, I]`` -> ``[n, H]``."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)


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
    """transformers' ``Qwen3MoeExperts`` / ``MixtralExperts`` loop: for each expert hit (in
    expert order), gather its tokens, run it, scale, and ``index_add_`` into the output.

    Args:
        x: ``[B, T, H]`` (model dtype); params as in the module docs.

    Returns:
        ``[B, T, H]`` in ``x.dtype``. Experts no token chose are skipped (one host
        synchronisation for the list of experts hit).
    """
    b, t, h = x.shape
    flat = x.reshape(-1, h)
    weights, experts = route(
        flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias
    )
    if round_router_weights:
        weights = weights.to(x.dtype)
    out = torch.zeros_like(flat)
    for e in torch.unique(experts).tolist():
        token, slot = torch.where(experts == e)
        y = _expert(flat[token], gate_up_weight[e], down_weight[e])
        y = y * weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out.view(b, t, h)


@register("moe", "grouped")
def grouped(
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
    """Sort the ``N * top_k`` (token, expert) assignments by expert, gather the tokens once,
    run each hit expert on its contiguous segment, scale, and scatter-add once (the layout of
    vLLM's ``fused_moe`` and of grouped-GEMM kernels, with the per-expert matmuls left to ATen).
    One host synchronisation (the per-expert counts). Same contract as :func:`reference`."""
    b, t, h = x.shape
    flat = x.reshape(-1, h)
    weights, experts = route(
        flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias
    )
    if round_router_weights:
        weights = weights.to(x.dtype)
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=gate_up_weight.shape[0]).tolist()
    token = order // top_k
    xs = flat[token]
    ys = torch.empty_like(xs)
    start = 0
    for e, n in enumerate(counts):
        if n:
            ys[start : start + n] = _expert(
                xs[start : start + n], gate_up_weight[e], down_weight[e]
            )
            start += n
    scaled = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(flat).index_add_(0, token, scaled).view(b, t, h)


def _grouped_linear(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """Rows ``x[offsets[e-1]:offsets[e]]`` times ``weight[e].T`` for every expert e, in one
    grouped GEMM: ``x [S, K]``, ``weight [E, N, K]``, ``offsets [E]`` int32 cumulative ends ->
    ``[S, N]``. ``torch.nn.functional.grouped_mm`` (torch >= 2.10), else ``torch._grouped_mm``.

    Raises:
        NotImplementedError: this torch has neither (or no kernel for the device and dtype).
    """
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise NotImplementedError("moe=grouped_mm needs torch.nn.functional.grouped_mm")
    out: Tensor = fn(x, weight.transpose(1, 2), offs=offsets)
    return out


@register("moe", "grouped_mm")
def grouped_mm(
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
    """:func:`grouped` with the per-expert loop replaced by two grouped GEMMs over all experts
    (PyTorch's ``grouped_mm``: CUTLASS on Hopper, as transformers' ``grouped_mm`` experts and
    torchtitan use): assignments sorted by expert, per-expert counts by ``scatter_add`` on the
    device — no host synchronisation and static shapes (CUDA-graph capturable), work
    proportional to ``N * top_k`` rows. Needs 16-byte-aligned rows (H and I multiples of 8 in
    bfloat16); on CUDA, bfloat16. Same contract as :func:`reference`."""
    b, t, h = x.shape
    flat = x.reshape(-1, h)
    weights, experts = route(
        flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias
    )
    if round_router_weights:
        weights = weights.to(x.dtype)
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.zeros(gate_up_weight.shape[0], dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts, dtype=torch.int32))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    token = order // top_k
    gate, up = _grouped_linear(flat[token], gate_up_weight, offsets).chunk(2, dim=-1)
    ys = _grouped_linear(F.silu(gate) * up, down_weight, offsets)
    scaled = (ys * weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(flat).index_add_(0, token, scaled).view(b, t, h)


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
    """Every expert on every token (``bmm`` over ``[E, N, H]``), combined with the routing
    weights scattered into a dense ``[N, E]`` matrix (zero where not chosen) and summed over
    experts in float32. E/top_k times the reference's FLOPs; no host synchronisation and static
    shapes (CUDA-graph capturable). Scratch: ``E * N * (2I + H)`` elements. Same contract as
    :func:`reference`."""
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

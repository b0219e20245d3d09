"""DeepSeek-V3's router (``topk_method: noaux_tc``, ``scoring_func: sigmoid``; DeepSeek-V3
technical report, arXiv:2412.19437, section 2.1.2; semantics of transformers'
``DeepseekV3TopkRouter``, ``transformers/models/deepseek_v3/modeling_deepseek_v3.py``, 5.x).

Scores ``s = sigmoid(x . w_e)`` in float32; choices from ``s + e_score_correction_bias`` only:
the experts are split into ``n_group`` equal groups, each scored by the sum of its two best
choice scores, the best ``topk_group`` groups are kept and the top ``top_k`` experts chosen
within them. Weights are the *un-biased* ``s`` of the chosen experts, divided by their sum
(``+ 1e-20``) when ``norm_topk_prob``, times ``routed_scaling_factor``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.precision import widened

Tensor = torch.Tensor


def group_scores(choice: Tensor, n_group: int) -> Tensor:
    """``[N, G]``: per group of ``choice [N, E]`` (E divisible by G, groups of 2 or more), the sum
    of its two largest entries."""
    return choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1).values.sum(dim=-1)


def group_mask(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """``[N, E]`` bool: the experts in the ``topk_group`` best groups of each row (all True when
    every group is kept)."""
    n, e = choice.shape
    if topk_group >= n_group:
        return torch.ones_like(choice, dtype=torch.bool)
    best = torch.topk(group_scores(choice, n_group), topk_group, dim=-1, sorted=False).indices
    kept = torch.zeros(n, n_group, dtype=torch.bool, device=choice.device)
    kept.scatter_(1, best, True)
    return kept[:, :, None].expand(n, n_group, e // n_group).reshape(n, e)


def sigmoid_logits(x: Tensor, router_weight: Tensor, router_bias: Tensor | None) -> Tensor:
    """``x [N, H] . router_weight [E, H]`` in float32 (float64 kept), plus ``router_bias`` (kiln's
    expert-load skew, on the logits) when given: ``[N, E]``."""
    logits = F.linear(widened(x), widened(router_weight))
    return logits if router_bias is None else logits + router_bias


def sigmoid_route(
    logits: Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    correction_bias: Tensor | None,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """The module docstring's routing of router ``logits [N, E]`` (float32 or float64).

    Returns ``(weights [N, top_k], experts [N, top_k] int64)``, weights in the logits' dtype.
    """
    scores = torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias
    if n_group > 1:
        keep = group_mask(choice, n_group, topk_group)
        choice = choice.masked_fill(~keep, float("-inf"))
    experts = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, experts

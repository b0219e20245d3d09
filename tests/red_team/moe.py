"""The MoE red team: ``moe`` implementations that are wrong in ways specific to mixtures of
experts, and honest ones that differ from the reference only within rounding of a routing tie.

Every wrong one must end INCORRECT on an MoE engine, in float32 and bfloat16 (the routing-aware
gate of :mod:`kiln.runtime.moe_check` must not excuse it as "undetermined"); every honest
one must measure ``ok`` (the gate must excuse exactly what rounding can change). Candidates are
code modules as agents send them, built from :mod:`kiln.ops.moe`'s own pieces so that each
differs from the reference in the one way its name says. ``tests/unit/test_moe_gate.py`` runs
them on CPU engines of each MoE family kiln builds (Qwen3-MoE with and without top-k
renormalisation, Mixtral).

Not here: a skipped shared expert. No family kiln builds has shared experts (DeepSeek-V3 and
Qwen2-MoE are refused by :func:`kiln.workloads.models.build.check_buildable`); the per-layer
comparison is over the whole op's output, and ``tests/unit/test_moe_check.py`` shows it catches
a candidate that skips a shared expert of a Qwen2-MoE-style op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.domain.candidate import Candidate, CodeModule
from kiln.workloads.config import MoEConfig

PRELUDE = '''
import math

import torch
import torch.nn.functional as F

from kiln.ops import moe as _moe
from kiln.ops.registry import register


def _probs(x, router_weight, router_bias, logits=None):
    """float32 [N, E] router probabilities (the reference's, unless ``logits`` are given)."""
    if logits is None:
        logits = F.linear(x.reshape(-1, x.shape[-1]), router_weight).float()
    if router_bias is not None:
        logits = logits + router_bias
    return torch.softmax(logits, dim=-1)


def _experts(x, gate_up_weight, down_weight, weights, experts, top_k, round_router_weights):
    """The reference's experts and combine, for the routing given ([N, k] each)."""
    if round_router_weights:
        weights = weights.to(x.dtype)
    flat = x.reshape(-1, x.shape[-1])
    a = _moe.sort_by_expert(weights, experts, gate_up_weight.shape[0])
    gate, up = _moe.gathered_linear(flat[a.token], gate_up_weight, a.experts).chunk(2, dim=-1)
    ys = _moe.gathered_linear(F.silu(gate) * up, down_weight, a.experts)
    return _moe._combine(flat, a, ys, top_k).view(x.shape)


def _norm(w, norm_topk_prob):
    return w / w.sum(dim=-1, keepdim=True) if norm_topk_prob else w
'''

_SIGNATURE = (
    "(x, *, router_weight, gate_up_weight, down_weight, top_k, norm_topk_prob, "
    "round_router_weights, router_bias=None)"
)


def _module(name: str, body: str) -> CodeModule:
    """A code module registering ``moe`` implementation ``name``: ``body`` computes ``w`` and
    ``e`` ([N, k] weights and experts); the experts and combine are the reference's."""
    lines = "\n".join("    " + line if line else "" for line in body.strip("\n").splitlines())
    source = (
        f'\n\n@register("moe", "{name}", replace=True)\ndef {name}{_SIGNATURE}:\n{lines}\n'
        "    return _experts(\n        x, gate_up_weight, down_weight, w, e, top_k, "
        "round_router_weights\n    )\n"
    )
    return CodeModule(f"red_team_moe_{name}", PRELUDE + source)


@dataclass(frozen=True)
class MoECase:
    """One ``moe`` candidate and the verdict it must get.

    Attributes:
        name: the implementation's name (test ids, reports).
        how: what it does differently, in words.
        candidate: ``{"moe": name}`` with its code module.
        applies: whether the case means anything for an MoE config (e.g. dropping the
            renormalisation only where the config renormalises).
    """

    name: str
    how: str
    candidate: Candidate
    applies: Callable[[MoEConfig], bool] = lambda m: True


def _case(
    name: str, how: str, body: str, applies: Callable[[MoEConfig], bool] = lambda m: True
) -> MoECase:
    return MoECase(
        name, how, Candidate.make({"moe": name}, code_modules=[_module(name, body)]), applies
    )


_ROUTE = """
flat = x.reshape(-1, x.shape[-1])
w, e = _moe.route(
    flat, router_weight, top_k=top_k, norm_topk_prob=norm_topk_prob, router_bias=router_bias
)
"""

WRONG: tuple[MoECase, ...] = (
    _case(
        "lowest_k",
        "wrong experts: top-k of the lowest router probabilities",
        """
p = _probs(x, router_weight, router_bias)
w, e = torch.topk(p, top_k, dim=-1, largest=False)
w = _norm(w, norm_topk_prob)
""",
        lambda m: m.top_k < m.num_experts,
    ),
    _case(
        "off_by_one",
        "wrong experts: every chosen expert id plus one (mod E), weights kept",
        _ROUTE + "e = (e + 1) % gate_up_weight.shape[0]\n",
        lambda m: m.num_experts > 1,
    ),
    _case(
        "uniform_weights",
        "wrong combine weights: the right experts, each weighted 1/k",
        _ROUTE + "w = torch.full_like(w, 1.0 / top_k)\n",
        lambda m: m.top_k > 1,
    ),
    _case(
        "no_renorm",
        "a dropped renormalisation: top-k probabilities used as they are where the config "
        "renormalises them",
        """
p = _probs(x, router_weight, router_bias)
w, e = torch.topk(p, top_k, dim=-1)
""",
        lambda m: m.norm_topk_prob and m.top_k < m.num_experts,
    ),
    _case(
        "extra_renorm",
        "wrong combine weights: top-k probabilities renormalised where the config does not",
        """
p = _probs(x, router_weight, router_bias)
w, e = torch.topk(p, top_k, dim=-1)
w = w / w.sum(dim=-1, keepdim=True)
""",
        lambda m: not m.norm_topk_prob and m.top_k < m.num_experts,
    ),
    _case(
        "capacity_drop",
        "tokens dropped past a capacity: each expert takes at most ceil(N k / E) assignments "
        "(capacity factor 1, GShard / Switch Transformer), in token order; the rest get weight 0",
        _ROUTE
        + """
n, n_experts = flat.shape[0], gate_up_weight.shape[0]
capacity = math.ceil(n * top_k / n_experts)
onehot = F.one_hot(e.reshape(-1), n_experts)
queue = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1
w = w * (queue < capacity).view(n, top_k)
""",
        lambda m: m.top_k < m.num_experts,
    ),
)
"""Each must be INCORRECT wherever it applies."""

HONEST: tuple[MoECase, ...] = (
    _case(
        "float32_router",
        "router logits in float32 (never rounded to the model dtype), else the reference: "
        "picks other experts only where the reference's scores are within rounding of a tie",
        """
flat = x.reshape(-1, x.shape[-1])
logits = F.linear(flat.float(), router_weight.float())
w, e = torch.topk(_probs(x, router_weight, router_bias, logits), top_k, dim=-1)
w = _norm(w, norm_topk_prob)
""",
    ),
    _case(
        "ties_to_last",
        "the reference's scores, exact ties broken toward the higher expert id (top-k over the "
        "experts in reverse order)",
        """
p = _probs(x, router_weight, router_bias).flip(-1)
w, e = torch.topk(p, top_k, dim=-1)
e = p.shape[-1] - 1 - e
w = _norm(w, norm_topk_prob)
""",
    ),
)
"""Each must measure ``ok``."""


def cases(config: MoEConfig, honest: bool = False) -> list[MoECase]:
    """The wrong (or, with ``honest``, the honest) cases that apply to ``config``."""
    return [c for c in (HONEST if honest else WRONG) if c.applies(config)]

"""Routing-aware correctness for mixture-of-experts models (derivation: docs/design/engine.md,
"MoE check").

For a model with ``moe`` layers, :class:`RoutedCheck` changes the gate of
:mod:`kiln.runtime.check`:

1. every reference forward runs through a recording view that keeps each MoE layer's input and
   params; the reference's routing is recomputed from them, never taken from a candidate;
2. per layer, the candidate's ``moe`` op on a copy of the reference's input must match the
   reference op at every position whose top-k choice is determined (max |error| <= rtol x max
   |reference output| of that call); other positions must be finite;
3. end to end, logit rows whose route may have flipped (under a radius widened by the drift;
   after a prefill, also earlier positions of the sequence) are skipped but must be finite.

Tie radius of a score: ``r_e = 2 u |l_e| + 2 g_H (|x| . |w_e|)``, ``u`` the model dtype's unit
roundoff, ``g_H`` = :func:`gamma` (H) at float32 roundoff. A position is determined when every
chosen expert's ``s - r`` lies above every other's ``s + r``. A sigmoid router (DeepSeek-V3,
:mod:`kiln.ops.moe_routing`) chooses by ``sigmoid(l_e) + b_e``: radii and spreads are a quarter
of the logits' (the sigmoid is 1/4-Lipschitz) plus float32 rounding of the sigmoid and the add;
with expert groups, the group choice must be determined too (each group's score, its two best,
moves by at most the sum of its two largest radii), and the top-k is then taken within the chosen
groups. Masks and a checksum of every
recorded input are taken before candidate code runs again; a change fails the check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kiln.ops.moe import route
from kiln.ops.moe_routing import group_scores
from kiln.runtime.check import CheckResult, not_plain
from kiln.workloads.models.decoder import DecoderModel

Tensor = torch.Tensor

ACCUMULATION_ROUNDOFF = 2.0**-24
"""Unit roundoff of the float32 accumulation the tie bound assumes (module docs)."""


def gamma(n: int, u: float = ACCUMULATION_ROUNDOFF) -> float:
    """Higham's ``g_n = n u / (1 - n u)``: the relative error bound of an n-term dot product."""
    return n * u / (1.0 - n * u)


@dataclass(frozen=True)
class Routing:
    """The reference's router on one MoE call: ``[N, E]`` float32 ``scores`` it chooses by
    (``fl(x . w_e) + b_e``; sigmoid routers ``sigmoid(..) + correction_bias``), ``radius`` of each
    and ``spread`` (``||w_e o x||_2``, sensitivity to drift in ``x``, in score units); ``top_k``;
    ``n_group`` / ``topk_group`` expert groups (1 / 1: none).
    """

    scores: Tensor
    radius: Tensor
    spread: Tensor
    top_k: int
    n_group: int = 1
    topk_group: int = 1


def routing_of(x: Tensor, params: Mapping[str, Any]) -> Routing:
    """The reference's scores and radii for ``x [..., H]`` under an ``moe`` site's params."""
    weight: Tensor = params["router_weight"]
    flat = x.reshape(-1, x.shape[-1])
    sigmoid = params.get("scoring", "softmax") == "sigmoid"
    logits = F.linear(flat.float(), weight.float()) if sigmoid else F.linear(flat, weight).float()
    bias = params.get("router_bias")
    scores = logits + bias if isinstance(bias, Tensor) else logits
    xf, wf = flat.float(), weight.float()
    u = torch.finfo(x.dtype).eps / 2
    radius = 2 * u * logits.abs() + 2 * gamma(x.shape[-1]) * (xf.abs() @ wf.abs().T)
    spread = torch.sqrt((xf * xf) @ (wf * wf).T)
    if not sigmoid:
        return Routing(scores, radius, spread, int(params["top_k"]))
    scores = torch.sigmoid(scores)
    correction = params.get("correction_bias")
    if isinstance(correction, Tensor):
        scores = scores + correction
    radius = radius / 4 + 4 * ACCUMULATION_ROUNDOFF * (scores.abs() + 1)
    return Routing(
        scores, radius, spread / 4, int(params["top_k"]), int(params.get("n_group", 1)),
        int(params.get("topk_group", 1)),
    )  # fmt: skip


def _separated(scores: Tensor, reach: Tensor, chosen: Tensor) -> Tensor:
    """``[N]`` bool: every chosen ``scores - reach`` above every other ``scores + reach``."""
    lowest_in = (scores - reach).masked_fill(~chosen, float("inf")).amin(-1)
    highest_out = (scores + reach).masked_fill(chosen, float("-inf")).amax(-1)
    return lowest_in > highest_out


def determined(r: Routing, drift: float = 0.0) -> Tensor:
    """``[N]`` bool: whether the top-k set (and the group choice) is the same for every score
    within ``radius + drift x spread``.
    """
    reach = r.radius + drift * r.spread if drift else r.radius
    scores, sure = r.scores, None
    if r.n_group > 1 and r.topk_group < r.n_group:
        n, e = scores.shape
        groups, group_reach = group_scores(scores, r.n_group), group_scores(reach, r.n_group)
        best = torch.zeros_like(groups, dtype=torch.bool)
        best.scatter_(1, torch.topk(groups, r.topk_group, dim=-1).indices, True)
        sure = _separated(groups, group_reach, best)
        keep = best[:, :, None].expand(n, r.n_group, e // r.n_group).reshape(n, e)
        scores = scores.masked_fill(~keep, float("-inf"))
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    chosen.scatter_(1, torch.topk(scores, r.top_k, dim=-1).indices, True)
    within = _separated(scores, reach, chosen)
    return within if sure is None else within & sure


_ROUTER_KEYS = ("scoring", "n_group", "topk_group", "correction_bias", "routed_scaling_factor")


def decisions(x: Tensor, params: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
    """The reference's top-k for ``x [..., H]``: ``(weights [N, k] float32, experts [N, k]
    int64)``.
    """
    return route(
        x.reshape(-1, x.shape[-1]),
        params["router_weight"],
        top_k=int(params["top_k"]),
        norm_topk_prob=bool(params["norm_topk_prob"]),
        router_bias=params.get("router_bias"),
        **{k: params[k] for k in _ROUTER_KEYS if k in params},
    )


@dataclass
class _Call:
    """One MoE call of a reference forward (layer, input copy, params, bound op); once sealed,
    its determined positions and checksum.
    """

    layer: int
    x: Tensor
    params: Mapping[str, Any]
    reference: Callable[[Tensor], Tensor]
    sure: Tensor | None = None
    checksum: tuple[float, ...] = ()

    def seal(self, routing: Routing | None = None) -> None:
        """Take the mask (from ``routing`` when given) and the checksum, once."""
        if self.sure is None:
            self.sure = determined(routing or routing_of(self.x, self.params))
            self.checksum = self._sums()

    def intact(self) -> bool:
        """Whether the input and the mask are as sealed."""
        return self.sure is not None and self._sums() == self.checksum

    def _sums(self) -> tuple[float, ...]:
        assert self.sure is not None
        return (*_checksum(self.x), *_checksum(self.sure))


@dataclass
class _Step:
    """One recorded forward: valid positions ``[B, T]``, whether it was a prefill, its MoE calls."""

    valid: Tensor
    starts: bool
    calls: list[_Call] = field(default_factory=list)


class _Recording:
    """A view of a reference model (same weights, cache and ops) that records its MoE calls."""

    def __init__(self, model: DecoderModel, label: str) -> None:
        self.label = label
        self.steps: list[_Step] = []
        self._starting = False
        view = object.__new__(DecoderModel)  # copy.copy would cache __slotnames__ on the class
        view.__dict__.update(model.__dict__)
        layers = []
        for i, ops in enumerate(model.ops.layers):
            site = model.slots.layers[i].ffn
            if site.op != "moe":
                layers.append(ops)
                continue

            def ffn(x: Tensor, i: int = i, inner: Any = ops.ffn, p: Any = site.params) -> Tensor:
                self.steps[-1].calls.append(_Call(i, x.detach().clone(), p, inner))
                out: Tensor = inner(x)
                return out

            layers.append(dataclasses.replace(ops, ffn=ffn))
        view.ops = dataclasses.replace(model.ops, layers=tuple(layers))

        def forward(tokens: Tensor, positions: Tensor, seq_lens: Tensor) -> Tensor:
            valid = positions < seq_lens[:, None]
            self.steps.append(_Step(valid, self._starting))
            self._starting = False
            return DecoderModel.forward(view, tokens, positions, seq_lens)

        def prefill(tokens: Tensor, seq_lens: Tensor | None = None, **kw: Any) -> Tensor:
            self._starting = True
            return DecoderModel.prefill(view, tokens, seq_lens, **kw)

        view.forward = forward  # type: ignore[method-assign]
        view.prefill = prefill  # type: ignore[method-assign]
        self.view = view


def _checksum(x: Tensor) -> tuple[float, float]:
    flat = x.detach().reshape(-1).double()
    ramp = torch.arange(flat.numel(), device=flat.device, dtype=torch.float64) % 7 + 1
    return float(flat.sum()), float((flat * ramp).sum())


def check_call(got: object, want: Tensor, sure: Tensor, rtol: float) -> tuple[float, float, str]:
    """``(max |error| at positions where sure holds (inf when not comparable), rtol x max |want|,
    why not correct or "")`` of a candidate MoE output ``got`` against ``want [..., H]``.
    """
    tol = rtol * float(want.float().abs().max())
    why = not_plain(got)
    if why or not isinstance(got, Tensor):
        return float("inf"), tol, f"the op's {why}"
    if got.shape != want.shape:
        return float("inf"), tol, f"output shape {list(got.shape)}, expected {list(want.shape)}"
    with torch._C.DisableTorchFunction():
        if not bool(torch.isfinite(got).all()):
            return float("inf"), tol, "non-finite output"
        diff = (got.float() - want.float()).reshape(sure.numel(), -1)[sure]
        err = float(diff.abs().max()) if diff.numel() else 0.0
    if err > tol:
        skipped = int((~sure).sum())
        return err, tol, (
            f"max |error| {err:.3g} exceeds {rtol:g} x max |reference| = {tol:.3g} where the "
            f"route is determined ({skipped} of {sure.numel()} positions within rounding of a "
            "tie, not compared)"
        )  # fmt: skip
    return err, tol, ""


class RoutedCheck:
    """One check's MoE bookkeeping; inert for a model without ``moe`` layers. ``lossy``: the
    candidate opted into a lossy implementation (drift up to ``rtol``).
    """

    def __init__(self, model: DecoderModel, rtol: float, *, lossy: bool = False) -> None:
        self.rtol = rtol
        self.lossy = lossy
        self.applies = any(layer.ffn.op == "moe" for layer in model.slots.layers)
        self._last = len(model.slots.layers) - 1  # no attention follows the last layer
        self._unit = torch.finfo(model.weights["model.embed_tokens.weight"].dtype).eps / 2
        self._recordings: dict[int, _Recording] = {}
        self._rows = [0, 0]  # compared, total
        self._positions = [0, 0]  # undetermined, total (per-layer check)

    def drift(self, layer: int) -> float:
        """Relative per-element drift allowed at MoE layer ``layer``: ``min(rtol, 2 u (layer +
        1))``, or ``rtol`` when lossy.
        """
        if self.lossy:
            return self.rtol
        return min(self.rtol, self._unit * 2 * (layer + 1))

    def record(self, model: DecoderModel, label: str) -> DecoderModel:
        """A recording view of the reference ``model`` (``model`` itself when inert); call
        :meth:`rows` before any candidate code runs again.
        """
        if not self.applies:
            return model
        rec = _Recording(model, label)
        self._recordings[id(rec.view)] = rec
        return rec.view

    def rows(self, view: DecoderModel) -> list[Tensor] | None:
        """Per recorded step of ``view``, ``[B]`` bool rows to compare end to end (None when
        inert); seals the recorded calls.
        """
        rec = self._recordings.get(id(view))
        if rec is None:
            return None
        out: list[Tensor] = []
        history: Tensor | None = None  # per sequence: a flip that attention carries on
        for step in rec.steps:
            b, t = step.valid.shape
            compared = step.valid.sum(dim=1) - 1  # the position whose logits are returned
            own = torch.zeros(b, dtype=torch.bool, device=step.valid.device)
            spread = torch.zeros_like(own)
            for call in step.calls:
                routing = routing_of(call.x, call.params)
                call.seal(routing)
                sure = determined(routing, self.drift(call.layer))
                unsure = ~sure.view(b, t) & step.valid
                own |= unsure[torch.arange(b, device=own.device), compared]
                if call.layer < self._last:
                    spread |= unsure.any(dim=1)
            if step.starts:
                history = spread
            elif history is not None:
                history = history | spread
            out.append(~(own | history) if history is not None else ~own)
            self._rows[0] += int(out[-1].sum())
            self._rows[1] += b
        return out

    @torch.no_grad()
    def check_layers(self, candidate: DecoderModel) -> CheckResult:
        """The candidate's ``moe`` op of each layer on every recorded input against the reference
        op at determined positions; a recorded input changed since sealing fails. Propagates what
        the candidate's op raises.
        """
        calls = [
            (f"{rec.label} step {j}", call)
            for rec in self._recordings.values()
            for j, step in enumerate(rec.steps)
            for call in step.calls
        ]
        for _, call in calls:
            call.seal()  # a recording whose rows were never asked for
        worst, tolerance = 0.0, 0.0
        for where, call in calls:
            if not call.intact():
                why = "its recorded input or mask changed after the reference ran"
                return _layer_failure(call.layer, where, why, float("inf"), tolerance)
            got = candidate.ops.layers[call.layer].ffn(call.x.clone())
            if not call.intact():
                why = "its recorded input or mask changed while the candidate's op ran"
                return _layer_failure(call.layer, where, why, float("inf"), tolerance)
            assert call.sure is not None
            err, tol, why = check_call(got, call.reference(call.x), call.sure, self.rtol)
            self._positions[0] += int((~call.sure).sum())
            self._positions[1] += call.sure.numel()
            tolerance = max(tolerance, tol)
            if why:
                return _layer_failure(call.layer, where, why, err, tol)
            worst = max(worst, err)
        return CheckResult(True, worst, tolerance)

    def note(self) -> str:
        """What the routing-aware check did, for the measurement's notes ("" if inert)."""
        if not self.applies:
            return ""
        return (
            f"moe: per-layer check on the reference's inputs, {self._positions[0]} of "
            f"{self._positions[1]} positions within rounding of a tie (not compared); "
            + self.rows_note()
        )

    def rows_note(self) -> str:
        """How many rows the end-to-end comparisons compared so far ("" if inert)."""
        if not self.applies:
            return ""
        return (
            f"end to end {self._rows[0]} of {self._rows[1]} rows compared (the others: a route "
            "within rounding and drift of a tie)"
        )


def _layer_failure(layer: int, where: str, why: str, err: float, tol: float) -> CheckResult:
    return CheckResult(
        False, err, tol, f"moe layer {layer} ({where}), per-layer check on the reference's "
        f"inputs: {why}"
    )  # fmt: skip

"""Whole-forward transforms a candidate may ask for, applied to the engine's model and undone
after the experiment.

Known transforms (parameter values are strings, as candidates carry them):

- ``threads``: ``n`` — ``torch.set_num_threads(n)`` for the experiment (1..the host's cores).
- ``torch_compile``: ``mode`` (``default``, ``reduce-overhead``, ``max-autotune``,
  ``max-autotune-no-cudagraphs``), ``fullgraph`` (``true``/``false``) — the decode step's forward
  (``T == 1``) runs through ``torch.compile``; prefill stays eager. Compilation happens on the
  first decode call, i.e. in the engine's warm-up (the ``compile`` phase).

- ``fused_decode``: kernel parameters (:data:`kiln.runtime.fused_decode.PARAMS`) — the decode
  step as a chain of fused Triton kernels (:mod:`kiln.runtime.fused_decode`); dense
  Llama-shaped models on a CUDA engine. Applied after the other transforms and before
  ``cuda_graph``, which then captures the fused step.

- ``cuda_graph``: no parameters — the decode step at the traffic shape captured as one CUDA
  graph and replayed (:mod:`kiln.runtime.cuda_graph`); CUDA engines only. Applied last,
  whatever its place in the list, so it captures the other transforms' forward (a
  ``torch_compile`` forward is compiled during the capture's warm-up). Its warm-up and capture
  time is reported as the ``graph_capture`` phase.

What applies to the model on this engine's device is :mod:`kiln.runtime.support`'s to say
(``threads`` on CPU engines, ``cuda_graph`` on CUDA ones, ``fused_decode`` per
:func:`~kiln.runtime.fused_decode.unsupported_reason`, ``cuda_graph`` not with ops that
synchronise with the host): a transform it refuses is rejected with its reason before any is
applied. Anything else unknown is rejected too: the candidate is REJECTED with the reason, not
run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kiln.domain.candidate import Transform
from kiln.ops.kernels.runtime import KernelUnavailableError
from kiln.runtime import cuda_graph, fused_decode
from kiln.runtime.support import COMPILE_MODES, TRANSFORMS, ModelSupport, support_for
from kiln.workloads.models import DecoderModel

KNOWN_TRANSFORMS = TRANSFORMS


class RejectedCandidate(ValueError):
    """The candidate cannot run here: an unknown transform or parameter, an unknown op or
    implementation, a lossy implementation without opting in. The message says which."""


@dataclass
class AppliedTransforms:
    """Transforms in effect on a model, and how to undo them (:meth:`revert`)."""

    notes: list[str] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)
    compiled: bool = False
    phases_ms: dict[str, float] = field(default_factory=dict)

    def revert(self) -> None:
        """Undo every transform, last applied first."""
        while self.undo:
            self.undo.pop()()


def _params(t: Transform, allowed: Sequence[str]) -> dict[str, str]:
    params = dict(t.params)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise RejectedCandidate(
            f"transform {t.name!r}: unknown parameter(s) {unknown} (known: {list(allowed)})"
        )
    return params


def _threads(t: Transform, applied: AppliedTransforms) -> None:
    params = _params(t, ("n", "num_threads"))
    text = params.get("n", params.get("num_threads", ""))
    cores = os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        raise RejectedCandidate(f"transform 'threads': n={text!r} is not an integer") from None
    if not 1 <= n <= cores:
        raise RejectedCandidate(f"transform 'threads': n={n} is outside 1..{cores} (host cores)")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    applied.undo.append(lambda: torch.set_num_threads(before))
    applied.notes.append(f"threads: {n} (was {before})")


def _bool(t: Transform, key: str, text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise RejectedCandidate(f"transform {t.name!r}: {key}={text!r} is not true/false")
    return text.lower() in ("true", "1")


def _torch_compile(t: Transform, model: DecoderModel, applied: AppliedTransforms) -> None:
    params = _params(t, ("mode", "fullgraph"))
    mode = params.get("mode", "default")
    if mode not in COMPILE_MODES:
        raise RejectedCandidate(f"transform 'torch_compile': mode {mode!r} not in {COMPILE_MODES}")
    fullgraph = _bool(t, "fullgraph", params.get("fullgraph", "false"))
    eager = model.forward
    compiled = torch.compile(eager, mode=None if mode == "default" else mode, fullgraph=fullgraph)

    def forward(
        tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor
    ) -> torch.Tensor:
        if tokens.shape[1] == 1:
            return compiled(tokens, positions, seq_lens)
        return eager(tokens, positions, seq_lens)

    model.__dict__["forward"] = forward  # shadows the method on this instance only

    def undo() -> None:
        model.__dict__.pop("forward", None)
        torch._dynamo.reset()

    applied.undo.append(undo)
    applied.compiled = True
    applied.notes.append(f"torch_compile: mode={mode}, fullgraph={fullgraph} (decode step)")


def _fused_decode(t: Transform, model: DecoderModel, applied: AppliedTransforms) -> None:
    try:
        undo = fused_decode.install(model, dict(t.params))
    except (fused_decode.FusedDecodeUnsupported, KernelUnavailableError) as exc:
        raise RejectedCandidate(str(exc)) from None
    applied.undo.append(undo)
    params = ", ".join(f"{k}={v}" for k, v in t.params) or "kernel defaults"
    applied.notes.append(f"fused_decode: {params}")


def apply_transforms(
    model: DecoderModel, transforms: Sequence[Transform], support: ModelSupport | None = None
) -> AppliedTransforms:
    """Apply ``transforms`` to ``model`` (already bound to the candidate's ops).

    ``support``: what applies to the model on its device (default: :func:`support_for` of
    ``model.config`` on its cache's device); what it refuses, with the bound ops too, is
    rejected before anything is applied. On failure, the transforms applied so far are
    reverted before the error propagates.

    Raises:
        RejectedCandidate: a transform the support statement refuses (its reason), an unknown
            transform or a bad parameter.
    """
    if support is None:
        support = support_for(model.config, model.cache.lengths.device.type)
    refusal = support.transforms_refusal(transforms, model.binding.recipe)
    if refusal is not None:
        raise RejectedCandidate(refusal)
    applied = AppliedTransforms()
    graphed = False
    fused: Transform | None = None
    try:
        for t in transforms:
            if t.name == "threads":
                _threads(t, applied)
            elif t.name == "torch_compile":
                _torch_compile(t, model, applied)
            elif t.name == "fused_decode":
                fused = t
            elif t.name == "cuda_graph":
                _params(t, ())
                graphed = True
            else:
                raise RejectedCandidate(
                    f"unknown transform {t.name!r} (known: {', '.join(KNOWN_TRANSFORMS)})"
                )
        if fused is not None:
            _fused_decode(fused, model, applied)
        if graphed:
            graph, undo = cuda_graph.install(model)
            applied.undo.append(undo)
            applied.phases_ms["graph_capture"] = graph.capture_ms
            applied.notes.append(f"cuda_graph: decode step at batch {graph.batch} captured")
    except BaseException:
        applied.revert()
        raise
    return applied

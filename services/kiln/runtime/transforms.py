"""Whole-forward transforms a candidate may ask for, applied to the engine's model and undone after
the experiment (parameter values are strings):

- ``threads``: ``n``: ``torch.set_num_threads(n)`` (1..the host's cores).
- ``torch_compile``: ``mode`` (``default``, ``reduce-overhead``, ``max-autotune``,
  ``max-autotune-no-cudagraphs``), ``fullgraph`` (``true``/``false``): the decode forward (``T ==
  1``) compiled on first call (the ``compile`` phase); prefill stays eager.
- ``fused_decode``: :data:`kiln.runtime.fused_decode.PARAMS` (:mod:`kiln.runtime.fused_decode`);
  applied after the others, before ``cuda_graph``.
- ``cuda_graph``: no parameters; the traffic-shape decode step captured and replayed
  (:mod:`kiln.runtime.cuda_graph`), applied last whatever its place; its time is the
  ``graph_capture`` phase.

What applies on this device is :mod:`kiln.runtime.support`'s to say; a refused or unknown transform
or parameter is REJECTED with its reason before any is applied.
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
    """Apply ``transforms`` to ``model`` (bound to the candidate's ops); ``support`` defaults to
    :func:`support_for` of ``model.config`` on its cache's device. On failure the transforms applied
    so far are reverted.

    Raises:
        RejectedCandidate: refused by support, unknown, or a bad parameter.
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

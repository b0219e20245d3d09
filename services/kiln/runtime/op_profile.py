"""Per-op profile of one decode step: ms per step of each op slot, summed per op name over the
layers held (rationale: docs/design/engine.md, "Op profile and CUDA graph").

One extra eager decode step at the traffic shape with every bound op timed (CUDA event pairs,
or ``time.perf_counter`` on CPU). Afterwards the cache is back at the operating point and the
model's ops and shadowed attributes restored, even when the step raises. Ops a candidate fuses
inside one slot are timed as that slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.workloads.models import DecoderModel

Tensor = torch.Tensor


@dataclass
class OpProfile:
    """One profiled decode step: ``op_ms`` (op -> ms per step, summed over layers) and ``shape``
    (``layers``, ``batch_size``, ``context_len`` before the step, ``dtype_bytes``).
    """

    op_ms: dict[str, float] = field(default_factory=dict)
    shape: dict[str, int] = field(default_factory=dict)


class _Recorder:
    """Collects (op, start, end) marks for one step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any, Any]] = []

    def wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start: Any
            end: Any
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                out = fn(*args, **kwargs)
                end.record()
            else:
                start = time.perf_counter()
                out = fn(*args, **kwargs)
                end = time.perf_counter()
            self.marks.append((op, start, end))
            return out

        return timed

    def totals_ms(self) -> dict[str, float]:
        """Sum per op, ms (synchronizes the device first on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for op, start, end in self.marks:
            ms = float(start.elapsed_time(end)) if self.cuda else (end - start) * 1e3
            out[op] = out.get(op, 0.0) + ms
        return out


def _class_shadows(model: DecoderModel) -> dict[str, Any]:
    """Instance attributes shadowing a method of the model's class (installed by transforms)."""
    cls = type(model)
    return {
        name: value
        for name, value in vars(model).items()
        if callable(getattr(cls, name, None)) and not isinstance(getattr(cls, name), property)
    }


def profile_decode_step(
    model: DecoderModel, token: Tensor, reset: Callable[[], None], dtype: torch.dtype
) -> OpProfile:
    """Time each op slot of one eager decode step of ``model`` (its cache at the operating point)
    on ``token [batch_size, 1]`` int64; ``reset`` puts the cache back. Propagates what the
    candidate's ops raise, after restoring the model.
    """
    device = token.device
    recorder = _Recorder(device)
    pairs = zip(model.slots.sites(), model.ops.sites(), strict=True)
    names = {id(bound): site.op for site, bound in pairs}
    timed_ops = model.ops.map(lambda bound: recorder.wrap(names[id(bound)], bound))
    bound_ops, shadows = model.ops, _class_shadows(model)
    for name in shadows:
        del model.__dict__[name]
    model.ops = timed_ops
    try:
        reset()
        with torch.no_grad():
            DecoderModel.decode_step(model, token)
        op_ms = recorder.totals_ms()
    finally:
        model.ops = bound_ops
        model.__dict__.update(shadows)
        reset()
    lengths = model.cache.lengths
    shape = {
        "layers": len(model.ops.layers),
        "batch_size": int(token.shape[0]),
        "context_len": int(lengths.max().item()) if lengths.numel() else 0,
        "dtype_bytes": torch.empty((), dtype=dtype).element_size(),
    }
    return OpProfile(op_ms=op_ms, shape=shape)


def profile_fields(
    wanted: bool, run: Callable[[], OpProfile], notes: list[str], phases: dict[str, float]
) -> dict[str, Any]:
    """The ``Measurement`` fields ``op_ms`` and ``op_profile_shape`` if ``wanted`` (else empty);
    a profile that raises is noted, not fatal. Its wall time is the ``profile`` phase.
    """
    if not wanted:
        return {}
    start = time.perf_counter()
    try:
        profile = run()
    except Exception as exc:
        notes.append(f"op profile failed: {type(exc).__name__}: {exc}")
        return {}
    finally:
        phases["profile"] = (time.perf_counter() - start) * 1e3
    notes.append(
        "op profile: one extra eager decode step, ms per op summed over "
        f"{profile.shape['layers']} layers"
    )
    return {"op_ms": profile.op_ms, "op_profile_shape": profile.shape}

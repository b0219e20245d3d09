"""Per-op profile of one decode step: ms per step of each op slot, summed per op name over the
layers held.

On ``RunRequest.profile``, after timing and verification, the engine runs one extra decode step at
the traffic shape with every bound op wrapped in a timer, eagerly (a CUDA graph replay or a compiled
forward is set aside for that step). CUDA: a CUDA event pair around each call, one synchronize after
the step; the time includes the GPU waiting for launches when the step is launch-bound, so it says
where an eager step's time goes, not bare kernel durations. CPU: ``time.perf_counter``.

The timed steps are untouched; the cache is put back at the operating point and the model's ops and
shadowed attributes restored, even when the step raises. Ops a candidate fuses inside one slot are
timed as that slot.
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
    """One profiled decode step.

    Attributes:
        op_ms: op name -> ms per decode step, summed over the layers held.
        shape: the operating point: ``layers`` (decoder layers held), ``batch_size``,
            ``context_len`` (tokens in the KV cache before the step), ``dtype_bytes`` (bytes
            per element of weights and KV cache).
    """

    op_ms: dict[str, float] = field(default_factory=dict)
    shape: dict[str, int] = field(default_factory=dict)


class _Recorder:
    """Collects (op, start, end) marks for one step: CUDA events, or perf_counter seconds."""

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
    """Instance attributes that shadow a method of the model's class (transforms install
    these: ``forward`` for torch.compile, ``decode_step`` for a CUDA graph)."""
    cls = type(model)
    return {
        name: value
        for name, value in vars(model).items()
        if callable(getattr(cls, name, None)) and not isinstance(getattr(cls, name), property)
    }


def profile_decode_step(
    model: DecoderModel, token: Tensor, reset: Callable[[], None], dtype: torch.dtype
) -> OpProfile:
    """Time each op slot of one eager decode step of ``model``.

    Args:
        model: the measured model, bound to the candidate's ops, its cache at the operating point
            (every sequence at ``context_len`` tokens).
        token: ``[batch_size, 1]`` int64 on the model's device.
        reset: puts the cache back at the operating point (called before and after the step).
        dtype: the model's dtype (for ``shape["dtype_bytes"]``).

    Returns:
        The per-op times (ms per step) and the operating point.

    Raises:
        whatever the candidate's ops raise (the model is restored first).
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
    """The ``Measurement`` fields of a profile, if ``wanted``: ``op_ms`` and
    ``op_profile_shape`` (empty dict when not wanted). A profile that raises is noted, not
    fatal: the experiment's verdict and timings stand without it. Its wall time is the
    ``profile`` phase, ms."""
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

"""The candidate space agents search: one dimension per swappable op and per transform.

A point picks, per op of :mod:`kiln.ops.registry` with alternatives, ``reference`` or one of its
non-lossy implementations that run on the target's device; ``threads`` (``cpu``: unset or
1, 2, 4, ... up to ``os.cpu_count()``); ``torch_compile`` (off or a mode); and on GPU targets
``cuda_graph`` and ``fused_decode`` (with one parameter dimension per kernel parameter, unset =
the kernels' default, meaningful only with the transform on).

:func:`model_space` restricts that to what an engine runs for the model
(:mod:`kiln.runtime.support`): values and dimensions that do not apply go, and two values that
apply alone but not together become an :class:`Exclusion`. The all-reference point is the
baseline, never proposed. Importing this module does not import torch.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.domain.candidate import REFERENCE, Candidate, Transform
from kiln.runtime.support import unused_ops as unused_ops  # re-exported (lives there)

if TYPE_CHECKING:
    from kiln.runtime.support import ModelSupport
    from kiln.workloads.config import ModelConfig

OP_PREFIX = "op:"
THREADS = "threads"
TORCH_COMPILE = "torch_compile"
CUDA_GRAPH = "cuda_graph"
FUSED_DECODE = "fused_decode"
PREFILL_ATTENTION = "sdpa"
"""The attention implementation a stacked start binds for prefill (whole prompts run causal
SDPA without a score matrix: :func:`kiln.ops.attention.sdpa`)."""
PARAM_SEP = "."
"""``transform.param``: the name of a transform-parameter dimension."""

FUSED_DECODE_PARAMS: dict[str, tuple[str, ...]] = {
    "projections": ("gemv", "tensor_core"),
    "block_k": ("256", "512", "1024"),
    "num_warps": ("2", "4", "8"),
    "o_block_n": ("4", "8", "16", "32"),
    "gate_up_block_n": ("4", "8", "16", "32"),
    "down_block_n": ("4", "8", "16", "32"),
    "down_split_k": ("1", "2", "4"),
    "qkv_block": ("4", "8", "16", "32"),
    "lm_block_n": ("16", "32", "64", "128"),
    "split_s": ("32", "64", "128", "256", "512"),
    "fused_combine": ("0", "1"),
    "pdl": ("0", "1"),
}
"""The ``fused_decode`` kernel parameters agents may set, with the values offered (strings, as
candidates carry them); unset means the kernels' default for the shape (``pdl``: 2, see
:data:`kiln.runtime.fused_decode.DEFAULT_PDL`; ``projections``: matrix-vector kernels below
:data:`kiln.runtime.fused_decode.TENSOR_CORE_BATCH` sequences, tensor-core GEMMs from it)."""

Value = str | None
"""A dimension's value: an implementation name, a transform parameter, or None (off)."""


@dataclass(frozen=True)
class Dimension:
    """One axis of the space. ``values[0]`` is the default (reference / transform off)."""

    name: str
    values: tuple[Value, ...]

    @property
    def op(self) -> str | None:
        """The op name of an op dimension, else None."""
        return self.name[len(OP_PREFIX) :] if self.name.startswith(OP_PREFIX) else None

    @property
    def parameter_of(self) -> tuple[str, str] | None:
        """``(transform, param)`` of a transform-parameter dimension, else None."""
        if self.op is not None or PARAM_SEP not in self.name:
            return None
        transform, param = self.name.split(PARAM_SEP, 1)
        return transform, param


def _transform(name: str, value: str) -> Transform:
    if name == THREADS:
        return Transform.of(THREADS, n=value)
    if name == TORCH_COMPILE:
        return Transform.of(TORCH_COMPILE, mode=value)
    if name in (CUDA_GRAPH, FUSED_DECODE):
        return Transform.of(name)
    raise ValueError(f"unknown transform dimension {name!r}")


def _transform_value(t: Transform) -> Value:
    if t.name in (CUDA_GRAPH, FUSED_DECODE):
        return "on"
    return t.param("n") if t.name == THREADS else t.param("mode", "default")


@dataclass(frozen=True)
class Exclusion:
    """No point has ``transform`` on together with op dimension ``op_dim`` at ``value`` (None:
    ``reference``).
    """

    transform: str
    op_dim: str
    value: Value
    reason: str

    def holds(self, point: dict[str, Value]) -> bool:
        """True when ``point`` (missing dimensions at their default) has both."""
        return point.get(self.transform) is not None and point.get(self.op_dim) == self.value


class CandidateSpace:
    """A finite product of dimensions less its excluded points; candidates are its points.

    Args:
        dims: op dimensions start with ``reference`` (stored as None), transform dimensions with
            None (off).
        exclusions: value pairs no point holds.
        support: the statement the space was restricted to (:func:`model_space`), used by
            :meth:`refusal`; None for a hardware space.

    Raises:
        ValueError: a dimension without values, or two with the same name.
    """

    def __init__(
        self,
        dims: Sequence[Dimension],
        exclusions: Sequence[Exclusion] = (),
        support: ModelSupport | None = None,
    ) -> None:
        names = [d.name for d in dims]
        if len(set(names)) != len(names):
            raise ValueError(f"a dimension appears twice: {names}")
        if any(not d.values for d in dims):
            raise ValueError("every dimension needs at least one value")
        self.dims = tuple(dims)
        self.exclusions = tuple(exclusions)
        self.support = support

    def without_ops(self, ops: frozenset[str]) -> CandidateSpace:
        """The same space without the dimensions of ``ops``."""
        dims = [d for d in self.dims if d.op not in ops]
        return CandidateSpace(dims, self._exclusions_over(dims), self.support)

    def within(self, support: ModelSupport) -> CandidateSpace:
        """This space restricted to what ``support`` says applies: refused values removed, a
        dimension left with its default only removed (a transform's parameter dimensions with
        it), conflicts as exclusions.
        """
        kept: list[Dimension] = []
        for d in self.dims:
            if d.parameter_of is not None:
                kept.append(d)
                continue
            values = tuple(v for v in d.values if v is None or _refusal(support, d, v) is None)
            if len(values) > 1 or len(d.values) == 1:
                kept.append(Dimension(d.name, values))
        exclusions = []
        names = {d.name: d for d in kept}
        for c in support.conflicts:
            value = None if c.impl == REFERENCE else c.impl
            op_dim = names.get(OP_PREFIX + c.op)
            if c.transform not in names or value not in (op_dim.values if op_dim else (None,)):
                continue
            if op_dim is None:  # the op is always reference: the transform never applies
                del names[c.transform]
                continue
            exclusions.append(Exclusion(c.transform, op_dim.name, value, c.reason))
        dims = [
            d
            for d in kept
            if d.name in names and (d.parameter_of is None or d.parameter_of[0] in names)
        ]
        kept_exclusions = self._exclusions_over(dims, [*self.exclusions, *exclusions])
        return CandidateSpace(dims, kept_exclusions, support)

    def _exclusions_over(
        self, dims: Sequence[Dimension], exclusions: Sequence[Exclusion] | None = None
    ) -> list[Exclusion]:
        names = {d.name for d in dims}
        pool = self.exclusions if exclusions is None else exclusions
        return [e for e in pool if e.transform in names and e.op_dim in names]

    def excluded(self, point: dict[str, Value]) -> str | None:
        """The reason ``point`` is excluded, or None."""
        return next((e.reason for e in self.exclusions if e.holds(point)), None)

    def refusal(self, candidate: Candidate) -> str | None:
        """Why an engine would refuse ``candidate`` as far as this space knows (the support
        statement's reason, else an exclusion it holds), or None.
        """
        if self.support is not None:
            reason = self.support.refusal(candidate)
            if reason is not None:
                return reason
        return self.excluded(self.assignment(candidate))

    @property
    def size(self) -> int:
        """Points of the product, the reference and excluded ones included."""
        n = 1
        for d in self.dims:
            n *= len(d.values)
        return n

    def candidate(self, assignment: dict[str, Value]) -> Candidate:
        """The candidate of a point (dimension -> value; missing = default); a transform
        parameter counts only when its transform is on.
        """
        ops: dict[str, str] = {}
        transforms: dict[str, Transform] = {}
        params: dict[str, dict[str, str]] = {}
        for d in self.dims:
            value = assignment.get(d.name)
            if value is None:
                continue
            if d.op is not None:
                ops[d.op] = value
            elif (of := d.parameter_of) is not None:
                params.setdefault(of[0], {})[of[1]] = value
            else:
                transforms[d.name] = _transform(d.name, value)
        for name, extra in params.items():
            if name in transforms:
                base = dict(transforms[name].params)
                transforms[name] = Transform.of(name, **{**base, **extra})
        return Candidate.make(ops, list(transforms.values()))

    def assignment(self, candidate: Candidate) -> dict[str, Value]:
        """The point of a candidate (its parts outside the space are ignored)."""
        ops = dict(candidate.ops)
        transforms = {t.name: t for t in candidate.transforms}
        point: dict[str, Value] = {}
        for d in self.dims:
            if d.op is not None:
                impl = ops.get(d.op)
                point[d.name] = None if impl in (None, REFERENCE) else impl
            elif (of := d.parameter_of) is not None:
                t = transforms.get(of[0])
                point[d.name] = None if t is None else (t.param(of[1]) or None)
            else:
                t = transforms.get(d.name)
                point[d.name] = None if t is None else _transform_value(t)
        return point

    def contains(self, candidate: Candidate) -> bool:
        """True when ``candidate`` is a point of this space (not an excluded one)."""
        point = self.assignment(candidate)
        inside = all(point[d.name] in d.values for d in self.dims)
        return inside and self.excluded(point) is None and self.candidate(point) == candidate

    def __iter__(self) -> Iterator[Candidate]:
        """Every point but the reference and excluded ones, the last dimension varying fastest."""
        for values in itertools.product(*(d.values for d in self.dims)):
            point = dict(zip((d.name for d in self.dims), values, strict=True))
            if self.excluded(point) is not None:
                continue
            c = self.candidate(point)
            if not c.is_reference:
                yield c

    def stacked(self) -> Candidate | None:
        """The point with every on/off transform on, and with ``fused_decode`` on the attention
        op of :data:`PREFILL_ATTENTION` where offered; the rest at defaults. None when the space
        has no such transform or the point is excluded.
        """
        point: dict[str, Value] = {
            d.name: "on" for d in self.dims if d.op is None and d.values == (None, "on")
        }
        if not point or self.excluded(point) is not None:
            return None
        attention = next((d for d in self.dims if d.op == "attention"), None)
        if FUSED_DECODE in point and attention is not None:
            if PREFILL_ATTENTION in attention.values:
                faster = {**point, attention.name: PREFILL_ATTENTION}
                if self.excluded(faster) is None:
                    point = faster
        return self.candidate(point)

    def neighbours(self, candidate: Candidate) -> list[tuple[str, Value, Candidate]]:
        """Points differing from ``candidate`` in exactly one dimension, as (dimension, value,
        candidate), without the reference and excluded points.
        """
        point = self.assignment(candidate)
        out: list[tuple[str, Value, Candidate]] = []
        for d in self.dims:
            for value in d.values:
                if value == point[d.name] or self.excluded({**point, d.name: value}):
                    continue
                c = self.candidate({**point, d.name: value})
                if not c.is_reference and c != candidate:  # a parameter of a transform that is off
                    out.append((d.name, value, c))
        return out


def thread_counts(cpus: int | None = None) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``cpus`` (default ``os.cpu_count()``), always with 1, 2 and ``cpus``."""
    top = max(2, cpus or os.cpu_count() or 2)
    counts = {1, 2, top}
    n = 4
    while n < top:
        counts.add(n)
        n *= 2
    return tuple(sorted(counts))


def op_dimensions(device_type: str | None = None) -> list[Dimension]:
    """One dimension per op with a non-lossy, non-alias alternative that runs on ``device_type``
    (None: any device); imports kiln.ops.
    """
    import kiln.ops  # noqa: F401  (registers the built-in implementations)
    from kiln.ops import registry

    dims = []
    for op in registry.ops():
        alternatives = [
            name
            for name in registry.implementations(op)
            if name != REFERENCE
            and not registry.get(op, name).lossy
            and registry.get(op, name).alias_of is None
            and (device_type is None or registry.get(op, name).runs_on(device_type))
        ]
        if alternatives:
            dims.append(Dimension(OP_PREFIX + op, (None, *alternatives)))
    return dims


def space_for(hardware: str, cpus: int | None = None) -> CandidateSpace:
    """The space for a hardware target (see the module docstring)."""
    # Order = the order of the coordinate agent's single moves: the cheap move with the largest
    # expected effect first (threads on a CPU, a CUDA graph on a GPU: on the H200 it took
    # Llama-3.2-1B batch-1 decode from 14.8 to 3.3 ms a step, benchmarks/RESULTS.md), then the
    # fused decode kernels, op implementations next, kernel parameters, torch_compile (seconds
    # to minutes of compilation) last.
    if device_type(hardware) == "cpu":
        first = [Dimension(THREADS, (None, *(str(n) for n in thread_counts(cpus))))]
        ops, tuning = op_dimensions("cpu"), []
        modes: tuple[Value, ...] = (None, "default")
    else:
        first = [Dimension(CUDA_GRAPH, (None, "on")), Dimension(FUSED_DECODE, (None, "on"))]
        ops = op_dimensions("cuda")
        tuning = [
            Dimension(FUSED_DECODE + PARAM_SEP + param, (None, *values))
            for param, values in FUSED_DECODE_PARAMS.items()
        ]
        modes = (None, "default", "max-autotune-no-cudagraphs")
    return CandidateSpace([*first, *ops, *tuning, Dimension(TORCH_COMPILE, modes)])


def device_type(hardware: str) -> str:
    """``"cpu"`` for the ``cpu`` target, else ``"cuda"``."""
    return "cpu" if hardware.strip().lower() == "cpu" else "cuda"


def _refusal(support: ModelSupport, d: Dimension, value: str) -> str | None:
    """Why ``support`` refuses ``value`` of dimension ``d`` (None for a transform it does not
    know).
    """
    if d.op is not None:
        return support.op_reason(d.op, value)
    if d.name not in (THREADS, TORCH_COMPILE, CUDA_GRAPH, FUSED_DECODE):
        return None
    return support.transform_reason(_transform(d.name, value))


def model_space(
    space: CandidateSpace,
    config: ModelConfig | Mapping[str, Any],
    hardware: str,
    *,
    name: str = "model",
) -> CandidateSpace:
    """``space`` restricted to what an engine runs for the model (imports torch).

    ``config`` is a :class:`~kiln.workloads.config.ModelConfig` or its ``config.json`` object.

    Raises:
        kiln.runtime.support.ModelNotSupported: kiln cannot build the model.
    """
    from kiln.runtime.support import support_for

    return space.within(support_for(config, device_type(hardware), name=name))

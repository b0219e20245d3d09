"""The candidate space agents search: one dimension per swappable op and per transform.

For the CPU target a point of the space picks

- per op of :mod:`kiln.ops.registry` that has alternatives: ``reference`` or one of its
  *non-lossy* implementations (lossy ones, e.g. quantization, must be opted into and are not
  proposed);
- ``threads``: unset (the engine's default) or ``n`` in 1, 2, 4, ... up to ``os.cpu_count()``
  (transform ``Transform("threads", {"n": "<n>"})``);
- ``torch_compile``: off or ``Transform("torch_compile", {"mode": "default"})``;
- on GPU targets (anything but ``cpu``), ``cuda_graph``: off or ``Transform("cuda_graph")``
  (the decode step captured as one CUDA graph); ``fused_decode``: off or on
  (:mod:`kiln.runtime.fused_decode`: the decode step as a chain of fused Triton kernels), with
  one *parameter dimension* per kernel parameter (``fused_decode.block_k``, ...: unset = the
  kernels' own default for the shape), which only matter when the transform is on; and a second
  ``torch_compile`` mode, ``max-autotune-no-cudagraphs``.

Op implementations that run only on some devices (Triton kernels: CUDA) are offered only on
targets of those devices.

A compilation searches :func:`model_space`: the hardware target's space restricted to what an
engine runs for its model (:mod:`kiln.runtime.support`, the statement engines refuse
candidates with): a transform that does not apply loses its dimension and its parameter
dimensions (``fused_decode`` on MoE models), an op implementation that does not apply its value,
an op the model never calls its dimension (``moe`` in a dense model, ``mlp`` in a model whose
every layer is MoE: varying it would measure the same forward twice), and two values that apply
alone but not together (``cuda_graph`` with an implementation a code module registered as not
capturable) become an *exclusion*: no point holds both. The restricted space keeps the statement, so
:meth:`CandidateSpace.refusal` also judges candidates outside its points (an LLM's code module).

The all-reference point is the reference candidate: the baseline, never proposed by agents.
Importing :mod:`kiln.ops` (to read the registry) imports torch; importing this module does not.
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
    """No point has transform dimension ``transform`` on together with op dimension ``op_dim`` at
    ``value`` (None: ``reference``), for ``reason``."""

    transform: str
    op_dim: str
    value: Value
    reason: str

    def holds(self, point: dict[str, Value]) -> bool:
        """True when ``point`` (missing dimensions at their default) has both."""
        return point.get(self.transform) is not None and point.get(self.op_dim) == self.value


class CandidateSpace:
    """A finite product of dimensions less its excluded points; candidates are its points
    (content-addressed).

    Args:
        dims: the dimensions, each with at least one value; op dimensions start with
            ``reference`` (stored as None) and transform dimensions with None (off).
        exclusions: value pairs no point holds.
        support: the statement the space was restricted to (:func:`model_space`), kept to
            judge candidates that are not points (:meth:`refusal`); None for a hardware space.

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
        """This space restricted to what ``support`` says applies (see the module docs): op
        values and transform values it refuses removed, a dimension left with its default
        only removed (a transform's parameter dimensions with it), conflicts as exclusions (a
        conflict with an op's ``reference`` when the op has no dimension removes the
        transform)."""
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
        """``exclusions`` (default: this space's) over dimensions that ``dims`` has."""
        names = {d.name for d in dims}
        pool = self.exclusions if exclusions is None else exclusions
        return [e for e in pool if e.transform in names and e.op_dim in names]

    def excluded(self, point: dict[str, Value]) -> str | None:
        """The reason ``point`` is excluded, or None."""
        return next((e.reason for e in self.exclusions if e.holds(point)), None)

    def refusal(self, candidate: Candidate) -> str | None:
        """Why an engine would refuse ``candidate`` as far as this space knows: its support
        statement's reason (any candidate, code modules included: their implementations are
        judged when an engine loads them), else an exclusion it holds; None otherwise."""
        if self.support is not None:
            reason = self.support.refusal(candidate)
            if reason is not None:
                return reason
        return self.excluded(self.assignment(candidate))

    @property
    def size(self) -> int:
        """Points of the product of the dimensions, the reference and excluded ones
        included."""
        n = 1
        for d in self.dims:
            n *= len(d.values)
        return n

    def candidate(self, assignment: dict[str, Value]) -> Candidate:
        """The candidate of a point (dimension name -> value; missing = default). A
        transform-parameter value counts only when its transform is on."""
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
        """Every point except the reference and the excluded ones, in a fixed order (the last
        dimension varies fastest)."""
        for values in itertools.product(*(d.values for d in self.dims)):
            point = dict(zip((d.name for d in self.dims), values, strict=True))
            if self.excluded(point) is not None:
                continue
            c = self.candidate(point)
            if not c.is_reference:
                yield c

    def stacked(self) -> Candidate | None:
        """The point with every on/off transform of the space on (``cuda_graph`` and
        ``fused_decode`` on a GPU target: the engine's fastest known path), and, with
        ``fused_decode`` on (decode then no longer calls the bound attention op), the attention
        op of :data:`PREFILL_ATTENTION` where the space offers it, so prefill does not build
        the reference's float32 score matrix; everything else at its default. None when the
        space has no such transform or the point is excluded."""
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
        """Points that differ from ``candidate`` in exactly one dimension, as (dimension,
        new value, candidate), dimension by dimension; the reference and excluded points are
        left out."""
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
    """1, 2, 4, ... up to ``cpus`` (default ``os.cpu_count()``), always with 1 and 2, and
    ``cpus`` itself."""
    top = max(2, cpus or os.cpu_count() or 2)
    counts = {1, 2, top}
    n = 4
    while n < top:
        counts.add(n)
        n *= 2
    return tuple(sorted(counts))


def op_dimensions(device_type: str | None = None) -> list[Dimension]:
    """One dimension per op with a non-lossy alternative to ``reference`` that runs on
    ``device_type`` (``"cpu"``, ``"cuda"``; None: every device); aliases (names kept for old
    recipes) are not offered (imports kiln.ops)."""
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
    """The space for a hardware target: op implementations that run on its device and
    ``torch_compile`` everywhere, plus ``threads`` on ``cpu``, and ``cuda_graph``,
    ``fused_decode`` with its kernel parameters elsewhere (see the comment for the order)."""
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
    """The device type engines of a hardware target run on: ``"cpu"`` for ``cpu``, else
    ``"cuda"``."""
    return "cpu" if hardware.strip().lower() == "cpu" else "cuda"


def _refusal(support: ModelSupport, d: Dimension, value: str) -> str | None:
    """Why ``support`` refuses value ``value`` of op or transform dimension ``d`` (None for a
    dimension of no transform it knows)."""
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
    """``space`` (the hardware target's) restricted to what an engine runs for the model
    (:meth:`CandidateSpace.within` of :func:`kiln.runtime.support.support_for`; imports
    torch).

    Args:
        config: a :class:`~kiln.workloads.config.ModelConfig`, or its ``config.json`` object
            (the model named ``name``).

    Raises:
        kiln.runtime.support.ModelNotSupported: kiln cannot build the model (no space).
    """
    from kiln.runtime.support import support_for

    return space.within(support_for(config, device_type(hardware), name=name))

"""The candidate space agents search: one dimension per swappable op and per transform.

For the CPU target a point of the space picks

- per op of :mod:`kiln.ops.registry` that has alternatives: ``reference`` or one of its
  *non-lossy* implementations (lossy ones, e.g. quantization, must be opted into and are not
  proposed);
- ``threads``: unset (the engine's default) or ``n`` in 1, 2, 4, ... up to ``os.cpu_count()``
  (transform ``Transform("threads", {"n": "<n>"})``);
- ``torch_compile``: off or ``Transform("torch_compile", {"mode": "default"})``;
- on GPU targets (anything but ``cpu``), ``cuda_graph``: off or ``Transform("cuda_graph")``
  (the decode step captured as one CUDA graph).

Ops the model never calls (``moe`` in a dense model, ``mlp`` in a model whose every layer is
MoE) are left out for that compilation (:meth:`CandidateSpace.without_ops`, :func:`unused_ops`):
varying them would measure the same forward twice.

The all-reference point is the reference candidate: the baseline, never proposed by agents.
Importing :mod:`kiln.ops` (to read the registry) imports torch.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kiln.workloads.candidate import REFERENCE, Candidate, Transform
from kiln.workloads.config import ModelConfig

OP_PREFIX = "op:"
THREADS = "threads"
TORCH_COMPILE = "torch_compile"
CUDA_GRAPH = "cuda_graph"

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


def _transform(name: str, value: str) -> Transform:
    if name == THREADS:
        return Transform.of(THREADS, n=value)
    if name == TORCH_COMPILE:
        return Transform.of(TORCH_COMPILE, mode=value)
    if name == CUDA_GRAPH:
        return Transform.of(CUDA_GRAPH)
    raise ValueError(f"unknown transform dimension {name!r}")


def _transform_value(t: Transform) -> Value:
    if t.name == CUDA_GRAPH:
        return "on"
    return t.param("n") if t.name == THREADS else t.param("mode", "default")


class CandidateSpace:
    """A finite product of dimensions; candidates are its points (content-addressed).

    Args:
        dims: the dimensions, each with at least one value; op dimensions start with
            ``reference`` (stored as None) and transform dimensions with None (off).

    Raises:
        ValueError: a dimension without values, or two with the same name.
    """

    def __init__(self, dims: Sequence[Dimension]) -> None:
        names = [d.name for d in dims]
        if len(set(names)) != len(names):
            raise ValueError(f"a dimension appears twice: {names}")
        if any(not d.values for d in dims):
            raise ValueError("every dimension needs at least one value")
        self.dims = tuple(dims)

    def without_ops(self, ops: frozenset[str]) -> CandidateSpace:
        """The same space without the dimensions of ``ops``."""
        return CandidateSpace([d for d in self.dims if d.op not in ops])

    @property
    def size(self) -> int:
        """Points in the space, the reference included."""
        n = 1
        for d in self.dims:
            n *= len(d.values)
        return n

    def candidate(self, assignment: dict[str, Value]) -> Candidate:
        """The candidate of a point (dimension name -> value; missing = default)."""
        ops: dict[str, str] = {}
        transforms: list[Transform] = []
        for d in self.dims:
            value = assignment.get(d.name)
            if value is None:
                continue
            if d.op is not None:
                ops[d.op] = value
            else:
                transforms.append(_transform(d.name, value))
        return Candidate.make(ops, transforms)

    def assignment(self, candidate: Candidate) -> dict[str, Value]:
        """The point of a candidate (its parts outside the space are ignored)."""
        ops = dict(candidate.ops)
        transforms = {t.name: t for t in candidate.transforms}
        point: dict[str, Value] = {}
        for d in self.dims:
            if d.op is not None:
                impl = ops.get(d.op)
                point[d.name] = None if impl in (None, REFERENCE) else impl
            else:
                t = transforms.get(d.name)
                point[d.name] = None if t is None else _transform_value(t)
        return point

    def contains(self, candidate: Candidate) -> bool:
        """True when ``candidate`` is a point of this space."""
        point = self.assignment(candidate)
        inside = all(point[d.name] in d.values for d in self.dims)
        return inside and self.candidate(point) == candidate

    def __iter__(self) -> Iterator[Candidate]:
        """Every point except the reference, in a fixed order (the last dimension varies
        fastest)."""
        for values in itertools.product(*(d.values for d in self.dims)):
            c = self.candidate(dict(zip((d.name for d in self.dims), values, strict=True)))
            if not c.is_reference:
                yield c

    def neighbours(self, candidate: Candidate) -> list[tuple[str, Value, Candidate]]:
        """Points that differ from ``candidate`` in exactly one dimension, as (dimension,
        new value, candidate), dimension by dimension; the reference is left out."""
        point = self.assignment(candidate)
        out: list[tuple[str, Value, Candidate]] = []
        for d in self.dims:
            for value in d.values:
                if value == point[d.name]:
                    continue
                c = self.candidate({**point, d.name: value})
                if not c.is_reference:
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


def op_dimensions() -> list[Dimension]:
    """One dimension per op with a non-lossy alternative to ``reference`` (imports kiln.ops)."""
    import kiln.ops  # noqa: F401  (registers the built-in implementations)
    from kiln.ops import registry

    dims = []
    for op in registry.ops():
        alternatives = [
            name
            for name in registry.implementations(op)
            if name != REFERENCE and not registry.get(op, name).lossy
        ]
        if alternatives:
            dims.append(Dimension(OP_PREFIX + op, (None, *alternatives)))
    return dims


def space_for(hardware: str, cpus: int | None = None) -> CandidateSpace:
    """The space for a hardware target: op implementations and ``torch_compile`` everywhere,
    plus ``threads`` on ``cpu`` and ``cuda_graph`` elsewhere (see the comment for the order)."""
    # Order = the order of the coordinate agent's single moves: the cheap move with the largest
    # expected effect first (threads on a CPU, a CUDA graph on a GPU: on the H200 it took
    # Llama-3.2-1B batch-1 decode from 14.8 to 3.3 ms a step, benchmarks/RESULTS.md), op
    # implementations next, torch_compile (seconds to minutes of compilation) last.
    cpu = hardware.strip().lower() == "cpu"
    first = (
        [Dimension(THREADS, (None, *(str(n) for n in thread_counts(cpus))))]
        if cpu
        else [Dimension(CUDA_GRAPH, (None, "on"))]
    )
    return CandidateSpace([*first, *op_dimensions(), Dimension(TORCH_COMPILE, (None, "default"))])


def unused_ops(config: ModelConfig) -> frozenset[str]:
    """Ops ``config``'s forward never calls: ``moe`` in a dense model, ``mlp`` in a model
    whose every layer routes to experts."""
    if not config.is_moe:
        return frozenset({"moe"})
    if all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
        return frozenset({"mlp"})
    return frozenset()

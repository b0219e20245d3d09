"""A plan's estimate as the cost model reports it: its headline numbers, every intermediate
:class:`Term` (for ``Explain``), and the serving model's figures where it ran."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kiln.cost_model.sharding import Parallelism, replica_batch
from kiln.domain.operating_point import OperatingPoint


class ServingFigures(Protocol):
    """What an estimate keeps of the serving model (``serving.ServingStats``)."""

    @property
    def tokens_per_s(self) -> float: ...
    @property
    def ttft_p50_ms(self) -> float: ...
    @property
    def ttft_p90_ms(self) -> float: ...
    @property
    def tpot_p50_ms(self) -> float: ...
    @property
    def tpot_p90_ms(self) -> float: ...


@dataclass(frozen=True)
class Term:
    """One number of an estimate: its name, value, unit and the formula or source behind it."""

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class Estimate:
    """A plan's roofline estimate at an operating point: bytes per device (weights, KV of b x
    context tokens of its replica, workspace; on the most loaded device), ``tpot_ms``, ``ttft_ms``
    (one ISL prompt), ``throughput_tokens_per_s`` (B / TPOT) and every intermediate
    :class:`Term`.
    """

    plan: Parallelism
    point: OperatingPoint
    hardware: str
    weight_bytes_per_device: float
    kv_bytes_per_device: float
    workspace_bytes_per_device: float
    tpot_ms: float
    ttft_ms: float
    throughput_tokens_per_s: float
    terms: tuple[Term, ...]
    overhead_bytes_per_device: float = 0.0
    """The CUDA-graph pool and the device's reserved bytes (context, libraries, NCCL)."""
    serving: ServingFigures | None = None
    """The serving model's figures (:mod:`kiln.cost_model.serving`) where it ran."""
    tpot_tier: str = "roofline"
    """Which tier produced TPOT: ``roofline``, ``microbenchmark`` or ``measured``."""
    ttft_tier: str = "roofline"
    """Which tier produced TTFT (``measured`` never: passes calibrate the decode step)."""

    @property
    def served_tpot_ms(self) -> float:
        """TPOT the plan is judged by: the serving model's median, else the step's."""
        return self.serving.tpot_p50_ms if self.serving else self.tpot_ms

    @property
    def served_ttft_ms(self) -> float:
        """TTFT the plan is judged by: the serving model's median, else one prompt alone."""
        return self.serving.ttft_p50_ms if self.serving else self.ttft_ms

    @property
    def served_tokens_per_s(self) -> float:
        """Output tokens/s of the whole plan: the serving model's replica of b users scaled to
        the plan's B users, else B / TPOT."""
        if self.serving:
            b = replica_batch(self.point.batch_size, self.plan.dp)
            return self.serving.tokens_per_s * self.point.batch_size / b
        return self.throughput_tokens_per_s

    @property
    def served_per_device(self) -> float:
        """:attr:`served_tokens_per_s` per occupied device."""
        return self.served_tokens_per_s / self.plan.devices

    @property
    def memory_bytes_per_device(self) -> float:
        """Weights + KV cache + workspace + CUDA-graph pool + reserved on the most loaded
        device, bytes."""
        return (
            self.weight_bytes_per_device
            + self.kv_bytes_per_device
            + self.workspace_bytes_per_device
            + self.overhead_bytes_per_device
        )

    @property
    def throughput_per_device(self) -> float:
        """Output tokens/s per occupied device: B / TPOT / (tp × pp × dp)."""
        return self.point.batch_size / (self.tpot_ms / 1e3) / self.plan.devices

    def term(self, name: str) -> Term:
        """The term called ``name`` (KeyError if absent)."""
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)


class Terms:
    """Collects terms in order; ``add`` returns the value."""

    def __init__(self) -> None:
        self.items: list[Term] = []

    def add(self, name: str, value: float, unit: str, source: str) -> float:
        self.items.append(Term(name, float(value), unit, source))
        return value

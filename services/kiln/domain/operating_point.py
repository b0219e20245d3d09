"""The operating point: the (batch, context, ISL, OSL) a measurement or a prediction is made at.

Derived once, here, from a traffic shape and lowered by an engine's limits: ``batch_size`` = the
traffic's, or a trace's mean concurrency (:func:`operating_batch_size`); ``isl`` / ``osl`` = the
p50 (else mean) of their distributions, rounded half up; ``context_len`` = the traffic's, else
:func:`operating_context_len`. Unset fields (0) take batch-1 decode defaults; every default and
lowering is reported as a note. Every number has a stated range (``MAX_BATCH``,
``MAX_TOKENS``, :data:`TRAFFIC_LIMITS`); one beyond it is :class:`OperatingPointRangeError`.
Stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

DEFAULT_BATCH = 1
"""Decode batch (sequences) when the traffic sets none."""
DEFAULT_ISL = 1024
"""Prompt tokens when the traffic's ISL distribution is unset."""
DEFAULT_OSL = 256
"""Generated tokens when the traffic's OSL distribution is unset."""
DEFAULT_MAX_BATCH = 256
"""Upper clamp of the batch a trace's shape derives from its concurrency (sequences)."""


MAX_BATCH = 65_536
"""Largest batch (sequences): serving engines run a few hundred to a few thousand at once
(vLLM's ``max_num_seqs`` defaults to 256-1024); 2^16 leaves ample headroom."""
MAX_TOKENS = 1 << 24
"""Largest ISL, OSL or context (tokens): 16,777,216, above Llama 4 Scout's 10M context."""
MAX_EXPERT_LOAD_SKEW = 4096.0
"""Largest expert-load skew: the hottest expert's share over the uniform one is at most the
expert count, itself at most 4,096 (kiln.workloads.config_bounds)."""
TRAFFIC_LIMITS: dict[str, float] = {
    "arrival_rate_rps": 1e7,  # requests/s: ~1,000x the busiest public traces
    "interarrival_cv": 1e3,  # bursty traces measure ~1-10
    "mean_concurrency": 1e7,  # in-flight requests (the batch derived from it is clamped)
    "expert_load_skew": MAX_EXPERT_LOAD_SKEW,
    "expert_zipf_exponent": 100.0,  # measured expert loads fit exponents of ~0-3
    "prefix_hit_rate": 1.0,  # a fraction
    "batch_size": MAX_BATCH,
    "context_len": MAX_TOKENS,
}
"""Upper bound of each scalar ``kiln.v1.TrafficShape`` field (all are >= 0); the ISL and OSL
distributions' values are token counts up to ``MAX_TOKENS``."""
TOKEN_DISTRIBUTIONS = ("isl_tokens", "osl_tokens")
DISTRIBUTION_FIELDS = ("p50", "p90", "p99", "mean", "max")


class OperatingPointError(ValueError):
    """A value an operating point cannot be made of; the message names the field and the value."""


class OperatingPointRangeError(OperatingPointError):
    """A number beyond its stated range (services answer OUT_OF_RANGE)."""


def check_traffic(traffic: Mapping[str, Any]) -> None:
    """Check every number of a traffic shape (``MessageToDict`` JSON) against its range:
    finite, >= 0, at most :data:`TRAFFIC_LIMITS` (token counts at most ``MAX_TOKENS``).

    Raises:
        OperatingPointError: a value not a finite number >= 0.
        OperatingPointRangeError: a value above its limit.
    """
    for name, high in TRAFFIC_LIMITS.items():
        _bounded(_number(traffic, name), f"traffic.{name}", high)
    for dist_name in TOKEN_DISTRIBUTIONS:
        dist = traffic.get(dist_name) or {}
        if not isinstance(dist, Mapping):
            raise OperatingPointError(f"traffic.{dist_name} must be a distribution")
        for key in DISTRIBUTION_FIELDS:
            value = _number(dist, key, f"{dist_name}.")
            _bounded(value, f"traffic.{dist_name}.{key}", MAX_TOKENS)


def _bounded(value: float, label: str, high: float) -> None:
    if value > high:
        raise OperatingPointRangeError(f"{label} = {value:g} is out of range 0..{high:g}")


def round_half_up(x: float) -> int:
    """``x`` rounded to the nearest integer, halves up (2.5 -> 3, not Python's 2)."""
    return math.floor(x + 0.5)


def operating_batch_size(mean_concurrency: float, max_batch: int = DEFAULT_MAX_BATCH) -> int:
    """``mean_concurrency`` rounded half up, clamped to ``[1, max_batch]``; OperatingPointError
    if ``max_batch < 1``.
    """
    if max_batch < 1:
        raise OperatingPointError(f"max_batch must be >= 1, got {max_batch}")
    return max(1, min(max_batch, round_half_up(mean_concurrency)))


def operating_context_len(isl: float, osl: float) -> int:
    """``isl + osl / 2`` rounded half up, at least 1: a request's mean context over its decode
    steps.
    """
    return max(1, round_half_up(isl + osl / 2))


@dataclass(frozen=True, kw_only=True)
class OperatingPoint:
    """Where a step is measured or predicted.

    Attributes:
        batch_size: sequences decoded together (>= 1).
        context_len: tokens in each KV cache at the decode step (>= 1; 0 at construction means
            :func:`operating_context_len`).
        isl, osl: prompt and generated tokens per request (>= 0).
        expert_load_skew: MoE hottest expert's share over the uniform share (>= 1).

    Raises:
        OperatingPointError: a count not whole or below its minimum, or a skew not finite and
            >= 1.
        OperatingPointRangeError: batch above ``MAX_BATCH``, a token count above
            ``MAX_TOKENS``, a skew above ``MAX_EXPERT_LOAD_SKEW``.
    """

    batch_size: int = DEFAULT_BATCH
    context_len: int = 0
    isl: int = DEFAULT_ISL
    osl: int = DEFAULT_OSL
    expert_load_skew: float = 1.0

    def __post_init__(self) -> None:
        for name, low in (("batch_size", 1), ("context_len", 0), ("isl", 0), ("osl", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise OperatingPointError(
                    f"operating point: {name} must be an integer >= {low}, got {value!r}"
                )
            high = MAX_BATCH if name == "batch_size" else MAX_TOKENS
            if value > high:
                raise OperatingPointRangeError(
                    f"operating point: {name} = {value} is out of range {low}..{high}"
                )
        skew = self.expert_load_skew
        if not (isinstance(skew, int | float) and math.isfinite(skew) and skew >= 1):
            raise OperatingPointError(
                f"operating point: expert_load_skew must be a finite number >= 1, got {skew!r}"
            )
        if skew > MAX_EXPERT_LOAD_SKEW:
            raise OperatingPointRangeError(
                f"operating point: expert_load_skew = {skew:g} is out of range "
                f"1..{MAX_EXPERT_LOAD_SKEW:g}"
            )
        if not self.context_len:
            object.__setattr__(self, "context_len", operating_context_len(self.isl, self.osl))

    @classmethod
    def from_traffic(
        cls,
        traffic: Mapping[str, Any] | None,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        batch_limit: str = "",
        context_limit: str = "",
    ) -> DerivedPoint:
        """The operating point of ``traffic`` (``kiln.v1.TrafficShape`` as ``MessageToDict``
        JSON, or None), lowered to ``max_batch`` and ``max_context`` (None: no cap), each
        lowering noted with what sets the cap. OperatingPointError on a field out of range
        (:func:`check_traffic`; OperatingPointRangeError above its limit) or a cap below 1.
        """
        notes: list[str] = []
        absent = traffic is None
        if traffic is None:
            notes.append(
                f"no traffic shape: default batch-{DEFAULT_BATCH} decode, "
                f"ISL {DEFAULT_ISL}, OSL {DEFAULT_OSL}"
            )
            traffic = {}
        check_traffic(traffic)
        batch = _count(traffic, "batch_size")
        isl, osl = _tokens(traffic, "isl_tokens"), _tokens(traffic, "osl_tokens")
        defaults = (
            ("batch_size", batch, f"batch {DEFAULT_BATCH}"),
            ("isl_tokens", isl, f"ISL {DEFAULT_ISL}"),
            ("osl_tokens", osl, f"OSL {DEFAULT_OSL}"),
        )
        if not absent:
            notes += [f"traffic.{name} unset: {what}" for name, got, what in defaults if not got]
        batch, isl, osl = batch or DEFAULT_BATCH, isl or DEFAULT_ISL, osl or DEFAULT_OSL
        context = _count(traffic, "context_len")
        if not context:
            context = operating_context_len(isl, osl)
            if not absent:
                notes.append(f"traffic.context_len unset: p50 ISL + p50 OSL / 2 = {context} tokens")
        skew = _number(traffic, "expert_load_skew")
        point = cls(
            batch_size=batch,
            context_len=context,
            isl=round_half_up(isl),
            osl=round_half_up(osl),
            expert_load_skew=max(1.0, skew),
        )
        return point.lowered(
            max_batch=max_batch,
            max_context=max_context,
            batch_limit=batch_limit,
            context_limit=context_limit,
            notes=notes,
        )

    def lowered(
        self,
        *,
        max_batch: int | None = None,
        max_context: int | None = None,
        batch_limit: str = "",
        context_limit: str = "",
        notes: list[str] | None = None,
    ) -> DerivedPoint:
        """This point lowered to the caps (None: none), each lowering noted after ``notes``;
        OperatingPointError on a cap below 1.
        """
        out = list(notes or ())
        batch, context = self.batch_size, self.context_len
        for name, cap in (("max_batch", max_batch), ("max_context", max_context)):
            if cap is not None and cap < 1:
                raise OperatingPointError(f"{name} must be >= 1, got {cap}")
        if max_batch is not None and batch > max_batch:
            out.append(f"batch clamped from {batch} to {max_batch}{_why(batch_limit)}")
            batch = max_batch
        if max_context is not None and context > max_context:
            out.append(
                f"context clamped from {context} to {max_context} tokens{_why(context_limit)}"
            )
            context = max_context
        point = replace(self, batch_size=batch, context_len=context)
        return DerivedPoint(point, tuple(out))

    def as_measured(self, batch_size: int = 0, context_len: int = 0) -> OperatingPoint:
        """This point with an engine's reported non-zero ``batch_size`` and ``context_len``."""
        return replace(
            self,
            batch_size=batch_size or self.batch_size,
            context_len=context_len or self.context_len,
        )


@dataclass(frozen=True)
class DerivedPoint:
    """An operating point and the defaults and lowerings applied to reach it, in words."""

    point: OperatingPoint
    notes: tuple[str, ...] = field(default=())


def _why(limit: str) -> str:
    return f" ({limit})" if limit else ""


def _number(traffic: Mapping[str, Any], name: str, where: str = "") -> float:
    """``traffic[name]`` as a finite number >= 0 (0.0 when missing)."""
    raw = traffic.get(name)
    label = f"traffic.{where}{name}"
    try:
        value = float(raw or 0.0)
    except (TypeError, ValueError):
        raise OperatingPointError(f"{label} {repr(raw)[:200]} is not a number") from None
    if not (math.isfinite(value) and value >= 0):
        raise OperatingPointError(f"{label} must be a finite number >= 0, got {repr(raw)[:200]}")
    return value


def _count(traffic: Mapping[str, Any], name: str) -> int:
    """``traffic[name]`` as a whole number >= 0 (0 when missing)."""
    value = _number(traffic, name)
    if not value.is_integer():
        raise OperatingPointError(f"traffic.{name} must be a whole number, got {value!r}")
    return int(value)


def _tokens(traffic: Mapping[str, Any], name: str) -> float:
    """The p50 of the distribution ``traffic[name]``, else its mean, else 0.0 (tokens)."""
    dist = traffic.get(name) or {}
    if not isinstance(dist, Mapping):
        raise OperatingPointError(f"traffic.{name} must be a distribution, got {repr(dist)[:200]}")
    return _number(dist, "p50", f"{name}.") or _number(dist, "mean", f"{name}.")

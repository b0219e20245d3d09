"""What the cost model asks the engine pool to microbenchmark, and the answer (NATS JSON).

The cost model sends a :class:`MicrobenchRequest` as a NATS request to
``{prefix}.microbench.{device_kind}`` (:func:`microbench_subject`); one engine pool with a device
of that kind (queue group ``kiln-microbench``) times the ops on it, appends the results to the
ledger's ``microbench-*`` stream (:mod:`kiln.events.microbenchmarks`) and replies with a
:class:`MicrobenchReply`. Shapes are integer dims; every list is bounded so that one request
cannot ask for hours of work or more memory than a device holds (:data:`MAX_ELEMENTS`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.events.microbenchmarks import OpSkipped

QUEUE_GROUP = "kiln-microbench"
MAX_ELEMENTS = 1 << 30
"""Largest tensor (elements) one timed op may allocate, per operand."""
MAX_POINTS = 1024
"""Most timed points one request may ask for, over every op."""
_TOKEN = re.compile(r"^[a-z0-9_-]{1,32}$")
_PREFIX = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")

Dim = Field(ge=1, le=1 << 20)


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GemmShape(_Shape):
    """``x[m, k] @ w[k, n]`` for each ``m`` of ``ms``."""

    n: int = Dim
    k: int = Dim
    ms: list[int] = Field(min_length=1, max_length=32)

    @model_validator(mode="after")
    def _bounded(self) -> GemmShape:
        if self.n * self.k > MAX_ELEMENTS or max(self.ms) * max(self.n, self.k) > MAX_ELEMENTS:
            raise ValueError(f"gemm n={self.n} k={self.k} m<={max(self.ms)} is too large")
        return self


class AttentionShape(_Shape):
    """Decode attention: ``batches`` x ``contexts`` grid (one query token per sequence over
    ``context`` cached tokens); prefill: ``contexts`` are the prompt lengths, batch 1."""

    heads: int = Dim
    kv_heads: int = Dim
    head_dim: int = Field(ge=1, le=1024)
    batches: list[int] = Field(default_factory=lambda: [1], min_length=1, max_length=16)
    contexts: list[int] = Field(min_length=1, max_length=16)

    @model_validator(mode="after")
    def _bounded(self) -> AttentionShape:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} not a multiple of kv_heads {self.kv_heads}")
        if max(self.batches) * max(self.contexts) * self.kv_heads * self.head_dim > MAX_ELEMENTS:
            raise ValueError("attention batch x context x kv_heads x head_dim is too large")
        return self


class ExpertShape(_Shape):
    """One routed expert (gate/up ``[hidden, 2 intermediate]``, down ``[intermediate,
    hidden]``) over each ``tokens`` count."""

    hidden: int = Dim
    intermediate: int = Dim
    tokens: list[int] = Field(min_length=1, max_length=32)

    @model_validator(mode="after")
    def _bounded(self) -> ExpertShape:
        if 2 * self.hidden * self.intermediate > MAX_ELEMENTS:
            raise ValueError("expert hidden x intermediate is too large")
        return self


class MicrobenchRequest(BaseModel):
    """Ops to time on one device of ``device_kind`` in ``dtype`` within ``budget_s`` (the pool
    caps it); ``model_name`` only labels the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_kind: str = Field(pattern=_TOKEN.pattern)
    dtype: str = Field(default="bfloat16", pattern=r"^(bfloat16|float16|float32|float8_e4m3fn)$")
    model_name: str = Field(default="", max_length=128)
    gemm: list[GemmShape] = Field(default_factory=list, max_length=128)
    attention_decode: list[AttentionShape] = Field(default_factory=list, max_length=8)
    attention_prefill: list[AttentionShape] = Field(default_factory=list, max_length=8)
    moe_expert: list[ExpertShape] = Field(default_factory=list, max_length=8)
    launch: bool = True
    budget_s: float = Field(default=10.0, gt=0, le=3600)

    @model_validator(mode="after")
    def _few_points(self) -> MicrobenchRequest:
        if self.points() > MAX_POINTS:
            raise ValueError(f"{self.points()} timed points asked for, at most {MAX_POINTS}")
        return self

    def points(self) -> int:
        """Timed points the request asks for."""
        return (
            sum(len(g.ms) for g in self.gemm)
            + sum(len(a.batches) * len(a.contexts) for a in self.attention_decode)
            + sum(len(a.contexts) for a in self.attention_prefill)
            + sum(len(e.tokens) for e in self.moe_expert)
            + int(self.launch)
        )


class MicrobenchReply(BaseModel):
    """The answer: ``stream_id`` the results were appended to, how many, what was skipped;
    ``error`` (and ``ok`` False) when the request was refused or the run failed."""

    model_config = ConfigDict(extra="forbid")

    ok: bool
    stream_id: str = ""
    results: int = 0
    skipped: list[OpSkipped] = Field(default_factory=list)
    error: str = ""
    pool_id: str = ""


def microbench_subject(prefix: str, device_kind: str) -> str:
    """``{prefix}.microbench.{device_kind}``; ValueError for a malformed part."""
    if not _PREFIX.match(prefix) or not _TOKEN.match(device_kind):
        raise ValueError(f"bad microbenchmark subject parts {prefix!r}, {device_kind!r}")
    return f"{prefix}.microbench.{device_kind}"

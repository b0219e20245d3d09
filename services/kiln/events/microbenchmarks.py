"""The microbenchmark stream: the cost model's tier 2 data, one stream per (device, software).

``microbench-<device kind>-<versions key>`` holds ``MicrobenchmarkMeasured`` events, each one
run of the engine pool's microbenchmarks (:mod:`kiln.engine_pool.microbench_service`) on one
device: the ops it timed at their shapes and those it skipped with the reason. The stream is
keyed by the device kind ("cpu", "h200") and a hash of the device name and the torch, triton and
CUDA versions (:func:`microbench_stream`), so a driver or library upgrade starts a new table
and old numbers never mix with new ones. The cost model folds every event of the category into
its tables (:mod:`kiln.cost_model.knowledge`); nothing else reads them, so no projection is
kept. Importing this module registers the event type (the ledger service does).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Literal

from pydantic import Field

from kiln.events.schema import EventSchema

CATEGORY = "microbench"
PREFIX = CATEGORY + "-"
EVENT_TYPE = "MicrobenchmarkMeasured"
_KIND_RE = re.compile(r"^[a-z0-9_-]{1,32}$")

OpName = Literal["gemm", "attention_decode", "attention_prefill", "moe_expert", "launch"]
"""``gemm``: ``x[M,K] @ w[K,N]``; ``attention_decode``: one query token per sequence over
``context`` cached tokens; ``attention_prefill``: ``tokens`` causal tokens of one sequence;
``moe_expert``: one routed expert's gate/up and down GEMMs over ``tokens`` tokens; ``launch``:
the fixed cost of one kernel (CUDA-graph replay on a GPU, eager dispatch on the CPU)."""


class OpResult(EventSchema):
    """One timed op at one shape: ``shape`` the integer dims (gemm: m, n, k; attention: batch,
    context or tokens, heads, kv_heads, head_dim; moe_expert: tokens, hidden, intermediate;
    launch: none), ``ms`` the median of ``samples`` timed runs, ``spread`` (p90 - p10) / median."""

    op: OpName
    dtype: str = Field(min_length=1, max_length=32)
    shape: dict[str, int] = Field(default_factory=dict)
    ms: float = Field(gt=0)
    samples: int = Field(ge=1)
    spread: float = Field(default=0.0, ge=0)


class OpSkipped(EventSchema):
    """An op the device could not time, and why (e.g. FP8 or CUDA graphs on the CPU)."""

    op: str = Field(min_length=1, max_length=64)
    dtype: str = ""
    reason: str = Field(min_length=1, max_length=500)


class MicrobenchmarkMeasured(EventSchema):
    """One microbenchmark run on one device of an engine pool."""

    event_type = EVENT_TYPE
    category = CATEGORY

    device_kind: str = Field(min_length=1, max_length=32)
    device_name: str = Field(min_length=1, max_length=128)
    versions: dict[str, str] = Field(
        description="torch, triton, cuda (empty string where absent) the ops ran with."
    )
    pool_id: str = ""
    model_name: str = Field(default="", description="The model whose shapes were asked for.")
    results: list[OpResult] = Field(default_factory=list, max_length=4096)
    skipped: list[OpSkipped] = Field(default_factory=list, max_length=1024)
    wall_s: float = Field(default=0.0, ge=0)


def versions_key(device_name: str, versions: dict[str, str]) -> str:
    """16 hex digits of sha256 over the device name and the torch/triton/cuda versions."""
    body = {"device": device_name, **{k: versions.get(k, "") for k in ("torch", "triton", "cuda")}}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def microbench_stream(device_kind: str, device_name: str, versions: dict[str, str]) -> str:
    """``microbench-<device kind>-<versions key>``; ValueError for a kind outside
    ``[a-z0-9_-]{1,32}``."""
    if not _KIND_RE.match(device_kind):
        raise ValueError(f"device kind {device_kind!r} is not 1-32 of [a-z0-9_-]")
    return f"{PREFIX}{device_kind}-{versions_key(device_name, versions)}"

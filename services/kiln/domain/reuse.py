"""Measurement reuse, the pure part: the operating-point key two experiments must share, whether
an earlier measurement may answer a new one, and the record a ``MeasurementReused`` event folds
into (docs/design/warm_start.md, "Reuse").

The key (:func:`reuse_key`) is what an engine builds from a work item, less the candidate and the
tier: the parsed model config, the weights' dtype (the config's when unset), seed and weights
directory, the hardware name and device count, and the traffic fields the engine reads (batch,
context, the p50 ISL/OSL a context is derived from when unset, the MoE expert skew). A reused
measurement must also agree with this compilation's fresh reference on the fast tier
(:func:`agrees`): the same engine environment (kiln, torch, triton, CUDA, GPU, Python: kiln's
version is the engine code's), the batch and context the engine measured at, and the bytes of
weights and KV cache held (the layer count and dtype) -- and be no older than the staleness
limit. The reference, confirmations, baselines and incumbent runs are never reused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kiln.domain.candidate import Candidate
from kiln.domain.experiment import Completed, ExperimentRecord, Requested
from kiln.events.types import ExperimentCompleted, Tier

REUSED = "MeasurementReused"
_TRAFFIC_FIELDS = ("batch_size", "context_len", "expert_load_skew", "expert_zipf_exponent")


def reuse_key(workload: Mapping[str, Any], tier: str) -> str:
    """``rk-`` + 16 hex digits of the SHA-256 of the operating point (see the module docs) of a
    ``kiln.v1.Workload`` as JSON, on ``tier``; ValueError when its config is not JSON."""
    model = dict(workload.get("model") or {})
    config = json.loads(str(model.get("config_json") or "{}"))
    traffic = dict(workload.get("traffic") or {})
    hardware = dict(workload.get("hardware") or {})
    body = {
        "config": config,
        "dtype": str(model.get("dtype") or config.get("torch_dtype") or ""),
        "seed": int(model.get("seed") or 0),
        "weights_dir": str(model.get("weights_dir") or ""),
        "hardware": str(hardware.get("name") or "").strip().lower(),
        "devices": int(hardware.get("num_devices") or 0),
        "traffic": {k: traffic.get(k) for k in _TRAFFIC_FIELDS},
        "isl_p50": (traffic.get("isl_tokens") or {}).get("p50"),
        "osl_p50": (traffic.get("osl_tokens") or {}).get("p50"),
        "tier": tier,
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return "rk-" + hashlib.sha256(text.encode()).hexdigest()[:16]


def agrees(
    earlier: ExperimentCompleted, reference: ExperimentCompleted, *, reference_of_earlier: Any
) -> str | None:
    """Why ``earlier`` (a correct measurement of another compilation) may not answer here, or
    None when it may: its environment and measured batch/context must equal this compilation's
    fresh ``reference``'s, and its own compilation's reference (``reference_of_earlier``, an
    ``ExperimentCompleted``) must have held the same weight and KV-cache bytes."""
    if earlier.status != "ok" or not earlier.correct or earlier.tokens_per_s <= 0:
        return "not a correct measurement"
    if dict(earlier.environment) != dict(reference.environment):
        return "measured in another engine environment"
    for name in ("batch_size", "context_len"):
        if getattr(earlier, name) != getattr(reference, name):
            return f"measured at another {name}"
    for name in ("weights_bytes", "kv_cache_bytes"):
        if getattr(reference_of_earlier, name) != getattr(reference, name):
            return f"its reference held other {name} (layers or dtype differ)"
    return None


def reused_record(d: Mapping[str, Any], position: int, at: datetime, team: str) -> ExperimentRecord:
    """The experiment record a ``MeasurementReused`` payload stands for: the original experiment
    (its id and compilation) asked for by ``d["agent"]``, completed with the original result, at
    the reuse event's ``position`` and time ``at``. ValueError when malformed."""
    candidate = Candidate.from_canonical(dict(d["candidate"]))
    if candidate.id != d["candidate_id"]:
        raise ValueError(f"MeasurementReused: candidate does not hash to {d['candidate_id']}")
    eid = str(d["experiment_id"])
    tier: Tier = "full" if d.get("tier") == "full" else "fast"
    req = Requested(
        experiment_id=eid,
        compilation_id=str(d["source_compilation_id"]),
        team=team,
        candidate=candidate,
        agent=str(d["agent"]),
        tier=tier,
        position=position,
    )
    result = ExperimentCompleted.model_validate(dict(d["result"]))
    return ExperimentRecord(req, Completed(eid, result, position, at))

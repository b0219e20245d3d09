"""The EnginePool gRPC servicer: RunExperiment and ListEngines over the engine pool.

``RunExperiment`` measures one candidate through the pool the work queue uses, on its best device
for it, and returns the ``kiln.v1.Measurement``; it writes nothing to the ledger. A failing
candidate is a measurement with a non-OK status; INVALID_ARGUMENT for: no
``experiment``/``workload`` or an empty ``config_json``; an architecture kiln cannot parse or build,
an unknown dtype, missing weights; ``deadline_s`` outside ``0..3600`` (0 =
``KILN_ENGINE_DEFAULT_DEADLINE_S``); a ``baseline`` not in
:data:`kiln.domain.baselines.BASELINE_NAMES` (a known one is measured instead of the candidate;
FAILED_PRECONDITION when the pool was given no external measure); a malformed candidate
(``malformed candidate: ...``); FAILED_PRECONDITION for a workload whose ``hardware.name`` is
not the kind of any device of this pool (a pool never measures one hardware's work on another;
no name: any device). An unspecified tier means fast.
Clamps and defaults applied to the traffic shape come back as trailing metadata
``kiln-engine-notes`` (a JSON list of strings).

``ListEngines`` lists every pool of the registry on the shared NATS, this one first and always
current; ``local_only`` (or NATS unreachable) gives this pool's alone.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.timestamp_pb2 import Timestamp
from pydantic import ValidationError

from kiln.common.errors import InvalidArgument
from kiln.common.identity import current_call
from kiln.common.work import ExperimentWork, device_kind
from kiln.domain.baselines import BASELINE_NAMES
from kiln.domain.candidate import Candidate
from kiln.domain.quoting import quote
from kiln.engine_pool.job import MALFORMED, Job, malformed
from kiln.engine_pool.pool import EnginePool
from kiln.engine_pool.process import EngineSnapshot
from kiln.engine_pool.registry import PoolRecord, Registry
from kiln.engine_pool.settings import EngineSettings
from kiln.runtime.measurement import Measurement, MemoryUsage, Timing
from kiln.v1 import common_pb2, engine_pool_pb2, engine_pool_pb2_grpc

NOTES_METADATA_KEY = "kiln-engine-notes"

_STATUS = {
    "ok": common_pb2.EXPERIMENT_STATUS_OK,
    "incorrect": common_pb2.EXPERIMENT_STATUS_INCORRECT,
    "crashed": common_pb2.EXPERIMENT_STATUS_CRASHED,
    "timed_out": common_pb2.EXPERIMENT_STATUS_TIMED_OUT,
    "rejected": common_pb2.EXPERIMENT_STATUS_REJECTED,
}
_TIER = {"fast": common_pb2.TIER_FAST, "full": common_pb2.TIER_FULL}
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""Experiment and compilation ids (the ledger's stream id rule)."""
_STATE = {
    "starting": engine_pool_pb2.ENGINE_STATE_STARTING,
    "ready": engine_pool_pb2.ENGINE_STATE_READY,
    "busy": engine_pool_pb2.ENGINE_STATE_BUSY,
    "restarting": engine_pool_pb2.ENGINE_STATE_RESTARTING,
    "dead": engine_pool_pb2.ENGINE_STATE_DEAD,
}


def memory_to_proto(memory: MemoryUsage) -> common_pb2.MemoryUsage:
    """Bytes as ``kiln.v1.MemoryUsage``."""
    return common_pb2.MemoryUsage(
        weights_bytes=memory.weights_bytes,
        kv_cache_bytes=memory.kv_cache_bytes,
        workspace_bytes=memory.workspace_bytes,
    )


def measurement_to_proto(m: Measurement) -> common_pb2.Measurement:
    """A measurement as ``kiln.v1.Measurement`` (``max_abs_error`` may be ``inf``)."""
    msg = common_pb2.Measurement(
        status=_STATUS[m.status],
        correct=m.correct,
        max_abs_error=m.max_abs_error,
        tokens_per_s=m.tokens_per_s,
        memory=memory_to_proto(m.memory),
        error=m.error,
        engine_id=m.engine_id,
        tier=_TIER.get(m.tier, common_pb2.TIER_UNSPECIFIED),
        batch_size=m.batch_size,
        context_len=m.context_len,
        verified_steps=m.verified_steps,
        escape_probability=m.escape_probability,
    )
    if m.timing is not None:
        msg.timing.CopyFrom(timing_to_proto(m.timing))
    if m.prefill is not None:
        msg.prefill.CopyFrom(timing_to_proto(m.prefill))
        msg.prefill_tokens_per_s = m.prefill_tokens_per_s
    msg.phases_ms.update(m.phases_ms)
    msg.op_ms.update(m.op_ms)
    msg.op_profile_shape.update(m.op_profile_shape)
    return msg


def timing_to_proto(t: Timing) -> common_pb2.Timing:
    """Timings (ms) as ``kiln.v1.Timing``."""
    return common_pb2.Timing(
        median_ms=t.median_ms,
        p10_ms=t.p10_ms,
        p90_ms=t.p90_ms,
        stdev_ms=t.stdev_ms,
        samples_ms=t.samples_ms,
        warmup_runs=t.warmup_runs,
        mean_ms=t.mean_ms,
        max_ms=t.max_ms,
    )


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def engine_to_proto(e: EngineSnapshot, pool: PoolRecord) -> engine_pool_pb2.EngineInfo:
    """An engine snapshot of ``pool`` as ``kiln.v1.EngineInfo``."""
    kinds = {d.device: d.kind for d in pool.devices}
    info = engine_pool_pb2.EngineInfo(
        engine_id=e.engine_id,
        host=pool.host,
        device=e.device,
        model_name=e.model_name,
        tier=_TIER.get(e.tier, common_pb2.TIER_UNSPECIFIED),
        state=_STATE.get(e.state, engine_pool_pb2.ENGINE_STATE_UNSPECIFIED),
        memory=memory_to_proto(e.memory),
        experiments_run=e.experiments_run,
        cold_start_s=e.cold_start_s,
        pool_id=pool.pool_id,
        spec_key=e.spec_key,
        model_key=e.model_key,
        restarts=e.restarts,
        last_heartbeat=_timestamp(pool.heartbeat_at),
        device_kind=kinds.get(e.device, ""),
        pid=e.pid,
        notes=e.notes,
    )
    if e.started_at is not None:
        ts = Timestamp()
        ts.FromDatetime(e.started_at)
        info.started_at.CopyFrom(ts)
    return info


def pool_to_proto(pool: PoolRecord) -> engine_pool_pb2.PoolInfo:
    """A registry record as ``kiln.v1.PoolInfo``."""
    return engine_pool_pb2.PoolInfo(
        pool_id=pool.pool_id,
        host=pool.host,
        pid=pool.pid,
        devices=[
            engine_pool_pb2.DeviceInfo(
                device=d.device,
                kind=d.kind,
                label=d.label,
                busy=d.busy,
                experiments_done=d.experiments_done,
            )
            for d in pool.devices
        ],
        hardware=pool.hardware,
        models=pool.models,
        subjects=pool.subjects,
        started_at=_timestamp(pool.started_at),
        last_heartbeat=_timestamp(pool.heartbeat_at),
        ttl_s=pool.ttl_s,
        experiments_done=pool.experiments_done,
        local=pool.local,
    )


def job_from_request(
    request: engine_pool_pb2.RunExperimentRequest, team: str, default_deadline_s: float
) -> Job:
    """The :class:`~kiln.engine_pool.job.Job` a RunExperiment request stands for (its candidate
    parsed from the proto here, once).

    Raises:
        InvalidArgument: no experiment / workload / config, a bad deadline or baseline, or a
            malformed candidate.
    """
    if not request.HasField("experiment"):
        raise InvalidArgument("experiment is missing: send the candidate and its workload")
    exp = request.experiment
    if not exp.HasField("workload") or not exp.workload.model.config_json.strip():
        raise InvalidArgument(
            "experiment.workload.model.config_json is empty: send the config.json text"
        )
    deadline = request.deadline_s or default_deadline_s
    if not (math.isfinite(deadline) and 0 < deadline <= 3600):
        raise InvalidArgument(f"deadline_s {request.deadline_s!r} is outside (0, 3600] seconds")
    baseline = request.baseline.strip().lower()
    if baseline and baseline not in BASELINE_NAMES:
        raise InvalidArgument(
            f"baseline {request.baseline!r} is unknown; known: {', '.join(BASELINE_NAMES)}"
        )
    if exp.tier not in (common_pb2.TIER_UNSPECIFIED, common_pb2.TIER_FAST, common_pb2.TIER_FULL):
        raise InvalidArgument(f"experiment.tier {exp.tier} is unknown: TIER_FAST or TIER_FULL")
    for name, value in (
        ("experiment_id", exp.experiment_id),
        ("compilation_id", exp.compilation_id),
    ):
        if value and not _ID_RE.match(value):
            raise InvalidArgument(
                f"experiment.{name} {quote(value)} must be 1 to 128 of [A-Za-z0-9_-]"
            )
    try:
        candidate = Candidate.from_proto(exp.candidate)
    except MALFORMED as exc:
        raise malformed(exc) from None
    workload: dict[str, Any] = MessageToDict(exp.workload, preserving_proto_field_name=True)
    try:
        work = ExperimentWork(
            experiment_id=exp.experiment_id or f"adhoc-{uuid.uuid4().hex[:16]}",
            compilation_id=exp.compilation_id or "adhoc",
            team=team,
            tier="full" if exp.tier == common_pb2.TIER_FULL else "fast",
            candidate=candidate.canonical(),
            workload=workload,
            deadline_s=deadline,
            profile=request.profile,
            baseline=baseline,
        )
    except ValidationError as exc:
        raise InvalidArgument(f"invalid experiment: {exc.errors()[0]['msg']}") from None
    return Job(work, candidate)


class EnginePoolServicer(engine_pool_pb2_grpc.EnginePoolServicer):
    """``kiln.v1.EnginePool`` over an :class:`EnginePool` and the pool :class:`Registry`."""

    def __init__(self, pool: EnginePool, settings: EngineSettings, registry: Registry) -> None:
        self.pool = pool
        self.settings = settings
        self.registry = registry

    async def RunExperiment(
        self, request: engine_pool_pb2.RunExperimentRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.Measurement:
        """Measure one candidate (see the module docstring)."""
        job = job_from_request(request, current_call().team, self.settings.default_deadline_s)
        kind = device_kind(job.work.workload) if request.experiment.workload.hardware.name else ""
        slot = self.pool.choose_slot(job.work, kind)  # never on another hardware kind
        measurement = await self.pool.measure(job, slot.device.name)
        context.set_trailing_metadata(((NOTES_METADATA_KEY, json.dumps(measurement.notes)),))
        return measurement_to_proto(measurement)

    async def ListEngines(
        self, request: engine_pool_pb2.ListEnginesRequest, context: grpc.aio.ServicerContext
    ) -> engine_pool_pb2.ListEnginesResponse:
        """The engines (all, or one model's) of every registered pool, or of this one."""
        pools = [self.registry.local()] if request.local_only else await self.registry.pools()
        return engine_pool_pb2.ListEnginesResponse(
            engines=[
                engine_to_proto(e, pool)
                for pool in pools
                for e in pool.engines
                if not request.model_name or e.model_name == request.model_name
            ],
            pools=[pool_to_proto(pool) for pool in pools],
        )

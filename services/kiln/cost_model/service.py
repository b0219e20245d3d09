"""The CostModel gRPC servicer: ``Plan`` and ``Explain`` over the roofline tier.

- ``workload.model.config_json`` is parsed with ``kiln.workloads.config.parse_config_json``; empty,
  non-JSON or unsupported: INVALID_ARGUMENT; a number out of its range
  (``kiln.workloads.config_bounds``): OUT_OF_RANGE.
- ``workload.hardware.name`` must name a catalogue entry (NOT_FOUND, listing them); ``num_devices``
  0 means the entry's ``max_devices_per_node``, above ``MAX_DEVICES`` is OUT_OF_RANGE.
- Weight dtype: ``workload.model.dtype``; else FP8 when the config has an FP8
  ``quantization_config``; else its ``torch_dtype``. Activations are BF16 (float32 with float32
  weights); the KV cache too, except where Plan picks an FP8 one (``kv_cache_dtype`` and ``note``
  of the plan say so) or Explain's ``plan.kv_cache_dtype`` names one (a ``ModelSpec.dtype`` name
  or ``fp8``; anything else is INVALID_ARGUMENT).
- The operating point is :meth:`kiln.domain.operating_point.OperatingPoint.from_traffic` of
  ``workload.traffic``, no engine caps; a malformed field is INVALID_ARGUMENT, one above its
  limit OUT_OF_RANGE. Plans' ``batch_size`` shows the B used (sequences in flight over all DP
  replicas); Explain lists every default applied.
- ``targets`` (TPOT, TTFT ms; 0: the default, :mod:`kiln.cost_model.objective`): negative or
  non-finite is INVALID_ARGUMENT. Plans are ranked by output tokens/s per GPU among those meeting
  them; each plan says whether it meets them and whether it is on the Pareto frontier.
- Plan runs the planner in a worker thread (``PLAN_WORKERS`` at once), so the event loop (health
  checks included) keeps answering; planning that passes ``PLAN_DEADLINE_S`` from the request's
  arrival ends with DEADLINE_EXCEEDED. Explain costs one plan, inline.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import structlog
from google.protobuf import json_format

from kiln.common.errors import DeadlineExceeded, InvalidArgument, OutOfRange, quote
from kiln.cost_model.bounds import check_devices, check_plan_degrees
from kiln.cost_model.estimate import Estimate, Term
from kiln.cost_model.evidence import NO_EVIDENCE, Evidence
from kiln.cost_model.hardware import Hardware, get_hardware
from kiln.cost_model.knowledge import Knowledge
from kiln.cost_model.objective import ServingTargets, lossy_kv
from kiln.cost_model.planner import (
    PlanDeadlineExceeded,
    PlanResult,
    evaluate,
    plan_workload,
    with_serving,
)
from kiln.cost_model.serving import serving_terms
from kiln.cost_model.sharding import FP8, Parallelism
from kiln.cost_model.tier2 import TIERS
from kiln.domain.operating_point import (
    OperatingPoint,
    OperatingPointError,
    OperatingPointRangeError,
)
from kiln.v1 import common_pb2, cost_model_pb2, cost_model_pb2_grpc
from kiln.workloads.config import (
    DTYPE_BYTES,
    ConfigRangeError,
    ModelConfig,
    UnsupportedModelError,
    parse_config_json,
)

log = structlog.get_logger("kiln.cost_model")

UINT64_MAX = 2**64 - 1
"""memory_bytes_per_device is a uint64: a larger estimate is reported as this (and pruned)."""

PLAN_DEADLINE_S = 8.0
"""Longest a Plan may compute, from its arrival (queueing included): below the agent runner's
10 s ``plan_timeout_s``, so it hears the reason rather than its own timeout."""
PLAN_WORKERS = 2
"""Plans computed at once (threads); more wait their turn within their deadline."""


def parse_model(spec: common_pb2.ModelSpec) -> ModelConfig:
    """The ModelConfig of ``spec.config_json``; InvalidArgument when empty, not JSON or
    unsupported.
    """
    try:
        return parse_config_json(spec.config_json, spec.name or "model")
    except ConfigRangeError as exc:
        raise OutOfRange(str(exc)) from None
    except UnsupportedModelError as exc:
        raise InvalidArgument(str(exc)) from None


def dtypes(spec: common_pb2.ModelSpec, cfg: ModelConfig) -> tuple[str, str]:
    """(weight dtype, activation/KV dtype) (see the module docstring); InvalidArgument for an
    unknown ``spec.dtype``.
    """
    if spec.dtype:
        if spec.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"workload.model.dtype {quote(spec.dtype)} is not one of {', '.join(DTYPE_BYTES)}"
            )
        weights = spec.dtype
    elif (cfg.raw.get("quantization_config") or {}).get("quant_method") == "fp8":
        weights = "float8_e4m3fn"
    else:
        weights = cfg.torch_dtype if cfg.torch_dtype in DTYPE_BYTES else "bfloat16"
    return weights, "float32" if weights == "float32" else "bfloat16"


def operating_point(workload: common_pb2.Workload) -> tuple[OperatingPoint, list[str]]:
    """The operating point of ``workload.traffic`` and the defaults applied; InvalidArgument for
    a field out of range.
    """
    traffic = None
    if workload.HasField("traffic"):
        traffic = json_format.MessageToDict(workload.traffic, preserving_proto_field_name=True)
    try:
        derived = OperatingPoint.from_traffic(traffic)
    except OperatingPointRangeError as exc:
        raise OutOfRange(str(exc)) from None
    except OperatingPointError as exc:
        raise InvalidArgument(str(exc)) from None
    return derived.point, list(derived.notes)


def _hardware(workload: common_pb2.Workload) -> tuple[Hardware, int]:
    if not workload.hardware.name:
        raise InvalidArgument("workload.hardware.name is empty: name a catalogue entry")
    hw = get_hardware(workload.hardware.name)
    return hw, check_devices(workload.hardware.num_devices) or hw.max_devices_per_node


def kv_dtype_of(plan: common_pb2.ParallelismPlan, act_dtype: str) -> str:
    """The KV dtype an Explain request's plan asks for: "" for the activation dtype (unset or
    the same), else a ``DTYPE_BYTES`` name (``fp8`` is ``float8_e4m3fn``); InvalidArgument for
    another."""
    name = FP8 if plan.kv_cache_dtype == "fp8" else plan.kv_cache_dtype
    if name and name not in DTYPE_BYTES:
        raise InvalidArgument(
            f"plan.kv_cache_dtype {quote(plan.kv_cache_dtype)} is not one of "
            f"{', '.join(DTYPE_BYTES)}, fp8 or empty (the activation dtype)"
        )
    return "" if name == act_dtype else name


def targets_of(msg: cost_model_pb2.ServingTargets) -> ServingTargets:
    """The request's targets (defaults for 0); InvalidArgument for a negative or non-finite one."""
    try:
        return ServingTargets.of(msg.tpot_ms, msg.ttft_ms)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


def to_proto(
    est: Estimate,
    reason: str = "",
    note: str = "",
    *,
    targets: ServingTargets | None = None,
    pareto: bool = False,
    kv_dtype: str = "bfloat16",
) -> common_pb2.ParallelismPlan:
    """The wire form of an estimate (memory rounded to whole bytes); ``note`` says why its
    operating point or KV cache departs from the workload's; ``kv_dtype``: the KV dtype of a
    plan that sets none (the activations')."""
    p = est.plan
    return common_pb2.ParallelismPlan(
        tp=p.tp,
        ep=p.ep,
        dp=p.dp,
        pp=p.pp,
        dcp=p.dcp,
        moe_tp=p.moe_tp,
        kv_cache_dtype=p.kv_dtype or kv_dtype,
        batch_size=est.point.batch_size,
        ttft_ms=est.served_ttft_ms,
        tpot_ms=est.served_tpot_ms,
        throughput_tokens_per_s=est.served_tokens_per_s,
        ttft_p90_ms=est.serving.ttft_p90_ms if est.serving else 0.0,
        tpot_p90_ms=est.serving.tpot_p90_ms if est.serving else 0.0,
        memory_bytes_per_device=_uint64(est.memory_bytes_per_device),
        estimate_tier=est.tpot_tier,
        feasible=not reason,
        infeasible_reason=reason,
        note=note,
        pareto_optimal=pareto,
        meets_targets=targets is not None and not reason and targets.miss(est) == 0,
        throughput_per_device=est.served_per_device,
    )


def explain_text(
    est: Estimate,
    reason: str,
    notes: list[str],
    hw: Hardware,
    targets: ServingTargets,
    evidence: Evidence = NO_EVIDENCE,
) -> str:
    """A readable account of an estimate: verdict, headline numbers, the tier of each and the
    evidence behind them, then every term."""
    p, pt = est.plan, est.point
    lines = [
        f"{p.label()} on {p.devices} × {hw.name}, B={pt.batch_size} ISL={pt.isl} "
        f"OSL={pt.osl} context={pt.context_len} (tier {est.tpot_tier})",
        f"verdict: {'infeasible: ' + reason if reason else 'feasible'}",
        f"tiers: TPOT {est.tpot_tier}, TTFT {est.ttft_tier}, memory roofline",
        *evidence_lines(evidence, hw),
        f"one step: TPOT {est.tpot_ms:.4g} ms, TTFT {est.ttft_ms:.4g} ms (one prompt alone), "
        f"{est.throughput_tokens_per_s:.4g} tokens/s, "
        f"{est.memory_bytes_per_device / 1e9:.3g} GB per device",
        *_serving_lines(est),
        f"targets: {_verdict(est, reason, targets)}; objective: {targets.describe()}",
        *(f"default: {n}" for n in notes),
        "terms:",
        *(
            f"  {t.name} = {t.value:.6g} {t.unit}  [{t.source}]"
            for t in (*est.terms, *serving_terms(est))
        ),
        f"hardware: {hw.source_summary()}",
    ]
    return "\n".join(lines)


def evidence_lines(evidence: Evidence, hw: Hardware) -> list[str]:
    """Where tiers 2 and 3 stand for this request, in words."""
    table, cal = evidence.table, evidence.calibration
    bench = (
        f"microbenchmarks: {table.label()}, {len(table.points)} points over {table.events} "
        f"run(s) ({table.stream_id})"
        if table is not None
        else f"microbenchmarks: none measured on {hw.name} yet (the roofline fills in)"
    )
    calibration = (
        f"calibration (measured passes): {cal.describe()}"
        if cal is not None
        else f"calibration (measured passes): none of this model on {hw.name} yet"
    )
    pre = evidence.prefill_calibration
    prefill = (
        f"prefill calibration (timed prefills): {pre.describe()}"
        if pre is not None
        else f"prefill calibration (timed prefills): none of this model on {hw.name} yet"
    )
    return [bench, calibration, prefill]


def tier_terms(est: Estimate) -> list[Term]:
    """``tier.tpot_ms`` and ``tier.ttft_ms``: the tier of each headline number (value: its
    index in roofline, microbenchmark, measured)."""
    return [
        Term(f"tier.{name}", float(TIERS.index(tier)), "tier", tier)
        for name, tier in (("tpot_ms", est.tpot_tier), ("ttft_ms", est.ttft_tier))
    ]


def _uint64(value: float) -> int:
    """``value`` rounded, at most :data:`UINT64_MAX` (also for inf and NaN)."""
    return round(value) if 0 <= value < UINT64_MAX else UINT64_MAX


def _verdict(est: Estimate, reason: str, targets: ServingTargets) -> str:
    if reason:
        return "n/a (the plan is infeasible)"
    miss = targets.miss(est)
    return "met" if miss == 0 else f"missed by {miss:.0%}"


def _serving_lines(est: Estimate) -> list[str]:
    sv = est.serving
    if sv is None:
        return []
    return [
        f"serving ({pt_users(est)} users, continuous batching, chunked prefill): TTFT p50 "
        f"{sv.ttft_p50_ms:.4g} / p90 {sv.ttft_p90_ms:.4g} ms, TPOT p50 {sv.tpot_p50_ms:.4g} / "
        f"p90 {sv.tpot_p90_ms:.4g} ms, {est.served_tokens_per_s:.4g} tokens/s "
        f"({est.served_per_device:.4g} per GPU)"
    ]


def pt_users(est: Estimate) -> str:
    """The serving model's load in words: B users over dp replicas."""
    p, b = est.plan, est.point.batch_size
    return f"{b}" if p.dp == 1 else f"{b} over {p.dp} replicas"


class CostModelServicer(cost_model_pb2_grpc.CostModelServicer):
    """kiln.v1.CostModel; errors are ``KilnError`` (mapped by the runtime to status codes).
    ``plan_deadline_s``: see ``PLAN_DEADLINE_S``."""

    def __init__(
        self, plan_deadline_s: float = PLAN_DEADLINE_S, knowledge: Knowledge | None = None
    ) -> None:
        self.plan_deadline_s = plan_deadline_s
        self.knowledge = knowledge
        self._planners = ThreadPoolExecutor(PLAN_WORKERS, thread_name_prefix="kiln-plan")

    def close(self) -> None:
        """Stop the planner threads (a plan under way ends at its deadline)."""
        self._planners.shutdown(wait=False, cancel_futures=True)

    async def _plan(
        self,
        cfg: ModelConfig,
        hw: Hardware,
        point: OperatingPoint,
        n: int,
        dtypes: tuple[str, str],
        targets: ServingTargets,
        evidence: Evidence = NO_EVIDENCE,
    ) -> PlanResult:
        """``plan_workload`` in a planner thread, within ``plan_deadline_s`` from now."""
        deadline = time.monotonic() + self.plan_deadline_s

        def run() -> PlanResult:
            if time.monotonic() > deadline:
                raise PlanDeadlineExceeded("waited for a planner thread past the deadline")
            return plan_workload(
                cfg, hw, point, n, *dtypes, deadline=deadline, targets=targets, evidence=evidence
            )

        loop = asyncio.get_running_loop()
        try:  # the thread stops itself at the deadline; the outer bound is a backstop
            return await asyncio.wait_for(
                loop.run_in_executor(self._planners, run), self.plan_deadline_s + 2.0
            )
        except (PlanDeadlineExceeded, TimeoutError) as exc:
            raise DeadlineExceeded(
                f"planning {cfg.name} on {n} × {hw.name} did not finish within "
                f"{self.plan_deadline_s:g} s ({str(exc) or 'no answer'}); ask for fewer devices or "
                "a shorter OSL"
            ) from None

    def evidence(
        self, spec: common_pb2.ModelSpec, cfg: ModelConfig, hw: Hardware, wdtype: str, adtype: str
    ) -> Evidence:
        """Tiers 2 and 3 for this request (none without a ledger follower); asks the engine
        pool for the model's microbenchmarks when the table lacks them."""
        if self.knowledge is None:
            return NO_EVIDENCE
        self.knowledge.want_microbenchmarks(cfg, hw, wdtype)
        return self.knowledge.evidence(cfg, spec.config_json, spec.dtype, hw, wdtype, adtype)

    async def Plan(
        self, request: cost_model_pb2.PlanRequest, context: Any
    ) -> cost_model_pb2.PlanResponse:
        """Ranked feasible plans (``max_plans`` of them, 0 = all) and the pruned ones."""
        wl = request.workload
        cfg = parse_model(wl.model)
        hw, n = _hardware(wl)
        wdtype, adtype = dtypes(wl.model, cfg)
        point, notes = operating_point(wl)
        targets = targets_of(request.targets)
        evidence = self.evidence(wl.model, cfg, hw, wdtype, adtype)
        result = await self._plan(cfg, hw, point, n, (wdtype, adtype), targets, evidence)
        feasible = result.feasible[: request.max_plans or None]
        log.info(
            "planned",
            model=cfg.name,
            hardware=hw.name,
            devices=n,
            feasible=len(result.feasible),
            pruned=len(result.pruned),
            defaults=notes,
            batch_note=result.batch_note or None,
        )
        return cost_model_pb2.PlanResponse(
            plans=[
                to_proto(
                    e,
                    note=result.note(e),
                    targets=targets,
                    pareto=e.plan.label() in result.frontier,
                    kv_dtype=adtype,
                )
                for e in feasible
            ],
            pruned=[to_proto(e, reason, kv_dtype=adtype) for e, reason in result.pruned],
            hardware_source=hw.source_summary(),
            objective=result.objective,
        )

    async def Explain(
        self, request: cost_model_pb2.ExplainRequest, context: Any
    ) -> cost_model_pb2.ExplainResponse:
        """Every term of one plan's estimate (degrees of 0 read as 1) and a readable text;
        OutOfRange for a degree above ``MAX_DEVICES`` or a batch above ``MAX_BATCH``."""
        wl, rp = request.workload, request.plan
        degrees = {"tp": rp.tp, "ep": rp.ep, "dp": rp.dp, "pp": rp.pp, "dcp": rp.dcp}
        check_plan_degrees({**degrees, "moe_tp": rp.moe_tp}, rp.batch_size)
        cfg = parse_model(wl.model)
        hw, n = _hardware(wl)
        wdtype, adtype = dtypes(wl.model, cfg)
        point, notes = operating_point(wl)
        if rp.batch_size:
            point = replace(point, batch_size=rp.batch_size)
        plan = Parallelism(
            tp=rp.tp or 1,
            ep=rp.ep or 1,
            dp=rp.dp or 1,
            pp=rp.pp or 1,
            dcp=rp.dcp or 1,
            moe_tp=rp.moe_tp,
            kv_dtype=kv_dtype_of(rp, adtype),
        )
        targets = targets_of(request.targets)
        evidence = self.evidence(wl.model, cfg, hw, wdtype, adtype)
        est, reason = evaluate(cfg, hw, point, plan, n, wdtype, adtype, evidence)
        if not reason:
            est = with_serving(cfg, hw, est, wdtype, adtype, evidence)
        terms = [
            cost_model_pb2.Term(name=t.name, value=t.value, unit=t.unit, source=t.source)
            for t in (*est.terms, *serving_terms(est), *tier_terms(est))
        ]
        lossy = "KV cache in FP8 (lossy), as asked" if lossy_kv(est) else ""
        return cost_model_pb2.ExplainResponse(
            plan=to_proto(est, reason, lossy, targets=targets, kv_dtype=adtype),
            terms=terms,
            text=explain_text(est, reason, notes, hw, targets, evidence),
        )

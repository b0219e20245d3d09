"""Enumerate parallelism plans, prune the infeasible ones with a reason, rank the rest.

Plans: ``tp``, ``pp``, ``dp`` powers of two with ``tp x pp x dp <= num_devices``; MoE ``ep`` a
power of two <= ``tp x dp``; ``dcp`` a power of two dividing ``tp / min(tp, kv heads)``.

Pruning reasons (all that apply, joined by "; "): ``devices``, ``heads``, ``kv heads``, ``ffn``,
``experts``, ``layers``, ``dcp`` (divisibility of each by its degree), ``topology`` (groups
within a node), ``interconnect``, ``memory`` (more than ``MEMORY_FRACTION`` of a device),
``estimate`` (non-finite times).

Deadline: :func:`plan_workload` given a ``deadline`` (``time.monotonic()`` value) checks it between
plans and raises :class:`PlanDeadlineExceeded` once it has passed.

Objective: :mod:`kiln.cost_model.objective` -- tokens/s per GPU under TTFT and TPOT targets;
the result also names the plans on the tokens/s-per-GPU vs TPOT Pareto frontier. The best
:data:`SERVED_PLANS` by the step estimate are re-ranked by the serving model
(:mod:`kiln.cost_model.serving`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from kiln.cost_model.hardware import Hardware
from kiln.cost_model.objective import DEFAULT_TARGETS, ServingTargets, frontier, rank
from kiln.cost_model.roofline import Estimate, estimate
from kiln.cost_model.serving import serve
from kiln.cost_model.sharding import Parallelism, kv_heads_for_sharding, kv_replication
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import ModelConfig

MEMORY_FRACTION = 0.9
ESTIMATE_TIER = "roofline"
SERVED_PLANS = 8
"""Best plans (by the step estimate) the serving model runs for, then re-ranked by its figures."""


class PlanDeadlineExceeded(Exception):
    """Planning passed its deadline; the message says how far it got."""


def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit`` inclusive."""
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def candidate_plans(cfg: ModelConfig, num_devices: int) -> list[Parallelism]:
    """Every plan the planner considers for ``num_devices`` devices (see the module docstring)."""
    plans = []
    for tp in powers_of_two(num_devices):
        for pp in powers_of_two(num_devices // tp):
            for dp in powers_of_two(num_devices // (tp * pp)):
                eps = powers_of_two(tp * dp) if cfg.is_moe else [1]
                dcps = [d for d in powers_of_two(tp) if kv_replication(cfg, tp) % d == 0]
                for ep in eps:
                    for dcp in dcps:
                        plans.append(Parallelism(tp=tp, ep=ep, dp=dp, pp=pp, dcp=dcp))
    return plans


def static_reasons(
    cfg: ModelConfig, plan: Parallelism, hw: Hardware, num_devices: int
) -> list[str]:
    """Why ``plan`` cannot run ``cfg`` on ``num_devices`` of ``hw``, memory aside (empty when it
    can).
    """
    r: list[str] = []
    tp, ep = plan.tp, plan.ep
    if min(tp, ep, plan.dp, plan.pp, plan.dcp) < 1:
        return ["plan: every degree must be at least 1"]
    if plan.devices > num_devices:
        r.append(f"devices: tp×pp×dp = {plan.devices} devices, the target has {num_devices}")
    if plan.devices > 1 and hw.interconnect_bandwidth_bytes_per_s <= 0:
        r.append(
            f"interconnect: {hw.name} has no link between devices in the catalogue "
            f"({hw.interconnect}), so a plan spans one device"
        )
    if cfg.num_attention_heads % tp:
        r.append(f"heads: {cfg.num_attention_heads} attention heads not divisible by tp={tp}")
    kvh = cfg.num_key_value_heads
    if cfg.mla is None and (kvh % tp if tp <= kvh else tp % kvh):
        r.append(f"kv heads: {kvh} KV heads neither divisible by nor dividing tp={tp}")
    if cfg.moe_layers_in(range(cfg.num_hidden_layers)) < cfg.num_hidden_layers:
        if cfg.intermediate_size % tp:
            r.append(f"ffn: intermediate_size {cfg.intermediate_size} not divisible by tp={tp}")
    if cfg.moe is None:
        if ep > 1:
            r.append(f"experts: ep={ep} but the model has no experts")
    else:
        if cfg.moe.num_experts % ep:
            r.append(f"experts: {cfg.moe.num_experts} experts not divisible by ep={ep}")
        if ep > tp * plan.dp:
            r.append(f"experts: ep={ep} exceeds tp×dp = {tp * plan.dp} ranks per stage")
        if cfg.moe.intermediate_size % plan.expert_tp:
            r.append(
                f"ffn: moe_intermediate_size {cfg.moe.intermediate_size} not divisible by "
                f"tp/ep = {plan.expert_tp}"
            )
    if cfg.num_hidden_layers % plan.pp:
        r.append(f"layers: {cfg.num_hidden_layers} layers not divisible by pp={plan.pp}")
    if tp % plan.dcp or kv_replication(cfg, tp) % plan.dcp:
        r.append(
            f"dcp: dcp={plan.dcp} must divide the KV replication tp/min(tp, kv heads) = "
            f"{tp}/{min(tp, kv_heads_for_sharding(cfg))}"
        )
    node = hw.max_devices_per_node
    if max(tp, ep) > node:
        r.append(
            f"topology: a TP/EP group of {max(tp, ep)} spans more than one {node}-device node "
            f"({hw.interconnect}); this tier keeps TP, EP and DCP inside a node"
        )
    return r


def memory_reason(est: Estimate, hw: Hardware) -> str | None:
    """The memory reason when ``est`` needs more than ``MEMORY_FRACTION`` of a device, else None."""
    limit = MEMORY_FRACTION * hw.memory_bytes
    if est.memory_bytes_per_device <= limit:
        return None
    g = 1e9
    return (
        f"memory: needs {est.memory_bytes_per_device / g:.1f} GB per device (weights "
        f"{est.weight_bytes_per_device / g:.1f} + KV {est.kv_bytes_per_device / g:.1f} + "
        f"workspace {est.workspace_bytes_per_device / g:.1f} + graph pool and reserved "
        f"{est.overhead_bytes_per_device / g:.1f}) > {MEMORY_FRACTION:g} × "
        f"{hw.memory_bytes / g:g} GB = {limit / g:.1f} GB"
    )


def evaluate(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    plan: Parallelism,
    num_devices: int,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
) -> tuple[Estimate, str]:
    """The estimate of one plan and its infeasibility reason ("" when feasible)."""
    reasons = static_reasons(cfg, plan, hw, num_devices)
    if reasons and reasons[0].startswith("plan:"):
        raise ValueError(reasons[0])
    est = estimate(cfg, hw, point, plan, weight_dtype, act_dtype)
    mem = memory_reason(est, hw)
    if mem:
        reasons.append(mem)
    if not reasons and not all(math.isfinite(v) for v in (est.tpot_ms, est.ttft_ms)):
        reasons.append(f"estimate: TPOT {est.tpot_ms} ms, TTFT {est.ttft_ms} ms are not finite")
    return est, "; ".join(reasons)


@dataclass(frozen=True)
class PlanResult:
    """Feasible estimates best first, pruned ones with reasons, the objective in words, the
    ``targets`` ranked by, the labels of the feasible plans on the Pareto ``frontier``, and
    ``batch_note`` (why the batch planned for is below the traffic's, "" if not).
    """

    feasible: list[Estimate]
    pruned: list[tuple[Estimate, str]]
    objective: str
    targets: ServingTargets = DEFAULT_TARGETS
    frontier: frozenset[str] = frozenset()
    batch_note: str = ""


def plan_workload(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    num_devices: int | None = None,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
    deadline: float | None = None,
    targets: ServingTargets | None = None,
) -> PlanResult:
    """Cost every candidate plan on ``num_devices`` (default the node's) at ``point`` and rank
    the feasible ones under ``targets`` (default :class:`ServingTargets`); when plans fail on
    memory alone, the batch is halved until one fits, with a ``batch_note``.
    PlanDeadlineExceeded once ``time.monotonic()`` passes ``deadline``.
    """
    goal = targets or DEFAULT_TARGETS
    result = _plan_at(cfg, hw, point, num_devices, weight_dtype, act_dtype, deadline, goal)
    batch = point.batch_size
    while not result.feasible and batch > 1 and _memory_only(result):
        batch //= 2
        smaller = replace(point, batch_size=batch)
        lowered = _plan_at(cfg, hw, smaller, num_devices, weight_dtype, act_dtype, deadline, goal)
        if lowered.feasible:
            note = (
                f"batch lowered from {point.batch_size} to {batch}: the KV cache of "
                f"{point.batch_size} sequences of {point.context_len} tokens does not fit "
                f"in {hw.name} memory with any plan"
            )
            return replace(lowered, batch_note=note)
    return result


def _memory_only(result: PlanResult) -> bool:
    return any(reason.startswith("memory:") and ";" not in reason for _, reason in result.pruned)


def _plan_at(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    num_devices: int | None,
    weight_dtype: str,
    act_dtype: str,
    deadline: float | None = None,
    targets: ServingTargets = DEFAULT_TARGETS,
) -> PlanResult:
    n = num_devices or hw.max_devices_per_node
    feasible: list[Estimate] = []
    pruned: list[tuple[Estimate, str]] = []
    plans = candidate_plans(cfg, n)
    for i, plan in enumerate(plans):
        if deadline is not None and i % 64 == 0 and time.monotonic() > deadline:
            raise PlanDeadlineExceeded(
                f"costed {i} of {len(plans)} candidate plans for {n} devices at batch "
                f"{point.batch_size} before the deadline"
            )
        est, reason = evaluate(cfg, hw, point, plan, n, weight_dtype, act_dtype)
        if reason:
            pruned.append((est, reason))
        else:
            feasible.append(est)
    ranked = rank(feasible, targets)
    served = [with_serving(cfg, hw, e, weight_dtype, act_dtype) for e in ranked[:SERVED_PLANS]]
    ranked = rank(served, targets) + ranked[SERVED_PLANS:]
    return PlanResult(ranked, pruned, targets.describe(), targets, frontier(ranked))


def with_serving(
    cfg: ModelConfig, hw: Hardware, est: Estimate, weight_dtype: str, act_dtype: str
) -> Estimate:
    """``est`` with the serving model's figures (:func:`kiln.cost_model.serving.serve`)."""
    stats = serve(cfg, hw, est.point, est.plan, weight_dtype, act_dtype)
    return replace(est, serving=stats)

"""Enumerate parallelism plans, prune the infeasible ones with a reason, rank the rest.

Plans: ``tp``, ``pp``, ``dp`` powers of two with ``tp x pp x dp <= num_devices`` and ``pp <=``
the layers (stages of ``ceil`` or ``floor(L / pp)`` layers, :mod:`kiln.cost_model.sharding`); a
``tp`` wider than a node, pruned by topology, only with the other degrees 1. MoE: ``ep`` a power
of two <= ``tp x dp`` (each expert split by ``tp / ep`` when ``ep < tp``), plus, with ``dp > 1``,
attention DP with MoE TP: the MoE group all ``tp x dp`` ranks of a stage, ``moe_tp`` 2 .. a
node, ``ep = tp x dp / moe_tp`` dividing the experts. ``dcp`` a power of two dividing ``tp /
min(tp, kv heads)``. KV cache: the activation dtype; on hardware with FP8, an FP8 one where
that does not fit or meet the targets (:func:`plan_workload`).

Pruning reasons (all that apply, joined by "; "): ``devices``, ``heads``, ``kv heads``, ``ffn``,
``experts``, ``dcp`` (divisibility of each by its degree), ``layers`` (a stage without layers),
``topology`` (TP, DCP and the TP inside an expert within a node; EP across nodes only over an
inter-node link), ``interconnect``, ``memory`` (more than ``MEMORY_FRACTION`` of a device),
``estimate`` (non-finite times).

Deadline: :func:`plan_workload` given a ``deadline`` (``time.monotonic()`` value) checks it between
plans and raises :class:`PlanDeadlineExceeded` once it has passed.

Objective: :mod:`kiln.cost_model.objective` -- tokens/s per GPU under TTFT and TPOT targets
(lossless KV first); the result also names the plans on the tokens/s-per-GPU vs TPOT Pareto
frontier. The best :data:`SERVED_PLANS` by the step estimate are re-ranked by the serving model
(:mod:`kiln.cost_model.serving`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from kiln.cost_model.estimate import Estimate
from kiln.cost_model.evidence import NO_EVIDENCE, Evidence
from kiln.cost_model.hardware import Hardware
from kiln.cost_model.objective import DEFAULT_TARGETS, ServingTargets, frontier, rank
from kiln.cost_model.roofline import estimate
from kiln.cost_model.serving import serve
from kiln.cost_model.sharding import FP8, Parallelism, kv_heads_for_sharding, kv_replication
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import DTYPE_BYTES, ModelConfig

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


def candidate_plans(cfg: ModelConfig, num_devices: int, node: int = 8) -> list[Parallelism]:
    """Every plan the planner considers for ``num_devices`` devices in nodes of ``node`` (see the
    module docstring)."""
    plans = []
    moe = cfg.moe
    for tp in powers_of_two(num_devices):
        if tp > node:  # TP across nodes: pruned by topology whatever the rest, so one plan each
            plans.append(Parallelism(tp=tp))
            continue
        for pp in powers_of_two(min(num_devices // tp, cfg.num_hidden_layers)):
            for dp in powers_of_two(num_devices // (tp * pp)):
                groups: list[tuple[int, int]] = [(1, 0)]
                if moe is not None:
                    groups = [(ep, 0) for ep in powers_of_two(tp * dp)]
                    if dp > 1:  # attention DP, experts split by TP over the stage's tp x dp
                        groups += [
                            (tp * dp // etp, etp)
                            for etp in powers_of_two(min(node, tp * dp))[1:]
                            if moe.num_experts % (tp * dp // etp) == 0
                            and moe.intermediate_size % etp == 0
                        ]
                dcps = [d for d in powers_of_two(tp) if kv_replication(cfg, tp) % d == 0]
                for ep, etp in groups:
                    for dcp in dcps:
                        plans.append(Parallelism(tp=tp, ep=ep, dp=dp, pp=pp, dcp=dcp, moe_tp=etp))
    return plans


def static_reasons(
    cfg: ModelConfig, plan: Parallelism, hw: Hardware, num_devices: int
) -> list[str]:
    """Why ``plan`` cannot run ``cfg`` on ``num_devices`` of ``hw``, memory aside (empty when it
    can).
    """
    r: list[str] = []
    tp, ep = plan.tp, plan.ep
    if min(tp, ep, plan.dp, plan.pp, plan.dcp) < 1 or plan.moe_tp < 0:
        return ["plan: every degree must be at least 1"]
    if plan.kv_dtype and plan.kv_dtype not in DTYPE_BYTES:
        return [f"plan: KV dtype {plan.kv_dtype!r} is not one of {', '.join(DTYPE_BYTES)}"]
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
    group = plan.expert_shards
    if cfg.moe is None:
        if ep > 1 or plan.moe_tp:
            r.append(f"experts: ep={ep}, moe_tp={plan.expert_tp} but the model has no experts")
    else:
        if cfg.moe.num_experts % ep:
            r.append(f"experts: {cfg.moe.num_experts} experts not divisible by ep={ep}")
        if ep > tp * plan.dp:
            r.append(f"experts: ep={ep} exceeds tp×dp = {tp * plan.dp} ranks per stage")
        elif plan.moe_tp and (group > tp * plan.dp or group % tp or (tp * plan.dp) % group):
            r.append(
                f"experts: the MoE group ep×moe_tp = {group} must be a multiple of tp={tp} "
                f"dividing tp×dp = {tp * plan.dp}"
            )
        if cfg.moe.intermediate_size % plan.expert_tp:
            r.append(
                f"ffn: moe_intermediate_size {cfg.moe.intermediate_size} not divisible by "
                f"moe_tp = {plan.expert_tp}"
            )
    if plan.pp > cfg.num_hidden_layers:
        r.append(
            f"layers: pp={plan.pp} stages for {cfg.num_hidden_layers} layers leave a stage "
            "without layers"
        )
    if tp % plan.dcp or kv_replication(cfg, tp) % plan.dcp:
        r.append(
            f"dcp: dcp={plan.dcp} must divide the KV replication tp/min(tp, kv heads) = "
            f"{tp}/{min(tp, kv_heads_for_sharding(cfg))}"
        )
    node = hw.max_devices_per_node
    widest_tp = max(tp, plan.expert_tp if cfg.moe is not None else 1)
    if widest_tp > node:
        r.append(
            f"topology: a TP group of {widest_tp} spans more than one {node}-device node "
            f"({hw.interconnect}); this tier keeps TP (of attention and inside an expert) and "
            "DCP inside a node"
        )
    if cfg.moe is not None and group > node and hw.inter_node_bandwidth_bytes_per_s <= 0:
        r.append(
            f"topology: an EP group of {group} spans more than one {node}-device node and "
            f"{hw.name} has no inter-node link in the catalogue"
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
    evidence: Evidence = NO_EVIDENCE,
) -> tuple[Estimate, str]:
    """The estimate of one plan (with ``evidence``: tiers 2 and 3) and its infeasibility
    reason ("" when feasible)."""
    reasons = static_reasons(cfg, plan, hw, num_devices)
    if reasons and reasons[0].startswith("plan:"):
        raise ValueError(reasons[0])
    if plan.dp > point.batch_size:
        reasons.append(
            f"replicas: dp={plan.dp} replicas for {point.batch_size} sequences in flight "
            "(some would idle)"
        )
    est = estimate(cfg, hw, point, plan, weight_dtype, act_dtype, evidence)
    mem = memory_reason(est, hw)
    if mem:
        reasons.append(mem)
    if not reasons and not all(math.isfinite(v) for v in (est.tpot_ms, est.ttft_ms)):
        reasons.append(f"estimate: TPOT {est.tpot_ms} ms, TTFT {est.ttft_ms} ms are not finite")
    return est, "; ".join(reasons)


@dataclass(frozen=True)
class PlanResult:
    """Feasible estimates best first, pruned ones with reasons, the objective in words, the
    ``targets`` ranked by, the labels of the feasible plans on the Pareto ``frontier``,
    ``batch_note`` (why the batch planned for is below the traffic's, "" if not) and
    ``kv_notes`` (label: why a plan's KV cache is FP8, for those that are).
    """

    feasible: list[Estimate]
    pruned: list[tuple[Estimate, str]]
    objective: str
    targets: ServingTargets = DEFAULT_TARGETS
    frontier: frozenset[str] = frozenset()
    batch_note: str = ""
    kv_notes: dict[str, str] = field(default_factory=dict)

    def note(self, est: Estimate) -> str:
        """Why ``est``'s plan departs from the workload: its KV-cache note and the batch note."""
        return "; ".join(n for n in (self.kv_notes.get(est.plan.label(), ""), self.batch_note) if n)


def plan_workload(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    num_devices: int | None = None,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
    deadline: float | None = None,
    targets: ServingTargets | None = None,
    evidence: Evidence = NO_EVIDENCE,
) -> PlanResult:
    """Cost every candidate plan on ``num_devices`` (default the node's) at ``point`` and rank
    the feasible ones under ``targets`` (default :class:`ServingTargets`).

    FP8 KV cache (lossy), on hardware with FP8 and a wider activation dtype: a plan pruned for
    memory alone is costed again with an FP8 cache, and when no plan meets the targets every
    feasible one is too (those kept only if one of them then meets the targets); a lossless
    plan ranks before an FP8 one that meets the targets as well
    (:func:`kiln.cost_model.objective.rank`), and each FP8 plan has a ``kv_notes`` entry. When
    plans still fail on memory alone, the batch is halved until one fits, with a
    ``batch_note``.
    PlanDeadlineExceeded once ``time.monotonic()`` passes ``deadline``. ``evidence``: the
    microbenchmark table and calibration every estimate uses (:class:`Evidence`).
    """
    goal = targets or DEFAULT_TARGETS
    ev = evidence
    result = _plan_at(cfg, hw, point, num_devices, weight_dtype, act_dtype, deadline, goal, ev)
    batch = point.batch_size
    while not result.feasible and batch > 1 and _memory_only(result):
        batch //= 2
        smaller = replace(point, batch_size=batch)
        lowered = _plan_at(
            cfg, hw, smaller, num_devices, weight_dtype, act_dtype, deadline, goal, ev
        )
        if lowered.feasible:
            kv = " even with an FP8 KV cache" if _fp8_kv(hw, act_dtype) else ""
            note = (
                f"batch lowered from {point.batch_size} to {batch}: the KV cache of "
                f"{point.batch_size} sequences of {point.context_len} tokens does not fit "
                f"in {hw.name} memory with any plan{kv}"
            )
            return replace(lowered, batch_note=note)
    return result


def _memory_only(result: PlanResult) -> bool:
    return any(_memory_only_reason(reason) for _, reason in result.pruned)


def _memory_only_reason(reason: str) -> bool:
    return reason.startswith("memory:") and ";" not in reason


def _fp8_kv(hw: Hardware, act_dtype: str) -> bool:
    """Whether the planner searches an FP8 KV cache: the device has FP8, the default is wider."""
    return hw.has_fp8 and DTYPE_BYTES[act_dtype] > DTYPE_BYTES[FP8]


def _plan_at(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    num_devices: int | None,
    weight_dtype: str,
    act_dtype: str,
    deadline: float | None = None,
    targets: ServingTargets = DEFAULT_TARGETS,
    evidence: Evidence = NO_EVIDENCE,
) -> PlanResult:
    n = num_devices or hw.max_devices_per_node
    feasible: list[Estimate] = []
    pruned: list[tuple[Estimate, str]] = []
    kv_notes: dict[str, str] = {}

    def cost(plans: list[Parallelism], what: str) -> None:
        for i, plan in enumerate(plans):
            if deadline is not None and i % 64 == 0 and time.monotonic() > deadline:
                raise PlanDeadlineExceeded(
                    f"costed {i} of {len(plans)} {what} for {n} devices at batch "
                    f"{point.batch_size} before the deadline"
                )
            est, reason = evaluate(cfg, hw, point, plan, n, weight_dtype, act_dtype, evidence)
            if reason:
                pruned.append((est, reason))
            else:
                feasible.append(est)

    cost(candidate_plans(cfg, n, hw.max_devices_per_node), "candidate plans")
    fp8 = _fp8_kv(hw, act_dtype)
    if fp8:  # an FP8 cache for the plans whose KV cache alone does not fit
        saved = 1 - DTYPE_BYTES[FP8] / DTYPE_BYTES[act_dtype]
        limit = MEMORY_FRACTION * hw.memory_bytes
        tight = [
            e.plan
            for e, reason in pruned
            if _memory_only_reason(reason)
            and e.memory_bytes_per_device - e.kv_bytes_per_device * saved <= limit
        ]
        before = len(feasible)
        cost([replace(p, kv_dtype=FP8) for p in tight], "plans with an FP8 KV cache")
        for e in feasible[before:]:
            kv_notes[e.plan.label()] = (
                f"KV cache in FP8 (lossy): with a {act_dtype} cache this plan needs more than "
                f"{MEMORY_FRACTION:g} of {hw.name} memory at batch {point.batch_size}"
            )
    dtypes = (weight_dtype, act_dtype)
    ranked = _served(cfg, hw, rank(feasible, targets), targets, dtypes, evidence)
    if fp8 and ranked and all(targets.miss(e) > 0 for e in ranked):  # none meets them: FP8 KV
        before, kept = len(feasible), len(pruned)
        lossless = [e.plan for e in feasible if not e.plan.kv_dtype]
        cost([replace(p, kv_dtype=FP8) for p in lossless], "plans with an FP8 KV cache")
        served = {e.plan: e for e in ranked if e.serving is not None}
        merged = [served.get(e.plan, e) for e in feasible]
        retry = _served(cfg, hw, rank(merged, targets), targets, dtypes, evidence)
        if targets.miss(retry[0]) == 0:  # kept only where an FP8 cache meets the targets
            ranked = retry
            for e in feasible[before:]:
                kv_notes[e.plan.label()] = (
                    f"KV cache in FP8 (lossy): no plan with a {act_dtype} cache meets the targets"
                )
        else:
            del feasible[before:], pruned[kept:]
    served_plans = [e for e in ranked if e.serving is not None]  # one measure on the frontier
    return PlanResult(
        ranked, pruned, targets.describe(), targets, frontier(served_plans), kv_notes=kv_notes
    )


def _served(
    cfg: ModelConfig,
    hw: Hardware,
    ranked: list[Estimate],
    targets: ServingTargets,
    dtypes: tuple[str, str],
    evidence: Evidence = NO_EVIDENCE,
) -> list[Estimate]:
    """``ranked`` with the serving model's figures for its best :data:`SERVED_PLANS` (those
    without them yet), re-ranked by them."""
    served = [
        e if e.serving is not None else with_serving(cfg, hw, e, *dtypes, evidence)
        for e in ranked[:SERVED_PLANS]
    ]
    return rank(served, targets) + ranked[SERVED_PLANS:]


def with_serving(
    cfg: ModelConfig,
    hw: Hardware,
    est: Estimate,
    weight_dtype: str,
    act_dtype: str,
    evidence: Evidence = NO_EVIDENCE,
) -> Estimate:
    """``est`` with the serving model's figures (:func:`kiln.cost_model.serving.serve`)."""
    stats = serve(cfg, hw, est.point, est.plan, weight_dtype, act_dtype, evidence)
    return replace(est, serving=stats)

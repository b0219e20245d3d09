"""The microbenchmark tier of one forward pass: the sum of its ops' measured times.

A pass over ``tokens`` tokens (decode: the replica's batch, one token each over ``context``
cached tokens; prefill: one prompt of ``tokens``) on one device costs, per layer, its GEMMs at
``m = tokens`` (:func:`kiln.cost_model.op_shapes.layer_gemms`), its attention and, in a MoE
layer, ``distinct experts x expert(tokens per expert)`` on the busiest rank; times the layers
(stretched as the roofline stretches uneven stages), plus the LM head at ``logit_tokens``. Each
op is read off the device's :class:`~kiln.cost_model.microbench_table.MicrobenchTable`; one it
lacks is the roofline's ``max(bytes / (bandwidth x e_bw), FLOPs / (rate x e_c))`` with the
table's measured efficiencies ``e_bw``, ``e_c``. Launch overhead and communication are the
caller's (the roofline pass: kernels x the table's measured launch cost, collectives from the
catalogue). The pass is tier ``microbenchmark`` when at least half its time was read off the
table, else ``roofline``; every op is a term naming how it was read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.cost_model.attention_span import causal_pairs, layer_groups
from kiln.cost_model.estimate import Terms
from kiln.cost_model.hardware import Hardware
from kiln.cost_model.interpolate import Lookup
from kiln.cost_model.microbench_table import MicrobenchTable
from kiln.cost_model.op_shapes import attention_heads, expert_dims, layer_gemms, lm_head
from kiln.cost_model.sharding import ExpertLoad, LayerShard, Parallelism
from kiln.workloads.config import DTYPE_BYTES, ModelConfig

MICROBENCHMARK = "microbenchmark"
ROOFLINE = "roofline"
MEASURED = "measured"
TIERS = (ROOFLINE, MICROBENCHMARK, MEASURED)
"""The tiers, least to most direct (``estimate_tier`` words)."""
MEASURED_SHARE = 0.5
"""Share of a pass's op time that must come off the table for it to be tier 2."""


@dataclass(frozen=True)
class MeasuredPass:
    """A pass's op time, ms (no launch overhead, no communication), the part read off the
    table, and its tier."""

    ms: float
    measured_ms: float
    tier: str


class _Ops:
    """Accumulates op times, measured or fallen back to the efficiency-scaled roofline."""

    def __init__(self, table: MicrobenchTable, hw: Hardware, wdtype: str, adtype: str) -> None:
        self.table, self.hw = table, hw
        rate = hw.flops_for(wdtype)
        self.bw_eff, self.fl_eff = table.efficiency(wdtype, hw.memory_bandwidth_bytes_per_s, rate)
        self.bw = hw.memory_bandwidth_bytes_per_s * self.bw_eff
        self.rate = rate * self.fl_eff
        self.wb, self.ab = DTYPE_BYTES[wdtype], DTYPE_BYTES[adtype]
        self.total = self.measured = 0.0
        self.how: dict[str, str] = {}

    def add(
        self, name: str, count: float, found: Lookup | None, nbytes: float, flops: float
    ) -> float:
        """``count`` x the op's time (the table's, else the roofline's), ms."""
        if found is not None:
            ms = found.ms * count
            self.measured += ms
            self.how[name] = found.how
        else:
            ms = max(nbytes / self.bw, flops / self.rate) * 1e3 * count
            self.how[name] = "roofline"
        self.total += ms
        return ms


def measured_pass(
    t: Terms,
    phase: str,
    cfg: ModelConfig,
    hw: Hardware,
    plan: Parallelism,
    table: MicrobenchTable,
    *,
    tokens: int,
    context: int,
    logit_tokens: int,
    kinds: tuple[LayerShard, LayerShard],
    layers: tuple[float, float],
    load: ExpertLoad | None,
    wdtype: str,
    adtype: str,
) -> MeasuredPass:
    """The pass's op time on ``table``'s device (see the module docs); records terms under
    ``{phase}.op.*``. ``layers``: (dense, MoE) layer counts, stretched; ``load``: the busiest
    rank's expert load (None for a dense model)."""
    ops = _Ops(table, hw, wdtype, adtype)
    gdtype = wdtype
    by_name: dict[str, float] = {}
    m = max(1, tokens)
    heads, kvh = attention_heads(cfg, plan.tp)
    d = cfg.head_dim
    spans = layer_groups(cfg)
    span_layers = sum(g.layers for g in spans)
    for shard, count in zip(kinds, layers, strict=True):
        if not count or not shard.always_read:
            continue
        for name, n, k in layer_gemms(cfg, plan, shard):
            found = table.gemm(m, n, k, gdtype)
            ms = ops.add(name, count, found, n * k * ops.wb, 2.0 * m * n * k)
            by_name[name] = by_name.get(name, 0.0) + ms
        for group in spans:  # each span's share of the layers (sliding, sparse, full)
            share = count * group.layers / span_layers
            if phase == "decode":
                gctx = max(1, -(-group.attended(context) // plan.dcp))
                att = None if cfg.mla else table.attention_decode(m, gctx, heads, kvh, d, adtype)
                kv = m * gctx * 2 * kvh * d * ops.ab
                flops = 4.0 * m * heads * gctx * d
            else:  # a table's prefill is full-causal: scaled by the span's share of the pairs
                cut = causal_pairs(m, group.span) / causal_pairs(m)
                found = None if cfg.mla else table.attention_prefill(m, heads, kvh, d, adtype)
                att = None if found is None else found.scaled(cut)
                kv = m * 2 * kvh * d * ops.ab
                flops = 2.0 * heads * m * m * d * cut
            by_name["attention"] = by_name.get("attention", 0.0) + ops.add(
                "attention", share, att, kv, flops
            )
        if shard.routed_expert and load is not None and load.distinct_experts > 0:
            dims = expert_dims(cfg, plan)
            assert dims is not None
            per_expert = load.assignments / load.distinct_experts
            found = table.expert(
                per_expert, *dims, adtype if gdtype.startswith("float8") else gdtype
            )
            ms = ops.add(
                "experts",
                count * load.distinct_experts,
                found,
                shard.routed_expert * ops.wb,
                2.0 * per_expert * shard.routed_expert,
            )
            by_name["experts"] = by_name.get("experts", 0.0) + ms
    name, n, k = lm_head(cfg, plan.tp)
    lt = max(1, logit_tokens)
    by_name[name] = ops.add(name, 1, table.gemm(lt, n, k, gdtype), n * k * ops.wb, 2.0 * lt * n * k)
    where = f"microbenchmark table {table.label()}"
    fallback = "not in the table: roofline at the measured efficiency"
    for op, ms in by_name.items():
        how = ops.how[op]
        t.add(
            f"{phase}.op.{op}_ms", ms, "ms", f"{how} ({fallback if how == 'roofline' else where})"
        )
    t.add(
        f"{phase}.measured_efficiency",
        ops.bw_eff,
        "fraction",
        f"bandwidth efficiency of the measured small-m GEMMs (compute: {ops.fl_eff:.3g}); "
        "what an op missing from the table is costed at",
    )
    share = ops.measured / ops.total if ops.total > 0 else 0.0
    tier = MICROBENCHMARK if share >= MEASURED_SHARE else ROOFLINE
    t.add(
        f"{phase}.measured_share",
        share,
        "fraction",
        f"of the op time read off the table ({tier} tier at >= {MEASURED_SHARE:g})",
    )
    return MeasuredPass(ops.total, ops.measured, tier)

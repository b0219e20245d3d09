"""The ops one forward of a plan is made of, at their shapes on one device, and the
microbenchmark request that measures them.

A decoder layer on one TP rank is a list of GEMMs (:func:`layer_gemms`): QKV and output
projections (MLA: one GEMM of its attention weights, ``n = weights / hidden``), the dense FFN's
gate/up and down, the router and the shared experts; plus attention (:func:`attention_heads`)
and, in a MoE layer, the routed experts (one expert's ``hidden x intermediate / moe_tp``). The
LM head is ``n = V / tp``, ``k = hidden``. :func:`request_for` asks for every such shape of
the tp degrees a node allows, at token counts up to the grid of :class:`Grid`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.common.microbench_wire import (
    MAX_ELEMENTS,
    MAX_POINTS,
    AttentionShape,
    ExpertShape,
    GemmShape,
    MicrobenchRequest,
)
from kiln.cost_model.sharding import LayerShard, Parallelism, layer_kinds
from kiln.workloads.config import ModelConfig

Gemm = tuple[str, int, int]
"""(name, n, k) of ``x[m, k] @ w[k, n]``."""


@dataclass(frozen=True)
class Grid:
    """Token counts and contexts a microbenchmark run measures at: ``ms`` GEMM rows (decode
    batches and prefill chunks), decode ``batches`` x ``contexts``, ``prompts`` for prefill
    attention, ``expert_tokens`` per routed expert, and the run's ``budget_s``."""

    ms: tuple[int, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prompts: tuple[int, ...]
    expert_tokens: tuple[int, ...]
    budget_s: float


CPU_GRID = Grid(
    ms=(1, 4, 16, 64, 256),
    batches=(1, 4, 16),
    contexts=(64, 256, 1024),
    prompts=(64, 256, 1024),
    expert_tokens=(1, 4, 16, 64),
    budget_s=20.0,
)
"""Small enough that a CPU run of a small model takes seconds (CI)."""
GPU_GRID = Grid(
    ms=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
    batches=(1, 8, 32, 128),
    contexts=(512, 2048, 8192, 32768),
    prompts=(256, 1024, 4096, 8192),
    expert_tokens=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    budget_s=120.0,
)


def grid_for(device_kind: str) -> Grid:
    """:data:`CPU_GRID` for the CPU, else :data:`GPU_GRID`."""
    return CPU_GRID if device_kind == "cpu" else GPU_GRID


def _ffn(elements: float, hidden: int, name: str) -> list[Gemm]:
    """Gate/up and down of an FFN of ``elements`` weights (3 x hidden x inter)."""
    inter = round(elements / (3 * hidden))
    return (
        [(f"{name}_gate_up", 2 * inter, hidden), (f"{name}_down", hidden, inter)] if inter else []
    )


def layer_gemms(cfg: ModelConfig, plan: Parallelism, shard: LayerShard) -> list[Gemm]:
    """The GEMMs of one layer on one device (routed experts apart); see the module docs."""
    h = cfg.hidden_size
    out: list[Gemm] = []
    if shard.attention:
        if cfg.mla is not None:
            out.append(("attention_proj", round(shard.attention / h), h))
        else:
            heads, kvh = attention_heads(cfg, plan.tp)
            d = cfg.head_dim
            out += [("qkv_proj", (heads + 2 * kvh) * d, h), ("o_proj", h, heads * d)]
    out += _ffn(shard.dense_ffn, h, "mlp")
    if shard.router:
        out.append(("router", round(shard.router / h), h))
    out += _ffn(shard.shared_experts, h, "shared_experts")
    return out


def lm_head(cfg: ModelConfig, tp: int) -> Gemm:
    """The LM head's vocab-parallel shard."""
    return ("lm_head", -(-cfg.vocab_size // tp), cfg.hidden_size)


def attention_heads(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """(query heads, KV heads) on one TP rank (KV heads replicated when tp exceeds them)."""
    return cfg.num_attention_heads // tp, max(1, cfg.num_key_value_heads // tp)


def expert_dims(cfg: ModelConfig, plan: Parallelism) -> tuple[int, int] | None:
    """(hidden, intermediate / moe_tp) of one routed expert's slice; None for a dense model."""
    if cfg.moe is None:
        return None
    return cfg.hidden_size, max(1, cfg.moe.intermediate_size // plan.expert_tp)


def request_for(
    cfg: ModelConfig,
    device_kind: str,
    dtype: str,
    tps: tuple[int, ...] = (1,),
    grid: Grid | None = None,
) -> MicrobenchRequest:
    """The microbenchmarks that cover ``cfg``'s ops at tp in ``tps`` on ``device_kind``
    (attention skipped for MLA, whose absorbed kernels are not SDPA's)."""
    g = grid or grid_for(device_kind)
    gemms: dict[tuple[int, int], None] = {}
    attn: dict[tuple[int, int, int], None] = {}
    experts: dict[tuple[int, int], None] = {}
    for tp in tps:
        plan = Parallelism(tp=tp)
        for shard in layer_kinds(cfg, plan):
            for _, n, k in layer_gemms(cfg, plan, shard):
                gemms[(n, k)] = None
        _, n, k = lm_head(cfg, tp)
        gemms[(n, k)] = None
        if cfg.mla is None and cfg.num_attention_heads % tp == 0:
            heads, kvh = attention_heads(cfg, tp)
            if heads % kvh == 0:
                attn[(heads, kvh, cfg.head_dim)] = None
        dims = expert_dims(cfg, plan)
        if dims:
            experts[dims] = None
    top = max(g.batches)
    shapes = [
        AttentionShape(heads=a, kv_heads=b, head_dim=d, batches=list(g.batches), contexts=cs)
        for a, b, d in attn
        if (cs := [c for c in g.contexts if top * c * b * d <= MAX_ELEMENTS])
    ][:8]
    prefill = [
        AttentionShape(heads=a, kv_heads=b, head_dim=d, contexts=cs)
        for a, b, d in attn
        if (cs := [c for c in g.prompts if c * max(a, b) * d <= MAX_ELEMENTS])
    ][:8]
    moe = [
        ExpertShape(hidden=h, intermediate=i, tokens=list(g.expert_tokens))
        for h, i in list(experts)[:8]
    ]
    room = MAX_POINTS - 1 - sum(len(a.batches) * len(a.contexts) for a in shapes)
    room -= sum(len(a.contexts) for a in prefill) + sum(len(e.tokens) for e in moe)
    gemm_shapes: list[GemmShape] = []
    for n, k in list(gemms)[:128]:  # tp = 1 first: the shapes of the first plans
        ms = [m for m in g.ms if m * max(n, k) <= MAX_ELEMENTS]
        if n * k > MAX_ELEMENTS or not ms or len(ms) > room:
            continue
        gemm_shapes.append(GemmShape(n=n, k=k, ms=ms))
        room -= len(ms)
    return MicrobenchRequest(
        device_kind=device_kind,
        dtype=dtype,
        model_name=cfg.name[:128],
        gemm=gemm_shapes,
        attention_decode=shapes,
        attention_prefill=prefill,
        moe_expert=moe,
        budget_s=g.budget_s,
    )

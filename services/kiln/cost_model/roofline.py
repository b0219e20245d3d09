"""Roofline estimates of one parallelism plan: memory per device, TPOT, TTFT and throughput.

Pure functions of a model config, hardware and plan; every number is a :class:`Term` for
``Explain``. The model (Williams et al., CACM 2009; Pope et al., MLSys 2023):

- DP replicas share the traffic: of the B sequences in flight each replica decodes
  ``b = ceil(B / dp)``.
- Decode step (b sequences of one replica): ``max(bytes / achievable bandwidth, FLOPs / dense
  rate) + kernels x kernel overhead + comm``. Bytes: the weights a step touches (embedding: b
  rows; MoE: experts routed to) plus the KV the b sequences' attention reads in the plan's KV
  dtype: per layer the tokens it attends (full: context; sliding window: min(context, window);
  GLM-5's DSA: min(context, top-k) latents plus the indexer keys of all context tokens;
  :mod:`kiln.cost_model.attention_span`). FLOPs: 2 per weight per token plus attention over the
  same tokens (DSA: plus the indexer's scoring of every context token). Kernels:
  :data:`DENSE_LAYER_KERNELS` a dense layer, :data:`MOE_LAYER_KERNELS` a MoE layer,
  :data:`STEP_KERNELS` a step.
- Communication: ring all-reduce ``bytes x 2(n-1)/n / link + latency + (n-1) x per-peer
  latency``; TP two all-reduces of b x hidden per layer; EP all-to-all of b x top_k x hidden
  per MoE layer (:func:`all_to_all_s`: over the inter-node link for the off-node share when
  the group spans nodes); DCP one all-reduce per layer; PP b x hidden between stages (over the
  inter-node link where a send crosses nodes).
- Attention DP (the MoE group spans ``r`` DP replicas): attention of the replica's b
  sequences, experts over the group's ``b x r`` tokens; with ``moe_tp > 1`` the tokens are
  all-gathered over the group and reduce-scattered back (one ring all-reduce of ``b x r x
  hidden`` over the group, in place of the MoE layer's FFN all-reduce), else all-to-all.
- Pipeline: one micro-batch through all stages plus (pp-1) sends, no bubbles; every stage is
  charged as long as the largest, ``ceil(L / pp)`` layers (the pace of a pipelined engine), so
  uneven stages cost ``pp x ceil(L / pp) / L`` of the layers' time.
- TTFT: one ISL prompt alone, compute against reading the weights once plus communication;
  attention over the causal pairs within each layer's span (DSA: plus the indexer over all
  causal pairs); the KV written is every token's in every layer.
- Throughput = ``B / TPOT`` output tokens/s; per device ``B / TPOT / (tp x pp x dp)``.

MLA: decode in the absorbed form, prefill expanded. FP8 block scales (of weights or KV) are not
counted; an FP8 KV cache is read at its own bytes and computed on as BF16.
"""

from __future__ import annotations

from kiln.cost_model import attention_span
from kiln.cost_model.communication import all_to_all_s, collective_s, pp_inter_node_sends
from kiln.cost_model.estimate import Estimate, Terms
from kiln.cost_model.evidence import NO_EVIDENCE, Evidence
from kiln.cost_model.hardware import Hardware
from kiln.cost_model.memory_terms import PREFILL_CHUNK_TOKENS, graph_pool_bytes, workspace_bytes
from kiln.cost_model.sharding import (
    LayerShard,
    Parallelism,
    expert_load,
    kv_bytes_per_device,
    kv_dtype_name,
    kv_shards,
    largest_stage_layers,
    layer_counts,
    layer_kinds,
    replica_batch,
    stored_weights_per_device,
    vocab_shard,
)
from kiln.cost_model.tier2 import MEASURED, ROOFLINE, measured_pass
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import DTYPE_BYTES, ModelConfig

DENSE_LAYER_KERNELS = 8
"""Kernels of a dense decoder layer's decode step: input norm, QKV, RoPE and cache write,
attention, output projection, residual norm, gate/up with activation, down (vLLM's CUDA-graph
path fuses about this far)."""
MOE_LAYER_KERNELS = 12
"""A MoE layer: the dense layer's attention half, router, top-k, token sort, two grouped expert
GEMMs, activation and combine."""
STEP_KERNELS = 4
"""Once a step: embedding, final norm, LM head, sampling."""


def step_kernels(cfg: ModelConfig) -> int:
    """Kernels of one forward step (see the module docs)."""
    n_dense, n_moe = layer_counts(cfg)
    return n_dense * DENSE_LAYER_KERNELS + n_moe * MOE_LAYER_KERNELS + STEP_KERNELS


def _pass(
    t: Terms,
    phase: str,
    cfg: ModelConfig,
    hw: Hardware,
    plan: Parallelism,
    *,
    tokens: int,
    logit_tokens: int,
    ep_tokens: float,
    skew: float,
    attention_flops: float,
    kv_bytes: float,
    wdtype: str,
    adtype: str,
    kv_source: str = "KV cache read (decode) or written",
    attention_source: str = "",
    kinds: tuple[LayerShard, LayerShard] | None = None,
    context: int = 0,
    evidence: Evidence = NO_EVIDENCE,
) -> tuple[float, str]:
    """Seconds of one forward over ``tokens`` on one TP group through the pipeline; records terms
    under ``phase``. ``ep_tokens``: tokens the MoE group sees (attention DP: every replica's);
    ``attention_flops`` and ``kv_bytes`` over all layers (:mod:`kiln.cost_model.attention_span`),
    stretched like the layers when the stages are uneven, ``kv_source`` and ``attention_source``
    saying how they were counted; ``kinds``: :func:`layer_kinds` of the plan, when already known.
    ``evidence``: with a microbenchmark table the ops' time is the table's
    (:mod:`kiln.cost_model.tier2`, ``context`` the attention's) and a kernel's launch cost the
    measured one; with a calibration a decode pass's device time (ops and launches, not the
    collectives) is multiplied by its factor. Returns (seconds, tier of the number).
    """
    dense_layer, moe_layer = kinds or layer_kinds(cfg, plan)
    n_dense, n_moe = layer_counts(cfg)
    layers = cfg.num_hidden_layers
    # every stage charged as the largest: pp x ceil(L/pp) layer-times (L when stages are even)
    stretch = plan.pp * largest_stage_layers(cfg, plan.pp) / layers
    n_dense_s, n_moe_s, layers_s = n_dense * stretch, n_moe * stretch, layers * stretch
    attention_flops, kv_bytes = attention_flops * stretch, kv_bytes * stretch
    h, wb, ab = cfg.hidden_size, DTYPE_BYTES[wdtype], DTYPE_BYTES[adtype]
    head = vocab_shard(cfg, plan.tp) + h
    always = n_dense_s * dense_layer.always_read + n_moe_s * moe_layer.always_read + head
    expert_read = expert_flops = 0.0
    load = None
    if cfg.moe is not None and n_moe:
        load = expert_load(cfg.moe, plan, ep_tokens, skew)
        t.add(
            f"{phase}.experts_touched_per_rank",
            load.distinct_experts,
            "experts",
            f"{load.experts_per_rank:g} experts per EP rank × (1 − (1 − p)^T), T = "
            f"{load.tokens:g} tokens, p = min(1, min(skew, ep) × top_k / E) = {load.p_hot:.4g}",
        )
        expert_read = n_moe_s * load.distinct_experts * moe_layer.routed_expert
        expert_flops = n_moe_s * 2 * moe_layer.routed_expert * load.assignments
    stages = (
        ""
        if stretch == 1
        else f"; layers × pp·ceil(L/pp)/L = {plan.pp * largest_stage_layers(cfg, plan.pp)}/"
        f"{layers}: every stage charged as the largest"
    )
    weight_bytes = t.add(
        f"{phase}.weight_bytes_read",
        (always + expert_read) * wb,
        "bytes",
        f"(per-device weights of all {layers} layers, final norm and LM head "
        f"(V·h/tp); routed experts only where touched) × {wb} B ({wdtype}); the embedding "
        f"table is not read, only B rows of it{stages}",
    )
    kv = t.add(f"{phase}.kv_bytes", kv_bytes, "bytes", kv_source)
    bw = hw.achievable_bandwidth_bytes_per_s
    mem_s = t.add(
        f"{phase}.memory_time_ms",
        (weight_bytes + kv) / bw * 1e3,
        "ms",
        f"bytes / ({hw.memory_bandwidth_bytes_per_s:.4g} B/s × "
        f"{hw.achievable_bandwidth_fraction:.4g} achievable)",
    )
    flops = t.add(
        f"{phase}.flops",
        2 * (always - head) * tokens + 2 * head * logit_tokens + expert_flops + attention_flops,
        "FLOP",
        f"2 × per-device weights × {tokens} tokens (LM head × {logit_tokens}) + 2 × expert "
        f"slice × token-expert assignments on the busiest rank + attention "
        f"{attention_flops:.4g}{attention_source}",
    )
    rate = hw.flops_for(wdtype)
    cmp_s = t.add(
        f"{phase}.compute_time_ms", flops / rate * 1e3, "ms", f"FLOPs / {rate:.4g} FLOP/s dense"
    )
    node = hw.max_devices_per_node
    act = tokens * h * ab
    group = plan.expert_shards
    gather = cfg.moe is not None and n_moe > 0 and plan.attention_dp and plan.expert_tp > 1
    # attention DP with experts split by TP: the MoE layers' FFN all-reduce becomes the group's
    # all-gather + reduce-scatter below
    tp_reduces = 2 * layers_s - (n_moe_s if gather else 0.0)
    tp_s = tp_reduces * collective_s(hw, act, plan.tp)
    ep_s = gather_s = 0.0
    if gather:
        gather_s = n_moe_s * collective_s(hw, ep_tokens * h * ab, group, across_nodes=group > node)
    elif plan.ep > 1 and cfg.moe is not None:
        ep_s = 2 * n_moe_s * all_to_all_s(hw, tokens * cfg.moe.top_k * h * ab, plan.ep)
    dcp_s = layers_s * collective_s(hw, act, plan.dcp)
    cross = pp_inter_node_sends(plan, node)
    pp_s = 0.0
    if plan.pp > 1:
        near = collective_s(hw, act, 2, ring=False)
        far = collective_s(hw, act, 2, ring=False, across_nodes=True)
        pp_s = sum(n * t for n, t in ((plan.pp - 1 - cross, near), (cross, far)) if n)
    link = f"over {hw.interconnect} at {hw.interconnect_bandwidth_bytes_per_s:.4g} B/s"
    t.add(
        f"{phase}.tp_allreduce_ms",
        tp_s * 1e3,
        "ms",
        f"{tp_reduces:.10g} all-reduces (2 per layer{'; MoE layers 1' if gather else ''}) × "
        f"({tokens}·h·{ab} B × 2(tp−1)/tp / link + {hw.collective_latency_s * 1e6:g} us + "
        f"(tp−1) × {hw.collective_latency_per_peer_s * 1e6:g} us) {link}",
    )
    wide = plan.ep > node or group > node
    inter = (
        f"; the group spans {-(-max(plan.ep, group) // node)} nodes: off-node share over "
        f"{hw.inter_node} at {hw.inter_node_bandwidth_bytes_per_s:.4g} B/s, "
        f"{hw.inter_node_latency_s * 1e6:g} us"
        if wide
        else ""
    )
    t.add(
        f"{phase}.ep_alltoall_ms",
        ep_s * 1e3,
        "ms",
        f"dispatch + combine per MoE layer: {tokens}·top_k·h·{ab} B × (ep−1)/ep / link + "
        f"latency{inter if not gather else ''}",
    )
    t.add(
        f"{phase}.moe_gather_ms",
        gather_s * 1e3,
        "ms",
        f"attention DP with experts split by moe_tp = {plan.expert_tp}: per MoE layer an "
        f"all-gather + reduce-scatter of the group's {ep_tokens:.10g} tokens·h·{ab} B over "
        f"ep × moe_tp = {group} ranks (a ring all-reduce){inter if gather else ''}"
        if gather
        else "none: no MoE group spanning DP replicas with experts split by TP",
    )
    t.add(f"{phase}.dcp_merge_ms", dcp_s * 1e3, "ms", "1 all-reduce of tokens·h per layer")
    t.add(
        f"{phase}.pp_send_ms",
        pp_s * 1e3,
        "ms",
        f"(pp−1) sends of tokens·h between stages, {cross} of them between nodes over "
        f"{hw.inter_node}",
    )
    layer_kernels = n_dense_s * DENSE_LAYER_KERNELS + n_moe_s * MOE_LAYER_KERNELS
    kernels = layer_kernels + STEP_KERNELS
    core_s, tier = max(mem_s, cmp_s) / 1e3, ROOFLINE
    per_kernel_s, per_kernel_src = hw.kernel_overhead_s, "the catalogue's"
    table = evidence.table
    if table is not None:
        mp = measured_pass(
            t,
            phase,
            cfg,
            hw,
            plan,
            table,
            tokens=tokens,
            context=context,
            logit_tokens=logit_tokens,
            kinds=(dense_layer, moe_layer),
            layers=(n_dense_s, n_moe_s),
            load=load,
            wdtype=wdtype,
            adtype=adtype,
        )
        core_s = t.add(f"{phase}.measured_ops_ms", mp.ms, "ms", f"sum of the ops ({mp.tier})")
        core_s, tier = core_s / 1e3, mp.tier
        launch = table.launch(graph=evidence.graphs and phase == "decode")
        if launch is not None:
            per_kernel_s, per_kernel_src = launch.ms / 1e3, f"measured on {table.label()}"
    launch_s = kernels * per_kernel_s
    t.add(
        f"{phase}.kernel_overhead_ms",
        launch_s * 1e3,
        "ms",
        f"{kernels:.10g} kernels ({n_dense} dense layers × {DENSE_LAYER_KERNELS} + {n_moe} MoE "
        f"layers × {MOE_LAYER_KERNELS}{' stretched' if stretch != 1 else ''} + {STEP_KERNELS}) "
        f"× {per_kernel_s * 1e6:.4g} us ({per_kernel_src})",
    )
    fixed_s = (
        t.add(
            f"{phase}.fixed_ms",
            (launch_s + tp_s + ep_s + gather_s + dcp_s + pp_s) * 1e3,
            "ms",
            "kernel overhead + communication: what overlaps neither memory nor math",
        )
        / 1e3
    )
    cal = evidence.calibration if phase == "decode" else evidence.prefill_calibration
    if cal is None:
        return core_s + fixed_s, tier
    device_s = core_s + launch_s
    t.add(f"{phase}.uncalibrated_ms", (core_s + fixed_s) * 1e3, "ms", f"the {tier} tier's step")
    t.add(
        f"{phase}.calibration_factor",
        cal.factor,
        "x",
        f"measured {'passes' if phase == 'decode' else 'prefills'} of this model on {hw.name}: "
        f"{cal.describe()}; multiplies the device "
        "time (ops and launches), not the collectives",
    )
    t.add(f"{phase}.calibration_residual", cal.residual, "fraction", cal.describe())
    return device_s * cal.factor + (fixed_s - launch_s), MEASURED


def estimate(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    plan: Parallelism,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
    evidence: Evidence = NO_EVIDENCE,
    prefill_prompts: int = 1,
) -> Estimate:
    """The estimate of ``plan`` for ``cfg`` on ``hw`` at ``point``; ``weight_dtype`` sets
    weight bytes and matmul rate, ``act_dtype`` activation and communication bytes and the KV
    cache's unless ``plan.kv_dtype`` sets it. ms, bytes, output tokens/s. ``evidence``: the
    microbenchmark table and decode calibration (:class:`Evidence`); without, the roofline
    tier alone. The estimate's ``tpot_tier`` and ``ttft_tier`` say which tier produced each.
    ``prefill_prompts``: prompts of ISL tokens the prefill pass takes at once (1: TTFT of one
    prompt; an engine's timed prefill is ``batch`` prompts of ``context`` tokens).
    """
    if prefill_prompts < 1:
        raise ValueError(f"prefill_prompts must be >= 1, got {prefill_prompts}")
    t = Terms()
    B, ctx, isl = point.batch_size, point.context_len, point.isl
    kv_dtype = plan.kv_dtype or act_dtype
    b = int(
        t.add(
            "decode.replica_batch",
            replica_batch(B, plan.dp),
            "sequences",
            f"ceil(B / dp) = ceil({B} / {plan.dp}): the DP replicas share the traffic",
        )
    )
    r = plan.replicas_per_ep_group
    group_tokens = t.add(
        "decode.moe_group_tokens",
        b * r,
        "tokens",
        (
            f"attention DP: the MoE group of ep × moe_tp = {plan.expert_shards} ranks spans "
            f"{r} DP replicas; each replica's attention (weights split by tp = {plan.tp}, KV of "
            f"its own b = {b} sequences) feeds the group's experts b × {r} tokens"
            if plan.attention_dp
            else f"b = {b}: the MoE group of {plan.expert_shards} ranks lies inside one replica"
            if cfg.moe is not None
            else f"b = {b}: a dense model, no experts"
        ),
    )
    stage = largest_stage_layers(cfg, plan.pp)
    t.add(
        "pipeline.largest_stage_layers",
        stage,
        "layers",
        f"ceil(L / pp) = ceil({cfg.num_hidden_layers} / {plan.pp}) (vLLM's split: L // pp a "
        "stage, the remainder on the stages before the last); it sets the weights and KV per "
        "device, and every stage of a step is charged as long",
    )
    wb = DTYPE_BYTES[weight_dtype]
    kinds = layer_kinds(cfg, plan)
    weights = t.add(
        "memory.weights_per_device",
        stored_weights_per_device(cfg, plan, kinds) * wb,
        "bytes",
        f"largest pipeline stage: its layers with attention and FFN split by tp, routed "
        f"experts by ep × moe_tp = {plan.expert_shards}, embedding (first stage) / LM head "
        f"(last) by tp (vocab-parallel), norms and router replicated; × {wb} B ({weight_dtype})",
    )
    kv_token = cfg.kv_bytes_per_token(kv_dtype)
    kv = t.add(
        "memory.kv_per_device",
        kv_bytes_per_device(cfg, plan, b * ctx, kv_dtype),
        "bytes",
        f"b × context = {b} × {ctx} tokens × {kv_token} B/token ({kv_dtype_name(kv_dtype)}) × "
        f"(largest stage {stage} / {cfg.num_hidden_layers} layers) / (min(tp, kv heads) × dcp = "
        f"{kv_shards(cfg, plan)})",
    )
    work = t.add(
        "memory.workspace_per_device",
        workspace_bytes(cfg, plan, point, act_dtype),
        "bytes",
        f"min(ISL, {PREFILL_CHUNK_TOKENS}) prefill tokens × widest activations + b × V/tp "
        "float32 logits",
    )
    pool = t.add(
        "memory.cuda_graph_pool_per_device",
        graph_pool_bytes(cfg, plan, point, act_dtype),
        "bytes",
        f"decode graphs up to batch b = {b}: b × widest activations + b × V/tp float32 logits",
    )
    reserved = t.add(
        "memory.reserved_per_device",
        hw.reserved_bytes,
        "bytes",
        f"{hw.name}: {hw.sources.get('reserved_bytes', 'none')}",
    )
    t.add(
        "memory.per_device",
        weights + kv + work + pool + reserved,
        "bytes",
        "weights + KV cache + workspace + CUDA-graph pool + reserved",
    )

    shards = kv_shards(cfg, plan)
    decode_attn = attention_span.decode_attention_flops(cfg, b, ctx, tp=plan.tp, dcp=plan.dcp)
    kv_read = attention_span.decode_kv_read_bytes(cfg, b, ctx, kv_dtype, shards=shards)
    dense = attention_span.is_dense(cfg)
    spans = attention_span.describe(cfg, ctx)
    kv_size, index = DTYPE_BYTES[kv_dtype], attention_span.index_elements_per_layer(cfg)
    kv_read_source = (
        f"KV cache read: b × context = {b} × {ctx} tokens × {kv_token} B/token "
        f"({kv_dtype_name(kv_dtype)}) / {shards} shards: every layer attends the whole context"
        if dense
        else f"KV cache read: b = {b} × ({spans}) × {kv_size} B ({kv_dtype_name(kv_dtype)}) × "
        f"{attention_span.attended_elements_per_layer(cfg)} elements a token and layer"
        + (f" (indexer key {index} elements)" if index else "")
        + f" / {shards} shards: sliding/sparse layers read only the tokens they attend"
    )
    decode_attn_source = (
        ""
        if dense
        else f" (2 × heads/tp × (dqk + dv) over the tokens each layer attends: {spans}"
        + (
            f"; indexer 2 × {cfg.dsa.n_heads} heads × {cfg.dsa.head_dim} over all context "
            "tokens, not split by tp)"
            if cfg.dsa is not None
            else ")"
        )
    )
    tpot_s, tpot_tier = _pass(
        t,
        "decode",
        cfg,
        hw,
        plan,
        tokens=b,
        logit_tokens=b,
        ep_tokens=group_tokens,
        skew=point.expert_load_skew,
        attention_flops=decode_attn,
        kv_bytes=kv_read,
        kv_source=kv_read_source,
        attention_source=decode_attn_source,
        wdtype=weight_dtype,
        adtype=act_dtype,
        kinds=kinds,
        context=ctx,
        evidence=evidence,
    )
    how = {
        "roofline": "max(memory, compute) + kernels + communication",
        "microbenchmark": "measured ops + kernels + communication",
        "measured": "calibration factor × (ops + kernels) + communication",
    }
    tpot_ms = t.add("tpot_ms", tpot_s * 1e3, "ms", f"{tpot_tier} tier: {how[tpot_tier]}")
    tps = t.add("throughput_tokens_per_s", B / tpot_s, "tokens/s", "B / TPOT (all replicas)")

    n = prefill_prompts
    prefill_attn = n * attention_span.prefill_attention_flops(cfg, isl, tp=plan.tp)
    kv_write = n * isl * kv_token / shards
    prefill_attn_source = (
        " (causal: ISL²/2 pairs a layer)"
        if dense
        else f" (causal pairs within each layer's span: {attention_span.describe(cfg)}; "
        "linear in ISL past the span"
        + (
            f"; indexer 2 × {cfg.dsa.n_heads} heads × {cfg.dsa.head_dim} over all ISL²/2 pairs)"
            if cfg.dsa is not None
            else ")"
        )
    )
    ttft_s, ttft_tier = _pass(
        t,
        "prefill",
        cfg,
        hw,
        plan,
        tokens=n * isl,
        logit_tokens=n,
        ep_tokens=n * isl,
        skew=point.expert_load_skew,
        attention_flops=prefill_attn,
        kv_bytes=kv_write,
        kv_source=f"KV cache written: {n} × ISL = {n} × {isl} tokens × {kv_token} B/token / "
        f"{shards} shards (every layer caches every token)",
        attention_source=prefill_attn_source,
        wdtype=weight_dtype,
        adtype=act_dtype,
        kinds=kinds,
        context=isl,
        evidence=evidence,
    )
    ttft_ms = t.add(
        "ttft_ms",
        ttft_s * 1e3,
        "ms",
        f"{ttft_tier} tier: prefill of {'one ISL prompt' if n == 1 else f'{n} ISL prompts'}, "
        f"no queueing ({how[ttft_tier]})",
    )
    return Estimate(
        plan=plan,
        point=point,
        hardware=hw.name,
        weight_bytes_per_device=weights,
        kv_bytes_per_device=kv,
        workspace_bytes_per_device=work,
        overhead_bytes_per_device=pool + reserved,
        tpot_ms=tpot_ms,
        ttft_ms=ttft_ms,
        throughput_tokens_per_s=tps,
        terms=tuple(t.items),
        tpot_tier=tpot_tier,
        ttft_tier=ttft_tier,
    )

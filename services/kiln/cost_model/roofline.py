"""Roofline estimates of one parallelism plan: memory per device, TPOT, TTFT and throughput.

Pure functions of a model config, hardware and plan; every number is a :class:`Term` for
``Explain``. The model (Williams et al., CACM 2009; Pope et al., MLSys 2023):

- DP replicas share the traffic: of the B sequences in flight each replica decodes
  ``b = ceil(B / dp)``.
- Decode step (b sequences of one replica): ``max(bytes / achievable bandwidth, FLOPs / dense
  rate) + kernels x kernel overhead + comm``. Bytes: the weights a step touches (embedding: b
  rows; MoE: experts routed to) plus the KV of b x context tokens in the plan's KV dtype.
  FLOPs: 2 per weight per token plus attention. Kernels: :data:`DENSE_LAYER_KERNELS` a dense
  layer, :data:`MOE_LAYER_KERNELS` a MoE layer, :data:`STEP_KERNELS` a step.
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
- TTFT: one ISL prompt alone, compute against reading the weights once plus communication.
- Throughput = ``B / TPOT`` output tokens/s; per device ``B / TPOT / (tp x pp x dp)``.

MLA: decode in the absorbed form, prefill expanded. FP8 block scales (of weights or KV) are not
counted; an FP8 KV cache is read at its own bytes and computed on as BF16.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kiln.cost_model.hardware import Hardware
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
    stored_weights_per_device,
    vocab_shard,
)
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

PREFILL_CHUNK_TOKENS = 8192
"""Largest prefill the workspace estimate provisions for at once, tokens (an assumption in line with
vLLM's and SGLang's chunked-prefill budgets).
"""


@dataclass(frozen=True)
class DecodeStepBytes:
    """Bytes one decode step reads: ``weights`` (once per step), ``kv`` (0 when ``context`` is 0,
    unknown) at ``batch`` and ``kv_bytes_per_token`` over the layers held.
    """

    weights: float
    kv: float
    batch: int
    context: int
    kv_bytes_per_token: float

    @property
    def total(self) -> float:
        """``weights + kv``, bytes per decode step."""
        return self.weights + self.kv

    def limit_tokens_per_s(self, bandwidth_bytes_per_s: float) -> float:
        """``batch x bandwidth / (weights + kv)`` tokens/s (0 when no bytes are read)."""
        return self.batch * bandwidth_bytes_per_s / self.total if self.total > 0 else 0.0


def decode_kv_bytes(batch: int, context: int, kv_bytes_per_token: float) -> float:
    """``batch x context x kv_bytes_per_token``: KV-cache bytes one decode step reads."""
    return float(batch * context * kv_bytes_per_token)


def decode_step_bytes(
    weights_bytes: float, batch: int, context: int, kv_bytes_per_token: float
) -> DecodeStepBytes:
    """The weights once plus :func:`decode_kv_bytes`; ``context`` 0 gives the weights alone."""
    kv = decode_kv_bytes(batch, context, kv_bytes_per_token)
    return DecodeStepBytes(float(weights_bytes), kv, batch, context, float(kv_bytes_per_token))


def expected_experts_read(
    num_experts: int, top_k: int, batch: int, shares: Sequence[float] | None = None
) -> float:
    """Expected distinct experts one MoE layer reads for ``batch`` independent tokens:
    ``sum_e 1 - (1 - min(1, top_k x share_e)) ** batch``, shares uniform when None.
    """
    probs = shares if shares is not None else [1.0 / num_experts] * num_experts
    return math.fsum(1.0 - (1.0 - min(1.0, top_k * p)) ** batch for p in probs)


def moe_unread_expert_bytes(
    cfg: ModelConfig,
    dtype_bytes: int,
    batch: int,
    *,
    layers: int = 0,
    shares: Sequence[float] | None = None,
) -> float:
    """Bytes of routed experts a step at ``batch`` is expected not to read over the first
    ``layers`` layers (0: all); 0 for a dense model.
    """
    m = cfg.moe
    if m is None:
        return 0.0
    held = layers if 0 < layers < cfg.num_hidden_layers else cfg.num_hidden_layers
    moe_layers = cfg.moe_layers_in(range(held))
    expert = 3 * cfg.hidden_size * m.intermediate_size * dtype_bytes
    unread = m.num_experts - expected_experts_read(m.num_experts, m.top_k, batch, shares)
    return moe_layers * max(0.0, unread) * expert


def weights_read_bytes(
    cfg: ModelConfig,
    held_bytes: float,
    dtype_bytes: int,
    batch: int,
    *,
    layers: int = 0,
    shares: Sequence[float] | None = None,
) -> float:
    """Weight bytes a step at ``batch`` reads of ``held_bytes``: all but an untied embedding
    table and the experts expected untouched (first ``layers`` layers, 0: all).
    """
    unread = moe_unread_expert_bytes(cfg, dtype_bytes, batch, layers=layers, shares=shares)
    if not cfg.tie_word_embeddings:
        unread += (cfg.vocab_size - batch) * cfg.hidden_size * dtype_bytes
    return max(0.0, held_bytes - unread)


def held_kv_bytes_per_token(cfg: ModelConfig, dtype: str, layers: int = 0) -> int:
    """KV bytes of one token in ``dtype`` over the first ``layers`` layers (0 or too many: all)."""
    if 0 < layers < cfg.num_hidden_layers:
        cfg = cfg.with_layers(layers)
    return cfg.kv_bytes_per_token(dtype)


class ServingFigures(Protocol):
    """What an estimate keeps of the serving model (``serving.ServingStats``)."""

    @property
    def tokens_per_s(self) -> float: ...
    @property
    def ttft_p50_ms(self) -> float: ...
    @property
    def ttft_p90_ms(self) -> float: ...
    @property
    def tpot_p50_ms(self) -> float: ...
    @property
    def tpot_p90_ms(self) -> float: ...


@dataclass(frozen=True)
class Term:
    """One number of an estimate: its name, value, unit and the formula or source behind it."""

    name: str
    value: float
    unit: str
    source: str


@dataclass(frozen=True)
class Estimate:
    """A plan's roofline estimate at an operating point: bytes per device (weights, KV of b x
    context tokens of its replica, workspace; on the most loaded device), ``tpot_ms``, ``ttft_ms``
    (one ISL prompt), ``throughput_tokens_per_s`` (B / TPOT) and every intermediate
    :class:`Term`.
    """

    plan: Parallelism
    point: OperatingPoint
    hardware: str
    weight_bytes_per_device: float
    kv_bytes_per_device: float
    workspace_bytes_per_device: float
    tpot_ms: float
    ttft_ms: float
    throughput_tokens_per_s: float
    terms: tuple[Term, ...]
    overhead_bytes_per_device: float = 0.0
    """The CUDA-graph pool and the device's reserved bytes (context, libraries, NCCL)."""
    serving: ServingFigures | None = None
    """The serving model's figures (:mod:`kiln.cost_model.serving`) where it ran."""

    @property
    def served_tpot_ms(self) -> float:
        """TPOT the plan is judged by: the serving model's median, else the step's."""
        return self.serving.tpot_p50_ms if self.serving else self.tpot_ms

    @property
    def served_ttft_ms(self) -> float:
        """TTFT the plan is judged by: the serving model's median, else one prompt alone."""
        return self.serving.ttft_p50_ms if self.serving else self.ttft_ms

    @property
    def served_tokens_per_s(self) -> float:
        """Output tokens/s of the whole plan: the serving model's replica of b users scaled to
        the plan's B users, else B / TPOT."""
        if self.serving:
            b = replica_batch(self.point.batch_size, self.plan.dp)
            return self.serving.tokens_per_s * self.point.batch_size / b
        return self.throughput_tokens_per_s

    @property
    def served_per_device(self) -> float:
        """:attr:`served_tokens_per_s` per occupied device."""
        return self.served_tokens_per_s / self.plan.devices

    @property
    def memory_bytes_per_device(self) -> float:
        """Weights + KV cache + workspace + CUDA-graph pool + reserved on the most loaded
        device, bytes."""
        return (
            self.weight_bytes_per_device
            + self.kv_bytes_per_device
            + self.workspace_bytes_per_device
            + self.overhead_bytes_per_device
        )

    @property
    def throughput_per_device(self) -> float:
        """Output tokens/s per occupied device: B / TPOT / (tp × pp × dp)."""
        return self.point.batch_size / (self.tpot_ms / 1e3) / self.plan.devices

    def term(self, name: str) -> Term:
        """The term called ``name`` (KeyError if absent)."""
        for t in self.terms:
            if t.name == name:
                return t
        raise KeyError(name)


class _Terms:
    """Collects terms in order; ``add`` returns the value."""

    def __init__(self) -> None:
        self.items: list[Term] = []

    def add(self, name: str, value: float, unit: str, source: str) -> float:
        self.items.append(Term(name, float(value), unit, source))
        return value


def collective_s(
    hw: Hardware, nbytes: float, ranks: int, ring: bool = True, *, across_nodes: bool = False
) -> float:
    """Seconds for one collective of ``nbytes`` per device over ``ranks`` (ring all-reduce, or
    ``nbytes / link + latency`` with ``ring=False``); 0 for one rank, inf without an
    interconnect. ``across_nodes``: over the inter-node link at its latency (the in-node link
    where the catalogue has none).
    """
    if ranks <= 1:
        return 0.0
    link, latency = hw.interconnect_bandwidth_bytes_per_s, hw.collective_latency_s
    if across_nodes and hw.inter_node_bandwidth_bytes_per_s > 0:
        link, latency = hw.inter_node_bandwidth_bytes_per_s, hw.inter_node_latency_s
    if link <= 0:
        return float("inf")
    factor = 2 * (ranks - 1) / ranks if ring else 1.0
    return nbytes * factor / link + latency + (ranks - 1) * hw.collective_latency_per_peer_s


def all_to_all_s(hw: Hardware, nbytes: float, ranks: int) -> float:
    """Seconds for one all-to-all over ``ranks`` in which each rank sends ``nbytes`` spread
    evenly over the ranks (its own share stays). Inside a node: ``nbytes (n-1)/n / link +
    latency + (n-1) x per-peer latency``. Over ``n > node`` ranks the in-node share ``(node-1)/n``
    goes over the in-node link while the off-node share ``(n-node)/n`` goes over the inter-node
    link, ``max`` of the two, plus the inter-node latency and the per-peer latencies; inf
    without an inter-node link.
    """
    if ranks <= 1:
        return 0.0
    node = hw.max_devices_per_node
    if ranks <= node:
        return collective_s(hw, nbytes * (ranks - 1) / ranks, ranks, ring=False)
    inter, intra = hw.inter_node_bandwidth_bytes_per_s, hw.interconnect_bandwidth_bytes_per_s
    if inter <= 0 or intra <= 0:
        return float("inf")
    wire = max(nbytes * (node - 1) / ranks / intra, nbytes * (ranks - node) / ranks / inter)
    return wire + hw.inter_node_latency_s + (ranks - 1) * hw.collective_latency_per_peer_s


def pp_inter_node_sends(plan: Parallelism, node: int) -> int:
    """Of the ``pp - 1`` sends between stages, those crossing nodes, ranks laid out TP first,
    then DP, then PP (Megatron's order; a stage's tp x dp ranks together): all of them when a
    stage fills a node, else ``tp x dp x pp / node - 1``."""
    if plan.pp <= 1:
        return 0
    stage = plan.tp * plan.dp
    if stage >= node:
        return plan.pp - 1
    return max(0, min(plan.pp - 1, -(-stage * plan.pp // node) - 1))


def replica_batch(batch: int, dp: int) -> int:
    """Sequences one of ``dp`` replicas decodes when they share ``batch``: ceil(batch / dp)."""
    return max(1, -(-batch // max(1, dp)))


def step_kernels(cfg: ModelConfig) -> int:
    """Kernels of one forward step (see the module docs)."""
    n_dense, n_moe = layer_counts(cfg)
    return n_dense * DENSE_LAYER_KERNELS + n_moe * MOE_LAYER_KERNELS + STEP_KERNELS


def _attention_dims(cfg: ModelConfig, decode: bool) -> tuple[int, int]:
    """(score dim, value dim) per attention head for FLOP counting (MLA: absorbed on decode)."""
    if cfg.mla is not None:
        m = cfg.mla
        if decode:
            return m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return cfg.head_dim, cfg.head_dim


def _pass(
    t: _Terms,
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
    kinds: tuple[LayerShard, LayerShard] | None = None,
) -> float:
    """Seconds of one forward over ``tokens`` on one TP group through the pipeline; records terms
    under ``phase``. ``ep_tokens``: tokens the MoE group sees (attention DP: every replica's);
    ``attention_flops`` and ``kv_bytes`` over all layers, stretched like the layers when the
    stages are uneven; ``kinds``: :func:`layer_kinds` of the plan, when already known.
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
    kv = t.add(f"{phase}.kv_bytes", kv_bytes, "bytes", "KV cache read (decode) or written")
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
        f"{attention_flops:.4g}",
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
    launch_s = kernels * hw.kernel_overhead_s
    t.add(
        f"{phase}.kernel_overhead_ms",
        launch_s * 1e3,
        "ms",
        f"{kernels:.10g} kernels ({n_dense} dense layers × {DENSE_LAYER_KERNELS} + {n_moe} MoE "
        f"layers × {MOE_LAYER_KERNELS}{' stretched' if stretch != 1 else ''} + {STEP_KERNELS}) "
        f"× {hw.kernel_overhead_s * 1e6:g} us",
    )
    return max(mem_s, cmp_s) / 1e3 + launch_s + tp_s + ep_s + gather_s + dcp_s + pp_s


def workspace_bytes(
    cfg: ModelConfig, plan: Parallelism, point: OperatingPoint, adtype: str
) -> float:
    """Activation and logits workspace on one device, bytes (an estimate):
    ``min(ISL, 8192) x widest per-token activations of a layer x act bytes + b x V/tp x 4``
    (b: the replica's batch).
    """
    chunk = min(point.isl, PREFILL_CHUNK_TOKENS)
    logits = replica_batch(point.batch_size, plan.dp) * cfg.vocab_size / plan.tp * 4
    return chunk * token_activations(cfg, plan) * DTYPE_BYTES[adtype] + logits


def token_activations(cfg: ModelConfig, plan: Parallelism) -> float:
    """The widest activations one token has live inside a layer on one device, elements:
    ``3h + (heads + 2 kv heads) x head_dim / tp + FFN (2 x intermediate / tp; MoE: top_k x
    (h + 2 x expert intermediate / expert tp) when wider)``."""
    h = cfg.hidden_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim / plan.tp
    ffn = 2 * cfg.intermediate_size / plan.tp
    if cfg.moe is not None:
        m = cfg.moe
        ffn = max(ffn, m.top_k * (h + 2 * m.intermediate_size / plan.expert_tp))
    return 3 * h + qkv + ffn


def graph_pool_bytes(
    cfg: ModelConfig, plan: Parallelism, point: OperatingPoint, adtype: str
) -> float:
    """The CUDA-graph memory pool of the decode graphs on one device, bytes: the largest
    captured batch's (the replica's b) live activations and float32 logits, ``b x widest
    activations x act bytes + b x V/tp x 4`` (captured graphs share one pool)."""
    b = replica_batch(point.batch_size, plan.dp)
    return b * token_activations(cfg, plan) * DTYPE_BYTES[adtype] + b * cfg.vocab_size / plan.tp * 4


def estimate(
    cfg: ModelConfig,
    hw: Hardware,
    point: OperatingPoint,
    plan: Parallelism,
    weight_dtype: str = "bfloat16",
    act_dtype: str = "bfloat16",
) -> Estimate:
    """The roofline estimate of ``plan`` for ``cfg`` on ``hw`` at ``point``; ``weight_dtype``
    sets weight bytes and matmul rate, ``act_dtype`` activation and communication bytes and
    the KV cache's unless ``plan.kv_dtype`` sets it. ms, bytes, output tokens/s.
    """
    t = _Terms()
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

    heads_per_rank = cfg.num_attention_heads / plan.tp
    dqk, dv = _attention_dims(cfg, decode=True)
    decode_attn = b * ctx * cfg.num_hidden_layers * heads_per_rank * 2 * (dqk + dv) / plan.dcp
    kv_read = decode_kv_bytes(b, ctx, kv_token / kv_shards(cfg, plan))
    tpot_s = _pass(
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
        wdtype=weight_dtype,
        adtype=act_dtype,
        kinds=kinds,
    )
    tpot_ms = t.add("tpot_ms", tpot_s * 1e3, "ms", "max(memory, compute) + communication")
    tps = t.add("throughput_tokens_per_s", B / tpot_s, "tokens/s", "B / TPOT (all replicas)")

    dqk, dv = _attention_dims(cfg, decode=False)
    prefill_attn = cfg.num_hidden_layers * isl * isl * heads_per_rank * (dqk + dv)
    kv_write = isl * kv_token / kv_shards(cfg, plan)
    ttft_s = _pass(
        t,
        "prefill",
        cfg,
        hw,
        plan,
        tokens=isl,
        logit_tokens=1,
        ep_tokens=isl,
        skew=point.expert_load_skew,
        attention_flops=prefill_attn,
        kv_bytes=kv_write,
        wdtype=weight_dtype,
        adtype=act_dtype,
        kinds=kinds,
    )
    ttft_ms = t.add("ttft_ms", ttft_s * 1e3, "ms", "prefill of one ISL prompt, no queueing")
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
    )

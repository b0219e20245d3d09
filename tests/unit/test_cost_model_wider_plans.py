"""Wider plans (issue 16, item 4): uneven pipeline stages, an FP8 KV cache, EP across nodes and
attention DP with MoE TP or EP, against hand-computed numbers.

As in test_cost_model_roofline.py the expected values are written out from published parameter
counts and datasheet figures. DeepSeek-V3's layers, from its config (hidden 7168, 128 heads, MLA
q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; 3 dense layers of FFN 18432, then 58 MoE
layers of 256 routed experts of 2048 and 1 shared; vocab 129280):

- attention: q_a 7168·1536 + norm 1536 + q_b 1536·128·192 + kv_a 7168·576 + norm 512 + kv_b
  512·128·256 + o 128·128·7168 = 187,107,328
- norms 2·7168 = 14,336; dense FFN 3·7168·18432 = 396,361,728; one expert 3·7168·2048 =
  44,040,192; router 7168·256 = 1,835,008
- dense layer 583,483,392; MoE layer 187,107,328 + 14,336 + 1,835,008 + 44,040,192 + 256 ×
  44,040,192 = 11,507,286,016; embedding = LM head = 129280·7168 = 926,679,040; final norm 7168
  (3 dense + 58 MoE + 2 × 926,679,040 + 7168 = 671,026,404,352, the published 671 B without MTP)
- KV: (512 + 64) × 2 B = 1,152 B a layer and token in BF16, 576 B in FP8
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from pathlib import Path

import pytest

from kiln.common.errors import InvalidArgument
from kiln.cost_model.communication import all_to_all_s
from kiln.cost_model.hardware import get_hardware
from kiln.cost_model.objective import ServingTargets
from kiln.cost_model.planner import candidate_plans, plan_workload, static_reasons
from kiln.cost_model.roofline import estimate
from kiln.cost_model.service import CostModelServicer
from kiln.cost_model.sharding import (
    FP8,
    Parallelism,
    largest_stage_layers,
    stage_layers,
    stored_weights_per_device,
)
from kiln.domain.operating_point import OperatingPoint
from kiln.v1 import common_pb2, cost_model_pb2
from kiln.workloads.config import load_config

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "models"
needs_models = pytest.mark.skipif(not MODELS.is_dir(), reason="../shared/data/models is absent")

H200 = get_hardware("h200")
NVLINK = 450e9  # NVLink 4, bytes/s per direction
IB = 50e9  # 400 Gb/s InfiniBand NDR per GPU, bytes/s per direction
ACHIEVED = 4.26e12  # H200 measured copy bandwidth, bytes/s
LIMIT = 0.9 * 141e9  # usable bytes per H200
DENSE_LAYER = 583_483_392
MOE_LAYER = 11_507_286_016
ATTENTION = 187_107_328
EXPERT = 44_040_192
VOCAB = 926_679_040
DS_MOE_KERNELS = 3 * 8 + 58 * 12  # 720 kernels in the layers, 4 more a step


def model(name: str):  # type: ignore[no-untyped-def]
    return load_config(MODELS / f"{name}.json")


# --------------------------------------------------------------------------- catalogue
def test_the_catalogue_has_an_inter_node_link_with_sources() -> None:
    for name in ("h100", "h200", "b200"):
        hw = get_hardware(name)
        assert hw.inter_node_bandwidth_bytes_per_s == IB  # 400 Gb/s = 50 GB/s
        assert hw.inter_node_latency_s == 10e-6
        assert hw.has_fp8
        assert "400 Gb/s" in hw.sources["inter_node_bandwidth_bytes_per_s"]
        assert "assumption" in hw.sources["inter_node_latency_s"]
    assert not get_hardware("cpu").has_fp8
    assert get_hardware("cpu").inter_node_bandwidth_bytes_per_s == 0


# --------------------------------------------------------------------------- 1. uneven PP
@needs_models
def test_deepseek_v3_splits_61_layers_over_two_stages_as_vllm_does() -> None:
    cfg = model("deepseek-v3")
    # vLLM get_pp_indices: 61 // 2 = 30 a stage, the 1 left over to the stage before the last
    assert [stage_layers(cfg, 2, s) for s in range(2)] == [range(0, 31), range(31, 61)]
    # 61 over 8: 7 each, 5 left over to stages 2..6 (never the last, which holds the head)
    assert [len(stage_layers(cfg, 8, s)) for s in range(8)] == [7, 7, 8, 8, 8, 8, 8, 7]
    assert largest_stage_layers(cfg, 2) == 31 and largest_stage_layers(cfg, 8) == 8
    assert not any(r.startswith("layers:") for r in static_reasons(cfg, Parallelism(pp=2), H200, 2))
    pp64 = static_reasons(cfg, Parallelism(pp=64), H200, 64)
    assert "layers: pp=64 stages for 61 layers leave a stage without layers" in pp64
    # the planner enumerates pp up to the layers: 1, 2, 4, 8, 16, 32 for 61
    assert {p.pp for p in candidate_plans(cfg, 128)} == {1, 2, 4, 8, 16, 32}


@needs_models
def test_the_largest_stage_by_weights_sets_the_memory() -> None:
    cfg = model("deepseek-v3")
    # stage 0: 3 dense + 28 MoE layers + embedding = 1,750,450,176 + 322,204,008,448 +
    # 926,679,040 = 324,881,137,664; stage 1: 30 MoE layers + head + norm = 345,218,580,480 +
    # 926,686,208 = 346,145,266,688: the last stage, with fewer layers, is the heavier one
    assert 3 * DENSE_LAYER + 28 * MOE_LAYER + VOCAB == 324_881_137_664
    assert 30 * MOE_LAYER + VOCAB + 7168 == 346_145_266_688
    assert stored_weights_per_device(cfg, Parallelism(pp=2)) == 346_145_266_688
    # Llama-3.2-1B (16 layers of 60,821,504, tied 262,668,288-weight embedding) over pp=3:
    # stages of 5, 6, 5 layers; the last holds a copy of the tied head and the final norm:
    # 5 × 60,821,504 + 262,668,288 + 2,048 = 566,777,856 (the middle: 364,929,024)
    llama = model("llama-3.2-1b")
    assert [len(stage_layers(llama, 3, s)) for s in range(3)] == [5, 6, 5]
    assert stored_weights_per_device(llama, Parallelism(pp=3)) == 566_777_856
    # KV of the largest stage: ceil(16 / 3) = 6 layers × 2 × 8 KV heads × 64 × 2 B = 12,288 B
    one = estimate(llama, H200, OperatingPoint(batch_size=1, context_len=1), Parallelism(pp=3))
    assert one.kv_bytes_per_device == 12_288


@needs_models
def test_deepseek_v3_bf16_runs_tp8_pp2_on_two_nodes() -> None:
    cfg = model("deepseek-v3")
    point = OperatingPoint(batch_size=64, isl=2048, osl=256, context_len=2176)
    plan = Parallelism(tp=8, pp=2)
    assert static_reasons(cfg, plan, H200, 16) == []
    est = estimate(cfg, H200, point, plan)
    # weights: the last stage (30 MoE layers + head + norm) split 8 ways, BF16: MLA keeps the
    # down projections (7168·1536 + 1536 + 7168·576 + 512 = 15,140,864) and the norms on every
    # rank, router too; the rest / 8
    whole = 30 * MOE_LAYER + VOCAB + 7168
    kept = 30 * (15_140_864 + 14_336 + 1_835_008) + 7168
    assert est.weight_bytes_per_device == pytest.approx(((whole - kept) / 8 + kept) * 2)
    # KV: 64 × 2176 tokens × 31 layers (the longest stage) × 1,152 B, the latent replicated
    # over tp (a bound: the heaviest stage by weights is the other one, of 30 layers)
    assert est.kv_bytes_per_device == 64 * 2176 * 31 * 1152 == 4_973_395_968
    # every stage charged as the largest: 62 layer-times for 61 layers
    launch_ms = (DS_MOE_KERNELS * 62 / 61 + 4) * 4e-6 * 1e3
    assert est.term("decode.kernel_overhead_ms").value == pytest.approx(launch_ms)
    assert launch_ms == pytest.approx(2.9432, abs=1e-4)
    # a stage fills a node, so the one send crosses nodes: 64 × 7168 × 2 B over InfiniBand +
    # 10 us + one peer's 1.5 us
    send_ms = (64 * 7168 * 2 / IB + 10e-6 + 1.5e-6) * 1e3
    assert est.term("decode.pp_send_ms").value == pytest.approx(send_ms)
    assert send_ms == pytest.approx(0.029850, abs=1e-6)
    # 2 all-reduces over 8 ranks for each of the 62 layer-times
    allreduce_ms = 124 * (64 * 7168 * 2 * 14 / 8 / NVLINK + 5e-6 + 7 * 1.5e-6) * 1e3
    assert est.term("decode.tp_allreduce_ms").value == pytest.approx(allreduce_ms)
    result = plan_workload(cfg, H200, point, 16)
    assert any(e.plan == plan for e in result.feasible)


# --------------------------------------------------------------------------- 2. FP8 KV
@needs_models
def test_an_fp8_kv_cache_fits_a_batch_that_bf16_lowers() -> None:
    cfg = model("llama-3.1-8b")
    point = OperatingPoint(batch_size=128, isl=1024, osl=256, context_len=8192)
    result = plan_workload(cfg, H200, point, 1)
    best = result.feasible[0]
    assert best.plan == Parallelism(kv_dtype=FP8) and best.point.batch_size == 128
    assert best.plan.label() == "tp1 ep1 dp1 pp1 dcp1 kv fp8"
    # 128 × 8192 tokens × 32 layers × 2 × 8 KV heads × 128 × 1 B = 68.7 GB (BF16: 137.4 GB)
    assert best.kv_bytes_per_device == 128 * 8192 * 65_536 == 68_719_476_736
    assert best.memory_bytes_per_device <= LIMIT
    assert result.batch_note == ""
    assert result.note(best).startswith("KV cache in FP8 (lossy): with a bfloat16 cache")
    # the BF16 plan is still listed as pruned, on memory alone
    (reason,) = [r for e, r in result.pruned if e.plan == Parallelism()]
    assert reason.startswith("memory:") and ";" not in reason
    # without FP8 on the device the batch is halved instead
    no_fp8 = replace(H200, dense_fp8_flops=0.0)
    lowered = plan_workload(cfg, no_fp8, point, 1)
    assert lowered.feasible[0].plan == Parallelism() and lowered.feasible[0].point.batch_size == 64
    assert lowered.batch_note.startswith("batch lowered from 128 to 64")


@needs_models
def test_fp8_kv_halves_the_decode_reads_and_answers_a_target_bf16_misses() -> None:
    cfg = model("llama-3.1-8b")
    point = OperatingPoint(batch_size=16, isl=128, osl=1024, context_len=32_768)
    bf16 = estimate(cfg, H200, point, Parallelism())
    fp8 = estimate(cfg, H200, point, Parallelism(kv_dtype=FP8))
    # weights read: all but the untied embedding (its 16 rows are not counted), BF16:
    # (8,030,261,248 − 525,336,576) × 2 = 15,009,849,344 B; KV 16 × 32,768 × 131,072 B =
    # 68,719,476,736 in BF16, half in FP8; + 260 kernels × 4 us
    weights, kv = 15_009_849_344, 68_719_476_736
    assert bf16.term("decode.kv_bytes").value == kv
    assert fp8.term("decode.kv_bytes").value == kv / 2
    assert bf16.tpot_ms == pytest.approx((weights + kv) / ACHIEVED * 1e3 + 1.04)  # 20.695 ms
    assert fp8.tpot_ms == pytest.approx((weights + kv / 2) / ACHIEVED * 1e3 + 1.04)  # 12.629
    assert fp8.tpot_ms == pytest.approx(12.629, abs=1e-3)
    # with a 16 ms TPOT target no BF16 plan meets it, so the FP8 one is searched and chosen
    tight = ServingTargets(tpot_ms=16.0)
    result = plan_workload(cfg, H200, point, 1, targets=tight)
    best = result.feasible[0]
    assert best.plan.kv_dtype == FP8 and tight.miss(best) == 0
    assert "no plan with a bfloat16 cache meets the targets" in result.note(best)
    assert [e.plan for e in result.feasible] == [Parallelism(kv_dtype=FP8), Parallelism()]
    # at the default 50 ms both meet it, and the lossless one is the answer alone
    loose = plan_workload(cfg, H200, point, 1)
    assert [e.plan for e in loose.feasible] == [Parallelism()]


@needs_models
def test_lossless_kv_plans_rank_before_fp8_ones_meeting_the_targets() -> None:
    cfg = model("llama-3.1-8b")
    point = OperatingPoint(batch_size=128, isl=1024, osl=256, context_len=8192)
    result = plan_workload(cfg, H200, point, 2)
    lossy = [e for e in result.feasible if e.plan.kv_dtype]
    lossless = [e for e in result.feasible if not e.plan.kv_dtype]
    assert lossy and lossless and result.targets.miss(lossy[0]) == 0
    # one GPU with an FP8 cache serves more per GPU than two with BF16, yet ranks after them
    assert lossy[0].plan == Parallelism(kv_dtype=FP8)
    assert lossy[0].served_per_device > result.feasible[0].served_per_device
    first_lossy = result.feasible.index(lossy[0])
    assert all(not e.plan.kv_dtype for e in result.feasible[:first_lossy])
    assert result.feasible[0].plan == Parallelism(tp=2)
    assert "lossless KV cache before an FP8 one" in result.objective


# --------------------------------------------------------------------------- 3. EP over nodes
def test_an_all_to_all_over_nodes_sends_the_off_node_share_over_infiniband() -> None:
    # DeepEP's published low-latency decode (H800 + CX7 400 Gb/s, 128 tokens, hidden 7168,
    # top-8, FP8 dispatch 7,340,032 B a rank, BF16 combine twice that): EP16 118 / 195 us,
    # EP32 155 / 273 us. Here: EP16 sends 8/16 off-node, EP32 24/32, at 50 GB/s, + 10 us + 1.5
    # us for each further rank.
    dispatch = 128 * 8 * 7168
    ep16 = dispatch * 8 / 16 / IB + 10e-6 + 15 * 1.5e-6  # 73.4 + 32.5 = 105.9 us
    ep32 = dispatch * 24 / 32 / IB + 10e-6 + 31 * 1.5e-6  # 110.1 + 56.5 = 166.6 us
    assert all_to_all_s(H200, dispatch, 16) == pytest.approx(ep16)
    assert all_to_all_s(H200, dispatch, 32) == pytest.approx(ep32)
    assert all_to_all_s(H200, 2 * dispatch, 32) * 1e6 == pytest.approx(276.7, abs=0.1)
    for ours, deepep in (
        (ep16, 118e-6),
        (ep32, 155e-6),
        (all_to_all_s(H200, 2 * dispatch, 16), 195e-6),
    ):
        assert abs(ours / deepep - 1) < 0.15
    # inside a node: (n−1)/n of the bytes over NVLink + 5 us + (n−1) × 1.5 us, as before
    assert all_to_all_s(H200, dispatch, 8) == pytest.approx(
        dispatch * 7 / 8 / NVLINK + 5e-6 + 7 * 1.5e-6
    )
    island = replace(H200, inter_node_bandwidth_bytes_per_s=0.0)
    assert math.isinf(all_to_all_s(island, dispatch, 16))


@needs_models
def test_deepseek_v3_ep32_spans_four_nodes_and_tp_stays_inside_one() -> None:
    cfg = model("deepseek-v3")
    point = OperatingPoint(batch_size=256, isl=2048, osl=256, context_len=2176)
    plan = Parallelism(tp=1, ep=32, dp=32)
    assert static_reasons(cfg, plan, H200, 32) == []
    est = estimate(cfg, H200, point, plan, "float8_e4m3fn")
    # each of 32 ranks decodes 8 sequences; dispatch and combine of 8 × 8 × 7168 × 2 B =
    # 917,504 B each per MoE layer, 24/32 of it off-node: 13.76 us + 10 us + 31 × 1.5 us
    a2a_s = 917_504 * 24 / 32 / IB + 10e-6 + 31 * 1.5e-6
    assert est.term("decode.ep_alltoall_ms").value == pytest.approx(2 * 58 * a2a_s * 1e3)
    assert est.term("decode.ep_alltoall_ms").value == pytest.approx(8.150, abs=1e-3)
    # 8 of the 256 experts a rank: 58 × 8 × 44,040,192 of routed experts, attention and the
    # rest whole (tp = 1), FP8
    routed = 58 * 8 * EXPERT
    rest = 3 * DENSE_LAYER + 58 * (MOE_LAYER - 256 * EXPERT) + 2 * VOCAB + 7168
    assert est.weight_bytes_per_device == routed + rest == 37_552_282_624
    # the experts see the group's 8 × 32 = 256 tokens
    assert est.term("decode.moe_group_tokens").value == 256
    # the planner offers EP16 and EP32 on 32 H200; a TP group of 16 is still pruned
    result = plan_workload(cfg, H200, point, 32, weight_dtype="float8_e4m3fn")
    assert {16, 32} <= {e.plan.ep for e in result.feasible}
    tp16 = [r for e, r in result.pruned if e.plan.tp == 16]
    assert tp16 and all(
        "topology: a TP group of 16 spans more than one 8-device node" in r for r in tp16
    )
    # with no inter-node link in the catalogue an EP group stays inside a node
    island = replace(H200, inter_node_bandwidth_bytes_per_s=0.0)
    assert any(
        r.startswith("topology: an EP group of 32") for r in static_reasons(cfg, plan, island, 32)
    )


# --------------------------------------------------------------------------- 4. attention DP
@needs_models
def test_attention_dp_replicates_attention_and_splits_the_experts_over_the_group() -> None:
    cfg = model("deepseek-v3")
    point = OperatingPoint(batch_size=64, isl=2048, osl=256, context_len=4096)
    ep8 = Parallelism(tp=1, ep=8, dp=8)  # vLLM DP8 + EP, SGLang --dp 8 --enable-dp-attention --ep 8
    etp8 = Parallelism(tp=1, ep=1, dp=8, moe_tp=8)  # SGLang --tp 8 --dp 8 --enable-dp-attention
    assert ep8.attention_dp and etp8.attention_dp
    assert ep8.replicas_per_ep_group == etp8.replicas_per_ep_group == 8
    assert etp8.label() == "tp1 ep1 dp8 pp1 dcp1 etp8"
    assert Parallelism(tp=8, ep=2, moe_tp=4) == Parallelism(tp=8, ep=2)  # the default reads as 0
    assert static_reasons(cfg, etp8, H200, 8) == []
    # weights: attention (187,107,328), norms, router, shared expert, dense layers, embedding
    # and head whole on every DP rank; routed experts 256 / 8 = 32 whole ones (EP) or 256
    # slices of 1/8 (MoE TP): 32 × 44,040,192 = 1,409,286,144 a MoE layer either way
    moe = ATTENTION + 14_336 + 1_835_008 + EXPERT + 32 * EXPERT
    assert moe == 1_642_283_008
    per_device = 3 * DENSE_LAYER + 58 * moe + 2 * VOCAB + 7168
    assert per_device == 98_856_229_888
    assert stored_weights_per_device(cfg, ep8) == stored_weights_per_device(cfg, etp8) == per_device
    a, b = (estimate(cfg, H200, point, p, "float8_e4m3fn") for p in (ep8, etp8))
    assert a.weight_bytes_per_device == b.weight_bytes_per_device == per_device  # FP8: 1 B
    # KV: each DP rank its own ceil(64 / 8) = 8 sequences: 8 × 4096 × 61 × 1,152 B
    assert a.kv_bytes_per_device == b.kv_bytes_per_device == 8 * 4096 * 70_272 == 2_302_672_896
    # the step: attention of 8 sequences, experts over the group's 8 × 8 = 64 tokens
    for e in (a, b):
        assert e.term("decode.replica_batch").value == 8
        assert e.term("decode.moe_group_tokens").value == 64
    # (1 − 8/256)^64 = 0.13111: EP's rank touches 32 × 0.86889 = 27.80 of its experts, MoE TP's
    # 256 × 0.86889 = 222.44 slices of 1/8: the same bytes
    assert a.term("decode.experts_touched_per_rank").value == pytest.approx(27.805, abs=1e-3)
    assert b.term("decode.experts_touched_per_rank").value == pytest.approx(222.442, abs=1e-3)
    assert a.term("decode.weight_bytes_read").value == pytest.approx(
        b.term("decode.weight_bytes_read").value
    )
    # EP: dispatch + combine of 8 tokens × top-8 × 7168 × 2 B, 7/8 of it to the other 7 ranks:
    # 2 × 58 × (802,816 B / 450 GB/s + 5 us + 7 × 1.5 us) = 2.005 ms
    ep_ms = 2 * 58 * (802_816 / NVLINK + 15.5e-6) * 1e3
    assert a.term("decode.ep_alltoall_ms").value == pytest.approx(ep_ms)
    assert ep_ms == pytest.approx(2.005, abs=1e-3)
    assert a.term("decode.moe_gather_ms").value == 0
    # MoE TP: all-gather + reduce-scatter of the group's 64 tokens × 7168 × 2 B = 917,504 B
    # over 8 ranks, one ring all-reduce a MoE layer: 58 × (917,504 × 14/8 / 450 GB/s + 5 us +
    # 7 × 1.5 us) = 1.106 ms; no all-to-all, and tp = 1 has no all-reduce
    gather_ms = 58 * (917_504 * 14 / 8 / NVLINK + 15.5e-6) * 1e3
    assert b.term("decode.moe_gather_ms").value == pytest.approx(gather_ms)
    assert gather_ms == pytest.approx(1.106, abs=1e-3)
    assert b.term("decode.ep_alltoall_ms").value == 0
    assert b.term("decode.tp_allreduce_ms").value == 0


@needs_models
def test_attention_dp_with_moe_tp_is_enumerated_and_bounded() -> None:
    cfg = model("deepseek-v3")
    plans = candidate_plans(cfg, 8)
    # tp1 dp8: EP 1..8 as before, and the whole stage as the MoE group with moe_tp 2, 4, 8
    tp1dp8 = {(p.ep, p.expert_tp) for p in plans if (p.tp, p.dp, p.pp, p.dcp) == (1, 8, 1, 1)}
    assert tp1dp8 == {(1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (2, 4), (1, 8)}
    # MoE TP wider than a node is not enumerated, and pruned by topology when asked for
    assert all(p.expert_tp <= 8 for p in candidate_plans(cfg, 64) if p.tp <= 8)
    wide = static_reasons(cfg, Parallelism(tp=1, ep=1, dp=16, moe_tp=16), H200, 16)
    assert any(r.startswith("topology: a TP group of 16") for r in wide)
    # a MoE group that is not a multiple of tp dividing tp × dp is pruned
    odd = static_reasons(cfg, Parallelism(tp=4, ep=1, dp=2, moe_tp=2), H200, 8)
    assert any(r.startswith("experts: the MoE group ep×moe_tp = 2") for r in odd)
    # TP wider than a node: one plan per tp stands for all its splits
    assert sum(p.tp == 16 for p in candidate_plans(cfg, 65_536)) == 1


# --------------------------------------------------------------------------- the service
def _explain(plan: common_pb2.ParallelismPlan, devices: int = 8) -> cost_model_pb2.ExplainResponse:
    cfg = (MODELS / "deepseek-v3.json").read_text()
    wl = common_pb2.Workload(
        model=common_pb2.ModelSpec(name="deepseek-v3", config_json=cfg),
        traffic=common_pb2.TrafficShape(
            isl_tokens=common_pb2.Distribution(p50=2048),
            osl_tokens=common_pb2.Distribution(p50=256),
            batch_size=64,
            context_len=4096,
        ),
        hardware=common_pb2.HardwareTarget(name="h200", num_devices=devices),
    )
    servicer = CostModelServicer()
    try:
        return asyncio.run(
            servicer.Explain(cost_model_pb2.ExplainRequest(workload=wl, plan=plan), None)
        )
    finally:
        servicer.close()


@needs_models
def test_explain_takes_the_kv_dtype_and_moe_tp_of_its_plan() -> None:
    bf16 = _explain(common_pb2.ParallelismPlan(tp=1, ep=1, dp=8, moe_tp=8))
    fp8 = _explain(common_pb2.ParallelismPlan(tp=1, ep=1, dp=8, moe_tp=8, kv_cache_dtype="fp8"))
    kv = {r.plan.kv_cache_dtype: {t.name: t.value for t in r.terms} for r in (bf16, fp8)}
    assert kv["bfloat16"]["memory.kv_per_device"] == 2_302_672_896  # 8 × 4096 × 61 × 1,152 B
    assert kv[FP8]["memory.kv_per_device"] == 1_151_336_448  # 576 B a layer and token
    assert fp8.plan.moe_tp == 8 and fp8.plan.note == "KV cache in FP8 (lossy), as asked"
    assert bf16.plan.note == "" and "etp8" in bf16.text and "kv fp8" in fp8.text
    assert kv[FP8]["decode.moe_gather_ms"] > 0 and kv[FP8]["decode.ep_alltoall_ms"] == 0
    with pytest.raises(InvalidArgument, match=r"plan\.kv_cache_dtype 'int4'"):
        _explain(common_pb2.ParallelismPlan(tp=8, kv_cache_dtype="int4"))


@needs_models
def test_plan_says_when_it_chose_an_fp8_kv_cache() -> None:
    cfg = (MODELS / "llama-3.1-8b.json").read_text()
    wl = common_pb2.Workload(
        model=common_pb2.ModelSpec(name="llama-3.1-8b", config_json=cfg),
        traffic=common_pb2.TrafficShape(
            isl_tokens=common_pb2.Distribution(p50=1024),
            osl_tokens=common_pb2.Distribution(p50=256),
            batch_size=128,
            context_len=8192,
        ),
        hardware=common_pb2.HardwareTarget(name="h200", num_devices=1),
    )
    servicer = CostModelServicer()
    try:
        reply = asyncio.run(servicer.Plan(cost_model_pb2.PlanRequest(workload=wl), None))
    finally:
        servicer.close()
    (plan,) = reply.plans
    assert (plan.tp, plan.batch_size, plan.kv_cache_dtype) == (1, 128, FP8)
    assert plan.note.startswith("KV cache in FP8 (lossy): with a bfloat16 cache this plan needs")
    # the BF16 plan is pruned on memory alone: 137.4 GB of KV > 126.9 GB
    (pruned,) = reply.pruned
    assert pruned.kv_cache_dtype == "bfloat16" and pruned.infeasible_reason.startswith("memory:")

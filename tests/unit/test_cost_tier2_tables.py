"""Tier 2 of the cost model: interpolation over measured points, the microbenchmark table, and
estimates composed from it (kiln.cost_model.interpolate, microbench_table, tier2)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kiln.cost_model.evidence import Evidence
from kiln.cost_model.hardware import get_hardware
from kiln.cost_model.interpolate import interp_1d, interp_2d, worst
from kiln.cost_model.microbench_table import MicrobenchTable
from kiln.cost_model.op_shapes import attention_heads, layer_gemms, request_for
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism, layer_kinds
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import ModelConfig, parse_config_json

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def tiny() -> ModelConfig:
    return parse_config_json(json.dumps(TINY), "tiny")


def test_interp_1d_kinds_and_values() -> None:
    xs, ys = [1.0, 4.0, 16.0], [2.0, 5.0, 17.0]
    assert interp_1d(xs, ys, 4.0).ms == 5.0 and interp_1d(xs, ys, 4.0).how == "measured"
    mid = interp_1d(xs, ys, 10.0)
    assert mid.how == "interpolated" and mid.ms == pytest.approx(5.0 + 12.0 * 6 / 12)
    low = interp_1d([2.0, 4.0], [3.0, 5.0], 1.0)
    assert (low.ms, low.how) == (3.0, "clamped")  # never below the smallest's fixed cost
    high = interp_1d(xs, ys, 64.0)
    assert high.how == "extrapolated" and high.ms == pytest.approx(17.0 * 4)
    with pytest.raises(ValueError):
        interp_1d([], [], 1.0)
    assert worst("measured", "scaled") == "scaled"


def test_interp_2d_bilinear_and_outside() -> None:
    grid = {(1.0, 10.0): 1.0, (1.0, 20.0): 3.0, (3.0, 10.0): 5.0, (3.0, 20.0): 11.0}
    centre = interp_2d([1.0, 3.0], [10.0, 20.0], grid, 2.0, 15.0)
    assert centre is not None and centre.how == "interpolated"
    assert centre.ms == pytest.approx((1 + 3 + 5 + 11) / 4)
    corner = interp_2d([1.0, 3.0], [10.0, 20.0], grid, 3.0, 20.0)
    assert corner is not None and (corner.ms, corner.how) == (11.0, "measured")
    out = interp_2d([1.0, 3.0], [10.0, 20.0], grid, 6.0, 40.0)  # 4x the work of the corner
    assert out is not None and out.how == "extrapolated" and out.ms == pytest.approx(44.0)
    del grid[(3.0, 20.0)]
    assert interp_2d([1.0, 3.0], [10.0, 20.0], grid, 2.0, 15.0) is None


def _gemm(m: int, n: int, k: int, ms: float) -> dict[str, object]:
    return {"op": "gemm", "dtype": "bfloat16", "shape": {"m": m, "n": n, "k": k}, "ms": ms}


def test_table_gemm_scales_from_the_nearest_shape_and_later_points_win() -> None:
    t = MicrobenchTable("microbench-cpu-x", "cpu")
    t.add_event(
        {
            "device_name": "cpu x2",
            "versions": {"torch": "2"},
            "results": [
                _gemm(1, 100, 100, 1.0),
                _gemm(8, 100, 100, 2.0),
                _gemm(1, 1000, 1000, 50.0),
            ],
        }
    )
    assert t.gemm(1, 100, 100, "bfloat16").ms == 1.0  # type: ignore[union-attr]
    got = t.gemm(4, 100, 100, "bfloat16")
    assert got is not None and got.ms == pytest.approx(1 + 3 / 7) and got.how == "interpolated"
    scaled = t.gemm(1, 200, 100, "bfloat16")  # nearest n*k is 100x100: twice the work
    assert scaled is not None and scaled.how == "scaled" and scaled.ms == pytest.approx(2.0)
    assert t.gemm(1, 100, 100, "float16") is None
    t.add_event({"results": [_gemm(1, 100, 100, 0.5)]})
    assert t.gemm(1, 100, 100, "bfloat16").ms == 0.5  # type: ignore[union-attr]
    assert t.events == 2


def test_efficiency_from_small_and_large_gemms() -> None:
    t = MicrobenchTable("microbench-cpu-x", "cpu")
    # 1000x1000 bf16 weights = 2 MB in 1 ms = 2 GB/s; 2*64*1e6 FLOP in 1 ms = 128 GFLOP/s
    t.add_event({"results": [_gemm(1, 1000, 1000, 1.0), _gemm(64, 1000, 1000, 1.0)]})
    bw, fl = t.efficiency("bfloat16", 4e9, 256e9)
    assert bw == pytest.approx(0.5) and fl == pytest.approx(0.5)
    assert MicrobenchTable("s", "cpu").efficiency("bfloat16", 1.0, 1.0) == (1.0, 1.0)


def _table_for(cfg: ModelConfig, per_elem_ms: float = 1e-6) -> MicrobenchTable:
    """A synthetic table covering ``cfg``'s shapes: GEMM ms proportional to m·n·k work plus a
    weight read, attention to batch × context."""
    req = request_for(cfg, "cpu", "bfloat16")
    results: list[dict[str, object]] = []
    for g in req.gemm:
        for m in g.ms:
            results.append(_gemm(m, g.n, g.k, per_elem_ms * g.n * g.k * (1 + m / 64)))
    for a in req.attention_decode:
        for b in a.batches:
            for c in a.contexts:
                shape = {
                    "batch": b,
                    "context": c,
                    "heads": a.heads,
                    "kv_heads": a.kv_heads,
                    "head_dim": a.head_dim,
                }
                results.append(
                    {
                        "op": "attention_decode",
                        "dtype": "bfloat16",
                        "shape": shape,
                        "ms": 0.01 + 1e-5 * b * c,
                    }
                )
    for a in req.attention_prefill:
        for c in a.contexts:
            shape = {"tokens": c, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim}
            results.append(
                {"op": "attention_prefill", "dtype": "bfloat16", "shape": shape, "ms": 1e-6 * c * c}
            )
    results.append({"op": "launch", "dtype": "none", "shape": {"graph": 0}, "ms": 0.003})
    t = MicrobenchTable("microbench-cpu-synthetic", "cpu")
    t.add_event({"device_name": "cpu x2", "versions": {"torch": "t"}, "results": results})
    return t


def test_estimate_from_the_table_sums_the_measured_ops() -> None:
    cfg, hw = tiny(), get_hardware("cpu")
    table = _table_for(cfg)
    point = OperatingPoint(batch_size=4, context_len=256, isl=256, osl=8)
    est = estimate(cfg, hw, point, Parallelism(), evidence=Evidence(table, None, graphs=False))
    roof = estimate(cfg, hw, point, Parallelism())
    assert (est.tpot_tier, est.ttft_tier) == ("microbenchmark", "microbenchmark")
    assert roof.tpot_tier == "roofline"
    plan = Parallelism()
    dense, _ = layer_kinds(cfg, plan)
    layers = cfg.num_hidden_layers
    for name, n, k in layer_gemms(cfg, plan, dense):
        measured = table.gemm(4, n, k, "bfloat16")
        assert measured is not None and measured.how == "measured"
        assert est.term(f"decode.op.{name}_ms").value == pytest.approx(layers * measured.ms)
    heads, kvh = attention_heads(cfg, 1)
    att = table.attention_decode(4, 256, heads, kvh, cfg.head_dim, "bfloat16")
    assert att is not None
    assert est.term("decode.op.attention_ms").value == pytest.approx(layers * att.ms)
    kernels = layers * 8 + 4
    assert est.term("decode.kernel_overhead_ms").value == pytest.approx(kernels * 0.003)
    ops = est.term("decode.measured_ops_ms").value
    assert est.tpot_ms == pytest.approx(ops + kernels * 0.003)  # one device: no collectives
    assert est.term("decode.measured_share").value == pytest.approx(1.0)


def test_ops_missing_from_the_table_fall_back_to_the_roofline_at_measured_efficiency() -> None:
    cfg, hw = tiny(), get_hardware("cpu")
    full = _table_for(cfg)
    gemms_only = MicrobenchTable("microbench-cpu-g", "cpu")
    gemms_only.add_event(
        {
            "results": [
                {"op": o, "dtype": d, "shape": dict(s), "ms": ms}
                for (o, d, s), ms in full.points.items()
                if o == "gemm"
            ]
        }
    )
    point = OperatingPoint(batch_size=16, context_len=1024, isl=64, osl=8)
    est = estimate(cfg, hw, point, Parallelism(), evidence=Evidence(gemms_only, None, False))
    assert "roofline" in est.term("decode.op.attention_ms").source
    bw_eff, _ = gemms_only.efficiency(
        "bfloat16", hw.memory_bandwidth_bytes_per_s, hw.flops_for("bfloat16")
    )
    heads, kvh = attention_heads(cfg, 1)
    kv = 16 * 1024 * 2 * kvh * cfg.head_dim * 2
    flops = 4.0 * 16 * heads * 1024 * cfg.head_dim
    rate = hw.flops_for("bfloat16")
    expect = (
        cfg.num_hidden_layers
        * max(kv / (hw.memory_bandwidth_bytes_per_s * bw_eff), flops / rate)
        * 1e3
    )
    assert est.term("decode.op.attention_ms").value == pytest.approx(expect)
    share = est.term("decode.measured_share").value
    assert 0 < share < 1
    assert est.tpot_tier == ("microbenchmark" if share >= 0.5 else "roofline")
    assert est.term("decode.kernel_overhead_ms").source.endswith("(the catalogue's)")


def test_request_covers_every_gemm_of_the_plans_and_stays_bounded() -> None:
    cfg = tiny()
    req = request_for(cfg, "h200", "bfloat16", (1, 2))
    asked = {(g.n, g.k) for g in req.gemm}
    for tp in (1, 2):
        plan = Parallelism(tp=tp)
        for shard in layer_kinds(cfg, plan):
            if shard.always_read:
                assert {(n, k) for _, n, k in layer_gemms(cfg, plan, shard)} <= asked
    assert req.points() <= 1024 and not math.isnan(req.budget_s)
    assert {(a.heads, a.kv_heads) for a in req.attention_decode} == {(4, 2), (2, 1)}


MOE = TINY | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "head_dim": 64,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}


def test_moe_layers_pay_the_measured_expert_per_touched_expert() -> None:
    from kiln.cost_model.sharding import expert_load

    cfg, hw = parse_config_json(json.dumps(MOE), "tiny-moe"), get_hardware("cpu")
    assert cfg.moe is not None
    req = request_for(cfg, "cpu", "bfloat16")
    (shape,) = req.moe_expert
    assert (shape.hidden, shape.intermediate) == (256, 128)
    t = _table_for(cfg)
    t.add_event(
        {
            "results": [
                {
                    "op": "moe_expert",
                    "dtype": "bfloat16",
                    "ms": 0.01 * n,
                    "shape": {"tokens": n, "hidden": 256, "intermediate": 128},
                }
                for n in shape.tokens
            ]
        }
    )
    point = OperatingPoint(batch_size=16, context_len=64, isl=64, osl=4)
    est = estimate(cfg, hw, point, Parallelism(), evidence=Evidence(t, None, graphs=False))
    load = expert_load(cfg.moe, Parallelism(), 16, point.expert_load_skew)
    per = load.assignments / load.distinct_experts
    found = t.expert(per, 256, 128, "bfloat16")
    assert found is not None and found.how == "interpolated"
    expect = cfg.num_hidden_layers * load.distinct_experts * found.ms
    assert est.term("decode.op.experts_ms").value == pytest.approx(expect)
    assert est.term("decode.op.router_ms").value > 0


def test_sliding_layers_are_costed_at_their_window() -> None:
    """A layer attending a 64-token window is read off the table at 64 tokens on decode and at
    its share of the causal pairs on prefill; the full layers at the whole context."""
    cfg = dataclasses.replace(tiny(), sliding_window=64, sliding_layers=(1,))
    hw, table = get_hardware("cpu"), _table_for(tiny())
    point = OperatingPoint(batch_size=4, context_len=256, isl=256, osl=8)
    est = estimate(cfg, hw, point, Parallelism(), evidence=Evidence(table, None, graphs=False))
    dense = estimate(tiny(), hw, point, Parallelism(), evidence=Evidence(table, None, False))
    heads, kvh = attention_heads(cfg, 1)
    full = table.attention_decode(4, 256, heads, kvh, cfg.head_dim, "bfloat16")
    window = table.attention_decode(4, 64, heads, kvh, cfg.head_dim, "bfloat16")
    assert full is not None and window is not None and window.ms < full.ms
    assert est.term("decode.op.attention_ms").value == pytest.approx(2 * full.ms + window.ms)
    assert dense.term("decode.op.attention_ms").value == pytest.approx(3 * full.ms)
    pre = table.attention_prefill(256, heads, kvh, cfg.head_dim, "bfloat16")
    assert pre is not None
    cut = (64 * 256 - 64 * 64 / 2) / (256 * 256 / 2)
    assert est.term("prefill.op.attention_ms").value == pytest.approx(pre.ms * (2 + cut))

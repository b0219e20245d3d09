"""Tier 3 of the cost model: the calibration math, the estimate it calibrates, and the folding
of ledger events into measured passes (kiln.cost_model.calibration, knowledge)."""

from __future__ import annotations

import json
import math

import pytest

from kiln.common.settings import KilnSettings
from kiln.cost_model.calibration import fit
from kiln.cost_model.evidence import Evidence
from kiln.cost_model.hardware import get_hardware
from kiln.cost_model.knowledge import CostSettings, Knowledge, model_key
from kiln.cost_model.roofline import estimate
from kiln.cost_model.sharding import Parallelism
from kiln.domain.operating_point import OperatingPoint
from kiln.workloads.config import parse_config_json

from .test_cost_tier2_tables import TINY


def test_one_ratio_everywhere_is_fitted_exactly() -> None:
    cal = fit([(3.0, 1.0), (6.0, 2.0), (30.0, 10.0)])
    assert cal is not None
    assert cal.factor == pytest.approx(3.0)
    assert cal.error_before == pytest.approx(2 / 3)
    assert cal.residual == pytest.approx(0.0, abs=1e-12)
    assert cal.holdout == pytest.approx(0.0, abs=1e-12)


def test_factor_is_the_geometric_mean_and_residuals_are_medians() -> None:
    cal = fit([(2.0, 1.0), (1.0, 2.0)])  # twice too slow, twice too fast
    assert cal is not None and cal.factor == pytest.approx(1.0) and cal.holdout is None
    assert cal.residual == pytest.approx(statistics_median([1.0, 0.5]))
    pairs = [(1.1, 1.0), (2.4, 2.0), (2.6, 2.0)]
    cal = fit(pairs)
    assert cal is not None
    f = math.exp(sum(math.log(m / p) for m, p in pairs) / 3)
    assert cal.factor == pytest.approx(f)
    assert cal.residual == pytest.approx(statistics_median([abs(f * p / m - 1) for m, p in pairs]))
    # leave-one-out: each point predicted by the factor of the other two
    loo = []
    for i, (m, p) in enumerate(pairs):
        rest = pairs[:i] + pairs[i + 1 :]
        fi = math.exp(sum(math.log(a / b) for a, b in rest) / 2)
        loo.append(abs(fi * p / m - 1))
    assert cal.holdout == pytest.approx(statistics_median(loo))
    assert cal.holdout > cal.residual
    assert "residual" in cal.describe()


def statistics_median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def test_unusable_points_are_dropped() -> None:
    assert fit([]) is None
    assert fit([(0.0, 1.0), (1.0, float("inf")), (-1.0, 2.0)]) is None
    cal = fit([(0.0, 1.0), (2.0, 1.0)])
    assert cal is not None and cal.points == 1 and cal.factor == pytest.approx(2.0)


def test_calibrated_step_multiplies_the_device_time() -> None:
    cfg, hw = parse_config_json(json.dumps(TINY), "tiny"), get_hardware("h200")
    point = OperatingPoint(batch_size=8, context_len=512, isl=128, osl=8)
    cal = fit([(2.0, 1.0)])
    base = estimate(cfg, hw, point, Parallelism())
    one = estimate(cfg, hw, point, Parallelism(), evidence=Evidence(None, cal))
    assert one.tpot_tier == "measured" and one.ttft_tier == "roofline"
    assert one.tpot_ms == pytest.approx(2.0 * base.tpot_ms)  # one device: all device time
    assert one.ttft_ms == pytest.approx(base.ttft_ms)  # no prefill calibration: not calibrated
    pre = estimate(
        cfg, hw, point, Parallelism(), evidence=Evidence(None, None, True, fit([(3, 1)]))
    )
    assert (pre.tpot_tier, pre.ttft_tier) == ("roofline", "measured")
    assert pre.tpot_ms == pytest.approx(base.tpot_ms)
    assert pre.ttft_ms == pytest.approx(3.0 * base.ttft_ms)
    assert pre.term("prefill.uncalibrated_ms").value == pytest.approx(base.ttft_ms)
    tp2 = Parallelism(tp=2)
    base2 = estimate(cfg, hw, point, tp2)
    two = estimate(cfg, hw, point, tp2, evidence=Evidence(None, cal))
    comm = base2.term("decode.tp_allreduce_ms").value
    assert comm > 0
    assert two.tpot_ms == pytest.approx(2.0 * (base2.tpot_ms - comm) + comm)  # not the collectives
    assert two.term("decode.uncalibrated_ms").value == pytest.approx(base2.tpot_ms)


def _knowledge() -> Knowledge:
    return Knowledge(KilnSettings(tls="off"), CostSettings(follow=False, microbench=False))


def _completed(cid: str, batch: int, ctx: int, ms: float, **over: object) -> dict[str, object]:
    return {
        "compilation_id": cid,
        "candidate_id": "c",
        "status": "ok",
        "correct": True,
        "median_ms": ms,
        "tier": "full",
        "batch_size": batch,
        "context_len": ctx,
    } | over


def test_knowledge_folds_measured_passes_and_calibrates_against_them() -> None:
    cfg, hw = parse_config_json(json.dumps(TINY), "tiny"), get_hardware("cpu")
    text = json.dumps(TINY)
    k = _knowledge()
    workload = {"model": {"name": "tiny", "config_json": text}, "hardware": {"name": "cpu"}}
    k.fold("compilation-c1", "CompilationSubmitted", {"hardware": "cpu", "workload": workload})
    k.fold("experiment-e1", "ExperimentCompleted", _completed("c1", 1, 64, 5.0))
    k.fold("experiment-e2", "ExperimentCompleted", _completed("c1", 1, 64, 4.0))  # faster wins
    k.fold("experiment-e3", "ExperimentCompleted", _completed("c1", 1, 64, 3.0, correct=False))
    k.fold("experiment-e4", "ExperimentCompleted", _completed("c1", 4, 128, 9.0, tier="fast"))
    k.fold("experiment-e5", "ExperimentRequested", {"baseline": "hf_eager"})
    k.fold("experiment-e5", "ExperimentCompleted", _completed("c1", 4, 128, 90.0))
    k.fold(
        "experiment-e6",
        "ExperimentCompleted",
        _completed("c1", 4, 128, 8.0, tier="fast", op_profile_shape={"layers": 1}),
    )
    k.fold("experiment-e7", "ExperimentCompleted", _completed("unknown", 2, 64, 1.0))
    passes = k.measured_passes(text, "", "cpu")
    assert sorted((p.batch, p.context, p.layers, p.ms) for p in passes) == [
        (1, 64, 0, 4.0),
        (4, 128, 1, 8.0),
    ]
    ev = k.evidence(cfg, text, "", hw, "bfloat16", "bfloat16")
    assert ev.table is None and ev.calibration is not None
    p1 = estimate(
        cfg, hw, OperatingPoint(batch_size=1, context_len=64, isl=64, osl=1), Parallelism()
    ).tpot_ms
    p2 = estimate(
        cfg.with_layers(1),
        hw,
        OperatingPoint(batch_size=4, context_len=128, isl=128, osl=1),
        Parallelism(),
    ).tpot_ms
    assert ev.calibration.factor == pytest.approx(math.sqrt(4.0 / p1 * 8.0 / p2))
    assert ev.calibration.points == 2
    other = k.evidence(cfg, text, "float32", hw, "float32", "float32")  # another dtype: none
    assert other.calibration is None
    assert model_key(text, "") == model_key(json.dumps(json.loads(text), indent=2), "")


def test_a_prefill_of_several_prompts_is_one_pass_over_all_their_tokens() -> None:
    """An engine times ``batch`` prompts of ``context`` tokens at once: the prediction it is
    calibrated against takes them in one pass (weights once, every prompt's attention)."""
    cfg, hw = parse_config_json(json.dumps(TINY), "tiny"), get_hardware("h200")
    point = OperatingPoint(batch_size=4, context_len=256, isl=256, osl=1)
    one = estimate(cfg, hw, point, Parallelism())
    four = estimate(cfg, hw, point, Parallelism(), prefill_prompts=4)
    assert four.term("prefill.kv_bytes").value == pytest.approx(
        4 * one.term("prefill.kv_bytes").value
    )
    assert one.ttft_ms < four.ttft_ms < 4 * one.ttft_ms  # the weights are read once
    assert four.tpot_ms == pytest.approx(one.tpot_ms)
    with pytest.raises(ValueError):
        estimate(cfg, hw, point, Parallelism(), prefill_prompts=0)


def test_knowledge_calibrates_the_prefill_against_the_timed_prefills() -> None:
    cfg, hw = parse_config_json(json.dumps(TINY), "tiny"), get_hardware("cpu")
    text = json.dumps(TINY)
    k = _knowledge()
    workload = {"model": {"name": "tiny", "config_json": text}, "hardware": {"name": "cpu"}}
    k.fold("compilation-c1", "CompilationSubmitted", {"hardware": "cpu", "workload": workload})
    k.fold("experiment-e1", "ExperimentCompleted", _completed("c1", 2, 64, 5.0))  # none timed
    assert k.evidence(cfg, text, "", hw, "bfloat16", "bfloat16").prefill_calibration is None
    k.fold(
        "experiment-e2",
        "ExperimentCompleted",
        _completed("c1", 2, 64, 6.0, prefill_median_ms=30.0),
    )
    k.fold(  # a faster decode without a timed prefill keeps the prefill already timed
        "experiment-e3", "ExperimentCompleted", _completed("c1", 2, 64, 4.0)
    )
    k.fold(
        "experiment-e4",
        "ExperimentCompleted",
        _completed("c1", 2, 64, 7.0, prefill_median_ms=20.0),  # the fastest prefill is kept
    )
    (p,) = k.measured_passes(text, "", "cpu")
    assert (p.ms, p.prefill_ms) == (4.0, 20.0)
    ev = k.evidence(cfg, text, "", hw, "bfloat16", "bfloat16")
    at = OperatingPoint(batch_size=2, context_len=64, isl=64, osl=1)
    predicted = estimate(cfg, hw, at, Parallelism(), prefill_prompts=2).ttft_ms
    assert ev.prefill_calibration is not None
    assert ev.prefill_calibration.factor == pytest.approx(20.0 / predicted)
    calibrated = estimate(cfg, hw, at, Parallelism(), evidence=ev, prefill_prompts=2)
    assert calibrated.ttft_tier == "measured"
    assert calibrated.ttft_ms == pytest.approx(20.0)  # one device, one point: reproduced

"""An MoE engine (CPU, in this process): the traffic's expert-load skew reaches the model, MoE
candidates are hot-reloaded, checked and timed, a wrong router is caught, and full-tier engines
are scaled to fit by layer count."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kiln.domain.candidate import Candidate, Transform
from kiln.engine_pool.settings import EngineSettings
from kiln.ops import registry
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec, SpecError
from kiln.workloads.traffic.experts import exponent_for_hot_ratio, zipf_shares

from .engine_testing import module, tiny_workload

# Qwen3-30B-A3B's architecture, tiny: 16 experts top-4, a dense layer (mlp_only_layers).
TINY_QWEN3_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)
ZIPF = 0.9


def moe_workload(
    *, config: dict[str, Any] | None = None, dtype: str = "float32", **traffic: Any
) -> dict[str, Any]:
    workload = tiny_workload(batch=3, context=24, dtype=dtype, name="tiny-qwen3-moe")
    workload["model"]["config_json"] = json.dumps(config or TINY_QWEN3_MOE)
    workload["traffic"].update(traffic)
    return workload


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    spec = EngineSpec.from_workload(moe_workload(expert_zipf_exponent=ZIPF), "full", LIMITS)
    yield Engine(spec, engine_id="test-moe-engine")


def _run(engine: Engine, candidate: Candidate) -> Measurement:
    return engine.run(RunRequest("exp", candidate, warmup=1, repeats=3))


def test_spec_carries_the_traffic_skew() -> None:
    spec = EngineSpec.from_workload(moe_workload(expert_zipf_exponent=ZIPF), "fast", LIMITS)
    assert spec.expert_zipf_exponent == ZIPF
    assert EngineSpec.from_dict(spec.to_dict()) == spec
    cfg = spec.model_config()
    assert cfg.moe is not None and cfg.moe.load_zipf_exponent == ZIPF
    assert any("Zipf s=0.9" in n and "hottest expert" in n for n in spec.notes)
    plain = EngineSpec.from_workload(moe_workload(), "fast", LIMITS)
    assert plain.expert_zipf_exponent == 0.0 and plain.key != spec.key
    assert any("router's own" in n for n in plain.notes)
    # only the cost model's ratio form given: converted for this model's 16 experts, top-4
    ratio = EngineSpec.from_workload(moe_workload(expert_load_skew=2.5), "fast", LIMITS)
    assert ratio.expert_zipf_exponent == pytest.approx(exponent_for_hot_ratio(2.5, 16, 4))
    # a checkpoint's router is left alone
    ckpt = moe_workload(expert_zipf_exponent=ZIPF)
    ckpt["model"]["weights_dir"] = "/somewhere"
    spec = EngineSpec.from_workload(ckpt, "fast", LIMITS)
    assert spec.expert_zipf_exponent == 0.0
    assert any("checkpoint router's own" in n for n in spec.notes)
    with pytest.raises(SpecError, match="expert_zipf_exponent"):
        EngineSpec.from_workload(moe_workload(expert_zipf_exponent=-1), "fast", LIMITS)


def test_dense_specs_ignore_the_skew_and_keep_their_key() -> None:
    dense = EngineSpec.from_workload(tiny_workload(), "fast", LIMITS)
    skewed = tiny_workload()
    skewed["traffic"]["expert_zipf_exponent"] = 1.5
    spec = EngineSpec.from_workload(skewed, "fast", LIMITS)
    assert spec.expert_zipf_exponent == 0.0 and spec.key == dense.key


def test_full_tier_is_scaled_to_fit_by_layer_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_ENGINE_MAX_LAYERS", "2")
    limits = EngineSettings().limits()
    assert limits.max_layers == 2
    full = EngineSpec.from_workload(moe_workload(), "full", limits)
    assert (full.layers, full.total_layers) == (2, 3)
    assert any("scaled to fit by layer count: 2 of 3 layers" in n for n in full.notes)
    monkeypatch.delenv("KILN_ENGINE_MAX_LAYERS")
    assert EngineSettings().limits().max_layers is None
    assert EngineSpec.from_workload(moe_workload(), "full", LIMITS).layers == 3


def test_the_engine_model_follows_the_skew(engine: Engine) -> None:
    report = engine.reference.expert_load
    assert report is not None and set(report.measured) == {0, 2}
    assert report.distance() < 0.07
    assert report.rank_profile() == pytest.approx(zipf_shares(16, 4, ZIPF), abs=0.035)
    # the measured model and the shape reference route with the same biases
    for model in (engine.model, engine.shape_reference):
        bias = model.slots.layers[0].ffn.params["router_bias"]
        assert bias is engine.weights["model.layers.0.mlp.gate.kiln_skew_bias"]


@pytest.mark.parametrize(
    "impl", [i for i in registry.implementations("moe") if registry.get("moe", i).runs_on("cpu")]
)
def test_moe_candidates_run_correctly(engine: Engine, impl: str) -> None:
    m = _run(engine, Candidate.make({"moe": impl}))
    assert m.status == "ok", m.error
    assert m.correct and m.timing is not None and m.tokens_per_s > 0
    assert any("3/3 layers" in n for n in m.notes)
    assert engine.weights_intact()


def test_moe_candidate_with_other_ops_and_threads(engine: Engine) -> None:
    c = Candidate.make(
        {"moe": "gathered", "mlp": "fused_gate_up", "attention": "sdpa"},
        [Transform.of("threads", n=1)],
    )
    assert _run(engine, c).status == "ok"


def test_a_router_that_ignores_the_skew_bias_is_incorrect(engine: Engine) -> None:
    """A candidate that routes without kiln's router bias picks other experts: caught."""
    unbiased = module(
        "unbiased_moe",
        """
from kiln.ops.moe import reference

@register("moe", "unbiased", replace=True)
def unbiased(x, *, router_bias=None, **params):
    return reference(x, router_bias=None, **params)
""",
    )
    m = _run(engine, Candidate.make({"moe": "unbiased"}, code_modules=[unbiased]))
    assert m.status == "incorrect", m.error
    assert "unbiased" not in registry.implementations("moe")
    assert _run(engine, Candidate()).status == "ok"


def test_bfloat16_moe_engine_checks_gathered_and_dense() -> None:
    spec = EngineSpec.from_workload(
        moe_workload(dtype="bfloat16", expert_zipf_exponent=0.5), "fast", LIMITS
    )
    engine = Engine(spec, engine_id="bf16-moe")
    for impl in ("gathered", "dense"):
        m = _run(engine, Candidate.make({"moe": impl}))
        assert m.status == "ok", (impl, m.error)

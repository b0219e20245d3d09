"""Baselines (kiln.baselines) on a tiny Llama on the CPU: each runs, reports a positive
throughput and prefill median and agrees with kiln's reference forward; a wrong one is flagged;
a missing transformers is a skipped baseline; an engine answers a baseline request (its prefill
timed when asked) and its next experiment is still verified correct; the compile view's
side-by-side table."""

from __future__ import annotations

import sys
import time
from typing import Any

import pytest
import torch
from rich.console import Console

from kiln.agent_runner.comparisons import validate_baselines
from kiln.baselines import gpt_fast, gpt_fast_model, hf_compile, hf_eager, hf_static
from kiln.baselines.in_engine import measure_baseline
from kiln.baselines.result import BaselineResult
from kiln.baselines.runner import run_named
from kiln.baselines.table import Comparison, bandwidth_limit
from kiln.cli.compile_view import comparison_table
from kiln.common.errors import InvalidArgument
from kiln.domain.baselines import BASELINE_NAMES, default_baselines, parse_names, skipped_reason
from kiln.domain.candidate import REFERENCE_CANDIDATE, Candidate
from kiln.engine_pool.delivery import completed_payload
from kiln.engine_pool.worker import run_request
from kiln.runtime.engine import Engine
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec
from kiln.v1 import common_pb2, compiler_pb2
from kiln.workloads.config import parse_config

from .engine_testing import TINY_LLAMA, tiny_workload

CONFIG = parse_config(TINY_LLAMA, "tiny-llama")
QWEN3 = parse_config(
    {**TINY_LLAMA, "model_type": "qwen3", "head_dim": 64, "rope_scaling": None,
     "rope_theta": 1e6, "tie_word_embeddings": False},
    "tiny-qwen3",
)  # fmt: skip
POINT: dict[str, Any] = {
    "batch": 2,
    "context": 12,
    "device": "cpu",
    "dtype": torch.float32,
    "seed": 5,
    "steps": 3,
    "warmup": 1,
}
HAS_TRANSFORMERS = "transformers" in sys.modules or bool(
    __import__("importlib.util").util.find_spec("transformers")
)
needs_hf = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers not installed")


def _check_ok(result: BaselineResult, name: str) -> None:
    assert result.name == name
    assert result.status == "ok", (result.error, result.notes)
    assert result.tokens_per_s > 0 and result.steps == POINT["steps"]
    assert result.p10_ms <= result.median_ms <= result.p90_ms
    assert result.correct and result.max_abs_error <= result.tolerance
    assert result.tolerance > 0
    # the prompt's prefill, timed after the decode steps (PREFILL_REPEATS times by default)
    assert 0 < result.prefill_p10_ms <= result.prefill_median_ms <= result.prefill_p90_ms
    assert any(n.startswith("prefill timed: 2 prompts of 12 tokens, 3 times") for n in result.notes)


@needs_hf
def test_hf_eager_runs_and_agrees_with_kiln() -> None:
    _check_ok(hf_eager.run(CONFIG, **POINT), "hf_eager")


@needs_hf
def test_hf_static_runs_and_agrees_with_kiln() -> None:
    _check_ok(hf_static.run(CONFIG, **POINT), "hf_static")


@needs_hf
def test_hf_baseline_of_a_truncated_config_builds_only_its_layers() -> None:
    # a fast-tier engine holds the first layers; its config's raw JSON still says all
    result = hf_static.run(CONFIG.with_layers(1), **POINT)
    _check_ok(result, "hf_static")
    assert "1 layers" in result.notes[0]


@needs_hf
def test_hf_compile_eager_path_runs_and_agrees_with_kiln() -> None:
    # the compiled path takes over a minute on a CPU: tests/gpu/test_baselines_gpu.py has it
    result = hf_compile.run(CONFIG, **POINT, compile_mode=None)
    _check_ok(result, "hf_compile")
    assert any("eager (no compile)" in n for n in result.notes)


def test_gpt_fast_eager_path_runs_and_agrees_with_kiln() -> None:
    _check_ok(gpt_fast.run(CONFIG, **POINT, compile_mode=None), "gpt_fast")


def test_the_prefill_timed_is_the_baselines_own(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = gpt_fast_model.prefill

    def slow_prefill(model: Any, prompt: torch.Tensor) -> Any:
        calls.append(tuple(prompt.shape))
        time.sleep(0.03)  # every timed prefill takes at least 30 ms
        return real(model, prompt)

    monkeypatch.setattr(gpt_fast_model, "prefill", slow_prefill)
    result = gpt_fast.run(CONFIG, **POINT, compile_mode=None, prefill_repeats=2)
    assert result.status == "ok" and result.correct, (result.error, result.notes)
    assert calls == [(2, 12)] * 4  # the checked prefill, one untimed, two timed: [batch, context]
    assert result.prefill_p10_ms >= 30  # each timed sample is one whole prefill call
    assert result.prefill_tokens_per_s == pytest.approx(2 * 12 / (result.prefill_median_ms / 1e3))


def test_no_prefill_repeats_no_prefill_and_a_failing_prefill_keeps_the_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    none = gpt_fast.run(CONFIG, **POINT, compile_mode=None, prefill_repeats=0)
    assert none.status == "ok" and none.prefill_median_ms == 0
    assert not any(n.startswith("prefill") for n in none.notes)
    real, calls = gpt_fast_model.prefill, []

    def fails_again(model: Any, prompt: torch.Tensor) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("prefill broke")
        return real(model, prompt)

    monkeypatch.setattr(gpt_fast_model, "prefill", fails_again)
    result = gpt_fast.run(CONFIG, **POINT, compile_mode=None)
    assert result.status == "ok" and result.correct and result.tokens_per_s > 0
    assert result.prefill_median_ms == 0
    assert "prefill not timed: RuntimeError: prefill broke" in result.notes


def test_gpt_fast_bfloat16_agrees_within_the_bf16_tolerance() -> None:
    result = gpt_fast.run(CONFIG, **{**POINT, "dtype": torch.bfloat16}, compile_mode=None)
    assert result.status == "ok" and result.correct


def test_a_wrong_baseline_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x * weight  # forgets to normalise: fast and wrong

    monkeypatch.setattr(gpt_fast_model, "rms_norm", no_norm)
    result = gpt_fast.run(CONFIG, **POINT, compile_mode=None)
    assert result.tokens_per_s > 0
    assert not result.correct and result.status == "incorrect"
    assert result.max_abs_error > result.tolerance
    assert any("INCORRECT" in n for n in result.notes)


def test_missing_transformers_is_a_skipped_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    for module in (hf_eager, hf_static, hf_compile):
        result = module.run(CONFIG, **POINT)
        assert result.status == "skipped"
        assert result.skipped_reason == "transformers not installed"
        assert result.tokens_per_s == 0


def test_gpt_fast_runs_qwen3_and_skips_moe() -> None:
    _check_ok(gpt_fast.run(QWEN3, **POINT, compile_mode=None), "gpt_fast")
    moe = parse_config(
        {**TINY_LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64},
        "tiny-qwen3-moe",
    )  # fmt: skip
    result = gpt_fast.run(moe, **POINT)
    assert result.status == "skipped" and "dense Llama and Qwen3 only" in result.skipped_reason


@needs_hf
@pytest.mark.parametrize("module", [hf_eager, hf_static], ids=["hf_eager", "hf_static"])
def test_hf_baselines_agree_with_kiln_on_qwen3(module: Any) -> None:
    # q/k norms and heads x head_dim (4 x 64) wider than hidden (128): transformers' Qwen3 on
    # kiln's weights, its cache and positions, match kiln's reference in float32
    result = module.run(QWEN3, **POINT)
    _check_ok(result, module.NAME)
    assert any("sdpa attention, eager forward" in n for n in result.notes)  # what ran, named


def test_run_named_reports_bad_input_as_an_error() -> None:
    result = run_named("gpt_fast", CONFIG, **{**POINT, "steps": 0})
    assert result.status == "crashed" and "steps" in result.error
    with pytest.raises(ValueError, match="unknown baseline"):
        run_named("vllm", CONFIG, **POINT)


def test_names() -> None:
    assert parse_names("hf_eager, GPT_FAST,hf_eager") == ["hf_eager", "gpt_fast"]
    assert parse_names("all") == list(BASELINE_NAMES)
    assert parse_names("none") == [] and parse_names("") == []
    with pytest.raises(ValueError, match="unknown baseline 'vllm'"):
        parse_names("vllm")
    assert default_baselines("h200") == list(BASELINE_NAMES) and default_baselines("cpu") == []
    assert validate_baselines([], "h200") == list(BASELINE_NAMES)
    assert validate_baselines(["none"], "h200") == []
    with pytest.raises(InvalidArgument):
        validate_baselines(["fast"], "cpu")
    assert skipped_reason("rejected", "skipped: no transformers") == "no transformers"
    assert skipped_reason("crashed", "skipped: x") == ""


# ---------------------------------------------------------------------- in an engine
def test_engine_answers_a_baseline_then_verifies_its_next_experiment() -> None:
    limits = EngineLimits(max_batch=4, max_context=32, prompt_len=8, check_steps=2)
    spec = EngineSpec.from_workload(tiny_workload(batch=2, context=16), "full", limits)
    engine = Engine(spec, engine_id="baseline-engine")
    placeholder = Candidate()
    request = RunRequest("b1", placeholder, warmup=1, repeats=3, prefill_repeats=2,
                         baseline="gpt_fast")  # fmt: skip
    assert engine.run(request).status == "rejected"  # the runtime runs candidates only
    unwired = run_request(engine, request)  # an engine process given no external measure
    assert unwired.status == "rejected" and "measures no baselines" in unwired.error
    m = run_request(engine, request, measure_baseline)  # what the engine process does
    assert m.status == "ok" and m.correct, (m.error, m.notes)
    assert m.candidate_id == "baseline:gpt_fast"
    assert m.tokens_per_s > 0 and m.timing is not None and m.timing.median_ms > 0
    assert m.timing.mean_ms > 0 and m.timing.decision_ms >= m.timing.median_ms
    assert m.tokens_per_s == pytest.approx(spec.batch_size / (m.timing.decision_ms / 1e3))
    # its prefill, as a candidate's: batch_size prompts of context_len tokens, 2 timed
    assert m.prefill is not None and m.prefill.median_ms > 0
    tokens = spec.batch_size * spec.context_len
    assert m.prefill_tokens_per_s == pytest.approx(tokens / (m.prefill.median_ms / 1e3))
    assert any(
        f"prefill timed: {spec.batch_size} prompts of {spec.context_len} tokens, 2 times" in n
        for n in m.notes
    )
    payload = completed_payload(_work(), m)  # what the engine pool appends
    assert payload["prefill_median_ms"] == m.prefill.median_ms > 0
    assert payload["candidate_id"] == "baseline:gpt_fast"
    assert not m.restart_engine and engine.weights_intact()
    engine.after_reply()
    unasked = run_request(
        engine,
        RunRequest("b0", placeholder, warmup=1, repeats=3, baseline="gpt_fast"),
        measure_baseline,
    )
    assert unasked.status == "ok" and unasked.prefill is None  # prefill_repeats 0: not timed
    assert completed_payload(_work(), unasked)["prefill_median_ms"] == 0
    engine.after_reply()
    bad = run_request(engine, RunRequest("b2", placeholder, baseline="vllm"), measure_baseline)
    assert bad.status == "rejected" and "unknown baseline" in bad.error
    nxt = engine.run(RunRequest("n1", Candidate(), warmup=1, repeats=3))
    assert nxt.status == "ok" and nxt.correct, nxt.error
    assert nxt.candidate_id == Candidate().id


def _work() -> Any:
    from kiln.common.work import ExperimentWork

    return ExperimentWork(
        experiment_id="e1", compilation_id="c1", team="t", tier="full",
        candidate=Candidate().canonical(), workload=tiny_workload(), deadline_s=60,
        baseline="gpt_fast",
    )  # fmt: skip


def test_engine_reports_a_skipped_baseline(monkeypatch: pytest.MonkeyPatch) -> None:
    limits = EngineLimits(max_batch=2, max_context=16, prompt_len=8, check_steps=1)
    engine = Engine(EngineSpec.from_workload(tiny_workload(batch=1, context=8), "fast", limits))
    monkeypatch.setitem(sys.modules, "transformers", None)
    request = RunRequest("b", Candidate(), baseline="hf_eager")
    m = run_request(engine, request, measure_baseline)
    assert m.status == "rejected" and m.error == "skipped: transformers not installed"


# ---------------------------------------------------------------------- the table
def _events() -> list[tuple[str, dict[str, Any]]]:
    ref = REFERENCE_CANDIDATE.id
    common = {"status": "ok", "correct": True, "tier": "full", "batch": 1}
    return [
        ("BaselineMeasured", {"tokens_per_s": 300.0, "median_ms": 3.33}),
        (
            "ExperimentCompleted",  # a baseline's completion: not the reference's
            {"candidate_id": "baseline:hf_eager", "tier": "full", "status": "ok",
             "correct": True, "tokens_per_s": 14.0, "median_ms": 71.4},
        ),
        (
            "ExperimentCompleted",
            {"candidate_id": ref, "tier": "full", "status": "ok", "correct": True,
             "tokens_per_s": 400.0, "median_ms": 2.5, "weights_bytes": 2_470_000_000},
        ),
        ("BaselineCompared", {**common, "name": "gpt_fast", "tokens_per_s": 742.0,
                              "median_ms": 1.348, "max_abs_error": 0.01,
                              "weights_bytes": 2_470_000_000}),
        ("BaselineCompared", {**common, "name": "hf_eager", "tokens_per_s": 14.0,
                              "median_ms": 71.4}),
        ("BaselineCompared", {"name": "hf_compile", "status": "rejected", "correct": False,
                              "skipped_reason": "transformers not installed"}),
        ("BaselineCompared", {**common, "name": "hf_static", "tokens_per_s": 900.0,
                              "median_ms": 1.1, "correct": False, "max_abs_error": 3.0}),
    ]  # fmt: skip


def test_comparison_folds_events() -> None:
    c = Comparison(REFERENCE_CANDIDATE.id)
    for kind, detail in _events():
        c.update(kind, detail)
    ref = c.reference()
    assert ref is not None and ref.tokens_per_s == 400.0 and ref.tier == "full"
    assert [r.label for r in c.baseline_rows()] == [
        "hf_eager",
        "hf_static",
        "hf_compile",
        "gpt_fast",
    ]
    notes = {r.label: r.note for r in c.baseline_rows()}
    assert notes["hf_compile"] == "skipped: transformers not installed"
    assert notes["hf_static"].startswith("INCORRECT")
    assert c.weights_bytes() == 2_470_000_000 and c.batch() == 1


def test_bandwidth_limit_of_an_h200() -> None:
    limit = bandwidth_limit("h200", 2_470_000_000, 1)
    assert limit is not None
    assert limit.tokens_per_s == pytest.approx(4.26e12 / 2.47e9, rel=1e-3)  # ~1,725 tok/s
    assert "h200" in limit.source and "4.26" in limit.describe()
    assert bandwidth_limit("h200", 0, 1) is None and bandwidth_limit("tpu9", 1, 1) is None


def test_compile_view_prints_baselines_reference_and_best() -> None:
    c = Comparison(REFERENCE_CANDIDATE.id)
    for kind, detail in _events():
        c.update(kind, detail)
    snap = compiler_pb2.Compilation(
        compilation_id="c1",
        workload=common_pb2.Workload(hardware=common_pb2.HardwareTarget(name="h200")),
    )
    snap.best.measurement.tokens_per_s = 1000.0
    snap.best.measurement.timing.median_ms = 1.0
    snap.best.measurement.tier = common_pb2.TIER_FULL
    table = comparison_table(c, snap)
    assert table is not None
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    cells = [line.split("│") for line in text.splitlines() if line.count("│") > 2]
    lines = {c[1].strip(): "│".join(c) for c in cells}
    assert "742.0" in lines["gpt_fast"] and "1.85x" in lines["gpt_fast"]  # 742 / 400
    assert "43%" in lines["gpt_fast"]  # 742 / 1,725
    assert "2.50x" in lines["kiln best"] and "58%" in lines["kiln best"]  # 1000 / 400, / 1,725
    assert "1.00x" in lines["kiln reference"]
    assert "skipped: transformers not installed" in lines["hf_compile"]
    assert "INCORRECT" in lines["hf_static"]
    assert "4.26 TB/s" in text
    assert comparison_table(Comparison(REFERENCE_CANDIDATE.id), snap) is None


# ---------------------------------------------------------------------- requests and events
def _run_request(baseline: str) -> Any:
    from google.protobuf.json_format import ParseDict

    from kiln.v1 import engine_pool_pb2

    exp = common_pb2.Experiment(experiment_id="e1", tier=common_pb2.TIER_FULL)
    ParseDict(tiny_workload(), exp.workload)
    return engine_pool_pb2.RunExperimentRequest(experiment=exp, baseline=baseline)


def test_run_experiment_request_carries_the_baseline() -> None:
    from kiln.common.work import ExperimentWork
    from kiln.engine_pool.service import job_from_request

    work = job_from_request(_run_request(" HF_Static "), "team", 60.0).work
    assert work.baseline == "hf_static" and work.tier == "full"
    assert ExperimentWork.from_json(work.to_json()).baseline == "hf_static"
    assert job_from_request(_run_request(""), "team", 60.0).work.baseline == ""
    with pytest.raises(InvalidArgument, match="baseline 'vllm' is unknown"):
        job_from_request(_run_request("vllm"), "team", 60.0)


def test_compared_event_from_a_baseline_experiment() -> None:
    from datetime import UTC, datetime

    from kiln.agent_runner.experiment import Completed, Requested
    from kiln.agent_runner.judge import compared_event
    from kiln.agent_runner.state import CompilationState
    from kiln.events.types import ExperimentCompleted

    state = CompilationState("c1", "team", common_pb2.Workload(), 60.0, 0, [], datetime.now(UTC), 1)
    req = Requested("e1", "c1", "team", REFERENCE_CANDIDATE, "compare:gpt_fast", "full", 5,
                    baseline="gpt_fast")  # fmt: skip
    done = ExperimentCompleted(
        compilation_id="c1", candidate_id="baseline:gpt_fast", status="ok", correct=True,
        max_abs_error=0.01, median_ms=2.0, p10_ms=1.9, p90_ms=2.2, tokens_per_s=1500.0,
        tier="full", weights_bytes=123, memory_bytes=123, prefill_median_ms=41.5,
    )  # fmt: skip
    event = compared_event(state, req, Completed("e1", done, 6, datetime.now(UTC)))
    assert event.type == "BaselineCompared"
    data = event.data
    assert isinstance(data, dict)
    assert data["name"] == "gpt_fast" and data["experiment_id"] == "e1"
    assert data["batch"] == 3 and data["weights_bytes"] == 123 and data["correct"]
    assert data["prefill_median_ms"] == 41.5
    again = compared_event(state, req, Completed("e1", done, 6, datetime.now(UTC)))
    assert again.event_id == event.event_id  # a restarted runner re-appends the same event
    skipped = done.model_copy(
        update={"status": "rejected", "error": "skipped: transformers not installed",
                "tokens_per_s": 0.0, "median_ms": 0.0, "correct": False}
    )  # fmt: skip
    data = compared_event(state, req, Completed("e1", skipped, 6, datetime.now(UTC))).data
    assert isinstance(data, dict)
    assert data["skipped_reason"] == "transformers not installed" and data["error"] == ""

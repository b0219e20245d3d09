"""The engine a worker process runs, in this process: build once, hot-reload many candidates,
check them against the reference, time them, and survive their failures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kiln.domain.candidate import Candidate, Transform
from kiln.ops import registry
from kiln.runtime.check import OutputGuard, compare, run_steps
from kiln.runtime.engine import Engine
from kiln.runtime.measurement import Measurement
from kiln.runtime.request import RunRequest
from kiln.runtime.spec import EngineLimits, EngineSpec, SpecError
from kiln.workloads import weights as weights_module
from kiln.workloads.models import build as build_module

from .engine_testing import (
    HANDWRITTEN_MLP,
    RAISING_MLP,
    TINY_LLAMA,
    ZEROS_ATTENTION,
    module,
    tiny_workload,
)

LIMITS = EngineLimits(max_batch=4, max_context=32, fast_layers=2, prompt_len=8, check_steps=2)


def _spec(**workload: object) -> EngineSpec:
    return EngineSpec.from_workload(tiny_workload(**workload), "fast", LIMITS)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    yield Engine(_spec(batch=3, context=24), engine_id="test-engine")


def _run(engine: Engine, candidate: Candidate, **kw: int) -> Measurement:
    return engine.run(RunRequest("exp", candidate, warmup=1, repeats=4, **kw))


def test_spec_clamps_and_notes_the_traffic_shape() -> None:
    spec = _spec(batch=30, context=1085)
    assert (spec.batch_size, spec.context_len, spec.layers, spec.total_layers) == (4, 32, 2, 3)
    assert spec.dtype == "float32" and spec.prompt_len == 8
    assert any("batch clamped from 30 to 4" in n for n in spec.notes)
    assert any("context clamped from 1085 to 32" in n for n in spec.notes)
    assert spec.key == _spec(batch=30, context=1085).key != _spec(batch=2).key
    assert EngineSpec.from_dict(spec.to_dict()) == spec
    full = EngineSpec.from_workload(tiny_workload(), "full", LIMITS)
    assert full.layers == 3 and full.key != _spec().key


def test_a_request_crosses_the_pipe_as_plain_data_with_its_candidate_in_canonical_form() -> None:
    candidate = Candidate.make(
        {"attention": "sdpa"}, [Transform.of("torch_compile", mode="default")], [HANDWRITTEN_MLP]
    )
    request = RunRequest("exp", candidate, repeats=3, profile=True)
    sent = request.to_dict()
    assert sent["candidate"] == candidate.canonical() and sent["repeats"] == 3
    back = RunRequest.from_dict(sent)
    assert back == request and back.candidate.id == candidate.id


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "gpt2"}, "unsupported architecture 'gpt2'"),
        ({"mlp_bias": True}, "cannot build MLP biases"),
    ],
)
def test_unbuildable_workloads_are_spec_errors(change: dict[str, object], match: str) -> None:
    import json

    workload = tiny_workload()
    workload["model"]["config_json"] = json.dumps({**TINY_LLAMA, **change})
    with pytest.raises(SpecError, match=match):
        EngineSpec.from_workload(workload, "fast", LIMITS)
    with pytest.raises(SpecError, match="config_json is empty"):
        EngineSpec.from_workload({"model": {}}, "fast", LIMITS)
    with pytest.raises(SpecError, match="dtype 'int8'"):
        EngineSpec.from_workload(tiny_workload(dtype="int8"), "fast", LIMITS)


def test_hot_reload_rebinds_without_touching_the_weights(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_reading(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights read again")

    monkeypatch.setattr(build_module, "seeded_random", no_reading)
    monkeypatch.setattr(build_module, "load_safetensors", no_reading)
    monkeypatch.setattr(weights_module, "seeded_random", no_reading)
    base = {name: (t, t.data_ptr()) for name, t in engine.weights.items()}
    candidates = [
        Candidate(),
        Candidate.make({"attention": "sdpa"}),
        Candidate.make({"qkv_proj": "fused", "mlp": "fused_gate_up"}),
        Candidate.make({"rope": "cos_sin_cache", "rms_norm": "fused_residual"}),
        Candidate.make({"mlp": "handwritten"}, code_modules=[HANDWRITTEN_MLP]),
        Candidate.make({"attention": "sdpa"}, [Transform.of("threads", n=1)]),
    ]
    for candidate in candidates:
        m = _run(engine, candidate)
        assert m.status == "ok", (candidate.describe(), m.error)
        assert m.correct and m.candidate_id == candidate.id
        for name, (tensor, ptr) in base.items():
            assert engine.weights.get(name) is tensor and tensor.data_ptr() == ptr
    assert engine.weights_intact()
    assert "handwritten" not in registry.implementations("mlp")  # the module's op is gone
    assert engine.model.binding.recipe["qkv_proj"] == "reference"  # re-bound after each run


def test_measurement_reports_timing_memory_and_phases(engine: Engine) -> None:
    m = engine.run(RunRequest("exp", Candidate(), warmup=2, repeats=7))
    assert m.status == "ok" and m.timing is not None
    t = m.timing
    assert len(t.samples_ms) == 7 and t.warmup_runs == 2
    assert t.p10_ms <= t.median_ms <= t.p90_ms and t.stdev_ms >= 0
    assert t.mean_ms == pytest.approx(sum(t.samples_ms) / 7) and t.max_ms == max(t.samples_ms)
    assert t.decision_ms == max(t.median_ms, t.mean_ms / 1.25)
    assert m.tokens_per_s == pytest.approx(3 / (t.decision_ms / 1e3))
    assert m.verified_steps == 7 and m.escape_probability == pytest.approx(0.8**7)
    gate = {"load", "bind", "compile", "check", "measure", "verify"}
    assert set(m.phases_ms) == gate | {"state_begin", "watches", "restore"}  # + the harness
    assert m.memory.weights_bytes == engine.weights.nbytes()
    assert m.memory.kv_cache_bytes > 0 and m.memory.workspace_bytes > 0
    assert m.max_abs_error <= 1e-3 * 10
    assert any(n.startswith("check seed") for n in m.notes)
    assert m.prefill is None and m.prefill_tokens_per_s == 0.0  # none asked for


def test_prefill_is_timed_at_the_traffic_shape_when_asked(engine: Engine) -> None:
    m = engine.run(RunRequest("exp", Candidate(), warmup=1, repeats=3, prefill_repeats=3))
    assert m.status == "ok" and m.prefill is not None, m.error
    assert len(m.prefill.samples_ms) == 3 and m.prefill.median_ms > 0
    spec = engine.spec
    expected = spec.batch_size * spec.context_len / (m.prefill.decision_ms / 1e3)
    assert m.prefill_tokens_per_s == pytest.approx(expected)
    assert "prefill" in m.phases_ms
    # the engine is back at the operating point: the next experiment checks and times as usual
    assert engine.run(RunRequest("next", Candidate(), warmup=1, repeats=3)).status == "ok"


def test_a_wrong_implementation_from_a_code_module_is_incorrect(engine: Engine) -> None:
    m = _run(engine, Candidate.make({"attention": "zeros"}, code_modules=[ZEROS_ATTENTION]))
    assert m.status == "incorrect" and not m.correct
    assert m.max_abs_error > 0 and m.timing is None
    assert "zeros" not in registry.implementations("attention")
    assert _run(engine, Candidate()).status == "ok"


def test_a_replaced_reference_cannot_fool_the_check(engine: Engine) -> None:
    """A module that redefines an op's *reference* changes the candidate, not the reference
    model it is checked against (bound at build time); the registry is restored after."""
    before = registry.get("rms_norm")
    sloppy = module(
        "sloppy_norm",
        """
@register("rms_norm", "reference", replace=True)
def reference(x, residual=None, *, weight, eps):
    if residual is not None:
        x = x + residual
    return x * 0.5, x
""",
    )
    m = _run(engine, Candidate.make(code_modules=[sloppy]))
    assert m.status == "incorrect"
    assert registry.get("rms_norm") == before


def test_stale_outputs_are_poisoned(engine: Engine) -> None:
    """An LM head that returns the same tensor every call sees it filled with NaN."""
    stale = module(
        "stale_head",
        """
_cache = {}

@register("lm_head", "stale", replace=True)
def stale(x, *, weight):
    key = tuple(x.shape[:-1])
    if key not in _cache:
        _cache[key] = (x @ weight.T).float()
    return _cache[key]
""",
    )
    m = _run(engine, Candidate.make({"lm_head": "stale"}, code_modules=[stale]))
    assert m.status == "incorrect", m.error


def test_output_guard_poisons_returned_tensors_but_never_engine_state() -> None:
    buffer, weight = torch.ones(2, 3), torch.ones(4)
    guard = OutputGuard({weight.untyped_storage().data_ptr()})
    outs = run_steps([lambda: buffer, lambda: buffer, lambda: weight, lambda: weight], guard)
    assert bool((outs[0] == 1).all())
    assert bool(outs[1].isnan().all())  # the same tensor again: poisoned in between
    assert bool((outs[3] == 1).all()) and bool((weight == 1).all())  # weights are never touched
    verdict = compare([outs[1]], [outs[0]], 1e-3)
    assert not verdict.correct and "non-finite" in verdict.reason


def test_an_exception_crashes_the_experiment_not_the_engine(engine: Engine) -> None:
    m = _run(engine, Candidate.make({"mlp": "boom"}, code_modules=[RAISING_MLP]))
    assert m.status == "crashed"
    assert "RuntimeError: kaboom from a candidate" in m.error
    assert "<candidate:boom#0>" in m.error  # the traceback shows the module's lines
    syntax = module("bad", "def broken(:\n")
    m = _run(engine, Candidate.make(code_modules=[syntax]))
    assert m.status == "crashed" and m.error.startswith("load: SyntaxError")
    assert _run(engine, Candidate.make({"attention": "sdpa"})).status == "ok"


@pytest.mark.parametrize(
    ("candidate", "match"),
    [
        (Candidate.make(transforms=[Transform.of("unroll_everything")]), "unknown transform"),
        (Candidate.make(transforms=[Transform.of("threads", n=0)]), "outside 1.."),
        (Candidate.make(transforms=[Transform.of("torch_compile", mode="x")]), "mode 'x'"),
        (Candidate.make(transforms=[Transform.of("cuda_graph")]), "cuda_graph"),
        (Candidate.make({"attention": "flash9"}), "no implementation 'flash9'"),
        (Candidate.make({"warp_drive": "on"}), "unknown op 'warp_drive'"),
    ],
)
def test_unknown_transforms_and_ops_are_rejected(
    engine: Engine, candidate: Candidate, match: str
) -> None:
    threads = torch.get_num_threads()
    m = _run(engine, candidate)
    assert m.status == "rejected" and match in m.error, m.error
    assert torch.get_num_threads() == threads


def test_a_candidate_that_writes_the_weights_asks_for_a_restart() -> None:
    engine = Engine(_spec(batch=2, context=16))  # its own: this one gets damaged
    vandal = module(
        "vandal",
        """
@register("mlp", "vandal", replace=True)
def vandal(x, *, gate_weight, up_weight, down_weight):
    down_weight.mul_(1.5)
    gate = x @ gate_weight.T
    return ((gate * torch.sigmoid(gate)) * (x @ up_weight.T)) @ down_weight.T
""",
    )
    candidate = Candidate.make({"mlp": "vandal"}, code_modules=[vandal])
    # sandboxed: it scales its own copy-on-write copy; the judge's weights stay, the sandbox goes
    m = engine.run(RunRequest("exp", candidate))
    assert m.status == "incorrect" and "state changed in the sandbox" in m.error, m.error
    assert not m.restart_engine and engine.weights_intact()
    assert any("sandbox replaced" in n for n in m.notes)
    assert engine.run(RunRequest("exp", Candidate())).status == "ok"
    engine.close()
    # in process (recipes' engine path): the weights really change, and only a restart helps
    here = Engine(_spec(batch=2, context=16), sandbox=False)
    m = here.run(RunRequest("exp", candidate))
    assert m.restart_engine
    assert any("modified the engine's weights" in n for n in m.notes)


def test_bfloat16_engine_allows_sdpa_drift() -> None:
    spec = EngineSpec.from_workload(tiny_workload(dtype="bfloat16"), "full", LIMITS)
    engine = Engine(spec)
    m = engine.run(RunRequest("exp", Candidate.make({"attention": "sdpa"}), repeats=2))
    assert m.status == "ok", m.error
    assert engine.weights[next(iter(engine.weights))].dtype == torch.bfloat16


@pytest.mark.skipif(not os.environ.get("KILN_TEST_SLOW"), reason="set KILN_TEST_SLOW=1 (compiles)")
def test_torch_compile_of_the_decode_step(engine: Engine) -> None:
    m = _run(engine, Candidate.make(transforms=[Transform.of("torch_compile")]))
    assert m.status == "ok", m.error
    assert m.phases_ms["compile"] > m.phases_ms["measure"]
    assert "forward" not in engine.model.__dict__
